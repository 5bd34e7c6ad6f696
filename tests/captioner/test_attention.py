"""The attention family: score functions, softmax/sparsemax, local, hard and mean attention.

Every check compares against an independent computation (the formula written out by hand,
a brute-force simplex projection, a chi-square bound on sampling frequencies), so that a
wrong implementation fails rather than merely a crashing one.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from captioner.inference import Captioner, DecodeOptions
from captioner.model import attention, kernels
from captioner.model.attention import MODES, NORMALIZERS, SCORES, Attention, sparsemax
from tests.tiny import tiny_captioner, tiny_image

B, D, Q, A = 3, 7, 5, 6  # key (annotation) size differs from the query (LSTM) size on purpose
GRID = (3, 4)
L = GRID[0] * GRID[1]


def make(score="additive", *, key_dim=D, query_dim=Q, seed=0, dtype=torch.float64, **kw) -> Attention:
    torch.manual_seed(seed)
    return Attention(key_dim, query_dim, A, score=score, **kw).to(dtype)


def inputs(key_dim=D, query_dim=Q, *, seed=1, batch=B, n=L, scale=1.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(batch, n, key_dim, generator=g, dtype=dtype) * scale).requires_grad_()
    h = (torch.randn(batch, query_dim, generator=g, dtype=dtype) * scale).requires_grad_()
    return a, h


def assert_distribution(alpha: torch.Tensor, shape=(B, L)):
    assert alpha.shape == shape
    assert torch.isfinite(alpha).all()
    assert (alpha >= 0).all()
    torch.testing.assert_close(alpha.sum(-1), torch.ones(shape[0], dtype=alpha.dtype), atol=1e-6, rtol=0)


def force_centre(att: Attention, cell: tuple[int, int], grid=GRID) -> None:
    """Make the centre network predict the middle of ``cell`` whatever the query."""
    last = att.centre[-1]
    with torch.no_grad():
        last.weight.zero_()
        p = torch.tensor([(cell[0] + 0.5) / grid[0], (cell[1] + 0.5) / grid[1]], dtype=last.bias.dtype)
        last.bias.copy_(torch.logit(p))


# ---------------------------------------------------------------------------- scores


@pytest.mark.parametrize("score", SCORES)
@pytest.mark.parametrize("dims", [(D, Q), (6, 6)], ids=["D7-Q5", "D6-Q6"])
def test_every_score_gives_a_distribution_and_a_context(score, dims):
    key_dim, query_dim = dims
    att = make(score, key_dim=key_dim, query_dim=query_dim)
    a, h = inputs(key_dim, query_dim)
    step = att(att.prepare(a), a, h, GRID)
    assert_distribution(step.alpha)
    assert step.context.shape == (B, key_dim)
    torch.testing.assert_close(step.context, torch.einsum("bl,bld->bd", step.alpha, a))
    assert step.sample is None and step.sample_log_prob is None and step.entropy is None


@pytest.mark.parametrize("local_window", [0.0, 2.0], ids=["global", "local"])
@pytest.mark.parametrize("normalizer", NORMALIZERS)
@pytest.mark.parametrize("score", SCORES)
def test_gradients_reach_every_parameter_the_query_and_the_keys(score, normalizer, local_window):
    att = make(score, normalizer=normalizer, local_window=local_window)
    a, h = inputs(scale=0.5)
    step = att(att.prepare(a), a, h, GRID)
    g = torch.Generator().manual_seed(3)
    loss = (step.context * torch.randn(step.context.shape, generator=g, dtype=a.dtype)).sum() + \
        (step.alpha * torch.randn(step.alpha.shape, generator=g, dtype=a.dtype)).sum()
    loss.backward()
    params = dict(att.named_parameters())
    if score in ("dot", "scaled_dot", "cosine") and local_window == 0:
        # D != Q: only the projection of h (and cosine's temperature, which the loop below
        # checks gets a gradient)
        assert set(params) == {"query_proj.weight"} | ({"log_temperature"} if score == "cosine" else set())
    for name, p in params.items():
        assert p.grad is not None, name
        if name == "v.bias":
            # w^T tanh(.) + b: b shifts every score of a query alike, which softmax and
            # sparsemax (and the local window's renormalisation) ignore: its gradient is 0
            # up to rounding
            assert p.grad.abs().max() < 1e-9, p.grad
            continue
        assert p.grad.abs().sum() > 0, name
    assert h.grad is not None and h.grad.abs().sum() > 0
    assert a.grad is not None and a.grad.abs().sum() > 0


@pytest.mark.parametrize("score", ["dot", "scaled_dot", "cosine"])
def test_query_is_projected_when_sizes_differ(score):
    att = make(score)  # D = 7, Q = 5
    assert att.query_proj.weight.shape == (D, Q)
    a, h = inputs()
    q = h @ att.query_proj.weight.T  # (B, D)
    if score == "cosine":
        expected = F.cosine_similarity(a, q.unsqueeze(1), dim=-1)
    else:
        expected = torch.einsum("bld,bd->bl", a, q) / (math.sqrt(D) if score == "scaled_dot" else 1.0)
    torch.testing.assert_close(att.scores(att.prepare(a), a, h), expected)
    same = make(score, key_dim=6, query_dim=6)
    assert not hasattr(same, "query_proj")
    assert [n for n, _ in same.named_parameters()] == (["log_temperature"] if score == "cosine" else [])


def test_a_registered_score_is_chosen_by_its_name(monkeypatch):
    """A score class added to the registry is built and called by name, like the built-in ones."""
    monkeypatch.setattr(attention, "_SCORES", dict(attention._SCORES))

    @attention.register_score("negative_dot")
    class NegativeDot(attention.Dot):
        def __call__(self, att, keys, a, hq):
            return -super().__call__(att, keys, a, hq)

    neg, dot = make("negative_dot"), make("dot")
    assert type(neg.f_att) is NegativeDot and neg.f_att.name == "negative_dot"
    neg.load_state_dict(dot.state_dict())  # the same layers, under the same names
    a, h = inputs()
    torch.testing.assert_close(neg.scores(neg.prepare(a), a, h), -dot.scores(dot.prepare(a), a, h))


def test_scaled_dot_is_dot_over_sqrt_d():
    dot, scaled = make("dot"), make("scaled_dot")
    scaled.load_state_dict(dot.state_dict())
    a, h = inputs()
    e_dot = dot.scores(dot.prepare(a), a, h)
    e_scaled = scaled.scores(scaled.prepare(a), a, h)
    torch.testing.assert_close(e_scaled, e_dot / math.sqrt(D))
    torch.testing.assert_close(scaled.weights(scaled.prepare(a), a, h, GRID),
                               torch.softmax(e_dot / math.sqrt(D), dim=-1))


def test_cosine_scores_lie_in_minus_one_one_and_ignore_scale():
    att = make("cosine", key_dim=6, query_dim=6)
    a, h = inputs(6, 6, scale=50.0)
    e = att.scores(att.prepare(a), a, h)
    assert e.abs().max() <= 1 + 1e-12
    torch.testing.assert_close(e, F.cosine_similarity(a, h.unsqueeze(1), dim=-1))
    torch.testing.assert_close(att.scores(att.prepare(3 * a), 3 * a, 0.1 * h), e)  # scale-free
    # a key parallel to the query scores 1, the opposite one -1
    a2 = torch.stack([h, -h, 2 * h], dim=1)
    torch.testing.assert_close(att.scores(att.prepare(a2), a2, h), torch.tensor([[1.0, -1.0, 1.0]] * B, dtype=h.dtype))


def test_general_is_bilinear_h_w_a():
    att = make("general")
    W = att.bilinear.weight  # (Q, D)
    assert W.shape == (Q, D) and att.bilinear.bias is None
    a, h = inputs()
    expected = torch.stack([torch.stack([h[b] @ W @ a[b, i] for i in range(L)]) for b in range(B)])
    torch.testing.assert_close(att.scores(att.prepare(a), a, h), expected)


def test_additive_is_w_tanh_wa_a_plus_wh_h():
    att = make("additive")
    a, h = inputs()
    Wa, ba = att.key_proj.weight, att.key_proj.bias
    Wh, bh = att.query_proj.weight, att.query_proj.bias
    w, bw = att.v.weight[0], att.v.bias[0]
    expected = torch.stack([torch.stack([w @ torch.tanh(Wa @ a[b, i] + ba + Wh @ h[b] + bh) + bw
                                         for i in range(L)]) for b in range(B)])
    e = att.scores(att.prepare(a), a, h)
    torch.testing.assert_close(e, expected)
    torch.testing.assert_close(att.weights(att.prepare(a), a, h, GRID), torch.softmax(expected, -1))


def test_concat_is_v_tanh_w_of_h_and_a():
    att = make("concat")
    a, h = inputs()
    W, bW, v, bv = att.joint.weight, att.joint.bias, att.v.weight[0], att.v.bias[0]
    expected = torch.stack([torch.stack([v @ torch.tanh(W @ torch.cat([h[b], a[b, i]]) + bW) + bv
                                         for i in range(L)]) for b in range(B)])
    torch.testing.assert_close(att.scores(att.prepare(a), a, h), expected)


@pytest.mark.parametrize("score,layer", [("additive", "key_proj"), ("general", "bilinear")])
def test_prepare_projects_each_image_once(score, layer):
    att = make(score)
    calls = {"n": 0}
    getattr(att, layer).register_forward_hook(lambda *_: calls.__setitem__("n", calls["n"] + 1))
    a, h = inputs()
    keys = att.prepare(a)
    assert calls["n"] == 1
    steps = 5
    first = None
    for _ in range(steps):
        step = att(keys, a, h, GRID)
        first = step.alpha if first is None else first
        h = torch.tanh(h + step.context[:, :Q])  # a changing query, as in decoding
    assert calls["n"] == 1  # the steps reuse the keys, they never re-project the image
    # and the keys are really what the step uses: other annotations, same keys, same weights
    a_other = torch.randn_like(a)
    h0 = inputs()[1]
    torch.testing.assert_close(att.weights(keys, a_other, h0, GRID), first)


def test_unknown_options_are_refused():
    for kw in ({"score": "nope"}, {"normalizer": "nope"}, {"mode": "nope"}):
        with pytest.raises(ValueError, match="nope"):
            Attention(D, Q, A, **kw)
    assert set(MODES) == {"soft", "hard", "mean"}


# ---------------------------------------------------------------------------- sparsemax


def simplex_projection(z: torch.Tensor, tol: float = 1e-12) -> torch.Tensor:
    """argmin_{p in simplex} ||p - z||^2 along the last axis, by bisection on the threshold
    tau of p = max(z - tau, 0): sum(max(z - tau, 0)) falls from >= 1 at max(z) - 1 to 0 at
    max(z), so tau is bracketed. No sorting, nothing shared with the code under test."""
    z = z.double()
    lo = z.max(-1, keepdim=True).values - 1.0
    hi = lo + 1.0
    while (hi - lo).max() > tol:
        mid = (lo + hi) / 2
        too_much = (z - mid).clamp_min(0).sum(-1, keepdim=True) > 1
        lo = torch.where(too_much, mid, lo)
        hi = torch.where(too_much, hi, mid)
    return (z - (lo + hi) / 2).clamp_min(0)


@pytest.mark.parametrize("n", [1, 2, 5, 17, 196])
@pytest.mark.parametrize("scale", [0.1, 1.0, 10.0])
def test_sparsemax_is_the_euclidean_projection_onto_the_simplex(n, scale):
    g = torch.Generator().manual_seed(n * 100 + int(scale * 10))
    z = torch.randn(64, n, generator=g, dtype=torch.float64) * scale
    p = sparsemax(z, dim=-1)
    torch.testing.assert_close(p, simplex_projection(z), atol=1e-9, rtol=0)
    assert (p >= 0).all()
    torch.testing.assert_close(p.sum(-1), torch.ones(64, dtype=z.dtype), atol=1e-12, rtol=0)
    # float32 agrees as well
    torch.testing.assert_close(sparsemax(z.float(), dim=-1), p.float(), atol=1e-5, rtol=0)


def test_sparsemax_has_exact_zeros_and_exact_one_hot():
    z = torch.linspace(0, 5, 10)
    p = sparsemax(z)
    assert (p == 0.0).sum() >= 5  # spread-out scores: most entries are exactly zero
    assert p[-1] > 0 and p.sum().item() == pytest.approx(1.0, abs=1e-6)
    torch.testing.assert_close(p, simplex_projection(z).float(), atol=1e-6, rtol=0)
    one_hot = sparsemax(torch.tensor([0.0, 3.0, 1.0, -2.0]))
    assert one_hot.tolist() == [0.0, 1.0, 0.0, 0.0]
    assert torch.equal(sparsemax(torch.zeros(2, 4)), torch.full((2, 4), 0.25))  # ties: uniform


def test_sparsemax_is_invariant_to_adding_a_constant():
    z = torch.randn(8, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    c = torch.randn(8, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(5)) * 100
    torch.testing.assert_close(sparsemax(z + c), sparsemax(z), atol=1e-10, rtol=0)


def test_sparsemax_along_another_dim_is_the_same_projection():
    z = torch.randn(4, 6, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    for dim in (0, 1, 2, -1, -2):
        moved = z.movedim(dim, -1)
        expected = simplex_projection(moved).movedim(-1, dim)
        torch.testing.assert_close(sparsemax(z, dim=dim), expected, atol=1e-9, rtol=0)


@pytest.mark.parametrize("scale", [0.1, 1.0, 30.0])
def test_sparsemax_under_bf16_autocast_is_the_float32_projection(scale, kernels_switch):
    """Under bf16 autocast (the GPU default) scores come in bf16 over 1,024 cells. Sorted
    and summed in bf16, supports and sums drift (maps summing to 0.98-1.02); the projection
    is computed in float32 whatever the input: each map sums to 1 within 1e-5 and is the
    map of the same scores in float32, and the gradient reaches the bf16 scores."""
    g = torch.Generator().manual_seed(int(10 * scale))
    z = (torch.randn(256, 1024, generator=g) * scale).bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        p = sparsemax(z)
    assert p.dtype == torch.float32
    torch.testing.assert_close(p.sum(-1), torch.ones(256), atol=1e-5, rtol=0)
    assert torch.equal(p, sparsemax(z.detach().float()))
    (p * torch.linspace(-1, 1, 1024)).sum().backward()
    assert z.grad.dtype == torch.bfloat16 and z.grad.abs().sum() > 0


@pytest.mark.parametrize("local_window", [0.0, 1.5])
def test_sparsemax_attention_maps_sum_to_one_under_bf16_autocast(local_window):
    att = Attention(12, 10, 8, normalizer="sparsemax", local_window=local_window)
    a = torch.randn(3, 32 * 32, 12, generator=torch.Generator().manual_seed(2)) * 4
    h = torch.randn(3, 10, generator=torch.Generator().manual_seed(3)) * 4
    with torch.autocast("cpu", dtype=torch.bfloat16):
        keys = att.prepare(a)
        alpha = att.weights(keys, a, h, (32, 32))
    torch.testing.assert_close(alpha.float().sum(-1), torch.ones(3), atol=1e-5, rtol=0)


def _untied(shape, seed, margin=1e-3):
    """Random double scores whose entries are all at least ``margin`` from the threshold tau
    and from each other, so finite differences never cross a kink of sparsemax."""
    g = torch.Generator().manual_seed(seed)
    while True:
        z = torch.randn(*shape, generator=g, dtype=torch.float64)
        p = simplex_projection(z.movedim(0, -1) if len(shape) > 1 else z)
        tau_gap = torch.where(p > 0, p, torch.full_like(p, float("inf")))
        zs = z.flatten().sort().values
        if (zs.diff() > margin).all() and tau_gap.min() > margin:
            return z


@pytest.mark.parametrize("dim", [-1, 0])
def test_sparsemax_gradcheck(dim, kernels_switch):
    """The kernels' closed-form Jacobian and autograd's through the projection alike."""
    z = _untied((5, 4), seed=7).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: sparsemax(x, dim=dim), (z,))
    # several support sizes in one batch along the last axis, including a one-hot row
    z2 = torch.tensor([[0.1, 0.5, 0.9, -0.3], [3.0, 0.2, -0.4, 0.7], [0.11, 0.24, 0.02, 0.33]],
                      dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: sparsemax(x, dim=-1), (z2,))
    assert torch.autograd.gradcheck(lambda x: sparsemax(x.T, dim=0), (z2,))


def test_sparsemax_gradient_is_zero_off_the_support_and_sums_to_zero(kernels_switch):
    z = torch.tensor([[2.0, 1.5, -1.0, 0.2, -3.0]], dtype=torch.float64, requires_grad=True)
    p = sparsemax(z)
    (p * torch.tensor([[1.0, -2.0, 5.0, 7.0, 3.0]], dtype=torch.float64)).sum().backward()
    off = p.detach() == 0
    assert off.any() and (z.grad[off] == 0).all()
    assert z.grad.sum().abs() < 1e-12  # invariance to a constant shift


# ---------------------------------------------------------------------------- local attention


@pytest.mark.parametrize("cell", [(0, 0), (1, 2), (2, 3)])
def test_narrow_local_window_concentrates_on_the_predicted_centre(cell):
    att = make("additive", local_window=0.5)  # sigma = 0.25 cells
    force_centre(att, cell)
    a, h = inputs()
    alpha = att.weights(att.prepare(a), a, h, GRID)
    assert_distribution(alpha)
    maps = alpha.view(B, *GRID)
    flat_cell = cell[0] * GRID[1] + cell[1]
    assert (alpha.argmax(-1) == flat_cell).all()
    r0, r1 = max(cell[0] - 1, 0), cell[0] + 2
    c0, c1 = max(cell[1] - 1, 0), cell[1] + 2
    assert (maps[:, r0:r1, c0:c1].sum((1, 2)) > 0.9).all()


def test_local_softmax_is_softmax_times_the_gaussian_window_renormalised():
    att = make("general", local_window=2.0)  # sigma = 1 cell
    force_centre(att, (1, 1))
    a, h = inputs()
    keys = att.prepare(a)
    e = att.scores(keys, a, h)
    rows, cols = torch.meshgrid(torch.arange(GRID[0]) + 0.5, torch.arange(GRID[1]) + 0.5, indexing="ij")
    d2 = ((rows - 1.5) ** 2 + (cols - 1.5) ** 2).flatten().double()
    expected = torch.softmax(e, -1) * torch.exp(-d2 / 2)
    expected = expected / expected.sum(-1, keepdim=True)
    torch.testing.assert_close(att.weights(keys, a, h, GRID), expected)


@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_a_very_wide_window_changes_nothing(normalizer):
    local = make("additive", normalizer=normalizer, local_window=1e4)
    glob = make("additive", normalizer=normalizer)
    glob.load_state_dict(local.state_dict(), strict=False)
    a, h = inputs()
    torch.testing.assert_close(local.weights(local.prepare(a), a, h, GRID),
                               glob.weights(glob.prepare(a), a, h, GRID), atol=1e-6, rtol=0)


def test_local_window_does_not_underflow_with_peaked_scores():
    """softmax(e) * window can underflow to zero everywhere although the renormalised product
    is perfectly defined: cell 15 has the best score but lies far from the window, cell 1 is
    next to it with a score 40 lower; the product must pick cell 1 (not the bare window)."""
    att = make("dot", key_dim=4, query_dim=4, local_window=0.5)  # sigma = 0.25
    force_centre(att, (0, 0), grid=(4, 4))
    a = torch.zeros(1, 16, 4, dtype=torch.float64)
    a[0, 15, 0], a[0, 1, 0] = 1.0, 0.8
    h = torch.tensor([[200.0, 0, 0, 0]], dtype=torch.float64)
    for dtype in (torch.float64, torch.float32):
        att_d, a_d, h_d = att.to(dtype), a.to(dtype), h.to(dtype)
        alpha = att_d.weights(att_d.prepare(a_d), a_d, h_d, (4, 4))
        assert_distribution(alpha, (1, 16))
        assert alpha[0, 1] > 0.999, alpha


@pytest.mark.parametrize("normalizer", NORMALIZERS)
@pytest.mark.parametrize("local_window", [1e-2, 1e-4])
def test_local_window_of_any_width_gives_a_distribution_and_finite_gradients(normalizer, local_window):
    att = make("additive", normalizer=normalizer, local_window=local_window)
    a, h = inputs(scale=3.0)
    step = att(att.prepare(a), a, h, GRID)
    assert_distribution(step.alpha)
    (step.context.sum() + step.alpha[:, 0].sum()).backward()
    assert all(torch.isfinite(p.grad).all() for p in att.parameters() if p.grad is not None)
    assert torch.isfinite(h.grad).all() and torch.isfinite(a.grad).all()


def test_local_sparsemax_stays_a_distribution_on_the_support_far_from_the_window():
    """Sparsemax puts all its mass far from a narrow window: the product alpha * window is then
    tiny everywhere (it used to underflow and fall back). It must stay a distribution, keep the
    exact zeros of sparsemax, and pick the supported cell nearest to the centre."""
    att = make("dot", key_dim=4, query_dim=4, normalizer="sparsemax", local_window=0.2)  # sigma 0.1
    force_centre(att, (0, 0), grid=(4, 4))
    a = torch.zeros(1, 16, 4, dtype=torch.float64, requires_grad=False)
    a[0, 15, 0], a[0, 10, 0], a[0, 11, 0] = 1.0, 0.99, 0.98  # the support: cells 10, 11, 15
    a.requires_grad_()
    h = torch.tensor([[10.0, 0, 0, 0]], dtype=torch.float64, requires_grad=True)
    keys = att.prepare(a)
    plain = sparsemax(att.scores(keys, a, h))
    assert set(plain.nonzero()[:, 1].tolist()) == {10, 11, 15}
    for dtype in (torch.float64, torch.float32):
        att_d = att.to(dtype)
        alpha = att_d.weights(att_d.prepare(a.to(dtype)), a.to(dtype), h.to(dtype), (4, 4))
        assert_distribution(alpha, (1, 16))
        assert (alpha[plain.to(dtype) == 0] == 0).all()  # alpha' = alpha * window keeps the zeros
        assert alpha[0, 10] > 0.999  # cell (2, 2) is the supported cell nearest to (0.5, 0.5)
    att.double()
    step = att(keys, a, h, (4, 4))
    step.context.sum().backward()
    assert torch.isfinite(h.grad).all() and torch.isfinite(a.grad).all()


# ---------------------------------------------------------------------------- hard and mean


@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_hard_attention_samples_exactly_one_annotation(normalizer):
    att = make("additive", normalizer=normalizer, mode="hard")
    a, h = inputs(scale=2.0)
    step = att(att.prepare(a), a, h, GRID, sample=True, generator=torch.Generator().manual_seed(0))
    assert step.sample.shape == (B,) and step.sample.dtype == torch.long
    for b in range(B):
        assert torch.equal(step.context[b], a[b, step.sample[b]])  # exactly a_s, no mixing
        assert step.alpha[b, step.sample[b]] > 0  # never a location of weight 0
    alpha = step.alpha.detach()
    torch.testing.assert_close(step.sample_log_prob.detach(), alpha.gather(1, step.sample[:, None]).squeeze(1).log())
    plogp = torch.where(alpha > 0, alpha * alpha.clamp_min(1e-300).log(), torch.zeros_like(alpha))
    torch.testing.assert_close(step.entropy.detach(), -plogp.sum(-1))
    assert (step.entropy >= 0).all() and (step.entropy <= math.log(L) + 1e-9).all()
    # the score-function gradient reaches the attention parameters through log p(s)
    step.sample_log_prob.sum().backward()
    assert att.v.weight.grad is not None and att.v.weight.grad.abs().sum() > 0


def test_hard_attention_samples_follow_alpha():
    """20,000 draws from one alpha over 12 cells. Under correct sampling Pearson's statistic
    sum (O - E)^2 / E is chi-square with 11 degrees of freedom: mean 11, sd ~4.7, and it
    exceeds 45 with probability below 1e-5, so 45 is a bound a correct sampler passes (the
    seed is fixed, so the test is deterministic too). A sampler of the wrong distribution
    (uniform, the argmax, alpha squared) scores in the hundreds or thousands, checked below."""
    att = make("additive", mode="hard")
    n = 20_000
    a, h = inputs(batch=1, scale=1.5)
    a, h = a.detach().expand(n, -1, -1), h.detach().expand(n, -1)
    step = att(att.prepare(a), a, h, GRID, sample=True, generator=torch.Generator().manual_seed(1))
    alpha = step.alpha[0].detach()
    assert (step.alpha.detach() == alpha).all()
    assert alpha.min() > 0.01  # every cell expects over 200 draws: the chi-square approximation holds
    counts = torch.bincount(step.sample, minlength=L).double()
    expected = n * alpha

    def chi2(p):
        return (((counts - n * p) ** 2) / (n * p)).sum().item()

    assert chi2(alpha) < 45.0
    for wrong in (torch.full_like(alpha, 1.0 / L), alpha**2 / (alpha**2).sum()):
        assert chi2(wrong) > 100.0  # the bound has power against a wrong sampler
    assert counts.argmax() == expected.argmax()


def test_hard_sampling_is_reproducible_with_a_generator():
    att = make("additive", mode="hard")
    a, h = inputs(batch=50)
    keys = att.prepare(a)
    s1 = att(keys, a, h, GRID, sample=True, generator=torch.Generator().manual_seed(9)).sample
    s2 = att(keys, a, h, GRID, sample=True, generator=torch.Generator().manual_seed(9)).sample
    assert torch.equal(s1, s2)


def test_hard_attention_without_sampling_returns_the_expected_context():
    hard, soft = make("additive", mode="hard"), make("additive", mode="soft")
    soft.load_state_dict(hard.state_dict())
    a, h = inputs()
    step = hard(hard.prepare(a), a, h, GRID)
    ref = soft(soft.prepare(a), a, h, GRID)
    assert step.sample is None and step.sample_log_prob is None
    torch.testing.assert_close(step.context, torch.einsum("bl,bld->bd", step.alpha, a))
    torch.testing.assert_close(step.context, ref.context)
    torch.testing.assert_close(step.alpha, ref.alpha)


@pytest.mark.parametrize("local_window", [0.0, 1.0])
def test_mean_mode_is_uniform_and_ignores_the_query(local_window):
    att = make("additive", mode="mean", local_window=local_window)
    a, h = inputs()
    keys = att.prepare(a)
    step = att(keys, a, h, GRID)
    assert torch.equal(step.alpha, torch.full((B, L), 1.0 / L, dtype=a.dtype))
    torch.testing.assert_close(step.context, a.mean(1))
    other = att(keys, a, torch.randn_like(h), GRID, sample=True)
    torch.testing.assert_close(other.context, step.context)
    assert other.sample is None


# ---------------------------------------------------------------------------- through the model

VARIANTS = [{"score": s} for s in SCORES] + [
    {"normalizer": "sparsemax"},
    {"score": "general", "normalizer": "sparsemax"},
    {"local_window": 1.5},
    {"score": "dot", "normalizer": "sparsemax", "local_window": 2.0},
    {"attention": "hard", "score": "cosine"},
    {"attention": "mean"},
    {"local_window": 1.5, "local_width": "learned"},
    {"heads": 2},
    {"heads": 3, "attention": "hard", "score": "dot", "local_window": 2.0, "local_width": "learned"},
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()))
def test_variant_is_selected_by_the_config_and_survives_a_checkpoint(variant, tmp_path):
    cap = tiny_captioner(seed=11, **variant)
    att = cap.model.decoder.attention
    assert att.score == variant.get("score", "additive")
    assert att.normalizer == variant.get("normalizer", "softmax")
    assert att.mode == variant.get("attention", "soft")
    assert att.local_window == variant.get("local_window", 0.0)
    assert att.local_width == variant.get("local_width", "fixed")
    assert att.num_heads == variant.get("heads", 1)
    first = att.heads[0] if att.num_heads > 1 else att
    assert hasattr(first, "centre") == ("local_window" in variant)
    path = tmp_path / "model.pt"
    cap.save(path)
    again = Captioner.load(path)
    assert again.model.config == cap.model.config
    assert again.model.decoder.attention.score == att.score
    assert again.model.decoder.attention.local_window == att.local_window
    assert again.model.decoder.attention.num_heads == att.num_heads
    for k, v in cap.model.state_dict().items():
        assert torch.equal(v, again.model.state_dict()[k]), k
    images = [tiny_image(i) for i in range(3)]
    for opts in (DecodeOptions(beam_size=1, max_len=6), DecodeOptions(beam_size=3, max_len=6)):
        for x, y in zip(cap.caption_images(images, opts), again.caption_images(images, opts)):
            assert x.words == y.words
            assert x.score == y.score
            assert torch.equal(x.alphas, y.alphas)
            assert x.alphas_heads.shape[1] == att.num_heads  # one head: its map on a head axis
            assert torch.equal(x.alphas_heads, y.alphas_heads)
            if x.words:
                sums = x.alphas.flatten(1).sum(-1)
                torch.testing.assert_close(sums, torch.ones_like(sums), atol=1e-5, rtol=0)


def test_model_refuses_an_unknown_score():
    with pytest.raises(ValueError, match="unknown attention score"):
        tiny_captioner(score="telepathy")


@pytest.mark.parametrize("block_bytes", [1, 300, 1 << 30])
@pytest.mark.parametrize("k", [1, 3])
def test_blocked_additive_scores_equal_the_plain_expression(monkeypatch, block_bytes, k, kernels_switch):
    torch.manual_seed(0)
    att = Attention(6, 5, 4)
    a, h = torch.randn(7, 9, 6), torch.randn(7 * k, 5)  # k queries per image
    keys = att.prepare(a)
    with torch.no_grad():
        q = att.query_proj(h)
        plain = att.v(torch.tanh(keys.repeat_interleave(k, 0) + q.unsqueeze(1))).squeeze(-1)  # (7k, 9)
        monkeypatch.setattr(kernels, "BLOCK_BYTES", block_bytes)  # 1 image, 2 images (7 = 2+2+2+1), plain
        blocked_used = kernels.additive_ok(keys, q.view(7, k, 4))
        got = att.scores(keys, a, h)
    assert blocked_used == (kernels_switch and block_bytes < 7 * k * 9 * 4 * 4)
    torch.testing.assert_close(got, plain)
    # With gradients on, the differentiable forms are used.
    e = att.scores(keys, a, h)
    assert e.requires_grad


@pytest.mark.parametrize("score", SCORES)
@pytest.mark.parametrize("variant", ["softmax", "sparsemax", "local", "hard-argmax", "hard-expected", "mean"])
def test_queries_sharing_an_image_equal_queries_with_their_own_copy(score, variant):
    """Beam search's k beams per image attend over one copy of the image's annotations:
    the result equals giving every beam its own copy."""
    k = 3
    kw = {"sparsemax": {"normalizer": "sparsemax"}, "local": {"local_window": 1.5},
          "hard-argmax": {"mode": "hard"}, "hard-expected": {"mode": "hard"}, "mean": {"mode": "mean"}}.get(variant, {})
    att = make(score, **kw)
    a, _ = inputs()
    h = torch.randn(B * k, Q, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    a_rep = a.repeat_interleave(k, 0)
    argmax = variant == "hard-argmax"
    with torch.no_grad():
        shared = att(att.prepare(a), a, h, GRID, argmax=argmax)
        copied = att(att.prepare(a_rep), a_rep, h, GRID, argmax=argmax)
    torch.testing.assert_close(shared.alpha, copied.alpha)
    torch.testing.assert_close(shared.context, copied.context)
    assert shared.alpha.shape == (B * k, L) and shared.context.shape == (B * k, D)
    if argmax:  # the context is exactly the chosen annotation of the query's own image
        torch.testing.assert_close(shared.context, a_rep[torch.arange(B * k), shared.sample])


def test_sampled_contexts_come_from_the_querys_own_image():
    k = 4
    att = make(mode="hard")
    a, _ = inputs()
    h = torch.randn(B * k, Q, dtype=torch.float64)
    with torch.no_grad():
        o = att(att.prepare(a), a, h, GRID, sample=True, generator=torch.Generator().manual_seed(0))
    image = torch.arange(B * k) // k
    torch.testing.assert_close(o.context, a[image, o.sample])


@pytest.mark.parametrize("b,k", [(5, 1), (3, 3)])
def test_blocked_additive_score_gradient_equals_autograds(b, k, monkeypatch):
    """Training's cache-blocked additive score (recomputed in the backward) against the plain
    expression w^T tanh(keys + q) + b through autograd, blocks of one image and of all."""
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(b, 7, 6, dtype=torch.float64, generator=g, requires_grad=True)
    q = torch.randn(b, k, 6, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(6, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(1, dtype=torch.float64, generator=g, requires_grad=True)
    de = torch.randn(b, k, 7, dtype=torch.float64, generator=g)
    plain = torch.tanh(keys.unsqueeze(1) + q.unsqueeze(2)) @ w + bias
    ref = torch.autograd.grad(plain, (keys, q, w, bias), de)
    for block in (7 * 6 * k * 8, 1 << 20):  # one image a block, then all at once
        monkeypatch.setattr(kernels, "BLOCK_BYTES", block)
        out = kernels._AdditiveScore.apply(keys, q, w, bias)
        torch.testing.assert_close(out, plain)
        for got, want in zip(torch.autograd.grad(out, (keys, q, w, bias), de), ref):
            torch.testing.assert_close(got, want)
    assert torch.autograd.gradcheck(kernels._AdditiveScore.apply, (keys, q, w, bias))


def test_training_scores_take_the_blocked_path_with_autograd(kernels_switch):
    """With gradients on (CPU), the module's additive scores go through the blocked function,
    or with the kernels off through autograd's plain expression, to the same values and
    gradients."""
    torch.manual_seed(0)
    att = Attention(6, 5, 4).double()
    a, h = torch.randn(2, 3, 6, dtype=torch.float64), torch.randn(2, 5, dtype=torch.float64)
    keys = att.prepare(a)
    e = att.scores(keys, a, h)
    custom = type(e.grad_fn.next_functions[0][0]).__name__ == "_AdditiveScoreBackward"  # under a reshape
    assert custom == kernels_switch
    plain = att.v(torch.tanh(keys + att.query_proj(h).unsqueeze(1))).squeeze(-1)  # (2, 3)
    torch.testing.assert_close(e, plain)
    g = torch.randn(2, 3, dtype=torch.float64)
    for got, want in zip(torch.autograd.grad(e, list(att.parameters()), g, retain_graph=True),
                         torch.autograd.grad(plain, list(att.parameters()), g)):
        torch.testing.assert_close(got, want)
