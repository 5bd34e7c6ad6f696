"""Self-attention over the annotation grid, with a learned 2-D relative position bias.

Legend: B batch, L = H*W grid cells, D annotation size, M block width (the self-attention's
query/key/value size, M <= D), n heads, c = rel_pos_clip, F feed-forward size.

Each of ``layers`` blocks (pre-norm: LayerNorm before each branch, the residual stream
left as it is, so the annotations keep their scale and meaning for the decoder):

    x = x + W_o MultiHead(LN(x))           over the L cells of one image
    x = x + W_2 GELU(W_1 LN(x))            per cell

with, per head, scores q_i^T k_j / sqrt(M / n) + b[clip(r_j - r_i), clip(c_j - c_i)]:
the bias b is a (2c+1) x (2c+1) table per head and per block, indexed by the row and column
offsets of cell j from cell i, each clipped to [-c, c]. The table does not depend on the
grid size, so the same parameters serve a 14x14 grid at 224 px, 16x16 for shapes, or any
other resolution; offsets beyond c share the edge entry. Without the bias the block is
permutation-equivariant over cells: position enters only through the bias.

A new block is the identity: the bias table and each branch's last layer (W_o, W_2)
start at 0, so a model with grid layers starts as the model without them.

The projections work at width M (``grid_dim``; 0: min(D, 512)) and back to D, so the cost
stays moderate at D = 2048: about 8.4M parameters a block there (M = 512, F = 1024),
against 33.6M at full width.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_MAX_WIDTH = 512


def grid_width(dim: int, grid_dim: int) -> int:
    """M, the block width: ``grid_dim`` if given, else min(D, 512)."""
    return grid_dim if grid_dim > 0 else min(dim, DEFAULT_MAX_WIDTH)


def check_grid_fields(*, dim: int, layers: int, heads: int, rel_pos_clip: int, grid_dim: int, grid_ff: int) -> None:
    """ValueError (one line) unless the grid fields make a valid module for annotations of size D."""
    if layers < 0:
        raise ValueError(f"model.grid_layers must be >= 0 (0: no self-attention over the grid), got {layers}")
    if layers == 0:
        return
    if heads < 1:
        raise ValueError(f"model.grid_heads must be >= 1, got {heads}")
    if rel_pos_clip < 0:
        raise ValueError(f"model.rel_pos_clip must be >= 0 (0: no position bias), got {rel_pos_clip}")
    if grid_dim < 0 or grid_ff < 0:
        name, value = ("grid_dim", grid_dim) if grid_dim < 0 else ("grid_ff", grid_ff)
        raise ValueError(f"model.{name} must be >= 0 (0: the default size), got {value}")
    width = grid_width(dim, grid_dim)
    if width % heads:
        source = "model.grid_dim" if grid_dim > 0 else f"min(annotation size {dim}, {DEFAULT_MAX_WIDTH})"
        raise ValueError(f"the grid width {width} ({source}) is not divisible by grid_heads={heads}")


@lru_cache(maxsize=32)
def _offset_index(gh: int, gw: int, clip: int, device: torch.device | None = None) -> torch.Tensor:
    """(L, L) index into the flattened (2c+1)^2 table: pair (i, j) -> its clipped offset. Made
    on ``device`` and kept: no copy from the host at each call (none may come inside a CUDA graph)."""
    rows = torch.arange(gh, device=device).repeat_interleave(gw)  # (L,) row of each cell, row-major like the encoder
    cols = torch.arange(gw, device=device).repeat(gh)  # (L,)
    dr = (rows.view(1, -1) - rows.view(-1, 1)).clamp(-clip, clip) + clip  # (L, L): r_j - r_i
    dc = (cols.view(1, -1) - cols.view(-1, 1)).clamp(-clip, clip) + clip
    return dr * (2 * clip + 1) + dc


class GridBlock(nn.Module):
    """One pre-norm block of multi-head self-attention and feed-forward over the cells."""

    def __init__(self, dim: int, *, width: int, heads: int, ff: int, clip: int):
        super().__init__()
        self.heads, self.clip = heads, clip
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * width)  # D -> 3M: queries, keys, values
        self.out = nn.Linear(width, dim)  # M -> D
        self.rel_bias = nn.Parameter(torch.zeros(heads, 2 * clip + 1, 2 * clip + 1))
        self.norm2 = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, ff), nn.GELU(), nn.Linear(ff, dim))
        # Each branch's last layer starts at 0, so a new block is the identity: a model with
        # grid layers starts as the model without them and learns what context to add.
        for last in (self.out, self.ff[2]):
            nn.init.zeros_(last.weight)
            nn.init.zeros_(last.bias)

    def position_bias(self, grid: tuple[int, int]) -> torch.Tensor:
        """(n, L, L): bias[h, i, j] = table[h, clip(r_j - r_i), clip(c_j - c_i)]."""
        index = _offset_index(int(grid[0]), int(grid[1]), self.clip, self.rel_bias.device)
        return self.rel_bias.flatten(1)[:, index]  # (n, (2c+1)^2) -> (n, L, L)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x (B, L, D), bias (n, L, L) or None (no position information) -> (B, L, D)."""
        b, cells, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)  # 3 x (B, L, M)
        # (B, L, M) -> (B, n, L, M/n)
        q, k, v = (t.view(b, cells, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        # softmax(q k^T / sqrt(M/n) + bias) v: (B, n, L, L) x (B, n, L, M/n) -> (B, n, L, M/n),
        # torch's fused form. The bias goes in as (1, n, L, L), broadcast over the batch: given
        # 4-D, torch's CPU takes its fused (flash) kernel rather than the unfused form it falls
        # back to for a 3-D mask (docs/grid-self-attention.md has the figures).
        mask = None if bias is None else bias.unsqueeze(0).to(q.dtype)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.out(y.transpose(1, 2).reshape(b, cells, -1))  # (B, L, M) -> (B, L, D)
        return x + self.ff(self.norm2(x))


class GridSelfAttention(nn.Module):
    """``layers`` GridBlocks: annotations (B, L, D) on an H x W grid -> (B, L, D), same grid."""

    def __init__(self, dim: int, *, layers: int, heads: int = 8, rel_pos_clip: int = 4,
                 width: int = 0, ff: int = 0):
        super().__init__()
        check_grid_fields(dim=dim, layers=layers, heads=heads, rel_pos_clip=rel_pos_clip, grid_dim=width, grid_ff=ff)
        m = grid_width(dim, width)
        self.blocks = nn.ModuleList(
            GridBlock(dim, width=m, heads=heads, ff=ff if ff > 0 else 2 * m, clip=rel_pos_clip)
            for _ in range(layers))

    def forward(self, a: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        gh, gw = grid
        if gh * gw != a.shape[1]:
            raise ValueError(f"grid {gh}x{gw} has {gh * gw} cells, the annotations {a.shape[1]}")
        for block in self.blocks:
            a = block(a, block.position_bias(grid))
        return a
