"""Resuming on other devices than the run was saved on (CUDA imitated on a CPU): what fits is
restored, what does not is said in words, and nothing fails."""

from __future__ import annotations

import random

import torch

from captioner.io.checkpoint import TrainingState
from captioner.train.config import ScstConfig
from captioner.train.loop import _rng_state, _set_rng_state
from captioner.train.scst import ScstObjective
from tests.tiny import tiny_vocab

CPU, GPU0 = torch.device("cpu"), torch.device("cuda", 0)
FAKE_CUDA_STATE = torch.arange(16, dtype=torch.uint8)  # a CUDA generator's state is 16 bytes


def _fake_cuda(monkeypatch) -> list:
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.append((state, device)))
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: FAKE_CUDA_STATE)
    return restored


def test_a_cpu_run_saves_no_gpu_state_and_restores_its_own_exactly():
    state = _rng_state(CPU)
    assert "cuda" not in state
    expected = torch.rand(3), random.random()
    assert _set_rng_state(state, CPU) == []
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]


def test_a_gpu_run_saves_only_its_own_gpu(monkeypatch):
    _fake_cuda(monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [FAKE_CUDA_STATE] * 8)
    assert torch.equal(_rng_state(GPU0)["cuda"], FAKE_CUDA_STATE)


def test_resumed_with_fewer_visible_gpus_takes_its_own_gpus_state(monkeypatch):
    """Older checkpoints hold every visible GPU's state; the resume sees one GPU."""
    restored = _fake_cuda(monkeypatch)
    every_gpu = {**_rng_state(CPU), "cuda": [FAKE_CUDA_STATE, FAKE_CUDA_STATE + 1]}
    saved = TrainingState(config={}, rng_per_rank=(every_gpu,))
    assert _set_rng_state(saved.rng_of(0, GPU0), GPU0) == []
    assert len(restored) == 1 and torch.equal(restored[0][0], FAKE_CUDA_STATE) and restored[0][1] == GPU0


def test_a_run_started_on_the_cpu_and_resumed_on_a_gpu_says_what_it_lacks(monkeypatch):
    restored = _fake_cuda(monkeypatch)
    lost = _set_rng_state(_rng_state(CPU), GPU0)
    assert restored == [] and len(lost) == 1 and "GPU's random state" in lost[0]


def test_a_gpu_run_resumed_on_the_cpu_restores_the_cpu_and_says_the_gpu_is_left(monkeypatch):
    state = {**_rng_state(CPU), "cuda": FAKE_CUDA_STATE}
    expected = torch.rand(3), random.random()
    lost = _set_rng_state(state, CPU)
    assert len(lost) == 1 and "resumed on the CPU" in lost[0]
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]  # the CPU's restored


def test_scst_sampler_from_another_kind_of_device_starts_from_its_seed():
    refs = [["a red circle"], ["a blue square"]]
    sampler = ScstObjective(ScstConfig(enabled=True), tiny_vocab(), refs, seed=3)
    fresh = sampler.generator.get_state()
    assert not sampler.load_state_dict({"generator": FAKE_CUDA_STATE, "device": "cuda"})
    older = TrainingState.from_dict({"config": {}, "scst": [{"generator": FAKE_CUDA_STATE}]})  # no device named
    assert not sampler.load_state_dict(older.objective["scst"][0])
    assert torch.equal(sampler.generator.get_state(), fresh)
    other = ScstObjective(ScstConfig(enabled=True), tiny_vocab(), refs, seed=9)
    assert sampler.load_state_dict(other.state_dict())  # the same kind: restored exactly
    assert torch.equal(sampler.generator.get_state(), other.generator.get_state())
