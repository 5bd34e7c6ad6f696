"""``captioner train``: registered into the captioner command through an entry point."""

from __future__ import annotations

import argparse
import sys
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
                   help="TOML config, e.g. train/configs/shapes-soft.toml (not needed with --resume); one that "
                        "names a base (base = \"FILE\", relative to its folder) states only what differs from it")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value, e.g. --set optim.epochs=5 (repeatable)")
    p.add_argument("--run-dir", type=Path, default=None,
                   help="where to write the run, missing folders made (default runs/<name>-<timestamp>)")
    p.add_argument("--resume", type=Path, default=None, metavar="RUN_DIR",
                   help="continue the run in RUN_DIR from its last.pt")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    from captioner.checkpoint import CheckpointError, load_checkpoint
    from captioner.cli import EXIT_SOME_FAILED, EXIT_USAGE, UsageError
    from captioner.distributed import is_main_process

    from .config import TrainConfig, apply_overrides, load_config
    from .data_cli import require_data
    from .loop import RunWriteError, new_run_dir, outcome_line, train
    from .startup import StartupError

    if args.resume is None and args.config is None:
        raise UsageError("give --config FILE for a new run, or --resume RUN_DIR")
    try:
        if args.resume is not None:
            run_dir = args.resume
            if args.config is not None:
                cfg = load_config(args.config, args.overrides)
            else:  # the run's own config, with any overrides (e.g. more epochs)
                saved = load_checkpoint(run_dir / "last.pt")["train_state"]["config"]
                cfg = apply_overrides(TrainConfig.from_dict(saved), args.overrides)
        else:
            cfg = load_config(args.config, args.overrides)
            run_dir = args.run_dir or new_run_dir(cfg)
        require_data(cfg)  # missing annotations or images: a one-line error now, not a traceback later
    except (OSError, ValueError, KeyError, CheckpointError) as e:
        raise UsageError(str(e)) from e
    try:
        outcome = train(cfg, run_dir, resume=args.resume is not None, progress=not args.quiet)
    except (StartupError, RunWriteError) as e:
        # Under torchrun every rank stops on the same error: rank 0 says it.
        if is_main_process():
            print(f"captioner train: error: {e}", file=sys.stderr)
        return EXIT_USAGE if isinstance(e, StartupError) else EXIT_SOME_FAILED
    if is_main_process():
        print(outcome_line(outcome, cfg), file=sys.stderr)
    return 130 if outcome.reason == "interrupted" else 0
