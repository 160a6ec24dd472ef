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
    """``x`` on the CPU in the entry dtype (float32 where float16 would overflow)."""
    if dtype not in ENTRY_DTYPES:
        raise ValueError(f"entry dtype {dtype!r}: expected one of {', '.join(ENTRY_DTYPES)}")
    x = x.detach()
    target = ENTRY_DTYPES[dtype]
    # checked on the source: half-precision arithmetic on the CPU is slow; NaN fails it too
    if target == torch.float16 and not bool(x.abs().amax() <= torch.finfo(torch.float16).max):
        target = torch.float32
    # converted on x's device, then moved: half the bytes cross to the CPU
    out = x.to(target).cpu()
    return out.clone() if out.data_ptr() == x.data_ptr() else out


def from_entry(x: torch.Tensor, device=None) -> torch.Tensor:
    """A stored latent as the float32 the sampler works in."""
    return x.to(device=device, dtype=torch.float32)
