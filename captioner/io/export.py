"""``captioner export``: a model as a folder to share and deploy (captioner.io.folder).

The weights go to safetensors, the config, vocabulary and familiarity record beside them
as JSON and safetensors (no pickle anywhere), a model card with the Hub's metadata, and with
``onnx=True`` two ONNX graphs that hold the model's arithmetic while the search stays
outside, in numpy (captioner.onnx), so that captioning needs no torch:

    encoder.onnx        images (B, 3, H, W) normalised
                        -> annotations (B, L, D')  what the decoder attends over (Decoder.annotate)
                           keys (B, L, A)          attention's per-image part (attention.prepare),
                                                   (B, heads, L, K) with heads > 1 (multihead.prepare)
                           h0, c0 (B, H)           the initial LSTM state (init_state)
                           features (B, D)         pooled encoder annotations, for familiarity
    decoder_step.onnx   word (N,) int64, h, c (N, H), annotations (N, L, D'), keys (N, L, A)
                        or (N, heads, L, K)
                        -> log_probs (N, V)        log-softmax of the step's logits
                           h_next, c_next (N, H)
                           alpha (N, heads, L)     each head's attention map
                           beta (N,)               the gate

N rows are the open beams, each with its image's annotations and keys; B and N are dynamic.
With ``int8`` (a form: "arithmetic", "weights") both graphs are then quantised in place
(captioner.io.quantize): same names, inputs and outputs.
A hard-attention model's step is its expected context (DecodeOptions.hard_attention
"expected", the default). The step holds dropout in eval mode: the same numbers as
``Decoder.step`` in eval.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import torch
from torch import nn

from captioner.io import folder as fmt
from captioner.io import quantize, tensorfile
from captioner.io.quantize import Quantized
from captioner.model.familiarity import pooled
from captioner.search.options import Tokens

OPSET = 18
ENCODER_IO = (["images"], ["annotations", "keys", "h0", "c0", "features"])
STEP_IO = (["word", "h", "c", "annotations", "keys"], ["log_probs", "h_next", "c_next", "alpha", "beta"])
# What a folder may hold: written here, or replaced by a new export into it.
OWN_FILES = (fmt.CONFIG, fmt.WEIGHTS, fmt.VOCAB, fmt.FAMILIARITY, fmt.CARD, fmt.ENCODER_ONNX, fmt.STEP_ONNX,
             fmt.ENCODER_DATA, fmt.STEP_DATA)
SMALLEST_OUTSIDE = 4096  # weights of at least this many bytes go to the file beside the graph


class ExportError(ValueError):
    """The export cannot be made as asked; the message says why, in one line."""


@dataclass(frozen=True)
class Exported:
    folder: Path
    files: tuple[str, ...]  # the names written, in the folder
    int8: Quantized | None = None  # with int8: the timings and sizes in fp32 and in int8 (captioner.io.quantize)


class _EncoderGraph(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor):
        ann = self.model.encode(images)
        dec = self.model.decoder
        used = dec.annotate(ann)
        h0, c0 = dec.init_state(used.vectors)
        return used.vectors, dec.attention.prepare(used.vectors), h0, c0, pooled(ann.vectors)


class _StepGraph(nn.Module):
    def __init__(self, model, grid: tuple[int, int]):
        super().__init__()
        self.decoder, self.grid = model.decoder, grid

    def forward(self, word, h, c, annotations, keys):
        o = self.decoder.step(word, h, c, annotations, keys, self.grid)
        return torch.log_softmax(o.logits.float(), dim=-1), o.h, o.c, o.alpha_heads, o.beta


def grid_of(captioner) -> tuple[int, int]:
    """The attention grid (H, W) of the captioner's input size."""
    h, w = captioner.preprocess.size
    with torch.no_grad():
        return captioner.model.encode(torch.zeros(1, 3, h, w, device=captioner.device)).grid


def write_onnx(captioner, folder: Path) -> dict:
    """encoder.onnx and decoder_step.onnx for ``captioner`` in ``folder``, each checked by
    onnx.checker; returns what config.json says of them."""
    try:
        import onnx
    except ImportError:
        raise ExportError('--onnx needs the onnx and onnxscript packages: pip install "captioner[export]"') from None
    model = captioner.model.eval().cpu()
    grid = grid_of(captioner)
    h, w = captioner.preprocess.size
    images = torch.zeros(2, 3, h, w)
    with torch.no_grad():
        ann, keys, h0, c0, _ = _EncoderGraph(model)(images)
    rows = 3  # an odd count, unlike the 2 images, so that no size is taken for another
    word = torch.full((rows,), 1, dtype=torch.long)
    # The first image's row, once per beam; keys are (B, L, A) with one head, (B, heads, L, K) with more.
    step_inputs = (word, *(t[:1].expand(rows, *t.shape[1:]).contiguous() for t in (h0, c0, ann, keys)))
    b, n = torch.export.Dim("batch"), torch.export.Dim("rows")
    jobs = [(fmt.ENCODER_ONNX, _EncoderGraph(model), (images,), ({0: b},), ENCODER_IO),
            (fmt.STEP_ONNX, _StepGraph(model, grid), step_inputs, tuple({0: n} for _ in step_inputs), STEP_IO)]
    for name, graph, inputs, dynamic, (ins, outs) in jobs:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*axis name.*will not be used")  # the step's 5 inputs share it
            torch.onnx.export(graph.eval(), inputs, folder / name, input_names=ins, output_names=outs,
                              dynamic_shapes=dynamic, opset_version=OPSET, dynamo=True, external_data=False,
                              verbose=False)
        onnx.checker.check_model(str(folder / name), full_check=True)
    return {"opset": OPSET, "encoder": {"file": fmt.ENCODER_ONNX, "inputs": ENCODER_IO[0], "outputs": ENCODER_IO[1]},
            "step": {"file": fmt.STEP_ONNX, "inputs": STEP_IO[0], "outputs": STEP_IO[1]},
            "hard_attention": "expected"}


def _plain(value):
    """``value`` as JSON data: containers kept, anything else that JSON lacks as its str."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def familiarity_config(record: dict) -> dict:
    """What config.json says of a familiarity record (``TrainingFeatures.to_dict``): all but its
    tensors, which go to familiarity.safetensors, and how many images it describes."""
    out = {k: _plain(v) for k, v in record.items() if not isinstance(v, torch.Tensor)}
    out["images"] = len(record["reference"])
    return out


def _write_familiarity_file(path: Path, record: dict) -> None:
    tensorfile.write(path, {k: record[k].detach().cpu().numpy() for k in fmt.FAMILIARITY_TENSORS})


def config_of(captioner, grid: tuple[int, int], onnx: dict | None, license: str, source: str | None) -> dict:
    fam = captioner.familiarity
    v = captioner.vocab
    return {
        "format": fmt.FORMAT, "version": fmt.VERSION, "captioner_version": version("captioner"),
        "architecture": "show-attend-and-tell",
        "model": captioner.model.config.to_dict(),
        "preprocess": captioner.preprocess.to_dict(),
        "tokenizer": v.tokenizer.name,
        "special_tokens": {"pad": v.pad, "start": v.start, "end": v.end, "unk": v.unk},
        "max_caption_len": captioner.max_len,
        "grid": list(grid),
        "language": language_of(captioner),
        "demo": captioner.demo.name if captioner.demo is not None else None,
        "notice": captioner.notice(),
        "training_data": captioner.training_data,
        "familiarity": familiarity_config(fam.to_dict()) if fam is not None else None,
        "onnx": onnx,
        "license": license,
        "source": source,
        "meta": _plain(captioner.meta),
    }


def language_of(captioner) -> str | None:
    if captioner.demo is not None:
        return captioner.demo.language
    lang = captioner.meta.get("language")
    if isinstance(lang, str) and lang:
        return lang
    return {"ptb": "en"}.get(captioner.vocab.tokenizer.name)


def _write_config_and_card(folder: Path, config: dict, name: str) -> None:
    from captioner.io.card import model_card

    (folder / fmt.CONFIG).write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    (folder / fmt.CARD).write_text(model_card(config, name=name), encoding="utf-8")


def write_familiarity(folder: str | os.PathLike, record: dict) -> None:
    """Give an exported folder this familiarity record (``captioner familiarity FOLDER``): its
    file, config.json and card, each written beside and renamed over the old one."""
    folder = Path(folder)
    config = fmt.read_config(folder)
    config["familiarity"] = familiarity_config(record)
    tmp = Path(tempfile.mkdtemp(prefix=".familiarity.", dir=folder))
    try:
        _write_familiarity_file(tmp / fmt.FAMILIARITY, record)
        _write_config_and_card(tmp, config, folder.name)
        for name in (fmt.FAMILIARITY, fmt.CARD, fmt.CONFIG):  # the config last: it names the record
            os.replace(tmp / name, folder / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def weights_beside(folder: Path, graph: str, data: str) -> None:
    """Move the weights of the graph ``folder/graph`` (those of SMALLEST_OUTSIDE bytes or more)
    into the file ``folder/data`` beside it, which the graph then names. onnxruntime maps such a
    file and uses the weights where they lie; weights inside the graph it holds twice, once as the
    parsed graph and once as the session's tensors (docs/export.md, "Memory")."""
    import onnx

    model = onnx.load(str(folder / graph))  # ``folder`` is the export's fresh temporary one: no ``data`` yet
    onnx.save(model, str(folder / graph), save_as_external_data=True, all_tensors_to_one_file=True, location=data,
              size_threshold=SMALLEST_OUTSIDE)


def check_target(out: Path) -> None:
    """Refuse a folder that holds anything an export would not write: a user's files are never
    mixed with, nor replaced by, a model's."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file; give a folder (missing folders are made)")
    if out.is_dir():
        others = sorted(p.name for p in out.iterdir() if p.name not in OWN_FILES and not p.name.startswith("."))
        if others:
            raise ExportError(f"--out {out} already holds other files ({', '.join(others[:3])}"
                              f"{', ...' if len(others) > 3 else ''}); give an empty or new folder")


def check_options(onnx: bool, int8: str | None, calibration: str | os.PathLike | None) -> None:
    """Refuse options that do not go together, before anything is loaded."""
    if int8 is not None and int8 not in quantize.FORMS:
        raise ExportError(f"--int8 {int8}: the form is one of {', '.join(quantize.FORMS)}")
    if int8 and not onnx:
        raise ExportError("--int8 quantises the ONNX graphs: give --onnx too")
    if calibration is not None and not int8:
        raise ExportError("--calibration calibrates the int8 encoder: give --onnx --int8 too")


def export(captioner, out: str | os.PathLike, *, onnx: bool = False, license: str = "unknown",
           source: str | None = None, int8: str | None = None,
           calibration: str | os.PathLike | None = None) -> Exported:
    """Write ``captioner`` to the folder ``out`` (made if missing; an earlier export there is
    replaced, whole). Written into a temporary folder beside it first, so a failure (an ONNX
    export that breaks half-way) leaves ``out`` as it was. ``int8``: the ONNX graphs quantised
    (captioner.io.quantize) in that form, "arithmetic" or "weights". The arithmetic form's encoder
    is calibrated on the images in the folder ``calibration``, or, for a model that knows only the
    synthetic shapes, on fresh shapes images; the weights form needs no calibration, and compares
    its captions with fp32's on those images where there are some."""
    out = Path(out)
    check_options(onnx, int8, calibration)
    check_target(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        grid = grid_of(captioner)
        files = [fmt.CONFIG, fmt.WEIGHTS, fmt.VOCAB, fmt.CARD]
        state = {k: t.detach().cpu().contiguous().numpy() for k, t in captioner.model.state_dict().items()}
        tensorfile.write(tmp / fmt.WEIGHTS, state, {"format": "pt"})
        (tmp / fmt.VOCAB).write_text(json.dumps(captioner.vocab.to_list(), ensure_ascii=False, indent=0) + "\n",
                                     encoding="utf-8")
        if captioner.familiarity is not None:
            _write_familiarity_file(tmp / fmt.FAMILIARITY, captioner.familiarity.to_dict())
            files.append(fmt.FAMILIARITY)
        quantized = None
        if int8:  # the calibration images first: a missing folder is told before the slow export
            try:
                quantize.require_onnxruntime()
                images, said = quantize.calibration_images(
                    None if calibration is None else Path(calibration), captioner.shapes_only, tmp / ".calibration",
                    required=int8 == "arithmetic")
            except quantize.CalibrationError as e:
                raise ExportError(str(e)) from None
        graphs = write_onnx(captioner, tmp) if onnx else None
        if graphs is not None:
            files += [fmt.ENCODER_ONNX, fmt.STEP_ONNX]
        if int8:
            try:
                quantized = quantize.quantize(tmp, captioner.preprocess, images, said, Tokens.of(captioner.vocab),
                                              captioner.max_len, form=int8)
            except quantize.CalibrationError as e:
                raise ExportError(str(e)) from None
            graphs["int8"] = quantized.to_config()
        if graphs is not None:  # last: the quantisation above reads and writes whole graphs
            for part, graph, data in (("encoder", fmt.ENCODER_ONNX, fmt.ENCODER_DATA),
                                      ("step", fmt.STEP_ONNX, fmt.STEP_DATA)):
                weights_beside(tmp, graph, data)
                graphs[part]["data"] = data
            files += [fmt.ENCODER_DATA, fmt.STEP_DATA]
        config = config_of(captioner, grid, graphs, license, source)
        _write_config_and_card(tmp, config, out.name)
        out.mkdir(exist_ok=True)
        for name in OWN_FILES:  # an earlier export's files that this one does not write go
            if name not in files:
                (out / name).unlink(missing_ok=True)
        for name in files:
            os.replace(tmp / name, out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Exported(out, tuple(files), quantized)

