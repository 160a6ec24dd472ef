"""The gate's certified thresholds (carnator_core/calibration/risk_control.py, calibration.certify_model).

Synthetic cases with a known answer: scores s ~ U(0, 1), a reuse misses tolerance with
probability s, so the risk among reuses accepted at threshold λ is λ/2 and the largest
threshold that keeps it within α is λ* = 2α. Learn-then-Test must stay at or below λ* in at
least 1−δ of independent calibration draws, and come close to λ* when data are plentiful.
"""
import random

import pytest

from carnator_core.calibration import fit as CAL
from carnator_core.calibration import risk_control as RC
from carnator_core.gate import EVIDENCE_CLASSES, GateSettings, RiskModel, decide, evidence_class
from carnator_core.signature import EarlySignature


def _draw(n, rng):
    return [(s, int(rng.random() < s)) for s in (rng.random() for _ in range(n))]


def _certify(pairs, alpha, delta):
    grid = sorted(s for s, _ in pairs)[::5]
    return RC.certify(lambda lam: [y for s, y in pairs if s <= lam], grid, alpha, delta)


def test_binomial_helpers_match_known_values():
    assert RC.binomial_cdf(0, 10, 0.1) == pytest.approx(0.9 ** 10)
    assert RC.binomial_cdf(3, 10, 0.5) == pytest.approx(176 / 1024)
    # 0 failures of n: the exact upper bound solves (1 − p)^n = δ
    assert RC.clopper_pearson_upper(0, 50, 0.05) == pytest.approx(1 - 0.05 ** (1 / 50), rel=1e-6)
    assert RC.clopper_pearson_lower(0, 50, 0.05) == 0.0
    assert RC.clopper_pearson_lower(25, 50, 0.05) < 0.5 < RC.clopper_pearson_upper(25, 50, 0.05)
    assert RC.min_accepted(0.05, 0.1) == 45  # 0.95^45 ≤ 0.1 < 0.95^44
    n = RC.min_tested(0.05, 0.1)  # where a failure rate of α/2 becomes certifiable
    assert RC.binomial_cdf(int(0.025 * n), n, 0.05) <= 0.1 < RC.binomial_cdf(int(0.025 * (n - 1)), n - 1, 0.05)


def test_certified_threshold_holds_with_the_stated_confidence():
    alpha, delta, trials = 0.1, 0.1, 200
    rng = random.Random(7)
    over = 0
    for _ in range(trials):
        res = _certify(_draw(400, rng), alpha, delta)
        over += res["threshold"] is not None and res["threshold"] > 2 * alpha
    # Binomial(200, δ) exceeds 30 with probability < 1%: a broken procedure lands far above
    assert over <= 30, f"certified above λ* in {over}/{trials} draws (δ = {delta})"


def test_certified_threshold_is_close_to_the_truth_with_plenty_of_data():
    res = _certify(_draw(20000, random.Random(3)), 0.1, 0.1)
    assert 0.17 < res["threshold"] <= 0.2
    assert res["upper_bound"] <= 0.1 and res["accepted"] > 3000


def test_too_few_reuses_certify_nothing():
    res = _certify(_draw(30, random.Random(1)), 0.05, 0.1)
    assert res["threshold"] is None and res["tested"] == 0  # 30 < min_accepted(0.05, 0.1)


def _instance(kind, agree, labels):
    """An instance with same-scene (agree) or edit evidence and labels at depths 4…16."""
    feats = ({"outside_mean": 0.002, "outside_max": 0.01, "region_fraction": 0.0, "similarity_gap": 0.001}
             if agree else {"outside_mean": 0.05, "outside_max": 0.33, "region_fraction": 0.15,
                            "similarity_gap": 0.1})
    return {"kind": kind, "features": {**feats, "depth_fraction": 0.0},
            "depths": [{"k": k, "depth_fraction": k / 20, "label": y}
                       for k, y in zip((4, 8, 12, 16), labels)]}


def test_certified_model_reuses_same_scene_deep_and_edits_shallow():
    """Evidence decides depth: a paraphrase is safe at 16 of 20 steps, an edit only at 4."""
    rng = random.Random(0)
    fit_set, cert_set = [], []
    for i in range(400):
        agree = i % 2 == 0
        labels = [0, 0, 0, int(rng.random() < 0.002)] if agree else [0, int(rng.random() < 0.3), 1, 1]
        (fit_set if i < 160 else cert_set).append(
            _instance("same" if agree else "edit", agree, labels))
    cert_set.append(_instance("identical", True, [1, 1, 1, 1]))  # exact repeats never reach the gate
    model = CAL.fit(fit_set, 0.35, form="interaction")
    report = CAL.certify_model(model, cert_set, delta=0.1)
    assert report["instances"] == 240  # the identical pair is left out
    # each evidence class is certified on its own members
    assert {k: c["instances"] for k, c in report["classes"].items()} == {"same_scene": 120, "other": 120}
    assert all("0.05" in model.thresholds[k] for k in EVIDENCE_CLASSES)
    assert model.confidence == pytest.approx(0.9)
    assert all(c["budgets"]["0.05"]["upper_bound"] <= 0.05 for c in report["classes"].values())
    same, edit = (CAL.gate_decision(model, _instance(k, a, [0] * 4), 0.05)
                  for k, a in (("same", True), ("edit", False)))
    assert same["k"] == 16 and edit["k"] == 4, (same, edit)
    # the gate uses the same certified rule, and refuses a budget stricter than any certified
    sig = EarlySignature(1, (1, 1, 1), __import__("torch").zeros(16, 1), None)
    plan, _ = decide(sig, [("e1", sig, 1.0, [4, 8, 12, 16])], 20, 2, model, GateSettings(risk_budget=0.05))
    assert plan.accept and plan.reuse_step == 16 and "certified" in plan.reason
    strict = min(float(a) for a in model.thresholds["same_scene"]) / 2
    plan, _ = decide(sig, [("e1", sig, 1.0, [4, 8, 12, 16])], 20, 2, model,
                     GateSettings(risk_budget=strict))
    assert not plan.accept and "no depth is certified" in plan.reason
    # thresholds survive a save and load
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        path = CAL.save(model, d, "fp")
        loaded = RiskModel.load(path)
    assert loaded.thresholds == model.thresholds and loaded.confidence == model.confidence


def test_evidence_class_reads_only_the_evidence():
    paraphrase = {"region_fraction": 0.004, "similarity_gap": 0.002}
    edit = {"region_fraction": 0.15, "similarity_gap": 0.002}
    far = {"region_fraction": 0.0, "similarity_gap": 0.1}
    assert [evidence_class(f) for f in (paraphrase, edit, far)] == ["same_scene", "other", "other"]


def test_signed_form_learns_that_a_larger_region_is_safer():
    """When M is computed by the request itself, the risk sits in what M missed: synthetic
    edits whose failures fall with M's size. The monotone form must pin M's weights at 0;
    the signed form learns them negative, keeps depth and outside disagreement monotone, and
    its certified gate lets the large-M edit go deeper than the small-M one."""
    rng = random.Random(5)

    def edit(m, labels):
        feats = {"outside_mean": 0.05, "outside_max": 0.3, "region_fraction": m, "similarity_gap": 0.1}
        return {"kind": "edit", "features": {**feats, "depth_fraction": 0.0},
                "depths": [{"k": k, "depth_fraction": k / 20, "label": y} for k, y in zip((4, 8, 12, 16), labels)]}

    def draw(i):
        m = (0.02, 0.3)[i % 2]
        fail = (0.0, 0.3, 0.6, 0.9) if m < 0.1 else (0.0, 0.0, 0.01, 0.4)  # per depth
        return edit(m, [int(rng.random() < f) for f in fail])
    fit_set = [draw(i) for i in range(400)]
    cert_set = [draw(i) for i in range(1200)]
    mono = CAL.fit(fit_set, 0.35, form="interaction")
    signed = CAL.fit(fit_set, 0.35, form="signed")
    # fitted on the edits it ranks: paraphrases (small M, never failing) leave it unchanged
    paraphrases = [_instance("same", True, [0, 0, 0, 0]) for _ in range(200)]
    assert CAL.fit(fit_set + paraphrases, 0.35, form="signed").weights == signed.weights
    assert mono.weights["region_fraction"] == pytest.approx(0, abs=1e-3)
    assert mono.depth_weights["region_fraction"] == pytest.approx(0, abs=1e-3)
    region_effect = signed.weights["region_fraction"] + 0.6 * signed.depth_weights["region_fraction"]
    assert region_effect < -0.1, signed
    assert signed.weights["depth_fraction"] >= 0 and signed.weights["outside_mean"] >= 0
    assert min(signed.depth_weights[k] for k in ("outside_mean", "outside_max")) >= 0
    CAL.certify_model(signed, cert_set, delta=0.1)
    small, large = (CAL.gate_decision(signed, edit(m, [0] * 4), 0.05) for m in (0.02, 0.3))
    assert small is not None and large is not None and large["k"] > small["k"], (small, large)


def _two_finish_edits(n, rng):
    """Edits with a known answer for the gate's choice between two finishes. Score
    s = u + 2·depth (u ~ U(0, 1)); finished every step, k = 4 never fails; at k = 12 both the
    every-step finish and a 4-call region finish (cheaper: 4 + 4·0.25 steps against 8) fail with
    probability u. At a threshold λ in [1.4, 2.2] the gate's rule takes every pair, the region
    finish at k = 12 where u ≤ λ − 1.2 and k = 4 elsewhere: its risk is (λ − 1.2)²/2, so the
    largest λ within α is λ* = 1.2 + √(2α)."""
    edit = {"outside_max": 0.3, "region_fraction": 0.2, "similarity_gap": 0.1}
    out = []
    for _ in range(n):
        u = rng.random()
        fail = int(rng.random() < u)
        out.append({"kind": "edit", "features": {**edit, "outside_mean": u}, "depths": [
            {"k": 4, "depth_fraction": 0.2, "label": 0},
            {"k": 12, "depth_fraction": 0.6, "label": fail},
            {"k": 12, "depth_fraction": 0.6, "label": fail, "finish_calls": 4, "region_steps": 4,
             "token_share": 0.25}]})
    return out


def _score_model():
    return RiskModel(weights={"outside_mean": 1.0, "outside_max": 0.0, "region_fraction": 0.0,
                              "depth_fraction": 2.0, "similarity_gap": 0.0}, bias=0.0,
                     finish_calls={"other": 4}, finish_region={"other": True})


def test_the_joint_threshold_certifies_the_gate_s_own_choice_among_finishes():
    """One λ for both finishes, certified on the decision the gate makes with it: at or below
    λ* in at least 1−δ of calibration draws, close to it with plenty of data, the gate's
    decisions within α on fresh pairs, and the region finish run wherever it is the cheapest
    accepted plan — where certifying each finish on its own leaves it to the few pairs whose
    region finish alone is within α (its reuses cannot average over safe shallow ones)."""
    alpha, delta = 0.05, 0.1
    star = 1.2 + (2 * alpha) ** 0.5
    rng = random.Random(11)
    over = 0
    for _ in range(30):
        model = _score_model()
        report = CAL.certify_model(model, _two_finish_edits(600, rng), delta=delta, budgets=(alpha,),
                                   joint=True)
        lam = model.thresholds["other"].get("0.05")
        assert lam == model.thresholds["other:guided"].get("0.05")  # one λ for both finishes
        assert report["classes"]["other"]["delta"] == delta          # the class's whole δ
        over += lam is not None and lam > star
    assert over <= 8, f"above λ* in {over}/30 draws (δ = {delta}: Binomial(30, 0.1) > 8 has p < 1%)"
    joint, apart = _score_model(), _score_model()
    cal = _two_finish_edits(8000, random.Random(5))
    CAL.certify_model(joint, cal, delta=delta, budgets=(alpha,), joint=True)
    CAL.certify_model(apart, cal, delta=delta, budgets=(alpha,))
    assert star - 0.08 < joint.thresholds["other"]["0.05"] <= star
    fresh = _two_finish_edits(8000, random.Random(6))
    for model in (joint, apart):
        picks = [CAL.gate_decision(model, i, alpha) for i in fresh]
        assert all(p is not None for p in picks)
        assert sum(p["label"] for p in picks) / len(picks) <= alpha
    region = {name: sum(bool(CAL.gate_decision(m, i, alpha).get("finish_calls")) for i in fresh)
              for name, m in (("joint", joint), ("apart", apart))}
    # joint: u ≤ √(2α) ≈ 0.32 of the pairs; apart: u ≤ 2α = 0.1 (where (λ−1.2)/2 ≤ α)
    assert region["joint"] > 0.28 * len(fresh) and region["apart"] < 0.12 * len(fresh)


def test_the_tiny_world_s_bundled_one_step_calibration_is_the_joint_edit_recipe():
    """What a person who sets probe_fraction 0.05 on the bundled tiny world gets: the recipe the
    README's numbers were measured with (M widened and filled on its own tokens, the region
    finish for edits), with one threshold per class certified on the gate's choice among its
    finishes — a per-finish calibration put back here would give edits' region finish its
    own, shallower threshold, or none."""
    import json
    from pathlib import Path
    from carnator_core.gate import calibration_file, class_of_option, option_key
    root = Path(__file__).resolve().parent.parent
    fingerprint = json.loads((root / "bench/results/tinyworld.json").read_text())["settings"]["fingerprint"]
    model = RiskModel.load(calibration_file(root / "models", fingerprint, 0.05))
    assert model.calibrated and model.probe_fraction == pytest.approx(0.05)
    assert model.finish_region == {"other": True} and model.finish_calls["other"] == 4
    assert model.region_fill_on_m and model.region_margin == 1 and model.measured_steps == 20
    # the cells: same-scene evidence, and edits per share of the tokens their reuse recomputes
    cells = [key for key in model.thresholds if ":" not in key]
    for klass in EVIDENCE_CLASSES:
        assert any(model.threshold_for(0.05, c) for c in cells if class_of_option(c) == klass), klass
    for alpha in (0.02, 0.05, 0.1):
        for cell in cells:
            finished = option_key(cell, model.finish_calls[class_of_option(cell)])
            assert model.threshold_for(alpha, finished) == model.threshold_for(alpha, cell), (alpha, cell)


def _risky(n, rng):
    """A population safe below score 0.05 and riskier above than ``_draw``'s: a reuse misses
    tolerance with probability max(0, 3s − 0.15), so the risk among reuses accepted at λ is
    3(λ − 0.05)²/2λ and λ* = 0.15 at α = 10% (``_draw``'s: 0.2)."""
    return [(s, int(rng.random() < max(0.0, 3 * s - 0.15))) for s in (rng.random() for _ in range(n))]


def _strata_decisions(strata):
    """decisions(λ, stratum) for certify_strata over {name: [(score, label)]}."""
    return lambda lam, s: [y for z, y in strata[s] if z <= lam]


def test_stratified_certification_holds_the_budget_in_the_population_the_mix_outvotes():
    """Two populations, one four times the other and riskier above the safest scores: pooled,
    the certified threshold lets the small one miss α; certified in each stratum it holds there."""
    alpha, delta, rng = 0.1, 0.1, random.Random(11)
    common, risky = _draw(8000, rng), _risky(2000, rng)  # λ* = 0.2 and 0.15
    strata = {"common": common, "risky": risky}
    grid = sorted(s for s, _ in common + risky)[::10]
    pooled = RC.certify(lambda lam: [y for s, y in common + risky if s <= lam], grid, alpha, delta)
    both = CAL.certify_strata(_strata_decisions(strata), ["common", "risky"], grid, alpha, delta)
    apart = {s: RC.certify(lambda lam, s=s: [y for z, y in strata[s] if z <= lam], grid, alpha, delta)
             for s in strata}
    assert both["threshold"] == min(r["threshold"] for r in apart.values()) == apart["risky"]["threshold"]
    assert both["binding_strata"] == ["risky"] and set(both["by_stratum"]) == {"common", "risky"}
    rate = lambda lam: sum(y for s, y in risky if s <= lam) / max(1, sum(s <= lam for s, _ in risky))  # noqa: E731
    assert rate(pooled["threshold"]) > alpha >= rate(both["threshold"])
    # a stratum too small to test refuses what the others would certify; one with no reuse
    # in a class is not asked
    small = {**strata, "few": risky[:20]}
    assert CAL.certify_strata(_strata_decisions(small), sorted(small), grid, alpha, delta)["threshold"] is None
    assert CAL.certify_strata(_strata_decisions(strata), ["common"], grid, alpha, delta) == apart["common"]


def test_stratified_certification_holds_with_the_stated_confidence_in_every_stratum():
    """Over independent draws the threshold exceeds the riskier stratum's λ* in at most about
    δ of them, though no stratum's δ is split (an intersection–union test)."""
    alpha, delta, trials, rng = 0.1, 0.1, 150, random.Random(5)
    over = certified = 0
    for _ in range(trials):
        strata = {"a": _draw(1500, rng), "b": _risky(1500, rng)}
        grid = sorted(s for pairs in strata.values() for s, _ in pairs)[::10]
        res = CAL.certify_strata(_strata_decisions(strata), ["a", "b"], grid, alpha, delta)
        certified += res["threshold"] is not None
        over += res["threshold"] is not None and res["threshold"] > 0.15  # b's λ*
    assert certified > trials // 2  # it certifies: the bound below is not met by refusing
    assert over <= 25, f"certified above the riskier stratum's λ* in {over}/{trials} draws"


def test_certify_model_certifies_each_named_stratum_and_reports_it():
    rng = random.Random(2)
    def pairs(n, p_deep, stratum):
        return [{**_instance("same", True, [0, 0, 0, int(rng.random() < p_deep)]), "group": f"{stratum}{i}",
                 "stratum": stratum} for i in range(n)]
    fit_set = pairs(100, 0.01, "a")
    model = CAL.fit([dict(i, features=dict(i["features"])) for i in fit_set] +
                    [_instance("edit", False, [0, 0, 1, 1]) for _ in range(50)], 0.35, form="interaction")
    cert = pairs(300, 0.0, "a") + pairs(300, 0.3, "b")  # b fails a deep reuse 30% of the time
    report = CAL.certify_model(model, cert, delta=0.1, joint=True)
    assert report["strata"] == ["a", "b"]
    res = report["classes"]["same_scene"]["budgets"]["0.05"]
    assert set(res["by_stratum"]) == {"a", "b"} and res["by_stratum"]["a"]["threshold"] == pytest.approx(0.8)
    assert model.thresholds["same_scene"]["0.05"] == pytest.approx(0.6)  # b holds only below 16 of 20
