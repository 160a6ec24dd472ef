"""The gate's recurring_sources: a scene asked again after a reuse runs in full once.

Only requests computed in full are reuse sources, so a scene whose first request reused
another scene is no source, and every rewording of it pays that shallow reuse again
(`serve`: 122 of 234 hits, docs/studies.md). With recurring_sources the second request of
such a scene finds the first among the served requests (cache_index.served_class), runs in
full, and the third reuses it as its own scene.

Real tiny Wan model in ComfyUI, real SQLite cache. A rewording is the same conditioning
scaled by 1 + 1e-3: its probe agrees with the original's (same-scene evidence) while its
exact key differs (no exact repeat).
"""
import pytest
import torch

from carnator_core.gate import GateSettings, RiskModel, evidence_class

EDITED = "a blue cube spins slowly on a wooden table"   # computed first: the source
SCENE = "a blue cube spins on a wooden table"           # other evidence against EDITED


def _inputs(requests_in, prompt, nudge=0.0):
    positive, negative, latent = requests_in.inputs("wan21", prompt)
    if nudge:
        positive = [[positive[0][0] * (1 + nudge), dict(positive[0][1])]]
    return positive, negative, latent


def _probe(requests_in, model, prompt, nudge=0.0, policy="same_seed"):
    from carnator_core import pipeline
    from carnator_core.comfy_adapter import ComfyRun
    cache, _ = pipeline.open_cache(requests_in.cache_folder, 1 << 30)
    run = ComfyRun(model, *_inputs(requests_in, prompt, nudge), 7, requests_in.steps, 4.0, "euler",
                   "simple", seed_policy=policy)
    return cache, pipeline.probe(run, cache, requests_in.settings)


def _run(requests_in, model, prompt, nudge=0.0, policy="same_seed", latent_too=False):
    from carnator_core.comfy_adapter import run_request
    positive, negative, latent = _inputs(requests_in, prompt, nudge)
    out = run_request(model, positive, negative, latent, 7, requests_in.steps, 4.0, "euler",
                      "simple", requests_in.settings,
                      {"folder": requests_in.cache_folder, "capacity_bytes": 1 << 30},
                      seed_policy=policy, label=prompt)
    return out if latent_too else out[1]


def _session(requests_in, model, recurring, policy="same_seed"):
    """EDITED, then SCENE and three rewordings of it; return their summaries."""
    from carnator_core.calibration.fit import save
    from carnator_core.comfy_adapter import model_fingerprint
    # both classes certified at every depth: every-step finish, so a same-scene reuse
    # (no region M to fill) saves more than an edit's (M filled in two steps)
    save(RiskModel(calibrated=True, thresholds={"same_scene": {"0.5": 1.0}, "other": {"0.5": 50.0}},
                   confidence=0.9),
         requests_in.cache_folder, model_fingerprint(model))
    requests_in.settings.gate = GateSettings(risk_budget=0.5, max_depth=0.5,
                                             recurring_sources=recurring)
    return [_run(requests_in, model, prompt, nudge, policy)
            for prompt, nudge in ((EDITED, 0.0), (SCENE, 0.0), (SCENE, 1e-3), (SCENE, 2e-3), (SCENE, 3e-3))]


def test_the_prompts_give_the_evidence_the_rule_needs(tiny_models, requests_in):
    from carnator_core.gate import evidence
    model = tiny_models["wan21"]
    edited, scene, reworded = (_probe(requests_in, model, p, nudge)[1].signature
                               for p, nudge in ((EDITED, 0), (SCENE, 0), (SCENE, 1e-3)))

    def klass(a, b):
        return evidence_class(evidence(a, b, a.similarity(b), RiskModel().region_threshold)[0])
    assert klass(scene, edited) == "other" and klass(reworded, scene) == "same_scene"


def test_without_it_every_rewording_reuses_the_other_scene(tiny_models, requests_in):
    edited, scene, *rewordings = _session(requests_in, tiny_models["wan21"], recurring=False)
    assert edited.outcome == "miss" and scene.outcome == "hit"
    assert [r.outcome for r in rewordings] == ["hit"] * 3
    assert {r.entry_id for r in [scene, *rewordings]} == {edited.stored_id}


def test_the_second_request_of_a_served_scene_becomes_its_source(tiny_models, requests_in):
    edited, scene, second, third, fourth = _session(requests_in, tiny_models["wan21"], recurring=True)
    # the scene's first request reuses the edited one: nothing to recognise yet
    assert scene.outcome == "hit" and scene.entry_id == edited.stored_id
    # its rewording finds it among the served requests and computes every step
    assert second.outcome == "miss" and "this scene was asked before" in second.reason
    assert scene.stored_id[:8] in second.reason
    assert second.steps_computed == second.model_calls == second.steps_total
    # later rewordings reuse it as their own scene, cheaper than the edited one
    for later in (third, fourth):
        assert later.outcome == "hit" and later.entry_id == second.stored_id
        assert later.steps_computed < scene.steps_computed


def test_it_spends_nothing_where_same_scene_reuse_is_not_certified(tiny_models, requests_in):
    from carnator_core.calibration.fit import save
    from carnator_core.comfy_adapter import model_fingerprint
    model = tiny_models["wan21"]
    # other evidence accepted at any depth (λ at the logit's clamp), same-scene at none
    save(RiskModel(calibrated=True, thresholds={"other": {"0.5": 50.0}, "same_scene": {"0.5": 0.0}},
                   confidence=0.9),
         requests_in.cache_folder, model_fingerprint(model))
    requests_in.settings.gate = GateSettings(risk_budget=0.5, max_depth=0.5, recurring_sources=True)
    edited, scene, second = (_run(requests_in, model, EDITED), _run(requests_in, model, SCENE),
                             _run(requests_in, model, SCENE, 1e-3))
    assert second.outcome == "hit" and second.entry_id == edited.stored_id


@pytest.mark.parametrize("recurring", [False, True])
def test_reuses_are_indexed_apart_from_sources(tiny_models, requests_in, recurring):
    """A lookup of the class returns sources only; the served class returns reuses only."""
    from carnator_core.cache.index import served_class
    model = tiny_models["wan21"]
    edited, scene, *rewordings = _session(requests_in, model, recurring)
    cache, pr = _probe(requests_in, model, SCENE, 5e-3)
    sig = pr.signature.global_vector()
    sources = {c.entry.id for c in cache.lookup(pr.klass.key, sig, 10).candidates}
    served = {c.entry.id for c in cache.lookup(served_class(pr.klass.key), sig, 10).candidates}
    everyone = [edited, scene, *rewordings]
    assert sources == {r.stored_id for r in everyone if r.outcome == "miss"}
    assert served == {r.stored_id for r in everyone if r.outcome == "hit"}
    assert len(sources) == (2 if recurring else 1)


@pytest.mark.parametrize("recurring,policy", [(True, "shared_noise"), (False, "shared_noise"),
                                              (True, "same_seed")])
def test_an_exact_repeat_of_a_reused_result(tiny_models, requests_in, recurring, policy):
    """On a service (shared_noise) re-serving a reuse to every repeat would multiply one gate
    decision by the prompt's popularity: with recurring_sources its first repeat runs in full
    and later ones get that. With same_seed (someone returning to a result they saw), or with
    recurring_sources off, the stored reuse is served as it is."""
    model = tiny_models["wan21"]
    edited, scene = _session(requests_in, model, recurring, policy)[:2]
    assert scene.outcome == "hit" and scene.stored_id           # a reuse, kept for its repeats
    (first_latent, first), (second_latent, second) = (
        _run(requests_in, model, SCENE, policy=policy, latent_too=True) for _ in range(2))
    if not (recurring and policy == "shared_noise"):
        assert first.outcome == second.outcome == "exact"
        assert first.entry_id == second.entry_id == scene.stored_id
        assert first.model_calls == first.steps_computed == 0   # not even a probe step
        return
    assert first.outcome == "miss" and "served by reusing" in first.reason
    assert scene.stored_id[:8] in first.reason and edited.stored_id[:8] in first.reason
    assert first.steps_computed == first.model_calls == first.steps_total
    assert first.stored_id and first.stored_id != scene.stored_id
    # the next repeat gets the full computation, exactly, computing nothing
    assert second.outcome == "exact" and second.entry_id == first.stored_id
    assert second.steps_computed == 0          # stored float16: the full result to its rounding
    torch.testing.assert_close(second_latent, first_latent, rtol=2**-11, atol=1e-6)


def test_a_gate_that_turns_recurring_sources_off_serves_the_repeat_and_counts_its_probe(
        tiny_models, requests_in):
    """In a node graph the probe runs with its own settings and the gate with the node's: a
    probe that left a full run open and a gate that then serves the stored reuse computed the
    probe's steps, and the summary says so."""
    from dataclasses import replace
    from carnator_core import pipeline
    model = tiny_models["wan21"]
    edited, scene = _session(requests_in, model, True, "shared_noise")[:2]
    cache, pr = _probe(requests_in, model, SCENE, policy="shared_noise")
    assert pr.repeat_may_run and pr.exact_entry.id == scene.stored_id
    assert pr.probe_calls > 0                                   # the probe ran
    found = pipeline.lookup(pr)
    model_risk = pipeline.calibrated_risk_model(pr)
    plan, _ = pipeline.gate(pr, found, model_risk, replace(pr.settings.gate, recurring_sources=False))
    assert not plan.accept and pr.exact_entry.id == scene.stored_id
    _, summary = pipeline.reuse(pr, plan)
    assert summary.outcome == "exact" and summary.model_calls == pr.probe_calls
    assert summary.steps_computed == pr.probe_steps
