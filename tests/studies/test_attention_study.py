"""studies.attention: the statistics its table rests on, the row checks, the whole
pipeline (train, score, table, rerun) on a tiny recipe, its subcommands, and its results
file."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from studies.attention import cli, plan, runner, scoring, store
from studies.attention import stats as cs
from studies.attention import table as ct
from studies.attention.checkpoints import last_step, last_step_model

# ----------------------------------------------------------------------------- BLEU

REFS = {1: ["a red circle", "a small red circle on the left", "one red circle"],
        2: ["a large blue square above a green star", "a blue square and a green star"],
        3: ["a white cross", "a large white cross in the middle of the image"],
        4: ["a yellow triangle to the left of a purple star", "two shapes"]}
CANDS = {1: "a red circle", 2: "a blue square above a star", 3: "white", 4: "a yellow triangle left of a purple star"}


def _pycoco_bleu4(refs: dict, cands: dict) -> float:
    from pycocoevalcap.bleu.bleu import Bleu

    from captioner.evaluation.metrics import _prepare

    gts, res = _prepare(refs, cands)
    return Bleu(4).compute_score(gts, res, verbose=0)[0][3]


def test_bleu_counts_give_pycocoevalcaps_corpus_bleu_on_the_set_and_on_a_resample():
    from captioner.evaluation.metrics import _prepare

    gts, res = _prepare(REFS, CANDS)
    stats = cs.bleu_stats(gts, res, [1, 2, 3, 4])
    assert cs.corpus_bleu4(stats.sum(0)) == pytest.approx(_pycoco_bleu4(REFS, CANDS), rel=1e-9)
    # A resample that takes image 2 three times and image 3 not at all is the corpus of those
    # captions: pycocoevalcap on copies of image 2 under new ids must agree.
    weights = np.array([1.0, 3.0, 0.0, 1.0])
    copies_r = {1: REFS[1], 2: REFS[2], 5: REFS[2], 6: REFS[2], 4: REFS[4]}
    copies_c = {1: CANDS[1], 2: CANDS[2], 5: CANDS[2], 6: CANDS[2], 4: CANDS[4]}
    assert cs.corpus_bleu4(weights @ stats) == pytest.approx(_pycoco_bleu4(copies_r, copies_c), rel=1e-9)


# -------------------------------------------------------------------------- figures

def test_figures_are_ratios_of_sums_over_images_not_means_of_per_image_ratios():
    stats = {"obj": np.array([1.0, 0.0]), "pt_hit": np.array([1.0, 0.0]), "pt_n": np.array([1.0, 3.0]),
             "pt_mass": np.array([0.5, 0.3]), "rel_true": np.array([0.0, 0.0]), "rel_named": np.array([0.0, 0.0]),
             "rel_n": np.array([0.0, 1.0])}
    f = cs.figures(stats)
    assert f["pointing"] == pytest.approx(0.25)  # 1 hit of 4 words, not (1/1 + 0/3) / 2
    assert f["mass_in_box"] == pytest.approx(0.2)
    assert f["object_accuracy"] == pytest.approx(0.5)
    assert f["relation_accuracy"] is None  # no relation between named objects: nothing to score, not 0
    named = cs.figures({**stats, "rel_true": np.array([1.0, 0.0]), "rel_named": np.array([2.0, 0.0])})
    assert named["relation_accuracy"] == pytest.approx(0.5)  # over the named relations, not the stated
    old = {k: v for k, v in stats.items() if k != "rel_named"}  # results from before directions were kept
    assert cs.figures({**old, "rel_true": np.array([1.0, 0.0])})["relation_accuracy"] is None
    boot = cs.resampled_figures([stats], np.array([[2.0, 0.0], [0.0, 2.0]]), np.ones((2, 1)))
    assert boot["pointing"].tolist() == [1.0, 0.0] and boot["object_accuracy"].tolist() == [1.0, 0.0]


def test_pooled_seeds_sum_their_counts_image_by_image():
    a = {"pt_hit": [1, 0], "pt_n": [2, 1], "obj": [1, 1], "cider": [4.0, 2.0]}
    b = {"pt_hit": [2, 1], "pt_n": [2, 1], "obj": [0, 1], "cider": [2.0, 0.0]}
    pooled = cs.pool([a, b])
    assert {k: v.tolist() for k, v in pooled.items()} == {"pt_hit": [3, 1], "pt_n": [4, 2], "obj": [1, 2],
                                                          "cider": [6.0, 2.0], "runs": [2, 2]}
    assert cs.concat([a, b])["pt_n"].tolist() == [2, 1, 2, 1]
    # Per-caption figures stay means over captions: 3 of the 4 captions name their objects.
    f = cs.figures(pooled)
    assert f["object_accuracy"] == pytest.approx(0.75) and f["CIDEr"] == pytest.approx(2.0)
    assert f["pointing"] == pytest.approx(4 / 6)


def test_bootstrap_difference_is_paired_over_the_same_images():
    rng = np.random.default_rng(1)
    ref = {"obj": (rng.random(300) < 0.5).astype(float)}
    first_miss = int(np.flatnonzero(ref["obj"] == 0)[0])
    one_better = {"obj": ref["obj"].copy()}
    one_better["obj"][first_miss] = 1.0  # the same captions but one
    weights = cs.bootstrap_weights(300, 500, seed=0)
    d = cs.paired_difference(one_better, ref, weights)["object_accuracy"]
    assert d["diff"] == pytest.approx(1 / 300)
    # Paired: every resample differs by (copies of that one image) / 300, so the interval is
    # tiny and never below 0; resampling the two sides apart would spread it over +-0.08.
    assert 0 <= d["lo"] <= d["hi"] <= 5 / 300
    same = cs.paired_difference(ref, ref, weights)["object_accuracy"]
    assert same == {"diff": 0.0, "lo": 0.0, "hi": 0.0}
    much_better = {"obj": np.ones(300)}
    d = cs.paired_difference(much_better, ref, weights)["object_accuracy"]
    assert d["lo"] > 0.4


def test_several_seeds_against_a_reference_widen_the_interval_by_their_spread():
    rng = np.random.default_rng(2)
    ref = {"obj": (rng.random(400) < 0.5).astype(float)}
    good, bad = {"obj": np.ones(400)}, {"obj": np.zeros(400)}
    one = scoring.difference([good], ref, resamples=400)["object_accuracy"]
    # One run: every resample keeps it, the interval is over the images alone and narrow.
    assert one["lo"] > 0.4
    two = scoring.difference([good, bad], ref, resamples=400)["object_accuracy"]
    # Two seeds that disagree: pooled they match the reference, and a resample that draws
    # the good seed twice (or the bad one) moves the difference by +-0.5.
    assert two["diff"] == pytest.approx(0.5 - ref["obj"].mean())
    assert two["lo"] < -0.4 and two["hi"] > 0.4
    agree = scoring.difference([good, good], ref, resamples=400)["object_accuracy"]
    assert agree["lo"] > 0.4  # seeds that agree add nothing to the width


# -------------------------------------------------------------------------- ranking

def test_rank_correlations():
    assert cs.spearman([1, 2, 3, 4], [10, 30, 35, 40]) == pytest.approx(1.0)
    assert cs.kendall_tau_b([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert cs.kendall_tau_b([1, 1, 2], [1, 2, 3]) == pytest.approx(2 / np.sqrt(6))  # tie in the first list
    assert cs.spearman([1, 1, 2], [1, 2, 3]) == pytest.approx(np.sqrt(3) / 2)
    assert cs.ranks([5, 1, 5, 3]).tolist() == [3.5, 1.0, 3.5, 2.0]


def _summary(values: dict[str, float]) -> dict:
    return {"rows": {n: {"figures": {k: {"mean": v, "sd": None, "n": 1} for k, _ in ct.COLUMNS}}
                     for n, v in values.items()}}


def test_check_ranking_reports_agreement_and_the_top_variant():
    full = _summary({"additive": 0.9, "dot": 0.7, "sparsemax": 0.8, "mean": 0.5})
    short = _summary({"additive": 0.6, "dot": 0.5, "sparsemax": 0.65, "mean": 0.2})
    text = ct.check_ranking(short, full)
    line = next(x for x in text.splitlines() if x.startswith("| object acc."))
    assert line == "| object acc. | +0.80 | +0.67 | sparsemax | additive | no |"
    with pytest.raises(ValueError, match="only 2 variant"):
        ct.check_ranking(_summary({"additive": 0.1, "dot": 0.2}), full)


# ------------------------------------------------------------------------ pipeline

def _rows_file(tmp_path: Path, extra_rows: str = "") -> Path:
    config = Path(__file__).resolve().parents[2] / "train" / "configs" / "shapes-soft.toml"
    data = tmp_path / "shapes-train"
    path = tmp_path / "rows.toml"
    path.write_text(f'''reference = "additive"
aa_pair = ["additive", "concat"]
[[rows]]
name = "additive"
sets = []
[[rows]]
name = "concat"
sets = ["model.score=concat"]
{extra_rows}
[recipes.tiny]
config = "{config}"
steps = 3
sets = ["data.dir={data}", "data.shapes_train=8", "data.shapes_val=2", "data.shapes_image_size=48",
        "model.encoder=small", "model.image_size=32", "model.embed_dim=8", "model.hidden_dim=8",
        "model.attention_dim=8", "optim.batch_size=4", "val.limit=2", "val.beam_size=1"]
''')
    return path


def _args(tmp_path: Path, rows_file: Path, *more: str) -> list[str]:
    """The train subcommand on the tiny recipe, in this process."""
    return ["train", "--rows-file", str(rows_file), "--recipe", "tiny", "--seeds", "0,1", "--test-images", "3",
            "--test-root", str(tmp_path / "tests"), "--out", str(tmp_path / "out"), "--runs", str(tmp_path / "runs"),
            "--jobs", "0", "--resamples", "50", *more]


# The test sets that _args's scoring reads (the train subcommand's --test-seeds, --test-images 3).
TEST_SETS = ([7001, 7002, 7003], 3)


def _record(results: store.Results, row: str, seed: int) -> dict:
    rec = results.get(row, seed)
    assert rec is not None, f"no record of {row} seed {seed}"
    return rec


def test_a_row_whose_field_or_parameter_this_code_lacks_stops_the_run_naming_it(tmp_path, capsys):
    rows = _rows_file(tmp_path, '''[[rows]]
name = "future"
sets = ["model.no_such_field=4"]
[[rows]]
name = "needs-param"
sets = []
requires_param = "no_such_param"
''')
    with pytest.raises(SystemExit) as e:
        cli.main(_args(tmp_path, rows, "--skip-timing"))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "future (unknown field model.no_such_field)" in err and "needs-param" in err and "no_such_param" in err
    assert "additive" not in err.split("cannot run:")[1]
    assert not (tmp_path / "out").exists()  # nothing trained before the check


@pytest.mark.slow
def test_pipeline_trains_scores_tabulates_and_a_rerun_trains_nothing(tmp_path, monkeypatch, shapes_test_sets):
    rows = _rows_file(tmp_path)
    shapes_test_sets(*TEST_SETS, tmp_path / "tests")
    assert cli.main(_args(tmp_path, rows, "--timing-steps", "5", "--timing-rounds", "2")) == 0
    out = tmp_path / "out" / "tiny-3steps"
    results = store.Results(out)
    timing = json.loads((out / "timing.json").read_text())["rates"]
    assert set(timing) == {"additive", "concat"}
    assert all(len(t["rounds"]) == 2 and t["steps_per_s"] == pytest.approx(np.median(t["rounds"]), rel=1e-3)
               and t["steps_per_s"] > 0 for t in timing.values())
    for name in ("additive", "concat"):
        for seed in (0, 1):
            rec = _record(results, name, seed)
            assert rec["steps"] == 3 and rec["seed"] == seed and sorted(rec["tests"]) == ["test7001", "test7002",
                                                                                          "test7003"]
            cols = rec["tests"]
            assert [len(cols[t]["image_ids"]) for t in sorted(cols)] == [3, 3, 3]
            assert all(len(cols[t]["stats"]["obj"]) == 3 for t in cols)
    summary = json.loads((out / "table.json").read_text())
    assert summary["n_images"] == 9 and set(summary["rows"]) == {"additive", "concat"}
    words = {r["pointing_words"] for r in summary["rows"].values()}
    assert len(words) == 1 and words.pop() > 0  # the same reference words for both variants
    assert summary["aa"]["object_accuracy"] is not None
    # The pooled difference is the difference of the seed means for a per-caption figure.
    means = {n: r["figures"]["CIDEr"]["mean"] for n, r in summary["rows"].items()}
    assert summary["vs_reference"]["concat"]["CIDEr"]["diff"] == pytest.approx(means["concat"] - means["additive"])
    table = (out / "table.md").read_text()
    assert "| additive | 2 |" in table and "| concat | 2 |" in table and "A/A noise floor (concat - additive" in table
    assert f"| {timing['concat']['steps_per_s']:.2f} |" in table.split("| concat | 2 |")[1].splitlines()[0]
    # Seeds differ: another seed is another model (not the same run scored twice).
    ent = [_record(results, "additive", s)["tests"]["test7001"]["figures"]["entropy"] for s in (0, 1)]
    assert ent[0] != ent[1]
    assert list(out.iterdir()) and not (out / "results").exists()  # one results file, no tree

    stamps = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.glob("results*")}
    import captioner.train.loop

    def no_training(*a, **k):
        raise AssertionError("a finished (row, seed) was trained again")

    monkeypatch.setattr(captioner.train.loop, "train", no_training)
    assert cli.main(_args(tmp_path, rows)) == 0  # nor timed again: timing.json has both
    assert stamps == {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.glob("results*")}

    monkeypatch.setattr(runner, "evaluate_checkpoint", no_training)
    (out / "table.md").unlink()
    assert cli.main(["table", "--rows-file", str(rows), "--recipe", "tiny", "--out", str(tmp_path / "out"),
                     "--resamples", "50"]) == 0  # reads the results file alone
    assert (out / "table.md").read_text() == table


@pytest.mark.slow  # trains and scores rows: seconds
def test_training_one_more_row_keeps_the_rows_already_in_the_table(tmp_path, shapes_test_sets):
    """train --rows B after A's seeds are in the results: the table it writes still holds A
    (every row of the file with results), as `table` alone would write it."""
    rows = _rows_file(tmp_path)
    shapes_test_sets(*TEST_SETS, tmp_path / "tests")
    assert cli.main([*_args(tmp_path, rows, "--rows", "additive"), "--skip-timing"]) == 0
    out = tmp_path / "out" / "tiny-3steps"
    assert "| additive | 2 |" in (out / "table.md").read_text()
    assert cli.main([*_args(tmp_path, rows, "--rows", "concat"), "--skip-timing"]) == 0
    table = (out / "table.md").read_text()
    assert "| additive | 2 |" in table and "| concat | 2 |" in table
    assert set(json.loads((out / "table.json").read_text())["rows"]) == {"additive", "concat"}
    (out / "table.md").unlink()
    assert cli.main(["table", "--rows-file", str(rows), "--recipe", "tiny", "--out", str(tmp_path / "out"),
                     "--resamples", "50"]) == 0
    assert (out / "table.md").read_text() == table


@pytest.mark.slow
def test_a_stopped_training_resumes_to_the_fixed_step_and_is_scored_there(tmp_path, monkeypatch, shapes_test_sets):
    import captioner.train.loop
    from captioner.train.config import load_config

    run_training = captioner.train.loop.train

    rows_file = _rows_file(tmp_path)
    the_plan = plan.load_plan(rows_file)
    recipe, steps = plan.recipe_of(the_plan, "tiny", None)
    additive = the_plan.rows[0]
    run_dir = tmp_path / "runs" / "tiny-3steps" / "additive" / "seed0"
    # A run stopped at step 2 (as Ctrl-C leaves it: last.pt, no result).
    stopped = plan.training_sets(recipe, steps, additive, 0)
    run_training(load_config(plan.ROOT / recipe["config"], stopped[:-2] + ["optim.max_steps=2", "optim.seed=0"]),
                 run_dir, progress=False)
    assert last_step(run_dir) == 2
    tests = shapes_test_sets(*TEST_SETS, tmp_path / "tests")
    calls = []
    monkeypatch.setattr(captioner.train.loop, "train",
                        lambda *a, **k: calls.append(k["resume"]) or run_training(*a, **k))
    out = tmp_path / "out" / "tiny-3steps"
    assert runner.run_job([additive], 0, recipe, "tiny", steps, tests, store.Results(out),
                          tmp_path / "runs" / "tiny-3steps", 3) == 0
    assert calls == [True] and last_step(run_dir) == 3
    rec = _record(store.Results(out), "additive", 0)  # read again from the file
    assert rec["checkpoint"].startswith("last.pt at step 3")
    # Scored with the weight average the recipe keeps (optim.ema), not the raw last weights.
    from captioner.io.checkpoint import load_checkpoint

    last = load_checkpoint(run_dir / "last.pt")
    average = last.train_state.weight_average.tensors
    scored = last_step_model(run_dir).model.state_dict()
    key = "decoder.L_o.weight"
    assert torch.equal(scored[key], average[key]) and not torch.equal(average[key], last.state_dict[key])



CHOSEN_ROWS = '''[[rows]]
name = "chosen-last"
train = "chosen"
sets = []
validate = true
[[rows]]
name = "chosen-best"
train = "chosen"
sets = []
validate = true
checkpoint = "best"
'''


@pytest.mark.slow  # trains and scores rows: seconds
def test_a_best_row_scores_the_checkpoint_validation_chose_and_its_twin_the_last_step(tmp_path, monkeypatch,
                                                                                     shapes_test_sets):
    """Two rows of one training validated every epoch (the tiny recipe: ten steps an epoch,
    here twelve steps): one scores last.pt's weights, the other best.pt, chosen on validation
    among the epoch's end and the last step; each record says which. best.pt is made to hold
    step 10 and weights of its own, so that scoring the last step for it would show."""
    from dataclasses import replace

    from captioner.io.checkpoint import load_checkpoint

    rows = _rows_file(tmp_path, CHOSEN_ROWS)
    scored = {}
    real = runner.evaluate_checkpoint

    def spy(cap, decode, test_sets, beam_size, progress=False):
        scored[len(scored)] = {k: v.clone() for k, v in cap.model.state_dict().items()}
        return real(cap, decode, test_sets, beam_size, progress)

    monkeypatch.setattr(runner, "evaluate_checkpoint", spy)
    args = _args(tmp_path, rows, "--rows", "chosen-last,chosen-best", "--seeds", "0", "--steps", "12", "--skip-timing")
    assert cli.main([*args, "--train-only"]) == 0
    run_dir = tmp_path / "runs" / "tiny-12steps" / "chosen" / "seed0"
    log = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "val" in r] == [10, 12]
    best = load_checkpoint(run_dir / "best.pt")
    best = replace(best, meta={**best.meta, "step": 10},
                   state_dict={**best.state_dict, "decoder.L_o.weight": best.state_dict["decoder.L_o.weight"] + 1.0})
    best.save(run_dir / "best.pt")
    shapes_test_sets(*TEST_SETS, tmp_path / "tests")
    assert cli.main(args) == 0
    results = store.Results(tmp_path / "out" / "tiny-12steps")
    last_rec, best_rec = _record(results, "chosen-last", 0), _record(results, "chosen-best", 0)
    assert last_rec["checkpoint"].startswith("last.pt at step 12")
    assert best_rec["checkpoint"].startswith("best.pt at step 10 of 12")
    assert best_rec["validation"]["step"] == 10 and last_rec["validation"]["step"] == 12
    header = (tmp_path / "out" / "tiny-12steps" / "table.md").read_text().splitlines()[0]
    assert "the weights at the last step (chosen-best: the checkpoint chosen on validation)" in header
    average = load_checkpoint(run_dir / "last.pt").train_state.weight_average.tensors
    assert all(torch.equal(scored[0][k], average[k]) for k in average)  # rows in the file's order
    assert all(torch.equal(scored[1][k], best.state_dict[k]) for k in best.state_dict)


@pytest.mark.parametrize("extra,says", [
    ('[[rows]]\nname = "b"\nsets = []\ncheckpoint = "best"\n', "b: checkpoint = \"best\" needs validate = true"),
    ('[[rows]]\nname = "b"\nsets = []\ncheckpoint = "first"\n', "b: checkpoint must be \"last\" or \"best\""),
    ('[[rows]]\nname = "x"\ntrain = "t"\nsets = []\nvalidate = true\n'
     '[[rows]]\nname = "y"\ntrain = "t"\nsets = []\n', "x, y share the training t"),
], ids=["best-unvalidated", "unknown-checkpoint", "shared-training-differs"])
def test_a_rows_file_whose_checkpoint_choice_cannot_work_is_refused(tmp_path, capsys, extra, says):
    with pytest.raises(SystemExit) as e:
        plan.load_plan(_rows_file(tmp_path, extra))
    assert e.value.code == 2 and says in capsys.readouterr().err


def _made_up(seed: int, hits: np.ndarray, device: str | None = None) -> dict:
    """A finished (row, seed)'s summary, and its per-image columns of one test set."""
    n = len(hits)
    stats = {"pt_hit": hits.tolist(), "pt_n": [3.0] * n, "obj": (hits == 3).astype(float).tolist(),
             "rel_true": [1.0] * n, "rel_named": [1.0] * n, "rel_n": [1.0] * n}
    return {"seed": seed, "steps": 3, **({"trained_on": device} if device else {}),
            "tests": {"test7001": {"image_ids": list(range(n)), "stats": stats}}}


def _write_result(out: Path, row: str, seed: int, hits: np.ndarray, device: str | None = None) -> None:
    """A finished (row, seed) as run_job leaves it: its record in the results file."""
    assert store.Results(out).add([{"row": row, **_made_up(seed, hits, device)}])


def _write_tree_result(out: Path, row: str, seed: int, hits: np.ndarray, device: str | None = None) -> None:
    """A finished (row, seed) as earlier versions left it: the summary and, beside it, the
    per-image columns."""
    folder = out / "results" / row
    folder.mkdir(parents=True, exist_ok=True)
    rec = _made_up(seed, hits, device)
    columns = rec.pop("tests")
    rec["tests"] = {name: {"figures": {}, "examples": {}} for name in columns}
    (folder / f"seed{seed}.json").write_text(json.dumps(rec))
    (folder / f"seed{seed}.images.json.gz").write_bytes(gzip.compress(json.dumps(columns).encode()))


def test_table_alone_takes_the_bootstrap_seed_and_refuses_a_negative_one(tmp_path, capsys):
    rows = _rows_file(tmp_path)
    out = tmp_path / "out" / "tiny-3steps"
    rng = np.random.default_rng(0)
    for row, shift in (("additive", 0.0), ("concat", -0.05)):
        for seed, offset in enumerate([0.1, -0.1, 0.0]):
            _write_result(out, row, seed, rng.binomial(3, np.clip(0.6 + shift + offset, 0, 1), 400).astype(float))
    base = ["table", "--rows-file", str(rows), "--recipe", "tiny", "--out", str(tmp_path / "out"), "--resamples", "200"]
    intervals = []
    for seed in ("0", "1"):
        assert cli.main([*base, "--bootstrap-seed", seed]) == 0
        summary = json.loads((out / "table.json").read_text())
        assert summary["bootstrap_seed"] == int(seed) and summary["resamples"] == 200
        d = summary["vs_reference"]["concat"]["pointing"]
        intervals.append((d["lo"], d["hi"]))
        assert d["lo"] < 0 < d["hi"] and d["seed_means"]["lo"] < 0 < d["seed_means"]["hi"]
    assert intervals[0] != intervals[1]
    import re

    # Welch's degrees of freedom as they came out: between n - 1 and 2n - 2 with n = 3 seeds a side.
    lo, hi = map(float, re.search(r"degrees of freedom, ([0-9.]+) to ([0-9.]+) here", (out / "table.md").read_text())
                 .groups())
    assert 2 <= lo <= hi <= 4
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        cli.main([*base, "--bootstrap-seed", "-1"])
    assert e.value.code == 2 and "--bootstrap-seed" in capsys.readouterr().err


def test_table_against_another_reference_is_written_beside_the_main_table(tmp_path):
    rows = _rows_file(tmp_path)
    out = tmp_path / "out" / "tiny-3steps"
    rng = np.random.default_rng(2)
    for row, p in (("additive", 0.6), ("concat", 0.3)):
        for seed in range(3):
            _write_result(out, row, seed, rng.binomial(3, p, 400).astype(float))
    base = ["table", "--rows-file", str(rows), "--recipe", "tiny", "--out", str(tmp_path / "out"), "--resamples", "200"]
    assert cli.main(base) == 0
    main_table = (out / "table.md").read_text()
    assert cli.main([*base, "--reference", "concat"]) == 0
    assert (out / "table.md").read_text() == main_table  # untouched
    summary = json.loads((out / "table-vs-concat.json").read_text())
    assert summary["reference"] == "concat" and list(summary["vs_reference"]) == ["additive"]
    assert summary["vs_reference"]["additive"]["pointing"]["lo"] > 0  # additive points better than concat here
    with pytest.raises(SystemExit) as e:  # a reference outside the rows compared
        cli.main([*base, "--rows", "additive", "--reference", "concat"])
    assert e.value.code == 2


# ------------------------------------------------- trained on one machine, scored on another

@pytest.mark.slow  # trains and scores rows: seconds
def test_trained_on_one_machine_packed_unpacked_and_scored_on_another(tmp_path, monkeypatch, capsys,
                                                                      shapes_test_sets):
    rows = _rows_file(tmp_path)
    gpu_box = _args(tmp_path, rows, "--rows", "additive")
    assert cli.main([*gpu_box, "--train-only", "--device", "cpu"]) == 0  # a device named: recorded as such
    out, runs = tmp_path / "out" / "tiny-3steps", tmp_path / "runs" / "tiny-3steps"
    assert not (out / store.RESULTS).exists() and not (tmp_path / "tests").exists()  # nothing scored, no test sets
    assert [last_step(runs / "additive" / f"seed{s}") for s in (0, 1)] == [3, 3]

    packs = tmp_path / "packs"
    pack = ["pack", str(packs), "--rows-file", str(rows), "--recipe", "tiny", "--rows", "additive", "--seeds", "0,1",
            "--runs", str(tmp_path / "runs")]
    assert cli.main([*pack, "--max-mb", "0.001"]) == 0
    tars = sorted(packs.glob("runs-*.tar"))
    assert len(tars) == 2  # a file each: one run is over the limit alone
    assert cli.main(pack) == 0 and sorted(packs.glob("*.tar")) == tars  # once only

    # The other machine: its own runs folder, nothing trained there.
    here = ["--runs", str(tmp_path / "here")]
    unpack = ["unpack", "--rows-file", str(rows), "--recipe", "tiny", *here]
    assert cli.main([*unpack, *map(str, tars)]) == 0
    slim_dir = tmp_path / "here" / "tiny-3steps" / "additive" / "seed0"
    assert last_step(slim_dir) == 3
    assert (slim_dir / "last.pt").stat().st_size < (runs / "additive" / "seed0" / "last.pt").stat().st_size / 2
    scored_there = last_step_model(runs / "additive" / "seed0").model.state_dict()
    scored_here = last_step_model(slim_dir).model.state_dict()
    assert scored_here.keys() == scored_there.keys()
    assert all(torch.equal(scored_here[k], scored_there[k]) for k in scored_here)  # the weight average, as there

    import captioner.train.loop

    def no_training(*a, **k):
        raise AssertionError("a packed run was trained again")

    monkeypatch.setattr(captioner.train.loop, "train", no_training)
    shapes_test_sets(*TEST_SETS, tmp_path / "tests")
    assert cli.main([*gpu_box, *here, "--skip-timing"]) == 0
    rec = _record(store.Results(out), "additive", 0)
    assert rec["steps"] == 3 and rec["trained_on"] == "cpu" and sorted(rec["tests"]) == ["test7001", "test7002",
                                                                                          "test7003"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:  # never over a run already there
        cli.main([*unpack, str(tars[0])])
    assert e.value.code == 2 and "already in" in capsys.readouterr().err



@pytest.mark.slow  # trains and scores rows: seconds
def test_a_validated_training_packs_its_best_checkpoint_and_is_scored_from_it_elsewhere(tmp_path, shapes_test_sets):
    """A "best" row trained on one machine is scored on another from the best.pt chosen there."""
    from captioner.io.checkpoint import load_checkpoint

    rows = _rows_file(tmp_path, CHOSEN_ROWS)
    there = _args(tmp_path, rows, "--rows", "chosen-last,chosen-best", "--seeds", "0", "--steps", "12")
    assert cli.main([*there, "--train-only"]) == 0
    run_dir = tmp_path / "runs" / "tiny-12steps" / "chosen" / "seed0"
    packs = tmp_path / "packs"
    assert cli.main(["pack", str(packs), "--rows-file", str(rows), "--recipe", "tiny", "--steps", "12", "--rows",
                     "chosen-best", "--seeds", "0", "--runs", str(tmp_path / "runs")]) == 0
    here = ["--runs", str(tmp_path / "here")]
    assert cli.main(["unpack", "--rows-file", str(rows), "--recipe", "tiny", "--steps", "12", *here,
                     *map(str, packs.glob("*.tar"))]) == 0
    unpacked = tmp_path / "here" / "tiny-12steps" / "chosen" / "seed0" / "best.pt"
    chosen = load_checkpoint(run_dir / "best.pt")
    assert torch.equal(load_checkpoint(unpacked).state_dict["decoder.L_o.weight"],
                       chosen.state_dict["decoder.L_o.weight"])
    shapes_test_sets(*TEST_SETS, tmp_path / "tests")
    assert cli.main([*there, *here, "--skip-timing"]) == 0
    rec = _record(store.Results(tmp_path / "out" / "tiny-12steps"), "chosen-best", 0)
    assert rec["checkpoint"].startswith(f"best.pt at step {chosen.meta['step']} of 12")


def test_unpack_refuses_anything_but_a_pack_of_runs_and_writes_nothing(tmp_path, capsys):
    import io
    import tarfile

    rows = _rows_file(tmp_path)
    for name in ("../escape/seed0/last.pt", "../seed0/last.pt", "additive/seed0/run.py", "/abs/seed0/last.pt"):
        bad = tmp_path / "bad.tar"
        with tarfile.open(bad, "w") as tar:
            info = tarfile.TarInfo(name)
            info.size = 3
            tar.addfile(info, io.BytesIO(b"abc"))
        with pytest.raises(SystemExit) as e:
            cli.main(["unpack", "--rows-file", str(rows), "--recipe", "tiny", "--runs", str(tmp_path / "runs"),
                      str(bad)])
        assert e.value.code == 2 and "not a pack of runs" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "escape").exists()


def test_a_device_trains_in_fp32_and_a_run_is_never_resumed_on_another_device(tmp_path):
    import captioner.train.loop
    from captioner.train.config import load_config

    rows_file = _rows_file(tmp_path)
    the_plan = plan.load_plan(rows_file)
    recipe, steps = plan.recipe_of(the_plan, "tiny", None)
    additive = the_plan.rows[0]
    sets = plan.training_sets(recipe, steps, additive, 0, "cuda")
    cfg = load_config(plan.ROOT / recipe["config"], sets)
    assert (cfg.optim.device, cfg.optim.precision) == ("cuda", "fp32")  # "auto" would be bf16 there
    assert plan.training_sets(recipe, steps, additive, 0) == [s for s in sets if not s.startswith("optim.device")
                                                              and s != "optim.precision=fp32"]
    run_dir = tmp_path / "runs" / "tiny-3steps" / "additive" / "seed0"
    stopped = plan.training_sets(recipe, steps, additive, 0)
    captioner.train.loop.train(load_config(plan.ROOT / recipe["config"],
                                           stopped[:-2] + ["optim.max_steps=2", "optim.seed=0"]),
                     run_dir, progress=False)
    with pytest.raises(RuntimeError, match="started with optim.device=auto, not cuda:0"):
        runner.run_job([additive], 0, recipe, "tiny", steps, None, store.Results(tmp_path / "out"),
                       tmp_path / "runs" / "tiny-3steps", 1, device="cuda:0")
    assert last_step(run_dir) == 2  # untouched


def test_the_table_says_which_device_trained_each_seed(tmp_path):
    out = tmp_path / "out"
    rng = np.random.default_rng(1)
    for row, seed, device in (("additive", 0, None), ("additive", 1, None), ("additive", 2, "auto"),
                              ("additive", 4, "cuda"), ("concat", 0, None), ("concat", 1, None), ("concat", 2, None),
                              ("concat", 4, "cuda")):
        _write_result(out, row, seed, rng.binomial(3, 0.6, 50).astype(float), device)
    where = ct.trained_where(store.Results(out).found(["additive", "concat"]))
    assert where == {"additive": {"auto": [0, 1, 2], "cuda": [4]}, "concat": {"auto": [0, 1, 2], "cuda": [4]}}
    assert ct.devices_line(where).endswith("additive, concat: auto 0-2; cuda 4.")
    assert ct._seed_list([0, 1, 2, 4, 6, 7]) == "0-2, 4, 6-7"


@pytest.fixture(scope="module")
def additive_runs(tmp_path_factory) -> Path:
    """The tiny recipe's additive row trained for seeds 0 and 1 (train --train-only), once for
    the tests that only read its checkpoints: the row's folder of runs (seed0/, seed1/)."""
    root = tmp_path_factory.mktemp("additive")
    assert cli.main([*_args(root, _rows_file(root), "--rows", "additive"), "--train-only"]) == 0
    return root / "runs" / "tiny-3steps" / "additive"


def _two_checkpoints_and_test_sets(tmp_path: Path, runs: Path, shapes_test_sets) -> tuple[str, str, dict]:
    """Two seeds of the tiny recipe's additive row (their last.pt) and three 3-image test sets."""
    tests = shapes_test_sets(*TEST_SETS, tmp_path / "tests")
    return str(runs / "seed0" / "last.pt"), str(runs / "seed1" / "last.pt"), tests


@pytest.mark.slow
def test_score_against_gives_the_paired_difference_of_two_checkpoints(tmp_path, capsys, additive_runs,
                                                                       shapes_test_sets):
    a, b, tests = _two_checkpoints_and_test_sets(tmp_path, additive_runs, shapes_test_sets)
    same = scoring.score_only([a], tests, 1, against=a, resamples=50)
    assert all(d is None or (d["diff"] == 0 and d["lo"] == 0 == d["hi"]) for d in same.values())
    other = scoring.score_only([b], tests, 1, against=a, resamples=50)
    assert other["entropy"]["diff"] != 0 and other["entropy"]["lo"] < other["entropy"]["hi"]
    out = capsys.readouterr().out
    assert f"{b} - {a}, 9 images" in out and "| entropy |" in out
    assert cli.main(["score", a, b, "--against", a, "--test-root", str(tmp_path / "tests"),
                     "--test-images", "3", "--beam-size", "1", "--resamples", "50"]) == 0
    out = capsys.readouterr().out
    # Both checkpoints have a row of their own, and the difference pools them as seeds.
    assert "all test sets, each checkpoint" in out and f"| {a} |" in out and f"| {b} |" in out
    assert f"2 seeds pooled - {a}, 9 images, 95% interval over the seeds and the images" in out
    with pytest.raises(SystemExit) as e:  # --against belongs to score
        cli.main(["train", "--against", a])
    assert e.value.code == 2



@pytest.mark.slow
def test_score_level_widens_the_interval_and_says_so(tmp_path, capsys, additive_runs, shapes_test_sets):
    """A second confirmation on fresh data splits the error rate between the tries: --level
    0.975 gives the wider interval of the same resamples and names its level."""
    a, b, tests = _two_checkpoints_and_test_sets(tmp_path, additive_runs, shapes_test_sets)
    at95 = scoring.score_only([b], tests, 1, against=a, resamples=200)
    at975 = scoring.score_only([b], tests, 1, against=a, resamples=200, level=0.975)
    e95, e975 = at95["entropy"], at975["entropy"]
    assert e975["diff"] == e95["diff"]
    assert e975["lo"] < e95["lo"] and e975["hi"] > e95["hi"]
    capsys.readouterr()
    assert cli.main(["score", b, "--against", a, "--test-root", str(tmp_path / "tests"), "--test-images", "3",
                     "--beam-size", "1", "--resamples", "50", "--level", "0.975"]) == 0
    assert "97.5% interval over the images" in capsys.readouterr().out
    for bad in ("1", "0", "0.4x"):
        with pytest.raises(SystemExit) as e:
            cli.main(["score", a, "--level", bad])
        assert e.value.code == 2


@pytest.mark.slow  # the additive row's two seeds trained (a module fixture): seconds
def test_score_reads_a_run_folder_as_the_table_does_its_weight_average(tmp_path, monkeypatch, additive_runs,
                                                                       shapes_test_sets):
    """A run folder is scored at its last.pt's weight average, the weights the table scores."""
    run_dir = additive_runs / "seed0"
    tests = shapes_test_sets(*TEST_SETS, tmp_path / "tests")
    seen = []
    real = scoring.evaluate_checkpoint
    monkeypatch.setattr(scoring, "evaluate_checkpoint",
                        lambda cap, *a, **k: seen.append(cap.model.state_dict()) or real(cap, *a, **k))
    scoring.score_only([str(run_dir)], tests, 1)
    scored = last_step_model(run_dir).model.state_dict()
    assert all(torch.equal(seen[0][k], scored[k]) for k in scored)


@pytest.mark.slow  # trains and scores rows: seconds
def test_a_row_whose_device_this_machine_lacks_is_left_out_not_failed(tmp_path, monkeypatch, capsys,
                                                                      shapes_test_sets):
    rows = _rows_file(tmp_path, '''[[rows]]
name = "additive-cuda"
sets = ["optim.device=cuda", "optim.precision=fp32"]
''')
    shapes_test_sets(*TEST_SETS, tmp_path / "tests")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(_args(tmp_path, rows, "--rows", "additive,additive-cuda", "--seeds", "0", "--skip-timing")) == 0
    err = capsys.readouterr().err
    assert "left out, their device is not on this machine: additive-cuda seed 0" in err
    results = store.Results(tmp_path / "out" / "tiny-3steps")
    assert results.done("additive", 0) and not any(r["row"] == "additive-cuda" for r in results.records())
    # Nor timed: the other rows are.
    assert cli.main(["timing", "--rows-file", str(rows), "--recipe", "tiny", "--out", str(tmp_path / "out"),
                     "--rows", "additive,additive-cuda", "--timing-steps", "5", "--timing-rounds", "1"]) == 0
    assert "not timed, their device is not on this machine: additive-cuda" in capsys.readouterr().err
    timing = json.loads((tmp_path / "out" / "tiny-3steps" / "timing.json").read_text())["rates"]
    assert set(timing) == {"additive"}


# ----------------------------------------------------------------------- subcommands

@pytest.mark.parametrize("command", cli.COMMANDS)
def test_each_subcommand_explains_itself(command, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m studies.attention {command} ") and len(out.splitlines()) > 5


def test_the_help_names_every_subcommand_and_an_unknown_one_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    listed = capsys.readouterr().out.split("positional arguments:")[1]
    assert all(f"\n    {c} " in listed for c in cli.COMMANDS) and "run-one" not in listed
    for argv, says in ((["tabel"], "unknown subcommand 'tabel'; subcommands: train, score, table"),
                       ([], "a subcommand is needed: train, score, table")):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and says in err


@pytest.mark.slow  # a child process of the pool, which imports and trains
def test_a_job_of_the_pool_hands_its_records_to_the_process_that_writes_them(tmp_path, shapes_test_sets):
    rows = _rows_file(tmp_path)
    shapes_test_sets(*TEST_SETS, tmp_path / "tests")
    argv = _args(tmp_path, rows, "--rows", "additive", "--seeds", "0", "--skip-timing")
    assert cli.main([*argv, "--jobs", "1"]) == 0  # one child process
    run_dir = tmp_path / "runs" / "tiny-3steps" / "additive" / "seed0"
    assert last_step(run_dir) == 3 and not store.handoff_path(run_dir).exists()
    rec = _record(store.Results(tmp_path / "out" / "tiny-3steps"), "additive", 0)
    assert rec["steps"] == 3 and sorted(rec["tests"]) == ["test7001", "test7002", "test7003"]
    assert "| additive | 1 |" in (tmp_path / "out" / "tiny-3steps" / "table.md").read_text()


# ---------------------------------------------------------------------- results file

def test_records_are_added_once_and_two_writers_keep_each_others(tmp_path):
    hits = np.array([3.0, 1.0])
    first, second = store.Results(tmp_path), store.Results(tmp_path)  # two commands on one table
    assert first.records() == [] and second.records() == []
    assert len(first.add([{"row": "additive", **_made_up(0, hits)}])) == 1
    assert len(second.add([{"row": "concat", **_made_up(0, hits)}])) == 1  # reads the file again first
    assert second.add([{"row": "additive", **_made_up(0, hits * 0)}]) == []  # finished: kept as it was
    again = store.Results(tmp_path)
    assert [(r["row"], r["seed"]) for r in again.records()] == [("additive", 0), ("concat", 0)]
    assert again.get("additive", 0)["tests"]["test7001"]["stats"]["pt_hit"] == [3.0, 1.0]
    assert not list(tmp_path.glob("*.tmp"))
    # A job's records, handed over in its run folder, reach the file once.
    run_dir = tmp_path / "runs" / "dot" / "seed1"
    run_dir.mkdir(parents=True)
    store.write_handoff(run_dir, [{"row": "dot", **_made_up(1, hits)}])
    assert [r["row"] for r in store.collect_handoff(again, run_dir)] == ["dot"]
    assert not store.handoff_path(run_dir).exists() and store.collect_handoff(again, run_dir) == []
    assert store.Results(tmp_path).done("dot", 1)


def test_compact_converts_a_results_tree_and_its_table_is_the_trees(tmp_path, capsys, monkeypatch):
    rows = _rows_file(tmp_path)
    out = tmp_path / "out" / "tiny-3steps"
    rng = np.random.default_rng(2)
    made: dict[str, dict[int, np.ndarray]] = {}
    for row, p in (("additive", 0.6), ("concat", 0.5), ("retired", 0.4)):
        for seed in (0, 1, 2, 10):  # seed10 sorts before seed2 by name
            hits = made.setdefault(row, {})[seed] = rng.binomial(3, p, 40).astype(float)
            _write_tree_result(out, row, seed, hits, "cuda" if seed == 10 else None)
    (out / "timing.json").write_text(json.dumps({"rates": {"additive": {"steps_per_s": 2.5}}}))
    command = ["--rows-file", str(rows), "--recipe", "tiny", "--out", str(tmp_path / "out"), "--resamples", "100"]
    assert cli.main(["compact", *command]) == 0
    said = capsys.readouterr().out
    assert "12 records" in said and "byte for byte" in said and "retired" in said
    results = store.Results(out)
    assert [(r["row"], r["seed"]) for r in results.records()][:4] == [("additive", s) for s in (0, 1, 2, 10)]
    assert (out / "results").is_dir()  # the tree is left for its owner to remove

    # The table the table subcommand writes from the file, against one built from the made-up
    # columns by hand (what the earlier reader gave: the ids and columns of each seed).
    assert cli.main(["table", *command]) == 0
    the_plan = plan.load_plan(rows)
    found = {row: {seed: {"ids": [("test7001", i) for i in range(40)],
                          "stats": _made_up(seed, hits)["tests"]["test7001"]["stats"],
                          "trained_on": "cuda" if seed == 10 else "auto"} for seed, hits in made[row].items()}
             for row in ("additive", "concat")}
    args = cli.parser().parse_args(["table", *command])
    expected, _ = ct.table_of(the_plan, the_plan.rows, found, "tiny", 3, args, {"rates": {"additive":
                                                                                            {"steps_per_s": 2.5}}})
    assert (out / "table.md").read_text() == expected + "\n"
    assert "| 2.50 |" in expected and "cuda 10" in expected

    capsys.readouterr()
    with pytest.raises(SystemExit) as e:  # never over a results file
        cli.main(["compact", *command])
    assert e.value.code == 2 and "is there already" in capsys.readouterr().err

    # A conversion that loses a record is caught, and leaves no results file.
    results.path.unlink()
    add = store.Results.add
    monkeypatch.setattr(store.Results, "add", lambda self, records: add(self, records[1:]))
    assert cli.main(["compact", *command]) == 1
    assert "differs" in capsys.readouterr().err and not results.path.exists()


def test_goal_reads_every_seed_against_the_floors_and_names_the_closest_row(tmp_path, capsys):
    """A mean over seeds may pass where one seed fails: goal says which seed misses what."""
    rows = _rows_file(tmp_path)
    out = tmp_path / "out" / "tiny-3steps"
    n = 50
    for row, seed, hits in (("additive", 0, 3.0), ("additive", 1, 3.0), ("concat", 0, 3.0), ("concat", 1, 2.0)):
        stats = {"pt_hit": [hits] * n, "pt_n": [3.0] * n, "pt_mass": [hits * 0.9] * n, "obj": [float(hits == 3)] * n,
                 "rel_true": [1.0] * n, "rel_named": [1.0] * n}
        store.Results(out).add([{"row": row, "seed": seed, "steps": 3,
                                 "tests": {"test7001": {"image_ids": list(range(n)), "stats": stats}}}])
    base = ["goal", "--rows-file", str(rows), "--recipe", "tiny", "--out", str(tmp_path / "out")]
    assert cli.main(base) == 0
    text = capsys.readouterr().out
    assert "- additive (2 seeds): every seed meets the goal" in text
    assert ("- concat (2 seeds): misses 3 of 8: seed 1: object_accuracy 0.000; seed 1: pointing 0.667; "
            "seed 1: mass_in_box 0.600") in text
    assert "| concat | 1 | **0.000** | **0.667** | **0.600** | 1.000 |" in text
    assert "- pointing: additive, worst seed 1.000" in text
    # A raised floor fails the seeds below it; a figure no record has counts as missed.
    assert cli.main([*base, "--rows", "additive", "--floor", "mass_in_box=0.95", "--floor", "BLEU-4=0.5"]) == 0
    text = capsys.readouterr().out
    assert ("misses 4 of 10: seed 0: mass_in_box 0.900; seed 0: BLEU-4 n/a; seed 1: mass_in_box 0.900; "
            "seed 1: BLEU-4 n/a") in text
    for bad in ("pointing", "speed=1", "pointing=high"):
        with pytest.raises(SystemExit) as e:
            cli.main([*base, "--floor", bad])
        assert e.value.code == 2 and "--floor" in capsys.readouterr().err


@pytest.mark.slow  # a `captioner shapes` process
def test_missing_test_sets_are_made_by_a_captioner_process_and_kept(tmp_path):
    from studies.attention import scoring

    sets = scoring.ensure_test_sets([3], 2, tmp_path)
    folder = sets["test3"]
    assert folder == tmp_path / "shapes-test3-2" and (folder / "instances_test.json").is_file()
    assert len(list((folder / "images" / "test").glob("*.png"))) == 2
    stamp = (folder / "instances_test.json").stat().st_mtime_ns
    assert scoring.ensure_test_sets([3], 2, tmp_path, make=lambda args: pytest.fail(f"made again: {args}")) == sets
    assert (folder / "instances_test.json").stat().st_mtime_ns == stamp
