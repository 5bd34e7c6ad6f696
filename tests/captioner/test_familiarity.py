"""Familiarity: how like its training images an image is to a model, from the checkpoint's
record of their features; reported by the API, `captioner caption` and `captioner evaluate`."""

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from captioner import bundled
from captioner.checkpoint import load_checkpoint
from captioner.cli import main
from captioner.data.coco import load_split
from captioner.familiarity import TrainingFeatures, pooled, training_features
from captioner.inference import Captioner, DecodeOptions
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
    assert all(f.unfamiliar and f.value == 0.0 for f in record.score(far))
    typical = record.mean.double()[None]
    assert record.values(typical).item() == 1.0 and not record.score(typical)[0].unfamiliar


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
    record = TrainingFeatures.from_dict(ckpt["familiarity"])
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
    from captioner.checkpoint import CheckpointError

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
    record = TrainingFeatures.from_dict(load_checkpoint(out)["familiarity"])
    assert record.data.startswith("synthetic shapes, split train"), record.data
