"""Greedy and batched beam search."""

import torch
import torch.nn.functional as F

from captioner.decoding import beam_search, greedy
from captioner.inference import Captioner, DecodeOptions
from tiny import tiny_captioner


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
    v = cap.vocab
    g = greedy(cap.model.decoder, ann, start=v.start, end=v.end, pad=v.pad, max_len=12)
    b = beam_search(cap.model.decoder, ann, start=v.start, end=v.end, pad=v.pad, beam_size=1, max_len=12)
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
    results = beam_search(cap.model.decoder, ann, start=v.start, end=v.end, pad=v.pad, beam_size=3, max_len=10)
    for i, r in enumerate(results):
        assert abs(r.score - _sequence_log_prob(cap, images[i], r.ids)) < 1e-3
        # The alpha of each step is the one the teacher-forced pass gives for that prefix.
        tokens = torch.tensor([[v.start] + r.ids])
        out = cap.model(images[i:i + 1], tokens, torch.tensor([len(r.ids) + 1]))
        torch.testing.assert_close(r.alphas, out.alphas[0], atol=1e-5, rtol=1e-4)


def test_beam_as_wide_as_the_vocabulary_finds_the_best_short_caption():
    """On a tiny space, enumerate every caption of at most two words: a beam of width V
    over two steps keeps every candidate that could win, so it must return the best."""
    cap = tiny_captioner(seed=7)
    images = _images(4, seed=8)
    ann = cap.model.encode(images)
    v = cap.vocab
    words = [v.unk] + list(range(4, len(v)))
    results = beam_search(cap.model.decoder, ann, start=v.start, end=v.end, pad=v.pad, beam_size=len(v), max_len=2)
    for i, r in enumerate(results):
        finished = [[v.end]] + [[w, v.end] for w in words]
        open_ = [[w1, w2] for w1 in words for w2 in words]
        best_finished = max(_sequence_log_prob(cap, images[i], c) for c in finished)
        best_open = max(_sequence_log_prob(cap, images[i], c) for c in open_)
        if r.ids[-1] == v.end:
            assert abs(r.score - best_finished) < 1e-4
        else:  # nothing ended within two words: the best open caption
            assert abs(r.score - best_open) < 1e-4


def test_no_end_token_within_the_limit_does_not_crash():
    cap = tiny_captioner(seed=2)
    with torch.no_grad():
        cap.model.decoder.L_o.bias[cap.vocab.end] = -1e4  # <end> never wins
    images = _images(3)
    for k in (1, 3):
        results = cap.caption_batch(images, DecodeOptions(beam_size=k, max_len=7))
        for r in results:
            assert len(r.words) == 7
            assert r.alphas.shape == (7, 2, 2)
            assert r.betas.shape == (7,)
            assert r.score < 0


def test_results_carry_one_map_per_word():
    cap = tiny_captioner(seed=0)
    for r in cap.caption_batch(_images(4), DecodeOptions(beam_size=3, max_len=9)):
        assert r.alphas.shape == (len(r.words), 2, 2)
        torch.testing.assert_close(r.alphas.sum((1, 2)), torch.ones(len(r.words)))
        assert "<end>" not in r.words and "<start>" not in r.words


def test_images_whose_beams_all_ended_leave_the_batch(tmp_path):
    from captioner.data.shapes import generate_dataset
    from captioner.images import load_image

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
    assert rows[0] == 6 * 3 and rows[-1] < rows[0]  # ... and the batch shrinks as they do
    assert rows == sorted(rows, reverse=True)
    for image, r in zip(images, together):  # leaving the batch changes no result
        alone = cap.caption(image, opts)
        assert alone.words == r.words and abs(alone.score - r.score) < 1e-4
        torch.testing.assert_close(alone.alphas, r.alphas, atol=1e-5, rtol=1e-4)
