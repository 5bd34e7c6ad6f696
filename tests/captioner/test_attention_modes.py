"""The attention's options as objects: each mode (phi), normaliser and local width answers
what depends on it, is chosen once by name, and computes what its equation says."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from captioner.model import attention
from captioner.model.attention import (
    HARD_INFERENCE,
    LOCAL_WIDTHS,
    MIN_HALF_WIDTH,
    MODES,
    NORMALIZERS,
    Attention,
    attention_mode,
    sparsemax,
)
from captioner.model.multihead import MultiHeadAttention
from captioner.search.decoding import hard_kwargs
from captioner.search.options import HARD_ATTENTION, DecodeOptions

B, D, Q, A = 3, 7, 5, 6
GRID = (3, 4)
L = GRID[0] * GRID[1]


def _inputs(seed=1, k=1):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(B, L, D, generator=g, dtype=torch.float64)
    alpha = torch.softmax(torch.randn(B * k, L, generator=g, dtype=torch.float64) * 3, -1)
    return a, alpha


# ---------------------------------------------------------------------------- the registries

def test_each_registry_holds_its_objects_under_their_own_names():
    for registry in (MODES, NORMALIZERS, LOCAL_WIDTHS):
        assert all(obj.name == name for name, obj in registry.items())
    assert list(MODES) == ["soft", "hard", "mean"]
    assert list(NORMALIZERS) == ["softmax", "sparsemax"]
    assert list(LOCAL_WIDTHS) == ["fixed", "learned"]
    assert list(HARD_INFERENCE) == ["expected", "argmax", "sample"]


@pytest.mark.parametrize("name, stochastic, attends", [("soft", False, True), ("hard", True, True),
                                                        ("mean", False, False)])
def test_each_mode_answers_what_depends_on_it(name, stochastic, attends):
    mode = attention_mode(name)
    assert mode is MODES[name]
    assert mode.stochastic is stochastic  # REINFORCE, the [hard] section, the decoding menu
    assert mode.attends is attends  # scores with gradients, the penalty, several heads, pointing


@pytest.mark.parametrize("name, learned, outputs", [("fixed", False, 2), ("learned", True, 3)])
def test_each_local_width_says_what_the_centre_network_predicts(name, learned, outputs):
    width = LOCAL_WIDTHS[name]
    assert width.learned is learned and width.outputs == outputs
    att = Attention(D, Q, A, local_window=1.5, local_width=name)
    assert att.centre[-1].out_features == outputs


@pytest.mark.parametrize("name, sample, argmax", [("expected", False, False), ("argmax", False, True),
                                                  ("sample", True, False)])
def test_each_hard_inference_choice_is_what_decoding_asks_the_attention_for(name, sample, argmax):
    look = HARD_INFERENCE[name]
    assert (look.sample, look.argmax) == (sample, argmax)
    assert hard_kwargs(DecodeOptions(hard_attention=name)) == {"sample": sample, "argmax": argmax}
    assert look.describes  # the app's menu shows these words


def test_the_options_name_every_hard_inference_choice_and_no_other():
    """The torch-free options list the registry's names: the runtime checks them without torch."""
    assert HARD_ATTENTION == tuple(HARD_INFERENCE)


def test_unknown_names_are_refused_in_one_line_with_the_registrys_choices():
    with pytest.raises(ValueError, match=r"unknown attention mode 'telepathy'; choose from soft, hard, mean$"):
        attention_mode("telepathy")
    with pytest.raises(ValueError, match=r"unknown normalizer 'entmax'; choose from softmax, sparsemax$"):
        Attention(D, Q, A, normalizer="entmax")
    with pytest.raises(ValueError, match=r"unknown local_width 'wide'; choose from fixed, learned$"):
        Attention(D, Q, A, local_window=1.0, local_width="wide")
    with pytest.raises(ValueError, match="unknown attention mode"):  # not a TypeError for a list
        attention_mode(["soft"])
    with pytest.raises(ValueError, match="hard_attention 'peek': must be one of expected, argmax, sample"):
        DecodeOptions(hard_attention="peek")
    with pytest.raises(ValueError, match="needs local_window > 0"):
        Attention(D, Q, A, local_width="learned")


# ---------------------------------------------------------------------------- chosen once

@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("normalizer", list(NORMALIZERS))
def test_the_attention_chooses_its_objects_once_and_reports_their_names(mode, normalizer):
    att = Attention(D, Q, A, mode=mode, normalizer=normalizer, local_window=1.5, local_width="learned")
    assert att.phi is MODES[mode] and att.normalize is NORMALIZERS[normalizer]
    assert att.width is LOCAL_WIDTHS["learned"]
    assert (att.mode, att.normalizer, att.local_width, att.score) == (mode, normalizer, "learned", "additive")
    # a mode that does not attend leaves its score layers without gradient
    assert all(p.requires_grad == MODES[mode].attends for p in att.parameters())
    assert "phi" not in dict(att.named_modules()) and not any("phi" in k for k in att.state_dict())


def test_several_heads_share_the_mode_and_refuse_one_that_does_not_attend():
    mh = MultiHeadAttention(D, Q, A, heads=2, mode="hard", normalizer="sparsemax")
    assert mh.phi is MODES["hard"] and all(h.phi is MODES["hard"] for h in mh.heads)
    assert (mh.mode, mh.normalizer, mh.local_width, mh.score) == ("hard", "sparsemax", "fixed", "additive")
    with pytest.raises(ValueError, match="attention 'mean' has no weights for several heads"):
        MultiHeadAttention(D, Q, A, heads=2, mode="mean")
    with pytest.raises(ValueError, match="unknown attention mode"):
        MultiHeadAttention(D, Q, A, heads=2, mode="nope")


# ---------------------------------------------------------------------------- the equations

def test_softmax_and_its_window_are_softmax_of_e_and_of_e_plus_log_window():
    e = torch.randn(4, L, dtype=torch.float64)
    log_w = -torch.rand(4, L, dtype=torch.float64) * 5
    softmax = NORMALIZERS["softmax"]
    torch.testing.assert_close(softmax(e), torch.softmax(e, -1), rtol=0, atol=0)
    windowed = torch.softmax(e, -1) * log_w.exp()
    torch.testing.assert_close(softmax.windowed(e, log_w), windowed / windowed.sum(-1, keepdim=True))


def test_sparsemax_and_its_window_keep_the_exact_zeros():
    e = torch.randn(4, L, dtype=torch.float64) * 3
    log_w = -torch.rand(4, L, dtype=torch.float64) * 5
    sm = NORMALIZERS["sparsemax"]
    alpha = sparsemax(e)
    torch.testing.assert_close(sm(e), alpha, rtol=0, atol=0)
    windowed = alpha * log_w.exp()
    out = sm.windowed(e, log_w)
    torch.testing.assert_close(out, windowed / windowed.sum(-1, keepdim=True))
    assert torch.equal(out == 0, alpha == 0)


def test_each_width_gives_the_half_width_of_its_definition():
    out = torch.randn(5, 3, dtype=torch.float64)
    assert LOCAL_WIDTHS["fixed"].half_width(out[:, :2], 2.5) == 2.5
    learned = LOCAL_WIDTHS["learned"].half_width(out, 2.5)
    assert learned.shape == (5, 1, 1)
    torch.testing.assert_close(learned.flatten(), MIN_HALF_WIDTH + F.softplus(out[:, 2]))
    att = Attention(D, Q, A, local_window=2.5, local_width="learned").double()
    start = LOCAL_WIDTHS["learned"].half_width(att.centre(torch.randn(6, Q, dtype=torch.float64)), 2.5)
    torch.testing.assert_close(start.flatten(), torch.full((6,), 2.5, dtype=torch.float64))


@pytest.mark.parametrize("name", list(MODES))
@pytest.mark.parametrize("k", [1, 3])
def test_every_mode_without_a_draw_gives_the_expected_context(name, k):
    a, alpha = _inputs(k=k)
    step = MODES[name].context(alpha, a)
    image = torch.arange(B * k) // k
    expected = (alpha.unsqueeze(-1) * a[image]).sum(1)  # sum_i alpha_i a_i, each query over its own image
    torch.testing.assert_close(step.context, expected)
    assert torch.equal(step.alpha_heads, alpha.unsqueeze(1)) and step.sample is None
    if name != "hard":  # only a stochastic mode draws or picks
        drawn = MODES[name].context(alpha, a, sample=True, argmax=True)
        assert torch.equal(drawn.context, step.context) and drawn.sample is None


@pytest.mark.parametrize("k", [1, 3])
def test_hard_picks_one_annotation_of_its_own_image(k):
    a, alpha = _inputs(k=k)
    image = torch.arange(B * k) // k
    hard = MODES["hard"]
    top = hard.context(alpha, a, argmax=True)
    assert torch.equal(top.sample, alpha.argmax(-1)) and torch.equal(top.context, a[image, top.sample])
    assert top.sample_log_prob is None
    g = torch.Generator().manual_seed(0)
    drawn = hard.context(alpha, a, sample=True, generator=g)
    assert torch.equal(drawn.context, a[image, drawn.sample])
    torch.testing.assert_close(drawn.sample_log_prob, alpha.gather(1, drawn.sample[:, None]).squeeze(1).log())
    torch.testing.assert_close(drawn.entropy, -(alpha * alpha.log()).sum(-1))


def test_a_mode_that_does_not_attend_gives_the_uniform_map_whatever_the_query():
    att = Attention(D, Q, A, mode="mean").double()
    a, _ = _inputs()
    h = torch.randn(B, Q, dtype=torch.float64)
    alpha = att.weights(att.prepare(a), a, h, GRID)
    assert torch.equal(alpha, torch.full((B, L), 1 / L, dtype=torch.float64))


def test_a_mode_added_to_the_registry_is_chosen_by_its_name(monkeypatch):
    """A new mode is one class and one registry entry: the module picks it by name."""

    class Nearest(attention.Hard):
        name = "nearest"

    monkeypatch.setitem(attention.MODES, "nearest", Nearest())
    att = Attention(D, Q, A, mode="nearest")
    assert att.mode == "nearest" and att.phi.stochastic
    a, _ = _inputs()
    h = torch.randn(B, Q)
    step = att(att.prepare(a.float()), a.float(), h, GRID, argmax=True)
    assert step.sample is not None
