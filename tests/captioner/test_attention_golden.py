"""Decoders saved before multi-head attention, learned widths and the cosine temperature
existed (tests/fixtures/build_attention_golden.py) load into today's code, through the
checkpoint's upgrade of older weights (captioner.io.checkpoint.upgrade_weights), and give the
same numbers: teacher forcing, hard samples, greedy and beam search (the
searches' entries re-made by today's search rules: see the builder's ``--searches``)."""

from pathlib import Path

import pytest
import torch

from captioner.io.checkpoint import upgrade_weights
from captioner.model.decoder import Decoder, ModelConfig
from captioner.model.encoders import Annotations
from captioner.search.decoding import beam_search, greedy
from captioner.search.options import DecodeOptions, Tokens

GOLDEN = torch.load(Path(__file__).parents[1] / "fixtures" / "attention_golden" / "decoders.pt", weights_only=True)


def _load(g: dict) -> Decoder:
    dec = Decoder(ModelConfig.from_dict(g["config"])).eval()
    dec.load_state_dict(upgrade_weights(g["config"], g["state_dict"], prefix=""))  # strict: none missing or extra
    return dec


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_a_decoder_saved_by_the_single_head_code_loads_and_gives_the_same_outputs(name):
    g = GOLDEN[name]
    dec = _load(g)
    old_keys = set(g["state_dict"])
    new_keys = set(dec.state_dict())
    # The same parameters under the same names; cosine only gains its temperature, at 1.
    assert new_keys - old_keys == ({"attention.log_temperature"} if name == "cosine" else set())
    assert old_keys <= new_keys
    for k, v in g["state_dict"].items():
        assert dec.state_dict()[k].shape == v.shape, k
    ann = Annotations(g["a"], tuple(g["grid"]))
    sample = g["sample_log_probs"] is not None
    with torch.no_grad():
        out = dec(ann, g["tokens"], g["lengths"], sample=sample, generator=torch.Generator().manual_seed(5))
        got_greedy = greedy(dec, ann, Tokens(start=1, end=2, pad=0), DecodeOptions(max_len=6))
        got_beam = beam_search(dec, ann, Tokens(start=1, end=2, pad=0), DecodeOptions(beam_size=3, max_len=6))
    torch.testing.assert_close(out.logits, g["logits"])
    torch.testing.assert_close(out.alphas, g["alphas"])
    torch.testing.assert_close(out.betas, g["betas"])
    if sample:
        torch.testing.assert_close(out.sample_log_probs, g["sample_log_probs"])
    for got, want in ((got_greedy, g["greedy"]), (got_beam, g["beam"])):
        for d, (ids, alphas, score) in zip(got, want):
            assert d.ids == ids
            torch.testing.assert_close(d.alphas, alphas)
            assert abs(d.score - score) < 1e-5
