"""The cheap calibration (carnator_core/calibration/cheap.py): thresholds of a transferred ranking
certified per cell by clustered anytime-valid tests, labels only where the gate decides, within
a budget in generation-equivalents. Synthetic labelled pools for the statistics; the real tiny
Wan 2.1 model through ComfyUI's own classes for the budget and the resume."""
import json
import random

import pytest
import torch

from carnator_core.calibration import cheap
from carnator_core.calibration import pairs as prompt_pairs
from carnator_core.calibration.meter import ComputeMeter
from carnator_core.calibration.risk_control import certify
from carnator_core.calibration.sequential import RiskSequence
from carnator_core.calibration.tolerance import Tolerance
from carnator_core.comfy_adapter import attach_meter, calibrate_model, model_fingerprint
from carnator_core.gate import RiskModel, calibration_file
from carnator_core.pipeline import ReuseSettings

BUDGETS = cheap.CHEAP_BUDGETS
SAME_SCENE = {"outside_mean": 0.01, "outside_max": 0.05, "region_fraction": 0.0, "depth_fraction": 0.0,
              "similarity_gap": 0.001, "reuse_share": 0.0}


def transferred(same_scene=0.8, other=0.0) -> RiskModel:
    """A ranking with one threshold per cell at every cheap budget (same-scene by depth share)."""
    table = lambda lam: {f"{a:g}": lam for a in BUDGETS}  # noqa: E731
    return RiskModel(thresholds={"same_scene": table(same_scene), "same_scene:guided": table(same_scene),
                                 "other": table(other)},
                     finish_calls={"same_scene": 4}, calibrated=True, source="synthetic ranking",
                     probe_fraction=ReuseSettings().probe_fraction)  # learned with the samplers' probe


def pair_row(group: int, labels: tuple[int, int]) -> dict:
    """A measured paraphrase pair: both directions same-scene, each reused at the decision of
    the one ladder point (k = 16 of 20, every step) with these labels."""
    instances = [{"group": group, "kind": "paraphrase", "features": dict(SAME_SCENE),
                  "depths": [{"k": 16, "depth_fraction": 0.8, "fill_steps": 0, "psnr": 40.0 - 20 * y, "label": y}],
                  "decisions": [[0.8, 16, 0]]} for y in labels]
    return {"pair_id": str(group), "instances": instances, "cost": {"generations": 2.4, "by": "meter"}}


def fitted(rows):
    return cheap.fit_rows(rows, transferred(), ReuseSettings(), 20,
                          tolerance={"psnr_bound": 30.0, "space": "latent"})


def test_too_few_labels_certify_nothing_and_the_summary_says_how_many_more():
    model, report = fitted([pair_row(g, (0, 0)) for g in range(5)])
    assert not any(report["certified"].values()) and not any(model.thresholds.values())
    refused = report["cells"]["same_scene"]["budgets"]["0.1"]
    assert refused["why"] == "too few labels" and refused["clusters"] == 5
    need = {a: cheap.clean_pairs_needed(a) - 5 for a in (0.05, 0.1)}  # clean pairs still missing
    assert refused["more_cell_pairs"] == need[0.1]
    assert refused["more_generations"] == pytest.approx(need[0.1] * 2.4, abs=0.1)
    text = cheap.report_text({**report, "model_fingerprint": "f" * 32})
    assert "nothing certified: no calibration file written" in text, text
    assert (f"same-scene evidence: refused at 5% (≈ {need[0.05] * 2.4:.0f} more generation-equivalents), "
            f"10% (≈ {need[0.1] * 2.4:.0f})") in text, text
    assert "too few labels (5 pairs, 0 of 10 beyond tolerance)" in text, text
    assert f"other evidence: refused at 5% (at least {cheap.clean_pairs_needed(0.05)} pairs like it)" in text, text
    assert "too few labels (no pair landed here yet)" in text, text
    assert [cheap.clean_pairs_needed(a) for a in (0.5, 0.3)] == [6, 9]
    _, report = fitted([pair_row(g, (0, 0)) for g in range(7)])  # enough clean pairs for 50%, not 30%
    assert report["certified"]["same_scene"] == ["0.5"]
    assert "same-scene evidence: certified α = 50% (threshold 0.8)" in cheap.report_text(report)


def test_what_more_a_refused_budget_costs_is_read_at_the_mix_after_the_paraphrase_lead():
    """After the pool's leading paraphrases only some pairs land in a cell, so each pair landing
    there costs the pairs drawn beside it: the estimate reads the pairs after the lead (here
    half of them same-scene, an edit beside each), not the lead's cheaper mix."""
    edit = {"outside_mean": 0.2, "outside_max": 0.9, "region_fraction": 0.3, "depth_fraction": 0.0,
            "similarity_gap": 0.05, "reuse_share": 0.3}
    edit_row = lambda g: {"pair_id": str(g), "cost": {"generations": 5.0, "by": "meter"},  # noqa: E731
                          "instances": [{"group": g, "kind": "edit", "features": dict(edit), "depths": [],
                                         "decisions": []} for _ in range(2)]}
    rows = [pair_row(g, (0, 0)) for g in range(10)]
    rows += [edit_row(g) if g % 2 == 0 else pair_row(g, (0, 0)) for g in range(10, 20)]
    report = cheap.fit_rows(rows, transferred(), ReuseSettings(), 20, lead=10)[1]
    refused = report["cells"]["same_scene"]["budgets"]["0.05"]
    assert refused["more_cell_pairs"] == cheap.clean_pairs_needed(0.05) - 15
    assert refused["more_generations"] == pytest.approx(refused["more_cell_pairs"] * (5 * 5.0 + 5 * 2.4) / 5, abs=0.1)


def test_a_synthetic_pool_certifies_the_budgets_its_failure_rate_allows():
    rng = random.Random(7)
    rows = [pair_row(g, (int(rng.random() < 0.01), int(rng.random() < 0.01))) for g in range(200)]
    model, report = fitted(rows)
    assert report["certified"]["same_scene"] == ["0.05", "0.1", "0.2", "0.3", "0.5"]
    assert model.thresholds["same_scene"]["0.05"] == 0.8 == model.thresholds["same_scene:guided"]["0.05"]
    assert model.threshold_for(0.07, "same_scene") == (0.05, 0.8)  # the gate's largest certified α' ≤ α
    rng = random.Random(8)
    rows = [pair_row(g, (int(rng.random() < 0.12), int(rng.random() < 0.12))) for g in range(200)]
    _, report = fitted(rows)
    assert report["certified"]["same_scene"] == ["0.2", "0.3", "0.5"]
    assert "at this rate more pairs will not certify it" in report["cells"]["same_scene"]["budgets"]["0.1"]["why"]


def test_the_pool_opens_with_the_paraphrases_that_certify_the_strictest_budget_and_keeps_its_prefix():
    """A budget spends itself on same-scene evidence first: the pool opens with as many
    paraphrases as certify α = 5% when none fails, so that many clean pairs (at ~2.4
    generation-equivalents each) certify it; a longer pool continues the same sequence."""
    lead = cheap.paraphrase_lead()
    assert lead == cheap.clean_pairs_needed(min(BUDGETS))
    long, short = cheap.pool(prompt_pairs.BUILTIN_PROMPTS, lead + 60, seed=5), cheap.pool(
        prompt_pairs.BUILTIN_PROMPTS, lead + 3, seed=5)
    assert long[:lead + 3] == short
    assert all(p["kind"] == "paraphrase" for p in long[:lead])
    assert any(p["kind"] != "paraphrase" for p in long[lead:])  # then the edits' cells get pairs
    unled = cheap.pool(prompt_pairs.BUILTIN_PROMPTS, lead, seed=5, lead=0)
    assert any(p["kind"] != "paraphrase" for p in unled)
    _, report = fitted([pair_row(g, (0, 0)) for g in range(lead)])
    assert report["certified"]["same_scene"][0] == "0.05"
    _, report = fitted([pair_row(g, (0, 0)) for g in range(lead - 1)])
    assert "0.05" not in report["certified"]["same_scene"]


def test_at_a_true_rate_of_alpha_it_certifies_alpha_in_at_most_delta_of_draws():
    rng, certified = random.Random(11), 0
    for _ in range(300):  # pairs of two labels failing at 10%, read after every pair (anytime)
        clusters = [(sum(rng.random() < 0.1 for _ in range(2)), 2) for _ in range(150)]
        certified += RiskSequence.of(clusters, cheap.CLUSTER).rejects(0.1, 0.1)
    assert certified / 300 <= 0.1


def test_labels_that_fail_together_are_one_observation_not_many():
    """A reference run whose eight labels fail together: counted as labels, 16 failures in 320
    reuses certify α = 10%; counted as 40 clusters of a reference each, they do not — and the
    same labels arriving independently would."""
    failing = {7, 19}
    clusters = [(8 if i in failing else 0, 8) for i in range(40)]
    labels = [1] * 16 + [0] * 304
    naive = certify(lambda lam: labels, [0.8], 0.1, 0.1)
    assert naive["threshold"] == 0.8  # the count of labels certifies it
    ladder = cheap.Ladder({"same_scene": [0.8]}, {"same_scene": {"0.1": 0}})
    clustered = cheap.certify_ladder({"same_scene": [clusters]}, ladder, budgets=(0.1,), max_cluster=8)
    assert clustered["same_scene"]["budgets"]["0.1"]["threshold"] is None
    rng = random.Random(0)
    rng.shuffle(labels)
    independent = cheap.certify_ladder({"same_scene": [[(y, 1) for y in labels]]}, ladder, budgets=(0.1,),
                                       max_cluster=1)
    assert independent["same_scene"]["budgets"]["0.1"]["threshold"] == 0.8
    # the procedure itself: a pair whose two directions fail together is one cluster of two
    rows = [pair_row(g, (1, 1) if g % 20 == 9 else (0, 0)) for g in range(60)]
    _, report = fitted(rows)
    point = report["cells"]["same_scene"]["points"][0]
    assert (point["clusters"], point["labels"], point["failures"]) == (60, 120, 6)
    assert "0.1" not in report["certified"]["same_scene"]
    assert certify(lambda lam: [d["label"] for r in rows for i in r["instances"] for d in i["depths"]],
                   [0.8], 0.1, 0.1)["threshold"] == 0.8  # where the naive count would certify


STEPS = 8
SHAPE = (1, 16, 3, 8, 8)


@pytest.fixture
def wan21(tiny_models):
    torch.set_num_threads(1)
    return tiny_models["wan21"]


def test_the_budget_stops_it_and_a_larger_one_resumes_without_measuring_again(wan21, tmp_path):
    """The tiny random Wan 2.1 through ComfyUI's classes: measurement stops once the budget is
    spent (the pair that crossed it finished), only the gate's decisions are labelled, and a
    rerun with a larger budget measures only the pairs not measured yet."""
    folder, latent = tmp_path / "cache", {"samples": torch.zeros(SHAPE)}
    pairs = cheap.pool(prompt_pairs.BUILTIN_PROMPTS, 6, seed=3)
    ranking = transferred(same_scene=0.75, other=1.0)
    lines: list[str] = []

    def calibrate(budget):
        return calibrate_model(wan21, None, latent, pairs, STEPS, 4.0, "euler", "simple", Tolerance(30.0, "latent"),
                               str(folder), ReuseSettings(), budget_generations=budget, log=lines.append,
                               procedure="cheap", transferred=ranking)[1]

    first = calibrate(6.0)
    cost = first["cost"]
    assert cost["stopped_by_budget"] and cost["pairs_measured_now"] == first["pairs"] < len(pairs)
    rows = [json.loads(x) for x in cheap.cheap_progress_path(calibration_file(
        folder, model_fingerprint(wan21), ranking.probe_fraction)).read_text().splitlines()]
    assert len(rows) == first["pairs"]
    assert 6.0 <= first["cost_generations"] <= 6.0 + rows[-1]["cost"]["generations"] + 1e-6
    for row in rows:  # a label where a ladder point decides, nowhere else
        for inst in row["instances"]:
            decided = {(k, c) for _, k, c in inst["decisions"] if k is not None}
            assert {(d["k"], d.get("finish_calls", 0)) for d in inst["depths"]} == decided
    assert any(inst["depths"] for row in rows for inst in row["instances"])
    assert "stopped by the budget of 6 generation-equivalents" in cheap.report_text(first)
    assert first["paraphrase_lead"] == first["pairs"]  # the pool opens with paraphrases
    assert f"the first {first['pairs']} pairs were paraphrases" in cheap.report_text(first)

    meter = ComputeMeter()  # counts what the second run computes, apart from it
    detach = attach_meter(wan21, meter)
    try:
        second = calibrate(100.0)
    finally:
        detach()
    cost = second["cost"]
    assert not cost["stopped_by_budget"] and second["pairs"] == len(pairs)
    assert cost["pairs_carried"] == first["pairs"] and cost["pairs_measured_now"] == len(pairs) - first["pairs"]
    assert cost["carried_generations"] == pytest.approx(first["cost_generations"], abs=1e-2)
    unit = STEPS * 3 * 4 * 4 * 2  # a generation's token rows: steps × tokens × cond/uncond
    assert cost["this_run_generations"] == pytest.approx(meter.rows / unit, abs=1e-2)
    # the pool drew the same prompts twice; each ran with its own seed and was measured apart
    assert len({(p["a"], p["b"]) for p in pairs}) < len(pairs)
    progress = cheap.cheap_progress_path(calibration_file(folder, model_fingerprint(wan21), ranking.probe_fraction))
    assert len({json.loads(x)["pair_id"] for x in progress.read_text().splitlines()}) == len(pairs)
