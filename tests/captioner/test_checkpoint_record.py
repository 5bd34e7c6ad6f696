"""The typed checkpoint record: ``Checkpoint.from_dict`` upgrades each older form (one test
each, failing were that upgrade gone), ``to_dict`` writes today's form back exactly, and a
missing or ill-typed field is refused in one line."""

from dataclasses import asdict

import pytest
import torch

from captioner.inference import Captioner, DecodeOptions
from captioner.io.bundled import DEMOS
from captioner.io.checkpoint import (
    Checkpoint,
    CheckpointError,
    TrainingState,
    load_checkpoint,
    training_data_of,
    upgrade_weights,
)
from tests.tiny import tiny_captioner, tiny_image


def same(a, b, where: str = "") -> None:
    """``a`` equals ``b``: the same keys in the same order, the same types, tensors equal."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def current(**train_state) -> dict:
    """A tiny captioner's checkpoint dict in today's form, with ``train_state`` when given."""
    d = tiny_captioner(seed=2).checkpoint(meta={"step": 3}).to_dict()
    if train_state:
        d["train_state"] = train_state
    return d


def full_train_state() -> dict:
    """A last.pt's train_state as train/loop.py's save writes it (hard attention, a weight average)."""
    from captioner.train.config import TrainConfig
    from captioner.train.loop import TrainState, _rng_state

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.Adam(model.parameters())
    rng = _rng_state(torch.device("cpu"))
    position = asdict(TrainState(step=4, epoch=1, batch_in_epoch=2, best=0.5, bad_vals=1, validated_at=2,
                                 train_seconds=1.5))
    return {**position, "optimizer": optimizer.state_dict(),
            "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1).state_dict(), "rng": rng, "rng_per_rank": [rng],
            "config": TrainConfig().to_dict(), "grad_scaler": {}, "baseline": -1.5,
            "hard": {"baseline": -1.5, "coin": torch.Generator().manual_seed(7).get_state()},
            "weight_average": {"decay": 0.9, "updates": 4, "tensors": {"w": torch.ones(2)}}}


# --- today's form, both ways ----------------------------------------------------------------

def test_today_s_form_comes_back_exactly_from_the_record():
    d = current(**full_train_state())
    same(Checkpoint.from_dict(d).to_dict(), d)


def test_a_demo_saved_in_today_s_form_comes_back_exactly():
    if not DEMOS["demo-zh"].installed:
        pytest.skip("demo-zh's weights are not here")
    raw = torch.load(DEMOS["demo-zh"].path, weights_only=True)
    same(load_checkpoint(DEMOS["demo-zh"].path).to_dict(), raw)


def test_a_tiny_run_s_last_checkpoint_comes_back_exactly(tiny_coco, tmp_path):
    from captioner.train.loop import train
    from tests.builders import tiny_train_config

    run = tmp_path / "run"
    train(tiny_train_config(tiny_coco, **{"optim.max_steps": 2, "optim.ema": 0.5, "val.every_epochs": 0,
                                          "model.attention": "hard"}), run, progress=False)
    raw = torch.load(run / "last.pt", weights_only=True)
    assert {"baseline", "hard", "weight_average", "rng_per_rank"} <= set(raw["train_state"])
    same(load_checkpoint(run / "last.pt").to_dict(), raw)


def test_a_saved_captioner_reads_back_as_the_record_it_wrote(tmp_path):
    cap = tiny_captioner(seed=4)
    cap.save(tmp_path / "m.pt", meta={"note": "x"})
    ckpt = load_checkpoint(tmp_path / "m.pt")
    assert ckpt.model_config == cap.model.config and ckpt.preprocess == cap.preprocess
    assert list(ckpt.vocab) == cap.vocab.words and ckpt.tokenizer == "ptb" and ckpt.meta == {"note": "x"}
    assert ckpt.train_state is None and ckpt.familiarity is None and ckpt.demo is None


# --- one test per upgrade of an older form --------------------------------------------------

def test_a_file_without_a_tokenizer_is_ptb():
    d = current()
    del d["tokenizer"]
    assert Checkpoint.from_dict(d).tokenizer == "ptb"


def test_a_file_without_meta_has_empty_meta():
    d = current()
    del d["meta"]
    assert Checkpoint.from_dict(d).meta == {}
    d["meta"] = None
    assert Checkpoint.from_dict(d).meta == {}


def test_a_file_without_resize_resizes_the_whole_image():
    d = current()
    del d["preprocess"]["resize"]
    assert Checkpoint.from_dict(d).preprocess.resize == 0


def test_a_cosine_model_saved_before_its_temperature_gets_tau_1_and_captions_the_same():
    cap = tiny_captioner(seed=1, score="cosine")
    d = cap.checkpoint().to_dict()
    assert torch.equal(d["state_dict"].pop("decoder.attention.log_temperature"), torch.zeros(()))
    ckpt = Checkpoint.from_dict(d)
    assert torch.equal(ckpt.state_dict["decoder.attention.log_temperature"], torch.zeros(()))
    again = Captioner.from_checkpoint(ckpt)
    opts = DecodeOptions(beam_size=2, max_len=6)
    assert again.caption(tiny_image(3), opts).words == cap.caption(tiny_image(3), opts).words


def test_a_multi_head_cosine_decoder_gets_a_temperature_per_head():
    state = {"attention.heads.0.v": torch.zeros(1), "attention.heads.1.log_temperature": torch.full((), 0.5)}
    got = upgrade_weights({"score": "cosine", "heads": 2}, state, prefix="")
    assert torch.equal(got["attention.heads.0.log_temperature"], torch.zeros(()))
    assert torch.equal(got["attention.heads.1.log_temperature"], torch.full((), 0.5))  # its own kept
    assert upgrade_weights({"score": "dot", "heads": 2}, state, prefix="") is state  # other scores: as they are


def test_a_multi_head_file_before_per_head_values_is_refused_with_its_reason():
    d = current()
    d["model_config"]["heads"] = 2
    d["state_dict"] = {**d["state_dict"], "decoder.attention.out_proj.weight": torch.zeros(8, 16)}
    with pytest.raises(CheckpointError, match=r"earlier form, before values were projected to 4 per head") as e:
        Checkpoint.from_dict(d, "old.pt")
    assert str(e.value).startswith("old.pt: ") and "\n" not in str(e.value)


def test_a_run_saved_with_amp_resumes_with_the_precision_it_meant():
    config = {"optim": {"amp": True, "lr": 0.5}}
    assert TrainingState.from_dict({"config": config}).config == {"optim": {"precision": "auto", "lr": 0.5}}
    assert TrainingState.from_dict({"config": {"optim": {"amp": False}}}).config["optim"] == {"precision": "fp32"}


def test_a_run_saved_before_a_position_field_existed_takes_its_default():
    ts = full_train_state()
    for name in ("bad_vals", "validated_at", "batch_in_epoch", "best", "train_seconds"):
        del ts[name]
    state = TrainingState.from_dict(ts)
    assert (state.step, state.epoch) == (4, 1)
    assert (state.bad_vals, state.validated_at, state.batch_in_epoch, state.best, state.train_seconds) == \
        (0, -1, 0, None, 0.0)


def test_a_run_saved_with_one_random_state_is_one_rank():
    ts = full_train_state()
    del ts["rng_per_rank"]
    assert TrainingState.from_dict(ts).rng_per_rank == (ts["rng"],)


def test_a_run_saved_without_a_grad_scaler_has_none_to_restore():
    ts = full_train_state()
    del ts["grad_scaler"]
    state = TrainingState.from_dict(ts)
    assert state.grad_scaler == {} and state.to_dict()["grad_scaler"] == {}


def test_a_hard_run_saved_before_its_coin_resumes_with_the_coin_its_seed_made():
    """Such a file's resume has always drawn from a freshly seeded coin: the upgrade makes that
    coin explicit, so the objective restores it like any other."""
    from captioner.train.config import HardConfig
    from captioner.train.losses import HardAttentionObjective

    ts = full_train_state()
    del ts["hard"]
    ts["config"]["optim"]["seed"] = 11
    saved = TrainingState.from_dict(ts).objective["hard"]
    assert saved["baseline"] == -1.5
    fresh = HardAttentionObjective(HardConfig(), seed=11)
    resumed = HardAttentionObjective(HardConfig(), seed=0)
    resumed.load_state_dict(saved)
    assert resumed.baseline == -1.5
    assert [resumed.use_expected_context() for _ in range(20)] == [fresh.use_expected_context() for _ in range(20)]


def test_an_scst_sampler_saved_without_its_device_is_named_by_its_state_s_size():
    cpu_state = torch.Generator().manual_seed(3).get_state()
    cuda_state = torch.arange(16, dtype=torch.uint8)
    ts = TrainingState.from_dict({"config": {}, "scst": [{"generator": cpu_state}, {"generator": cuda_state}]})
    assert [s["device"] for s in ts.objective["scst"]] == ["cpu", "cuda"]
    assert torch.equal(ts.objective["scst"][0]["generator"], cpu_state)


def test_a_gpu_state_saved_for_every_visible_gpu_gives_the_resuming_gpu_its_own():
    one, two = torch.zeros(16, dtype=torch.uint8), torch.ones(16, dtype=torch.uint8)
    ts = TrainingState(config={}, rng_per_rank=({"torch": None, "cuda": [one, two]},))
    assert torch.equal(ts.rng_of(0, torch.device("cuda", 1))["cuda"], two)
    assert torch.equal(ts.rng_of(0, torch.device("cuda"))["cuda"], one)
    assert ts.rng_of(0, torch.device("cuda", 2))["cuda"] is None  # none saved for it
    assert ts.rng_per_rank[0]["cuda"] == [one, two]  # the record itself unchanged


def test_older_metadata_names_what_the_model_was_trained_on_without_folders():
    assert training_data_of({"trained_on": "synthetic shapes"}) == "synthetic shapes"
    assert training_data_of({"training_data": "mine", "trained_on": "older"}) == "mine"
    assert training_data_of({"training_data": "COCO (data/coco, split train)"}) == "COCO (split train)"
    assert training_data_of({"training_data": "COCO (C:\\data)"}) == "COCO"
    assert training_data_of({"training_data": "", "data": "data/x"}) is None


def test_a_file_of_an_earlier_format_version_reads_and_a_later_one_is_refused():
    d = current()
    assert d["version"] == 1 and Checkpoint.from_dict(d).to_dict()["version"] == 1
    del d["version"]
    assert Checkpoint.from_dict(d).to_dict()["version"] == 1
    d["version"] = 2
    with pytest.raises(CheckpointError, match="format version 2; this captioner reads up to 1"):
        Checkpoint.from_dict(d)


# --- refusals, in one line ------------------------------------------------------------------

@pytest.mark.parametrize("key", ["model_config", "vocab", "preprocess", "state_dict"])
def test_a_missing_field_is_named_in_one_line(key):
    d = current()
    del d[key]
    with pytest.raises(CheckpointError) as e:
        Checkpoint.from_dict(d, "m.pt")
    assert str(e.value) == f"m.pt lacks '{key}'"


ILL_TYPED = [
    ("vocab", "a b c", "'vocab' is str, not list or tuple"),
    ("vocab", [1, 2], "'vocab' must be a list of words"),
    ("model_config", [], "'model_config' is list, not dict"),
    ("model_config", {"vocab_size": 5, "colour": "red"}, "unusable model_config: unknown model config keys"),
    ("preprocess", {"size": [8, 8]}, "unusable preprocess: KeyError 'mean'"),
    ("state_dict", {"w": [1.0]}, "'state_dict' must map names to tensors"),
    ("tokenizer", 3, "'tokenizer' is int, not str"),
    ("tokenizer", "mecab", "names an unknown tokenizer 'mecab'"),
    ("meta", ["x"], "'meta' is list, not dict"),
    ("demo", 1, "'demo' is int, not str"),
    ("familiarity", {"method": "other"}, "familiarity record is unusable: unknown familiarity method"),
    ("train_state", [], "'train_state' is list, not dict"),
    ("train_state", {"step": 1}, "train_state lacks 'config'"),
    ("train_state", {"config": {}, "step": "1"}, "train_state: 'step' is str, not int"),
    ("train_state", {"config": {}, "weight_average": {"decay": 0.9, "updates": 1}},
     "weight average lacks 'tensors'"),
]


@pytest.mark.parametrize("key, value, says", ILL_TYPED, ids=[f"{k}-{s[:20]}" for k, _, s in ILL_TYPED])
def test_an_ill_typed_field_is_refused_in_one_line(key, value, says):
    d = current()
    d[key] = value
    with pytest.raises(CheckpointError) as e:
        Checkpoint.from_dict(d, "m.pt")
    message = str(e.value)
    assert message.startswith("m.pt") and says in message and "\n" not in message, message


def test_a_file_whose_field_is_ill_typed_is_refused_by_load_naming_the_file(tmp_path):
    d = current()
    d["vocab"] = "not a list"
    torch.save(d, tmp_path / "odd.pt")
    with pytest.raises(CheckpointError, match=r"odd\.pt: 'vocab' is str, not list or tuple"):
        Captioner.load(tmp_path / "odd.pt")
