"""The Captioner: model + vocabulary + preprocessing, rebuilt from one checkpoint."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import torch

from captioner.data.images import DEFAULT_MAX_PIXELS, Preprocess, as_image
from captioner.data.vocab import Vocabulary
from captioner.io.bundled import DEFAULT, DEMOS, SYNTHETIC_SHAPES, BundledModel, bundled_at, shapes_only_notice
from captioner.io.checkpoint import Checkpoint, CheckpointError, TrainingState, load_checkpoint, training_data_of
from captioner.io.folder import CONFIG, WEIGHTS, is_model_folder, shape_mismatch
from captioner.model import kernels
from captioner.model.decoder import CaptionModel
from captioner.model.encoders import Annotations
from captioner.model.familiarity import TrainingFeatures, pooled
from captioner.search.decoding import Alternative, CaptionResult, DecodedIds, beam_search, greedy
from captioner.search.graph import SearchGraphs, search_form
from captioner.search.options import DecodeOptions, Tokens

__all__ = ["Captioner", "DecodeOptions", "resolve_weights"]


def resolve_weights(weights: str | os.PathLike | None) -> Path:
    """A bundled model name (demo-soft, demo-hard, demo-zh), a path to a checkpoint file, or a
    model folder ``captioner export`` wrote."""
    name = str(weights or DEFAULT)
    if name in DEMOS:
        if not DEMOS[name].installed:
            raise CheckpointError(f"the bundled model {name!r} is missing from this installation ({DEMOS[name].path})")
        return DEMOS[name].path
    path = Path(name).expanduser()
    if path.is_dir():
        if not is_model_folder(path):
            raise CheckpointError(f"no such checkpoint: {name} is a folder but not an exported model (it has no "
                                  f"{CONFIG}); give a checkpoint file, or a folder `captioner export` wrote")
        return path
    if not path.is_file():
        raise CheckpointError(f"no such checkpoint: {name} (use a file path, an exported model folder, or one "
                              f"of {', '.join(DEMOS)})")
    return path


# The files every run of `captioner train` writes: named alone, they would not say which model.
RUN_FILES = ("best.pt", "last.pt")


def checkpoint_name(path: Path, meta: dict | None) -> str:
    """A checkpoint's name in JSON lines, overlay titles and the app: the file's name, but for a
    run's best.pt or last.pt its run's with it ("my-photos/best.pt"): the run's folder as
    training recorded it (``meta["run"]``), else the folder the file lies in."""
    if path.name not in RUN_FILES:
        return path.name
    run = (meta or {}).get("run")
    run = run if isinstance(run, str) and run else path.resolve().parent.name
    return f"{run}/{path.name}" if run else path.name


# Numeric precision -> autocast dtype (None: no autocast). Training uses the same names.
AUTOCAST_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
INFERENCE_PRECISIONS = tuple(AUTOCAST_DTYPES)


class Captioner:
    def __init__(self, model: CaptionModel, vocab: Vocabulary, preprocess: Preprocess, meta: dict | None = None,
                 *, name: str | None = None, demo: BundledModel | None = None,
                 familiarity: TrainingFeatures | None = None):
        self.model = model.eval()
        self.vocab = vocab
        self.preprocess = preprocess
        self.meta = dict(meta or {})
        self.precision = "fp32"
        self.name = name  # what the user chose: a bundled model's name or the file's name
        self.demo = demo  # the record of the demo model shipped in the package that this is, if one
        self.familiarity = familiarity  # its training images' features; None: familiarity unknown
        self._search_graphs: SearchGraphs | None = None  # the beam search's graphs, on a GPU
        self._channels_last = False  # the encoder's weights in channels-last memory (encode)

    @property
    def training_data(self) -> str | None:
        """What the model was trained on, in words, when known, and never where it lay on the
        trainer's disk (the app shows it to every visitor). Checkpoints from ``captioner train``
        store it as ``meta["training_data"]`` (``checkpoint.training_data_of``); the bundled models
        are trained on the synthetic shapes whatever their metadata says (older files name only
        the data folder)."""
        said = training_data_of(self.meta)
        if said is not None:
            return said
        if self.demo is not None:
            return self.demo.training_data
        data = self.meta.get("data")
        return f"the data in a folder named {Path(data).name}" if isinstance(data, str) and data else None

    @property
    def bundled(self) -> bool:
        """One of the demo models shipped in the package."""
        return self.demo is not None

    @property
    def shapes_only(self) -> bool:
        """True for a model that has seen the synthetic shapes and nothing else."""
        return self.bundled or (self.training_data or "").startswith(SYNTHETIC_SHAPES)

    @property
    def max_len(self) -> int:
        """The longest caption, in tokens, the model was trained on (``meta["max_caption_len"]``):
        the length limit of decoding unless one is asked for. 20 where the checkpoint does not
        say (the English demos); a Chinese model counts characters, about twice as many."""
        n = self.meta.get("max_caption_len")
        return n if isinstance(n, int) and n > 0 else DecodeOptions.max_len

    def notice(self) -> str | None:
        """One sentence for the user of a shapes-only model (the demos); None for others."""
        if not self.shapes_only:
            return None
        if self.demo is not None:
            return self.demo.notice()
        return shapes_only_notice(f"{self.name or 'this model'} is")

    def use_precision(self, precision: str) -> "Captioner":
        """"fp32" (default), or "bf16"/"fp16" autocast for encoder and decoder (a GPU's fast
        path; on a CPU bf16 helps where it has bf16 instructions). Scores and maps come back as fp32."""
        if precision not in INFERENCE_PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(INFERENCE_PRECISIONS)}, got {precision!r}")
        self.precision = precision
        return self

    def compile(self, **options) -> "Captioner":
        """torch.compile the decoder's per-word step (see Decoder.compile_step); the first
        batch waits for the compiler."""
        self.model.decoder.compile_step(**options)
        return self

    @property
    def tokens(self) -> Tokens:
        """The vocabulary's special ids, as the searches take them."""
        v = self.vocab
        return Tokens(start=v.start, end=v.end, pad=v.pad, unk=v.unk)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, device: str | torch.device = "cpu", *, name: str | None = None,
                        demo: BundledModel | None = None) -> "Captioner":
        """The one way a model is rebuilt from a checkpoint (captioning, evaluation, export,
        resuming a run, the studies)."""
        cfg = ckpt.model_config
        # The checkpoint holds every encoder weight: build the encoder without asking
        # torchvision for ImageNet weights (no network, no hub cache needed), and keep the
        # config saying how the model was trained.
        model = CaptionModel(replace(cfg, encoder_pretrained=False))
        model.config = replace(model.config, encoder_pretrained=cfg.encoder_pretrained)
        try:
            model.load_state_dict(ckpt.state_dict)
        except RuntimeError as e:  # a module's own reason, else the first misfit in words
            wrong = shape_mismatch({k: tuple(v.shape) for k, v in model.state_dict().items()},
                                   {k: tuple(v.shape) for k, v in ckpt.state_dict.items()})
            reason = wrong if wrong is not None and str(e).startswith("Error(s) in loading") else str(e)
            raise CheckpointError(f"checkpoint weights do not fit its own config: {reason}") from None
        vocab = ckpt.vocabulary
        if len(vocab) != cfg.vocab_size:
            raise CheckpointError(f"vocabulary has {len(vocab)} words but the model expects {cfg.vocab_size}")
        familiarity = ckpt.familiarity
        if familiarity is not None and len(familiarity.mean) != model.encoder.dim:
            raise CheckpointError(f"checkpoint's familiarity record describes {len(familiarity.mean)}-dimensional "
                                  f"features, its encoder gives {model.encoder.dim}")
        return cls(model.to(device), vocab, ckpt.preprocess, ckpt.meta,
                   name=name, demo=demo, familiarity=None if familiarity is None else familiarity.to(device))

    @classmethod
    def load(cls, weights: str | os.PathLike | None = None, device: str | torch.device = "cpu") -> "Captioner":
        path = resolve_weights(weights)
        return cls.from_file(path, load_checkpoint(path, map_location=device), device)

    @classmethod
    def from_file(cls, path: Path, ckpt: Checkpoint, device: str | torch.device = "cpu") -> "Captioner":
        """The captioner of ``ckpt``, read from ``path``: named by its file, and a demo (its
        record, its notice) when the file is a shipped one, however it was named."""
        demo = bundled_at(path)
        name = demo.name if demo is not None else checkpoint_name(path, ckpt.meta)
        if demo is None and ckpt.demo in DEMOS:  # a demo's exported folder: its record and notice
            demo = DEMOS[ckpt.demo]
        try:
            return cls.from_checkpoint(ckpt, device, name=name, demo=demo)
        except CheckpointError as e:
            if not path.is_dir():
                raise
            raise CheckpointError(str(e).replace("checkpoint weights do not fit its own config",
                                                 f"{path / WEIGHTS} does not fit its {CONFIG}")) from None

    def checkpoint(self, meta: dict | None = None, train_state: TrainingState | None = None) -> Checkpoint:
        """This captioner as a checkpoint, ``meta`` added to its own."""
        return Checkpoint(model_config=self.model.config, vocab=tuple(self.vocab.to_list()),
                          tokenizer=self.vocab.tokenizer.name, preprocess=self.preprocess,
                          state_dict=self.model.state_dict(), meta={**self.meta, **(meta or {})},
                          train_state=train_state, familiarity=self.familiarity)

    def save(self, path: str | os.PathLike, meta: dict | None = None) -> None:
        self.checkpoint(meta).save(path)

    def autocast(self) -> torch.autocast:
        """The autocast of this captioner's precision (off for fp32), on its device."""
        dtype = AUTOCAST_DTYPES[self.precision]
        return torch.autocast(self.device.type, dtype=dtype or torch.float32, enabled=dtype is not None)

    @torch.no_grad()
    def caption_batch(self, images: torch.Tensor, options: DecodeOptions | None = None) -> list[CaptionResult]:
        """Preprocessed images (B, 3, H, W) -> one CaptionResult each. 8-bit pixels
        (``Preprocess.pixels``, as the batch loader hands them over) are normalised here, on the
        model's device."""
        opt = options or DecodeOptions()
        self.model.eval()
        with self.autocast():
            ann = self.encode(images)
            graphed = search_form(ann.vectors.device, opt.hard_attention, self.model.decoder.compiled) == "graphed"
            if opt.greedy and not graphed:
                decoded = greedy(self.model.decoder, ann, self.tokens, opt)
            else:
                decoded = self.beam_search_batch(ann, opt)
        results = [self.to_result(d, ann.grid, alternatives=opt.num_captions > 1, length_penalty=opt.length_penalty)
                   for d in decoded]
        if self.familiarity is None:
            return results
        known = self.familiarity.score(pooled(ann.vectors), opt.unfamiliar_below)
        return [replace(r, familiarity=f) for r, f in zip(results, known)]

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> Annotations:
        """Preprocessed images (B, 3, H, W), 8-bit pixels or normalised -> their annotations, on
        the model's device, under the caller's autocast. On CUDA in bf16 or fp16, with the
        kernels on, the encoder and the images are put in channels-last memory first
        (``kernels.channels_last_ok``: the layout cuDNN computes in there); back to torch's
        default layout when that no longer holds (fp32, another device)."""
        images = images.to(self.device)
        if images.dtype == torch.uint8:
            images = self.preprocess.normalize(images)
        nhwc = kernels.channels_last_ok(self.device, AUTOCAST_DTYPES[self.precision])
        if nhwc != self._channels_last:
            with torch.inference_mode(False):  # weights that training, or a later call, may still write
                self.model.encoder.to(memory_format=torch.channels_last if nhwc else torch.contiguous_format)
            self._channels_last = nhwc
        if nhwc:
            images = images.contiguous(memory_format=torch.channels_last)
        return self.model.encode(images)

    def beam_search_batch(self, ann: Annotations, opt: DecodeOptions) -> list[DecodedIds]:
        """The beam search: its plain form, or on a GPU its fixed program replayed as CUDA graphs
        (captioner.search_graph), which returns the same captions (there greedy decoding too
        runs as a search of width 1: the same captions, without a host wait at every word)."""
        decoder = self.model.decoder
        if search_form(ann.vectors.device, opt.hard_attention, decoder.compiled) == "plain":
            return beam_search(decoder, ann, self.tokens, opt)
        if self._search_graphs is None or self._search_graphs.decoder is not decoder:
            self._search_graphs = SearchGraphs(decoder)
        return self._search_graphs.search(ann, self.tokens, opt)

    def to_result(self, d: DecodedIds, grid: tuple[int, int], alternatives: bool = False,
                  length_penalty: float = 0.0) -> CaptionResult:
        """``alternatives``: the result lists ``d`` and its runners-up as Alternatives, each with
        the rank the search ordered them by where ``length_penalty`` > 0."""
        words = self.vocab.decode(d.ids)
        t = len(words)  # one alpha map per word; the <end> step is not shown
        heads = d.alphas_heads[:t].unflatten(-1, grid)  # (T, h, H, W), on the host already (DecodedIds)
        probs = d.log_probs.double().exp().tolist()  # (T,) or (T + 1,) with <end>
        ended = d.ids[-1:] == [self.vocab.end]
        text = self.vocab.join(words)

        def alternative(x: DecodedIds, w: list[str], text: str) -> Alternative:
            rank = x.score / len(x.ids) ** length_penalty if length_penalty > 0 else None
            return Alternative(tuple(w), x.score, text, rank)

        alts = ((alternative(d, words, text),
                 *(alternative(x, w, self.vocab.join(w)) for x in d.runners_up for w in [self.vocab.decode(x.ids)]))
                if alternatives else ())
        return CaptionResult(words, d.alphas[:t].reshape(t, *grid), d.betas[:t], d.score,
                             heads, text=text, word_probs=tuple(probs[:t]), alternatives=alts,
                             end_prob=probs[t] if ended else None)

    def caption_images(self, images: list, options: DecodeOptions | None = None,
                       max_pixels: int = DEFAULT_MAX_PIXELS) -> list[CaptionResult]:
        """Each image a path, raw bytes, a PIL image of any mode or an array, read as ``captioner
        caption`` reads files (``captioner.data.images.as_image``)."""
        if not images:
            return []
        side = self.preprocess.decode_side
        batch = torch.stack([self.preprocess(as_image(im, max_pixels, side)) for im in images])
        return self.caption_batch(batch, options)

    def caption(self, image, options: DecodeOptions | None = None,
                max_pixels: int = DEFAULT_MAX_PIXELS) -> CaptionResult:
        """One image: a path, raw bytes, a PIL image of any mode or an array (see ``caption_images``)."""
        return self.caption_images([image], options, max_pixels)[0]
