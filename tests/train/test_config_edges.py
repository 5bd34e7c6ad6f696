"""train/config.py's value checks at their edges: each bound accepts the value on its edge and
refuses the nearest one beyond it, and an infinite value is refused wherever a number is read
(a TOML file can write ``inf``; ``--set`` can overflow to it)."""

from __future__ import annotations

import pytest

from captioner.train.config import load_config

# (setting, on the edge: accepted, beyond it: refused with this message)
EDGES = [
    ("data.min_count", "1", "0", "data.min_count must be >= 1, got 0"),
    ("data.max_vocab", "0", "-1", "data.max_vocab must be >= 0, got -1"),
    ("optim.lr", "1e-9", "0", "optim.lr must be > 0, got 0.0"),
    ("optim.lr_decay", "1", "1.0001", "optim.lr_decay must be in (0, 1], got 1.0001"),
    ("optim.lr_decay", "0.0001", "0", "optim.lr_decay must be in (0, 1], got 0.0"),
    ("optim.ema", "0", "-0.01", "optim.ema must be in [0, 1) (0: off), got -0.01"),
    ("optim.ema", "0.9999", "1", "optim.ema must be in [0, 1) (0: off), got 1.0"),
    ("optim.grad_clip", "0", "-0.5", "optim.grad_clip must be >= 0, got -0.5"),
    ("hard.baseline_decay", "0", "-0.01", "hard.baseline_decay must be between 0 and 1, got -0.01"),
    ("hard.baseline_decay", "1", "1.01", "hard.baseline_decay must be between 0 and 1, got 1.01"),
]


@pytest.mark.parametrize("key, edge, beyond, message", EDGES, ids=[f"{e[0]}={e[2]}" for e in EDGES])
def test_each_bound_takes_its_edge_and_refuses_what_lies_beyond(key, edge, beyond, message):
    section, name = key.split(".")
    assert getattr(getattr(load_config(None, [f"{key}={edge}"]), section), name) == float(edge)
    with pytest.raises(ValueError) as caught:
        load_config(None, [f"{key}={beyond}"])
    assert str(caught.value) == message


@pytest.mark.parametrize("key", ["optim.lr", "optim.max_minutes", "optim.grad_clip"])
def test_an_infinite_value_is_refused_from_a_file_and_from_set(tmp_path, key):
    """Every bound but a finite one lets infinity through (inf > 0): a rate of inf would turn
    the weights into NaN at the first step."""
    section, name = key.split(".")
    config = tmp_path / "inf.toml"
    config.write_text(f"[{section}]\n{name} = inf\n")
    with pytest.raises(ValueError, match=rf"^{key} must be .*, got inf$"):
        load_config(config, [])
    with pytest.raises(ValueError, match=rf"^{key} must be .*, got inf$"):
        load_config(None, [f"{key}=1e400"])  # overflows to inf
    config.write_text(f"[{section}]\n{name} = 1e300\n")  # large, finite: its bound decides
    assert getattr(getattr(load_config(config, []), section), name) == 1e300


@pytest.mark.parametrize("sets, message", [
    (["scst.samples=1"], "scst.samples must be at least 2 with the loo baseline, got 1"),
    (["scst.baseline=greedy", "scst.samples=0"], "scst.samples must be at least 1 with the greedy baseline, got 0"),
    (["scst.max_len=0"], "scst.max_len counts words and must be >= 1, got 0"),
])
def test_scst_values_at_their_edges(sets, message):
    with pytest.raises(ValueError) as caught:
        load_config(None, sets)
    assert str(caught.value) == message
    edge = [s.replace("=1", "=2").replace("=0", "=1") for s in sets]  # one step back: accepted
    load_config(None, edge)


def test_loader_workers_share_the_cores_among_the_ranks_of_one_machine(monkeypatch, tmp_path):
    from captioner.train.config import DataConfig

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr("captioner.batching.CGROUP", tmp_path)  # no CPU quota, whatever runs the tests
    for ranks, workers, expected in [(None, 16, 8), ("2", 16, 4), ("3", 16, 2), ("16", 16, 1), ("2", 3, 3),
                                     ("2", 0, 0), ("0", 16, 8)]:
        if ranks is None:
            monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        else:
            monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
        got = DataConfig(workers=workers).loader_workers()
        assert got == expected and isinstance(got, int), (ranks, workers, got)


def test_the_resolved_config_reads_back_as_written(tmp_path):
    """to_toml writes the run's config.toml, which --resume and a rerun read: every value, a
    quote or a backslash in a string included, comes back the same."""
    from captioner.train.config import to_toml

    cfg = load_config(None, ['name=say "hi" \\ bye', "data.karpathy=C:\\data\\split.json", "data.cache_images=true",
                             "optim.lr=0.0003", "optim.max_steps=7", "val.metric=min: CIDEr , BLEU-4"])
    path = tmp_path / "config.toml"
    path.write_text(to_toml(cfg))
    text = path.read_text()
    assert "cache_images = true" in text and "length_buckets = false" in text and "lr = 0.0003" in text
    again = load_config(path)
    assert again.to_dict() == cfg.to_dict()
    assert again.name == 'say "hi" \\ bye' and again.data.karpathy == "C:\\data\\split.json"


def test_min_metrics_are_read_name_by_name():
    from captioner.train.config import grounding_metrics, metric_names, metric_parts

    assert metric_parts("min: CIDEr , BLEU-4") == ["CIDEr", "BLEU-4"]
    assert metric_parts(" CIDEr ") == ["CIDEr"]
    assert metric_names("min:CIDEr,object_accuracy") == ["CIDEr", "object_accuracy"]
    assert grounding_metrics("min:CIDEr,object_accuracy") == ["object_accuracy"]
    assert grounding_metrics("CIDEr") == []
    with pytest.raises(ValueError, match="'BLEU' is not a figure validation gives; did you mean BLEU-1?"):
        metric_names("BLEU")
    with pytest.raises(ValueError, match="'zzz' is not a figure validation gives; caption metrics"):
        metric_names("zzz")


# What a config that states nothing trains with (the shipped configs state what they change).
# A default changed here changes every run that relies on it: the change must be deliberate.
DEFAULTS = {
    "data": {"dir": "data/shapes", "train_split": "train", "val_split": "val", "karpathy": "", "min_count": 5,
             "max_vocab": 0, "max_caption_len": 20, "cache_images": False, "feature_cache": False,
             "feature_cache_dir": "", "workers": 8, "skip_unreadable": False, "length_buckets": False,
             "generate_shapes": False, "shapes_train": 3000, "shapes_val": 200, "shapes_seed": 1,
             "shapes_image_size": 128, "shapes_top_to_bottom": False, "shapes_language": "en"},
    "model": {"init_from": "", "encoder_from": "", "image_size": 128, "resize": 0},
    "optim": {"epochs": 20, "max_steps": 0, "max_minutes": 0.0, "batch_size": 64, "optimizer": "adam",
              "lr": 4e-4, "encoder_lr": 1e-4, "weight_decay": 0.0, "lr_decay": 0.8, "lr_decay_every": 5,
              "grad_clip": 5.0, "ema": 0.0, "doubly_stochastic": 1.0, "seed": 0, "precision": "auto",
              "compile": "", "device": "auto", "threads": 0, "log_every": 20, "save_every": 200},
    "val": {"every_epochs": 1, "metric": "CIDEr", "beam_size": 1, "max_len": 20, "limit": 0, "patience": 5},
    # The authors' REINFORCE weights (capgen.py): lambda_r 1/10, entropy 0.002, baseline decay 0.9.
    "hard": {"reward": "word_mean", "lambda_r": 0.1, "entropy": 0.002, "reduction": "mean", "baseline_decay": 0.9,
             "expected_context_prob": 0.5},
    "scst": {"enabled": False, "samples": 5, "baseline": "loo", "max_len": 20},
    "log": {"tensorboard": True, "tensorboard_images": 3},
}


def test_the_defaults_are_those_recorded():
    from captioner.train.config import TrainConfig

    resolved = TrainConfig().to_dict()
    changed = {f"{s}.{k}": (v, resolved[s][k]) for s, values in DEFAULTS.items() for k, v in values.items()
               if resolved[s].get(k, "(gone)") != v or type(resolved[s].get(k)) is not type(v)}
    assert not changed, changed  # key: (recorded, now)
    assert load_config(None).to_dict() == resolved


def test_a_section_that_is_not_a_table_is_refused(tmp_path):
    config = tmp_path / "flat.toml"
    config.write_text("data = 5\n")
    with pytest.raises(ValueError, match=r"^unknown config section \[data\]$"):
        load_config(config)
    config.write_text("[datta]\nmin_count = 1\n")
    with pytest.raises(ValueError, match=r"^unknown config section \[datta\]$"):
        load_config(config)


def test_an_ignored_value_is_named_with_where_it_came_from():
    """Of several ignored values, the first is named with its own source: the file or --set."""
    from captioner.train.config import check_ignored

    soft = load_config(None, ["model.attention=soft"])
    with pytest.raises(ValueError, match=r"^hard.lambda_r \(from the config file\) has no effect: REINFORCE"):
        check_ignored(soft, stated={"hard.lambda_r"}, overridden={"hard.entropy"})
    with pytest.raises(ValueError, match=r"^hard.lambda_r \(from --set\) has no effect"):
        check_ignored(soft, stated={"hard.entropy"}, overridden={"hard.lambda_r"})
    # --set model.attention=soft over a hard config: the file's hard values are noted, not refused.
    assert check_ignored(soft, stated={"hard.lambda_r"}, written={"hard.lambda_r"},
                         overridden={"model.attention"}) == [
        "ignored, REINFORCE is for hard attention, and model.attention is soft: hard.lambda_r = 0.1"]


# --- mutation testing's survivors (docs/testing.md) -----------------------------------------
def test_a_config_name_near_a_shipped_one_is_suggested_and_one_like_none_is_not():
    from captioner.train.config import find_config

    with pytest.raises(ValueError, match="no config file own-sfot; did you mean own-soft\\?"):
        find_config("own-sfot")
    with pytest.raises(ValueError, match="no config file zzzz; shipped configs") as refused:
        find_config("zzzz")
    assert "did you mean" not in str(refused.value)


# Every lower bound, written out: a bound moved is a change to what runs accept. (EDGES above
# has the bounds of other shapes.)
AT_LEAST = {"data.min_count": 1, "data.max_vocab": 0, "data.max_caption_len": 1, "data.workers": 0,
            "data.shapes_train": 1, "data.shapes_val": 1, "data.shapes_image_size": 1, "model.image_size": 1,
            "model.resize": 0, "optim.epochs": 1, "optim.max_steps": 0, "optim.max_minutes": 0,
            "optim.batch_size": 1, "optim.weight_decay": 0, "optim.lr_decay_every": 1, "optim.grad_clip": 0,
            "optim.doubly_stochastic": 0, "optim.threads": 0, "optim.log_every": 1, "optim.save_every": 0,
            "val.every_epochs": 0, "val.beam_size": 1, "val.max_len": 1, "val.limit": 0, "val.patience": 0,
            "val.min_images": 0, "hard.lambda_r": 0, "hard.entropy": 0, "log.tensorboard_images": 0}


@pytest.mark.parametrize("key, low", AT_LEAST.items(), ids=list(AT_LEAST))
def test_every_lower_bound_takes_its_edge_and_refuses_the_value_below(key, low):
    section, name = key.split(".")
    default = getattr(getattr(load_config(None, []), section), name)
    below = low - 1 if isinstance(default, int) else low - 0.5
    assert getattr(getattr(load_config(None, [f"{key}={low}"]), section), name) == low
    with pytest.raises(ValueError) as caught:
        load_config(None, [f"{key}={below}"])
    assert str(caught.value) == f"{key} must be >= {low}, got {below}"


def test_the_table_of_lower_bounds_names_every_one():
    from captioner.train.config import BOUNDS

    assert {k for k, (_, what) in BOUNDS.items() if what.startswith(">=")} == set(AT_LEAST)


def test_counts_and_chance_levels_are_no_figures_to_validate_on():
    for name in ("n_images", "relation_chance", "pointing_chance"):
        with pytest.raises(ValueError, match=f"'{name}' is not a figure validation gives"):
            load_config(None, [f"val.metric={name}"])
    assert load_config(None, ["val.metric=relation_accuracy"]).val.metric == "relation_accuracy"


def test_a_run_name_keeps_every_character_after_the_first_equals_sign():
    assert load_config(None, ["name=lr=3e-4"]).name == "lr=3e-4"


def test_what_a_config_ignores_is_a_frozen_record():
    import dataclasses

    from captioner.train.config import ignored_values

    found = ignored_values(load_config(None, ["scst.samples=3"]))  # SCST's settings, with SCST off
    assert any(i.keys[0] == "scst.samples" and i.because == "scst.enabled is false" for i in found), found
    with pytest.raises(dataclasses.FrozenInstanceError):
        found[0].because = "changed"
    assert len(set(found)) == len(found)  # hashable: a record, compared by value


def test_the_keys_a_config_writes_name_the_run_s_name_only_when_it_is_written():
    from captioner.train.config import written_keys

    assert written_keys({"name": "x", "optim": {"lr": 1.0}, "val": {}}) == {"name", "optim.lr"}
    assert written_keys({"optim": {"lr": 1.0, "epochs": 2}}) == {"optim.lr", "optim.epochs"}


def test_a_set_value_may_itself_hold_an_equals_sign():
    """Only the first '=' of --set parts key and value: a folder named "a=b" is a value."""
    from captioner.train.config import TrainConfig, apply_overrides

    cfg = apply_overrides(TrainConfig(), ["data.dir=runs/lr=0.1/data", "name=a=b"])
    assert cfg.data.dir == "runs/lr=0.1/data" and cfg.name == "a=b"
