"""Computing region M's tokens alone (carnator_core/reuse/region_compute.py) on a real tiny Wan
model in ComfyUI: a region call must give M exactly what a full call from the same input
gives it (the outside's keys and values kept from that call), and a region finish must run
its full calls and its region calls where it says. Counted, not timed."""
import pytest
import torch

from carnator_core.reuse.guided_finish import GuidedFinish
from carnator_core.reuse.region_compute import RegionCompute, RegionFinish, token_index

PROMPT = "a red ball rolls left across a green field"


def _mask(shape):
    m = torch.zeros(1, 1, *shape[-3:])
    m[..., :, : shape[-2] // 2, : shape[-1] // 2] = 1  # the top-left quarter of every frame
    return m


def test_token_index_follows_the_patch_grid():
    m = torch.zeros(1, 1, 2, 4, 4)
    m[..., 0, 0, 0] = 1          # one cell → the token of its 2×2 patch in frame 0
    m[..., 1, 3, 3] = 1          # the last cell → the last token
    assert token_index(m, (1, 2, 2)).tolist() == [0, 7]
    with pytest.raises(ValueError):
        RegionCompute(torch.arange(8), 8)  # all of the tokens: nothing to save


def _call(run, x, sigma, cond):
    """One model call as the sampler makes it (the clone's wrappers and patches)."""
    m = run.experts[0].patched
    opts = dict(m.model_options["transformer_options"])
    opts.update(sigmas=sigma, cond_or_uncond=[0])
    opts["wrappers"] = m.wrappers  # as the sampler merges them in (the call counter)
    return m.model.apply_model(x, sigma, c_crossattn=cond, transformer_options=opts)


def test_a_region_call_gives_m_what_a_full_call_gives_it(tiny_models, requests_in):
    run = requests_in.run_obj(tiny_models["wan21"], "wan21", PROMPT)
    shape = run.latent_shape
    mask = _mask(shape)
    region = run.compute_region(mask)
    torch.manual_seed(0)
    x, sigma = torch.randn(shape), run.sigmas[3:4]
    cond = run.positive[0][0]
    calls = run.model_calls
    region.mode = "record"
    full = _call(run, x, sigma, cond)
    region.mode = "region"
    part = _call(run, x, sigma, cond)
    region.mode = None
    inside = mask.expand_as(full).bool()
    torch.testing.assert_close(part[inside], full[inside], rtol=1e-4, atol=1e-4)
    blocks = len(run.experts[0].patched.get_model_object("diffusion_model").blocks)
    assert region.self_attention_extended == blocks  # every block attended to the outside too
    assert run.model_calls - calls == 1 and run.recorder.region_calls == 1
    assert 0 < region.share < 1
    # without the outside's keys and values M's rows would differ: the extension matters
    region.kv = {key: (kv[0][:, :0], kv[1][:, :0]) for key, kv in region.kv.items()}
    region.mode = "region"
    alone = _call(run, x, sigma, cond)
    region.mode = None
    assert not torch.allclose(alone[inside], full[inside], atol=1e-3)


def test_a_region_finish_computes_m_between_its_full_calls(tiny_models, requests_in):
    model = tiny_models["wan21"]
    run = requests_in.run_obj(model, "wan21", PROMPT)
    n, k = run.steps, 4
    xs, x0s = {}, {}
    run.sample(0, n, None, on_step=lambda s, x, x0: (xs.__setitem__(s, x.clone()), x0s.__setitem__(s, x0.clone())))
    mask = _mask(run.latent_shape)
    other = requests_in.run_obj(model, "wan21", PROMPT + " slowly")
    region = other.compute_region(mask)
    guide = RegionFinish(GuidedFinish(other.sigmas, x0s, k, 2), mask)
    calls = other.model_calls
    out = other.sample(k, n, other.boundary_from_sampler_space(xs[k], k), guide=guide)
    assert other.model_calls - calls == 2                     # the finish's two full calls
    assert other.recorder.region_calls == region.region_calls == n - k - 2 == guide.region_steps
    assert torch.isfinite(out).all()
    other.compute_region(None)
    plain = other.sample(k, n, other.boundary_from_sampler_space(xs[k], k),
                         guide=GuidedFinish(other.sigmas, x0s, k, 2))
    assert not torch.allclose(out, plain)  # M followed the request's own prediction


# ---------------------------------------------------------------- the gate and a hit
def test_the_gate_counts_a_region_finish_at_m_s_share():
    from carnator_core.gate import finish_cost
    assert finish_cost(8, 20, 0) == 12
    assert finish_cost(8, 20, 5) == 5
    assert finish_cost(8, 20, 5, region_share=0.25) == pytest.approx(5 + 7 * 0.25)
    assert finish_cost(18, 20, 5, region_share=0.25) == 2  # fewer steps left than calls


def test_the_calibration_names_the_classes_measured_with_a_region_finish():
    from carnator_core.calibration.fit import measured_region_finish
    edit = {"region_fraction": 0.2, "similarity_gap": 0.1}
    same = {"region_fraction": 0.0, "similarity_gap": 0.0}
    region = {"features": edit, "depths": [{"k": 8}, {"k": 8, "finish_calls": 5, "region_steps": 7}]}
    guided = {"features": same, "depths": [{"k": 8, "finish_calls": 4}]}
    assert measured_region_finish([region, guided]) == {"other": True}
    plain = {"features": edit, "depths": [{"k": 8, "finish_calls": 5}]}
    with pytest.raises(ValueError):
        measured_region_finish([region, plain])


def test_a_hit_with_a_certified_region_finish_computes_m_alone_between_its_calls(tiny_models, requests_in):
    from carnator_core.gate import RiskModel, evidence_class
    from test_guided_finish import RELATED, _hit_plan
    model = RiskModel(calibrated=True, thresholds={"same_scene": {"0.5": 1.0}, "other": {"0.5": 50.0},
                                  "other:guided": {"0.5": 50.0}},
                      confidence=0.9, finish_calls={"other": 3}, finish_region={"other": True})
    pipeline, pr, plan = _hit_plan(requests_in, tiny_models["wan21"], model)
    assert evidence_class(plan.features) == "other" and plan.finish_calls == 3 and plan.finish_region
    assert plan.region_fraction > 0, "the related prompt must leave a region M to compute"
    n, k = pr.run.steps, plan.reuse_step
    _, s = pipeline.reuse(pr, plan)
    fill = min(requests_in.settings.region_fill_calls, k - pr.probe_steps)
    assert s.outcome == "hit" and s.steps_computed == pr.probe_steps + fill + 3
    assert s.region_calls == n - k - 3 and 0 < s.region_token_share < 1
    assert s.model_calls == s.steps_computed  # the region calls are counted apart
    assert s.step_equivalents == pytest.approx(s.steps_computed + s.region_calls * s.region_token_share)
    assert "on region M's tokens alone" in s.text()
    assert pr.run.recorder.region is None  # the next use of the run computes every token


def test_a_region_finish_starts_only_where_its_calls_are_every_other_step():
    from carnator_core.calibration.fit import gate_decision
    from carnator_core.gate import REGION_FINISH_STEPS_PER_CALL, RiskModel, finish_allows
    assert REGION_FINISH_STEPS_PER_CALL == 2
    assert finish_allows(8, 20, 6, region=True) and not finish_allows(6, 20, 6, region=True)
    assert finish_allows(4, 20, 6, region=False)  # the plain guided finish has no such floor
    # the gate's rule in the calibration: a region finish certified everywhere is taken at
    # the deepest allowed depth, and never below the floor even where it is the only option
    edit = {"outside_mean": 0.1, "outside_max": 0.5, "region_fraction": 0.2, "similarity_gap": 0.1}
    model = RiskModel(calibrated=True, thresholds={"other": {"0.5": -50.0}, "other:guided": {"0.5": 50.0}},
                      confidence=0.9, finish_calls={"other": 6}, finish_region={"other": True})
    inst = {"features": edit, "depths": [
        {"k": k, "depth_fraction": k / 20, "label": 0, "finish_calls": 6, "region_steps": 1, "token_share": 0.2}
        for k in (4, 6)]}
    assert gate_decision(model, inst, 0.5) is None
    inst["depths"].append({"k": 8, "depth_fraction": 0.4, "label": 0, "finish_calls": 6,
                           "region_steps": 6, "token_share": 0.2})
    assert gate_decision(model, inst, 0.5)["k"] == 8


def test_a_region_finish_keeps_its_share_of_the_trajectory_and_its_call_density_at_another_n():
    """Calibrated at 20 steps, 4 calls may span the last 8 of them — so the last 12 of 30 and
    20 of 50 (the share of the trajectory), with calls added to keep 2 steps per call; a
    model that did not record its N keeps the absolute rule. The gate plans it so."""
    from carnator_core.gate import RiskModel, _cheapest_acceptable, finish_allows, finish_calls_at
    assert finish_allows(12, 20, 4, True, 20) and not finish_allows(11, 20, 4, True, 20)
    assert finish_allows(18, 30, 4, True, 20) and not finish_allows(17, 30, 4, True, 20)
    assert finish_allows(30, 50, 4, True, 20) and not finish_allows(29, 50, 4, True, 20)
    assert not finish_allows(18, 30, 4, True)  # N not recorded: 8 steps at any N
    assert finish_calls_at(12, 20, 4, True) == 4 and finish_calls_at(16, 20, 4, True) == 4
    assert finish_calls_at(18, 30, 4, True) == 6 and finish_calls_at(30, 50, 4, True) == 10
    assert finish_calls_at(30, 50, 4, False) == 4  # the plain guided finish keeps its calls
    edit = {"outside_mean": 0.1, "outside_max": 0.5, "region_fraction": 0.2, "similarity_gap": 0.1}
    certified = dict(calibrated=True, thresholds={"other": {"0.5": 50.0}, "other:guided": {"0.5": 50.0}}, confidence=0.9,
                     finish_calls={"other": 4}, finish_region={"other": True})
    for measured, calls in ((20, 6), (0, 0)):
        model = RiskModel(measured_steps=measured, **certified)
        plan = _cheapest_acceptable(edit, [18, 15, 12], 30, model, 0.5, True, {"region_tiles": None})
        assert plan.accept and plan.reuse_step == 18 and plan.finish_calls == calls
        assert plan.finish_region is bool(calls)
        assert ("guided finish of 6 calls with region M" in plan.reason) is bool(calls)
    # the calibration's replay of the gate follows it: measured at 30 steps, a 4-call region
    # finish at k = 18 is not what the gate runs there (6 calls), a 6-call one is
    from carnator_core.calibration.fit import gate_decision
    at_30 = lambda k, calls: {"k": k, "depth_fraction": k / 30, "label": 0, "finish_calls": calls,
                              "region_steps": 30 - k, "token_share": 0.2}
    model = RiskModel(measured_steps=20, **certified)
    assert model.finish_options(edit) == [0, 4]
    assert gate_decision(model, {"features": edit, "depths": [at_30(18, 4)]}, 0.5) is None
    pick = gate_decision(model, {"features": edit, "depths": [at_30(18, 4), at_30(22, 4)]}, 0.5)
    assert pick["k"] == 22  # 8 steps left: the 4 calls are what the gate makes there too


def test_the_calibration_records_the_steps_its_reuses_were_measured_with():
    from carnator_core.calibration.fit import measured_steps
    at = lambda n: {"features": {}, "depths": [{"k": k, "depth_fraction": k / n} for k in (4, 12)]}
    assert measured_steps([at(20), at(20)]) == 20 and measured_steps([at(30)]) == 30
    assert measured_steps([{"features": {}, "depths": []}]) == 0
    with pytest.raises(ValueError, match="calibrate each N apart"):
        measured_steps([at(20), at(30)])


def test_a_region_is_refused_where_the_conditioning_adds_tokens(tiny_models, requests_in):
    """A reference image (ComfyUI's reference_latents; newer releases' context_latents) adds
    tokens to Wan's input that a region of the latent cannot be placed among: a clear error,
    which the finish turns into every step computed."""
    run = requests_in.run_obj(tiny_models["wan21"], "wan21", PROMPT)
    cond, extras = run.positive[0]
    run.positive = [[cond, {**extras, "reference_latents": [torch.zeros(run.latent_shape)]}]]
    with pytest.raises(ValueError, match="reference_latents"):
        run.compute_region(_mask(run.latent_shape))
    assert run.recorder.region is None


# ---------------------------------------------------------------- the fill of region M on its tokens
def test_the_fill_on_m_starts_its_segments_at_stored_snapshots():
    from carnator_core.reuse.region_compute import fill_segment_starts
    snaps = [4, 6, 8, 10, 12, 14, 16]
    assert fill_segment_starts(2, 12, snaps) == [4, 8]   # the first after the probe, the middle
    assert fill_segment_starts(1, 16, snaps) == [4, 10]
    assert fill_segment_starts(2, 6, snaps) == [4]       # nothing between the first and k
    assert fill_segment_starts(2, 4, snaps) == []        # nothing between the probe and k: coarse


def _segment_counts(starts, k):
    from carnator_core.reuse.region_compute import FILL_SEGMENT_STEPS
    steps = [min(FILL_SEGMENT_STEPS, b - a) for a, b in zip(starts, starts[1:] + [k])]
    return len(starts), sum(s - 1 for s in steps)


def test_a_fill_on_m_computes_m_s_own_trajectory_among_the_stored_outside(tiny_models, requests_in):
    """Region M filled by its own trajectory in segments (pipeline.fill_region with the
    candidate's snapshots): a full call at each segment's start, M's tokens alone after it,
    the outside the candidate's stored latent at each start and at k."""
    from carnator_core.pipeline import TrajectoryRecord, fill_region
    from carnator_core.reuse.region_compute import fill_segment_starts
    from carnator_core.signature import tiles_to_latent_mask
    model = tiny_models["wan21"]
    run = requests_in.run_obj(model, "wan21", PROMPT, steps=20)
    other = requests_in.run_obj(model, "wan21", PROMPT + " slowly", steps=20)
    p, k, snaps = 2, 12, [4, 6, 8, 10, 12]
    stored = TrajectoryRecord(other, snaps)
    other.sample(0, other.steps, None, stored.on_step)
    probe = TrajectoryRecord(run, [])
    x_probe = run.sample(0, p, None, probe.on_step)
    region = torch.zeros(probe.grid[0] * probe.grid[1] * probe.grid[2], dtype=torch.bool)
    region[: region.numel() // 3] = True
    starts = fill_segment_starts(p, k, snaps)
    full_calls, region_calls = _segment_counts(starts, k)
    assert starts == [4, 8] and (full_calls, region_calls) == (2, 2)

    calls, regions = run.model_calls, run.recorder.region_calls
    got = fill_region(run, stored.snapshots[k], region, probe.grid, probe.last_x0, x_probe, p, k, 2,
                      stored.snapshots)
    assert got.on_m and got.note == ""
    assert (got.calls, got.region_calls) == (full_calls, region_calls)
    assert run.model_calls - calls == full_calls and run.recorder.region_calls - regions == region_calls
    assert 0 < got.token_share < 1 and got.steps == pytest.approx(2 + 2 * got.token_share)
    assert run.recorder.region is None  # the next call computes every token again
    mask = tiles_to_latent_mask(region, probe.grid, run.latent_shape).bool().expand_as(got.latent)
    outside = run.boundary_from_sampler_space(stored.snapshots[k], k)
    torch.testing.assert_close(got.latent[~mask], outside[~mask])
    coarse = fill_region(run, stored.snapshots[k], region, probe.grid, probe.last_x0, x_probe, p, k, 2)
    assert not torch.allclose(got.latent[mask], coarse.latent[mask], atol=1e-3)
    # M was computed among the stored outside of the middle segment's start: change it there
    # (outside M only) and M's fill changes
    moved = dict(stored.snapshots)
    moved[8] = stored.snapshots[8] + 0.5 * (~tiles_to_latent_mask(region, probe.grid, run.latent_shape).bool())
    again = fill_region(run, stored.snapshots[k], region, probe.grid, probe.last_x0, x_probe, p, k, 2, moved)
    torch.testing.assert_close(again.latent[~mask], got.latent[~mask])
    assert not torch.allclose(again.latent[mask], got.latent[mask], atol=1e-4)
    # no snapshot between the probe and k: the coarse fill
    short = fill_region(run, stored.snapshots[4], region, probe.grid, probe.last_x0, x_probe, p, 4, 2,
                        stored.snapshots)
    assert not short.on_m and short.calls == 2


def test_a_hit_fills_m_as_its_calibration_measured(tiny_models, requests_in):
    """A calibration measured with the fill on M (RiskModel.region_fill_on_m): the hit fills
    M that way — its full calls in the steps computed, its calls on M's tokens apart."""
    from test_guided_finish import _hit_plan
    from carnator_core.gate import RiskModel
    model = RiskModel(calibrated=True, thresholds={"same_scene": {"0.5": 1.0}, "other": {"0.5": 50.0}},
                      confidence=0.9, region_fill_on_m=True)
    pipeline, pr, plan = _hit_plan(requests_in, tiny_models["wan21"], model)
    assert plan.region_fraction > 0, "the related prompt must leave a region M to compute"
    s = _reuse_filling_on_m(pipeline, pr, plan, requests_in)
    assert 0 < s.region_token_share < 1
    assert s.model_calls == s.steps_computed
    assert "region M filled by its own trajectory" in s.text()


def _reuse_filling_on_m(pipeline, pr, plan, requests_in):
    """Run the hit; check it made the fill on M's full and region calls; its summary."""
    from carnator_core.reuse.region_compute import fill_segment_starts
    n, k = pr.run.steps, plan.reuse_step
    starts = fill_segment_starts(pr.probe_steps, k, requests_in.settings.snapshot_steps(n))
    assert starts, f"no snapshot between the probe and k*={k}: nothing on M to test"
    full_calls, region_calls = _segment_counts(starts, k)
    _, s = pipeline.reuse(pr, plan)
    assert s.outcome == "hit" and s.steps_computed == pr.probe_steps + full_calls + (n - k)
    assert s.region_calls == region_calls
    return s


def test_the_calibration_records_how_m_was_filled(tmp_path):
    from carnator_core.calibration.fit import measured_fill_on_m
    from carnator_core.gate import RiskModel
    edit = {"region_fraction": 0.2, "similarity_gap": 0.1}
    same = {"region_fraction": 0.0, "similarity_gap": 0.0}
    on_m = {"features": edit, "depths": [{"k": 4, "fill_steps": 2, "fill": "on_m"},
                                         {"k": 8, "fill_steps": 2.5, "fill": "on_m"}]}
    coarse = {"features": edit, "depths": [{"k": 8, "fill_steps": 2}]}
    empty = {"features": same, "depths": [{"k": 8, "fill_steps": 0}]}
    assert measured_fill_on_m([on_m, empty]) is True
    assert measured_fill_on_m([coarse, empty]) is False
    with pytest.raises(ValueError):
        measured_fill_on_m([on_m, coarse])
    path = tmp_path / "model.json"
    RiskModel(region_fill_on_m=True).save(path)
    assert RiskModel.load(path).region_fill_on_m


def test_the_gate_counts_the_fill_on_m_at_m_s_share():
    from carnator_core.gate import Plan, hit_saving
    tiles = torch.zeros(8, dtype=torch.bool)
    tiles[:2] = True  # M: a quarter of the tiles
    plan = Plan(True, reuse_step=12, region_tiles=tiles)
    assert hit_saving(plan, 20, 2, fill_calls=2) == pytest.approx(1 - (2 + 2 + 8) / 20)
    assert hit_saving(plan, 20, 2, fill_calls=2, fill_on_m=True) == pytest.approx(1 - (2 + 2.5 + 8) / 20)


def test_widen_tiles_grows_the_region_by_its_margin_in_space_and_time():
    from carnator_core.gate import reuse_region
    from carnator_core.signature import widen_tiles
    grid = (3, 5, 5)
    one = torch.zeros(grid, dtype=torch.bool)
    one[1, 2, 2] = True
    wide = widen_tiles(one.reshape(-1), grid, 1).reshape(grid)
    assert int(wide.sum()) == 27 and bool(wide[0:3, 1:4, 1:4].all())  # a 3×3×3 block
    corner = torch.zeros(grid, dtype=torch.bool)
    corner[0, 0, 0] = True
    assert int(widen_tiles(corner.reshape(-1), grid, 1).sum()) == 8  # clipped at the grid's edges
    assert torch.equal(widen_tiles(one.reshape(-1), grid, 0), one.reshape(-1))
    edit = {"region_fraction": 1 / 75, "similarity_gap": 0.1}
    same = {"region_fraction": 1 / 75, "similarity_gap": 0.0}
    assert int(reuse_region(edit, one.reshape(-1), grid, 1).sum()) == 27
    assert torch.equal(reuse_region(same, one.reshape(-1), grid, 1), one.reshape(-1))  # paraphrases keep M
    assert torch.equal(reuse_region(edit, one.reshape(-1), grid, 0), one.reshape(-1))


def test_the_calibration_records_the_margin_m_was_widened_by(tmp_path):
    from carnator_core.calibration.fit import measured_region_margin
    from carnator_core.gate import RiskModel
    edit = {"region_fraction": 0.2, "similarity_gap": 0.1}
    same = {"region_fraction": 0.01, "similarity_gap": 0.0}
    wide = {"features": edit, "depths": [{"k": 8, "fill": "on_m", "margin": 1}]}
    narrow = {"features": edit, "depths": [{"k": 8, "fill": "on_m"}]}
    paraphrase = {"features": same, "depths": [{"k": 8}]}  # never widened: does not tell
    assert measured_region_margin([wide, paraphrase]) == 1
    assert measured_region_margin([narrow, paraphrase]) == 0
    with pytest.raises(ValueError, match="widened"):
        measured_region_margin([wide, narrow])
    path = tmp_path / "model.json"
    RiskModel(region_margin=1).save(path)
    assert RiskModel.load(path).region_margin == 1


def test_a_hit_widens_m_as_its_calibration_measured(tiny_models, requests_in):
    """A calibration measured with region M widened (RiskModel.region_margin): the gate's plan
    carries the widened M — the probe's M and a ring around it — while the evidence still
    describes the probe's M, and the hit fills the widened M on its tokens."""
    from carnator_core.gate import RiskModel, evidence_class
    from carnator_core.signature import tiles_to_latent_mask, widen_tiles
    from test_guided_finish import _hit_plan
    model = RiskModel(calibrated=True, thresholds={"same_scene": {"0.5": 1.0}, "other": {"0.5": 50.0}},
                      confidence=0.9, region_fill_on_m=True, region_margin=1)
    # (the tiny random model's M is sparse and the widened one half the frame: the test is
    # about which tokens are computed, so any saving will do)
    pipeline, pr, plan = _hit_plan(requests_in, tiny_models["wan21"], model, min_saving=-1.0)
    assert evidence_class(plan.features) == "other"
    grid = pr.record.grid
    detected = plan.features["region_fraction"]  # the evidence: the probe's own M
    assert 0 < detected < plan.region_fraction, (detected, plan.region_fraction)
    # the plan's M is a union of 3×3×3 blocks: eroding it and widening again gives it back
    core = ~widen_tiles(~plan.region_tiles, grid, 1)
    assert torch.equal(widen_tiles(core, grid, 1), plan.region_tiles)
    mask = tiles_to_latent_mask(plan.region_tiles, grid, pr.run.latent_shape)
    share = pr.run.compute_region(mask).share
    pr.run.compute_region(None)
    s = _reuse_filling_on_m(pipeline, pr, plan, requests_in)
    assert s.region_token_share == pytest.approx(share)  # the fill ran on the widened M


def test_the_gate_plans_no_region_finish_where_m_covers_the_whole_frame():
    """A widened M can cover every tile; a region finish there would compute every token,
    so the gate plans it only where M leaves an outside (and the calibration measures it
    only there, tests/test_calibration_audit.py)."""
    from carnator_core.gate import RiskModel, _cheapest_acceptable
    edit = {"outside_mean": 0.1, "outside_max": 0.5, "region_fraction": 0.2, "similarity_gap": 0.1}
    model = RiskModel(calibrated=True, thresholds={"other": {"0.5": -50.0}, "other:guided": {"0.5": 50.0}},
                      confidence=0.9, finish_calls={"other": 4}, finish_region={"other": True})
    part = torch.zeros(16, dtype=torch.bool)
    part[:4] = True
    plans = {name: _cheapest_acceptable(edit, [14, 12, 10], 20, model, 0.5, True,
                                        dict(entry_id="e", region_tiles=tiles, similarity=0.9))
             for name, tiles in (("part", part), ("whole", torch.ones(16, dtype=torch.bool)))}
    assert plans["part"].accept and plans["part"].finish_region and plans["part"].reuse_step == 14
    # certified for the region finish only: on the whole frame there is nothing to reuse at all
    assert not plans["whole"].accept
