"""Training with the encoder in channels-last memory (kernels.channels_last_ok: CUDA under bf16
or fp16). A CPU runs the same code with the condition forced: the layout changes the order of
the values in memory, not the run, and a run saved in one layout resumes in the other."""

from __future__ import annotations

import pytest
import torch

from captioner.cli.main import main as captioner_main
from captioner.io.checkpoint import load_checkpoint
from captioner.model import kernels
from captioner.train.config import to_toml
from captioner.train.loop import optimizer_state_like_params
from captioner.train.losses import soft_loss
from tests.builders import tiny_train_config
from tests.tiny import tiny_captioner, tiny_image, token_batch


def test_channels_last_is_for_cuda_under_bf16_or_fp16_with_the_kernels_on():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert kernels.channels_last_ok(cuda, torch.bfloat16) and kernels.channels_last_ok(cuda, torch.float16)
    assert not kernels.channels_last_ok(cuda, None) and not kernels.channels_last_ok(cpu, torch.bfloat16)
    before = kernels.set_enabled(False)
    try:
        assert not kernels.channels_last_ok(cuda, torch.bfloat16)
    finally:
        kernels.set_enabled(before)


def test_the_optimizer_state_takes_its_parameters_layout_values_kept():
    conv = torch.nn.Parameter(torch.randn(4, 3, 3, 3))
    bias = torch.nn.Parameter(torch.randn(4))
    opt = torch.optim.Adam([conv, bias], fused=True)
    conv.grad, bias.grad = torch.randn_like(conv), torch.randn_like(bias)
    opt.step()
    saved = opt.state[conv]["exp_avg"].clone()
    opt.state[conv]["exp_avg"] = saved.contiguous(memory_format=torch.channels_last)  # as a file from NHWC training
    bias_state = opt.state[bias]["exp_avg"]
    optimizer_state_like_params(opt)
    moved = opt.state[conv]["exp_avg"]
    assert moved.stride() == conv.stride() and torch.equal(moved, saved)
    assert opt.state[bias]["exp_avg"] is bias_state  # already alike: left as it is
    assert opt.state[conv]["step"].shape == ()  # not a parameter-shaped tensor: untouched


def test_a_channels_last_step_gives_the_plain_steps_loss_and_gradients():
    cap = tiny_captioner(seed=3)
    model = cap.model.train()
    tokens, lengths = token_batch(cap.vocab, ["a red circle", "a small blue square and a star"])
    images = torch.stack([cap.preprocess(tiny_image(seed=i)) for i in range(2)])

    def step(imgs):
        model.zero_grad(set_to_none=True)
        parts = soft_loss(model, imgs, tokens, lengths, 1.0)
        parts.loss.backward()
        return parts.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss, grads = step(images)
    model.encoder.to(memory_format=torch.channels_last)
    assert any(not p.is_contiguous() for p in model.encoder.parameters())
    loss_cl, grads_cl = step(images.contiguous(memory_format=torch.channels_last))
    assert torch.allclose(loss_cl, loss, rtol=1e-5)
    for name in grads:
        assert torch.allclose(grads_cl[name], grads[name], rtol=1e-4, atol=1e-6), name


def _train(cfg_path, run, *more):
    return captioner_main(["train", "--config", str(cfg_path), "--run-dir", str(run), "--quiet", *more])


@pytest.mark.slow
def test_a_channels_last_run_saves_its_layout_and_resumes_in_either(tiny_coco, tmp_path, monkeypatch):
    cfg_path = tmp_path / "cfg.toml"
    cfg_path.write_text(to_toml(tiny_train_config(tiny_coco, **{"optim.max_steps": 4, "val.every_epochs": 0,
                                                                "model.dropout": 0.0})))
    assert _train(cfg_path, tmp_path / "plain") == 0
    monkeypatch.setattr(kernels, "channels_last_ok", lambda device, dtype: True)
    layouts = []

    def record(module, args):
        x = args[0] if args else None
        if module.training and torch.is_tensor(x) and x.dim() == 4 and x.shape[1] == 3:  # the images
            layouts.append(args[0].is_contiguous(memory_format=torch.channels_last) and not args[0].is_contiguous())

    hook = torch.nn.modules.module.register_module_forward_pre_hook(record)
    try:
        assert _train(cfg_path, tmp_path / "nhwc") == 0
    finally:
        hook.remove()
    assert layouts and layouts[-1]  # the last step's images came to the encoder in NHWC
    plain = load_checkpoint(tmp_path / "plain" / "last.pt").state_dict
    nhwc = load_checkpoint(tmp_path / "nhwc" / "last.pt").state_dict
    convs = [k for k, v in nhwc.items() if v.dim() == 4]
    assert convs and all(nhwc[k].is_contiguous(memory_format=torch.channels_last) for k in convs)
    moved = [k for k in convs if not nhwc[k].is_contiguous()]  # a 1x1 kernel is both at once
    assert moved and not any(plain[k].is_contiguous(memory_format=torch.channels_last) for k in moved)
    monkeypatch.undo()  # resumed where channels-last does not apply: its optimiser state comes back NCHW
    assert captioner_main(["train", "--resume", str(tmp_path / "nhwc"), "--set", "optim.max_steps=6", "--quiet"]) == 0
    resumed = load_checkpoint(tmp_path / "nhwc" / "last.pt")
    assert resumed.train_state.step == 6 and all(resumed.state_dict[k].is_contiguous() for k in moved)
    states = [v for st in resumed.train_state.optimizer["state"].values() for v in st.values()
              if torch.is_tensor(v) and v.dim() == 4]
    assert states and all(v.is_contiguous() for v in states)  # the saved NHWC state came back NCHW
