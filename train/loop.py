"""The training loop: resumable exactly, interruptible cleanly, checkpoints written atomically.

A run folder holds ``config.toml`` (the resolved config), ``metrics.jsonl`` (one JSON
object per log line and per validation), ``last.pt`` (model + everything needed to
continue: optimiser, scheduler, RNG, position in the epoch) and ``best.pt`` (the model
with the best validation score, from real decoding).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

from captioner.checkpoint import CheckpointError, atomic_save, load_checkpoint
from captioner.data.coco import (CaptionDataset, TrainingCaptions, build_vocab, collate_captions, load_splits,
                                  training_captions)
from captioner.distributed import DistContext, setup, teardown, work_done
from captioner.encoders import Annotations
from captioner.evaluation import evaluate
from captioner.images import IMAGENET_MEAN, IMAGENET_STD, Preprocess
from captioner.inference import Captioner, DecodeOptions, resolve_weights
from captioner.model import CaptionModel, ModelConfig
from captioner.vocab import Vocabulary

from .averaging import WeightAverage
from .config import TrainConfig, model_config, to_toml
from .datainfo import training_data_name
from .losses import HardAttentionObjective, LossParts, soft_loss
from .precision import MixedPrecision
from .scst import ScstObjective


class StartupError(ValueError):
    """Training cannot start: the data, the config or the run folder need the user. Raised
    before anything is written, or after what was written is taken back; one line."""


class RunWriteError(Exception):
    """A write to the run folder failed (a full disk, say). The message names the file and the
    last checkpoint, which is intact: checkpoints are written to a temporary file, then renamed."""


@dataclass
class TrainOutcome:
    run_dir: Path
    step: int
    epoch: int
    reason: str  # finished | max_steps | time_budget | early_stop | interrupted
    best_metric: float | None
    train_seconds: float


class _StopFlag:
    """SIGINT / SIGTERM ask the loop to save and stop after the current step.

    A terminal's Ctrl-C reaches every process of the job: the data loader's workers (forked
    with this handler) and under torchrun every rank. The notice is printed once: by the
    process that set the handler, on rank 0 (``announce``)."""

    def __init__(self, announce: bool = True) -> None:
        self.signal: int | None = None
        self.announce = announce
        self._pid = os.getpid()
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "_StopFlag":
        self._pid = os.getpid()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals stay as they are
                pass
        return self

    def _handle(self, signum, frame) -> None:
        if os.getpid() != self._pid:  # a data-loader worker: the training process stops it
            return
        if self.signal is not None:  # second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.signal = signum
        if self.announce:
            print(f"\n{signal.Signals(signum).name}: saving and stopping after this step "
                  "(again to abort without saving)", file=sys.stderr)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class _BarLoss:
    """The progress bar's loss, fresh every step (a moving average of this rank's losses,
    written into the bar at most once a second), and the time left of ``optim.max_minutes``."""

    def __init__(self, max_minutes: float) -> None:
        self.max_minutes = max_minutes
        self.average: float | None = None
        self.shown_at = float("-inf")
        self.bar: tqdm | None = None

    def show(self, bar: tqdm, nll: float, train_seconds: float) -> None:
        self.average = nll if self.average is None else 0.9 * self.average + 0.1 * nll
        now = time.monotonic()
        if now - self.shown_at < 1.0 and bar is self.bar:  # a new epoch's bar gets it at once
            return
        self.shown_at, self.bar = now, bar
        text = f"nll={self.average:.2f}"
        if self.max_minutes:
            left = max(0, round(60 * self.max_minutes - train_seconds))
            clock = f"{left // 3600}:{left // 60 % 60:02d}:{left % 60:02d}" if left >= 3600 \
                else f"{left // 60:02d}:{left % 60:02d}"
            text += f", budget left {clock}"  # tqdm's own estimate is for this epoch only
        bar.set_postfix_str(text, refresh=False)


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


def _epoch_batches(n: int, batch_size: int, seed: int, epoch: int,
                   lengths: list[int] | None = None) -> list[list[int]]:
    """The order of one epoch depends only on (seed, epoch) and the items' caption lengths:
    a resumed run sees the same batches. With ``lengths`` (one per item), batches hold
    captions of about one length: a random order sorted (stably) by length, cut into
    batches, and the batches shuffled; only the last of the sorted run may be short."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    perm = torch.randperm(n, generator=g).tolist()
    if lengths is None:
        return [perm[i:i + batch_size] for i in range(0, n, batch_size)]
    if len(lengths) != n:
        raise ValueError(f"{len(lengths)} caption lengths for {n} items")
    perm.sort(key=lengths.__getitem__)  # stable: random order within a length
    batches = [perm[i:i + batch_size] for i in range(0, n, batch_size)]
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]


def new_run_dir(cfg: TrainConfig, root: Path = Path("runs")) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    path = root / f"{cfg.name}-{stamp}"
    suffix = 1
    while path.exists():
        path = root / f"{cfg.name}-{stamp}-{suffix}"
        suffix += 1
    return path


def train(cfg: TrainConfig | None, run_dir: Path, *, resume: bool = False, progress: bool = True) -> TrainOutcome:
    """Train into ``run_dir``; with ``resume``, continue from ``run_dir/last.pt`` exactly.

    Under torchrun every rank calls this: each trains on its share of every global batch
    (DistributedDataParallel averages the gradients), rank 0 validates and writes."""
    ckpt = None
    if resume:
        ckpt = load_checkpoint(run_dir / "last.pt")
        if "train_state" not in ckpt:
            raise ValueError(f"{run_dir / 'last.pt'} has no training state to resume from")
        cfg = cfg if cfg is not None else TrainConfig.from_dict(ckpt["train_state"]["config"])
    assert cfg is not None
    ctx = setup(cfg.optim.device)
    try:
        outcome = _train(cfg, run_dir, ckpt, ctx, progress)
        work_done(ctx)  # every rank saved, or stopped on the same error: each ends with its own code
        return outcome
    except (StartupError, RunWriteError):
        work_done(ctx)
        raise
    finally:
        teardown(ctx)


def _train(cfg: TrainConfig, run_dir: Path, ckpt: dict | None, ctx: DistContext, progress: bool) -> TrainOutcome:
    d, m, o = cfg.data, cfg.model, cfg.optim
    device = ctx.device
    if o.threads > 0:
        torch.set_num_threads(o.threads)
    torch.manual_seed(o.seed)  # the same initial weights on every rank
    random.seed(o.seed)
    if ctx.is_main:
        _prepare_data(cfg)
    ctx.barrier()

    karpathy = d.split_file
    splits = load_splits(d.dir, [d.train_split, d.val_split], karpathy)
    preprocess = Preprocess(size=(m.image_size, m.image_size), mean=IMAGENET_MEAN, std=IMAGENET_STD,
                            resize=m.resize)
    # Every image decoded once now, the way training decodes it: a damaged one stops the run
    # here, each named, rather than with a traceback an hour in (or is left out, on request).
    unreadable = _unreadable_images(splits, preprocess, d, ctx, progress)
    if unreadable and not d.skip_unreadable:
        raise StartupError(_unreadable_message(unreadable))
    left_out = {name: sum(r.path in unreadable for r in records) for name, records in splits.items()}
    train_records, val_records = ([r for r in splits[name] if r.path not in unreadable]
                                  for name in (d.train_split, d.val_split))
    if not train_records or not val_records:
        raise StartupError("no readable images left in split "
                           f"{d.train_split if not train_records else d.val_split!r}")
    kept = training_captions(train_records, d.max_caption_len)
    if ckpt is not None:
        vocab = Vocabulary(list(ckpt["vocab"]))
    else:
        vocab = build_vocab(train_records, min_count=d.min_count, max_size=d.max_vocab or None, captions=kept)
    if ckpt is not None:
        model_cfg = ModelConfig.from_dict(ckpt["model_config"])
        model_cfg.encoder_pretrained = False  # the weights come from the checkpoint
    else:
        # init_from is where to start, resize belongs to the preprocessing: the rest is the model's shape.
        model_cfg = model_config(m, len(vocab))
    model = CaptionModel(model_cfg).to(device)
    if ckpt is not None:
        model.load_state_dict(ckpt["state_dict"])
    elif m.init_from:
        _init_from(model, vocab, Path(m.init_from))
    if ckpt is None and m.encoder_from:
        _encoder_from(model, m.encoder_from)
    # Dropout masks and attention samples: a different stream on each rank (rank 0 = a single run).
    torch.manual_seed(o.seed + ctx.rank)

    enc_params = [p for p in model.encoder.parameters() if p.requires_grad]
    groups = [{"params": list(model.decoder.parameters()), "lr": o.lr}]
    if enc_params:
        groups.append({"params": enc_params, "lr": o.encoder_lr})
    optimizer = build_optimizer(groups, o)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=max(1, o.lr_decay_every), gamma=o.lr_decay)
    # Self-critical training replaces the objective; the references are the training split's.
    scst = (ScstObjective(cfg.scst, vocab, [r.captions for r in train_records], seed=o.seed, rank=ctx.rank,
                          device=device) if cfg.scst.enabled else None)
    hard = (HardAttentionObjective(cfg.hard, o.doubly_stochastic, seed=o.seed, dist=ctx)
            if model_cfg.attention == "hard" and scst is None else None)
    average = WeightAverage(model, o.ema) if o.ema else None

    state = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "best": None, "bad_vals": 0, "train_seconds": 0.0}
    if ckpt is not None:
        ts = ckpt["train_state"]
        optimizer.load_state_dict(ts["optimizer"])
        scheduler.load_state_dict(ts["scheduler"])
        state.update({k: ts[k] for k in state})
        if hard is not None:
            hard.load_state_dict({"baseline": ts.get("baseline", 0.0), **ts.get("hard", {})})
        if scst is not None and "scst" in ts:  # else its samples start from here
            scst.load_state_dict(ts["scst"][ctx.rank])
        if average is not None and "weight_average" in ts:  # else the average starts from here
            average.load_state_dict(ts["weight_average"])
        rngs = ts.get("rng_per_rank") or [ts["rng"]]
        if len(rngs) != ctx.world:
            raise StartupError(f"the run was saved with {len(rngs)} processes; resume it with as many")
        _set_rng_state(rngs[ctx.rank])
        done = _finished(cfg, state)
        if done is not None:  # resuming must not take one more step (nor rewrite the run)
            if ctx.is_main:
                print(f"{run_dir} already finished ({_reason_text(done, cfg, state['step'], state['epoch'])}): "
                      "nothing to train; raise optim.max_steps, optim.max_minutes or optim.epochs with --set "
                      "to go on", file=sys.stderr)
            return TrainOutcome(run_dir, state["step"], state["epoch"], done, state["best"], state["train_seconds"])

    # The run folder: made (or, resuming, rewritten) only now that everything above is known good.
    created = ckpt is None and not run_dir.exists()

    def open_run() -> None:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.toml").write_text(to_toml(cfg))
        except OSError as e:
            if created:
                _take_back(run_dir)
            raise StartupError(f"cannot write the run folder {run_dir}: {e.strerror or e}") from e

    _on_main(ctx, open_run)
    try:
        if ctx.is_main:  # what it trains on, before the hours a feature cache may take
            _print_summary(cfg, {d.train_split: train_records, d.val_split: val_records}, vocab, kept, left_out,
                           model, device, run_dir)
        grid = None
        if d.feature_cache:
            from .features import CachedCaptionDataset, CacheSpaceError, build_cache

            cache_dir = Path(d.feature_cache_dir or run_dir)
            try:
                cache = build_cache(model, train_records, preprocess, cache_dir, ctx, workers=d.loader_workers(),
                                    progress=progress)
            except CacheSpaceError as e:
                raise RunWriteError(str(e)) from e
            except OSError as e:
                raise RunWriteError(f"cannot write the feature cache in {cache_dir}: {e.strerror or e}") from e
            dataset = CachedCaptionDataset(train_records, vocab, cache, d.max_caption_len, captions=kept)
            grid = cache.grid
        else:
            dataset = CaptionDataset(train_records, vocab, preprocess, max_len=d.max_caption_len,
                                     cache_images=d.cache_images, captions=kept)
    except BaseException:
        if created and ctx.is_main:
            _take_back(run_dir)
        raise
    net = model
    if ctx.active:
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    captioner = Captioner(model, vocab, preprocess)
    meta = {"name": cfg.name, "data": d.dir, "training_data": training_data_name(d),
            "attention": model_cfg.attention, **({"weight_average": o.ema} if average is not None else {})}
    log = open(run_dir / "metrics.jsonl", "a", encoding="utf-8") if ctx.is_main else None
    precision = MixedPrecision(o.precision, device)
    if ckpt is not None:
        precision.load_state_dict(ckpt["train_state"].get("grad_scaler"))
    if o.compile:
        model.decoder.compile_step(backend=o.compile)

    # A write that fails on rank 0 (a full disk) is kept here and raised on every rank at the
    # next step they take together, so that no rank waits for the others forever.
    failure: list[str] = []
    saved = {"step": state["step"] if ckpt is not None else None}  # the last checkpoint written whole

    def guarded(path: Path, work) -> None:
        if failure:
            return
        try:
            work()
        except OSError as e:
            failure.append(f"cannot write {path}: {e.strerror or e}")

    def stop_on_failure() -> None:
        """Every rank calls this together; all raise RunWriteError when rank 0 could not write."""
        message = ctx.broadcast(failure[0] if failure else None)
        if message is not None:
            intact = (f"the last checkpoint, {run_dir / 'last.pt'} (step {saved['step']}), is intact: make room "
                      f"and continue with --resume {run_dir}" if saved["step"] is not None
                      else "no checkpoint was written yet: make room and start again")
            raise RunWriteError(f"{message}; {intact}")

    def save_last() -> None:
        rngs = ctx.gather(_rng_state())
        samplers = ctx.gather(scst.state_dict()) if scst is not None else None
        if ctx.is_main:
            train_state = {**state, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                           "rng": rngs[0], "rng_per_rank": rngs, "config": cfg.to_dict(),
                           "grad_scaler": precision.state_dict()}
            if hard is not None:
                train_state["baseline"] = hard.baseline
                train_state["hard"] = hard.state_dict()  # the baseline and the expected-context coin
            if scst is not None:
                train_state["scst"] = samplers  # each rank's sampling generator
            if average is not None:
                train_state["weight_average"] = average.state_dict()

            def save() -> None:
                atomic_save(captioner.checkpoint(meta={**meta, "step": state["step"]}, train_state=train_state),
                            run_dir / "last.pt")
                saved["step"] = state["step"]

            guarded(run_dir / "last.pt", save)
        stop_on_failure()

    def write(record: dict) -> None:
        def append() -> None:
            log.write(json.dumps(record) + "\n")
            log.flush()

        if log is not None:
            guarded(run_dir / "metrics.jsonl", append)

    def save_best(checkpoint: dict) -> None:
        guarded(run_dir / "best.pt", lambda: atomic_save(checkpoint, run_dir / "best.pt"))

    def validate() -> bool:
        """Real decoding on the validation split (rank 0); saves best.pt; True when early stopping says stop."""
        stop_early = False
        if ctx.is_main:
            with average.applied(model) if average is not None else nullcontext():
                stop_early = _validate(cfg, captioner, val_records, karpathy, state, meta, save_best, write)
        stop_early = ctx.broadcast(stop_early)
        stop_on_failure()
        return stop_early

    reason = "finished"
    model.train()
    bar_loss = _BarLoss(o.max_minutes)
    with _StopFlag(announce=ctx.is_main) as stop:
        try:
            while state["epoch"] < o.epochs:
                batches = _epoch_batches(len(dataset), o.batch_size, o.seed, state["epoch"],
                                         [len(ids) for _, ids in dataset.items] if d.length_buckets else None)
                # This rank's share of every global batch (a final batch smaller than the world is dropped).
                todo = [b for b in batches[state["batch_in_epoch"]:] if len(b) >= ctx.world]
                mine = [b[ctx.rank::ctx.world] for b in todo]
                loader = DataLoader(dataset, batch_sampler=mine, collate_fn=collate_captions,
                                    num_workers=d.loader_workers(), pin_memory=device.type == "cuda",
                                    # Its own generator: creating a loader must not draw from the
                                    # global RNG, or a resumed run would drift from the original.
                                    generator=torch.Generator().manual_seed(o.seed + state["epoch"]))
                # Epochs counted from 1, as the validation lines count them ("epoch 1 step ...: val").
                bar = tqdm(total=len(batches), initial=state["batch_in_epoch"],
                           desc=f"epoch {state['epoch'] + 1}/{o.epochs}", unit="batch", file=sys.stderr,
                           disable=not (progress and ctx.is_main), leave=False)
                tick = time.perf_counter()
                for batch, global_batch in zip(loader, todo):
                    batch = batch.to(device, non_blocking=True)
                    inputs = Annotations(batch.images, grid) if grid is not None else batch.images
                    with precision.autocast():
                        if scst is not None:
                            parts: LossParts = scst(net, inputs, batch.image_indices)
                        elif hard is not None:
                            parts = hard(net, inputs, batch.tokens, batch.lengths, len(global_batch))
                        else:
                            parts = soft_loss(net, inputs, batch.tokens, batch.lengths, o.doubly_stochastic)
                    # DDP averages gradients over ranks; weighting each rank's mean by its share
                    # makes that the mean over the global batch even when shares differ.
                    share = len(batch.tokens) * ctx.world / len(global_batch)
                    optimizer.zero_grad(set_to_none=True)
                    precision.backward(parts.loss * share)
                    precision.step(optimizer, model.parameters(), o.grad_clip)
                    if average is not None:
                        average.update(model)
                    now = time.perf_counter()
                    state["train_seconds"] += now - tick
                    tick = now
                    state["step"] += 1
                    state["batch_in_epoch"] += 1
                    if not bar.disable:
                        bar_loss.show(bar, parts.nll, state["train_seconds"])
                    bar.update(1)
                    if state["step"] % o.log_every == 0:
                        nll = ctx.mean(parts.nll)
                        write({"step": state["step"], "epoch": state["epoch"], "nll": round(nll, 4),
                               "penalty": round(ctx.mean(parts.penalty), 4), "lr": optimizer.param_groups[0]["lr"],
                               "train_seconds": round(state["train_seconds"], 1),
                               **({"baseline": round(hard.baseline, 4)} if hard is not None else {}),
                               **({"reward": round(ctx.mean(parts.reward), 4)} if scst is not None else {}),
                               **({"grad_scale": precision.scaler.get_scale()} if precision.scaler else {})})
                        stop_on_failure()
                    if o.max_steps and state["step"] >= o.max_steps:
                        reason = "max_steps"
                    elif o.max_minutes and ctx.any(state["train_seconds"] >= 60 * o.max_minutes):
                        reason = "time_budget"
                    elif ctx.any(stop.signal is not None):
                        reason = "interrupted"
                    if reason != "finished":
                        break
                    if o.save_every and state["step"] % o.save_every == 0:
                        save_last()
                        tick = time.perf_counter()  # saving is not training time
                if not bar.disable:
                    bar.refresh()  # the epoch's last loss is seen even when steps outpace the bar
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
            if log is not None:
                try:
                    log.close()
                except OSError:  # what it still held could not be written either: already reported
                    pass
    return TrainOutcome(run_dir, state["step"], state["epoch"], reason, state["best"], state["train_seconds"])


def _print_summary(cfg: TrainConfig, splits: dict, vocab: Vocabulary, kept: TrainingCaptions,
                   unreadable: dict[str, int], model: CaptionModel, device: torch.device, run_dir: Path) -> None:
    """The start-up summary on stderr: what the run trains on, with what, where it writes."""
    from .data_cli import summary_lines

    m = model.config
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    threads = torch.get_num_threads()
    lines = summary_lines(cfg, splits, len(vocab), kept, unreadable) + [
        f"model: {m.attention} attention, {m.encoder} encoder"
        f"{' (ImageNet weights)' if m.encoder_pretrained else ''}, {total:,} parameters ({trainable:,} trained)",
        f"device: {device}, {threads} thread{'s' if threads != 1 else ''}",
        f"run folder: {run_dir}",
    ]
    print("\n".join(lines), file=sys.stderr)


def _unreadable_images(splits: dict[str, list], preprocess: Preprocess, d, ctx: DistContext,
                       progress: bool) -> dict[Path, str]:
    """Path -> why, for every image of ``splits`` that does not decode; each rank checks its share."""
    from captioner.data.check import unreadable_images

    paths = sorted({r.path for records in splits.values() for r in records})
    mine = unreadable_images(paths[ctx.rank::ctx.world], preprocess, workers=d.loader_workers(),
                             progress=progress and ctx.is_main)
    shares = ctx.gather(mine)
    return ctx.broadcast({path: why for share in shares for path, why in share.items()} if ctx.is_main else None)


LISTED = 10  # unreadable images named in the one-line error; `data check` lists them all


def _unreadable_message(unreadable: dict[Path, str]) -> str:
    named = "; ".join(f"{path} ({why})" for path, why in list(unreadable.items())[:LISTED])
    more = f"; and {len(unreadable) - LISTED:,} more" if len(unreadable) > LISTED else ""
    one = len(unreadable) == 1
    return (f"{len(unreadable):,} image{'' if one else 's'} cannot be read: {named}{more}. Replace or remove "
            f"{'it' if one else 'them'} (`captioner data check --config FILE` lists every one), or train without "
            f"{'it' if one else 'them'}: --set data.skip_unreadable=true")


def _on_main(ctx: DistContext, work) -> None:
    """``work()`` on rank 0; a StartupError there is raised on every rank, which would otherwise
    wait for rank 0 at their next step together."""
    error = None
    if ctx.is_main:
        try:
            work()
        except StartupError as e:
            error = str(e)
    error = ctx.broadcast(error)
    if error is not None:
        raise StartupError(error)


def _take_back(run_dir: Path) -> None:
    """Undo a new run's start-up: what it wrote goes (the folder too, when that leaves it empty),
    but a complete feature cache stays, for the next attempt to use."""
    keep = set()
    for meta in run_dir.glob("features-*.json"):
        try:
            complete = json.loads(meta.read_text()).get("complete")
        except (OSError, ValueError):
            complete = False
        if complete:
            keep |= {meta, meta.with_suffix(".f16")}
    for path in run_dir.iterdir() if run_dir.is_dir() else ():
        if path not in keep:
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    try:
        run_dir.rmdir()
    except OSError:  # not empty (a cache kept), or gone already
        pass


def _finished(cfg: TrainConfig, state: dict) -> str | None:
    """Why a run in this state has nothing left to train under ``cfg``, or None."""
    o, v = cfg.optim, cfg.val
    if o.max_steps and state["step"] >= o.max_steps:
        return "max_steps"
    if o.max_minutes and state["train_seconds"] >= 60 * o.max_minutes:
        return "time_budget"
    if state["epoch"] >= o.epochs:
        return "finished"
    if v.patience > 0 and state["bad_vals"] >= v.patience:
        return "early_stop"
    return None


def _init_from(model: CaptionModel, vocab: Vocabulary, path: Path) -> None:
    """Copy another checkpoint's weights: same sizes and the same vocabulary required
    (the attention mode may differ: soft and hard attention share every parameter)."""
    try:
        src = load_checkpoint(path)
    except CheckpointError as e:
        raise StartupError(f"model.init_from: {e}") from e
    if list(src["vocab"]) != vocab.words:
        raise StartupError(f"{path} has a different vocabulary; it cannot initialise this run")
    try:
        model.load_state_dict(src["state_dict"])
    except RuntimeError as e:
        raise StartupError(f"{path} does not fit this model: {e}") from e


def _encoder_from(model: CaptionModel, name: str) -> None:
    """Copy only the encoder's weights of another checkpoint (a bundled model's name or a
    path); the decoder keeps its fresh initialisation. The encoders must be the same."""
    try:
        src = load_checkpoint(resolve_weights(name))
    except CheckpointError as e:
        raise StartupError(f"model.encoder_from: {e}") from e
    theirs = src["model_config"].get("encoder")
    if theirs != model.config.encoder:
        raise StartupError(f"model.encoder_from: {name} has the encoder {theirs!r}, this model "
                           f"{model.config.encoder!r}")
    weights = {k.removeprefix("encoder."): v for k, v in src["state_dict"].items() if k.startswith("encoder.")}
    try:
        model.encoder.load_state_dict(weights)
    except RuntimeError as e:
        raise StartupError(f"model.encoder_from: {name}'s encoder does not fit this model: {e}") from e


def figure(value: float) -> str:
    """A validation figure as a reader takes it in: four decimals, or three digits when smaller
    than that shows (3.83e-13, not 3.829206137800792e-13 nor a 0.0000 that looks like nothing)."""
    return f"{value:.4f}" if value == 0 or abs(value) >= 1e-4 else f"{value:.2e}"


def _reason_text(reason: str, cfg: TrainConfig, step: int, epoch: int) -> str:
    """Why a run stopped and where it is, e.g. "stopped at optim.max_steps = 3: step 3, 1 of 30 epochs done"."""
    o, v = cfg.optim, cfg.val
    where = f"step {step:,}, {epoch} of {o.epochs} epoch{'s' if o.epochs != 1 else ''} done"
    why = {"finished": "finished every epoch",
           "max_steps": f"stopped at optim.max_steps = {o.max_steps:,}",
           "time_budget": f"stopped at optim.max_minutes = {o.max_minutes:g}",
           "early_stop": f"stopped early: val {v.metric} did not improve in {v.patience} validations (val.patience)",
           "interrupted": "interrupted, saved"}.get(reason, reason)
    return f"{why}: {where}"


def outcome_line(outcome: TrainOutcome, cfg: TrainConfig) -> str:
    """The line `captioner train` ends with."""
    best = ("no validation yet" if outcome.best_metric is None
            else f"best val {cfg.val.metric} {figure(outcome.best_metric)} (best.pt)")
    resume = f"; continue with --resume {outcome.run_dir}" if outcome.reason == "interrupted" else ""
    return (f"{_reason_text(outcome.reason, cfg, outcome.step, outcome.epoch)}; {best}; "
            f"run folder {outcome.run_dir}{resume}")


def validation_value(metric: str, figures: dict) -> float:
    """The figure named by ``val.metric``: one name, or ``min:A,B,...`` for the smallest of several."""
    names = [n.strip() for n in metric.removeprefix("min:").split(",")] if metric.startswith("min:") else [metric]
    missing = [repr(n) for n in names if n not in figures]
    if missing:
        raise ValueError(f"validation metric {metric!r}: {', '.join(missing)} not among {sorted(figures)}")
    # None: nothing to score (no word named an object, say): the worst figure, not a crash.
    return min(0.0 if figures[n] is None else float(figures[n]) for n in names)


def _validate(cfg: TrainConfig, captioner: Captioner, val_records, karpathy, state: dict, meta: dict,
              save_best, write) -> bool:
    model = captioner.model
    model.eval()
    report = evaluate(captioner, cfg.data.dir, cfg.data.val_split, karpathy=karpathy, records=val_records,
                      options=DecodeOptions(beam_size=cfg.val.beam_size, max_len=cfg.val.max_len),
                      limit=cfg.val.limit or None, meteor=False, progress=False)
    model.train()
    value = validation_value(cfg.val.metric, {**report.metrics, **(report.grounding or {})})
    previous = state["best"]
    improved = previous is None or value > previous
    if improved:
        state["best"], state["bad_vals"] = value, 0
        save_best(captioner.checkpoint(meta={**meta, "step": state["step"], "epoch": state["epoch"],
                                             f"val_{cfg.val.metric}": value,
                                             "train_seconds": round(state["train_seconds"], 1)}))
        verdict = ("first validation" if previous is None else f"up from {figure(previous)}") + ": saved as best.pt"
    else:
        state["bad_vals"] += 1
        verdict = f"best so far {figure(previous)}"
    write({"step": state["step"], "epoch": state["epoch"], "val": report.metrics,
           "grounding": report.grounding, "improved": improved})
    print(f"epoch {state['epoch']} step {state['step']}: val {cfg.val.metric} {figure(value)} ({verdict})",
          file=sys.stderr)
    return cfg.val.patience > 0 and state["bad_vals"] >= cfg.val.patience


def build_optimizer(groups: list[dict], o) -> torch.optim.Optimizer:
    """The optimizer named by ``o.optimizer`` (an ``OptimConfig``) over parameter groups."""
    # Adam and SGD as one fused kernel over each parameter (CPU and CUDA): the for-each-
    # parameter form makes some ten passes over every weight, and at COCO sizes (21M decoder
    # weights) that was about 5% of a CPU training step. Same updates up to float rounding.
    if o.optimizer == "adam":
        return torch.optim.Adam(groups, weight_decay=o.weight_decay, fused=True)
    if o.optimizer == "sgd":
        return torch.optim.SGD(groups, momentum=0.9, weight_decay=o.weight_decay, fused=True)
    if o.optimizer == "rmsprop":
        # Graves' centred RMSProp with momentum, the form of the authors' rmsprop() (the paper's
        # choice for Flickr8k): averages decaying by 0.95, epsilon 1e-4, momentum 0.9.
        return torch.optim.RMSprop(groups, alpha=0.95, eps=1e-4, momentum=0.9, centered=True,
                                   weight_decay=o.weight_decay)
    raise ValueError(f"optim.optimizer must be adam, rmsprop or sgd, got {o.optimizer!r}")
