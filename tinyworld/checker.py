"""Analytic checker: read shape, colour, position and motion back from a tiny-world video.

Works in pixel space on (3, T, H, W) videos in [0, 1] (``latent.decode`` output).

1. Every pixel is labelled with the nearest of {background, palette colours}; pixels further
   than ``MAX_DIST`` from all of them are unlabelled.
2. Each palette colour with enough pixels (``MIN_PIXELS`` per frame on average) is an object.
   Per frame its largest 4-connected component is kept (stray specks dropped).
3. position = quadrant of the mean centroid over frames; motion = the dominant axis and sign
   of the least-squares centroid velocity (``MIN_SPEED`` px/frame at least, else "static");
   shape = the template (square/circle/triangle, as the generator draws them) with the best
   IoU against the per-frame masks, searched over small offsets around the centroid.
4. :func:`compare` matches caption objects to detected objects (the assignment with fewest
   disagreements) and reports per-attribute agreement plus the object count.

Any size the world renders (``world.render(frames=, size=)``; read from the video's shape):
the pixel thresholds scale with the size (``MIN_PIXELS`` by the shapes' area, the templates as the
world draws them, their offset search by the length), and ``MIN_SPEED`` is a share of the speed the world
gives an object at that size and frame count (0.5 px/frame at 4 frames, 32 px). Ground-truth
renders are judged right on every attribute at every size of ``world.SIZES``
(tests/test_tinyworld_sizes.py); at 16 px the shapes are 6 to 7 px across (the world's floor
of 3/4 scale), so a denoiser's small shape errors there weigh more than at 32 or 48 px.
"""
from __future__ import annotations

import itertools
from typing import Dict, List

import numpy as np
import torch

from . import world as WD

MAX_DIST = 0.38
MIN_PIXELS = 10.0
MIN_SPEED = 0.5

_NAMES = ["background"] + list(WD.COLOURS)
_PALETTE = np.array([WD.BACKGROUND] + [WD.COLOURS[c] for c in WD.COLOURS], dtype=np.float32)  # (K, 3)


def _largest_component(m: np.ndarray) -> np.ndarray:
    if m.sum() == 0:
        return m
    h, w = m.shape
    lab = np.zeros((h, w), dtype=np.int32)
    best, best_n, cur = 0, 0, 0
    for y0 in range(h):
        for x0 in range(w):
            if m[y0, x0] and not lab[y0, x0]:
                cur += 1
                stack = [(y0, x0)]
                lab[y0, x0] = cur
                n = 0
                while stack:
                    y, x = stack.pop()
                    n += 1
                    for yy, xx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                        if 0 <= yy < h and 0 <= xx < w and m[yy, xx] and not lab[yy, xx]:
                            lab[yy, xx] = cur
                            stack.append((yy, xx))
                if n > best_n:
                    best, best_n = cur, n
    return lab == best


def min_pixels(size: int = WD.H) -> float:
    return MIN_PIXELS * WD.shape_scale(size) ** 2


def min_speed(frames: int = WD.T, size: int = WD.H) -> float:
    """The speed (px/frame) below which an object is static: MIN_SPEED at the default size,
    the same share of the world's speed (``SPAN * size / 32 / (frames - 1)``) at any other."""
    return MIN_SPEED * (WD.SPAN * WD.scale_of(size) / (frames - 1)) / WD.STEP


def _shape_of(masks: np.ndarray, cents, size: int = WD.H) -> (str, Dict[str, float]):
    scores = {}
    k = WD.scale_of(size)
    offs = np.arange(-1.5, 1.51, 0.5) * k
    for shape in WD.SHAPES:
        tot = 0.0
        for t, m in enumerate(masks):
            if m.sum() == 0:
                continue
            cx, cy = cents[t]
            if shape == "triangle":
                cy = cy - 1.2 * WD.shape_scale(size)  # centroid of an apex-up triangle sits below its box centre
            best = 0.0
            for dx in offs:
                for dy in offs:
                    tm = WD.shape_mask(shape, cx + dx, cy + dy, size)
                    inter = np.logical_and(tm, m).sum()
                    union = np.logical_or(tm, m).sum()
                    best = max(best, inter / max(union, 1))
            tot += best
        scores[shape] = tot / max(1, len(masks))
    return max(scores, key=scores.get), scores


def detect(video) -> List[dict]:
    """Objects found in a video (3, T, S, S) of any size the world renders: [{"colour", "shape",
    "position", "motion", "pixels", ...}]."""
    if isinstance(video, torch.Tensor):
        video = video.detach().float().cpu().numpy()
    v = np.asarray(video, dtype=np.float32)
    c, t, h, w = v.shape
    if h != w:
        raise ValueError(f"checker: the tiny world's frames are square, got {h}x{w}")
    pix = v.transpose(1, 2, 3, 0)  # (T, H, W, 3)
    d = np.linalg.norm(pix[..., None, :] - _PALETTE[None, None, None], axis=-1)  # (T,H,W,K)
    lab = d.argmin(-1)
    lab[d.min(-1) > MAX_DIST] = -1
    objs = []
    for k, name in enumerate(_NAMES):
        if k == 0:
            continue
        masks = lab == k
        if masks.sum() / t < min_pixels(h):
            continue
        masks = np.stack([_largest_component(m) for m in masks])
        cents = []
        for m in masks:
            if m.sum() == 0:
                cents.append((np.nan, np.nan))
                continue
            ys, xs = np.nonzero(m)
            cents.append((xs.mean() + 0.5, ys.mean() + 0.5))
        cents_a = np.array(cents)
        ok = ~np.isnan(cents_a[:, 0])
        if ok.sum() == 0:
            continue
        mx, my = cents_a[ok].mean(0)
        position = ("top" if my < h / 2 else "bottom") + " " + ("left" if mx < w / 2 else "right")
        if ok.sum() >= 2:
            ts = np.arange(t)[ok].astype(np.float64)
            vx = np.polyfit(ts, cents_a[ok, 0], 1)[0]
            vy = np.polyfit(ts, cents_a[ok, 1], 1)[0]
        else:
            vx = vy = 0.0
        if max(abs(vx), abs(vy)) < min_speed(t, h):
            motion = "static"
        elif abs(vx) >= abs(vy):
            motion = "right" if vx > 0 else "left"
        else:
            motion = "down" if vy > 0 else "up"
        shape, scores = _shape_of(masks, cents, h)
        objs.append({"colour": name, "shape": shape, "position": position, "motion": motion,
                     "pixels": float(masks.sum() / t), "centroid": (float(mx), float(my)),
                     "velocity": (float(vx), float(vy)), "shape_scores": scores})
    return objs


def compare(detected: List[dict], scene: dict) -> dict:
    """Per-attribute agreement between detected objects and a scene, or a caption string
    read by the strict ``world.parse_caption`` (ValueError if it is not caption()'s phrasing)."""
    if isinstance(scene, str):
        scene = WD.parse_caption(scene)
    want = scene["objects"]
    best = None
    det = list(detected)
    cand = det + [None] * len(want)
    for perm in itertools.permutations(range(len(cand)), len(want)):
        res = {a: [] for a in WD.ATTRIBUTES}
        miss = 0
        for wi, di in enumerate(perm):
            d = cand[di]
            for a in WD.ATTRIBUTES:
                ok = d is not None and d[a] == want[wi][a]
                res[a].append(ok)
                miss += not ok
        if best is None or miss < best[0]:
            best = (miss, res)
    res = best[1]
    out = {a: float(np.mean(v)) for a, v in res.items()}
    out["count"] = float(len(det) == len(want))
    out["all"] = float(all(all(v) for v in res.values()) and len(det) == len(want))
    return out


def check(video, scene) -> dict:
    return compare(detect(video), scene)


def evaluate(videos, scenes) -> dict:
    per = [check(v, s) for v, s in zip(videos, scenes)]
    keys = list(WD.ATTRIBUTES) + ["count", "all"]
    summary = {k: float(np.mean([p[k] for p in per])) for k in keys}
    return {"summary": summary, "per_video": per}
