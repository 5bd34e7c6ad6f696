"""The project's decoder against the popular PyTorch tutorial's, side by side in one run.

    python benchmarks/compare_tutorial.py PATH/TO/sgrvinod-tutorial [--rounds 3] [--device cpu]

PATH is the folder holding the tutorial's ``models.py`` (MIT licence; it is imported from
there by path, nothing of it is copied here). Both decoders get the paper's COCO sizes on
precomputed annotations: batch 32, L = 196 locations, D = 2048, embedding, hidden and
attention 512, vocabulary 10,000, 21 teacher-forced steps (the encoder is left out of both).

Measured in interleaved rounds (every round times each contender once, so a machine whose
speed drifts slows all of them alike), reported as the median over rounds:
  - training: steps/s of forward + backward + Adam step, each with its own loss and
    optimizer (the project's: -log p(y) + the doubly stochastic penalty with the scalar
    gate, Adam as ``captioner train`` builds it, one fused kernel per weight; the tutorial's:
    cross-entropy over its packed steps + its penalty, torch's per-parameter Adam as its
    train.py builds it), and, for reference, the project's decoder with the tutorial's
    per-parameter Adam (the decoder alone against the decoder) and run step by step
    (``forward_stepwise``, T calls of the decoding step);
  - beam search, k = 3, over the same images: the project's batched ``beam_search`` against
    the tutorial's per-image loop from its ``caption.py`` (re-implemented below with that
    loop's logic, calling the tutorial model's modules as caption.py does, integer division
    fixed). The end token is made unreachable in both, so every search runs all its steps.
It prints the ratios, the project's training GFLOP/s (counted matrix products, see
``train_flops``) and the machine's measured fp32 matrix-product peak.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pack_padded_sequence

from captioner.model.decoder import Decoder, ModelConfig, attention_penalty
from captioner.model.encoders import Annotations
from captioner.search.decoding import beam_search
from captioner.search.graph import SearchGraphs
from captioner.search.options import DecodeOptions, Tokens
from captioner.train.config import OptimConfig
from captioner.train.graphed import GraphedSoftStep, cuda_capture
from captioner.train.loop import build_optimizer
from captioner.train.losses import LossParts, caption_log_likelihood

V, D, E, H, A, L, GRID = 10_000, 2048, 512, 512, 512, 196, (14, 14)
START, END, PAD = 1, 2, 0


def load_tutorial(path: Path):
    """The tutorial's models.py imported by path (it builds nothing at import but a device)."""
    file = path / "models.py" if path.is_dir() else path
    if not file.is_file():
        print(f"error: no models.py at {path} (give the tutorial's folder)", file=sys.stderr)
        sys.exit(2)
    spec = importlib.util.spec_from_file_location("tutorial_models", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train_flops(b: int, t: int) -> float:
    """Matrix-product FLOPs of one project training step (forward 1x, backward 2x where the
    input needs a gradient, 1x where only the weight does). Elementwise work is not counted."""
    mm = lambda m, k, n: 2.0 * m * k * n  # noqa: E731
    keys = 2 * mm(b * L, D, A)  # W_a a once per image, and its weight gradient (a needs none)
    init = 2 * 2 * mm(b, D, H)  # f_init_h, f_init_c and their weight gradients
    per_step = (3 * mm(b, E + D + H, 4 * H)  # LSTM gates
                + 3 * (mm(b, H, A) + mm(b, H, 1))  # W_h h and the gate f_beta
                + 3 * mm(b * L, A, 1)  # w^T tanh(.)
                + 2 * mm(b, L, D)  # sum_i alpha_i a_i and its gradient to alpha
                + 3 * (mm(b, H, E) + mm(b, D, E) + mm(b, E, V)))  # deep output L_h, L_z, L_o
    return keys + init + t * per_step


def matmul_peak(device: torch.device, seconds: float = 0.5) -> float:
    """fp32 GFLOP/s of a large square product, the best of the runs timed in ``seconds``."""
    n = 2048
    x, y = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    best = float("inf")
    end = time.perf_counter() + seconds
    torch.mm(x, y)
    while time.perf_counter() < end or best == float("inf"):
        t = time.perf_counter()
        torch.mm(x, y)
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def tutorial_beam_search(dec, encoder_out: torch.Tensor, beam_size: int, max_steps: int) -> list[int]:
    """The tutorial's caption.py beam search (its caption_image_beam_search from the encoder's
    output on), one image: encoder_out (1, L, D). The anchor's algorithm, used here only for
    timing; two departures: '//' for the parent index (its '/' gives float indices), and when
    no beam has ended by the step limit the best unfinished one is returned (it would crash)."""
    k = beam_size
    enc = encoder_out.expand(k, -1, -1)  # (k, L, D)
    prev_words = torch.full((k, 1), START, dtype=torch.long, device=enc.device)
    seqs = prev_words
    top_scores = torch.zeros(k, 1, device=enc.device)
    seqs_alpha = torch.ones(k, 1, *GRID, device=enc.device)
    complete, complete_alpha, complete_scores = [], [], []
    step = 1
    h, c = dec.init_hidden_state(enc)
    while True:
        emb = dec.embedding(prev_words).squeeze(1)  # (s, E)
        awe, alpha = dec.attention(enc, h)  # (s, D), (s, L)
        alpha = alpha.view(-1, *GRID)
        gate = dec.sigmoid(dec.f_beta(h))
        awe = gate * awe
        h, c = dec.decode_step(torch.cat([emb, awe], dim=1), (h, c))
        scores = F.log_softmax(dec.fc(h), dim=1)
        scores = top_scores.expand_as(scores) + scores
        if step == 1:
            top_scores, top_words = scores[0].topk(k, 0, True, True)
        else:
            top_scores, top_words = scores.view(-1).topk(k, 0, True, True)
        prev_inds = top_words // V
        next_inds = top_words % V
        seqs = torch.cat([seqs[prev_inds], next_inds.unsqueeze(1)], dim=1)
        seqs_alpha = torch.cat([seqs_alpha[prev_inds], alpha[prev_inds].unsqueeze(1)], dim=1)
        incomplete = [i for i, w in enumerate(next_inds) if w != END]
        done = list(set(range(len(next_inds))) - set(incomplete))
        if done:
            complete.extend(seqs[done].tolist())
            complete_alpha.extend(seqs_alpha[done].tolist())
            complete_scores.extend(top_scores[done])
        k -= len(done)
        if k == 0:
            break
        seqs, seqs_alpha = seqs[incomplete], seqs_alpha[incomplete]
        h, c = h[prev_inds[incomplete]], c[prev_inds[incomplete]]
        enc = enc[prev_inds[incomplete]]
        top_scores = top_scores[incomplete].unsqueeze(1)
        prev_words = next_inds[incomplete].unsqueeze(1)
        if step >= max_steps:
            break
        step += 1
    if not complete:
        return seqs[0].tolist()
    return complete[complete_scores.index(max(complete_scores))]


def decoder_loss(dec: Decoder):
    """The project's loss as graphed.py takes it: (annotations, tokens, lengths, steps) -> LossParts."""
    def loss(a, tokens, lengths, steps) -> LossParts:
        out = dec(Annotations(a, GRID), tokens, lengths, steps=steps)
        nll = -caption_log_likelihood(out, tokens[:, 1:]).mean()
        penalty = attention_penalty(out.alphas, out.mask)
        return LossParts(nll + penalty, nll.detach(), penalty.detach(), out.mask.sum())
    return loss


CAPTURE = cuda_capture  # how a graph is recorded (a test hands in a stand-in with a graph's contract)
GRAPH_TOLERANCE = 1e-4  # the graphed step's loss and gradients, relative to the plain step's
# A parameter's gradient is measured against its own largest entry, or this share of the largest
# entry of all, whichever is larger (gradient_gap)
GRADIENT_FLOOR = 1e-2


def gradient_gap(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """The largest difference between two sets of gradients, each parameter's relative to its own
    largest entry, or to GRADIENT_FLOOR of the largest entry of all when its own is smaller. A
    gradient that is zero in exact arithmetic is rounding noise, and two noises differ by 100%:
    attention's v.bias shifts every score alike and the softmax ignores the shift, so on a GPU its
    gradient was some 1e-9 where the others' reached 1e-2, and the graphed and eager steps'
    noises differed by 150%."""
    sizes = [float(w.abs().max()) for w in want]
    floor = GRADIENT_FLOOR * max(sizes, default=0.0)
    return max((float((g - w).abs().max()) / max(size, floor, 1e-30) for g, w, size in zip(got, want, sizes)),
               default=0.0)


def _graphed(dec: Decoder, device: torch.device) -> GraphedSoftStep:
    return GraphedSoftStep(decoder_loss(dec), list(dec.parameters()),
                           lambda: torch.autocast(device.type, enabled=False), capture=CAPTURE)


def graphed_step(dec: Decoder, opt, a, tokens, lengths):
    """The project's training step with its forward and backward replayed as a CUDA graph."""
    step = _graphed(dec, a.device)

    def run() -> None:
        step.step(a, tokens, lengths)  # one shape: always its graph
        torch.nn.utils.clip_grad_norm_(dec.parameters(), 5.0)
        opt.step()
        _sync(a.device)
    return run


def search_graphs_check(dec: Decoder, a: torch.Tensor, steps: int, dev: torch.device) -> tuple[bool, Callable]:
    """Record the beam search (k = 3) of images ``a`` as a CUDA graph (captioner.search_graph):
    whether it gives the plain search's captions, and the timed run of its replay."""
    graphs = SearchGraphs(dec)
    tokens, options = Tokens(start=START, end=END, pad=PAD), DecodeOptions(beam_size=3, max_len=steps)

    def run() -> list:
        with torch.no_grad():
            out = graphs.search(Annotations(a, GRID), tokens, options)
        _sync(dev)
        return out

    with torch.no_grad():
        plain = beam_search(dec, Annotations(a, GRID), tokens, options)
    return [d.ids for d in run()] == [d.ids for d in plain], run


def graphs_check(cfg: ModelConfig, dev: torch.device, a, tokens, lengths) -> tuple[str, bool]:
    """The graphed step's loss and gradients against the plain step's, from the same weights,
    without dropout (its masks differ), over two batches of captions of different lengths:
    a line saying how far apart they are, and whether that is within GRAPH_TOLERANCE."""
    torch.manual_seed(1)
    dec = Decoder(ModelConfig.from_dict({**cfg.to_dict(), "dropout": 0.0})).to(dev).train()
    params = list(dec.parameters())
    step = _graphed(dec, dev)
    worst_loss = worst_grad = 0.0
    for seed in (0, 1, 0):  # the third replays the first batch's graph
        g = torch.Generator().manual_seed(seed)
        lens = torch.randint(3, tokens.shape[1] + 1, (tokens.shape[0],), generator=g).to(dev)
        lens = lens.clamp(max=tokens.shape[1] - 4 * seed)  # the longest caption sets the graph's steps
        lens[0] = tokens.shape[1] - 4 * seed
        toks = tokens[:, : int(lens.max())]
        dec.zero_grad(set_to_none=True)
        plain = decoder_loss(dec)(a, toks, lens, None)  # steps None: the plain forward
        plain.loss.backward()
        want_loss = float(plain.loss.detach())
        del plain  # its autograd graph must not outlive it: see graphed.py, _capture
        want = [p.grad.clone() for p in params]
        got = step.step(a, toks, lens)
        worst_loss = max(worst_loss, abs(float(got.loss) - want_loss) / abs(want_loss))
        worst_grad = max(worst_grad, gradient_gap([p.grad for p in params], want))
    ok = worst_loss <= GRAPH_TOLERANCE and worst_grad <= GRAPH_TOLERANCE
    return (f"{len(step.graphs)} graphs; largest relative difference: loss {worst_loss:.1e}, "
            f"gradients {worst_grad:.1e} (of each gradient's largest entry, at least "
            f"{GRADIENT_FLOOR:g} of the largest of all): "
            + ("within" if ok else "BEYOND") + f" {GRAPH_TOLERANCE:.0e}"), ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tutorial", type=Path, help="folder of the tutorial's models.py (or the file itself)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported (default 3)")
    ap.add_argument("--train-steps", type=int, default=2, help="training steps per contender per round (default 2)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=21, help="teacher-forced steps per caption (default 21)")
    ap.add_argument("--beam-images", type=int, default=32, help="images per beam-search round, 0 to skip")
    ap.add_argument("--beam-steps", type=int, default=20, help="words per beam search (default 20)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--compile", default="", metavar="BACKEND",
                    help="also time the project's step under torch.compile with this backend (e.g. inductor)")
    ap.add_argument("--no-stepwise", action="store_true", help="leave out the project's step-by-step reference")
    ap.add_argument("--graphs", action="store_true",
                    help="also time the project's step with its forward and backward replayed as a CUDA graph "
                         "(train/graphed.py; CUDA only), after checking its gradients against the plain step's")
    args = ap.parse_args()
    if args.rounds < 1 or args.train_steps < 1 or args.batch < 1 or args.steps < 1:
        ap.error("--rounds, --train-steps, --batch and --steps must be >= 1")
    if args.graphs and not args.device.startswith("cuda"):
        ap.error("--graphs: CUDA graphs need --device cuda")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    tut = load_tutorial(args.tutorial)
    tut.device = dev  # its forward allocates on the module's global device

    torch.manual_seed(0)
    b, t = args.batch, args.steps
    a = torch.randn(b, L, D, device=dev)
    tokens = torch.randint(4, V, (b, t + 1), device=dev)
    tokens[:, 0] = START
    lengths = torch.full((b,), t + 1, device=dev)

    cfg = ModelConfig(vocab_size=V, annotation_dim=D, embed_dim=E, hidden_dim=H, attention_dim=A, dropout=0.5)
    ours = Decoder(cfg).to(dev).train()
    theirs = tut.DecoderWithAttention(attention_dim=A, embed_dim=E, decoder_dim=H, vocab_size=V,
                                      encoder_dim=D, dropout=0.5).to(dev).train()
    def project_optimizer(model):  # as `captioner train` builds it
        return build_optimizer([{"params": list(model.parameters()), "lr": 4e-4}], OptimConfig())

    opt_ours = project_optimizer(ours)
    opt_theirs = torch.optim.Adam(theirs.parameters(), lr=4e-4)
    opt_plain = torch.optim.Adam(ours.parameters(), lr=4e-4)  # torch's default, as the tutorial's
    compiled = None
    if args.compile:
        compiled = Decoder(cfg).to(dev).train()
        compiled.compile_step(backend=args.compile)
        opt_compiled = project_optimizer(compiled)

    def project_step(dec, opt, stepwise=False):
        def run() -> None:
            fn = dec.forward_stepwise if stepwise else dec
            out = fn(Annotations(a, GRID), tokens, lengths)
            loss = -caption_log_likelihood(out, tokens[:, 1:]).mean() + attention_penalty(out.alphas, out.mask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(dec.parameters(), 5.0)
            opt.step()
            _sync(dev)
        return run

    def tutorial_step() -> None:
        # The tutorial's train.py: scores over packed steps, cross-entropy, penalty, clip by value.
        scores, caps, decode_lengths, alphas, _ = theirs(a.view(b, *GRID, D), tokens, lengths.unsqueeze(1))
        scores = pack_padded_sequence(scores, decode_lengths, batch_first=True).data
        targets = pack_padded_sequence(caps[:, 1:], decode_lengths, batch_first=True).data
        loss = F.cross_entropy(scores, targets) + ((1.0 - alphas.sum(dim=1)) ** 2).mean()
        opt_theirs.zero_grad(set_to_none=True)
        loss.backward()
        for p in theirs.parameters():
            if p.grad is not None:
                p.grad.clamp_(-5.0, 5.0)
        opt_theirs.step()
        _sync(dev)

    beam_a = a[: args.beam_images]

    def project_beam() -> None:
        with torch.no_grad():
            beam_search(ours, Annotations(beam_a, GRID), Tokens(start=START, end=END, pad=PAD),
                        DecodeOptions(beam_size=3, max_len=args.beam_steps))
        _sync(dev)

    project_beam_graphed = None

    def tutorial_beam() -> None:
        with torch.no_grad():
            for i in range(beam_a.shape[0]):
                tutorial_beam_search(theirs, beam_a[i: i + 1], 3, args.beam_steps)
        _sync(dev)

    train_runs = {"tutorial": tutorial_step, "project": project_step(ours, opt_ours),
                  "project, per-parameter Adam": project_step(ours, opt_plain)}
    if not args.no_stepwise:
        train_runs["project, step by step"] = project_step(ours, opt_ours, stepwise=True)
    if compiled is not None:
        train_runs[f"project, compiled ({args.compile})"] = project_step(compiled, opt_compiled)
    if args.graphs:
        line, same = graphs_check(cfg, dev, a, tokens, lengths)
        print(f"CUDA graph against the plain step: {line}", flush=True)
        if not same:  # a faster step that trains something else is not worth timing
            sys.exit(1)
        graphed_dec = Decoder(cfg).to(dev).train()
        train_runs["project, CUDA graph"] = graphed_step(graphed_dec, project_optimizer(graphed_dec), a, tokens,
                                                         lengths)
    print(f"device {dev}, torch {torch.__version__}, {torch.get_num_threads()} CPU threads; "
          f"batch {b}, L={L}, D={D}, {E}/{H}/{A}, vocabulary {V}, {t} steps", flush=True)
    for name, fn in train_runs.items():  # warm-up (and compilation)
        fn()
    if args.beam_images:
        ours.eval()
        theirs.eval()
        with torch.no_grad():  # <end> never wins: every search runs all its steps (the worst case)
            ours.L_o.bias[END] = -1e4
            theirs.fc.bias[END] = -1e4
        project_beam()
        tutorial_beam_search(theirs, beam_a[:1], 3, args.beam_steps)
        if args.graphs:  # recorded here; the plain search's captions, or no timing
            same, project_beam_graphed = search_graphs_check(ours, beam_a, args.beam_steps, dev)
            print(f"beam search as CUDA graphs against the plain search: {'same' if same else 'OTHER'} captions",
                  flush=True)
            if not same:
                sys.exit(1)
        ours.train()
        theirs.train()

    times: dict[str, list[float]] = {name: [] for name in train_runs}
    beam_runs = {"tutorial": tutorial_beam, "project": project_beam}
    if project_beam_graphed is not None:
        beam_runs["project, CUDA graph"] = project_beam_graphed
    beam_times: dict[str, list[float]] = {name: [] for name in beam_runs}
    peaks: list[float] = []  # measured every round too: the machine's speed drifts
    for r in range(args.rounds):
        peaks.append(matmul_peak(dev))
        for name, fn in train_runs.items():
            start = time.perf_counter()
            for _ in range(args.train_steps):
                fn()
            times[name].append((time.perf_counter() - start) / args.train_steps)
        if args.beam_images:
            ours.eval()
            theirs.eval()
            for name, fn in beam_runs.items():
                start = time.perf_counter()
                fn()
                beam_times[name].append(time.perf_counter() - start)
            ours.train()
            theirs.train()
        line = ", ".join(f"{n} {1 / times[n][-1]:.3f}" for n in train_runs)
        if args.beam_images:
            line += "; beam images/s: " + ", ".join(f"{n} {beam_a.shape[0] / beam_times[n][-1]:.2f}"
                                                   for n in beam_times)
        print(f"round {r + 1}/{args.rounds}: train steps/s: {line}; matrix-product peak {peaks[-1]:.0f} GFLOP/s",
              flush=True)

    peak = max(peaks)
    med = {n: statistics.median(v) for n, v in times.items()}

    def ratio(table: dict[str, list[float]], name: str) -> float:
        """The median over rounds of the tutorial's time / this one's, each pair from one round."""
        return statistics.median(t / s for t, s in zip(table["tutorial"], table[name]))

    flops = train_flops(b, t)
    print("\ntraining (medians over rounds; ratios: the median of each round's ratio):")
    for n, s in med.items():
        extra = f", {flops / s / 1e9:.0f} GFLOP/s ({flops / s / 1e9 / peak:.0%} of the peak)" \
            if n.startswith("project") else ""
        print(f"  {n:28s} {1 / s:6.3f} steps/s  {ratio(times, n):5.2f}x the tutorial{extra}")
    print(f"  one project step: {flops / 1e9:.1f} GFLOP of matrix products")
    if args.beam_images:
        bm = {n: statistics.median(v) for n, v in beam_times.items()}
        n_img = beam_a.shape[0]
        print(f"beam search k=3, {n_img} images, {args.beam_steps} words (medians over rounds):")
        print(f"  tutorial (one image at a time) {n_img / bm['tutorial']:7.2f} images/s")
        print(f"  project (batched)              {n_img / bm['project']:7.2f} images/s  "
              f"{ratio(beam_times, 'project'):5.2f}x the tutorial")
        if "project, CUDA graph" in bm:
            print(f"  project (batched, CUDA graph)  {n_img / bm['project, CUDA graph']:7.2f} images/s  "
                  f"{ratio(beam_times, 'project, CUDA graph'):5.2f}x the tutorial")
    print(f"fp32 matrix-product peak (2048 x 2048 x 2048, the best of every round's 0.5 s): {peak:.0f} GFLOP/s")
    print(f"SUMMARY train {ratio(times, 'project'):.2f}x, "
          + (f"beam {ratio(beam_times, 'project'):.2f}x, " if args.beam_images else "")
          + f"train {flops / med['project'] / 1e9:.0f} GFLOP/s, {flops / med['project'] / 1e9 / peak:.0%} "
          f"of a {peak:.0f} GFLOP/s peak")

if __name__ == "__main__":
    main()
