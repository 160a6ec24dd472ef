"""Probe → lookup → gate → reuse: the request flow of DESIGN.md §2, model-agnostic.

The functions here drive a *run* object (``comfy_adapter.ComfyRun`` in ComfyUI) through a
small interface: ``sample(start, end, boundary_latent, on_step, capture_steps)``,
``boundary_from_sampler_space``, ``renoise``, ``block_tokens``, ``compatibility_class``,
``exact_key``, ``steps``, ``sigmas``, ``latent_shape``, ``model_calls``. They hold no
ComfyUI knowledge, so the node classes stay declarations and the method stays readable.
"""
from __future__ import annotations

import copy
import logging
import math
import sqlite3
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from .calibration import audit, online
from .cache.folder import CacheError, LookupResult, StoredEntry, TrajectoryCache
from .cache.backend import open_cache as open_location
from .cache.precision import from_entry, latent_keys, loaded_latent, stored_latent, to_entry
from .cache.index import served_class
from .gate import (DEFAULT_PROBE_FRACTION, SAME_SCENE_GAP, GateSettings, Plan, RiskModel, decide,
                   evidence_class, fill_steps, gate_model_for, hit_saving, option_key, tile_share)
from .keys import CompatibilityClass, shape_str
from .reuse.sparse_reuse import CONNECTIVITY_KEYS, Connectivity, SparseSettings
from .calibration.status import model_status, remember_model_names, status_line
from .calibration.tolerance import psnr
from .reuse.guided_finish import GuidedFinish
from .reuse.region_compute import (FILL_SEGMENT_STEPS, FillSegment, RegionFinish, fill_segment_starts,
                                   token_share)
from .signature import (EarlySignature, pool_latent_tiles, pool_token_tiles, tile_grid_for,
                        tiles_to_latent_mask)

log = logging.getLogger("carnator")


@dataclass
class ReuseSettings:
    # share of steps the probe runs (at least 1); a calibration holds for the probe it was
    # measured with (gate.risk_model_for)
    probe_fraction: float = DEFAULT_PROBE_FRACTION
    snapshot_count: int = 7         # stored x_k snapshots per trajectory (4, 6, …, 16 of 20)
    top_k: int = 3
    # Model steps spent on the request's own coarse trajectory from the probe to k*, which
    # fills region M on a hit (0: its probe x̂0 re-noised to k*, no extra step). Two steps
    # cut edits' failures at k = 10 of 20 from 25–43% to 5–8% (bench/studies/depth_studies.py).
    region_fill_calls: int = 2
    # What a calibration measures hits with region M filled by M's own trajectory computed on
    # its tokens (pipeline.fill_region's ``stored``; Wan-layout models). A hit fills M the way
    # its model's calibration measured it (RiskModel.region_fill_on_m), whatever this says.
    region_fill_on_m: bool = False
    # Tiles by which a calibration widens region M for other evidence before it measures
    # reuses (gate.reuse_region); a hit widens it as its calibration measured
    # (RiskModel.region_margin), whatever this says.
    region_margin: int = 0
    gate: GateSettings = field(default_factory=GateSettings)
    sparse: SparseSettings = field(default_factory=SparseSettings)
    store: bool = True
    entry_dtype: str = "int8"       # how snapshots and the final latent are stored (entry_precision.py)
    audit_rate: float = 0.0         # share of hits also computed in full to check α (audit.py)
    # Share of the candidates one point of the online certificate's ladder beyond the gate's
    # threshold would accept that are explored: computed and served in full, and that deeper
    # reuse run and labelled apart, so audits can certify it (calibration/online.py). Costs
    # compute (a full run and the reuse), never quality. 0: the gate's thresholds are only
    # confirmed or stepped back by audits, never extended past what it serves.
    explore_rate: float = 0.0
    # Model calls of the guided finish a calibration also measures same-scene reuses with
    # (guided_finish.py: the steps between follow the candidate's stored x̂0); the gate
    # chooses it where it is certified and computes less. 0: calibrate every-step only.
    same_scene_finish_calls: int = 4
    # The same for reuses with other evidence (edits, other scenes on the same noise); off by
    # default. Measured on the tiny world's calibration (bench/studies/region_finish_study.py):
    # 6 calls fail 4.4% of these reuses at k = 8 of 20 and 7.9% at 10, where every step fails
    # 1.2% and 5.2%, so Learn-then-Test certified it only at α ≥ 0.3 — and measuring it
    # costs a calibration about 40% more. The changed object needs its own computed steps.
    other_finish_calls: int = 0
    # ...with region M computed on its own tokens between those calls (region_compute.py;
    # Wan-layout models only). The gate runs it where a calibration measured and certified
    # it (RiskModel.finish_region), from gate.finish_allows' depth on. Tiny world, 6 calls:
    # 2.3% beyond tolerance at k = 8, certified at α = 0.05 (docs/results.md); off by default
    # until the committed calibration carries it.
    other_finish_region: bool = False

    def finish_calls_for(self, klass: str) -> int:
        """The guided finish a calibration measures for this evidence class (0: none)."""
        return self.same_scene_finish_calls if klass == "same_scene" else self.other_finish_calls

    def probe_steps(self, steps: int) -> int:
        return max(1, min(steps - 1, math.ceil(self.probe_fraction * steps)))

    def snapshot_steps(self, steps: int) -> list[int]:
        lo = max(1, math.ceil(self.gate.min_depth * steps))
        hi = max(lo, math.floor(self.gate.max_depth * steps))
        n = max(1, min(self.snapshot_count, hi - lo + 1))
        return sorted({round(lo + i * (hi - lo) / max(n - 1, 1)) for i in range(n)})


class TrajectoryRecord:
    """What a request computed: per-step tile maps, snapshots, the last x̂0."""

    def __init__(self, run, snapshot_steps: list[int], dtype: str = "float32"):
        self.run, self.dtype = run, dtype
        self.grid = tile_grid_for(run.latent_shape)
        self.thw = tuple(run.latent_shape[-3:])
        self.snapshot_steps = set(snapshot_steps)
        # x̂0 at the snapshots and the last step: what a guided finish follows (guided_finish.py)
        self.denoised_steps = self.snapshot_steps | ({run.steps - 1} if snapshot_steps else set())
        self.xhat: dict[int, torch.Tensor] = {}
        self.features: dict[int, torch.Tensor] = {}
        self.snapshots: dict[int, torch.Tensor] = {}
        self.denoised: dict[int, torch.Tensor] = {}
        self.last_x0: torch.Tensor | None = None

    def on_step(self, step: int, x: torch.Tensor, x0: torch.Tensor) -> None:
        self.xhat[step] = pool_latent_tiles(x0, self.grid).cpu()
        self.last_x0 = x0
        tokens = self.run.block_tokens(step)
        if tokens is not None:
            tiles = pool_token_tiles(tokens, self.thw, self.grid,
                                     getattr(self.run, "token_patches", None))
            if tiles is not None:
                self.features[step] = tiles
        if step in self.snapshot_steps:
            self.snapshots[step] = to_entry(x, self.dtype)
        if step in self.denoised_steps:
            self.denoised[step] = to_entry(x0, self.dtype)

    def fork(self, snapshots: bool = True) -> "TrajectoryRecord":
        """A copy to continue into, so a probe re-used by ComfyUI's node cache stays clean.
        ``snapshots`` False: it records none (a reuse is never a reuse source)."""
        other = TrajectoryRecord(self.run, sorted(self.snapshot_steps) if snapshots else [], self.dtype)
        other.xhat, other.features = dict(self.xhat), dict(self.features)
        other.snapshots = dict(self.snapshots) if snapshots else {}
        other.denoised = dict(self.denoised) if snapshots else {}
        other.last_x0 = self.last_x0
        return other

    def signature(self, step: int) -> EarlySignature:
        return EarlySignature(step, self.grid, self.xhat[step], self.features.get(step))

    def tensors(self, final: torch.Tensor, denoised: bool = True) -> dict[str, torch.Tensor]:
        """What an entry stores; ``denoised`` False leaves out the x̂0 a guided finish
        follows (a model whose calibration has none would never read them)."""
        steps = sorted(self.xhat)
        out = {"final": to_entry(final, self.dtype), "tile_steps": torch.tensor(steps, dtype=torch.int64),
               "xhat_tiles": torch.stack([self.xhat[s] for s in steps])}
        fsteps = sorted(self.features)
        if fsteps:
            out["feature_steps"] = torch.tensor(fsteps, dtype=torch.int64)
            out["feature_tiles"] = torch.stack([self.features[s] for s in fsteps])
        for k, x in self.snapshots.items():
            out.update(stored_latent(f"snapshot.{k}", x, self.dtype))
        if denoised and self.denoised:
            out["denoised_steps"] = torch.tensor(sorted(self.denoised), dtype=torch.int64)
            for k, x in self.denoised.items():
                out.update(stored_latent(f"denoised.{k}", x, self.dtype))
        return out


def stored_signature(tensors: dict[str, torch.Tensor], step: int,
                     grid: tuple[int, int, int]) -> EarlySignature | None:
    """An entry's signature at ``step``, if it computed that step."""
    steps = tensors["tile_steps"].tolist()
    if step not in steps:
        return None
    feats = None
    if "feature_steps" in tensors and step in tensors["feature_steps"].tolist():
        feats = tensors["feature_tiles"][tensors["feature_steps"].tolist().index(step)]
    return EarlySignature(step, grid, tensors["xhat_tiles"][steps.index(step)], feats)


@dataclass
class ProbeResult:
    run: Any
    settings: ReuseSettings
    klass: CompatibilityClass
    exact_key: str
    cache: TrajectoryCache | None
    cache_message: str | None
    probe_steps: int
    record: TrajectoryRecord
    x_probe: torch.Tensor | None = None           # between-samplers latent at step P
    exact_entry: StoredEntry | None = None
    exact_latent: torch.Tensor | None = None
    # the exact repeat's stored result was itself a reuse and this is a service's request: it
    # may run in full instead (so the probe ran), as the gate's settings decide (serves_stored)
    repeat_may_run: bool = False
    seconds: float = 0.0
    probe_calls: int = 0
    probe_expert_calls: dict[str, int] = field(default_factory=dict)  # two-expert models
    prompt: str = ""
    decode: Any = None                # latent → frames in 0..1 (a VAE), for audits on frames
    gate_model: RiskModel | None = None  # the risk model the gate judged with (before audits)
    gate_used: RiskModel | None = None   # ...after audits: online certificate, tightening
    exploring: "Exploring | None" = None  # what the gate can explore one ladder point beyond
    model_names: list[str] = field(default_factory=list)  # the files the model was loaded from

    @property
    def serves_stored(self) -> bool:
        """The exact repeat gets its stored result (under the gate's current settings)."""
        return self.exact_latent is not None and not (
            self.repeat_may_run and recomputes_repeat(self.run, self.settings.gate))

    @property
    def signature(self) -> EarlySignature | None:
        last = self.probe_steps - 1
        return self.record.signature(last) if last in self.record.xhat else None


@dataclass
class Summary:
    outcome: str                    # "hit" | "miss" | "exact"
    steps_total: int
    steps_computed: int
    model_calls: int
    seconds: float
    reuse_step: int | None = None
    risk: float | None = None
    entry_id: str | None = None     # the matched entry
    stored_id: str | None = None    # the new entry written for this request
    region_fraction: float | None = None
    saved_seconds: float | None = None
    sparse_calls: int = 0             # self-attention calls that ran block-sparse
    sparse_density: float | None = None
    sparse_backend: str | None = None
    attention: str = ""               # which attention ran when another is chained to Carnator's
    reason: str = ""
    messages: list[str] = field(default_factory=list)
    audit: dict | None = None         # this hit was also computed in full (audit.py)
    calibration: str = ""             # the gate's calibration and audits, in one line
    model: str = ""                   # the file names the model was loaded from, when known
    model_fingerprint: str = ""
    expert_calls: dict[str, int] | None = None  # model calls per expert (Wan 2.2 A14B)
    region_calls: int = 0             # model calls on region M's tokens alone (not in steps_computed)
    region_token_share: float | None = None  # their share of the tokens

    @property
    def step_equivalents(self) -> float:
        """Steps computed, a region call counted at M's share of the tokens."""
        return self.steps_computed + self.region_calls * (self.region_token_share or 0.0)

    def text(self) -> str:
        if self.outcome == "exact":
            head = f"EXACT · entry {self.entry_id[:8]} · 0/{self.steps_total} steps computed"
        elif self.outcome == "hit":
            head = (f"HIT k*={self.reuse_step}/{self.steps_total} · computed "
                    f"{self.steps_computed}/{self.steps_total} steps · risk {self.risk:.1%} · "
                    f"region {self.region_fraction:.0%} recomputed · entry {self.entry_id[:8]}")
        else:
            head = (f"MISS · computed {self.steps_computed}/{self.steps_total} steps"
                    + (" · stored" if self.stored_id else ""))
        if self.sparse_calls:
            head += f" · sparse attention {self.sparse_density:.0%} dense ({self.sparse_backend})"
        if self.expert_calls:
            head += " · calls " + ", ".join(f"{k.replace('_', '-')} {v}" for k, v in self.expert_calls.items())
        lines = [head + f" · {self.seconds:.2f} s"]
        if self.attention:
            lines.append(self.attention)
        if self.saved_seconds:
            lines.append(f"saved ≈ {self.saved_seconds:.2f} s")
        if self.reason:
            lines.append(self.reason)
        if self.audit:
            lines.append(self.audit["text"])
        if self.calibration:
            lines.append(self.calibration)
        if self.model:
            lines.append(f"model: {self.model} ({self.model_fingerprint[:8]})")
        lines.extend(self.messages)
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["text"] = self.text()
        return d


def guarded(cache: TrajectoryCache | None, what: str, fn, *args, default=None):
    """Run a cache operation; a database or disk failure becomes a report, not a crash.

    The request in flight matters more than the cache: it finishes as a miss and the
    message says what broke.
    """
    if cache is None:
        return default
    try:
        return fn(*args)
    except (sqlite3.Error, OSError, CacheError) as e:
        cache._report(f"{what} failed ({e}); the request continues without it")
        return default


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


def recomputes_repeat(run, gate: GateSettings) -> bool:
    """Whether an exact repeat of a result that was itself a reuse runs in full once.

    On a service (shared_noise) a repeated prompt is popularity: serving its reused result to
    every repeat would multiply one gate decision's error by it, so the first repeat is
    computed in full and later ones get that (the newest exact entry). With same_seed the
    repeat is someone returning to a result they saw: it gets that result, computing nothing."""
    return gate.recurring_sources and getattr(run, "seed_policy", "") == "shared_noise"


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
        return Plan(False, reason=(
            f"exact repeat of entry {pr.exact_entry.id[:8]}, which was served by reusing entry "
            f"{pr.exact_entry.source_entry[:8]}: computed in full once, to become its own source "
            f"(recurring_sources)")), []
    if pr.exact_latent is not None:
        return Plan(False, entry_id=pr.exact_entry.id,
                    reason=f"exact repeat of entry {pr.exact_entry.id[:8]}: its stored result is "
                           "returned, nothing to gate"), []
    if not found.candidates:
        return Plan(False, reason=f"no candidates: {found.message}"), []
    comparable = comparable_candidates(pr, found)
    if not comparable:
        return Plan(False, reason="no candidate has evidence at this probe step"), []
    model, budget, note, beyond = _audited(pr, risk_model, settings.risk_budget)
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


def region_share_for(run, grid: tuple[int, int, int]):
    """The gate's measure of a region of tiles: the share of this run's model tokens it
    covers, as a region finish computes them (the tiles' share for a model whose patches the
    run does not know). Calibration measures its pairs' reuses with the same function."""
    patch = getattr(run, "patch_size", None)
    if patch is None:
        return tile_share

    def share(region: torch.Tensor) -> float:
        return token_share(tiles_to_latent_mask(region, grid, run.latent_shape), patch)
    return share


def region_share_of(pr: ProbeResult):
    return region_share_for(pr.run, pr.signature.grid)


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
                features=plan.features, region_tiles=plan.region_tiles, reason=(
                    f"this scene was asked before (request {best.entry_id[:8]}, served by reuse, "
                    f"so no source): computed in full to become its source — its later requests "
                    f"save {would:.0%} of the steps, where reusing entry {plan.entry_id[:8]} "
                    f"(k*={plan.reuse_step}) would save {now:.0%}"))


def _audited(pr: ProbeResult, model: RiskModel, alpha: float) -> tuple[RiskModel, float, str, dict]:
    """The risk model and budget after live audits: thresholds extended or stepped back by
    the online certificate (calibration/online.py), then tightened by the served-rate rule;
    what that changed, in words; and per cell the threshold one ladder point beyond where
    the gate now runs (what exploring labels; {} for an uncalibrated model)."""
    if not (Path(pr.cache.folder) / audit.DB_NAME).exists():
        return model, alpha, "", {}  # never audited: no file made for users who do not audit
    fingerprint, calibration = pr.klass.model_fingerprint, audit.calibration_id(model)

    def read():
        with audit.AuditLog(pr.cache.folder) as log_:
            levels = log_.levels(fingerprint, calibration, alpha)
            if not model.thresholds:  # the prior: no ladder to certify
                return levels, model, "", {}
            return (levels, *online.read(log_, fingerprint, model, alpha, lambda cells: (
                *online.gate_model(model, alpha, cells), online.beyond(cells))))
    levels, extended, said, beyond = guarded(pr.cache, "reading the audits", read, default=None) \
        or ({}, model, "", {})
    notes = [said] if said else []
    tight, budget = audit.tightened(extended, alpha, levels)
    if any(levels.values()):
        notes.append("gate tightened by live audits (" + ", ".join(
            f"{k.replace('_', '-')} level {v}" for k, v in sorted(levels.items()) if v) + ")")
    return tight, budget, " · ".join(notes), beyond


@dataclass
class Exploring:
    """What the gate saw, kept to find the reuse one ladder point beyond it (``_exploration``)."""
    candidates: list
    model: RiskModel            # the gate's model after audits
    settings: GateSettings      # with the budget it judged at
    beyond: dict[str, float]    # cell → the threshold one ladder point beyond its gate's


def _beyond_plan(pr: ProbeResult, ex: Exploring) -> Plan | None:
    """The reuse the gate would run with each cell one ladder point beyond (None: it would
    run none there, or only in a cell with no point beyond)."""
    alpha = ex.settings.risk_budget
    deeper = copy.deepcopy(ex.model)
    for cell, lam in ex.beyond.items():
        own = ex.model.thresholds.get(cell)
        for key, table in deeper.thresholds.items():
            # a finish certified with its cell's own table follows it (audit.online_model)
            if key.split(":")[0] == cell and ex.model.thresholds[key] == own:
                table[f"{alpha:g}"] = lam
    plan, _ = decide(pr.signature, ex.candidates, pr.run.steps, pr.probe_steps, deeper, ex.settings,
                     pr.settings.region_fill_calls, deeper.region_fill_on_m, region_share_of(pr))
    if not plan.accept or deeper.cell(plan.features) not in ex.beyond:
        return None
    return plan


def _ran_at(model: RiskModel, plan: Plan, alpha: float) -> float | None:
    """The threshold of the online ladder a plan's reuse was accepted at: its cell's at α
    (None: its finish has a table of its own, which the ladder does not walk)."""
    cell = model.cell(plan.features)
    if model.thresholds.get(option_key(cell, plan.finish_calls)) != model.thresholds.get(cell):
        return None
    at = model.threshold_for(alpha, cell)
    return at[1] if at else None


def _reuse_of(plan: Plan | None) -> tuple | None:
    return None if plan is None else (plan.entry_id, plan.reuse_step, plan.finish_calls)


def _draw_key(pr: ProbeResult, plan: Plan) -> str:
    """What the request's audit and exploration draw hashes (``audit.draw``)."""
    return f"{pr.exact_key}:{plan.entry_id}" if plan.accept else f"{pr.exact_key}:explore"


def _exploration(pr: ProbeResult, plan: Plan) -> dict | None:
    """What this request explores (``audit.explore``), or None. A candidate the next ladder
    point accepts is explored at ``explore_rate``: where that reuse is not the one the gate
    serves, the request is computed and served in full and the reuse run and labelled apart."""
    ex, rate = pr.exploring, pr.settings.explore_rate
    if ex is None or rate <= 0 or pr.exact_latent is not None:
        return None
    key = _draw_key(pr, plan)
    if audit.draw(key) >= rate:  # decided before the second gate decision is paid for
        return None
    tol = (pr.gate_model or RiskModel()).tolerance or {}
    if tol.get("space") == "frames" and pr.decode is None:
        return None  # no label could be read: explore nothing rather than compute for nothing
    deeper = _beyond_plan(pr, ex)
    if deeper is None:
        return None
    now = plan if plan.accept else None
    alpha = pr.settings.gate.risk_budget
    got = audit.explore(key, _reuse_of(now), _reuse_of(deeper), pr.settings.audit_rate, rate)
    return {**got, "now": now, "beyond": deeper,
            "feeds": {"now": _ran_at(ex.model, now, alpha) if now else None,
                      "beyond": ex.beyond[ex.model.cell(deeper.features)]}}


def lookup_and_gate(pr: ProbeResult) -> tuple[Plan, LookupResult]:
    """Lookup, then the gate with this model's calibrated risk model (or the prior)."""
    found = lookup(pr)
    if pr.cache is None:
        return Plan(False, reason=pr.cache_message or "cache unavailable"), found
    return gate(pr, found, calibrated_risk_model(pr))[0], found


def calibrated_risk_model(pr: ProbeResult) -> RiskModel:
    """This model's risk model; an unusable calibration file gives the uncalibrated prior
    with why (``rejected``, shown in the summary): it must never fail the request."""
    return gate_model_for(pr.cache.folder, pr.klass.model_fingerprint,
                          pr.settings.probe_fraction, pr.run.steps)


def _start_from_candidate(pr: ProbeResult, plan: Plan) -> Fill | None:
    """Where the hit resumes at k* and what filling M cost: the candidate's x_k outside M;
    inside M the request's own estimate of its x_k, filled as the gate's calibration measured
    it. None: the entry lost its snapshot."""
    k, device = plan.reuse_step, pr.record.last_x0.device
    on_m = bool(pr.gate_model is not None and pr.gate_model.region_fill_on_m)
    has_region = plan.region_tiles is not None and bool(plan.region_tiles.any())
    starts = fill_segment_starts(pr.probe_steps, k, pr.settings.snapshot_steps(pr.run.steps)) \
        if on_m and has_region else []
    names = [f"snapshot.{s}" for s in [k] + starts]
    tensors = guarded(pr.cache, "reading the snapshot", pr.cache.load_tensors, plan.entry_id,
                      [key for name in names for key in latent_keys(name)])
    if tensors is None or f"snapshot.{k}" not in tensors:
        return None
    x_k = loaded_latent(tensors, f"snapshot.{k}", device)
    if tuple(x_k.shape) != tuple(pr.run.latent_shape):
        raise CacheError(f"cached snapshot {shape_str(x_k.shape)} does not match latent "
                         f"{shape_str(pr.run.latent_shape)} — no reuse")
    if not has_region:
        return Fill(pr.run.boundary_from_sampler_space(x_k, k))
    stored = {s: loaded_latent(tensors, f"snapshot.{s}", device) for s in starts
              if f"snapshot.{s}" in tensors} if on_m else None
    return fill_region(pr.run, x_k, plan.region_tiles, pr.record.grid, pr.record.last_x0,
                       pr.x_probe, pr.probe_steps, k, pr.settings.region_fill_calls, stored)


def guided_finish_for(run, stored: dict[int, torch.Tensor], start: int, calls: int) -> GuidedFinish | None:
    """A guided finish from ``start`` on these stored x̂0 (step → latent), or None when
    they cannot guide it (an entry written before x̂0 was stored)."""
    if calls <= 0:
        return None
    try:
        return GuidedFinish(run.sigmas, stored, start, calls)
    except ValueError:
        return None


def _guided_finish(pr: ProbeResult, plan: Plan, notes: list[str]) -> GuidedFinish | None:
    calls = plan.finish_calls
    if calls <= 0:
        return None
    # one read: every step's name is asked for, the entry's file holds those it stored
    steps = range(pr.run.steps)
    keys = [key for s in steps for key in latent_keys(f"denoised.{s}")]
    tensors = guarded(pr.cache, "reading the stored x̂0", pr.cache.load_tensors, plan.entry_id, keys) or {}
    device = pr.record.last_x0.device
    stored = {s: loaded_latent(tensors, f"denoised.{s}", device) for s in steps
              if f"denoised.{s}" in tensors}
    guide = guided_finish_for(pr.run, stored, plan.reuse_step, calls)
    if guide is None:  # lost since the gate saw the entry: every step, at least as exact
        notes.append(f"entry {plan.entry_id[:8]} lost its stored x̂0: every step after k* computed")
    elif plan.finish_region and plan.region_tiles is not None and bool(plan.region_tiles.any()):
        # between the calls region M follows the request's own prediction, computed on M's
        # tokens alone (region_compute.py); the calibration measured the finish this way
        mask = tiles_to_latent_mask(plan.region_tiles, pr.record.grid, pr.run.latent_shape)
        try:
            pr.run.compute_region(mask)
        except ValueError as e:
            notes.append(f"{e}: every step after k* computed")
            return None
        return RegionFinish(guide, mask)
    return guide


@dataclass
class Fill:
    """Where a hit resumes at k (the resume form) and what filling region M computed."""
    latent: torch.Tensor
    calls: int = 0              # model calls on the whole frame
    region_calls: int = 0       # model calls on M's tokens alone
    token_share: float = 0.0    # M's share of the tokens
    on_m: bool = False          # M's own trajectory computed on its tokens (region_compute.py)
    note: str = ""              # why a fill on M's tokens fell back to the coarse one

    @property
    def steps(self) -> float:
        """In model steps, a call on M's tokens counted at their share."""
        return self.calls + self.region_calls * self.token_share


def fill_region(run, stored_x_k: torch.Tensor, region_tiles: torch.Tensor,
                grid: tuple[int, int, int], x0_probe: torch.Tensor, x_probe: torch.Tensor,
                probe_steps: int, k: int, calls: int,
                stored: dict[int, torch.Tensor] | None = None) -> Fill:
    """The stored x_k outside region M, the request's own estimate inside, as the latent
    ``run.sample`` resumes from at k.

    ``calls`` 0: the probe's last x̂0 re-noised to σ_k with the request's own noise (free,
    but a 2-step x̂0 is blurry). ``calls`` > 0: the request's own trajectory from the probe
    to k in that many coarse steps (the conversions to the resume form are affine, so the
    blend can happen after them). ``stored`` (the candidate's sampler-space snapshots by
    step): M's own trajectory in segments on its tokens instead, the outside the stored one
    at each segment's start (``region_compute.fill_segment_starts``); where no snapshot lies
    between the probe and k, or the model cannot compute M alone, the coarse fill."""
    mask = tiles_to_latent_mask(region_tiles, grid, run.latent_shape).to(stored_x_k.device)
    outside = run.boundary_from_sampler_space(stored_x_k, k)
    note = ""
    if stored is not None:
        starts = fill_segment_starts(probe_steps, k, stored)
        if starts:
            try:
                return _fill_on_m(run, outside, mask, x0_probe, k, starts, stored)
            except ValueError as e:  # not a Wan-layout model, or M covers every token
                note = f"{e}: region M filled by coarse steps"
    if calls <= 0 or k <= probe_steps:
        own = run.boundary_from_sampler_space(run.renoise(x0_probe, k), k)
        return Fill(torch.lerp(outside, own.to(outside.device), mask.to(outside.device)), note=note)
    own = run.jump(probe_steps, k, x_probe, calls)
    return Fill(torch.lerp(outside, own.to(outside.device), mask.to(outside.device)),
                fill_steps(calls, k, probe_steps), note=note)


def _fill_on_m(run, outside_k: torch.Tensor, mask: torch.Tensor, x0_probe: torch.Tensor, k: int,
               starts: list[int], stored: dict[int, torch.Tensor]) -> Fill:
    """fill_region's segments on M's tokens (region_compute.py, FILL_SEGMENT_STEPS each)."""
    region = run.compute_region(mask)
    fill = Fill(outside_k, token_share=region.share, on_m=True)
    try:
        own = run.boundary_from_sampler_space(run.renoise(x0_probe, starts[0]), starts[0])
        for a, b in zip(starts, starts[1:] + [k]):
            here = run.boundary_from_sampler_space(stored[a].to(own.device, torch.float32), a)
            own = torch.lerp(here, own, mask.to(own.device))
            guide = FillSegment(a)
            own = run.jump(a, b, own, min(FILL_SEGMENT_STEPS, b - a), guide=guide)
            fill.calls += guide.full_calls
            fill.region_calls += guide.region_steps
    finally:
        run.compute_region(None)
    fill.latent = torch.lerp(outside_k, own.to(outside_k.device), mask.to(outside_k.device))
    return fill


def reuse(pr: ProbeResult, plan: Plan) -> tuple[torch.Tensor, Summary]:
    """Finish the request: exact repeat, resume from the plan, or continue the probe."""
    t0 = time.perf_counter()
    run, n = pr.run, pr.run.steps
    if pr.serves_stored:
        guarded(pr.cache, "recording the hit", pr.cache.record_use, pr.exact_entry.id, n)
        # the probe ran only where a full run was open and the gate then chose the stored result
        probed = pr.probe_steps if pr.x_probe is not None else 0
        s = Summary("exact", n, probed, pr.probe_calls, pr.seconds + time.perf_counter() - t0,
                    entry_id=pr.exact_entry.id, reason="exact repeat of a stored request")
        s.expert_calls = ({k: pr.probe_expert_calls.get(k, 0) for k in _expert_calls(run)}
                          or None)
        _finish_summary(pr, s, [])
        return pr.exact_latent, s

    notes, start, fill, calls = [], None, None, run.model_calls
    region_calls, token_share = 0, None
    expert_calls = _expert_calls(run)
    ex = _exploration(pr, plan)
    explored_in_full = ex is not None and ex["serve"] == "full"
    if explored_in_full:  # the user gets the full result; the deeper reuse is measured after
        plan = Plan(False, entry_id=plan.entry_id, features=plan.features, reason=(
            f"explored one point beyond the gate's threshold (explore_rate): entry "
            f"{ex['beyond'].entry_id[:8]} at k*={ex['beyond'].reuse_step} — computed and served in "
            f"full, that reuse measured apart"))
    if plan.accept:
        try:
            fill = _start_from_candidate(pr, plan)
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
    _plan_attention(pr, plan if start is not None else None,
                    None if explored_in_full else own_connectivity, resume_at)
    if start is not None:
        guide = _guided_finish(pr, plan, notes)
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
                reason=plan.reason, region_calls=region_calls, region_token_share=token_share)
    if expert_calls:
        spent = _calls_since(expert_calls, _expert_calls(run))
        s.expert_calls = {k: pr.probe_expert_calls.get(k, 0) + v for k, v in spent.items()}
    _report_attention(run.attention, s)
    if outcome == "hit":
        s.reuse_step, s.risk, s.entry_id = plan.reuse_step, plan.risk, plan.entry_id
        s.region_fraction = plan.region_fraction
        s.saved_seconds = seconds / computed * (n - computed)
        guarded(pr.cache, "recording the hit", pr.cache.record_use, plan.entry_id, n - computed)
        s.audit = _audit_served(pr, plan, final, ex)
    elif explored_in_full:
        s.audit = _explored(pr, ex, final)
    s.stored_id = _store(pr, record, final, plan if outcome == "hit" else None, own_connectivity)
    s.model, s.model_fingerprint = " + ".join(pr.model_names), pr.klass.model_fingerprint
    if pr.cache is not None and pr.model_names:  # the cache tab names models as people loaded them
        guarded(pr.cache, "recording the model's file name", remember_model_names, pr.cache.folder,
                pr.klass.model_fingerprint, pr.model_names)
    if pr.cache is not None:
        s.calibration = guarded(pr.cache, "reading the calibration status", lambda: status_line(
            model_status(pr.cache.folder, pr.klass.model_fingerprint, pr.gate_model,
                         pr.settings.probe_fraction, n),
            pr.settings.gate.risk_budget, n),
            default="") or ""
    _finish_summary(pr, s, notes)
    return final, s


def _audit_served(pr: ProbeResult, plan: Plan, final: torch.Tensor, ex: dict | None) -> dict | None:
    """Audit a served hit when its draw says so: at ``audit_rate`` for the gate's threshold,
    and where exploring found this same reuse one ladder point beyond, for that point too."""
    alpha = pr.settings.gate.risk_budget
    if ex is not None:
        names = ex["label"].get(_reuse_of(plan), [])
    else:
        names = ["now"] if audit.sampled(pr.settings.audit_rate, _draw_key(pr, plan)) else []
    if not names:
        return None
    model = pr.gate_used or pr.gate_model or RiskModel()
    if not model.thresholds:
        feeds = None  # the prior: no ladder (audit.online skips it)
    else:
        ran = {"now": _ran_at(model, plan, alpha), "beyond": ex["feeds"]["beyond"] if ex else None}
        feeds = [ran[name] for name in names if ran[name] is not None]
    # labelled for the point beyond only: not drawn at audit_rate, so not in the served rate
    return _audit(pr, plan, final, feeds, explored="now" not in names)


def _explored(pr: ProbeResult, ex: dict, final: torch.Tensor) -> dict:
    """Run and label the reuses an explored request was not served (``final``, its full
    result, is their reference): the one beyond, and the gate's own where its audit was drawn
    (``audit_rate``)."""
    run, labels, texts, calls = pr.run, [], [], 0
    for reuse_key, names in ex["label"].items():
        plan = ex["beyond"] if reuse_key == _reuse_of(ex["beyond"]) else ex["now"]
        feeds = [ex["feeds"][name] for name in names if ex["feeds"][name] is not None]
        before = run.model_calls
        reused = _reuse_apart(pr, plan)
        if reused is None:
            texts.append(f"explored reuse of entry {plan.entry_id[:8]} could not be read: not measured")
            continue
        # the gate's own reuse, drawn at audit_rate, counts in its served rate as if served:
        # that rate's audits stay a uniform share of the reuses the gate accepts
        got = _audit(pr, plan, reused, feeds, explored="now" not in names, reference=final,
                     what=f"explored k*={plan.reuse_step}" if "beyond" in names else f"audited k*={plan.reuse_step}")
        calls += run.model_calls - before
        labels.append(got)
        texts.append(got["text"])
    return {"audited": bool(labels), "explored": True, "calls": calls, "labels": labels,
            "text": " · ".join(texts)}


def _reuse_apart(pr: ProbeResult, plan: Plan) -> torch.Tensor | None:
    """The result this reuse would have served, computed as a hit computes it (its fill of
    M, finish and attention), recording nothing. None: the entry's snapshot is gone."""
    try:
        fill = _start_from_candidate(pr, plan)
    except CacheError:
        return None
    if fill is None:
        return None
    _plan_attention(pr, plan, None, plan.reuse_step)
    guide = _guided_finish(pr, plan, [])
    tokens = pr.run.recorder.region
    try:
        return pr.run.sample(plan.reuse_step, pr.run.steps, fill.latent, guide=guide)
    finally:
        if tokens is not None:
            pr.run.compute_region(None)


def _audit(pr: ProbeResult, plan: Plan, final: torch.Tensor, feeds: list[float] | None = None,
           explored: bool = False, reference: torch.Tensor | None = None,
           what: str = "audited") -> dict:
    """Judge a reuse's result against the request computed in full (``reference``, else
    computed now: dense, from its own noise) with the calibration's tolerance; record it with
    the online ladder's thresholds it feeds (``feeds``), and say if the gate tightened."""
    run, n = pr.run, pr.run.steps
    model = pr.gate_model or RiskModel()
    tol = model.tolerance or {"psnr_bound": 30.0, "space": "latent"}
    if tol.get("space") == "frames" and pr.decode is None:
        return {"audited": False, "text": "audit skipped: this model was calibrated on decoded "
                "frames; connect its VAE to the sampler's vae input to audit"}
    calls = run.model_calls
    if reference is None:
        att = run.attention
        att.capture_steps, att.sparse_steps, att.connectivity = set(), set(), None
        reference = run.sample(0, n, None)
    if tol.get("space") == "frames":
        q = psnr(pr.decode(final), pr.decode(reference), peak=1.0)
    else:
        q = psnr(final, reference)
    label = int(q < float(tol["psnr_bound"]))
    fp, alpha = pr.klass.model_fingerprint, pr.settings.gate.risk_budget

    def record():
        with audit.AuditLog(pr.cache.folder) as log_:
            return log_.record(fp, audit.calibration_id(model), alpha, plan.features,
                               model.score(plan.features) if model.thresholds else plan.risk,
                               plan.reuse_step, n, q, label, tol["space"], plan.entry_id, pr.exact_key,
                               probe_fraction=model.probe_fraction, feeds=feeds, explored=explored)
    state = guarded(pr.cache, "recording the audit", record) or {}
    text = (f"{what}: PSNR {q:.1f} dB vs its full computation ({tol['space']}, bound "
            f"{tol['psnr_bound']:g} dB): {'BEYOND' if label else 'within'} tolerance")
    if state.get("audits") and not explored:
        text += (f" · {state['failures']}/{state['audits']} audits beyond "
                 f"({state['lower']:.0%}–{state['upper']:.0%}) at α {alpha:.0%}")
    if state.get("tightened"):
        text += f" · {state['reason']}"
    return {"audited": True, "psnr": q, "label": label, "space": tol["space"], "explored": explored,
            "feeds": feeds, "calls": run.model_calls - calls, "text": text,
            **{k: state[k] for k in ("klass", "level", "audits", "failures", "rate", "lower",
                                     "upper", "tightened") if k in state}}


def _plan_attention(pr: ProbeResult, plan: Plan | None, own: Connectivity | None,
                    start: int) -> None:
    """Which connectivity drives steps start..N: the candidate's on a hit, optionally the
    request's own probe measurement on a miss, none when sparse attention is off."""
    att, sparse, n = pr.run.attention, pr.settings.sparse, pr.run.steps
    att.capture_steps, att.sparse_steps, att.connectivity = set(), set(), None
    att.reset_measurement()
    att.skipped = None
    att._dense_blocks = {}
    if not sparse.enabled:
        return
    if plan is not None:
        tensors = guarded(pr.cache, "reading the connectivity", pr.cache.load_tensors,
                          plan.entry_id, CONNECTIVITY_KEYS)
        att.connectivity = Connectivity.from_tensors(tensors or {})
        att.region_tiles, att.tile_grid = plan.region_tiles, pr.record.grid
    elif sparse.on_miss:
        att.connectivity = own
    if att.connectivity is None:
        return
    if att.connectivity.density > sparse.max_density or att.connectivity.bits is None:
        att.skipped = (f"sparse attention skipped: stored connectivity is "
                       f"{att.connectivity.density:.0%} dense (limit {sparse.max_density:.0%})"
                       + ("; only its density was stored" if att.connectivity.bits is None else ""))
        att.connectivity = None
        return
    steps = set(range(start, n))
    if sparse.refresh_every > 0:  # dense re-measurement every N steps, sparse in between
        att.capture_steps = {s for s in steps if (s - start) % sparse.refresh_every == 0}
    att.sparse_steps = steps - att.capture_steps


def _report_attention(att, s: Summary) -> None:
    from .reuse.sparse_attention import select_backend
    if att.skipped:
        s.reason = f"{s.reason} · {att.skipped}" if s.reason else att.skipped
    if att.sparse_calls:
        s.sparse_calls = att.sparse_calls
        s.sparse_density = att.connectivity.density
        s.sparse_backend = select_backend(att.sparse_device)  # not the CPU's on a GPU run
    if att.chained_to:
        s.attention = ("attention: " + (
            f"Carnator block-sparse on {att.sparse_calls} calls, chained to {att.chained_to} "
            f"for the other {att.chained_calls}" if att.sparse_calls else
            f"{att.chained_to} on all {att.chained_calls} calls (Carnator's sparse off)"))


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
