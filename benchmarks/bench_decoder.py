"""Decoder speed at the paper's COCO sizes, on precomputed annotations.

    python benchmarks/bench_decoder.py [--device cpu] [--repeats 5]

L=196 locations, D=2048, hidden 512, attention 512, embedding 512, vocabulary 10,000,
batch 32, 20 steps. Prints teacher-forced forward+backward steps/s, and beam-search
(k=3) images/s at batch 1 and batch 32 (the batched search runs B images x k beams as
one tensor program).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from captioner.decoding import beam_search
from captioner.encoders import Annotations
from captioner.model import Decoder, ModelConfig, attention_penalty

SIZES = dict(vocab_size=10_000, annotation_dim=2048, embed_dim=512, hidden_dim=512, attention_dim=512)
L, GRID, BATCH, STEPS = 196, (14, 14), 32, 20


def _timed(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats; the best is reported")
    args = ap.parse_args()
    dev = torch.device(args.device)
    torch.manual_seed(0)
    decoder = Decoder(ModelConfig(**SIZES, dropout=0.5)).to(dev)
    opt = torch.optim.Adam(decoder.parameters(), lr=1e-4)

    a = torch.randn(BATCH, L, SIZES["annotation_dim"], device=dev)
    tokens = torch.randint(4, SIZES["vocab_size"], (BATCH, STEPS + 1), device=dev)
    tokens[:, 0] = 1
    lengths = torch.full((BATCH,), STEPS + 1, device=dev)

    def train_step() -> None:
        out = decoder(Annotations(a, GRID), tokens, lengths)
        loss = F.cross_entropy(out.logits.flatten(0, 1), tokens[:, 1:].flatten()) + attention_penalty(out.alphas, out.mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()

    decoder.train()
    t_train = _timed(train_step, args.repeats)

    decoder.eval()
    # <end> never wins: every search runs the full 20 steps (the worst case).
    with torch.no_grad():
        decoder.L_o.bias[2] = -1e4

    def search(b: int):
        def run() -> None:
            beam_search(decoder, Annotations(a[:b], GRID), start=1, end=2, pad=0, beam_size=3, max_len=STEPS)
            if dev.type == "cuda":
                torch.cuda.synchronize()
        return run

    t1 = _timed(search(1), args.repeats)
    t32 = _timed(search(32), args.repeats)
    print(f"device {dev}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"sizes: L={L} D=2048 hidden=512 attention=512 embedding=512 vocab=10000 batch={BATCH} steps={STEPS}")
    print(f"teacher-forced forward+backward: {1 / t_train:.2f} steps/s ({BATCH / t_train:.1f} captions/s)")
    print(f"beam search k=3, batch 1:  {1 / t1:.2f} images/s")
    print(f"beam search k=3, batch 32: {32 / t32:.2f} images/s ({t1 * 32 / t32:.1f}x batch 1)")


if __name__ == "__main__":
    main()
