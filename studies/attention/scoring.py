"""The comparison's scoring: three fresh shapes test sets, and per test image what the
figures are built from (stats.py): whether the caption names its objects and states its
relations right, CIDEr-D and BLEU counts, and the pointing game and entropy of the maps of
each image's first reference caption fed to the model (teacher forcing,
forced.py), the same words for every model.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from . import stats as cs
from .plan import UsageError, child_env

MAX_LEN = 20  # the longest caption the comparison decodes, in words

FIGURE_NAMES = ["object_accuracy", "relation_accuracy", "pointing", "pointing_generated", "pointing_chance",
                "mass_in_box", "entropy", "BLEU-4", "CIDEr"]


def ensure_test_sets(seeds: list[int], n_images: int, root: Path,
                     make: Callable[[list[str]], object] | None = None) -> dict[str, Path]:
    """Three fresh test sets, each `captioner shapes --train 0 --val 0 --test N --seed S`, made
    where missing: by a `captioner` process, or by ``make(arguments)`` (the tests call the
    command line in their own process)."""
    sets = {}
    for seed in seeds:
        folder = root / f"shapes-test{seed}-{n_images}"
        if not (folder / "instances_test.json").is_file():
            args = ["shapes", "--out", str(folder), "--train", "0", "--val", "0", "--test", str(n_images),
                    "--seed", str(seed)]
            if make is None:
                subprocess.run([sys.executable, "-m", "captioner.cli", *args], check=True, env=child_env())
            else:
                make(args)
        sets[f"test{seed}"] = folder
    return sets


def test_set_arguments(p) -> None:
    """The arguments of a subcommand that reads checkpoints' maps on one shapes test set."""
    p.add_argument("weights", nargs="+", help="checkpoint files or run folders")
    p.add_argument("--data", type=Path, required=True, help="a shapes test set (captioner shapes ... --test N)")
    p.add_argument("--images", type=int, default=1000, help="its first N test images")


def decoded_sets_arguments(p) -> None:
    """The arguments of a subcommand that decodes checkpoints on shapes test sets, as the
    comparison decodes (beam 3), and counts over every set given."""
    p.add_argument("weights", nargs="+", help="checkpoint files, run folders or bundled models' names")
    p.add_argument("--data", type=Path, action="append", required=True,
                   help="a shapes test set (captioner shapes ... --test N); repeat it to count over several")
    p.add_argument("--images", type=int, default=1000, help="the first N test images of each")
    p.add_argument("--beam-size", type=int, default=3, help="beam of the decoding (the comparison's: 3)")


def decoded_test_images(cap, folder: Path, images: int, beam_size: int) -> list[tuple[list[str], list]]:
    """(caption words, objects) of each of the first ``images`` test images of ``folder``,
    the caption decoded as the comparison decodes."""
    import torch

    from captioner.data.coco import load_split
    from captioner.evaluation.evaluate import decode_records
    from captioner.evaluation.grounding import load_shape_objects
    from captioner.inference import DecodeOptions

    records = load_split(folder, "test")[:images]
    objects = load_shape_objects(folder / "instances_test.json")
    with torch.inference_mode():
        results = decode_records(cap, records, DecodeOptions(beam_size=beam_size, max_len=MAX_LEN))
    return [(res.words, objects[rec.image_id].objects) for rec, res in zip(records, results)]


def check_test_set(folder: Path, images: int) -> None:
    """Refuse, in one line, a folder that is not a shapes test set or a count below 1."""
    if not (folder / "instances_test.json").is_file():
        raise UsageError(f"{folder} has no instances_test.json: make one with captioner shapes --train 0 "
                         "--val 0 --test N")
    if images < 1:
        raise UsageError("--images must be >= 1")


def image_stats(records, results, forced, objects: dict, with_pointing: bool) -> dict[str, list]:
    """Per-image columns (see stats.py) for one test set."""
    from pycocoevalcap.cider.cider import Cider

    from captioner.evaluation.grounding import object_accuracy, pointing_game, relation_accuracy
    from captioner.evaluation.metrics import _prepare

    cols: dict[str, list] = {k: [] for k in ("obj", "rel_true", "rel_named", "rel_n", "ent_sum", "ent_n")}
    if with_pointing:
        cols.update({k: [] for k in ("pt_hit", "pt_n", "pt_mass", "pt_chance", "gen_hit", "gen_n")})
    for rec, res, (words, maps) in zip(records, results, forced):
        img = objects[rec.image_id]
        cols["obj"].append(float(object_accuracy(res.words, img.objects).exact_color_shape))
        rel = relation_accuracy(res.words, img.objects)
        cols["rel_true"].append(rel.relations_true)
        cols["rel_named"].append(rel.n_relations_named)
        cols["rel_n"].append(rel.n_relations)
        cols["ent_sum"].append(float(-(maps * np.log(np.clip(maps, 1e-30, None))).sum()))
        cols["ent_n"].append(len(words))
        if with_pointing:
            fixed = pointing_game(words, maps, img.objects, img.size)
            cols["pt_hit"].append(sum(p.hit for p in fixed))
            cols["pt_n"].append(len(fixed))
            cols["pt_mass"].append(sum(p.mass for p in fixed))
            cols["pt_chance"].append(sum(p.chance for p in fixed))
            own = pointing_game(res.words, res.alphas, img.objects, img.size)
            cols["gen_hit"].append(sum(p.hit for p in own))
            cols["gen_n"].append(len(own))
    gts, res_tok = _prepare({r.image_id: r.captions for r in records},
                            {r.image_id: res.caption for r, res in zip(records, results)})
    ids = [r.image_id for r in records]
    cols["bleu"] = cs.bleu_stats(gts, res_tok, ids).tolist()
    order = list(gts)
    _, per_image = Cider().compute_score(gts, res_tok)
    cider = dict(zip(order, (float(s) for s in per_image)))
    cols["cider"] = [cider[i] for i in ids]
    return cols


def evaluate_checkpoint(cap, decode: dict, test_sets: dict[str, Path], beam_size: int,
                        progress: bool = False) -> dict:
    """Per-image columns and figures of a Captioner on each test set."""
    import torch

    from captioner.data.coco import load_split
    from captioner.evaluation.evaluate import decode_records
    from captioner.evaluation.grounding import load_shape_objects
    from captioner.inference import DecodeOptions

    from .forced import forced_maps

    options = DecodeOptions(beam_size=beam_size, max_len=MAX_LEN, **decode)
    with_pointing = cap.model.decoder.attention.phi.attends  # a uniform map points nowhere
    out = {}
    for name, folder in test_sets.items():
        records = load_split(folder, "test")
        with torch.inference_mode():
            results = decode_records(cap, records, options, progress=progress)
            forced = forced_maps(cap, records)
        cols = image_stats(records, results, forced, load_shape_objects(folder / "instances_test.json"),
                           with_pointing)
        out[name] = {"image_ids": [r.image_id for r in records], "stats": cols,
                     "figures": cs.figures({k: np.asarray(v) for k, v in cols.items()}),
                     "examples": {r.image_id: res.caption for r, res in list(zip(records, results))[:5]}}
    return out


def difference(variant: list[dict], reference: dict, resamples: int = 2000, seed: int = 0,
               level: float = 0.95) -> dict:
    """Per figure, the variant's seeds pooled minus the reference, with a bootstrap
    interval at ``level`` (95% by default): paired over the test images (both sides see the same draws) and, with more
    than one seed, over the variant's seeds too (each resample draws them with
    replacement), so that the interval says what another training of the recipe would
    give, not only these runs. The reference is one fixed model: no seed part."""
    n = len(next(iter(reference.values())))
    seeds = cs.seed_weights(len(variant), resamples, seed, "variant") if len(variant) > 1 else None
    return cs.paired_difference(variant, reference, cs.bootstrap_weights(n, resamples, seed), variant_seeds=seeds,
                                level=level)


def _print_figures(title: str, rows: dict[str, dict]) -> None:
    print(f"\n{title}:\n")
    print("| | " + " | ".join(FIGURE_NAMES) + " | words scored (reference / own) |")
    print("|---" * (len(FIGURE_NAMES) + 2) + "|")
    for name, stats in rows.items():
        f = cs.figures(stats)
        cells = ["n/a" if f.get(n) is None else f"{f[n]:.3f}" for n in FIGURE_NAMES]
        words = f"{int(sum(stats.get('pt_n', []))):,} / {int(sum(stats.get('gen_n', []))):,}"
        print(f"| {name} | " + " | ".join(cells) + f" | {words} |")


def score_only(weights: list[str], test_sets: dict[str, Path], beam_size: int, against: str | None = None,
               resamples: int = 2000, seed: int = 0, level: float = 0.95) -> dict:
    """The comparison's figures of each checkpoint on each test set and on all together,
    printed. Several checkpoints are the seeds of one recipe; with ``against``, that
    checkpoint is scored too and ``difference`` (the seeds pooled minus it, all test sets
    together) is printed, its interval at ``level``. Returns the differences (empty without
    ``against``)."""
    from captioner.io.checkpoint import CheckpointError

    from .checkpoints import load_weights

    scored = {}
    for w in list(weights) + ([against] if against else []):
        try:
            cap = load_weights(w)  # a run folder: its last.pt's weight average, as the table scores it
        except CheckpointError as e:
            raise UsageError(str(e)) from e
        tests = evaluate_checkpoint(cap, {}, test_sets, beam_size, progress=True)
        scored[w] = cs.concat([tests[n]["stats"] for n in sorted(tests)])
        _print_figures(w, {**{n: t["stats"] for n, t in tests.items()}, "all": scored[w]})
    if len(weights) > 1:
        _print_figures("all test sets, each checkpoint", {w: scored[w] for w in weights})
    if not against:
        return {}
    diff = difference([scored[w] for w in weights], scored[against], resamples, seed, level)
    n = len(next(iter(scored[against].values())))
    over = "the seeds and the images" if len(weights) > 1 else "the images"
    label = weights[0] if len(weights) == 1 else f"{len(weights)} seeds pooled"
    print(f"\n{label} - {against}, {n:,} images, {100 * level:g}% interval over {over} ({resamples:,} resamples):\n")
    print("| figure | difference | interval |\n|---|---|---|")
    for name in FIGURE_NAMES:
        d = diff.get(name)
        cells = "n/a | n/a" if d is None else f"{d['diff']:+.3f} | [{d['lo']:+.3f}, {d['hi']:+.3f}]"
        print(f"| {name} | {cells} |")
    return diff
