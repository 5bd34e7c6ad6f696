"""An exported model folder: what it holds and how it is read, with no torch.

``captioner export`` writes a model as a folder the Hugging Face Hub's conventions expect
(``huggingface_hub.upload_folder`` takes it as it is), with no pickle in it:

    config.json               everything needed to rebuild and run the model (FORMAT, VERSION)
    model.safetensors         the weights, the state_dict's names
    vocab.json                the vocabulary, index order (0..3: <pad> <start> <end> <unk>)
    familiarity.safetensors   the training images' feature record (mean, whiten, reference), if any
    README.md                 the model card, Hub metadata in YAML front matter
    encoder.onnx              with --onnx: images -> annotations, keys, initial state, pooled features
    decoder_step.onnx         with --onnx: one word of the decoder (see captioner.io.export)

Both readers start here: the torch one (``captioner.io.checkpoint.load_checkpoint``, which
reads the folder into a Checkpoint record) and the onnxruntime one (``captioner.onnx``).
A folder with a file missing, a config written by a newer captioner, or tensors whose shapes
do not fit the config is refused with one line saying which.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from captioner.io import tensorfile

FORMAT = "captioner-model"
VERSION = 1
CONFIG, WEIGHTS, VOCAB, FAMILIARITY, CARD = (
    "config.json", "model.safetensors", "vocab.json", "familiarity.safetensors", "README.md")
ENCODER_ONNX, STEP_ONNX = "encoder.onnx", "decoder_step.onnx"
ENCODER_DATA, STEP_DATA = f"{ENCODER_ONNX}.data", f"{STEP_ONNX}.data"  # each graph's weights, beside it
WHAT = {CONFIG: "the model's config", WEIGHTS: "the model's weights", VOCAB: "the vocabulary",
        FAMILIARITY: "the familiarity record its config names", ENCODER_ONNX: "the encoder's ONNX graph",
        STEP_ONNX: "the decoder step's ONNX graph", ENCODER_DATA: "the encoder graph's weights",
        STEP_DATA: "the decoder step graph's weights"}
FAMILIARITY_TENSORS = ("mean", "whiten", "reference")


class FolderError(ValueError):
    """The folder is not a usable exported model; the message says why, in one line."""


def is_model_folder(path: str | os.PathLike) -> bool:
    """A folder ``captioner export`` wrote (it has a config.json)."""
    path = Path(path)
    return path.is_dir() and (path / CONFIG).is_file()


def require(folder: Path, *names: str) -> None:
    for name in names:
        if not (folder / name).is_file():
            raise FolderError(f"{folder} lacks {name} ({WHAT.get(name, name)}); export the model again "
                              "(captioner export CHECKPOINT --out FOLDER) or copy the whole folder")


def weight_files(config: dict) -> list[str]:
    """The files beside an exported folder's ONNX graphs that hold their weights, as its config
    names them (none for folders exported before the weights moved out of the graphs)."""
    onnx = config.get("onnx") or {}
    return [onnx[part]["data"] for part in ("encoder", "step") if (onnx.get(part) or {}).get("data")]


def graph_files(config: dict) -> list[str]:
    """The files of an exported folder's ONNX graphs: each graph, and its weights' file."""
    return [ENCODER_ONNX, STEP_ONNX, *weight_files(config)]


def graph_bytes(folder: str | os.PathLike) -> int:
    """The bytes on disk of an exported folder's ONNX graphs, their weights' files included."""
    folder = Path(folder)
    return sum((folder / name).stat().st_size for name in graph_files(read_config(folder)))


def read_config(folder: str | os.PathLike) -> dict:
    """config.json of ``folder``, checked: its format, a version this captioner reads, its keys."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FolderError(f"no such model folder: {folder}")
    require(folder, CONFIG)
    try:
        config = json.loads((folder / CONFIG).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise FolderError(f"{folder / CONFIG} is not readable JSON ({e})") from None
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        raise FolderError(f"{folder / CONFIG} is not a captioner model config (no \"format\": \"{FORMAT}\")")
    version = config.get("version")
    if not isinstance(version, int) or version > VERSION:
        raise FolderError(f"{folder / CONFIG} has format version {version!r}, written by captioner "
                          f"{config.get('captioner_version', '?')}; this captioner reads up to version {VERSION}: "
                          "upgrade captioner to load it")
    for key in ("model", "preprocess", "tokenizer", "grid", "max_caption_len"):
        if key not in config:
            raise FolderError(f"{folder / CONFIG} lacks {key!r}")
    return config


def read_vocab(folder: Path, config: dict) -> list[str]:
    require(folder, VOCAB)
    try:
        words = json.loads((folder / VOCAB).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise FolderError(f"{folder / VOCAB} is not readable JSON ({e})") from None
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise FolderError(f"{folder / VOCAB} is not a list of words")
    if len(words) != config["model"].get("vocab_size"):
        raise FolderError(f"{folder / VOCAB} has {len(words)} words, the config's model "
                          f"{config['model'].get('vocab_size')}")
    return words


def read_familiarity(folder: Path, config: dict) -> dict | None:
    """The familiarity record as ``TrainingFeatures.to_dict`` gives it, its tensors as numpy
    arrays; None where the config names none."""
    plain = config.get("familiarity")
    if plain is None:
        return None
    require(folder, FAMILIARITY)
    try:
        tensors, _ = tensorfile.read(folder / FAMILIARITY)
    except tensorfile.TensorFileError as e:
        raise FolderError(str(e)) from None
    missing = [k for k in FAMILIARITY_TENSORS if k not in tensors]
    if missing:
        raise FolderError(f"{folder / FAMILIARITY} lacks {', '.join(missing)}")
    dim = config["model"].get("annotation_dim")
    n = tensors["reference"].shape
    if tensors["mean"].shape != (dim,) or tensors["whiten"].shape != (dim, dim) or len(n) != 1 or n[0] == 0:
        raise FolderError(f"{folder / FAMILIARITY} has shapes mean {list(tensors['mean'].shape)}, whiten "
                          f"{list(tensors['whiten'].shape)}, reference {list(n)}; the config's encoder gives "
                          f"{dim}-dimensional features")
    return {**plain, **tensors}


def shape_mismatch(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]]) -> str | None:
    """What keeps weights of these shapes (name -> shape) from a model that has ``expected``:
    the first tensor missing, extra or of another shape, in words; None when they fit."""
    missing = [k for k in expected if k not in found]
    if missing:
        more = ", ..." if len(missing) > 3 else ""
        return f"it lacks {len(missing)} of the model's tensors ({', '.join(missing[:3])}{more})"
    extra = [tensorfile.printable(k) for k in found if k not in expected]  # the file's names: any string
    if extra:
        more = ", ..." if len(extra) > 3 else ""
        return f"it holds tensors the model does not have ({', '.join(extra[:3])}{more})"
    for name, shape in expected.items():
        if tuple(found[name]) != tuple(shape):
            return f"{name} has shape {list(found[name])}, the config's model needs {list(shape)}"
    return None
