"""The Captioner: a model, its vocabulary and preprocessing, captioning images.

Loading (which file a name means, the model rebuilt from a checkpoint, what it says about itself)
is ``captioner.io.loading``; the search is ``captioner.search``. This class runs them on a device
and hands back typed results.

    from captioner import Captioner, DecodeOptions

    cap = Captioner.load()  # the bundled demo-soft model, or a checkpoint path, or an exported folder
    result = cap.caption("photo.jpg", DecodeOptions(beam_size=3))
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from captioner.data.images import DEFAULT_MAX_PIXELS, Preprocess, as_image
from captioner.data.vocab import Vocabulary
from captioner.explain import gradient_maps
from captioner.io.bundled import BundledModel
from captioner.io.checkpoint import Checkpoint, TrainingState, load_checkpoint
from captioner.io.loading import Described, identify, rebuild, resolve_weights
from captioner.model import kernels
from captioner.model.decoder import CaptionModel
from captioner.model.encoders import Annotations
from captioner.model.familiarity import TrainingFeatures, pooled
from captioner.search.budget import NoFit
from captioner.search.decoding import CaptionResult, DecodedIds, beam_search
from captioner.search.graph import SearchGraphs, search_form
from captioner.search.options import DecodeOptions, Tokens
from captioner.search.results import to_result

__all__ = ["Captioner", "DecodeOptions", "resolve_weights"]

# Numeric precision -> autocast dtype (None: no autocast). Training uses the same names.
AUTOCAST_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
INFERENCE_PRECISIONS = tuple(AUTOCAST_DTYPES)


class Captioner(Described):
    """Captions images with one model on one device; ``Described`` answers what the model is."""

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
        return Tokens.of(self.vocab)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, device: str | torch.device = "cpu", *, name: str | None = None,
                        demo: BundledModel | None = None) -> "Captioner":
        """The captioner of a checkpoint, its model rebuilt on ``device`` (``loading.rebuild``)."""
        model, familiarity = rebuild(ckpt, device)
        return cls(model, ckpt.vocabulary, ckpt.preprocess, ckpt.meta, name=name, demo=demo, familiarity=familiarity)

    @classmethod
    def load(cls, weights: str | os.PathLike | None = None, device: str | torch.device = "cpu") -> "Captioner":
        """A bundled demo's name (None: the default), a checkpoint file or an exported folder."""
        path = resolve_weights(weights)
        return cls.from_file(path, load_checkpoint(path, map_location=device), device)

    @classmethod
    def from_file(cls, path: Path, ckpt: Checkpoint, device: str | torch.device = "cpu") -> "Captioner":
        """The captioner of ``ckpt``, read from ``path``: named and recognised as a demo by
        ``loading.identify``."""
        name, demo = identify(path, ckpt)
        model, familiarity = rebuild(ckpt, device, path)
        return cls(model, ckpt.vocabulary, ckpt.preprocess, ckpt.meta, name=name, demo=demo, familiarity=familiarity)

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
    def caption_batch(self, images: torch.Tensor, options: DecodeOptions | None = None,
                      explain: str | Sequence[str] | None = None) -> list[CaptionResult]:
        """Preprocessed images (B, 3, H, W) -> one CaptionResult each. 8-bit pixels
        (``Preprocess.pixels``, as the batch loader hands them over) are normalised here, on the
        model's device. ``explain``: each word's gradient map too, of that kind or of each kind
        given ("gradcam", "gradinput": captioner.explain), in ``CaptionResult.gradients``."""
        opt = options or DecodeOptions()
        self.model.eval()
        with self.autocast():
            ann = self.encode(images)
            decoded = self.beam_search_batch(ann, opt)
            misses = self._no_fits(ann, opt, [i for i, d in enumerate(decoded) if not d.ids])
        results = [replace(to_result(d, self.vocab, ann.grid, opt.num_captions > 1, opt.length_penalty),
                           no_fit=misses.get(i)) for i, d in enumerate(decoded)]
        if explain:
            kinds = (explain,) if isinstance(explain, str) else tuple(explain)
            maps = gradient_maps(self.model.decoder, ann, [d.ids for d in decoded], self.tokens, kinds)
            results = [replace(r, gradients={k: maps[k][i] for k in kinds}) for i, r in enumerate(results)]
        if self.familiarity is None:
            return results
        known = self.familiarity.score(pooled(ann.vectors), opt.unfamiliar_below)
        return [replace(r, familiarity=f) for r, f in zip(results, known)]

    def _no_fits(self, ann: Annotations, opt: DecodeOptions, rows: list[int]) -> dict[int, NoFit]:
        """Why the images ``rows`` got no caption (none fits ``max_chars``): the shortest of the
        captions the same search finds without the budget (its N best, N = its width)."""
        if not rows or opt.max_chars is None:
            return {}
        unbudgeted = replace(opt, max_chars=None, num_captions=opt.beam_size)
        pick = torch.tensor(rows, device=ann.vectors.device)
        found = self.beam_search_batch(Annotations(ann.vectors[pick], ann.grid), unbudgeted)
        misses = {}
        for i, d in zip(rows, found):
            misses[i] = NoFit.among(opt.max_chars, [self.vocab.join(self.vocab.decode(x.ids))
                                                    for x in (d, *d.runners_up) if x.ids[-1:] == [self.vocab.end]])
        return misses

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
        """The beam search (greedy: of width 1), run eagerly, or on a GPU replayed as CUDA graphs
        (``search.graph``), which returns the same captions."""
        decoder = self.model.decoder
        if search_form(ann.vectors.device, opt.hard_attention, decoder.compiled) == "plain":
            return beam_search(decoder, ann, self.tokens, opt)
        if self._search_graphs is None or self._search_graphs.decoder is not decoder:
            self._search_graphs = SearchGraphs(decoder)
        return self._search_graphs.search(ann, self.tokens, opt)

    def caption_images(self, images: list, options: DecodeOptions | None = None,
                       max_pixels: int = DEFAULT_MAX_PIXELS,
                       explain: str | Sequence[str] | None = None) -> list[CaptionResult]:
        """Each image a path, raw bytes, a PIL image of any mode or an array, read as ``captioner
        caption`` reads files (``captioner.data.images.as_image``); ``explain`` as ``caption_batch``."""
        if not images:
            return []
        side = self.preprocess.decode_side
        batch = torch.stack([self.preprocess(as_image(im, max_pixels, side)) for im in images])
        return self.caption_batch(batch, options, explain)

    def caption(self, image, options: DecodeOptions | None = None,
                max_pixels: int = DEFAULT_MAX_PIXELS, explain: str | Sequence[str] | None = None) -> CaptionResult:
        """One image: a path, raw bytes, a PIL image of any mode or an array (see ``caption_images``)."""
        return self.caption_images([image], options, max_pixels, explain)[0]
