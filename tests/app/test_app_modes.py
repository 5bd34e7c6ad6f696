"""The page asks the model's attention mode what it offers: a stochastic (hard) mode the menu of
how it looks at inference, as the registry lists it; other modes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from captioner.model.attention import HARD_INFERENCE
from tests.tiny import tiny_captioner

AppTest = pytest.importorskip("streamlit.testing.v1").AppTest

APP = Path(__file__).resolve().parents[2] / "app" / "streamlit_app.py"


def test_only_a_stochastic_mode_offers_the_registrys_hard_attention_menu(tmp_path, monkeypatch):
    for mode in ("soft", "hard", "mean"):
        tiny_captioner(seed=2, attention=mode).save(tmp_path / f"tiny-{mode}.pt")
    monkeypatch.setenv("CAPTIONER_WEIGHTS_DIR", str(tmp_path))
    at = AppTest.from_file(str(APP), default_timeout=180).run()
    for mode in ("soft", "mean"):
        at.sidebar.selectbox[0].select(f"tiny-{mode}.pt").run()
        assert not at.exception and not at.sidebar.radio
    at.sidebar.selectbox[0].select("tiny-hard.pt").run()
    assert not at.exception
    menu = at.sidebar.radio[0]
    assert menu.options == [look.describes for look in HARD_INFERENCE.values()]
    assert menu.value == "expected"
