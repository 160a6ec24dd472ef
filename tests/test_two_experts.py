"""Wan 2.2 A14B: a high-noise and a low-noise expert, switched at a boundary step.

Both tiny experts are loaded by ComfyUI's own loader (detected as WAN21_T2V, as the real
files are). The reference for "the same computation" is the real two-KSamplerAdvanced chain
from the host's nodes.py. Model calls are counted per expert through each expert's
DIFFUSION_MODEL wrapper, never timed.
"""
from pathlib import Path

import pytest
import torch
from conftest import Requests

from carnator_core.reuse import experts
from carnator_core.gate import GateSettings, RiskModel

REPO = Path(__file__).resolve().parent.parent
PROMPT = "a red ball rolls left across a green field"
RELATED = "a red ball rolls left across a green field slowly"
BACKBONE, STEPS, SWITCH = "wan22_a14b", 10, 5
HIGH, LOW = experts.HIGH_NOISE, experts.LOW_NOISE


@pytest.fixture(scope="module")
def pair():
    import comfy.sd
    tiny = REPO / "models" / "tiny"
    return {name: comfy.sd.load_diffusion_model(str(tiny / f"carnator_tiny_wan22_a14b_{name}.safetensors"))
            for name in ("high", "low")}


@pytest.fixture
def requests_in(tmp_path):
    return Requests(tmp_path / "cache", steps=STEPS)


def ask(requests, pair, prompt, switch_step=SWITCH, **kw):
    return requests(pair["high"], BACKBONE, prompt, low_noise_model=pair["low"],
                    switch_step=switch_step, **kw)


def ksampler_advanced_chain(pair, prompt, seed=7, boundary=SWITCH):
    """What a user's workflow computes: two KSamplerAdvanced nodes of the host's nodes.py."""
    from comfy_host import host_nodes
    nodes = host_nodes()
    requests = Requests("unused", steps=STEPS)
    positive, negative, latent = requests.inputs(BACKBONE, prompt)
    sampler = nodes.KSamplerAdvanced()
    common = dict(noise_seed=seed, steps=STEPS, cfg=4.0, sampler_name="euler", scheduler="simple",
                  positive=positive, negative=negative)
    (mid,) = sampler.sample(pair["high"], "enable", latent_image=latent, start_at_step=0,
                            end_at_step=boundary, return_with_leftover_noise="enable", **common)
    (out,) = sampler.sample(pair["low"], "disable", latent_image=mid, start_at_step=boundary,
                            end_at_step=10000, return_with_leftover_noise="disable", **common)
    return out["samples"]


def calls_on_each_side(start: int, end: int, boundary: int) -> dict[str, int]:
    """Steps start..end-1 split by the expert that owns each step."""
    high = max(0, min(end, boundary) - start)
    return {HIGH: high, LOW: (end - start) - high}


def fill_calls(p: int, k: int, calls: int, boundary: int) -> dict[str, int]:
    """Region M's coarse jump from the probe to k, split as comfy_adapter.ComfyRun.jump does."""
    idx = torch.linspace(p, k, max(1, calls) + 1).round().long().unique().tolist()
    starts = idx[:-1]
    return {HIGH: sum(s < boundary for s in starts), LOW: sum(s >= boundary for s in starts)}


def test_miss_then_related_hit_then_exact_repeat_counted_per_expert(pair, requests_in):
    first, s1 = ask(requests_in, pair, PROMPT)
    assert s1.outcome == "miss" and s1.stored_id
    assert s1.expert_calls == {HIGH: SWITCH, LOW: STEPS - SWITCH}, s1.expert_calls

    second, s2 = ask(requests_in, pair, RELATED)
    assert s2.outcome == "hit" and s2.entry_id == s1.stored_id, s2.text()
    assert sum(s2.expert_calls.values()) == s2.model_calls == s2.steps_computed < STEPS
    assert s2.expert_calls[HIGH] >= 1  # the probe runs on the high-noise expert
    assert s2.expert_calls[HIGH] < SWITCH or s2.expert_calls[LOW] < STEPS - SWITCH
    assert not torch.equal(second, first) and torch.isfinite(second).all()

    again, s3 = ask(requests_in, pair, PROMPT)
    assert s3.outcome == "exact" and s3.model_calls == 0
    assert s3.expert_calls == {HIGH: 0, LOW: 0}
    torch.testing.assert_close(again, first, rtol=2**-11, atol=1e-6)


def test_probe_and_continuation_equal_the_two_ksampler_advanced_chain(pair, requests_in):
    reference = ksampler_advanced_chain(pair, PROMPT)
    latent, s = ask(requests_in, pair, PROMPT)
    assert s.outcome == "miss"
    torch.testing.assert_close(latent, reference, rtol=1e-4, atol=1e-4)
    high_alone = requests_in.run_obj(pair["high"], BACKBONE, PROMPT)
    assert (high_alone.sample(0, STEPS, None) - reference).abs().max() > 0.1  # the switch matters


@pytest.mark.parametrize("k", [3, SWITCH, 7])
def test_resume_from_a_snapshot_continues_on_the_expert_that_owns_the_step(pair, requests_in, k):
    """k* before, at and after the boundary: the resumed run is the chain's trajectory and
    only the experts owning steps k..N-1 are called."""
    from carnator_core.pipeline import TrajectoryRecord
    run = requests_in.run_obj(pair["high"], BACKBONE, PROMPT, low_noise_model=pair["low"],
                              switch_step=SWITCH)
    record = TrajectoryRecord(run, [k], "float32")
    full = run.sample(0, STEPS, None, record.on_step)
    torch.testing.assert_close(full, ksampler_advanced_chain(pair, PROMPT), rtol=1e-4, atol=1e-4)
    before = run.expert_calls
    resumed = run.sample(k, STEPS, run.boundary_from_sampler_space(record.snapshots[k], k))
    torch.testing.assert_close(resumed, full, rtol=1e-4, atol=1e-4)
    spent = {e: run.expert_calls[e] - before[e] for e in before}
    assert spent == calls_on_each_side(k, STEPS, SWITCH), spent


@pytest.mark.parametrize("depth", [0.3, 0.7])
def test_a_hit_on_either_side_of_the_boundary_counts_each_expert(pair, requests_in, depth):
    """The gate's k* falls before (3) or after (7) the switch at 5: every step from k* on,
    and region M's coarse fill, runs on the expert that owns it."""
    from carnator_core import pipeline
    ask(requests_in, pair, PROMPT)
    cache, _ = pipeline.open_cache(requests_in.cache_folder, 1 << 30)
    run = requests_in.run_obj(pair["high"], BACKBONE, RELATED, low_noise_model=pair["low"],
                              switch_step=SWITCH)
    pr = pipeline.probe(run, cache, requests_in.settings)
    gate = GateSettings(risk_budget=1.0, min_depth=depth, max_depth=depth)
    plan, _ = pipeline.gate(pr, pipeline.lookup(pr), RiskModel(), gate)
    assert plan.accept and plan.reuse_step == round(depth * STEPS), plan.reason
    plan.region_tiles = torch.zeros_like(plan.region_tiles)
    plan.region_tiles[:4] = True  # an edit: region M is filled from the request's own path
    _, s = pipeline.reuse(pr, plan)
    k, p = plan.reuse_step, pr.probe_steps
    fill = fill_calls(p, k, requests_in.settings.region_fill_calls, SWITCH)
    rest = calls_on_each_side(k, STEPS, SWITCH)
    expected = {e: calls_on_each_side(0, p, SWITCH)[e] + fill[e] + rest[e] for e in (HIGH, LOW)}
    assert s.outcome == "hit" and s.expert_calls == expected, (s.expert_calls, expected)
    assert s.model_calls == s.steps_computed == sum(expected.values())


def test_another_pairing_or_boundary_finds_no_candidates(pair, requests_in):
    _, first = ask(requests_in, pair, PROMPT)
    assert first.outcome == "miss"
    cases = {
        "boundary": dict(model=pair["high"], low_noise_model=pair["low"], switch_step=6),
        "swapped experts": dict(model=pair["low"], low_noise_model=pair["high"], switch_step=SWITCH),
        "high-noise expert alone": dict(model=pair["high"]),
    }
    for name, kw in cases.items():
        model = kw.pop("model")
        _, s = requests_in(model, BACKBONE, RELATED, **kw)
        assert s.outcome == "miss", name
        assert "none for this model" in s.lookup_message, (name, s.lookup_message)


def test_the_boundary_by_sigma_is_the_first_step_below_it(pair, requests_in):
    run = requests_in.run_obj(pair["high"], BACKBONE, PROMPT, low_noise_model=pair["low"],
                              switch_sigma=experts.WAN22_SWITCH_SIGMA)
    below = [i for i, s in enumerate(run.sigmas[:STEPS].tolist()) if s < experts.WAN22_SWITCH_SIGMA]
    assert run.boundary == below[0] and 1 <= run.boundary < STEPS


def test_bad_pairs_and_boundaries_get_actionable_errors(pair, tiny_models, requests_in):
    import comfy.sd
    from safetensors.torch import load_file
    run = lambda model, low, **kw: requests_in.run_obj(  # noqa: E731
        model, BACKBONE, PROMPT, low_noise_model=low, **kw)
    with pytest.raises(ValueError, match="must be one architecture"):
        run(pair["high"], tiny_models["hunyuan_video"], switch_step=SWITCH)
    with pytest.raises(ValueError, match="must be one architecture"):
        run(pair["high"], tiny_models["wan22_5b"], switch_step=SWITCH)  # WAN22 vs WAN21
    deeper = load_file(str(REPO / "models" / "tiny" / "carnator_tiny_wan22_a14b_low.safetensors"))
    deeper.update({k.replace("blocks.1.", "blocks.2."): v for k, v in deeper.items()
                   if k.startswith("blocks.1.")})
    with pytest.raises(ValueError, match="expert layouts differ: blocks.2"):
        run(pair["high"], comfy.sd.load_diffusion_model_state_dict(deeper), switch_step=SWITCH)
    with pytest.raises(ValueError, match="same model as model"):
        run(pair["high"], pair["high"], switch_step=SWITCH)
    with pytest.raises(ValueError, match=r"switch_step 10 is outside 1\.\.9"):
        run(pair["high"], pair["low"], switch_step=STEPS)
    with pytest.raises(ValueError, match="switch_sigma 0.0001 puts all 10 steps on the high-noise"):
        run(pair["high"], pair["low"], switch_sigma=0.0001)


def test_hits_run_block_sparse_and_dense_calls_chain_to_an_existing_override(pair, tmp_path):
    from carnator_core.reuse.sparse_attention import reset_sparse_call_counts, sparse_call_counts
    seen = {"calls": 0}

    def users_override(func, *args, **kwargs):
        seen["calls"] += 1
        return func(*args, **kwargs)

    low = pair["low"].clone()
    low.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = users_override
    requests = Requests(tmp_path, steps=STEPS)
    requests.settings.sparse.keep_mass, requests.settings.sparse.max_density = 0.5, 1.0
    requests(pair["high"], BACKBONE, PROMPT, low_noise_model=low, switch_step=SWITCH)
    reset_sparse_call_counts()
    seen["calls"] = 0
    requests.settings.store = False
    _, s = requests(pair["high"], BACKBONE, RELATED, low_noise_model=low, switch_step=SWITCH)
    assert s.outcome == "hit" and s.sparse_calls > 0, s.text()
    assert sum(sparse_call_counts().values()) == s.sparse_calls  # the kernel itself ran
    # the low-noise expert's cross-attention (dense) went through the user's override
    assert seen["calls"] >= s.expert_calls[LOW]


def test_a_pair_is_calibrated_as_the_one_model_it_is(pair, requests_in):
    """Carnator Calibrate with a low_noise_model writes the calibration under the pair's
    fingerprint (both experts and the switch), and the pair's requests then use it."""
    from carnator_core.calibration import pairs as prompt_pairs
    from carnator_core.comfy_adapter import calibrate_model, model_fingerprint
    from carnator_core.demo_text import DEFAULT_LATENT_SHAPES
    from carnator_core.pipeline import ReuseSettings
    from carnator_core.calibration.tolerance import Tolerance
    latent = {"samples": torch.zeros(DEFAULT_LATENT_SHAPES[BACKBONE])}
    pairs = prompt_pairs.pairs_from_text(f"{PROMPT} || {RELATED}", 4, seed=0)
    _, report = calibrate_model(pair["high"], None, latent, pairs, STEPS, 4.0, "euler", "simple",
                                Tolerance(30.0, "latent"), requests_in.cache_folder,
                                ReuseSettings(probe_fraction=0.1), low_noise_model=pair["low"],
                                switch_step=SWITCH)
    run = requests_in.run_obj(pair["high"], BACKBONE, PROMPT, low_noise_model=pair["low"],
                              switch_step=SWITCH)
    assert report["model_fingerprint"] == run.fingerprint() != model_fingerprint(pair["high"])
    _, s = ask(requests_in, pair, PROMPT)
    assert "gate: calibrated" in s.calibration, s.calibration
