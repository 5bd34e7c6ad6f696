"""The attention comparison's command line: `python -m studies.attention SUBCOMMAND`,
run from the repository root. Each subcommand's --help says what it does and its options.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from captioner.cli.common import number

from . import goal, heads, misses, naming, relations, widths
from .plan import DEFAULT_ROWS, PROG, Plan, Row, UsageError, by_training, check_rows, load_plan, recipe_of, select_rows

DESCRIPTION = """\
The attention family on shapes, compared so that the table can rank: every variant trained
for the same number of steps, several seeds, scored on three fresh test sets, with intervals
against a reference variant (a bootstrap over seeds and images, paired over images, and
Welch's interval of the seed means) and an A/A noise floor. See docs/attention-comparison.md.

Rows and recipes are data (studies/attention/rows.toml): a row is `--set` overrides of the
recipe's config (demo-soft's). Each (training, seed) runs to a fixed step count with no
validation on the way; the model scored is the one at that last step (the moving average of
the weights, as the recipe keeps one), the same rule for every variant, unless a row says
otherwise (validate = true: validation every epoch; checkpoint = "best": the one it chose). Each finished
(row, seed) adds a record with its per-image statistics to OUT/<recipe>-<steps>steps/
results.jsonl.gz; a rerun skips what is finished and resumes a stopped training from its
last.pt.

  python -m studies.attention train                  # the full table (long: see the docs)
  python -m studies.attention train --recipe quarter --rows mean,additive,concat,dot,sparsemax
  python -m studies.attention table                  # the table again, from the results alone
  python -m studies.attention goal --rows frozen-soft  # does every seed reach the demo's floors?
  python -m studies.attention table --check-ranking quarter --rows mean,additive,concat,dot,sparsemax
  python -m studies.attention timing                 # training steps/s alone (an idle machine)
  python -m studies.attention score demo-soft        # the scoring alone, on any checkpoint
  python -m studies.attention score CANDIDATE.pt --against demo-soft --test-seeds 9001,9002,9003
  python -m studies.attention score runs/a/best.pt runs/b/best.pt runs/c/best.pt --against demo-soft
  python -m studies.attention score runs/a runs/b runs/c --against demo-soft   # run folders

Trained on a GPU machine, scored on another (one without the evaluation's packages, say):

  python -m studies.attention train --rows heads4 --device cuda --train-only --jobs 12  # there
  python -m studies.attention pack packs --rows heads4                                  # there
  python -m studies.attention unpack packs/runs-*.tar                                   # here
  python -m studies.attention train --rows heads4                                       # here: scores
"""


# ------------------------------------------------------------------------ option groups

def _at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}")
        return value
    return parse


def _level(text: str) -> float:
    value = number(text)
    if not 0.5 <= value < 1:
        raise argparse.ArgumentTypeError("must be at least 0.5 and below 1")
    return value


def _seeds(text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated integers, not {text!r}") from None


def _options(*groups: str) -> argparse.ArgumentParser:
    """A parent parser with the named groups of options, shared by the subcommands."""
    p = argparse.ArgumentParser(add_help=False)
    if "plan" in groups:
        p.add_argument("--rows-file", type=Path, default=DEFAULT_ROWS, help="rows and recipes (TOML)")
        p.add_argument("--rows", default=None, help="comma-separated row names (default: every row of the file)")
        p.add_argument("--recipe", default="full",
                       help="a recipe of the rows file: full (default), half, quarter, tiny")
        p.add_argument("--steps", type=_at_least(1), default=None, help="training steps (default: the recipe's)")
    if "seeds" in groups:
        p.add_argument("--seeds", type=_seeds, default=[0, 1, 2],
                       help="training seeds (optim.seed), comma-separated, at least 3 for a ranking (default 0,1,2)")
    if "out" in groups:
        p.add_argument("--out", type=Path, default=Path("studies/attention/results"),
                       help="results (small, meant to be committed) go under OUT/<recipe>-<steps>steps/")
    if "runs" in groups:
        p.add_argument("--runs", type=Path, default=Path("runs/attention-comparison"),
                       help="training runs (checkpoints, logs) go under RUNS/<recipe>-<steps>steps/")
    if "tests" in groups or "header" in groups:
        p.add_argument("--test-seeds", default="7001,7002,7003",
                       help="seeds of the three fresh test sets (never used to train or choose anything)")
        p.add_argument("--beam-size", type=_at_least(1), default=3, help="beam of the test decoding")
    if "tests" in groups:
        p.add_argument("--test-images", type=_at_least(1), default=1000, help="images in each test set")
        p.add_argument("--test-root", type=Path, default=Path("data"), help="where the test sets are made")
    if "bootstrap" in groups:
        p.add_argument("--resamples", type=_at_least(1), default=2000,
                       help="bootstrap resamples (each draws every variant's seeds and the test images)")
        p.add_argument("--bootstrap-seed", type=_at_least(0), default=0,
                       help="seed of the bootstrap's draws (another one shows how much the interval ends move)")
    if "device" in groups:
        p.add_argument("--device", default=None,
                       help="train on this device (cuda, cuda:1, cpu), in fp32 as on a CPU; default: the recipe's")
    if "timing" in groups:
        p.add_argument("--timing-steps", type=_at_least(1), default=40, help="measured steps per timing run")
        p.add_argument("--timing-rounds", type=_at_least(1), default=3, help="interleaved timing rounds")
    return p


def _test_seeds(args, training: list[int] | None = None) -> list[int]:
    try:
        seeds = _seeds(args.test_seeds)
    except argparse.ArgumentTypeError as e:
        raise UsageError(f"--test-seeds: {e}") from e
    if len(seeds) != 3 or set(seeds) & set(training or ()):
        raise UsageError("--test-seeds: three seeds, none of them a training seed")
    return seeds


def _plan(args) -> tuple[Plan, list[Row], dict, int]:
    plan = load_plan(args.rows_file)
    rows = select_rows(plan, args.rows)
    recipe, steps = recipe_of(plan, args.recipe, args.steps)
    return plan, rows, recipe, steps


def _under(root: Path, args, steps: int) -> Path:
    return root / f"{args.recipe}-{steps}steps"


# ----------------------------------------------------------------------------- commands

def cmd_train(args) -> int:
    from .runner import run_all
    from .scoring import ensure_test_sets
    from .store import Results
    from .timing import time_trainings, timed

    plan, rows, recipe, steps = _plan(args)
    test_seeds = _test_seeds(args, args.seeds)
    check_rows(rows, recipe, steps)
    folder, runs = _under(args.out, args, steps), _under(args.runs, args, steps)
    test_sets = None if args.train_only else ensure_test_sets(test_seeds, args.test_images, args.test_root)
    failures = run_all(rows, args.seeds, args, recipe, steps, test_sets, Results(folder), runs)
    if failures:
        print("failed:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    if args.train_only:
        print(f"trained; score with the same command without --train-only (runs in {runs})", file=sys.stderr)
        return 0
    if not args.skip_timing and any(r.train_key not in timed(folder) for r in rows):
        time_trainings(rows, recipe, folder, args.timing_steps, args.timing_rounds)
    return _write_table(plan, _tabled(plan, rows, Results(folder)), folder, steps, args)


def _tabled(plan: Plan, trained: list[Row], results) -> list[Row]:
    """The rows train's table holds: every row of the file with results, not only those just
    trained, so that training one more row leaves the others in table.md (as `table` writes
    it); in the file's order."""
    recorded = {r["row"] for r in results.records()}
    return [r for r in plan.rows if r in trained or r.name in recorded]


def cmd_run_one(args) -> int:
    """One job of train's pool, in its own process: train, score, hand the records over."""
    from .runner import run_job
    from .scoring import ensure_test_sets

    plan, rows, recipe, steps = _plan(args)
    if {r.train_key for r in rows} != {args.training}:
        raise UsageError(f"run-one: the rows {args.rows} are not all of the training {args.training}")
    test_sets = None if args.train_only else ensure_test_sets(_test_seeds(args), args.test_images, args.test_root)
    return run_job(rows, args.seed, recipe, args.recipe, steps, test_sets, None, _under(args.runs, args, steps),
                   args.beam_size, device=args.device)


def _write_table(plan: Plan, rows: list[Row], folder: Path, steps: int, args, reference: str | None = None) -> int:
    """Write the table (table.md, table.json); against ``reference`` instead of the rows
    file's (a set-up whose reference is not the study's), a table of its own
    (table-vs-REFERENCE.md, .json) beside it."""
    from .table import table_for

    stem = "table"
    if reference:
        if reference not in [r.name for r in rows]:
            raise UsageError(f"--reference {reference} is not among the rows compared (--rows)")
        plan = replace(plan, reference=reference, twins=())
        stem = f"table-vs-{reference}"
    text, summary = table_for(plan, rows, folder, args.recipe, steps, args)
    print(text)
    (folder / f"{stem}.md").write_text(text + "\n")
    (folder / f"{stem}.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0


def cmd_table(args) -> int:
    from .table import check_ranking, table_for

    plan, rows, _, steps = _plan(args)
    _test_seeds(args)
    folder = _under(args.out, args, steps)
    if not args.check_ranking:
        return _write_table(plan, rows, folder, steps, args, args.reference)
    _, short_steps = recipe_of(plan, args.check_ranking, None)
    _, short = table_for(plan, rows, args.out / f"{args.check_ranking}-{short_steps}steps", args.check_ranking,
                         short_steps, args)
    _, full = table_for(plan, rows, folder, args.recipe, steps, args)
    try:
        ranking = check_ranking(short, full)
    except ValueError as e:
        raise UsageError(str(e)) from e
    text = (f"Ranking under `{args.check_ranking}` ({short_steps:,} steps) against `{args.recipe}` "
            f"({steps:,} steps), means over seeds:\n\n" + ranking)
    print(text)
    (folder / f"ranking-vs-{args.check_ranking}.md").write_text(text + "\n")
    return 0


def cmd_goal(args) -> int:
    from .store import Results

    _, rows, _, steps = _plan(args)
    floors = goal.parse_floors(args.floor)
    folder = _under(args.out, args, steps)
    found = Results(folder).found([r.name for r in rows])
    if not found:
        raise UsageError(f"no results for {', '.join(r.name for r in rows)} in {folder}")
    print(goal.markdown(goal.per_seed(found), floors))
    return 0


def cmd_timing(args) -> int:
    from .timing import time_trainings

    _, rows, recipe, steps = _plan(args)
    check_rows(rows, recipe, steps)
    time_trainings(rows, recipe, _under(args.out, args, steps), args.timing_steps, args.timing_rounds,
                   device=args.device)
    return 0


def cmd_score(args) -> int:
    from .scoring import ensure_test_sets, score_only

    test_sets = ensure_test_sets(_test_seeds(args), args.test_images, args.test_root)
    score_only(args.weights, test_sets, args.beam_size, args.against, args.resamples, args.bootstrap_seed,
               args.level)
    return 0


def cmd_pack(args) -> int:
    from .transfer import pack_runs

    _, rows, _, steps = _plan(args)
    files = pack_runs(list(by_training(rows)), args.seeds, _under(args.runs, args, steps), steps, args.dest,
                      int(args.max_mb * 2**20), args.max_files)
    print(f"{len(files)} file(s) written" + "".join(f"\n  {f}" for f in files))
    return 0


def cmd_unpack(args) -> int:
    from .transfer import unpack_runs

    _, _, _, steps = _plan(args)
    runs = _under(args.runs, args, steps)
    found = unpack_runs(args.tars, runs, steps)
    print(f"{len(found)} training(s) unpacked into {runs}: {', '.join(found)}")
    return 0


def cmd_compact(args) -> int:
    """Exit status 1 when the two tables differ (the results file is then removed again)."""
    from .store import Results, found_in, tree_records
    from .table import table_for, table_of

    plan, rows, _, steps = _plan(args)
    _test_seeds(args)
    folder = _under(args.out, args, steps)
    results = Results(folder)
    if results.path.exists():
        raise UsageError(f"{results.path} is there already; move it away to convert the tree again")
    if not (folder / "results").is_dir():
        raise UsageError(f"no results tree in {folder / 'results'}")
    records = tree_records(folder)
    names = [r.name for r in rows]
    timing_path = folder / "timing.json"
    timing = json.loads(timing_path.read_text()) if timing_path.is_file() else None
    tree_text, tree_summary = table_of(plan, rows, found_in(records, names), args.recipe, steps, args, timing)
    results.add(records)
    text, summary = table_for(plan, rows, folder, args.recipe, steps, args)
    if text != tree_text or json.dumps(summary) != json.dumps(tree_summary):
        results.path.unlink()
        print(f"{PROG} compact: the table from {results.path.name} differs from the tree's; nothing kept",
              file=sys.stderr)
        return 1
    others = sorted({r["row"] for r in records} - set(names))
    print(f"{len(records)} records from {folder / 'results'} in {results.path} "
          f"({results.path.stat().st_size / 2**20:.1f} MiB); the table built from it is the tree's, byte for byte"
          + (f"; rows of the tree the rows file lacks (kept in the file, not in the table): {', '.join(others)}"
             if others else "") + f". The tree is no longer read: remove it (git rm -r {folder / 'results'}).")
    return 0


# ------------------------------------------------------------------------------ parser

COMMANDS = ("train", "score", "table", "goal", "timing", "pack", "unpack", "heads", "widths", "misses", "relation",
            "naming", "compact")


def _train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", parents=[_options("plan", "seeds", "out", "runs", "tests", "bootstrap", "device",
                                                  "timing")],
                       help="train and score every missing (row, seed), time the trainings, write the table",
                       description="Train every (row, seed) the results lack, JOBS at a time (one thread each), "
                                   "score each on the three test sets, measure steps/s of the trainings not yet "
                                   "timed, and write the table (table.md, table.json) beside the results: every row "
                                   "of the rows file with results, the ones trained before too. A rerun "
                                   "skips what is finished and resumes a stopped training from its last.pt; Ctrl-C "
                                   "makes every running training save and stop.")
    p.add_argument("--jobs", type=_at_least(0), default=2, help="trainings at once, one thread each (0: in this "
                                                                  "process)")
    p.add_argument("--train-only", action="store_true",
                   help="train and stop: no scoring, no table (score later, here or on another machine, with the "
                        "same command without it)")
    p.add_argument("--skip-timing", action="store_true", help="do not measure steps/s after the trainings")
    p.set_defaults(func=cmd_train)


def _score_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("score", parents=[_options("tests", "bootstrap")],
                       help="the comparison's scoring of checkpoints, and their difference from another",
                       description="Score checkpoints (files, or demo-soft / demo-hard) on the three test sets and "
                                   "print their figures: the comparison's scoring, on models trained elsewhere. "
                                   "Several checkpoints are the seeds of one recipe. With --against, score that one "
                                   "too and print the seeds pooled minus it, with a bootstrap interval paired over "
                                   "the test images and, for several seeds, drawn over the seeds too.")
    p.add_argument("weights", metavar="WEIGHTS", nargs="+",
                   help="checkpoint files, run folders (their last.pt's weight average, as the table scores "
                        "them) or bundled models' names (several: the seeds of one recipe)")
    p.add_argument("--against", metavar="REFERENCE", default=None,
                   help="score this checkpoint too, and print WEIGHTS' minus its figures (e.g. a candidate demo "
                        "against the shipped one)")
    p.add_argument("--level", type=_level, default=0.95,
                   help="confidence level of the --against interval (default 0.95); e.g. 0.975 for each of two "
                        "confirmations on fresh data, so that together they keep a 5%% error rate")
    p.set_defaults(func=cmd_score)


def _table_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("table", parents=[_options("plan", "out", "header", "bootstrap")],
                       help="the table again, from the results alone (no training, no decoding)",
                       description="Build the table of --recipe from its results file (and timing.json): "
                                   "print it and write table.md and table.json beside the results. With "
                                   "--check-ranking, compare a shorter recipe's ranking with this one's instead.")
    p.add_argument("--check-ranking", metavar="SHORT_RECIPE", default=None,
                   help="compare SHORT_RECIPE's ranking with --recipe's on the variants both have results for "
                        "(Spearman, Kendall tau-b, the same top variant); writes ranking-vs-SHORT_RECIPE.md")
    p.add_argument("--reference", metavar="ROW", default=None,
                   help="compare the rows with ROW instead of the rows file's reference (no A/A floor unless ROW "
                        "is the first of its pair); writes table-vs-ROW.md and .json, leaving table.md as it is")
    p.set_defaults(func=cmd_table)


def _goal_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("goal", parents=[_options("plan", "out")],
                       help="each seed of the rows against floors on every figure",
                       description=goal.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--floor", action="append", metavar="FIGURE=VALUE",
                   help=f"a floor to reach (repeatable): one of {', '.join(goal.FIGURES)}; default "
                        + ", ".join(f"{k}={v:g}" for k, v in goal.DEFAULT_FLOORS.items()))
    p.set_defaults(func=cmd_goal)


def _timing_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("timing", parents=[_options("plan", "out", "device", "timing")],
                       help="training steps/s alone, one thread (on an idle machine)",
                       description="Measure training steps/s of each training of the rows, one thread, in "
                                   "interleaved rounds (the median of the rounds), into timing.json beside the "
                                   "results; trainings timed before keep their figures.")
    p.set_defaults(func=cmd_timing)


def _pack_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pack", parents=[_options("plan", "seeds", "runs")],
                       help="finished trainings as slim checkpoints in tar files, to score on another machine",
                       description="Pack the finished trainings of --rows and --seeds not packed before, as slim "
                                   "checkpoints (the weights scored, the step, the config and the log; no optimizer "
                                   "state; best.pt too where the training validated) in DIR/runs-NNN.tar files.")
    p.add_argument("dest", metavar="DIR", type=Path, help="where the tar files go")
    p.add_argument("--max-mb", type=float, default=15.0, help="the largest tar file written, in MiB")
    p.add_argument("--max-files", type=_at_least(0), default=0,
                   help="at most this many tar files (0: no limit); a later pack takes the rest")
    p.set_defaults(func=cmd_pack)


def _unpack_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("unpack", parents=[_options("plan", "runs")],
                       help="packed trainings into this machine's runs folder",
                       description="Put packed trainings into the runs folder of --recipe, refusing anything "
                                   "else in the files and never writing over a run there; train (the same rows "
                                   "and seeds) then scores them.")
    p.add_argument("tars", metavar="TAR", type=Path, nargs="+", help="tar files written by pack")
    p.set_defaults(func=cmd_unpack)


def _compact_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compact", parents=[_options("plan", "out", "header", "bootstrap")],
                       help="convert a results tree (results/<row>/seed<S>.json ...) into the results file",
                       description="Convert the results tree of --recipe (OUT/<recipe>-<steps>steps/results/<row>/"
                                   "seed<S>.json and seed<S>.images.json.gz, as earlier versions wrote them) into "
                                   "results.jsonl.gz beside it, then check that the table built from the new file "
                                   "is the table built from the tree, byte for byte (with the options given here). "
                                   "The tree is left in place, to be removed once checked. Exit status: 0 the same "
                                   "table; 1 they differ (the new file is removed); 2 a mistake in the command.")
    p.set_defaults(func=cmd_compact)


def _run_one_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run-one", parents=[_options("plan", "runs", "tests", "device")])  # train's jobs
    p.add_argument("--training", required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--train-only", action="store_true")
    p.set_defaults(func=cmd_run_one)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", metavar="SUBCOMMAND", required=True)
    for add in (_train_parser, _score_parser, _table_parser, _goal_parser, _timing_parser, _pack_parser,
                _unpack_parser, heads.register, widths.register, misses.register, relations.register, naming.register,
                _compact_parser, _run_one_parser):
        add(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        raise UsageError(f"a subcommand is needed: {', '.join(COMMANDS)} (--help says more)")
    if not argv[0].startswith("-") and argv[0] not in (*COMMANDS, "run-one"):
        raise UsageError(f"unknown subcommand {argv[0]!r}; subcommands: {', '.join(COMMANDS)}")
    args = parser().parse_args(argv)
    return args.func(args)
