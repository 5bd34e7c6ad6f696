"""What alt-text writes and what it holds for a person (each rule at its edge), and the cache of
captions by image content: where it lives, what keys it, what it keeps."""

import math
from types import SimpleNamespace

from captioner.alttext.cache import CaptionCache, default_folder, model_digest
from captioner.alttext.decide import MAX_CHARS, MIN_CONFIDENCE, Caption, Rules, confidence, held_because
from captioner.search.budget import NoFit

RULES = Rules(min_confidence=0.05, unfamiliar_below=0.01)


def _caption(text="a red circle", p=0.5, familiarity=0.5, words=3) -> Caption:
    return Caption(text, math.log(p), familiarity, words)


def test_the_defaults_are_the_measured_threshold_and_the_usual_budget():
    assert (MIN_CONFIDENCE, MAX_CHARS) == (0.05, 125)
    assert Rules() == Rules(MIN_CONFIDENCE, 0.01)


def test_the_confidence_is_the_caption_s_probability():
    assert confidence(math.log(0.25)) == 0.25
    assert confidence(0.0) == 1.0


def test_a_caption_that_passes_every_rule_is_written():
    assert held_because(_caption(), RULES) is None


def test_below_the_minimum_confidence_is_held_and_at_it_is_written():
    assert held_because(_caption(p=0.05), RULES) is None
    why = held_because(_caption(p=0.0499), RULES)
    assert why == "confidence 0.0499 below --min-confidence 0.05"


def test_an_unfamiliar_image_is_held_whatever_its_confidence():
    assert held_because(_caption(p=1.0, familiarity=0.01), RULES) is None
    why = held_because(_caption(p=1.0, familiarity=0.0099), RULES)
    assert why == "unfamiliar: unlike the model's training images (familiarity 0.0099 < 0.01)"


def test_familiarity_unknown_leaves_the_confidence_to_decide():
    assert held_because(_caption(familiarity=None), RULES) is None
    assert held_because(_caption(familiarity=None, p=0.01), RULES).startswith("confidence ")


def test_no_caption_is_held_and_one_that_fits_no_budget_says_so():
    assert held_because(_caption(text="", words=0), RULES) == "the model gave no caption"
    missed = Caption("", 0.0, 0.5, 0, "no caption fits in --max-chars 5 (...)")
    assert held_because(missed, RULES) == "no caption fits in --max-chars 5 (...)"


def _result(words, score, familiarity=None, no_fit=None):
    known = None if familiarity is None else SimpleNamespace(value=familiarity, unfamiliar=familiarity < 0.01)
    return SimpleNamespace(words=words, caption=" ".join(words), score=score, familiarity=known, no_fit=no_fit)


def test_a_caption_is_made_from_a_search_result():
    assert Caption.of(_result(["a", "red", "circle"], -1.5, 0.3)) == Caption("a red circle", -1.5, 0.3, 3)
    assert Caption.of(_result(["a"], -0.5)) == Caption("a", -0.5, None, 1)
    none_fits = Caption.of(_result([], -math.inf, 0.3, NoFit(5, "a red circle")))
    assert none_fits == Caption("", 0.0, 0.3, 0, NoFit(5, "a red circle").reason)
    assert none_fits.no_fit.startswith("no caption fits in 5 characters")
    assert Caption.from_json(none_fits.to_json()) == none_fits


def test_the_cache_lives_under_xdg_cache_home_or_the_home_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_folder() == tmp_path / "xdg" / "captioner" / "alt-text"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_folder() == tmp_path / "home" / ".cache" / "captioner" / "alt-text"


def test_the_cache_keeps_a_caption_per_model_and_options(tmp_path):
    caption = _caption(text="红色的圆", familiarity=None)
    cache = CaptionCache(tmp_path, "model-1", {"beam_size": 3})
    assert cache.get("ab" * 32) is None
    assert cache.put("ab" * 32, caption)
    assert CaptionCache(tmp_path, "model-1", {"beam_size": 3}).get("ab" * 32) == caption
    assert CaptionCache(tmp_path, "model-2", {"beam_size": 3}).get("ab" * 32) is None
    assert CaptionCache(tmp_path, "model-1", {"beam_size": 2}).get("ab" * 32) is None
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == ["ab" * 32 + ".json"]


def test_an_entry_that_cannot_be_read_is_captioned_again(tmp_path):
    cache = CaptionCache(tmp_path, "m", {})
    cache.put("cd" * 32, _caption())
    entry = next(tmp_path.rglob("*.json"))
    entry.write_text('{"text": "cut off')
    assert cache.get("cd" * 32) is None


def test_a_cache_that_cannot_be_written_says_so(tmp_path):
    (tmp_path / "file").write_text("in the way")
    assert not CaptionCache(tmp_path / "file", "m", {}).put("ef" * 32, _caption())


def test_a_model_s_digest_is_its_files_content(tmp_path):
    (tmp_path / "a.pt").write_bytes(b"weights")
    (tmp_path / "b.pt").write_bytes(b"weights")
    assert model_digest(tmp_path / "a.pt") == model_digest(tmp_path / "b.pt")
    folder = tmp_path / "exported"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"1")
    before = model_digest(folder)
    (folder / "model.safetensors").write_bytes(b"2")
    assert model_digest(folder) != before
