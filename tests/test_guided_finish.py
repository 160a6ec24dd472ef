"""The guided finish (carnator_core/guided_finish.py): a same-scene reuse computes a few of
the steps after k* and follows the candidate's stored x̂0 at the others.

Counted, not timed: model calls go through the adapter's DIFFUSION_MODEL counter; the
prediction path goes through ComfyUI's PREDICT_NOISE wrapper on a real tiny Wan model.
"""
import pytest
import torch

from carnator_core.calibration import measured_finish
from carnator_core.gate import GateSettings, RiskModel
from carnator_core.guided_finish import GuidedFinish, finish_steps

PROMPT = "a red ball rolls left across a green field"
RELATED = "a red ball rolls left across a green field slowly"


# ---------------------------------------------------------------- plain torch
def test_finish_steps_spread_the_calls_and_keep_both_ends():
    assert finish_steps(10, 20, 3) == {10, 14, 19}  # round(14.5) is 14 (banker's rounding)
    assert finish_steps(4, 20, 2) == {4, 19}
    assert finish_steps(10, 20, 1) == {10}
    assert finish_steps(17, 20, 3) == {17, 18, 19}
    assert finish_steps(17, 20, 5) == {17, 18, 19}  # more calls than steps: every step
    assert finish_steps(10, 20, 0) == set(range(10, 20))


def test_predictions_follow_the_candidate_plus_the_last_measured_offset():
    sigmas = torch.linspace(1.0, 0.0, 11)
    base = torch.randn(1, 4, 2, 3, 3)
    # a candidate x̂0 that moves linearly in σ, stored only at some steps: the σ-interpolation
    # between them is then exact
    cand = {s: base * float(sigmas[s]) for s in (4, 6, 9)}
    guide = GuidedFinish(sigmas, cand, start=4, calls=2)
    assert guide.compute == {4, 9}
    assert guide.predict(5) is None  # no offset measured yet: compute
    offset = torch.full_like(base, 0.25)
    guide.observe(4, cand[4] + offset)
    for step in (5, 6, 7, 8):
        torch.testing.assert_close(guide.predict(step), base * float(sigmas[step]) + offset)
    assert guide.predicted == 4
    assert guide.predict(9) is None  # a step it computes


def test_stored_steps_that_cannot_cover_the_finish_are_refused():
    sigmas = torch.linspace(1.0, 0.0, 11)
    with pytest.raises(ValueError, match="cannot guide"):
        GuidedFinish(sigmas, {4: torch.zeros(1)}, start=4, calls=2)  # nothing stored after 4


def test_a_class_uses_the_finish_only_when_all_its_reuses_were_measured_with_it():
    same = {"region_fraction": 0.0, "outside_mean": 0.0, "outside_max": 0.0, "similarity_gap": 0.0}
    edit = {**same, "region_fraction": 0.2}
    guided = [{"k": 4, "finish_calls": 3}, {"k": 6, "finish_calls": 3}]
    full = [{"k": 4}, {"k": 6}]
    assert measured_finish([{"features": same, "depths": guided},
                            {"features": edit, "depths": full}]) == {"same_scene": 3}
    # one same-scene reuse measured with every step: the thresholds do not speak for the finish
    assert measured_finish([{"features": same, "depths": guided},
                            {"features": same, "depths": full}]) == {}


# ---------------------------------------------------------------- on a real ComfyUI model
def _own_trajectory(run):
    x0s = {}
    final = run.sample(0, run.steps, None, on_step=lambda step, x, x0: x0s.__setitem__(step, x0.clone()))
    return final, x0s


def test_guided_by_its_own_trajectory_a_request_reproduces_its_full_run(tiny_models, requests_in):
    """Guided by its own stored x̂0 at every step, the finish must land on the request's own
    full run while the model runs only at the computed steps: the predictions are put in
    the sampler at the right steps with the right values."""
    model = tiny_models["wan21"]
    run = requests_in.run_obj(model, "wan21", PROMPT)
    n, k = run.steps, 4
    xs = {}
    full = run.sample(0, n, None, on_step=lambda step, x, x0: xs.__setitem__(step, x.clone()))
    _, x0s = _own_trajectory(requests_in.run_obj(model, "wan21", PROMPT))
    guide = GuidedFinish(run.sigmas, x0s, start=k, calls=2)
    calls = run.model_calls
    out = run.sample(k, n, run.boundary_from_sampler_space(xs[k], k), guide=guide)
    assert run.model_calls - calls == 2 and guide.predicted == n - k - 2
    torch.testing.assert_close(out, full, rtol=1e-4, atol=1e-4)
    # and without the guide the same segment runs every step
    calls = run.model_calls
    run.sample(k, n, run.boundary_from_sampler_space(xs[k], k))
    assert run.model_calls - calls == n - k


def _hit_plan(requests_in, model, risk_model):
    from carnator_core import pipeline
    requests_in(model, "wan21", PROMPT)
    cache, _ = pipeline.open_cache(requests_in.cache_folder, 1 << 30)
    pr = pipeline.probe(requests_in.run_obj(model, "wan21", RELATED), cache, requests_in.settings)
    # a shallow k*: the finish has steps to skip
    plan, _ = pipeline.gate(pr, pipeline.lookup(pr), risk_model, GateSettings(risk_budget=1.0, max_depth=0.5))
    assert plan.accept, plan.reason
    return pipeline, pr, plan


def _calibrated(finish_calls):
    # the prior's ranking, with a guided finish certified for both classes (the tiny random
    # model's related prompt is not same-scene evidence; the class rule is tested below)
    return RiskModel(finish_calls=finish_calls)


def test_a_hit_with_a_certified_finish_computes_only_its_calls(tiny_models, requests_in):
    model = tiny_models["wan21"]
    pipeline, pr, plan = _hit_plan(requests_in, model, _calibrated({"same_scene": 3, "other": 3}))
    n, k = pr.run.steps, plan.reuse_step
    assert n - k > 3  # the finish has steps to skip
    _, s = pipeline.reuse(pr, plan)
    fill = min(requests_in.settings.region_fill_calls, k - pr.probe_steps) if plan.region_fraction else 0
    assert s.outcome == "hit" and s.steps_computed == pr.probe_steps + fill + 3
    assert s.model_calls == s.steps_computed  # the network really ran that often
    assert "guided finish: 3 of the" in s.text()


def test_a_class_without_a_certified_finish_finishes_every_step(tiny_models, requests_in):
    model = tiny_models["wan21"]
    pipeline, pr, plan = _hit_plan(requests_in, model, _calibrated({"same_scene": 3}))
    from carnator_core.gate import evidence_class
    assert evidence_class(plan.features) == "other"
    _, s = pipeline.reuse(pr, plan)
    fill = min(requests_in.settings.region_fill_calls, plan.reuse_step - pr.probe_steps) if plan.region_fraction else 0
    assert s.steps_computed == pr.probe_steps + fill + (pr.run.steps - plan.reuse_step)
    assert s.model_calls == s.steps_computed and "guided finish" not in s.text()


def test_turning_the_finish_off_finishes_every_step(tiny_models, requests_in):
    model = tiny_models["wan21"]
    requests_in.settings.same_scene_finish_calls = 0
    pipeline, pr, plan = _hit_plan(requests_in, model, _calibrated({"same_scene": 3, "other": 3}))
    _, s = pipeline.reuse(pr, plan)
    assert s.model_calls == s.steps_computed
    assert s.steps_computed > pr.probe_steps + 3 + (2 if plan.region_fraction else 0)


def test_entries_store_the_denoised_estimates_a_finish_follows(tiny_models, requests_in):
    from carnator_core.cache import TrajectoryCache
    model = tiny_models["wan21"]
    _, s = requests_in(model, "wan21", PROMPT)
    stored = TrajectoryCache(requests_in.cache_folder, 1 << 30).load_tensors(s.stored_id)
    snaps = sorted(int(k.split(".")[1]) for k in stored if k.startswith("snapshot.") and not k.endswith(".scale"))
    x0s = sorted(int(k.split(".")[1]) for k in stored if k.startswith("denoised.") and not k.endswith(".scale"))
    assert x0s == sorted(set(snaps) | {requests_in.steps - 1})
