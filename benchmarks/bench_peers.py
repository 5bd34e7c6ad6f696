"""Captioning on a CPU beside the captioners users pick instead: ms per image, FLOPs, peak RSS.

    pip install -e ".[bench]"     # transformers, for the two peers
    python benchmarks/bench_peers.py [--rounds 5] [--threads 2] [--folders DIR] [--only NAME ...] [--tiny]

Models, all with random weights (speed does not depend on them; nothing is downloaded):
  captioner at the paper's sizes (224 px, LSTM 512, attention 512, embedding 512, vocabulary
  10,000) with a ResNet-101 and with a VGG-19 encoder, each in torch eager (Captioner), and in the
  torch-free runtime (captioner.onnx) with its fp32 and its int8 graphs (captioner export --onnx
  [--int8 [weights]], exported once into --folders, or a temporary folder), its threads sleeping
  between runs as by default, and for fp32 also spinning (``--spin``);
  vit-gpt2 (nlpconnect/vit-gpt2-image-captioning's architecture: ViT-B/16 + GPT-2) and BLIP-base
  (Salesforce/blip-image-captioning-base's), built from transformers' default configs, in eager.
Each generates exactly 20 words with beam 3 (the peers: min_new_tokens = max_new_tokens = 20;
the captioner: max_len 20, its <end> out of reach before then), from the same 8 fresh shapes images,
prepared beforehand as each model's input (decoding and resizing are left out of every figure).

Each model runs in a process of its own (its peak RSS is its own), on ``--threads`` threads; the
processes take turns (one works at a time), in ``--rounds`` interleaved rounds of: batch 1 (two
images, one at a time), then batch 8. Printed: ms per image (medians), the ratio to the
ResNet-101 captioner in the runtime (fp32), FLOPs per image (torch's FlopCounterMode on the
model's torch form, batch 1: products and convolutions), the achieved GFLOP/s beside the CPU's
peak as one 2048 x 2048 fp32 matrix product measures it on the same threads, a bound for each
(compute where it reaches half the peak, else per-call overhead and memory traffic), peak RSS,
and for the runtime at batch 1 the encoder's and the search's share. Then the targets.
``--tiny``: tiny sizes for every model (a check that each line runs; the figures mean nothing).
A full run takes about half an hour on an idle 2-core machine (the exports included).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS, BEAM, IMAGES = 20, 3, 8
ROOT = Path(__file__).resolve().parents[1]
OURS = {  # name -> (encoder, form)
    "resnet101 torch": ("resnet101", "torch"), "resnet101 onnx fp32": ("resnet101", "fp32"),
    "resnet101 onnx fp32 spinning": ("resnet101", "fp32"),
    "resnet101 onnx int8": ("resnet101", "int8"), "resnet101 onnx int8 weights": ("resnet101", "int8w"),
    "vgg19 torch": ("vgg19", "torch"), "vgg19 onnx fp32": ("vgg19", "fp32"), "vgg19 onnx int8": ("vgg19", "int8"),
}
PEERS = ("vit-gpt2", "blip-base")
BASELINE = "resnet101 onnx fp32"


# ------------------------------------------------------------------ the models

def paper_captioner(encoder: str, tiny: bool):
    """The captioner at the paper's sizes with ``encoder`` (random weights, seed 0); --tiny: tiny sizes."""
    import torch

    from captioner.data.images import Preprocess
    from captioner.data.vocab import SPECIALS, Vocabulary
    from captioner.inference import Captioner
    from captioner.model.decoder import CaptionModel, ModelConfig

    torch.manual_seed(0)
    v, size, dims = (60, 32, dict(embed_dim=16, hidden_dim=16, attention_dim=16)) if tiny else \
        (10_000, 224, dict(embed_dim=512, hidden_dim=512, attention_dim=512))
    vocab = Vocabulary(list(SPECIALS) + [f"w{i}" for i in range(v - len(SPECIALS))])
    cfg = ModelConfig(vocab_size=len(vocab), encoder="small" if tiny else encoder, image_size=(size, size),
                      dropout=0.5, **dims)
    model = CaptionModel(cfg).eval()
    with torch.no_grad():  # <end> out of reach until only it may come: every caption has exactly WORDS words
        model.decoder.L_o.bias[vocab.end] = -1e4
    return Captioner(model, vocab, Preprocess(size=(size, size)), meta={"max_caption_len": WORDS})


def peer(name: str, tiny: bool):
    """(model, image size, generate keyword arguments) of a peer from transformers' default configs."""
    import torch

    torch.manual_seed(0)
    if name == "vit-gpt2":
        from transformers import GPT2Config, VisionEncoderDecoderConfig, VisionEncoderDecoderModel, ViTConfig

        small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
                     patch_size=8) if tiny else {}
        gpt2 = dict(n_embd=32, n_layer=2, n_head=2) if tiny else {}
        cfg = VisionEncoderDecoderConfig.from_encoder_decoder_configs(
            ViTConfig(**small), GPT2Config(add_cross_attention=True, **gpt2))
        model = VisionEncoderDecoderModel(cfg)
        eos = model.config.decoder.eos_token_id
        model.config.decoder_start_token_id, model.config.pad_token_id, model.config.eos_token_id = eos, eos, eos
        model.generation_config.decoder_start_token_id = eos
        model.generation_config.pad_token_id = model.generation_config.eos_token_id = eos
        size = cfg.encoder.image_size
    elif name == "blip-base":
        from transformers import BlipConfig, BlipForConditionalGeneration

        kw = dict(vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                     image_size=32, patch_size=8),
                  text_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                   encoder_hidden_size=32)) if tiny else {}
        model = BlipForConditionalGeneration(BlipConfig(**kw))
        size = model.config.vision_config.image_size
    else:
        raise ValueError(name)
    return model.eval(), size, dict(num_beams=BEAM, max_new_tokens=WORDS, min_new_tokens=WORDS, do_sample=False)


def images(tmp: Path, tiny: bool):
    """The IMAGES fresh shapes images, as PIL images."""
    from PIL import Image

    from captioner.data.shapes import generate_dataset

    generate_dataset(tmp / "shapes", {"bench": IMAGES}, seed=6161)
    return [Image.open(p).convert("RGB") for p in sorted((tmp / "shapes" / "images" / "bench").glob("*.png"))]


def export_folders(out: Path, tiny: bool, only: list[str]) -> None:
    """The captioner's ONNX folders (fp32 and int8) for each encoder a chosen model needs, unless there."""
    from captioner.io.export import export

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        images(tmp, tiny)
        for name, (encoder, form) in OURS.items():
            folder = out / f"{encoder}-{form}"
            if form == "torch" or name not in only or (folder / "config.json").is_file():
                continue
            print(f"exporting {folder.name} ...", file=sys.stderr, flush=True)
            int8 = {"int8": "arithmetic", "int8w": "weights"}.get(form)
            export(paper_captioner(encoder, tiny), folder, onnx=True, int8=int8,
                   calibration=tmp / "shapes" / "images" if int8 else None)


# ------------------------------------------------------------------ one model's process

def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM: getrusage's ru_maxrss would keep the parent's
    peak across the exec that started it)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def worker(name: str, folders: Path, tiny: bool, threads: int) -> None:
    """Serve one model on stdin: "run B" captions the first B images (batch B) and answers the
    seconds; "quit" answers the peak RSS. Says "ready" with the FLOPs per image first."""
    with tempfile.TemporaryDirectory() as tmp:
        pics = images(Path(tmp), tiny)
    flops, run = None, None
    if name in OURS and OURS[name][1] != "torch":
        import numpy as np

        from captioner.onnx.runtime import OnnxCaptioner  # no torch in this process
        from captioner.onnx.search import beam_search

        rt = OnnxCaptioner(folders / f"{OURS[name][0]}-{OURS[name][1]}", threads=threads,
                           spin=name.endswith(" spinning"))
        pixels = np.stack([rt.preprocess.array(p) for p in pics])  # (8, H, W, 3)
        opts = rt.options(beam_size=BEAM, max_len=WORDS)

        def run(b):
            start = time.perf_counter()
            ann, keys, h0, c0, _ = rt.encode(rt.preprocess.normalize_array(pixels[:b]))
            encoded = time.perf_counter()
            found = beam_search(rt.step, ann, keys, h0, c0, rt.tokens, opts)
            done = time.perf_counter()
            return {"seconds": done - start, "encoder": encoded - start, "search": done - encoded,
                    "words": statistics.mean(len(d.ids) for d in found)}
    else:
        import torch
        from torch.utils.flop_counter import FlopCounterMode

        torch.set_num_threads(threads)
        if name in OURS:
            from captioner.inference import DecodeOptions

            cap = paper_captioner(OURS[name][0], tiny)
            batch = torch.stack([cap.preprocess.pixels(p) for p in pics])  # (8, 3, H, W) uint8
            opts = DecodeOptions(beam_size=BEAM, max_len=WORDS)

            def call(b):
                return cap.caption_batch(batch[:b], opts)
        else:
            model, size, kw = peer(name, tiny)
            from captioner.data.images import Preprocess

            pre = Preprocess(size=(size, size), mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))  # both peers' default
            batch = torch.stack([pre(p) for p in pics])

            def call(b):
                return model.generate(pixel_values=batch[:b], **kw)

        def run(b):
            with torch.inference_mode():
                start = time.perf_counter()
                call(b)
                return {"seconds": time.perf_counter() - start}

        with torch.inference_mode():
            call(1)  # warm-up, then the count
            with FlopCounterMode(display=False) as counter:
                call(1)
        flops = counter.get_total_flops()
    run(1)
    run(IMAGES)
    print(json.dumps({"ready": name, "flops": flops}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "run":
            print(json.dumps(run(int(cmd[1]))), flush=True)
        elif cmd[0] == "quit":
            print(json.dumps({"peak_rss_mb": peak_rss_mb()}), flush=True)
            return


# ------------------------------------------------------------------ the run

class Worker:
    def __init__(self, name: str, args: argparse.Namespace, folders: Path):
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT)}
        cmd = [sys.executable, __file__, "--worker", name, "--folders", str(folders), "--threads", str(args.threads)]
        self.name = name
        self.proc = subprocess.Popen(cmd + (["--tiny"] if args.tiny else []), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self.flops = self.ask(None)["flops"]

    def ask(self, command: str | None) -> dict:
        if command is not None:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name}'s process ended (exit code {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> float:
        peak = self.ask("quit")["peak_rss_mb"]
        self.proc.wait()
        return peak


def matmul_peak(threads: int, tiny: bool) -> float:
    """GFLOP/s of one large fp32 matrix product on ``threads`` threads (the best of five)."""
    import torch

    torch.set_num_threads(threads)
    n = 256 if tiny else 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--threads", type=int, default=2, help="threads of every model (default 2)")
    ap.add_argument("--folders", type=Path, default=None,
                    help="where the captioner's ONNX exports are kept between runs (default: a temporary folder)")
    ap.add_argument("--only", nargs="+", default=None, choices=[*OURS, *PEERS], help="these models only")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes: a check that every line runs")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.folders, args.tiny, args.threads)
        return 0
    names = args.only or [*OURS, *PEERS]
    with tempfile.TemporaryDirectory() as tmp:
        folders = args.folders or Path(tmp)
        export_folders(folders, args.tiny, names)
        peak = matmul_peak(args.threads, args.tiny)
        workers = [Worker(n, args, folders) for n in names]
        flops = {w.name: w.flops for w in workers}
        for name, (encoder, form) in OURS.items():  # the graphs do the torch form's arithmetic
            if form != "torch" and name in flops:
                flops[name] = flops.get(f"{encoder} torch")
        times = {n: {1: [], IMAGES: []} for n in names}
        parts = {n: [] for n in names}
        for _ in range(args.rounds):
            for w in workers:
                for i in range(2):  # batch 1: two images
                    r = w.ask("run 1")
                    times[w.name][1].append(r["seconds"])
                    if "encoder" in r:
                        parts[w.name].append(r)
                times[w.name][IMAGES].append(w.ask(f"run {IMAGES}")["seconds"] / IMAGES)
        rss = {w.name: w.close() for w in workers}
    report(names, times, parts, flops, rss, peak, args)
    return 0


def report(names, times, parts, flops, rss, peak, args) -> None:
    ms = {n: {b: statistics.median(t) * 1000 for b, t in times[n].items()} for n in names}
    print(f"{args.threads} threads, beam {BEAM}, {WORDS} words, {args.rounds} interleaved rounds"
          f"{', TINY SIZES (figures mean nothing)' if args.tiny else ''}; one {2048 if not args.tiny else 256}^2 "
          f"fp32 matrix product: {peak:.1f} GFLOP/s")
    head = (f"{'model':<29}{'ms/img b1':>10}{'ms/img b8':>10}{'x base b1':>10}{'x base b8':>10}{'GFLOP/img':>10}"
            f"{'GFLOP/s b1':>11}{'GFLOP/s b8':>11}{'% peak b8':>10}{'RSS MB':>8}  bound")
    print(head)
    base = ms.get(BASELINE)
    for n in names:
        f = flops.get(n)
        rate = {b: f / (ms[n][b] / 1000) / 1e9 for b in ms[n]} if f else None
        share = rate[IMAGES] / peak if rate else None
        bound = "" if share is None else "compute" if share >= 0.5 else "per-call overhead and memory traffic"
        ratio = {b: ms[n][b] / base[b] for b in ms[n]} if base else None

        def cell(x, width: int, spec: str, unit: str = "") -> str:
            return f"{format(x, spec) + unit if x is not None else '-':>{width}}"
        print(f"{n:<29}{ms[n][1]:>10.1f}{ms[n][IMAGES]:>10.1f}{cell(ratio and ratio[1], 10, '.2f', 'x')}"
              f"{cell(ratio and ratio[IMAGES], 10, '.2f', 'x')}{cell(f and f / 1e9, 10, '.2f')}"
              f"{cell(rate and rate[1], 11, '.1f')}{cell(rate and rate[IMAGES], 11, '.1f')}"
              f"{cell(share and share * 100, 10, '.0f', '%')}{rss[n]:>8.0f}  {bound or '-'}")
    for n in names:
        if parts[n]:
            enc = statistics.median(p["encoder"] for p in parts[n]) * 1000
            search = statistics.median(p["search"] for p in parts[n]) * 1000
            words = statistics.mean(p["words"] for p in parts[n])
            print(f"{n} at batch 1: encoder {enc:.1f} ms, search {search:.1f} ms ({search / enc:.2f}x the encoder; "
                  f"{words:.1f} tokens per caption)")
    print("targets:")
    if base and "vit-gpt2" in ms:
        for b, need in ((1, 10), (IMAGES, 8)):
            got = ms["vit-gpt2"][b] / base[b]
            print(f"  {BASELINE} vs vit-gpt2 at batch {b}: {got:.1f}x faster (target >= {need}x): "
                  f"{'met' if got >= need else 'missed'}")
    if parts.get(BASELINE):
        enc = statistics.median(p["encoder"] for p in parts[BASELINE])
        search = statistics.median(p["search"] for p in parts[BASELINE])
        print(f"  search <= encoder at batch 1 ({BASELINE}): {search * 1000:.1f} vs {enc * 1000:.1f} ms: "
              f"{'met' if search <= enc else 'missed'}")
    if BASELINE in rss:
        print(f"  peak RSS of the runtime at paper size <= 600 MB: {rss[BASELINE]:.0f} MB: "
              f"{'met' if rss[BASELINE] <= 600 else 'missed'}")


if __name__ == "__main__":
    sys.exit(main())
