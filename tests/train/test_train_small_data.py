"""Training on a small data set: a validation of a handful of images neither stops a run early
nor chooses its best.pt, an equal figure keeps the later weights, the vocabulary keeps the
words of a small data set, and a finished run names the value that stopped it."""

from __future__ import annotations

from collections import Counter

import pytest

from captioner.cli.main import main as captioner_main
from captioner.data.vocab import PTB, UNK
from captioner.io.checkpoint import load_checkpoint
from captioner.train import loop
from captioner.train.captions import TrainingCaptions
from captioner.train.config import DataConfig, load_config
from captioner.train.datainfo import vocab_min_count, vocabulary
from captioner.train.loop import TrainOutcome, outcome_line, train
from tests.builders import tiny_train_config

OWN_SOFT = "own-soft"
# own-soft.toml made tiny for a CPU test (as tests/project/test_own_data_e2e.py), its [val] and
# vocabulary rules left as the recipe states them.
TINY = ["model.encoder=small", "model.encoder_pretrained=false", "model.image_size=32", "model.embed_dim=16",
        "model.hidden_dim=24", "model.attention_dim=12", "data.feature_cache=false", "data.workers=0",
        "optim.batch_size=8", "optim.threads=1", "optim.save_every=0", "val.max_len=6", "val.beam_size=1"]


def figures(monkeypatch, values):
    """Validation gives ``values`` one after the other (the last again and again): the run's
    choices made on figures set by the test, not by what a few steps happen to learn."""
    given = list(values)

    def value(metric, report):
        return given.pop(0) if len(given) > 1 else given[0]

    monkeypatch.setattr(loop, "validation_value", value)


def validated_steps(run) -> list[int]:
    import json

    return [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "val" in r]


@pytest.mark.slow
def test_the_own_data_recipe_does_not_stop_early_on_two_validation_images(tiny_coco, tmp_path, monkeypatch, capsys):
    """own-soft as shipped (val.patience = 5) on a data set whose validation split has two
    images, validation giving the same figure every epoch: the run trains every epoch; its
    start-up says why, and best.pt holds the last weights, not the first epoch's."""
    figures(monkeypatch, [0.0])
    run = tmp_path / "run"
    sets = [f"data.dir={tiny_coco}", "data.karpathy=", *TINY, "optim.epochs=7", "optim.lr=0.01"]
    code = captioner_main(["train", "--config", OWN_SOFT, *[a for s in sets for a in ("--set", s)],
                           "--run-dir", str(run), "--quiet"])
    err = capsys.readouterr().err
    assert code == 0
    assert "finished every epoch: step" in err and "stopped early" not in err
    assert "validation: 2 images, fewer than val.min_images = 50" in err
    assert "too few to choose by" in err and "last val CIDEr" in err
    assert validated_steps(run)[-1] == load_checkpoint(run / "best.pt").meta["step"] == \
        load_checkpoint(run / "last.pt").meta["step"]


@pytest.mark.parametrize("min_images,reason,epochs", [(3, "finished", 4), (2, "early_stop", 2)])
def test_early_stopping_waits_for_a_validation_of_val_min_images(tiny_coco, tmp_path, monkeypatch, min_images,
                                                                   reason, epochs):
    """Two validation images: below val.min_images = 3 the same figure four times does not stop
    the run; at val.min_images = 2 the second validation's equal figure is patience's one."""
    figures(monkeypatch, [0.5])
    cfg = tiny_train_config(tiny_coco, **{"optim.epochs": 4, "val.every_epochs": 1, "val.patience": 1,
                                          "val.min_images": min_images, "optim.save_every": 0})
    outcome = train(cfg, tmp_path / "run", progress=False)
    assert (outcome.reason, outcome.epoch) == (reason, epochs)
    assert outcome.chosen == (min_images == 2)


def test_val_limit_counts_as_the_validation_s_size(tiny_coco, tmp_path, monkeypatch):
    """val.limit = 1 of two images: one image scored, under val.min_images = 2."""
    figures(monkeypatch, [0.5])
    cfg = tiny_train_config(tiny_coco, **{"optim.epochs": 3, "val.every_epochs": 1, "val.patience": 1,
                                          "val.min_images": 2, "val.limit": 1, "optim.save_every": 0})
    assert train(cfg, tmp_path / "run", progress=False).reason == "finished"


@pytest.mark.slow  # four trainings: over a second each
@pytest.mark.parametrize("values,min_images,kept", [
    ([0.9, 0.5, 0.1], 3, -1),  # too few images: the last validated weights, whatever the figure
    ([0.9, 0.5, 0.1], 0, 0),  # enough: the best figure, the first
    ([0.5, 0.5, 0.5], 0, -1),  # an equal figure: the later weights
    ([0.1, 0.5, 0.5, 0.3], 0, 2),  # ... and not the falling one after it
], ids=["too-few", "falling", "equal", "equal-then-falling"])
def test_best_pt_holds_the_weights_validation_chose(tiny_coco, tmp_path, monkeypatch, values, min_images, kept):
    figures(monkeypatch, values)
    run = tmp_path / "run"
    cfg = tiny_train_config(tiny_coco, **{"optim.epochs": len(values), "val.every_epochs": 1,
                                          "val.min_images": min_images, "optim.save_every": 0})
    outcome = train(cfg, run, progress=False)
    steps = validated_steps(run)
    assert len(steps) == len(values)
    best = load_checkpoint(run / "best.pt").meta
    assert best["step"] == steps[kept] and best["val_BLEU-1"] == values[kept] == outcome.best_metric


def test_the_validation_lines_say_what_best_pt_got(tiny_coco, tmp_path, monkeypatch, capsys):
    figures(monkeypatch, [0.5, 0.5, 0.25])
    cfg = tiny_train_config(tiny_coco, **{"optim.epochs": 3, "val.every_epochs": 1, "optim.save_every": 0})
    train(cfg, tmp_path / "run", progress=False)
    lines = [line for line in capsys.readouterr().err.splitlines() if ": val BLEU-1 " in line]
    assert [line.split("(", 1)[1] for line in lines] == [
        "first validation: saved as best.pt)", "equal to the best: the later weights saved as best.pt)",
        "best so far 0.5000)"]


@pytest.mark.parametrize("sets,reason,key", [
    ({"val.patience": 1}, "early_stop", "val.patience"),
    ({"optim.max_steps": 5}, "max_steps", "optim.max_steps"),
    ({"optim.epochs": 2}, "finished", "optim.epochs"),
    ({"optim.max_minutes": 1e-4}, "time_budget", "optim.max_minutes"),
], ids=["patience", "max_steps", "epochs", "max_minutes"])
def test_resuming_a_finished_run_names_the_value_that_stopped_it(tiny_coco, tmp_path, monkeypatch, capsys,
                                                                  sets, reason, key):
    figures(monkeypatch, [0.5])
    run = tmp_path / "run"
    first = train(tiny_train_config(tiny_coco, **{"val.every_epochs": 1, "optim.save_every": 0, **sets}), run,
                  progress=False)
    assert first.reason == reason
    capsys.readouterr()
    train(None, run, resume=True, progress=False)
    said = capsys.readouterr().err
    hint = said.split("nothing to train; ", 1)[1]
    assert f"raise {key}" in hint and f"--resume {run} --set {key}=N" in hint
    others = {"val.patience", "optim.max_steps", "optim.epochs", "optim.max_minutes"} - {key}
    assert not any(other in hint for other in others), hint


def test_an_early_stop_ends_with_how_to_go_on(tmp_path):
    cfg = load_config(None, ["val.patience=3"])
    line = outcome_line(TrainOutcome(tmp_path, 12, 6, "early_stop", 0.25, 60.0), cfg)
    assert line.startswith("stopped early: val CIDEr did not improve in 3 validations (val.patience): step 12")
    assert line.endswith(f"to go on, raise val.patience (0: never stop early): --resume {tmp_path} "
                         "--set val.patience=N")
    assert "--resume" not in outcome_line(TrainOutcome(tmp_path, 12, 6, "max_steps", 0.25, 60.0), cfg)


def captions(*texts: str) -> TrainingCaptions:
    return TrainingCaptions([(0, PTB.tokenize(t)) for t in texts], too_long=0, empty=0)


# 14 words: "a" 5 times, "cat" and "dog" twice, five words once.
SMALL = captions("a cat on a mat", "a dog", "a cat and a dog in fog")


@pytest.mark.parametrize("share,expected", [(1.0, 3), (9 / 14, 3), (0.64, 2), (5 / 14, 2), (0.35, 1), (0.0, 1)])
def test_min_count_is_lowered_until_at_most_max_unk_share_of_the_words_are_unknown(share, expected):
    """14 words: at min_count 3, the nine seen once or twice (9/14) would be <unk>; at 2, the
    five seen once (5/14); at 1, none. A share exactly met is enough."""
    counts = Counter(t for _, tokens in SMALL.items for t in tokens)
    assert sum(counts.values()) == 14 and sorted(counts.values()) == [1, 1, 1, 1, 1, 2, 2, 5]
    d = DataConfig(min_count=3, max_unk_share=share)
    assert vocab_min_count(d, SMALL) == expected
    vocab = vocabulary(d, SMALL, PTB)
    assert all((w in vocab) == (c >= expected) for w, c in counts.items())


def test_min_count_is_never_raised_and_an_empty_set_keeps_it():
    assert vocab_min_count(DataConfig(min_count=1, max_unk_share=0.0), SMALL) == 1
    assert vocab_min_count(DataConfig(min_count=4, max_unk_share=0.0), captions()) == 4


def test_the_own_data_recipe_keeps_every_word_of_a_small_data_set(tiny_coco, capsys):
    """own-soft on six training images: every word of their captions in the vocabulary (a
    model that never learns <unk> never says it), and `data check` says min_count was lowered."""
    sets = [f"data.dir={tiny_coco}", "data.karpathy=", *TINY]
    assert captioner_main(["data", "check", "--config", OWN_SOFT, *[a for s in sets for a in ("--set", s)],
                           "--quiet"]) == 0
    said = capsys.readouterr().out
    cfg = load_config("own-soft", sets)
    assert cfg.data.min_count > 1 and cfg.data.max_unk_share < 0.05
    from captioner.data.coco import load_split
    from captioner.train.captions import training_captions

    kept = training_captions(load_split(tiny_coco, "train"), cfg.data.max_caption_len, PTB)
    words = {t for _, tokens in kept.items for t in tokens}
    vocab = vocabulary(cfg.data, kept, PTB)
    assert words <= set(vocab.words) and UNK in vocab
    assert f"vocabulary: {len(words) + 4} words (tokenizer ptb, min_count 1 (data.min_count {cfg.data.min_count} " \
           "lowered: at most 1% of the training words <unk>)" in said


def test_one_validation_image_is_said_in_the_singular(tiny_coco, tmp_path, monkeypatch, capsys):
    """val.limit = 1: the start-up and the validation lines say "1 image", "1 validation image is"."""
    figures(monkeypatch, [0.0])
    sets = [f"data.dir={tiny_coco}", "data.karpathy=", *TINY, "optim.epochs=1", "val.limit=1"]
    code = captioner_main(["train", "--config", OWN_SOFT, *[a for s in sets for a in ("--set", s)],
                           "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 0
    assert "validation: 1 image, fewer than val.min_images" in err
    assert "1 validation image is too few to choose by" in err and " 1 images" not in err
