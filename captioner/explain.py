"""Why this word: gradient maps beside the attention maps.

The attention map shows where the model looked before a word; a gradient map shows what in
the image made it say that word. For the caption the search chose, the decoder is
teacher-forced on that caption's own words, and for each word w_t the log-probability
s_t = log p(w_t | w_<t, a) is differentiated with respect to the annotation vectors a (L x D),
which are the encoder's last feature map laid out as L = H x W locations:

- ``gradinput``, gradient x input: m_l = sum_d a_ld * ds_t/da_ld;
- ``gradcam``, Grad-CAM (Selvaraju et al. 2017) on that feature map: weights
  w_d = (1/L) sum_l ds_t/da_ld, then m_l = sum_d w_d a_ld.

Each map keeps its positive part (what spoke for the word) and is scaled to sum to 1, as an
attention map does (a map with no positive part is uniform: nothing in the image spoke for the
word), on the same H x W grid, so that it is drawn, and its grounding measured, as the
attention maps are. A hard-attention model is explained through its expected context (the
teacher-forced pass takes the expectation over its map rather than a sample). The maps cost
one backward pass through the decoder per word; the encoder is not run again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from captioner.model.decoder import Decoder
from captioner.model.encoders import Annotations
from captioner.search.options import Tokens

KINDS = ("gradcam", "gradinput")


def gradient_maps(decoder: Decoder, ann: Annotations, ids: list[list[int]], tokens: Tokens,
                  kinds: Sequence[str]) -> dict[str, list[torch.Tensor]]:
    """For each of ``kinds``, one (T_i, H, W) map per word of each image's caption ``ids[i]``
    (its token ids, <end> included where it ended; T_i the words before <end>), of annotations
    ``ann`` (B, L, D). Every kind comes from the same forward pass and the same gradients."""
    for kind in kinds:
        if kind not in KINDS:
            raise ValueError(f"the gradient map must be one of {', '.join(KINDS)}, got {kind!r}")
    b, (gh, gw) = len(ids), ann.grid
    words = [len(x) - (1 if x and x[-1] == tokens.end else 0) for x in ids]
    steps = max(words, default=0)
    out = {kind: [torch.full((w, gh, gw), 1.0 / (gh * gw)) for w in words] for kind in kinds}
    if steps == 0 or not kinds:
        return out
    device = ann.vectors.device
    # <start> w_1 .. w_T: step t reads w_<t and is scored on w_t
    forced = torch.full((b, steps + 1), tokens.pad, dtype=torch.long)
    forced[:, 0] = tokens.start
    for i, x in enumerate(ids):
        forced[i, 1:words[i] + 1] = torch.tensor(x[:words[i]], dtype=torch.long)
    forced = forced.to(device)
    lengths = torch.tensor([w + 1 for w in words], device=device).clamp_min(2)
    with torch.enable_grad(), torch.autocast(device.type, enabled=False):
        a = ann.vectors.detach().float().requires_grad_(True)
        logits = decoder(Annotations(a, ann.grid), forced, lengths).logits  # (B, T, V)
        logp = F.log_softmax(logits.float(), -1).gather(2, forced[:, 1:, None]).squeeze(2)  # (B, T)
        for t in range(steps):
            alive = torch.tensor([t < w for w in words], device=device)
            score = (logp[:, t] * alive).sum()  # the images are independent: one backward for all
            (g,) = torch.autograd.grad(score, a, retain_graph=t + 1 < steps)
            for kind in kinds:
                m = _map(a.detach(), g, kind)  # (B, L)
                for i in range(b):
                    if t < words[i]:
                        out[kind][i][t] = m[i].view(gh, gw).cpu()
    return out


def _map(a: torch.Tensor, g: torch.Tensor, kind: str) -> torch.Tensor:
    """(B, L) maps from annotations ``a`` (B, L, D) and the gradient ``g`` of one word's log p."""
    if kind == "gradinput":
        m = (a * g).sum(-1)
    else:
        m = (a * g.mean(1, keepdim=True)).sum(-1)
    m = m.clamp_min(0)
    total = m.sum(1, keepdim=True)
    uniform = torch.full_like(m, 1.0 / m.shape[1])
    return torch.where(total > 0, m / total.clamp_min(1e-30), uniform)
