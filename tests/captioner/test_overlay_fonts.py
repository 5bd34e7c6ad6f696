"""Attention figures draw Chinese and Japanese with a font that has their glyphs."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from PIL import Image

from captioner.overlay import attention_figure, cjk_font_file
from captioner.search.decoding import CaptionResult

# CI installs Debian's fonts-wqy-microhei (.ci/run); elsewhere the test needs some CJK font.
needs_font = pytest.mark.skipif(cjk_font_file() is None and not os.environ.get("CI"),
                                reason="no font with CJK glyphs (apt-get install fonts-wqy-microhei)")


def figure(words: list[str]) -> np.ndarray:
    result = CaptionResult(words, torch.full((len(words), 2, 2), 0.25), torch.ones(len(words)), -1.0,
                           text="".join(words))
    image = Image.new("RGB", (32, 32), (40, 40, 40))
    return np.asarray(attention_figure(image, result, panel=64, model="demo-zh"))


@needs_font
def test_chinese_words_are_drawn_as_glyphs_not_empty_boxes():
    assert cjk_font_file() is not None
    # A font without the glyphs draws every character as the same box: two captions that differ
    # only in characters would give the same picture.
    red, blue = figure(list("红色")), figure(list("蓝色"))
    assert red.shape == blue.shape and (red != blue).any()
    assert (figure(list("圆形")) != figure(list("方形"))).any()


def test_english_figures_keep_the_default_font(monkeypatch):
    from captioner import overlay

    a, b = figure(["red"]), figure(["red"])
    assert (a == b).all() and (figure(["red"]) != figure(["blue"])).any()
    # With no CJK font to be found, an English figure is drawn exactly as with one: it never used it.
    monkeypatch.setattr(overlay, "cjk_font_file", lambda: None)
    assert (figure(["red"]) == a).all()
