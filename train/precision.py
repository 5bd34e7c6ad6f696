"""Numeric precision of a training run: fp32, or mixed precision with autocast.

    precision = "auto"   bf16 autocast on CUDA, fp32 on CPU (the default)
                "fp32"   no autocast
                "bf16"   autocast to bfloat16: fp32's exponent range, so no loss scaling
                "fp16"   autocast to float16 with a gradient scaler: the loss is scaled up
                         so that small gradients do not underflow, gradients are unscaled
                         before clipping, and a step whose gradients overflowed is skipped
                         (the scale then halves; it grows again after 2000 clean steps)

An explicit "bf16" or "fp16" is honoured on CPU as well (useful to test the fp16 path;
seldom faster there). The scaler's state is plain numbers, saved in checkpoints so that
a resumed fp16 run continues with the same scale.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch

from captioner.inference import AUTOCAST_DTYPES

PRECISIONS = ("auto", *AUTOCAST_DTYPES)
PrecisionName = Literal[PRECISIONS]  # optim.precision's annotation: the config accepts these names


class MixedPrecision:
    def __init__(self, precision: str, device: torch.device):
        if precision not in PRECISIONS:
            raise ValueError(f"optim.precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        if precision == "auto":
            precision = "bf16" if device.type == "cuda" else "fp32"
        if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ValueError("this GPU has no bfloat16 support: use optim.precision = \"fp16\"")
        self.name = precision
        self.device_type = device.type
        self.dtype = AUTOCAST_DTYPES[precision]
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None

    def autocast(self):
        return torch.autocast(self.device_type, dtype=self.dtype or torch.float32, enabled=self.dtype is not None)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer, params: Iterable[torch.nn.Parameter],
             grad_clip: float) -> bool:
        """Clip (on true, unscaled gradients) and step. False when fp16 gradients overflowed
        and the step was skipped."""
        if self.scaler is None:
            if grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, grad_clip)
            optimizer.step()
            return True
        self.scaler.unscale_(optimizer)
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        scale = self.scaler.get_scale()
        self.scaler.step(optimizer)  # skipped when any gradient is inf/nan
        self.scaler.update()
        return self.scaler.get_scale() >= scale

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict | None) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
