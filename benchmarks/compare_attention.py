"""The attention family on shapes: the same training budget for each variant, then one
evaluation on an unseen test set, a table, and a figure of one image's per-word maps.

    python benchmarks/compare_attention.py --minutes 5 --parallel 2 \\
        --test-data data/shapes-test --out runs/family

Each variant is `captioner train --config train/configs/shapes-soft.toml` with one
attention option changed and the same time budget (one CPU thread each); the table
reports BLEU-4, CIDEr, object accuracy, the pointing game, the mean attention entropy,
the share of exact zeros in the maps, and the training time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from PIL import Image, ImageDraw

from captioner.checkpoint import load_checkpoint
from captioner.data.coco import load_split
from captioner.evaluation import evaluate
from captioner.images import load_image
from captioner.inference import Captioner, DecodeOptions
from captioner.overlay import _font, attention_figure

VARIANTS = {
    "additive": [],
    "concat": ["model.score=concat"],
    "dot": ["model.score=dot"],
    "scaled_dot": ["model.score=scaled_dot"],
    "general": ["model.score=general"],
    "cosine": ["model.score=cosine"],
    "sparsemax": ["model.normalizer=sparsemax"],
    "local (w=2)": ["model.local_window=2.0"],
}


def run_dir_name(name: str) -> str:
    return name.replace(" ", "").replace("(", "-").replace(")", "").replace("=", "")


def train_all(out: Path, minutes: float, parallel: int, config: str) -> None:
    queue = list(VARIANTS.items())
    running: list[tuple[str, subprocess.Popen]] = []
    while queue or running:
        while queue and len(running) < parallel:
            name, sets = queue.pop(0)
            run = out / run_dir_name(name)
            if (run / "last.pt").exists():
                print(f"{name}: already trained", file=sys.stderr)
                continue
            args = [sys.executable, "-m", "captioner.cli", "train", "--config", config, "--run-dir", str(run),
                    "--quiet", "--set", f"optim.max_minutes={minutes}", "--set", "optim.threads=1",
                    "--set", "optim.epochs=1000", "--set", "val.patience=0"]
            for s in sets:
                args += ["--set", s]
            print(f"{name}: training", file=sys.stderr)
            running.append((name, subprocess.Popen(args, stderr=subprocess.DEVNULL)))
        time.sleep(2)
        for item in list(running):
            if item[1].poll() is not None:
                if item[1].returncode != 0:
                    raise SystemExit(f"{item[0]}: training failed with code {item[1].returncode}")
                running.remove(item)


def evaluate_all(out: Path, test_data: Path, limit: int | None) -> list[dict]:
    rows = []
    for name in VARIANTS:
        run = out / run_dir_name(name)
        cap = Captioner.load(run / "best.pt")
        report = evaluate(cap, test_data, "test", options=DecodeOptions(beam_size=3, max_len=20), limit=limit,
                          meteor=False, progress=False)
        g = report.grounding or {}
        rows.append({
            "variant": name, "BLEU-4": report.metrics["BLEU-4"], "CIDEr": report.metrics["CIDEr"],
            "object_accuracy": g.get("object_accuracy"), "pointing": g.get("pointing_accuracy"),
            "pointing_chance": g.get("pointing_chance"), "alpha_mass_in_box": g.get("alpha_mass_in_box"),
            "entropy": report.attention["entropy"], "uniform_entropy": report.attention["uniform_entropy"],
            "zero_share": report.attention["zero_share"],
            "train_minutes": load_checkpoint(run / "last.pt")["train_state"]["train_seconds"] / 60,
            "steps": load_checkpoint(run / "last.pt")["train_state"]["step"],
        })
    return rows


def figure(out: Path, test_data: Path, image_index: int, path: Path) -> None:
    record = load_split(test_data, "test")[image_index]
    image = load_image(record.path)
    panels = []
    for name in VARIANTS:
        cap = Captioner.load(out / run_dir_name(name) / "best.pt")
        fig = attention_figure(image, cap.caption(image, DecodeOptions(beam_size=3, max_len=20)), panel=112,
                               columns=12)
        panels.append((name, fig))
    label_w = 130
    width = label_w + max(f.width for _, f in panels)
    sheet = Image.new("RGB", (width, sum(f.height for _, f in panels)), "white")
    draw = ImageDraw.Draw(sheet)
    y = 0
    for name, fig in panels:
        sheet.paste(fig, (label_w, y))
        draw.text((6, y + fig.height // 2 - 8), name, fill="black", font=_font(16))
        y += fig.height
    path.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(path)


def markdown(rows: list[dict]) -> str:
    def f(v, d=3):
        return "n/a" if v is None else f"{v:.{d}f}"

    lines = ["| variant | BLEU-4 | CIDEr | object acc. | pointing (chance) | mass in box | entropy (uniform) "
             "| exact zeros | train min (steps) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {f(r['BLEU-4'])} | {f(r['CIDEr'])} | {f(r['object_accuracy'])} | "
                     f"{f(r['pointing'])} ({f(r['pointing_chance'])}) | {f(r['alpha_mass_in_box'])} | "
                     f"{f(r['entropy'], 2)} ({f(r['uniform_entropy'], 2)}) | {f(r['zero_share'])} | "
                     f"{r['train_minutes']:.1f} ({r['steps']}) |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=5.0, help="training budget per variant")
    ap.add_argument("--parallel", type=int, default=2, help="variants trained at once (one thread each)")
    ap.add_argument("--config", default="train/configs/shapes-soft.toml")
    ap.add_argument("--test-data", type=Path, required=True, help="a shapes folder with a test split")
    ap.add_argument("--limit", type=int, default=None, help="evaluate only the first N test images")
    ap.add_argument("--out", type=Path, default=Path("runs/family"))
    ap.add_argument("--figure", type=Path, default=Path("docs/attention-variants.png"))
    ap.add_argument("--figure-image", type=int, default=3, help="index of the test image in the figure")
    args = ap.parse_args()
    train_all(args.out, args.minutes, args.parallel, args.config)
    rows = evaluate_all(args.out, args.test_data, args.limit)
    (args.out / "comparison.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(markdown(rows))
    figure(args.out, args.test_data, args.figure_image, args.figure)
    print(f"figure: {args.figure}", file=sys.stderr)


if __name__ == "__main__":
    main()
