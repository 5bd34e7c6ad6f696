"""torch.distributed for training and batch captioning: set up from torchrun's environment.

Under ``torchrun --nproc_per_node N`` every rank joins one process group, N = 1 included (so
that the NCCL path can be checked on one GPU): NCCL on GPUs, gloo on CPUs. Each rank takes its
own GPU, cuda:LOCAL_RANK; GPUs are chosen with CUDA_VISIBLE_DEVICES, and a device index is
honoured only for a single process. Without torchrun this is a world of one and every helper
is a no-op, so the training loop reads the same either way.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistContext:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    grouped: bool = False  # in a process group (under torchrun), even of one process

    @property
    def backend(self) -> str | None:
        return dist.get_backend() if self.grouped else None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        """In a process group: collectives run, the model trains under DistributedDataParallel."""
        return self.grouped

    def sum(self, value: float) -> float:
        """The sum of a per-rank number over all ranks."""
        if not self.active:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self._comm_device)
        dist.all_reduce(t)
        return float(t)

    def mean(self, value: float) -> float:
        """The mean of a per-rank number over all ranks."""
        return self.sum(value) / self.world

    def any_of(self, *flags: bool) -> list[bool]:
        """Each flag, true on every rank when it is true on some rank (a stop request, say): one
        collective for all of them."""
        if not self.active:
            return list(flags)
        t = torch.tensor([1.0 if f else 0.0 for f in flags], device=self._comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [bool(x) for x in t.tolist()]

    def broadcast(self, obj):
        """Rank 0's object, on every rank."""
        if not self.active:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj) -> list | None:
        """Every rank's object, as a list on rank 0 (None elsewhere)."""
        if not self.active:
            return [obj]
        out = [None] * self.world if self.is_main else None
        dist.gather_object(obj, out, dst=0)
        return out

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    @property
    def _comm_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")


class DeviceError(ValueError):
    """A device that cannot be honoured under torchrun, said in one line."""


def under_torchrun() -> bool:
    """Started by torchrun (torch.distributed.run), whatever the number of processes."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ)


def setup(device_name: str = "auto") -> DistContext:
    """The process's place in the run and its device. ``device_name``: auto, cpu, cuda or cuda:N."""
    wanted = torch.device("cuda" if device_name == "auto" and torch.cuda.is_available()
                          else "cpu" if device_name == "auto" else device_name)
    if not under_torchrun():
        return DistContext(device=wanted)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if wanted.type == "cuda":
        if wanted.index is not None and world > 1:
            raise DeviceError(f"device {device_name}: under torchrun each of the {world} processes takes its own "
                              "GPU (cuda:LOCAL_RANK); give cuda or auto, and choose the GPUs with "
                              "CUDA_VISIBLE_DEVICES")
        device = torch.device("cuda", local_rank if wanted.index is None else wanted.index)
        torch.cuda.set_device(device)
    else:
        device = wanted
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, device, grouped=True)


def teardown(ctx: DistContext) -> None:
    if ctx.active and dist.is_initialized():
        dist.destroy_process_group()


def is_main_process() -> bool:
    """Rank 0 under torchrun, or a single process: the one that prints what all ranks share."""
    return int(os.environ.get("RANK", "0")) == 0


def work_done(ctx: DistContext) -> None:
    """Call on every rank once all of them are past their last collective step. torchrun stops
    the ranks still running with SIGTERM as soon as one exits non-zero (some images failed, an
    interrupted run); from here that SIGTERM is ignored, so each rank finishes and ends with its
    own exit code instead of showing up as killed (-15)."""
    if ctx.active:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
