"""How a process finds its place under torchrun, CUDA imitated on a CPU: every torchrun
process joins a group (one process too, so that NCCL can be checked on one GPU), an explicit
CUDA device is honoured or refused in one line, never swapped for the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from captioner import distributed
from captioner.distributed import DeviceError, setup


@pytest.fixture
def fake_world(monkeypatch):
    """A torchrun environment and a process group that only records how it was made."""
    made, chosen = [], []

    def torchrun(world: int, local_rank: int, cuda: bool = True) -> None:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
        monkeypatch.setenv("WORLD_SIZE", str(world))
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        monkeypatch.setenv("RANK", str(local_rank))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        monkeypatch.setattr(torch.cuda, "set_device", lambda d: chosen.append(torch.device(d)))
        monkeypatch.setattr(dist, "is_initialized", lambda: bool(made))
        monkeypatch.setattr(dist, "init_process_group", lambda backend: made.append(backend))
        monkeypatch.setattr(dist, "get_rank", lambda: local_rank)
        monkeypatch.setattr(dist, "get_world_size", lambda: world)
        monkeypatch.setattr(dist, "get_backend", lambda: made[-1])

    return torchrun, made, chosen


def test_one_torchrun_process_on_a_gpu_joins_an_nccl_group(fake_world):
    torchrun, made, chosen = fake_world
    torchrun(world=1, local_rank=0)
    ctx = setup("auto")
    assert made == ["nccl"] and ctx.active and ctx.backend == "nccl"
    assert ctx.device == torch.device("cuda", 0) and chosen == [torch.device("cuda", 0)]


def test_one_torchrun_process_on_the_cpu_joins_a_gloo_group(fake_world):
    torchrun, made, _ = fake_world
    torchrun(world=1, local_rank=0, cuda=False)
    ctx = setup("auto")
    assert made == ["gloo"] and ctx.active and ctx.device == torch.device("cpu")


@pytest.mark.parametrize("name", ["cuda", "auto"])
def test_each_rank_takes_its_own_gpu(fake_world, name):
    torchrun, made, chosen = fake_world
    torchrun(world=2, local_rank=1)
    ctx = setup(name)
    assert made == ["nccl"] and ctx.device == torch.device("cuda", 1) and chosen == [ctx.device]


def test_an_explicit_cuda_device_is_honoured_by_one_process(fake_world):
    torchrun, made, _ = fake_world
    torchrun(world=1, local_rank=0)
    ctx = setup("cuda:0")
    assert made == ["nccl"] and ctx.device == torch.device("cuda", 0)  # not the CPU with gloo


def test_an_explicit_cuda_device_for_several_processes_is_refused_in_one_line(fake_world):
    torchrun, made, _ = fake_world
    torchrun(world=2, local_rank=1)
    with pytest.raises(DeviceError, match="CUDA_VISIBLE_DEVICES") as e:
        setup("cuda:0")
    assert "\n" not in str(e.value) and made == []


def test_cpu_under_torchrun_stays_on_the_cpu_with_gloo(fake_world):
    torchrun, made, _ = fake_world
    torchrun(world=2, local_rank=0)
    assert setup("cpu").device == torch.device("cpu") and made == ["gloo"]


def test_without_torchrun_there_is_no_group(monkeypatch):
    for name in ("TORCHELASTIC_RUN_ID", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    ctx = setup("cpu")
    assert not ctx.active and ctx.world == 1 and not distributed.under_torchrun()
