"""Multi-head decoder attention (model.heads) and the learned local width (model.local_width)."""

import pytest
import torch
import torch.nn.functional as F

from captioner.model.attention import MIN_HALF_WIDTH, Attention
from captioner.model.decoder import Decoder, ModelConfig
from captioner.model.encoders import Annotations
from captioner.model.multihead import MultiHeadAttention, build_attention

B, L, D, Q, A = 3, 12, 7, 5, 6
GRID = (3, 4)


def _inputs(seed=1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(B, L, D, generator=g, dtype=dtype).requires_grad_()
    h = torch.randn(B, Q, generator=g, dtype=dtype).requires_grad_()
    return a, h


def _multi(heads=2, seed=0, **kw):
    torch.manual_seed(seed)
    return build_attention(D, Q, A, heads=heads, **kw).double()


def _decoder(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = dict(vocab_size=9, annotation_dim=8, embed_dim=6, hidden_dim=7, attention_dim=6, dropout=0.0)
    return Decoder(ModelConfig(**{**cfg, **kw})).double().eval()


def test_one_head_is_the_single_attention_with_its_parameter_names():
    one = _decoder(heads=1)
    assert type(one.attention) is Attention
    default = _decoder()
    assert [(k, v.shape) for k, v in one.state_dict().items()] == \
        [(k, v.shape) for k, v in default.state_dict().items()]
    two = _decoder(heads=2)
    assert isinstance(two.attention, MultiHeadAttention)
    assert "attention.out_proj.weight" in two.state_dict() and "attention.heads.1.v.weight" in two.state_dict()


@pytest.mark.parametrize("score", ["additive", "concat", "dot", "scaled_dot", "general", "cosine"])
def test_soft_heads_attend_apart_and_their_contexts_are_concatenated_and_projected(score):
    att = _multi(score=score)
    a, h = _inputs()
    step = att(att.prepare(a), a, h, GRID)
    assert step.alpha_heads.shape == (B, 2, L)
    # Each head is its own Attention, with its own projections: the maps differ.
    assert (step.alpha_heads[:, 0] - step.alpha_heads[:, 1]).abs().max() > 1e-3
    for j, head in enumerate(att.heads):
        torch.testing.assert_close(step.alpha_heads[:, j], head.weights(head.prepare(a), a, h, GRID))
    torch.testing.assert_close(step.alpha, step.alpha_heads.mean(1))
    values = torch.cat([torch.einsum("bl,bld->bd", step.alpha_heads[:, j], a) @ att.value_proj[j].weight.T
                        for j in range(2)], -1)  # (B, 2 V): each head's attended annotation, projected
    assert values.shape == (B, 2 * (D // 2))
    torch.testing.assert_close(step.context, values @ att.out_proj.weight.T + att.out_proj.bias)
    assert step.context.shape == (B, D)
    (step.context.sum() + (step.alpha_heads[:, 1] * torch.arange(L)).sum()).backward()
    for name, p in att.named_parameters():
        if not name.endswith("v.bias"):  # a constant added to every score: softmax ignores it
            assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_hard_heads_each_sample_one_cell_and_their_log_probs_and_entropies_add():
    att = _multi(heads=3, mode="hard", normalizer="sparsemax", local_window=2.0, local_width="learned")
    a, h = _inputs()
    step = att(att.prepare(a), a, h, GRID, sample=True, generator=torch.Generator().manual_seed(2))
    assert step.sample.shape == (B, 3)
    heads = step.alpha_heads.detach()  # (B, 3, L)
    picked = heads.gather(2, step.sample.unsqueeze(2)).squeeze(2)  # (B, 3)
    assert (picked > 0).all()  # never a cell of weight 0
    torch.testing.assert_close(step.sample_log_prob.detach(), picked.log().sum(1))
    plogp = torch.where(heads > 0, heads * heads.clamp_min(1e-300).log(), torch.zeros_like(heads))
    torch.testing.assert_close(step.entropy.detach(), -plogp.sum((1, 2)))
    chosen = torch.cat([att.value_proj[j](a[torch.arange(B), step.sample[:, j]]) for j in range(3)], -1)  # (B, 3V)
    torch.testing.assert_close(step.context, att.out_proj(chosen))
    arg = att(att.prepare(a), a, h, GRID, argmax=True)
    assert torch.equal(arg.sample, heads.argmax(-1))


def test_values_are_projected_to_d_over_h_so_the_size_does_not_grow_with_the_heads():
    """The seeds' multi-head attention: values of D / h per head, W_o from h (D / h) = D
    back to D. The value and output projections hold 2 D^2 + D parameters for any h that
    divides D; at the paper's sizes (D 2048, attention 512) the attention module with 4
    or 8 heads then holds 9.7 M parameters, not the 18.8 M or 35.5 M of h full-size values."""
    def count(module, skip=""):
        return sum(p.numel() for n, p in module.named_parameters() if not (skip and n.startswith(skip)))

    d = 64
    for h in (2, 4, 8):
        att = build_attention(d, 16, 16, heads=h)
        assert [tuple(w.weight.shape) for w in att.value_proj] == [(d // h, d)] * h
        assert tuple(att.out_proj.weight.shape) == (d, d)
        assert count(att) - count(att.heads) == 2 * d * d + d
    one = count(build_attention(2048, 512, 512, heads=1))
    for h in (4, 8):
        many = build_attention(2048, 512, 512, heads=h)
        assert count(many) - count(many.heads) == 2 * 2048 * 2048 + 2048
        assert abs(count(many.heads) - one) < 0.01 * one  # the heads' scores together match one head's
        assert count(many) < 9.8e6


def test_a_checkpoint_of_the_earlier_form_is_refused_with_a_reason():
    from captioner.inference import Captioner
    from captioner.io.checkpoint import Checkpoint, CheckpointError
    from tests.tiny import tiny_captioner

    cap = tiny_captioner(seed=0, heads=2)
    ckpt = cap.checkpoint().to_dict()
    state = dict(ckpt["state_dict"])
    d = cap.model.decoder.attention.key_dim
    for j in range(2):
        del state[f"decoder.attention.value_proj.{j}.weight"]
    state["decoder.attention.out_proj.weight"] = torch.zeros(d, 2 * d)
    with pytest.raises(CheckpointError, match="earlier form"):
        Captioner.from_checkpoint(Checkpoint.from_dict({**ckpt, "state_dict": state}))


def test_multi_head_queries_sharing_an_image_equal_queries_with_their_own_copy():
    att = _multi(score="additive", local_window=1.5, local_width="learned")
    a, _ = _inputs()
    k = 3
    h = torch.randn(B * k, Q, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    a_rep = a.repeat_interleave(k, 0)
    with torch.no_grad():
        keys = att.prepare(a)
        assert keys.shape == (B, 2, L, A // 2)  # per head, once per image
        shared = att(keys, a, h, GRID)
        copied = att(att.prepare(a_rep), a_rep, h, GRID)
    torch.testing.assert_close(shared.alpha_heads, copied.alpha_heads)
    torch.testing.assert_close(shared.context, copied.context)


def test_bad_head_and_width_settings_are_refused():
    with pytest.raises(ValueError, match="heads must be"):
        _decoder(heads=0)
    with pytest.raises(ValueError, match="'mean'"):
        _decoder(heads=2, attention="mean")
    with pytest.raises(ValueError, match="local_width 'learned' needs local_window"):
        _decoder(local_width="learned")
    with pytest.raises(ValueError, match="unknown local_width"):
        _decoder(local_window=2.0, local_width="wide")


VARIANTS = {
    "soft": {},
    "cosine-sparsemax": {"score": "cosine", "normalizer": "sparsemax"},
    "local-learned": {"local_window": 1.5, "local_width": "learned"},
    "hard": {"attention": "hard"},
    "hard-local-learned": {"attention": "hard", "score": "general", "local_window": 2.0, "local_width": "learned"},
}


@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_teacher_forced_forward_equals_the_decoding_step_with_several_heads(name, heads, kernels_switch):
    variant = VARIANTS[name]
    dec = _decoder(seed=3, heads=heads, **variant)
    g = torch.Generator().manual_seed(0)
    ann = Annotations(torch.randn(3, 12, 8, generator=g, dtype=torch.float64), GRID)
    tokens = torch.tensor([[1, 4, 5, 6, 7, 2], [1, 7, 2, 0, 0, 0], [1, 3, 3, 2, 0, 0]])
    lengths = torch.tensor([6, 3, 4])
    sample = variant.get("attention") == "hard"
    fast = dec(ann, tokens, lengths, sample=sample, generator=torch.Generator().manual_seed(9))
    slow = dec.forward_stepwise(ann, tokens, lengths, sample=sample, generator=torch.Generator().manual_seed(9))
    m = fast.mask
    torch.testing.assert_close(fast.logits[m], slow.logits[m])
    torch.testing.assert_close(fast.alphas, slow.alphas)
    torch.testing.assert_close(fast.betas, slow.betas)
    assert fast.alphas_heads.shape == (3, 5, heads, 12)  # one head: its map on a head axis
    torch.testing.assert_close(fast.alphas_heads, slow.alphas_heads)
    torch.testing.assert_close(fast.alphas, fast.alphas_heads.mean(2))
    if sample:
        torch.testing.assert_close(fast.sample_log_probs, slow.sample_log_probs)
        torch.testing.assert_close(fast.entropies, slow.entropies)


# --- the learned width ---------------------------------------------------------------------

def _force(att: Attention, row: float, col: float, width: float, query=Q):
    """Make the centre network output (row, col, width) raw values whatever the query."""
    with torch.no_grad():
        last = att.centre[2]
        last.weight.zero_()
        last.bias.copy_(torch.tensor([row, col, width], dtype=last.bias.dtype))


def test_the_learned_width_starts_at_local_window():
    torch.manual_seed(0)
    learned = Attention(D, Q, A, local_window=2.5, local_width="learned").double()
    fixed = Attention(D, Q, A, local_window=2.5).double()
    fixed.load_state_dict({k: v for k, v in learned.state_dict().items() if not k.startswith("centre.2")},
                          strict=False)
    with torch.no_grad():
        fixed.centre[2].weight.copy_(learned.centre[2].weight[:2])
        fixed.centre[2].bias.copy_(learned.centre[2].bias[:2])
    a, h = _inputs()
    keys = fixed.prepare(a)
    torch.testing.assert_close(learned.weights(keys, a, h, GRID), fixed.weights(keys, a, h, GRID))


def test_a_narrower_learned_width_concentrates_the_weights():
    torch.manual_seed(0)
    att = Attention(D, Q, A, local_window=2.0, local_width="learned").double()
    a, h = _inputs()
    keys = att.prepare(a)
    peaks = []
    for width in (3.0, 0.0, -3.0):  # half-widths MIN + softplus(width): about 3.1, 0.8, 0.15 cells
        _force(att, 0.0, -0.5108, width)  # the centre of cell (1, 1): 3 sigmoid(0), 4 sigmoid(-0.5108)
        with torch.no_grad():
            peaks.append(float(att.weights(keys, a, h, GRID).max(-1).values.mean()))
    assert peaks[0] < peaks[1] < peaks[2]
    assert peaks[2] > 0.99


EXTREME = [(-1e6, -1e6), (1e6, 1e6), (-1e6, 1e6), (60.0, -60.0), (0.0, 0.0)]  # corners, far outside, middle


@pytest.mark.parametrize("normalizer", ["softmax", "sparsemax"])
@pytest.mark.parametrize("width", [-1e6, -30.0, 0.0, 30.0, 1e6])
@pytest.mark.parametrize("centre", EXTREME)
def test_the_learned_width_stays_finite_for_extreme_centres_and_widths(centre, width, normalizer):
    att = Attention(D, Q, A, local_window=1.0, local_width="learned", normalizer=normalizer)
    _force(att, *centre, width)
    g = torch.Generator().manual_seed(0)
    a = (10 * torch.randn(B, 16 * 16, D, generator=g)).requires_grad_()  # 16x16 grid, peaked scores
    h = torch.randn(B, Q, generator=g).requires_grad_()
    step = att(att.prepare(a), a, h, (16, 16))
    assert torch.isfinite(step.alpha).all() and (step.alpha >= 0).all()
    torch.testing.assert_close(step.alpha.sum(-1), torch.ones(B), atol=1e-5, rtol=0)
    (step.context.sum() + (step.alpha * torch.randn(step.alpha.shape, generator=g)).sum()).backward()
    for name, p in [("a", a), ("h", h)] + list(att.named_parameters()):
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_the_half_width_never_falls_below_its_floor():
    att = Attention(D, Q, A, local_window=1.0, local_width="learned").double()
    _force(att, 0.0, 0.0, -1e6)
    a, h = _inputs()
    log_window = att._log_window(h, GRID)  # -d^2 / (2 sigma^2), sigma = half-width / 2
    cells = torch.stack(torch.meshgrid(torch.arange(3.0) + 0.5, torch.arange(4.0) + 0.5, indexing="ij"), -1)
    d2 = ((cells.view(-1, 2) - torch.tensor([1.5, 2.0])) ** 2).sum(-1).double()  # centre at the middle
    torch.testing.assert_close(log_window[0], -d2 / (2 * (MIN_HALF_WIDTH / 2) ** 2))


# --- the cosine temperature ----------------------------------------------------------------

def _cosine_mass_after_training(learn_temperature: bool, steps=300) -> float:
    """Train a cosine attention over a 16x16 grid to point at one cell; return the mass on it."""
    torch.manual_seed(0)
    att = Attention(D, Q, A, score="cosine")
    att.log_temperature.requires_grad_(learn_temperature)
    g = torch.Generator().manual_seed(1)
    a = torch.randn(1, 256, D, generator=g)
    h = torch.randn(1, Q, generator=g)
    target = 37
    opt = torch.optim.Adam([p for p in att.parameters() if p.requires_grad], lr=0.05)
    keys = att.prepare(a)
    for _ in range(steps):
        opt.zero_grad()
        loss = -torch.log(att.weights(keys, a, h, (16, 16))[0, target])
        loss.backward()
        opt.step()
    with torch.no_grad():
        return float(att.weights(keys, a, h, (16, 16))[0, target])


def test_cosine_with_a_learned_temperature_can_point_at_one_cell_of_a_16x16_grid():
    # At temperature 1 the scores lie in [-1, 1]: at most e / (e + 255 / e) = 2.8% on one cell.
    assert _cosine_mass_after_training(learn_temperature=False) < 0.03
    assert _cosine_mass_after_training(learn_temperature=True) > 0.5


def test_the_cosine_temperature_divides_the_cosine():
    torch.manual_seed(0)
    att = Attention(D, Q, A, score="cosine").double()
    a, h = _inputs()
    keys = att.prepare(a)
    cos = F.cosine_similarity(a, att.query_proj(h).unsqueeze(1), dim=-1)
    torch.testing.assert_close(att.scores(keys, a, h), cos)  # tau = 1 at the start
    with torch.no_grad():
        att.log_temperature.fill_(-2.0)
    torch.testing.assert_close(att.scores(keys, a, h), cos / torch.exp(torch.tensor(-2.0)))
