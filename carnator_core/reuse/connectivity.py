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
    "num_blocks", "block_pool", "pooled_scores", "block_scores", "connectivity_mask", "pack_mask", "unpack_mask",
    "mask_density", "expand_block_mask", "effective_block_mask", "pack_rows", "unpack_rows",
    "count_bits", "head_chunks",
]


def num_blocks(length: int, block_size: int) -> int:
    return (int(length) + block_size - 1) // block_size


def block_pool(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean over blocks of tokens along dim -2; returns (pooled float32 (..., n, D), counts (n,)).

    Sums one block at a time in float32 straight from ``x``'s own dtype and memory: at Wan 14B
    720p a float32 (or padded) copy of q or k would be ~3 GB on the model's device, one block
    is ~5 MB. The partial last block is summed as it is (no padding copy).
    """
    length, dim = x.shape[-2], x.shape[-1]
    n, full = num_blocks(length, block_size), length // block_size
    sums = torch.empty(*x.shape[:-2], n, dim, device=x.device, dtype=torch.float32)
    for i in range(n):
        sums[..., i, :] = x[..., i * block_size:min((i + 1) * block_size, length), :].sum(
            -2, dtype=torch.float32)
    counts = torch.full((n,), float(block_size), device=x.device, dtype=torch.float32)
    counts[-1] = length - full * block_size if full < n else block_size
    return sums / counts[:, None], counts


def pooled_scores(qp: torch.Tensor, kp: torch.Tensor, kcounts: torch.Tensor,
                  scale: float | None = None) -> torch.Tensor:
    """Block scores from already pooled q and k (see :func:`block_scores`)."""
    scale = qp.shape[-1] ** -0.5 if scale is None else scale
    logits = (qp @ kp.transpose(-1, -2)) * scale + torch.log(kcounts)
    return torch.softmax(logits, dim=-1)


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
    qp, _ = block_pool(q, block_size)
    kp, kcounts = block_pool(k, block_size)
    return pooled_scores(qp, kp, kcounts, scale)


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


_BIT_WEIGHTS = (128, 64, 32, 16, 8, 4, 2, 1)  # numpy.packbits' order: first bit is the high one
_POPCOUNT = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.int32)


def pack_rows(mask: torch.Tensor) -> torch.Tensor:
    """Bit-pack the last dim of a bool mask, on the mask's own device: (..., m) -> (..., ceil(m/8))
    uint8, each row starting on a byte (so identical rows pack to identical bytes)."""
    pad = (-mask.shape[-1]) % 8
    bits = torch.nn.functional.pad(mask.to(torch.uint8), (0, pad))
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=mask.device)
    return (bits.view(*mask.shape[:-1], -1, 8) * weights).sum(-1, dtype=torch.uint8)


def unpack_rows(packed: torch.Tensor, length: int) -> torch.Tensor:
    """Inverse of :func:`pack_rows` (exact): (..., nbytes) uint8 -> (..., length) bool."""
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=packed.device)
    bits = (packed[..., None] >> shifts) & 1
    return bits.reshape(*packed.shape[:-1], -1)[..., :length].bool()


def count_bits(packed: torch.Tensor) -> int:
    """Set bits of a packed mask (pad bits are zero), one row at a time to stay small."""
    table = _POPCOUNT.to(packed.device)
    rows = packed.reshape(-1, packed.shape[-1]) if packed.dim() else packed.reshape(1, 1)
    return int(sum(int(table[r.long()].sum()) for r in rows))


def head_chunks(heads: int, n_query: int, n_key: int, budget: int = 1 << 21):
    """Head ranges whose (heads, nq, nk) score block stays under ``budget`` elements: the
    selection's transients (scores per batch item, sort values and indices) then stay
    ~60 MB whatever the model."""
    step = max(1, budget // max(1, n_query * n_key))
    return [(h, min(heads, h + step)) for h in range(0, heads, step)]


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
