"""Attention connectivity across requests: capture it at the probe, reuse it on a hit.

Per run, an ``AttentionPlan`` says for each denoising step whether self-attention calls are
measured (capture: block-pooled q·k mass accumulated per layer), run block-sparse with a
stored mask (sparse), or left alone. The ComfyUI side (comfy_adapter) only finds the
self-attention calls and hands their q, k, v here; the decisions and the mask math live in
this file, free of ComfyUI.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .connectivity import block_scores, connectivity_mask, mask_density, pack_mask, unpack_mask
from .signature import VIDEO_PATCHES, token_grid
from .sparse_attention import sparse_attention


@dataclass
class SparseSettings:
    enabled: bool = True
    keep_mass: float = 0.9       # share of the attention mass each query block keeps
    min_density: float = 0.1     # at least this share of key blocks per query block
    refresh_every: int = 0       # >0: every N reused steps run dense and re-measure
    on_miss: bool = False        # on a miss, run the rest sparse with the probe's own mask
    max_density: float = 0.6     # denser masks run dense: the block-sparse kernel would not pay


def block_size_for(n_tokens: int) -> int:
    """Blocks big enough for the kernel to pay off, small enough to be selective."""
    return 128 if n_tokens >= 8192 else 64 if n_tokens >= 1024 else 32


@dataclass
class Connectivity:
    """Per-layer block masks (layers, heads, nq, nk) at a given block size."""

    mask: torch.Tensor
    block_size: int

    @property
    def density(self) -> float:
        return mask_density(self.mask)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        packed, shape = pack_mask(self.mask)
        return {"connectivity": packed, "connectivity_shape": torch.tensor(shape, dtype=torch.int64),
                "connectivity_block": torch.tensor([self.block_size], dtype=torch.int64)}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> "Connectivity | None":
        if "connectivity" not in t:
            return None
        shape = tuple(int(s) for s in t["connectivity_shape"].tolist())
        return cls(unpack_mask(t["connectivity"], shape), int(t["connectivity_block"][0]))


def region_query_blocks(region_tiles: torch.Tensor | None, tile_grid: tuple[int, int, int],
                        tgrid: tuple[int, int, int], block_size: int) -> torch.Tensor | None:
    """Query blocks holding any token of the target-specific region M (they stay dense)."""
    if region_tiles is None or not bool(region_tiles.any()):
        return None
    t, h, w = tgrid
    tt, th, tw = tile_grid
    ti = (torch.arange(t) * tt // t).view(t, 1, 1)
    hi = (torch.arange(h) * th // h).view(1, h, 1)
    wi = (torch.arange(w) * tw // w).view(1, 1, w)
    tile_of_token = (ti * th * tw + hi * tw + wi).reshape(-1)
    in_region = region_tiles.reshape(-1)[tile_of_token]
    blocks = torch.nonzero(in_region).reshape(-1) // block_size
    return torch.unique(blocks)


@dataclass
class AttentionPlan:
    """What self-attention does at each step of one request, and what it measured."""

    settings: SparseSettings
    latent_thw: tuple[int, int, int]
    capture_steps: set[int] = field(default_factory=set)
    sparse_steps: set[int] = field(default_factory=set)
    connectivity: Connectivity | None = None
    region_tiles: torch.Tensor | None = None
    tile_grid: tuple[int, int, int] = (1, 1, 1)
    # measured
    scores: dict[int, torch.Tensor] = field(default_factory=dict)
    score_counts: dict[int, int] = field(default_factory=dict)
    block_size: int | None = None
    sparse_calls: int = 0
    dense_calls: int = 0
    fresh: bool = False  # captured since the mask was last rebuilt (refresh)
    skipped: str | None = None  # why a stored mask was not used
    _dense_blocks: dict = field(default_factory=dict)  # region M's query blocks, per layout

    def classify(self, q_len: int, k_len: int, n_context: int,
                 text_first: bool = False) -> tuple[int, int] | None:
        """(image tokens, text tokens after them) for self/joint attention, else None.

        ``text_first``: the model's joint attention puts the text tokens before the image
        tokens (newer HunyuanVideo); such calls are not sliced here and stay dense."""
        if q_len != k_len or q_len == n_context:
            return None  # cross-attention, or text-only attention (HunyuanVideo's refiner)
        if token_grid(q_len, self.latent_thw, VIDEO_PATCHES) is not None:
            return q_len, 0
        if (n_context and not text_first
                and token_grid(q_len - n_context, self.latent_thw, VIDEO_PATCHES) is not None):
            return q_len - n_context, n_context  # joint attention: image then text tokens
        return None

    def mode(self, step: int | None) -> str:
        if step in self.sparse_steps and self.connectivity is not None:
            if self.fresh:  # a refresh step just re-measured: use the request's own mask
                self.connectivity, self.fresh = self.measured() or self.connectivity, False
            return "sparse"
        if step in self.capture_steps:
            return "capture"
        return "dense"

    def capture(self, layer: int, q: torch.Tensor, k: torch.Tensor, n_img: int) -> None:
        """Accumulate block-pooled attention mass over image tokens, per layer."""
        self.block_size = self.block_size or block_size_for(n_img)
        s = block_scores(q[:, :, :n_img], k[:, :, :n_img], self.block_size).mean(dim=0)
        self.scores[layer] = self.scores.get(layer, 0) + s.cpu()
        self.score_counts[layer] = self.score_counts.get(layer, 0) + 1
        self.fresh = True

    def measured(self) -> Connectivity | None:
        """The mask this request's own captured steps give."""
        if not self.scores:
            return None
        layers = sorted(self.scores)
        masks = [connectivity_mask(self.scores[i] / self.score_counts[i], self.settings.keep_mass,
                                   self.settings.min_density) for i in layers]
        return Connectivity(torch.stack(masks), self.block_size)

    def run_sparse(self, layer: int, q, k, v, n_img: int, n_txt: int) -> torch.Tensor | None:
        """Block-sparse attention with the stored mask, or None when it does not fit."""
        conn = self.connectivity
        if layer >= conn.mask.shape[0]:
            return None
        mask = conn.mask[layer]
        nq = math.ceil(q.shape[2] / conn.block_size)
        if mask.shape[0] != q.shape[1] or mask.shape[-1] > nq:
            return None  # another head count or token count: not this model's mask
        if mask.shape[-1] < nq:  # text tokens beyond the image blocks: dense rows/columns
            padded = torch.ones(mask.shape[0], nq, nq, dtype=torch.bool)
            padded[:, :mask.shape[1], :mask.shape[2]] = mask
            mask = padded
        key = (n_img, conn.block_size)
        if key not in self._dense_blocks:  # same for every layer and step of this run
            tg = token_grid(n_img, self.latent_thw, VIDEO_PATCHES)
            self._dense_blocks[key] = region_query_blocks(self.region_tiles, self.tile_grid, tg,
                                                          conn.block_size)
        dense_q = self._dense_blocks[key]
        out = sparse_attention(q, k, v, mask.to(q.device), conn.block_size,
                               dense_query_blocks=dense_q,
                               dense_token_range=(n_img, n_img + n_txt) if n_txt else None)
        self.sparse_calls += 1
        return out
