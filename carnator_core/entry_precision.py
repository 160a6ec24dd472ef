"""The precision latents are stored in: snapshots x_k and the final latent of an entry.

Stored float32 they were 80% of an entry at Wan 1.3B size, though the model computes in bf16
or fp16. float16 keeps 11 significant bits, 8× finer than bf16's and far below what the
sampler's own bf16 steps perturb; a latent it cannot hold (|x| > 65504, or non-finite after
rounding) stays float32. Readers accept any stored dtype, so older float32 entries still load.
"""
from __future__ import annotations

import torch

ENTRY_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def to_entry(x: torch.Tensor, dtype: str = "float16") -> torch.Tensor:
    """``x`` on the CPU in the entry dtype (float32 where that dtype would overflow)."""
    if dtype not in ENTRY_DTYPES:
        raise ValueError(f"entry dtype {dtype!r}: expected one of {', '.join(ENTRY_DTYPES)}")
    x = x.detach()
    compact = x.to(ENTRY_DTYPES[dtype])
    if compact.dtype != torch.float32 and not bool(torch.isfinite(compact).all()):
        compact = x.float()
    return compact.cpu().clone() if compact.data_ptr() == x.data_ptr() else compact.cpu()


def from_entry(x: torch.Tensor, device=None) -> torch.Tensor:
    """A stored latent as the float32 the sampler works in."""
    return x.to(device=device, dtype=torch.float32)
