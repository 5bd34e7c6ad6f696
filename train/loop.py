"""The training loop: resumable exactly, interruptible cleanly, checkpoints written atomically.

A run folder holds ``config.toml`` (the resolved config), ``metrics.jsonl`` (one JSON
object per log line and per validation), ``last.pt`` (model + everything needed to
continue: optimiser, scheduler, RNG, position in the epoch) and ``best.pt`` (the model
with the best validation score, from real decoding).

A run in its parts, in the order ``train`` takes them: ``build_run`` (data, model, optimiser,
objectives: a ``Run``), ``restore`` (resuming: a ``TrainState`` and the saved states put
back), ``open_run`` (the run folder, the training set), then ``run_epochs``: ``run_epoch``
after ``run_epoch``, with ``validate`` (best.pt) and ``save`` (last.pt) at each epoch's end;
at a finished run's end, ``record_familiarity`` adds the training images' features to both.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, fields, make_dataclass, replace
from datetime import datetime
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from captioner.data.coco import ImageRecord
from captioner.data.images import Preprocess
from captioner.distributed import DeviceError, DistContext, setup, teardown, work_done
from captioner.evaluation.evaluate import evaluate
from captioner.inference import Captioner, DecodeOptions
from captioner.io.checkpoint import POSITION, Checkpoint, TrainingState, atomic_save, load_checkpoint
from captioner.model import kernels
from captioner.model.decoder import CaptionModel
from captioner.model.encoders import Annotations
from captioner.model.familiarity import MIN_IMAGES, TrainingFeatures, training_features

from .averaging import WeightAverage, same_encoder
from .captions import CaptionDataset, TrainingCaptions, collate_captions, training_captions
from .config import GROUNDING_FIGURES, TrainConfig, metric_parts, to_toml
from .datainfo import DataSet, load_dataset, summary_lines
from .graphed import GraphedSoftStep, graphs_apply
from .losses import LossParts, soft_loss
from .objectives import Objective, choose_objective
from .precision import MixedPrecision
from .startup import StartupError, data_tokenizer, new_model, on_main, prepare_data, readable_splits, take_back
from .tensorboard import Board, NoBoard, open_board


class RunWriteError(Exception):
    """A write to the run folder failed (a full disk, say). The message names the file and the
    last checkpoint, which is intact: checkpoints are written to a temporary file, then renamed."""


@dataclass
class TrainOutcome:
    run_dir: Path
    step: int
    epoch: int
    reason: str  # finished | max_steps | time_budget | early_stop | interrupted
    best_metric: float | None  # best.pt's validation figure
    train_seconds: float
    chosen: bool = True  # best.pt chosen by its figure; False: validation too small (val.min_images), the last


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
    written into the bar at most once a second), and the time left of ``optim.max_minutes``.
    Self-critical training shows its samples' mean reward instead: what it climbs (the
    samples' NLL it would show falls as sampling sharpens, whatever the captions' quality)."""

    LABEL = "nll (recent mean)"  # a moving average over about the last ten steps, and it says so

    def __init__(self, max_minutes: float, average: float | None = None) -> None:
        self.max_minutes = max_minutes
        self.average: float | torch.Tensor | None = average  # a resumed run's, from its last.pt
        self.shown_at = float("-inf")
        self.bar: tqdm | None = None

    def show(self, bar: tqdm, parts: LossParts, train_seconds: float) -> None:
        label, value = (self.LABEL, parts.nll) if parts.reward is None else ("reward", parts.reward)
        # A (detached) tensor stays on the device: only the text, once a second, waits for it.
        self.average = value if self.average is None else 0.9 * self.average + 0.1 * value
        now = time.monotonic()
        if now - self.shown_at < 1.0 and bar is self.bar:  # a new epoch's bar gets it at once
            return
        self.shown_at, self.bar = now, bar
        text = f"{label}={float(self.average):.2f}"
        if self.max_minutes:
            left = max(0, round(60 * self.max_minutes - train_seconds))
            clock = f"{left // 3600}:{left // 60 % 60:02d}:{left % 60:02d}" if left >= 3600 \
                else f"{left // 60:02d}:{left % 60:02d}"
            text += f", budget left {clock}"  # tqdm's own estimate is for this epoch only
        bar.set_postfix_str(text, refresh=False)


def _rng_state(device: torch.device) -> dict:
    """This process's random state: the CPU's, Python's and, on a GPU, that GPU's (the one it
    trains on, not every visible one: a resume may see fewer)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> list[str]:
    """Restore what fits this process's devices (``state``: ``TrainingState.rng_of`` this rank
    and device); returns what could not be restored, in words."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    saved = state.get("cuda")
    if device.type == "cuda":
        if saved is None:
            return ["the GPU's random state (none was saved for it: the run was saved on the CPU or on "
                    "another GPU)"]
        torch.cuda.set_rng_state(saved, device)
    elif saved is not None:
        return ["the GPU's random state (resumed on the CPU)"]
    return []


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


# Where a run is, as training moves it on: checkpoint.TrainingState's position fields
# (checkpoint.POSITION, declared and documented there once), here as a mutable record. Saved with
# every last.pt (``train_state``, beside the optimiser's, the scheduler's and the random states)
# and restored from it, so that --resume goes on exactly.
TrainState = make_dataclass("TrainState", [(f.name, f.type, field(default=f.default))
                                           for f in fields(TrainingState) if f.name in POSITION])


@dataclass
class Run:
    """What a run trains with: made by ``build_run``; ``open_run`` adds the training set and the
    run folder's files."""

    cfg: TrainConfig
    run_dir: Path
    ctx: DistContext
    progress: bool
    preprocess: Preprocess
    data: DataSet  # its training and validation splits with readable images only
    left_out: dict[str, int]  # split -> images left out as unreadable
    kept: TrainingCaptions
    model: CaptionModel
    captioner: Captioner
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.StepLR
    precision: MixedPrecision
    objective: Objective  # soft, hard (REINFORCE) or self-critical: chosen once (objectives.py)
    average: WeightAverage | None
    meta: dict  # what every checkpoint of the run says about it
    net: torch.nn.Module | None = None  # the model, under DistributedDataParallel with several ranks
    dataset: Dataset | None = None
    grid: tuple[int, int] | None = None  # the annotations' grid, when they come from the feature cache
    files: RunFiles | None = None
    board: Board | NoBoard = field(default_factory=NoBoard)  # TensorBoard's event files (tensorboard.py)
    graphed: GraphedSoftStep | None = None  # the step as CUDA graphs, where it may run (graphed.py)
    channels_last: bool = False  # the encoder and its images in NHWC memory (kernels.channels_last_ok)

    @property
    def train_records(self) -> list[ImageRecord]:
        return self.data.splits[self.cfg.data.train_split]

    @property
    def val_records(self) -> list[ImageRecord]:
        return self.data.splits[self.cfg.data.val_split]

    @property
    def val_images(self) -> int:
        """The images a validation scores: the split's, or its first ``val.limit``."""
        n, limit = len(self.val_records), self.cfg.val.limit
        return min(n, limit) if limit else n

    @property
    def val_chooses(self) -> bool:
        """Validation scores enough images (``val.min_images``) for its figure to choose best.pt
        and stop the run early: a caption metric over a handful of images moves by chance."""
        return self.val_images >= self.cfg.val.min_images


class RunFiles:
    """The run folder's writes: metrics.jsonl (rank 0 only), last.pt and best.pt.

    A write that fails on rank 0 (a full disk) is kept here and raised on every rank at the
    next step they take together (``stop_on_failure``), so that no rank waits for the others
    forever."""

    def __init__(self, run_dir: Path, ctx: DistContext, saved_step: int | None) -> None:
        self.run_dir, self.ctx = run_dir, ctx
        self.log = open(run_dir / "metrics.jsonl", "a", encoding="utf-8") if ctx.is_main else None
        self.failure: str | None = None
        self.saved_step = saved_step  # the step of the last checkpoint written whole

    def guarded(self, path: Path, work) -> None:
        if self.failure is not None:
            return
        try:
            work()
        except OSError as e:
            self.failure = f"cannot write {path}: {e.strerror or e}"

    def stop_on_failure(self) -> None:
        """Every rank calls this together; all raise RunWriteError when rank 0 could not write."""
        message = self.ctx.broadcast(self.failure)
        if message is not None:
            last = self.run_dir / "last.pt"
            intact = (f"the last checkpoint, {last} (step {self.saved_step}), is intact: make room and continue "
                      f"with --resume {self.run_dir}" if self.saved_step is not None
                      else "no checkpoint was written yet: make room and start again")
            raise RunWriteError(f"{message}; {intact}")

    def write(self, record: dict) -> None:
        """One line of metrics.jsonl."""
        def append() -> None:
            self.log.write(json.dumps(record) + "\n")
            self.log.flush()

        if self.log is not None:
            self.guarded(self.run_dir / "metrics.jsonl", append)

    def save_last(self, checkpoint: Checkpoint, step: int) -> None:
        def save() -> None:
            atomic_save(checkpoint.to_dict(), self.run_dir / "last.pt")
            self.saved_step = step

        self.guarded(self.run_dir / "last.pt", save)

    def save_best(self, checkpoint: Checkpoint) -> None:
        self.guarded(self.run_dir / "best.pt", lambda: atomic_save(checkpoint.to_dict(), self.run_dir / "best.pt"))

    def close(self) -> None:
        if self.log is not None:
            try:
                self.log.close()
            except OSError:  # what it still held could not be written either: already reported
                pass


def train(cfg: TrainConfig | None, run_dir: Path, *, resume: bool = False, progress: bool = True,
          last: Checkpoint | None = None, data: DataSet | None = None) -> TrainOutcome:
    """Train into ``run_dir``; with ``resume``, continue from ``run_dir/last.pt`` exactly
    (``last``: that file's contents, when the caller has read it already: a COCO run's last.pt
    with its optimiser state is large; ``data``: the config's data, when the caller has read it:
    COCO's annotations take seconds to parse).

    Under torchrun every rank calls this: each trains on its share of every global batch
    (DistributedDataParallel averages the gradients), rank 0 validates and writes."""
    ckpt = None
    if resume:
        ckpt = last if last is not None else load_checkpoint(run_dir / "last.pt")
        if ckpt.train_state is None:
            raise ValueError(f"{run_dir / 'last.pt'} has no training state to resume from")
        cfg = cfg if cfg is not None else TrainConfig.from_dict(ckpt.train_state.config)
    assert cfg is not None
    try:
        ctx = setup(cfg.optim.device)
    except DeviceError as e:
        raise StartupError(str(e)) from None
    try:
        outcome = _train(cfg, run_dir, ckpt, ctx, progress, data)
        work_done(ctx)  # every rank saved, or stopped on the same error: each ends with its own code
        return outcome
    except (StartupError, RunWriteError):
        work_done(ctx)
        raise
    finally:
        teardown(ctx)


def _train(cfg: TrainConfig, run_dir: Path, ckpt: Checkpoint | None, ctx: DistContext, progress: bool,
           data: DataSet | None) -> TrainOutcome:
    run = build_run(cfg, run_dir, ckpt, ctx, progress, data)
    state = TrainState()
    if ckpt is not None:
        state = restore(run, ckpt)
        done = _finished(cfg, state)
        if done is not None:  # resuming must not take one more step (nor rewrite the run)
            if ctx.is_main:
                print(f"{run_dir} already finished ({_reason_text(done, cfg, state.step, state.epoch)}): "
                      f"nothing to train; {_go_on(done, run_dir)}", file=sys.stderr)
            return TrainOutcome(run_dir, state.step, state.epoch, done, state.best, state.train_seconds,
                                run.val_chooses)
    open_run(run, resumed_at=state.step if ckpt is not None else None, train_seconds=state.train_seconds)
    reason = run_epochs(run, state)
    if reason != "interrupted" and ctx.is_main:
        record_familiarity(run)
    return TrainOutcome(run_dir, state.step, state.epoch, reason, state.best, state.train_seconds, run.val_chooses)


def record_familiarity(run: Run) -> None:
    """Add to best.pt and last.pt their training images' features (captioner.model.familiarity),
    each through its own encoder (best.pt's may be an earlier one), and to last.pt's weight
    average, where the run keeps one, the record of the averaged encoder (the weights a
    finished run is scored and shipped with, studies/attention/checkpoints.py): what the familiarity of an
    image is measured against. With the feature cache (a frozen encoder) the features are the
    cache's, pooled (fp16 annotations, so within fp16 rounding of encoding the images again),
    not the images encoded once more. A write that fails leaves the checkpoint as it was; with
    too few training images to describe, the checkpoints stay without it, and it says so."""
    if len(run.train_records) < MIN_IMAGES:
        print(f"no familiarity record: {len(run.train_records)} training image"
              f"{'s' if len(run.train_records) != 1 else ''}, it needs at least {MIN_IMAGES}", file=sys.stderr)
        return
    data = f"{run.meta['training_data']}, split {run.cfg.data.train_split}, {len(run.train_records)} images"
    done: list[tuple[dict, TrainingFeatures]] = []  # (state dict, record): one pass per distinct encoder

    def record_of(ckpt: Checkpoint, state: dict) -> TrainingFeatures:
        found = next((r for e, r in done if same_encoder(e, state)), None)
        if found is not None:
            return found
        cache = getattr(run.dataset, "cache", None)  # the feature cache of the run's frozen encoder
        if cache is not None and same_encoder(state, run.model.state_dict()):
            from .features import cache_features

            found = TrainingFeatures.fit(cache_features(cache), data=data)
        else:
            cap = Captioner.from_checkpoint(replace(ckpt, state_dict=state), run.ctx.device)
            found = training_features(cap, run.train_records, data=data, progress=run.progress,
                                      workers=run.cfg.data.loader_workers())
        done.append((state, found))
        return found

    for path in (run.run_dir / "best.pt", run.run_dir / "last.pt"):
        if not path.is_file():
            continue
        ckpt = load_checkpoint(path)
        ckpt = replace(ckpt, familiarity=record_of(ckpt, ckpt.state_dict))
        ts = ckpt.train_state
        if ts is not None and ts.weight_average is not None:
            average = replace(ts.weight_average, familiarity=record_of(ckpt, ts.weight_average.tensors))
            ckpt = replace(ckpt, train_state=replace(ts, weight_average=average))
        try:
            atomic_save(ckpt.to_dict(), path)
        except OSError as e:
            print(f"could not add the familiarity record to {path} ({e.strerror or e}); `captioner familiarity` "
                  "adds it later", file=sys.stderr)


def build_run(cfg: TrainConfig, run_dir: Path, ckpt: Checkpoint | None, ctx: DistContext, progress: bool,
              data: DataSet | None = None) -> Run:
    """The data (``data`` as the caller read it, else read here, after generating shapes), the model
    (fresh, from ``model.init_from`` / ``encoder_from``, or the checkpoint's when resuming), the
    optimiser and the objectives; nothing written yet."""
    d, o = cfg.data, cfg.optim
    if o.threads > 0:
        torch.set_num_threads(o.threads)
    torch.manual_seed(o.seed)  # the same initial weights on every rank
    random.seed(o.seed)
    if ctx.is_main:
        prepare_data(cfg)
    ctx.barrier()

    data = data if data is not None else load_dataset(d)
    preprocess, data, left_out = readable_splits(cfg, data, ctx, progress)
    tokenizer = data_tokenizer(data, ckpt)
    kept = training_captions(data.splits[d.train_split], d.max_caption_len, tokenizer)
    if ckpt is not None:  # resuming: the checkpoint's model and vocabulary
        resumed = Captioner.from_checkpoint(ckpt, ctx.device)
        model, vocab = resumed.model.train(), resumed.vocab
    else:
        model, vocab = new_model(cfg, kept, ctx.device, tokenizer)
    # Dropout masks and attention samples: a different stream on each rank (rank 0 = a single run).
    torch.manual_seed(o.seed + ctx.rank)

    enc_params = [p for p in model.encoder.parameters() if p.requires_grad]
    groups = [{"params": list(model.decoder.parameters()), "lr": o.lr}]
    if enc_params:
        groups.append({"params": enc_params, "lr": o.encoder_lr})
    optimizer = build_optimizer(groups, o)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=max(1, o.lr_decay_every), gamma=o.lr_decay)
    # Self-critical training's references are the training split's.
    objective = choose_objective(cfg, model.config.attention, vocab, [r.captions for r in data.splits[d.train_split]],
                                 ctx)
    average = WeightAverage(model, o.ema) if o.ema else None
    # "run": the run folder's name, which names its best.pt and last.pt (captioner.io.loading.checkpoint_name).
    m = cfg.model
    start = m.init_from or m.encoder_from
    meta = {"name": cfg.name, "run": run_dir.name, "data": d.dir, "training_data": data.name,
            # where the encoder's weights came from, for the model card
            "encoder_weights": "pretrained on ImageNet" if m.encoder_pretrained
            else f"from {Path(start).name}" if start else "random",
            "max_caption_len": d.max_caption_len,  # decoding's default length limit (Captioner.max_len)
            "attention": model.config.attention, **({"weight_average": o.ema} if average is not None else {})}
    return Run(cfg=cfg, run_dir=run_dir, ctx=ctx, progress=progress, preprocess=preprocess, data=data,
               left_out=left_out, kept=kept, model=model, captioner=Captioner(model, vocab, preprocess),
               optimizer=optimizer, scheduler=scheduler, precision=MixedPrecision(o.precision, ctx.device),
               objective=objective, average=average, meta=meta)


def restore(run: Run, ckpt: Checkpoint) -> TrainState:
    """Put the optimiser, the scheduler, the objectives' and the random states back as
    ``ckpt`` (a last.pt) holds them; the run's position."""
    ts, ctx = ckpt.train_state, run.ctx
    run.optimizer.load_state_dict(ts.optimizer)
    run.scheduler.load_state_dict(ts.scheduler)
    state = TrainState(**{name: getattr(ts, name) for name in POSITION})
    lost = run.objective.restore(ts, ctx.rank)
    if run.average is not None and ts.weight_average is not None:  # else the average starts from here
        run.average.load(ts.weight_average)
    run.precision.load_state_dict(ts.grad_scaler)
    if len(ts.rng_per_rank) != ctx.world:
        raise StartupError(f"the run was saved with {len(ts.rng_per_rank)} processes; resume it with as many")
    lost = _set_rng_state(ts.rng_of(ctx.rank, ctx.device), ctx.device) + lost
    if lost and ctx.is_main:
        print(f"resume: not restored, so the run's random draws differ from here on: {'; '.join(lost)}",
              file=sys.stderr)
    return state


def open_run(run: Run, resumed_at: int | None, train_seconds: float = 0.0) -> None:
    """Write the run folder's config.toml (made, or resuming rewritten, only now that everything
    above is known good), say what the run trains on, and make the training set (with the feature
    cache, building it if need be). A new run's folder is taken back if this fails.
    ``resumed_at``: the step of the checkpoint resumed from, None for a new run; ``train_seconds``:
    the run's training time there."""
    cfg, ctx, run_dir = run.cfg, run.ctx, run.run_dir
    created = resumed_at is None and not run_dir.exists()

    def write_config() -> None:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.toml").write_text(to_toml(cfg))
        except OSError as e:
            if created:
                take_back(run_dir)
            raise StartupError(f"cannot write the run folder {run_dir}: {e.strerror or e}") from e

    on_main(ctx, write_config)
    try:
        if ctx.is_main:  # what it trains on, before the hours a feature cache may take
            _print_summary(run)
        run.dataset, run.grid = _training_set(run)
    except BaseException:
        if created and ctx.is_main:
            take_back(run_dir)
        raise
    run.channels_last = run.grid is None and kernels.channels_last_ok(ctx.device, run.precision.dtype)
    if run.channels_last:  # before DDP takes the parameters' layout for its buckets
        run.model.encoder.to(memory_format=torch.channels_last)
    optimizer_state_like_params(run.optimizer)
    run.net = run.model
    if ctx.active:
        from torch.nn.parallel import DistributedDataParallel

        device = ctx.device
        run.net = DistributedDataParallel(run.model, device_ids=[device.index] if device.type == "cuda" else None)
    run.files = RunFiles(run_dir, ctx, resumed_at)
    run.board = open_board(run_dir, enabled=cfg.log.tensorboard, main=ctx.is_main, resumed_at=resumed_at,
                           figure_images=run.val_records[:cfg.log.tensorboard_images], train_seconds=train_seconds)
    if cfg.optim.compile:
        run.model.decoder.compile_step(backend=cfg.optim.compile)
    run.graphed = _graphed_step(run)


def optimizer_state_like_params(optimizer: torch.optim.Optimizer) -> None:
    """Each optimiser state tensor of a parameter's shape in that parameter's memory layout. A
    run resumed with another layout (channels-last on one GPU, not on another device or with
    the kernels off) would otherwise hand a fused optimiser a state laid out unlike its
    parameter, which a GPU's fused kernels read element by element in memory order."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            for name, value in list(state.items()):
                if torch.is_tensor(value) and value.shape == p.shape and value.stride() != p.stride():
                    state[name] = torch.empty_like(p, dtype=value.dtype).copy_(value)


def _graphed_step(run: Run) -> GraphedSoftStep | None:
    """The training step as CUDA graphs (graphed.py) where it may run, else None; a run on a GPU
    says which it takes, and why not the graphs."""
    o, ctx = run.cfg.optim, run.ctx
    why_not = graphs_apply(device=ctx.device, objective=run.objective.name, distributed=ctx.active,
                           precision=run.precision.name, compiled=bool(o.compile), enabled=o.cuda_graphs)
    if ctx.is_main and ctx.device.type == "cuda":
        print(f"training step: {'CUDA graphs' if why_not is None else f'plain, not CUDA graphs ({why_not})'}",
              file=sys.stderr)
    if why_not is not None:
        return None
    dtype, lam = run.precision.dtype, o.doubly_stochastic

    def loss(inputs, tokens, lengths, steps):
        return soft_loss(run.net, inputs, tokens, lengths, lam, steps=steps)

    def autocast():  # a graph cannot hold autocast's cache of cast weights
        return torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None, cache_enabled=False)

    return GraphedSoftStep(loss, [p for p in run.model.parameters() if p.requires_grad], autocast)


def _training_set(run: Run) -> tuple[Dataset, tuple[int, int] | None]:
    """The training captions with their images, or with their annotations from the feature
    cache (and then the annotations' grid)."""
    d, vocab = run.cfg.data, run.captioner.vocab
    if not d.feature_cache:
        return CaptionDataset(run.train_records, vocab, run.preprocess, max_len=d.max_caption_len,
                              cache_images=d.cache_images, captions=run.kept), None
    from .features import CachedCaptionDataset, CacheSpaceError, build_cache

    cache_dir = Path(d.feature_cache_dir or run.run_dir)
    try:
        cache = build_cache(run.model, run.train_records, run.preprocess, cache_dir, run.ctx,
                            workers=d.loader_workers(), progress=run.progress)
    except CacheSpaceError as e:
        raise RunWriteError(str(e)) from e
    except OSError as e:
        raise RunWriteError(f"cannot write the feature cache in {cache_dir}: {e.strerror or e}") from e
    return CachedCaptionDataset(run.train_records, vocab, cache, d.max_caption_len, captions=run.kept), cache.grid


def run_epochs(run: Run, state: TrainState) -> str:
    """Train epoch after epoch from ``state`` until the last epoch or a limit, validating and
    saving at each epoch's end; the reason it stopped (see TrainOutcome)."""
    o, v = run.cfg.optim, run.cfg.val
    reason = "finished"
    run.model.train()
    bar_loss = _BarLoss(o.max_minutes, state.shown_loss)
    with _StopFlag(announce=run.ctx.is_main) as stop:
        try:
            while state.epoch < o.epochs:
                stopped = run_epoch(run, state, stop, bar_loss)
                if stopped is not None:
                    reason = stopped
                    break
                state.epoch += 1
                state.batch_in_epoch = 0
                run.scheduler.step()
                early = v.every_epochs > 0 and state.epoch % v.every_epochs == 0 and validate(run, state)
                save(run, state, bar_loss)
                if early:
                    reason = "early_stop"
                    break
            # A run that ends before its first validation still leaves a best.pt, and one that stops
            # between validations (a step or time limit) has its final weights validated too.
            final_unseen = v.every_epochs > 0 and state.validated_at != state.step
            if reason != "interrupted" and (state.best is None or final_unseen):
                validate(run, state)
            save(run, state, bar_loss)
        finally:
            run.files.close()
            run.board.close()
    return reason


def run_epoch(run: Run, state: TrainState, stop: _StopFlag, bar_loss: _BarLoss) -> str | None:
    """The rest of the epoch ``state`` is in, step by step, saving every ``optim.save_every``
    steps; the reason the run stops within it (a limit, a signal), or None at its end."""
    cfg, ctx, o = run.cfg, run.ctx, run.cfg.optim
    lengths = [len(ids) for _, ids in run.dataset.items] if cfg.data.length_buckets else None
    batches = _epoch_batches(len(run.dataset), o.batch_size, o.seed, state.epoch, lengths)
    # This rank's share of every global batch (a final batch smaller than the world is dropped).
    todo = [b for b in batches[state.batch_in_epoch:] if len(b) >= ctx.world]
    mine = [b[ctx.rank::ctx.world] for b in todo]
    loader = DataLoader(run.dataset, batch_sampler=mine, collate_fn=collate_captions,
                        num_workers=cfg.data.loader_workers(), pin_memory=ctx.device.type == "cuda",
                        # Its own generator: creating a loader must not draw from the
                        # global RNG, or a resumed run would drift from the original.
                        generator=torch.Generator().manual_seed(o.seed + state.epoch))
    # Epochs counted from 1, as the validation lines count them ("epoch 1 step ...: val").
    bar = tqdm(total=len(batches), initial=state.batch_in_epoch, desc=f"epoch {state.epoch + 1}/{o.epochs}",
               unit="batch", file=sys.stderr, disable=not (run.progress and ctx.is_main), leave=False)
    reason = None
    tick = time.perf_counter()
    for batch, global_batch in zip(loader, todo):
        parts = _train_step(run, batch, len(global_batch))
        now = time.perf_counter()
        state.train_seconds += now - tick
        tick = now
        state.step += 1
        state.batch_in_epoch += 1
        run.board.took(len(global_batch))
        if not bar.disable:
            bar_loss.show(bar, parts, state.train_seconds)
        bar.update(1)
        if state.step % o.log_every == 0:
            _log_step(run, state, parts)
        reason = _stop_reason(run, state, stop)
        if reason is not None:
            break
        if o.save_every and state.step % o.save_every == 0:
            save(run, state, bar_loss)
            tick = time.perf_counter()  # saving is not training time
    if not bar.disable:
        bar.refresh()  # the epoch's last loss is seen even when steps outpace the bar
    bar.close()
    return reason


def _train_step(run: Run, batch, global_size: int) -> LossParts:
    """One optimiser step on this rank's share of a global batch of ``global_size`` captions."""
    o, ctx, precision = run.cfg.optim, run.ctx, run.precision
    batch = batch.to(ctx.device, non_blocking=True)
    inputs = Annotations(batch.images, run.grid) if run.grid is not None else batch.images
    if run.channels_last:  # the encoder's weights are (open_run); kernels.channels_last_ok
        inputs = inputs.contiguous(memory_format=torch.channels_last)
    # DDP averages gradients over ranks; weighting each rank's mean by its share
    # makes that the mean over the global batch even when shares differ.
    share = len(batch.tokens) * ctx.world / global_size
    parts = None
    if run.graphed is not None and share == 1:  # the same forward and backward, replayed (graphed.py)
        parts = run.graphed.step(inputs, batch.tokens, batch.lengths)
    if parts is None:
        with precision.autocast():
            parts = run.objective.loss(run.net, inputs, batch, global_size)
        run.optimizer.zero_grad(set_to_none=True)
        precision.backward(parts.loss * share)
        # Nothing keeps the step's autograd graph alive past it: a CUDA graph captured later
        # (graphed.py) must not meet this step's gradient accumulators.
        parts = replace(parts, loss=parts.loss.detach())
    precision.step(run.optimizer, run.model.parameters(), o.grad_clip)
    if run.average is not None:
        run.average.update(run.model)
    return parts


def _log_step(run: Run, state: TrainState, parts: LossParts) -> None:
    """A training line of metrics.jsonl, its figures averaged over the ranks (all ranks call this)."""
    ctx, scaler = run.ctx, run.precision.scaler
    nll = ctx.mean(float(parts.nll))
    lrs = [group["lr"] for group in run.optimizer.param_groups]
    record = {"step": state.step, "epoch": state.epoch, "loss": round(ctx.mean(float(parts.loss)), 4),
              "nll": round(nll, 4), "penalty": round(ctx.mean(float(parts.penalty)), 4), "lr": lrs[0],
              "train_seconds": round(state.train_seconds, 1), **run.objective.log_fields(parts, ctx),
              **({"grad_scale": scaler.get_scale()} if scaler else {})}
    run.files.write(record)
    run.board.training(state.step, record, lrs, state.train_seconds)
    run.files.stop_on_failure()


def _stop_reason(run: Run, state: TrainState, stop: _StopFlag) -> str | None:
    """Why the run stops after this step, or None; the same answer on every rank."""
    o, ctx = run.cfg.optim, run.ctx
    if o.max_steps and state.step >= o.max_steps:
        return "max_steps"
    # One collective for both flags (each one waits for every rank and, on GPUs, the device).
    out_of_time, signalled = ctx.any_of(bool(o.max_minutes) and state.train_seconds >= 60 * o.max_minutes,
                                        stop.signal is not None)
    if out_of_time:
        return "time_budget"
    if signalled:
        return "interrupted"
    return None


def save(run: Run, state: TrainState, bar_loss: _BarLoss | None = None) -> None:
    """last.pt: the model and everything needed to go on exactly (all ranks call this: each
    rank's random state and SCST sampler are gathered to rank 0, which writes), the progress
    bar's moving average (``bar_loss``) included."""
    ctx = run.ctx
    if bar_loss is not None and bar_loss.average is not None:
        state.shown_loss = float(bar_loss.average)
    rngs = ctx.gather(_rng_state(ctx.device))
    objective = run.objective.save(ctx)
    if ctx.is_main:
        train_state = TrainingState(config=run.cfg.to_dict(), **asdict(state), optimizer=run.optimizer.state_dict(),
                                    scheduler=run.scheduler.state_dict(), rng_per_rank=tuple(rngs),
                                    grad_scaler=run.precision.state_dict(),
                                    objective=objective,  # hard: its baseline and coin; SCST: each rank's sampler
                                    weight_average=run.average.state() if run.average is not None else None)
        checkpoint = run.captioner.checkpoint(meta={**run.meta, "step": state.step}, train_state=train_state)
        run.files.save_last(checkpoint, state.step)
    run.files.stop_on_failure()


def validate(run: Run, state: TrainState) -> bool:
    """Real decoding on the validation split (rank 0, with the averaged weights when
    ``optim.ema``); saves best.pt when the figure improves. True when early stopping says stop."""
    stop_early, state.validated_at = False, state.step  # on every rank: each decides the same
    if run.ctx.is_main:
        with run.average.applied(run.model) if run.average is not None else nullcontext():
            stop_early = _validate_here(run, state)
    stop_early = run.ctx.broadcast(stop_early)
    run.files.stop_on_failure()
    return stop_early


def _validate_here(run: Run, state: TrainState) -> bool:
    """``validate``'s work on rank 0: decode, score, say it, keep the best."""
    cfg, model = run.cfg, run.model
    model.eval()
    options = DecodeOptions(beam_size=cfg.val.beam_size, max_len=cfg.val.max_len)
    report = evaluate(run.captioner, cfg.data.dir, cfg.data.val_split, karpathy=cfg.data.split_file,
                      records=run.val_records, options=options, limit=cfg.val.limit or None, meteor=False,
                      progress=False, with_coco_objects=False)
    grounding = report.grounding.to_dict() if report.grounding is not None else None
    figures = {**report.metrics, **(grounding or {})}
    # the board plots every figure val.metric may name (config.CAPTION_FIGURES, GROUNDING_FIGURES), not the counts
    shown = {k: v for k, v in figures.items() if k in report.metrics or k in GROUNDING_FIGURES}
    run.board.validation(state.step, shown, run.captioner, options)
    model.train()
    value = validation_value(cfg.val.metric, figures)
    previous, chooses = state.best, run.val_chooses
    improved = previous is None or value > previous
    # best.pt: a higher figure; an equal one too (the same score after more training: the later
    # weights); and every validation too small to choose by (val.min_images): the latest weights.
    keep = improved or not chooses or value == previous
    state.bad_vals = 0 if improved or not chooses else state.bad_vals + 1
    if keep:
        state.best = value
        # each part of a min:A,B metric too (a card names metrics, not expressions), and how many
        # images the figure rests on
        parts = {f"val_{n}": float(figures[n]) for n in metric_parts(cfg.val.metric)
                 if n != cfg.val.metric and figures.get(n) is not None}
        run.files.save_best(run.captioner.checkpoint(meta={**run.meta, "step": state.step, "epoch": state.epoch,
                                                           f"val_{cfg.val.metric}": value, **parts,
                                                           "val_images": run.val_images,
                                                           "train_seconds": round(state.train_seconds, 1)}))
    if not chooses:
        few = f"{run.val_images} validation image is" if run.val_images == 1 else \
            f"{run.val_images} validation images are"
        verdict = f"saved as best.pt: {few} too few to choose by (val.min_images = {cfg.val.min_images})"
    elif improved:
        verdict = ("first validation" if previous is None else f"up from {figure(previous)}") + ": saved as best.pt"
    else:
        verdict = "equal to the best: the later weights saved as best.pt" if keep else \
            f"best so far {figure(previous)}"
    run.files.write({"step": state.step, "epoch": state.epoch, "val": report.metrics,
                     "grounding": grounding, "improved": improved})
    # the epoch the bar shows: the one the run is in, or at an epoch's end the one just done
    shown = state.epoch + (1 if state.batch_in_epoch else 0)
    print(f"epoch {shown} step {state.step}: val {cfg.val.metric} {figure(value)} ({verdict})",
          file=sys.stderr)
    return chooses and cfg.val.patience > 0 and state.bad_vals >= cfg.val.patience


def _print_summary(run: Run) -> None:
    """The start-up summary on stderr: what the run trains on, with what, where it writes."""
    model, m = run.model, run.model.config
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    threads = torch.get_num_threads()
    lines = summary_lines(run.cfg.data, run.data.splits, run.captioner.vocab, run.kept, run.left_out) + [
        f"model: {m.attention} attention, {m.encoder} encoder"
        f"{' (ImageNet weights)' if m.encoder_pretrained else ''}, {total:,} parameters ({trainable:,} trained)",
        f"device: {run.ctx.device}, {threads} thread{'s' if threads != 1 else ''}"
        + (f", {run.ctx.world} process{'es' if run.ctx.world != 1 else ''} ({run.ctx.backend})" if run.ctx.active
           else ""),
        f"run folder: {run.run_dir}",
    ]
    if not run.val_chooses:
        n = run.val_images
        lines.insert(-3, f"validation: {n} image{'s' if n != 1 else ''}, fewer than val.min_images = "
                         f"{run.cfg.val.min_images}: "
                         "too few to choose by; no early stopping, best.pt holds the last validated weights")
    print("\n".join(lines), file=sys.stderr)


def _finished(cfg: TrainConfig, state: TrainState) -> str | None:
    """Why a run in this state has nothing left to train under ``cfg``, or None."""
    o, v = cfg.optim, cfg.val
    if o.max_steps and state.step >= o.max_steps:
        return "max_steps"
    if o.max_minutes and state.train_seconds >= 60 * o.max_minutes:
        return "time_budget"
    if state.epoch >= o.epochs:
        return "finished"
    if v.patience > 0 and state.bad_vals >= v.patience:
        return "early_stop"
    return None


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


# What stopped a run -> the value --resume RUN --set raises to go on.
GO_ON = {"finished": "optim.epochs", "max_steps": "optim.max_steps", "time_budget": "optim.max_minutes",
         "early_stop": "val.patience"}


def _go_on(reason: str, run_dir: Path) -> str:
    """How to continue a run that ``reason`` stopped: the one value that stopped it, raised."""
    key = GO_ON[reason]
    zero = " (0: never stop early)" if key == "val.patience" else ""
    return f"to go on, raise {key}{zero}: --resume {run_dir} --set {key}=N"


def outcome_line(outcome: TrainOutcome, cfg: TrainConfig) -> str:
    """The line `captioner train` ends with."""
    if outcome.best_metric is None:
        best = "no validation yet"
    elif outcome.chosen:
        best = f"best val {cfg.val.metric} {figure(outcome.best_metric)} (best.pt)"
    else:
        best = (f"last val {cfg.val.metric} {figure(outcome.best_metric)} (best.pt: the last validated weights, "
                f"validation being smaller than val.min_images = {cfg.val.min_images})")
    resume = {"interrupted": f"; continue with --resume {outcome.run_dir}",
              "early_stop": f"; {_go_on('early_stop', outcome.run_dir)}"}.get(outcome.reason, "")
    return (f"{_reason_text(outcome.reason, cfg, outcome.step, outcome.epoch)}; {best}; "
            f"run folder {outcome.run_dir}{resume}")


def validation_value(metric: str, figures: dict) -> float:
    """The figure named by ``val.metric``: one name, or ``min:A,B,...`` for the smallest of several."""
    names = metric_parts(metric)
    missing = [repr(n) for n in names if n not in figures]
    if missing:
        raise ValueError(f"validation metric {metric!r}: {', '.join(missing)} not among {sorted(figures)}")
    # None: nothing to score (no word named an object, say): the worst figure, not a crash.
    return min(0.0 if figures[n] is None else float(figures[n]) for n in names)


def build_optimizer(groups: list[dict], o) -> torch.optim.Optimizer:
    """The optimizer named by ``o.optimizer`` (an ``OptimConfig``) over parameter groups."""
    # Adam and SGD as one fused kernel over each parameter (CPU and CUDA): the for-each-
    # parameter form makes some ten passes over every weight. Same updates up to float
    # rounding; docs/benchmarks.md has what it was measured to change.
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
