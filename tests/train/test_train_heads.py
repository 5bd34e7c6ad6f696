"""Training with the attention options of the config: several heads, a learned width, the
cosine temperature. Short runs on the tiny COCO-format fixture."""

import math

import pytest
import torch

from captioner.inference import Captioner, DecodeOptions
from captioner.train.loop import train
from tests.builders import tiny_train_config
from tests.tiny import tiny_image


@pytest.mark.slow
def test_hard_attention_with_two_heads_and_a_learned_width_trains_and_captions(tiny_coco, tmp_path):
    sets = {"model.attention": "hard", "model.heads": 2, "model.local_window": 1.5, "model.local_width": "learned",
            "optim.max_steps": 12, "val.every_epochs": 0}
    run = tmp_path / "run"
    outcome = train(tiny_train_config(tiny_coco, **sets), run, progress=False)
    assert outcome.step == 12
    cap = Captioner.load(run / "last.pt")
    assert cap.model.config.heads == 2 and cap.model.config.local_width == "learned"
    centre = cap.model.decoder.attention.heads[0].centre[2]
    # The width's output trained away from its start (zero weights, the same width everywhere).
    assert centre.weight[2].abs().sum() > 0
    r = cap.caption(tiny_image(0), DecodeOptions(max_len=6))
    assert r.alphas_heads.shape == (len(r.words), 2, *r.alphas.shape[1:])
    assert torch.isfinite(r.alphas_heads).all()


def test_the_cosine_temperature_trains(tiny_coco, tmp_path):
    sets = {"model.score": "cosine", "optim.max_steps": 6, "val.every_epochs": 0}
    run = tmp_path / "run"
    train(tiny_train_config(tiny_coco, **sets), run, progress=False)
    log_t = Captioner.load(run / "last.pt").model.decoder.attention.log_temperature.item()
    assert log_t != 0.0 and math.isfinite(log_t)
