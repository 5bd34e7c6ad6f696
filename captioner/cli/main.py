"""The ``captioner`` command.

Library commands live here (caption, evaluate, shapes). Commands that belong to other
parts of the project (``train`` from train/, ``app`` from app/) register themselves
through the ``captioner.commands`` entry-point group, so the library never imports them.
What every subcommand shares (exit codes, UsageError, the model loader) is in cli_common.py.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from captioner.cli.alt_text import add_alt_text_parser
from captioner.cli.caption_files import FORMATS as CAPTION_FORMATS
from captioner.cli.caption_files import check_format_flags
from captioner.cli.common import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_SOME_FAILED,
    EXIT_USAGE,
    UsageError,
    check_device,
    check_out_file,
    load_model,
    make_folders,
    non_negative,
    positive,
    whole_number,
)
from captioner.cli.export import add_export_parser
from captioner.search.options import HARD_ATTENTION, MAX_WORDS, UNFAMILIAR_BELOW, DecodeOptions, OptionError, parser
from captioner.serve.cli import add_serve_parser

if TYPE_CHECKING:
    from captioner.cli.batch import BatchSummary, Discovery, ResumePlan
    from captioner.distributed import DistContext
    from captioner.inference import Captioner

RANK_ERROR_WAIT = 5.0  # seconds a rank other than 0 waits before exiting on a mistake (see main)


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (usage is one --help away), exit code 2."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """The model and how it decodes: shared by caption and evaluate."""
    p.add_argument("--weights", default=None,
                   help="checkpoint file, or a bundled demo model: demo-soft (default), demo-hard, demo-zh (Chinese "
                        "captions). The demo "
                        "models are trained on synthetic shapes only: they describe coloured shapes, not photographs")
    p.add_argument("--beam-size", type=parser("beam_size"), default=3, help="beam width; 1 = greedy (default 3)")
    p.add_argument("--max-len", type=parser("max_len"), default=None,
                   help="most tokens per caption: words, or characters for a Chinese model (default: the longest "
                        f"caption the model was trained on, 20 for models that do not say; at most {MAX_WORDS})")
    p.add_argument("--hard-attention", choices=HARD_ATTENTION, default="expected",
                   help="hard-attention models: context from the expected location mix (default, "
                        "deterministic), the most likely location (argmax), or a random sample")
    p.add_argument("--allow-unk", action="store_true",
                   help="let captions hold <unk>, the vocabulary's word for any word it lacks (default: never; "
                        "a caption with <unk> says that the model saw something it has no word for)")
    p.add_argument("--unfamiliar-below", type=parser("unfamiliar_below", float), default=UNFAMILIAR_BELOW,
                   metavar="SHARE",
                   help='report an image as "unfamiliar" when its "familiarity" (the share of the model\'s '
                        "training images at least as far from their distribution: 1 typical, near 0 unlike all "
                        f"of them) is below SHARE (default {UNFAMILIAR_BELOW}). Checkpoints without a record of their "
                        "training images (captioner familiarity adds one) report both as null")


def add_caption_parser(sub: argparse._SubParsersAction) -> None:
    from captioner.explain import KINDS as EXPLAIN_KINDS
    from captioner.inference import INFERENCE_PRECISIONS  # torch: not at this module's import (captioner.onnx uses it)

    p = sub.add_parser(
        "caption", help="caption image files and folders, one JSON line per image",
        description="Caption images. PATHs are image files or folders (searched recursively for image "
                    "extensions; symlink loops are safe). Each image gives one JSON line: "
                    '{"image", "caption", "words", "score", "familiarity", "unfamiliar", "word_probs", '
                    '"end_prob", "model"} (score = sum of log word_probs + log end_prob), or '
                    '{"image", "error"} for a file that cannot be read; the run goes on. With --out FILE '
                    "that already holds results, the run resumes: images already captioned there (found by "
                    "their real location, however the folder is spelled) are skipped, images that failed "
                    "before are tried again, and images captioned without the attention (or the "
                    "alternatives) asked for now are captioned again; the file keeps one line per image. "
                    "With --format txt or metadata the captions go into files instead: a .txt beside each image, "
                    "or Hugging Face's metadata.jsonl (see --format). "
                    "Exit code: 0 all captioned, 1 some failed (this run), 2 usage error. The default model "
                    "is a demo trained on synthetic shapes only. Transparent pixels are laid on white, as "
                    "the model sees the image: a transparent background is described as white.")
    p.add_argument("paths", nargs="+", metavar="PATH",
                   help="image files or folders; - reads paths from standard input, one per line (e.g. from "
                        "find ... | captioner caption -). URLs are not fetched: download the image first")
    _add_model_args(p)
    p.add_argument("--length-penalty", type=parser("length_penalty", float), default=0.0,
                   help="rank finished beams by score / length**P (default 0: raw log-probability)")
    p.add_argument("--num-captions", type=parser("num_captions"), default=1, metavar="N",
                   help='also write "alternatives": the N best finished captions of the beam search with '
                        "their scores, best first (the first is the caption); the search goes on until no open "
                        "beam can beat the N-th best, so fewer than N only where fewer can end within --max-len. "
                        'With --length-penalty they come in the order of the search\'s rank, log p / '
                        'length**P, given as "rank". N at most --beam-size (default 1: none)')
    p.add_argument("--max-chars", type=parser("max_chars"), default=None, metavar="C",
                   help="the best caption whose text (as the model's language writes it: spaces between English "
                        "words, none between Chinese characters) is at most C characters, found by the search "
                        "among the captions that fit, never cut (with --num-captions: the N best that fit). An "
                        'image that no caption fits gets an "error" line naming the budget and the shortest '
                        "caption found without it (e.g. 125 for alt text; default: no budget)")
    p.add_argument("--batch-size", type=positive, default=None,
                   help="images per batch (default 16 on a CPU, 64 on a GPU, where a batch of 32 images' beam "
                        "search takes about the time of one image's)")
    p.add_argument("--workers", type=non_negative, default=None,
                   help="image-decoding worker processes (default: 2 for more than 64 images, else 0)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON-lines output file (default stdout; missing folders are made); resumable: each line "
                        'also holds "resolved", the absolute path resume matches on. With --format txt: the '
                        "folder the .txt files go to, in the tree of the folder given (default: beside the images)")
    p.add_argument("--format", choices=CAPTION_FORMATS, default="jsonl",
                   help="jsonl (default): one JSON line per image, as above. txt: the caption in NAME.txt beside "
                        "each image (photo.jpg -> photo.txt), or under --out DIR, as tools that train image "
                        "generators read them. metadata: Hugging Face's metadata.jsonl in the one folder given, "
                        '{"file_name": path relative to the folder, "text": caption} a line, which '
                        'datasets.load_dataset("imagefolder", data_dir=FOLDER) reads as it is. With txt and '
                        "metadata, an image whose .txt (or metadata.jsonl line) is there already is not captioned "
                        "and its file is kept (named in the summary): a run that stopped continues where it "
                        "stopped, and captions corrected by hand stay. captioner data import reads both back "
                        "(docs/caption-files.md)")
    p.add_argument("--prefix", default="", metavar="TEXT",
                   help="with --format txt or metadata: TEXT before each caption, as it is (give the separator "
                        'too: --prefix "sks, ")')
    p.add_argument("--suffix", default="", metavar="TEXT",
                   help="with --format txt or metadata: TEXT after each caption, as it is")
    p.add_argument("--overwrite", action="store_true",
                   help="with --format txt or metadata: caption every image and replace the .txt files (or "
                        "metadata.jsonl lines) that are there, those corrected by hand too")
    p.add_argument("--with-attention", action="store_true",
                   help='add "alphas" (T x H x W, rounded) and "betas" (T) to each line')
    p.add_argument("--attention-dir", type=Path, default=None,
                   help="write one PNG per image: the caption and the model as its title, the image and an "
                        "attention overlay per word (missing folders are made)")
    p.add_argument("--explain", choices=EXPLAIN_KINDS, default=None,
                   help="each word's gradient map too, what in the image made the model say it (the attention "
                        "maps show where it looked before the word): gradcam (Grad-CAM on the encoder's last "
                        "feature map) or gradinput (gradient x input on the annotation vectors), the decoder "
                        "teacher-forced on the chosen caption. In each line as \"gradcam\" or \"gradinput\" (T x H "
                        "x W, beside \"alphas\"), and with --attention-dir a second figure of these maps, its "
                        "path as \"gradcam_png\" or \"gradinput_png\". One backward pass per word: slower")
    p.add_argument("--attention-heads", action="store_true",
                   help='each attention head\'s maps too (models with model.heads > 1; the default maps are '
                        'the heads\' mean): "alphas_heads" (T x heads x H x W) on each line, with "alphas" and '
                        '"betas", and in --attention-dir a row per word, its mean map then one overlay per head')
    p.add_argument("--max-pixels", type=positive, default=None,
                   help="refuse images with more pixels than this, a guard against decompression bombs "
                        "(default: Pillow's 89,478,485); a higher value lets larger images through")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument("--precision", choices=INFERENCE_PRECISIONS, default="fp32",
                   help="fp32 (default), or bf16/fp16 autocast: faster on a GPU (bf16 also on CPUs with "
                        "bf16 instructions), the same captions up to rounding")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="torch.compile the decoder step, with torch's inductor backend unless another is "
                        "named (e.g. aot_eager: traces without generating code): pays off on a GPU for large "
                        "folders (the first batch waits for the compiler)")
    p.add_argument("--decode-on-device", action="store_true",
                   help="decode JPEGs on the model's device (nvJPEG on a GPU): the worker processes only read "
                        "the files, for when they cannot keep up with the GPU; other formats, CMYK and "
                        "EXIF-rotated JPEGs go through the usual path. Pixels differ from it by a level or two "
                        "of 255 (full-scale decoding, torch's resampling), so a near tie may caption differently")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar or summary on stderr (the demo-model note is still printed; with "
                        "--format txt or metadata, so are the images that failed, which have no other record)")
    p.set_defaults(func=cmd_caption)


URL_SCHEMES = ("http://", "https://", "ftp://", "s3://", "gs://")


def given_paths(paths: list[str]) -> list[str]:
    """The PATH arguments of ``caption``, each ``-`` replaced by the paths on standard input (one
    a line, blank lines skipped); a URL is refused in one line, as it is not fetched."""
    given: list[str] = []
    for path in paths:
        if path == "-":
            read = [line.strip() for line in sys.stdin if line.strip()]
            if not read:
                raise UsageError("- reads image paths from standard input, one per line, and it gave none")
            given += read
        else:
            given.append(path)
    for path in given:
        if path.lower().startswith(URL_SCHEMES):
            name = path.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1] or "image.jpg"
            raise UsageError(f"{path} is a URL; images are not fetched from the network: download it first, "
                             f"e.g. curl -L -o {name} '{path}', then captioner caption {name}")
    return given


def interrupted_caption(out: Path | None) -> str:
    """What Ctrl-C during ``caption`` says: with --out, that the same command goes on."""
    if out is not None:
        return (f"captioner caption: interrupted; the captions made so far are in {out}: the same command "
                "continues where it stopped")
    return ("captioner caption: interrupted; the captions made so far went to standard output (with --out FILE "
            "the same command continues where it stopped)")


def default_batch_size(device) -> int:
    """Images per batch of `captioner caption` without --batch-size: on a GPU a batch's beam
    search costs about what one image's does (docs/benchmarks.md), so batches are larger there."""
    return 64 if str(device).startswith("cuda") else 16


def decode_options(args: argparse.Namespace, model_max_len: int = DecodeOptions.max_len) -> DecodeOptions:
    """The decoding options the flags ask for (``DecodeOptions`` checks them), the model's own
    length limit where --max-len is not given; a refusal is a one-line UsageError."""
    given = {name: getattr(args, name) for name in ("length_penalty", "num_captions", "max_chars")
             if hasattr(args, name)}
    try:
        return DecodeOptions(beam_size=args.beam_size, max_len=args.max_len or model_max_len,
                             hard_attention=args.hard_attention, unfamiliar_below=args.unfamiliar_below,
                             allow_unk=args.allow_unk, **given)
    except OptionError as e:
        raise UsageError(e.for_command()) from None


def cmd_caption(args: argparse.Namespace) -> int:
    from captioner.distributed import DeviceError, setup, teardown, work_done

    check_device(args.device)
    decode_options(args)  # refused before any work; the model's own length limit comes in later
    check_format_flags(args)
    if args.format == "jsonl":
        check_out_file(args.out)
    if args.attention_dir is not None:
        make_folders(args.attention_dir, "--attention-dir")  # refuses a file in the way, in one line
    # Under torchrun each rank captions its share into a part file; rank 0 merges them.
    try:
        ctx = setup(args.device)
    except DeviceError as e:
        raise UsageError(str(e)) from None
    try:
        if args.format != "jsonl":
            if ctx.active:
                raise UsageError(f"--format {args.format} runs in one process: under torchrun, use --format jsonl")
            return _caption_files(args, ctx)
        found = _caption_inputs(args, ctx)
        captioner = load_model("caption", args.weights, ctx.device, notice=ctx.is_main).captioner
        captioner.use_precision(args.precision)
        if args.compile:
            captioner.compile(backend=args.compile)
        plan = _caption_plan(args, ctx, found.images)
        try:
            summary = _caption_share(args, ctx, captioner, plan.todo[ctx.rank::ctx.world])
        except KeyboardInterrupt:
            if ctx.is_main:
                print(interrupted_caption(args.out), file=sys.stderr)
            return EXIT_INTERRUPTED
        summary = _caption_gathered(args, ctx, summary, plan)
        if ctx.is_main:
            _caption_report(args, summary, found.skipped, plan)
        # torchrun stops every rank as soon as one exits non-zero (some images failed): no
        # rank leaves before rank 0 has merged the parts and printed the summary, and then
        # none is stopped half-way out (each ends with its own exit code).
        ctx.barrier()
        work_done(ctx)
        return EXIT_SOME_FAILED if summary.failed else EXIT_OK
    finally:
        teardown(ctx)


def _caption_files(args: argparse.Namespace, ctx: DistContext) -> int:
    """``caption --format txt | metadata``: each caption into its file (caption_files.py), the
    images that have one already left as they are; the summary names those and the failures."""
    from captioner.cli.batch import caption_paths
    from captioner.cli.caption_files import CaptionFiles, CaptionFilesError, plan_files
    from captioner.data.images import DEFAULT_MAX_PIXELS

    found = _caption_inputs(args, ctx)
    try:
        plan = plan_files(args.format, found.images, found.roots, out_dir=args.out, overwrite=args.overwrite)
    except CaptionFilesError as e:
        raise UsageError(str(e)) from None
    captioner = load_model("caption", args.weights, ctx.device).captioner
    captioner.use_precision(args.precision)
    if args.compile and plan.todo:
        captioner.compile(backend=args.compile)
    files = CaptionFiles(plan, args.prefix, args.suffix, args.overwrite)
    workers = args.workers if args.workers is not None else (2 if len(plan.todo) > 64 else 0)
    try:
        summary = caption_paths(captioner, plan.todo, None, options=decode_options(args, captioner.max_len),
                                batch_size=args.batch_size or default_batch_size(captioner.device),
                                workers=workers, attention_dir=args.attention_dir,
                                max_pixels=args.max_pixels or DEFAULT_MAX_PIXELS,
                                progress=False if args.quiet else None, heads=args.attention_heads,
                                decode_on_device=args.decode_on_device, on_record=files, explain=args.explain)
    except KeyboardInterrupt:
        what = plan.metadata if plan.metadata is not None else "the .txt files"
        print(f"captioner caption: interrupted; the captions made so far are in {what}: the same command "
              "continues where it stopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        files.close()
    if not args.quiet:
        for line in files.summary(summary.captioned, found.skipped, args.out):
            print(line, file=sys.stderr)
    for line in files.failures():
        print(f"captioner caption: {line}", file=sys.stderr)
    if files.wordless:
        n = len(files.wordless)
        print(f"captioner caption: note: {n} caption{'s' if n != 1 else ''} with no word, so no .txt written "
              f"(nor metadata line), e.g. {files.wordless[0]}: the model has nothing to say of "
              f"{'them' if n != 1 else 'it'}", file=sys.stderr)
    return EXIT_SOME_FAILED if files.failed else EXIT_OK


def _caption_inputs(args: argparse.Namespace, ctx: DistContext) -> Discovery:
    """The image files of the PATHs (``discover``), or a one-line UsageError: no image among
    them, a path that is not there, a URL, or no --out under torchrun."""
    from captioner.cli.batch import discover

    if ctx.active and args.out is None:
        raise UsageError("under torchrun, --out FILE is required (ranks write parts that are merged into it)")
    paths = given_paths(args.paths)
    try:
        found = discover(paths)
    except FileNotFoundError as e:
        raise UsageError(str(e)) from e
    if not found.images:
        others = f" ({found.skipped} other file{'s' if found.skipped != 1 else ''})" if found.skipped else ""
        raise UsageError(f"no image files in {', '.join(paths)}{others}; images are found by their "
                         "extension (.jpg, .png, ...)")
    return found


def _caption_plan(args: argparse.Namespace, ctx: DistContext, images: list[str]) -> ResumePlan:
    """The images this run captions: those found, less what --out already holds as asked for."""
    from captioner.cli.batch import merge_parts, plan_resume, read_resume

    if ctx.active and ctx.is_main:
        merge_parts(args.out)  # parts left by an earlier, killed distributed run
    ctx.barrier()
    resume = (read_resume(args.out, with_attention=args.with_attention, attention_dir=args.attention_dir,
                          heads=args.attention_heads, alternatives=args.num_captions > 1,
                          explain=args.explain)
              if args.out is not None else None)
    return plan_resume(images, resume)


def _caption_share(args: argparse.Namespace, ctx: DistContext, captioner: Captioner,
                   pending: list[str]) -> BatchSummary:
    """Caption this rank's ``pending`` images into --out (a part file of it under torchrun), or
    to standard output, with the decoding and outputs the options ask for."""
    from captioner.cli.batch import caption_paths, part_path
    from captioner.data.images import DEFAULT_MAX_PIXELS

    workers = args.workers if args.workers is not None else (2 if len(pending) > 64 else 0)
    options = decode_options(args, captioner.max_len)
    target = part_path(args.out, ctx.rank) if ctx.active else args.out
    out = open(target, "a", encoding="utf-8") if target is not None else sys.stdout
    try:
        return caption_paths(captioner, pending, out, options=options,
                             batch_size=args.batch_size or default_batch_size(captioner.device),
                             workers=workers, with_attention=args.with_attention, attention_dir=args.attention_dir,
                             max_pixels=args.max_pixels or DEFAULT_MAX_PIXELS,
                             progress=False if args.quiet or not ctx.is_main else None,
                             resolved=args.out is not None, heads=args.attention_heads,
                             decode_on_device=args.decode_on_device, explain=args.explain)
    finally:
        if out is not sys.stdout:
            out.close()


def _caption_gathered(args: argparse.Namespace, ctx: DistContext, summary: BatchSummary,
                      plan: ResumePlan) -> BatchSummary:
    """The whole run's summary (every rank's, summed), once --out holds one line per image."""
    from captioner.cli.batch import BatchSummary, compact, merge_parts

    if ctx.active:
        ctx.barrier()
        if ctx.is_main:
            merge_parts(args.out)
        return BatchSummary(round(ctx.sum(summary.captioned)), round(ctx.sum(summary.failed)),
                            round(ctx.sum(summary.wordless)), round(ctx.sum(summary.unfamiliar)))
    if args.out is not None and (plan.retried or plan.again):
        compact(args.out)  # the new lines replace the error lines and the lines without attention
    return summary


def _caption_report(args: argparse.Namespace, summary: BatchSummary, skipped: int, plan: ResumePlan) -> None:
    """On stderr: what the run did (unless --quiet), and a note of the captions with no word."""
    from captioner.data.vocab import UNK

    if not args.quiet:
        extra = (f", retried {plan.retried} (failed before)" if plan.retried else "") + \
                (f", {plan.again} again for their attention" if plan.again else "")
        unfamiliar = f" ({summary.unfamiliar} unfamiliar: unlike the model's training images)" \
            if summary.unfamiliar else ""
        print(f"captioned {summary.captioned}{unfamiliar}, failed {summary.failed}, skipped {skipped} "
              f"(not image files), already done {plan.already}{extra}", file=sys.stderr)
    if summary.wordless:
        print(f"captioner caption: note: {summary.wordless} caption{'s' if summary.wordless != 1 else ''} "
              f"with no word (empty, or only {UNK}): the model has nothing to say of "
              f"{'them' if summary.wordless != 1 else 'it'}; a model trained longer or on such "
              "images may", file=sys.stderr)


def add_shapes_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("shapes", help="generate the synthetic shapes dataset (COCO format)",
                       description="Write the synthetic shapes dataset: images of 1-3 coloured shapes with 5 "
                                   "captions each, as images/, captions_<split>.json, instances_<split>.json.")
    p.add_argument("--out", type=Path, required=True, help="output folder (missing folders are made)")
    p.add_argument("--train", type=non_negative, default=3000, help="training images (default 3000)")
    p.add_argument("--val", type=non_negative, default=200, help="validation images (default 200)")
    p.add_argument("--test", type=non_negative, default=500, help="test images (default 500)")
    p.add_argument("--seed", type=whole_number, default=0, help="random seed (default 0)")
    p.add_argument("--image-size", type=positive, default=128, help="image side in pixels (default 128)")
    p.add_argument("--top-to-bottom", action="store_true",
                   help="also caption images of 2-3 objects \"from top to bottom: ...\" (same images; "
                        "off by default, as the test sets are made)")
    p.add_argument("--language", choices=("en", "zh"), default="en",
                   help="the captions' language: en (default) or zh, Chinese (\"一个红色的大圆形和一个蓝色的三角形\"); "
                        "the images and objects are the same for the same seed")
    p.add_argument("--overwrite", action="store_true",
                   help="write into an --out that is not empty, replacing the shapes data set there (other files "
                        "stay); without it such a folder is refused, so that nothing is lost")
    p.set_defaults(func=cmd_shapes)


def cmd_shapes(args: argparse.Namespace) -> int:
    from captioner.data.shapes import generate_dataset, remove_dataset

    counts = {k: n for k, n in (("train", args.train), ("val", args.val), ("test", args.test)) if n > 0}
    if not counts:
        raise UsageError("nothing to generate: all split sizes are 0")
    if args.out.exists() and not args.out.is_dir():
        raise UsageError(f"--out {args.out} is a file, not a folder")
    held = sorted(p.name for p in args.out.iterdir() if not p.name.startswith(".")) if args.out.is_dir() else []
    if held and not args.overwrite:
        raise UsageError(f"--out {args.out} is not empty (it holds {', '.join(held[:3])}{', ...' if held[3:] else ''}"
                         "): give another --out (missing or empty) for a new data set, or add --overwrite to "
                         "replace the shapes data set there")
    if args.overwrite and args.out.is_dir():
        remove_dataset(args.out)  # a smaller set must not leave the larger one's images behind
    try:
        summary = generate_dataset(args.out, counts, seed=args.seed, image_size=args.image_size, progress=True,
                                   top_to_bottom=args.top_to_bottom, language=args.language)
    except ValueError as e:  # e.g. an image size too small to draw shapes in
        raise UsageError(str(e)) from e
    except OSError as e:
        raise UsageError(f"--out {args.out}: {e.strerror or e}") from e
    print(shapes_summary(summary), file=sys.stderr)
    return EXIT_OK


def shapes_summary(summary: dict) -> str:
    """What ``captioner shapes`` wrote, in a few readable lines."""
    splits = summary["splits"]
    total = sum(s["images"] for s in splits.values())
    px = summary["image_size"]
    lines = [f"wrote {total:,} images ({px}x{px} px, seed {summary['seed']}) to {summary['out_dir']}:",
             f"  {'split':<8}{'images':>8}{'captions':>10}{'shapes':>8}  files"]
    for name, s in splits.items():
        lines.append(f"  {name:<8}{s['images']:>8,}{s['captions']:>10,}{s['objects']:>8,}  "
                     f"captions_{name}.json, instances_{name}.json")
    lines.append(f"  images in {Path(summary['out_dir']) / 'images'}")
    return "\n".join(lines)


def add_evaluate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("evaluate", help="caption metrics (BLEU, METEOR, ROUGE-L, CIDEr) and attention grounding",
                       description="Decode a split with real decoding (no teacher forcing) and score it: "
                                   "BLEU-1..4, METEOR (English models, when java is on PATH), ROUGE-L, CIDEr, on "
                                   "the tokens of the model's tokenizer (characters for Chinese); on shapes data also "
                                   "object accuracy, hallucinated shapes and the attention pointing game with its "
                                   "chance level; on COCO data with its instance annotations "
                                   "(annotations/instances_train2014.json, instances_val2014.json) also CHAIRs and "
                                   "CHAIRi (captions and object mentions naming an object not in the image) and the "
                                   "attention's pointing game on the objects' boxes and masks, overall and per "
                                   "category. --out's results file gives each image's objects named and hallucinated.")
    p.add_argument("--data", type=Path, required=True,
                   help="folder with captions_<split>.json and images/ (COCO's format, as captioner shapes "
                        "writes it), or an own-data folder with the dataset.json captioner data import wrote")
    p.add_argument("--split", default="test", help="split to evaluate (default test)")
    p.add_argument("--karpathy", type=Path, default=None, help="Karpathy split file (dataset_coco.json)")
    _add_model_args(p)
    p.add_argument("--batch-size", type=positive, default=32, help="images per batch (default 32)")
    p.add_argument("--limit", type=positive, default=None, help="evaluate only the first N images")
    p.add_argument("--out", type=Path, default=None,
                   help="write metrics JSON here, and the COCO results JSON beside it (missing folders are "
                        "made; default: print only)")
    p.add_argument("--no-meteor", action="store_true", help="skip METEOR even when java is available")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument("--captions", type=Path, default=None, metavar="FILE",
                   help="score the captions in FILE instead of decoding, with no model: JSON Lines as `captioner "
                        'caption` writes them, or a COCO results file ([{"image_id", "caption"}]). Every measure is '
                        "given; the attention's only for captions written with --with-attention, their maps read "
                        "as covering the region --weights' model sees (the whole image without --weights)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar or note of the file written on stderr (the demo-model note is still "
                        "printed)")
    p.set_defaults(func=cmd_evaluate)


def _split_records(args: argparse.Namespace) -> list:
    """``args.split`` of ``args.data`` (with ``args.karpathy``), its first ``args.limit`` images,
    each image file there: a missing file or image is a one-line usage error."""
    from captioner.data.coco import load_split, require_images

    try:
        records = load_split(args.data, args.split, args.karpathy)[:args.limit]
        require_images(records, args.split)
    except FileNotFoundError as e:
        raise UsageError(str(e)) from e
    return records


def cmd_evaluate(args: argparse.Namespace) -> int:
    from captioner.evaluation.evaluate import evaluate, format_table, write_report

    device = check_device(args.device)
    decode_options(args)
    check_out_file(args.out)
    if args.captions is not None:
        return _evaluate_captions_file(args, device)
    # The data first: a missing file is the one line a user sees, before any model is loaded.
    records = _split_records(args)
    captioner = load_model("evaluate", args.weights, device).captioner
    report = evaluate(captioner, args.data, args.split, karpathy=args.karpathy,
                      options=decode_options(args, captioner.max_len),
                      batch_size=args.batch_size, meteor=False if args.no_meteor else None, records=records,
                      progress=not args.quiet)
    print(format_table(report))
    if args.out is not None:
        write_report(report, args.out)
        if not args.quiet:
            print(f"wrote {args.out}", file=sys.stderr)
    return EXIT_OK


def _evaluate_captions_file(args: argparse.Namespace, device: str) -> int:
    """`evaluate --captions FILE`: the file's captions scored on the split, no decoding."""
    from captioner.data.coco import load_split
    from captioner.evaluation.evaluate import evaluate_captions, format_table, write_report

    if not args.captions.is_file():
        raise UsageError(f"--captions {args.captions}: no such file")
    try:
        records = load_split(args.data, args.split, args.karpathy)[:args.limit]
    except FileNotFoundError as e:
        raise UsageError(str(e)) from e
    preprocess = None
    if args.weights is not None:
        preprocess = load_model("evaluate", args.weights, "cpu", notice=False).captioner.preprocess
    try:
        report, read = evaluate_captions(args.captions, args.data, args.split, karpathy=args.karpathy,
                                         records=records, meteor=False if args.no_meteor else None,
                                         preprocess=preprocess)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if read.outside:
        print(f"captioner evaluate: note: {read.outside} caption{'s' if read.outside != 1 else ''} in "
              f"{args.captions} for images not in split {args.split!r}, e.g. {read.example}: not scored",
              file=sys.stderr)
    if read.missing or read.failed:
        print(f"captioner evaluate: note: {read.missing} image{'s' if read.missing != 1 else ''} of the split "
              f"without a caption in the file ({read.failed} failed lines): scored on the "
              f"{report.n_images} with one", file=sys.stderr)
    print(format_table(report))
    if args.out is not None:
        write_report(report, args.out)
        print(f"wrote {args.out}", file=sys.stderr)
    return EXIT_OK


def add_familiarity_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "familiarity", help="record in a checkpoint its training images' features, for familiarity",
        description="Add to CHECKPOINT (in place, atomically, or to --out) a description of the features of "
                    "the images it was trained on: the mean and shrunk covariance of their pooled annotation "
                    "vectors, and their distances. With it, caption, evaluate, the API and the app report each "
                    "image's familiarity. `captioner train` records it at the end of a run; this is for "
                    "checkpoints made before, with the data they were trained on. Exit code: 0 done, 2 usage "
                    "error.")
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint file, or a bundled demo model's name")
    p.add_argument("--data", type=Path, required=True, help="the folder the model was trained on")
    p.add_argument("--split", default="train", help="the split it was trained on (default train)")
    p.add_argument("--karpathy", type=Path, default=None, help="Karpathy split file, if it was trained with one")
    p.add_argument("--limit", type=positive, default=None, help="the first N images only")
    p.add_argument("--data-name", default=None,
                   help="what the data is, in words, kept with the record (default: what the checkpoint says "
                        "it was trained on, or the folder's name); the split and the image count are added")
    p.add_argument("--batch-size", type=positive, default=64, help="images per batch (default 64)")
    p.add_argument("--out", type=Path, default=None,
                   help="write the checkpoint here instead of in place (a file that is there already, another "
                        "checkpoint say, is refused unless --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace the file --out names")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary on stderr")
    p.set_defaults(func=cmd_familiarity)


def cmd_familiarity(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from captioner.model.familiarity import training_features

    device = check_device(args.device)
    if args.out is not None:
        if args.out.is_file() and not args.overwrite and not _same_file(args.out, args.checkpoint):
            raise UsageError(f"--out {args.out} already exists: give another --out, or add --overwrite to replace "
                             "it (without --out the record is added to CHECKPOINT in place)")
        check_out_file(args.out)
    records = _split_records(args)
    model = load_model("familiarity", args.checkpoint, device, notice=False)
    captioner, path, ckpt = model.captioner, model.path, model.checkpoint
    data = f"{args.data_name or captioner.training_data or args.data.name}, split {args.split}, {len(records)} images"
    try:
        record = training_features(captioner, records, data=data, batch_size=args.batch_size,
                                   progress=not args.quiet)
    except ValueError as e:  # too few images
        raise UsageError(str(e)) from e
    target = args.out or path
    if target.is_dir():  # an exported model folder: its record file and config
        from captioner.io.export import write_familiarity

        write_familiarity(target, record.to_dict())
    else:
        replace(ckpt, familiarity=record).save(target)
    if not args.quiet:
        print(f"wrote {target}: familiarity from {data}", file=sys.stderr)
    return EXIT_OK


def _installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("captioner")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "(not installed)"


def _same_file(a: Path, b: str) -> bool:
    try:
        return a.samefile(b)
    except OSError:
        return False


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="captioner",
        description="Image captioning with visual attention (Show, Attend and Tell). `captioner caption IMG` "
                    "runs with no download, on the bundled demo model: it is trained on synthetic shapes only "
                    "(coloured circles, squares, triangles, stars and crosses), so it describes any picture, "
                    "a photograph too, as coloured shapes. For photographs, train a model on your own data "
                    "(captioner train) and pass it with --weights.")
    parser.add_argument("--version", action="version", version=f"captioner {_installed_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_caption_parser(sub)
    add_evaluate_parser(sub)
    add_familiarity_parser(sub)
    add_shapes_parser(sub)
    add_export_parser(sub)
    add_serve_parser(sub)
    add_alt_text_parser(sub, _add_model_args, decode_options)
    for ep in sorted(entry_points(group="captioner.commands"), key=lambda e: e.name):
        try:
            ep.load()(sub)
        except ImportError:  # that part of the project is not installed
            continue
    return parser


NO_TORCH = ("this install has no torch, which the captioner command needs; an exported model folder "
            "captions without it: python -m captioner.onnx FOLDER IMAGES... (docs/export.md)")


def main(argv: list[str] | None = None) -> int:
    try:
        import torch  # noqa: F401  (every subcommand, and --help, builds on it)
    except ImportError:  # a torch-free install (the runtime's): one line, not a traceback
        print(f"captioner: error: {NO_TORCH}", file=sys.stderr)
        return EXIT_USAGE
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
        parser.error(f"give a command: {', '.join(commands)}")
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UsageError as e:
        from captioner.distributed import is_main_process

        # Under torchrun every rank meets the same mistake: rank 0 says it (two ranks writing at
        # once glued their lines into one). The others wait before they exit: torchrun stops
        # every rank when the first exits non-zero, and rank 0 must not be stopped unheard.
        if is_main_process():
            sys.stderr.write(f"captioner {args.command}: error: {e}\n")
            sys.stderr.flush()
        else:
            time.sleep(RANK_ERROR_WAIT)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. piped into `head`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK


def run(command: Callable[[], int | None] | None = None) -> None:
    """The ``captioner`` command and ``python -m captioner.cli`` (``command``: main, or another
    program's main, such as the studies' subcommands): the command, then an exit that skips most
    of Python's shutdown work. That shutdown runs several full garbage collections over every
    object alive, most of them left by torch's and torchvision's imports, where the operating
    system frees them all at once anyway: seconds a call on a small CPU (docs/benchmarks.md). So
    the garbage there is is collected first, which runs its finalizers, and what is still alive
    is frozen, out of the collector's sight. A command that raises is left to the usual
    shutdown; argparse's exits (--help, --version, a usage error) are not."""
    try:
        code = (command or main)()
    except SystemExit as done:
        code = done.code
    gc.collect()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    run()
