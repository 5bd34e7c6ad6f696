"""The comparison's results: one record per finished (row, seed), all of a table's records
in one compressed file, OUT/<recipe>-<steps>steps/results.jsonl.gz (one JSON line each).

A record holds the row, seed, recipe, steps, overrides, decoding, checkpoint rule, training
seconds, the device that trained it (``trained_on``), the validation at the end, and per
test set its figures, a few example captions, its image ids and the per-image columns the
table is built from (stats.py).

Only the process that plans the trainings writes the file: a job of the pool hands its
records over in a file of its run folder (write_handoff), which that process then adds.
Every write replaces the file whole (a new gzip member after the old ones, written beside
it and renamed over it) under a lock on its folder, so that two commands run side by side
on the same table add their records without losing either's. A rerun trusts what it finds.

Before this file, each record was two files, results/<row>/seed<S>.json and
seed<S>.images.json.gz: compact_tree converts such a tree.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
from collections.abc import Iterator
from pathlib import Path

from . import stats as cs

RESULTS = "results.jsonl.gz"
HANDOFF = "scored.jsonl.gz"  # a job's records, in its run folder, until they are added


def atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)  # whole or absent: a rerun trusts what it finds


def compact_columns(cols: dict[str, list]) -> dict[str, list]:
    """Counts as ints, other figures to 6 decimals."""
    def one(v):
        return int(v) if float(v).is_integer() else round(float(v), 6)
    return {k: [[one(x) for x in v] if isinstance(v, list) else one(v) for v in vals] for k, vals in cols.items()}


def _lines(records: list[dict]) -> bytes:
    return gzip.compress("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records).encode(), mtime=0)


def _read(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in gzip.decompress(path.read_bytes()).splitlines() if line.strip()]


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """The folder locked against another writer (where the platform has flock)."""
    try:
        import fcntl
    except ImportError:  # no flock: one writer at a time is then the user's to keep
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def entry(record: dict) -> dict:
    """What the table reads of a record: the image ids of every test set joined (test sets
    in name order), the per-image columns joined the same way, and the device that trained
    it (optim.device; records from before it was kept: "auto")."""
    tests = record["tests"]
    names = sorted(tests)
    return {"ids": [(n, i) for n in names for i in tests[n]["image_ids"]],
            "stats": cs.concat([tests[n]["stats"] for n in names]),
            "trained_on": record.get("trained_on", "auto")}


class Results:
    """The records of one table, in ``folder``/results.jsonl.gz."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.path = self.folder / RESULTS
        self._records: list[dict] | None = None

    def records(self) -> list[dict]:
        if self._records is None:
            self._records = _read(self.path)
        return self._records

    def get(self, row: str, seed: int) -> dict | None:
        return next((r for r in self.records() if r["row"] == row and r["seed"] == seed), None)

    def done(self, row: str, seed: int) -> bool:
        return self.get(row, seed) is not None

    def add(self, records: list[dict]) -> list[dict]:
        """Add the records whose (row, seed) the file lacks; returns those added."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with _locked(self.folder):
            self._records = None  # another command may have added some since this one read
            have = {(r["row"], r["seed"]) for r in self.records()}
            new = [r for r in records if (r["row"], r["seed"]) not in have]
            if new:
                old = self.path.read_bytes() if self.path.is_file() else b""
                atomic_write(self.path, old + _lines(new))  # gzip members in a row read as one
                self._records = self.records() + new
        return new

    def found(self, rows: list[str]) -> dict[str, dict[int, dict]]:
        return found_in(self.records(), rows)


def found_in(records: list[dict], rows: list[str]) -> dict[str, dict[int, dict]]:
    """row -> seed -> entry, for the rows of ``rows`` that have records, in that order."""
    out: dict[str, dict[int, dict]] = {}
    for row in rows:
        for rec in sorted((r for r in records if r["row"] == row), key=lambda r: r["seed"]):
            out.setdefault(row, {}).setdefault(rec["seed"], entry(rec))
    return out


# ------------------------------------------------------------------- a job's records

def handoff_path(run_dir: Path) -> Path:
    return run_dir / HANDOFF


def write_handoff(run_dir: Path, records: list[dict]) -> None:
    atomic_write(handoff_path(run_dir), _lines(records))


def collect_handoff(results: Results, run_dir: Path) -> list[dict]:
    """Add a job's handed-over records to ``results`` and remove the hand-over file;
    returns the records added (none when there is no such file)."""
    path = handoff_path(run_dir)
    if not path.is_file():
        return []
    added = results.add(_read(path))
    path.unlink()
    return added


# ------------------------------------------------------------------ the earlier tree

def tree_records(folder: Path) -> list[dict]:
    """The records of a tree folder/results/<row>/seed<S>.json + seed<S>.images.json.gz, in
    (row, seed) order: each summary with its per-image columns put back into its tests."""
    records = []
    for row_dir in sorted(p for p in (folder / "results").iterdir() if p.is_dir()):
        paths = sorted(row_dir.glob("seed*[0-9].json"), key=lambda p: int(p.stem.removeprefix("seed")))
        for path in paths:
            rec = json.loads(path.read_text())
            columns = json.loads(gzip.decompress(path.with_name(path.stem + ".images.json.gz").read_bytes()))
            rec.setdefault("row", row_dir.name)
            rec["tests"] = {name: {**rec.get("tests", {}).get(name, {}), **columns[name]} for name in sorted(columns)}
            records.append(rec)
    return records
