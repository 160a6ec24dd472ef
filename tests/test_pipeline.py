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
    assert s2.steps_computed == 1 + (s2.steps_total - s2.reuse_step)  # probe + remaining steps
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
    from carnator_core.entry_precision import from_entry
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
