"""int8 against fp32 in the torch-free runtime: the same captions, object accuracy, pointing, and size.

    python benchmarks/int8_parity.py [--images 500] [--seed 5858] [--beam-size 3] [--models demo-soft ...]
                                     [--forms arithmetic weights] [--paper-size]

For each demo model: export it with --onnx (fp32) and with --onnx --int8 FORM for each form
(arithmetic: calibrated on fresh shapes images; weights: int8 and fp16 weights computed in fp32;
captioner.io.quantize) into a temporary folder, caption N fresh shapes images
(``captioner shapes --seed SEED``, a seed neither the demos nor the calibration used) with both
folders in onnxruntime (captioner.onnx), from the same decoded pixels, and print per model: the
share of identical captions, object accuracy (colour and shape, per image) and pointing accuracy
(argmax cell in the named object's box, per word) of each, and the graphs' size on disk
(encoder.onnx + decoder_step.onnx) of each.
``--paper-size`` adds the size in each form of a captioner at the paper's sizes (ResNet-101 at 224 px,
LSTM 512, attention 512, embedding 512, vocabulary 10,000; random weights, which leave the size
as it is), calibrated on the same shapes images.
Targets, per form: >= 98% identical captions, accuracies within 0.01, int8 graphs <= 0.35x fp32's size;
exit 0 when some form meets them all.
For the captions that differ it also prints how near a tie each was: the fp32 graphs' log
probability of fp32's caption less that of int8's caption, both teacher-forced through the fp32
step on the same image (median, 90th percentile, smallest; a negative gap: int8's beam found a
caption fp32 scores higher, which a beam search can miss).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

from captioner.data.shapes import generate_dataset
from captioner.evaluation.grounding import evaluate_caption, load_shape_objects, summarize_grounding
from captioner.inference import Captioner
from captioner.io import folder as fmt
from captioner.io.export import export
from captioner.io.quantize import FORMS
from captioner.onnx.runtime import OnnxCaptioner


def caption_all(rt: OnnxCaptioner, pixels: np.ndarray, beam_size: int, batch: int = 16) -> list:
    opts = rt.options(beam_size=beam_size)
    out = []
    for i in range(0, len(pixels), batch):
        out += rt.caption_arrays(pixels[i:i + batch], opts)
    return out


def caption_log_prob(rt: OnnxCaptioner, pixels: np.ndarray, words: list[str]) -> float:
    """log p(words, <end> | image) under ``rt``'s graphs, teacher-forced from <start>; ``pixels``:
    one (H, W, 3) image at the input size."""
    index = {w: i for i, w in enumerate(rt.words)}
    targets = [index[w] for w in words] + [rt.special["end"]]
    ann, keys, h, c, _ = rt.encode(rt.preprocess.normalize_array(pixels[None]))
    word, total = np.array([rt.special["start"]], dtype=np.int64), 0.0
    for t in targets:
        log_probs, h, c, _, _ = rt.step(word, h, c, ann, keys)
        total += float(log_probs[0, t])
        word = np.array([t], dtype=np.int64)
    return total


def tie_gaps(rt: OnnxCaptioner, pixels: np.ndarray, ours: list, theirs: list) -> list[float]:
    """For each image whose captions differ: log p of ``ours`` less log p of ``theirs``, under ``rt``."""
    return [caption_log_prob(rt, x, a.words) - caption_log_prob(rt, x, b.words)
            for x, a, b in zip(pixels, ours, theirs) if a.text != b.text]


def grounding(captions: list, objects: list, crops: list) -> tuple[float, float]:
    """Object accuracy (colour and shape) and pointing accuracy of the captions."""
    pointing, accuracy = [], []
    for cap, image, crop in zip(captions, objects, crops):
        p, a = evaluate_caption(cap.words, cap.alphas, image, crop)
        pointing.append(p)
        accuracy.append(a)
    g = summarize_grounding(pointing, accuracy)
    return g.object_accuracy, g.pointing_accuracy


def paper_size(tmp: Path, calibration: Path, forms: list[str]) -> dict[str, int]:
    """Graph bytes of a paper-size captioner (random weights) in fp32 and in each int8 form."""
    import torch

    from captioner.data.images import Preprocess
    from captioner.data.vocab import SPECIALS, Vocabulary
    from captioner.model.decoder import CaptionModel, ModelConfig

    torch.manual_seed(0)
    vocab = Vocabulary(list(SPECIALS) + [f"w{i}" for i in range(10_000 - len(SPECIALS))])
    cfg = ModelConfig(vocab_size=len(vocab), encoder="resnet101", image_size=(224, 224), embed_dim=512,
                      hidden_dim=512, attention_dim=512, dropout=0.5)
    cap = Captioner(CaptionModel(cfg), vocab, Preprocess(size=(224, 224)))
    sizes = {"fp32": fmt.graph_bytes(export(cap, tmp / "paper-fp32", onnx=True).folder)}
    for form in forms:
        sizes[form] = fmt.graph_bytes(export(  # the weights form compares captions on images given: none here
            cap, tmp / f"paper-{form}", onnx=True, int8=form,
            calibration=calibration if form == "arithmetic" else None).folder)
    return sizes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=500)
    ap.add_argument("--seed", type=int, default=5858)
    ap.add_argument("--beam-size", type=int, default=3)
    ap.add_argument("--models", nargs="+", default=["demo-soft", "demo-hard", "demo-zh"])
    ap.add_argument("--forms", nargs="+", choices=FORMS, default=list(FORMS), help="int8 forms (default: both)")
    ap.add_argument("--paper-size", action="store_true", help="also the graphs' size at the paper's sizes")
    ap.add_argument("--show", type=int, default=5, help="captions that differ to print per model (default 5)")
    args = ap.parse_args()
    ok = {form: True for form in args.forms}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        generate_dataset(tmp / "shapes", {"test": args.images}, seed=args.seed, progress=False)
        objects = sorted(load_shape_objects(tmp / "shapes" / "instances_test.json").values(), key=lambda o: o.file_name)
        paths = [tmp / "shapes" / "images" / o.file_name for o in objects]
        print(f"beam {args.beam_size}; {len(paths)} fresh shapes images (seed {args.seed}); onnxruntime, fp32 "
              "graphs against int8 (arithmetic: encoder calibrated on 64 fresh shapes images, seed 7373; weights: "
              "int8 and fp16 weights, computed in fp32)")
        print(f"{'model':<10} {'form':<10} {'identical':>9}  {'objects fp32':>12} {'int8':>6}  {'pointing fp32':>13} "
              f"{'int8':>6}  {'MB fp32':>8} {'int8':>6} {'ratio':>6}")
        for name in args.models:
            cap = Captioner.load(name)
            folders = {"fp32": export(cap, tmp / name / "fp32", onnx=True).folder,
                       **{form: export(cap, tmp / name / form, onnx=True, int8=form).folder for form in args.forms}}
            runtimes = {k: OnnxCaptioner(f) for k, f in folders.items()}
            pre = runtimes["fp32"].preprocess
            pixels = np.stack([pre.array(pre.load(p)) for p in paths])  # (N, H, W, 3), decoded once for all
            crops = [pre.crop_box(o.size) for o in objects]
            caps = {k: caption_all(rt, pixels, args.beam_size) for k, rt in runtimes.items()}
            obj32, pt32 = grounding(caps["fp32"], objects, crops)
            for form in args.forms:
                same = sum(a.text == b.text for a, b in zip(caps["fp32"], caps[form])) / len(paths)
                obj8, pt8 = grounding(caps[form], objects, crops)
                size = {k: fmt.graph_bytes(folders[k]) for k in ("fp32", form)}
                ratio = size[form] / size["fp32"]
                ok[form] &= same >= 0.98 and abs(obj32 - obj8) <= 0.01 and abs(pt32 - pt8) <= 0.01
                print(f"{name:<10} {form:<10} {same:>9.1%}  {obj32:>12.3f} {obj8:>6.3f}  {pt32:>13.3f} {pt8:>6.3f}  "
                      f"{size['fp32'] / 1e6:>8.2f} {size[form] / 1e6:>6.2f} {ratio:>6.2f}")
                differ = [(p.name, a.text, b.text) for p, a, b in zip(paths, caps["fp32"], caps[form])]
                for file, a, b in [d for d in differ if d[1] != d[2]][:args.show]:
                    print(f"    differs: {file}: fp32 {a!r}, {form} {b!r}")
                gaps = tie_gaps(runtimes["fp32"], pixels, caps["fp32"], caps[form])
                if gaps:
                    print(f"    near ties: fp32's log p of its caption less of {form}'s, over the {len(gaps)} that "
                          f"differ: median {np.median(gaps):.3f}, 90th percentile {np.percentile(gaps, 90):.3f}, "
                          f"smallest {min(gaps):.3f}")
        if args.paper_size:
            sizes = paper_size(tmp, tmp / "shapes" / "images", args.forms)
            for form in args.forms:
                ok[form] &= sizes[form] / sizes["fp32"] <= 0.35
                print(f"{'paper size':<10} {form:<10} {'':>9}  {'':>12} {'':>6}  {'':>13} {'':>6}  "
                      f"{sizes['fp32'] / 1e6:>8.1f} {sizes[form] / 1e6:>6.1f} {sizes[form] / sizes['fp32']:>6.2f}   "
                      "(ResNet-101, LSTM 512, vocabulary 10,000)")
    for form in args.forms:
        print(f"{form}: {'targets met' if ok[form] else 'TARGETS MISSED'}")
    return 0 if any(ok.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
