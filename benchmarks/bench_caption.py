"""Batch captioning speed and memory.

    python benchmarks/bench_caption.py [--images 300] [--batch-size 32] [--workers 2] [--repeats 3]
                                       [--device cpu|cuda] [--precision fp32|bf16|fp16]

1. Speed, on the same few hundred generated photos (JPEG, 640x480): images/s of the whole
   `captioner caption` pipeline (decode + preprocess in worker processes, encoder, batched
   beam search k=3, JSON lines written) and of the encoder's forward pass alone on
   already-preprocessed tensors; their ratio says what loading, decoding and writing cost
   on top of the encoder. For the bundled default model and for a ResNet-101 model at the
   paper's sizes (random weights: speed does not depend on them).
2. Memory: peak resident (host) memory of `captioner caption` on 200 and on 2,000 images, in
   fp32 (--precision is for the speed half).

Both halves run on ``--device`` (default: the CPU), the memory half through `captioner caption
--device`; on a GPU the timings wait for its queue (torch.cuda.synchronize) before they stop.
``--precision`` autocasts the encoder and the search alike, as `captioner caption --precision`;
``--decode-on-device`` adds the pipeline with JPEGs decoded there (`captioner caption
--decode-on-device`).
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw
from torch.utils.flop_counter import FlopCounterMode

from captioner.cli.batch import caption_paths, image_loader
from captioner.data.images import Preprocess, load_image
from captioner.data.vocab import SPECIALS, Vocabulary
from captioner.inference import AUTOCAST_DTYPES, Captioner, DecodeOptions
from captioner.model.decoder import CaptionModel, ModelConfig
from captioner.model.encoders import Annotations
from captioner.search.decoding import beam_search
from captioner.search.graph import search_form


def photo_images(n: int, seed: int = 0) -> Iterator[Image.Image]:
    """640x480 smooth gradients with a few shapes: JPEG-compressible like real photos."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:480, 0:640].astype(np.float32)
    for _ in range(n):
        c0, c1 = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
        t = (xx / 640 * rng.uniform(0.3, 1) + yy / 480 * rng.uniform(0.3, 1))[..., None] / 2
        im = Image.fromarray((c0 * (1 - t) + c1 * t).astype(np.uint8), "RGB")
        draw = ImageDraw.Draw(im)
        for _ in range(3):
            x, y, s = rng.integers(0, 560), rng.integers(0, 400), rng.integers(30, 120)
            draw.ellipse([x, y, x + s, y + s], fill=tuple(int(v) for v in rng.integers(0, 255, 3)))
        yield im


def make_photos(folder: Path, n: int, seed: int = 0) -> list[str]:
    """``n`` of :func:`photo_images` saved as JPEGs in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, im in enumerate(photo_images(n, seed)):
        path = folder / f"photo_{i:05d}.jpg"
        im.save(path, quality=90)
        paths.append(str(path))
    return paths


def resnet101_captioner(device: str = "cpu") -> Captioner:
    torch.manual_seed(0)
    vocab = Vocabulary(list(SPECIALS) + [f"w{i}" for i in range(10_000 - len(SPECIALS))])
    cfg = ModelConfig(vocab_size=len(vocab), encoder="resnet101", image_size=(224, 224), embed_dim=512,
                      hidden_dim=512, attention_dim=512, dropout=0.5)
    return Captioner(CaptionModel(cfg).to(device), vocab, Preprocess(size=(224, 224)))


def preprocessed_batches(captioner: Captioner, paths: list[str], batch_size: int) -> list[torch.Tensor]:
    """Already on the model's device: the encoder-alone timing leaves out loading and the copy."""
    tensors = [captioner.preprocess(load_image(p)) for p in paths]
    return [torch.stack(tensors[i:i + batch_size]).to(captioner.device) for i in range(0, len(tensors), batch_size)]


def synchronize(captioner: Captioner) -> None:
    if captioner.device.type == "cuda":
        torch.cuda.synchronize(captioner.device)


def search(captioner: Captioner, ann: Annotations, form: str = "taken") -> None:
    """The beam search (k=3) alone, on annotations already computed: in the form captioning
    takes ("taken": on a GPU the graphed one, captioner.search.graph), or run eagerly ("eager")."""
    if form == "taken":
        captioner.beam_search_batch(ann, DecodeOptions(beam_size=3, max_len=20))
        return
    beam_search(captioner.model.decoder, ann, captioner.tokens, DecodeOptions(beam_size=3, max_len=20))


def bench_speed(captioner: Captioner, paths: list[str], batches: list[torch.Tensor], batch_size: int,
                workers: int, repeats: int, on_device: bool = False) -> dict[str, float]:
    """Images/s of the whole caption pipeline, of the encoder's forward pass alone, and, to
    show where the rest goes, of loading alone (the same DataLoader, no model) and of the
    beam search alone (on annotations already computed). Each is the best of ``repeats``
    timings, taken in turn, so that a slow moment of the machine does not skew one ratio.
    ``on_device``: also the pipeline and the loading with JPEGs decoded on the model's device
    (--decode-on-device). "first batch" is the seconds until the loader's first batch (the
    worker processes starting), which a short run pays in full."""
    options = DecodeOptions(beam_size=3, max_len=20)
    with torch.inference_mode(), captioner.autocast():
        captioner.caption_batch(batches[0], options)  # warm-up
        anns = [captioner.encode(batch) for batch in batches]

    def encoder() -> None:
        with torch.inference_mode(), captioner.autocast():
            for batch in batches:
                captioner.encode(batch)  # as captioning encodes: on a GPU in bf16, channels-last

    def searches(form: str = "taken") -> None:
        with torch.inference_mode(), captioner.autocast():
            for ann in anns:
                search(captioner, ann, form)

    first = {False: float("inf"), True: float("inf")}  # by raw: each loading's own first batch

    def loading(raw: bool = False) -> None:
        t0 = time.perf_counter()
        for i, batch in enumerate(image_loader(paths, captioner.preprocess, batch_size, workers, raw_jpegs=raw)):
            if i == 0:
                first[raw] = min(first[raw], time.perf_counter() - t0)
            if raw:
                batch.decoded_on(captioner.device, paths, captioner.preprocess)

    def caption(raw: bool = False) -> None:
        out = io.StringIO()
        caption_paths(captioner, paths, out, options=options, batch_size=batch_size, workers=workers,
                      progress=False, decode_on_device=raw)
        assert out.getvalue().count("\n") == len(paths)

    jobs = {"caption": caption, "encoder": encoder, "search": searches, "loading": loading}
    if search_form(captioner.device, "expected", captioner.model.decoder.compiled) != "plain":
        jobs["search, eager"] = lambda: searches("eager")
    if on_device:
        jobs |= {"caption, device decoding": lambda: caption(True), "loading, device decoding": lambda: loading(True)}
    best = {name: float("inf") for name in jobs}
    for _ in range(repeats):
        for name, job in jobs.items():
            t0 = time.perf_counter()
            job()
            synchronize(captioner)
            best[name] = min(best[name], time.perf_counter() - t0)
    return {**{name: len(paths) / seconds for name, seconds in best.items()}, "first batch": first[False],
            "first batch, device decoding": first[True]}


def flops_per_image(captioner: Captioner, batch: torch.Tensor) -> tuple[float, float]:
    """Arithmetic of the encoder and of the beam search (k=3) per image, counting matrix
    products and convolutions only: what no pipelining can hide."""
    with torch.inference_mode():
        with FlopCounterMode(display=False) as count:
            ann = captioner.model.encode(batch)
        encoder = count.get_total_flops()
        with FlopCounterMode(display=False) as count:
            search(captioner, ann, "plain")  # a graph's replay hides its operators from the counter
    return encoder / len(batch), count.get_total_flops() / len(batch)


def peak_memory_mb(folder: Path, weights: str | None, workers: int, device: str = "cpu") -> float:
    """Peak RSS of a fresh `captioner caption` process (or of its largest worker) over a folder."""
    extra = f", '--weights', {weights!r}" if weights else ""
    code = (
        "import resource, sys; from captioner.cli.main import main; "
        f"rc = main(['caption', {str(folder)!r}, '--out', sys.argv[1], '--quiet', '--workers', '{workers}', "
        f"'--device', {device!r}{extra}]); "
        "me = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; "
        "kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss; "
        "print(max(me, kids) / 1024)"
    )
    with tempfile.TemporaryDirectory() as tmp:
        res = subprocess.run([sys.executable, "-c", code, str(Path(tmp) / "out.jsonl")], capture_output=True,
                             text=True, check=True)
    return float(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="each timing is the best of this many")
    ap.add_argument("--weights", default=None, help="the default model (demo-soft) or another checkpoint")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--skip-resnet", action="store_true", help="leave out the ResNet-101 model at the paper's sizes")
    ap.add_argument("--skip-demo", action="store_true",
                    help="leave out the default (or --weights) model: ResNet-101 alone, e.g. on a time-boxed GPU")
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N: both halves run there")
    ap.add_argument("--precision", choices=tuple(AUTOCAST_DTYPES), default="fp32")
    ap.add_argument("--decode-on-device", action="store_true",
                    help="also time the pipeline and the loading with JPEGs decoded on --device")
    args = ap.parse_args()
    if args.skip_demo and args.skip_resnet:
        ap.error("--skip-demo and --skip-resnet leave no model to time")
    where = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "CPU"
    print(f"torch {torch.__version__}, {args.device} ({where}), {args.precision}, threads {torch.get_num_threads()}, "
          f"batch {args.batch_size}, workers {args.workers}, beam 3, best of {args.repeats}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "photos"
        paths = make_photos(folder, args.images)
        models = [] if args.skip_demo else [(f"{args.weights or 'demo-soft'} (small encoder, 128 px)",
                                             Captioner.load(args.weights, device=args.device))]
        if not args.skip_resnet:
            models.append(("resnet101, paper sizes", resnet101_captioner(args.device)))
        for name, cap in models:
            cap.use_precision(args.precision)
            batches = preprocessed_batches(cap, paths, args.batch_size)  # outside the encoder timing
            r = bench_speed(cap, paths, batches, args.batch_size, args.workers, args.repeats, args.decode_on_device)
            print(f"{name}: caption {r['caption']:.1f} img/s, encoder alone {r['encoder']:.1f} img/s, "
                  f"caption time / encoder time = {r['encoder'] / r['caption']:.2f}")
            enc_flops, search_flops = flops_per_image(cap, batches[0])
            print(f"    arithmetic per image: encoder {enc_flops / 1e6:.0f} MFLOP, beam search "
                  f"{search_flops / 1e6:.0f} MFLOP ({search_flops / enc_flops:.2f} of the encoder's)")
            print(f"    of which: beam search alone {r['search']:.1f} img/s "
                  f"({r['encoder'] / r['search']:.2f} encoder times), loading alone ({args.workers} workers) "
                  f"{r['loading']:.1f} img/s ({r['encoder'] / r['loading']:.2f} encoder times; first batch after "
                  f"{r['first batch']:.2f} s)")
            if "search, eager" in r:
                eager = r["search, eager"]
                print(f"    beam search as CUDA graphs {r['search']:.1f} img/s ({r['search'] / eager:.2f}x the "
                      f"search run eagerly, {eager:.1f})")
            if args.decode_on_device:
                dc, dl = r["caption, device decoding"], r["loading, device decoding"]
                print(f"    JPEGs decoded on {args.device}: caption {dc:.1f} img/s (caption time / encoder time = "
                      f"{r['encoder'] / dc:.2f}), loading alone {dl:.1f} img/s (first batch after "
                      f"{r['first batch, device decoding']:.2f} s)")
        if not args.skip_memory:
            big = Path(tmp) / "many"
            make_photos(big, 2000, seed=1)
            small = Path(tmp) / "few"
            small.mkdir()
            for p in sorted(big.iterdir())[:200]:
                (small / p.name).symlink_to(p)
            m200 = peak_memory_mb(small, args.weights, args.workers, args.device)
            m2000 = peak_memory_mb(big, args.weights, args.workers, args.device)
            print(f"peak host memory, RSS (default model, fp32): 200 images {m200:.0f} MB, "
                  f"2000 images {m2000:.0f} MB ({m2000 / m200:.2f}x)")


if __name__ == "__main__":
    main()
