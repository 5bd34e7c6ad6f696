"""Hard attention trained by REINFORCE: the estimator is unbiased for d L_s.

L_s = sum_s p(s|a) log p(y|s,a). On a tiny model (2x2 grid, a 3-step caption) every
attention path s (4^3 = 64 of them; with 2 heads, each drawing its own cell of a 1x2 grid,
(2^2)^3 = 64 too) can be enumerated, so the exact gradient of L_s and
the exact mean and variance of the per-sample estimator
    g(s) = d log p(y|s,a) + (log p(y|s,a) - b) d log p(s|a)
are known. The average of N sampled estimates must then lie within a few standard
errors sqrt(Var[g] / N) of the exact gradient, element by element.
"""

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from captioner.model.decoder import CaptionModel, ModelConfig
from captioner.model.encoders import Annotations
from captioner.train.config import HardConfig
from captioner.train.losses import HardAttentionObjective, caption_log_likelihood
from tests.tiny import tiny_captioner, token_batch

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


def _path_terms(model, image, tokens, path, with_entropy=False):
    """log p(s|a) and log p(y|s,a) (and the summed entropy of alpha_t) along a forced
    attention path, written from the equations (independent of the decoder's own loop).
    With several heads a path's step s is one cell per head: log p(s_t|a) = sum_j log
    alpha^j_t[s^j], and the context is W_o [a_{s^1}; ..; a_{s^h}] + b_o."""
    d = model.decoder
    ann = model.encode(image)
    a, grid = ann.vectors, ann.grid
    keys = d.attention.prepare(a)
    h, c = d.init_state(a)
    log_ps = torch.zeros(())
    log_py = torch.zeros(())
    entropy = torch.zeros(())
    multi = d.attention.num_heads > 1
    for t, s in enumerate(path):
        cells = list(s) if multi else [s]
        alpha = d.attention.head_weights(keys, a, h, grid)[0] if multi else d.attention.weights(keys, a, h, grid)
        alpha = alpha.view(len(cells), -1)  # (heads, L)
        log_ps = log_ps + sum(torch.log(alpha[j, cell]) for j, cell in enumerate(cells))
        entropy = entropy - (alpha * torch.log(alpha)).sum()
        values = [d.attention.value_proj[j](a[:, cell]) for j, cell in enumerate(cells)] if multi else None
        context = d.attention.out_proj(torch.cat(values, 1)) if multi else a[:, s]
        z = torch.sigmoid(d.f_beta(h)) * context  # beta_t * a_{s_t}
        emb = d.embedding(tokens[:, t])
        h, c = d.lstm(torch.cat([emb, z], 1), (h, c))
        logits = d.L_o(emb + d.L_h(h) + d.L_z(z))
        log_py = log_py + F.log_softmax(logits, -1)[0, tokens[0, t + 1]]
    return (log_ps, log_py, entropy) if with_entropy else (log_ps, log_py)


def _flat_grad(model, scalar):
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(scalar, params, allow_unused=True, retain_graph=True)
    return torch.cat([(g if g is not None else torch.zeros_like(p)).flatten() for g, p in zip(grads, params)])


# b: a baseline far from log p(y|s,a): it must not bias the estimate. Two heads' b leaves the
# check the power to see half a score-function term (the power is computed exactly, by
# enumeration: 6.4 standard errors at b = -30).
@pytest.mark.slow  # every path of attention cells enumerated, in float64: seconds
@pytest.mark.parametrize("heads, grid, b", [(1, (2, 2), -3.0), (2, (1, 2), -30.0)])
def test_reinforce_gradient_matches_the_exact_gradient_of_the_lower_bound(heads, grid, b):
    torch.manual_seed(0)
    cap = tiny_captioner(seed=11, attention="hard", dropout=0.0, heads=heads)
    model = cap.model.double().eval()  # sampling is explicit, dropout is off
    n_loc = grid[0] * grid[1]
    model.encoder = _FixedAnnotations(torch.randn(1, n_loc, model.config.annotation_dim, dtype=torch.float64), grid)
    image = torch.zeros(1, 1, dtype=torch.float64)  # the stand-in encoder ignores it
    tokens, lengths = token_batch(cap.vocab, [CAPTION])
    steps = tokens.shape[1] - 1
    # One step's choices: a cell, or with several heads a cell for each.
    choices = list(range(n_loc)) if heads == 1 else list(itertools.product(range(n_loc), repeat=heads))

    # Exact: L_s by enumeration, and the per-path estimator g(s) with its probability.
    bound = torch.zeros((), dtype=torch.float64)
    pathwise, score_fn, p_paths = [], [], []
    for path in itertools.product(choices, repeat=steps):
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
    # The estimator above: reward the caption's log-likelihood, weight 1, averaged over samples.
    plain = HardConfig(reward="caption", lambda_r=1.0, reduction="mean", entropy=0.0, expected_context_prob=0.0)
    objective = HardAttentionObjective(plain, 0.0, b)
    parts = objective(model, image.expand(n, -1), tokens.expand(n, -1), lengths.expand(n))
    assert parts.sampled
    estimate = -_flat_grad(model, parts.loss)  # the loss is minus the surrogate

    se = (var / n).sqrt()
    z = (estimate - exact).abs() / se.clamp_min(1e-12)
    # Elements with no variance (parameters the paths do not move) must match exactly.
    assert torch.allclose(estimate[se < 1e-12], exact[se < 1e-12], atol=1e-9)
    assert float(z[se >= 1e-12].max()) < 5.0  # ~1e-3 chance of a false alarm over all elements
    # The test has power: an estimator without the score-function term fails it, and so does
    # one with half of it (what averaging the heads' log-probabilities would give).
    no_score = (p_paths[:, None] * torch.stack(pathwise)).sum(0)
    assert float(((no_score - exact).abs() / se.clamp_min(1e-12)).max()) > 5
    half_score = (p_paths[:, None] * (torch.stack(pathwise) + 0.5 * torch.stack(score_fn))).sum(0)
    assert float(((half_score - exact).abs() / se.clamp_min(1e-12)).max()) > 5


def _fixed_hard_model(seed, **variant):
    cap = tiny_captioner(seed=seed, attention="hard", dropout=0.0, **variant)
    model = cap.model.double().eval()  # sampling is explicit, dropout is off
    torch.manual_seed(seed)
    model.encoder = _FixedAnnotations(torch.randn(1, 4, model.config.annotation_dim, dtype=torch.float64), (2, 2))
    return cap, model


CAPTIONS = ["red circle", "a small blue star"]  # different lengths: 3 and 5 real steps


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gradient_and_baseline_are_scaled_as_the_paper_or_the_authors_code(reduction):
    """The objective against the formula written out by hand along the sampled paths:
    loss = mean_b -log p(y_b) - c sum_b [0.1 (log p(y_b)/n_b - b) log p(s_b) + 0.002 H_b],
    b <- 0.9 b + 0.1 mean_b log p(y_b)/n_b (n_b: the caption's real steps, <end> included),
    with c = 1/B by default (the paper's mean over the samples), 1 with capgen's "sum"."""
    cap, model = _fixed_hard_model(4)
    tokens, lengths = token_batch(cap.vocab, CAPTIONS)
    images = torch.zeros(len(CAPTIONS), 1, dtype=torch.float64)
    b0 = -1.5
    c = 1 / len(CAPTIONS) if reduction == "mean" else 1.0
    objective = HardAttentionObjective(HardConfig(expected_context_prob=0.0, reduction=reduction), 0.0, b0)
    torch.manual_seed(7)
    parts = objective(model, images, tokens, lengths)
    assert parts.sampled
    got = _flat_grad(model, parts.loss)

    # The same draws again, to read off the sampled locations: s_t is where log alpha_t = log p(s_t).
    torch.manual_seed(7)
    out = model(images, tokens, lengths, sample=True)
    paths = (torch.log(out.alphas) - out.sample_log_probs.unsqueeze(-1)).abs().argmin(-1)  # (B, T)
    hand = torch.zeros((), dtype=torch.float64)
    rewards = []
    for i, n in enumerate((lengths - 1).tolist()):
        log_ps, log_py, entropy = _path_terms(model, images[:1], tokens[i:i + 1], paths[i, :n].tolist(),
                                              with_entropy=True)
        reward = log_py.item() / n
        rewards.append(reward)
        hand = hand - log_py / len(CAPTIONS) - c * (0.1 * (reward - b0) * log_ps + 0.002 * entropy)
    expected = _flat_grad(model, hand)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)  # the objective works in float32
    assert abs(objective.baseline - (0.9 * b0 + 0.1 * sum(rewards) / len(rewards))) < 1e-6
    assert parts.baseline == objective.baseline
    # The test has power: this project's first form (whole-caption reward, weight 1, batch mean) differs.
    first = HardAttentionObjective(HardConfig(reward="caption", lambda_r=1.0, reduction="mean",
                                              expected_context_prob=0.0), 0.0, b0)
    torch.manual_seed(7)
    other = _flat_grad(model, first(model, images, tokens, lengths).loss)
    assert not torch.allclose(other, expected, rtol=1e-3, atol=1e-6)


def test_duplicating_every_caption_leaves_the_default_gradient_alone_and_doubles_the_summed_terms(monkeypatch):
    """The default averages the score-function and entropy terms over the captions, as it
    does the NLL: a batch of every caption twice is the same objective. capgen's summed
    form adds them over the captions: twice the captions, twice those terms."""
    cap, model = _fixed_hard_model(5)
    tokens, lengths = token_batch(cap.vocab, CAPTIONS)
    images = torch.zeros(len(CAPTIONS), 1, dtype=torch.float64)
    # A caption and its copy must draw the same cells: the most likely one stands in for the
    # draw (log p(s|a) and its gradient are computed as for a sample).
    monkeypatch.setattr(torch, "multinomial", lambda p, n, generator=None: p.argmax(-1, keepdim=True))

    def grad(twice: bool, **kw) -> torch.Tensor:
        objective = HardAttentionObjective(HardConfig(expected_context_prob=0.0, **kw), 0.0, -1.0)
        rep = 2 if twice else 1
        parts = objective(model, images.repeat(rep, 1), tokens.repeat(rep, 1), lengths.repeat(rep))
        assert parts.sampled
        return _flat_grad(model, parts.loss)

    torch.testing.assert_close(grad(True), grad(False))  # the default
    once, twice, mean = grad(False, reduction="sum"), grad(True, reduction="sum"), grad(False, reduction="mean")
    b = len(CAPTIONS)
    extra = (once - mean) / (1 - 1 / b)  # the summed score-function and entropy terms of one copy
    assert extra.abs().max() > 1e-3  # they move the weights: the check has power
    torch.testing.assert_close(twice - once, extra)


def test_shares_of_a_batch_weighted_as_the_loop_weighs_them_give_the_whole_batch_gradient(monkeypatch):
    """Under torchrun each of R ranks holds a share of the global batch; the loop scales a
    rank's loss by its share (local B * R / global B) and averages the ranks' gradients. With
    the default per-caption mean, that is the objective over the global batch, every term of
    it: the same draws give the same gradient as one process holding all the captions."""
    cap, model = _fixed_hard_model(5)
    captions = CAPTIONS + ["a red star", "a blue circle and a red square"]
    tokens, lengths = token_batch(cap.vocab, captions)
    images = torch.zeros(len(captions), 1, dtype=torch.float64)
    monkeypatch.setattr(torch, "multinomial", lambda p, n, generator=None: p.argmax(-1, keepdim=True))
    whole = HardAttentionObjective(HardConfig(expected_context_prob=0.0), 0.0, -1.0)
    expected = _flat_grad(model, whole(model, images, tokens, lengths).loss)
    ranks = [slice(0, 1), slice(1, 4)]  # shares of different sizes, as a short last batch gives

    def rank_loss(part: slice) -> torch.Tensor:
        objective = HardAttentionObjective(HardConfig(expected_context_prob=0.0), 0.0, -1.0)
        t = tokens[part][:, :int(lengths[part].max())]  # each rank pads to its own longest caption
        return objective(model, images[part], t, lengths[part], global_batch=len(captions)).loss

    got = torch.zeros_like(expected)
    for part in ranks:
        share = len(tokens[part]) * len(ranks) / len(captions)
        got += _flat_grad(model, rank_loss(part) * share) / len(ranks)  # DDP's average over the ranks
    torch.testing.assert_close(got, expected)
    # The check has power: without the share weighting the short share would count 3 times over.
    unweighted = sum(_flat_grad(model, rank_loss(p)) for p in ranks) / len(ranks)
    assert not torch.allclose(unweighted, expected, rtol=1e-3, atol=1e-6)


def test_the_mean_reduction_divides_the_score_and_entropy_terms_by_the_batch():
    cap, model = _fixed_hard_model(5)
    tokens, lengths = token_batch(cap.vocab, CAPTIONS)
    images = torch.zeros(len(CAPTIONS), 1, dtype=torch.float64)
    grads = {}
    for reduction in ("sum", "mean"):
        objective = HardAttentionObjective(HardConfig(reduction=reduction, expected_context_prob=0.0), 0.0, -1.0)
        torch.manual_seed(3)
        loss = objective(model, images, tokens, lengths).loss
        nll_only = -caption_log_likelihood(_replay(model, images, tokens, lengths, 3), tokens[:, 1:]).mean()
        grads[reduction] = _flat_grad(model, loss - nll_only)  # the score-function and entropy terms alone
    torch.testing.assert_close(grads["mean"] * len(CAPTIONS), grads["sum"])
    # Under torchrun each process holds a share: "sum" adds up over the global batch.
    objective = HardAttentionObjective(HardConfig(reduction="sum", expected_context_prob=0.0), 0.0, -1.0)
    torch.manual_seed(3)
    share = objective(model, images, tokens, lengths, global_batch=8).loss
    nll_only = -caption_log_likelihood(_replay(model, images, tokens, lengths, 3), tokens[:, 1:]).mean()
    torch.testing.assert_close(_flat_grad(model, share - nll_only), grads["mean"] * 8)


def _replay(model, images, tokens, lengths, seed):
    torch.manual_seed(seed)
    return model(images, tokens, lengths, sample=True)


def test_expected_minibatches_add_the_entropy_bonus_and_update_the_baseline():
    """The authors apply the entropy term and the baseline update on every minibatch; on the
    expected context the loss is the soft model's minus the entropy bonus."""
    cap, model = _fixed_hard_model(6)
    tokens, lengths = token_batch(cap.vocab, CAPTIONS)
    images = torch.zeros(len(CAPTIONS), 1, dtype=torch.float64)
    objective = HardAttentionObjective(HardConfig(expected_context_prob=1.0), 0.0, baseline=-2.0)
    parts = objective(model, images, tokens, lengths)
    assert parts.sampled is False
    got = _flat_grad(model, parts.loss)

    soft = CaptionModel(ModelConfig.from_dict({**model.config.to_dict(), "attention": "soft"})).double().eval()
    soft.encoder = model.encoder
    soft.load_state_dict(model.state_dict())
    out = soft(images, tokens, lengths)
    ll = caption_log_likelihood(out, tokens[:, 1:])  # (B,) the expected context's log-likelihood
    mask = out.mask.double()
    entropy = (-(out.alphas * torch.log(out.alphas)).sum(-1) * mask).sum(1)  # (B,)
    hand = -ll.mean() - 0.002 * entropy.mean()
    torch.testing.assert_close(parts.loss.item(), hand.item(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, _flat_grad(soft, hand), rtol=1e-4, atol=1e-6)
    word_mean = (ll / mask.sum(1)).mean().item()
    assert abs(objective.baseline - (0.9 * -2.0 + 0.1 * word_mean)) < 1e-6


def test_with_several_heads_the_entropy_bonus_is_the_sum_of_the_heads_entropies():
    """Heads draw their cells independently: the entropy of the draw is the sum of the heads'
    entropies (not the entropy of their mean map), as log p(s|a) is the sum of theirs."""
    cap, model = _fixed_hard_model(6, heads=2)
    tokens, lengths = token_batch(cap.vocab, CAPTIONS)
    images = torch.zeros(len(CAPTIONS), 1, dtype=torch.float64)
    objective = HardAttentionObjective(HardConfig(expected_context_prob=1.0), 0.0, baseline=-2.0)
    parts = objective(model, images, tokens, lengths)
    out = model(images, tokens, lengths)  # the expected context, as on this minibatch
    mask = out.mask.double()
    heads = out.alphas_heads  # (B, T, 2, L)
    entropy = (-(heads * torch.log(heads)).sum((-1, -2)) * mask).sum(1)  # (B,)
    of_mean = (-(out.alphas * torch.log(out.alphas)).sum(-1) * mask).sum(1)
    assert float((entropy - of_mean).abs().min()) > 1e-3  # the two differ: the check can fail
    torch.testing.assert_close(float(parts.entropy), entropy.mean().item(), rtol=1e-5, atol=1e-6)
    hand = -caption_log_likelihood(out, tokens[:, 1:]).mean() - 0.002 * entropy.mean()
    torch.testing.assert_close(parts.loss.item(), hand.item(), rtol=1e-5, atol=1e-6)


def test_the_coin_is_its_own_stream_the_same_on_every_rank_and_resumed():
    """Ranks seed the global RNG differently (their own samples and dropout): the coin must not
    depend on it, or ranks would mix sampled and expected contexts in one update."""
    flips = []
    for rank in range(2):
        torch.manual_seed(100 + rank)
        objective = HardAttentionObjective(HardConfig(), 0.0, seed=9)
        flips.append([objective.use_expected_context() for _ in range(64)])
    assert flips[0] == flips[1] and 10 < sum(flips[0]) < 54
    objective = HardAttentionObjective(HardConfig(), 0.0, seed=9)
    for _ in range(20):
        objective.use_expected_context()
    resumed = HardAttentionObjective(HardConfig(), 0.0, seed=0)
    resumed.load_state_dict(objective.state_dict())
    assert [resumed.use_expected_context() for _ in range(44)] == flips[0][20:]


class _TwoRanks:
    """Stands in for a DistContext of two ranks whose other rank holds ``other`` (sum, count)."""

    active = True

    def __init__(self, other_sum, other_count):
        self.others = iter([other_sum, other_count])

    def sum(self, value):
        return value + next(self.others)


def test_the_baseline_follows_the_mean_reward_of_the_global_batch():
    cap, model = _fixed_hard_model(8)
    tokens, lengths = token_batch(cap.vocab, CAPTIONS)
    images = torch.zeros(len(CAPTIONS), 1, dtype=torch.float64)
    local = HardAttentionObjective(HardConfig(expected_context_prob=1.0), 0.0, baseline=-1.0)
    local(model, images, tokens, lengths)
    mine = (local.baseline - 0.9 * -1.0) / 0.1 * len(CAPTIONS)  # this rank's summed reward
    shared = HardAttentionObjective(HardConfig(expected_context_prob=1.0), 0.0, baseline=-1.0,
                                    dist=_TwoRanks(-3.0, 2))  # the other rank: two captions, rewards summing to -3
    shared(model, images, tokens, lengths)
    assert abs(shared.baseline - (0.9 * -1.0 + 0.1 * (mine - 3.0) / 4)) < 1e-6


def test_expected_context_is_used_for_about_half_of_the_minibatches():
    objective = HardAttentionObjective(HardConfig(expected_context_prob=0.5), 0.0, baseline=0.0)
    n = 4000
    flips = sum(objective.use_expected_context() for _ in range(n))
    # Binomial(4000, 0.5): sd about 32; 4 sd either side.
    assert abs(flips - n / 2) < 4 * 32
    never = HardAttentionObjective(HardConfig(expected_context_prob=0.0), 0.0)
    always = HardAttentionObjective(HardConfig(expected_context_prob=1.0), 0.0)
    assert not any(never.use_expected_context() for _ in range(100))
    assert all(always.use_expected_context() for _ in range(100))


def test_unknown_reward_or_reduction_is_refused():
    with pytest.raises(ValueError, match="hard.reward"):
        HardAttentionObjective(HardConfig(reward="sentence"), 0.0)
    with pytest.raises(ValueError, match="hard.reduction"):
        HardAttentionObjective(HardConfig(reduction="max"), 0.0)
