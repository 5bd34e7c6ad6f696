"""The shape of the code base, for a before/after comparison of a restructuring: Python files
and lines per folder, the longest files and functions, `sys.path` edits, and pairs of places
that share six or more consecutive lines (blank lines and comments ignored).

    python benchmarks/code_shape.py            # captioner/ train/ app/ benchmarks/ studies/ tests/
    python benchmarks/code_shape.py --json     # the same as data
"""

from __future__ import annotations

import argparse
import ast
import json
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("captioner", "train", "app", "benchmarks", "studies", "tests")
WINDOW = 6


def python_files(folders: tuple[str, ...]) -> list[Path]:
    return sorted(p for f in folders for p in (ROOT / f).rglob("*.py") if ".venv" not in p.parts)


def functions(path: Path) -> list[tuple[int, str]]:
    """(lines, qualified name) of every function and method."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((child.end_lineno - child.lineno + 1, f"{prefix}{child.name}"))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
    visit(tree, "")
    return out


def shared_windows(files: list[Path]) -> list[tuple[str, str]]:
    """Pairs of places (file:line) whose next WINDOW code lines are the same, one pair per
    run of overlapping windows."""
    seen: dict[tuple[str, ...], list[tuple[str, int]]] = defaultdict(list)
    for path in files:
        lines = [(i + 1, re.sub(r"\s+", " ", s.strip())) for i, s in enumerate(path.read_text().splitlines())]
        code = [(n, s) for n, s in lines if s and not s.startswith("#")]
        for k in range(len(code) - WINDOW + 1):
            window = tuple(s for _, s in code[k:k + WINDOW])
            if sum(len(s) for s in window) < 120:  # runs of brackets, `return x`: not a shared idea
                continue
            seen[window].append((str(path.relative_to(ROOT)), code[k][0]))
    pairs, last = [], {}
    for places in seen.values():
        for i in range(len(places)):
            for j in range(i + 1, len(places)):
                (fa, la), (fb, lb) = places[i], places[j]
                key = (fa, fb)
                prev = last.get(key)
                if prev and 0 < la - prev[0] <= WINDOW and 0 < lb - prev[1] <= WINDOW:
                    last[key] = (la, lb)
                    continue
                last[key] = (la, lb)
                pairs.append((f"{fa}:{la}", f"{fb}:{lb}"))
    return pairs


def shape(folders: tuple[str, ...]) -> dict:
    files = python_files(folders)
    per_folder = {f: {"files": 0, "lines": 0} for f in folders}
    sizes, funcs, path_edits = [], [], []
    for p in files:
        rel = str(p.relative_to(ROOT))
        text = p.read_text(encoding="utf-8")
        n = len(text.splitlines())
        top = rel.split("/")[0]
        per_folder[top]["files"] += 1
        per_folder[top]["lines"] += n
        sizes.append((n, rel))
        funcs += [(m, f"{rel}:{name}") for m, name in functions(p)]
        path_edits += [f"{rel}:{i + 1}" for i, s in enumerate(text.splitlines())
                       if re.search(r"sys\.path(\.(insert|append|extend)\(|\s*\[[^]]*\]\s*=|\s*\+?=)", s)]
    return {"folders": per_folder, "longest_files": sorted(sizes, reverse=True)[:10],
            "longest_functions": sorted(funcs, reverse=True)[:10], "sys_path_edits": path_edits,
            "shared_six_lines": shared_windows(files)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args(argv)
    s = shape(FOLDERS)
    if args.json:
        print(json.dumps(s, indent=1))
        return
    print("| folder | files | lines |\n|---|---|---|")
    for f, v in s["folders"].items():
        print(f"| {f} | {v['files']} | {v['lines']} |")
    print("\nlongest files:")
    for n, name in s["longest_files"]:
        print(f"  {n:5d}  {name}")
    print("\nlongest functions:")
    for n, name in s["longest_functions"]:
        print(f"  {n:5d}  {name}")
    print(f"\nsys.path edits: {len(s['sys_path_edits'])}")
    for e in s["sys_path_edits"]:
        print(f"  {e}")
    print(f"\npairs of places sharing {WINDOW}+ lines: {len(s['shared_six_lines'])}")
    for a, b in s["shared_six_lines"]:
        print(f"  {a}  ~  {b}")


if __name__ == "__main__":
    main()
