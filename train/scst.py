"""Self-critical sequence training (Rennie et al. 2017): fine-tune a captioner on the
CIDEr-D of its own sampled captions.

Legend: B images in the batch (this process's share), k samples per image, R = B k rows,
T steps, V vocabulary.

For image i, k captions w^ij ~ p(w | I_i) are drawn (multinomial, temperature 1) and each
is rewarded with r_ij = CIDEr-D(w^ij, S_i) against the image's training references S_i,
the document frequencies those of the training split's references
(:class:`captioner.evaluation.cider.CiderD`, built once). The loss

    L = -1/(B k) sum_ij (r_ij - b_ij) log p(w^ij | I_i)

has the REINFORCE gradient of the expected reward; a baseline b_ij that does not depend
on w^ij leaves it unbiased and lowers its variance:

    loo (default): b_ij = 1/(k - 1) sum_{j' != j} r_ij'   the image's other samples' mean
    greedy (Rennie's): b_ij = CIDEr-D(w^_i, S_i)          w^_i the greedy caption

Sampling: <end> is drawn like any word and belongs to the caption and to its
probability. After max_len words one more word is drawn: <end> ends the caption, any
other cuts it off at max_len words; the probability of a cut caption is that of what
happened, p(w_1..w_max_len) (1 - p(<end> | w_1..w_max_len)), and its reward is that of
its max_len words (no <end> is credited to it).

Two passes. The samples are drawn step by step without gradient, from a torch.Generator
of their own (saved with the run, so that a resumed run draws the same); then their
log-probabilities are computed with gradient by the teacher-forced forward, through the
model as the training loop holds it (DistributedDataParallel under torchrun), which
averages the gradients over processes as for cross-entropy. Rewards and baselines are
per image, so each process needs only its own images. The encoder runs once per image.

Both passes (and the greedy caption) run with the model in eval mode, whatever mode the
training loop holds it in: the samples come from the model as it decodes at test time,
and the second pass computes exactly the probabilities they were drawn with. Dropout is
off (with it, each pass would draw its own masks), and a trainable encoder's batch norm
normalises with its running statistics and leaves them as they are (in training mode
the samples would depend on the other images of the batch, and the statistics would
move with every SCST step). The modes are put back afterwards.

Hard attention uses the expected context sum_i alpha_ti a_i in both passes, no location
is sampled: that is how a hard-attention model decodes by default, so self-critical
training tunes what is evaluated, and the score function carries the words' variance
only (sampled locations would add log p(s | a) to it, and the noise of L cells a step).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from captioner.data.vocab import Vocabulary
from captioner.evaluation.cider import CiderD
from captioner.model.decoder import CaptionModel, Decoder
from captioner.model.encoders import Annotations
from captioner.search.decoding import greedy
from captioner.search.options import DecodeOptions, Tokens

from .config import ScstConfig, check_scst_section
from .losses import LossParts, token_log_prob


@dataclass
class Samples:
    """k sampled captions per image, image-major (rows i k .. i k + k - 1 are image i's)."""

    tokens: torch.Tensor  # (R, T + 1) <start> w_1 .. w_n <end> <pad>..; a cut caption ends in <end> too
    lengths: torch.Tensor  # (R,) tokens, <start> and that last <end> included
    ended: torch.Tensor  # (R,) True: drew <end>; False: cut off at max_len words
    log_probs: torch.Tensor  # (R,) log p of each caption as drawn (no gradient)
    words: list[list[str]]  # (R,) each caption's words, <end> not included


@torch.no_grad()
def sample_captions(decoder: Decoder, ann: Annotations, vocab: Vocabulary, *, k: int, max_len: int,
                    generator: torch.Generator) -> Samples:
    """k captions per image drawn from p(w | a) at temperature 1; <start> and <pad> are never
    drawn (as in decoding). Rows that ended draw on, their draws unused, until every row
    has ended: the generator's use depends only on the longest caption."""
    start, end, pad = vocab.start, vocab.end, vocab.pad
    ann = decoder.annotate(ann)
    a = ann.vectors  # (B, L, D)
    keys = decoder.attention.prepare(a)  # once per image, shared by its k rows
    h, c = decoder.init_state(a)
    h, c = h.repeat_interleave(k, 0), c.repeat_interleave(k, 0)  # (R, H)
    rows = h.shape[0]
    y = torch.full((rows,), start, dtype=torch.long, device=a.device)
    done = torch.zeros(rows, dtype=torch.bool, device=a.device)
    ended = torch.zeros(rows, dtype=torch.bool, device=a.device)
    ids, logps = [], []
    for t in range(max_len + 1):
        o = decoder.step(y, h, c, a, keys, ann.grid)
        h, c = o.h, o.c
        logp = _allowed_log_softmax(o.logits.float(), start, pad)  # (R, V)
        y = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)  # (R,)
        step = logp.gather(1, y.unsqueeze(1)).squeeze(1)
        ended = ended | (~done & (y == end))
        if t == max_len:  # past the last word: <end>, or the caption is cut off
            cut = ~done & (y != end)
            step = torch.where(cut, _log_not(logp, end), step)
            y = torch.where(cut, torch.full_like(y, end), y)  # marks the step for teacher forcing
        y = torch.where(done, torch.full_like(y, pad), y)
        logps.append(torch.where(done, torch.zeros_like(step), step))
        ids.append(y)
        done = done | (y == end)
        if bool(done.all()):
            break
    body = torch.stack(ids, 1)  # (R, T)
    tokens = torch.cat([torch.full((rows, 1), start, dtype=torch.long, device=a.device), body], 1)
    lengths = 1 + (body != pad).sum(1)
    words = [[vocab.words[i] for i in row[: n - 2]] for row, n in zip(body.tolist(), lengths.tolist())]
    return Samples(tokens, lengths, ended, torch.stack(logps, 1).sum(1), words)


def _allowed_log_softmax(logits: torch.Tensor, *never: int) -> torch.Tensor:
    """log softmax over the words that may be drawn: ``never`` get probability 0."""
    return F.log_softmax(logits.index_fill(-1, torch.tensor(never, device=logits.device), float("-inf")), -1)


def _log_not(logp: torch.Tensor, word: int) -> torch.Tensor:
    """log (1 - p(word)) from log-probabilities (..., V), as a sum over the other words (stable)."""
    return torch.logsumexp(logp.index_fill(-1, torch.tensor([word], device=logp.device), float("-inf")), -1)


def sample_log_probs(model: nn.Module, ann: Annotations, samples: Samples, vocab: Vocabulary) -> tuple[
        torch.Tensor, torch.Tensor]:
    """log p of every sample with gradient, by teacher forcing through ``model`` (a
    CaptionModel, possibly DDP-wrapped): (R,), and the mask of real steps (R, T). ``ann``
    holds the B images once; each is repeated for its k rows."""
    k = samples.tokens.shape[0] // ann.vectors.shape[0]
    rows = Annotations(ann.vectors.repeat_interleave(k, 0), ann.grid)
    out = model(rows, samples.tokens, samples.lengths)
    logits = out.logits.float().index_fill(-1, torch.tensor([vocab.start, vocab.pad], device=out.logits.device),
                                           float("-inf"))  # (R, T, V)
    # Padding steps aim at <end> rather than at <pad> (probability 0): finite, then masked out.
    targets = samples.tokens[:, 1:].masked_fill(~out.mask, vocab.end)  # (R, T)
    logp = token_log_prob(logits, targets)  # (R, T)
    cut = (~samples.ended).nonzero().squeeze(1)
    if len(cut):  # a cut caption's last step: log (1 - p(<end>)), not log p(<end>)
        last = samples.lengths[cut] - 2
        logp = logp.index_put((cut, last), _log_not(F.log_softmax(logits[cut, last], -1), vocab.end))
    return (logp * out.mask).sum(1), out.mask


@contextmanager
def _eval_mode(model: nn.Module):
    """Every module of the model in eval mode for the duration (dropout off, batch norm on
    its running statistics), then back as it was, module by module."""
    switched = [m for m in model.modules() if m.training]
    for m in switched:
        m.eval()
    try:
        yield
    finally:
        for m in switched:
            m.train()


class ScstObjective:
    """The self-critical loss of a batch (see the module's docstring).

    ``references[i]``: the reference captions (raw text) of training image i, i the image
    index the training batches carry; the document frequencies come from these and from
    nothing else. ``seed`` and ``rank`` seed the sampling generator (each process draws
    its own samples); ``state_dict`` holds it for an exact resume."""

    def __init__(self, cfg: ScstConfig, vocab: Vocabulary, references: Sequence[Sequence[str]], *,
                 seed: int = 0, rank: int = 0, device: torch.device | str = "cpu"):
        check_scst_section(cfg)
        self.cfg = cfg
        self.vocab = vocab
        self.references = [list(r) for r in references]
        self.cider = CiderD(self.references, tokenizer=vocab.tokenizer)  # the data set's tokens
        self.generator = torch.Generator(device=device).manual_seed(1_000_003 * (seed + 1) + rank)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "device": self.generator.device.type}

    def load_state_dict(self, state: dict) -> bool:
        """Restore the sampling generator; False (and the generator left as seeded) when it was
        saved on another kind of device, whose generator state this one cannot take."""
        if state["device"] != self.generator.device.type:
            return False
        self.generator.set_state(state["generator"])
        return True

    def rewards(self, captions: Sequence[Sequence[str]], images: Sequence[int]) -> torch.Tensor:
        """CIDEr-D of each caption (its words, joined and tokenised as the evaluation scores a
        caption) against its image's references: (len(captions),). An image's references are
        weighed once per call, and a caption drawn several times for an image scored once."""
        refs = {i: self.cider.references(self.references[i]) for i in set(images)}
        scores: dict[tuple[int, str], float] = {}
        for w, i in zip(captions, images):
            text = " ".join(w)
            if (i, text) not in scores:
                scores[i, text] = self.cider.score(text, refs[i])
        return torch.tensor([scores[i, " ".join(w)] for w, i in zip(captions, images)], dtype=torch.float64)

    def baselines(self, rewards: torch.Tensor, greedy_rewards: torch.Tensor | None = None) -> torch.Tensor:
        """b_ij for rewards (B, k): the leave-one-out mean of the image's other samples, or
        the greedy caption's reward (B,) broadcast over the image's samples."""
        if self.cfg.baseline == "greedy":
            return greedy_rewards.unsqueeze(1).expand_as(rewards)
        k = rewards.shape[1]
        return (rewards.sum(1, keepdim=True) - rewards) / (k - 1)

    def advantages(self, rewards: torch.Tensor, baselines: torch.Tensor) -> torch.Tensor:
        """r - b, the weight of each sample's log-probability."""
        return rewards - baselines

    def __call__(self, net: nn.Module, images: torch.Tensor | Annotations, image_indices: torch.Tensor) -> LossParts:
        """``net``: the CaptionModel, or its DDP wrapper; ``images`` (B, 3, H, W) or cached
        annotations; ``image_indices`` (B,) each image's index in the training records."""
        model: CaptionModel = getattr(net, "module", net)
        k, max_len = self.cfg.samples, self.cfg.max_len
        index = image_indices.tolist()
        with _eval_mode(model):
            ann = images if isinstance(images, Annotations) else model.encode(images)
            fixed = Annotations(ann.vectors.detach(), ann.grid)
            samples = sample_captions(model.decoder, fixed, self.vocab, k=k, max_len=max_len,
                                      generator=self.generator)
            greedy_rewards = None
            if self.cfg.baseline == "greedy":
                best = greedy(model.decoder, fixed, Tokens.of(self.vocab), DecodeOptions(max_len=max_len))
                greedy_rewards = self.rewards([self.vocab.decode(d.ids) for d in best], index)
            rewards = self.rewards(samples.words, [i for i in index for _ in range(k)]).view(-1, k)  # (B, k)
            baselines = self.baselines(rewards, greedy_rewards)
            log_p, mask = sample_log_probs(net, ann, samples, self.vocab)  # (R,), (R, T)
        weight = self.advantages(rewards, baselines).flatten().to(log_p.device, log_p.dtype)  # (R,)
        loss = -(weight * log_p).mean()
        return LossParts(loss, -log_p.mean().item(), 0.0, int(mask.sum()), baseline=float(baselines.mean()),
                         reward=float(rewards.mean()))
