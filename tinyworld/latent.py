"""A fixed, exactly invertible pixels <-> latent transform with Wan 2.1's 16 channels.

    model-space latent z = SCALE * Q @ [space_to_depth_2x2(2 * pixels - 1) ; 0 0 0 0]

pixels (B, 3, T, 32, 32) in [0, 1] -> z (B, 16, T, 16, 16). Q is a fixed seeded 16x16
orthogonal matrix; the 4 padding channels are zero, so decoding (Q^T, drop the padding,
depth_to_space) is an exact left inverse: decode(encode(v)) == v up to float rounding. The
grey background maps to 0.

ComfyUI's WAN21 model wraps the diffusion model with ``latent_formats.Wan21``: a LATENT dict
holds ``process_latent_out(z)`` and the sampler feeds ``process_latent_in(LATENT) = z`` to the
model. :func:`to_comfy` / :func:`from_comfy` do that conversion (constants copied from ComfyUI
0.3.75 ``comfy/latent_formats.py``), so ``encode_comfy``/``decode_comfy`` work on LATENT
samples directly.

The *coordinate frames* (:func:`coords`) are 16 fixed channels of (x, y, t) features. The
tiny-world model has in_dim = 32 and receives them through ComfyUI's standard
``concat_latent_image`` conditioning key (WAN21.concat_cond, the image-to-video channel
path), which gives the translation-equivariant RoPE transformer a noise-free absolute
position and frame index in every token: a Wan-layout DiT has no absolute position embedding
and can otherwise only infer absolute position from boundary effects (a first model trained
without it followed colour but not position words).
"""
from __future__ import annotations

import torch

CHANNELS = 16
SCALE = 2.0
_Q_SEED = 20250601

WAN21_MEAN = [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
              0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921]
WAN21_STD = [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
             3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160]


def _orthogonal() -> torch.Tensor:
    g = torch.Generator().manual_seed(_Q_SEED)
    a = torch.randn(CHANNELS, CHANNELS, generator=g, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)
    return q


Q64 = _orthogonal()


def _q(dtype, device):
    return Q64.to(dtype=dtype, device=device)


def encode(video: torch.Tensor) -> torch.Tensor:
    """(B, 3, T, H, W) or (3, T, H, W) pixels in [0, 1] -> (B, 16, T, H/2, W/2) latent."""
    if video.ndim == 4:
        video = video.unsqueeze(0)
    b, c, t, h, w = video.shape
    assert c == 3 and h % 2 == 0 and w % 2 == 0
    v = video * 2.0 - 1.0
    v = v.reshape(b, 3, t, h // 2, 2, w // 2, 2).permute(0, 1, 4, 6, 2, 3, 5).reshape(b, 12, t, h // 2, w // 2)
    pad = torch.zeros(b, CHANNELS - 12, t, h // 2, w // 2, dtype=v.dtype, device=v.device)
    v = torch.cat([v, pad], dim=1)
    z = torch.einsum("oc,bcthw->bothw", _q(v.dtype, v.device), v)
    return z * SCALE


def decode(z: torch.Tensor, clamp: bool = False) -> torch.Tensor:
    """(B, 16, T, h, w) latent -> (B, 3, T, 2h, 2w) pixels (exact inverse of encode)."""
    b, c, t, h, w = z.shape
    assert c == CHANNELS
    v = torch.einsum("oc,bothw->bcthw", _q(z.dtype, z.device), z / SCALE)[:, :12]
    v = v.reshape(b, 3, 2, 2, t, h, w).permute(0, 1, 4, 5, 2, 6, 3).reshape(b, 3, t, h * 2, w * 2)
    v = (v + 1.0) * 0.5
    return v.clamp(0.0, 1.0) if clamp else v


def _stats(z):
    mean = torch.tensor(WAN21_MEAN, dtype=z.dtype, device=z.device).view(1, CHANNELS, 1, 1, 1)
    std = torch.tensor(WAN21_STD, dtype=z.dtype, device=z.device).view(1, CHANNELS, 1, 1, 1)
    return mean, std


def to_comfy(z: torch.Tensor) -> torch.Tensor:
    """Model-space latent -> ComfyUI LATENT samples (Wan21.process_latent_out)."""
    mean, std = _stats(z)
    return z * std + mean


def from_comfy(x: torch.Tensor) -> torch.Tensor:
    """ComfyUI LATENT samples -> model-space latent (Wan21.process_latent_in)."""
    mean, std = _stats(x)
    return (x - mean) / std


def encode_comfy(video: torch.Tensor) -> torch.Tensor:
    return to_comfy(encode(video))


def decode_comfy(samples: torch.Tensor, clamp: bool = True) -> torch.Tensor:
    return decode(from_comfy(samples), clamp=clamp)


def coords(frames: int = 4, h: int = 16, w: int = 16, batch: int = 1, dtype=torch.float32) -> torch.Tensor:
    """Model-space coordinate frames (batch, 16, frames, h, w): fixed features of (x, y, t).

    Fed to the model as 16 extra input channels (in_dim = 32) through ComfyUI's standard
    ``concat_latent_image`` conditioning key, like an image-to-video model's image channels.
    """
    ys = (torch.arange(h, dtype=torch.float64) + 0.5) / h * 2 - 1
    xs = (torch.arange(w, dtype=torch.float64) + 0.5) / w * 2 - 1
    ts = torch.linspace(-1, 1, frames, dtype=torch.float64) if frames > 1 else torch.zeros(1, dtype=torch.float64)
    tt, yy, xx = torch.meshgrid(ts, ys, xs, indexing="ij")
    feats = [xx, yy, torch.sign(xx), torch.sign(yy), tt, torch.sign(xx) * torch.sign(yy)]
    for k in (1, 2):
        feats += [torch.sin(torch.pi * k * xx / 2), torch.cos(torch.pi * k * xx / 2),
                  torch.sin(torch.pi * k * yy / 2), torch.cos(torch.pi * k * yy / 2)]
    feats += [torch.sign(tt), tt * xx]
    assert len(feats) == CHANNELS
    a = torch.stack(feats, 0).unsqueeze(0)  # (1, 16, frames, h, w)
    return a.to(dtype).repeat(batch, 1, 1, 1, 1)


def coords_comfy(frames: int = 4, h: int = 16, w: int = 16, dtype=torch.float32) -> torch.Tensor:
    """:func:`coords` in ComfyUI LATENT space, as the ``concat_latent_image`` conditioning value."""
    return to_comfy(coords(frames, h, w, 1, torch.float64)).to(dtype)
