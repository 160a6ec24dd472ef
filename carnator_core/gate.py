"""Risk-aware Compatibility Gate (DESIGN.md §2.4).

Given the probe's signature and a candidate's signature at the same step, decide:
- the target-specific region M: tiles whose early evidence disagrees (recomputed fresh);
- the reuse depth k*: the deepest stored snapshot whose predicted risk fits the budget;
- the predicted risk: probability that reusing at k* deviates beyond tolerance from what
  the request would have produced from the same noise.

The risk model (risk_model.py) is a logistic function of the evidence features
(evidence.py). Its default weights are an *uncalibrated* prior; ``RiskModel.fit`` (and the
calibration command) replace them with weights fitted on measured deviations for a given
model fingerprint.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .reuse.region_compute import FILL_SEGMENT_STEPS
from .signature import EarlySignature, tile_deviation, widen_tiles

# the vocabulary and the risk model, where the gate's users have always found them
from .evidence import (EVIDENCE, EVIDENCE_CLASSES, FEATURES, NEAR_SCENE_CELL,
                       REGION_FINISH_STEPS_PER_CALL, REGION_SHARE_BOUNDS, SAME_SCENE_GAP,
                       SAME_SCENE_REGION, class_of_option,
                       evidence_class, finish_allows, finish_calls_at, finish_cost, option_key,
                       share_bin_text, share_cell)
from .risk_model import (CALIBRATION_NAME, DEFAULT_PROBE_FRACTION, INTERACTION_EVIDENCE_SCALE,
                         RISK_FORMS, SIGNED_FREE, UNNAMED_PROBE_FRACTION, RiskModel,
                         calibrated_probes, calibrated_steps, calibration_file, calibration_files,
                         calibration_in_use, gate_model_for, risk_model_for, same_probe)


__all__ = ["CALIBRATION_NAME", "DEFAULT_PROBE_FRACTION", "EVIDENCE", "EVIDENCE_CLASSES",
           "FEATURES", "GateSettings", "INTERACTION_EVIDENCE_SCALE", "NEAR_SCENE_CELL", "Plan",
           "REGION_FINISH_STEPS_PER_CALL", "REGION_SHARE_BOUNDS", "RISK_FORMS", "RiskModel",
           "SAME_SCENE_GAP", "SAME_SCENE_REGION", "SIGNED_FREE", "UNNAMED_PROBE_FRACTION",
           "calibrated_probes", "calibrated_steps", "calibration_file", "calibration_files",
           "calibration_in_use", "class_of_option", "decide", "depth_reason", "evidence",
           "evidence_class", "fill_steps", "finish_allows", "finish_calls_at", "finish_cost",
           "gate_model_for", "hit_saving", "option_key", "region_reason", "reuse_region",
           "risk_model_for", "same_probe", "share_bin_text", "share_cell", "tile_share"]


@dataclass
class GateSettings:
    risk_budget: float = 0.05      # α: the accepted share of reuses beyond tolerance
    min_depth: float = 0.2         # k* bounds as fractions of the step count
    max_depth: float = 0.8         # deepest snapshot; how deep each evidence class may go is certified
    max_region_fraction: float = 0.5  # beyond this the request is mostly new: reject
    guided_finish: bool = True     # may choose a guided finish where the calibration certified one
    # The least share of the steps a reuse must save. Only requests computed in full are reuse
    # sources (cache.lookup: chained reuse broke the budget), so a hit that saves little
    # (an edit resumed at k* = 10 of 20 saves 30%) also costs every later request for the
    # same scene its same-scene reuse (70% saved). Below this share the request runs in
    # full and becomes a source. 0: reuse whenever the budget allows.
    min_saving: float = 0.0
    # Compute in full a request whose own scene was asked before but served by reuse of
    # another (so no source), when a source of that scene would be reused cheaper than the
    # reuse it has now (pipeline.recurring_scene): the scene's next requests then reuse it
    # same-scene. Unlike min_saving it spends a full computation only on a scene seen twice,
    # so it is on by default: on the tiny world's serve it took the whole workload from 1.46×
    # to 1.71× fewer steps, and cost editing sessions (iterate) 1% (docs/results.md).
    recurring_sources: bool = True


# Why a request was not served by a reuse, one code each (Plan.why; the reason in words beside
# it): what a benchmark's records and an operator's report group misses by.
WHY_NOT = {
    "exact_repeat": "an exact repeat: its stored result returned",
    "repeat_recomputed": "an exact repeat of a reuse, computed in full to become a source (recurring_sources)",
    "no_cache": "the cache could not be opened",
    "no_candidate": "no stored request of its compatibility class was close enough",
    "no_evidence": "no candidate had evidence at this probe step",
    "region_too_large": "region M beyond max_region_fraction: mostly a new request",
    "no_depth": "no snapshot depth between min_depth and max_depth",
    "not_certified": "its calibration certified no depth for this evidence at this budget",
    "whole_frame": "widened region M covers the whole frame",
    "risk": "predicted risk over the budget at every allowed depth",
    "min_saving": "the best reuse saves less than min_saving",
    "recurring_source": "the scene was asked before: computed in full to become its source",
    "explored": "explored one ladder point beyond: computed and served in full",
    "snapshot_lost": "the accepted entry's snapshot could not be read: ran as a miss",
}


@dataclass
class Plan:
    """The gate's decision for one request."""

    accept: bool
    entry_id: str | None = None
    reuse_step: int | None = None          # k*
    region_tiles: torch.Tensor | None = None  # bool (tiles,) — M
    risk: float | None = None
    similarity: float | None = None
    features: dict[str, float] | None = None
    reason: str = ""
    # why it is no reuse, as one of WHY_NOT (the reason in words beside it); "" on a hit
    why: str = ""
    finish_calls: int = 0                  # 0: every step after k*; else a guided finish's calls
    finish_region: bool = False            # the guided finish computes M's tokens between its calls

    @property
    def region_fraction(self) -> float:
        if self.region_tiles is None:
            return 0.0
        return float(self.region_tiles.float().mean())


def evidence(new: EarlySignature, old: EarlySignature, similarity: float,
             region_threshold: float) -> tuple[dict[str, float], torch.Tensor]:
    """Features for the risk model, and the region M, for one candidate."""
    dev = tile_deviation(new, old)
    region = dev > region_threshold
    outside = dev[~region] if (~region).any() else dev.new_zeros(1)
    feats = {"outside_mean": float(outside.mean()), "outside_max": float(outside.max()),
             "region_fraction": float(region.float().mean()),
             "depth_fraction": 0.0, "similarity_gap": max(0.0, 1.0 - similarity)}
    return feats, region


def reuse_region(features: dict[str, float], region: torch.Tensor, grid: tuple[int, int, int],
                 margin: int) -> torch.Tensor:
    """The region a reuse computes itself: the probe's M, widened by ``margin`` tiles where the
    evidence is *other* (an edit). The probe sees an edit early and blurred, so its M misses the
    edge of what changes, and with M on its own trajectory that edge is what fails deep reuses:
    one tile more in space and time cut the reuses beyond tolerance at k = 16 of 20 from 27 to
    13 of 98 edit pairs for +0.6 steps (bench/studies/region_dilation_study.py). Same-scene evidence
    keeps its few tiles as they are. The evidence features still describe the probe's M."""
    if margin <= 0 or evidence_class(features) != "other" or not bool(region.any()):
        return region
    return widen_tiles(region, grid, margin)


def region_reason(fraction: float, limit: float) -> str:
    """Why a candidate whose region M is too large is not reused."""
    if limit <= 0:
        return (f"{fraction:.0%} of tiles differ and max_region is 0 (reuse only when no tile "
                "differs); raise max_region to let the gate recompute a region")
    return (f"{fraction:.0%} of tiles differ, more than max_region ({limit:.0%}) allows"
            + (": mostly a new video" if fraction > 0.5 else ""))


def depth_reason(settings: GateSettings, lo: int, hi: int, probe_steps: int, steps: int) -> str:
    """Why no depth k* could be chosen, in the words of the settings a person set."""
    if settings.min_depth > settings.max_depth:
        return (f"min_depth ({settings.min_depth:.2f}) is above max_depth ({settings.max_depth:.2f}): "
                "the bounds are swapped, so no depth can be reused; set min_depth ≤ max_depth")
    if lo > hi:
        return (f"max_depth ({settings.max_depth:.2f}) ends at step {hi} of {steps}, before the "
                f"probe's {probe_steps} steps: no depth is left to reuse; raise max_depth")
    return (f"the matched entry has no stored snapshot between steps {lo} and {hi} "
            "(it was stored with other depth bounds)")


def tile_share(region: torch.Tensor) -> float:
    """Share of the tiles a region covers: ``decide``'s stand-in for its token share where the
    caller cannot map tiles to the model's tokens."""
    return float(region.float().mean()) if region.numel() else 0.0


def decide(new: EarlySignature, candidates: list[tuple[str, EarlySignature, float, list[int]]],
           steps: int, probe_steps: int, model: RiskModel,
           settings: GateSettings, fill_calls: int = 0, fill_on_m: bool = False,
           region_share=tile_share) -> tuple[Plan, list[Plan]]:
    """Pick the best acceptable candidate and depth; also return every candidate's verdict.

    ``candidates``: (entry id, its signature at the probe step, similarity, snapshot steps,
    optionally whether it stored the x̂0 a guided finish needs — assumed when absent).
    The candidate whose hit computes least (fill of M and finish, ``hit_saving``) wins; ties go
    to lower risk.
    ``fill_calls``: model steps a hit spends filling region M (ReuseSettings.region_fill_calls),
    or ``fill_on_m`` M's own trajectory on its tokens (RiskModel.region_fill_on_m), counted in
    the saving ``settings.min_saving`` asks for. ``region_share``: the share of the model's
    tokens a region of tiles covers (the pipeline maps tiles to its run's tokens, as a region
    finish computes them); it places other evidence in its certified cell (``share_cell``).
    """
    lo = max(probe_steps, math.ceil(settings.min_depth * steps))
    hi = math.floor(settings.max_depth * steps)
    verdicts: list[Plan] = []
    for entry_id, old, sim, snapshot_steps, *stored_x0 in candidates:
        feats, region = evidence(new, old, sim, model.region_threshold)
        region = reuse_region(feats, region, new.grid, model.region_margin)
        feats["reuse_share"] = region_share(region) if bool(region.any()) else 0.0
        base = dict(entry_id=entry_id, region_tiles=region, similarity=sim)
        if feats["region_fraction"] > settings.max_region_fraction:
            verdicts.append(Plan(False, features=feats, why="region_too_large", reason=region_reason(
                feats["region_fraction"], settings.max_region_fraction), **base))
            continue
        depths = sorted((k for k in snapshot_steps if lo <= k <= hi), reverse=True)
        if not depths:
            verdicts.append(Plan(False, features=feats, why="no_depth", reason=depth_reason(
                settings, lo, hi, probe_steps, steps), **base))
            continue
        guided = settings.guided_finish and (stored_x0[0] if stored_x0 else True)
        verdicts.append(_cheapest_acceptable(feats, depths, steps, model, settings.risk_budget, guided, base))
    accepted = [p for p in verdicts if p.accept]
    if not accepted:
        if not verdicts:
            return Plan(False, why="no_candidate", reason="no candidates"), verdicts
        return verdicts[0], verdicts  # the best-ranked candidate's verdict explains the miss
    # Ranked by all the work a hit computes — M's fill too, not the finish alone: an edit resumed
    # at k* = 16 of 20 finishes in as few calls as a same-scene reuse at 14, but fills M first.
    # Ranked by the finish, ties went to the lower predicted risk, which is not comparable
    # across cells (same-scene reuse is certified by depth), so the edit won; recurring_scene
    # then found the same-scene source cheaper and ran the request in full (21 of `serve`'s
    # requests at α = 5%).
    accepted.sort(key=lambda p: (-hit_saving(p, steps, probe_steps, fill_calls, fill_on_m), p.risk))
    best = accepted[0]
    saving = hit_saving(best, steps, probe_steps, fill_calls, fill_on_m)
    if saving < settings.min_saving:
        return Plan(False, entry_id=best.entry_id, risk=best.risk, similarity=best.similarity,
                    features=best.features, region_tiles=best.region_tiles, why="min_saving", reason=(
                        f"the best reuse (k*={best.reuse_step}) saves {saving:.0%} of the steps, "
                        f"less than min_saving {settings.min_saving:.0%}: computed in full, so "
                        "this request becomes a reuse source for later ones")), verdicts
    return best, verdicts


def hit_saving(plan: Plan, steps: int, probe_steps: int, fill_calls: int = 0,
               fill_on_m: bool = False) -> float:
    """Share of the steps an accepted plan does not compute: probe, M's fill (when M is not
    empty) and the finish are computed; region calls count at M's token share (its share of
    the tiles stands in for it here)."""
    fill = 0.0
    if plan.region_fraction > 0:
        fill = fill_steps(fill_calls, plan.reuse_step, probe_steps)
        if fill_on_m and plan.reuse_step > probe_steps + FILL_SEGMENT_STEPS:
            # region_compute's fill in (at most) two segments: a full call each, the rest on
            # M's tokens
            fill = 2 * (1 + (FILL_SEGMENT_STEPS - 1) * plan.region_fraction)
    return 1.0 - (probe_steps + fill + _cost(plan, steps)) / steps


def fill_steps(calls: int, k: int, probe_steps: int) -> int:
    """Model steps the fill of region M computes from the probe to k (pipeline.fill_region)."""
    return min(calls, k - probe_steps) if calls > 0 and k > probe_steps else 0


def _cheapest_acceptable(feats: dict[str, float], depths: list[int], steps: int,
                         model: RiskModel, alpha: float, guided: bool, base: dict) -> Plan:
    """Of the finishes this evidence may run, the one that computes least: each at the
    deepest depth (``depths`` deepest first) the risk model accepts for it under α."""
    plans = [_deepest_acceptable(feats, depths, steps, model, alpha, base, calls)
             for calls in model.finish_options(feats, guided)]
    accepted = [p for p in plans if p.accept]
    if not accepted:
        return plans[0]  # the every-step finish's verdict explains the miss
    return min(accepted, key=lambda p: (_cost(p, steps), p.finish_calls))


def _cost(plan: Plan, steps: int) -> float:
    return finish_cost(plan.reuse_step, steps, plan.finish_calls,
                       plan.region_fraction if plan.finish_region else 0.0)


def _deepest_acceptable(feats: dict[str, float], depths: list[int], steps: int,
                        model: RiskModel, alpha: float, base: dict, finish_calls: int = 0) -> Plan:
    """The deepest depth (``depths`` deepest first) the risk model accepts under α for
    this finish."""
    klass = evidence_class(feats)
    cell = model.cell(feats)
    key = option_key(cell, finish_calls)
    what = share_bin_text(cell, model.region_share_bounds)
    certified = model.threshold_for(alpha, key) if model.thresholds else None
    if model.thresholds and certified is None:
        budgets = [float(a) for a in model.thresholds.get(key, {})]
        if budgets:
            why = f"the strictest certified budget is {min(budgets):.1%}: raise the budget or re-calibrate"
        elif cell != klass:  # a share bin the calibration's pairs did not cover well enough
            why = ("its calibration certified no budget there (too few measured reuses like it): "
                   "not extrapolated; calibrate with pairs whose edits cover that much of the frame")
        else:
            why = "none is: raise the budget or re-calibrate"
        return Plan(False, features=feats, why="not_certified", reason=(
            f"no depth is certified at risk budget {alpha:.1%} for {what} on this model "
            f"({why})"), **base)
    how = (f"{what}, certified at budget {certified[0]:.1%} with "
           f"{model.confidence:.0%} confidence" if certified else f"≤ budget {alpha:.1%}")
    region = bool(finish_calls and model.finish_region.get(klass))
    tiles = base.get("region_tiles")
    if region and tiles is not None and bool(tiles.all()):  # widened M is the whole frame
        return Plan(False, features=feats, why="whole_frame", reason=(
            "region M covers the whole frame: a region finish would compute every token"), **base)
    for k in depths:
        f = {**feats, "depth_fraction": k / steps}
        if (finish_allows(k, steps, finish_calls, region, model.measured_steps)
                and model.accepts(f, alpha, finish_calls)):
            r = model.risk(f)
            calls = finish_calls_at(k, steps, finish_calls, region)
            finish = (f", guided finish of {calls} calls" + (" with region M computed between them"
                                                            if region else "")) if calls else ""
            return Plan(True, reuse_step=k, risk=r, features=f, finish_calls=calls,
                        finish_region=region, reason=f"risk {r:.1%} at k*={k} ({how}{finish})", **base)
    f = {**feats, "depth_fraction": depths[-1] / steps}
    r = model.risk(f)
    return Plan(False, risk=r, features=f, why="risk", reason=(
        f"predicted risk {r:.1%} at the shallowest depth {depths[-1]} is not within the "
        f"budget {alpha:.1%}"), **base)
