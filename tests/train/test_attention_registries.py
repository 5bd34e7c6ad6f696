"""The names a config, the CLI and the app accept are the registries' keys (a name added in one
place cannot be missing from another), and training asks a mode's object, never its name."""

from __future__ import annotations

import argparse
from typing import get_args, get_type_hints

import pytest
import torch

from captioner.cli.main import build_parser
from captioner.distributed import DistContext
from captioner.inference import AUTOCAST_DTYPES
from captioner.model import attention
from captioner.model.attention import HARD_INFERENCE, LOCAL_WIDTHS, MODES, NORMALIZERS, SCORES
from captioner.model.decoder import ModelConfig
from captioner.train.config import ModelSection, OptimConfig, TrainConfig, ignored_values, load_config
from captioner.train.losses import soft_loss
from captioner.train.objectives import Hard, Soft, choose_objective
from captioner.train.precision import PRECISIONS, MixedPrecision
from tests.tiny import tiny_captioner, tiny_vocab, token_batch

REGISTRIES = {"attention": MODES, "score": SCORES, "normalizer": NORMALIZERS, "local_width": LOCAL_WIDTHS}


def _choices(command: str, option: str) -> tuple:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return tuple(next(a for a in sub.choices[command]._actions if option in a.option_strings).choices)


# ---------------------------------------------------------------------------- no drift

@pytest.mark.parametrize("field", list(REGISTRIES))
def test_the_model_fields_accept_exactly_the_registrys_names_in_its_order(field):
    assert get_args(get_type_hints(ModelConfig)[field]) == tuple(REGISTRIES[field])
    assert get_args(get_type_hints(ModelSection)[field]) == tuple(REGISTRIES[field])


@pytest.mark.parametrize("field", list(REGISTRIES))
def test_a_config_takes_every_registered_name_and_lists_them_when_refusing(field):
    extra = ["model.local_window=1.5"] if field == "local_width" else []
    for name in REGISTRIES[field]:
        assert getattr(load_config(None, [f"model.{field}={name}", *extra]).model, field) == name
    with pytest.raises(ValueError, match=f"model.{field} must be one of {', '.join(REGISTRIES[field])}, got 'x'"):
        load_config(None, [f"model.{field}=x"])


def test_precisions_are_the_autocast_registrys_names_everywhere():
    assert PRECISIONS == ("auto", *AUTOCAST_DTYPES)
    assert get_args(get_type_hints(OptimConfig)["precision"]) == PRECISIONS
    assert _choices("caption", "--precision") == tuple(AUTOCAST_DTYPES)
    assert _choices("app", "--precision") == tuple(AUTOCAST_DTYPES)
    for name in PRECISIONS:  # each one the config takes, a run can use
        assert load_config(None, [f"optim.precision={name}"]).optim.precision == name
        assert MixedPrecision(name, torch.device("cpu")).name in AUTOCAST_DTYPES


def test_the_hard_attention_choices_are_the_registrys_for_every_command():
    assert _choices("caption", "--hard-attention") == tuple(HARD_INFERENCE)
    assert _choices("evaluate", "--hard-attention") == tuple(HARD_INFERENCE)


# ---------------------------------------------------------------------------- asked, not compared

@pytest.mark.parametrize("name", list(MODES))
def test_the_objective_and_the_ignored_values_follow_the_modes_properties(name):
    mode, cfg, ctx = MODES[name], TrainConfig(), DistContext()
    cfg.model.attention = name
    objective = choose_objective(cfg, name, tiny_vocab(), [["a red circle"]], ctx)
    assert isinstance(objective, Hard if mode.stochastic else Soft)
    ignored = {k for rule in ignored_values(cfg) for k in rule.keys}
    assert ("hard.lambda_r" in ignored) is not mode.stochastic
    assert ("optim.doubly_stochastic" in ignored) is not mode.attends


def _registered(monkeypatch, name: str, base: type) -> None:
    cls = type(name.title(), (base,), {"name": name})
    monkeypatch.setitem(attention.MODES, name, cls())


def test_a_new_stochastic_mode_is_trained_with_reinforce_without_naming_it(monkeypatch):
    _registered(monkeypatch, "nearest", attention.Hard)
    cfg = TrainConfig()
    cfg.model.attention = "nearest"
    assert isinstance(choose_objective(cfg, "nearest", tiny_vocab(), [["a red circle"]], DistContext()), Hard)
    ignored = {k for rule in ignored_values(cfg) for k in rule.keys}
    assert not any(k.startswith("hard.") for k in ignored) and "optim.doubly_stochastic" not in ignored


def test_a_new_mode_that_does_not_attend_skips_the_penalty_without_naming_it(monkeypatch):
    _registered(monkeypatch, "blank", attention.Mean)
    cfg = TrainConfig()
    cfg.model.attention = "blank"
    notes = {rule.because for rule in ignored_values(cfg)}
    assert "blank attention's maps are uniform: the penalty is a constant" in notes
    cap = tiny_captioner(seed=3, attention="blank")
    tokens, lengths = token_batch(cap.vocab, ["a red circle", "a small blue square"])
    images = torch.rand(2, 3, 32, 32)
    parts = soft_loss(cap.model, images, tokens, lengths, doubly_stochastic=1.0)
    assert float(parts.penalty) > 0 and torch.equal(parts.loss, parts.nll)  # a constant penalty, left out
    soft = tiny_captioner(seed=3)
    parts = soft_loss(soft.model, images, tokens, lengths, doubly_stochastic=1.0)
    torch.testing.assert_close(parts.loss, parts.nll + parts.penalty)
