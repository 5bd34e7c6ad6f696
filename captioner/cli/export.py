"""``captioner export``: its arguments and what it does (torch loads only when it runs)."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from captioner.cli.common import EXIT_OK, UsageError, load_model
from captioner.io.quantize import CALIBRATION_IMAGES, FORMS

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
                    "folder. huggingface_hub's upload_folder uploads it as it is. With --int8 the two graphs are "
                    "quantised (about 4x smaller): the decoder step dynamically, the encoder statically, calibrated "
                    "on images like the training images; the export times both forms on this CPU and says where "
                    "int8 is slower (it gains on CPUs with VNNI or AMX). With --int8 weights only the stored "
                    "weights shrink and the graphs compute in fp32, keeping fp32's captions. "
                    "Exit code: 0 done, 2 usage error.")
    p.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="checkpoint file, exported folder, or a bundled demo model's name (demo-soft, ...)")
    p.add_argument("--out", type=Path, required=True,
                   help="the folder to write (made if missing; an earlier export there is replaced; a folder "
                        "holding other files is refused)")
    p.add_argument("--onnx", action="store_true",
                   help='also write the encoder and one decoder step as ONNX graphs (needs "captioner[export]")')
    p.add_argument("--int8", nargs="?", const="arithmetic", default=None, choices=FORMS, metavar="FORM",
                   help="with --onnx: the graphs in 8 bits. FORM arithmetic (the default): int8 weights and "
                        "activations, about 4x smaller, the encoder's activation ranges calibrated on "
                        "--calibration's images; faster on CPUs with VNNI or AMX, and it changes some captions "
                        "(the share is printed). FORM weights: convolution weights stored in int8 and the rest "
                        "in fp16, computed in fp32: files about 3x smaller at the paper's sizes (more memory once "
                        "loaded), fp32's speed, fp32's captions for 98-99%% of the demos' images. Each form is timed "
                        "against fp32 on this CPU")
    p.add_argument("--calibration", type=Path, default=None, metavar="DIR",
                   help=f"with --int8: a folder of images like the model's training images (e.g. its training "
                        f"split's), searched recursively, at most {CALIBRATION_IMAGES} used; a model trained on the "
                        "synthetic shapes alone (the demos) is calibrated on fresh shapes images without it. The "
                        "weights form needs none; given some, it compares its captions with fp32's on them")
    p.add_argument("--license", type=_license, default="unknown",
                   help="the license id for the model card's metadata, e.g. mit, apache-2.0, cc-by-4.0 "
                        "(default: unknown)")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from captioner.io.export import ExportError, check_options, check_target, export

    try:
        check_options(args.onnx, args.int8, args.calibration)
        check_target(args.out)
        captioner = load_model("export", args.checkpoint, "cpu").captioner
        done = export(captioner, args.out, onnx=args.onnx, license=args.license, source=captioner.name,
                      int8=args.int8, calibration=args.calibration)
    except ExportError as e:
        raise UsageError(str(e)) from None
    print(f"wrote {done.folder}: {', '.join(done.files)}", file=sys.stderr)
    if done.int8 is not None:
        q = done.int8
        print(q.size_line(), file=sys.stderr)
        for timing in q.timings:
            print(timing.line(), file=sys.stderr)
        if q.agreement_line():
            print(q.agreement_line(), file=sys.stderr)
    return EXIT_OK
