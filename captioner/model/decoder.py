"""Show, Attend and Tell: encoder, attention LSTM decoder with the beta gate, deep output.

Legend: B batch, T caption steps, L locations, D annotation size, E embedding size,
H hidden size, V vocabulary size.

    h_0 = tanh(f_init_h(mean_i a_i)),  c_0 = tanh(f_init_c(mean_i a_i))
    alpha_t = softmax(f_att(a, h_{t-1}))                  (attention.py)
                  with heads > 1: h such maps, each head's context projected to
                  D/h, concatenated and projected back to D before the gate
                  (multihead.py); alpha_t is the mean of the h maps (h = 1: the map)
    beta_t = sigmoid(f_beta(h_{t-1}))                     a scalar per step
    z_t = beta_t * sum_i alpha_ti a_i                     (hard: beta_t * a_{s_t})
                  with coords: a_i is [a_i; x_i; y_i], its cell's centre in [-1, 1]
                  appended, so z_t carries beta_t * sum_i alpha_ti (x_i, y_i), where
                  the map looks
    h_t, c_t = LSTM([E y_{t-1}; z_t], (h_{t-1}, c_{t-1}))
    p(y_t) = softmax(L_o(dropout(E y_{t-1} + L_h h_t + L_z z_t)))
"""

from __future__ import annotations

import types
from dataclasses import asdict, dataclass, fields

import torch
from torch import nn

from captioner.model import kernels
from captioner.model.attention import LocalWidthName, ModeName, NormalizerName, ScoreName
from captioner.model.encoders import Annotations, create_encoder
from captioner.model.grid import GridSelfAttention, check_grid_fields
from captioner.model.multihead import build_attention
from captioner.model.teacher_forcing import DecoderOutput, unrolled


@dataclass
class ModelConfig:
    vocab_size: int
    encoder: str = "small"
    encoder_pretrained: bool = False
    fine_tune_blocks: int = 0
    freeze_encoder: bool = False  # keep even a from-scratch encoder fixed (e.g. for a feature cache)
    annotation_dim: int = 128  # D: set from the encoder
    image_size: tuple[int, int] = (128, 128)
    embed_dim: int = 512
    hidden_dim: int = 512
    attention_dim: int = 512
    dropout: float = 0.5
    attention: ModeName = "soft"
    score: ScoreName = "additive"
    normalizer: NormalizerName = "softmax"
    local_window: float = 0.0
    # fixed: local_window; learned: predicted per step, starting at local_window
    local_width: LocalWidthName = "fixed"
    heads: int = 1  # decoder attention heads; values of D/h each, concatenated and projected back to D
    # Self-attention over the grid cells before the decoder (grid.py): blocks (0: none),
    # heads, clip of the relative offsets, block width (0: min(D, 512)), feed-forward (0: 2x width).
    grid_layers: int = 0
    grid_heads: int = 8
    rel_pos_clip: int = 4
    grid_dim: int = 0
    grid_ff: int = 0
    # Append each cell's centre (x, y in [-1, 1]) to its annotation, after the grid layers:
    # the context then says where the map looks, which features that carry position only
    # weakly (a conv trunk) do not; the decoder's D becomes the encoder's + 2.
    coords: bool = False

    def __post_init__(self):
        check_grid_fields(dim=self.annotation_dim, layers=self.grid_layers, heads=self.grid_heads,
                          rel_pos_clip=self.rel_pos_clip, grid_dim=self.grid_dim, grid_ff=self.grid_ff)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["image_size"] = list(self.image_size)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown model config keys: {sorted(unknown)}")
        d = dict(d)
        if "image_size" in d:
            d["image_size"] = tuple(d["image_size"])
        return cls(**d)


@dataclass
class StepOutput:
    logits: torch.Tensor  # (B, V)
    h: torch.Tensor  # (B, H)
    c: torch.Tensor  # (B, H)
    alpha_heads: torch.Tensor  # (B, h, L) each head's map; h = 1 for one head
    beta: torch.Tensor  # (B,)
    sample_log_prob: torch.Tensor | None = None  # (B,) hard attention only
    entropy: torch.Tensor | None = None  # (B,) hard attention only

    @property
    def alpha(self) -> torch.Tensor:
        """(B, L) the heads' mean map (one head: its map)."""
        return self.alpha_heads.mean(1)


def cell_centres(grid: tuple[int, int], device=None, dtype=None) -> torch.Tensor:
    """(1, H*W, 2): each cell's centre (x, y), the image spanning [-1, 1] on both axes, in
    the annotations' row-major order (x grows to the right, y downwards)."""
    rows, cols = grid
    y = (torch.arange(rows, device=device, dtype=dtype) + 0.5) * (2 / rows) - 1
    x = (torch.arange(cols, device=device, dtype=dtype) + 0.5) * (2 / cols) - 1
    yy, xx = torch.meshgrid(y, x, indexing="ij")
    return torch.stack([xx, yy], dim=-1).reshape(1, rows * cols, 2)


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, e, h, v = cfg.annotation_dim, cfg.embed_dim, cfg.hidden_dim, cfg.vocab_size
        grid_d, self.coords = d, cfg.coords
        d += 2 if cfg.coords else 0  # what the decoder attends over (annotate)
        self.attention = build_attention(d, h, cfg.attention_dim, heads=cfg.heads, score=cfg.score,
                                         normalizer=cfg.normalizer, mode=cfg.attention,
                                         local_window=cfg.local_window, local_width=cfg.local_width)
        self.embedding = nn.Embedding(v, e)
        self.init_h = nn.Linear(d, h)
        self.init_c = nn.Linear(d, h)
        self.f_beta = nn.Linear(h, 1)  # scalar gate, as in the paper
        self.lstm = nn.LSTMCell(e + d, h)
        self.L_h = nn.Linear(h, e)
        self.L_z = nn.Linear(d, e)
        self.dropout = nn.Dropout(cfg.dropout)
        self.L_o = nn.Linear(e, v)
        # None when off, so that the model and its state_dict are those of a decoder without it.
        self.grid_attention = GridSelfAttention(
            grid_d, layers=cfg.grid_layers, heads=cfg.grid_heads, rel_pos_clip=cfg.rel_pos_clip, width=cfg.grid_dim,
            ff=cfg.grid_ff) if cfg.grid_layers > 0 else None
        self._compiled_step = None
        self._compiled_recur = None

    def compile_step(self, **options) -> None:
        """Run the per-word step through ``torch.compile`` from now on (training's recurrent
        part and decoding's step).

        One step is some twenty small kernels (attention, gate, LSTM cell, deep output);
        on CUDA the compiler fuses them, which is where the step's time goes at these sizes.
        Hard attention's sampling draws from a torch.Generator, which the compiler leaves
        to eager mode (a graph break), so the soft step gains most. ``options`` go to
        torch.compile (e.g. backend, mode).

        Built to reach a steady state: each model compiles its own copy of the two functions
        (the compiler caches per code object, so models sharing one would take each other's
        recompilation budget), the batch dimension is dynamic (images leave a beam search as
        they finish), and the compiled functions only ever see contiguous tensors that are
        no views (``kernels.plain``): a view and a copy of the same shape are different inputs to
        the compiler. What remains are one graph per kind of call (beam search, greedy,
        training) and per autocast setting."""
        options = {"dynamic": True, **options}  # dynamic=False: one graph per batch size, for a comparison
        self._compiled_step = torch.compile(_own_copy(self._step), **options)
        self._compiled_recur = torch.compile(_own_copy(self._recur), **options)

    @property
    def compiled(self) -> bool:
        return self._compiled_step is not None

    def annotate(self, ann: Annotations) -> Annotations:
        """The annotations the decoder attends over, once per image: the encoder's (or the
        feature cache's), after self-attention over the grid when ``grid_layers`` > 0.
        Every entry point (teacher forcing, greedy, beam search) starts here. With
        ``coords``, each cell's centre is appended (cell_centres). A compiled decoder gets
        them in one layout (``kernels.plain``), once per decode rather than at every step."""
        if self.grid_attention is not None:
            ann = Annotations(self.grid_attention(ann.vectors, ann.grid), ann.grid)
        if self.coords:
            a = ann.vectors
            xy = cell_centres(ann.grid, a.device, a.dtype).expand(a.shape[0], -1, -1)
            ann = Annotations(torch.cat([a, xy], dim=2), ann.grid)
        return Annotations(kernels.plain(ann.vectors), ann.grid) if self._compiled_step is not None else ann

    def init_state(self, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = a.mean(dim=1)  # (B, D)
        return torch.tanh(self.init_h(mean)), torch.tanh(self.init_c(mean))

    def step(self, y_prev: torch.Tensor, h: torch.Tensor, c: torch.Tensor, a: torch.Tensor,
             keys: torch.Tensor, grid: tuple[int, int], *, sample: bool = False, argmax: bool = False,
             generator: torch.Generator | None = None) -> StepOutput:
        """One word: y_prev (B*k,) token ids, state (B*k, H), annotations (B, L, D) and keys
        of B images; k rows per image (k > 1 in beam search: the beams of each image)."""
        if self._compiled_step is None:
            return self._step(y_prev, h, c, a, keys, grid, sample=sample, argmax=argmax, generator=generator)
        plain = kernels.plain
        return self._compiled_step(plain(y_prev), plain(h), plain(c), plain(a), plain(keys), grid,
                                   sample=sample, argmax=argmax, generator=generator)

    def _step(self, y_prev: torch.Tensor, h: torch.Tensor, c: torch.Tensor, a: torch.Tensor,
              keys: torch.Tensor, grid: tuple[int, int], *, sample: bool = False, argmax: bool = False,
              generator: torch.Generator | None = None) -> StepOutput:
        att = self.attention(keys, a, h, grid, sample=sample, argmax=argmax, generator=generator)
        beta = torch.sigmoid(self.f_beta(h))  # (B, 1)
        z = beta * att.context  # (B, D)
        emb = self.embedding(y_prev)  # (B, E)
        h, c = self.lstm(torch.cat([emb, z], dim=1), (h, c))
        logits = self.L_o(self.dropout(emb + self.L_h(h) + self.L_z(z)))  # (B, V)
        return StepOutput(logits, h, c, att.alpha_heads, beta.squeeze(1), att.sample_log_prob, att.entropy)

    def forward(self, ann: Annotations, tokens: torch.Tensor, lengths: torch.Tensor, *,
                sample: bool = False, generator: torch.Generator | None = None,
                steps: int | None = None) -> DecoderOutput:
        """Teacher forcing. tokens (B, T+1) = <start> w_1 .. w_n <end> <pad>..; lengths (B,)
        count the tokens including start and end. The same model as ``forward_stepwise``,
        arranged for speed (``teacher_forcing.unrolled``, which says how; ``steps``: a fixed
        number of steps, the form a CUDA graph records)."""
        return unrolled(self, ann, tokens, lengths, sample=sample, generator=generator, steps=steps)

    def _recur(self, pre: torch.Tensor, h: torch.Tensor, c: torch.Tensor, a: torch.Tensor, keys: torch.Tensor,
               w_zh: torch.Tensor, grid: tuple[int, int], *, sample: bool = False,
               generator: torch.Generator | None = None, product=torch.addmm):
        """The part of a training step that needs h_{t-1}: pre (B, 4H) is the embedding's
        share of the LSTM gates with both biases, w_zh (D + H, 4H) the LSTM's z and h weights,
        ``product`` the gates' pre + [z; h] w_zh (``_lstm_weights``).
        Returns h_t, c_t (B, H), z_t (B, D), the attention step and beta_t (B,)."""
        att = self.attention(keys, a, h, grid, sample=sample, generator=generator)
        beta = torch.sigmoid(self.f_beta(h))  # (B, 1)
        z = beta * att.context  # (B, D)
        zh = torch.cat([z, h], 1)  # (B, D + H)
        gates = product(pre, zh, w_zh)  # (B, 4H), nn.LSTMCell's order i, f, g, o
        i, f, g, o = gates.chunk(4, 1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        return h, c, z, att, beta.squeeze(1)

    def forward_stepwise(self, ann: Annotations, tokens: torch.Tensor, lengths: torch.Tensor, *,
                         sample: bool = False, generator: torch.Generator | None = None) -> DecoderOutput:
        """Teacher forcing as T calls of ``step``, the decoding step: the reference that
        ``forward`` must equal (logits at padding steps aside), and slower."""
        ann = self.annotate(ann)
        a = ann.vectors
        keys = self.attention.prepare(a)  # once per image
        h, c = self.init_state(a)
        steps = int(lengths.max()) - 1
        mask = torch.arange(steps, device=a.device).unsqueeze(0) < (lengths.to(a.device) - 1).unsqueeze(1)
        logits, heads, betas, logps, ents = [], [], [], [], []
        for t in range(steps):
            o = self.step(tokens[:, t], h, c, a, keys, ann.grid, sample=sample, generator=generator)
            h, c = o.h, o.c
            logits.append(o.logits)
            heads.append(o.alpha_heads)
            betas.append(o.beta)
            if o.sample_log_prob is not None:
                logps.append(o.sample_log_prob)
                ents.append(o.entropy)
        return DecoderOutput(
            torch.stack(logits, 1), torch.stack(heads, 1), torch.stack(betas, 1), mask,
            torch.stack(logps, 1) if logps else None, torch.stack(ents, 1) if ents else None)


class CaptionModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.encoder = create_encoder(cfg.encoder, pretrained=cfg.encoder_pretrained,
                                      fine_tune_blocks=cfg.fine_tune_blocks, freeze=cfg.freeze_encoder)
        if cfg.annotation_dim != self.encoder.dim:
            cfg = ModelConfig.from_dict({**cfg.to_dict(), "annotation_dim": self.encoder.dim})
        self.config = cfg
        self.decoder = Decoder(cfg)

    def encode(self, images: torch.Tensor) -> Annotations:
        return self.encoder(images)

    def forward(self, images: torch.Tensor | Annotations, tokens: torch.Tensor, lengths: torch.Tensor,
                **kw) -> DecoderOutput:
        """Images (B, 3, H, W), or annotations already computed (a feature cache)."""
        ann = images if isinstance(images, Annotations) else self.encode(images)
        return self.decoder(ann, tokens, lengths, **kw)


def _own_copy(method):
    """``method`` bound to a copy of its function with a code object of its own: torch.compile
    keeps its compiled graphs, and counts recompilations against its limit, per code object."""
    f = method.__func__
    g = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    g.__kwdefaults__, g.__qualname__ = f.__kwdefaults__, f.__qualname__
    return types.MethodType(g, method.__self__)


def attention_penalty(alphas: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Doubly stochastic regularisation sum_i (1 - sum_t alpha_ti)^2, summed over real steps
    only and averaged over the batch. alphas (B, T, L), mask (B, T)."""
    coverage = (alphas * mask.unsqueeze(-1).to(alphas.dtype)).sum(dim=1)  # (B, L)
    return ((1.0 - coverage) ** 2).sum(dim=1).mean()
