"""``captioner train``: registered into the captioner command through an entry point."""

from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="train a captioning model from a TOML config",
        description="Train a model. Writes a run folder with the resolved config.toml, metrics.jsonl, "
                    "last.pt (resumable) and best.pt (best validation score by real decoding). "
                    "Ctrl-C or SIGTERM saves and stops; --resume RUN_DIR continues exactly where it stopped. "
                    "Exit code: 0 the run ended (every epoch, or a limit reached); 1 a write to the run folder "
                    "failed mid-run (a full disk: the last checkpoint stays intact); 2 a mistake in the command, "
                    "config or data, or a run folder that cannot be written, said in one line before anything "
                    "is written; 130 interrupted (saved).")
    p.add_argument("--config", type=Path, default=None,
                   help="TOML config: a file, or a shipped config's name from any folder (own-soft, shapes-soft, "
                        "...; train/configs/ in the repository) (not with --resume: a run goes on with "
                        "its own); one that names a base (base = \"FILE\", relative to its folder) states only "
                        "what differs from it. A value the run would ignore (a [hard] key on a soft model, say) "
                        "is refused; one a base config sets is named in a note at start-up")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value, e.g. --set optim.epochs=5, or the run's name: --set name=NAME "
                        f"(repeatable); with --resume only {', '.join(ON_RESUME)}")
    p.add_argument("--run-dir", type=Path, default=None,
                   help="where to write the run, missing folders made (default runs/<name>-<timestamp>); a folder "
                        "that holds a run is refused (--resume it, or --overwrite)")
    p.add_argument("--resume", type=Path, default=None, metavar="RUN_DIR",
                   help="continue the run in RUN_DIR from its last.pt")
    p.add_argument("--overwrite", action="store_true",
                   help="a new run into a --run-dir that holds a run starts over in place, deleting that run's "
                        "checkpoints and log (without it such a folder is refused: nothing is lost)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train)


# What --set may change when a run resumes: how long it goes on, where it runs and what it
# writes for watching (TensorBoard). The rest
# (the data, the model, the rates) is the run's own: changed, it would no longer be that run.
ON_RESUME = ("optim.epochs", "optim.max_steps", "optim.max_minutes", "val.patience", "optim.threads",
             "optim.device", "data.workers", "optim.cuda_graphs",
             "log.tensorboard", "log.tensorboard_images")


def _read_last(run_dir: Path):
    """The run's last.pt; where it cannot be read, a CheckpointError that says whether best.pt
    is intact and how to go on from its weights (a new run: best.pt holds no optimiser state)."""
    from captioner.io.checkpoint import CheckpointError, load_checkpoint

    try:
        return load_checkpoint(run_dir / "last.pt")
    except CheckpointError as e:
        best = run_dir / "best.pt"
        try:
            step = (load_checkpoint(best).meta or {}).get("step") if best.is_file() else None
            intact = best.is_file()
        except CheckpointError:
            intact = False
        if not intact:
            raise CheckpointError(f"{e}. The run has no intact best.pt either: start it again with "
                                  f"--config {run_dir / 'config.toml'} --run-dir {run_dir} --overwrite") from e
        at = f" (step {step})" if step is not None else ""
        raise CheckpointError(
            f"{e}. {best}{at} is intact: to go on from its weights (a new run; the optimiser's state "
            f"and the position in the data are in last.pt alone), captioner train --config "
            f"{run_dir / 'config.toml'} --set model.init_from={best} --run-dir NEW_RUN_DIR") from e


def cmd_train(args: argparse.Namespace) -> int:
    from captioner.cli.common import EXIT_SOME_FAILED, EXIT_USAGE, UsageError
    from captioner.distributed import is_main_process
    from captioner.io.checkpoint import CheckpointError

    from .config import TrainConfig, apply_overrides, check_ignored, find_config, over_bases, written_keys
    from .data_cli import require_data
    from .graphed import GraphCaptureError
    from .loop import RunWriteError, new_run_dir, outcome_line, train
    from .startup import StartupError, check_new_run, check_run_folder, clear_run_folder

    if args.resume is None and args.config is None:
        raise UsageError("give --config FILE for a new run, or --resume RUN_DIR")
    if args.resume is not None and args.overwrite:
        raise UsageError(f"--overwrite is for a new run; --resume {args.resume} goes on with the run there")
    if args.resume is not None and args.config is not None:
        raise UsageError(f"--config does not go with --resume: a run goes on with its own config "
                         f"({args.resume / 'config.toml'}); --set may change {', '.join(ON_RESUME)}")
    notes: list[str] = []
    last = None
    try:
        if args.resume is not None:
            run_dir = args.resume
            for item in args.overrides:
                if item.split("=", 1)[0] not in ON_RESUME:
                    raise ValueError(f"--set {item}: a resumed run keeps its config; --set may change "
                                     f"{', '.join(ON_RESUME)} (start a new run for the rest)")
            last = _read_last(run_dir)  # read once: train() takes it as it is
            if last.train_state is None:
                raise ValueError(f"{run_dir / 'last.pt'} has no training state to resume from")
            cfg = apply_overrides(TrainConfig.from_dict(last.train_state.config), args.overrides)
        else:
            config = find_config(args.config)  # a file, or a shipped config's name
            with open(config, "rb") as f:
                own = tomllib.load(f)  # read once: its own keys, beside its bases', and merged over them
            merged = over_bases(config, own)
            in_chain, stated = written_keys(merged), written_keys(own)
            cfg = apply_overrides(TrainConfig.from_dict(merged), args.overrides)
            overridden = {item.split("=", 1)[0] for item in args.overrides}
            notes = check_ignored(cfg, stated, in_chain, overridden)
            run_dir = args.run_dir or new_run_dir(cfg)
            check_run_folder(run_dir, args.overwrite)  # a run there is kept, unless asked
            check_new_run(cfg, config)
        data = require_data(cfg)  # missing annotations or images: a one-line error now, not a traceback later
    except (OSError, ValueError, KeyError, CheckpointError) as e:
        raise UsageError(str(e)) from e
    if is_main_process():
        for note in notes:
            print(f"captioner train: note: {note}", file=sys.stderr)
        if args.overwrite and args.resume is None:
            clear_run_folder(run_dir)
    try:
        outcome = train(cfg, run_dir, resume=args.resume is not None, progress=not args.quiet, last=last,
                        data=data)
    except (StartupError, RunWriteError, GraphCaptureError) as e:
        # Under torchrun every rank stops on the same error: rank 0 says it.
        if is_main_process():
            print(f"captioner train: error: {e}", file=sys.stderr)
        return EXIT_USAGE if isinstance(e, StartupError) else EXIT_SOME_FAILED
    if is_main_process():
        print(outcome_line(outcome, cfg), file=sys.stderr)
    return 130 if outcome.reason == "interrupted" else 0
