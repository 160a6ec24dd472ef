"""What "beyond tolerance" means when no checker exists: PSNR against the request's own
full computation, on decoded frames or on the latent. Plain torch."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch


@dataclass
class Tolerance:
    """When a reuse counts as deviating: PSNR against the request's own full computation
    below ``psnr_bound`` dB, measured on decoded frames (``space="frames"``, values in 0..1)
    or on the latent (``"latent"``, peak = the reference latent's range)."""
    psnr_bound: float = 30.0
    space: str = "latent"

    def __post_init__(self):
        if self.space not in ("latent", "frames"):
            raise ValueError(f"tolerance space must be 'latent' or 'frames', not {self.space!r}")

    def as_dict(self) -> dict:
        return asdict(self)


def psnr(result: torch.Tensor, reference: torch.Tensor, peak: float | None = None,
         cap: float = 100.0) -> float:
    """PSNR in dB of ``result`` against ``reference``; ``peak`` defaults to the reference's
    range (latents have no fixed scale)."""
    result, reference = result.float(), reference.float()
    if result.shape != reference.shape:
        raise ValueError(f"cannot compare shapes {tuple(result.shape)} and {tuple(reference.shape)}")
    mse = float((result - reference).pow(2).mean())
    if peak is None:
        peak = float(reference.max() - reference.min()) or 1.0
    return cap if mse <= 0 else min(cap, 10 * math.log10(peak * peak / mse))
