"""Training on the tiny COCO-format fixture: the loss falls, resume is exact."""

import dataclasses
import json

import pytest
import torch

from captioner.inference import Captioner
from captioner.io.checkpoint import load_checkpoint
from captioner.model.decoder import CaptionModel
from captioner.train.averaging import WeightAverage
from captioner.train.config import HardConfig
from captioner.train.loop import train, validation_value
from tests.builders import nll_log, tiny_train_config


def test_reinforce_defaults_are_the_authors_settings_averaged_per_caption():
    """capgen.py: the per-word mean cost against a baseline of the same, /10., entropy 0.002,
    b <- 0.9 b + 0.1 cost, the 0.5 coin; the known gradients averaged over the captions like
    the NLL (the paper's eq. 12), not added over them as capgen does (x B)."""
    assert dataclasses.asdict(HardConfig()) == {"reward": "word_mean", "lambda_r": 0.1, "entropy": 0.002,
                                                "reduction": "mean", "baseline_decay": 0.9,
                                                "expected_context_prob": 0.5}


@pytest.mark.slow
def test_the_encoder_starts_from_a_checkpoint_and_the_decoder_fresh(tiny_coco, tmp_path, capsys):
    """model.encoder_from with freeze_encoder: the paper's set-up of a new decoder over a
    trained encoder that stays fixed (its features read through the cache)."""
    first = tmp_path / "first"
    train(tiny_train_config(tiny_coco, **{"optim.max_steps": 4, "val.every_epochs": 0, "optim.seed": 7}), first,
          progress=False)
    source = load_checkpoint(first / "last.pt").state_dict
    run = tmp_path / "run"
    cfg = tiny_train_config(tiny_coco, **{"optim.max_steps": 3, "val.every_epochs": 0, "model.attention": "hard",
                                          "model.encoder_from": str(first / "last.pt"), "model.freeze_encoder": True,
                                          "data.feature_cache": True})
    train(cfg, run, progress=False)
    got = load_checkpoint(run / "last.pt").state_dict
    encoder = [k for k in source if k.startswith("encoder.")]
    assert encoder and all(torch.equal(got[k], source[k]) for k in encoder)  # copied, then never trained
    torch.manual_seed(cfg.optim.seed)
    fresh = CaptionModel(load_checkpoint(run / "last.pt").model_config).state_dict()
    # The decoder started fresh (the seed's initialisation), not from the source's decoder:
    # the bias of the last layer moved by three small steps from the fresh one.
    start = fresh["decoder.L_o.bias"]
    bias = got["decoder.L_o.bias"]
    assert (bias - start).abs().max() < (bias - source["decoder.L_o.bias"]).abs().max()
    # An encoder of another kind is refused with one line.
    bad = tiny_train_config(tiny_coco, **{"model.encoder": "small8", "model.encoder_from": str(first / "last.pt")})
    with pytest.raises(ValueError, match="encoder_from"):
        train(bad, tmp_path / "bad", progress=False)


@pytest.mark.slow
def test_fixture_trains_and_the_loss_falls(tiny_coco, tmp_path):
    run = tmp_path / "run"
    outcome = train(tiny_train_config(tiny_coco, **{"optim.max_steps": 60, "val.every_epochs": 0}), run, progress=False)
    assert outcome.reason == "max_steps" and outcome.step == 60
    nll = nll_log(run)
    assert sum(nll[-8:]) / 8 < 0.5 * sum(nll[:8]) / 8
    # The best checkpoint rebuilds a captioner on its own.
    cap = Captioner.load(run / "best.pt")
    assert cap.vocab.words[:4] == ["<pad>", "<start>", "<end>", "<unk>"]
    assert (run / "config.toml").read_text().startswith('name = "run"')


@pytest.mark.slow
@pytest.mark.parametrize("attention,ema", [("soft", 0.0), ("hard", 0.0), ("soft", 0.9)],
                         ids=["soft", "hard", "soft-weight-average"])
def test_resume_reproduces_the_uninterrupted_run_exactly(tiny_coco, tmp_path, attention, ema):
    sets = {"model.attention": attention, "optim.max_steps": 9, "optim.ema": ema}
    straight = tmp_path / "straight"
    train(tiny_train_config(tiny_coco, **sets), straight, progress=False)

    split = tmp_path / "split"
    first = train(tiny_train_config(tiny_coco, **{**sets, "optim.max_steps": 5}), split, progress=False)
    assert first.step == 5
    again = train(tiny_train_config(tiny_coco, **sets), split, resume=True, progress=False)
    assert again.step == 9

    a = load_checkpoint(straight / "last.pt")
    b = load_checkpoint(split / "last.pt")
    assert a.state_dict.keys() == b.state_dict.keys()
    for k in a.state_dict:
        assert torch.equal(a.state_dict[k], b.state_dict[k]), k
    assert a.train_state.epoch == b.train_state.epoch >= 1  # an epoch boundary was crossed
    if attention == "hard":
        assert a.train_state.objective["baseline"] == b.train_state.objective["baseline"] != 0.0
    if ema:
        wa, wb = a.train_state.weight_average, b.train_state.weight_average
        assert wa.updates == wb.updates == 9
        for k in wa.tensors:
            assert torch.equal(wa.tensors[k], wb.tensors[k]), k
        best_a, best_b = load_checkpoint(straight / "best.pt"), load_checkpoint(split / "best.pt")
        for k in best_a.state_dict:
            assert torch.equal(best_a.state_dict[k], best_b.state_dict[k]), k


@pytest.mark.parametrize("limit,reason", [({"optim.max_steps": 5}, "max_steps"),
                                          ({"optim.epochs": 2}, "finished"),
                                          ({"optim.max_minutes": 1e-4}, "time_budget")],
                         ids=["max_steps", "last_epoch", "max_minutes"])
def test_resuming_a_finished_run_says_so_and_changes_nothing(tiny_coco, tmp_path, capsys, limit, reason):
    """--resume of a run that reached its limit (or was killed after its final checkpoint)
    must not take one more step."""
    run = tmp_path / "run"
    sets = {"val.every_epochs": 0, "optim.save_every": 0, **limit}
    first = train(tiny_train_config(tiny_coco, **sets), run, progress=False)
    assert first.reason == reason
    before = load_checkpoint(run / "last.pt")
    files = {p.name: p.read_bytes() for p in run.iterdir()}
    capsys.readouterr()

    again = train(None, run, resume=True, progress=False)  # `captioner train --resume RUN`: the run's own config
    assert (again.step, again.epoch, again.reason) == (first.step, first.epoch, reason)
    said = {"max_steps": "stopped at optim.max_steps = 5: step 5,", "finished": "finished every epoch: step",
            "time_budget": "stopped at optim.max_minutes = 0.0001: step"}[reason]
    assert f"already finished ({said}" in capsys.readouterr().err
    after = load_checkpoint(run / "last.pt")
    assert after.train_state.step == first.step
    for k in before.state_dict:
        assert torch.equal(before.state_dict[k], after.state_dict[k]), k
    assert {p.name: p.read_bytes() for p in run.iterdir()} == files  # nothing rewritten

    if reason == "max_steps":  # a higher limit continues the run
        more = train(tiny_train_config(tiny_coco, **{**sets, "optim.max_steps": 7}), run, resume=True, progress=False)
        assert more.step == 7


def test_weight_average_follows_its_formula_and_swaps_back():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    start = {k: v.clone() for k, v in model.state_dict().items()}
    average = WeightAverage(model, decay=0.5)
    expected = start["0.weight"].clone()
    for n in range(3):
        with torch.no_grad():
            model[0].weight.add_(1.0)
            model[1].num_batches_tracked += 1
        d = min(0.5, (1 + n) / (10 + n))  # 0.1, 0.18..., 0.25
        expected = d * expected + (1 - d) * model[0].weight.detach()
        average.update(model)
    assert torch.allclose(average.tensors["0.weight"], expected)
    assert not torch.allclose(expected, model[0].weight)  # the average lags the weights
    assert average.tensors["1.num_batches_tracked"].item() == 3  # integers are copied
    own = {k: v.clone() for k, v in model.state_dict().items()}
    with average.applied(model):
        assert torch.allclose(model[0].weight, expected)
    for k, v in model.state_dict().items():
        assert torch.equal(v, own[k]), k
    with pytest.raises(ValueError, match="strictly between"):
        WeightAverage(model, decay=1.0)


def test_best_checkpoint_holds_the_averaged_weights(tiny_coco, tmp_path):
    run = tmp_path / "run"
    outcome = train(tiny_train_config(tiny_coco, **{"optim.epochs": 1, "optim.ema": 0.9}), run, progress=False)
    assert outcome.reason == "finished"
    last, best = load_checkpoint(run / "last.pt"), load_checkpoint(run / "best.pt")
    averaged = last.train_state.weight_average.tensors
    assert best.meta["weight_average"] == 0.9
    key = "decoder.L_o.weight"
    assert torch.equal(best.state_dict[key], averaged[key])  # validated and saved: the average
    assert not torch.equal(best.state_dict[key], last.state_dict[key])  # not the last step's weights


def test_validation_value_takes_one_figure_or_the_smallest_of_several():
    figures = {"object_accuracy": 0.96, "pointing_accuracy": 0.91, "CIDEr": 5.0}
    assert validation_value("CIDEr", figures) == 5.0
    assert validation_value("min:object_accuracy,pointing_accuracy", figures) == 0.91
    assert validation_value("min: CIDEr, pointing_accuracy", figures) == 0.91
    with pytest.raises(ValueError, match="'BLEU-9' not among"):
        validation_value("min:object_accuracy,BLEU-9", figures)
    with pytest.raises(ValueError, match="'' not among"):
        validation_value("min:", figures)


def test_a_figure_with_nothing_to_score_counts_as_zero():
    # An untrained model that names no object has no pointing figure (None): the worst
    # score, not a crash, so any later validation that scores something beats it.
    figures = {"object_accuracy": 0.0, "pointing_accuracy": None, "CIDEr": 0.2}
    assert validation_value("pointing_accuracy", figures) == 0.0
    assert validation_value("min:CIDEr,pointing_accuracy", figures) == 0.0


@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_adam_and_sgd_step_as_one_fused_kernel_with_the_plain_form_s_updates(name):
    """build_optimizer's fused Adam/SGD against torch's for-each-parameter form: the same
    weights after a few steps (the fused kernel is the speed, not a different rule)."""
    from captioner.train.config import OptimConfig
    from captioner.train.loop import build_optimizer

    o = OptimConfig(optimizer=name, weight_decay=1e-4)
    torch.manual_seed(0)
    a = torch.nn.Linear(7, 5)
    b = torch.nn.Linear(7, 5)
    b.load_state_dict(a.state_dict())
    before = a.weight.detach().clone()
    fused = build_optimizer([{"params": list(a.parameters()), "lr": 1e-2}], o)
    assert fused.defaults["fused"] is True
    cls = torch.optim.Adam if name == "adam" else torch.optim.SGD
    extra = {} if name == "adam" else {"momentum": 0.9}
    plain = cls([{"params": list(b.parameters()), "lr": 1e-2}], weight_decay=1e-4, foreach=False, **extra)
    for _ in range(4):
        x = torch.randn(3, 7)
        for m, opt in ((a, fused), (b, plain)):
            opt.zero_grad()
            m(x).pow(2).sum().backward()
            opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q)
    assert (a.weight - before).abs().max() > 1e-3  # the steps moved the weights


def test_a_run_stopped_by_its_step_limit_validates_its_final_weights(tiny_coco, tmp_path):
    """Validation each epoch and a step limit within an epoch (14 captions, batches of 4: four
    steps an epoch, the limit at step 6): the final weights are validated too, so best.pt is
    chosen among every epoch's end and the last step, not the ends alone."""
    run = tmp_path / "run"
    outcome = train(tiny_train_config(tiny_coco, **{"optim.max_steps": 6, "val.every_epochs": 1,
                                                    "optim.save_every": 0}),
                    run, progress=False)
    log = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert outcome.reason == "max_steps" and outcome.step == 6
    assert [(r["epoch"], r["step"]) for r in log if "val" in r] == [(1, 4), (1, 6)]
    assert load_checkpoint(run / "last.pt").train_state.validated_at == 6


@pytest.mark.slow
def test_validating_leaves_the_training_as_it_is(tiny_coco, tmp_path):
    """A run validated every epoch ends with the weights (and their average) of the same run
    never validated: validation draws no random numbers and restores the training weights,
    so a checkpoint chosen on validation and the last step come from one training."""
    sets = {"optim.max_steps": 9, "optim.save_every": 0, "optim.ema": 0.9, "optim.seed": 3}
    train(tiny_train_config(tiny_coco, **sets, **{"val.every_epochs": 0}), tmp_path / "plain", progress=False)
    train(tiny_train_config(tiny_coco, **sets, **{"val.every_epochs": 1}), tmp_path / "validated", progress=False)
    a, b = (load_checkpoint(tmp_path / name / "last.pt") for name in ("plain", "validated"))
    assert all(torch.equal(a.state_dict[k], b.state_dict[k]) for k in a.state_dict)
    wa, wb = (c.train_state.weight_average.tensors for c in (a, b))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    log = [json.loads(line) for line in (tmp_path / "validated" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "val" in r] == [4, 8, 9]


@pytest.mark.slow
def test_a_finished_run_records_its_training_images_features_with_each_checkpoint_s_encoder(tiny_coco, tmp_path,
                                                                                             monkeypatch):
    from captioner.data.coco import load_split
    from captioner.model.familiarity import training_features
    from captioner.train import loop

    figures = iter([0.9, 0.5, 0.4, 0.3, 0.2])  # falling: best.pt is the first epoch's, last.pt the fourth's
    monkeypatch.setattr(loop, "validation_value", lambda metric, report: next(figures))
    run = tmp_path / "run"
    train(tiny_train_config(tiny_coco, **{"optim.epochs": 4, "val.every_epochs": 1}), run, progress=False)
    records = load_split(tiny_coco, "train")
    best, last = (load_checkpoint(run / name).state_dict for name in ("best.pt", "last.pt"))
    # Two encoders, so that each file's record must come from its own, not the other's.
    assert any(not torch.equal(best[k], last[k]) for k in best if k.startswith("encoder."))
    for name in ("best.pt", "last.pt"):
        ckpt = load_checkpoint(run / name)
        record = ckpt.familiarity
        assert record.images == len(records) and "split train" in record.data
        again = training_features(Captioner.from_checkpoint(ckpt), records, progress=False)
        assert torch.allclose(record.reference, again.reference, rtol=1e-4)


def test_too_few_training_images_for_familiarity_end_the_run_with_a_note(tmp_path, capsys):
    """Two training images cannot be described (a held-out covariance needs three): the run
    still ends well, its checkpoints without the record, and says why in one line."""
    from types import SimpleNamespace

    from captioner.train.loop import record_familiarity

    (tmp_path / "best.pt").write_bytes(b"untouched")
    run = SimpleNamespace(train_records=[object(), object()], run_dir=tmp_path, meta={"training_data": "x"},
                          cfg=SimpleNamespace(data=SimpleNamespace(train_split="train")), progress=False)
    record_familiarity(run)
    assert (tmp_path / "best.pt").read_bytes() == b"untouched"
    assert "no familiarity record: 2 training images, it needs at least 3" in capsys.readouterr().err


def test_the_averaged_weights_are_scored_and_shipped_with_their_own_record(tiny_coco, tmp_path):
    """optim.ema with a trained encoder: the averaged encoder is not last.pt's, so the record of
    the model scored at the last step (and of its slim copy) is fitted on the averaged encoder."""
    from dataclasses import replace

    from captioner.data.coco import load_split
    from captioner.model.familiarity import TrainingFeatures, training_features
    from studies.attention.checkpoints import model_at_last_step, slim_checkpoint

    run = tmp_path / "run"
    train(tiny_train_config(tiny_coco, **{"optim.max_steps": 6, "optim.ema": 0.5, "val.every_epochs": 0}), run,
          progress=False)
    ckpt = load_checkpoint(run / "last.pt")
    records = load_split(tiny_coco, "train")
    scored = model_at_last_step(ckpt)
    refit = training_features(scored, records, progress=False)
    raw = ckpt.familiarity
    assert not torch.allclose(raw.mean, refit.mean, atol=1e-3)  # two encoders: the test can tell them apart
    for record in (scored.familiarity, TrainingFeatures.from_dict(slim_checkpoint(ckpt)["familiarity"])):
        torch.testing.assert_close(record.mean, refit.mean, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(record.reference, refit.reference, rtol=1e-3, atol=1e-4)
    # A last.pt whose average has no record of its own (made before): familiarity unknown, not another's.
    average = replace(ckpt.train_state.weight_average, familiarity=None)
    ckpt = replace(ckpt, train_state=replace(ckpt.train_state, weight_average=average))
    assert model_at_last_step(ckpt).familiarity is None and "familiarity" not in slim_checkpoint(ckpt)


def test_a_frozen_encoder_s_record_comes_from_the_feature_cache(tiny_coco, tmp_path, monkeypatch):
    """The end of a run with the feature cache reads the cached features instead of encoding
    every training image again; the record is the one encoding gives, within fp16 rounding."""
    from captioner.data.coco import load_split
    from captioner.model.familiarity import training_features
    from captioner.train import loop
    from studies.attention.checkpoints import model_at_last_step

    def no_encoding(*args, **kwargs):
        raise AssertionError("the training images were encoded again")

    monkeypatch.setattr(loop, "training_features", no_encoding)
    run = tmp_path / "run"
    cfg = tiny_train_config(tiny_coco, **{"optim.max_steps": 3, "val.every_epochs": 0, "optim.ema": 0.5,
                                          "model.freeze_encoder": True, "data.feature_cache": True})
    train(cfg, run, progress=False)
    ckpt = load_checkpoint(run / "last.pt")
    record = ckpt.familiarity
    again = training_features(Captioner.from_checkpoint(ckpt), load_split(tiny_coco, "train"), progress=False)
    torch.testing.assert_close(record.mean, again.mean, rtol=1e-2, atol=2e-3)
    assert record.images == again.images
    # the frozen encoder's average is itself: its model at the last step keeps the record
    torch.testing.assert_close(model_at_last_step(ckpt).familiarity.mean, record.mean)
