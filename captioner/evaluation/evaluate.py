"""Evaluate a captioner on a split by real decoding (no teacher forcing), or captions
from any source (a file) without a model.

Caption metrics for any COCO-format data; on shapes data (an ``instances_<split>.json``
beside the captions) also object accuracy, hallucinated shapes and the attention pointing
game; on COCO data with its instance annotations in the published layout
(``annotations/instances_{train,val}2014.json``) also CHAIR (:mod:`captioner.evaluation.chair`) and
the attention's grounding on the instances (:mod:`captioner.evaluation.coco_grounding`).
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

from captioner.data.coco import (
    ImageDataset,
    ImageInstances,
    ImageRecord,
    dataset_tokenizer,
    instance_files,
    load_instances,
    load_split,
    require_images,
)
from captioner.data.images import Preprocess
from captioner.data.vocab import PTB, TOKENIZERS, Tokenizer, tokenizer_named
from captioner.evaluation.chair import ChairSummary, ImageChair, chair
from captioner.evaluation.coco_grounding import CocoGroundingSummary, coco_pointing, summarize_coco_grounding
from captioner.evaluation.grounding import GroundingSummary, evaluate_caption, load_shape_objects, summarize_grounding
from captioner.evaluation.metrics import caption_metrics, meteor_wanted
from captioner.inference import Captioner, DecodeOptions
from captioner.model.familiarity import Familiarity
from captioner.search.decoding import CaptionResult


@dataclass
class EvalReport:
    split: str
    n_images: int
    beam_size: int | None  # None: captions read from a file, not decoded
    seconds: float
    metrics: dict[str, float]
    grounding: GroundingSummary | None = None  # shapes data only
    attention: dict | None = None  # how peaked the maps are: mean entropy, share of exact zeros
    familiarity: dict | None = None  # images, mean familiarity, how many unfamiliar; None: unknown
    captions: dict[int, str] = field(default_factory=dict)  # image id -> generated caption
    tokenizer: str = "ptb"  # the tokens the metrics count: the model's (characters for "chars" and "chars2")
    chair: ChairSummary | None = None  # COCO data with its instances only
    coco_grounding: CocoGroundingSummary | None = None  # likewise, and captions with their maps
    objects: dict[int, ImageChair] = field(default_factory=dict)  # image id -> objects named, hallucinated
    captions_file: str | None = None  # the file the captions were read from

    def summary(self) -> dict:
        d = asdict(self)
        d.pop("captions")
        d.pop("objects")
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
                p, a = evaluate_caption(res.words, res.alphas if has_maps(res) else None, image, crop)
                pointing.append(p)
                accuracy.append(a)
        grounding = summarize_grounding(pointing, accuracy)
    return metrics, grounding


def has_maps(result: CaptionResult) -> bool:
    """Whether a result holds its attention maps (a caption read from a file may not)."""
    return result.alphas.dim() == 3 and result.alphas.shape[1] * result.alphas.shape[2] > 0


def coco_objects(data_dir: Path, split: str, records: list[ImageRecord]) -> dict[int, ImageInstances] | None:
    """The COCO instances of the records' images, from the data folder's instances files in
    the published layout; None when it has none."""
    files = instance_files(data_dir, split)
    return load_instances(files, {r.image_id for r in records}) if files else None


def coco_scores(records: list[ImageRecord], results: list[CaptionResult], objects: dict[int, ImageInstances],
                preprocess: Preprocess | None = None
                ) -> tuple[ChairSummary | None, list[ImageChair], CocoGroundingSummary | None]:
    """CHAIR of the captions of the images that ``objects`` knows (each image's objects: its
    instances and what its references name), and the maps' grounding on the instances
    (captions with maps only). ``preprocess`` as in :func:`score`."""
    known = [(r, res) for r, res in zip(records, results) if r.image_id in objects]
    if not known:
        return None, [], None
    summary, per_image = chair({r.image_id: res.caption for r, res in known},
                               {r.image_id: [i.category for i in objects[r.image_id].instances] for r, _ in known},
                               {r.image_id: r.captions for r, _ in known})
    pointing = []
    for r, res in known:
        if has_maps(res):
            image = objects[r.image_id]
            crop = preprocess.crop_box(image.size) if preprocess is not None else None
            pointing.append(coco_pointing(res.words, res.alphas, image, crop))
    return summary, per_image, summarize_coco_grounding(pointing) if pointing else None


def attention_stats(results: list[CaptionResult]) -> dict:
    """Mean entropy (nats) of the per-word maps, against log L for a uniform map, and the
    share of exact zeros (sparsemax produces them; softmax never does)."""
    maps = [r.alphas.flatten(1).double() for r in results if len(r.words) and has_maps(r)]
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
            "unfamiliar": sum(f.unfamiliar for f in known),
            # None: the flags come from a captions file, which does not say its threshold
            "threshold": None if math.isnan(known[0].threshold) else known[0].threshold}


def evaluate(captioner: Captioner, data_dir: str | Path, split: str, *, karpathy: str | Path | None = None,
             options: DecodeOptions | None = None, batch_size: int = 32, limit: int | None = None,
             meteor: bool | None = None, progress: bool = True, workers: int = 0,
             records: list[ImageRecord] | None = None, with_coco_objects: bool = True) -> EvalReport:
    """Decode the split and score it. ``with_coco_objects``: CHAIR and COCO grounding when
    the data has COCO's instances files (reading them takes a while on COCO: training's
    validation leaves them out)."""
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
    objects = coco_objects(data_dir, split, records) if with_coco_objects else None
    hallucination, per_image, coco_grounding = (coco_scores(records, results, objects, captioner.preprocess)
                                                if objects else (None, [], None))
    return EvalReport(split, len(records), options.beam_size, round(seconds, 2), metrics, grounding,
                      attention_stats(results), familiarity_stats(results),
                      {r.image_id: res.caption for r, res in zip(records, results)}, tokenizer.name,
                      hallucination, coco_grounding, {c.image_id: c for c in per_image})


@dataclass(frozen=True)
class CaptionsFile:
    """Captions read from a file, matched to a split's images."""

    results: dict[int, CaptionResult]  # image id -> the caption, its words, its maps where the file has them
    outside: int  # captions of images that are not in the split
    example: str | None  # one of those, as the file names it
    failed: int  # lines that hold an error instead of a caption
    missing: int = 0  # images of the split with no caption in the file


def _result(caption: str, words: list[str] | None, alphas: list | None, tokenizer: Tokenizer,
            familiarity: Familiarity | None = None) -> CaptionResult:
    words = list(words) if words is not None else tokenizer.tokenize(caption)
    maps = torch.tensor(alphas, dtype=torch.float32) if alphas else torch.zeros(len(words), 0, 0)
    return CaptionResult(words, maps, torch.zeros(len(words)), 0.0, text=caption, familiarity=familiarity)


def _familiarity(line: dict) -> Familiarity | None:
    """A line's familiarity as ``captioner caption`` wrote it ("familiarity", "unfamiliar"); the
    threshold it was flagged at is not in the line (NaN: the file's own flags are counted)."""
    value, flag = line.get("familiarity"), line.get("unfamiliar")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not isinstance(flag, bool):
        return None
    return Familiarity(float(value), flag, float("nan"))


def read_captions(path: Path, records: list[ImageRecord], tokenizer: Tokenizer = PTB) -> CaptionsFile:
    """Captions from ``path``: JSON Lines as ``captioner caption`` writes them (matched to the
    split's images by their real location, else by file name), or a COCO results file
    (``[{"image_id", "caption"}]``). ValueError, in one line, for a file of neither kind."""
    text = Path(path).read_text(encoding="utf-8")
    ids = {r.image_id for r in records}
    by_path = {str(r.path.resolve()): r.image_id for r in records}
    by_name: dict[str, list[int]] = {}
    for r in records:
        by_name.setdefault(r.path.name, []).append(r.image_id)
    results: dict[int, CaptionResult] = {}
    outside, example, failed = 0, None, 0
    try:
        if text.lstrip().startswith("["):
            entries = json.loads(text)
            lines = [(e["image_id"], str(e["image_id"]), e) for e in entries]
        else:
            lines = []
            for n, line in enumerate(text.split("\n"), start=1):  # not splitlines: U+2028 is no line end
                if not line.strip():
                    continue
                e = json.loads(line)
                if "image_id" in e:
                    lines.append((e["image_id"], str(e["image_id"]), e))
                    continue
                name = str(e["image"])
                key = e.get("resolved") or str(Path(name).resolve())
                same_name = by_name.get(Path(name).name, [])
                lines.append((by_path.get(key, same_name[0] if len(same_name) == 1 else None), name, e))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not JSON Lines as `captioner caption` writes them nor a COCO results file "
                         f'([{{"image_id", "caption"}}]): {type(e).__name__} {e}') from None
    for image_id, name, e in lines:
        if "caption" not in e:
            failed += 1
        elif image_id in ids:
            results[image_id] = _result(str(e["caption"]), e.get("words"), e.get("alphas"), tokenizer,
                                        _familiarity(e))
        else:
            outside += 1
            example = example or name
    return CaptionsFile(results, outside, example, failed, sum(i not in results for i in ids))


def evaluate_captions(path: str | Path, data_dir: str | Path, split: str, *, karpathy: str | Path | None = None,
                      records: list[ImageRecord] | None = None, meteor: bool | None = None,
                      preprocess: Preprocess | None = None) -> tuple[EvalReport, CaptionsFile]:
    """Score the captions of a file (:func:`read_captions`) on a split, with no model: every
    measure ``evaluate`` gives, the attention's only for captions that carry their maps
    ("alphas": ``captioner caption --with-attention``). ``preprocess``: the model's, for the
    region its maps cover (None: the whole image). Tokens: the data set's tokenizer."""
    data_dir = Path(data_dir)
    tokenizer = tokenizer_named(dataset_tokenizer(data_dir, karpathy, split))
    meteor = meteor_wanted(meteor, tokenizer)
    if records is None:
        records = load_split(data_dir, split, karpathy)
    read = read_captions(Path(path), records, tokenizer)
    kept = [r for r in records if r.image_id in read.results]
    if not kept:
        raise ValueError(f"{path}: no caption for an image of split {split!r}"
                         + (f" ({read.outside} for other images, e.g. {read.example})" if read.outside else ""))
    results = [read.results[r.image_id] for r in kept]
    instances = data_dir / f"instances_{split}.json"
    metrics, grounding = score(kept, results, instances if karpathy is None else None, meteor, preprocess, tokenizer)
    objects = coco_objects(data_dir, split, kept)
    hallucination, per_image, coco_grounding = coco_scores(kept, results, objects, preprocess) if objects \
        else (None, [], None)
    report = EvalReport(split, len(kept), None, 0.0, metrics, grounding, attention_stats(results),
                        familiarity_stats(results),
                        {r.image_id: res.caption for r, res in zip(kept, results)}, tokenizer.name,
                        hallucination, coco_grounding, {c.image_id: c for c in per_image}, str(path))
    return report, read


def scored_units(tokenizer: str) -> str:
    """What the metrics counted for a report of ``tokenizer`` ("characters", "words split at spaces")."""
    return TOKENIZERS[tokenizer].unit if tokenizer in TOKENIZERS else "tokens"


def format_table(report: EvalReport) -> str:
    rows = [("images", str(report.n_images))]
    if report.beam_size is None:
        rows.append(("captions from", str(report.captions_file)))
    else:
        rows += [("beam size", str(report.beam_size)), ("decoding seconds", f"{report.seconds:.1f}")]
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
            ("CHAIRs / CHAIRi, shapes", f"{fmt('chair_s')} / {fmt('chair_i')}  (captions / mentions naming "
                                        "a shape the image does not hold)"),
            ("CHAIRs / CHAIRi, colour and shape", f"{fmt('chair_s_with_color')} / {fmt('chair_i_with_color')}"),
        ]
    rows += chair_rows(report)
    if report.attention and report.attention["entropy"] is not None:
        at = report.attention
        rows.append(("attention entropy (nats)", f"{at['entropy']:.3f}  (uniform {at['uniform_entropy']:.3f})"))
        rows.append(("attention exact zeros", f"{at['zero_share']:.3f}"))
    fam = report.familiarity
    if fam is None:
        said = "unknown (no familiarity record: captioner familiarity adds one)"
    else:
        rule = ("as the file flags them" if fam["threshold"] is None
                else f"familiarity below {fam['threshold']:g}")
        said = f"{fam['unfamiliar']} of {fam['images']} ({rule}; mean familiarity {fam['mean']:.3f})"
    rows.append(("unfamiliar images", said))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _share(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.4f}"


def chair_rows(report: EvalReport) -> list[tuple[str, str]]:
    """The table's rows for CHAIR and the COCO grounding (COCO data with its instances)."""
    rows = []
    if report.chair is not None:
        c = report.chair
        rows += [("CHAIRs", f"{c.chair_s:.4f}  (captions naming an object not in the image)"),
                 ("CHAIRi", f"{_share(c.chair_i)}  ({c.n_hallucinated} of {c.n_mentions} object mentions)"),
                 ("CHAIRs / CHAIRi, list corrected", f"{c.corrected_chair_s:.4f} / {_share(c.corrected_chair_i)}")]
    if report.coco_grounding is not None:
        g = report.coco_grounding
        unseen = f"; {g.n_words_unseen} more named objects outside the crop" if g.n_words_unseen else ""
        rows += [("COCO pointing (object words)",
                  f"{_share(g.pointing_accuracy)}  (chance {_share(g.pointing_chance)}, {g.n_words} words{unseen})"),
                 ("COCO pointing, cell touches a box", _share(g.pointing_accuracy_touch)),
                 ("alpha mass on the objects", f"{_share(g.alpha_mass)}  (uniform map {_share(g.alpha_mass_chance)})")]
        rows += [(f"  {name}", f"pointing {c.pointing_accuracy:.3f}, mass {c.alpha_mass:.3f}, chance {c.chance:.3f}, "
                               f"{c.n_words} words") for name, c in g.per_category.items()]
    elif report.chair is not None and report.beam_size is None:
        rows.append(("COCO pointing", "not computed: the captions carry no maps (captioner caption --with-attention)"))
    return rows


def results_json(report: EvalReport) -> list[dict]:
    """The COCO results ([{image_id, caption}]); with CHAIR, each entry also names the objects
    its caption names ("objects", each mention) and those hallucinated ("hallucinated"):
    COCO's own tools read the two keys they need and leave the others."""
    from captioner.evaluation.metrics import coco_results_json

    entries = coco_results_json(report.captions)
    for e in entries:
        found = report.objects.get(e["image_id"])
        if found is not None:
            e.update(objects=list(found.named), hallucinated=list(found.hallucinated))
    return entries


def write_report(report: EvalReport, out: Path) -> Path:
    """Metrics JSON at ``out``; the COCO results JSON (:func:`results_json`) beside it."""

    out.parent.mkdir(parents=True, exist_ok=True)
    results_path = out.with_name(out.stem + ".results.json")
    # UTF-8, unescaped: a Chinese caption stays readable in the file.
    out.write_text(json.dumps({**report.summary(), "results_file": results_path.name}, indent=2,
                              ensure_ascii=False) + "\n", encoding="utf-8")
    results_path.write_text(json.dumps(results_json(report), ensure_ascii=False) + "\n", encoding="utf-8")
    return results_path
