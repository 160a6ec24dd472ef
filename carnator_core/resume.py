"""How a hit resumes from a stored trajectory: the start latent at k* (the candidate's x_k
outside region M, M filled as the calibration measured), the guided finish, and which
connectivity drives the block-sparse attention of the remaining steps."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache.folder import CacheError
from .cache.precision import latent_keys, loaded_latent
from .gate import Plan, fill_steps
from .keys import shape_str
from .reuse.sparse_reuse import CONNECTIVITY_KEYS, Connectivity
from .reuse.guided_finish import GuidedFinish
from .reuse.region_compute import FILL_SEGMENT_STEPS, FillSegment, RegionFinish, fill_segment_starts
from .signature import tiles_to_latent_mask

from .request import ProbeResult, Summary, guarded


def start_from_candidate(pr: ProbeResult, plan: Plan) -> Fill | None:
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


def finish_guide(pr: ProbeResult, plan: Plan, notes: list[str]) -> GuidedFinish | None:
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


def reuse_apart(pr: ProbeResult, plan: Plan) -> torch.Tensor | None:
    """The result this reuse would have served, computed as a hit computes it (its fill of
    M, finish and attention), recording nothing. None: the entry's snapshot is gone."""
    try:
        fill = start_from_candidate(pr, plan)
    except CacheError:
        return None
    if fill is None:
        return None
    plan_attention(pr, plan, None, plan.reuse_step)
    guide = finish_guide(pr, plan, [])
    tokens = pr.run.recorder.region
    try:
        return pr.run.sample(plan.reuse_step, pr.run.steps, fill.latent, guide=guide)
    finally:
        if tokens is not None:
            pr.run.compute_region(None)


def plan_attention(pr: ProbeResult, plan: Plan | None, own: Connectivity | None,
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


def report_attention(att, s: Summary) -> None:
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


