"""The beam search's fixed program and its CUDA graphs (captioner/search/graph.py), held to the
plain search on a CPU.

A CPU cannot capture a CUDA graph, so the capture is replaced here by one with a graph's
contract run eagerly: the tensors the captured run returned are the ones every replay writes,
and a replay reads its input from the tensor it was captured with. What is tested is everything
around the graph: the fixed program (the plain search's captions, no host waits), the padding
of a batch into a graph's input, one graph per shape, the limit, a failed capture, and when the
plain search runs instead. The GPU check (benchmarks/gpu_check.py) runs the real capture."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from captioner.model import kernels
from captioner.model.encoders import Annotations
from captioner.onnx import search as npsearch
from captioner.search import decoding
from captioner.search import graph as search_graph
from captioner.search.decoding import DecodedIds, beam_search
from captioner.search.graph import SearchGraphs, search_form
from captioner.search.options import DecodeOptions, OptionError, Tokens
from tests.builders import torch_step
from tests.captioner.test_decoding import (
    END,
    MULTI_HEAD,
    PAD,
    START,
    TOKENS,
    A,
    _images,
    _random_decoder,
    _reference_search,
    _StepTable,
)
from tests.cuda_standin import stand_in_cuda
from tests.tiny import tiny_captioner


def _same(plain: list[DecodedIds], fixed: list[DecodedIds], exact: bool = True) -> None:
    """The same captions, runners-up included, with the same scores, maps, gates and token log p."""
    assert len(plain) == len(fixed)
    for i, (x, y) in enumerate(zip(plain, fixed)):
        for p, f in [(x, y), *zip(x.runners_up, y.runners_up, strict=True)]:
            assert p.ids == f.ids, i
            if exact:
                assert p.score == f.score
                for a, b in ((p.alphas_heads, f.alphas_heads), (p.betas, f.betas), (p.log_probs, f.log_probs)):
                    assert torch.equal(a, b), i
            else:
                assert abs(p.score - f.score) < 1e-5
                torch.testing.assert_close(p.alphas_heads, f.alphas_heads, atol=1e-6, rtol=1e-5)


def _plain(decoder, a: torch.Tensor, tokens: Tokens, options: DecodeOptions) -> list:
    """The plain search, where each image leaves the batch when it is done: the numpy port's (the
    torch-free runtime's search), fed by ``decoder``'s step."""
    with torch.no_grad():
        keys = decoder.attention.prepare(a)
        h, c = decoder.init_state(a)
    step = torch_step(decoder, (2, 2))
    return npsearch.beam_search(step, a.numpy(), keys.numpy(), h.numpy(), c.numpy(), tokens, options)


def _same_as_plain(searched: list[DecodedIds], plain: list) -> None:
    """The same captions and runners-up as the plain search, with its scores and maps."""
    assert len(searched) == len(plain)
    for i, (x, y) in enumerate(zip(searched, plain)):
        for p, q in [(x, y), *zip(x.runners_up, y.runners_up, strict=True)]:
            assert p.ids == q.ids, i
            assert abs(p.score - q.score) < 1e-5
            np.testing.assert_allclose(p.alphas_heads.numpy(), q.heads, atol=1e-6)
            np.testing.assert_allclose(p.log_probs.numpy(), q.log_probs, atol=1e-5)


@pytest.mark.slow
def test_the_search_returns_the_plain_search_s_captions_on_random_tiny_models():
    """1,000 images over 200 random decoders (vocabulary 6, k 2-4, max_len 4-8, some with a
    length penalty, 1 to k captions asked for): images done at different steps, images cut off
    at the limit, and their runners-up, all as the plain search returns them."""
    early = 0
    for seed in range(200):
        decoder = _random_decoder(seed)
        k, max_len = 2 + seed % 3, 4 + seed % 5
        o = DecodeOptions(beam_size=k, max_len=max_len, length_penalty=0.7 if seed % 5 == 3 else 0.0,
                          num_captions=1 + seed % k)
        a = torch.randn(5, 4, 5, dtype=torch.float64)
        searched = beam_search(decoder, Annotations(a, (2, 2)), TOKENS, o)
        _same_as_plain(searched, _plain(decoder, a, TOKENS, o))
        early += sum(len(r.ids) < max_len + 1 for r in searched)
    assert early > 500  # most images were done before the last step: their pools were frozen


@pytest.mark.slow  # many random tiny models, each searched: seconds
def test_the_search_knows_the_step_at_which_the_plain_search_lets_each_image_go():
    """done_at: for each image, the step after which the plain search (the reference of
    test_decoding), given that image alone, runs no more, with and without a length penalty."""
    checked = 0
    for seed in range(40):
        decoder = _random_decoder(seed)
        k, max_len, penalty = 2 + seed % 3, 4 + seed % 5, (0.7 if seed % 2 else 0.0)
        a = torch.randn(4, 4, 5, dtype=torch.float64)
        o = DecodeOptions(beam_size=k, max_len=max_len, length_penalty=penalty)
        with torch.no_grad():
            done_at = decoding.search(decoder, a, (2, 2), TOKENS, o).done_at.tolist()
        for i in range(4):
            *_, steps = _reference_search(decoder, a[i:i + 1], (2, 2), k=k, max_len=max_len, length_penalty=penalty)
            assert done_at[i] == steps - 1, (seed, i)
            checked += done_at[i] < max_len
    assert checked > 60  # most were let go before the limit


def test_captions_cut_off_at_the_limit_are_the_plain_search_s():
    """A decoder whose <end> never comes: every caption is its best open beam, cut off at max_len
    words, read from the open beams of the step before the last (the last step only ends)."""
    for seed in range(12):
        decoder = _random_decoder(seed)
        with torch.no_grad():
            decoder.L_o.bias[END] = float("-inf")
        a = torch.randn(3, 4, 5, dtype=torch.float64)
        o = DecodeOptions(beam_size=2 + seed % 3, max_len=3 + seed % 4)
        searched = beam_search(decoder, Annotations(a, (2, 2)), TOKENS, o)
        assert all(len(r.ids) == o.max_len and END not in r.ids for r in searched)
        _same_as_plain(searched, _plain(decoder, a, TOKENS, o))


@pytest.mark.parametrize("variant", MULTI_HEAD, ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()))
def test_the_search_follows_the_plain_search_with_several_heads(variant):
    for seed in range(6):
        decoder = _random_decoder(seed, **variant)
        a = torch.randn(4, 4, 5, dtype=torch.float64)
        o = DecodeOptions(beam_size=2 + seed % 3, max_len=4 + seed % 3)
        _same_as_plain(beam_search(decoder, Annotations(a, (2, 2)), TOKENS, o), _plain(decoder, a, TOKENS, o))


def test_stopping_at_the_step_every_image_is_done_changes_nothing():
    """The eager search stops once every image is done; the program a graph records runs every
    step: the same captions, runners-up, scores, maps and gates, to the bit."""
    stopped = 0
    for seed in range(40):
        decoder = _random_decoder(seed)
        o = DecodeOptions(beam_size=2 + seed % 3, max_len=6 + seed % 4, num_captions=1 + seed % 2,
                          length_penalty=0.7 if seed % 3 == 1 else 0.0)
        a = torch.randn(4, 4, 5, dtype=torch.float64)
        with torch.no_grad():
            early = decoding.search(decoder, a, (2, 2), TOKENS, o)
            full = decoding.search(decoder, a, (2, 2), TOKENS, o, compact=False)
        _same(early.captions(4), full.captions(4))
        stopped += int(early.done_at.max()) < o.max_len
    assert stopped > 20  # most batches were done before the limit


def test_an_image_s_pool_is_frozen_from_the_step_it_is_done():
    """No later ending can outrank a done image's best, but one can tie with it, and a GPU's
    topk puts ties in no fixed order: a later "A <end>" could then take the place of the
    "<end>" the plain search returned. So nothing joins a done image's pool. Here "<end>" and
    "A" have p 0.5 at step 0, and "A <end>" has p 0.5 too: the image is done at step 0."""
    table = _StepTable([{END: 0.5, A: 0.5}, {END: 1.0}, {END: 1.0}, {END: 1.0}])
    ann = Annotations(torch.zeros(1, 4, 3), (2, 2))
    kw = (Tokens(start=START, end=END, pad=PAD), DecodeOptions(beam_size=3, max_len=3))
    assert beam_search(table, ann, *kw)[0].ids == [END]
    searched = decoding.search(table, ann.vectors, ann.grid, *kw)
    assert searched.pool.rank[0, 0] == torch.log(torch.tensor(0.5))
    assert searched.pool.rank[0, 1:].isneginf().all()  # "A <end>" (step 1) did not join
    assert searched.captions(1)[0].ids == [END]


VARIANTS = [{}, {"local_window": 1.5}, {"local_window": 1.5, "local_width": "learned"}, {"coords": True},
            {"grid_layers": 1, "grid_heads": 2}, {"heads": 2, "local_window": 1.5}, {"attention": "hard"}]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()) or "soft")
def test_the_search_never_waits_for_the_device_nor_copies_from_the_host(monkeypatch, variant):
    """Every conversion of a tensor to a Python value (a host wait on a GPU) and every tensor made
    from host data or moved between devices (a copy no CUDA graph may hold) fails inside the
    search's program, for each kind of attention and annotation; reading its captions back, once
    at the end, is the first wait."""
    cap = tiny_captioner(seed=2, **variant)
    ann = cap.model.encode(_images(3))
    opts = DecodeOptions(beam_size=3, max_len=6, length_penalty=0.5, num_captions=2)

    def no_wait(*_, **__):
        raise AssertionError("a host wait in the beam search")

    def no_copy(*_, **__):
        raise AssertionError("a tensor copied from the host in the beam search")

    real_to = torch.Tensor.to

    def to(self, *args, **kw):
        if "device" in kw or any(isinstance(x, (torch.device, str)) for x in args):
            no_copy()
        return real_to(self, *args, **kw)

    for name in ("item", "__bool__", "__int__", "__float__", "__index__", "tolist", "nonzero", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, no_wait)
    monkeypatch.setattr(torch, "nonzero", no_wait)
    monkeypatch.setattr(torch.Tensor, "to", to)
    for name in ("tensor", "as_tensor", "from_numpy"):
        monkeypatch.setattr(torch, name, no_copy)
    with torch.no_grad():
        searched = decoding.search(cap.model.decoder, ann.vectors, ann.grid, cap.tokens, opts, compact=False)
        with pytest.raises(AssertionError, match="host wait"):
            beam_search(cap.model.decoder, ann, cap.tokens, DecodeOptions(beam_size=3, max_len=6))
    monkeypatch.undo()
    got = searched.captions(3)
    plain = beam_search(cap.model.decoder, ann, cap.tokens, opts)
    _same(plain, got, exact=False)


def eager_capture(run, pool):
    """A graph's contract without CUDA: the captured run's tensors are the ones each replay writes."""
    searched = run()

    def replay():
        for mine, theirs in zip(searched.tensors(), run().tensors(), strict=True):
            mine.copy_(theirs)
    return replay, searched, ("pool", pool)


class Counted:
    """eager_capture, counting its captures."""

    def __init__(self, fail: bool = False):
        self.captures, self.fail = 0, fail

    def __call__(self, run, pool):
        self.captures += 1
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing\nmore lines")
        return eager_capture(run, pool)


def _graphed(monkeypatch, capture) -> list:
    """Captioner.caption_batch takes the graphed search on this CPU, through ``capture``. Returns
    what each run of the fixed program saw of autocast: (on, its type, its cache on)."""
    monkeypatch.setattr("captioner.inference.search_form", lambda *a: "graphed")
    monkeypatch.setattr(search_graph, "CAPTURE", capture)
    seen, search = [], search_graph.search

    def watched(*args, **kw):
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
                     torch.is_autocast_cache_enabled()))
        return search(*args, **kw)
    monkeypatch.setattr(search_graph, "search", watched)
    return seen


def _results(cap, images, options):
    return [(r.words, r.score, r.alphas, [(a.words, a.score) for a in r.alternatives])
            for r in cap.caption_batch(images, options)]


def test_captioning_through_graphs_gives_the_plain_captions_batch_after_batch(monkeypatch):
    """Batches of 3, 8, 5 and 11 images: one graph for the first three (padded to 8; the 5 after
    the 8 meet rows an earlier batch left), one for the 11 (padded to 16), one for other options;
    each batch's captions those of the plain search."""
    cap = tiny_captioner(seed=4)
    options = DecodeOptions(beam_size=3, max_len=7, num_captions=2)
    batches = [_images(n, seed=n) for n in (3, 8, 5, 11)]
    plain = [_results(cap, images, options) for images in batches]
    other = DecodeOptions(beam_size=2, max_len=5, length_penalty=0.6)
    plain_other = _results(cap, batches[0], other)
    capture = Counted()
    seen = _graphed(monkeypatch, capture)
    for images, expected in zip(batches, plain):
        got = _results(cap, images, options)
        assert [g[0] for g in got] == [e[0] for e in expected]
        for g, e in zip(got, expected):
            assert abs(g[1] - e[1]) < 1e-5 and torch.allclose(g[2], e[2], atol=1e-6)
            assert [w for w, _ in g[3]] == [w for w, _ in e[3]]
    assert capture.captures == 2 and sorted(k[0] for k in cap._search_graphs.graphs) == [8, 16]
    assert [r[0] for r in _results(cap, batches[0], other)] == [r[0] for r in plain_other]
    assert capture.captures == 3
    assert seen and all(not cache for _, _, cache in seen)  # a graph computes its own casts


def test_beyond_the_graph_limit_and_after_a_failed_capture_the_fixed_program_runs_without_a_graph(monkeypatch):
    cap = tiny_captioner(seed=6)
    options = DecodeOptions(beam_size=3, max_len=6)
    small, large = _images(2, seed=1), _images(12, seed=2)
    expected = [_results(cap, small, options), _results(cap, large, options)]
    capture = Counted()
    graphs = SearchGraphs(cap.model.decoder, capture=capture, max_graphs=1)
    kw = (cap.tokens, DecodeOptions(beam_size=3, max_len=6))
    for images, want in zip((small, large, small), (*expected, expected[0])):
        ann = cap.model.encode(images)
        got = graphs.search(ann, *kw)
        assert [cap.vocab.decode(d.ids) for d in got] == [w[0] for w in want]
    assert capture.captures == 1 and len(graphs.graphs) == 1
    assert not any(d.runners_up for d in got)  # one caption an image unless more are asked for

    failing = Counted(fail=True)
    graphs = SearchGraphs(cap.model.decoder, capture=failing)
    with pytest.warns(RuntimeWarning, match="could not be recorded as a CUDA graph .RuntimeError: operation not "
                                            "permitted when stream is capturing.; it runs without one") as said:
        got = graphs.search(cap.model.encode(small), *kw)
    assert said[0].filename == __file__  # the warning points at the caller's line
    assert [cap.vocab.decode(d.ids) for d in got] == [w[0] for w in expected[0]]
    got = graphs.search(cap.model.encode(large), *kw)  # no second try, no second warning
    assert [cap.vocab.decode(d.ids) for d in got] == [w[0] for w in expected[1]]
    assert failing.captures == 1 and graphs.graphs == {} and graphs.failed.startswith("RuntimeError")


def test_a_graph_recorded_under_autocast_casts_for_itself_in_the_caller_s_type(monkeypatch):
    """Autocast keeps the weights it cast until the caller's autocast ends; a graph holding those
    casts would read freed memory at its next replay. So the captured run autocasts in the
    caller's type with the cache off."""
    cap = tiny_captioner(seed=8).use_precision("bf16")
    options = DecodeOptions(beam_size=2, max_len=5)
    images = _images(4, seed=3)
    plain = _results(cap, images, options)
    seen = _graphed(monkeypatch, Counted())
    got = _results(cap, images, options)
    assert seen and all(a == (True, torch.bfloat16, False) for a in seen)
    assert [g[0] for g in got] == [p[0] for p in plain]


def test_the_cuda_capture_warms_up_on_a_side_stream_then_records_one_run(monkeypatch):
    events = stand_in_cuda(monkeypatch)

    def run():
        events.append("run")
        return "searched"

    replay, searched, pool = search_graph.cuda_capture(run, "old pool")
    assert events == [("wait", "side", "main"), ("on", "side"), "run", ("off", "side"), ("wait", "main", "side"),
                      ("record", "old pool", "thread_local"), "run", "recorded"]
    assert searched == "searched" and pool == "new pool"
    replay()
    assert events[-1] == "replay"


def test_the_graphed_search_is_taken_on_a_gpu_for_a_deterministic_uncompiled_search_with_the_kernels_on():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert search_form(cuda, "expected", compiled=False) == "graphed"
    assert search_form(cuda, "argmax", compiled=False) == "graphed"
    assert search_form(cpu, "expected", compiled=False) == "plain"
    assert search_form(cuda, "sample", compiled=False) == "plain"
    assert search_form(cuda, "expected", compiled=True) == "plain"
    before = kernels.set_enabled(False)
    try:
        assert search_form(cuda, "expected", compiled=False) == "plain"
    finally:
        kernels.set_enabled(before)


def test_a_captioner_on_a_cpu_runs_the_plain_search():
    cap = tiny_captioner(seed=1)
    cap.caption_batch(_images(2), DecodeOptions(beam_size=2, max_len=4))
    assert cap._search_graphs is None


@pytest.mark.parametrize("bad, match", [(dict(beam_size=0), "beam_size"), (dict(num_captions=4), "num_captions"),
                                        (dict(length_penalty=float("nan")), "length_penalty"),
                                        (dict(max_len=0), "max_len"), (dict(hard_attention="mean"), "hard_attention")])
def test_what_no_search_can_take_is_refused_where_the_options_are_made(bad, match):
    """The searches take DecodeOptions and trust them: a bad option never reaches one."""
    with pytest.raises(OptionError, match=match):
        DecodeOptions(**{"beam_size": 3, "max_len": 4, **bad})


@pytest.mark.parametrize("first_inference_mode", [True, False])
def test_a_graph_recorded_in_inference_mode_serves_calls_outside_it_and_back(first_inference_mode):
    """A tensor made in inference mode can never be written outside it: a graph's input and
    outputs are made outside, whatever mode the call that records it runs in."""
    cap = tiny_captioner(seed=9)
    kw = (cap.tokens, DecodeOptions(beam_size=2, max_len=5))
    graphs = SearchGraphs(cap.model.decoder, capture=eager_capture)
    want = [d.ids for d in beam_search(cap.model.decoder, cap.model.encode(_images(3)), *kw)]
    for mode in (first_inference_mode, not first_inference_mode, first_inference_mode):
        with torch.inference_mode(mode):
            got = graphs.search(cap.model.encode(_images(3)), *kw)
        assert [d.ids for d in got] == want
    assert len(graphs.graphs) == 1


def test_on_a_gpu_greedy_decoding_runs_as_a_graphed_search_of_width_one(monkeypatch):
    """Greedy asks the device after every word whether all captions have ended; where the graphed
    search is taken, beam 1 runs through it instead, with greedy's captions."""
    cap = tiny_captioner(seed=11)
    images = _images(6, seed=4)
    options = DecodeOptions(beam_size=1, max_len=6)
    plain = _results(cap, images, options)
    capture = Counted()
    _graphed(monkeypatch, capture)
    got = _results(cap, images, options)
    assert capture.captures == 1
    assert [g[0] for g in got] == [p[0] for p in plain]
    assert all(abs(g[1] - p[1]) < 1e-5 for g, p in zip(got, plain))


def test_searches_from_several_threads_take_turns_at_a_graph():
    """The app captions from several threads with one captioner; a graph's input and outputs are
    one set of tensors, so two replays at once would mix their batches. Two threads started
    together: their replays never overlap, and each gets its own images' captions."""
    import threading
    import time

    decoder = _random_decoder(0)  # whose captions differ between the two batches
    kw = (Tokens(start=START, end=END, pad=PAD), DecodeOptions(beam_size=2, max_len=6))
    inside, most = [0], [0]

    def slow_capture(run, pool):
        replay, searched, pool = eager_capture(run, pool)

        def watched():
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            time.sleep(0.05)
            replay()
            inside[0] -= 1
        return watched, searched, pool

    graphs = SearchGraphs(decoder, capture=slow_capture)
    batches = [Annotations(torch.randn(4, 4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(s)),
                           (2, 2)) for s in (20, 21)]
    want = [[d.ids for d in beam_search(decoder, ann, *kw)] for ann in batches]
    assert want[0] != want[1]
    graphs.search(batches[0], *kw)  # recorded before the race
    got, start = [None, None], threading.Barrier(2)

    def caption(i):
        start.wait()
        got[i] = [d.ids for d in graphs.search(batches[i], *kw)]

    threads = [threading.Thread(target=caption, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1 and got == want


def test_annotations_of_another_grid_get_a_graph_of_their_own():
    decoder = _random_decoder(0)
    kw = (Tokens(start=START, end=END, pad=PAD), DecodeOptions(beam_size=2, max_len=5))
    graphs = SearchGraphs(decoder, capture=eager_capture)
    for cells, grid in ((4, (2, 2)), (9, (3, 3)), (4, (2, 2))):
        ann = Annotations(torch.randn(3, cells, 5, dtype=torch.float64), grid)
        _same(beam_search(decoder, ann, *kw), graphs.search(ann, *kw), exact=False)
    assert len(graphs.graphs) == 2
