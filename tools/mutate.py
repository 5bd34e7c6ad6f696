"""Mutation testing of one module at a time against its own test files, with cosmic-ray.

    pip install -e ".[mutation]"
    python tools/mutate.py train/startup.py --max-mutants 60 --minutes 30
    python tools/mutate.py --list

Each mutant changes one operator, comparison, constant or condition of the module (the operators
of OPERATORS); the module's own tests (MODULES) then run on it and must fail: the mutant is
killed. A mutant they pass survived: a rule the tests do not hold. The report gives each
module's kill rate and each survivor's line, for docs/testing.md.

The mutants are made in a copy of the repository (the working tree, untouched; tracked and
untracked files), never in place. Its modules are the ones imported: the test command runs
there with the copy first on PYTHONPATH, and ``captioner/train`` and ``captioner/app`` are
links in the copy to ``train/`` and ``app/``, so ``captioner.train.startup`` is the copy's
``train/startup.py`` rather than the editable install's (which maps ``captioner.train`` to the
original tree). The tool checks this before it starts.

The budget (a shared two-core machine): at most ``--max-mutants`` mutants a module, spread
evenly over the file when it has more; no new mutant after ``--minutes``; ``--jobs`` copies
side by side (1 by default). Each session is kept in ``--out`` (a cosmic-ray work database per
module: ``cr-report out/mutation/train-startup.sqlite`` lists every mutant and its output).
"""

from __future__ import annotations

import argparse
import ast
import compileall
import concurrent.futures
import importlib.util
import os
import queue
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# module (a path from the repository's root) -> its own test files. A module's rate counts only
# what these kill: a rule held only by another module's tests is a rule its own tests miss.
MODULES: dict[str, list[str]] = {
    "captioner/batching.py": ["tests/captioner/test_batching.py"],
    "train/startup.py": ["tests/train/test_train_startup.py", "tests/train/test_startup_edges.py"],
    "train/config.py": ["tests/train/test_train_config.py", "tests/train/test_config_edges.py"],
    "captioner/cli/batch.py": ["tests/captioner/test_batch.py", "tests/captioner/test_caption_resume.py",
                           "tests/captioner/test_cli_caption.py"],
    "captioner/data/jpeg_device.py": ["tests/captioner/test_jpeg_device.py"],
    "captioner/model/familiarity.py": ["tests/captioner/test_familiarity.py"],
    "captioner/search/decoding.py": ["tests/captioner/test_decoding.py"],
    "captioner/data/vocab.py": ["tests/captioner/test_vocab.py", "tests/captioner/test_tokenizer.py"],
    "train/own.py": ["tests/train/test_data_import.py"],
    "train/graphed.py": ["tests/train/test_graphed.py"],
    "captioner/search/graph.py": ["tests/captioner/test_search_graph.py"],
}

# The cosmic-ray operators used: one natural replacement for each arithmetic and set operator,
# each comparison moved across its edge or negated, boolean constants and connectives, `not`
# added or removed, numbers moved by one, loops run zero times, break/continue swapped, an
# except clause that catches nothing. Left out: all-pairs operator swaps (many, mostly
# redundant), decorator removal (a dataclass without @dataclass breaks every test at import)
# and variable replacement/insertion (random, not reproducible).
OPERATORS = {
    *(f"core/ReplaceBinaryOperator_{a}_{b}" for a, b in [
        ("Add", "Sub"), ("Sub", "Add"), ("Mul", "Div"), ("Div", "Mul"), ("FloorDiv", "Div"), ("Mod", "FloorDiv"),
        ("Pow", "Mul"), ("BitOr", "BitAnd"), ("BitAnd", "BitOr"), ("BitXor", "BitOr"), ("LShift", "RShift"),
        ("RShift", "LShift")]),
    *(f"core/ReplaceComparisonOperator_{a}_{b}" for a, b in [
        ("Eq", "NotEq"), ("NotEq", "Eq"), ("Lt", "LtE"), ("Lt", "GtE"), ("LtE", "Lt"), ("LtE", "Gt"),
        ("Gt", "GtE"), ("Gt", "LtE"), ("GtE", "Gt"), ("GtE", "Lt"), ("Is", "IsNot"), ("IsNot", "Is")]),
    "core/ReplaceUnaryOperator_Delete_Not", "core/ReplaceUnaryOperator_USub_UAdd", "core/AddNot",
    "core/ReplaceTrueWithFalse", "core/ReplaceFalseWithTrue", "core/ReplaceAndWithOr", "core/ReplaceOrWithAnd",
    "core/ReplaceBreakWithContinue", "core/ReplaceContinueWithBreak", "core/NumberReplacer",
    "core/ZeroIterationForLoop", "core/ExceptionReplacer",
}

# One test process (-n 0, not pyproject's pytest-xdist workers): --jobs runs the copies side by side.
PYTEST = "-m pytest -x -q -n 0 -p no:cacheprovider --no-header -m 'not browser'"


def module_name(path: str) -> str:
    """The installed name of a module path: train/x.py -> captioner.train.x, app/x.py ->
    captioner.app.x (pyproject's package-dir), captioner/a/b.py -> captioner.a.b."""
    parts = list(Path(path).with_suffix("").parts)
    if parts[0] in ("train", "app"):
        parts.insert(0, "captioner")
    return ".".join(parts)


def _files() -> list[str]:
    """The working tree's files: tracked, and untracked ones git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                         capture_output=True).stdout
    return [f for f in out.decode().split("\0") if f and (ROOT / f).is_file()]


def make_copy(where: Path) -> Path:
    """A copy of the working tree in ``where`` whose modules are the ones imported (see above),
    compiled once so that each test run compiles only the mutated module."""
    for f in _files():
        (where / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, where / f)
    link_packages(where)
    compileall.compile_dir(where, quiet=1, workers=1)
    return where


def link_packages(where: Path) -> None:
    """captioner/train -> ../train and captioner/app -> ../app in ``where``: with ``where`` first
    on the path, ``captioner.train.x`` is found there, before the editable install's mapping."""
    for package in ("train", "app"):
        (where / "captioner" / package).symlink_to(Path("..") / package, target_is_directory=True)


def test_env(copy: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(copy), os.environ.get("PYTHONPATH", "")]).rstrip(
        os.pathsep), "PYTHONDONTWRITEBYTECODE": "1"}


def check_imports_from(copy: Path, module: str) -> None:
    """Refuse to start unless the test command would import ``module`` from ``copy``."""
    name = module_name(module)
    found = subprocess.run([sys.executable, "-c", f"import importlib.util as u; print(u.find_spec({name!r}).origin)"],
                           cwd=copy, env=test_env(copy), capture_output=True, text=True)
    origin = Path(found.stdout.strip() or "?").resolve()
    if origin != (copy / module).resolve():
        sys.exit(f"mutate: {name} would be imported from {origin}, not the mutated copy {copy / module}: "
                 f"{found.stderr.strip()[-300:]}")


def test_command(copy: Path, tests: list[str]) -> str:
    """What cosmic-ray runs for each mutant: the module's tests, in ``copy``, stopping at the
    first failure."""
    inner = f"cd {shlex.quote(str(copy))} && exec {shlex.quote(sys.executable)} {PYTEST} " + " ".join(
        shlex.quote(t) for t in tests)
    return "sh -c " + shlex.quote(inner)


@dataclass
class Outcome:
    module: str
    total: int  # mutants of OPERATORS in the module
    run: int = 0
    killed: int = 0
    timeouts: int = 0  # counted as killed: the tests did not pass
    survivors: list[str] = field(default_factory=list)  # "line N: operator: - old / + new"
    not_made: int = 0  # mutants cosmic-ray could not apply or test (its output is in the session)
    baseline_s: float = 0.0

    @property
    def rate(self) -> float:
        return self.killed / self.run if self.run else float("nan")


def _sample(items: list, cap: int, offset: float = 0.0) -> list:
    """At most ``cap`` of ``items``, spread evenly (items sorted by their place in the file),
    each ``offset`` (0 to 1) of the way to the next: 0.5 draws a second sample between the
    first's (the default's) mutants, to check a rate on mutants no test was written for."""
    if cap <= 0 or len(items) <= cap:
        return items
    return [items[int((i + offset) * len(items) / cap)] for i in range(cap)]


def unevaluated_annotations(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """The (start, end) positions (line, column) of the function annotations of a module that
    imports ``annotations`` from __future__: strings never evaluated, so a mutant there cannot
    change what the module does. (Class-level annotations are kept: dataclasses and
    get_type_hints read them.)"""
    tree = ast.parse(source)
    if not any(isinstance(n, ast.ImportFrom) and n.module == "__future__" and any(a.name == "annotations"
               for a in n.names) for n in tree.body):
        return []
    spans = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            notes = [x.annotation for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg)
                     if x is not None and x.annotation is not None] + ([node.returns] if node.returns else [])
            spans += [((n.lineno, n.col_offset), (n.end_lineno, n.end_col_offset)) for n in notes]
    return spans


def _inside(spans, start: tuple[int, int]) -> bool:
    return any(a <= start < b for a, b in spans)


def _changed_lines(diff: str) -> str:
    lines = [x for x in (diff or "").splitlines() if x[:1] in "+-" and x[:3] not in ("+++", "---")]
    return " / ".join(" ".join(x.split()) for x in lines[:2])


def mutate_module(module: str, tests: list[str], args, out_dir: Path, deadline: float) -> Outcome:
    import attrs
    from cosmic_ray.commands import init
    from cosmic_ray.mutating import mutate_and_test
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

    with tempfile.TemporaryDirectory(prefix="mutate-") as tmp:
        copies = [make_copy(Path(tmp) / f"copy{j}") for j in range(args.jobs)]
        original = (copies[0] / module).read_bytes()
        for copy in copies:
            check_imports_from(copy, module)
        for copy in copies:  # the module under mutation is compiled from its source each run
            for pyc in (copy / module).parent.glob(f"__pycache__/{Path(module).stem}.*.pyc"):
                pyc.unlink()

        start = time.monotonic()
        base = subprocess.run(shlex.split(test_command(copies[0], tests)), env=test_env(copies[0]),
                              capture_output=True, text=True)
        baseline_s = time.monotonic() - start
        if base.returncode != 0:
            sys.exit(f"mutate: {module}'s tests fail before any mutation:\n{base.stdout[-2000:]}")
        timeout = max(60.0, 4 * baseline_s)

        db_path = out_dir / (module.removesuffix(".py").replace("/", "-") + ".sqlite")
        db_path.unlink(missing_ok=True)
        with use_db(str(db_path), WorkDB.Mode.create) as db:
            init([copies[0] / module], db, {})
            # cosmic-ray counts lines from 1 and columns from 0, as ast does.
            annotations = unevaluated_annotations((ROOT / module).read_text())
            items = sorted((w for w in db.work_items if w.mutations[0].operator_name in OPERATORS
                            and not _inside(annotations, tuple(w.mutations[0].start_pos))),
                           key=lambda w: (w.mutations[0].start_pos, w.mutations[0].operator_name))
            chosen = _sample(items, args.max_mutants, args.offset)
            chosen_ids = {w.job_id for w in chosen}
            db.set_multiple_results([w.job_id for w in db.work_items if w.job_id not in chosen_ids],
                                    WorkResult(worker_outcome=WorkerOutcome.SKIPPED))
            outcome = Outcome(module, total=len(items), baseline_s=baseline_s)
            print(f"{module}: {len(items)} mutants, {len(chosen)} to run against {' '.join(tests)} "
                  f"(baseline {baseline_s:.0f} s, timeout {timeout:.0f} s each)", file=sys.stderr, flush=True)

            def one(j: int, item):
                if time.monotonic() > deadline:
                    return item, None
                copy = copies[j % len(copies)]
                spec = attrs.evolve(item.mutations[0], module_path=copy / module)
                return item, mutate_and_test([spec], test_command(copy, tests), timeout)

            # Each copy takes every jobs-th mutant, one at a time; results come back as they are
            # made (the work database is written from this thread only).
            results: queue.Queue = queue.Queue()
            lanes = [[(j, w) for j, w in enumerate(chosen) if j % args.jobs == lane] for lane in range(args.jobs)]

            def run_lane(lane):
                done = 0
                try:
                    for j, w in lane:
                        results.put(one(j, w))
                        done += 1
                finally:  # whatever happens, one result for each of the lane's mutants
                    for _, w in lane[done:]:
                        results.put((w, None))

            with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
                futures = [pool.submit(run_lane, lane) for lane in lanes]
                for _ in range(len(chosen)):
                    item, result = results.get()
                    if result is None:  # past the time budget, or its lane failed
                        continue
                    db.set_result(item.job_id, result)
                    if result.worker_outcome != WorkerOutcome.NORMAL:  # not made, or the machinery failed
                        outcome.not_made += 1
                        continue
                    if result.test_outcome == TestOutcome.SURVIVED:
                        line = item.mutations[0].start_pos[0]
                        outcome.survivors.append(f"line {line}: {item.mutations[0].operator_name.removeprefix('core/')}"
                                                 f": {_changed_lines(result.diff)}")
                    else:
                        outcome.killed += 1
                        outcome.timeouts += result.output == "timeout"
                    outcome.run += 1
                    print(f"  [{outcome.run}/{len(chosen)}] line {item.mutations[0].start_pos[0]} "
                          f"{item.mutations[0].operator_name.removeprefix('core/')}: "
                          f"{'survived' if result.test_outcome == TestOutcome.SURVIVED else 'killed'}",
                          file=sys.stderr, flush=True)
                for future in futures:
                    future.result()  # a lane's own error, raised here
        outcome.survivors.sort(key=lambda s: int(s.split()[1].rstrip(":")))
        for copy in copies:  # the copy must still hold the module as it was
            assert (copy / module).read_bytes() == original, f"{copy / module} left mutated"
        return outcome


def report(outcomes: list[Outcome]) -> str:
    lines = ["module | mutants | run | killed | survived | kill rate", "--- | --- | --- | --- | --- | ---"]
    for o in outcomes:
        lines.append(f"{o.module} | {o.total} | {o.run} | {o.killed} | {len(o.survivors)} | {o.rate:.0%}")
    for o in outcomes:
        if o.survivors:
            lines += ["", f"{o.module}: survivors"] + [f"- {s}" for s in o.survivors]
        if o.run < o.total:
            lines.append(f"({o.module}: {o.total - o.run} of {o.total} mutants not run: the cap or the time budget"
                         f"{f'; {o.not_made} could not be made' if o.not_made else ''})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("modules", nargs="*", help="module paths from the repository root (default: all of MODULES)")
    p.add_argument("--max-mutants", type=int, default=60, help="mutants per module at most, spread evenly over "
                   "the file (0: all; default 60)")
    p.add_argument("--offset", type=float, default=0.0, help="where in each stretch of the file its sampled "
                   "mutant stands, 0 to 1 (default 0; 0.5: a second sample, between the first's)")
    p.add_argument("--minutes", type=float, default=60.0, help="no new mutant after this long (default 60)")
    p.add_argument("--jobs", type=int, default=1, help="mutants tested side by side, each in its own copy "
                   "(default 1)")
    p.add_argument("--out", type=Path, default=ROOT / "out" / "mutation", help="where the sessions are kept "
                   "(default out/mutation)")
    p.add_argument("--list", action="store_true", help="print the modules and their test files, and stop")
    args = p.parse_args(argv)
    if not 0 <= args.offset < 1:
        p.error(f"--offset must be from 0 to below 1, got {args.offset}")
    if args.list:
        for module, tests in MODULES.items():
            print(f"{module}: {' '.join(tests)}")
        return 0
    if importlib.util.find_spec("cosmic_ray") is None:
        p.error('cosmic-ray is not installed: pip install -e ".[mutation]"')
    unknown = [m for m in args.modules if m not in MODULES]
    if unknown:
        p.error(f"no tests listed for {', '.join(unknown)} (tools/mutate.py MODULES): {', '.join(MODULES)}")
    if args.jobs < 1:
        p.error("--jobs must be at least 1")
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + 60 * args.minutes
    outcomes = [mutate_module(m, MODULES[m], args, args.out, deadline) for m in args.modules or MODULES]
    print(report(outcomes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
