"""Attention connectivity across requests: capture it at the probe, reuse it on a hit.

Per run, an ``AttentionPlan`` says for each denoising step whether self-attention calls are
measured (capture: block-pooled q·k mass accumulated per layer), run block-sparse with a
stored mask (sparse), or left alone. The ComfyUI side (comfy_adapter) only finds the
self-attention calls and hands their q, k, v here; the decisions and the mask math live in
this file, free of ComfyUI.
"""
from __future__ import annotations

import hashlib
import math
import zlib
from dataclasses import dataclass, field

import torch

from .connectivity import (block_pool, connectivity_mask, count_bits, head_chunks, pack_rows,
                           pooled_scores, unpack_mask, unpack_rows)
from ..signature import VIDEO_PATCHES, token_grid
from .sparse_attention import sparse_attention


@dataclass
class SparseSettings:
    enabled: bool = True
    keep_mass: float = 0.9       # share of the attention mass each query block keeps
    min_density: float = 0.1     # at least this share of key blocks per query block
    refresh_every: int = 0       # >0: every N reused steps run dense and re-measure
    on_miss: bool = False        # on a miss, run the rest sparse with the probe's own mask
    max_density: float = 0.6     # denser masks run dense: the block-sparse kernel would not pay
    store_connectivity: bool = False  # measure and store it even while sparse reuse is off

    @property
    def measuring(self) -> bool:
        """Connectivity costs a pass over every layer's block scores: only when it is used."""
        return self.enabled or self.store_connectivity


def block_size_for(n_tokens: int) -> int:
    """Blocks big enough for the kernel to pay off, small enough to be selective."""
    return 128 if n_tokens >= 8192 else 64 if n_tokens >= 1024 else 32


# every tensor name an entry's connectivity may use (this format and the first one)
CONNECTIVITY_KEYS = ["connectivity_bits", "connectivity_heads", "connectivity_shape",
                     "connectivity_block", "connectivity_density", "connectivity"]


@dataclass
class Connectivity:
    """Block masks (layers, heads, nq, nk), kept bit-packed one (layer, head) per row.

    ``bits`` (layers, heads, ceil(nq*nk/8)) uint8, or None when the storing request found the
    mask too dense to be worth keeping (only its density was stored). A layer is unpacked on
    the device where it runs, when it runs: a whole 14B-size mask as bools is 559 MB.
    """

    bits: torch.Tensor | None
    shape: tuple[int, int, int, int]
    block_size: int
    kept: int | None = None  # set bits, when already known

    @classmethod
    def from_mask(cls, mask: torch.Tensor, block_size: int) -> "Connectivity":
        layers, heads, nq, nk = mask.shape
        return cls(pack_rows(mask.reshape(layers, heads, nq * nk)), tuple(mask.shape),
                   block_size, int(mask.sum()))

    @property
    def density(self) -> float:
        if self.kept is None:
            self.kept = count_bits(self.bits)
        total = math.prod(self.shape)
        return self.kept / total if total else 0.0

    @property
    def mask(self) -> torch.Tensor:
        """Every layer unpacked (tests and tools; the sampler uses :meth:`layer_mask`)."""
        return unpack_rows(self.bits, self.shape[2] * self.shape[3]).reshape(self.shape)

    def layer_mask(self, layer: int, device) -> torch.Tensor:
        _, heads, nq, nk = self.shape
        return unpack_rows(self.bits[layer].to(device), nq * nk).reshape(heads, nq, nk)

    def to_tensors(self, with_mask: bool = True) -> dict[str, torch.Tensor]:
        """Identical (layer, head) masks stored once, then deflated: local attention packs
        into long runs of 0x00/0xFF bytes. ``with_mask`` False keeps only the density."""
        out = {"connectivity_shape": torch.tensor(self.shape, dtype=torch.int64),
               "connectivity_block": torch.tensor([self.block_size], dtype=torch.int64),
               "connectivity_density": torch.tensor([self.density], dtype=torch.float64)}
        if with_mask and self.bits is not None:
            rows = self.bits.reshape(-1, self.bits.shape[-1]).cpu().numpy()
            keep, index = _distinct_rows(rows)
            deflate = zlib.compressobj(1)  # streamed row by row: no second copy of the mask
            blob = b"".join([deflate.compress(rows[i]) for i in keep] + [deflate.flush()])
            out["connectivity_bits"] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
            out["connectivity_heads"] = index.reshape(self.shape[:2]).to(torch.int32)
        return out

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> "Connectivity | None":
        if "connectivity_shape" not in t:
            return None
        shape = tuple(int(s) for s in t["connectivity_shape"].tolist())
        block = int(t["connectivity_block"][0])
        if "connectivity" in t:  # first format: one numpy.packbits run over the whole mask
            return cls.from_mask(unpack_mask(t["connectivity"], shape), block)
        kept = round(float(t["connectivity_density"][0]) * math.prod(shape))
        if "connectivity_bits" not in t:
            return cls(None, shape, block, kept)
        nbytes = (shape[2] * shape[3] + 7) // 8
        raw = zlib.decompress(t["connectivity_bits"].numpy().tobytes())
        unique = torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(-1, nbytes)
        bits = unique[t["connectivity_heads"].long().reshape(-1)].reshape(*shape[:2], nbytes)
        return cls(bits, shape, block, kept)


def _distinct_rows(rows) -> tuple[list[int], torch.Tensor]:
    """(indices of the first of each distinct row, index of each row into those), exact: rows
    are matched by a 128-bit hash of their bytes (a collision is 2^-64-unlikely)."""
    seen: dict[bytes, int] = {}
    index = torch.empty(len(rows), dtype=torch.int64)
    keep: list[int] = []
    for i, row in enumerate(rows):
        key = hashlib.blake2b(row.tobytes(), digest_size=16).digest()
        if key not in seen:
            seen[key] = len(keep)
            keep.append(i)
        index[i] = seen[key]
    return keep, index


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
    # the model's own patch size when the adapter knows it (Wan 2.2 5B and HunyuanVideo 1.5
    # differ from Wan 2.1): then only its token grid counts as video
    patches: tuple[tuple[int, int, int], ...] = VIDEO_PATCHES
    capture_steps: set[int] = field(default_factory=set)
    sparse_steps: set[int] = field(default_factory=set)
    connectivity: Connectivity | None = None
    region_tiles: torch.Tensor | None = None
    tile_grid: tuple[int, int, int] = (1, 1, 1)
    # measured: per layer, the packed mask of its latest captured step, on the model's device
    masks: dict[int, torch.Tensor] = field(default_factory=dict)
    mask_steps: dict[int, int | None] = field(default_factory=dict)
    n_blocks: int = 0
    block_size: int | None = None
    sparse_calls: int = 0
    sparse_device: str = "cpu"  # where the sparse calls ran: its backend is the one reported
    dense_calls: int = 0
    fresh: bool = False  # captured since the mask was last rebuilt (refresh)
    skipped: str | None = None  # why a stored mask was not used
    # the other attention Carnator hands its dense calls to (another node's override, the
    # checkpoint's own per-layer attention), named for the summary, and how many it got
    chained_to: str | None = None
    chained_calls: int = 0
    _dense_blocks: dict = field(default_factory=dict)  # region M's query blocks, per layout

    def classify(self, q_len: int, k_len: int, n_context: int,
                 text_first: bool | None = False) -> tuple[int, int] | None:
        """(image tokens, text tokens after them) for self/joint attention, else None.

        ``text_first``: the model's joint attention puts the text tokens before the image
        tokens (as the adapter observed it); None: the order is not known. Either way joint
        calls are not sliced here and stay dense, rather than masking the wrong tokens."""
        if q_len != k_len or q_len == n_context:
            return None  # cross-attention, or text-only attention (HunyuanVideo's refiner)
        if token_grid(q_len, self.latent_thw, self.patches) is not None:
            return q_len, 0
        if (n_context and text_first is False
                and token_grid(q_len - n_context, self.latent_thw, self.patches) is not None):
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

    def reset_measurement(self) -> None:
        self.masks, self.mask_steps, self.fresh = {}, {}, False

    @torch.no_grad()
    def capture(self, layer: int, q: torch.Tensor, k: torch.Tensor, n_img: int,
                step: int | None = None) -> None:
        """Measure this layer's block mask over image tokens, on q's device, right away.

        Only the packed mask is kept (40 heads × 591² blocks at Wan 14B: 1.7 MB a layer, where
        float scores would be 56 MB). A second call at the same step (cond and uncond run as
        separate model calls) adds the blocks it needs; a call at a new step replaces the mask.
        """
        self.block_size = self.block_size or block_size_for(n_img)
        qp, _ = block_pool(q[:, :, :n_img], self.block_size)
        kp, kcounts = block_pool(k[:, :, :n_img], self.block_size)
        self.capture_pooled(layer, qp, kp, kcounts, step)

    @torch.no_grad()
    def capture_pooled(self, layer: int, qp: torch.Tensor, kp: torch.Tensor,
                       kcounts: torch.Tensor, step: int | None = None) -> None:
        """:meth:`capture` from block-pooled q and k (B, H, n, D): the selection and packing."""
        heads, n = qp.shape[1], qp.shape[2]
        parts = []
        for h0, h1 in head_chunks(heads, n, n):  # bounded transients, whatever the model
            scores = pooled_scores(qp[:, h0:h1], kp[:, h0:h1], kcounts).mean(dim=0)
            mask = connectivity_mask(scores, self.settings.keep_mass, self.settings.min_density)
            parts.append(pack_rows(mask.reshape(h1 - h0, n * n)))
        bits = torch.cat(parts)
        if layer in self.masks and self.mask_steps.get(layer) == step:
            self.masks[layer] |= bits
        else:
            self.masks[layer], self.mask_steps[layer] = bits, step
        self.n_blocks, self.fresh = n, True

    def measured(self) -> Connectivity | None:
        """The mask this request's own latest captured step gives (no CPU work: a stack)."""
        if not self.masks:
            return None
        bits = torch.stack([self.masks[i] for i in sorted(self.masks)])
        return Connectivity(bits, (bits.shape[0], bits.shape[1], self.n_blocks, self.n_blocks),
                            self.block_size)

    def run_sparse(self, layer: int, q, k, v, n_img: int, n_txt: int) -> torch.Tensor | None:
        """Block-sparse attention with the stored mask, or None when it does not fit."""
        conn = self.connectivity
        if layer >= conn.shape[0]:
            return None
        nq = math.ceil(q.shape[2] / conn.block_size)
        if conn.shape[1] != q.shape[1] or conn.shape[-1] > nq:
            return None  # another head count or token count: not this model's mask
        mask = conn.layer_mask(layer, q.device)
        if mask.shape[-1] < nq:  # text tokens beyond the image blocks: dense rows/columns
            padded = torch.ones(mask.shape[0], nq, nq, dtype=torch.bool, device=q.device)
            padded[:, :mask.shape[1], :mask.shape[2]] = mask
            mask = padded
        key = (n_img, conn.block_size)
        if key not in self._dense_blocks:  # same for every layer and step of this run
            tg = token_grid(n_img, self.latent_thw, self.patches)
            self._dense_blocks[key] = region_query_blocks(self.region_tiles, self.tile_grid, tg,
                                                          conn.block_size)
        dense_q = self._dense_blocks[key]
        out = sparse_attention(q, k, v, mask, conn.block_size,
                               dense_query_blocks=dense_q,
                               dense_token_range=(n_img, n_img + n_txt) if n_txt else None)
        self.sparse_calls += 1
        self.sparse_device = q.device.type
        return out
