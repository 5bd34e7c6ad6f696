"""The training loss's word log-probabilities: the same values and gradients as
log_softmax + gather with the kernels on or off; with them on (captioner.kernels), one pass
and no (B, T, V) log-softmax kept."""

import torch
import torch.nn.functional as F

from captioner.model import kernels
from captioner.model.decoder import DecoderOutput
from captioner.train.losses import caption_log_likelihood, token_log_prob


def _reference(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def test_token_log_prob_matches_log_softmax_values_and_gradients(kernels_switch):
    torch.manual_seed(0)
    # 70 rows: not a multiple of the backward's row block; large logits: exp would overflow
    # without the log-sum-exp shift
    logits = (torch.randn(70, 53, dtype=torch.float64) * 30).requires_grad_()
    targets = torch.randint(0, 53, (70,))
    g = torch.randn(70, dtype=torch.float64)
    ref = _reference(logits, targets)
    (d_ref,) = torch.autograd.grad(ref, logits, g)
    got = token_log_prob(logits, targets)
    (d_got,) = torch.autograd.grad(got, logits, g)
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(d_got, d_ref)
    assert torch.autograd.gradcheck(token_log_prob, (logits[:5, :7].detach().requires_grad_(), targets[:5] % 7))


def test_caption_log_likelihood_masks_padding_and_keeps_gradients(kernels_switch):
    torch.manual_seed(1)
    b, t, v = 3, 5, 11
    logits = torch.randn(b, t, v, requires_grad=True)
    targets = torch.randint(0, v, (b, t))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    out = DecoderOutput(logits, torch.zeros(b, t, 1, 4), torch.zeros(b, t), mask)
    ll = caption_log_likelihood(out, targets)
    ref = (_reference(logits, targets) * mask).sum(1)
    torch.testing.assert_close(ll, ref)
    (d,) = torch.autograd.grad(ll.sum(), logits)
    (d_ref,) = torch.autograd.grad(ref.sum(), logits)
    torch.testing.assert_close(d, d_ref)
    assert d[1, 3:].abs().max() == 0 and d[2, 1:].abs().max() == 0  # padding steps get no gradient


def test_token_log_prob_keeps_no_vocabulary_sized_log_softmax(kernels_on):
    """What autograd keeps for the backward: the logits (already alive) and per-row numbers,
    not a second (N, V) tensor."""
    logits = torch.randn(64, 1000, requires_grad=True)
    targets = torch.randint(0, 1000, (64,))
    kept = []

    def pack(x):
        kept.append(x)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        token_log_prob(logits, targets)
    big = [x for x in kept if x.numel() >= logits.numel() and x.data_ptr() != logits.data_ptr()]
    assert not big, [tuple(x.shape) for x in big]


def test_row_log_sum_exp_matches_torch_on_extreme_rows():
    """The forward's blocked log-sum-exp: more rows than one block, huge logits, a row of
    -inf only and a row with +inf give what torch.logsumexp gives."""
    torch.manual_seed(2)
    v = 300
    rows = kernels.ROW_BLOCK_BYTES // (v * 4) * 2 + 7  # two blocks and a part
    x = torch.randn(rows, v) * 50
    x[3] = float("-inf")
    x[5, 7] = float("inf")
    x[9, :] = 1e30
    torch.testing.assert_close(kernels._logsumexp_rows(x), torch.logsumexp(x, -1))


def test_token_log_prob_forward_allocates_nothing_vocabulary_sized(kernels_on):
    """torch.logsumexp writes an (N, V) temporary (x - max); the forward here works a block
    of rows at a time, so no allocation is as large as half the logits."""
    from torch.profiler import ProfilerActivity, profile

    logits = torch.randn(512, 2000)
    targets = torch.randint(0, 2000, (512,))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        token_log_prob(logits, targets)
    biggest = max(e.cpu_memory_usage for e in prof.events())
    assert 0 < biggest < logits.numel() * logits.element_size() // 2, biggest
