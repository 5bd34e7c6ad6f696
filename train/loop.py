"""The training loop: resumable exactly, interruptible cleanly, checkpoints written atomically.

A run folder holds ``config.toml`` (the resolved config), ``metrics.jsonl`` (one JSON
object per log line and per validation), ``last.pt`` (model + everything needed to
continue: optimiser, scheduler, RNG, position in the epoch) and ``best.pt`` (the model
with the best validation score, from real decoding).
"""

from __future__ import annotations

import json
import random
import signal
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

from captioner.checkpoint import atomic_save, load_checkpoint
from captioner.data.coco import CaptionDataset, build_vocab, collate_captions, load_split
from captioner.evaluation import evaluate
from captioner.images import IMAGENET_MEAN, IMAGENET_STD, Preprocess
from captioner.inference import Captioner, DecodeOptions
from captioner.model import CaptionModel, ModelConfig
from captioner.vocab import Vocabulary

from .config import TrainConfig, to_toml
from .losses import HardAttentionObjective, LossParts, soft_loss


@dataclass
class TrainOutcome:
    run_dir: Path
    step: int
    epoch: int
    reason: str  # finished | max_steps | time_budget | early_stop | interrupted
    best_metric: float | None
    train_seconds: float


class _StopFlag:
    """SIGINT / SIGTERM ask the loop to save and stop after the current step."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "_StopFlag":
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals stay as they are
                pass
        return self

    def _handle(self, signum, frame) -> None:
        if self.signal is not None:  # second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.signal = signum
        print(f"\n{signal.Signals(signum).name}: saving and stopping after this step "
              "(again to abort without saving)", file=sys.stderr)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _prepare_data(cfg: TrainConfig) -> None:
    d = cfg.data
    if d.generate_shapes and not (Path(d.dir) / f"captions_{d.train_split}.json").is_file():
        from captioner.data.shapes import generate_dataset

        print(f"generating the shapes dataset in {d.dir}", file=sys.stderr)
        generate_dataset(Path(d.dir), {d.train_split: d.shapes_train, d.val_split: d.shapes_val},
                         seed=d.shapes_seed, image_size=d.shapes_image_size, progress=True)


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _epoch_batches(n: int, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """The order of one epoch depends only on (seed, epoch): a resumed run sees the same batches."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    perm = torch.randperm(n, generator=g).tolist()
    return [perm[i:i + batch_size] for i in range(0, n, batch_size)]


def new_run_dir(cfg: TrainConfig, root: Path = Path("runs")) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    path = root / f"{cfg.name}-{stamp}"
    suffix = 1
    while path.exists():
        path = root / f"{cfg.name}-{stamp}-{suffix}"
        suffix += 1
    return path


def train(cfg: TrainConfig | None, run_dir: Path, *, resume: bool = False, progress: bool = True) -> TrainOutcome:
    """Train into ``run_dir``; with ``resume``, continue from ``run_dir/last.pt`` exactly."""
    ckpt = None
    if resume:
        ckpt = load_checkpoint(run_dir / "last.pt")
        if "train_state" not in ckpt:
            raise ValueError(f"{run_dir / 'last.pt'} has no training state to resume from")
        saved = TrainConfig.from_dict(ckpt["train_state"]["config"])
        cfg = cfg if cfg is not None else saved
    assert cfg is not None
    device = _device(cfg.optim.device)
    if cfg.optim.threads > 0:
        torch.set_num_threads(cfg.optim.threads)
    torch.manual_seed(cfg.optim.seed)
    random.seed(cfg.optim.seed)
    _prepare_data(cfg)

    d, m, o = cfg.data, cfg.model, cfg.optim
    karpathy = d.karpathy or None
    train_records = load_split(d.dir, d.train_split, karpathy)
    val_records = load_split(d.dir, d.val_split, karpathy)
    if ckpt is not None:
        vocab = Vocabulary(list(ckpt["vocab"]))
    else:
        vocab = build_vocab(train_records, min_count=d.min_count, max_size=d.max_vocab or None)
    preprocess = Preprocess(size=(m.image_size, m.image_size), mean=IMAGENET_MEAN, std=IMAGENET_STD)
    model_cfg = ModelConfig(vocab_size=len(vocab), encoder=m.encoder, encoder_pretrained=m.encoder_pretrained,
                            fine_tune_blocks=m.fine_tune_blocks, image_size=(m.image_size, m.image_size),
                            embed_dim=m.embed_dim, hidden_dim=m.hidden_dim, attention_dim=m.attention_dim,
                            dropout=m.dropout, attention=m.attention, score=m.score, normalizer=m.normalizer,
                            local_window=m.local_window)
    if ckpt is not None:
        model_cfg = ModelConfig.from_dict(ckpt["model_config"])
        model_cfg.encoder_pretrained = False  # the weights come from the checkpoint
    model = CaptionModel(model_cfg).to(device)
    if ckpt is not None:
        model.load_state_dict(ckpt["state_dict"])

    enc_params = [p for p in model.encoder.parameters() if p.requires_grad]
    groups = [{"params": list(model.decoder.parameters()), "lr": o.lr}]
    if enc_params:
        groups.append({"params": enc_params, "lr": o.encoder_lr})
    optimizer = torch.optim.Adam(groups, weight_decay=o.weight_decay)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=max(1, o.lr_decay_every), gamma=o.lr_decay)
    hard = HardAttentionObjective(cfg.hard, o.doubly_stochastic) if model_cfg.attention == "hard" else None

    state = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "best": None, "bad_vals": 0, "train_seconds": 0.0}
    if ckpt is not None:
        ts = ckpt["train_state"]
        optimizer.load_state_dict(ts["optimizer"])
        scheduler.load_state_dict(ts["scheduler"])
        state.update({k: ts[k] for k in state})
        if hard is not None:
            hard.baseline = float(ts.get("baseline", 0.0))
        _set_rng_state(ts["rng"])
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(to_toml(cfg))

    dataset = CaptionDataset(train_records, vocab, preprocess, max_len=d.max_caption_len, cache_images=d.cache_images)
    captioner = Captioner(model, vocab, preprocess)
    meta = {"name": cfg.name, "data": d.dir, "attention": model_cfg.attention}
    log = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")
    use_amp = o.amp and device.type == "cuda"

    def save_last() -> None:
        train_state = {**state, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                       "rng": _rng_state(), "config": cfg.to_dict()}
        if hard is not None:
            train_state["baseline"] = hard.baseline
        atomic_save(captioner.checkpoint(meta={**meta, "step": state["step"]}, train_state=train_state),
                    run_dir / "last.pt")

    def write(record: dict) -> None:
        log.write(json.dumps(record) + "\n")
        log.flush()

    def validate() -> bool:
        """Real decoding on the validation split; saves best.pt; True when early stopping says stop."""
        model.eval()
        report = evaluate(captioner, d.dir, d.val_split, karpathy=karpathy, records=val_records,
                          options=DecodeOptions(beam_size=cfg.val.beam_size, max_len=cfg.val.max_len),
                          limit=cfg.val.limit or None, meteor=False, progress=False)
        model.train()
        value = report.metrics.get(cfg.val.metric)
        if value is None and report.grounding:
            value = report.grounding.get(cfg.val.metric)
        if value is None:
            raise ValueError(f"validation metric {cfg.val.metric!r} not among {sorted(report.metrics)}")
        improved = state["best"] is None or value > state["best"]
        if improved:
            state["best"], state["bad_vals"] = value, 0
            atomic_save(captioner.checkpoint(meta={**meta, "step": state["step"], "epoch": state["epoch"],
                                                   f"val_{cfg.val.metric}": value,
                                                   "train_seconds": round(state["train_seconds"], 1)}),
                        run_dir / "best.pt")
        else:
            state["bad_vals"] += 1
        write({"step": state["step"], "epoch": state["epoch"], "val": report.metrics,
               "grounding": report.grounding, "improved": improved})
        print(f"epoch {state['epoch']} step {state['step']}: val {cfg.val.metric} {value:.4f}"
              f"{' (best)' if improved else ''}", file=sys.stderr)
        return cfg.val.patience > 0 and state["bad_vals"] >= cfg.val.patience

    reason = "finished"
    model.train()
    with _StopFlag() as stop:
        try:
            while state["epoch"] < o.epochs:
                batches = _epoch_batches(len(dataset), o.batch_size, o.seed, state["epoch"])
                loader = DataLoader(dataset, batch_sampler=batches[state["batch_in_epoch"]:],
                                    collate_fn=collate_captions, num_workers=d.workers,
                                    pin_memory=device.type == "cuda",
                                    # Its own generator: creating a loader must not draw from the
                                    # global RNG, or a resumed run would drift from the original.
                                    generator=torch.Generator().manual_seed(o.seed + state["epoch"]))
                bar = tqdm(total=len(batches), initial=state["batch_in_epoch"], desc=f"epoch {state['epoch']}",
                           unit="batch", file=sys.stderr, disable=not progress, leave=False)
                tick = time.perf_counter()
                for batch in loader:
                    batch = batch.to(device, non_blocking=True)
                    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp):
                        if hard is not None:
                            parts: LossParts = hard(model, batch.images, batch.tokens, batch.lengths)
                        else:
                            parts = soft_loss(model, batch.images, batch.tokens, batch.lengths, o.doubly_stochastic)
                    optimizer.zero_grad(set_to_none=True)
                    parts.loss.backward()
                    if o.grad_clip > 0:
                        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
                    optimizer.step()
                    now = time.perf_counter()
                    state["train_seconds"] += now - tick
                    tick = now
                    state["step"] += 1
                    state["batch_in_epoch"] += 1
                    bar.update(1)
                    bar.set_postfix(nll=f"{parts.nll:.2f}")
                    if state["step"] % o.log_every == 0:
                        write({"step": state["step"], "epoch": state["epoch"], "nll": round(parts.nll, 4),
                               "penalty": round(parts.penalty, 4), "lr": optimizer.param_groups[0]["lr"],
                               "train_seconds": round(state["train_seconds"], 1),
                               **({"baseline": round(hard.baseline, 4)} if hard is not None else {})})
                    if o.max_steps and state["step"] >= o.max_steps:
                        reason = "max_steps"
                    elif o.max_minutes and state["train_seconds"] >= 60 * o.max_minutes:
                        reason = "time_budget"
                    elif stop.signal is not None:
                        reason = "interrupted"
                    if reason != "finished":
                        break
                    if o.save_every and state["step"] % o.save_every == 0:
                        save_last()
                        tick = time.perf_counter()  # saving is not training time
                bar.close()
                if reason != "finished":
                    break
                state["epoch"] += 1
                state["batch_in_epoch"] = 0
                scheduler.step()
                early = cfg.val.every_epochs > 0 and state["epoch"] % cfg.val.every_epochs == 0 and validate()
                save_last()
                if early:
                    reason = "early_stop"
                    break
            if state["best"] is None and reason != "interrupted":
                validate()  # a run that ends before its first validation still leaves a best.pt
            save_last()
        finally:
            log.close()
    return TrainOutcome(run_dir, state["step"], state["epoch"], reason, state["best"], state["train_seconds"])
