"""Familiarity: how like its training images an image is to a model, from the checkpoint's
record of their features; reported by the API, `captioner caption` and `captioner evaluate`."""

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from captioner.cli.main import main
from captioner.data.coco import load_split
from captioner.inference import Captioner, DecodeOptions
from captioner.io import bundled
from captioner.io.checkpoint import load_checkpoint
from captioner.model.familiarity import TrainingFeatures, pooled, training_features
from tests.tiny import tiny_captioner, tiny_image

PHOTOS = Path(__file__).parents[1] / "fixtures" / "photos" / "coco"
SHAPES = Path(__file__).parents[2] / "app" / "examples"
DEMOS = [m.name for m in bundled.installed()]


def _gaussian(n: int, seed: int, dim: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(dim, dim, generator=torch.Generator().manual_seed(99))  # the same correlations every call
    return torch.randn(n, dim, generator=g, dtype=torch.float64) @ mix.double() + 3.0


def _deciles(values: torch.Tensor) -> torch.Tensor:
    return torch.histc(values.float(), bins=10, min=0, max=1) / len(values)


def test_familiarity_of_training_and_fresh_images_of_their_distribution_is_near_uniform():
    record = TrainingFeatures.fit(_gaussian(3000, seed=0))
    for x in (_gaussian(3000, seed=0), _gaussian(3000, seed=1)):  # the training images, fresh ones
        values = record.values(x)
        assert values.min() >= 0 and values.max() <= 1
        assert (_deciles(values) - 0.1).abs().max() < 0.03
        assert 0.003 < float((values < 0.01).double().mean()) < 0.02  # the default threshold flags ~1%


def test_an_image_unlike_every_training_image_has_familiarity_zero():
    record = TrainingFeatures.fit(_gaussian(500, seed=0))
    far = _gaussian(4, seed=2) * 10
    assert record.values(far).tolist() == [0.0] * 4
    assert all(f.unfamiliar and f.value == 0.0 for f in record.score(far, 0.01))
    typical = record.mean.double()[None]
    assert record.values(typical).item() == 1.0 and not record.score(typical, 0.01)[0].unfamiliar


def test_the_record_is_plain_tensors_a_weights_only_load_reads(tmp_path):
    record = TrainingFeatures.fit(_gaussian(200, seed=0), data="gaussian")
    torch.save(record.to_dict(), tmp_path / "r.pt")
    again = TrainingFeatures.from_dict(torch.load(tmp_path / "r.pt", weights_only=True))
    assert again.data == "gaussian" and again.images == 200
    x = _gaussian(50, seed=3)
    assert torch.equal(again.values(x), record.values(x))


def _with_familiarity(tmp_path: Path, tiny_coco: Path) -> Path:
    cap = tiny_captioner(seed=1)
    path = tmp_path / "m.pt"
    cap.save(path)
    assert main(["familiarity", str(path), "--data", str(tiny_coco), "--split", "train", "--quiet"]) == 0
    return path


def test_the_command_adds_the_record_to_an_existing_checkpoint(tmp_path, tiny_coco):
    path = _with_familiarity(tmp_path, tiny_coco)
    ckpt = load_checkpoint(path)
    record = ckpt.familiarity
    assert record.images == 6  # the tiny training split
    cap = Captioner.load(path)
    assert cap.familiarity is not None
    # The training images' own values are what the record says of them: the same model, the same encoder.
    images = [Image.open(r.path).convert("RGB") for r in load_split(tiny_coco, "train")]
    got = [r.familiarity.value for r in cap.caption_images(images, DecodeOptions(beam_size=2, max_len=4))]
    feats = pooled(cap.model.encode(torch.stack([cap.preprocess(im) for im in images])).vectors)
    assert got == pytest.approx(record.values(feats).tolist())


def test_an_old_checkpoint_loads_and_says_its_familiarity_is_unknown(tmp_path):
    path = tmp_path / "old.pt"
    tiny_captioner(seed=1).save(path)
    cap = Captioner.load(path)
    assert cap.familiarity is None
    result = cap.caption(tiny_image(0), DecodeOptions(beam_size=2, max_len=4))
    assert result.familiarity is None
    line = result.to_json("x.png")
    assert line["familiarity"] is None and line["unfamiliar"] is None


def test_a_record_that_does_not_fit_the_encoder_is_refused_in_one_line(tmp_path):
    from captioner.io.checkpoint import CheckpointError

    cap = tiny_captioner(seed=1)
    cap.familiarity = TrainingFeatures.fit(_gaussian(50, seed=0, dim=7))  # the tiny encoder gives 128
    cap.save(tmp_path / "m.pt")
    with pytest.raises(CheckpointError, match="familiarity record describes 7-dimensional"):
        Captioner.load(tmp_path / "m.pt")


def test_caption_json_reports_familiarity_with_the_threshold_asked_for(tmp_path, tiny_coco):
    path = _with_familiarity(tmp_path, tiny_coco)
    image = tmp_path / "noise.png"
    tiny_image(5, (40, 40)).save(image)
    lines = {}
    for below in ("0.01", "0", "1"):
        out = tmp_path / f"c{below}.jsonl"
        assert main(["caption", str(image), "--weights", str(path), "--out", str(out), "--quiet", "--max-len", "4",
                     "--unfamiliar-below", below]) == 0
        lines[below] = json.loads(out.read_text().splitlines()[0])
    assert 0 <= lines["0.01"]["familiarity"] <= 1
    value = lines["0.01"]["familiarity"]
    assert lines["0"]["familiarity"] == lines["1"]["familiarity"] == value
    assert lines["0.01"]["unfamiliar"] == (value < 0.01)
    assert lines["0"]["unfamiliar"] is False and lines["1"]["unfamiliar"] == (value < 1)


def test_unfamiliar_below_must_be_a_share(tmp_path, tiny_coco, capsys):
    image = tmp_path / "a.png"
    tiny_image(5).save(image)
    with pytest.raises(SystemExit) as e:
        main(["caption", str(image), "--unfamiliar-below", "-0.5"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        main(["caption", str(image), "--unfamiliar-below", "1.5"])
    assert "--unfamiliar-below" in capsys.readouterr().err


def test_evaluate_reports_how_many_images_were_unfamiliar(tmp_path, tiny_coco, capsys):
    path = _with_familiarity(tmp_path, tiny_coco)
    out = tmp_path / "eval.json"
    assert main(["evaluate", "--weights", str(path), "--data", str(tiny_coco), "--split", "test", "--max-len", "4",
                 "--beam-size", "2", "--no-meteor", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    fam = report["familiarity"]
    assert fam["images"] == 2 and 0 <= fam["mean"] <= 1 and fam["unfamiliar"] in (0, 1, 2)
    assert fam["threshold"] == 0.01
    assert "unfamiliar images" in capsys.readouterr().out


def test_familiarity_is_fitted_on_the_model_s_own_encoder(tiny_coco):
    records = load_split(tiny_coco, "train")
    one, other = tiny_captioner(seed=1), tiny_captioner(seed=2)
    a = training_features(one, records, progress=False)
    b = training_features(other, records, progress=False)
    assert not torch.allclose(a.mean, b.mean)


@pytest.mark.parametrize("name", DEMOS)
def test_the_demos_flag_photographs_and_not_shapes(name):
    cap = Captioner.load(name)
    assert cap.familiarity is not None and cap.familiarity.images == 3000
    opts = DecodeOptions(beam_size=1, max_len=12)
    photos = [Image.open(p).convert("RGB") for p in sorted(PHOTOS.glob("*/*.jpg"))]
    shapes = [Image.open(p).convert("RGB") for p in sorted(SHAPES.glob("*.png"))]
    assert len(photos) == 12 and len(shapes) == 4
    assert all(r.familiarity.unfamiliar for r in cap.caption_images(photos, opts))
    assert not any(r.familiarity.unfamiliar for r in cap.caption_images(shapes, opts))


def test_a_demo_s_record_names_what_the_demo_was_trained_on(tmp_path, tiny_coco):
    """`captioner familiarity demo-soft` reads the demo as `Captioner.load` does (a shipped file
    is a demo): its record says "synthetic shapes", not the name of a folder."""
    out = tmp_path / "demo.pt"
    assert main(["familiarity", "demo-soft", "--data", str(tiny_coco), "--split", "train", "--quiet",
                 "--out", str(out)]) == 0
    record = load_checkpoint(out).familiarity
    assert record.data.startswith("synthetic shapes, split train"), record.data


# --- exchangeable reference distances: exact leave-one-out ----------------------------------
def _refit_without_each(x: torch.Tensor) -> torch.Tensor:
    """Each image's squared distance to a plain fit on the others (the ridge of the fit on all)."""
    n, d = x.shape
    ridge = 0.01 * float(torch.cov(x.T).diagonal().mean())
    out = []
    for i in range(n):
        rest = torch.cat([x[:i], x[i + 1:]])
        cov = torch.cov(rest.T).reshape(d, d) + ridge * torch.eye(d, dtype=x.dtype)
        u = x[i] - rest.mean(0)
        out.append(u @ torch.linalg.solve(cov, u))
    return torch.stack(out)


@pytest.mark.parametrize("n, dim", [(3, 4), (7, 5), (6, 10), (40, 3)])
def test_reference_distances_are_exactly_those_of_fits_leaving_each_image_out(n, dim):
    x = _gaussian(n, seed=n, dim=dim)
    record = TrainingFeatures.fit(x)
    torch.testing.assert_close(record.reference.double(), torch.sort(_refit_without_each(x)).values, rtol=1e-5,
                               atol=0)
    # and the fit on all N is the plain one: a fresh image's distance to it
    fresh = _gaussian(5, seed=99, dim=dim)
    cov = torch.cov(x.T).reshape(dim, dim)
    cov = cov + 0.01 * cov.diagonal().mean() * torch.eye(dim, dtype=x.dtype)
    u = fresh - x.mean(0)
    torch.testing.assert_close(record.distances(fresh).double(), (u @ torch.linalg.inv(cov) * u).sum(1), rtol=1e-4,
                               atol=0)


def _flagged_share(dim: int, n: int, draws: int, fresh: int = 500, seed: int = 0) -> float:
    """The share of fresh images flagged at the default threshold, over ``draws`` training sets of
    ``n`` Gaussian images (correlated, unequal variances): the rate a user meets, not one set's."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.linspace(1.0, 0.05, dim, dtype=torch.float64).sqrt()  # (D,) unequal variances
    flagged = []
    for _ in range(draws):
        x = torch.randn(n + fresh, dim, generator=g, dtype=torch.float64) * spread + 3.0
        record = TrainingFeatures.fit(x[:n])
        flagged.append(float((record.values(x[n:]) < 0.01).double().mean()))
    return sum(flagged) / draws


@pytest.mark.parametrize("dim, n", [(128, 99), (12, 60)])
def test_fresh_images_are_flagged_at_the_threshold_s_rate_whatever_the_feature_size(dim, n):
    """About 1% at the default threshold, whatever D/N: the cross-fitted (5-fold) distances flagged
    none at D = 128, N = 99; at N = 60 the floor 1/(N + 1) = 1.6% (only an image farther than
    all 60 is below 0.01). benchmarks/familiarity_calibration.py runs the whole grid."""
    share = _flagged_share(dim, n, draws=30)
    floor = 1 / (n + 1)
    assert 0.5 * max(0.01, floor) < share < 1.5 * max(0.01, floor), share


def test_familiarity_needs_three_images_and_says_so_in_one_line(tmp_path, tiny_coco, capsys):
    TrainingFeatures.fit(_gaussian(3, seed=0))
    with pytest.raises(ValueError, match="at least 3 training images, got 2"):
        TrainingFeatures.fit(_gaussian(2, seed=0))
    path = tmp_path / "m.pt"
    tiny_captioner(seed=1).save(path)
    assert main(["familiarity", str(path), "--data", str(tiny_coco), "--split", "train", "--quiet",
                 "--limit", "2"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == ["captioner familiarity: error: familiarity needs at least 3 training "
                                        "images, got 2"]
    assert main(["familiarity", str(path), "--data", str(tiny_coco), "--split", "train", "--quiet",
                 "--limit", "3"]) == 0


def _record(reference: list[float]) -> TrainingFeatures:
    """A one-dimensional record by hand: d(x) = x^2."""
    return TrainingFeatures(torch.zeros(1), torch.ones(1, 1), torch.tensor(reference), "by hand")


def test_familiarity_counts_the_training_images_at_least_as_far_and_flags_below_the_threshold():
    record = _record([float(i) for i in range(1, 101)])  # distances 1 .. 100
    # d = 99.5: one of the 100 at least as far, familiarity 0.01 exactly: not below 0.01
    at = record.score(torch.tensor([[99.5 ** 0.5]]), threshold=0.01)[0]
    assert at.value == 0.01 and not at.unfamiliar
    assert record.score(torch.tensor([[100.5 ** 0.5]]), threshold=0.01)[0].unfamiliar  # farther than all
    assert record.score(torch.tensor([[99.5 ** 0.5]]), threshold=0.0101)[0].unfamiliar
    # a distance equal to a reference counts that reference as at least as far
    tied = _record([1.0, 4.0, 9.0, 16.0])
    assert tied.values(torch.tensor([[2.0], [3.0], [0.0], [5.0]])).tolist() == [0.75, 0.5, 1.0, 0.0]


# --- on the model's device ------------------------------------------------------------------
def test_a_record_loaded_on_another_device_scores_features_there():
    """The meta device stands in for a GPU: a checkpoint read with map_location=device keeps the
    record there, and the image's features come from the model on that device (or the host)."""
    ckpt = load_checkpoint(bundled.DEMOS["demo-soft"].path, map_location="meta")
    record = ckpt.familiarity
    assert record.mean.device.type == "meta"
    for features in (torch.randn(2, 128), torch.randn(2, 128, device="meta")):
        values = record.values(features)
        assert values.shape == (2,) and values.device.type == "meta"


def test_the_captioner_keeps_its_record_on_its_model_s_device():
    ckpt = load_checkpoint(bundled.DEMOS["demo-soft"].path)
    cap = Captioner.from_checkpoint(ckpt, device="meta")
    assert cap.familiarity.mean.device.type == "meta" and cap.device.type == "meta"
    features = pooled(cap.model.encode(torch.zeros(2, 3, 64, 64, device="meta")).vectors)
    assert cap.familiarity.values(features).device.type == "meta"
    on_host = Captioner.from_checkpoint(ckpt)
    assert on_host.familiarity.mean.device.type == "cpu"
    features = pooled(on_host.model.encode(torch.zeros(2, 3, 64, 64)).vectors)
    assert on_host.familiarity.to("meta").values(features).device.type == "meta"


# --- mutation testing's survivors (docs/testing.md) -----------------------------------------
@pytest.mark.parametrize("n, dim", [(6, 10), (40, 3)])
@pytest.mark.parametrize("unit", [1e-3, 0.5, 1e3])
def test_familiarity_does_not_depend_on_the_features_units(n, dim, unit):
    """The ridge is a share of the features' own variance, whatever their scale: an encoder whose
    pooled features vary by thousandths (a mean variance below 1) is scored as one whose features
    vary by units. At N < D the ridge alone fills the directions the images do not span."""
    x, fresh = _gaussian(n, seed=n, dim=dim), _gaussian(5, seed=99, dim=dim)
    plain, scaled = TrainingFeatures.fit(x), TrainingFeatures.fit(x * unit)
    torch.testing.assert_close(scaled.reference, plain.reference, rtol=1e-4, atol=0)
    torch.testing.assert_close(scaled.distances(fresh * unit), plain.distances(fresh), rtol=1e-4, atol=0)


def test_features_that_do_not_vary_still_make_a_record():
    """Every training image the same (no variance at all): the fit needs a ridge of its own; an
    image equal to them is typical, any other is unlike all of them."""
    same = torch.full((5, 4), 2.0, dtype=torch.float64)
    record = TrainingFeatures.fit(same)
    assert record.values(same[:1]).tolist() == [1.0]
    assert record.values(same[:1] + 0.1).tolist() == [0.0]


@pytest.mark.parametrize("field, bad", [("mean", torch.zeros(1, 12)), ("whiten", torch.zeros(12, 11)),
                                        ("reference", torch.zeros(5, 1)), ("reference", torch.zeros(0))])
def test_a_record_with_any_one_tensor_of_the_wrong_shape_is_refused(field, bad):
    d = TrainingFeatures.fit(_gaussian(20, seed=0)).to_dict()
    TrainingFeatures.from_dict(d)
    with pytest.raises(ValueError, match="wrong shapes"):
        TrainingFeatures.from_dict({**d, field: bad})


def test_the_caption_summary_counts_the_unfamiliar_images(capsys):
    """Photographs captioned by a demo: the summary says how many it flagged, beside how many it
    captioned; shapes alone, it says nothing of it."""
    photos = sorted(str(p) for p in PHOTOS.glob("*/*.jpg"))[:3]
    assert main(["caption", *photos, "--weights", "demo-soft", "--beam-size", "1", "--max-len", "8"]) == 0
    assert "captioned 3 (3 unfamiliar: unlike the model's training images), failed 0" in capsys.readouterr().err
    shapes = sorted(str(p) for p in SHAPES.glob("*.png"))[:2]
    assert main(["caption", *shapes, "--weights", "demo-soft", "--beam-size", "1", "--max-len", "8"]) == 0
    assert "captioned 2, failed 0" in capsys.readouterr().err
