"""What an exported folder's graphs hold in memory once onnxruntime has loaded them.

    python benchmarks/load_memory.py FOLDER [FOLDER ...]

Each folder's two sessions are made as the runtime makes them (captioner.onnx.runtime.session),
in a fresh process of its own, and the process's resident memory is printed: its peak while the
sessions loaded (VmHWM) and what it holds once they have (VmRSS), in MB, with the graphs' size
on disk (their weights' files included). Linux only (/proc/self/status). A weights-form folder
(--int8 weights) is expanded to fp32 as it loads, so what it holds beyond the fp32 folder's is
what onnxruntime keeps of the stored weights.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def status_mb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) // 1024  # kB
    raise RuntimeError(f"no {key} in /proc/self/status (Linux only)")


def load(folder: Path) -> dict:
    """Load ``folder``'s graphs in this process; its memory figures after."""
    from captioner.io import folder as fmt
    from captioner.onnx.runtime import session

    sessions = [session(folder / g) for g in (fmt.ENCODER_ONNX, fmt.STEP_ONNX)]
    return {"folder": str(folder), "sessions": len(sessions), "peak_mb": status_mb("VmHWM"),
            "held_mb": status_mb("VmRSS"), "graphs_mb": round(fmt.graph_bytes(folder) / 1e6, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--one", type=Path, help=argparse.SUPPRESS)  # the child: load one folder, print JSON
    args = ap.parse_args(argv)
    if args.one is not None:
        print(json.dumps(load(args.one)))
        return 0
    print(f"{'folder':<40} {'graphs MB':>10} {'peak MB':>8} {'held MB':>8}")
    for folder in args.folders:
        out = subprocess.run([sys.executable, __file__, str(folder), "--one", str(folder)], capture_output=True,
                             text=True, check=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(f"{folder.name:<40} {r['graphs_mb']:>10.1f} {r['peak_mb']:>8} {r['held_mb']:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
