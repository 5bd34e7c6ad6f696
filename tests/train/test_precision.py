"""Mixed precision and torch.compile: the fp16 gradient scaler, the compiled decoder step,
and autocast captioning. All on CPU (autocast and the scaler work there too)."""

import pytest
import torch

from captioner.evaluation.grounding import parse_mentions
from captioner.inference import Captioner
from captioner.model.decoder import Decoder, ModelConfig
from captioner.model.encoders import Annotations
from captioner.train.loop import train
from captioner.train.precision import MixedPrecision
from tests.builders import tiny_train_config
from tests.tiny import tiny_captioner


def _param(value: float) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.tensor([value]))


def test_auto_is_fp32_on_cpu_and_unknown_names_are_refused():
    mp = MixedPrecision("auto", torch.device("cpu"))
    assert mp.name == "fp32" and mp.dtype is None and mp.scaler is None
    with pytest.raises(ValueError, match="optim.precision"):
        MixedPrecision("half", torch.device("cpu"))


def test_fp16_scaler_skips_an_overflowing_step_and_halves_its_scale():
    mp = MixedPrecision("fp16", torch.device("cpu"))
    p = _param(1.0)
    opt = torch.optim.SGD([p], lr=0.1)
    scale = mp.scaler.get_scale()
    mp.backward((p * float("inf")).sum())
    assert mp.step(opt, [p], grad_clip=0.0) is False
    assert p.item() == 1.0  # nothing applied
    assert mp.scaler.get_scale() == scale / 2


def test_fp16_scaler_clips_the_true_gradient_not_the_scaled_one():
    mp = MixedPrecision("fp16", torch.device("cpu"))
    p = _param(0.0)
    opt = torch.optim.SGD([p], lr=1.0)
    opt.zero_grad()
    mp.backward((3.0 * p).sum())  # true gradient 3, scaled by 65536 in the backward pass
    assert p.grad.item() == pytest.approx(3.0 * mp.scaler.get_scale())
    assert mp.step(opt, [p], grad_clip=1.0) is True
    assert p.grad.item() == pytest.approx(1.0)  # unscaled (3), then clipped to norm 1
    assert p.item() == pytest.approx(-1.0)


@pytest.mark.slow
def test_fp16_training_runs_and_resume_restores_the_scaler(tiny_coco, tmp_path):
    run = tmp_path / "run"
    cfg = tiny_train_config(tiny_coco, **{"optim.max_steps": 6, "val.every_epochs": 0, "optim.precision": "fp16"})
    train(cfg, run, progress=False)
    state = torch.load(run / "last.pt", weights_only=True)["train_state"]["grad_scaler"]
    assert 0 < state["scale"] <= 65536.0 and "_growth_tracker" in state
    # Tamper with the saved scale: a resumed run must pick it up, not start afresh.
    ckpt = torch.load(run / "last.pt", weights_only=True)
    ckpt["train_state"]["grad_scaler"]["scale"] = 1024.0
    ckpt["train_state"]["config"]["optim"]["max_steps"] = 7
    torch.save(ckpt, run / "last.pt")
    outcome = train(None, run, resume=True, progress=False)
    assert outcome.step == 7
    after = torch.load(run / "last.pt", weights_only=True)["train_state"]["grad_scaler"]
    assert after["scale"] in (1024.0, 512.0)  # kept (or halved by one overflowing step), never reset to 65536


def _tiny_decoder():
    torch.manual_seed(0)
    return Decoder(ModelConfig(vocab_size=30, annotation_dim=8, embed_dim=6, hidden_dim=10, attention_dim=5,
                               dropout=0.0))


@pytest.mark.slow  # torch.compile
def test_compiled_step_matches_eager_values_and_gradients():
    a = torch.randn(3, 4, 8)
    tokens = torch.randint(4, 30, (3, 6))
    lengths = torch.tensor([6, 4, 5])
    eager, compiled = _tiny_decoder(), _tiny_decoder()
    compiled.compile_step(backend="aot_eager")  # traced by dynamo; no C++ toolchain needed
    assert compiled.compiled and not eager.compiled
    outs = []
    for dec in (eager, compiled):
        out = dec(Annotations(a, (2, 2)), tokens, lengths)
        (out.logits.square().mean() + out.alphas.square().mean()).backward()
        outs.append((out, {n: p.grad.clone() for n, p in dec.named_parameters()}))
    (o1, g1), (o2, g2) = outs
    torch.testing.assert_close(o1.logits, o2.logits)
    torch.testing.assert_close(o1.alphas, o2.alphas)
    assert g1.keys() == g2.keys() and all(g1[n].abs().sum() > 0 for n in ("L_o.weight", "lstm.weight_hh"))
    for n in g1:
        torch.testing.assert_close(g1[n], g2[n], msg=n)


@pytest.mark.slow  # torch.compile
def test_training_with_a_compiled_step_equals_eager_training(tiny_coco, tmp_path, monkeypatch):
    """The loop's optim.compile reaches the step, and training through it is training. The
    compiler's own numbers (AOTAutograd's tracing of the step and its gradients) are
    test_compiled_step_matches_eager_values_and_gradients'; here the eager backend runs the
    captured graphs."""
    backends, real_compile = [], Decoder.compile_step

    def recording_compile(self, **options):
        backends.append(options.get("backend"))
        real_compile(self, **options)

    monkeypatch.setattr(Decoder, "compile_step", recording_compile)
    weights = []
    for backend in ("", "eager"):
        run = tmp_path / f"run-{backend or 'eager'}"
        # SGD: Adam turns rounding-level gradient differences near zero into full-size steps.
        train(tiny_train_config(tiny_coco, **{"optim.max_steps": 3, "val.every_epochs": 0, "optim.compile": backend,
                                              "optim.optimizer": "sgd"}),
              run, progress=False)
        weights.append(torch.load(run / "last.pt", weights_only=True)["state_dict"])
    assert backends == ["eager"]  # only the second run compiled its step, with that backend
    for k in weights[0]:
        torch.testing.assert_close(weights[0][k], weights[1][k], rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def shapes_images(tmp_path_factory):
    from captioner.data.images import load_image
    from captioner.data.shapes import generate_dataset

    out = tmp_path_factory.mktemp("shapes")
    generate_dataset(out, {"test": 6}, seed=777)
    return [load_image(p) for p in sorted((out / "images" / "test").glob("*.png"))]


@pytest.mark.slow  # the demo model captions twice, once under autocast: over a second each
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_autocast_captioning_names_the_same_objects_and_returns_fp32_maps(shapes_images, precision):
    cap = Captioner.load("demo-soft")
    ref = cap.caption_images(shapes_images)
    low = cap.use_precision(precision).caption_images(shapes_images)
    same = 0
    for r, lo in zip(ref, low):
        assert lo.alphas.dtype == torch.float32 and lo.betas.dtype == torch.float32
        # The same objects are named. bf16 keeps 8 bits of mantissa: where two phrasings
        # are nearly tied ("a single red cross" / "a dark background with a red cross")
        # it may pick the other one; fp16 (10 bits) keeps every caption.
        assert [(m.color, m.shape) for m in parse_mentions(lo.words)] == \
            [(m.color, m.shape) for m in parse_mentions(r.words)]
        if precision == "fp16":
            assert lo.words == r.words
        if lo.words == r.words:
            same += 1
            torch.testing.assert_close(lo.alphas, r.alphas, atol=0.02, rtol=0.05)
    assert same >= len(ref) // 2
    with pytest.raises(ValueError, match="precision"):
        cap.use_precision("int8")


@pytest.mark.slow  # torch.compile
def test_compiled_captioner_gives_the_same_captions():
    cap = tiny_captioner()
    images = torch.rand(3, 3, 32, 32)
    ref = cap.caption_batch(images)
    # The compiled decoder's own numbers are test_compile_steady's: this is the Captioner's switch.
    assert cap.compile(backend="eager") is cap and cap.model.decoder.compiled
    got = cap.caption_batch(images)
    for r, g in zip(ref, got):
        assert g.words == r.words
        torch.testing.assert_close(g.alphas, r.alphas)
