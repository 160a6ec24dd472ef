"""Early Signature: what a request's own first steps reveal about where it is heading.

Built from two kinds of evidence collected during the probe (DESIGN.md §2.2):
- the model's denoised estimate x̂0 at each probe step, pooled onto a coarse
  spatio-temporal tile grid (layout and colour are decided early and show up here first);
- token features from one transformer block, pooled onto the same tiles and projected
  to a small fixed width (what the network "thinks" is where).

The signature has a global descriptor (unit vector, ranked by cosine in the cache) and a
per-tile map (compared tile by tile in the gate to localize what must be recomputed).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FEATURE_WIDTH = 32  # projected width of block features per tile


def tile_grid_for(latent_shape: tuple[int, ...]) -> tuple[int, int, int]:
    """Coarse (frames, rows, cols) tile grid for a (B, C, T, H, W) latent."""
    t, h, w = latent_shape[-3:]
    return (min(t, 4), min(h, 8), min(w, 8))


def pool_latent_tiles(x: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
    """(B, C, T, H, W) → (C, tiles) for the first batch item, float32."""
    x = x[:1].float()
    if x.ndim == 4:  # image models: one frame
        x = x.unsqueeze(2)
    pooled = F.adaptive_avg_pool3d(x, grid)
    return pooled.reshape(x.shape[1], -1)


VIDEO_PATCHES = ((1, 2, 2), (1, 1, 1))  # Wan, HunyuanVideo, Mochi, Cosmos; LTX-Video


def token_grid(n_tokens: int, latent_thw: tuple[int, int, int],
               patches=VIDEO_PATCHES + ((2, 2, 2), (1, 4, 4), (2, 1, 1))) -> tuple[int, int, int] | None:
    """Infer the token grid of a patchified latent from the token count.

    Video DiTs patchify (T, H, W) with small patch sizes; trying the common ones keeps this
    free of per-model code. Returns None when nothing fits (the caller then skips features).
    Callers that must not confuse other token sequences with the video (attention
    classification) pass the strict ``VIDEO_PATCHES``.
    """
    t, h, w = latent_thw
    for pt, ph, pw in patches:
        grid = (math.ceil(t / pt), math.ceil(h / ph), math.ceil(w / pw))
        if grid[0] * grid[1] * grid[2] == n_tokens:
            return grid
    return None


def projection(width_in: int, width_out: int = FEATURE_WIDTH) -> torch.Tensor:
    """Fixed seeded random projection: identical in every process, no weights to store."""
    g = torch.Generator().manual_seed(1729 + width_in)
    return torch.randn(width_in, width_out, generator=g) / math.sqrt(width_out)


_PROJECT_ROWS = 4096


def pool_token_tiles(tokens: torch.Tensor, latent_thw: tuple[int, int, int],
                     grid: tuple[int, int, int], patches=None) -> torch.Tensor | None:
    """(L, D) block tokens → (FEATURE_WIDTH, tiles), or None if the layout is unknown.
    ``patches``: the model's own patch size(s), when known; else the common ones."""
    tgrid = token_grid(tokens.shape[0], latent_thw, *([patches] if patches else []))
    if tgrid is None:
        return None
    proj = projection(tokens.shape[1]).to(tokens.device)
    # a few thousand tokens at a time: a float32 copy of a Wan-14B block's tokens is 1.5 GB
    feats = torch.cat([part.float() @ proj for part in tokens.split(_PROJECT_ROWS)])
    vol = feats.T.reshape(1, FEATURE_WIDTH, *tgrid)
    return F.adaptive_avg_pool3d(vol, grid).reshape(FEATURE_WIDTH, -1).cpu()


def _unit(v: torch.Tensor) -> torch.Tensor:
    v = v.reshape(-1).float()
    return v / v.norm().clamp_min(1e-8)


@dataclass
class EarlySignature:
    """Signature of one request at probe step ``step``."""

    step: int                      # the probe step the maps describe
    grid: tuple[int, int, int]
    xhat_tiles: torch.Tensor       # (C, tiles) pooled x̂0 at ``step``
    feature_tiles: torch.Tensor | None  # (FEATURE_WIDTH, tiles) or None

    @property
    def n_tiles(self) -> int:
        return self.xhat_tiles.shape[1]

    def global_vector(self) -> torch.Tensor:
        """Unit descriptor for retrieval: layout (x̂0 tiles) and features, equally weighted."""
        parts = [_unit(self.xhat_tiles - self.xhat_tiles.mean(dim=1, keepdim=True))]
        if self.feature_tiles is not None:
            parts.append(_unit(self.feature_tiles))
        return _unit(torch.cat(parts))

    def similarity(self, other: "EarlySignature") -> float:
        """Cosine of the two global descriptors (what the gate's similarity gap reads)."""
        return float(torch.dot(self.global_vector(), other.global_vector()))


def tile_deviation(new: EarlySignature, old: EarlySignature) -> torch.Tensor:
    """Per-tile disagreement between two signatures at the same step, shape (tiles,).

    x̂0 part: distance per tile relative to the typical tile magnitude of the stored entry,
    so it reads the same on any latent scale. Feature part: 1 − cosine per tile. The larger
    of the two decides: either kind of disagreement means the tile will not match.
    """
    scale = old.xhat_tiles.pow(2).mean().sqrt().clamp_min(1e-6)
    dx = (new.xhat_tiles - old.xhat_tiles).pow(2).mean(dim=0).sqrt() / scale
    if new.feature_tiles is None or old.feature_tiles is None:
        return dx
    df = 1.0 - F.cosine_similarity(new.feature_tiles, old.feature_tiles, dim=0)
    return torch.maximum(dx, df)


def widen_tiles(tile_mask: torch.Tensor, grid: tuple[int, int, int], margin: int) -> torch.Tensor:
    """Boolean (tiles,) region → the same widened by ``margin`` tiles in every direction of
    the (frames, rows, cols) grid."""
    if margin <= 0:
        return tile_mask
    vol = tile_mask.float().reshape(1, 1, *grid)
    size = 2 * margin + 1
    return F.max_pool3d(vol, size, stride=1, padding=margin).reshape(-1) > 0.5


def tiles_to_latent_mask(tile_mask: torch.Tensor, grid: tuple[int, int, int],
                         latent_shape: tuple[int, ...]) -> torch.Tensor:
    """Boolean (tiles,) region → float (1, 1, T, H, W) mask on the latent grid."""
    vol = tile_mask.float().reshape(1, 1, *grid)
    return F.interpolate(vol, size=tuple(latent_shape[-3:]), mode="nearest")
