"""The character budget inside the search (``max_chars``): a caption's printed length is that of
its joined text, and the search with a budget returns exactly what the plain search returns when
every over-budget extension is masked, checked on random tiny decoders, and what an exhaustive
enumeration of every caption returns where the beam holds every prefix."""

import itertools
import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from captioner.data.vocab import TOKENIZERS, Spelling, Vocabulary, tokenizer_named
from captioner.model.encoders import Annotations
from captioner.search import decoding
from captioner.search.budget import Budget
from captioner.search.decoding import beam_search, greedy
from captioner.search.options import DecodeOptions, OptionError, Tokens, parser
from tests.captioner.test_decoding import END, PAD, START, _random_decoder, _reference_search
from tests.tiny import tiny_captioner, tiny_image

# The tiny decoders' three words (ids 3, 4, 5), spelt in two ways: English words of 1, 3 and 6
# letters joined with spaces; and a Chinese character, a Latin word and a full stop joined as
# chars2 joins them (a space only between two Latin words).
SPELLINGS = {"ptb": ["a", "red", "circle"], "chars2": ["红", "ab", "。"]}


def _tokens(name: str) -> tuple[Tokens, list[str]]:
    words = ["<pad>", "<start>", "<end>", *SPELLINGS[name]]
    spelling = Spelling.of(words, tokenizer_named(name), (PAD, START, END))
    return Tokens(start=START, end=END, pad=PAD, spelling=spelling), words


def _printed(name: str, words: list[str], ids: list[int]) -> int:
    """The length of the text a caption shows: its words joined by the tokenizer itself."""
    return len(tokenizer_named(name).join([words[i] for i in ids if i != END]))


def _fits(name: str, words: list[str], budget: int):
    """The reference search's budget, from the joined text alone: a caption of at least one word
    whose text is at most ``budget`` characters."""
    return lambda ids: ids != [END] and _printed(name, words, ids) <= budget


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_the_printed_length_is_the_length_of_the_joined_text(name):
    tokenizer = tokenizer_named(name)
    pieces = ["a", "red", "红", "圆", "ab", "12", "。", "，", "-5", "x.y", "T", "の"]
    words = ["<pad>", "<start>", "<end>", "<unk>", *pieces]
    spelling = Spelling.of(words, tokenizer, (0, 1, 2))
    table = [np.array(x) for x in (spelling.lengths, spelling.before, spelling.after)]
    rng = random.Random(0)
    for _ in range(300):  # the budget's count, word by word, of one row, and the joined text
        ids = [rng.randrange(3, len(words)) for _ in range(rng.randrange(1, 7))]
        budget = Budget(100, 2, *table, np.zeros(1, dtype=np.int64), np.zeros(1, dtype=bool))
        for i in ids:
            budget = budget.follow(np.zeros(1, dtype=np.int64), np.array([i]))
        assert int(budget.chars[0]) == len(tokenizer.join([words[i] for i in ids])), [words[i] for i in ids]


def test_a_word_is_over_the_budget_one_character_past_it_and_end_never_comes_first():
    # ids: 0 <pad>, 1 <start>, 2 <end>, 3 "red" (spaced), 4 "红" (no space), 5 "ab" (spaced)
    words = ["<pad>", "<start>", "<end>", "red", "红", "ab"]
    spelling = Spelling.of(words, tokenizer_named("chars2"), (0, 1, 2))
    table = [np.array(x) for x in (spelling.lengths, spelling.before, spelling.after)]
    rows = np.array([0, 3, 3, 1])  # printed so far; rows 1, 3 end in a Latin word (a space next), row 2 in 红
    closes = np.array([False, True, False, False])
    for limit in (6, 5):
        over = Budget(limit, 2, *table, rows, closes).over()
        assert over[:, 2].tolist() == [True, False, False, False]  # <end>: not as the first token
        # "ab" after a Latin word takes 1 + 2; after 红 or at the start 2
        assert over[:, 5].tolist() == [False, 3 + 3 > limit, 3 + 2 > limit, False]
        assert over[:, 3].tolist() == [False, 3 + 4 > limit, 3 + 3 > limit, 1 + 3 > limit]
        assert not over[:, 4].any()  # 红 takes no space: 3 + 1


def test_join_puts_spaces_where_it_did_before_the_budget():
    assert tokenizer_named("ptb").join(["a", "red", "circle"]) == "a red circle"
    assert tokenizer_named("chars2").join(["红", "ab", "12", "。", "cd", "圆"]) == "红ab 12。cd圆"
    assert tokenizer_named("chars").join(["红", "iphone", "12", "圆"]) == "红iphone 12圆"
    assert tokenizer_named("whitespace").join(["бежит", "кот"]) == "бежит кот"
    assert Vocabulary(["<pad>", "<start>", "<end>", "<unk>", "a"]).spelling.lengths == (0, 0, 0, 5, 1)


@pytest.mark.slow
def test_the_budgeted_search_is_the_plain_search_with_over_budget_words_masked():
    """250 images over 50 random decoders (k 1-4, N best up to k, max_len 3-7, some with a
    length penalty, both spellings), each with a budget drawn at or below the printed length of
    its caption without one: the batched search returns exactly the plain search's captions,
    runners-up and scores; every one fits. 0 differences."""
    rng = random.Random(1)
    differences = changed = fitted_none = 0
    for seed in range(50):
        name = ("ptb", "chars2")[seed % 2]
        tokens, words = _tokens(name)
        decoder = _random_decoder(seed)
        k, max_len = 1 + seed % 4, 3 + seed % 5
        n = 1 + rng.randrange(k)
        penalty = 0.7 if seed % 5 == 3 else 0.0
        a = torch.randn(5, 4, 5, dtype=torch.float64)
        ann = Annotations(a, (2, 2))
        free = beam_search(decoder, ann, tokens, DecodeOptions(beam_size=k, max_len=max_len, length_penalty=penalty))
        budgets = [rng.randint(0, _printed(name, words, r.ids)) or 1 for r in free]
        for i, budget in enumerate(budgets):
            options = DecodeOptions(beam_size=k, max_len=max_len, length_penalty=penalty, num_captions=n,
                                    max_chars=budget)
            [got] = beam_search(decoder, Annotations(a[i:i + 1], (2, 2)), tokens, options)
            ids, score, held, *_ = _reference_search(decoder, a[i:i + 1], (2, 2), k=k, max_len=max_len,
                                                     length_penalty=penalty, num_captions=n,
                                                     fits=_fits(name, words, budget))
            best = [h for _, h in sorted(held, key=lambda x: -x[0])[:n]]
            mine = [got.ids] + [r.ids for r in got.runners_up]
            same = got.ids == ids and (not ids or mine == best) and (
                score == got.score == -math.inf or abs(got.score - score) < 1e-4)
            differences += not same
            assert all(_printed(name, words, x) <= budget and x[-1:] == [END] for x in mine if x)
            changed += got.ids != free[i].ids
            fitted_none += got.ids == []
    assert differences == 0
    assert changed > 100  # the budget decided the caption, often
    assert fitted_none == 0  # "a" and "。" fit any budget


def test_batched_and_eager_and_fixed_searches_agree_under_a_budget():
    """The batch (images leaving it as they are done) and the fixed program (graph.py's form)
    give the one-image-at-a-time captions under a budget."""
    for seed in range(4):
        tokens, _ = _tokens(("ptb", "chars2")[seed % 2])
        decoder = _random_decoder(seed)
        a = torch.randn(4, 4, 5, dtype=torch.float64)
        options = DecodeOptions(beam_size=3, max_len=6, num_captions=2, max_chars=4 + seed % 5)
        batch = beam_search(decoder, Annotations(a, (2, 2)), tokens, options)
        with torch.no_grad():
            fixed = decoding.search(decoder, a, (2, 2), tokens, options, compact=False).captions(4)
        for i in range(4):
            [one] = beam_search(decoder, Annotations(a[i:i + 1], (2, 2)), tokens, options)
            for x in (batch[i], fixed[i]):
                assert x.ids == one.ids and [r.ids for r in x.runners_up] == [r.ids for r in one.runners_up]
                assert x.score == pytest.approx(one.score, abs=1e-6)


@torch.no_grad()
def _log_p(decoder, a: torch.Tensor, ids: list[int]) -> float:
    """log p of the caption ``ids`` (its <end> included), one step at a time."""
    keys = decoder.attention.prepare(a)
    h, c = decoder.init_state(a)
    total, y = 0.0, START
    for w in ids:
        o = decoder.step(torch.tensor([y]), h, c, a, keys, (2, 2))
        total += float(F.log_softmax(o.logits.double(), -1)[0, w])
        h, c, y = o.h, o.c, w
    return total


@pytest.mark.slow
def test_a_beam_that_holds_every_prefix_finds_the_best_captions_within_the_budget_by_enumeration():
    """Three words and at most three of them: a beam of 27 holds every prefix, so the search is
    exhaustive. Its N best within the budget are the N best of every caption whose joined text
    fits, enumerated and scored one by one."""
    max_len, k = 3, 27
    for seed in range(8):
        name = ("ptb", "chars2")[seed % 2]
        tokens, words = _tokens(name)
        decoder = _random_decoder(seed)
        a = torch.randn(1, 4, 5, dtype=torch.float64)
        captions = [list(c) + [END] for n in range(1, max_len + 1) for c in itertools.product((3, 4, 5), repeat=n)]
        scored = sorted(((_log_p(decoder, a, c), c) for c in captions), key=lambda x: -x[0])
        for budget in (1, 3, 5, 8):
            within = [c for _, c in scored if _printed(name, words, c) <= budget][:3]
            got = beam_search(decoder, Annotations(a, (2, 2)), tokens,
                              DecodeOptions(beam_size=k, max_len=max_len, num_captions=3, max_chars=budget))[0]
            assert [got.ids] + [r.ids for r in got.runners_up] == within, (seed, budget)


def test_greedy_with_a_budget_is_the_plain_search_of_width_one():
    tokens, words = _tokens("ptb")
    for seed in range(10):
        decoder = _random_decoder(seed)
        a = torch.randn(4, 4, 5, dtype=torch.float64)
        got = greedy(decoder, Annotations(a, (2, 2)), tokens, DecodeOptions(max_len=5, max_chars=5))
        for i, g in enumerate(got):
            ids, *_ = _reference_search(decoder, a[i:i + 1], (2, 2), k=1, max_len=5, length_penalty=0.0,
                                        fits=_fits("ptb", words, 5))
            assert g.ids == ids and _printed("ptb", words, g.ids) <= 5


def test_a_budget_no_word_fits_gives_no_caption_not_a_cut_one():
    tokens, _ = _tokens("ptb")
    spelling = Spelling.of(["<pad>", "<start>", "<end>", "ab", "red", "circle"], tokenizer_named("ptb"),
                           (PAD, START, END))
    tokens = Tokens(start=START, end=END, pad=PAD, spelling=spelling)
    decoder = _random_decoder(3)
    a = torch.randn(2, 4, 5, dtype=torch.float64)
    for k in (1, 3):
        for r in beam_search(decoder, Annotations(a, (2, 2)), tokens, DecodeOptions(beam_size=k, max_chars=1)):
            assert r.ids == [] and r.score == -math.inf and r.runners_up == []
        fits = beam_search(decoder, Annotations(a, (2, 2)), tokens, DecodeOptions(beam_size=k, max_chars=2))
        assert all(r.ids == [3, END] for r in fits)  # "ab", the one caption of at most 2 characters


def test_the_captioner_says_which_budget_no_caption_fits_and_the_shortest_it_found():
    cap = tiny_captioner(seed=3)
    words = list(cap.vocab.words)
    words[words.index("a")] = "aa"  # no word of one character left
    cap.vocab = Vocabulary(words)
    r = cap.caption(tiny_image(0), DecodeOptions(beam_size=3, max_len=6, max_chars=1))
    assert r.words == [] and r.caption == "" and r.no_fit is not None
    listed = cap.caption(tiny_image(0), DecodeOptions(beam_size=3, max_len=6, max_chars=1, num_captions=3,
                                                      length_penalty=1.0))
    assert listed.no_fit is not None and listed.alternatives == ()  # nothing to list, nothing ranked
    assert r.no_fit.max_chars == 1 and r.no_fit.shortest
    unbudgeted = cap.caption(tiny_image(0), DecodeOptions(beam_size=3, max_len=6, num_captions=3))
    assert r.no_fit.shortest == min((x.caption for x in unbudgeted.alternatives), key=len)
    line = r.no_fit.message("x.png")
    assert line.startswith("x.png: no caption fits in 1 character") and repr(r.no_fit.shortest) in line
    fits = cap.caption(tiny_image(0), DecodeOptions(beam_size=3, max_len=6, max_chars=12))
    assert fits.no_fit is None and 0 < len(fits.caption) <= 12


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "12"])
def test_a_budget_below_one_character_or_not_whole_is_refused(bad):
    with pytest.raises(OptionError, match="max_chars"):
        DecodeOptions(max_chars=bad)
    assert DecodeOptions(max_chars=None).max_chars is None and DecodeOptions(max_chars=1).max_chars == 1


def test_the_flag_is_held_to_the_same_rule():
    import argparse

    assert parser("max_chars")("125") == 125
    for text in ("0", "-1", "x", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            parser("max_chars")(text)


def test_a_budget_needs_tokens_that_know_how_words_print():
    decoder = _random_decoder(0)
    with pytest.raises(ValueError, match="max_chars"):
        beam_search(decoder, Annotations(torch.randn(1, 4, 5, dtype=torch.float64), (2, 2)),
                    Tokens(start=START, end=END, pad=PAD), DecodeOptions(max_chars=10))


def test_the_graphed_search_runs_a_budget_eagerly_and_records_no_graph():
    from captioner.search.graph import SearchGraphs

    def no_capture(run, pool):
        raise AssertionError("a budget was recorded as a graph")

    cap = tiny_captioner(seed=4)
    with torch.no_grad():
        ann = cap.model.encode(torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0)))
    graphs = SearchGraphs(cap.model.decoder, capture=no_capture)
    options = DecodeOptions(beam_size=3, max_len=6, num_captions=2, max_chars=9)
    got = graphs.search(ann, cap.tokens, options)
    want = beam_search(cap.model.decoder, ann, cap.tokens, options)
    assert [(x.ids, [r.ids for r in x.runners_up]) for x in got] == [(x.ids, [r.ids for r in x.runners_up])
                                                                        for x in want]
    assert graphs.graphs == {} and graphs.failed is None
    assert all(len(cap.vocab.join(cap.vocab.decode(x.ids))) <= 9 for x in got)


@pytest.mark.parametrize("beam,n,budget", [(1, 1, 6), (3, 1, 9), (3, 3, 12), (4, 2, 5), (2, 1, 1)])
def test_the_numpy_search_keeps_the_budget_as_the_torch_search_does(beam, n, budget):
    from captioner.onnx import search as npsearch
    from tests.builders import torch_step

    cap = tiny_captioner(seed=2)
    words = list(cap.vocab.words)
    words[words.index("a")] = "aa"  # budget 1: no word fits
    cap.vocab = Vocabulary(words)
    images = torch.stack([cap.preprocess(tiny_image(i)) for i in range(5)])
    dec = cap.model.decoder
    with torch.no_grad():
        ann = dec.annotate(cap.model.encode(images))
        keys = dec.attention.prepare(ann.vectors)
        h, c = dec.init_state(ann.vectors)
    options = DecodeOptions(beam_size=beam, max_len=6, num_captions=n, max_chars=budget)
    assert not options.greedy  # a budget takes the beam search, even of width 1
    ours = beam_search(dec, ann, cap.tokens, options)
    theirs = npsearch.beam_search(torch_step(dec, ann.grid), ann.vectors.numpy(), keys.numpy(), h.numpy(),
                                  c.numpy(), cap.tokens, options)
    for a, b in zip(ours, theirs, strict=True):
        assert b.ids == a.ids and [r.ids for r in b.runners_up] == [r.ids for r in a.runners_up]
        assert b.score == pytest.approx(a.score, abs=1e-5)
        np.testing.assert_allclose(b.log_probs, a.log_probs.numpy(), atol=1e-5)
        assert len(cap.vocab.join(cap.vocab.decode(a.ids))) <= budget
    assert all(a.ids == [] for a in ours) == (budget == 1)


def _no_single_letter(seed: int):
    """The tiny captioner with "a" spelt "aa": no word of one character, so a budget of 1 fits none."""
    cap = tiny_captioner(seed=seed)
    words = list(cap.vocab.words)
    words[words.index("a")] = "aa"
    cap.vocab = Vocabulary(words)
    return cap


def test_the_caption_command_keeps_the_budget_and_names_an_image_no_caption_fits(tmp_path, capsys):
    import json

    from captioner.cli.main import main

    path, image = tmp_path / "m.pt", tmp_path / "a.png"
    cap = _no_single_letter(3)
    cap.save(path)
    tiny_image(1).save(image)
    out = tmp_path / "c.jsonl"
    assert main(["caption", str(image), "--weights", str(path), "--out", str(out), "--quiet", "--max-len", "6",
                 "--max-chars", "9", "--num-captions", "2"]) == 0
    line = json.loads(out.read_text())
    want = cap.caption(tiny_image(1), DecodeOptions(max_len=6, max_chars=9, num_captions=2))
    assert line["caption"] == want.caption and len(line["caption"]) <= 9
    assert all(len(a["caption"]) <= 9 for a in line["alternatives"])
    assert main(["caption", str(image), "--weights", str(path), "--max-len", "6", "--max-chars", "1", "--quiet"]) == 1
    [line] = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert line["image"] == str(image) and "caption" not in line
    assert line["error"].startswith("no caption fits in 1 character "
                                    "(the shortest found without a budget is ")
    assert main(["caption", str(image), "--weights", str(path), "--max-len", "6", "--max-chars", "1", "--quiet",
                 "--format", "txt"]) == 1
    assert f"failed: {image}: no caption fits in 1 character (" in capsys.readouterr().err
    assert not (tmp_path / "a.txt").exists()
    with pytest.raises(SystemExit) as refused:
        main(["caption", str(image), "--weights", str(path), "--max-chars", "0"])
    assert refused.value.code == 2 and "--max-chars: must be >= 1, got 0" in capsys.readouterr().err
