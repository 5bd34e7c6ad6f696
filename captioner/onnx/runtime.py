"""Caption with an exported model's ONNX graphs: onnxruntime, numpy and pillow, no torch.

    python -m captioner.onnx MODEL_FOLDER IMAGES... [--beam-size K] [--max-len N]
        [--num-captions N] [--max-chars C] [--with-attention] [--out FILE]

MODEL_FOLDER is what ``captioner export CHECKPOINT --out FOLDER --onnx`` wrote. The images are
decoded and resized by the project's own code (captioner.data.images), the graphs run the encoder
and one decoder step (captioner.io.export), and the search around the step is the project's,
in numpy (captioner.onnx.search). Each image gives the JSON line ``captioner caption`` gives
(``{"image", "caption", "words", "score", "familiarity", "unfamiliar", "word_probs",
"end_prob", ...}``, or ``{"image", "error"}``). Nothing this module imports loads torch.

Exit code: 0 all captioned, 1 some images failed, 2 usage error (a bad folder, a bad option).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from captioner.data.images import DEFAULT_MAX_PIXELS, ImageLoadError, Preprocess, is_image_path
from captioner.data.vocab import Spelling, tokenizer_named
from captioner.io import folder as fmt
from captioner.onnx.search import Decoded, beam_search, greedy
from captioner.search.budget import NoFit
from captioner.search.options import UNFAMILIAR_BELOW, DecodeOptions, OptionError, Tokens, count, parser
from captioner.search.record import DIGITS, caption_record


@dataclass(frozen=True)
class Caption:
    """One image's caption, as CaptionResult holds it, in numpy."""

    words: list[str]
    text: str
    score: float
    alphas: np.ndarray  # (T, H, W) the heads' mean map per word
    betas: np.ndarray  # (T,)
    word_probs: tuple[float, ...]
    end_prob: float | None  # p of the <end> that closed it; None: cut off at the length limit
    familiarity: float | None
    unfamiliar: bool | None
    alternatives: tuple[tuple[str, float], ...] = ()  # (caption, score), best first, with --num-captions > 1
    no_fit: NoFit | None = None  # no caption fits the character budget: words empty (CaptionResult.no_fit)

    def to_json(self, image: str, with_attention: bool = False, digits: int = DIGITS) -> dict:
        attention = {}
        if with_attention:
            attention["alphas"] = np.round(self.alphas.astype(np.float64), digits).tolist()
            attention["betas"] = np.round(self.betas.astype(np.float64), digits).tolist()
        return caption_record(image=image, caption=self.text, words=self.words, score=self.score,
                              familiarity=self.familiarity, unfamiliar=self.unfamiliar,
                              word_probs=self.word_probs, end_prob=self.end_prob,
                              alternatives=[(text, score, None) for text, score in self.alternatives],
                              attention=attention, digits=digits)


def session(path: str | os.PathLike, threads: int | None = None, spin: bool = False):
    """An onnxruntime session on the CPU for the graph at ``path``, on ``threads`` threads (default:
    onnxruntime's, one a core) that sleep between runs unless ``spin``: a caption's sessions take
    turns, and threads left spinning in one take the cores the other runs on (docs/export.md)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


class OnnxCaptioner:
    """An exported model folder's graphs in onnxruntime sessions, with its preprocessing,
    vocabulary and familiarity record."""

    def __init__(self, folder: str | os.PathLike, threads: int | None = None, spin: bool = False):
        """``threads`` and ``spin``: each session's threads, and whether they spin between runs
        (``session``; by default they sleep: the encoder and the step take turns)."""
        folder = Path(folder)
        config = fmt.read_config(folder)
        if not config.get("onnx"):
            raise fmt.FolderError(f"{folder} has no ONNX graphs: export it with --onnx "
                                  "(captioner export CHECKPOINT --out FOLDER --onnx)")
        fmt.require(folder, *fmt.graph_files(config))
        words = fmt.read_vocab(folder, config)
        self.familiarity = fmt.read_familiarity(folder, config)
        self.encoder = session(folder / fmt.ENCODER_ONNX, threads, spin)
        self.decoder = session(folder / fmt.STEP_ONNX, threads, spin)
        self.config, self.words, self.name = config, words, folder.name
        self.tokenizer = tokenizer_named(config["tokenizer"])
        self.preprocess = Preprocess.from_dict(config["preprocess"])
        self.grid = tuple(config["grid"])
        self.max_len = int(config["max_caption_len"])
        self.special = config["special_tokens"]
        s = self.special
        spelling = Spelling.of(words, self.tokenizer, (s["pad"], s["start"], s["end"]))
        self.tokens = Tokens(start=s["start"], end=s["end"], pad=s["pad"], unk=s.get("unk"), spelling=spelling)
        self.training_data = config.get("training_data")
        self.notice = config.get("notice")

    def step(self, word, h, c, annotations, keys):
        """One decoder step for N rows (decoder_step.onnx)."""
        return tuple(self.decoder.run(None, {"word": word, "h": h, "c": c, "annotations": annotations,
                                             "keys": keys}))

    def encode(self, images: np.ndarray) -> tuple[np.ndarray, ...]:
        """(B, 3, H, W) normalised float32 -> annotations, keys, h0, c0, features."""
        return tuple(self.encoder.run(None, {"images": np.ascontiguousarray(images, dtype=np.float32)}))

    def familiarities(self, features: np.ndarray) -> list[float | None]:
        """(B, D) pooled features -> the share of training images at least as far (familiarity.py)."""
        if self.familiarity is None:
            return [None] * len(features)
        f = self.familiarity
        z = (features.astype(np.float32) - f["mean"]) @ f["whiten"]  # (B, D)
        d = (z * z).sum(1)
        reference = f["reference"]
        nearer = np.searchsorted(reference, d, side="left")
        return ((len(reference) - nearer) / len(reference)).tolist()

    def options(self, **given) -> DecodeOptions:
        """DecodeOptions with this model's caption length limit unless ``max_len`` is given."""
        return DecodeOptions(**{"max_len": self.max_len, **{k: v for k, v in given.items() if v is not None}})

    def caption_arrays(self, pixels: np.ndarray, options: DecodeOptions | None = None) -> list[Caption]:
        """(B, H, W, 3) 8-bit pixels at the input size (Preprocess.array) -> one Caption each
        (``options``: by default, ``self.options()``)."""
        opt = options or self.options()
        ann, keys, h0, c0, features = self.encode(self.preprocess.normalize_array(pixels))
        search = greedy if opt.greedy else beam_search
        decoded = search(self.step, ann, keys, h0, c0, self.tokens, opt)
        fam = self.familiarities(features)
        captions = [self._caption(d, f, opt.unfamiliar_below, opt.num_captions > 1) for d, f in zip(decoded, fam)]
        missed = [i for i, d in enumerate(decoded) if not d.ids]
        if missed and opt.max_chars is not None:  # Captioner._no_fits: the shortest caption without the budget
            free = replace(opt, max_chars=None, num_captions=opt.beam_size)
            for i, d in zip(missed, beam_search(self.step, ann[missed], keys[missed], h0[missed], c0[missed],
                                                self.tokens, free)):
                ended = [self.tokenizer.join(self.decode(x.ids)) for x in (d, *d.runners_up)
                         if x.ids[-1:] == [self.special["end"]]]
                captions[i] = replace(captions[i], no_fit=NoFit.among(opt.max_chars, ended))
        return captions

    def decode(self, ids: list[int]) -> list[str]:
        """Words up to the first <end>, <start> and <pad> skipped (Vocabulary.decode)."""
        s, out = self.special, []
        for i in ids:
            if i == s["end"]:
                break
            if i not in (s["pad"], s["start"]):
                out.append(self.words[i])
        return out

    def _caption(self, d: Decoded, familiarity: float | None, below: float, alternatives: bool) -> Caption:
        words = self.decode(d.ids)
        t = len(words)
        ended = len(d.ids) > t and d.ids[t] == self.special["end"]
        probs = np.exp(d.log_probs.astype(np.float64))
        alts = ()
        if alternatives:
            alts = tuple((self.tokenizer.join(self.decode(x.ids)), x.score) for x in (d, *d.runners_up))
        return Caption(words, self.tokenizer.join(words), float(d.score), d.heads[:t].mean(1).reshape(t, *self.grid),
                       d.betas[:t], tuple(probs[:t].tolist()), float(probs[t]) if ended else None, familiarity,
                       None if familiarity is None else familiarity < below, alts)

    def caption_files(self, paths: list[str], options: DecodeOptions | None = None,
                      max_pixels: int = DEFAULT_MAX_PIXELS) -> list[Caption | str]:
        """Each path's Caption, or the reason it could not be read (a string)."""
        out: list[Caption | str] = [""] * len(paths)
        pixels, good = [], []
        for i, path in enumerate(paths):
            try:
                pixels.append(self.preprocess.array(self.preprocess.load(path, max_pixels)))
                good.append(i)
            except ImageLoadError as e:
                out[i] = str(e)
        if good:
            for i, cap in zip(good, self.caption_arrays(np.stack(pixels), options)):
                out[i] = cap
        return out


def discover(paths: list[str]) -> list[str]:
    """Image files: those given, and those found (sorted) in the folders given."""
    found = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            found += sorted(str(f) for f in path.rglob("*") if f.is_file() and is_image_path(f))
        elif path.exists():
            found.append(p)
        else:
            raise FileNotFoundError(f"no such file or folder: {p}")
    return found


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m captioner.onnx",
                description="Caption images with an exported model's ONNX graphs (captioner export --onnx), with "
                            "onnxruntime, numpy and pillow only: no torch. One JSON line per image, as captioner "
                            "caption writes them. Exit code: 0 all captioned, 1 some failed, 2 usage error.")
    p.add_argument("folder", metavar="MODEL_FOLDER", help="the folder captioner export --onnx wrote")
    p.add_argument("images", nargs="+", metavar="IMAGE", help="image files or folders (searched recursively)")
    p.add_argument("--beam-size", type=parser("beam_size"), default=3, help="beam width; 1 = greedy (default 3)")
    p.add_argument("--max-len", type=parser("max_len"), default=None,
                   help="most tokens per caption (default: the longest caption the model was trained on)")
    p.add_argument("--num-captions", type=parser("num_captions"), default=1, metavar="N",
                   help='also write "alternatives": the N best finished captions, best first (N <= --beam-size)')
    p.add_argument("--allow-unk", action="store_true",
                   help="let captions hold <unk>, the vocabulary's word for any word it lacks (default: never)")
    p.add_argument("--max-chars", type=parser("max_chars"), default=None, metavar="C",
                   help="the best caption whose text is at most C characters, found by the search, never cut; "
                        "an image no caption fits is an error line that says the shortest found (default: none)")
    p.add_argument("--with-attention", action="store_true", help='add "alphas" (T x H x W) and "betas" (T)')
    p.add_argument("--unfamiliar-below", type=parser("unfamiliar_below", float), default=UNFAMILIAR_BELOW,
                   metavar="SHARE", help=f"report an image as unfamiliar below this familiarity (default "
                                         f"{UNFAMILIAR_BELOW})")
    p.add_argument("--batch-size", type=count, default=16, help="images per batch (default 16)")
    p.add_argument("--threads", type=count, default=None, help="onnxruntime's threads (default: its own)")
    p.add_argument("--spin", action="store_true",
                   help="let onnxruntime's threads spin between runs rather than sleep (default: sleep; spinning "
                        "threads of the encoder and of the step take each other's cores, see docs/export.md)")
    p.add_argument("--out", type=Path, default=None, help="JSON-lines output file (default stdout)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prog = "python -m captioner.onnx"
    try:
        DecodeOptions(beam_size=args.beam_size, num_captions=args.num_captions)  # before the model loads
        model = OnnxCaptioner(args.folder, threads=args.threads, spin=args.spin)
        options = model.options(beam_size=args.beam_size, max_len=args.max_len, num_captions=args.num_captions,
                                unfamiliar_below=args.unfamiliar_below, allow_unk=args.allow_unk,
                                max_chars=args.max_chars)
        paths = discover(args.images)
    except OptionError as e:
        print(f"{prog}: error: {e.for_command()}", file=sys.stderr)
        return 2
    except (fmt.FolderError, FileNotFoundError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:
        print(f"{prog}: error: {e} (pip install onnxruntime numpy pillow)", file=sys.stderr)
        return 2
    if model.notice:
        print(f"{prog}: note: {model.notice}", file=sys.stderr)
    tag = {"model": model.name, **({"training_data": model.training_data} if model.training_data else {})}
    failed = 0
    out = open(args.out, "w", encoding="utf-8") if args.out is not None else sys.stdout
    try:
        for i in range(0, len(paths), args.batch_size):
            chunk = paths[i:i + args.batch_size]
            results = model.caption_files(chunk, options)
            for path, r in zip(chunk, results):
                if isinstance(r, str) or r.no_fit is not None:
                    failed += 1
                    record = {"image": path, "error": r if isinstance(r, str) else r.no_fit.reason}
                else:
                    record = {**r.to_json(path, args.with_attention), **tag}
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
            out.flush()
    finally:
        if out is not sys.stdout:
            out.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
