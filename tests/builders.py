"""Builders shared by the test modules: a tiny training config, a config for the photo
fixture, a run's NLL log, JSON Lines read back, a free local port. (The tiny model,
vocabulary, images and COCO-format data set are in tiny.py; two ranks in ranks.py; fixtures in
conftest.py.)"""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import torch

from captioner.train.config import load_config

TORCHRUN_ARGS = ["--standalone", "--nproc_per_node", "2"]  # two workers on this machine (ranks.torchrun)


def tiny_train_config(data_dir, **sets):
    """A TrainConfig of the tiny model on ``data_dir`` (the tiny COCO fixture), ``sets``
    given as `--set` overrides (``tiny.tiny_config`` is the ModelConfig alone)."""
    base = [
        f"data.dir={data_dir}", "data.min_count=1", "data.workers=0", "data.cache_images=true",
        "model.encoder=small", "model.image_size=32", "model.embed_dim=16", "model.hidden_dim=24",
        "model.attention_dim=12", "model.dropout=0.2", "optim.batch_size=4", "optim.lr=0.01",
        "optim.encoder_lr=0.01", "optim.log_every=1", "optim.save_every=2", "optim.epochs=50",
        "optim.lr_decay_every=1", "optim.lr_decay=0.9", "val.metric=BLEU-1", "val.max_len=8", "val.patience=0",
    ]
    return load_config(None, base + [f"{k}={v}" for k, v in sets.items()])


def coco_config(tmp_path: Path, photos: Path, **extra: object) -> Path:
    """A training config file on the photo fixture in COCO's layout; ``extra`` as
    section__name=value."""
    coco = photos / "coco"
    lines = ['name = "photos"', "[data]", f'dir = "{coco}"', f'karpathy = "{coco / "dataset_coco.json"}"',
             "min_count = 1", "max_caption_len = 20", "workers = 0",
             "[model]", 'encoder = "small"', "image_size = 32", "embed_dim = 8", "hidden_dim = 8",
             "attention_dim = 8",
             "[optim]", "max_steps = 2", "batch_size = 4", "threads = 1", "[val]", "limit = 1", "max_len = 4"]
    for key, value in extra.items():
        section, name = key.split("__")
        lines.insert(lines.index(f"[{section}]") + 1, f"{name} = {json.dumps(value)}")
    path = tmp_path / "config.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def nll_log(run_dir):
    """The NLL of every logged step of a run (its metrics.jsonl)."""
    return [r["nll"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "nll" in r]


def free_port() -> int:
    """A TCP port of 127.0.0.1 free at the moment of asking (for a server a test starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_jsonl(path):
    """The records of a JSON Lines file (`captioner caption --out`)."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def one_line(err: str) -> str:
    """The one non-blank line of ``err`` (a refusal's stderr), which holds no traceback."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def torch_step(decoder, grid: tuple[int, int]):
    """``decoder``'s step as the numpy search (captioner.onnx.search) calls a step: numpy in, numpy
    out, one row per beam."""
    import torch.nn.functional as F

    def step(word, h, c, ann, keys):
        with torch.no_grad():
            o = decoder.step(*(torch.from_numpy(x) for x in (word, h, c, ann, keys)), grid)
        return (F.log_softmax(o.logits.float(), -1).numpy(), o.h.numpy(), o.c.numpy(), o.alpha_heads.numpy(),
                o.beta.numpy())
    return step


def hold_gate(gate, slots: int = 1) -> threading.Event:
    """Start ``slots`` jobs that each hold a slot of ``gate`` (captioner.batching.Gate) until the
    returned event is set; return once they all hold one."""
    release, held = threading.Event(), threading.Semaphore(0)

    def work(items):
        held.release()
        release.wait(10)
        return items

    for i in range(slots):
        threading.Thread(target=gate.run, args=(None, i, work), daemon=True).start()
    for _ in range(slots):
        assert held.acquire(timeout=5)
    return release
