"""Decoder speed at the paper's COCO sizes, on precomputed annotations.

    python benchmarks/bench_decoder.py [--device cpu] [--repeats 5] [--batch 32] [--previous] [--demo]

L=196 locations, D=2048, hidden 512, attention 512, embedding 512, vocabulary 10,000,
batch 32 (--batch B), 20 steps. Prints teacher-forced forward+backward steps/s, and
beam-search (k=3) images/s at batch 1 and batch B (the batched search runs B images x k
beams as one tensor program). --demo and --search-demo keep their own batch of 32.

--previous also times the previous training step (the decoder run step by step,
``forward_stepwise``, with the kernels off: autograd's additive scores), interleaved with
the current one.
--demo takes demo-soft's whole model instead (its small8 encoder trained from scratch,
128 px images, 128/256/128, 30 words, captions of 5 to 12 words), training only.
--model KEY=VALUE (repeatable) changes the model's attention, e.g. --model heads=4, or
--model local_window=2 --model local_width=learned, --model score=cosine.
--tiny: tiny sizes (a 4x4 grid, D=32, 16/16/16, V=50, 4 steps), for the GPU check's quick CPU
run: every line of the tool runs, its figures mean nothing.
--search-demo N: beam search (k=3, up to 20 words) with a bundled demo model on N
generated shapes images, batch 32: images/s and the decoder steps each image took (the
search runs until no open beam can beat the best finished caption, so the steps depend
on the model, not only on the caption lengths).
To time it before and after a change, run it at both commits with benchmarks/bench_revisions.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
import torch.nn.functional as F

from captioner.model.decoder import Decoder, ModelConfig, attention_penalty
from captioner.model.encoders import Annotations
from captioner.search.decoding import beam_search
from captioner.search.options import DecodeOptions, Tokens

SIZES = dict(vocab_size=10_000, annotation_dim=2048, embed_dim=512, hidden_dim=512, attention_dim=512)
L, GRID, BATCH, STEPS = 196, (14, 14), 32, 20
TINY = dict(vocab_size=50, annotation_dim=32, embed_dim=16, hidden_dim=16, attention_dim=16)  # --tiny, on a 4x4 grid


def _timed(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def compare_previous(step_now, step_previous, repeats: int) -> None:
    """Interleaved rounds of the current and the previous training step; the median ratio."""
    import statistics

    from captioner.model import kernels

    def previous() -> None:
        setting = kernels.set_enabled(False)  # autograd's plain additive scores
        try:
            step_previous()
        finally:
            kernels.set_enabled(setting)

    step_now()
    previous()
    now, before = [], []
    for _ in range(repeats):
        for fn, times in ((step_now, now), (previous, before)):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    ratios = [b / n for n, b in zip(now, before)]
    print(f"training step: {1 / statistics.median(now):.2f} steps/s, previous form "
          f"{1 / statistics.median(before):.2f} steps/s: {statistics.median(ratios):.2f}x "
          f"(rounds: {', '.join(f'{r:.2f}' for r in ratios)})")


def _model_options(items: list[str]) -> dict:
    """KEY=VALUE strings -> ModelConfig fields (numbers as int or float)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in {f.name for f in dataclasses.fields(ModelConfig)}:
            raise ValueError(f"--model {item!r}: expected FIELD=VALUE with a ModelConfig field")
        for kind in (int, float):
            try:
                out[key] = kind(value)
                break
            except ValueError:
                out[key] = value
    return out


def demo(args) -> None:
    from captioner.model.decoder import CaptionModel
    from captioner.train.losses import caption_log_likelihood

    torch.manual_seed(0)
    model = CaptionModel(ModelConfig(vocab_size=30, encoder="small8", image_size=(128, 128), embed_dim=128,
                                     hidden_dim=256, attention_dim=128, dropout=0.3, **args.model)).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    lengths = torch.randint(7, 15, (32,))  # <start> + 5..12 words + <end>
    tokens = torch.randint(4, 30, (32, int(lengths.max())))
    tokens[:, 0] = 1
    images = torch.randn(32, 3, 128, 128)

    def step(stepwise: bool):
        def run() -> None:
            ann = model.encode(images)
            out = (model.decoder.forward_stepwise if stepwise else model.decoder)(ann, tokens, lengths)
            loss = -caption_log_likelihood(out, tokens[:, 1:]).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return run

    print(f"demo-soft's model, batch 32, CPU, {torch.get_num_threads()} threads"
          + "".join(f", {k}={v}" for k, v in args.model.items()))
    compare_previous(step(False), step(True), args.repeats)


def search_demo(args) -> None:
    """Beam search as users run it: a demo model on shapes images, where captions end."""
    import tempfile
    from pathlib import Path

    from captioner.data.images import load_image
    from captioner.data.shapes import generate_dataset
    from captioner.inference import Captioner, DecodeOptions

    cap = Captioner.load(args.weights)
    with tempfile.TemporaryDirectory() as tmp:
        generate_dataset(Path(tmp), {"test": args.search_demo}, seed=args.seed)
        images = torch.stack([cap.preprocess(load_image(p))
                              for p in sorted((Path(tmp) / "images" / "test").glob("*.png"))])
    steps, real_step = [], cap.model.decoder.step

    def counting_step(y, *a, **kw):
        steps.append(y.shape[0])
        return real_step(y, *a, **kw)

    opts = DecodeOptions(beam_size=3, max_len=20)

    def run() -> None:
        for i in range(0, len(images), 32):
            cap.caption_batch(images[i:i + 32], opts)

    t = _timed(run, args.repeats)
    cap.model.decoder.step = counting_step
    try:
        run()
    finally:
        del cap.model.decoder.step
    beam_rows = sum(steps)  # one row per image and beam, every step
    print(f"{args.weights}, {len(images)} shapes images (seed {args.seed}), beam 3, batch 32, CPU, "
          f"{torch.get_num_threads()} threads")
    print(f"beam search: {len(images) / t:.1f} images/s; decoder steps per image {beam_rows / 3 / len(images):.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats; the best is reported")
    ap.add_argument("--batch", type=int, default=BATCH,
                    help=f"captions per training step and images of the batched search (default {BATCH})")
    ap.add_argument("--previous", action="store_true", help="also time the previous training step, interleaved")
    ap.add_argument("--demo", action="store_true", help="demo-soft's whole model instead (training only, CPU)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--search-demo", type=int, default=0, metavar="N",
                    help="beam search with a bundled demo model on N generated shapes images instead")
    ap.add_argument("--weights", default="demo-soft", help="the demo model of --search-demo (default demo-soft)")
    ap.add_argument("--seed", type=int, default=9102, help="the shapes images' seed for --search-demo")
    ap.add_argument("--model", action="append", default=[], metavar="FIELD=VALUE",
                    help="a model config field for the attention, e.g. heads=4 (repeatable)")
    ap.add_argument("--tiny", action="store_true",
                    help="tiny sizes (L=16, D=32, 16/16/16, V=50, 4 steps) instead of the paper's: a quick CPU run "
                         "of the code (benchmarks/gpu_check.py --quick), whose figures mean nothing")
    args = ap.parse_args()
    try:
        args.model = _model_options(args.model)
    except ValueError as e:
        ap.error(str(e))
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.demo:
        demo(args)
        return
    if args.search_demo:
        search_demo(args)
        return
    sizes, n_loc, grid, steps = (TINY, 16, (4, 4), 4) if args.tiny else (SIZES, L, GRID, STEPS)
    dev = torch.device(args.device)
    torch.manual_seed(0)
    decoder = Decoder(ModelConfig(**sizes, dropout=0.5, **args.model)).to(dev)
    opt = torch.optim.Adam(decoder.parameters(), lr=1e-4)

    batch = args.batch
    a = torch.randn(batch, n_loc, sizes["annotation_dim"], device=dev)
    tokens = torch.randint(4, sizes["vocab_size"], (batch, steps + 1), device=dev)
    tokens[:, 0] = 1
    lengths = torch.full((batch,), steps + 1, device=dev)

    def train_step() -> None:
        out = decoder(Annotations(a, grid), tokens, lengths)
        loss = (F.cross_entropy(out.logits.flatten(0, 1), tokens[:, 1:].flatten())
                + attention_penalty(out.alphas, out.mask))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()

    print(f"device {dev}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"sizes: L={n_loc} D={sizes['annotation_dim']} hidden={sizes['hidden_dim']} "
          f"attention={sizes['attention_dim']} embedding={sizes['embed_dim']} vocab={sizes['vocab_size']} "
          f"batch={batch} steps={steps}"
          + "".join(f" {k}={v}" for k, v in args.model.items()))
    decoder.train()
    t_train = _timed(train_step, args.repeats)
    if args.previous:
        def previous_step() -> None:
            out = decoder.forward_stepwise(Annotations(a, grid), tokens, lengths)
            loss = F.cross_entropy(out.logits.flatten(0, 1), tokens[:, 1:].flatten()) \
                + attention_penalty(out.alphas, out.mask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if dev.type == "cuda":
                torch.cuda.synchronize()
        compare_previous(train_step, previous_step, args.repeats)

    decoder.eval()
    # <end> never wins: every search runs the full 20 steps (the worst case).
    with torch.no_grad():
        decoder.L_o.bias[2] = -1e4

    def search(b: int):
        def run() -> None:
            beam_search(decoder, Annotations(a[:b], grid), Tokens(start=1, end=2, pad=0),
                        DecodeOptions(beam_size=3, max_len=steps))
            if dev.type == "cuda":
                torch.cuda.synchronize()
        return run

    t1 = _timed(search(1), args.repeats)
    tb = _timed(search(batch), args.repeats)
    print(f"teacher-forced forward+backward: {1 / t_train:.2f} steps/s ({batch / t_train:.1f} captions/s)")
    print(f"beam search k=3, batch 1:  {1 / t1:.2f} images/s")
    print(f"beam search k=3, batch {batch}: {batch / tb:.2f} images/s ({t1 * batch / tb:.1f}x batch 1)")


if __name__ == "__main__":
    main()
