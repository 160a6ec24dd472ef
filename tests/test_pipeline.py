"""The core pipeline on each backbone, loaded through ComfyUI's own loader (in process).

Every speed claim here is counted, not timed: model calls go through a DIFFUSION_MODEL
wrapper that counts them, so "fewer steps" means the network really ran fewer times.
"""
import math

import pytest
import torch
from conftest import BACKBONES

PROMPT = "a red ball rolls left across a green field"
RELATED = "a red ball rolls left across a green field slowly"


@pytest.mark.parametrize("backbone", BACKBONES)
def test_miss_then_related_hit_then_exact_repeat(backbone, tiny_models, requests_in):
    model = tiny_models[backbone]
    first, s1 = requests_in(model, backbone, PROMPT)
    assert s1.outcome == "miss" and s1.stored_id
    assert s1.model_calls == s1.steps_total == requests_in.steps  # cond+uncond batched: 1 call/step

    second, s2 = requests_in(model, backbone, RELATED)
    assert s2.outcome == "hit", s2.text()
    assert s2.entry_id == s1.stored_id
    assert s2.reuse_step >= 2
    assert s2.model_calls == s2.steps_computed < s2.steps_total
    # probe + region M's own coarse steps (when M is not empty) + remaining steps
    fill = min(requests_in.settings.region_fill_calls, s2.reuse_step - 1) if s2.region_fraction else 0
    assert s2.steps_computed == 1 + fill + (s2.steps_total - s2.reuse_step)
    assert second.shape == first.shape and torch.isfinite(second).all()
    assert not torch.equal(second, first)  # its own conditioning drove the remaining steps

    again, s3 = requests_in(model, backbone, PROMPT)
    assert s3.outcome == "exact" and s3.model_calls == 0 and s3.steps_computed == 0
    # stored float16 (entry_precision.py): the repeat is the first result to float16 rounding
    assert again.dtype == first.dtype
    torch.testing.assert_close(again, first, rtol=2**-11, atol=1e-6)


@pytest.mark.parametrize("backbone", BACKBONES)
def test_probe_then_continue_equals_one_full_run(backbone, tiny_models, requests_in):
    """A miss costs only bookkeeping: probe + continuation is the plain full sampling."""
    model = tiny_models[backbone]
    run = requests_in.run_obj(model, backbone, PROMPT)
    full = run.sample(0, run.steps, None)
    latent, summary = requests_in(model, backbone, PROMPT)
    assert summary.outcome == "miss"
    torch.testing.assert_close(latent, full, rtol=1e-4, atol=1e-4)


def psnr(x: torch.Tensor, reference: torch.Tensor) -> float:
    """dB, peak = the reference's value range."""
    err = float((x.float() - reference.float()).pow(2).mean())
    peak = float(reference.max() - reference.min())
    return float("inf") if err == 0 else 10 * math.log10(peak ** 2 / err)


@pytest.mark.parametrize("backbone", BACKBONES)
def test_resuming_from_a_stored_snapshot_reproduces_the_trajectory(backbone, tiny_models, requests_in):
    """Snapshots are stored in sampler space; converting back must land on the same path:
    exactly from a float32 snapshot, within float16 rounding (≥ 45 dB) from the compact one."""
    from carnator_core.cache.precision import from_entry
    from carnator_core.pipeline import TrajectoryRecord
    model = tiny_models[backbone]
    run = requests_in.run_obj(model, backbone, PROMPT)
    k = run.steps // 2
    exact, compact = TrajectoryRecord(run, [k], "float32"), TrajectoryRecord(run, [k], "float16")
    full = run.sample(0, run.steps, None, lambda *a: (exact.on_step(*a), compact.on_step(*a)))
    assert compact.snapshots[k].dtype == torch.float16
    resumed = run.sample(k, run.steps, run.boundary_from_sampler_space(exact.snapshots[k], k))
    torch.testing.assert_close(resumed, full, rtol=1e-4, atol=1e-4)
    snapshot = from_entry(compact.snapshots[k])
    resumed16 = run.sample(k, run.steps, run.boundary_from_sampler_space(snapshot, k))
    assert psnr(resumed16, full) >= 45, psnr(resumed16, full)


def test_other_shape_schedule_or_model_finds_no_candidates(tiny_models, requests_in):
    wan, hunyuan = tiny_models["wan21"], tiny_models["hunyuan_video"]
    _, s1 = requests_in(wan, "wan21", PROMPT)
    assert s1.outcome == "miss"
    cases = {
        "shape": dict(model=wan, backbone="wan21", shape=(1, 16, 3, 16, 24)),
        "schedule": dict(model=wan, backbone="wan21", scheduler="normal"),
        "steps": dict(model=wan, backbone="wan21", steps=12),
        "seed": dict(model=wan, backbone="wan21", seed=8),
        # same latent shape (1×16×3×16×16), another model
        "model": dict(model=hunyuan, backbone="hunyuan_video"),
    }
    for name, kw in cases.items():
        latent, s = requests_in(prompt=RELATED, **kw)
        assert s.outcome == "miss", name
        assert "none for this model" in s.lookup_message, (name, s.lookup_message)
        assert torch.isfinite(latent).all()


def test_region_fill_follows_the_requests_own_trajectory(tiny_models, requests_in):
    """Region M is filled from the request's own coarse trajectory (``region_fill_calls``
    model steps from the probe to k*), the rest from the stored x_k; at full resolution the
    jump *is* the request's own trajectory."""
    from carnator_core.pipeline import TrajectoryRecord, fill_region
    from carnator_core.signature import tiles_to_latent_mask
    run = requests_in.run_obj(tiny_models["wan21"], "wan21", PROMPT)
    p, k = 1, 7
    other = requests_in.run_obj(tiny_models["wan21"], "wan21", RELATED)
    stored = TrajectoryRecord(other, [k])
    other.sample(0, other.steps, None, stored.on_step)
    probe = TrajectoryRecord(run, [])
    x_probe = run.sample(0, p, None, probe.on_step)
    torch.testing.assert_close(run.jump(p, k, x_probe, k - p), run.sample(p, k, x_probe),
                               rtol=1e-4, atol=1e-4)

    region = torch.zeros(probe.grid[0] * probe.grid[1] * probe.grid[2], dtype=torch.bool)
    region[: region.numel() // 3] = True
    calls = run.model_calls
    got = fill_region(run, stored.snapshots[k], region, probe.grid, probe.last_x0, x_probe, p, k, 2)
    start = got.latent
    assert got.calls == got.steps == 2 and not got.on_m and run.model_calls - calls == 2
    mask = tiles_to_latent_mask(region, probe.grid, run.latent_shape).bool().expand_as(start)
    own = run.jump(p, k, x_probe, 2)
    outside = run.boundary_from_sampler_space(stored.snapshots[k], k)
    assert mask.any() and (~mask).any()
    torch.testing.assert_close(start[mask], own[mask])
    torch.testing.assert_close(start[~mask], outside[~mask])
    # the free fill (calls=0) spends no model step
    calls = run.model_calls
    got = fill_region(run, stored.snapshots[k], region, probe.grid, probe.last_x0, x_probe, p, k, 0)
    assert got.steps == 0 and run.model_calls == calls


def test_a_hit_counts_the_region_fill_steps(tiny_models, requests_in):
    from carnator_core import pipeline
    from carnator_core.gate import GateSettings, RiskModel
    model = tiny_models["wan21"]
    requests_in(model, "wan21", PROMPT)
    requests_in.settings.region_fill_calls = 2
    cache, _ = pipeline.open_cache(requests_in.cache_folder, 1 << 30)
    pr = pipeline.probe(requests_in.run_obj(model, "wan21", RELATED), cache, requests_in.settings)
    plan, _ = pipeline.gate(pr, pipeline.lookup(pr), RiskModel(), GateSettings(risk_budget=1.0))
    assert plan.accept, plan.reason
    plan.region_tiles = torch.zeros_like(plan.region_tiles)
    plan.region_tiles[:4] = True  # an edit: some tiles must be the request's own
    _, s = pipeline.reuse(pr, plan)
    n, p = s.steps_total, pr.probe_steps
    assert s.outcome == "hit" and s.steps_computed == p + 2 + (n - plan.reuse_step)
    assert s.model_calls == s.steps_computed


def test_a_reused_trajectory_is_kept_for_exact_repeats_but_never_reused(tiny_models, requests_in):
    """Chained reuse (C reusing B, which reused A) compounds B's own reuse error, and B's
    snapshots are A's trajectory, not what B's signature describes: only entries computed in
    full are reuse sources."""
    from carnator_core.cache.folder import TrajectoryCache
    model = tiny_models["wan21"]
    _, a = requests_in(model, "wan21", PROMPT)
    _, b = requests_in(model, "wan21", RELATED)
    assert a.outcome == "miss" and b.outcome == "hit" and b.entry_id == a.stored_id and b.stored_id
    cache = TrajectoryCache(requests_in.cache_folder, 1 << 30)
    stored_b = cache.load_tensors(b.stored_id)
    assert "final" in stored_b and not any(k.startswith("snapshot.") for k in stored_b)
    _, c = requests_in(model, "wan21", RELATED + " today")
    assert c.outcome == "hit" and c.entry_id == a.stored_id, c.text()
    _, again = requests_in(model, "wan21", RELATED)  # same_seed: the result B's asker saw
    assert again.outcome == "exact" and again.entry_id == b.stored_id
