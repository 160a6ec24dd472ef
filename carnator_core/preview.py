"""Pictures of a request: frames side by side, region M outlined (plain torch + Pillow).

Used by the cache previews (nodes/routes.py) and the demo's pictures (scripts/demo_pictures.py),
so the README shows exactly what the node and the cache tab show. Deterministic: the same
frames give the same PNG bytes.
"""
from __future__ import annotations

import io

import torch

M_COLOUR = (255, 255, 255)  # region M's outline: white reads on the tiny world's grey and on colour


def pick_frames(t: int, n: int) -> list[int]:
    """Up to n frame indices of t, evenly spaced, first and last included."""
    n = min(t, n)
    return [round(i * (t - 1) / (n - 1)) for i in range(n)] if n > 1 else [0]


def region_edges(region: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(h, w) bool mask of one frame's region M, upscaled (nearest) to (height, width) →
    bool (height, width): pixels on M's boundary (inside M, next to outside or the border)."""
    m = torch.nn.functional.interpolate(region.float()[None, None], size=(height, width),
                                        mode="nearest")[0, 0] > 0.5
    pad = torch.nn.functional.pad(m[None, None].float(), (1, 1, 1, 1), value=0.0)[0, 0] > 0.5
    inner = pad[1:-1, 1:-1] & pad[:-2, 1:-1] & pad[2:, 1:-1] & pad[1:-1, :-2] & pad[1:-1, 2:]
    return m & ~inner


def frame_strip(frames: torch.Tensor, region: torch.Tensor | None = None, n: int = 4,
                frame_px: int = 96, gap: int = 0) -> torch.Tensor:
    """(T, H, W, 3) frames in [0, 1] → (frame_px', W'·n + gaps, 3) uint8 strip, each frame
    enlarged by an integer factor (nearest); region (T, h, w) M outlined per frame."""
    t, h, w = frames.shape[:3]
    scale = max(1, frame_px // max(h, 1))
    tiles = []
    for i in pick_frames(t, n):
        f = (frames[i].clamp(0, 1) * 255).round().to(torch.uint8)
        f = f.repeat_interleave(scale, 0).repeat_interleave(scale, 1)
        if region is not None and region.shape[0] > 0:
            j = min(region.shape[0] - 1, round(i * (region.shape[0] - 1) / max(t - 1, 1)))
            edges = region_edges(region[j], h * scale, w * scale)
            f[edges] = torch.tensor(M_COLOUR, dtype=torch.uint8)
        tiles.append(f)
        if gap:
            tiles.append(torch.zeros(h * scale, gap, 3, dtype=torch.uint8))
    return torch.cat(tiles[:-1] if gap else tiles, dim=1)


def png_bytes(pixels: torch.Tensor) -> bytes:
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(pixels.contiguous().numpy(), "RGB").save(buf, format="PNG", optimize=False)
    return buf.getvalue()


def frame_strip_png(frames: torch.Tensor, region: torch.Tensor | None = None, n: int = 4,
                    frame_px: int = 96) -> bytes:
    return png_bytes(frame_strip(frames, region, n, frame_px))
