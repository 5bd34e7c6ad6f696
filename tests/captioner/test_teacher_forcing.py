"""The fast teacher-forced forward against the step-by-step one (T calls of the decoding step):
the same loss and gradients, for soft, hard and mean attention."""

import pytest
import torch
from torch import nn

from captioner.model import kernels
from captioner.model.decoder import Decoder, ModelConfig, attention_penalty
from captioner.model.encoders import Annotations
from captioner.train.losses import caption_log_likelihood

B, L, D, T = 4, 6, 9, 7


class FixedDropout(nn.Module):
    """Dropout whose masks are drawn up front, masks (B, T, E) already scaled by 1 / (1 - p):
    the step-by-step form takes column t at its t-th call, the fast form all of it at once."""

    def __init__(self, masks: torch.Tensor):
        super().__init__()
        self.masks = masks
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3:  # (B, T, E)
            return x * self.masks[:, : x.shape[1]]
        self.calls += 1
        return x * self.masks[:, self.calls - 1]


def _decoder(mode: str, p: float = 0.5) -> Decoder:
    torch.manual_seed(0)
    dec = Decoder(ModelConfig(vocab_size=23, annotation_dim=D, embed_dim=5, hidden_dim=8, attention_dim=7,
                              dropout=p, attention=mode)).train()
    masks = (torch.rand(B, T, 5, generator=torch.Generator().manual_seed(3)) > p).float() / (1 - p)
    dec.dropout = FixedDropout(masks)
    return dec


def _batch():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(B, L, D, generator=g)
    lengths = torch.tensor([T + 1, 3, 6, 5])  # tokens incl. start and end: T, 2, 5 and 4 steps
    tokens = torch.randint(4, 23, (B, T + 1), generator=g)
    tokens[:, 0] = 1
    for i, n in enumerate(lengths.tolist()):
        tokens[i, n - 1] = 2
        tokens[i, n:] = 0
    return Annotations(a, (2, 3)), tokens, lengths


def _loss_and_grads(dec: Decoder, fn, sample: bool):
    ann, tokens, lengths = _batch()
    out = fn(ann, tokens, lengths, sample=sample, generator=torch.Generator().manual_seed(7))
    ll = caption_log_likelihood(out, tokens[:, 1:])  # (B,)
    loss = -ll.mean() + attention_penalty(out.alphas, out.mask)
    if sample:  # the REINFORCE terms: log p(s|a) and the entropy over real steps
        m = out.mask.float()
        loss = loss - (ll.detach() * (out.sample_log_probs * m).sum(1)).mean() - (out.entropies * m).sum(1).mean()
    dec.zero_grad(set_to_none=True)
    loss.backward()
    return out, loss.detach(), {n: p.grad.clone() for n, p in dec.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("deferred", ["packed", "mm", "off"])
@pytest.mark.parametrize("mode,sample", [("soft", False), ("hard", True), ("hard", False), ("mean", False)])
def test_fast_forward_equals_the_step_by_step_form(mode, sample, deferred, kernels_switch, monkeypatch):
    """With the LSTM weight's gradient formed once over all steps (the recurrent product from
    oneDNN's packed weight, or torch.mm's) and with it step by step; with the kernels off,
    the plain forms throughout."""
    if deferred == "packed" and not kernels._packing_ok(torch.zeros(1)):
        pytest.skip("no oneDNN in this torch build")
    monkeypatch.setattr(kernels, "DEFERRED_MIN_WEIGHT", 1 << 40 if deferred == "off" else 0)
    if deferred == "mm":
        monkeypatch.setattr(kernels, "_packing_ok", lambda w: False)
    made, real = [], kernels._DeferredWeightGrad

    def make(w, rows):
        made.append(real(w, rows))
        return made[-1]

    monkeypatch.setattr(kernels, "_DeferredWeightGrad", make)
    dec = _decoder(mode)
    ref, ref_loss, ref_grads = _loss_and_grads(dec, dec.forward_stepwise, sample)
    dec.dropout.calls = 0
    out, loss, grads = _loss_and_grads(dec, dec.forward, sample)
    assert dec.dropout.calls == 0  # the fast form drew its masks in one call, over (B, T, E)
    deferred_used = kernels_switch and deferred != "off"
    assert [m.w.shape for m in made] == ([(D + 8, 4 * 8)] if deferred_used else [])  # the LSTM's [z; h] weights
    assert [m.packed is not None for m in made] == [deferred == "packed"] * len(made)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(out.alphas, ref.alphas)
    torch.testing.assert_close(out.betas, ref.betas)
    torch.testing.assert_close(out.logits[out.mask], ref.logits[ref.mask])
    assert (out.logits[~out.mask] == 0).all()  # padding steps: no output layer
    if sample:
        torch.testing.assert_close(out.sample_log_probs, ref.sample_log_probs)
        torch.testing.assert_close(out.entropies, ref.entropies)
    assert grads.keys() == ref_grads.keys()
    assert all(ref_grads[n].abs().sum() > 0 for n in ("L_o.weight", "lstm.weight_ih", "lstm.weight_hh", "L_z.weight"))
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-4, atol=1e-6, msg=n)


def test_a_failed_packing_falls_back_to_torch_mm(kernels_on, monkeypatch):
    """A torch build whose oneDNN operators refuse the weight: the step uses torch.mm, with
    the same loss and gradients as the step-by-step form."""
    monkeypatch.setattr(kernels, "DEFERRED_MIN_WEIGHT", 0)
    monkeypatch.setattr(kernels, "_packing_ok", lambda w: True)

    class Refuses:
        def __init__(self, w, rows):
            raise RuntimeError("no such layout")

    monkeypatch.setattr(kernels, "_PackedWeight", Refuses)
    made, real = [], kernels._DeferredWeightGrad
    monkeypatch.setattr(kernels, "_DeferredWeightGrad", lambda w, rows: made.append(real(w, rows)) or made[-1])
    dec = _decoder("soft")
    _, ref_loss, ref_grads = _loss_and_grads(dec, dec.forward_stepwise, False)
    _, loss, grads = _loss_and_grads(dec, dec.forward, False)
    assert len(made) == 1 and made[0].packed is None
    torch.testing.assert_close(loss, ref_loss)
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-4, atol=1e-6, msg=n)


def test_large_weights_take_the_deferred_gradient():
    """The paper's LSTM weight (2560 x 2048 elements) is over the size limit, the tiny one is not."""
    assert (2048 + 512) * 4 * 512 >= kernels.DEFERRED_MIN_WEIGHT > (D + 8) * 4 * 8


def test_dropout_masks_matter_to_the_comparison():
    """The comparison above sees the masks: other masks give another loss."""
    dec = _decoder("soft")
    _, loss, _ = _loss_and_grads(dec, dec.forward, False)
    dec.dropout.masks = dec.dropout.masks.flip(1)
    _, other, _ = _loss_and_grads(dec, dec.forward, False)
    assert not torch.allclose(loss, other)


def test_word_only_products_run_once_per_batch_not_once_per_step():
    """The output layer, L_h, L_z and the embedding run once for all T steps."""
    dec = _decoder("soft")
    calls = {"L_o": 0, "L_h": 0, "L_z": 0, "embedding": 0}
    for name in calls:
        getattr(dec, name).register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
    ann, tokens, lengths = _batch()
    dec(ann, tokens, lengths)
    assert calls == {"L_o": 1, "L_h": 1, "L_z": 1, "embedding": 1}


def test_output_layer_skips_padding_steps():
    """Of the B x T steps only the real ones reach L_o: 7 + 2 + 5 + 4 rows."""
    dec = _decoder("soft")
    rows = []
    dec.L_o.register_forward_hook(lambda m, inp, out: rows.append(inp[0].shape[0]))
    ann, tokens, lengths = _batch()
    dec(ann, tokens, lengths)
    assert rows == [int((lengths - 1).sum())]
