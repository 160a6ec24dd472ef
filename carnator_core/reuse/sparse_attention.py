"""Block-sparse self-attention replaying a stored connectivity mask.

Two backends compute the same thing, softmax attention restricted to the kept
(query block, key block) pairs of :func:`connectivity.effective_block_mask`:

- ``flex``: ``torch.nn.attention.flex_attention`` compiled once per process with
  ``torch.compile`` (CPU C++ template or GPU Triton kernel) and a ``BlockMask`` whose blocks
  are all "full" (no mask_mod: out-of-range keys of a partial last block are bounded by the
  kernel through ``seq_lengths``).
- ``fallback``: pure eager torch. Query blocks are sorted by how many key blocks they keep;
  each chunk gathers its kept key blocks and runs SDPA on them. Correct everywhere and also
  sub-quadratic, just less tuned.

:func:`select_backend` picks one (``CARNATOR_SPARSE_BACKEND=flex|fallback`` forces it; auto
tries a tiny flex compile and falls back on any exception); :func:`backend_report` says which
and why; :func:`sparse_call_counts` counts calls that really ran block-sparse, per backend.
"""
from __future__ import annotations

import os
import threading
import time

import torch
import torch.nn.functional as F

from .connectivity import effective_block_mask, num_blocks

__all__ = [
    "sparse_attention", "select_backend", "backend_report", "sparse_call_counts",
    "reset_sparse_call_counts", "BACKENDS", "ENV_VAR",
]

ENV_VAR = "CARNATOR_SPARSE_BACKEND"
BACKENDS = ("flex", "fallback")
_FLEX_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FLEX_RECOMPILE_LIMIT = 64
_GATHER_BUDGET = 1 << 24  # elements of gathered K (and V) per fallback chunk (64 MiB fp32)
_GATHER_BUDGET_CUDA = 1 << 27  # on a GPU: fewer, larger chunks (each one is a kernel launch)

_lock = threading.Lock()
_compiled_flex = None                      # module-level cache of torch.compile(flex_attention)
_choice: dict[str, dict] = {}              # device type -> {"backend", "reason", ...}
_calls = {name: 0 for name in BACKENDS}
_flex_failures: list[str] = []
_flex_refused: set[tuple] = set()          # signatures flex failed on: never compiled again


# ----------------------------------------------------------------------------- flex backend
def _get_compiled_flex():
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention
        _compiled_flex = torch.compile(flex_attention, dynamic=True)
    return _compiled_flex


def _flex_block_mask(mask: torch.Tensor, block_size: int, lq: int, lk: int):
    from torch.nn.attention.flex_attention import BlockMask
    m = mask.to(torch.int32)
    num = m.sum(-1, dtype=torch.int32)
    idx = torch.argsort(m, dim=-1, descending=True, stable=True).to(torch.int32)
    # Every kept block is "full"; the partial-block lists are empty. They must be distinct
    # tensors: the CPU template fails to compile when kv_indices aliases full_kv_indices.
    return BlockMask.from_kv_blocks(
        torch.zeros_like(num), idx.clone(), num, idx, BLOCK_SIZE=block_size,
        seq_lengths=(lq, lk), compute_q_blocks=False)


def _flex_run(q, k, v, mask, block_size, scale):
    # contiguous inputs: the compiled kernel guards on strides, so views would recompile
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    # full (B, H) block tables: broadcast dims would specialise the graph and recompile
    mask = mask.expand(q.shape[0], q.shape[1], *mask.shape[-2:]).contiguous()
    bm = _flex_block_mask(mask, block_size, q.shape[-2], k.shape[-2])
    fn = _get_compiled_flex()
    # Each (block size, dtype, grad/inference mode, size-1 batch or heads) variant compiles
    # once; dynamo's default of 8 variants per function would then silently run eager flex.
    with torch._dynamo.config.patch(recompile_limit=_FLEX_RECOMPILE_LIMIT):
        return fn(q, k, v, block_mask=bm, scale=scale)


# ------------------------------------------------------------------------- fallback backend
def _fallback_run(q, k, v, mask, block_size, scale):
    B, H, lq, D = q.shape
    lk, Dv = k.shape[-2], v.shape[-1]
    nq, nk, bs = num_blocks(lq, block_size), num_blocks(lk, block_size), block_size

    def blocks(x, n):  # (B, H, L, d) -> (B*H*n, bs*d), padding the last partial block
        pad = n * bs - x.shape[-2]
        x = F.pad(x, (0, 0, 0, pad)) if pad else x
        return x.reshape(B * H * n, bs * x.shape[-1])

    qb, kb, vb = blocks(q, nq), blocks(k, nk), blocks(v, nk)
    key_ok = (torch.arange(nk * bs, device=q.device) < lk).view(nk, bs)
    rows_mask = mask.expand(B, H, nq, nk).reshape(B * H * nq, nk)
    counts = rows_mask.sum(-1)
    kept = torch.argsort(rows_mask.to(torch.uint8), dim=-1, descending=True, stable=True)
    order = torch.argsort(counts, descending=True)   # group rows keeping alike block counts
    counts_sorted = counts[order].tolist()           # the one host sync of a call
    budget = _GATHER_BUDGET_CUDA if q.device.type == "cuda" else _GATHER_BUDGET
    out_sorted = q.new_empty(B * H * nq, bs * Dv)
    i, n_rows = 0, order.numel()
    while i < n_rows:
        kmax = counts_sorted[i]
        rows = order[i:i + max(1, budget // (kmax * bs * max(D, Dv)))]
        R = rows.numel()
        sel = kept[rows, :kmax]                                     # (R, kmax) key block ids
        flat = torch.div(rows, nq, rounding_mode="floor")[:, None] * nk + sel
        # F.embedding is a fast row gather on CPU (index_select is element-wise there)
        keys = F.embedding(flat, kb).view(R, 1, kmax * bs, D)
        vals = F.embedding(flat, vb).view(R, 1, kmax * bs, Dv)
        valid = torch.arange(kmax, device=q.device) < counts[rows][:, None]
        valid = (valid[..., None] & key_ok[sel]).view(R, 1, 1, kmax * bs)
        # decided on the host (a device sync per chunk costs more than the chunk on a GPU):
        # a mask is needed when some row keeps fewer blocks or the last key block is partial
        ragged = counts_sorted[i + R - 1] < kmax or lk % bs != 0
        attn_mask = valid if ragged else None
        o = F.scaled_dot_product_attention(F.embedding(rows, qb).view(R, 1, bs, D), keys,
                                           vals, attn_mask=attn_mask, scale=scale)
        out_sorted[i:i + R] = o.view(R, bs * Dv)
        i += R
    out = F.embedding(torch.argsort(order), out_sorted)        # back to the original row order
    return out.view(B, H, nq * bs, Dv)[:, :, :lq]


# ------------------------------------------------------------------------- backend choice
@torch.no_grad()
def _probe_flex(device: torch.device) -> float:
    """Compile and check flex on a tiny problem; returns seconds spent; raises on failure."""
    t0 = time.perf_counter()
    g = torch.Generator(device="cpu").manual_seed(0)
    # What the device's video models run: on a GPU bf16 at head dim 64 with 128-token blocks
    # (its Triton kernel has no configuration for float32 at head dim 16, so a probe there
    # refused flex for every model on an H200); on the CPU float32.
    cuda = torch.device(device).type == "cuda"
    dtype, head_dim, block, tol = ((torch.bfloat16, 64, 128, 3e-2) if cuda else
                                   (torch.float32, 16, 64, 1e-3))
    q, k, v = (torch.randn(1, 1, block + block // 2, head_dim, generator=g).to(device, dtype)
               for _ in range(3))
    mask = torch.tensor([[[[True, False], [True, True]]]], device=device)
    got = _flex_run(q, k, v, mask, block, None).float()
    ref = _fallback_run(q.float(), k.float(), v.float(), mask, block, None)
    err = (got - ref).abs().max().item()
    if not err < tol:
        raise RuntimeError(f"flex probe disagrees with reference (max err {err:.3g})")
    return time.perf_counter() - t0


def select_backend(device: torch.device | str = "cpu", refresh: bool = False) -> str:
    """Backend for tensors on ``device`` ('flex' or 'fallback'), decided once per device type.

    ``CARNATOR_SPARSE_BACKEND=fallback`` forces the fallback; ``=flex`` forces flex and raises
    if it cannot compile; unset/``auto`` tries flex and falls back on any exception.
    """
    dev = torch.device(device)
    with _lock:
        if dev.type in _choice and not refresh:
            return _choice[dev.type]["backend"]
        _flex_refused.difference_update({sig for sig in _flex_refused if sig[0] == dev.type})
        forced = os.environ.get(ENV_VAR, "").strip().lower() or "auto"
        if forced not in BACKENDS + ("auto",):
            raise ValueError(f"{ENV_VAR}={forced!r}: expected one of flex, fallback, auto")
        rec = {"backend": "fallback", "forced": forced, "device": dev.type,
               "probe_seconds": None, "error": None}
        if forced == "fallback":
            rec["reason"] = f"forced by {ENV_VAR}=fallback"
        else:
            try:
                rec["probe_seconds"] = round(_probe_flex(dev), 2)
                rec["backend"] = "flex"
                rec["reason"] = ("forced by env and compiled" if forced == "flex" else
                                 "flex_attention compiled and matched the reference")
            except Exception as exc:  # noqa: BLE001 - any failure means: use the fallback
                rec["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
                if forced == "flex":
                    raise RuntimeError(f"{ENV_VAR}=flex but flex_attention is unusable: "
                                       f"{rec['error']}") from exc
                rec["reason"] = "flex_attention unavailable, using gather+SDPA fallback"
        _choice[dev.type] = rec
        return rec["backend"]


def backend_report() -> dict:
    """What was chosen per device type and why, plus per-backend sparse call counts."""
    with _lock:
        per_device = {d: dict(r) for d, r in _choice.items()}
        return {
            "backend": next(iter(per_device.values()))["backend"] if per_device else None,
            "devices": per_device,
            "env": os.environ.get(ENV_VAR),
            "calls": dict(_calls),
            "flex_runtime_failures": list(_flex_failures[-5:]),
            "flex_refused": sorted(f"{d} {str(t).removeprefix('torch.')} head_dim {hq}/{hv} "
                                   f"block {b}" for d, t, hq, hv, b in _flex_refused),
            "torch": torch.__version__,
        }


def sparse_call_counts() -> dict[str, int]:
    with _lock:
        return dict(_calls)


def reset_sparse_call_counts() -> None:
    with _lock:
        for name in _calls:
            _calls[name] = 0


# ------------------------------------------------------------------------------ public API
@torch.no_grad()
def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     block_mask: torch.Tensor, block_size: int, *,
                     dense_query_blocks=None, dense_token_range=None,
                     scale: float | None = None, backend: str | None = None) -> torch.Tensor:
    """Softmax attention over (B, H, L, D) restricted to kept (query block, key block) pairs.

    block_mask: bool (nq, nk), (H, nq, nk) or (B, H, nq, nk) with nq = ceil(Lq / block_size)
    (size-1 batch/head dims broadcast). dense_query_blocks: query block indices (or bool flags)
    that attend to every key. dense_token_range: (start, end) token range, or a list of them,
    kept dense both as queries and as keys (text tokens of joint attention). backend: 'flex' or
    'fallback' to override :func:`select_backend` for this call. Returns (B, H, Lq, Dv).
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be (B, heads, L, head_dim)")
    if k.shape[1] != q.shape[1]:
        raise ValueError("grouped-query attention is not supported: repeat k/v heads first")
    mask = effective_block_mask(block_mask.to(q.device), block_size, q.shape[-2], k.shape[-2],
                                dense_query_blocks, dense_token_range)
    name = backend or select_backend(q.device)
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}")
    signature = (q.device.type, q.dtype, q.shape[-1], v.shape[-1], block_size)
    if (name == "flex" and q.dtype in _FLEX_DTYPES and q.dtype == k.dtype == v.dtype
            and signature not in _flex_refused):
        try:
            out = _flex_run(q, k, v, mask, block_size, scale)
            with _lock:
                _calls["flex"] += 1
            return out
        except Exception as exc:  # noqa: BLE001 - one bad shape must not break a sampling run
            # A compile that failed once would be attempted (and paid for) again on every layer
            # and step: this signature goes straight to the fallback from now on.
            with _lock:
                _flex_failures.append(f"{tuple(q.shape)} {type(exc).__name__}: {str(exc)[:300]}")
                _flex_refused.add(signature)
    out = _fallback_run(q, k, v, mask, block_size, scale)
    with _lock:
        _calls["fallback"] += 1
    return out
