"""Probe → lookup → gate → reuse: the request flow of DESIGN.md §2, model-agnostic.

The functions here drive a *run* object (``comfy_adapter.ComfyRun`` in ComfyUI) through a
small interface: ``sample(start, end, boundary_latent, on_step, capture_steps)``,
``boundary_from_sampler_space``, ``renoise``, ``block_tokens``, ``compatibility_class``,
``exact_key``, ``steps``, ``sigmas``, ``latent_shape``, ``model_calls``. They hold no
ComfyUI knowledge, so the node classes stay declarations and the method stays readable.
"""
from __future__ import annotations

import logging
import sqlite3
import time
from dataclasses import replace

import torch

from .cache.folder import CacheError, LookupResult, TrajectoryCache
from .cache.backend import open_cache as open_location
from .cache.precision import from_entry
from .cache.index import served_class
from .gate import (SAME_SCENE_GAP, GateSettings, Plan, RiskModel, decide,
                   evidence_class, gate_model_for, hit_saving)
from .keys import shape_str
from .reuse.sparse_reuse import Connectivity
from .calibration.status import model_status, remember_model_names, status_line
from .reuse.region_compute import RegionFinish
from .signature import tiles_to_latent_mask

from .request import (ProbeResult, ReuseSettings, Summary, TrajectoryRecord, guarded, recomputes_repeat,
                      region_share_for, region_share_of, stored_signature)
from .resume import (Fill, fill_region, finish_guide, guided_finish_for, plan_attention,
                           report_attention, start_from_candidate)
from .served_audits import Exploring, after_audits, audit_served, exploration, label_explored

# what nodes, scripts and tests use from the flow, wherever it is defined
__all__ = ["Fill", "ProbeResult", "ReuseSettings", "Summary", "TrajectoryRecord", "calibrated_risk_model",
           "comparable_candidates", "decide", "fill_region", "gate", "guarded", "guided_finish_for",
           "lookup", "lookup_and_gate", "open_cache", "probe", "recurring_scene", "region_share_for",
           "region_share_of", "reuse", "start_from_candidate", "stored_signature"]

log = logging.getLogger("carnator")


def open_cache(location: str, capacity_bytes: int) -> tuple[TrajectoryCache | None, str | None]:
    """The cache at a folder or postgresql:// URL, or None with a message a person can act
    on (the request still runs)."""
    try:
        return open_location(location, capacity_bytes), None
    except (CacheError, sqlite3.Error, OSError) as e:
        log.warning("Carnator: %s", e)
        return None, str(e)


def probe(run, cache: TrajectoryCache | None, settings: ReuseSettings,
          cache_message: str | None = None, prompt: str = "") -> ProbeResult:
    """Exact-repeat check, then the request's own first P steps with evidence collection."""
    t0 = time.perf_counter()
    if len(run.latent_shape) != 5:  # image models: nothing to reuse across frames and tiles
        cache, cache_message = None, (f"Carnator reuses video latents (B×C×T×H×W); this "
                                      f"{len(run.latent_shape)}-D latent runs without reuse")
    klass = run.compatibility_class()
    exact_key = run.exact_key(klass)
    p = settings.probe_steps(run.steps)
    record = TrajectoryRecord(run, settings.snapshot_steps(run.steps), settings.entry_dtype)
    result = ProbeResult(run, settings, klass, exact_key, cache, cache_message, p, record,
                         prompt=prompt)
    if cache is not None:
        entry = guarded(cache, "exact-repeat lookup", cache.find_exact, exact_key)
        if entry is not None:
            tensors = guarded(cache, "reading the stored result", cache.load_tensors, entry.id, ["final"])
            if tensors is not None:
                result.exact_entry, result.exact_latent = entry, from_entry(tensors["final"])
                result.repeat_may_run = bool(entry.source_entry) and recomputes_repeat(run, settings.gate)
                if not result.repeat_may_run:  # served as it is: not one model call
                    result.seconds = time.perf_counter() - t0
                    return result
    calls, expert_calls = run.model_calls, _expert_calls(run)
    run.attention.settings = settings.sparse
    # connectivity: measured at the probe's last step, and only when it will be used
    run.attention.capture_steps = {p - 1} if settings.sparse.measuring else set()
    result.x_probe = run.sample(0, p, None, record.on_step, capture_steps=set(range(p)))
    result.probe_calls = run.model_calls - calls
    result.probe_expert_calls = _calls_since(expert_calls, _expert_calls(run))
    result.seconds = time.perf_counter() - t0
    return result


def _expert_calls(run) -> dict[str, int]:
    """Model calls per expert so far, for runs of a two-expert model ({} otherwise)."""
    return dict(getattr(run, "expert_calls", None) or {})


def _calls_since(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items()}


def lookup(pr: ProbeResult, top_k: int | None = None) -> LookupResult:
    if pr.exact_latent is not None:
        return LookupResult([], "exact repeat: no lookup needed")
    if pr.cache is None:
        return LookupResult([], pr.cache_message or "cache unavailable")
    sig = pr.signature
    result = guarded(pr.cache, "cache lookup", pr.cache.lookup, pr.klass.key,
                     sig.global_vector(), top_k or pr.settings.top_k,
                     default=LookupResult([], "cache lookup failed"))
    result.reports.extend(pr.cache.reports)
    return result


def gate(pr: ProbeResult, found: LookupResult, risk_model: RiskModel,
         settings: GateSettings | None = None) -> tuple[Plan, list[Plan]]:
    settings = settings or pr.settings.gate
    # the audit judges this budget; what the entry stores follows this model's calibration
    pr.gate_model, pr.settings.gate = risk_model, settings
    pr.gate_used, pr.exploring = risk_model, None
    if pr.exact_latent is not None and not pr.serves_stored:
        return Plan(False, why="repeat_recomputed", reason=(
            f"exact repeat of entry {pr.exact_entry.id[:8]}, which was served by reusing entry "
            f"{pr.exact_entry.source_entry[:8]}: computed in full once, to become its own source "
            f"(recurring_sources)")), []
    if pr.exact_latent is not None:
        return Plan(False, entry_id=pr.exact_entry.id, why="exact_repeat",
                    reason=f"exact repeat of entry {pr.exact_entry.id[:8]}: its stored result is "
                           "returned, nothing to gate"), []
    if not found.candidates:
        return Plan(False, why="no_candidate", reason=f"no candidates: {found.message}"), []
    comparable = comparable_candidates(pr, found)
    if not comparable:
        return Plan(False, why="no_evidence", reason="no candidate has evidence at this probe step"), []
    model, budget, note, beyond = after_audits(pr, risk_model, settings.risk_budget)
    settings = replace(settings, risk_budget=budget)
    pr.gate_used = model
    plan, verdicts = decide(pr.signature, comparable, pr.run.steps, pr.probe_steps, model,
                            settings, pr.settings.region_fill_calls, model.region_fill_on_m,
                            region_share_of(pr))
    if beyond:
        pr.exploring = Exploring(comparable, model, settings, beyond)
    if plan.accept and settings.recurring_sources:
        plan = recurring_scene(pr, plan, model, settings) or plan
    if note:
        plan.reason = f"{plan.reason} · {note}"
    if risk_model.rejected:
        plan.reason = f"{plan.reason} · gate on the uncalibrated prior: {risk_model.rejected}"
    return plan, verdicts


def comparable_candidates(pr: ProbeResult, found: LookupResult) -> list[tuple]:
    """decide()'s candidates: each found entry with its signature at the probe step."""
    new_sig, comparable = pr.signature, []
    for cand in found.candidates:
        tensors = guarded(pr.cache, "reading a candidate", pr.cache.load_tensors, cand.entry.id,
                          ["tile_steps", "xhat_tiles", "feature_steps", "feature_tiles", "denoised_steps"])
        if tensors is None:
            continue  # file lost or corrupt: already quarantined and reported by the cache
        old_sig = stored_signature(tensors, new_sig.step, new_sig.grid)
        if old_sig is None:
            continue
        sim = new_sig.similarity(old_sig)
        # a guided finish needs the entry's stored x̂0 (entries of older versions, or of a model
        # not calibrated for it, have none): without them only the every-step finish is open
        comparable.append((cand.entry.id, old_sig, sim, cand.entry.snapshot_steps,
                           "denoised_steps" in tensors))
    return comparable


def recurring_scene(pr: ProbeResult, plan: Plan, model: RiskModel,
                    settings: GateSettings) -> Plan | None:
    """A plan to compute in full when this request's scene was asked before and served by
    reuse (so it is no source), and a source of it would be reused cheaper than ``plan``.

    Only requests computed in full are reuse sources, so a scene whose first request reused
    another scene (an edit, a scene on the same noise: k* ≈ 8–10 of 20) never becomes one,
    and each of its rewordings pays that shallow reuse again. The served request's probe
    signature is kept (cache_index.served_class); the gate judges it as if it had been
    stored as a source, with this request's snapshot steps. Where that reuse is certified
    and saves more than ``plan``, the scene recurs and this request becomes its source.
    None: keep ``plan`` (also when its own evidence is same-scene, or nothing recurs)."""
    if evidence_class(plan.features or {}) == "same_scene":
        return None
    found = guarded(pr.cache, "looking up served requests", pr.cache.lookup,
                    served_class(pr.klass.key), pr.signature.global_vector(), pr.settings.top_k,
                    default=LookupResult([], ""))
    # same-scene evidence needs the lookup's cosine within the gap: read no other's tensors
    found.candidates = [c for c in found.candidates if 1.0 - c.similarity <= SAME_SCENE_GAP + 1e-3]
    snapshots = pr.settings.snapshot_steps(pr.run.steps)
    as_sources = [(eid, sig, sim, snapshots, True)
                  for eid, sig, sim, *_ in comparable_candidates(pr, found)]
    if not as_sources:
        return None
    steps, probe, fill = pr.run.steps, pr.probe_steps, (pr.settings.region_fill_calls, model.region_fill_on_m)
    best, _ = decide(pr.signature, as_sources, steps, probe, model,
                     replace(settings, min_saving=0.0), *fill, region_share_of(pr))
    if not best.accept or evidence_class(best.features) != "same_scene":
        return None
    would, now = hit_saving(best, steps, probe, *fill), hit_saving(plan, steps, probe, *fill)
    if would <= now:
        return None
    return Plan(False, entry_id=plan.entry_id, risk=plan.risk, similarity=plan.similarity,
                features=plan.features, region_tiles=plan.region_tiles, why="recurring_source", reason=(
                    f"this scene was asked before (request {best.entry_id[:8]}, served by reuse, "
                    f"so no source): computed in full to become its source — its later requests "
                    f"save {would:.0%} of the steps, where reusing entry {plan.entry_id[:8]} "
                    f"(k*={plan.reuse_step}) would save {now:.0%}"))


def lookup_and_gate(pr: ProbeResult) -> tuple[Plan, LookupResult]:
    """Lookup, then the gate with this model's calibrated risk model (or the prior)."""
    found = lookup(pr)
    if pr.cache is None:
        return Plan(False, why="no_cache", reason=pr.cache_message or "cache unavailable"), found
    return gate(pr, found, calibrated_risk_model(pr))[0], found


def calibrated_risk_model(pr: ProbeResult) -> RiskModel:
    """This model's risk model; an unusable calibration file gives the uncalibrated prior
    with why (``rejected``, shown in the summary): it must never fail the request."""
    return gate_model_for(pr.cache.folder, pr.klass.model_fingerprint,
                          pr.settings.probe_fraction, pr.run.steps)


def reuse(pr: ProbeResult, plan: Plan) -> tuple[torch.Tensor, Summary]:
    """Finish the request: exact repeat, resume from the plan, or continue the probe."""
    t0 = time.perf_counter()
    run, n = pr.run, pr.run.steps
    if pr.serves_stored:
        guarded(pr.cache, "recording the hit", pr.cache.record_use, pr.exact_entry.id, n)
        # the probe ran only where a full run was open and the gate then chose the stored result
        probed = pr.probe_steps if pr.x_probe is not None else 0
        s = Summary("exact", n, probed, pr.probe_calls, pr.seconds + time.perf_counter() - t0,
                    entry_id=pr.exact_entry.id, reason="exact repeat of a stored request", why="exact_repeat")
        s.expert_calls = ({k: pr.probe_expert_calls.get(k, 0) for k in _expert_calls(run)}
                          or None)
        _finish_summary(pr, s, [])
        return pr.exact_latent, s

    notes, start, fill, calls = [], None, None, run.model_calls
    region_calls, token_share = 0, None
    expert_calls = _expert_calls(run)
    ex = exploration(pr, plan)
    explored_in_full = ex is not None and ex["serve"] == "full"
    if explored_in_full:  # the user gets the full result; the deeper reuse is measured after
        plan = Plan(False, entry_id=plan.entry_id, features=plan.features, why="explored", reason=(
            f"explored one point beyond the gate's threshold (explore_rate): entry "
            f"{ex['beyond'].entry_id[:8]} at k*={ex['beyond'].reuse_step} — computed and served in "
            f"full, that reuse measured apart"))
    if plan.accept:
        try:
            fill = start_from_candidate(pr, plan)
            if fill is None:
                notes.append(f"entry {plan.entry_id[:8]} lost its snapshot; ran as a miss")
            else:
                start = fill.latent
                if fill.note:
                    notes.append(fill.note)
        except CacheError as e:
            notes.append(str(e))
    record = pr.record.fork(snapshots=start is None)  # a reuse is kept for exact repeats only
    own_connectivity = run.attention.measured()
    resume_at = plan.reuse_step if start is not None else pr.probe_steps
    # an explored request is the reference its reuses are judged against: dense, as in full
    plan_attention(pr, plan if start is not None else None,
                    None if explored_in_full else own_connectivity, resume_at)
    if start is not None:
        guide = finish_guide(pr, plan, notes)
        tokens = run.recorder.region  # set by a finish that computes M's tokens alone
        try:
            final = run.sample(plan.reuse_step, n, start, record.on_step, guide=guide)
        finally:
            if tokens is not None:
                run.compute_region(None)
        predicted = guide.predicted if guide is not None else 0
        outcome, computed = "hit", pr.probe_steps + fill.calls + (n - plan.reuse_step) - predicted
        if fill.on_m:
            region_calls, token_share = fill.region_calls, fill.token_share
            notes.append(f"region M filled by its own trajectory: {fill.calls} full calls, "
                         f"{fill.region_calls} on M's tokens alone ({token_share:.0%} of the tokens)")
        if isinstance(guide, RegionFinish):
            region_calls, token_share = region_calls + guide.region_steps, tokens.share
            notes.append(f"guided finish: {n - plan.reuse_step - predicted} of the {n - plan.reuse_step} "
                         f"steps after k* computed in full, {guide.region_steps} on region M's tokens "
                         f"alone ({token_share:.0%} of the tokens)")
        elif guide is not None:
            notes.append(f"guided finish: {n - plan.reuse_step - predicted} of the {n - plan.reuse_step} "
                         f"steps after k* computed, {predicted} followed the stored trajectory")
    else:
        final = run.sample(pr.probe_steps, n, pr.x_probe, record.on_step)
        outcome, computed = "miss", n
    seconds = pr.seconds + time.perf_counter() - t0
    s = Summary(outcome, n, computed, pr.probe_calls + run.model_calls - calls, seconds,
                reason=plan.reason, region_calls=region_calls, region_token_share=token_share,
                why="" if outcome == "hit" else ("snapshot_lost" if plan.accept else plan.why))
    if expert_calls:
        spent = _calls_since(expert_calls, _expert_calls(run))
        s.expert_calls = {k: pr.probe_expert_calls.get(k, 0) + v for k, v in spent.items()}
    report_attention(run.attention, s)
    if outcome == "hit":
        s.reuse_step, s.risk, s.entry_id = plan.reuse_step, plan.risk, plan.entry_id
        s.region_fraction = plan.region_fraction
        s.saved_seconds = seconds / computed * (n - computed)
        guarded(pr.cache, "recording the hit", pr.cache.record_use, plan.entry_id, n - computed)
        s.audit = audit_served(pr, plan, final, ex)
    elif explored_in_full:
        s.audit = label_explored(pr, ex, final)
    s.stored_id = _store(pr, record, final, plan if outcome == "hit" else None, own_connectivity)
    s.model, s.model_fingerprint = " + ".join(pr.model_names), pr.klass.model_fingerprint
    if pr.cache is not None and pr.model_names:  # the cache tab names models as people loaded them
        guarded(pr.cache, "recording the model's file name", remember_model_names, pr.cache.folder,
                pr.klass.model_fingerprint, pr.model_names)
    if pr.cache is not None:
        s.calibration = guarded(pr.cache, "reading the calibration status", lambda: status_line(
            model_status(pr.cache.folder, pr.klass.model_fingerprint, pr.gate_model,
                         pr.settings.probe_fraction, n),
            pr.settings.gate.risk_budget, n, pr.record.thw),
            default="") or ""
    _finish_summary(pr, s, notes)
    return final, s


def _finish_summary(pr: ProbeResult, s: Summary, notes: list[str]) -> None:
    """Attach every problem met on the way (cache repairs included), log the request."""
    reports = list(pr.cache.reports) if pr.cache is not None else []
    # each problem once: a message the reason already carries (the gate explains a miss with
    # the cache's own message) is not repeated beside it
    s.messages = [m for m in dict.fromkeys(
        ([pr.cache_message] if pr.cache_message else []) + reports + notes)
        if m and m not in (s.reason or "")]
    guarded(pr.cache, "logging the request", getattr(pr.cache, "log_request", None), s.outcome,
            s.entry_id, s.steps_computed, s.steps_total, s.seconds, pr.klass.key)
    log.info("Carnator: %s", s.text().replace("\n", " | "))


def _store(pr: ProbeResult, record: TrajectoryRecord, final: torch.Tensor,
           plan: Plan | None, connectivity: Connectivity | None) -> str | None:
    if pr.cache is None or not pr.settings.store or pr.signature is None:
        return None
    stored = guarded(pr.cache, "exact-repeat lookup", pr.cache.find_exact, pr.exact_key)
    # the same request stored meanwhile (ComfyUI re-ran this node) is kept, unless it was a
    # reuse and this one is computed in full: then this one is newer, and a reuse source
    if stored is not None and not (plan is None and stored.source_entry):
        return None
    run = pr.run
    row = {"class_key": pr.klass.key, "exact_key": pr.exact_key,
           "model_fingerprint": pr.klass.model_fingerprint, "backbone": run.backbone,
           "latent_shape": shape_str(run.latent_shape), "steps": run.steps, "seed": run.seed,
           "cfg": run.cfg, "sampler": run.sampler_name, "scheduler": run.scheduler,
           "prompt": pr.prompt[:500], "probe_step": pr.probe_steps,
           "snapshot_steps": str(sorted(record.snapshots)),
           "source_entry": plan.entry_id if plan else None,
           "class_json": str(pr.klass), "latent_format": run.latent_format}
    # the x̂0 a guided finish follows, only where this model's calibration certified one
    tensors = record.tensors(final, denoised=bool(pr.gate_model is not None and pr.gate_model.finish_calls))
    if plan is not None:  # a reuse is no reuse source (cache.lookup): nor its connectivity
        connectivity = None
        if plan.region_tiles is not None:  # region M, for the pictures (cache previews)
            tensors["region"] = tiles_to_latent_mask(
                plan.region_tiles, pr.record.grid, run.latent_shape)[0, 0].to(torch.uint8)
    if connectivity is not None:  # a mask no hit would run sparse is not worth its bytes
        tensors.update(connectivity.to_tensors(
            with_mask=connectivity.density <= pr.settings.sparse.max_density))
    return guarded(pr.cache, "storing the trajectory", pr.cache.store, row, tensors,
                   pr.signature.global_vector())
