"""Self-attention connectivity: block-pooled attention mass -> boolean block masks.

Plain torch/numpy (no ComfyUI). Tensors use the layout (B, heads, L, head_dim).

A *block mask* is a bool tensor (..., nq, nk): entry [i, j] is True when query block i
attends to key block j, a block being ``block_size`` consecutive tokens (the last one may be
partial). The connectivity captured during a request's probe steps is such a mask per layer,
stored bit-packed, and replayed later by :mod:`carnator_core.sparse_attention`.
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence

import numpy as np
import torch

__all__ = [
    "num_blocks", "block_scores", "connectivity_mask", "pack_mask", "unpack_mask",
    "mask_density", "expand_block_mask", "effective_block_mask",
]


def num_blocks(length: int, block_size: int) -> int:
    return (int(length) + block_size - 1) // block_size


def _block_pool(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean over blocks of tokens along dim -2; returns (pooled (..., n, D), counts (n,))."""
    length = x.shape[-2]
    n = num_blocks(length, block_size)
    pad = n * block_size - length
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, pad))
    sums = x.reshape(*x.shape[:-2], n, block_size, x.shape[-1]).sum(-2)
    counts = torch.full((n,), float(block_size), device=x.device, dtype=torch.float32)
    counts[-1] = block_size - pad
    return sums / counts.to(sums.dtype)[:, None], counts


@torch.no_grad()
def block_scores(q: torch.Tensor, k: torch.Tensor, block_size: int,
                 scale: float | None = None) -> torch.Tensor:
    """Estimated share of attention mass each query block sends to each key block.

    q: (B, H, Lq, D) or (H, Lq, D); k likewise with Lk. Returns float32 (B?, H, nq, nk), rows
    summing to 1: softmax over key blocks of (mean-pooled q . mean-pooled k) * scale, each key
    block weighted by its token count (so a partial last block counts for what it holds).
    """
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"head_dim mismatch: {q.shape[-1]} vs {k.shape[-1]}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qp, _ = _block_pool(q.float(), block_size)
    kp, kcounts = _block_pool(k.float(), block_size)
    logits = (qp @ kp.transpose(-1, -2)) * scale + torch.log(kcounts)
    return torch.softmax(logits, dim=-1)


@torch.no_grad()
def connectivity_mask(scores: torch.Tensor, keep_mass: float = 0.9, min_density: float = 0.1,
                      include_diagonal: bool = True) -> torch.Tensor:
    """Reduce block scores (B?, H, nq, nk) to a bool block mask (H, nq, nk).

    Scores are averaged over batch. Per query block, keep the smallest set of key blocks whose
    mass reaches ``keep_mass``, at least ceil(min_density * nk) of them, plus the diagonal.
    keep_mass >= 1 keeps everything.
    """
    s = scores.float()
    if s.dim() == 4:
        s = s.mean(0)
    if s.dim() == 2:
        s = s[None]
    if s.dim() != 3:
        raise ValueError(f"scores must be (B?, H, nq, nk), got {tuple(scores.shape)}")
    s = s / s.sum(-1, keepdim=True).clamp_min(1e-30)
    nq, nk = s.shape[-2:]
    if keep_mass >= 1.0:
        return torch.ones(s.shape, dtype=torch.bool, device=s.device)
    sorted_s, order = torch.sort(s, dim=-1, descending=True)
    csum = sorted_s.cumsum(-1)
    need = (csum < keep_mass - 1e-6).sum(-1, keepdim=True) + 1  # blocks to reach keep_mass
    floor = min(nk, max(1, math.ceil(min_density * nk)))
    need = need.clamp(min=floor, max=nk)
    rank = torch.arange(nk, device=s.device).expand_as(s)
    mask = torch.zeros_like(s, dtype=torch.bool).scatter_(-1, order, rank < need)
    if include_diagonal:
        d = torch.arange(min(nq, nk), device=s.device)
        mask[:, d, d] = True
    return mask


def pack_mask(mask: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Bit-pack a bool mask: returns (uint8 tensor of ceil(numel/8) bytes, original shape)."""
    arr = mask.detach().to("cpu", torch.bool).numpy().reshape(-1)
    return torch.from_numpy(np.packbits(arr)), tuple(int(x) for x in mask.shape)


def unpack_mask(packed: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Inverse of :func:`pack_mask` (exact)."""
    n = int(np.prod(shape)) if len(shape) else 1
    bits = np.unpackbits(packed.detach().cpu().numpy().astype(np.uint8), count=n)
    return torch.from_numpy(bits.astype(bool)).reshape(tuple(shape))


def mask_density(mask: torch.Tensor) -> float:
    """Share of kept (query block, key block) pairs."""
    return float(mask.float().mean().item()) if mask.numel() else 0.0


def expand_block_mask(mask: torch.Tensor, block_size: int, lq: int, lk: int) -> torch.Tensor:
    """Token-level bool mask (..., lq, lk) from a block mask (..., nq, nk)."""
    m = mask.repeat_interleave(block_size, dim=-2).repeat_interleave(block_size, dim=-1)
    return m[..., :lq, :lk]


def _as_index_set(blocks, n: int, device) -> torch.Tensor:
    """Bool vector (n,) from indices or a bool vector."""
    if isinstance(blocks, torch.Tensor) and blocks.dtype == torch.bool:
        if blocks.numel() != n:
            raise ValueError(f"dense block flags need {n} entries, got {blocks.numel()}")
        return blocks.to(device).reshape(n)
    out = torch.zeros(n, dtype=torch.bool, device=device)
    idx = torch.as_tensor(list(blocks) if not isinstance(blocks, torch.Tensor) else blocks,
                          dtype=torch.long, device=device).reshape(-1)
    if idx.numel():
        if int(idx.min()) < -n or int(idx.max()) >= n:
            raise IndexError(f"dense query block index out of range 0..{n - 1}")
        out[idx] = True
    return out


def _ranges(token_range) -> list[tuple[int, int]]:
    if token_range is None:
        return []
    if len(token_range) == 2 and all(isinstance(x, (int, np.integer)) for x in token_range):
        return [(int(token_range[0]), int(token_range[1]))]
    return [(int(a), int(b)) for a, b in token_range]


def effective_block_mask(mask: torch.Tensor, block_size: int, lq: int, lk: int,
                         dense_query_blocks: Iterable[int] | torch.Tensor | None = None,
                         dense_token_range=None) -> torch.Tensor:
    """The block mask actually executed, (B|1, H|1, nq, nk).

    - ``dense_query_blocks`` (indices or bool flags over query blocks): those rows attend to all
      key blocks (the target-specific region M).
    - ``dense_token_range`` ((start, end) or a list of them, token indices of the joint
      sequence, e.g. text tokens): every query and key block overlapping it becomes dense
      (full row and full column); image tokens sharing such a block only gain exactness.
    - a query block left with no key block at all is made dense (never an empty softmax).
    """
    nq, nk = num_blocks(lq, block_size), num_blocks(lk, block_size)
    m = mask.to(torch.bool)
    while m.dim() < 4:
        m = m[None]
    if tuple(m.shape[-2:]) != (nq, nk):
        raise ValueError(f"block mask is {tuple(m.shape[-2:])}, sequence needs {(nq, nk)} "
                         f"blocks of {block_size}")
    rows = torch.zeros(nq, dtype=torch.bool, device=m.device)
    cols = torch.zeros(nk, dtype=torch.bool, device=m.device)
    if dense_query_blocks is not None:
        rows |= _as_index_set(dense_query_blocks, nq, m.device)
    for start, end in _ranges(dense_token_range):
        start, end = max(0, start), min(end, max(lq, lk))
        if end <= start:
            continue
        rows[start // block_size: num_blocks(min(end, lq), block_size)] = True
        cols[start // block_size: num_blocks(min(end, lk), block_size)] = True
    m = m | rows[:, None] | cols[None, :]
    empty = ~m.any(-1, keepdim=True)
    return m | empty
