"""The training objective is chosen once (soft, hard, self-critical), and each one saves and
takes back its own state under the keys runs have always had."""

from __future__ import annotations

from captioner.distributed import DistContext
from captioner.io.checkpoint import TrainingState
from captioner.train.config import TrainConfig
from captioner.train.objectives import Hard, SelfCritical, Soft, choose_objective
from tests.tiny import tiny_vocab

REFS = [["a red circle"], ["a small blue square"]]


def _state(**entries) -> TrainingState:
    """A last.pt's train_state holding ``entries``, read as training reads it."""
    return TrainingState.from_dict({"config": TrainConfig().to_dict(), **entries})


def _cfg(**sets) -> TrainConfig:
    cfg = TrainConfig()
    for key, value in sets.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    return cfg


def test_the_objective_follows_the_config_and_scst_replaces_the_others():
    ctx = DistContext()
    assert isinstance(choose_objective(_cfg(), "soft", tiny_vocab(), REFS, ctx), Soft)
    assert isinstance(choose_objective(_cfg(), "mean", tiny_vocab(), REFS, ctx), Soft)
    assert isinstance(choose_objective(_cfg(), "hard", tiny_vocab(), REFS, ctx), Hard)
    for attention in ("soft", "hard"):
        assert isinstance(choose_objective(_cfg(**{"scst.enabled": True}), attention, tiny_vocab(), REFS, ctx),
                          SelfCritical)


def test_hard_attention_saves_its_baseline_and_coin_and_reads_older_files():
    ctx = DistContext()
    hard = choose_objective(_cfg(), "hard", tiny_vocab(), REFS, ctx)
    hard.objective.baseline = -1.25
    hard.objective.use_expected_context()  # the coin moves on
    saved = hard.save(ctx)
    assert saved["baseline"] == -1.25 and set(saved["hard"]) == {"baseline", "coin"}
    again = choose_objective(_cfg(), "hard", tiny_vocab(), REFS, ctx)
    assert again.restore(_state(**saved), rank=0) == []
    assert again.objective.baseline == -1.25
    assert [again.objective.use_expected_context() for _ in range(8)] == \
        [hard.objective.use_expected_context() for _ in range(8)]
    older = choose_objective(_cfg(), "hard", tiny_vocab(), REFS, ctx)
    older.restore(_state(baseline=-3.0), rank=0)  # files written before the coin was saved
    assert older.objective.baseline == -3.0


def test_self_critical_keeps_each_ranks_sampler_and_soft_keeps_nothing():
    ctx = DistContext()
    scst = choose_objective(_cfg(**{"scst.enabled": True}), "soft", tiny_vocab(), REFS, ctx)
    saved = scst.save(ctx)
    assert list(saved) == ["scst"] and len(saved["scst"]) == 1  # one sampler per rank
    assert scst.restore(_state(**saved), rank=0) == [] and scst.restore(_state(), rank=0) == []
    soft = choose_objective(_cfg(), "soft", tiny_vocab(), REFS, ctx)
    assert soft.save(ctx) == {} and soft.restore(_state(baseline=1.0), rank=0) == []
