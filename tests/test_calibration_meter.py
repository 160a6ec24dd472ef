"""The compute meter of calibrations (carnator_core/calibration/meter.py, counted at the model by
comfy_adapter.attach_meter): a full generation reads 1.0 and a reuse from depth k reads
(N − k)/N, exactly; a calibration's metered cost equals the rule on its records; a budget stops
a calibration and a larger one continues it with the cost carried in the progress file. Real
ComfyUI classes and the bundled tiny Wan 2.1 model, CPU."""
import json
from pathlib import Path

import pytest
import torch

from carnator_core.calibration import pairs as prompt_pairs
from carnator_core.calibration.generic import progress_path, report_text
from carnator_core.calibration.meter import (ComputeMeter, CostLedger, PairCost, ServedSize, at_served_size,
                                             cost_text, pair_cost)
from carnator_core.calibration.tolerance import Tolerance
from carnator_core.comfy_adapter import attach_meter, calibrate_model, model_fingerprint
from carnator_core.gate import calibration_file
from carnator_core.pipeline import ReuseSettings

STEPS = 8
SHAPE = (1, 16, 3, 8, 8)
TOKENS = 3 * (8 // 2) * (8 // 2)  # Wan 2.1's patch is 1×2×2


@pytest.fixture
def wan21(tiny_models):
    torch.set_num_threads(1)
    return tiny_models["wan21"]


def test_a_full_generation_reads_one_and_a_reuse_from_k_the_steps_left(wan21, requests_in):
    meter = ComputeMeter()
    detach = attach_meter(wan21, meter)
    try:
        assert meter.available
        run = requests_in.run_obj(wan21, "wan21", "a red ball rolls left", seed=3, shape=SHAPE, steps=STEPS)
        run.sample(0, STEPS, None)
        full = meter.rows
        assert full == STEPS * TOKENS * 2  # every step, every token, cond and uncond (cfg 4)
        for k in (2, 5):
            x_k = run.sample(0, k, None)
            before = meter.rows
            run.sample(k, STEPS, x_k)
            assert (meter.rows - before) / full == (STEPS - k) / STEPS
    finally:
        detach()
    before = meter.rows
    run.sample(0, STEPS, None)
    assert meter.rows == before  # detached: nothing counted any more


def test_a_generation_at_a_proxy_size_reads_its_token_share_of_the_served_size(wan21, requests_in):
    """What a calibration at a smaller size costs at the served size: the meter's rows of one
    generation at each size, converted by at_served_size, are exactly the token ratio."""
    small, served = (1, 16, 2, 8, 8), (1, 16, 4, 16, 16)
    rows = []
    for shape in (small, served):
        meter = ComputeMeter()
        detach = attach_meter(wan21, meter)
        try:
            run = requests_in.run_obj(wan21, "wan21", "a red ball rolls left", seed=3, shape=shape, steps=STEPS)
            run.sample(0, STEPS, None)
        finally:
            detach()
        rows.append(meter.rows)
    tokens = [t * (h // 2) * (w // 2) for _, _, t, h, w in (small, served)]
    assert rows == [STEPS * n * 2 for n in tokens]
    assert at_served_size(1.0, *tokens) == pytest.approx(rows[0] / rows[1]) == pytest.approx(1 / 8)
    with pytest.raises(ValueError, match="positive"):
        at_served_size(1.0, 0, tokens[1])


@pytest.mark.parametrize("recipe", ["default", "fill_on_m"])
def test_a_calibrations_metered_cost_is_the_rule_on_its_records(wan21, tmp_path, recipe):
    """Fills of M, guided finishes and region finishes on M's tokens: what the model computed
    equals what the records say (the rule bench/studies/calibration_cost.py applies to old records)."""
    settings = ReuseSettings()
    if recipe == "fill_on_m":
        settings = ReuseSettings(region_fill_on_m=True, region_margin=1, other_finish_calls=2,
                                 other_finish_region=True)
    _, report = calibrate_model(wan21, None, {"samples": torch.zeros(SHAPE)}, prompt_pairs.pairs(n=2, seed=0),
                                STEPS, 4.0, "euler", "simple", Tolerance(30.0, "latent"), str(tmp_path),
                                settings, log=lambda line: None)
    progress = progress_path(calibration_file(tmp_path, model_fingerprint(wan21), settings.probe_fraction))
    rows = [json.loads(line) for line in progress.read_text().splitlines()]
    assert len(rows) == 2 and all(r["cost"]["by"] == "meter" for r in rows)
    for r in rows:
        assert r["cost"]["rows_per_generation"] == STEPS * TOKENS * 2
        assert r["cost"]["generations"] == pytest.approx(pair_cost(r["instances"], STEPS), abs=1e-3)
    assert report["cost_generations"] == pytest.approx(sum(r["cost"]["generations"] for r in rows), abs=1e-2)
    if recipe == "fill_on_m":  # calls on M's tokens were made, and counted at their share
        assert any(d.get("region_steps") for r in rows for i in r["instances"] for d in i["depths"])


def test_a_budget_stops_the_calibration_and_a_larger_one_continues_it(wan21, requests_in, tmp_path):
    folder, pairs = tmp_path / "cache", prompt_pairs.pairs(n=4, seed=0)
    latent, tol, settings = {"samples": torch.zeros(SHAPE)}, Tolerance(30.0, "latent"), requests_in.settings
    lines: list[str] = []

    def calibrate(budget):
        return calibrate_model(wan21, None, latent, pairs, STEPS, 4.0, "euler", "simple", tol, str(folder),
                               settings, budget_generations=budget, log=lines.append)[1]

    first = calibrate(10.0)
    cost = first["cost"]
    per_pair = cost["generations_per_pair"]
    assert cost["stopped_by_budget"] and cost["pairs_measured_now"] == 2 and cost["pairs_skipped"] == 2
    assert 10.0 <= first["cost_generations"] <= 10.0 + per_pair + 1e-6  # the pair that crossed it finished
    assert "ETA" in lines[0] and "the budget stops it after about 1 pair more" in lines[0], lines[0]
    text = report_text(first)
    assert "stopped by the budget of 10 generation-equivalents after 2 of 4 pairs" in text, text
    assert "again with a larger budget and it continues" in text
    fp = model_fingerprint(wan21)
    progress = progress_path(calibration_file(folder, fp, settings.probe_fraction))
    assert len(progress.read_text().splitlines()) == 2

    meter = ComputeMeter()  # counts what the second run computes, independently of it
    detach = attach_meter(wan21, meter)
    try:
        second = calibrate(100.0)
    finally:
        detach()
    cost = second["cost"]
    assert not cost["stopped_by_budget"] and second["pairs"] == 4
    assert cost["pairs_carried"] == 2 and cost["pairs_measured_now"] == 2  # nothing measured again
    assert cost["carried_generations"] == pytest.approx(first["cost_generations"], abs=1e-2)
    assert cost["this_run_generations"] == pytest.approx(meter.rows / (STEPS * TOKENS * 2), abs=1e-2)
    assert second["cost_generations"] == pytest.approx(cost["carried_generations"] + cost["this_run_generations"],
                                                       abs=1e-2)
    assert len(progress.read_text().splitlines()) == 4
    assert "cost: " in report_text(second) and "stopped by the budget" not in report_text(second)
    saved = json.loads(Path(str(progress).replace(".progress.jsonl", ".report.json")).read_text())
    assert saved["cost_generations"] == second["cost_generations"] and saved["seconds"] >= 0


def test_the_ledger_counts_old_records_by_rule_and_says_when_the_budget_stops():
    old = [{"depths": [{"k": 4, "fill_steps": 2}, {"k": 6, "fill_steps": 0, "finish_calls": 4,
                                                    "predicted_steps": 6},
                       {"k": 12, "fill_steps": 1.5, "finish_calls": 4, "predicted_steps": 4,
                        "region_steps": 4, "token_share": 0.25}]}]
    # 2 full runs + (16 + 2)/20 + (14 − 6)/20 + (8 − 4 + 4·0.25 + 1.5)/20
    assert pair_cost(old, 20) == pytest.approx(2 + 18 / 20 + 8 / 20 + 6.5 / 20)
    by_rule = PairCost.of({"pair_id": "x", "instances": old}, old, 20)
    assert by_rule.by == "rule" and by_rule.seconds is None
    ledger = CostLedger(budget_generations=5.0, pairs_planned=4, carried=[by_rule])
    ledger.measured.append(PairCost(3.0, 10.0))
    assert ledger.exhausted and ledger.per_pair() == (3.0, 10.0)
    line = ledger.progress_line(2, 2)
    assert "2 pairs left ≈ 6 generation-equivalents, ETA 20 s" in line, line
    assert "the budget is spent: no new pair is started" in line


def test_a_budget_at_the_served_size_counts_a_proxy_s_work_by_its_share_of_the_tokens():
    """Calibrating at a quarter of the served tokens, a budget of 2 served generations lets 8
    generations at the calibrated size be spent; the progress line and the report say both."""
    served = ServedSize.of((3, 8, 8), (3, 16, 16))
    assert served.token_share == pytest.approx(0.25) and served.latent == (3, 16, 16)
    ledger = CostLedger(budget_generations=2.0, pairs_planned=4, served=served)
    ledger.measured.append(PairCost(4.0, 8.0))
    assert not ledger.exhausted and ledger.spent_against_budget == pytest.approx(1.0)
    line = ledger.progress_line(1, 3)
    assert "spent 4.0 (1.0 at the served size) of a budget of 2" in line, line
    assert "the budget stops it after about 1 pair more" in line, line
    ledger.measured.append(PairCost(4.0, 8.0))
    assert ledger.exhausted and ledger.skip_if_spent() and ledger.skip_if_spent()  # the two pairs left
    text = "\n".join(cost_text({"cost": ledger.as_dict(), "latents": [[3, 8, 8]], "seconds": 16}))
    assert "cost: 8.0 generation-equivalents" in text and "latent 3×8×8" in text, text
    assert "at the served size, latent 3×16×16: 2.0 generation-equivalents of that size" in text, text
    assert "25.0% of its tokens" in text and "the budget of 2 is counted there" in text, text
    assert "stopped by the budget of 2 generation-equivalents of the served size after 2 of 4 pairs" in text, text
    with pytest.raises(ValueError, match="three positive counts"):
        ServedSize.of((3, 8, 8), (3, 0, 16))


def test_a_calibration_with_a_served_latent_stops_at_the_budget_counted_at_that_size(wan21, requests_in, tmp_path):
    """The real tiny Wan through the adapter: measured at 3×8×8 and served at 3×16×16 (four
    times the tokens), a budget of 2.5 served generations is 10 at the calibrated size."""
    folder, pairs = tmp_path / "cache", prompt_pairs.pairs(n=4, seed=0)
    latent, served = {"samples": torch.zeros(SHAPE)}, {"samples": torch.zeros(1, 16, 3, 16, 16)}
    _, report = calibrate_model(wan21, None, latent, pairs, STEPS, 4.0, "euler", "simple", Tolerance(30.0, "latent"),
                                str(folder), requests_in.settings, budget_generations=2.5, served_latent=served)
    cost = report["cost"]
    assert cost["stopped_by_budget"] and cost["served"]["latent"] == [3, 16, 16]
    assert cost["served"]["token_share"] == pytest.approx(0.25)
    assert cost["served"]["cost_generations"] == pytest.approx(report["cost_generations"] / 4, abs=1e-3)
    assert 2.5 <= cost["served"]["cost_generations"] <= 2.5 + cost["generations_per_pair"] / 4 + 1e-6
    assert cost["pairs_measured_now"] == 2  # as a budget of 10 at the calibrated size stops it
    assert "at the served size, latent 3×16×16" in report_text(report)


def test_pairs_worded_as_the_traffic_are_certified_as_their_own_population(wan21, tmp_path):
    """Traffic pairs carry their stratum into the measured instances, the certification names
    both populations and the report checks the gate on each."""
    pairs = prompt_pairs.with_traffic(prompt_pairs.pairs(n=2, seed=0), prompt_pairs.pairs(n=2, seed=1))
    assert [p["group"] for p in pairs] == [0, 1, 2, 3]
    settings = ReuseSettings()
    _, report = calibrate_model(wan21, None, {"samples": torch.zeros(SHAPE)}, pairs, STEPS, 4.0, "euler",
                                "simple", Tolerance(30.0, "latent"), str(tmp_path), settings, log=lambda line: None)
    progress = progress_path(calibration_file(tmp_path, model_fingerprint(wan21), settings.probe_fraction))
    strata = [i["stratum"] for line in progress.read_text().splitlines() for i in json.loads(line)["instances"]]
    assert strata == ["generic"] * 4 + ["traffic"] * 4
    assert report["certification"]["strata"] == ["generic", "traffic"]
    assert set(report["heldout_by_stratum"]) <= {"generic", "traffic"}
    text = report_text(report)
    assert "each population of pairs alike: " in text
    assert all(f"held-out check on the {s} pairs α=5%" in text for s in report["heldout_by_stratum"])


def test_the_node_and_the_script_make_traffic_pairs_only_from_prompts_given():
    """pairs_from_texts, as Carnator Calibrate and scripts/calibrate_model.py call it: blank
    traffic text adds nothing (not the built-in list); given prompts add as many pairs again."""
    plain = prompt_pairs.pairs_from_text("a red ball moves left", 4, seed=3)
    assert prompt_pairs.pairs_from_texts("a red ball moves left", " \n ", 4, seed=3) == plain
    both = prompt_pairs.pairs_from_texts("a red ball moves left", "a blue square rises", 4, seed=3)
    assert [p["stratum"] for p in both] == ["generic"] * 4 + ["traffic"] * 4
    assert [p["group"] for p in both] == list(range(8))
    assert all("blue square" in p["a"] or "blue square" in p["b"] for p in both[4:])
