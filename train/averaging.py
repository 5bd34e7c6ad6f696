"""An exponential moving average of the weights, validated and shipped in place of the last step's.

After each optimiser step, every floating-point tensor of the model's state (parameters and
buffers such as batch-norm statistics) moves towards its new value:

    avg <- d * avg + (1 - d) * w,    d = min(decay, (1 + n) / (10 + n))

where n counts the updates so far; the second term lets the average forget the random
initial weights quickly. Integer buffers (batch-norm's step counters) are copied.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from captioner.io.checkpoint import AverageState


class WeightAverage:
    def __init__(self, model: nn.Module, decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"optim.ema must lie strictly between 0 and 1 (0 turns it off), got {decay}")
        self.decay = decay
        self.updates = 0
        self.tensors = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def weight(self) -> float:
        """The decay d used by the next update."""
        return min(self.decay, (1 + self.updates) / (10 + self.updates))

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        d = self.weight()
        for k, v in model.state_dict().items():
            avg = self.tensors[k]
            if avg.is_floating_point():
                avg.lerp_(v.detach().to(avg.dtype), 1.0 - d)
            else:
                avg.copy_(v)
        self.updates += 1

    @contextmanager
    def applied(self, model: nn.Module) -> Iterator[None]:
        """The model holds the averaged weights inside the block and its own again after it."""
        own = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.load_state_dict(self.tensors)
        try:
            yield
        finally:
            model.load_state_dict(own)

    def state(self) -> AverageState:
        """What last.pt keeps of it (``train_state.weight_average``)."""
        return AverageState(self.decay, self.updates, self.tensors)

    def load(self, state: AverageState) -> None:
        if state.tensors.keys() != self.tensors.keys():
            raise ValueError("the saved weight average does not match this model")
        self.decay = float(state.decay)
        self.updates = int(state.updates)
        for k, v in state.tensors.items():
            self.tensors[k].copy_(v)


def same_encoder(a: dict, b: dict) -> bool:
    """Two state dicts hold the same encoder weights (wherever each lies): an average of a
    frozen encoder is that encoder."""
    keys = [k for k in a if k.startswith("encoder.")]
    return keys == [k for k in b if k.startswith("encoder.")] and all(torch.equal(a[k].cpu(), b[k].cpu()) for k in keys)
