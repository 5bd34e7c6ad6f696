"""Hard attention trained by REINFORCE: the estimator is unbiased for d L_s.

L_s = sum_s p(s|a) log p(y|s,a). On a tiny model (2x2 grid, a 3-step caption) every
attention path s (4^3 = 64 of them) can be enumerated, so the exact gradient of L_s and
the exact mean and variance of the per-sample estimator
    g(s) = d log p(y|s,a) + (log p(y|s,a) - b) d log p(s|a)
are known. The average of N sampled estimates must then lie within a few standard
errors sqrt(Var[g] / N) of the exact gradient, element by element.
"""

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from captioner.encoders import Annotations
from tiny import tiny_captioner, token_batch
from train.config import HardConfig
from train.losses import HardAttentionObjective

CAPTION = "red circle"


class _FixedAnnotations(nn.Module):
    """Stands in for the encoder: every image has the same annotations (1, L, D), so
    N samples cost N decoder rows, not N CNN passes."""

    def __init__(self, a: torch.Tensor, grid: tuple[int, int]):
        super().__init__()
        self.register_buffer("a", a)
        self.grid = grid

    def forward(self, images: torch.Tensor) -> Annotations:
        return Annotations(self.a.expand(images.shape[0], -1, -1), self.grid)


def _path_terms(model, image, tokens, path):
    """log p(s|a) and log p(y|s,a) along a forced attention path, written from the
    equations (independent of the decoder's own loop)."""
    d = model.decoder
    ann = model.encode(image)
    a, grid = ann.vectors, ann.grid
    keys = d.attention.prepare(a)
    h, c = d.init_state(a)
    log_ps = torch.zeros(())
    log_py = torch.zeros(())
    for t, s in enumerate(path):
        alpha = d.attention.weights(keys, a, h, grid)  # (1, L)
        log_ps = log_ps + torch.log(alpha[0, s])
        z = torch.sigmoid(d.f_beta(h)) * a[:, s]  # beta_t * a_{s_t}
        emb = d.embedding(tokens[:, t])
        h, c = d.lstm(torch.cat([emb, z], 1), (h, c))
        logits = d.L_o(emb + d.L_h(h) + d.L_z(z))
        log_py = log_py + F.log_softmax(logits, -1)[0, tokens[0, t + 1]]
    return log_ps, log_py


def _flat_grad(model, scalar):
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(scalar, params, allow_unused=True, retain_graph=True)
    return torch.cat([(g if g is not None else torch.zeros_like(p)).flatten() for g, p in zip(grads, params)])


def test_reinforce_gradient_matches_the_exact_gradient_of_the_lower_bound():
    torch.manual_seed(0)
    cap = tiny_captioner(seed=11, attention="hard", dropout=0.0)
    model = cap.model.double().eval()  # sampling is explicit, dropout is off
    model.encoder = _FixedAnnotations(torch.randn(1, 4, model.config.annotation_dim, dtype=torch.float64), (2, 2))
    image = torch.zeros(1, 1, dtype=torch.float64)  # the stand-in encoder ignores it
    tokens, lengths = token_batch(cap.vocab, [CAPTION])
    steps = tokens.shape[1] - 1
    n_loc = 4
    b = -3.0  # a baseline far from log p(y|s,a): it must not bias the estimate

    # Exact: L_s by enumeration, and the per-path estimator g(s) with its probability.
    bound = torch.zeros((), dtype=torch.float64)
    pathwise, score_fn, p_paths = [], [], []
    for path in itertools.product(range(n_loc), repeat=steps):
        log_ps, log_py = _path_terms(model, image, tokens, path)
        bound = bound + log_ps.exp() * log_py
        pathwise.append(_flat_grad(model, log_py))
        score_fn.append((log_py.detach() - b) * _flat_grad(model, log_ps))
        p_paths.append(log_ps.exp().detach())
    exact = _flat_grad(model, bound)
    p_paths = torch.stack(p_paths)
    g_paths = torch.stack(pathwise) + torch.stack(score_fn)
    assert abs(float(p_paths.sum()) - 1) < 1e-9
    mean = (p_paths[:, None] * g_paths).sum(0)
    torch.testing.assert_close(mean, exact)  # the identity E[g] = d L_s, exactly
    var = (p_paths[:, None] * (g_paths - mean) ** 2).sum(0)

    # Sampled: the training objective on N copies of the image averages N estimates.
    n = 20_000
    objective = HardAttentionObjective(HardConfig(lambda_r=1.0, entropy=0.0, expected_context_prob=0.0), 0.0, b)
    parts = objective(model, image.expand(n, -1), tokens.expand(n, -1), lengths.expand(n))
    assert parts.sampled
    estimate = -_flat_grad(model, parts.loss)  # the loss is minus the surrogate

    se = (var / n).sqrt()
    z = (estimate - exact).abs() / se.clamp_min(1e-12)
    # Elements with no variance (parameters the paths do not move) must match exactly.
    assert torch.allclose(estimate[se < 1e-12], exact[se < 1e-12], atol=1e-9)
    assert float(z[se >= 1e-12].max()) < 5.0  # ~1e-3 chance of a false alarm over all elements
    # The test has power: leaving out the score-function term misses the exact gradient.
    # The test has power: an estimator without the score-function term fails it.
    no_score = (p_paths[:, None] * torch.stack(pathwise)).sum(0)
    assert float(((no_score - exact).abs() / se.clamp_min(1e-12)).max()) > 5


def test_baseline_moves_towards_the_log_likelihood():
    cap = tiny_captioner(seed=2, attention="hard")
    tokens, lengths = token_batch(cap.vocab, ["a red circle", "a blue star"])
    images = torch.randn(2, 3, 32, 32)
    objective = HardAttentionObjective(HardConfig(baseline_decay=0.9, expected_context_prob=0.0), 0.0, baseline=-1.0)
    parts = objective(cap.model, images, tokens, lengths)
    log_py = -parts.nll  # mean log p(y|s,a) of this minibatch
    assert abs(objective.baseline - (0.9 * -1.0 + 0.1 * log_py)) < 1e-5
    assert parts.baseline == objective.baseline


def test_expected_context_is_used_for_about_half_of_the_minibatches():
    torch.manual_seed(0)
    objective = HardAttentionObjective(HardConfig(expected_context_prob=0.5), 0.0, baseline=0.0)
    n = 4000
    flips = sum(objective.use_expected_context() for _ in range(n))
    # Binomial(4000, 0.5): sd about 32; 4 sd either side.
    assert abs(flips - n / 2) < 4 * 32
    never = HardAttentionObjective(HardConfig(expected_context_prob=0.0), 0.0)
    always = HardAttentionObjective(HardConfig(expected_context_prob=1.0), 0.0)
    assert not any(never.use_expected_context() for _ in range(100))
    assert all(always.use_expected_context() for _ in range(100))


def test_expected_minibatches_use_the_soft_context_and_leave_the_baseline():
    cap = tiny_captioner(seed=3, attention="hard")
    tokens, lengths = token_batch(cap.vocab, ["a red circle"])
    images = torch.randn(1, 3, 32, 32)
    objective = HardAttentionObjective(HardConfig(expected_context_prob=1.0), 0.0, baseline=-2.0)
    parts = objective(cap.model, images, tokens, lengths)
    assert parts.sampled is False and objective.baseline == -2.0
    # The expected-context loss is the soft model's: deterministic, the same twice.
    again = objective(cap.model, images, tokens, lengths)
    assert abs(parts.nll - again.nll) < 1e-6
    sampled = HardAttentionObjective(HardConfig(expected_context_prob=0.0), 0.0, baseline=-2.0)
    assert sampled(cap.model, images, tokens, lengths).sampled is True
