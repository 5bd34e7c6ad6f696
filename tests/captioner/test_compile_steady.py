"""The compiled decoder reaches a steady state: a whole beam search (its batch shrinking as
images finish), a greedy decode and training steps of several batch sizes and lengths compile
a bounded number of graphs, never reach torch's recompilation limit, and a second model does
not take the first one's graphs or budget."""

from __future__ import annotations

import pytest
import torch

from captioner.search.decoding import beam_search, greedy
from captioner.search.options import DecodeOptions
from tests.tiny import tiny_captioner, tiny_image, token_batch

pytestmark = pytest.mark.slow  # torch.compile: seconds of tracing each

# One graph per kind of call: beam search, greedy (a beam of one row per image: another
# relation between the batch sizes of the annotations and the state), and training's recurrence.
# Autocast would add one per setting; none is used here.
GRAPHS_DECODING = 2
GRAPHS_TRAINING = 1
# Graphs and recompilations are dynamo's: the backend that runs a graph neither adds nor
# removes any, so the counting tests use the one that does least ("eager"); the captions test
# goes through AOTAutograd's tracing too ("aot_eager"), as inductor does.
COUNTING_BACKEND = "eager"


@pytest.fixture
def counters():
    """dynamo's counters, with its caches and counts reset; imported when a test asks, not when
    the suite is collected (dynamo's import takes seconds)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    return counters


def _graphs(counters) -> int:
    return int(counters["stats"]["unique_graphs"])


def _images(cap, n: int) -> torch.Tensor:
    return torch.stack([cap.preprocess(tiny_image(seed=i)) for i in range(n)])


def _decode_everything(cap) -> None:
    dec = cap.model.decoder
    with torch.no_grad():
        for n in (7, 3, 7):  # other batch sizes, and the first size again
            ann = cap.model.encode(_images(cap, n))
            beam_search(dec, ann, cap.tokens, DecodeOptions(beam_size=3, max_len=12))
            greedy(dec, ann, cap.tokens, DecodeOptions(max_len=12))


def _train_steps(cap, steps: int = 5) -> None:
    model = cap.model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    captions = ["a red circle", "a small blue square and a star", "a large green star", "a circle",
                "a red square and a small blue circle", "a star"]
    for step in range(steps):
        batch = captions[: 3 + step % 4]  # 3 to 6 captions, of other lengths each step
        tokens, lengths = token_batch(cap.vocab, batch)
        out = model(_images(cap, len(batch)), tokens, lengths)
        out.logits[out.mask].logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    model.eval()


def test_beam_greedy_and_training_compile_a_bounded_number_of_graphs(caplog, counters):
    cap = tiny_captioner(seed=3)
    cap.model.decoder.compile_step(backend=COUNTING_BACKEND)
    _decode_everything(cap)
    decoding = _graphs(counters)
    _decode_everything(cap)  # steady: nothing new the second time
    assert _graphs(counters) == decoding <= GRAPHS_DECODING, (decoding, dict(counters["recompiles"]))
    _train_steps(cap)
    assert _graphs(counters) - decoding <= GRAPHS_TRAINING, dict(counters["stats"])
    assert "recompile_limit" not in caplog.text and "cache_size_limit" not in caplog.text


def test_each_model_compiles_its_own_graphs(counters):
    """Two models (the same code) each get their own compiled functions: the second one's
    recompilations come out of its own budget, not the first one's."""
    first, second = tiny_captioner(seed=1), tiny_captioner(seed=2, hidden_dim=20)
    for cap in (first, second):
        cap.model.decoder.compile_step(backend=COUNTING_BACKEND)
    assert first.model.decoder._compiled_step is not second.model.decoder._compiled_step
    one, two = (cap.model.decoder._compiled_step._torchdynamo_orig_callable.__code__ for cap in (first, second))
    assert one is not two  # a code object each: the compiler's cache and limit are per code object
    for cap in (first, second, first):
        _decode_everything(cap)
    assert _graphs(counters) <= 2 * GRAPHS_DECODING


def test_compiled_decoding_gives_the_eager_captions():
    eager, compiled = tiny_captioner(seed=4), tiny_captioner(seed=4)
    compiled.model.decoder.compile_step(backend="aot_eager")
    with torch.no_grad():
        imgs = _images(eager, 6)
        for fn, options in ((beam_search, DecodeOptions(beam_size=3, max_len=10)),
                            (greedy, DecodeOptions(max_len=10))):
            a = fn(eager.model.decoder, eager.model.encode(imgs), eager.tokens, options)
            b = fn(compiled.model.decoder, compiled.model.encode(imgs), compiled.tokens, options)
            assert [x.ids for x in a] == [x.ids for x in b]
            for x, y in zip(a, b):
                torch.testing.assert_close(x.alphas, y.alphas, atol=1e-5, rtol=1e-4)
