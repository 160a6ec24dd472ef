"""A calibration file is input, not trusted state: check every field before the gate uses it.

Calibration files travel between people (shared folders, the bundled ones, a colleague's
cache): a wrong type must not crash a request, and a non-finite or out-of-range number must
not make the gate accept what no calibration certified (thresholds of +inf accept every
reuse "with a guarantee"). ``check_calibration`` names the file and the first field that is
wrong; the caller then serves the uncalibrated prior and says so.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .evidence import NEAR_SCENE_CELL

FORMAT_VERSION = 1           # written by RiskModel.save; files without it are version 1
LOGIT_LIMIT = 50.0           # RiskModel.risk clamps the logit here: beyond it a number means nothing
KNOWN_SPACES = ("frames", "latent")


class CalibrationRejected(ValueError):
    """The file cannot be used; the message names the file and the field."""


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_calibration(data: Any, path: str | Path, features: tuple[str, ...],
                      evidence: tuple[str, ...], classes: tuple[str, ...]) -> dict:
    """``data`` (a parsed calibration file) checked field by field; the fields RiskModel
    takes, without ``format_version``. Raises CalibrationRejected naming the field."""
    def bad(field: str, why: str) -> CalibrationRejected:
        return CalibrationRejected(f"calibration file {path}: field {field!r} {why}; the gate uses "
                                   "the uncalibrated prior until it is re-measured or replaced")

    if not isinstance(data, dict):
        raise bad("(top level)", f"is a {type(data).__name__}, not an object")
    data = dict(data)
    version = data.pop("format_version", FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise bad("format_version", f"is {version!r}; this version of Carnator reads {FORMAT_VERSION}")

    weights = data.get("weights")
    if not isinstance(weights, dict) or set(weights) != set(features):
        raise bad("weights", f"must name exactly {list(features)}")
    for name, w in weights.items():  # any size: a degenerate fit on separable pairs is huge, not hostile
        if not _finite(w):
            raise bad(f"weights.{name}", f"is {w!r}, not a finite number")
    depth_weights = data.get("depth_weights", {})
    if not isinstance(depth_weights, dict) or not set(depth_weights) <= set(evidence):
        raise bad("depth_weights", f"must be an object over {list(evidence)}")
    for name, w in depth_weights.items():
        if not _finite(w):
            raise bad(f"depth_weights.{name}", f"is {w!r}, not a finite number")

    _check_number(data, "bias", bad, lo=-math.inf, hi=math.inf)
    _check_number(data, "region_threshold", bad, lo=0.0, hi=1e6, open_lo=True)
    _check_number(data, "probe_fraction", bad, lo=0.0, hi=1.0, open_lo=True, optional=True)
    if data.get("evidence_scale") is not None:
        _check_number(data, "evidence_scale", bad, lo=0.0, hi=1e6, open_lo=True)
    if data.get("confidence") is not None:
        _check_number(data, "confidence", bad, lo=0.0, hi=1.0, open_lo=True)
    for name in ("calibrated", "region_fill_on_m", "near_scene_cell"):
        if name in data and not isinstance(data[name], bool):
            raise bad(name, f"is {data[name]!r}, not true or false")
    if "source" in data and not isinstance(data["source"], str):
        raise bad("source", "is not text")
    for name in ("measured_reuses", "region_margin", "measured_steps"):
        if name in data and not _count(data[name]):
            raise bad(name, f"is {data[name]!r}, not a whole number ≥ 0")

    latents = data.get("measured_latents", [])
    if not isinstance(latents, list) or not all(
            isinstance(t, list) and len(t) == 3 and all(_count(v) and v > 0 for v in t) for t in latents):
        raise bad("measured_latents", f"is {latents!r}, not a list of [frames, height, width] sizes")
    _check_tolerance(data.get("tolerance"), bad)
    _check_per_class(data.get("finish_calls", {}), "finish_calls", classes, bad,
                     lambda v: _count(v) and v <= 1000, "a number of model calls")
    _check_per_class(data.get("finish_region", {}), "finish_region", classes, bad,
                     lambda v: isinstance(v, bool), "true or false")
    bounds = _check_share_bounds(data.get("region_share_bounds", []), bad)
    cells = tuple(classes) + tuple(f"other/{round(b * 100)}" for b in bounds)
    if data.get("near_scene_cell"):
        cells += (NEAR_SCENE_CELL,)
    _check_thresholds(data.get("thresholds", {}), cells, bad)
    _check_ladders(data.get("ladders", {}), cells, bad)
    if data.get("thresholds") and not data.get("calibrated"):
        raise bad("thresholds", "are set on a file that says it is not calibrated")
    return data


def _check_number(data: dict, name: str, bad, lo: float, hi: float, open_lo: bool = False,
                  optional: bool = False) -> None:
    if name not in data:
        if optional:
            return
        raise bad(name, "is missing")
    v = data[name]
    if not _finite(v) or v > hi or v < lo or (open_lo and v <= lo):
        raise bad(name, f"is {v!r}, not a finite number in {'(' if open_lo else '['}{lo:g}, {hi:g}]")


def _check_tolerance(tol: Any, bad) -> None:
    if tol is None:
        return
    if not isinstance(tol, dict):
        raise bad("tolerance", f"is {tol!r}, not an object")
    bound = tol.get("psnr_bound")
    if not _finite(bound) or not 0 < bound <= 200:
        raise bad("tolerance.psnr_bound", f"is {bound!r}, not a PSNR in (0, 200] dB")
    if tol.get("space") not in KNOWN_SPACES:
        raise bad("tolerance.space", f"is {tol.get('space')!r}, not one of {list(KNOWN_SPACES)}")
    if "checker" in tol and not isinstance(tol["checker"], bool):
        raise bad("tolerance.checker", "is not true or false")


def _check_share_bounds(bounds: Any, bad) -> list[float]:
    """Bins of the token share other evidence is certified by: increasing, in (0, 1], the
    last 1 (every reuse falls in a bin), whole percents (they name the thresholds' cells)."""
    if not isinstance(bounds, list) or not all(_finite(b) and not isinstance(b, bool) for b in bounds):
        raise bad("region_share_bounds", "is not a list of numbers")
    if bounds and (bounds[-1] != 1 or any(not 0 < b <= 1 for b in bounds)
                   or any(b2 <= b1 for b1, b2 in zip(bounds, bounds[1:]))
                   or any(abs(b * 100 - round(b * 100)) > 1e-9 for b in bounds)):
        raise bad("region_share_bounds", f"is {bounds!r}: shares must increase in whole percents "
                  "within (0, 1] and end at 1")
    return [float(b) for b in bounds]


def _check_per_class(value: Any, name: str, classes: tuple[str, ...], bad, ok, what: str) -> None:
    if not isinstance(value, dict):
        raise bad(name, "is not an object")
    for klass, v in value.items():
        if klass not in classes:
            raise bad(f"{name}.{klass}", f"names no evidence class (one of {list(classes)})")
        if not ok(v):
            raise bad(f"{name}.{klass}", f"is {v!r}, not {what}")


def _check_ladders(ladders: Any, cells: tuple[str, ...], bad) -> None:
    """Per cell, a list of finite thresholds (depth shares for same-scene, else logits)."""
    if not isinstance(ladders, dict):
        raise bad("ladders", f"is {type(ladders).__name__}, not an object")
    for cell, points in ladders.items():
        if cell not in cells:
            raise bad(f"ladders.{cell}", f"names no evidence cell (one of {sorted(cells)})")
        lo, hi = (0.0, 1.0) if cell == "same_scene" else (-LOGIT_LIMIT, LOGIT_LIMIT)
        if not isinstance(points, list) or not all(_finite(v) and lo <= v <= hi for v in points):
            raise bad(f"ladders.{cell}", f"is {points!r}, not a list of finite numbers in [{lo:g}, {hi:g}]")


def _check_thresholds(thresholds: Any, classes: tuple[str, ...], bad) -> None:
    """Per option (a class, or ``<class>:guided``): budgets α in (0, 1) → finite thresholds,
    never looser for a stricter budget (a certified λ grows with α)."""
    if not isinstance(thresholds, dict):
        raise bad("thresholds", f"is {type(thresholds).__name__}, not an object")
    options = set(classes) | {f"{c}:guided" for c in classes}
    for option, table in thresholds.items():
        if option not in options:
            raise bad(f"thresholds.{option}", f"names no evidence class (one of {sorted(options)})")
        if not isinstance(table, dict):
            raise bad(f"thresholds.{option}", "is not an object of budget → threshold")
        by_alpha = []
        for alpha, lam in table.items():
            try:
                a = float(alpha)
            except (TypeError, ValueError):
                raise bad(f"thresholds.{option}", f"has budget {alpha!r}, not a number") from None
            if not (math.isfinite(a) and 0 < a < 1):
                raise bad(f"thresholds.{option}", f"has budget {alpha!r} outside (0, 1)")
            # same-scene thresholds are depth shares; others are logits, meaningless past the clamp
            lo, hi = (0.0, 1.0) if option.startswith("same_scene") else (-LOGIT_LIMIT, LOGIT_LIMIT)
            if not _finite(lam) or not lo <= lam <= hi:
                raise bad(f"thresholds.{option}.{alpha}", f"is {lam!r}, not a finite number in [{lo:g}, {hi:g}]")
            by_alpha.append((a, lam))
        by_alpha.sort()
        for (a1, l1), (a2, l2) in zip(by_alpha, by_alpha[1:]):
            if l2 < l1 - 1e-12:
                raise bad(f"thresholds.{option}", f"are not monotone: budget {a2:g} accepts less "
                          f"({l2:g}) than the stricter {a1:g} ({l1:g})")
