"""train/config.py's value checks at their edges: each bound accepts the value on its edge and
refuses the nearest one beyond it, and an infinite value is refused wherever a number is read
(a TOML file can write ``inf``; ``--set`` can overflow to it)."""

from __future__ import annotations

import pytest

from captioner.train.config import load_config

# (setting, on the edge: accepted, beyond it: refused with this message)
EDGES = [
    ("data.min_count", "1", "0", "data.min_count must be >= 1, got 0"),
    ("data.max_vocab", "0", "-1", "data.max_vocab must be >= 0, got -1"),
    ("optim.lr", "1e-9", "0", "optim.lr must be > 0, got 0.0"),
    ("optim.lr_decay", "1", "1.0001", "optim.lr_decay must be in (0, 1], got 1.0001"),
    ("optim.lr_decay", "0.0001", "0", "optim.lr_decay must be in (0, 1], got 0.0"),
    ("optim.ema", "0", "-0.01", "optim.ema must be in [0, 1) (0: off), got -0.01"),
    ("optim.ema", "0.9999", "1", "optim.ema must be in [0, 1) (0: off), got 1.0"),
    ("optim.grad_clip", "0", "-0.5", "optim.grad_clip must be >= 0, got -0.5"),
    ("hard.baseline_decay", "0", "-0.01", "hard.baseline_decay must be between 0 and 1, got -0.01"),
    ("hard.baseline_decay", "1", "1.01", "hard.baseline_decay must be between 0 and 1, got 1.01"),
]


@pytest.mark.parametrize("key, edge, beyond, message", EDGES, ids=[f"{e[0]}={e[2]}" for e in EDGES])
def test_each_bound_takes_its_edge_and_refuses_what_lies_beyond(key, edge, beyond, message):
    section, name = key.split(".")
    assert getattr(getattr(load_config(None, [f"{key}={edge}"]), section), name) == float(edge)
    with pytest.raises(ValueError) as caught:
        load_config(None, [f"{key}={beyond}"])
    assert str(caught.value) == message


@pytest.mark.parametrize("key", ["optim.lr", "optim.max_minutes", "optim.grad_clip"])
def test_an_infinite_value_is_refused_from_a_file_and_from_set(tmp_path, key):
    """Every bound but a finite one lets infinity through (inf > 0): a rate of inf would turn
    the weights into NaN at the first step."""
    section, name = key.split(".")
    config = tmp_path / "inf.toml"
    config.write_text(f"[{section}]\n{name} = inf\n")
    with pytest.raises(ValueError, match=rf"^{key} must be .*, got inf$"):
        load_config(config, [])
    with pytest.raises(ValueError, match=rf"^{key} must be .*, got inf$"):
        load_config(None, [f"{key}=1e400"])  # overflows to inf
    config.write_text(f"[{section}]\n{name} = 1e300\n")  # large, finite: its bound decides
    assert getattr(getattr(load_config(config, []), section), name) == 1e300
