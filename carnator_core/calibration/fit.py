"""Calibration of the gate's risk model from measured reuses (DESIGN.md §2.4), plain torch.

A calibration run (bench/calibrate.py) measures, for candidate pairs (request, stored entry
with the same compatibility class), the gate's evidence features and the *true* outcome of
reusing the entry at each stored depth k: did the result miss tolerance against the
request's own full computation? This module turns those measurements into a fitted
``RiskModel`` and checks it the way the gate uses it: accept the deepest depth whose
predicted risk is ≤ α, and count how many accepted reuses actually missed tolerance.

An *instance* is one (request, candidate) pair:
``{"group": any, "features": {FEATURES without depth}, "depths": [{"k": int,
"depth_fraction": float, "label": 0|1, "psnr": float}, ...]}``.
"""
from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Callable

from ..gate import (UNNAMED_PROBE_FRACTION, EVIDENCE_CLASSES, FEATURES, NEAR_SCENE_CELL, REGION_SHARE_BOUNDS,
                   RiskModel, calibration_file, class_of_option, evidence_class, finish_allows,
                   finish_calls_at, finish_cost, option_key, share_cell)
from .risk_control import certify, clopper_pearson_upper


def exceeds_tolerance(psnr: float, checker_ok_reference: bool, checker_ok: bool,
                      psnr_bound: float) -> int:
    """1 when a reuse misses tolerance: PSNR vs the reference below the bound, or the
    checker disagreeing with the prompt where the reference agrees (DESIGN.md §4)."""
    return int(psnr < psnr_bound or (checker_ok_reference and not checker_ok))


def rows_of(instances: list[dict]) -> tuple[list[dict], list[int]]:
    """Fit rows: reuses finished every step (the ranking the thresholds of every finish use)."""
    rows, labels = [], []
    for inst in instances:
        for d in _finished(inst["depths"], 0):
            rows.append({**inst["features"], "depth_fraction": d["depth_fraction"]})
            labels.append(int(d["label"]))
    return rows, labels


def split(instances: list[dict], holdout: float = 0.3, seed: int = 0) -> tuple[list, list]:
    """Split by group, so a pair never lands on both sides."""
    groups = sorted({str(i["group"]) for i in instances})
    random.Random(seed).shuffle(groups)
    n_hold = max(1, int(round(holdout * len(groups)))) if len(groups) > 1 else 0
    held = set(groups[:n_hold])
    return ([i for i in instances if str(i["group"]) not in held],
            [i for i in instances if str(i["group"]) in held])


def fit(instances: list[dict], region_threshold: float, l2: float = 1e-3,
        form: str = "linear") -> RiskModel:
    if form == "signed":
        # its logit ranks other evidence only (same-scene evidence is scored by depth alone,
        # RiskModel.score): fitted across both classes, "small M, close texts → safe" (the
        # paraphrases) would outweigh "small M → unsafe" within the edits
        instances = [i for i in instances if evidence_class(i["features"]) == "other"]
    rows, labels = rows_of(instances)
    if not rows:
        raise ValueError("no measured reuses to calibrate on")
    model = RiskModel.fit(rows, labels, region_threshold, l2=l2, form=form)
    pos = sum(labels)
    model.source = (f"{form} form fitted on {len(rows)} measured reuses ({pos} exceeded tolerance) "
                    f"from {len(instances)} candidate pairs")
    if pos == 0 or pos == len(labels):
        model.source += " — WARNING: only one label class; the fit is degenerate"
    return model


def reuse_share(inst: dict) -> float:
    """The share of the model's tokens this pair's reuses compute themselves (region M after
    widening; the gate's ``features["reuse_share"]``): recorded in the features, else read
    from the measurements — a region finish records it (``token_share``), a fill on M's
    tokens costs ``fill_calls + fill_region_calls·share`` steps. A non-empty M with neither
    covered every token (no region call can run on the whole frame): 1."""
    if "reuse_share" in inst["features"]:
        return float(inst["features"]["reuse_share"])
    if inst["features"]["region_fraction"] <= 0:
        return 0.0
    for d in inst["depths"]:
        if d.get("token_share"):
            return float(d["token_share"])
    for d in inst["depths"]:
        if d.get("fill_region_calls"):
            return (d["fill_steps"] - d["fill_calls"]) / d["fill_region_calls"]
    return 1.0


def evidence_of(inst: dict) -> dict:
    """A pair's evidence as the gate reads it, with the share its reuse computes."""
    return {**inst["features"], "reuse_share": reuse_share(inst)}


def gate_decision(model: RiskModel, inst: dict, alpha: float, max_region_fraction: float = 0.5,
                  min_k: int | None = None, max_k: int | None = None) -> dict | None:
    """What the gate would accept for this instance at budget α (``gate.decide``'s rule):
    per finish the deepest depth the risk model accepts, then the finish computing least;
    or None."""
    if inst["features"]["region_fraction"] > max_region_fraction:
        return None
    picks, evidence = [], evidence_of(inst)
    for calls in model.finish_options(evidence):
        depths = _depths(inst, min_k, max_k, calls, model.measured_steps)
        for d in sorted(depths, key=lambda d: -d["k"]):
            f = {**evidence, "depth_fraction": d["depth_fraction"]}
            if model.accepts(f, alpha, calls):
                picks.append({**d, "risk": model.risk(f)})
                break
    return min(picks, key=lambda d: (_cost(d), d.get("finish_calls", 0))) if picks else None


def _cost(d: dict) -> float:
    steps = round(d["k"] / d["depth_fraction"])
    return finish_cost(d["k"], steps, d.get("finish_calls", 0), d.get("token_share", 0.0))


def _finished(depths: list[dict], finish_calls: int) -> list[dict]:
    return [d for d in depths if d.get("finish_calls", 0) == finish_calls]


def _depths(inst: dict, min_k: int | None, max_k: int | None, finish_calls: int = 0,
            measured_steps: int = 0) -> list[dict]:
    # A region finish is measured at every depth but may only start where gate.finish_allows,
    # and at another N than the calibration's the gate adds calls (gate.finish_calls_at): a
    # depth measured with fewer calls than the gate would make there is not what it runs.
    def as_gate_runs(d: dict) -> bool:
        steps, region = round(d["k"] / d["depth_fraction"]), "region_steps" in d
        return (finish_allows(d["k"], steps, finish_calls, region, measured_steps)
                and finish_calls_at(d["k"], steps, finish_calls, region) == finish_calls)
    return [d for d in _finished(inst["depths"], finish_calls)
            if (min_k is None or d["k"] >= min_k) and (max_k is None or d["k"] <= max_k) and as_gate_runs(d)]


def evaluate(model: RiskModel, instances: list[dict], alphas=(0.02, 0.05, 0.10),
             max_region_fraction: float = 0.5) -> dict:
    """Measured false-accept rate of the gate's decisions at each α (per instance)."""
    out = {}
    for a in alphas:
        acc = [gate_decision(model, i, a, max_region_fraction) for i in instances]
        acc = [d for d in acc if d is not None]
        bad = sum(d["label"] for d in acc)
        n = len(acc)
        out[f"{a:g}"] = {
            "alpha": a, "instances": len(instances), "accepted": n,
            "accept_rate": n / len(instances) if instances else 0.0,
            "false_accepts": bad,
            "false_accept_rate": bad / n if n else 0.0,
            # one-sided 95% upper bound (Clopper–Pearson), so a small sample is not over-read
            "false_accept_upper95": clopper_pearson_upper(bad, n, 0.05),
            "holds": (bad / n if n else 0.0) <= a,
            "mean_depth_fraction": (sum(d["depth_fraction"] for d in acc) / n) if n else None,
        }
    return out


GRID_POINTS = 400
CERTIFY_SHARE = 0.6  # of the pairs, held out of the fit to certify on (the fit only ranks)
CERTIFIED_BUDGETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5)  # each certified on its own (δ each)


def certify_model(model: RiskModel, instances: list[dict], delta: float = 0.1,
                  budgets=CERTIFIED_BUDGETS, max_region_fraction: float = 0.5,
                  min_k: int | None = None, max_k: int | None = None, joint: bool = False) -> dict:
    """Choose the gate's threshold on ``RiskModel.score`` for each evidence class and budget by
    Learn-then-Test (``risk_control.certify``) on measured reuses the model was *not* fitted
    on, store them in ``model.thresholds`` with confidence 1−δ (per class), and return the
    evidence. Certifying each class apart (the classes are read from the evidence, never
    from labels) keeps the budget whatever share of paraphrases and edits a workload has.

    Identical requests are left out: the pipeline answers them as exact repeats, so the gate
    never sees them and they would only dilute the measured risk.

    Instances naming a ``"stratum"`` (the population their pair was drawn from) are certified
    in every stratum at once (``certify_strata``): the budget holds on each, not only on the mix.

    ``joint``: a class measured with several finishes gets one threshold for all of them,
    certified on the decision the gate actually makes with it — per finish the deepest
    accepted depth, then the finish that computes least (``gate_decision``) — at the class's
    whole δ. Certified apart, a finish that may only start deep (a region finish) has no
    shallow reuses to average over and is rarely certified at small α, though the gate would
    run it only where it is the cheapest accepted plan.
    """
    if joint:
        return _certify_joint(model, instances, delta, budgets, max_region_fraction, min_k, max_k)
    # a class measured with a guided finish too has two finishes to certify: each at δ/2
    # (Bonferroni), so both guarantees hold together at 1−δ and the gate may pick either
    options = _class_finishes(model)
    per_class: dict[str, list] = {option_key(k, c): [] for k in _cells(model) for c in options[class_of_option(k)]}
    for inst in _certifiable(instances, max_region_fraction):
        cell = model.cell(evidence_of(inst))
        for calls in options[class_of_option(cell)]:
            scored = [(z, int(d["label"])) for z, d in _scored(model, inst, calls, min_k, max_k)]
            if scored:
                per_class[option_key(cell, calls)].append((stratum_of(inst), scored))
    model.thresholds, model.confidence = {}, 1.0 - delta
    report = {"delta": delta, "instances": sum(len(v) for v in per_class.values()), "classes": {},
              **_strata_note(instances)}
    for key, members in per_class.items():
        klass_delta = delta / len(options[class_of_option(key)])
        def decisions(lam: float, stratum, members=members) -> list[int]:
            picked = (next((y for z, y in scored if z <= lam), None) for s, scored in members if s == stratum)
            return [y for y in picked if y is not None]

        grid = _thinned_grid(z for _, scored in members for z, _ in scored)
        res = {f"{a:g}": certify_strata(decisions, _strata(members), grid, a, klass_delta) for a in budgets}
        model.thresholds[key] = {a: r["threshold"] for a, r in res.items() if r["threshold"] is not None}
        report["classes"][key] = {"instances": len(members), "delta": klass_delta, "budgets": res}
    return report


def _certify_joint(model: RiskModel, instances: list[dict], delta: float, budgets,
                   max_region_fraction: float, min_k: int | None, max_k: int | None) -> dict:
    """``certify_model(joint=True)``: one λ per class, shared by its finishes."""
    options = _class_finishes(model)
    per_class: dict[str, list] = {k: [] for k in _cells(model)}
    for inst in _certifiable(instances, max_region_fraction):
        klass = model.cell(evidence_of(inst))
        finishes = []
        for calls in options[class_of_option(klass)]:
            scored = [(z, (_cost(d), calls), int(d["label"]))
                      for z, d in _scored(model, inst, calls, min_k, max_k)]
            if scored:
                finishes.append(scored)
        if finishes:
            per_class[klass].append((stratum_of(inst), finishes))
    model.thresholds, model.confidence = {}, 1.0 - delta
    report = {"delta": delta, "joint": True, "instances": sum(len(v) for v in per_class.values()),
              "classes": {}, **_strata_note(instances)}
    for klass, members in per_class.items():
        if not members:
            continue

        def decisions(lam: float, stratum, members=members) -> list[int]:
            labels = []
            for s, finishes in members:  # per finish its deepest accepted depth, then the cheapest
                if s != stratum:
                    continue
                picks = [p for p in (next(((c, y) for z, c, y in scored if z <= lam), None)
                                     for scored in finishes) if p is not None]
                if picks:
                    labels.append(min(picks)[1])
            return labels

        grid = _thinned_grid(z for _, finishes in members for scored in finishes for z, _, _ in scored)
        res = {f"{a:g}": certify_strata(decisions, _strata(members), grid, a, delta) for a in budgets}
        for c in options[class_of_option(klass)]:
            model.thresholds[option_key(klass, c)] = {a: r["threshold"] for a, r in res.items()
                                                      if r["threshold"] is not None}
        report["classes"][klass] = {"instances": len(members), "delta": delta, "budgets": res,
                                    "finishes": [option_key(klass, c) for c in options[class_of_option(klass)]]}
    return report


def stratum_of(inst: dict) -> str:
    """The population a measured pair was drawn from (``"stratum"``, set by whoever loads the
    measurements; one stratum when none is named)."""
    return str(inst.get("stratum", ""))


def _strata(members: list[tuple[str, object]]) -> list[str]:
    return sorted({s for s, _ in members})


def _strata_note(instances: list[dict]) -> dict:
    names = sorted({stratum_of(i) for i in instances})
    return {"strata": names} if len(names) > 1 else {}


def certify_strata(decisions: Callable[[float, str], list[int]], strata: list[str], grid: list[float],
                   alpha: float, delta: float) -> dict:
    """Learn-then-Test in every stratum of the calibration at once: a threshold is certified
    only where each stratum's own test certifies it, so the budget holds on each population
    the pairs were drawn from, not only on their mix (a population a fifth of the pairs would
    otherwise be outvoted by the rest). An intersection–union test: rejecting "some stratum's
    risk exceeds α" because every stratum's level-δ test rejects its own is itself level δ, so
    no stratum's δ is split. The fixed-sequence test certifies every λ up to its last, so the
    thresholds all strata certify are those up to the smallest. A stratum with no reuse in a
    class says nothing about it and is not asked; one with too few to test refuses it."""
    per = {s: certify(lambda lam, s=s: decisions(lam, s), grid, alpha, delta) for s in strata or [""]}
    if len(per) == 1:
        return next(iter(per.values()))
    found = [r["threshold"] for r in per.values()]
    lam = None if None in found else min(found)
    binding = [s for s, r in per.items() if r["threshold"] is None or r["threshold"] == lam]
    return {**per[binding[0]], "threshold": lam, "binding_strata": binding, "by_stratum": per}


def _class_finishes(model: RiskModel) -> dict[str, list[int]]:
    return {k: model.class_finishes(k) for k in EVIDENCE_CLASSES}


def _cells(model: RiskModel) -> list[str]:
    """The cells thresholds are certified for: same-scene evidence, and other evidence as
    one class or per bin of the token share its reuse computes (``model.region_share_bounds``)."""
    others = [share_cell("other", b, model.region_share_bounds) for b in model.region_share_bounds]
    near = [NEAR_SCENE_CELL] if model.near_scene_cell else []
    return [k for k in EVIDENCE_CLASSES if k != "other"] + near + (others or ["other"])


def thresholds_side_by_side(model: RiskModel) -> list[dict]:
    """Each certified cell's threshold per budget on one row, and which budgets certified the
    same threshold (a looser budget that buys nothing, a stricter one that protects nothing)."""
    rows = []
    for key, table in sorted(model.thresholds.items()):
        by_alpha = sorted((float(a), lam) for a, lam in table.items())
        same = [[f"{a1:g}", f"{a2:g}"] for (a1, l1), (a2, l2) in zip(by_alpha, by_alpha[1:])
                if abs(l1 - l2) <= 1e-12]
        rows.append({"cell": key, "thresholds": {f"{a:g}": lam for a, lam in by_alpha},
                     "coinciding_budgets": same})
    return rows


def _certifiable(instances: list[dict], max_region_fraction: float) -> list[dict]:
    """The pairs the gate can see: identical ones are exact repeats, and an M beyond the
    region limit is refused before any depth."""
    return [i for i in instances if i.get("kind") != "identical"
            and i["features"]["region_fraction"] <= max_region_fraction]


def _scored(model: RiskModel, inst: dict, calls: int, min_k: int | None,
            max_k: int | None) -> list[tuple[float, dict]]:
    """This pair's reuses with one finish, deepest first, each with the score the thresholds
    compare."""
    evidence = evidence_of(inst)  # once per pair: the share is read from its depth records
    return [(model.score({**evidence, "depth_fraction": d["depth_fraction"]}), d)
            for d in sorted(_depths(inst, min_k, max_k, calls, model.measured_steps), key=lambda d: -d["k"])]


def _thinned_grid(scores) -> list[float]:
    grid = sorted(set(scores))
    return grid[::max(1, len(grid) // GRID_POINTS)]  # thinned by the scores alone, never labels


def fit_and_certify(instances: list[dict], region_threshold: float, delta: float = 0.1,
                    holdout: float = CERTIFY_SHARE, form: str = "interaction",
                    max_region_fraction: float = 0.5, tolerance: dict | None = None,
                    alphas=(0.02, 0.05, 0.1),
                    probe_fraction: float = UNNAMED_PROBE_FRACTION,
                    joint: bool = False,
                    region_share_bounds=REGION_SHARE_BOUNDS,
                    near_scene_cell: bool = False) -> tuple[RiskModel, dict]:
    """The whole procedure on measured instances: split by pair, fit the ranking on one
    side, certify the thresholds on the other (Learn-then-Test, confidence 1−δ), and check
    the gate's decisions on both. Returns the model (ready to save) and a report.
    ``probe_fraction``: the probe the instances were measured with (the model holds for it).
    ``joint``: one threshold per class for all its finishes (``certify_model``).
    ``region_share_bounds``: bins of the token share other evidence is certified by, each
    apart (``gate.share_cell``); empty for one class. ``near_scene_cell``: near-scene
    evidence certified as a cell of its own (``RiskModel.cell``)."""
    if not rows_of(instances)[0]:
        raise ValueError(f"none of the {len(instances)} measured candidate pairs came within the "
                         f"gate's region limit ({max_region_fraction:.0%} of the tiles), so no reuse "
                         "could be measured; give prompts closer to each other (or more pairs)")
    train, held = split(instances, holdout)
    if not train or not held:
        raise ValueError(f"{len(instances)} measured pairs cannot be split into a fit and a "
                         "certification part; measure more pairs")
    model = fit(train, region_threshold, form=form)
    model.finish_calls = measured_finish(instances)
    model.finish_region = measured_region_finish(instances)
    model.region_fill_on_m = measured_fill_on_m(instances)
    model.region_margin = measured_region_margin(instances)
    model.measured_steps = measured_steps(instances)
    model.measured_latents = measured_latents(instances)
    model.region_share_bounds = [float(b) for b in region_share_bounds]
    model.near_scene_cell = bool(near_scene_cell)
    certification = certify_model(model, held, delta=delta, max_region_fraction=max_region_fraction,
                                  joint=joint)
    model.source += (f"; thresholds certified by Learn-then-Test on {certification['instances']} "
                     f"held-out pairs at {1 - delta:.0%} confidence"
                     + (", one per class on the gate's choice among its finishes" if joint else ""))
    rows, labels = rows_of(instances)
    model.tolerance, model.measured_reuses = tolerance, len(rows)
    model.probe_fraction = float(probe_fraction)
    report = {
        "instances": len(instances), "measured_reuses": len(rows), "exceeded_tolerance": sum(labels),
        "train_instances": len(train), "heldout_instances": len(held), "form": form,
        "tolerance": tolerance, "certification": certification,
        "heldout": evaluate(model, held, alphas=alphas, max_region_fraction=max_region_fraction),
        "train": evaluate(model, train, alphas=alphas, max_region_fraction=max_region_fraction),
        "thresholds_side_by_side": thresholds_side_by_side(model),
        "heldout_by_share": {cell: evaluate(model, [i for i in held if model.cell(evidence_of(i)) == cell],
                                            alphas=alphas, max_region_fraction=max_region_fraction)
                             for cell in _cells(model) if cell != "same_scene"},
        "heldout_by_kind": {k: evaluate(model, [i for i in held if i.get("kind") == k], alphas=alphas,
                                        max_region_fraction=max_region_fraction)
                            for k in sorted({str(i.get("kind")) for i in held})},
    }
    if "strata" in certification:
        report["heldout_by_stratum"] = {s: evaluate(model, [i for i in held if stratum_of(i) == s], alphas=alphas,
                                                    max_region_fraction=max_region_fraction)
                                        for s in certification["strata"]}
    return model, report


def measured_finish(instances: list[dict]) -> dict[str, int]:
    """Per evidence class, the guided finish its reuses were also measured with (one number
    of calls per class; a class measured with several is an error, not a guess)."""
    seen: dict[str, set[int]] = {}
    for inst in instances:
        for d in inst["depths"]:
            if d.get("finish_calls"):
                seen.setdefault(evidence_class(inst["features"]), set()).add(int(d["finish_calls"]))
    mixed = {k: sorted(v) for k, v in seen.items() if len(v) > 1}
    if mixed:
        raise ValueError(f"measurements mix guided finishes {mixed}: measure each class with one")
    return {klass: calls.pop() for klass, calls in seen.items()}


def measured_region_finish(instances: list[dict]) -> dict[str, bool]:
    """Evidence classes whose guided finish was measured computing region M's tokens between
    its calls (depths carrying ``region_steps``); a class measured both ways is an error."""
    seen: dict[str, set[bool]] = {}
    for inst in instances:
        for d in inst["depths"]:
            if d.get("finish_calls"):
                seen.setdefault(evidence_class(inst["features"]), set()).add("region_steps" in d)
    mixed = sorted(k for k, v in seen.items() if len(v) > 1)
    if mixed:
        raise ValueError(f"the guided finish of {mixed} was measured with and without region M's "
                         "own computation: measure each class one way")
    return {klass: True for klass, ways in seen.items() if True in ways}


def measured_steps(instances: list[dict]) -> int:
    """The steps N every reuse was measured with (a depth record's k over its share of N);
    measurements at several N are an error: the depth shares would not mean one thing."""
    seen = {round(d["k"] / d["depth_fraction"]) for inst in instances for d in inst["depths"]
            if d.get("depth_fraction")}
    if len(seen) > 1:
        raise ValueError(f"measurements mix step counts {sorted(seen)}: calibrate each N apart")
    return seen.pop() if seen else 0


def measured_latents(instances: list[dict]) -> list[list[int]]:
    """The latent sizes [frames, height, width] the reuses were measured at, fewest tokens
    first (live audits, and measurements from before sizes were recorded, name none)."""
    sizes = {tuple(int(v) for v in inst["latent"]) for inst in instances if inst.get("latent")}
    return [list(t) for t in sorted(sizes, key=lambda t: (math.prod(t), t))]


def measured_fill_on_m(instances: list[dict]) -> bool:
    """Whether the reuses were measured with region M filled by its own trajectory on its
    tokens (depths carrying ``fill`` "on_m", where that fill was asked for: pipeline.fill_region
    falls back to coarse steps where it cannot run, as a hit does). Only reuses with a region
    M tell (an empty M fills nothing); some each way is an error."""
    seen = {d.get("fill") == "on_m" for inst in instances if inst["features"]["region_fraction"] > 0
            for d in inst["depths"]}
    if len(seen) > 1:
        raise ValueError("region M was filled by its own trajectory in some measured reuses and by "
                         "coarse steps in others: measure the calibration one way")
    return seen == {True}


def measured_region_margin(instances: list[dict]) -> int:
    """Tiles by which region M was widened in the measured reuses (depths carrying
    ``margin``; gate.reuse_region widens only other evidence's M). Only those reuses tell;
    some each way is an error."""
    seen = {int(d.get("margin", 0)) for inst in instances
            if inst["features"]["region_fraction"] > 0 and evidence_class(inst["features"]) == "other"
            for d in inst["depths"]}
    if len(seen) > 1:
        raise ValueError(f"region M was widened by {sorted(seen)} tiles in different measured "
                         "reuses: measure the calibration one way")
    return seen.pop() if seen else 0


def calibration_path(cache_folder: str | Path, model_fingerprint: str,
                     probe_fraction: float = UNNAMED_PROBE_FRACTION) -> Path:
    """Where ``gate.risk_model_for`` looks for this model's risk model for this probe."""
    return calibration_file(cache_folder, model_fingerprint, probe_fraction)


def save(model: RiskModel, cache_folder: str | Path, model_fingerprint: str) -> Path:
    """Write the model where the gate finds it for the probe it was measured with: as the
    general file (used at any N, depths by their share), unless that one holds a calibration
    measured at another N — then beside it, for requests at this N only, so calibrating at
    30 steps does not take away the 20-step guarantee (or the reverse)."""
    path = calibration_path(cache_folder, model_fingerprint, model.probe_fraction)
    steps = model.measured_steps
    if steps and path.is_file() and _measured_steps_of(path) not in (steps, None):
        path = calibration_file(cache_folder, model_fingerprint, model.probe_fraction, steps)
    path.parent.mkdir(parents=True, exist_ok=True)
    model.save(path)
    return path


def _measured_steps_of(path: Path) -> int | None:
    """The N a calibration file was measured at (0: not recorded); None: unreadable, replace it."""
    try:
        return int(json.loads(path.read_text()).get("measured_steps") or 0)
    except (OSError, ValueError, AttributeError):
        return None


def save_instances(instances: list[dict], path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for inst in instances:
            f.write(json.dumps(inst) + "\n")


def load_instances(path: str | Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


__all__ = ["FEATURES", "exceeds_tolerance", "rows_of", "split", "fit", "gate_decision",
           "evaluate", "certify_model", "fit_and_certify", "reuse_share", "evidence_of",
           "thresholds_side_by_side", "CERTIFIED_BUDGETS", "calibration_path", "save", "save_instances", "load_instances"]
