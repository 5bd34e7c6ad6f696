"""``captioner export``: its arguments and what it does (torch loads only when it runs)."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from captioner.cli.common import EXIT_OK, UsageError, load_model

LICENSE = re.compile(r"[a-z0-9][a-z0-9.+-]*")  # the Hub's license ids: mit, apache-2.0, cc-by-4.0, other, ...


def _license(value: str) -> str:
    if not LICENSE.fullmatch(value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a license id (lower case, e.g. mit, apache-2.0, "
                                         "cc-by-4.0, other)")
    return value


def add_export_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export", help="write a model as a folder to share and deploy: safetensors, config, model card, ONNX",
        description="Write CHECKPOINT as a folder in the Hugging Face Hub's conventions (no pickle in it): "
                    "model.safetensors, config.json (architecture, attention, preprocessing, tokenizer, length "
                    "limit, captioner version), vocab.json, familiarity.safetensors (where the checkpoint has a "
                    "familiarity record) and README.md, a model card with the Hub's metadata. With --onnx also "
                    "encoder.onnx and decoder_step.onnx, with which `python -m captioner.onnx FOLDER IMAGES` "
                    "captions with onnxruntime and no torch. Every command that takes a checkpoint takes the "
                    "folder. huggingface_hub's upload_folder uploads it as it is. Exit code: 0 done, 2 usage "
                    "error.")
    p.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="checkpoint file, exported folder, or a bundled demo model's name (demo-soft, ...)")
    p.add_argument("--out", type=Path, required=True,
                   help="the folder to write (made if missing; an earlier export there is replaced; a folder "
                        "holding other files is refused)")
    p.add_argument("--onnx", action="store_true",
                   help='also write the encoder and one decoder step as ONNX graphs (needs "captioner[export]")')
    p.add_argument("--license", type=_license, default="unknown",
                   help="the license id for the model card's metadata, e.g. mit, apache-2.0, cc-by-4.0 "
                        "(default: unknown)")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from captioner.io.export import ExportError, check_target, export

    try:
        check_target(args.out)
        captioner = load_model("export", args.checkpoint, "cpu").captioner
        done = export(captioner, args.out, onnx=args.onnx, license=args.license, source=captioner.name)
    except ExportError as e:
        raise UsageError(str(e)) from None
    print(f"wrote {done.folder}: {', '.join(done.files)}", file=sys.stderr)
    return EXIT_OK
