"""A cheap calibration: the risk ranking transferred, only its thresholds certified here.

The full calibration (``generic.calibrate``) measures every depth and finish of every pair,
fits the ranking on 40% of them and certifies thresholds on the rest: ~10 generation-
equivalents a pair, thousands in all. This one takes the ranking (weights, share cells) of a
calibrated ``RiskModel`` — the bundled tiny world's — and spends the user's compute only on
what certifying its thresholds needs:

- **A ladder per cell.** The transferred model's thresholds at the budgets asked for, strict →
  permissive, one threshold per cell for all its finishes (``fit.certify_model(joint=True)``).
  Budget α is tested from the transferred threshold at α towards the more permissive ones
  (fixed-sequence testing: no correction for the number of points).
- **Only the decisions are labelled.** Per direction of a pair, the reuse the gate would run at
  each ladder point (per finish its deepest accepted depth, then the cheapest finish:
  ``fit.gate_decision``), deepest first: usually one or two reuses, each costing what is left
  after its depth, instead of every depth and finish. Shallower reuses are measured even where
  the deeper one passed: a reuse that passes at depth k can fail at a shallower depth with
  another finish (a guided finish from k − 2 predicts steps a finish from k computes), so a
  pass says nothing about the decision of a stricter threshold.
- **Clusters.** A pair's two full runs are each other's reference, so its two directions are
  not independent: a pair is one cluster. Each ladder point's test is the anytime-valid
  clustered betting test of ``sequential.RiskSequence`` on the pooled share of labelled reuses
  beyond tolerance, one closed cluster per pair. Anytime-valid because the budget is an input:
  a calibration stopped by its budget and continued with a larger one is read again, and a
  fixed-n test read after every extension would certify by chance.
- **Pairs, not families.** Valid under dependence inside a cluster, a cluster counts as one
  observation however many labels it holds (all ordered pairs of R runs bound a rate no
  better than R/2 disjoint pairs do), so the cheapest observation is a pair: 2 full runs and
  its two directions' decisions (~2.4 generation-equivalents for same-scene evidence), where a
  family of three costs 3 runs and six directions for the same one observation.
- **The budget** in generation-equivalents (``meter.py``) stops the measurement (the pair in
  progress is finished); the progress file keeps every pair with its cost and decisions, so a
  larger budget continues without measuring again. The report names what was certified and,
  for each cell and budget refused, roughly how many more generation-equivalents the rate
  measured so far would need.

What holds: for each cell and budget, with confidence 1 − δ, the pooled share of the gate's
accepted reuses beyond tolerance is below α on pairs drawn like these (pairs independent of
each other; the pair order fixed before any label). The ranking may be poor for the user's
model: then less is certified, never a wrong threshold.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import time
from pathlib import Path
from typing import Callable

import torch

from ..gate import (EVIDENCE_CLASSES, RiskModel, class_of_option, option_key)
from ..pipeline import ReuseSettings
from . import fit as CAL
from .generic import (FullRun, _progress_rows, _say, append_progress, compute_pair, direction_evidence, distinct_ids,
                      measure_reuse, metered_cost, pair_id, progress_path, psnr_outcome, reuse_depths)
from .meter import ComputeMeter, CostLedger, PairCost, ServedSize
from .sequential import RiskSequence
from .tolerance import Tolerance
from . import pairs as PAIRS
from .pairs import PARAPHRASE_SHARE
from .cheap_report import refused_budget, report_text

# α ≤ 2% needs 145 clean pairs in one cell with this test (~500 generation-equivalents):
# beyond what a cheap calibration spends, so their (shallower, costlier) decisions are not
# measured; a full calibration certifies them.
CHEAP_BUDGETS = (0.05, 0.1, 0.2, 0.3, 0.5)
DELTA = 0.1
CLUSTER = 2  # labels a pair can bring to one ladder point: its two directions


# ------------------------------------------------------------------ the ladder
@dataclasses.dataclass
class Ladder:
    """Per cell the thresholds tested (strict → permissive) and, per budget, the index the
    fixed sequence starts at (absent: the transferred model certified nothing there)."""
    points: dict[str, list[float]]
    start: dict[str, dict[str, int]]

    def signature(self) -> str:
        return hashlib.sha256(json.dumps([self.points, self.start], sort_keys=True).encode()).hexdigest()[:12]


def cell_keys(model: RiskModel, cell: str) -> list[str]:
    return [option_key(cell, c) for c in model.class_finishes(class_of_option(cell))]


def ladder_of(transferred: RiskModel, budgets=CHEAP_BUDGETS) -> Ladder:
    """The transferred thresholds to test. One threshold per cell for all its finishes: a model
    certified per finish (``joint`` off) has no single ladder to transfer."""
    points, start = {}, {}
    for cell in CAL._cells(transferred):
        tables = [transferred.thresholds.get(k, {}) for k in cell_keys(transferred, cell)]
        table = tables[0]
        if any(t != table for t in tables[1:]):
            raise ValueError(f"the transferred model certifies {cell}'s finishes apart; transfer one "
                             "certified with one threshold per cell (fit.certify_model(joint=True))")
        at = {f"{a:g}": float(table[f"{a:g}"]) for a in budgets if f"{a:g}" in table}
        points[cell] = sorted(set(at.values()))
        start[cell] = {a: points[cell].index(lam) for a, lam in at.items()}
    return Ladder(points, start)


# The ranking a cheap calibration keeps unless told otherwise: the bundled tiny world's
# calibration for the default probe, in the pack's models/calibration/.
BUNDLED_RANKING = "0706ef2962b7d36f497afe0f24c29ec0.probe0.05.json"


def settings_for(transferred: RiskModel, probe_fraction: float | None = None) -> ReuseSettings:
    """The recipe the transferred ranking was learned with (probe, fill of M, finishes): its
    evidence and decisions mean here what they meant there. A probe asked for must be its."""
    if probe_fraction is not None and abs(float(probe_fraction) - transferred.probe_fraction) > 1e-9:
        raise ValueError(f"the cheap calibration keeps a ranking learned with probe_fraction "
                         f"{transferred.probe_fraction:g}, not {float(probe_fraction):g}: calibrate with probe_fraction "
                         f"{transferred.probe_fraction:g}, or with the full procedure for this probe")
    return ReuseSettings(probe_fraction=transferred.probe_fraction, region_fill_on_m=transferred.region_fill_on_m,
                         region_margin=transferred.region_margin,
                         same_scene_finish_calls=transferred.finish_calls.get("same_scene", 0),
                         other_finish_calls=transferred.finish_calls.get("other", 0),
                         other_finish_region=bool(transferred.finish_region.get("other")))


def ranking_for(transferred: RiskModel, settings: ReuseSettings, steps: int) -> RiskModel:
    """The transferred ranking with the recipe these pairs are measured with (finishes, fill
    of M, probe, N): what the gate will run and what the decisions are planned for."""
    finish = {k: settings.finish_calls_for(k) for k in EVIDENCE_CLASSES if settings.finish_calls_for(k)}
    return dataclasses.replace(
        transferred, thresholds={}, finish_calls=finish,
        finish_region={"other": True} if settings.other_finish_region and finish.get("other") else {},
        region_fill_on_m=settings.region_fill_on_m, region_margin=settings.region_margin,
        probe_fraction=float(settings.probe_fraction), measured_steps=steps, measured_latents=[],
        ladders={}, rejected=None)


def recipe_differences(transferred: RiskModel, ranking: RiskModel) -> list[str]:
    """Where this measurement's recipe differs from the one the ranking was learned with (the
    certificate still holds; a ranking learned on another recipe may certify less)."""
    out = []
    for name in ("probe_fraction", "finish_calls", "finish_region", "region_fill_on_m", "region_margin"):
        a, b = getattr(transferred, name), getattr(ranking, name)
        if a != b:
            out.append(f"{name}: learned with {a}, measured with {b}")
    return out


def _at(model: RiskModel, cell: str, lam: float) -> RiskModel:
    return dataclasses.replace(model, thresholds={k: {"1": lam} for k in cell_keys(model, cell)})


def decision(model: RiskModel, inst: dict, cell: str, lam: float, max_region_fraction: float) -> dict | None:
    """The reuse the gate runs for this instance with threshold λ in its cell (``fit.gate_decision``)."""
    return CAL.gate_decision(_at(model, cell, lam), inst, 1.0, max_region_fraction)


def _key(d: dict) -> tuple[int, int]:
    return int(d["k"]), int(d.get("finish_calls", 0))


def candidates(model: RiskModel, features: dict, settings: ReuseSettings, steps: int) -> list[dict]:
    """Every reuse the gate could plan for this evidence, as depth records without outcome (a
    region finish at the token share the evidence reports, as its measured record will)."""
    out = []
    region = bool(model.finish_region.get(class_of_option(model.cell(features))))
    for k in reuse_depths(settings, steps):
        for calls in model.finish_options(features):
            d = {"k": k, "depth_fraction": k / steps}
            if calls:
                d["finish_calls"] = calls
                if region:
                    d.update(region_steps=0, token_share=float(features.get("reuse_share", 0.0)))
            out.append(d)
    return out


# ------------------------------------------------------------------ measuring
def measure_pair(pair: dict, seed: int, make_run: Callable[[str, int], object], settings: ReuseSettings,
                 ranking: RiskModel, ladder: Ladder, steps: int, judge, region_threshold: float,
                 meter: ComputeMeter | None = None, wanted: dict[str, set[int]] | None = None) -> dict:
    """One progress line: both requests in full, then per direction the decisions of the
    ladder points of its cell (``wanted``: those indices only; None: all), deepest first, with
    what it cost."""
    t0, rows0 = time.perf_counter(), meter.rows if meter is not None else 0
    snaps, p = settings.snapshot_steps(steps), settings.probe_steps(steps)
    full, unit = compute_pair(pair, seed, make_run, snaps, p, meter)
    out = []
    for req, cand in (("b", "a"), ("a", "b")):
        direction = direction_evidence(full[req], full[cand], settings, region_threshold)
        inst = {"group": pair["group"], "kind": pair.get("kind"), "prompt": pair[req],
                "candidate_prompt": pair[cand], **direction.inst, "decisions": []}
        if not direction.refused:
            outcome = judge(pair, req, full[req])
            new_run = lambda req=req: make_run(pair[req], seed)  # noqa: E731
            cell = ranking.cell(CAL.evidence_of(inst))
            points = [lam for j, lam in enumerate(ladder.points.get(cell, []))
                      if wanted is None or j in wanted.get(cell, ())]
            _label_decisions(inst, lambda k, f: measure_reuse(full[req], full[cand], new_run, settings,
                                                              direction, k, f, outcome),
                             ranking, points, settings, steps)
        out.append(inst)
    cost = metered_cost(meter, rows0, unit, time.perf_counter() - t0, out, steps)
    return {"instances": out, "cost": cost}


def _label_decisions(inst: dict, measure: Callable[[int, int], dict | None], ranking: RiskModel,
                     points: list[float], settings: ReuseSettings, steps: int) -> None:
    """Measure the reuse each of these ladder points decides for the instance, deepest first, until
    the decisions — replanned with what was measured (a region finish's own token share; a
    reuse the gate could not run dropped) — are all measured. Writes ``depths`` and
    ``decisions`` ([threshold, k, finish calls] or [threshold, None, None])."""
    cell = ranking.cell(CAL.evidence_of(inst))
    limit = settings.gate.max_region_fraction
    measured: dict[tuple[int, int], dict | None] = {}
    while True:
        pool = [measured.get(_key(d), d) for d in candidates(ranking, inst["features"], settings, steps)]
        pool = [d for d in pool if d is not None]
        picks = {lam: decision(ranking, {**inst, "depths": pool}, cell, lam, limit)
                 for lam in points}
        todo = sorted({_key(d) for d in picks.values() if d is not None} - set(measured), reverse=True)
        if not todo:
            break
        for k, calls in todo:
            measured[(k, calls)] = measure(k, calls)
    inst["depths"] = [d for d in measured.values() if d is not None]
    inst["decisions"] = [[lam, *(_key(d) if d is not None else (None, None))] for lam, d in picks.items()]


def measure(pairs: list[dict], make_run: Callable[[str, int], object], settings: ReuseSettings,
            transferred: RiskModel, progress_file: str | Path, steps: int, seed: int = 0,
            judge=None, budgets=CHEAP_BUDGETS, region_threshold: float | None = None,
            meter: ComputeMeter | None = None, ledger: CostLedger | None = None,
            log: Callable[[str], None] | None = None,
            on_pair: Callable[[int, int], None] | None = None, delta: float = DELTA) -> list[dict]:
    """Measure the pairs in order, resuming from ``progress_file``, until the ledger's budget is
    spent; returns the progress rows of the pairs measured (in pair order). ``judge(pair,
    side, full run)`` returns the outcome function of that side's reuses (``psnr_outcome``'s
    form); pair i runs with seed ``seed + group``, both requests alike. Only the ladder points
    some budget could still certify by the end of this budget are labelled (``within_reach``)."""
    ranking = ranking_for(transferred, settings, steps)
    ladder = ladder_of(transferred, budgets)
    region_threshold = RiskModel().region_threshold if region_threshold is None else region_threshold
    ledger = ledger if ledger is not None else CostLedger()
    log = log or _say
    ledger.pairs_planned = len(pairs)
    done = _progress_rows(progress_file)
    Path(progress_file).parent.mkdir(parents=True, exist_ok=True)
    pids = distinct_ids([pair_key(pair, seed, steps, settings, ladder) for pair in pairs], pairs)
    ledger.carry(done, pids, steps)
    rows: list[dict] = []
    landed: dict[str, int] = {}  # pairs so far with a direction in each cell (evidence only)
    for i, (pair, pid) in enumerate(zip(pairs, pids)):
        if pid not in done:
            if ledger.skip_if_spent():
                continue
            wanted = within_reach(ladder, landed, len(rows), _planned(ledger, len(rows), len(pairs)), delta)
            done[pid] = {"pair_id": pid, **measure_pair(pair, seed + int(pair["group"]), make_run, settings,
                                                        ranking, ladder, steps, judge, region_threshold, meter,
                                                        wanted)}
            append_progress(progress_file, done[pid])
            ledger.measured.append(PairCost.of(done[pid], done[pid]["instances"], steps))
            log(ledger.progress_line(i + 1, sum(q not in done for q in pids[i + 1:])))
        rows.append(done[pid])
        for cell in {ranking.cell(CAL.evidence_of(inst))
                     for inst in CAL._certifiable(done[pid]["instances"], settings.gate.max_region_fraction)}:
            landed[cell] = landed.get(cell, 0) + 1
        if on_pair is not None:
            on_pair(i + 1, len(pairs))
    return rows


@functools.lru_cache(maxsize=None)
def clean_pairs_needed(alpha: float, delta: float = DELTA, max_cluster: int = CLUSTER) -> int:
    """The fewest pairs, every label within tolerance, whose test certifies α."""
    seq, n = RiskSequence(max_cluster=max_cluster), 0
    while not seq.rejects(alpha, delta) and n < 100_000:
        seq.add(0, max_cluster)
        n += 1
    return n


def paraphrase_lead(budgets=CHEAP_BUDGETS, delta: float = DELTA) -> int:
    """Paraphrase pairs a cheap pool opens with: as many as certify same-scene evidence at the
    strictest budget offered if none fails. Same-scene reuse is the deepest and cheapest to
    label, so a small budget spent on it first certifies the strict budget people ask for
    (α = 5%: 58 pairs, ~140 generation-equivalents on the tiny world) instead of looser budgets
    for every cell; the mixed pairs after it certify the edits' cells as the budget grows. The
    block is fixed by its index before any pair is measured, so the tests stay valid; what the
    same-scene certificate covers is its pairs: paraphrases first, then edits whose evidence
    reads same-scene (on the tiny world 8 of 320 edit directions did, none beyond tolerance)."""
    return clean_pairs_needed(min(float(a) for a in budgets), delta)


def pool(base_prompts, n: int, paraphrase_share: float = PARAPHRASE_SHARE, seed: int = 0,
         lead: int | None = None) -> list[dict]:
    """``pairs.pool`` (its arguments in its order) opening with ``paraphrase_lead()`` paraphrases
    (``lead`` given: that many)."""
    return PAIRS.pool(base_prompts, n, paraphrase_share, seed, paraphrase_lead() if lead is None else lead)


def pool_from_text(text: str, n: int, paraphrase_share: float = PARAPHRASE_SHARE, seed: int = 0,
                   lead: int | None = None) -> list[dict]:
    """``pairs.pool_from_text`` opening with ``paraphrase_lead()`` paraphrases."""
    return PAIRS.pool_from_text(text, n, paraphrase_share, seed, paraphrase_lead() if lead is None else lead)


def within_reach(ladder: Ladder, landed: dict[str, int], seen: int, planned: float,
                 delta: float = DELTA) -> dict[str, set[int]]:
    """Per cell the ladder points worth labelling: always the loosest budget's (the deepest,
    cheapest decisions, on every budget's sequence), and a stricter point where a budget whose
    sequence holds it could reach its clean-pair minimum with the pairs expected in the cell by
    the end of this budget (the cell's share of the pairs so far, one in two before any). A
    strict decision that cannot count before the budget ends is not paid for (edits' α = 5%
    threshold decides shallow reuses, several times dearer). Reads evidence and spend only,
    never a label, so the tests stay valid; a larger budget labels them from then on."""
    out = {}
    for cell, pts in ladder.points.items():
        if not ladder.start.get(cell):
            out[cell] = set()
            continue
        expected = (landed.get(cell, 0) + 1) / (seen + 2) * planned
        first = max(ladder.start[cell].values())
        for a, j in ladder.start[cell].items():
            if j < first and expected >= clean_pairs_needed(float(a), delta):
                first = j
        out[cell] = set(range(first, len(pts)))
    return out


def _planned(ledger: CostLedger, seen: int, listed: int) -> float:
    """The pairs this budget will have measured: at the cost per pair so far (at least two full
    runs a pair before any), all listed without a budget."""
    if ledger.budget_generations <= 0:
        return float(listed)
    per_pair = ledger.spent_against_budget / seen if seen else ledger.in_budget_unit(2.0)
    return min(float(listed), ledger.budget_generations / max(per_pair, 1e-9) + 1)


def pair_key(pair: dict, seed: int, steps: int, settings: ReuseSettings, ladder: Ladder) -> str:
    """generic's pair id, with the ladder: another transferred model decides other reuses."""
    base = pair_id(pair, seed, steps, settings.same_scene_finish_calls, settings.other_finish_calls,
                   settings.other_finish_region, settings.region_fill_on_m, settings.region_margin)
    return f"{base}-{ladder.signature()}"


# ------------------------------------------------------------------ certifying
def streams(rows: list[dict], ranking: RiskModel, ladder: Ladder,
            max_region_fraction: float = 0.5) -> dict[str, list[list[tuple[int, int]]]]:
    """Per cell and ladder point, one (failures, labels) per pair that brought that point a
    decision, in pair order. Which pairs count depends on the evidence only, never a label."""
    out = {cell: [[] for _ in pts] for cell, pts in ladder.points.items()}
    for row in rows:
        tally: dict[tuple[str, int], list[int]] = {}
        for inst in CAL._certifiable(row["instances"], max_region_fraction):
            cell = ranking.cell(CAL.evidence_of(inst))
            labels = {_key(d): int(d["label"]) for d in inst["depths"]}
            for lam, k, calls in inst.get("decisions", []):
                if k is None or cell not in ladder.points or lam not in ladder.points[cell]:
                    continue
                f_n = tally.setdefault((cell, ladder.points[cell].index(lam)), [0, 0])
                f_n[0] += labels[(k, calls)]
                f_n[1] += 1
        for (cell, j), (fails, n) in tally.items():
            out[cell][j].append((fails, n))
    return out


def landed_in(rows: list[dict], ranking: RiskModel, max_region_fraction: float = 0.5) -> dict[str, int]:
    """Pairs with a direction the gate could reuse in each cell (evidence only)."""
    out: dict[str, int] = {}
    for row in rows:
        for cell in {ranking.cell(CAL.evidence_of(i)) for i in CAL._certifiable(row["instances"], max_region_fraction)}:
            out[cell] = out.get(cell, 0) + 1
    return out


def certify_ladder(observed: dict[str, list[list[tuple[int, int]]]], ladder: Ladder,
                   budgets=CHEAP_BUDGETS, delta: float = DELTA, max_cluster: int = CLUSTER,
                   cost_per_cell_pair: dict[str, float] | None = None,
                   landed: dict[str, int] | None = None) -> dict:
    """Per cell and budget the certified threshold, by fixed-sequence testing along the ladder
    from the budget's start with each point's clustered anytime-valid test; refused budgets say
    why and, where the rate measured so far allows, about how many more pairs (and, given
    ``cost_per_cell_pair``, generation-equivalents) they would need. ``landed``: per cell the
    pairs with a direction there (default: the clusters at the point)."""
    cells = {}
    for cell, pts in ladder.points.items():
        seqs = [RiskSequence.of(observed.get(cell, [[]] * len(pts))[j], max_cluster) for j in range(len(pts))]
        report = {"points": [{"threshold": lam, **_point(s, delta)} for lam, s in zip(pts, seqs)],
                  "budgets": {}}
        for a in budgets:
            key = f"{a:g}"
            if key not in ladder.start.get(cell, {}):
                report["budgets"][key] = {"threshold": None, "why": "the transferred model certified no "
                                          "threshold at this budget here"}
                continue
            first = ladder.start[cell][key]
            last = None
            for j in range(first, len(pts)):
                if not seqs[j].rejects(a, delta):
                    break
                last = j
            if last is not None:
                report["budgets"][key] = {"threshold": pts[last], "clusters": len(seqs[last].counts)}
            else:
                in_cell = (landed or {}).get(cell, len(seqs[first].counts))
                report["budgets"][key] = {"threshold": None, **refused_budget(
                    seqs[first], a, delta, max_cluster, in_cell, (cost_per_cell_pair or {}).get(cell))}
        cells[cell] = report
    return cells


def _point(seq: RiskSequence, delta: float) -> dict:
    n = int(sum(seq.counts))
    return {"clusters": len(seq.counts), "labels": n, "failures": int(round(sum(seq.fails))),
            "upper": seq.upper(delta) if seq.counts else 1.0}


def fit_rows(rows: list[dict], transferred: RiskModel, settings: ReuseSettings, steps: int,
             budgets=CHEAP_BUDGETS, delta: float = DELTA, tolerance: dict | None = None,
             lead: int = 0) -> tuple[RiskModel, dict]:
    """The calibration these measured pairs certify: the transferred ranking with the
    thresholds certified per cell (a cell-budget left uncertified reuses nothing there).
    ``lead``: the paraphrase pairs the pool opened with (``paraphrase_lead``)."""
    ranking = ranking_for(transferred, settings, steps)
    ladder = ladder_of(transferred, budgets)
    limit = settings.gate.max_region_fraction
    # what more pairs cost per pair landing in a cell, at the mix a larger budget draws: the
    # pairs after the pool's paraphrase lead (measured once; edits land there only)
    ahead = rows[lead:] or rows
    spent = sum(PairCost.of(r, r["instances"], steps).generations for r in ahead)
    per_cell = {cell: spent / n for cell, n in landed_in(ahead, ranking, limit).items()}
    cells = certify_ladder(streams(rows, ranking, ladder, limit), ladder, budgets, delta,
                           cost_per_cell_pair=per_cell, landed=landed_in(rows, ranking, limit))
    thresholds = {}
    for cell, rep in cells.items():
        table = {a: r["threshold"] for a, r in rep["budgets"].items() if r["threshold"] is not None}
        for key in cell_keys(ranking, cell):
            thresholds[key] = dict(table)
    # every point the transferred ranking offers a cell, certified here or not: the online
    # certificate may walk them as audits accumulate (audit.ladder)
    ladders = {cell: sorted({float(p["threshold"]) for p in rep["points"]}) for cell, rep in cells.items()
               if rep["points"]}
    instances = [i for r in rows for i in r["instances"]]
    reuses = [d for i in instances for d in i["depths"]]
    model = dataclasses.replace(ranking, thresholds=thresholds, confidence=1.0 - delta, calibrated=True,
                                tolerance=tolerance, measured_reuses=len(reuses),
                                measured_latents=CAL.measured_latents(instances), ladders=ladders)
    model.source = (f"cheap calibration: ranking transferred ({transferred.source.split(';')[0]}), "
                    f"thresholds certified per cell on {len(rows)} prompt pairs ({len(reuses)} labelled "
                    f"reuses, pairs as clusters) by anytime-valid betting tests at {1 - delta:.0%} confidence")
    certified = {cell: sorted((a for a, r in rep["budgets"].items() if r["threshold"] is not None), key=float)
                 for cell, rep in cells.items()}
    report = {
        "procedure": "cheap", "pairs": len(rows), "instances": len(instances), "measured_reuses": len(reuses),
        "exceeded_tolerance": sum(int(d["label"]) for d in reuses), "delta": delta,
        "budgets": [f"{a:g}" for a in budgets], "ladder": ladder.points, "cells": cells,
        "certified": certified, "thresholds": thresholds, "tolerance": tolerance,
        "region_share_bounds": list(ranking.region_share_bounds),
        "recipe_differences": recipe_differences(transferred, ranking),
        "transferred_source": transferred.source,
    }
    return model, report


# ------------------------------------------------------------------ the whole procedure
def calibrate(make_run: Callable[[str, int], object], pairs: list[dict], settings: ReuseSettings,
              tolerance: Tolerance, cache_folder: str | Path, fingerprint: str, steps: int,
              transferred: RiskModel, seed: int = 0,
              decode: Callable[[torch.Tensor], torch.Tensor] | None = None,
              budget_generations: float = 0.0, budgets=CHEAP_BUDGETS, delta: float = DELTA,
              meter: ComputeMeter | None = None, judge=None, log: Callable[[str], None] | None = None,
              on_pair: Callable[[int, int], None] | None = None,
              served: ServedSize | None = None) -> tuple[RiskModel, dict]:
    """Measure (resumably, within ``budget_generations``; 0: every pair, counted in generations
    of the ``served`` size where given), certify and — where
    anything was certified — save the calibration file the gate loads for ``fingerprint``, the
    report beside it. ``judge`` labels reuses (default: PSNR against the request's own full
    computation by ``tolerance``, on frames with ``decode``)."""
    if tolerance.space == "frames" and decode is None and judge is None:
        raise ValueError("a tolerance on decoded frames needs a decoder (connect the VAE), "
                         "or use the latent tolerance")
    t0 = time.perf_counter()
    path = CAL.calibration_path(cache_folder, fingerprint, settings.probe_fraction)
    if judge is None:
        def judge(pair, side, full: FullRun):  # noqa: ARG001 - the default judges by PSNR alone
            return psnr_outcome(full, tolerance, decode)
    ledger = CostLedger(budget_generations=max(0.0, float(budget_generations or 0)), served=served)
    rows = measure(pairs, make_run, settings, transferred, cheap_progress_path(path), steps, seed, judge,
                   budgets, meter=meter, ledger=ledger, log=log, on_pair=on_pair, delta=delta)
    lead = min(len(rows), next((i for i, p in enumerate(pairs) if p.get("kind") != "paraphrase"), len(pairs)))
    model, report = fit_rows(rows, transferred, settings, steps, budgets, delta, tolerance.as_dict(), lead)
    report.update(model_fingerprint=fingerprint, steps=steps, probe_fraction=settings.probe_fraction,
                  paraphrase_lead=lead,
                  region_fill_on_m=model.region_fill_on_m, region_margin=model.region_margin,
                  latents=model.measured_latents, cost=ledger.as_dict(), cost_generations=round(ledger.spent, 3),
                  seconds=round(time.perf_counter() - t0, 1), source=model.source)
    if any(report["certified"].values()):
        saved = CAL.save(model, cache_folder, fingerprint)
        saved.with_name(saved.stem + ".report.json").write_text(json.dumps(report, indent=1))
        report["saved"] = str(saved)
    else:  # nothing to promise: the gate keeps what it had; the measurements are kept
        cheap_progress_path(path).with_name(path.stem + ".cheap.report.json").write_text(json.dumps(report, indent=1))
    return model, report


def cheap_progress_path(calibration_file: str | Path) -> Path:
    """The cheap procedure's measured pairs (apart from the full calibration's, which labels
    every depth)."""
    p = progress_path(calibration_file)
    return p.with_name(p.name.replace(".progress.jsonl", ".cheap.progress.jsonl"))


def pairs_for_budget(budget_generations: float) -> int:
    """Pairs to plan for a budget: a pair costs at least its two full runs."""
    return max(2, math.ceil(budget_generations / 2.0) + 1)


__all__ = ["BUNDLED_RANKING", "CHEAP_BUDGETS", "settings_for", "PARAPHRASE_SHARE", "Ladder", "ladder_of", "ranking_for", "measure",
           "fit_rows", "certify_ladder", "streams", "calibrate", "pool", "pool_from_text",
           "pairs_for_budget", "report_text", "cheap_progress_path"]
