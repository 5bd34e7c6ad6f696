"""Greedy and batched beam search."""

import math

import pytest
import torch
import torch.nn.functional as F

from captioner.inference import Captioner, DecodeOptions
from captioner.model.encoders import Annotations
from captioner.search import decoding
from captioner.search.decoding import beam_search, greedy
from captioner.search.options import Tokens
from tests.tiny import tiny_captioner


def _images(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _sequence_log_prob(cap, image: torch.Tensor, ids: list[int]) -> float:
    """log p(ids | image) by teacher forcing, independent of the search code."""
    tokens = torch.tensor([[cap.vocab.start] + ids])
    out = cap.model(image[None], tokens, torch.tensor([len(ids) + 1]))
    logp = F.log_softmax(out.logits[0], -1)
    return float(logp.gather(1, torch.tensor(ids)[:, None]).sum())


def test_beam_one_equals_greedy():
    cap = tiny_captioner(seed=3)
    images = _images(6)
    ann = cap.model.encode(images)
    g = greedy(cap.model.decoder, ann, cap.tokens, DecodeOptions(max_len=12))
    b = beam_search(cap.model.decoder, ann, cap.tokens, DecodeOptions(beam_size=1, max_len=12))
    for x, y in zip(g, b):
        assert x.ids == y.ids
        assert abs(x.score - y.score) < 1e-4
        torch.testing.assert_close(x.alphas, y.alphas)


def test_batched_beam_equals_one_image_at_a_time():
    cap = tiny_captioner(seed=1)
    images = _images(5, seed=2)
    opts = DecodeOptions(beam_size=4, max_len=10)
    together = cap.caption_batch(images, opts)
    for i in range(5):
        alone = cap.caption_batch(images[i:i + 1], opts)[0]
        assert alone.words == together[i].words
        assert abs(alone.score - together[i].score) < 1e-4
        torch.testing.assert_close(alone.alphas, together[i].alphas, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(alone.betas, together[i].betas, atol=1e-5, rtol=1e-4)


def test_beam_score_is_the_caption_log_probability_and_alphas_follow_the_words():
    cap = tiny_captioner(seed=4)
    images = _images(3, seed=5)
    ann = cap.model.encode(images)
    v = cap.vocab
    results = beam_search(cap.model.decoder, ann, cap.tokens, DecodeOptions(beam_size=3, max_len=10))
    for i, r in enumerate(results):
        assert abs(r.score - _sequence_log_prob(cap, images[i], r.ids)) < 1e-3
        # The alpha of each step is the one the teacher-forced pass gives for that prefix.
        tokens = torch.tensor([[v.start] + r.ids])
        out = cap.model(images[i:i + 1], tokens, torch.tensor([len(r.ids) + 1]))
        torch.testing.assert_close(r.alphas, out.alphas[0], atol=1e-5, rtol=1e-4)


def test_beam_as_wide_as_the_vocabulary_finds_the_best_short_caption():
    """On a tiny space, enumerate every caption of at most one word: a beam of width V
    keeps every one-word caption open, and after the one word only <end> may come, so it
    must return the best finished caption of at most one word, never one cut off."""
    cap = tiny_captioner(seed=7)
    images = _images(4, seed=8)
    ann = cap.model.encode(images)
    v = cap.vocab
    words = [v.unk] + list(range(4, len(v)))
    results = beam_search(cap.model.decoder, ann, cap.tokens, DecodeOptions(beam_size=len(v), max_len=1))
    for i, r in enumerate(results):
        finished = [[v.end]] + [[w, v.end] for w in words]
        best = max(finished, key=lambda c: _sequence_log_prob(cap, images[i], c))
        assert r.ids == best
        assert abs(r.score - _sequence_log_prob(cap, images[i], best)) < 1e-4


def test_no_end_token_within_the_limit_does_not_crash():
    cap = tiny_captioner(seed=2)
    with torch.no_grad():
        cap.model.decoder.L_o.bias[cap.vocab.end] = float("-inf")  # <end> can never come
    images = _images(3)
    for k in (1, 3):
        results = cap.caption_batch(images, DecodeOptions(beam_size=k, max_len=7))
        for i, r in enumerate(results):
            assert len(r.words) == 7
            assert r.alphas.shape == (7, 2, 2)
            assert r.betas.shape == (7,)
            # The score is the cut-off caption's own log-probability (no <end> in it).
            ids = [cap.vocab.index(w) for w in r.words]
            assert abs(r.score - _sequence_log_prob(cap, images[i], ids)) < 1e-3


def test_results_carry_one_map_per_word():
    cap = tiny_captioner(seed=0)
    for r in cap.caption_batch(_images(4), DecodeOptions(beam_size=3, max_len=9)):
        assert r.alphas.shape == (len(r.words), 2, 2)
        torch.testing.assert_close(r.alphas.sum((1, 2)), torch.ones(len(r.words)))
        assert "<end>" not in r.words and "<start>" not in r.words


def test_images_done_early_leave_the_batch_and_keep_their_captions(tmp_path):
    """Eager, an image leaves the batch at the step it is done (the steps of the others are not
    paid for it), so captions of different lengths come out of one batch as each image alone
    gives them; the steps stop at the one where the last image is done, before the length limit.
    The fixed program a CUDA graph records keeps the batch whole (test_search_graph.py)."""
    from captioner.data.images import load_image
    from captioner.data.shapes import generate_dataset

    generate_dataset(tmp_path, {"test": 6}, seed=99)  # 1-3 objects: captions of different lengths
    images = [load_image(p) for p in sorted((tmp_path / "images" / "test").glob("*.png"))]
    cap = Captioner.load("demo-soft")
    opts = DecodeOptions(beam_size=3, max_len=20)
    decoder = cap.model.decoder
    rows, real_step = [], decoder.step

    def counting_step(y, *args, **kw):
        rows.append(y.shape[0])
        return real_step(y, *args, **kw)

    decoder.step = counting_step
    try:
        together = cap.caption_images(images, opts)
    finally:
        del decoder.step
    lengths = sorted(len(r.words) for r in together)
    assert lengths[0] < lengths[-1]  # the captions end at different steps ...
    assert rows[0] == 6 * 3 and rows == sorted(rows, reverse=True) and rows[-1] < rows[0]  # ... leaving it
    assert all(r % 3 == 0 for r in rows) and len(rows) < opts.max_len + 1
    for image, r in zip(images, together):  # the other images change no result
        alone = cap.caption(image, opts)
        assert alone.words == r.words and abs(alone.score - r.score) < 1e-4
        torch.testing.assert_close(alone.alphas, r.alphas, atol=1e-5, rtol=1e-4)


# --- the finished pool -------------------------------------------------------------------
# A stub decoder whose next-word distribution depends only on the step: the searches below
# are worked out by hand. Vocabulary: 0 <pad>, 1 <start>, 2 <end>, 3 A, 4 B, 5 C.
PAD, START, END, A, B, C = range(6)
TOKENS = Tokens(start=START, end=END, pad=PAD)  # a table of words without <unk>


class _StepTable:
    """Stands in for a Decoder: p(w_t) = table[t] whatever came before; h carries t."""

    def __init__(self, table: list[dict[int, float]]):
        rows = []
        for probs in table:
            p = torch.zeros(6, dtype=torch.float64)
            for w, q in probs.items():
                p[w] = q
            assert abs(float(p.sum()) - 1) < 1e-9
            rows.append(torch.log(p))
        self.logp = torch.stack(rows)  # (T, V); <pad> and <start> get -inf
        self.attention = self
        self.num_heads = 1

    def annotate(self, ann):
        return ann

    def prepare(self, a):
        return a

    def init_state(self, a):
        z = torch.zeros(a.shape[0], 1)
        return z, z

    def step(self, y, h, c, a, keys, grid, **kw):
        from captioner.model.decoder import StepOutput

        t = int(h[0, 0])
        n = y.shape[0]
        logits = self.logp[t].float().expand(n, -1)
        return StepOutput(logits, h + 1, c, torch.full((n, 1, a.shape[1]), 1.0 / a.shape[1]), torch.ones(n))


# Beam 2. Step 0: "A" (-0.105). Step 1: "A <end>" (-2.81) is second of the best two,
# behind "A C" (-0.27). Step 2: "A C A", "A C B" (-1.18, -1.32) both beat it. Step 4: the
# two best extensions end, at -2.95 and -3.09. Keeping "A <end>" among the beams loses it
# at step 2 and returns "A C A A <end>" (-2.95); the pool keeps it.
PUSHED_OUT = [
    {A: 0.9, B: 0.05, C: 0.04, END: 0.01},
    {C: 0.85, END: math.exp(-2.71), A: 0.04, B: 0.15 - math.exp(-2.71) - 0.04},
    {A: 0.4, B: 0.35, C: 0.125, END: 0.125},
    {A: 0.45, B: 0.35, END: 0.2},
    {END: 0.38, A: 0.32, B: 0.3},
]
LONG = math.log(0.9 * 0.85 * 0.4 * 0.45 * 0.38)  # "A C A A <end>"


def _stub_search(table, k, max_len, length_penalty=0.0):
    ann = Annotations(torch.zeros(1, 4, 3), (2, 2))
    return beam_search(_StepTable(table), ann, TOKENS,
                       DecodeOptions(beam_size=k, max_len=max_len, length_penalty=length_penalty))[0]


def test_a_full_pool_does_not_stop_an_open_beam_that_can_still_win():
    # Beam 2. Step 0: "<end>" (-2.30) joins the pool. Step 1: "A <end>" (-1.21) joins it
    # and fills it, but the open "A A" (-0.67) can still beat it: step 2 ends it at -0.78.
    table = [{A: 0.85, END: 0.10, B: 0.05}, {A: 0.6, END: 0.35, B: 0.05}, {END: 0.9, A: 0.1}]
    r = _stub_search(table, k=2, max_len=2)
    assert r.ids == [A, A, END]
    assert abs(r.score - math.log(0.85 * 0.6 * 0.9)) < 1e-5


def test_a_long_likely_caption_beats_an_early_unlikely_end():
    # Twenty steps of {A .99, <end> .01}, then <end>: the early "<end>" (-4.61) and the
    # short captions fill the pool of 3, but the open beam of A's stays above them until the
    # twenty-word caption (-0.20), which greedy finds too.
    table = [{A: 0.99, END: 0.01}] * 20 + [{END: 1.0}]
    for k in (1, 3):
        r = _stub_search(table, k=k, max_len=20)
        assert r.ids == [A] * 20 + [END], k
        assert abs(r.score - 20 * math.log(0.99)) < 1e-5
    g = greedy(_StepTable(table), Annotations(torch.zeros(1, 4, 3), (2, 2)), TOKENS, DecodeOptions(max_len=20))[0]
    assert g.ids == [A] * 20 + [END]


def test_max_len_counts_words_and_a_caption_of_exactly_that_many_can_end():
    table = [{A: 0.9, END: 0.1}] * 3 + [{END: 0.8, B: 0.2}, {A: 1.0}]
    ann = Annotations(torch.zeros(1, 4, 3), (2, 2))
    for k in (1, 2, 3):
        r = _stub_search(table, k=k, max_len=3)
        assert r.ids == [A, A, A, END], k  # three words, then <end>
        assert r.alphas.shape == (4, 4)
    g = greedy(_StepTable(table), ann, TOKENS, DecodeOptions(max_len=3))[0]
    assert g.ids == [A, A, A, END]
    assert abs(g.score - math.log(0.9 ** 3 * 0.8)) < 1e-5
    # No <end> before the fourth step and two words allowed: the caption is cut off at two
    # words, its score without <end>.
    never_early = [{A: 0.9, B: 0.1}] * 3 + [{END: 0.8, B: 0.2}]
    for search in (lambda: _stub_search(never_early, k=2, max_len=2),
                   lambda: greedy(_StepTable(never_early), ann, TOKENS, DecodeOptions(max_len=2))[0]):
        r = search()
        assert r.ids == [A, A]
        assert abs(r.score - 2 * math.log(0.9)) < 1e-5
        assert r.alphas.shape == (2, 4)


# Step 0 ranks A (-0.69) and B (-1.20) above <end> (-1.61); with one word allowed, step 1
# can only end: "A <end>" (-5.30) is the best finished caption, though at step 1 "A A" and
# "A B" outrank every extension that ends.
ONLY_END_LAST = [{A: 0.5, B: 0.3, END: 0.2}, {A: 0.6, B: 0.39, END: 0.01}]


def test_after_the_last_word_only_end_may_come():
    ann = Annotations(torch.zeros(1, 4, 3), (2, 2))
    searches = {k: (lambda k=k: _stub_search(ONLY_END_LAST, k=k, max_len=1)) for k in (1, 2)}
    searches["greedy"] = lambda: greedy(_StepTable(ONLY_END_LAST), ann, TOKENS, DecodeOptions(max_len=1))[0]
    for name, search in searches.items():
        r = search()
        assert r.ids == [A, END], name  # not "A" cut off at the limit
        assert abs(r.score - math.log(0.5 * 0.01)) < 1e-5, name
        assert r.alphas.shape == (2, 4) and r.betas.shape == (2,)
    # Three beams hold <end> at step 0 (-1.61) among their best: the empty caption wins.
    assert _stub_search(ONLY_END_LAST, k=3, max_len=1).ids == [END]


def test_max_len_must_allow_a_word():
    with pytest.raises(ValueError, match="max_len"):
        _stub_search([{END: 1.0}], k=2, max_len=0)


def test_a_finished_caption_pushed_out_of_the_beams_is_still_returned():
    r = _stub_search(PUSHED_OUT, k=2, max_len=4)
    assert r.ids == [A, END]
    assert abs(r.score - (math.log(0.9) - 2.71)) < 1e-5  # -2.81, not -2.95
    assert r.alphas.shape == (2, 4) and r.betas.shape == (2,)


def test_length_penalty_ranks_the_finished_pool_by_score_per_length():
    # Same search: the pool ends with "A <end>" (-2.81, 2 tokens) and "A C A A <end>"
    # (-2.95, 5 tokens). By score the short one wins; divided by the length, the long one.
    assert _stub_search(PUSHED_OUT, k=2, max_len=4, length_penalty=0.0).ids == [A, END]
    r = _stub_search(PUSHED_OUT, k=2, max_len=4, length_penalty=1.0)
    assert r.ids == [A, C, A, A, END]
    assert abs(r.score - LONG) < 1e-5  # the log p, not the rank


def test_the_search_stops_when_no_open_beam_can_beat_the_best_finished_caption():
    # Step 0: "<end>" alone has p 0.6; every open beam is already below it: done at once,
    # even though the pool holds one caption of k = 3.
    table = [{END: 0.6, A: 0.2, B: 0.1, C: 0.1}] + [{A: 0.5, END: 0.5}] * 5
    stub = _StepTable(table)
    ann = Annotations(torch.zeros(1, 4, 3), (2, 2))
    options = DecodeOptions(beam_size=3, max_len=5)
    r = beam_search(stub, ann, TOKENS, options)[0]
    assert r.ids == [END] and _steps(stub, ann, options) == [1]


# --- against a plain search, one image and one beam at a time ------------------------------
@torch.no_grad()
def _reference_search(decoder, a, grid, *, k, max_len, length_penalty, num_captions=1, never=(START, PAD),
                      fits=None):
    """Beam search of width k written plainly from DESIGN.md's definition, for one image:
    Python lists of (log p, ids, state), every extension scored one at a time.

    k open beams and a pool of finished captions. Each step takes the extensions of the
    open beams, best first: after the ``max_len``-th word only <end> may come, so at that
    step the extensions that end are the only ones. The ones among the best k that end
    join the pool; the best k that do not end are the next open beams. The search stops
    when no open beam can still beat the pool's ``num_captions``-th best (an open caption's
    log p only falls; its rank is best when it is as long as it can be), or after the step
    that can only end. No caption holds a word of ``never``. ``fits`` (a character budget): an
    extension is taken only where ``fits(ids)`` holds of its ids. Returns (ids, log p) of the pool's
    best, or of the best open beam cut off at ``max_len`` words when nothing ended (only where <end> cannot come), every
    finished caption the pool held, as (rank, ids), whether the search reached the last
    step, and how many steps it took."""
    def rank(logp, n):
        return logp / n ** length_penalty if length_penalty > 0 else logp

    keys = decoder.attention.prepare(a)
    h, c = decoder.init_state(a)
    beams = [(0.0, [], (h, c))]
    pool = []
    for t in range(max_len + 1):
        cands = []
        for score, ids, (h, c) in beams:
            o = decoder.step(torch.tensor([ids[-1] if ids else START]), h, c, a, keys, grid)
            logp = F.log_softmax(o.logits.double(), -1)[0].tolist()
            for w, lp in enumerate(logp):
                if w in never or lp == -math.inf or (t == max_len and w != END):
                    continue
                if fits is not None and not fits(ids + [w]):
                    continue
                cands.append((score + lp, ids + [w], (o.h, o.c)))
        cands.sort(key=lambda x: -x[0])
        pool += [(rank(score, len(ids)), score, ids) for score, ids, _ in cands[:k] if ids[-1] == END]
        if t == max_len:
            break
        beams = [x for x in cands if x[1][-1] != END][:k]
        if not beams:  # nothing to go on with (a character budget no word fits)
            break
        ranked = sorted((x[0] for x in pool), reverse=True)
        if len(ranked) >= num_captions and ranked[num_captions - 1] >= rank(beams[0][0], max_len + 1):
            break
    held = [(r, ids) for r, _, ids in pool]
    if pool:
        best = max(pool, key=lambda x: x[0])
        return best[2], best[1], held, t == max_len, t + 1
    if not beams:
        return [], -math.inf, held, False, t + 1
    return beams[0][1], beams[0][0], held, t == max_len, t + 1


def _random_decoder(seed, **variant):
    from captioner.model.decoder import Decoder, ModelConfig

    torch.manual_seed(seed)
    decoder = Decoder(ModelConfig(vocab_size=6, annotation_dim=5, embed_dim=6, hidden_dim=7, attention_dim=4,
                                  dropout=0.0, **variant)).double().eval()
    with torch.no_grad():  # sharper or flatter word distributions, and <end> more or less likely
        decoder.L_o.weight.mul_(1 + 5 * torch.rand(()).item())
        decoder.L_o.bias[END] += 2 * torch.randn(()).item()
    return decoder


@pytest.mark.slow
def test_batched_search_equals_the_plain_search_on_random_tiny_models():
    """500 images over 100 random decoders (vocabulary 6, k 2-4, max_len 4-8, some with a
    length penalty): the batched search returns exactly what the plain one does, and
    always a finished caption (<end> can always come here)."""
    differs_from_best_beam = reached_the_limit = 0
    for seed in range(100):
        decoder = _random_decoder(seed)
        k, max_len = 2 + seed % 3, 4 + seed % 5
        length_penalty = 0.7 if seed % 5 == 3 else 0.0
        a = torch.randn(5, 4, 5, dtype=torch.float64)
        got = beam_search(decoder, Annotations(a, (2, 2)), TOKENS,
                          DecodeOptions(beam_size=k, max_len=max_len, length_penalty=length_penalty))
        for i, r in enumerate(got):
            ids, score, held, limit, _ = _reference_search(decoder, a[i:i + 1], (2, 2), k=k, max_len=max_len,
                                                           length_penalty=length_penalty)
            assert r.ids == ids, (seed, i)
            assert abs(r.score - score) < 1e-4
            assert r.ids[-1] == END and len(r.ids) <= max_len + 1, (seed, i)
            mine = r.score / len(r.ids) ** length_penalty if length_penalty > 0 else r.score
            assert all(mine >= rank - 1e-5 for rank, _ in held)  # never below a caption it held
            differs_from_best_beam += any(ids != h for _, h in held)
            reached_the_limit += limit
    assert differs_from_best_beam > 0  # the pool held other captions than the one returned
    assert reached_the_limit > 25  # the step that can only end was tested, often


@pytest.mark.parametrize("allow_unk", [False, True])
def test_unk_is_never_a_word_unless_asked_for_as_the_plain_search_has_it(allow_unk):
    """With C as the vocabulary's <unk>, made likely: greedy and the beam search give the plain
    search's captions without it, and with ``allow_unk`` the plain search's captions with it."""
    tokens = Tokens(start=START, end=END, pad=PAD, unk=C)
    never = (START, PAD) if allow_unk else (START, PAD, C)
    chose_unk = 0
    for seed in range(30):
        decoder = _random_decoder(seed)
        with torch.no_grad():
            decoder.L_o.bias[C] += 3.0
        k, max_len = 1 + seed % 3, 3 + seed % 4
        a = torch.randn(3, 4, 5, dtype=torch.float64)
        options = DecodeOptions(beam_size=k, max_len=max_len, allow_unk=allow_unk)
        for i, r in enumerate(beam_search(decoder, Annotations(a, (2, 2)), tokens, options)):
            ids, score, *_ = _reference_search(decoder, a[i:i + 1], (2, 2), k=k, max_len=max_len, length_penalty=0.0,
                                               never=never)
            assert r.ids == ids and abs(r.score - score) < 1e-4, (seed, i)
            chose_unk += C in r.ids
        if k == 1:
            assert [g.ids for g in greedy(decoder, Annotations(a, (2, 2)), tokens, options)] == \
                [r.ids for r in beam_search(decoder, Annotations(a, (2, 2)), tokens, options)]
    assert (chose_unk > 10) if allow_unk else chose_unk == 0


def test_greedy_ends_at_the_limit_and_equals_beam_one_on_random_tiny_models():
    """Short limits, so that many captions reach the step after the last word: greedy
    ends them there (never cut off), as beam search of width 1 and the plain search do."""
    reached_the_limit = 0
    for seed in range(40):
        decoder = _random_decoder(seed)
        max_len = 2 + seed % 3
        a = torch.randn(5, 4, 5, dtype=torch.float64)
        ann = Annotations(a, (2, 2))
        g = greedy(decoder, ann, TOKENS, DecodeOptions(max_len=max_len))
        b = beam_search(decoder, ann, TOKENS, DecodeOptions(beam_size=1, max_len=max_len))
        for i, (x, y) in enumerate(zip(g, b)):
            ids, score, _, limit, _ = _reference_search(decoder, a[i:i + 1], (2, 2), k=1, max_len=max_len,
                                                        length_penalty=0.0)
            assert x.ids == y.ids == ids, (seed, i)
            assert abs(x.score - score) < 1e-4 and abs(y.score - score) < 1e-4
            assert x.ids[-1] == END
            reached_the_limit += limit
    assert reached_the_limit > 20


def _steps(decoder, ann: Annotations, options: DecodeOptions) -> list[int]:
    """Each image's steps until it is done (rule 3): where a search that let it go would stop."""
    with torch.no_grad():
        return (decoding.search(decoder, ann.vectors, ann.grid, TOKENS, options).done_at + 1).tolist()


@pytest.mark.slow
def test_the_n_best_are_those_of_a_search_that_goes_on_until_none_can_beat_the_n_th():
    """60 images over 20 random decoders (k 2-4, N 2..k, some with a length penalty): the
    N best finished captions, in rank order, are those of the plain search that stops only
    when no open beam can beat its N-th best; the search takes as many steps as that one, and
    its best is the best of N = 1 (which takes the steps of the search for the best alone).
    With a length penalty the order is the rank's, not always the log p's."""
    longer = out_of_score_order = 0
    for seed in range(20):
        decoder = _random_decoder(seed)
        k, max_len = 2 + seed % 3, 3 + seed % 5
        n = 2 + seed % (k - 1)
        length_penalty = 1.0 if seed % 4 == 1 else 0.0
        for i in range(3):
            a = torch.randn(1, 4, 5, dtype=torch.float64)
            steps = {}
            for want in (1, n):
                options = DecodeOptions(beam_size=k, max_len=max_len, length_penalty=length_penalty,
                                        num_captions=want)
                got = beam_search(decoder, Annotations(a, (2, 2)), TOKENS, options)[0]
                ids, score, held, _, ref_steps = _reference_search(decoder, a, (2, 2), k=k, max_len=max_len,
                                                                   length_penalty=length_penalty, num_captions=want)
                assert got.ids == ids and abs(got.score - score) < 1e-4, (seed, i, want)
                [steps[want]] = _steps(decoder, Annotations(a, (2, 2)), options)
                assert steps[want] == ref_steps, (seed, i, want)
                best = sorted(held, key=lambda x: -x[0])[:want]
                assert [got.ids] + [r.ids for r in got.runners_up] == [h for _, h in best], (seed, i, want)
                ranks = [x.score / len(x.ids) ** length_penalty if length_penalty else x.score
                         for x in [got, *got.runners_up]]
                assert ranks == sorted(ranks, reverse=True)
                scores = [x.score for x in [got, *got.runners_up]]
                out_of_score_order += scores != sorted(scores, reverse=True)
                if want == 1:
                    first = got.ids
                    assert got.runners_up == []
                else:
                    assert got.ids == first
                    assert len(got.runners_up) == want - 1  # <end> can always come here: the pool fills
            longer += steps[n] > steps[1]
    assert longer > 5  # going on for the N-th best was needed, often
    assert out_of_score_order > 0


def test_a_length_penalty_s_bound_counts_the_end_token():
    """The best an open beam can still reach is log p / (max_len + 1)**P: with max_len**P the
    search stops a step early. k = 1, max_len = 2, P = 1: "A <end>" (-1.11 / 2 = -0.555) is in
    the pool when the open "A A" (-1.31) could still reach -1.31 / 3 = -0.437 (not -0.655):
    the search goes on and "A A <end>" (-1.416 / 3 = -0.472) wins."""
    table = [{A: 0.6, END: 0.4}, {A: 0.45, END: 0.55}, {END: 0.9, A: 0.1}]
    r = _stub_search(table, k=1, max_len=2, length_penalty=1.0)
    assert r.ids == [A, A, END]
    assert abs(r.score - math.log(0.6 * 0.45 * 0.9)) < 1e-5


def test_the_n_best_stop_as_soon_as_no_open_beam_can_beat_the_n_th():
    # Step 0: "<end>" (0.6). Step 1: "A <end>" (0.2 * 0.55 = 0.11) joins the pool, the open "A A"
    # (0.09) is below it: for N = 2 the pool's 2nd best beats every open beam, done after 2 steps
    # (N = 1: after one, test_the_search_stops_when_no_open_beam_can_beat_the_best_finished_caption).
    table = [{END: 0.6, A: 0.2, B: 0.1, C: 0.1}] + [{A: 0.45, END: 0.55}] * 5
    stub = _StepTable(table)
    ann = Annotations(torch.zeros(1, 4, 3), (2, 2))
    options = DecodeOptions(beam_size=3, max_len=5, num_captions=2)
    r = beam_search(stub, ann, TOKENS, options)[0]
    assert r.ids == [END] and [x.ids for x in r.runners_up] == [[A, END]] and _steps(stub, ann, options) == [2]


MULTI_HEAD = [{"heads": 2}, {"heads": 2, "local_window": 1.5, "local_width": "learned"},
              {"heads": 3, "score": "cosine", "normalizer": "sparsemax"}]


@pytest.mark.parametrize("variant", MULTI_HEAD, ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()))
def test_batched_search_with_several_heads_equals_the_plain_search(variant):
    """The k beams of an image share its keys (prepared once per image, for every head)."""
    for seed in range(8):
        decoder = _random_decoder(seed, **variant)
        k, max_len = 2 + seed % 3, 4 + seed % 3
        a = torch.randn(4, 4, 5, dtype=torch.float64)
        got = beam_search(decoder, Annotations(a, (2, 2)), TOKENS, DecodeOptions(beam_size=k, max_len=max_len))
        for i, r in enumerate(got):
            ids, score, *_ = _reference_search(decoder, a[i:i + 1], (2, 2), k=k, max_len=max_len,
                                               length_penalty=0.0)
            assert r.ids == ids, (seed, i)
            assert abs(r.score - score) < 1e-4
            # Each word's head maps are the ones teacher forcing gives for that prefix.
            tokens = torch.tensor([[START] + r.ids])
            out = decoder(Annotations(a[i:i + 1], (2, 2)), tokens, torch.tensor([len(r.ids) + 1]))
            torch.testing.assert_close(r.alphas_heads, out.alphas_heads[0].float(), atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(r.alphas, out.alphas[0].float(), atol=1e-5, rtol=1e-4)


def test_results_of_a_multi_head_model_carry_each_heads_maps():
    cap = tiny_captioner(seed=5, heads=2)
    images = _images(4, seed=6)
    # <unk> allowed: this untrained model's likeliest words are <unk>, and the maps need words
    for opts in (DecodeOptions(beam_size=1, max_len=8, allow_unk=True),
                 DecodeOptions(beam_size=3, max_len=8, allow_unk=True)):
        together = cap.caption_batch(images, opts)
        for i, r in enumerate(together):
            assert r.alphas_heads.shape == (len(r.words), 2, *r.alphas.shape[1:])
            torch.testing.assert_close(r.alphas_heads.mean(1), r.alphas)
            torch.testing.assert_close(r.alphas_heads.sum((2, 3)), torch.ones(len(r.words), 2))
            alone = cap.caption_batch(images[i:i + 1], opts)[0]
            assert alone.words == r.words
            torch.testing.assert_close(alone.alphas_heads, r.alphas_heads, atol=1e-5, rtol=1e-4)
    spread = max(float((r.alphas_heads[:, 0] - r.alphas_heads[:, 1]).abs().max()) for r in together if r.words)
    assert spread > 1e-3  # the heads look at different places
    one = tiny_captioner(seed=5).caption_batch(images, DecodeOptions(beam_size=3, max_len=8))
    for r in one:
        assert r.alphas_heads.shape == (len(r.words), 1, *r.alphas.shape[1:])  # one head: its map
        assert torch.equal(r.alphas_heads[:, 0], r.alphas)


def test_greedy_and_beam_one_agree_on_the_head_maps():
    cap = tiny_captioner(seed=7, heads=2, attention="hard")
    ann = cap.model.encode(_images(5, seed=8))
    for hard in ("expected", "argmax"):
        g = greedy(cap.model.decoder, ann, cap.tokens, DecodeOptions(max_len=9, hard_attention=hard))
        b = beam_search(cap.model.decoder, ann, cap.tokens, DecodeOptions(beam_size=1, max_len=9, hard_attention=hard))
        for x, y in zip(g, b):
            assert x.ids == y.ids
            assert x.alphas_heads.shape == (len(x.ids), 2, 4)
            torch.testing.assert_close(x.alphas_heads, y.alphas_heads)


@pytest.mark.parametrize("beam", [1, 3])
def test_a_batch_reads_its_maps_back_to_the_host_once_not_per_image(beam, monkeypatch):
    """Each copy of a GPU tensor to the host (.cpu(), .item()) waits for the GPU: captioning a
    batch copies the maps back in one transfer per decode (beam search: per group of images
    finishing together), not three per image as it did. Counted here as calls, on the CPU."""
    from tests.tiny import tiny_captioner, tiny_image

    cap = tiny_captioner(seed=5)
    reads = {"n": 0}
    for name in ("cpu", "item"):
        real = getattr(torch.Tensor, name)

        def counted(self, *a, _real=real, **kw):
            reads["n"] += 1
            return _real(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, counted)
    options = DecodeOptions(beam_size=beam, max_len=5)
    counts = {}
    for n in (2, 16):
        images = torch.stack([cap.preprocess(tiny_image(seed=i)) for i in range(n)])
        reads["n"] = 0
        results = cap.caption_batch(images, options)
        counts[n] = reads["n"]
        assert len(results) == n and all(r.alphas.device.type == "cpu" for r in results)
    # Growing the batch by 14 images adds far fewer copies than images (three per image before).
    assert counts[16] - counts[2] < 14, counts


# --- the records ---------------------------------------------------------------------------
def test_an_alternative_is_a_frozen_record():
    """The N best travel from the search to the CLI, the API and the app: nobody may change one
    on the way, and equal ones are one (hashable)."""
    import dataclasses

    from captioner.search.decoding import Alternative

    a = Alternative(("a", "red", "circle"), -1.5, rank=-0.375)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.score = 0.0
    assert len({a, Alternative(("a", "red", "circle"), -1.5, rank=-0.375)}) == 1


def test_a_caption_s_json_rounds_scores_to_four_decimals_and_probabilities_to_four_digits():
    from captioner.search.decoding import Alternative, CaptionResult

    r = CaptionResult(["a", "circle"], torch.full((2, 1, 1), 1.0), torch.ones(2), -1.2345678,
                      word_probs=(0.123456789, 0.000123456), end_prob=0.98765,
                      alternatives=(Alternative(("a", "circle"), -1.2345678, rank=-0.41152),
                                    Alternative(("circle",), -2.3456789, rank=-1.17283945)))
    line = r.to_json()
    assert line["score"] == -1.2346
    assert line["word_probs"] == [0.1235, 0.0001235] and line["end_prob"] == 0.9877
    assert line["alternatives"][1] == {"caption": "circle", "score": -2.3457, "rank": -1.1728}


def test_greedy_is_done_at_the_step_where_every_caption_has_ended():
    table = [{A: 0.9, END: 0.1}, {END: 0.8, B: 0.2}] + [{A: 1.0}] * 6
    stub = _StepTable(table)
    ann, options = Annotations(torch.zeros(3, 4, 3), (2, 2)), DecodeOptions(beam_size=1, max_len=6)
    g = greedy(stub, ann, TOKENS, options)
    assert [x.ids for x in g] == [[A, END]] * 3 and _steps(stub, ann, options) == [2] * 3


@pytest.mark.parametrize("beam_size,num_captions", [(0, 1), (3, 0), (3, 4)])
def test_a_beam_size_below_1_and_a_number_of_captions_outside_1_to_k_are_refused(beam_size, num_captions):
    with pytest.raises(ValueError, match="beam_size" if beam_size < 1 else "num_captions"):
        DecodeOptions(beam_size=beam_size, max_len=2, num_captions=num_captions)
    assert DecodeOptions(beam_size=3, num_captions=3).num_captions == 3  # the edge: N = k


@pytest.mark.parametrize("penalty", [-0.5, float("nan"), float("inf")])
def test_a_negative_or_undefined_length_penalty_is_refused_not_taken_for_none(penalty):
    with pytest.raises(ValueError, match="length_penalty .*must be a number >= 0"):
        DecodeOptions(length_penalty=penalty)
    assert DecodeOptions(length_penalty=0.0).length_penalty == 0.0
