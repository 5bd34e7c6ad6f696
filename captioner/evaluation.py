"""Evaluate a captioner on a split by real decoding (no teacher forcing).

Caption metrics for any COCO-format data; on shapes data (an ``instances_<split>.json``
beside the captions) also object accuracy and the attention pointing game.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

from .data.coco import ImageDataset, ImageRecord, load_split, require_images
from .decoding import CaptionResult
from .grounding import GroundingSummary, evaluate_caption, load_shape_objects, summarize_grounding
from .images import Preprocess
from .inference import Captioner, DecodeOptions
from .metrics import caption_metrics, meteor_wanted
from .vocab import PTB, TOKENIZERS, Tokenizer


@dataclass
class EvalReport:
    split: str
    n_images: int
    beam_size: int
    seconds: float
    metrics: dict[str, float]
    grounding: GroundingSummary | None = None  # shapes data only
    attention: dict | None = None  # how peaked the maps are: mean entropy, share of exact zeros
    familiarity: dict | None = None  # images, mean familiarity, how many unfamiliar; None: unknown
    captions: dict[int, str] = field(default_factory=dict)  # image id -> generated caption
    tokenizer: str = "ptb"  # the tokens the metrics count: the model's (characters for "chars2")

    def summary(self) -> dict:
        d = asdict(self)
        d.pop("captions")
        return d


def decode_records(captioner: Captioner, records: list[ImageRecord], options: DecodeOptions,
                   batch_size: int = 32, workers: int = 0, progress: bool = True,
                   cache_images: bool = False) -> list[CaptionResult]:
    """CaptionResults in the order of ``records``."""
    loader = DataLoader(ImageDataset(records, captioner.preprocess, cache_images=cache_images),
                        batch_size=batch_size, num_workers=workers, shuffle=False,
                        generator=torch.Generator())  # leaves the global RNG (a training run's) alone
    results: list[CaptionResult] = []
    with tqdm(total=len(records), desc="decoding", unit="img", file=sys.stderr,
              disable=not progress, leave=False) as bar:
        for images, _ in loader:
            results.extend(captioner.caption_batch(images, options))
            bar.update(len(images))
    return results


def score(records: list[ImageRecord], results: list[CaptionResult], instances: Path | None = None,
          meteor: bool | None = None, preprocess: Preprocess | None = None,
          tokenizer: Tokenizer = PTB) -> tuple[dict[str, float], GroundingSummary | None]:
    """Caption metrics on the tokens of ``tokenizer`` (the model's), and grounding figures
    when an instances file (shapes data) is given. ``preprocess``: the captioner's; with a
    centre crop the attention grid covers only the crop, and the pointing game maps it there
    (None: the whole image)."""
    scored = [(r, res) for r, res in zip(records, results) if r.captions]
    refs = {r.image_id: r.captions for r, _ in scored}
    cands = {r.image_id: res.caption for r, res in scored}
    metrics = caption_metrics(refs, cands, meteor=meteor, tokenizer=tokenizer) if scored else {}
    grounding = None
    if instances is not None and instances.is_file():
        objects = load_shape_objects(instances)
        pointing, accuracy = [], []
        for r, res in zip(records, results):
            if r.image_id in objects:
                image = objects[r.image_id]
                crop = preprocess.crop_box(image.size) if preprocess is not None else None
                p, a = evaluate_caption(res.words, res.alphas, image, crop)
                pointing.append(p)
                accuracy.append(a)
        grounding = summarize_grounding(pointing, accuracy)
    return metrics, grounding


def attention_stats(results: list[CaptionResult]) -> dict:
    """Mean entropy (nats) of the per-word maps, against log L for a uniform map, and the
    share of exact zeros (sparsemax produces them; softmax never does)."""
    maps = [r.alphas.flatten(1).double() for r in results if len(r.words)]
    if not maps:
        return {"entropy": None, "uniform_entropy": None, "zero_share": None}
    a = torch.cat(maps)  # (words, L)
    ent = -(a * torch.log(a.clamp_min(1e-30))).sum(1)
    return {"entropy": round(float(ent.mean()), 4), "uniform_entropy": round(float(torch.log(torch.tensor(a.shape[1],
            dtype=torch.float64))), 4), "zero_share": round(float((a == 0).double().mean()), 4)}


def familiarity_stats(results: list[CaptionResult]) -> dict | None:
    """How familiar the images were to the model: their mean familiarity and how many were
    unfamiliar; None when the model has no record of its training images."""
    known = [r.familiarity for r in results if r.familiarity is not None]
    if not known:
        return None
    return {"images": len(known), "mean": round(sum(f.value for f in known) / len(known), 4),
            "unfamiliar": sum(f.unfamiliar for f in known), "threshold": known[0].threshold}


def evaluate(captioner: Captioner, data_dir: str | Path, split: str, *, karpathy: str | Path | None = None,
             options: DecodeOptions | None = None, batch_size: int = 32, limit: int | None = None,
             meteor: bool | None = None, progress: bool = True, workers: int = 0,
             records: list[ImageRecord] | None = None) -> EvalReport:
    options = options or DecodeOptions()
    tokenizer = captioner.vocab.tokenizer
    meteor = meteor_wanted(meteor, tokenizer)  # a request that cannot be met fails before decoding
    data_dir = Path(data_dir)
    if records is None:
        records = load_split(data_dir, split, karpathy)
    if limit:
        records = records[:limit]
    require_images(records, split)  # a missing file is a one-line error now, not a traceback mid-run
    start = time.perf_counter()
    with torch.inference_mode():
        results = decode_records(captioner, records, options, batch_size, workers, progress)
    seconds = time.perf_counter() - start
    instances = data_dir / f"instances_{split}.json"
    metrics, grounding = score(records, results, instances if karpathy is None else None, meteor,
                               captioner.preprocess, tokenizer)
    return EvalReport(split, len(records), options.beam_size, round(seconds, 2), metrics, grounding,
                      attention_stats(results), familiarity_stats(results),
                      {r.image_id: res.caption for r, res in zip(records, results)}, tokenizer.name)


def scored_units(tokenizer: str) -> str:
    """What the metrics counted for a report of ``tokenizer`` ("characters", "words split at spaces")."""
    return TOKENIZERS[tokenizer].unit if tokenizer in TOKENIZERS else "tokens"


def format_table(report: EvalReport) -> str:
    rows = [("images", str(report.n_images)), ("beam size", str(report.beam_size)),
            ("decoding seconds", f"{report.seconds:.1f}")]
    rows += [(k, f"{v:.4f}") for k, v in report.metrics.items()]
    if report.tokenizer != "ptb" and report.metrics:
        rows += [("METEOR", "not computed: it scores English only"),
                 ("tokens scored", scored_units(report.tokenizer))]
    if report.grounding:
        g = report.grounding
        def fmt(key: str) -> str:
            v = getattr(g, key)
            return "n/a" if v is None else f"{v:.4f}"
        rows += [
            ("object accuracy (colour+shape)", fmt("object_accuracy")),
            ("object accuracy (with size)", fmt("object_accuracy_with_size")),
            ("relation direction accuracy", f"{fmt('relation_accuracy')}  (chance {fmt('relation_chance')}, over "
                                            f"{g.n_relations - g.n_relations_misnamed} relations "
                                            f"between rightly named objects)"),
            ("relations with a misnamed object", f"{g.n_relations_misnamed} of {g.n_relations} stated"),
            ("pointing game (shape+colour words)", f"{fmt('pointing_accuracy')}  (chance {fmt('pointing_chance')})"),
            ("pointing game, argmax cell touches the box", f"{fmt('pointing_accuracy_touch')}  "
                                                           f"(chance {fmt('pointing_chance_touch')})"),
            ("pointing game, shape words", fmt("pointing_accuracy_shape")),
            ("pointing game, colour words", fmt("pointing_accuracy_color")),
            ("alpha mass in box", f"{fmt('alpha_mass_in_box')}  (uniform map {fmt('alpha_mass_chance')})"),
            ("alpha mass on cells touching the box", fmt("alpha_mass_touch")),
            ("map entropy on those words (nats)", fmt("alpha_entropy_named")),
            ("scored words", str(g.n_words) + (
                f"  ({g.n_words_unseen} more named an object outside the centre crop: not scored)"
                if g.n_words_unseen else "")),
        ]
    if report.attention and report.attention["entropy"] is not None:
        at = report.attention
        rows.append(("attention entropy (nats)", f"{at['entropy']:.3f}  (uniform {at['uniform_entropy']:.3f})"))
        rows.append(("attention exact zeros", f"{at['zero_share']:.3f}"))
    fam = report.familiarity
    rows.append(("unfamiliar images", "unknown (no familiarity record: captioner familiarity adds one)" if fam is None
                 else f"{fam['unfamiliar']} of {fam['images']} (familiarity below {fam['threshold']:g}; "
                      f"mean familiarity {fam['mean']:.3f})"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def write_report(report: EvalReport, out: Path) -> Path:
    """Metrics JSON at ``out``; the COCO results JSON ([{image_id, caption}]) beside it."""
    from .metrics import coco_results_json

    out.parent.mkdir(parents=True, exist_ok=True)
    results_path = out.with_name(out.stem + ".results.json")
    # UTF-8, unescaped: a Chinese caption stays readable in the file.
    out.write_text(json.dumps({**report.summary(), "results_file": results_path.name}, indent=2,
                              ensure_ascii=False) + "\n", encoding="utf-8")
    results_path.write_text(json.dumps(coco_results_json(report.captions), ensure_ascii=False) + "\n",
                            encoding="utf-8")
    return results_path
