"""compare_tutorial --graphs: its check of the graphed step against the plain one, run on a CPU
with a stand-in capture that keeps a graph's contract (tests/train/test_graphed.py), passes when
the two agree and fails when a replay computes something else."""

from __future__ import annotations

import pytest
import torch

from benchmarks import compare_tutorial as ct
from captioner.model.decoder import ModelConfig
from tests.train.test_graphed import eager_capture

CFG = ModelConfig(vocab_size=50, annotation_dim=16, embed_dim=8, hidden_dim=8, attention_dim=8, dropout=0.5)


def _inputs():
    torch.manual_seed(0)
    a = torch.randn(3, ct.L, 16)
    tokens = torch.randint(4, 50, (3, 10))
    tokens[:, 0] = ct.START
    return a, tokens, torch.full((3,), 10)


def test_the_graphed_step_agrees_with_the_plain_one(monkeypatch):
    monkeypatch.setattr(ct, "CAPTURE", eager_capture)
    line, same = ct.graphs_check(CFG, torch.device("cpu"), *_inputs())
    assert same and "2 graphs" in line and "within 1e-04" in line


def test_a_replay_that_computes_something_else_is_caught(monkeypatch):
    def slightly_off(run, params, pool):
        replay, parts, pool = eager_capture(run, params, pool)
        grads = [p.grad for p in params]  # the graph's own, which each replay writes

        def wrong():
            replay()
            for g in grads:
                if g is not None:
                    g.mul_(1.001)  # gradients 0.1% off
        return wrong, parts, pool

    monkeypatch.setattr(ct, "CAPTURE", slightly_off)
    line, same = ct.graphs_check(CFG, torch.device("cpu"), *_inputs())
    assert not same and "BEYOND" in line


def test_a_gradient_zero_in_exact_arithmetic_is_measured_against_the_others():
    # attention's v.bias shifts every score alike, and the softmax ignores a shift: its gradient
    # is rounding noise (on a GPU, 1e-9 against the others' 1e-2), and two noises differ by 100%
    want = [torch.tensor([0.02, -0.01]), torch.tensor([1e-9])]
    assert ct.gradient_gap([torch.tensor([0.02, -0.01]), torch.tensor([-2e-9])], want) < ct.GRAPH_TOLERANCE
    # a gradient that is not noise is still measured against its own size
    assert ct.gradient_gap([torch.tensor([0.02, -0.01]), torch.tensor([1e-3])], want) > 1e-2
    gap = ct.gradient_gap([torch.tensor([0.02002, -0.01]), torch.tensor([1e-9])], want)
    assert gap == pytest.approx(1e-3, rel=1e-3)


def test_the_timed_graphed_step_trains(monkeypatch):
    monkeypatch.setattr(ct, "CAPTURE", eager_capture)
    a, tokens, lengths = _inputs()
    dec = ct.Decoder(CFG)
    before = [p.detach().clone() for p in dec.parameters()]
    run = ct.graphed_step(dec, torch.optim.Adam(dec.parameters(), lr=1e-2), a, tokens, lengths)
    run()
    run()
    assert any(not torch.equal(b, p) for b, p in zip(before, dec.parameters()))


def test_the_graphed_search_is_timed_only_when_it_gives_the_plain_search_s_captions(monkeypatch):
    from captioner.search import graph as search_graph
    from tests.captioner.test_search_graph import eager_capture as eager_search_capture

    torch.manual_seed(1)
    dec = ct.Decoder(CFG).eval()
    a = torch.randn(5, ct.L, 16)
    monkeypatch.setattr(search_graph, "CAPTURE", eager_search_capture)
    same, run = ct.search_graphs_check(dec, a, 6, torch.device("cpu"))
    assert same and len(run()) == 5

    def other_words(run_, pool):  # a replay that writes other words than the search chose
        replay, searched, pool = eager_search_capture(run_, pool)

        def wrong():
            replay()
            searched.trace.words.add_(1).remainder_(CFG.vocab_size)
        return wrong, searched, pool

    monkeypatch.setattr(search_graph, "CAPTURE", other_words)
    same, _ = ct.search_graphs_check(dec, a, 6, torch.device("cpu"))
    assert not same
