"""The guided finish (carnator_core/reuse/guided_finish.py): a reuse computes a few of the steps
after k* and follows the candidate's stored x̂0 at the others — same-scene reuses with one
number of calls, reuses with other evidence with their own.

Counted, not timed: model calls go through the adapter's DIFFUSION_MODEL counter; the
prediction path goes through ComfyUI's PREDICT_NOISE wrapper on a real tiny Wan model.
"""
import pytest
import torch

from carnator_core.calibration.fit import measured_finish
from carnator_core.gate import GateSettings, RiskModel
from carnator_core.reuse.guided_finish import GuidedFinish, finish_steps

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


SAME = {"region_fraction": 0.0, "outside_mean": 0.0, "outside_max": 0.0, "similarity_gap": 0.0}


def test_the_calibration_names_the_finish_each_class_was_also_measured_with():
    edit = {**SAME, "region_fraction": 0.2}
    both = [{"k": 4}, {"k": 4, "finish_calls": 3}]
    assert measured_finish([{"features": SAME, "depths": both},
                            {"features": edit, "depths": [{"k": 4}]}]) == {"same_scene": 3}
    with pytest.raises(ValueError, match="mix guided finishes"):
        measured_finish([{"features": SAME, "depths": both},
                         {"features": SAME, "depths": [{"k": 4, "finish_calls": 2}]}])


def _certified(same_full=None, same_guided=None):
    """A risk model whose same-scene class is certified as a depth cap per finish."""
    thresholds = {"other": {"0.05": -50.0}}  # no edit is reused
    if same_full is not None:
        thresholds["same_scene"] = {"0.05": same_full}
    if same_guided is not None:
        thresholds["same_scene:guided"] = {"0.05": same_guided}
    return RiskModel(calibrated=True, thresholds=thresholds, confidence=0.9, finish_calls={"same_scene": 3})


def _decide_same_scene(model, guided=True, depths=(16, 14, 12, 10, 8, 6, 4)):
    from carnator_core.gate import _cheapest_acceptable
    return _cheapest_acceptable(SAME, list(depths), 20, model, 0.05, guided, {})


def test_the_gate_runs_the_finish_that_computes_least_where_it_is_certified():
    # every step certified to 0.6·N (computes 8 after k* = 12), guided to 0.4·N (3 calls)
    plan = _decide_same_scene(_certified(same_full=0.6, same_guided=0.4))
    assert plan.accept and plan.finish_calls == 3 and plan.reuse_step == 8
    assert "guided finish of 3 calls" in plan.reason
    # at k* = 18 of 20 only 2 steps remain: every step computes less than 3 guided calls
    plan = _decide_same_scene(_certified(same_full=0.9, same_guided=0.9))
    assert plan.finish_calls == 3 and plan.reuse_step == 16  # 16 is the deepest stored: 4 > 3
    deep = _decide_same_scene(_certified(same_full=0.9, same_guided=0.9), depths=(18, 16))
    assert deep.finish_calls == 0 and deep.reuse_step == 18


def test_the_gate_falls_back_to_every_step_where_the_finish_is_not_certified_or_off():
    plan = _decide_same_scene(_certified(same_full=0.6))  # nothing certified for the guided finish
    assert plan.accept and plan.finish_calls == 0 and plan.reuse_step == 12
    # switched off by the user, or the entry stored no x̂0 to follow
    plan = _decide_same_scene(_certified(same_full=0.6, same_guided=0.8), guided=False)
    assert plan.finish_calls == 0 and plan.reuse_step == 12
    assert not _decide_same_scene(_certified()).accept  # neither finish is certified


def test_certification_gives_each_finish_half_the_error_allowance():
    from carnator_core.calibration.fit import certify_model
    inst = [{"group": i, "features": SAME,
             "depths": [{"k": 8, "depth_fraction": 0.4, "label": 0},
                        {"k": 8, "depth_fraction": 0.4, "label": 0, "finish_calls": 3}]}
            for i in range(400)]
    model = RiskModel(finish_calls={"same_scene": 3})
    report = certify_model(model, inst, delta=0.1)
    assert report["classes"]["same_scene"]["delta"] == report["classes"]["same_scene:guided"]["delta"] == 0.05
    assert report["classes"]["other"]["delta"] == 0.1
    assert model.thresholds["same_scene:guided"]["0.05"] == pytest.approx(0.4)


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


def _hit_plan(requests_in, model, risk_model, stored_model=None, **gate):
    from carnator_core import pipeline
    from carnator_core.calibration.fit import save
    from carnator_core.comfy_adapter import model_fingerprint
    # the first request stores what this model's calibration asks for (x̂0 when it has a
    # guided finish)
    save(stored_model or risk_model, requests_in.cache_folder, model_fingerprint(model))
    requests_in(model, "wan21", PROMPT)
    cache, _ = pipeline.open_cache(requests_in.cache_folder, 1 << 30)
    pr = pipeline.probe(requests_in.run_obj(model, "wan21", RELATED), cache, requests_in.settings)
    # a shallow k*: the finish has steps to skip
    plan, _ = pipeline.gate(pr, pipeline.lookup(pr), risk_model,
                            GateSettings(risk_budget=0.5, max_depth=0.5, **gate))
    assert plan.accept, plan.reason
    return pipeline, pr, plan


def _calibrated(finish_calls):
    # every reuse certified (the widest thresholds a calibration file may hold: every depth
    # share, the logit's clamp) for both finishes of the named classes: the tiny random
    # model's related prompt is "other" evidence (the class rule is tested above)
    thresholds = {k: {"0.5": 1.0 if k == "same_scene" else 50.0} for k in ("same_scene", "other")}
    thresholds.update({f"{k}:guided": {"0.5": 1.0 if k == "same_scene" else 50.0} for k in finish_calls})
    return RiskModel(calibrated=True, thresholds=thresholds, confidence=0.9, finish_calls=finish_calls)


def test_a_hit_with_a_certified_finish_computes_only_its_calls(tiny_models, requests_in):
    model = tiny_models["wan21"]
    pipeline, pr, plan = _hit_plan(requests_in, model, _calibrated({"other": 3}))
    n, k = pr.run.steps, plan.reuse_step
    assert plan.finish_calls == 3 and n - k > 3  # the finish has steps to skip
    _, s = pipeline.reuse(pr, plan)
    fill = min(requests_in.settings.region_fill_calls, k - pr.probe_steps) if plan.region_fraction else 0
    assert s.outcome == "hit" and s.steps_computed == pr.probe_steps + fill + 3
    assert s.model_calls == s.steps_computed  # the network really ran that often
    assert "guided finish: 3 of the" in s.text()


def test_a_class_without_a_certified_finish_finishes_every_step(tiny_models, requests_in):
    model = tiny_models["wan21"]
    pipeline, pr, plan = _hit_plan(requests_in, model, _calibrated({"same_scene": 3}))
    from carnator_core.gate import evidence_class
    assert evidence_class(plan.features) == "other" and plan.finish_calls == 0
    _, s = pipeline.reuse(pr, plan)
    fill = min(requests_in.settings.region_fill_calls, plan.reuse_step - pr.probe_steps) if plan.region_fraction else 0
    assert s.steps_computed == pr.probe_steps + fill + (pr.run.steps - plan.reuse_step)
    assert s.model_calls == s.steps_computed and "guided finish" not in s.text()


def test_turning_the_finish_off_finishes_every_step(tiny_models, requests_in):
    model = tiny_models["wan21"]
    pipeline, pr, plan = _hit_plan(requests_in, model, _calibrated({"other": 3}), guided_finish=False)
    assert plan.finish_calls == 0
    _, s = pipeline.reuse(pr, plan)
    assert s.model_calls == s.steps_computed
    assert s.steps_computed > pr.probe_steps + 3 + (2 if plan.region_fraction else 0)


def test_an_entry_without_stored_estimates_is_finished_every_step(tiny_models, requests_in):
    """Stored while the model had no guided finish calibrated: the gate does not plan one."""
    model = tiny_models["wan21"]
    pipeline, pr, plan = _hit_plan(requests_in, model, _calibrated({"other": 3}),
                                   stored_model=_calibrated({}))
    assert plan.finish_calls == 0, plan.reason
    _, s = pipeline.reuse(pr, plan)
    assert s.model_calls == s.steps_computed and "guided finish" not in s.text()


def _stored_steps(stored, prefix):
    return sorted(int(k.split(".")[1]) for k in stored if k.startswith(prefix) and not k.endswith(".scale"))


def test_entries_store_the_estimates_only_for_a_model_calibrated_with_the_finish(tiny_models, requests_in):
    from carnator_core.cache.folder import TrajectoryCache
    from carnator_core.calibration.fit import save
    from carnator_core.comfy_adapter import model_fingerprint
    model = tiny_models["wan21"]
    cache = TrajectoryCache(requests_in.cache_folder, 1 << 30)
    _, s = requests_in(model, "wan21", PROMPT)  # uncalibrated: never guided, nothing stored for it
    assert not _stored_steps(cache.load_tensors(s.stored_id), "denoised.")
    save(_calibrated({"same_scene": 3}), requests_in.cache_folder, model_fingerprint(model))
    _, s = requests_in(model, "wan21", RELATED)
    stored = cache.load_tensors(s.stored_id)
    x0s = _stored_steps(stored, "denoised.")
    assert x0s == sorted(set(_stored_steps(stored, "snapshot.")) | {requests_in.steps - 1})
    assert stored["denoised_steps"].tolist() == x0s


def test_the_calibration_measures_each_class_with_its_own_guided_finish(tiny_models, requests_in):
    """Other evidence (an edit) is measured finished every step *and* by the other class's
    guided finish at every depth the gate may choose, so the gate can certify both; with
    that finish set to 0 only every step is measured. Counted on a real tiny Wan model."""
    from dataclasses import replace

    from carnator_core.gate import evidence_class
    from carnator_core.calibration.generic import compute_full, measure_direction, reuse_depths
    model = tiny_models["wan21"]
    settings = requests_in.settings
    p, steps = settings.probe_steps(requests_in.steps), requests_in.steps
    snaps = settings.snapshot_steps(steps)
    full = {t: compute_full(requests_in.run_obj(model, "wan21", t), snaps, p) for t in (PROMPT, RELATED)}
    runs = []

    def new_run():
        runs.append(requests_in.run_obj(model, "wan21", RELATED))
        return runs[-1]

    def measured(other_calls):
        runs.clear()
        inst = measure_direction(full[RELATED], full[PROMPT], new_run,
                                 replace(settings, other_finish_calls=other_calls), 0.35,
                                 lambda final: {"psnr": 40.0, "label": 0})
        return inst, [(d["k"], d.get("finish_calls", 0), d.get("predicted_steps")) for d in inst["depths"]]

    inst, depths = measured(3)
    assert evidence_class(inst["features"]) == "other"
    ks = reuse_depths(settings, steps)
    assert [(k, f) for k, f, _ in depths] == [(k, 0) for k in ks] + [(k, 3) for k in ks]
    # the guided reuses computed 3 of the steps after k (where more than 3 were left)
    assert all(pred == max(0, steps - k - 3) for k, f, pred in depths if f == 3)
    assert measured_finish([inst]) == {"other": 3}
    inst, depths = measured(0)
    assert [f for _, f, _ in depths] == [0] * len(ks) and measured_finish([inst]) == {}
