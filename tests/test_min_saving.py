"""The gate's min_saving: a hit that saves little runs in full and becomes a reuse source.

Only requests computed in full are reuse sources (cache.lookup), so every hit that saves a
little takes a source away from the later requests for the same scene. Measured on the tiny
world's serve workload, 122 of 234 hits resumed another scene while a rewording of their own
scene had been served before — as a hit, so not a source (docs/studies.md).
"""
import pytest
import torch

from carnator_core.gate import GateSettings, RiskModel, decide, hit_saving
from carnator_core.signature import EarlySignature

PROMPT = "a red ball rolls left across a green field"
RELATED = "a red ball rolls left across a green field slowly"
OTHER = "a red ball rolls left across a green field quickly"


def _signature(tiles):
    return EarlySignature(1, (1, 1, 4), torch.tensor(tiles, dtype=torch.float32).reshape(1, 4), None)


def _certified():
    """Every depth certified for both classes; same-scene hits may run a 3-call guided finish."""
    thresholds = {k: {"0.05": 50.0 if k == "other" else 1.0} for k in ("same_scene", "other", "same_scene:guided")}
    return RiskModel(calibrated=True, thresholds=thresholds, confidence=0.9, finish_calls={"same_scene": 3},
                     region_threshold=0.35)


def test_the_saving_counts_probe_fill_and_finish():
    new, edit = _signature([1.0, 2.0, 3.0, 4.0]), _signature([1.0, 2.0, 3.0, -4.0])
    plan, _ = decide(new, [("edit", edit, 0.9, [4, 8, 12])], 20, 2, _certified(),
                     GateSettings(), fill_calls=2)
    assert plan.accept and plan.reuse_step == 12 and plan.region_fraction == 0.25
    # probe 2 + fill 2 + every step after k* = 12: 12 of 20 computed
    assert hit_saving(plan, 20, 2, fill_calls=2) == pytest.approx(1 - 12 / 20)
    # an empty region M needs no fill
    same, _ = decide(new, [("same", new, 1.0, [4, 8, 12])], 20, 2, _certified(), GateSettings(),
                     fill_calls=2)
    assert same.finish_calls == 3 and hit_saving(same, 20, 2, fill_calls=2) == pytest.approx(1 - 5 / 20)


def test_a_reuse_saving_less_than_min_saving_is_refused_and_a_cheaper_one_kept():
    new, edit = _signature([1.0, 2.0, 3.0, 4.0]), _signature([1.0, 2.0, 3.0, -4.0])
    model = _certified()
    plan, verdicts = decide(new, [("edit", edit, 0.9, [4, 8, 12])], 20, 2, model,
                            GateSettings(min_saving=0.5), fill_calls=2)
    assert not plan.accept and plan.entry_id == "edit" and "min_saving 50%" in plan.reason
    assert "becomes a reuse source" in plan.reason and verdicts[0].accept  # the budget allowed it
    # a same-scene candidate beside it saves 75%: it is the plan
    plan, _ = decide(new, [("edit", edit, 0.9, [4, 8, 12]), ("same", new, 1.0, [4, 8, 12])], 20, 2,
                     model, GateSettings(min_saving=0.5), fill_calls=2)
    assert plan.accept and plan.entry_id == "same"


def test_candidates_are_ranked_by_all_the_work_a_hit_computes_fill_of_m_included():
    """An edit resumed deep finishes in as few calls as a same-scene reuse but fills its region
    M first: the same-scene reuse computes less and is the plan, whatever order the lookup
    returned them in and however their predicted risks compare."""
    flat = {k: 0.0 for k in ("outside_mean", "outside_max", "region_fraction", "depth_fraction", "similarity_gap")}
    thresholds = {k: {"0.05": 50.0 if k.startswith("other") else 1.0}
                  for k in ("same_scene", "same_scene:guided", "other", "other:guided")}
    model = RiskModel(calibrated=True, thresholds=thresholds, confidence=0.9, region_threshold=0.35,
                      finish_calls={"same_scene": 3, "other": 3}, weights=flat, bias=-3.0)
    new, edit = _signature([1.0, 2.0, 3.0, 4.0]), _signature([1.0, 2.0, 3.0, -4.0])
    for order in ([("edit", edit, 0.9, [4, 8, 12, 16]), ("same", new, 1.0, [4, 8, 12, 16])],
                  [("same", new, 1.0, [4, 8, 12, 16]), ("edit", edit, 0.9, [4, 8, 12, 16])]):
        plan, verdicts = decide(new, order, 20, 2, model, GateSettings(), fill_calls=2)
        assert all(v.accept and v.reuse_step == 16 and v.finish_calls == 3 for v in verdicts)
        assert verdicts[0].risk == verdicts[1].risk  # equal finishes, equal risk: only the fill differs
        assert plan.entry_id == "same"
        assert hit_saving(plan, 20, 2, fill_calls=2) == pytest.approx(1 - 5 / 20)


def _sources_after(requests_in, model, min_saving):
    """Run PROMPT, then RELATED under min_saving; return RELATED's summary and the entries a
    third request's lookup may reuse."""
    from carnator_core import pipeline
    from carnator_core.calibration.fit import save
    from carnator_core.comfy_adapter import model_fingerprint
    save(RiskModel(calibrated=True, thresholds={"same_scene": {"0.5": 1.0}, "other": {"0.5": 50.0}},
                   confidence=0.9),
         requests_in.cache_folder, model_fingerprint(model))
    requests_in.settings.gate = GateSettings(risk_budget=0.5, max_depth=0.5, min_saving=min_saving)
    _, first = requests_in(model, "wan21", PROMPT)
    _, second = requests_in(model, "wan21", RELATED)
    cache, _ = pipeline.open_cache(requests_in.cache_folder, 1 << 30)
    pr = pipeline.probe(requests_in.run_obj(model, "wan21", OTHER), cache, requests_in.settings)
    found = pipeline.lookup(pr, top_k=10)
    return first, second, {c.entry.id for c in found.candidates}


def test_without_min_saving_the_hit_is_no_source(tiny_models, requests_in):
    first, second, sources = _sources_after(requests_in, tiny_models["wan21"], 0.0)
    assert second.outcome == "hit" and second.steps_computed < second.steps_total
    assert sources == {first.stored_id}


def test_under_min_saving_the_request_runs_in_full_and_becomes_a_source(tiny_models, requests_in):
    first, second, sources = _sources_after(requests_in, tiny_models["wan21"], 0.95)
    assert second.outcome == "miss" and "min_saving 95%" in second.reason
    # every step computed by the network (the probe's steps belong to it), and stored as a source
    assert second.steps_computed == second.model_calls == second.steps_total
    assert sources == {first.stored_id, second.stored_id}


def test_the_source_study_tells_why_a_hit_resumed_another_scene():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "studies"))
    from source_study import study
    scene = {name: {"objects": [{"shape": name}]} for name in "ABC"}
    line = lambda s, seed=200_000: {"scene": scene[s], "seed": seed, "seed_policy": "shared_noise"}  # noqa: E731
    hit = lambda same: {"outcome": "hit", "same_scene": same}  # noqa: E731
    miss = {"outcome": "miss", "same_scene": None}
    lines = [line("A"), line("B"), line("B"), line("A"), line("C"), line("C"), line("C", 200_001)]
    records = [miss, hit(False), hit(False), hit(True), miss, hit(False), hit(False)]
    assert study(records, lines) == {
        "gate_hits": 5,
        "resumed another scene; its own scene was new": 2,  # B first, C on another noise
        "resumed another scene; its own was served before, only as a reuse": 1,
        "reused its own scene": 1,
        "resumed another scene though its own had a source": 1}
    with pytest.raises(ValueError, match="records for"):
        study(records[:-1], lines)
