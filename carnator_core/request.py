"""What a request carries through the flow: its settings, the trajectory it records, the
probe's result, the summary the node shows, and the guard that turns a cache failure into a
report instead of a crash."""
from __future__ import annotations

import math
import sqlite3
from dataclasses import dataclass, field
from typing import Any

import torch

from .cache.folder import CacheError, StoredEntry, TrajectoryCache
from .cache.precision import stored_latent, to_entry
from .gate import DEFAULT_PROBE_FRACTION, GateSettings, RiskModel, tile_share
from .keys import CompatibilityClass
from .reuse.sparse_reuse import SparseSettings
from .reuse.region_compute import token_share
from .signature import (EarlySignature, pool_latent_tiles, pool_token_tiles, tile_grid_for,
                        tiles_to_latent_mask)


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
    exploring: Any = None  # served_audits.Exploring: what the gate can explore one ladder point beyond
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
    why: str = ""                     # no hit: one of gate.WHY_NOT; "" on a hit
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


def recomputes_repeat(run, gate: GateSettings) -> bool:
    """Whether an exact repeat of a result that was itself a reuse runs in full once.

    On a service (shared_noise) a repeated prompt is popularity: serving its reused result to
    every repeat would multiply one gate decision's error by it, so the first repeat is
    computed in full and later ones get that (the newest exact entry). With same_seed the
    repeat is someone returning to a result they saw: it gets that result, computing nothing."""
    return gate.recurring_sources and getattr(run, "seed_policy", "") == "shared_noise"


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


