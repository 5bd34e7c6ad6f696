"""The Captioner: model + vocabulary + preprocessing, rebuilt from one checkpoint."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from PIL import Image

from .checkpoint import CheckpointError, atomic_save, load_checkpoint, make_checkpoint
from .decoding import CaptionResult, DecodedIds, beam_search, greedy
from .images import Preprocess
from .model import CaptionModel, ModelConfig
from .vocab import Vocabulary

BUNDLED_DIR = Path(__file__).parent / "weights"
BUNDLED = {"demo-soft": "demo-soft.pt", "demo-hard": "demo-hard.pt"}
DEFAULT_WEIGHTS = "demo-soft"


def resolve_weights(weights: str | os.PathLike | None) -> Path:
    """A bundled model name (demo-soft, demo-hard) or a path to a checkpoint file."""
    name = str(weights or DEFAULT_WEIGHTS)
    if name in BUNDLED:
        path = BUNDLED_DIR / BUNDLED[name]
        if not path.is_file():
            raise CheckpointError(f"the bundled model {name!r} is missing from this installation ({path})")
        return path
    path = Path(name).expanduser()
    if not path.is_file():
        raise CheckpointError(f"no such checkpoint: {name} (use a file path, or one of {', '.join(BUNDLED)})")
    return path


# Numeric precision -> autocast dtype (None: no autocast). Training uses the same names.
AUTOCAST_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
INFERENCE_PRECISIONS = tuple(AUTOCAST_DTYPES)


@dataclass
class DecodeOptions:
    beam_size: int = 3
    max_len: int = 20
    length_penalty: float = 0.0
    # Hard-attention models only. "expected" (default): the context is the alpha-weighted
    # mean of the annotations, the deterministic expectation the model was also trained on
    # (half of its minibatches); "argmax": the single most likely location (what a hard
    # look at one place means, also deterministic); "sample": s_t ~ Multinoulli(alpha_t).
    hard_attention: str = "expected"


class Captioner:
    def __init__(self, model: CaptionModel, vocab: Vocabulary, preprocess: Preprocess, meta: dict | None = None):
        self.model = model.eval()
        self.vocab = vocab
        self.preprocess = preprocess
        self.meta = dict(meta or {})
        self.precision = "fp32"

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
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @classmethod
    def from_checkpoint(cls, ckpt: dict, device: str | torch.device = "cpu") -> "Captioner":
        cfg = ModelConfig.from_dict(ckpt["model_config"])
        # The checkpoint holds every encoder weight: build the encoder without asking
        # torchvision for ImageNet weights (no network, no hub cache needed), and keep the
        # config saying how the model was trained.
        model = CaptionModel(replace(cfg, encoder_pretrained=False))
        model.config = replace(model.config, encoder_pretrained=cfg.encoder_pretrained)
        try:
            model.load_state_dict(ckpt["state_dict"])
        except RuntimeError as e:
            raise CheckpointError(f"checkpoint weights do not fit its own config: {e}") from e
        vocab = Vocabulary(list(ckpt["vocab"]))
        if len(vocab) != cfg.vocab_size:
            raise CheckpointError(f"vocabulary has {len(vocab)} words but the model expects {cfg.vocab_size}")
        return cls(model.to(device), vocab, Preprocess.from_dict(ckpt["preprocess"]), ckpt.get("meta"))

    @classmethod
    def load(cls, weights: str | os.PathLike | None = None, device: str | torch.device = "cpu") -> "Captioner":
        return cls.from_checkpoint(load_checkpoint(resolve_weights(weights), map_location=device), device)

    def checkpoint(self, meta: dict | None = None, train_state: dict | None = None) -> dict:
        return make_checkpoint(model_state=self.model.state_dict(), model_config=self.model.config.to_dict(),
                               vocab=self.vocab.to_list(), preprocess=self.preprocess.to_dict(),
                               meta={**self.meta, **(meta or {})}, train_state=train_state)

    def save(self, path: str | os.PathLike, meta: dict | None = None) -> None:
        atomic_save(self.checkpoint(meta), path)

    @torch.no_grad()
    def caption_batch(self, images: torch.Tensor, options: DecodeOptions | None = None) -> list[CaptionResult]:
        """Preprocessed images (B, 3, H, W) -> one CaptionResult each."""
        opt = options or DecodeOptions()
        self.model.eval()
        dtype = AUTOCAST_DTYPES[self.precision]
        v = self.vocab
        with torch.autocast(self.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            ann = self.model.encode(images.to(self.device))
            if opt.beam_size == 1 and opt.length_penalty == 0:
                decoded = greedy(self.model.decoder, ann, start=v.start, end=v.end, pad=v.pad, max_len=opt.max_len,
                                 hard=opt.hard_attention)
            else:
                decoded = beam_search(self.model.decoder, ann, start=v.start, end=v.end, pad=v.pad,
                                      beam_size=opt.beam_size, max_len=opt.max_len,
                                      length_penalty=opt.length_penalty, hard=opt.hard_attention)
        return [self.to_result(d, ann.grid) for d in decoded]

    def to_result(self, d: DecodedIds, grid: tuple[int, int]) -> CaptionResult:
        words = self.vocab.decode(d.ids)
        t = len(words)  # one alpha map per word; the <end> step is not shown
        return CaptionResult(words, d.alphas[:t].reshape(t, *grid).float().cpu(), d.betas[:t].float().cpu(), d.score)

    def caption_images(self, images: list[Image.Image], options: DecodeOptions | None = None) -> list[CaptionResult]:
        if not images:
            return []
        batch = torch.stack([self.preprocess(im) for im in images])
        return self.caption_batch(batch, options)

    def caption(self, image: Image.Image, options: DecodeOptions | None = None) -> CaptionResult:
        return self.caption_images([image], options)[0]
