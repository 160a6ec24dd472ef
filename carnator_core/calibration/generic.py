"""Calibrate the gate on any model with no ground truth but the model itself.

For each prompt pair (``prompt_pairs``) both requests are computed in full from the same
noise; then, in both directions, the request *actually reuses* the other's trajectory at
every depth the gate may choose — the candidate's x_k outside region M, the request's own
estimate inside (``pipeline.fill_region``, as a hit does) — and finishes. A reuse is
labelled by a ``Tolerance`` defined on the model's own output: PSNR of the decoded frames
(a VAE connected) or of the latent (none) against the request's own full computation.

Progress is a JSON-lines file of measured pairs beside the calibration file: an
interrupted calibration resumes where it stopped, a finished one refits without measuring.
Plain torch; the caller hands in ``make_run(prompt, seed)`` (``comfy_adapter.ComfyRun`` in
ComfyUI, the tiny world's runs in the benchmark) and optionally ``decode(latent)``.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..gate import RiskModel, evidence, evidence_class, finish_allows, reuse_region, share_bin_text
from ..pipeline import ReuseSettings, TrajectoryRecord, fill_region, guided_finish_for, region_share_for
from ..reuse.region_compute import RegionFinish
from ..signature import tiles_to_latent_mask
from .meter import ComputeMeter, CostLedger, PairCost, ServedSize, cost_text, pair_cost
from .tolerance import Tolerance, psnr


@dataclass
class FullRun:
    """A request computed in full, with what a reuse needs from it."""
    record: TrajectoryRecord
    final: torch.Tensor
    x0_probe: torch.Tensor
    x_probe: torch.Tensor


def compute_full(run, snapshot_steps: list[int], probe_steps: int) -> FullRun:
    """``run`` from noise to the end, recording snapshots, tiles and the probe's state."""
    record = TrajectoryRecord(run, list(snapshot_steps))
    stash = {}

    def on_step(step, x, x0):
        record.on_step(step, x, x0)
        if step == probe_steps - 1:
            stash["x0_probe"] = x0.detach().clone()
        if step == probe_steps:  # what the probe hands on: the latent at step P
            stash["x_probe"] = run.boundary_from_sampler_space(x.detach(), step)

    final = run.sample(0, run.steps, None, on_step, capture_steps=set(range(probe_steps)))
    return FullRun(record, final, stash["x0_probe"], stash["x_probe"])


def reuse_depths(settings: ReuseSettings, steps: int) -> list[int]:
    """The stored depths the gate may choose (as ``gate.decide`` bounds them)."""
    p = settings.probe_steps(steps)
    lo = max(p, math.ceil(settings.gate.min_depth * steps))
    hi = math.floor(settings.gate.max_depth * steps)
    return [k for k in settings.snapshot_steps(steps) if lo <= k <= hi]


@dataclass
class Direction:
    """A request against a candidate at the probe step: the gate's evidence (``inst``, the
    calibration's instance without depths yet), the region M a reuse computes itself (after
    widening) and the evidence class; ``refused`` where the region limit rejects it before
    any depth."""
    inst: dict
    region: torch.Tensor
    klass: str
    refused: bool
    stored_x0: dict | None = None  # the candidate's x̂0 a guided finish follows, read once


def direction_evidence(request: FullRun, candidate: FullRun, settings: ReuseSettings,
                       region_threshold: float) -> Direction:
    """The gate's evidence for ``request`` against ``candidate``, read as ``gate.decide`` reads
    it, with the share of the tokens its reuse computes (``features["reuse_share"]``)."""
    steps = request.record.run.steps
    p = settings.probe_steps(steps)
    new_sig, old_sig = request.record.signature(p - 1), candidate.record.signature(p - 1)
    feats, region = evidence(new_sig, old_sig, new_sig.similarity(old_sig), region_threshold)
    inst = {"features": feats, "depths": [], "latent": [int(v) for v in request.record.thw]}
    if p > 1:  # what a one-step probe would have seen (a cheaper probe's evidence)
        new0, old0 = request.record.signature(0), candidate.record.signature(0)
        inst["features_step0"] = evidence(new0, old0, new0.similarity(old0), region_threshold)[0]
    klass = evidence_class(feats)
    if feats["region_fraction"] > settings.gate.max_region_fraction:
        return Direction(inst, region, klass, True)  # the gate rejects it before any depth
    region = reuse_region(feats, region, request.record.grid, settings.region_margin)
    # the share of the tokens the reuse computes itself: the gate certifies other evidence per
    # bin of it (gate.share_cell), reading it the same way (pipeline.region_share_for)
    feats["reuse_share"] = (region_share_for(request.record.run, request.record.grid)(region)
                            if bool(region.any()) else 0.0)
    return Direction(inst, region, klass, False)


def measure_reuse(request: FullRun, candidate: FullRun, new_run: Callable[[], object],
                  settings: ReuseSettings, direction: Direction, k: int, finish: int,
                  outcome: Callable[[torch.Tensor], dict]) -> dict | None:
    """One reuse of ``candidate`` by ``request`` at depth k, finished every step (``finish``
    0) or by a guided finish of that many calls — a region finish for other evidence when
    ``settings.other_finish_region`` — as a depth record with ``outcome(final latent)``;
    None where the gate never plans that reuse (a region finish too shallow or on every token)."""
    steps = request.record.run.steps
    p = settings.probe_steps(steps)
    region, klass = direction.region, direction.klass
    by_region = klass == "other" and settings.other_finish_region and finish > 0
    if by_region and (not finish_allows(k, steps, finish, region=True) or bool(region.all())):
        return None  # the gate never plans a region finish this shallow or on the whole frame
    run = new_run()
    x_k = candidate.record.snapshots[k].float()
    if bool(region.any()):
        filled = fill_region(run, x_k, region, request.record.grid, request.x0_probe,
                             request.x_probe, p, k, settings.region_fill_calls,
                             candidate.record.snapshots if settings.region_fill_on_m else None)
        start, fill = filled.latent, {"fill_steps": round(filled.steps, 4)}
        if settings.region_fill_on_m:  # as a hit of the calibrated model will fill it
            fill.update(fill="on_m", fill_calls=filled.calls, fill_region_calls=filled.region_calls)
        if settings.region_margin and klass == "other":
            fill["margin"] = settings.region_margin
    else:
        start, fill = run.boundary_from_sampler_space(x_k, k), {"fill_steps": 0}
    if direction.stored_x0 is None:
        direction.stored_x0 = {s: x.float() for s, x in candidate.record.denoised.items()}
    guide = guided_finish_for(run, direction.stored_x0, k, finish)
    if finish and guide is None:
        return None  # nothing stored to guide it (cannot happen with snapshots recorded)
    tokens = None
    if by_region and bool(region.any()):  # (an empty M: the plain guided finish)
        mask = tiles_to_latent_mask(region, request.record.grid, run.latent_shape)
        try:
            tokens = run.compute_region(mask)
        except ValueError:  # M (widened) covers every token: a hit computes every step
            return None     # after k* instead, which is measured as the every-step finish
        guide = RegionFinish(guide, mask)
    final = run.sample(k, steps, start, guide=guide)
    how = {"finish_calls": finish, "predicted_steps": guide.predicted} if guide else {}
    if by_region:  # model calls on M's tokens alone, and their share of the tokens
        how.update(region_steps=guide.region_steps if tokens else 0,
                   token_share=round(tokens.share, 4) if tokens else 0.0)
        run.compute_region(None)
    return {"k": k, "depth_fraction": k / steps, **fill, **how, **outcome(final)}


def measure_direction(request: FullRun, candidate: FullRun, new_run: Callable[[], object],
                      settings: ReuseSettings, region_threshold: float,
                      outcome: Callable[[torch.Tensor], dict],
                      finishes: Callable[[str], list[int]] | None = None) -> dict:
    """One instance (``calibration`` module's format): the gate's evidence for ``request``
    against ``candidate`` at the probe step, and ``outcome(final latent)`` of reusing the
    candidate at each depth the gate may choose (``outcome`` returns at least psnr and
    label), finished every step and by the evidence class's guided finish — or by
    ``finishes(evidence class)`` only (0: every step, else a guided finish's calls)."""
    direction = direction_evidence(request, candidate, settings, region_threshold)
    if direction.refused:
        return direction.inst
    # a reuse is measured finished every step and by its class's guided finish: the gate
    # certifies both and runs whichever computes less at the budget
    if finishes is None:
        calls = settings.finish_calls_for(direction.klass)
        chosen = [0, calls] if calls else [0]
    else:
        chosen = finishes(direction.klass)
    steps = request.record.run.steps
    for k, finish in [(k, f) for f in chosen for k in reuse_depths(settings, steps)]:
        record = measure_reuse(request, candidate, new_run, settings, direction, k, finish, outcome)
        if record is not None:
            direction.inst["depths"].append(record)
    return direction.inst


def pair_id(pair: dict, seed: int, steps: int, finish_calls: int = 0, other_finish_calls: int = 0,
            other_finish_region: bool = False, fill_on_m: bool = False, margin: int = 0) -> str:
    """A measured pair's key in the progress file: a pair measured with other guided
    finishes or another fill of M has other labels, so it is measured again (the defaults
    keep the ids of older files)."""
    other = f"other-finish:{other_finish_calls}" + (":region" if other_finish_region else "")
    key = ([pair["a"], pair["b"], seed, steps] + ([f"finish:{finish_calls}"] if finish_calls else [])
           + ([other] if other_finish_calls else []) + (["fill:on_m"] if fill_on_m else [])
           + ([f"margin:{margin}"] if margin else []))
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]


def distinct_ids(pids: list[str], pairs: list[dict]) -> list[str]:
    """The same prompts drawn twice are two measurements (each pair runs with its own seed,
    seed + group): a repeat's id carries its group, or it would reuse the first one's labels as
    if a second, independent pair had given them. The first keeps the plain id."""
    seen: set[str] = set()
    out = []
    for pid, pair in zip(pids, pairs):
        out.append(pid if pid not in seen else f"{pid}-{pair['group']}")
        seen.add(out[-1])
    return out


def progress_path(calibration_file: str | Path) -> Path:
    """Where the measured pairs of a calibration live while (and after) it runs."""
    p = Path(calibration_file)
    return p.with_name(p.stem + ".progress.jsonl")


def load_progress(path: str | Path) -> dict[str, list[dict]]:
    """Measured pairs by pair id; a line cut short by an interruption is dropped."""
    return {pid: row["instances"] for pid, row in _progress_rows(path).items()}


def _progress_rows(path: str | Path) -> dict[str, dict]:
    """The progress file's lines by pair id (instances, and the pair's cost where metered)."""
    done: dict[str, dict] = {}
    if not Path(path).is_file():
        return done
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
                if isinstance(row["instances"], list):
                    done[row["pair_id"]] = row
            except (ValueError, KeyError, TypeError):
                continue  # the last line of a killed run
    return done


def measure(pairs: list[dict], make_run: Callable[[str, int], object], settings: ReuseSettings,
            tolerance: Tolerance, progress_file: str | Path, steps: int, seed: int = 0,
            decode: Callable[[torch.Tensor], torch.Tensor] | None = None,
            region_threshold: float | None = None,
            on_pair: Callable[[int, int], None] | None = None, log: Callable[[str], None] | None = None,
            meter: ComputeMeter | None = None, ledger: CostLedger | None = None) -> list[dict]:
    """Measure every pair (both directions), resuming from ``progress_file``; returns the
    instances. Pair i runs with seed ``seed + group``: both requests of a pair share it, as
    requests the cache may match do under the same_seed policy.

    Each pair's cost (``meter``: token rows counted at the model, in generation-equivalents;
    without one, or on a model whose blocks it cannot find, by ``meter.pair_cost``'s rule)
    and seconds are kept with it in the progress file and added to ``ledger``; once the
    ledger's budget is spent no new pair is started (the pairs measured so far are returned)."""
    if tolerance.space == "frames" and decode is None:
        raise ValueError("a tolerance on decoded frames needs a decoder (connect the VAE), "
                         "or use the latent tolerance")
    region_threshold = RiskModel().region_threshold if region_threshold is None else region_threshold
    ledger = ledger if ledger is not None else CostLedger()
    log = log or _say
    ledger.pairs_planned = len(pairs)
    done = _progress_rows(progress_file)
    p = settings.probe_steps(steps)
    snaps = settings.snapshot_steps(steps)
    instances: list[dict] = []
    Path(progress_file).parent.mkdir(parents=True, exist_ok=True)
    pids = distinct_ids([pair_id(pair, seed, steps, settings.same_scene_finish_calls, settings.other_finish_calls,
                                 settings.other_finish_region, settings.region_fill_on_m, settings.region_margin)
                         for pair in pairs], pairs)
    ledger.carry(done, pids, steps)
    for i, (pair, pid) in enumerate(zip(pairs, pids)):
        if pid not in done:
            if ledger.skip_if_spent():
                continue
            done[pid] = {"pair_id": pid, **_measure_pair(pair, seed + int(pair["group"]), make_run, settings,
                                                         tolerance, decode, region_threshold, snaps, p, meter)}
            append_progress(progress_file, done[pid])
            ledger.measured.append(PairCost.of(done[pid], done[pid]["instances"], steps))
            log(ledger.progress_line(i + 1, sum(q not in done for q in pids[i + 1:])))
        instances += done[pid]["instances"]
        if on_pair is not None:
            on_pair(i + 1, len(pairs))
    return instances


def append_progress(progress_file: str | Path, row: dict) -> None:
    """One line per pair, synced: a kill loses one pair at most."""
    with open(progress_file, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _say(line: str) -> None:
    print(line, flush=True)


def _measure_pair(pair, seed, make_run, settings, tolerance, decode, region_threshold, snaps, p,
                  meter=None) -> dict:
    """One progress line: the pair's instances and what measuring them cost."""
    t0, rows0 = time.perf_counter(), meter.rows if meter is not None else 0
    full, unit = compute_pair(pair, seed, make_run, snaps, p, meter)
    frames = {side: decode(f.final) for side, f in full.items()} if decode else {}
    out = []
    for req, cand in (("b", "a"), ("a", "b")):
        outcome = psnr_outcome(full[req], tolerance, decode, frames.get(req))
        inst = measure_direction(full[req], full[cand], lambda req=req: make_run(pair[req], seed),
                                 settings, region_threshold, outcome)
        out.append({"group": pair["group"], "kind": pair.get("kind"), "prompt": pair[req],
                    "candidate_prompt": pair[cand], **inst,
                    **({"stratum": str(pair["stratum"])} if pair.get("stratum") else {})})
    return {"instances": out, "cost": metered_cost(meter, rows0, unit, time.perf_counter() - t0, out,
                                                   full["a"].record.run.steps)}


def compute_pair(pair: dict, seed: int, make_run: Callable[[str, int], object], snaps: list[int],
                 probe_steps: int, meter: ComputeMeter | None = None) -> tuple[dict[str, FullRun], int]:
    """Both requests of a pair computed in full from the pair's seed, and the token rows the
    meter counted for the first (the pair's unit of one generation; 0 without a meter)."""
    full, unit = {}, 0
    for side in ("a", "b"):
        before = meter.rows if meter is not None else 0
        full[side] = compute_full(make_run(pair[side], seed), snaps, probe_steps)
        if meter is not None and not unit:
            unit = meter.rows - before
    return full, unit


def psnr_outcome(reference: FullRun, tolerance: Tolerance,
                 decode: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 reference_frames: torch.Tensor | None = None) -> Callable[[torch.Tensor], dict]:
    """A reuse's outcome against the request's own full computation: PSNR on the latent, and
    on the decoded frames with a decoder; labelled beyond tolerance below the bound."""
    if decode is not None and reference_frames is None:
        reference_frames = decode(reference.final)

    def outcome(final: torch.Tensor) -> dict:
        got = {"psnr_latent": psnr(final, reference.final)}
        if decode is not None:
            got["psnr_frames"] = psnr(decode(final), reference_frames, peak=1.0)
        q = got["psnr_frames" if tolerance.space == "frames" else "psnr_latent"]
        return {**got, "psnr": q, "label": int(q < tolerance.psnr_bound)}
    return outcome


def metered_cost(meter: ComputeMeter | None, rows0: int, unit: int, seconds: float,
                 instances: list[dict], steps: int) -> dict:
    """A pair's cost for its progress line: the rows counted at the model since ``rows0`` in
    units of its first full generation, else (a model whose blocks the meter cannot find) the
    same rule on the records."""
    if unit:
        rows = meter.rows - rows0
        cost = PairCost(rows / unit, seconds, "meter").as_dict()
        cost.update(rows=rows, rows_per_generation=unit)
        return cost
    return PairCost(pair_cost(instances, steps), seconds, "rule").as_dict()


def calibrate(make_run: Callable[[str, int], object], pairs: list[dict], settings: ReuseSettings,
              tolerance: Tolerance, cache_folder: str | Path, fingerprint: str, steps: int,
              seed: int = 0, decode: Callable[[torch.Tensor], torch.Tensor] | None = None,
              include_audits: bool = True, delta: float = 0.1,
              on_pair: Callable[[int, int], None] | None = None,
              form: str | None = None, meter: ComputeMeter | None = None,
              budget_generations: float = 0.0, served: ServedSize | None = None,
              log: Callable[[str], None] | None = None) -> tuple[RiskModel, dict]:
    """Measure (resumably), fit, certify and save the calibration file the gate loads for
    ``fingerprint``; the report (with its held-out check) is saved beside it. ``form``: the
    risk form (``gate.RISK_FORMS``); by default the one that matches how M is filled.

    The report's ``cost_generations`` is what the pairs it uses cost (``meter``: counted at
    the model; the progress file keeps each pair's cost, so a resumed calibration counts the
    spend of earlier runs), ``seconds`` this run's wall time. ``budget_generations`` > 0: no
    new pair is started once that much is spent; what was measured is fitted (the report says
    the budget stopped it) and a rerun with a larger budget continues. ``served``: the size
    served when this one is a proxy; the budget and the report count generations of it."""
    from . import fit as CAL
    from .audit import DB_NAME, AuditLog
    t0 = time.perf_counter()
    path = CAL.calibration_path(cache_folder, fingerprint, settings.probe_fraction)
    ledger = CostLedger(budget_generations=max(0.0, float(budget_generations or 0)), served=served)
    instances = measure(pairs, make_run, settings, tolerance, progress_path(path), steps, seed,
                        decode, on_pair=on_pair, log=log, meter=meter, ledger=ledger)
    used = len(pairs) - ledger.pairs_skipped
    audits = []
    if include_audits and (Path(cache_folder) / DB_NAME).exists():
        with AuditLog(cache_folder) as log_:
            audits = log_.audit_instances(fingerprint, tolerance, settings.probe_fraction)
    try:
        model, report = CAL.fit_and_certify(instances + audits, RiskModel().region_threshold,
                                            delta=delta, form=form or risk_form_for(settings),
                                            tolerance=tolerance.as_dict(),
                                            max_region_fraction=settings.gate.max_region_fraction,
                                            probe_fraction=settings.probe_fraction)
    except ValueError as e:
        if not ledger.stopped_by_budget:
            raise
        # the budget stopped it before there was enough to fit: nothing is written but the
        # progress file, which the next run continues from
        report = _unfitted_report(instances, str(e), tolerance)
        model = RiskModel(probe_fraction=settings.probe_fraction)
    model.source = (f"generic calibration: {used} prompt pairs, {len(audits)} live audits, "
                    f"PSNR on {tolerance.space} ≥ {tolerance.psnr_bound:g} dB; " + model.source)
    report.update(model_fingerprint=fingerprint, pairs=used, audits_used=len(audits),
                  steps=steps, source=model.source, thresholds=model.thresholds,
                  probe_fraction=settings.probe_fraction, region_fill_on_m=model.region_fill_on_m,
                  region_margin=model.region_margin, cost=ledger.as_dict(), latents=model.measured_latents,
                  cost_generations=round(ledger.spent, 3), seconds=round(time.perf_counter() - t0, 1))
    if report.get("not_fitted"):
        return model, report
    saved = CAL.save(model, cache_folder, fingerprint)  # beside the general file if that holds another N
    saved.with_name(saved.stem + ".report.json").write_text(json.dumps(report, indent=1))
    return model, report


def _unfitted_report(instances: list[dict], why: str, tolerance: Tolerance) -> dict:
    reuses = [d for inst in instances for d in inst["depths"]]
    return {"instances": len(instances), "measured_reuses": len(reuses),
            "exceeded_tolerance": sum(int(d["label"]) for d in reuses), "heldout": {},
            "tolerance": tolerance.as_dict(), "not_fitted": why}


def risk_form_for(settings: ReuseSettings) -> str:
    """With M filled on its own tokens a larger M is safer, not riskier (``gate.SIGNED_FREE``),
    so the monotone interaction form would misrank the edits: the signed form fits that case."""
    return "signed" if settings.region_fill_on_m else "interaction"


def report_text(report: dict) -> str:
    """The calibration's outcome for a person: what was measured, what is certified, and
    the held-out check of the gate's decisions."""
    tol = report.get("tolerance") or {}
    what = "measured (not calibrated yet)" if report.get("not_fitted") else "calibrated"
    lines = [f"{what} model {report['model_fingerprint'][:12]}: {report['pairs']} prompt pairs "
             f"+ {report.get('audits_used', 0)} audits → {report['measured_reuses']} reuses measured, "
             f"{report['exceeded_tolerance']} beyond tolerance (PSNR on {tol.get('space')} < "
             f"{tol.get('psnr_bound')} dB), for probe_fraction {report.get('probe_fraction', 0.1):g} "
             "(the samplers' probe must match)"]
    if report.get("region_fill_on_m"):
        lines.append(f"region M filled on its own tokens, widened by {report.get('region_margin', 0)} "
                     f"tile(s) for edits; {report.get('form')} risk form")
    thresholds = report.get("thresholds") or {}
    bounds = sorted({int(cell.split("/")[1]) / 100 for cell in (k.split(":")[0] for k in thresholds)
                     if "/" in cell and cell.split("/")[1].isdigit()})
    for key, budgets in thresholds.items():
        certified = ", ".join(f"{float(a):.0%}" for a in sorted(budgets, key=float)) or "none"
        finish = ", guided finish" if key.endswith(":guided") else ""
        lines.append(f"{share_bin_text(key.split(':')[0], bounds)}{finish}: budgets certified {certified}")
    strata = report.get("heldout_by_stratum") or {}
    if strata:
        lines.append(f"every budget certified in each population of pairs alike: {', '.join(strata)}")
    for name, check in [("", report["heldout"])] + [(f" on the {s} pairs", v) for s, v in strata.items()]:
        for a, v in check.items():
            lines.append(f"held-out check{name} α={float(a):.0%}: {v['accepted']} of {v['instances']} accepted, "
                         f"false accepts {v['false_accept_rate']:.1%} (95% upper {v['false_accept_upper95']:.1%})")
    if report.get("not_fitted"):
        lines.append(f"not fitted, nothing written but the measurements: {report['not_fitted']}")
    return "\n".join(lines + cost_text(report))
