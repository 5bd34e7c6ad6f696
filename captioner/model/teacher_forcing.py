"""Teacher forcing arranged for speed: ``Decoder.forward``.

The same model as ``Decoder.forward_stepwise`` (T calls of the decoding step, the paper's
equations as written), which the tests hold it to: only what needs h_{t-1} runs inside the time
loop (attention, gate, the LSTM's z and h products). The embedding's share of the LSTM input runs
before the loop and the deep output L_o(E y + L_h h_t + L_z z_t) after it, each as one product
over all T steps, and the output layer only on real (non-padding) steps: padding logits are 0.

``steps``: run exactly this many steps (tokens then hold at least steps + 1 columns) and give the
output layer every step, padding ones included, so that the call waits for the device nowhere and
its shapes depend on the arguments' shapes alone: the form a CUDA graph records (captioner.train's
graphed step). The padding steps come after every caption's last word and are masked out of the
loss, so the loss and its gradients are the plain call's; only the padding logits differ (not 0).

Legend: B batch, T caption steps, L locations, D annotation size, E embedding size, H hidden size,
V vocabulary size, h attention heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from captioner.model import kernels
from captioner.model.encoders import Annotations


@dataclass
class DecoderOutput:
    """Teacher-forced outputs over T = max length - 1 steps."""

    logits: torch.Tensor  # (B, T, V); Decoder.forward leaves padding steps at 0
    alphas_heads: torch.Tensor  # (B, T, h, L) each head's map; h = 1 for one head
    betas: torch.Tensor  # (B, T)
    mask: torch.Tensor  # (B, T) True on real (non-padding) steps
    sample_log_probs: torch.Tensor | None = None  # (B, T) log p(s_t | a), hard attention (summed over heads)
    entropies: torch.Tensor | None = None  # (B, T) (summed over heads)

    @property
    def alphas(self) -> torch.Tensor:
        """(B, T, L) the heads' mean map (one head: its map)."""
        return self.alphas_heads.mean(2)


def unrolled(decoder: nn.Module, ann: Annotations, tokens: torch.Tensor, lengths: torch.Tensor, *,
             sample: bool = False, generator: torch.Generator | None = None,
             steps: int | None = None) -> DecoderOutput:
    """Teacher forcing of ``decoder`` (a ``decoder.Decoder``, whose step's parts this runs): tokens
    (B, T+1) = <start> w_1 .. w_n <end> <pad>..; lengths (B,) count the tokens including start and
    end (the module's docstring says how it runs)."""
    ann = decoder.annotate(ann)
    a = ann.vectors
    compiled = decoder._compiled_recur is not None
    fixed = steps is not None
    if fixed and tokens.shape[1] < steps + 1:
        raise ValueError(f"{steps} fixed steps need tokens of at least {steps + 1} columns, got {tokens.shape[1]}")
    b, steps = a.shape[0], (steps if fixed else int(lengths.max()) - 1)
    mask = torch.arange(steps, device=a.device).unsqueeze(0) < (lengths.to(a.device) - 1).unsqueeze(1)
    keys = decoder.attention.prepare(a)  # once per image
    h, c = decoder.init_state(a)
    emb = decoder.embedding(tokens[:, :steps])  # (B, T, E)
    w_e, w_zh, product = _lstm_weights(decoder, b)
    # (T, B, 4H), time-major so that each step reads one contiguous slice
    pre = F.linear(emb.transpose(0, 1), w_e, decoder.lstm.bias_ih + decoder.lstm.bias_hh)
    recur = decoder._compiled_recur if compiled else decoder._recur
    hs, zs, heads, betas, logps, ents = [], [], [], [], [], []
    # unbind: the backward stacks the T slices' gradients once, rather than T full-size ones
    for t, pre_t in enumerate(pre.unbind(0)):
        if compiled:  # one layout for the compiler (see compile_step); pre_t is always a view of pre
            h, c = kernels.plain(h), kernels.plain(c)
        h, c, z, att, beta = recur(pre_t, h, c, a, keys, w_zh, ann.grid, sample=sample, generator=generator,
                                   product=product)
        hs.append(h)
        zs.append(z)
        heads.append(att.alpha_heads)
        betas.append(beta)
        if att.sample_log_prob is not None:
            logps.append(att.sample_log_prob)
            ents.append(att.entropy)
    hs_, zs_ = torch.stack(hs, 1), torch.stack(zs, 1)  # (B, T, H), (B, T, D)
    x = decoder.dropout(emb + decoder.L_h(hs_) + decoder.L_z(zs_))  # (B, T, E)
    if fixed or bool(mask.all()):
        logits = decoder.L_o(x)  # (B, T, V)
    else:
        real = decoder.L_o(x[mask])  # (N, E) -> (N, V), N real steps
        logits = real.new_zeros(b, steps, real.shape[-1])
        logits[mask] = real
    return DecoderOutput(
        logits, torch.stack(heads, 1), torch.stack(betas, 1), mask,
        torch.stack(logps, 1) if logps else None, torch.stack(ents, 1) if ents else None)


def _lstm_weights(decoder: nn.Module, rows: int):
    """The LSTM's weights as the teacher-forced loop uses them: the embedding's columns w_e (4H, E),
    applied to all T steps before the loop; the z and h columns W_zh (D + H, 4H); and the product
    pre + [z; h] W_zh of each step (torch.addmm's signature). ``rows``: the batch size. In training
    with a large weight the kernels' form (kernels.deferred_lstm) forms W_zh's gradient once over
    all steps; a compiled step takes the plain form, which the compiler fuses."""
    w_ih, w_hh = decoder.lstm.weight_ih, decoder.lstm.weight_hh  # (4H, E + D): columns [E y; z]; (4H, H)
    e = decoder.embedding.embedding_dim
    if decoder._compiled_recur is None and kernels.deferred_lstm_ok(w_ih, w_hh, e):
        return kernels.deferred_lstm(w_ih, w_hh, e, rows)
    return w_ih[:, :e], torch.cat([w_ih[:, e:], w_hh], 1).t(), torch.addmm

