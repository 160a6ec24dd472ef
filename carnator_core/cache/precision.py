"""The precision latents are stored in: snapshots x_k and the final latent of an entry.

Stored float32 they were 80% of an entry at Wan 1.3B size, though the model computes in bf16
or fp16. Formats (``ReuseSettings.entry_dtype``):

- ``float16``: 11 significant bits, 8× finer than bf16's; a latent beyond its range
  (|x| > 65504) stays float32.
- ``int8``: snapshots as 8-bit integers with one float32 scale per (item, channel, frame):
  a step of amax/127, far below the tolerance reuse is calibrated to (tests bound the
  resumed result at ≥ 45 dB against float32); the final latent, returned as is by an exact
  repeat, stays float16.
- ``bfloat16``, ``float32``.

Readers accept whatever is stored, so entries written float32 by older versions still load.
"""
from __future__ import annotations

import torch

FLOAT_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
ENTRY_DTYPES = (*FLOAT_DTYPES, "int8")
SCALE_SUFFIX = ".scale"


def _check(dtype: str) -> None:
    if dtype not in ENTRY_DTYPES:
        raise ValueError(f"entry dtype {dtype!r}: expected one of {', '.join(ENTRY_DTYPES)}")


def to_entry(x: torch.Tensor, dtype: str = "float16") -> torch.Tensor:
    """``x`` on the CPU as a float of the entry format (int8 entries keep float16 here)."""
    _check(dtype)
    x = x.detach()
    target = FLOAT_DTYPES.get(dtype, torch.float16)
    # checked on the source: half-precision arithmetic on the CPU is slow; NaN fails it too
    if target == torch.float16 and not bool(x.abs().amax() <= torch.finfo(torch.float16).max):
        target = torch.float32
    # converted on x's device, then moved: half the bytes cross to the CPU
    out = x.to(target).cpu()
    return out.clone() if out.data_ptr() == x.data_ptr() else out


def stored_latent(name: str, x: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
    """The tensors that store latent ``x`` under ``name`` (plus ``name.scale`` for int8)."""
    _check(dtype)
    if dtype != "int8" or x.dim() < 3:
        return {name: to_entry(x, dtype)}
    x = x.detach().to(torch.float32, copy=True)  # worked on in place below
    dims = tuple(range(3, x.dim()))  # one scale per (item, channel, frame)
    amax = torch.maximum(x.amax(dim=dims, keepdim=True), -x.amin(dim=dims, keepdim=True))
    scale = amax.div_(127).clamp_min_(1e-12)
    q = x.div_(scale).round_().clamp_(-127, 127).to(torch.int8)
    return {name: q.cpu(), name + SCALE_SUFFIX: scale.cpu()}


def latent_keys(name: str) -> list[str]:
    return [name, name + SCALE_SUFFIX]


def loaded_latent(tensors: dict[str, torch.Tensor], name: str, device=None) -> torch.Tensor | None:
    """A stored latent as the float32 the sampler works in, whatever format stored it."""
    x = tensors.get(name)
    if x is None:
        return None
    x = x.to(device=device, dtype=torch.float32)
    scale = tensors.get(name + SCALE_SUFFIX)
    return x * scale.to(x.device) if scale is not None else x


def from_entry(x: torch.Tensor, device=None) -> torch.Tensor:
    """A stored float latent as float32 (see :func:`loaded_latent` for int8 ones)."""
    return x.to(device=device, dtype=torch.float32)
