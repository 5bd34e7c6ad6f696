"""torchvision's pretrained weight files, faked offline: random weights under torchvision's own
file names in a temporary TORCH_HOME, and a guard that fails any download."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

WEIGHTS = {"resnet18": "ResNet18_Weights", "vgg19": "VGG19_Weights"}


def fake_torch_home(home: Path, monkeypatch: pytest.MonkeyPatch, *names: str) -> dict[str, torch.Tensor]:
    """Point TORCH_HOME at ``home`` holding random weights for ``names``; downloads fail.
    Returns the last state dict written (to check that it was the one loaded)."""
    import torchvision.models as tvm

    monkeypatch.setenv("TORCH_HOME", str(home))
    forbid_downloads(monkeypatch)
    folder = home / "hub" / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    state: dict[str, torch.Tensor] = {}
    for name in names:
        weights = getattr(tvm, WEIGHTS[name]).DEFAULT
        torch.manual_seed(1)
        state = getattr(tvm, name)().state_dict()
        torch.save(state, folder / Path(weights.url).name)
    return state


def forbid_downloads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Make every torch.hub download fail; returns the list of URLs asked for."""
    asked: list[str] = []

    def refuse(url, dst, *args, **kwargs):
        asked.append(url)
        raise OSError(f"download refused in tests: {url}")

    monkeypatch.setattr(torch.hub, "download_url_to_file", refuse)
    return asked
