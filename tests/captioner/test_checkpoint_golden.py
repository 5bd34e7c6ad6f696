"""Models saved by today's code (tests/fixtures/build_checkpoint_golden.py) load and give
the same outputs: a whole checkpoint through `Captioner.load`, and decoders of every
attention variant through a strict `load_state_dict`. A change of the model's structure
that renames a parameter or moves a number fails here."""

from pathlib import Path

import pytest
import torch

from captioner.inference import Captioner, DecodeOptions
from captioner.model.decoder import Decoder, ModelConfig
from captioner.model.encoders import Annotations
from captioner.search.decoding import beam_search, greedy
from captioner.search.options import Tokens
from tests.tiny import tiny_image, token_batch

HERE = Path(__file__).parents[1] / "fixtures" / "checkpoint_golden"
EXPECTED = torch.load(HERE / "expected.pt", weights_only=True)
DECODERS = torch.load(HERE / "decoders.pt", weights_only=True)
CAPTIONS = ["a red circle and a blue square", "a small green star"]
OPTIONS = {"greedy": DecodeOptions(beam_size=1, max_len=8), "beam3": DecodeOptions(beam_size=3, max_len=8)}


def _same_results(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g["words"] == w["words"]
        torch.testing.assert_close(g["alphas"], w["alphas"])
        torch.testing.assert_close(g["betas"], w["betas"])
        assert g["score"] == pytest.approx(w["score"], abs=1e-5)


def test_a_whole_checkpoint_loads_and_captions_as_when_it_was_saved():
    cap = Captioner.load(HERE / "whole.pt")
    want = EXPECTED["whole"]
    images = torch.stack([cap.preprocess(tiny_image(s)) for s in (1, 2)])
    tokens, lengths = token_batch(cap.vocab, CAPTIONS)
    with torch.no_grad():
        tf = cap.model.eval()(images, tokens, lengths)
    for field in ("logits", "alphas", "betas", "alphas_heads"):
        torch.testing.assert_close(getattr(tf, field), want[field], msg=field)
    for name, opt in OPTIONS.items():
        got = [{"words": r.words, "alphas": r.alphas, "betas": r.betas, "score": r.score}
               for r in cap.caption_batch(images, opt)]
        _same_results(got, want[name])


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_a_saved_decoder_of_each_variant_loads_strictly_and_gives_the_same_outputs(name):
    saved, want = DECODERS[name], EXPECTED[name]
    dec = Decoder(ModelConfig.from_dict(saved["config"])).eval()
    dec.load_state_dict(saved["state_dict"])  # strict: no key missing, none unexpected
    ann = Annotations(saved["a"], (3, 4))
    hard = saved["config"]["attention"] == "hard"
    with torch.no_grad():
        out = dec(ann, want["tokens"], want["lengths"], sample=hard, generator=torch.Generator().manual_seed(5))
        got_greedy = greedy(dec, ann, Tokens(start=1, end=2, pad=0), DecodeOptions(max_len=6))
        got_beam = beam_search(dec, ann, Tokens(start=1, end=2, pad=0), DecodeOptions(beam_size=3, max_len=6))
    for field in ("logits", "alphas", "betas", "alphas_heads", "sample_log_probs", "entropies"):
        g, w = getattr(out, field), want[field]
        if w is None and field == "alphas_heads" and g is not None:
            torch.testing.assert_close(g, want["alphas"].unsqueeze(2))  # one head: its map, on a head axis
        elif w is None:
            assert g is None, field
        else:
            torch.testing.assert_close(g, w, msg=field)
    for got, expected in ((got_greedy, want["greedy"]), (got_beam, want["beam"])):
        assert [d.ids for d in got] == [ids for ids, _, _ in expected]
        for d, (_, alphas, score) in zip(got, expected):
            torch.testing.assert_close(d.alphas, alphas)
            assert d.score == pytest.approx(score, abs=1e-5)
