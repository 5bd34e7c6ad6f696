"""Several scored captions (the beam's finished pool, best first) and each word's probability
given the words before it, checked against teacher-forced re-scores of the same captions."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from captioner.cli.main import main
from captioner.inference import DecodeOptions
from tests.tiny import tiny_captioner, tiny_image, token_batch


def _rescore(cap, image, words: list[str]) -> torch.Tensor:
    """log p of each token of ``words`` + <end>, teacher-forced: (len(words) + 1,)."""
    tokens, lengths = token_batch(cap.vocab, [" ".join(words)])
    ended = cap.vocab.encode(words)  # <start> w_1 .. w_n <end>
    assert tokens[0].tolist() == ended
    with torch.no_grad():
        out = cap.model.eval()(cap.preprocess(image)[None], tokens, lengths)
    logp = F.log_softmax(out.logits.float(), -1)[0]  # (T, V)
    return logp.gather(1, tokens[0, 1:, None]).squeeze(1)


@pytest.mark.parametrize("beam_size", [1, 3])
def test_each_word_probability_matches_a_teacher_forced_rescore(beam_size):
    cap = tiny_captioner(seed=1)  # captions of several words: each word's own p, not the running product
    lengths = []
    for i in range(4):
        image = tiny_image(i)
        r = cap.caption(image, DecodeOptions(beam_size=beam_size, max_len=8))
        assert len(r.word_probs) == len(r.words)
        ref = _rescore(cap, image, r.words)
        torch.testing.assert_close(torch.tensor(r.word_probs, dtype=torch.float64), ref[:-1].exp().double(),
                                   rtol=1e-4, atol=1e-6)
        # The score is log p of the words and of <end> (of the words alone for a caption cut off).
        assert r.score == pytest.approx(float(ref.sum()), abs=1e-4) or len(r.words) == 8
        lengths.append(len(r.words))
    assert max(lengths) >= 2, lengths


def test_alternatives_are_distinct_sorted_scored_and_led_by_the_beam_s_caption():
    cap = tiny_captioner(seed=3)
    seen_several = 0
    for i in range(6):
        image = tiny_image(i)
        best = cap.caption(image, DecodeOptions(beam_size=5, max_len=6))
        r = cap.caption(image, DecodeOptions(beam_size=5, max_len=6, num_captions=5))
        alts = r.alternatives
        assert 1 <= len(alts) <= 5
        assert r.words == best.words and alts[0].words == tuple(best.words)
        assert alts[0].score == pytest.approx(best.score)
        assert len({a.words for a in alts}) == len(alts)  # distinct
        assert [a.score for a in alts] == sorted((a.score for a in alts), reverse=True)
        for a in alts:  # each is what the model gives that caption, <end> included
            assert a.score == pytest.approx(float(_rescore(cap, image, list(a.words)).sum()), abs=1e-4)
        seen_several += len(alts) > 1
    assert seen_several >= 3


def test_without_num_captions_there_are_no_alternatives_in_the_json():
    cap = tiny_captioner(seed=3)
    r = cap.caption(tiny_image(0), DecodeOptions(beam_size=3, max_len=6))
    line = r.to_json("x.png")
    assert "alternatives" not in line and len(line["word_probs"]) == len(line["words"])


def test_num_captions_cannot_exceed_the_beam():
    with pytest.raises(ValueError, match="num_captions"):
        DecodeOptions(beam_size=2, num_captions=3)


def test_caption_command_writes_alternatives_and_word_probabilities(tmp_path, capsys):
    path = tmp_path / "m.pt"
    tiny_captioner(seed=3).save(path)
    image = tmp_path / "a.png"
    tiny_image(1).save(image)
    out = tmp_path / "c.jsonl"
    assert main(["caption", str(image), "--weights", str(path), "--out", str(out), "--quiet", "--max-len", "6",
                 "--beam-size", "4", "--num-captions", "3"]) == 0
    line = json.loads(out.read_text().splitlines()[0])
    alts = line["alternatives"]
    assert alts[0] == {"caption": line["caption"], "score": line["score"]} and len(alts) == 3
    assert line["model"] == "m.pt" and 0 < line["end_prob"] <= 1
    assert all(0 < p <= 1 for p in line["word_probs"]) and len(line["word_probs"]) == len(line["words"])
    assert main(["caption", str(image), "--weights", str(path), "--beam-size", "2", "--num-captions", "3"]) == 2
    assert "--num-captions" in capsys.readouterr().err


def test_resuming_with_num_captions_captions_again_the_images_without_alternatives(tmp_path):
    path = tmp_path / "m.pt"
    tiny_captioner(seed=3).save(path)
    images = []
    for i in range(2):
        images.append(str(tmp_path / f"{i}.png"))
        tiny_image(i).save(images[-1])
    out = tmp_path / "c.jsonl"
    assert main(["caption", *images, "--weights", str(path), "--out", str(out), "--quiet", "--max-len", "6"]) == 0
    assert main(["caption", *images, "--weights", str(path), "--out", str(out), "--quiet", "--max-len", "6",
                 "--num-captions", "2"]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 2 and all("alternatives" in x for x in lines)


@pytest.mark.parametrize("beam_size", [1, 3])
def test_the_score_adds_up_from_the_word_probabilities_and_the_end_probability(beam_size):
    cap = tiny_captioner(seed=1)
    for i in range(4):
        image = tiny_image(i)
        r = cap.caption(image, DecodeOptions(beam_size=beam_size, max_len=8))
        ref = _rescore(cap, image, r.words)
        assert r.end_prob == pytest.approx(float(ref[-1].exp()), rel=1e-4)
        total = sum(math.log(p) for p in r.word_probs) + math.log(r.end_prob)
        assert total == pytest.approx(r.score, abs=1e-4)
        line = r.to_json("x.png")  # rounded to 4 significant digits, it still adds up within rounding
        total = sum(math.log(p) for p in line["word_probs"]) + math.log(line["end_prob"])
        assert total == pytest.approx(line["score"], abs=1e-4 * (len(r.words) + 2))


def test_a_caption_cut_off_at_the_length_limit_has_no_end_probability():
    from captioner.search.decoding import DecodedIds
    from captioner.search.results import to_result

    cap = tiny_captioner(seed=1)
    words = [cap.vocab.index("a"), cap.vocab.index("red")]
    cut = DecodedIds(words, torch.zeros(2, 1, 16), torch.ones(2), -1.5, torch.log(torch.tensor([0.5, 0.4])))
    r = to_result(cut, cap.vocab, (4, 4))
    assert r.words == ["a", "red"] and r.end_prob is None and r.to_json()["end_prob"] is None
    ended = DecodedIds(words + [cap.vocab.end], torch.zeros(3, 1, 16), torch.ones(3), -1.6,
                       torch.log(torch.tensor([0.5, 0.4, 0.9])))
    r = to_result(ended, cap.vocab, (4, 4))
    assert r.words == ["a", "red"] and r.word_probs == pytest.approx((0.5, 0.4)) and r.end_prob == pytest.approx(0.9)


def test_probabilities_are_written_to_four_significant_digits_never_zero():
    from captioner.search.decoding import CaptionResult

    r = CaptionResult(["a", "b", "c"], torch.zeros(3, 1, 1), torch.ones(3), -20.0,
                      word_probs=(0.123456, 0.0000123456, 1.0), end_prob=2.345678e-9)
    line = r.to_json()
    assert line["word_probs"] == [0.1235, 1.235e-05, 1.0] and line["end_prob"] == 2.346e-09


def test_with_a_length_penalty_each_alternative_carries_the_rank_it_was_ordered_by():
    cap = tiny_captioner(seed=3)
    for i in range(4):
        r = cap.caption(tiny_image(i), DecodeOptions(beam_size=4, max_len=6, num_captions=4, length_penalty=1.0))
        line = r.to_json()
        alts = line["alternatives"]
        assert [a["rank"] for a in alts] == sorted((a["rank"] for a in alts), reverse=True)
        for a, alt in zip(alts, r.alternatives):
            assert alt.rank == pytest.approx(alt.score / (len(alt.words) + 1))
            assert a["rank"] == round(alt.rank, 4)
    plain = cap.caption(tiny_image(0), DecodeOptions(beam_size=4, max_len=6, num_captions=4)).to_json()
    assert all("rank" not in a for a in plain["alternatives"])  # without a penalty the rank is the score


def test_the_n_best_fill_the_pool_where_captions_can_end():
    """With beam 5 and N = 5 every image gets 5 captions (<end> can come at every step here);
    the search's best is N = 1's."""
    cap = tiny_captioner(seed=3)
    for i in range(6):
        best = cap.caption(tiny_image(i), DecodeOptions(beam_size=5, max_len=6))
        r = cap.caption(tiny_image(i), DecodeOptions(beam_size=5, max_len=6, num_captions=5))
        assert len(r.alternatives) == 5 and r.words == best.words
