"""The library's import graph at a git revision: its files, the imports between them (arrows),
its floors (a file stands one floor above the highest file it imports; floor 1 imports none),
the arrows inside circles (files that import each other in a loop, the only arrows that can run
back up), and the same per folder of captioner/. For docs/architecture.md's before and after.

    python tools/import_graph.py [REVISION ...]     # default HEAD

Every import counts, at the top of a file or inside a function; ``from captioner.x import y``
is an arrow to x's file, or to y's where y is a module of the package x.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict

PACKAGE = "captioner"


def sources(rev: str) -> dict[str, str]:
    """Module name -> source of every Python file of the package at ``rev``."""
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, PACKAGE + "/"], capture_output=True,
                           text=True, check=True).stdout.split()
    out = {}
    for name in names:
        if name.endswith(".py"):
            module = name[:-3].replace("/", ".").removesuffix(".__init__")
            out[module] = subprocess.run(["git", "show", f"{rev}:{name}"], capture_output=True, text=True,
                                         check=True).stdout
    return out


def arrows(files: dict[str, str]) -> set[tuple[str, str]]:
    """(importer, imported) module pairs inside the package."""
    packages = {m for m in files if any(other.startswith(m + ".") for other in files)} | {PACKAGE}
    found = set()
    for module, text in files.items():
        here = module if module in packages else module.rsplit(".", 1)[0]  # the package relative imports start at
        for node in ast.walk(ast.parse(text)):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = here.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for target in targets:
                while target and target not in files:  # import captioner.x.y as z: the file y
                    target = target.rsplit(".", 1)[0] if "." in target else ""
                if target and target != module:
                    found.add((module, target))
    return found


def circles(nodes: set[str], edges: set[tuple[str, str]]) -> list[set[str]]:
    """Strongly connected components of more than one file (Tarjan)."""
    out, index, low, stack, on = [], {}, {}, [], set()
    succ = defaultdict(list)
    for a, b in edges:
        succ[a].append(b)

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in succ[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def floors(nodes: set[str], edges: set[tuple[str, str]], loops: list[set[str]]) -> dict[str, int]:
    """Each file's floor, a circle's files counted as one room."""
    room = {v: v for v in nodes}
    for i, comp in enumerate(loops):
        for v in comp:
            room[v] = f"circle {i}"
    succ = defaultdict(set)
    for a, b in edges:
        if room[a] != room[b]:
            succ[room[a]].add(room[b])
    memo: dict[str, int] = {}

    def floor(r: str) -> int:
        if r not in memo:
            memo[r] = 1 + max((floor(s) for s in succ[r]), default=0)
        return memo[r]

    return {v: floor(room[v]) for v in nodes}


def figures(files: dict[str, str], edges: set[tuple[str, str]]) -> dict:
    nodes = set(files)
    loops = circles(nodes, edges)
    inside = sum(1 for a, b in edges if any(a in c and b in c for c in loops))
    level = floors(nodes, edges, loops)
    return {"files": len(nodes), "floors": max(level.values()), "arrows": len(edges), "arrows back up": inside,
            "circles": len(loops)}


def folder_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else module


def report(rev: str) -> None:
    files = sources(rev)
    edges = arrows(files)
    print(f"{rev}: files (modules) {figures(files, edges)}")
    rooms = {folder_of(m): "" for m in files}
    room_edges = {(folder_of(a), folder_of(b)) for a, b in edges if folder_of(a) != folder_of(b)}
    print(f"{rev}: rooms (captioner's folders, and its top-level files) {figures(rooms, room_edges)}")


if __name__ == "__main__":
    for rev in sys.argv[1:] or ["HEAD"]:
        report(rev)
