"""The kernels' one switch: read from the environment, settable from code, and when off a
whole training step (model, loss, backward) and a decoding run use no fast form and no
custom autograd function, only torch's plain operations."""

import os
import subprocess
import sys

import pytest
import torch

from captioner.model import kernels
from captioner.search.decoding import beam_search
from captioner.search.options import DecodeOptions
from captioner.train.config import HardConfig
from captioner.train.losses import HardAttentionObjective, soft_loss
from tests.tiny import tiny_captioner, tiny_image, token_batch

CAPTIONS = ["a red circle and a blue square", "a small green star"]
VARIANTS = {
    "additive": {},
    "sparsemax-local": {"normalizer": "sparsemax", "local_window": 1.5},
    "heads2-cosine": {"heads": 2, "score": "cosine"},
    "hard": {"attention": "hard"},
}
ENTRY_POINTS = ("deferred_lstm", "additive_scores", "sparsemax_gradient", "token_log_prob")
FUNCTIONS = ("_LSTMWeights", "_CollectWeightGrad", "_StepProduct", "_AdditiveScore", "_SparsemaxGradient",
             "_TokenLogProb")


def _custom_functions(loss: torch.Tensor) -> set[str]:
    """Names of the custom autograd functions in the graph behind ``loss``."""
    found, seen, stack = set(), set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            found.add(type(node).__name__)
        stack.extend(f for f, _ in node.next_functions)
    return found


def _refuse(*_args, **_kwargs):
    raise AssertionError("a fast form ran with the kernels switched off")


def _training_step(variant: dict) -> torch.Tensor:
    """One training step of a tiny model on two images: its loss, after the backward."""
    cap = tiny_captioner(seed=4, **variant)
    model = cap.model.train()
    images = torch.stack([cap.preprocess(tiny_image(s)) for s in (1, 2)])
    tokens, lengths = token_batch(cap.vocab, CAPTIONS)
    if variant.get("attention") == "hard":
        objective = HardAttentionObjective(HardConfig(expected_context_prob=0.0), doubly_stochastic=1.0)
        parts = objective(model, images, tokens, lengths)
    else:
        parts = soft_loss(model, images, tokens, lengths, doubly_stochastic=1.0)
    parts.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.decoder.parameters() if p.grad is not None)
    assert model.decoder.lstm.weight_hh.grad.abs().sum() > 0
    return parts.loss


@pytest.fixture
def every_fast_form_eligible(monkeypatch):
    """Sizes at which every fast form would be taken: the LSTM's deferred gradient and the
    blocked no-gradient scores however small the model."""
    monkeypatch.setattr(kernels, "DEFERRED_MIN_WEIGHT", 0)
    monkeypatch.setattr(kernels, "BLOCK_BYTES", 1)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_with_the_switch_off_a_training_step_uses_no_custom_autograd_function(
        name, every_fast_form_eligible, monkeypatch):
    before = kernels.set_enabled(False)
    try:
        for entry in ENTRY_POINTS:
            monkeypatch.setattr(kernels, entry, _refuse)
        for fn in FUNCTIONS:
            monkeypatch.setattr(getattr(kernels, fn), "apply", _refuse)
        loss = _training_step(VARIANTS[name])
    finally:
        kernels.set_enabled(before)
    assert _custom_functions(loss) == set()


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_with_the_switch_on_the_same_step_takes_the_fast_forms(name, every_fast_form_eligible, kernels_on):
    """The check above can see them: here they are in the graph."""
    found = _custom_functions(_training_step(VARIANTS[name]))
    assert {"_StepProductBackward", "_TokenLogProbBackward"} <= found
    assert ("_AdditiveScoreBackward" in found) == (VARIANTS[name].get("score", "additive") == "additive")
    assert ("_SparsemaxGradientBackward" in found) == name.startswith("sparsemax")


def test_with_the_switch_off_decoding_takes_no_fast_form(every_fast_form_eligible, monkeypatch):
    """Beam search without gradient, where the blocked additive scores would otherwise run."""
    cap = tiny_captioner(seed=4)
    ann = cap.model.encode(torch.stack([cap.preprocess(tiny_image(s)) for s in (1, 2)]))
    with torch.no_grad():
        want = beam_search(cap.model.decoder, ann, cap.tokens, DecodeOptions(beam_size=3, max_len=6))
    before = kernels.set_enabled(False)
    try:
        monkeypatch.setattr(kernels, "additive_scores", _refuse)
        with torch.no_grad():
            got = beam_search(cap.model.decoder, ann, cap.tokens, DecodeOptions(beam_size=3, max_len=6))
    finally:
        kernels.set_enabled(before)
    for g, w in zip(got, want):
        assert g.ids == w.ids
        torch.testing.assert_close(g.alphas, w.alphas)


def test_set_enabled_returns_the_setting_it_replaces():
    before = kernels.set_enabled(False)
    try:
        assert kernels.enabled() is False
        assert kernels.set_enabled(True) is False
        assert kernels.enabled() is True
    finally:
        kernels.set_enabled(before)


@pytest.mark.parametrize("value,on", [("0", False), ("off", False), ("False", False), (" no ", False),
                                      ("1", True), ("", True), ("on", True)])
def test_the_environment_variable_reads_as_a_switch(value, on, monkeypatch):
    monkeypatch.setenv(kernels.ENVIRONMENT_VARIABLE, value)
    assert kernels._from_environment() is on


@pytest.mark.slow  # a process of its own
def test_a_process_started_with_the_variable_at_0_has_the_kernels_off():
    code = "from captioner.model import kernels; print(kernels.enabled())"
    env = {**os.environ, kernels.ENVIRONMENT_VARIABLE: "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
