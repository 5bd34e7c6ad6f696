"""Training configs: one model schema with captioner's, values checked against their
annotations, configs as deltas on a base, and the shipped configs' resolved values."""

import dataclasses
import json
import tomllib
from pathlib import Path
from typing import get_args, get_type_hints

import pytest

from captioner.cli.main import main as captioner_main
from captioner.model.attention import LOCAL_WIDTHS, MODES, NORMALIZERS, SCORES
from captioner.model.decoder import ModelConfig
from captioner.train.config import (
    SET_BY_THE_RUN,
    HardConfig,
    ModelSection,
    ModelStart,
    OptimConfig,
    TrainConfig,
    apply_overrides,
    load_config,
    model_config,
    read_config,
    to_toml,
)
from captioner.train.losses import REDUCTIONS, REWARDS
from captioner.train.precision import PRECISIONS
from tests.builders import one_line, tiny_train_config

CONFIGS = sorted((Path(__file__).parents[2] / "train" / "configs").glob("*.toml"))


# --- the shipped configs --------------------------------------------------------------------

@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_shipped_config_loads_with_the_values_it_states(path):
    cfg = load_config(path)
    assert cfg.name == path.stem
    assert cfg.model.attention in ("soft", "hard", "mean")
    raw = tomllib.loads(path.read_text())
    for section, values in raw.items():
        if isinstance(values, dict):
            for key, value in values.items():
                got = getattr(getattr(cfg, section), key)
                assert got == value and type(got) is type(value) or isinstance(value, int) and got == float(value), \
                    f"{section}.{key}: {got!r} from {value!r}"
    assert load_config_text(to_toml(cfg)) == cfg  # what a run writes reads back the same
    if cfg.model.attention == "hard":  # the hard configs say which REINFORCE they use
        assert set(raw["hard"]) == {f.name for f in dataclasses.fields(HardConfig)}


def load_config_text(text):
    return TrainConfig.from_dict(tomllib.loads(text))


def test_every_shipped_config_resolves_to_the_values_recorded_for_it():
    """The shipped configs' every resolved value, types included (5 is not 5.0), as
    tests/fixtures/build_resolved_configs.py recorded them: a config rewritten (as a delta on
    another, say) trains what it trained before."""
    recorded = json.loads((Path(__file__).parents[1] / "fixtures" / "resolved_configs.json").read_text())
    assert sorted(recorded) == sorted(p.stem for p in CONFIGS)
    for path in CONFIGS:
        got = load_config(path).to_dict()
        assert json.dumps(got, sort_keys=True) == json.dumps(recorded[path.stem], sort_keys=True), path.stem


def test_the_variants_state_only_what_differs_from_their_base():
    """A variant's file holds none of its base's values again (the base's header says what
    the variant keeps)."""
    variants = {p.stem: tomllib.loads(p.read_text()) for p in CONFIGS}
    assert {name: raw.get("base") for name, raw in variants.items() if "base" in raw} == {
        "shapes-mean": "shapes-soft.toml", "shapes-hard": "shapes-soft.toml",
        "shapes-hard-scratch": "shapes-soft.toml", "shapes-scst": "shapes-soft.toml",
        "shapes-soft-frozen": "shapes-soft.toml", "shapes-zh-soft": "shapes-soft.toml",
        "coco-vgg19-hard": "coco-vgg19-soft.toml", "coco-vgg19-scst": "coco-vgg19-soft.toml",
        "flickr8k-vgg19-soft": "coco-vgg19-soft.toml"}
    for name, raw in variants.items():
        if "base" not in raw:
            continue
        base = read_config(CONFIGS[0].parent / raw["base"])
        same = [f"{section}.{key}" for section, values in raw.items() if isinstance(values, dict)
                for key, value in values.items() if base.get(section, {}).get(key, None) == value]
        assert not same, f"{name} restates {same}"


# --- one model schema -----------------------------------------------------------------------

def test_the_model_section_is_model_config_less_what_the_run_sets_plus_how_it_starts():
    shape = [f for f in dataclasses.fields(ModelConfig) if f.name not in SET_BY_THE_RUN]
    start = {f.name: f for f in dataclasses.fields(ModelStart)}
    section = {f.name: f for f in dataclasses.fields(ModelSection)}
    assert list(section) == [f.name for f in shape] + [n for n in start if n not in {f.name for f in shape}]
    kinds, config_kinds = get_type_hints(ModelSection), get_type_hints(ModelConfig)
    for f in shape:
        if f.name not in start:
            assert kinds[f.name] == config_kinds[f.name] and section[f.name].default == f.default, f.name
    assert kinds["image_size"] is int and section["image_size"].default == ModelConfig.image_size[0]


def test_model_config_carries_every_shared_field_and_the_run_s_sizes():
    cfg = load_config(None, ["model.attention=hard", "model.heads=2", "model.score=dot", "model.image_size=96",
                             "model.grid_layers=1", "model.grid_heads=2", "model.resize=110"])
    m = model_config(cfg.model, vocab_size=17)
    assert (m.vocab_size, m.image_size, m.annotation_dim) == (17, (96, 96), ModelConfig.annotation_dim)
    for f in dataclasses.fields(ModelConfig):
        if f.name not in (*SET_BY_THE_RUN, "image_size"):
            assert getattr(m, f.name) == getattr(cfg.model, f.name), f.name


def test_the_choices_of_the_annotations_are_those_the_code_takes():
    model, optim, hard = get_type_hints(ModelConfig), get_type_hints(OptimConfig), get_type_hints(HardConfig)
    assert set(get_args(model["attention"])) == set(MODES)
    assert set(get_args(model["score"])) == set(SCORES)
    assert set(get_args(model["normalizer"])) == set(NORMALIZERS)
    assert set(get_args(model["local_width"])) == set(LOCAL_WIDTHS)
    assert set(get_args(optim["precision"])) == set(PRECISIONS)
    assert set(get_args(hard["reward"])) == set(REWARDS)
    assert set(get_args(hard["reduction"])) == set(REDUCTIONS)


# --- values checked against their annotations -----------------------------------------------

def test_a_config_file_with_an_unknown_key_or_a_wrong_type_is_refused(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\n[hard]\nlambda = 0.1\n')
    with pytest.raises(ValueError, match="unknown config key hard.lambda"):
        load_config(bad)
    bad.write_text('name = "x"\n[optim]\ncache_images = true\n')
    with pytest.raises(ValueError, match="unknown config key optim.cache_images"):
        load_config(bad)
    bad.write_text('name = "x"\n[data]\ncache_images = "sometimes"\n')
    with pytest.raises(ValueError, match="must be true or false"):
        load_config(bad)


@pytest.mark.parametrize("text,message", [
    ('[optim]\nepochs = "many"', "optim.epochs must be an integer, got 'many'"),
    ("[optim]\nepochs = 2.5", "optim.epochs must be an integer, got 2.5"),
    ('[model]\ndropout = "high"', "model.dropout must be a number, got 'high'"),
    ("[model]\nencoder_pretrained = 2", "model.encoder_pretrained must be true or false, got 2"),
    ("[data]\ndir = 5", "data.dir must be a string, got 5"),
    ('name = 3', "name must be a string, got 3"),
    ('[model]\nattention = "sideways"', "model.attention must be one of soft, hard, mean, got 'sideways'"),
    ('[model]\nscore = "cos"', "model.score must be one of additive, concat, dot, scaled_dot, general, cosine, "
                               "got 'cos'"),
    ('[model]\nnormalizer = "entmax"', "model.normalizer must be one of softmax, sparsemax, got 'entmax'"),
    ('[model]\nlocal_width = "wide"', "model.local_width must be one of fixed, learned, got 'wide'"),
    ('[model]\nencoder = "vgg9"', "model.encoder must be one of .*small8.*, got 'vgg9'"),
    ('[optim]\nprecision = "fp8"', "optim.precision must be one of auto, fp32, bf16, fp16, got 'fp8'"),
    ('[optim]\noptimizer = "lion"', "optim.optimizer must be one of adam, rmsprop, sgd, got 'lion'"),
    ('[hard]\nreduction = "max"', "hard.reduction must be one of mean, sum, got 'max'"),
    ('[hard]\nreward = 1', "hard.reward must be one of word_mean, caption, got 1"),
    ('[scst]\nbaseline = "mean"', "scst.baseline must be one of loo, greedy, got 'mean'"),
])
def test_a_wrong_type_or_an_unknown_choice_is_one_line_naming_the_key_the_value_and_what_is_allowed(
        tmp_path, text, message):
    bad = tmp_path / "bad.toml"
    bad.write_text(text + "\n")
    with pytest.raises(ValueError, match=f"^{message}$"):
        load_config(bad)


def test_overrides_are_typed_and_checked(tmp_path):
    cfg = tiny_train_config(tmp_path, **{"optim.epochs": 3})
    assert cfg.optim.epochs == 3 and isinstance(cfg.optim.lr, float)
    with pytest.raises(ValueError, match="unknown config key"):
        apply_overrides(cfg, ["optim.epoch=3"])
    with pytest.raises(ValueError, match="^optim.epochs must be an integer, got 'many'$"):
        apply_overrides(cfg, ["optim.epochs=many"])
    with pytest.raises(ValueError, match="^model.attention must be one of soft, hard, mean, got 'sideways'$"):
        apply_overrides(cfg, ["model.attention=sideways"])
    cfg = apply_overrides(cfg, ["optim.max_steps=1e4", "optim.lr=1", "data.cache_images=false",
                                "val.metric=min:BLEU-4,CIDEr", "model.init_from=123", "model.encoder_from=demo-soft",
                                "optim.device=cuda:1",
                                "model.attention='hard'"])
    assert cfg.optim.max_steps == 10_000 and type(cfg.optim.max_steps) is int
    assert cfg.optim.lr == 1.0 and type(cfg.optim.lr) is float
    assert cfg.data.cache_images is False and cfg.val.metric == "min:BLEU-4,CIDEr"
    assert (cfg.model.init_from, cfg.model.encoder_from, cfg.optim.device) == ("123", "demo-soft", "cuda:1")
    assert cfg.model.attention == "hard"


def test_captioner_train_refuses_an_unknown_choice_inone_line(tmp_path, capsys):
    code = captioner_main(["train", "--config", "train/configs/shapes-soft.toml", "--run-dir", str(tmp_path / "r"),
                           "--set", "model.attention=sideways"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err == "captioner train: error: model.attention must be one of soft, hard, mean, got 'sideways'"
    assert not (tmp_path / "r").exists()


def test_configs_of_older_runs_with_amp_still_load(tmp_path):
    from captioner.io.checkpoint import TrainingState

    saved = tiny_train_config(tmp_path).to_dict()
    del saved["optim"]["precision"]
    for amp, precision in ((True, "auto"), (False, "fp32")):
        saved["optim"]["amp"] = amp
        config = TrainingState.from_dict({"config": saved}).config  # a last.pt's, upgraded
        assert TrainConfig.from_dict(config).optim.precision == precision


# --- configs as deltas ----------------------------------------------------------------------

def test_a_config_states_only_what_differs_from_its_base(tmp_path):
    (tmp_path / "base.toml").write_text('name = "base"\n[optim]\nepochs = 7\nlr = 0.5\n[val]\nbeam_size = 2\n')
    (tmp_path / "delta.toml").write_text('base = "base.toml"\nname = "delta"\n[optim]\nlr = 0.25\n')
    cfg = load_config(tmp_path / "delta.toml", ["val.limit=3"])
    assert cfg.name == "delta"
    assert (cfg.optim.epochs, cfg.optim.lr, cfg.val.beam_size, cfg.val.limit) == (7, 0.25, 2, 3)
    assert cfg.optim.batch_size == OptimConfig.batch_size  # stated by neither: the default
    assert "base" not in tomllib.loads(to_toml(cfg))  # a run writes the resolved values


def test_bases_chain_each_relative_to_its_own_file(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "b").mkdir()
    (tmp_path / "root.toml").write_text('name = "root"\n[model]\nheads = 2\nembed_dim = 8\n[data]\nmin_count = 3\n')
    (tmp_path / "a" / "middle.toml").write_text('base = "../root.toml"\nname = "middle"\n[model]\nembed_dim = 16\n')
    (tmp_path / "a" / "b" / "leaf.toml").write_text('base = "../middle.toml"\n[model]\nattention = "hard"\n')
    cfg = load_config(tmp_path / "a" / "b" / "leaf.toml")
    assert cfg.name == "middle"  # a value the file does not state comes from its bases, the name too
    assert (cfg.model.heads, cfg.model.embed_dim, cfg.model.attention, cfg.data.min_count) == (2, 16, "hard", 3)


def test_a_cycle_of_bases_is_refused_naming_it(tmp_path):
    (tmp_path / "a.toml").write_text('base = "b.toml"\n')
    (tmp_path / "b.toml").write_text('base = "c.toml"\n')
    (tmp_path / "c.toml").write_text('base = "a.toml"\n')
    a, b, c = (str(tmp_path / f"{x}.toml") for x in "abc")
    with pytest.raises(ValueError, match=f"^config bases run in a circle: {a} -> {b} -> {c} -> {a}$"):
        load_config(tmp_path / "a.toml")
    (tmp_path / "self.toml").write_text('base = "./self.toml"\n')
    with pytest.raises(ValueError, match="circle"):
        load_config(tmp_path / "self.toml")


def test_a_missing_or_malformed_base_isone_line(tmp_path, capsys):
    (tmp_path / "x.toml").write_text('base = "nowhere.toml"\n')
    with pytest.raises(ValueError, match=r"x.toml: base 'nowhere.toml' is not a file \(.*nowhere.toml\)$"):
        load_config(tmp_path / "x.toml")
    (tmp_path / "x.toml").write_text('base = 3\n')
    with pytest.raises(ValueError, match="base must be a string"):
        load_config(tmp_path / "x.toml")
    (tmp_path / "x.toml").write_text('[model]\nbase = "a.toml"\n')  # only at the top: in a section it is a key
    with pytest.raises(ValueError, match="unknown config key model.base"):
        load_config(tmp_path / "x.toml")
    (tmp_path / "x.toml").write_text('base = "nowhere.toml"\n')
    assert captioner_main(["train", "--config", str(tmp_path / "x.toml")]) == 2
    assert "is not a file" in capsys.readouterr().err


def test_shapes_soft_frozen_trains_what_the_comparison_found_robust():
    """train/configs/shapes-soft-frozen.toml is the comparison's frozen-sparsemax-8k-coords-ttb
    row (studies/attention/rows.toml, recipe "full"), the recipe whose every seed named,
    pointed and related: every resolved value the same but the run's name, its seed and its
    thread count, which choose a run, not the recipe."""
    from studies.attention.plan import DEFAULT_ROWS, load_plan, training_config

    plan = load_plan(DEFAULT_ROWS)
    row = next(r for r in plan.rows if r.name == "frozen-sparsemax-8k-coords-ttb")
    recipe = plan.recipes["full"]
    studied = training_config(recipe, int(recipe["steps"]), row, seed=0).to_dict()
    ours = load_config(CONFIGS[0].parent / "shapes-soft-frozen.toml").to_dict()
    for got in (studied, ours):
        got.pop("name")
        got["optim"].pop("seed")
        got["optim"].pop("threads")
    assert ours == studied


# --- values the run cannot use, or would ignore: refused before any data is read -------------

def _train_cli(tmp_path, data_dir, text: str = "", *sets: str, config=None) -> tuple[int, float]:
    """``captioner train`` on a tiny config over ``data_dir`` (plus ``text``, TOML); the exit code
    and the seconds it took."""
    import time

    if config is None:
        config = tmp_path / "own.toml"
        config.write_text(f'name = "own"\n[data]\ndir = "{data_dir}"\nmin_count = 1\nworkers = 0\n'
                          '[model]\nencoder = "small"\nimage_size = 32\nembed_dim = 8\nhidden_dim = 8\n'
                          'attention_dim = 8\n[optim]\nmax_steps = 2\nbatch_size = 4\n[val]\nmax_len = 4\n'
                          'metric = "BLEU-1"\n' + text)
    start = time.perf_counter()
    code = captioner_main(["train", "--config", str(config), "--run-dir", str(tmp_path / "run"), "--quiet",
                           *[a for s in sets for a in ("--set", s)]])
    return code, time.perf_counter() - start


@pytest.mark.parametrize("setting, words", [
    ("val.metric=BLEU4", "'BLEU4' is not a figure validation gives; did you mean BLEU-4?"),
    ("val.metric=min:CIDEr,pointing", "'pointing' is not a figure validation gives"),
    ("val.metric=BLEU-4,CIDEr", "'BLEU-4,CIDEr' is not a figure validation gives"),  # several need min:
    ("val.metric=METEOR", "'METEOR' is not a figure validation gives"),  # validation skips METEOR
    ("val.metric=object_accuracy", "object_accuracy needs the objects of each image"),  # no instances file
    ("val.beam_size=0", "val.beam_size must be >= 1, got 0"),
    ("val.max_len=0", "val.max_len must be >= 1, got 0"),
    ("optim.batch_size=0", "optim.batch_size must be >= 1, got 0"),
    ("optim.lr=-1", "optim.lr must be > 0, got -1.0"),
    ("optim.max_minutes=-5", "optim.max_minutes must be >= 0, got -5.0"),
    ("optim.ema=1", "optim.ema must be in [0, 1) (0: off), got 1.0"),
    ("data.min_count=0", "data.min_count must be >= 1, got 0"),
    ("hard.expected_context_prob=1.5", "hard.expected_context_prob must be between 0 and 1, got 1.5"),
])
def test_a_value_the_run_cannot_use_is_one_line_before_any_data_is_read(tiny_coco, tmp_path, capsys,
                                                                         setting, words):
    """Each of these used to pass and end in a traceback at the first step or validation."""
    code, seconds = _train_cli(tmp_path, tiny_coco, "", setting)
    line = one_line(capsys.readouterr().err)
    assert code == 2 and words in line, line
    assert not (tmp_path / "run").exists()
    assert seconds < 5


def test_a_grounding_metric_is_taken_on_shapes_data_even_before_it_is_generated(tmp_path):
    from captioner.train.startup import check_new_run

    cfg = load_config(None, [f"data.dir={tmp_path / 'shapes'}", "data.generate_shapes=true",
                             "val.metric=min:object_accuracy,pointing_accuracy"])
    check_new_run(cfg)  # the run generates the data, objects included
    assert not (tmp_path / "shapes").exists()
    with pytest.raises(ValueError, match="needs the objects"):
        check_new_run(apply_overrides(cfg, ["data.generate_shapes=false"]))


@pytest.mark.parametrize("text, sets, words", [
    ('[hard]\nentropy = 0.01\n', (), "hard.entropy (from the config file) has no effect: REINFORCE is for hard "
                                       "attention, and model.attention is soft"),
    ("", ("hard.lambda_r=0.5",), "hard.lambda_r (from --set) has no effect"),
    ('[scst]\nenabled = true\nsamples = 2\n', ("optim.doubly_stochastic=0.5",),
     "optim.doubly_stochastic (from --set) has no effect: self-critical training"),
    ('[model]\nattention = "hard"\n[scst]\nenabled = true\n[hard]\nlambda_r = 0.2\n', (),
     "hard.lambda_r (from the config file) has no effect: self-critical training"),
    ("", ("model.freeze_encoder=true", "model.fine_tune_blocks=2"),
     "model.fine_tune_blocks (from --set) has no effect: model.freeze_encoder is true"),
    ('[scst]\nsamples = 3\n', (), "scst.samples (from the config file) has no effect: scst.enabled is false"),
])
def test_a_value_the_chosen_model_ignores_is_refused_in_one_line_saying_why(tiny_coco, tmp_path, capsys,
                                                                             text, sets, words):
    code, seconds = _train_cli(tmp_path, tiny_coco, text.replace("[model]\n", ""), *sets) \
        if "[model]" not in text else _train_cli(tmp_path, tiny_coco, "", *sets, config=_with_model(
            tmp_path, tiny_coco, text))
    line = one_line(capsys.readouterr().err)
    assert code == 2 and words in line, line
    assert not (tmp_path / "run").exists() and seconds < 5


def _with_model(tmp_path, data_dir, text):
    """A tiny config whose [model] section is ``text``'s (TOML sections appear once)."""
    model = text.split("[model]\n", 1)[1].split("[", 1)
    rest = "[" + model[1] if len(model) > 1 else ""
    path = tmp_path / "own.toml"
    path.write_text(f'[data]\ndir = "{data_dir}"\nmin_count = 1\nworkers = 0\n[model]\nencoder = "small"\n'
                    f'image_size = 32\nembed_dim = 8\nhidden_dim = 8\nattention_dim = 8\n{model[0]}'
                    f'[optim]\nmax_steps = 2\nbatch_size = 4\n[val]\nmax_len = 4\nmetric = "BLEU-1"\n{rest}')
    return path


def test_the_shipped_configs_state_nothing_they_ignore_and_name_what_their_base_sets():
    """A base's values the variant ignores are named once at start-up, not refused: shapes-scst
    inherits shapes-soft's penalty weight and encoder rate, neither used under SCST with a frozen
    encoder; switching a hard config to soft from the command line notes its [hard] section."""
    from captioner.train.config import check_ignored, written_keys

    notes = {}
    for path in CONFIGS:
        stated = written_keys(tomllib.loads(path.read_text()))
        notes[path.stem] = check_ignored(load_config(path), stated, written_keys(read_config(path)))
    assert any("optim.doubly_stochastic = 0.0" in n and "self-critical" in n for n in notes["shapes-scst"])
    assert any("optim.encoder_lr = 0.001" in n for n in notes["shapes-scst"])
    assert notes["shapes-soft"] == [] and notes["coco-vgg19-soft"] == []

    path = CONFIGS[0].parent / "shapes-hard-scratch.toml"  # its header's reference run
    cfg = load_config(path, ["model.attention=soft"])
    notes = check_ignored(cfg, written_keys(tomllib.loads(path.read_text())), written_keys(read_config(path)),
                          {"model.attention"})
    assert any(n.startswith("ignored, REINFORCE is for hard attention") and "hard.reward" in n for n in notes)


def test_a_run_s_own_config_toml_trains_again_with_its_ignored_values_noted(tiny_coco, tmp_path, capsys):
    """config.toml states every key, the [hard] section of a soft run too: a record, not a mistake."""
    cfg = tiny_train_config(tiny_coco, **{"optim.max_steps": 1, "val.every_epochs": 0, "hard.entropy": 0.01})
    (tmp_path / "cfg.toml").write_text(to_toml(cfg))
    code, _ = _train_cli(tmp_path, tiny_coco, config=tmp_path / "cfg.toml")
    err = capsys.readouterr().err
    assert code == 0, err
    assert "note: ignored, REINFORCE is for hard attention, and model.attention is soft: hard.entropy = 0.01" in err


def test_set_name_renames_the_run(tmp_path, monkeypatch):
    cfg = load_config(CONFIGS[0].parent / "shapes-soft.toml", ["name=own"])
    assert cfg.name == "own"
    from captioner.train.loop import new_run_dir
    assert new_run_dir(cfg, tmp_path).name.startswith("own-")
    with pytest.raises(ValueError, match="name must not be empty"):
        load_config(None, ["name="])


def test_a_resume_reads_last_pt_once(tiny_coco, tmp_path, monkeypatch, capsys):
    """`captioner train --resume` takes the run's config from last.pt and hands the file's
    contents on to training rather than reading it again (a COCO run's last.pt, optimiser state
    and all, is large)."""
    import captioner.io.checkpoint
    from captioner.train import loop

    code, _ = _train_cli(tmp_path, tiny_coco, "", "val.every_epochs=1000")
    assert code == 0
    reads = []
    real = captioner.io.checkpoint.load_checkpoint

    def counted(path, *args, **kwargs):
        reads.append(Path(path).name)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(captioner.io.checkpoint, "load_checkpoint", counted)
    monkeypatch.setattr(loop, "load_checkpoint", counted)
    # The run is finished: the resume stops before training, so every read is start-up's.
    assert captioner_main(["train", "--resume", str(tmp_path / "run"), "--quiet"]) == 0
    assert "already finished" in capsys.readouterr().err
    assert reads == ["last.pt"]
