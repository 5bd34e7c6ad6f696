"""int8 graphs for the torch-free runtime (``captioner export --onnx --int8 [FORM]``), in two forms.

``arithmetic`` (the default): the two graphs captioner.io.export writes are quantised with
onnxruntime's tools, each the way its arithmetic suits:

    decoder_step.onnx   dynamically: the weights of its matrix products (the LSTM's gates, the
                        attention's query, the deep output layer, the gate), per output channel,
                        and its word embedding stored in 8 bits, each activation quantised as it
                        comes (no calibration; products of two activations, the attention's,
                        stay fp32)
    encoder.onnx        statically: convolutions and matrix products with int8 weights per output
                        channel and uint8 activations whose ranges are calibrated on images like
                        the training images (QDQ format, onnxruntime fuses it into int8 kernels)

Weights keep 7 bits of the 8 (reduce_range), for CPUs without VNNI (docs/export.md).

The graphs keep their names, inputs and outputs, so ``python -m captioner.onnx`` runs the
folder unchanged; model.safetensors stays fp32 (torch reads it as before). Whether int8 is
faster depends on the CPU: with VNNI (AVX-512 VNNI, AVX-VNNI) or AMX its integer products run
at several times fp32's rate, without them (AVX2 alone) the static encoder can be slower than
fp32. So the export times each part both ways on a few images, on the CPU it runs on, and says
in one line where int8 is slower.

``weights``: only the stored weights shrink (``weights_only``): convolution weights in int8 with a
scale per output channel, every other weight of 1,024 values or more in fp16, each expanded back
to fp32 by a Cast (and a Mul by the scales) that onnxruntime folds once, as the graph loads. The
graphs then compute in fp32, as the fp32 graphs do, at their speed: smaller files that keep fp32's
captions. int8 arithmetic rounds every activation too, and on models whose captions hold several
wordings at nearly equal probability (the demos) that tips a share of captions to another
wording; rounding the step's weights alone to 8 bits already does (docs/results.md gives the
shares), so the weights form keeps the step's weights in 16 bits and rounds to 8 only the
convolutions'.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy and the images load when a model is quantised, not when the CLI starts
    import numpy as np

    from captioner.data.images import Preprocess

CALIBRATION_IMAGES = 64  # the most images the encoder's ranges are calibrated on
SHAPES_SEED = 7373  # fresh shapes images for a shapes model's calibration: a seed no demo was trained on
TIMED_IMAGES = 4  # images the export times each encoder on, at batch 1
TIMED_STEPS = 20  # decoder steps it times each step graph on, 3 rows (beam 3 at batch 1)
BEAMS = 3
AGREEMENT_IMAGES = 64  # calibration images both forms caption, to say how often int8 changes the caption
FORMS = ("arithmetic", "weights")  # --int8's forms; the first is the default
SMALLEST_FP16 = 1024  # float weights with fewer values (biases, norms' scales) stay fp32 in the weights form
FP16_MAX = 65504.0  # the largest finite fp16: a tensor reaching past it stays fp32


class CalibrationError(ValueError):
    """The int8 graphs cannot be made as asked (no calibration images, no onnxruntime); the
    message says why, in one line."""


NEEDS = '--int8 needs onnxruntime\'s quantisation tools: pip install "captioner[export,runtime]"'


def require_onnxruntime() -> None:
    """Refuse --int8 at once, before the slow export, where onnxruntime is missing."""
    import importlib.util

    if importlib.util.find_spec("onnxruntime") is None:
        raise CalibrationError(NEEDS)


@dataclass(frozen=True)
class PartTiming:
    """One graph's time in fp32 and int8 on this CPU (medians of interleaved runs)."""

    part: str  # "encoder", "decoder step"
    fp32_ms: float
    int8_ms: float
    per: str  # what one timing covers: "per image", "per step of 3 beams"
    form: str = "arithmetic"  # FORMS

    @property
    def slower(self) -> bool:
        return self.int8_ms > self.fp32_ms

    def line(self) -> str:
        """The timing in one line; where int8 arithmetic is slower, it says so and where it gains.
        The weights form computes in fp32: its line gives the two times, which should be alike."""
        if self.form == "weights":
            return (f"weights-form {self.part}: {self.int8_ms:.2f} ms {self.per}, fp32's {self.fp32_ms:.2f} ms "
                    f"({self.int8_ms / self.fp32_ms:.2f}x; both compute in fp32)")
        figures = f"{self.int8_ms:.2f} ms {self.per} in int8, {self.fp32_ms:.2f} ms in fp32"
        if self.slower:
            return (f"int8 {self.part} is {self.int8_ms / self.fp32_ms:.2f}x slower than fp32 on this CPU ({figures}); "
                    "int8 gains on CPUs with VNNI or AMX (docs/export.md)")
        return f"int8 {self.part} is {self.fp32_ms / self.int8_ms:.2f}x faster than fp32 on this CPU ({figures})"

    def to_dict(self) -> dict:
        return {"fp32_ms": round(self.fp32_ms, 3), "int8_ms": round(self.int8_ms, 3), "per": self.per}


@dataclass(frozen=True)
class Quantized:
    """What quantising a folder's graphs did: config.json's ``onnx.int8``, the timings and sizes."""

    calibration: str  # where the calibration (or, for the weights form, comparison) images came from, in words
    images: int
    timings: tuple[PartTiming, ...]
    fp32_bytes: dict[str, int]  # graph file -> its size before
    int8_bytes: dict[str, int]
    same_captions: float | None = None  # the share of the calibration images int8 captions as fp32 does
    compared: int = 0  # the images that share is over (beam BEAMS)
    form: str = "arithmetic"  # FORMS

    def size_line(self) -> str:
        """The graphs' size against fp32's, and what the form computes in, in one line."""
        fp32, int8 = sum(self.fp32_bytes.values()), sum(self.int8_bytes.values())
        size = f"{int8 / 1e6:.1f} MB, {int8 / fp32:.2f}x fp32's {fp32 / 1e6:.1f} MB"
        if self.form == "weights":
            return (f"int8 graphs (weights form): {size}; computed in fp32 from weights stored in int8 "
                    "(convolutions) and fp16 (the rest)")
        return f"int8 graphs: {size}; encoder calibrated on {self.images} images ({self.calibration})"

    def agreement_line(self) -> str | None:
        """How often int8 keeps fp32's caption, in one line (None: not measured)."""
        if self.same_captions is None:
            return None
        which = "calibration images" if self.form == "arithmetic" else f"images ({self.calibration})"
        return (f"int8 gives fp32's caption for {self.same_captions:.0%} of {self.compared} {which} "
                f"(beam {BEAMS}); the others mostly swap words the model holds nearly equally likely "
                "(docs/export.md)")

    def to_config(self) -> dict:
        if self.form == "weights":
            parts = {
                "encoder": "weights only: convolution weights stored in int8 per output channel, the other "
                           f"weights of {SMALLEST_FP16} values or more in fp16, expanded to fp32 as the graph "
                           "loads; computed in fp32",
                "decoder_step": f"weights only: weights of {SMALLEST_FP16} values or more stored in fp16, expanded "
                                "to fp32 as the graph loads; computed in fp32"}
        else:
            parts = {
                "encoder": "static: int8 weights (7 bits) per output channel, uint8 activations (QDQ), "
                           f"calibrated (min-max) on {self.images} images: {self.calibration}",
                "decoder_step": "dynamic: int8 weights (7 bits) per output channel of its matrix products and "
                                "word embedding, uint8 activations quantised as they come"}
        return {
            "form": self.form,
            **parts,
            "timing": {t.part: t.to_dict() for t in self.timings},
            "bytes": {"fp32": self.fp32_bytes, "int8": self.int8_bytes},
            **({} if self.same_captions is None else {"same_captions": {
                "share": round(self.same_captions, 4), "images": self.compared, "beam_size": BEAMS}}),
        }


def calibration_images(given: Path | None, shapes_only: bool, scratch: Path,
                       required: bool = True) -> tuple[list[Path], str]:
    """The images the encoder's ranges are calibrated on, and where they came from: those in
    ``given`` (searched recursively, at most CALIBRATION_IMAGES spread over them in name order),
    or for a model that knows only the synthetic shapes, fresh shapes images made in ``scratch``.
    Where none are given for another model: refused if ``required`` (int8 arithmetic needs them),
    else none (the weights form uses images only to compare captions)."""
    import numpy as np

    from captioner.data.images import is_image_path

    if given is not None:
        if not given.is_dir():
            raise CalibrationError(f"--calibration {given} is not a folder; give a folder of training images")
        found = sorted(p for p in given.rglob("*") if p.is_file() and is_image_path(p))
        if not found:
            raise CalibrationError(f"--calibration {given} holds no images (.jpg, .png, ...)")
        picked = [found[i] for i in np.linspace(0, len(found) - 1, min(len(found), CALIBRATION_IMAGES)).astype(int)]
        return list(dict.fromkeys(picked)), f"from {given.name}"
    if not shapes_only:
        if not required:
            return [], "none given"
        raise CalibrationError("--int8 calibrates the encoder on images like the model's training images: give "
                               "--calibration DIR, a folder of them (e.g. the training split's images)")
    from captioner.data.shapes import generate_split

    generate_split(scratch, "calibration", CALIBRATION_IMAGES, seed=SHAPES_SEED)
    return sorted((scratch / "images" / "calibration").glob("*.png")), \
        f"fresh synthetic shapes images (seed {SHAPES_SEED})"


def _batches(paths: list[Path], preprocess: Preprocess) -> list[np.ndarray]:
    """Each readable image as the encoder's (1, 3, H, W) input; unreadable ones are left out."""
    from captioner.data.images import ImageLoadError

    out = []
    for p in paths:
        try:
            out.append(preprocess.normalize_array(preprocess.array(preprocess.load(p)))[None])
        except ImageLoadError:
            continue
    if not out:
        raise CalibrationError(f"none of the {len(paths)} calibration images could be read")
    return out


def _median_ms(runs: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Each run's median time in ms over ``rounds`` interleaved rounds, after one warm-up each."""
    for run in runs.values():
        run()
    times = {k: [] for k in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) * 1000)
    return {k: statistics.median(v) for k, v in times.items()}


def load_graphs(paths: dict[str, Path]) -> tuple:
    """A folder's two graphs, ``paths`` by file name, as onnxruntime sessions: (encoder, step),
    made as the runtime makes them, so that their timings are what ``python -m captioner.onnx`` gets."""
    from captioner.io import folder as fmt
    from captioner.onnx.runtime import session

    return session(paths[fmt.ENCODER_ONNX]), session(paths[fmt.STEP_ONNX])


def time_parts(fp32: tuple, int8: tuple, inputs: list[np.ndarray], form: str = "arithmetic") -> tuple[PartTiming, ...]:
    """Each graph in fp32 and in int8 of ``form`` (``load_graphs``' sessions) on this CPU: the encoder
    per image at batch 1 on ``inputs`` (TIMED_IMAGES of them), and one decoder step for 3 rows (beam 3
    at batch 1)."""
    import numpy as np

    enc = {"fp32": fp32[0], "int8": int8[0]}
    step = {"fp32": fp32[1], "int8": int8[1]}
    images = inputs[:TIMED_IMAGES]

    def encode(session):
        return lambda: [session.run(None, {"images": x}) for x in images]

    ms = _median_ms({k: encode(s) for k, s in enc.items()}, rounds=3)
    encoder = PartTiming("encoder", ms["fp32"] / len(images), ms["int8"] / len(images), "per image", form)
    ann, keys, h0, c0, _ = enc["fp32"].run(None, {"images": images[0]})
    feed = {"word": np.full(BEAMS, 1, dtype=np.int64),
            **{k: np.repeat(v, BEAMS, 0) for k, v in (("h", h0), ("c", c0), ("annotations", ann), ("keys", keys))}}

    def steps(session):
        return lambda: [session.run(None, feed) for _ in range(TIMED_STEPS)]

    ms = _median_ms({k: steps(s) for k, s in step.items()}, rounds=3)
    decoder = PartTiming("decoder step", ms["fp32"] / TIMED_STEPS, ms["int8"] / TIMED_STEPS,
                         f"per step of {BEAMS} beams", form)
    return encoder, decoder


def agreement(fp32: tuple, int8: tuple, inputs: list[np.ndarray], tokens, max_len: int) -> float:
    """The share of ``inputs`` (each (1, 3, H, W)) whose caption (beam BEAMS, the runtime's search)
    is the same token for token through the graphs ``int8`` as through ``fp32`` (``load_graphs``)."""
    import numpy as np

    from captioner.onnx.search import beam_search
    from captioner.search.options import DecodeOptions

    options = DecodeOptions(beam_size=BEAMS, max_len=max_len)
    x = np.concatenate(inputs)
    ids = []
    for encoder, step in (fp32, int8):
        def run(word, h, c, annotations, keys, step=step):
            return tuple(step.run(None, {"word": word, "h": h, "c": c, "annotations": annotations, "keys": keys}))

        ann, keys, h0, c0, _ = encoder.run(None, {"images": x})
        ids.append([d.ids for d in beam_search(run, ann, keys, h0, c0, tokens, options)])
    return sum(a == b for a, b in zip(*ids)) / len(x)


def weights_only(src: Path, dst: Path) -> None:
    """Write ``src``'s graph to ``dst`` with its weights stored small and computed as before, in fp32
    (the weights form): each float initializer that only convolutions take as their weights in int8
    with one scale per output channel (absolute maximum / 127, so that a weak channel keeps its own
    precision), expanded by a Cast and a Mul; every other float initializer of SMALLEST_FP16 values
    or more in fp16, expanded by a Cast. The expanded tensors keep the initializers' names, so every
    node reads them as before, and onnxruntime folds the expansions once, when the graph loads."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.load(str(src))
    graph = model.graph
    takers: dict[str, list[tuple[str, int]]] = {}
    for node in graph.node:
        for place, name in enumerate(node.input):
            takers.setdefault(name, []).append((node.op_type, place))
    taken = {i.name for i in graph.initializer}
    kept, expand = [], []

    def fresh(name: str) -> str:
        if name in taken:
            raise ValueError(f"{src.name} already names a tensor {name}")
        taken.add(name)
        return name

    for init in graph.initializer:
        w = numpy_helper.to_array(init)
        if w.dtype != np.float32 or w.size < SMALLEST_FP16:
            kept.append(init)
        elif takers.get(init.name) and all(t == ("Conv", 1) for t in takers[init.name]):
            channels = w.reshape(len(w), -1)
            scale = np.abs(channels).max(1) / 127
            scale[scale == 0] = 1  # an all-zero channel: any scale keeps its zeros
            q = np.round(channels / scale[:, None]).astype(np.int8).reshape(w.shape)
            stored, factor, wide = fresh(f"{init.name}.int8"), fresh(f"{init.name}.scale"), fresh(f"{init.name}.wide")
            kept += [numpy_helper.from_array(q, stored),
                     numpy_helper.from_array(scale.astype(np.float32).reshape(-1, *[1] * (w.ndim - 1)), factor)]
            expand += [helper.make_node("Cast", [stored], [wide], to=TensorProto.FLOAT),
                       helper.make_node("Mul", [wide, factor], [init.name])]
        elif np.abs(w).max() <= FP16_MAX:
            stored = fresh(f"{init.name}.fp16")
            kept.append(numpy_helper.from_array(w.astype(np.float16), stored))
            expand.append(helper.make_node("Cast", [stored], [init.name], to=TensorProto.FLOAT))
        else:
            kept.append(init)
    nodes = expand + list(graph.node)  # the expansions first: each node still comes after what it reads
    del graph.initializer[:], graph.node[:]
    graph.initializer.extend(kept)
    graph.node.extend(nodes)
    onnx.save(model, str(dst))


def _arithmetic(prepared: dict[str, Path], out: dict[str, Path], inputs: list[np.ndarray]) -> None:
    """The arithmetic form of the prepared graphs into ``out``: the step dynamically, the encoder
    statically, calibrated on ``inputs``."""
    from captioner.io import folder as fmt

    try:
        from onnxruntime.quantization import (
            CalibrationDataReader,
            QuantFormat,
            QuantType,
            quantize_dynamic,
            quantize_static,
        )
    except ImportError:
        raise CalibrationError(NEEDS) from None
    # Weights in 7 bits (reduce_range): AVX2's uint8 x int8 products without VNNI add pairs into
    # saturating 16-bit sums, which full-range int8 weights overflow (docs/export.md).
    quantize_dynamic(prepared[fmt.STEP_ONNX], out[fmt.STEP_ONNX], weight_type=QuantType.QInt8,
                     per_channel=True, reduce_range=True, op_types_to_quantize=["MatMul", "Gemm", "Gather"],
                     extra_options={"MatMulConstBOnly": True})  # attention's products of activations stay fp32

    class Images(CalibrationDataReader):  # the prepared (1, 3, H, W) inputs, once each
        def __init__(self):
            self.left = iter(inputs)

        def get_next(self) -> dict | None:
            x = next(self.left, None)
            return None if x is None else {"images": x}

    quantize_static(prepared[fmt.ENCODER_ONNX], out[fmt.ENCODER_ONNX], Images(),
                    quant_format=QuantFormat.QDQ, per_channel=True, reduce_range=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                    op_types_to_quantize=["Conv", "MatMul", "Gemm"])


def quantize(folder: Path, preprocess: Preprocess, calibration: list[Path], source: str, tokens=None,
             max_len: int | None = None, form: str = "arithmetic") -> Quantized:
    """Replace ``folder``'s encoder.onnx and decoder_step.onnx (fp32, as write_onnx made them)
    by their int8 forms (``form``: FORMS), after timing both forms on this CPU; with the
    vocabulary's ``tokens`` (search.options.Tokens) and ``max_len``, after captioning the
    ``calibration`` images with both. The weights form takes no calibration and may be given no
    images: it is then timed on a grey image and compares no captions."""
    import numpy as np

    from captioner.io import folder as fmt

    if form not in FORMS:
        raise ValueError(f"int8 form {form!r}: one of {', '.join(FORMS)}")
    try:
        from onnxruntime.quantization.shape_inference import quant_pre_process
    except ImportError:
        raise CalibrationError(NEEDS) from None
    if calibration or form == "arithmetic":
        inputs = _batches(calibration, preprocess)
    else:
        h, w = preprocess.size
        inputs = [preprocess.normalize_array(np.full((h, w, 3), 128, dtype=np.uint8))[None]]
    names = (fmt.ENCODER_ONNX, fmt.STEP_ONNX)
    fp32 = {n: folder / n for n in names}
    with tempfile.TemporaryDirectory(prefix=".int8.", dir=folder) as tmp:
        tmp = Path(tmp)
        int8 = {n: tmp / n for n in names}
        if form == "weights":
            for n in names:
                weights_only(fp32[n], int8[n])
        else:
            # Each graph's shapes inferred and its batch norms folded into the convolutions first
            # (onnxruntime's advice), so that each product becomes one int8 kernel.
            prepared = {n: tmp / f"prepared.{n}" for n in names}
            for n in names:
                quant_pre_process(str(fp32[n]), str(prepared[n]), skip_symbolic_shape=True)
            _arithmetic(prepared, int8, inputs)
        graphs = load_graphs(fp32), load_graphs(int8)  # read once, for the timings and the captions
        timings = time_parts(*graphs, inputs, form)
        compared = inputs[:AGREEMENT_IMAGES] if calibration else []
        same = None if tokens is None or not compared else agreement(*graphs, compared, tokens, max_len)
        done = Quantized(source, len(inputs) if calibration else 0, timings, {n: fp32[n].stat().st_size for n in names},
                         {n: int8[n].stat().st_size for n in names}, same, len(compared) if same is not None else 0,
                         form)
        for n in names:
            int8[n].replace(fp32[n])
    return done
