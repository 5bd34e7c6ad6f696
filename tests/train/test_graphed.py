"""The training step as CUDA graphs (train/graphed.py), held to the plain step on a CPU.

A CPU cannot capture a CUDA graph, so the capture is replaced here by one with a graph's
contract run eagerly: the captured pass's output and gradient tensors are the ones every
replay writes, and a replay reads the inputs from the tensors it was captured with. What is
tested is everything around the graph: the fixed-step forward it records (no host waits, the
plain loss and gradients), the padding and copying of each batch into the graph's inputs, one
graph per shape, the gradients handed to the parameters, and when the plain step runs instead.
The GPU check (benchmarks/gpu_check.py) runs the real capture against the plain step."""

from __future__ import annotations

import pytest
import torch

from captioner.model import kernels
from captioner.model.encoders import Annotations
from captioner.train import graphed
from captioner.train.graphed import GraphCaptureError, GraphedSoftStep, graphs_apply, padded_steps
from captioner.train.losses import LossParts, soft_loss
from tests.cuda_standin import stand_in_cuda
from tests.tiny import tiny_captioner, tiny_image, token_batch

CAPTIONS = ["a red circle", "a small blue square and a star", "a green star", "a large red square"]


def eager_capture(run, params, pool):
    """A graph's contract without CUDA: the captured pass's tensors are those each replay writes."""
    parts = run()
    grads = [p.grad for p in params]

    def replay():
        for p in params:
            p.grad = None
        new = run()
        for mine, theirs in zip((parts.loss, parts.nll, parts.penalty, parts.tokens),
                                (new.loss, new.nll, new.penalty, new.tokens)):
            mine.detach().copy_(theirs.detach())
        for g, p in zip(grads, params):
            if g is not None:
                g.copy_(p.grad)
    return replay, parts, ("pool", pool)


def _batch(cap, captions, seed=0):
    tokens, lengths = token_batch(cap.vocab, captions)
    images = torch.stack([cap.preprocess(tiny_image(seed=seed + i)) for i in range(len(captions))])
    return images, tokens, lengths


def _plain_grads(model, images, tokens, lengths, **kw):
    model.zero_grad(set_to_none=True)
    parts = soft_loss(model, images, tokens, lengths, 1.0, **kw)
    parts.loss.backward()
    return parts, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _graphed(model, **kw):
    params = [p for p in model.parameters() if p.requires_grad]

    def loss(inputs, tokens, lengths, steps):
        return soft_loss(model, inputs, tokens, lengths, 1.0, steps=steps)
    return GraphedSoftStep(loss, params, _no_autocast, capture=eager_capture, **kw)


def _no_autocast():
    return torch.autocast("cpu", enabled=False)


def test_padded_steps_round_up_to_the_bucket():
    assert [padded_steps(n) for n in (1, 3, 4, 5, 8, 9)] == [4, 4, 4, 8, 8, 12]
    assert padded_steps(5, bucket=1) == 5
    with pytest.raises(ValueError):
        padded_steps(0)


@pytest.mark.parametrize("attention", ["soft", "mean"])
def test_fixed_steps_give_the_plain_loss_and_gradients(attention):
    cap = tiny_captioner(seed=1, attention=attention)
    model = cap.model.train()
    images, tokens, lengths = _batch(cap, CAPTIONS)
    steps = int(lengths.max()) - 1
    padded = torch.cat([tokens, torch.zeros(len(CAPTIONS), 5, dtype=tokens.dtype)], 1)  # 5 more steps
    plain, g_plain = _plain_grads(model, images, tokens, lengths)
    fixed, g_fixed = _plain_grads(model, images, padded, lengths, steps=steps + 5)
    assert torch.allclose(fixed.loss, plain.loss, atol=1e-6)
    assert torch.equal(fixed.tokens, plain.tokens)
    assert g_plain.keys() == g_fixed.keys()
    for name in g_plain:
        assert torch.allclose(g_fixed[name], g_plain[name], atol=1e-6), name
    out_plain = model(images, tokens, lengths)
    out_fixed = model(images, padded, lengths, steps=steps + 5)
    assert out_fixed.logits.shape[1] == steps + 5 and out_fixed.mask[:, steps:].sum() == 0
    mask = out_plain.mask
    assert torch.allclose(out_fixed.logits[:, :steps][mask], out_plain.logits[mask], atol=1e-5)
    assert torch.allclose(out_fixed.alphas[:, :steps][mask], out_plain.alphas[mask], atol=1e-6)


def test_the_fixed_step_forward_and_backward_never_wait_for_the_device(monkeypatch):
    cap = tiny_captioner(seed=2)
    images, tokens, lengths = _batch(cap, CAPTIONS)

    def no_wait(*_):
        raise AssertionError("a host synchronisation in the graphed forward or backward")

    tokens = torch.cat([tokens, torch.zeros(len(CAPTIONS), 12 + 1 - tokens.shape[1], dtype=tokens.dtype)], 1)
    with pytest.raises(ValueError, match="13 columns"):
        soft_loss(cap.model.train(), images, tokens[:, :12], lengths, 1.0, steps=12)
    for name in ("item", "__bool__", "__int__", "__index__", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, no_wait)
    parts = soft_loss(cap.model.train(), images, tokens, lengths, 1.0, steps=12)
    parts.loss.backward()
    monkeypatch.undo()
    with pytest.raises(AssertionError, match="host synchronisation"):  # the plain form does wait
        monkeypatch.setattr(torch.Tensor, "__int__", no_wait)
        soft_loss(cap.model.train(), images, tokens, lengths, 1.0)


def test_graphed_steps_give_the_plain_steps_gradients_shape_after_shape():
    cap = tiny_captioner(seed=3)
    model = cap.model.train()
    step = _graphed(model)
    batches = [CAPTIONS, CAPTIONS[::-1], ["a red circle", "a star"], ["a small blue square and a star"] * 4,
               ["a green star", "a red circle"], ["a star", "a red star", "a circle", "a square"]]
    for i, captions in enumerate(batches):
        images, tokens, lengths = _batch(cap, captions, seed=10 * i)
        plain, g_plain = _plain_grads(model, images, tokens, lengths)
        model.zero_grad(set_to_none=True)
        parts = step.step(images, tokens, lengths)
        assert isinstance(parts, LossParts)
        assert torch.allclose(parts.loss, plain.loss, atol=1e-6) and torch.allclose(parts.nll, plain.nll, atol=1e-6)
        assert torch.allclose(parts.penalty, plain.penalty, atol=1e-6) and torch.equal(parts.tokens, plain.tokens)
        for name, p in model.named_parameters():
            assert torch.allclose(p.grad, g_plain[name], atol=1e-6), (i, name)
    # one graph per (batch size, padded length): 4 x 8 steps (three batches), 2 x 4 (two), 4 x 4
    assert sorted(step.graphs) == [(2, 4), (4, 4), (4, 8)]


def test_the_figures_handed_out_are_copies_the_next_replay_leaves_alone():
    cap = tiny_captioner(seed=4)
    step = _graphed(cap.model.train())
    images, tokens, lengths = _batch(cap, CAPTIONS)
    first = step.step(images, tokens, lengths)
    kept = first.nll.clone()
    images2, tokens2, lengths2 = _batch(cap, CAPTIONS[::-1], seed=7)
    second = step.step(images2, tokens2, lengths2)
    assert len(step.graphs) == 1
    assert torch.equal(first.nll, kept) and not torch.equal(second.nll, kept)
    assert not first.loss.requires_grad


def test_each_graph_gives_the_parameters_its_own_gradients():
    cap = tiny_captioner(seed=5)
    model = cap.model.train()
    step = _graphed(model)
    short = _batch(cap, ["a red circle", "a star"])
    long = _batch(cap, ["a small blue square and a star", "a large red square and a green star"])
    step.step(*short)
    short_grads = [p.grad for p in step.params]
    step.step(*long)
    assert sorted(step.graphs) == [(2, 4), (2, 12)]  # 4 and 9 steps
    assert all(p.grad is g for p, g in zip(step.params, step.graphs[(2, 12)].grads))
    assert not any(p.grad is g for p, g in zip(step.params, short_grads))
    step.step(*short)
    assert all(p.grad is g for p, g in zip(step.params, short_grads))


def test_annotations_from_a_feature_cache_are_copied_into_the_graph():
    cap = tiny_captioner(seed=6)
    model = cap.model.train()
    images, tokens, lengths = _batch(cap, CAPTIONS)
    with torch.no_grad():
        ann = model.encode(images)
    step = _graphed(model)
    parts = step.step(Annotations(ann.vectors.clone(), ann.grid), tokens, lengths)
    plain, _ = _plain_grads(model, Annotations(ann.vectors, ann.grid), tokens, lengths)
    assert torch.allclose(parts.loss, plain.loss, atol=1e-6)
    other = Annotations(ann.vectors.flip(0).contiguous(), ann.grid)
    parts = step.step(other, tokens, lengths)
    plain, _ = _plain_grads(model, other, tokens, lengths)
    assert torch.allclose(parts.loss, plain.loss, atol=1e-6)


def test_shapes_beyond_the_graph_limit_take_the_plain_step():
    cap = tiny_captioner(seed=7)
    step = _graphed(cap.model.train(), max_graphs=1)
    assert step.step(*_batch(cap, CAPTIONS)) is not None
    assert step.step(*_batch(cap, CAPTIONS[:2])) is None
    assert step.step(*_batch(cap, CAPTIONS, seed=3)) is not None  # a shape it holds
    assert list(step.graphs) == [(4, 8)]


def test_a_failed_capture_stops_with_how_to_go_on_and_the_gradients_as_they_were():
    cap = tiny_captioner(seed=8)
    model = cap.model.train()

    def refuses(run, params, pool):
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    step = GraphedSoftStep(lambda *a: None, [p for p in model.parameters()], _no_autocast, capture=refuses)
    before = [torch.full_like(p, 0.5) for p in step.params]
    for p, g in zip(step.params, before):
        p.grad = g
    with pytest.raises(GraphCaptureError, match="stream is capturing\\)") as e:
        step.step(*_batch(cap, CAPTIONS))
    assert "--set optim.cuda_graphs=false" in str(e.value) and "more detail" not in str(e.value)
    assert all(p.grad is g for p, g in zip(step.params, before))
    assert step.graphs == {}


def test_the_figures_a_graph_keeps_hold_no_autograd_graph():
    """A kept autograd graph keeps the parameters' gradient accumulators alive, and a capture
    that meets them on another stream fails (seen on a GPU)."""
    cap = tiny_captioner(seed=10)
    step = _graphed(cap.model.train())
    step.step(*_batch(cap, CAPTIONS))
    (graph,) = step.graphs.values()
    assert graph.parts.loss.grad_fn is None and not graph.parts.loss.requires_grad


def test_the_pool_of_the_first_capture_is_shared_with_the_next():
    cap = tiny_captioner(seed=9)
    step = _graphed(cap.model.train())
    step.step(*_batch(cap, CAPTIONS))
    assert step.pool == ("pool", None)
    step.step(*_batch(cap, CAPTIONS[:2]))
    assert step.pool == ("pool", ("pool", None))


def _apply(**kw):
    args = dict(device=torch.device("cuda"), objective="soft", distributed=False, precision="fp32", compiled=False,
                enabled=True)
    args.update(kw)
    return graphs_apply(**args)


def test_when_the_graphs_apply():
    assert _apply() is None and _apply(precision="bf16") is None
    assert "off" in _apply(enabled=False)
    assert "CUDA" in _apply(device=torch.device("cpu"))
    assert "hard" in _apply(objective="hard") and "scst" in _apply(objective="scst")
    # torchrun, even of one process: DistributedDataParallel's hooks broke the capture on a GPU
    assert "torchrun" in _apply(distributed=True)
    assert "scaler" in _apply(precision="fp16")
    assert "compiled" in _apply(compiled=True)
    before = kernels.set_enabled(False)
    try:
        assert kernels.ENVIRONMENT_VARIABLE in _apply()
    finally:
        kernels.set_enabled(before)


def test_a_cpu_run_says_nothing_and_takes_the_plain_step(tmp_path, capsys):
    from captioner.train.loop import _graphed_step

    class _Ctx:
        device, world, is_main, active = torch.device("cpu"), 1, True, False

    class _Run:
        from captioner.train.config import TrainConfig
        cfg, ctx, progress = TrainConfig(), _Ctx(), True

        class objective:
            name = "soft"

        class precision:
            name, dtype = "fp32", None
    assert _graphed_step(_Run()) is None
    assert capsys.readouterr().err == ""  # the line on which step runs is for a GPU's runs


def test_a_gpu_run_takes_the_graphs_by_default(capsys):
    # On the card the graphed step's gradients agreed with the plain step's (docs/benchmarks.md,
    # "On a GPU, third session"), and it ran 5.3x the tutorial's step against 1.2x: on by default.
    from captioner.train.config import TrainConfig
    from captioner.train.loop import _graphed_step

    class _Ctx:
        device, world, is_main, active = torch.device("cuda"), 1, True, False

    class _Run:
        cfg, ctx, progress = TrainConfig(), _Ctx(), True
        model = net = torch.nn.Linear(2, 2)

        class objective:
            name = "soft"

        class precision:
            name, dtype = "fp32", None
    assert isinstance(_graphed_step(_Run()), GraphedSoftStep)
    assert capsys.readouterr().err == "training step: CUDA graphs\n"
    _Ctx.active = True  # torchrun with one process
    assert _graphed_step(_Run()) is None
    assert "plain, not CUDA graphs" in capsys.readouterr().err


def test_training_with_the_graphed_step_matches_the_plain_training(monkeypatch):
    """Three optimiser steps through the loop's step function, graphed (with the stand-in
    capture) and plain, from the same weights: the same weights after."""
    from captioner.train import loop

    def weights_after(use_graphs: bool):
        cap = tiny_captioner(seed=11)
        model = cap.model.train()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)

        class _Precision:
            name, dtype, scaler = "fp32", None, None

            @staticmethod
            def autocast():
                return _no_autocast()

            @staticmethod
            def backward(loss):
                loss.backward()

            @staticmethod
            def step(optimizer, params, clip):
                torch.nn.utils.clip_grad_norm_(params, clip)
                optimizer.step()

        class _Ctx:
            device, world = torch.device("cpu"), 1

        class _Objective:
            name = "soft"

            @staticmethod
            def loss(net, inputs, batch, global_size):
                return soft_loss(net, inputs, batch.tokens, batch.lengths, 1.0)

        class _Run:
            from captioner.train.config import TrainConfig
            cfg, ctx, precision, objective, net = TrainConfig(), _Ctx(), _Precision(), _Objective(), model
            optimizer, average, grid, channels_last = opt, None, None, False
            graphed = _graphed(model) if use_graphs else None

        _Run.model = model

        class _Batch:
            def __init__(self, images, tokens, lengths):
                self.images, self.tokens, self.lengths = images, tokens, lengths

            def to(self, *a, **k):
                return self

        for i, captions in enumerate([CAPTIONS, CAPTIONS[:2], CAPTIONS[::-1]]):
            parts = loop._train_step(_Run, _Batch(*_batch(cap, captions, seed=i)), len(captions))
            assert parts.loss.grad_fn is None  # no step's autograd graph outlives it
        if use_graphs:
            assert len(_Run.graphed.graphs) == 2
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(weights_after(True), weights_after(False)):
        assert torch.allclose(a, b, atol=1e-5)



def test_a_capture_failing_mid_run_is_one_line_and_the_run_resumes_without_graphs(tiny_coco, tmp_path, capsys,
                                                                                    monkeypatch):
    """The run stops in one line naming the way on; its last checkpoint resumes with the graphs off
    (optim.cuda_graphs is one of the keys --set may change on a resume)."""
    from captioner.cli.main import main as captioner_main
    from captioner.io.checkpoint import load_checkpoint
    from captioner.train import loop
    from captioner.train.config import to_toml
    from tests.builders import tiny_train_config

    captures = []

    def second_fails(run, params, pool):
        captures.append(1)
        if len(captures) > 1:
            raise RuntimeError("operation not permitted when stream is capturing")
        return eager_capture(run, params, pool)

    def graphed_step(run):
        def loss(inputs, tokens, lengths, steps):
            return soft_loss(run.net, inputs, tokens, lengths, run.cfg.optim.doubly_stochastic, steps=steps)
        return GraphedSoftStep(loss, [p for p in run.model.parameters() if p.requires_grad], _no_autocast,
                               capture=second_fails, bucket=1)  # every caption length a graph of its own

    monkeypatch.setattr(loop, "_graphed_step", lambda run: graphed_step(run) if run.cfg.optim.cuda_graphs else None)
    cfg_path = tmp_path / "cfg.toml"
    cfg_path.write_text(to_toml(tiny_train_config(tiny_coco, **{"optim.max_steps": 6, "optim.save_every": 1,
                                                                "optim.batch_size": 2, "val.every_epochs": 0,
                                                                "optim.cuda_graphs": True})))
    run = tmp_path / "run"
    code = captioner_main(["train", "--config", str(cfg_path), "--run-dir", str(run), "--quiet"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err and len(captures) == 2
    line = err.strip().splitlines()[-1]
    assert line.startswith("captioner train: error: ") and "stream is capturing" in line
    assert "--resume RUN_DIR --set optim.cuda_graphs=false" in line
    saved = load_checkpoint(run / "last.pt").train_state.step
    assert 1 <= saved < 6
    assert captioner_main(["train", "--resume", str(run), "--set", "optim.cuda_graphs=false", "--quiet"]) == 0
    assert load_checkpoint(run / "last.pt").train_state.step == 6 and len(captures) == 2


def test_the_cuda_capture_warms_up_on_a_side_stream_then_records_one_pass(monkeypatch):
    """cuda_capture with torch.cuda's stream and graph calls stood in for: WARMUP eager passes on
    a side stream, each one's gradients dropped, the streams joined both ways, then one pass
    recorded into a graph sharing the pool it is given, errors of other threads not its own."""
    events = stand_in_cuda(monkeypatch)
    w = torch.nn.Parameter(torch.ones(2))

    def run():
        w.grad = torch.full_like(w, 3.0)
        events.append(("pass", w.grad is None))
        return "parts"

    replay, parts, pool = graphed.cuda_capture(run, [w], "old pool")
    warm = [("pass", False)] * graphed.WARMUP
    assert events == [("wait", "side", "main"), ("on", "side"), *warm, ("off", "side"), ("wait", "main", "side"),
                      ("record", "old pool", "thread_local"), ("pass", False), "recorded"]
    assert parts == "parts" and pool == "new pool"
    replay()
    assert events[-1] == "replay"
    assert w.grad is not None  # the recorded pass's gradients stay: they are the graph's

    events.clear()
    seen = []

    def run_checking():
        seen.append(w.grad is None)  # each warm-up pass starts from dropped gradients
        w.grad = torch.zeros_like(w)
        return "parts"

    w.grad = None
    graphed.cuda_capture(run_checking, [w], None)
    assert seen == [True] * (graphed.WARMUP + 1) and graphed.WARMUP >= 1
