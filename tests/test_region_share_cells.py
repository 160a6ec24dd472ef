"""Other evidence is certified per bin of the token share its reuse computes itself.

A reuse that recomputes most of the frame along a coarse fill is a different reuse from one
that recomputes a sixth of it. Synthetic calibrations with a known answer: the two kinds have
identical evidence features (so no ranking can tell them apart) and differ only in the share
of the tokens their widened region M covers; the large ones fail deep, the small ones do not.
One class for all other evidence lets the large ones through deep on the small ones' record;
share cells keep each kind to what its own reuses showed, and a cell the calibration did not
cover is refused with a reason.
"""
import random

import pytest
import torch

from carnator_core.calibration import fit as CAL
from carnator_core.gate import (REGION_SHARE_BOUNDS, GateSettings, RiskModel, decide,
                                share_cell)
from carnator_core.risk_model_check import CalibrationRejected
from carnator_core.signature import EarlySignature

EDIT = {"outside_mean": 0.05, "outside_max": 0.33, "region_fraction": 0.15, "similarity_gap": 0.1}
DEPTHS = (4, 8, 12, 16)


def _edit(share: float, labels: list[int], recorded: bool = True) -> dict:
    """An edit pair whose reuses compute ``share`` of the tokens: recorded in the features,
    or (``recorded`` False) only in its region-finish depth records, as measurements keep it."""
    feats = {**EDIT, "depth_fraction": 0.0, **({"reuse_share": share} if recorded else {})}
    depths = [{"k": k, "depth_fraction": k / 20, "label": y, **({} if recorded else {"token_share": share})}
              for k, y in zip(DEPTHS, labels)]
    return {"kind": "edit", "features": feats, "depths": depths}


def _calibration(seed: int, small: int = 300, large: int = 40) -> list[dict]:
    rng = random.Random(seed)
    pairs = [_edit(0.3, [int(rng.random() < 0.01) for _ in DEPTHS]) for _ in range(small)]
    pairs += [_edit(0.9, [0, 1, 1, 1]) for _ in range(large)]  # safe only at the shallowest depth
    return pairs


def _certified(bounds, seed=0, **kw) -> RiskModel:
    pairs = _calibration(seed, **kw)
    model = CAL.fit(pairs[::3], 0.35, form="interaction")  # the ranking: depth, the evidence being equal
    model.region_share_bounds = list(bounds)
    CAL.certify_model(model, pairs, delta=0.1)
    return model


def test_one_class_for_all_other_evidence_lets_large_regions_through_deep():
    """The failure the cells fix: pooled, the large-region reuses ride on the small ones'."""
    model = _certified([])
    large = CAL.gate_decision(model, _edit(0.9, [0] * 4), 0.2)
    assert large is not None and large["k"] >= 8  # deep, where every such reuse fails


def test_share_cells_accept_small_regions_deep_and_large_ones_shallow():
    model = _certified(REGION_SHARE_BOUNDS)
    assert set(model.thresholds) >= {"other/50", "other/100"}
    for alpha in (0.05, 0.1, 0.2):
        small = CAL.gate_decision(model, _edit(0.3, [0] * 4), alpha)
        large = CAL.gate_decision(model, _edit(0.9, [0] * 4), alpha)
        assert small is not None and small["k"] == 16, (alpha, small)
        assert large is None or large["k"] == 4, (alpha, large)
    # the large cell's own reuses, accepted where its threshold lets them, keep the budget
    held = _calibration(seed=1)
    for a, row in CAL.evaluate(model, held).items():
        assert row["false_accept_rate"] <= float(a), (a, row)


def test_a_cell_the_calibration_did_not_cover_is_refused_with_a_reason():
    """No large-region reuse in the calibration: that cell certifies nothing, and the gate
    refuses there instead of borrowing the small cell's threshold."""
    model = _certified(REGION_SHARE_BOUNDS, small=300, large=0)
    assert model.threshold_for(0.05, "other/100") is None
    assert model.threshold_for(0.05, "other/50") is not None
    assert CAL.gate_decision(model, _edit(0.9, [0] * 4), 0.05) is None
    # through the gate itself: a region the run maps to 90% of its tokens
    new = EarlySignature(1, (1, 2, 2), torch.tensor([[5.0, 1.0, 1.0, 1.0]] * 4), None)
    old = EarlySignature(1, (1, 2, 2), torch.ones(4, 4), None)
    plan, _ = decide(new, [("e1", old, 0.9, [4, 8, 12, 16])], 20, 2, model,
                     GateSettings(risk_budget=0.05), region_share=lambda region: 0.9)
    assert not plan.accept and plan.features["reuse_share"] == pytest.approx(0.9)
    assert "75–100% of the tokens" in plan.reason and "not extrapolated" in plan.reason
    plan, _ = decide(new, [("e1", old, 0.9, [4, 8, 12, 16])], 20, 2, model,
                     GateSettings(risk_budget=0.05), region_share=lambda region: 0.3)
    assert plan.accept and plan.reuse_step == 16 and "25–50% of the tokens" in plan.reason


def test_the_share_is_read_from_measurements_that_did_not_record_it():
    """Calibration files measured before the cells keep the share in their region-finish
    records (``token_share``) or in what the fill on M's tokens cost."""
    assert CAL.reuse_share(_edit(0.62, [0] * 4, recorded=False)) == pytest.approx(0.62)
    filled = {"features": {**EDIT}, "depths": [
        {"k": 10, "fill_steps": 3.1875, "fill_calls": 2, "fill_region_calls": 2}]}
    assert CAL.reuse_share(filled) == pytest.approx(0.59375, abs=1e-4)
    assert CAL.reuse_share({"features": {**EDIT, "region_fraction": 0.0}, "depths": []}) == 0.0
    assert CAL.reuse_share({"features": {**EDIT}, "depths": [{"k": 4}]}) == 1.0  # M was every token


def test_cells_survive_a_save_and_a_checked_load(tmp_path):
    model = _certified(REGION_SHARE_BOUNDS)
    path = CAL.save(model, tmp_path, "f" * 32)
    loaded = RiskModel.load(path)
    assert loaded.region_share_bounds == list(REGION_SHARE_BOUNDS)
    assert loaded.thresholds == model.thresholds
    assert share_cell("other", 0.9, loaded.region_share_bounds) == "other/100"
    assert share_cell("same_scene", 0.9, loaded.region_share_bounds) == "same_scene"
    assert share_cell("other", 0.9, []) == "other"  # files without bins: one class
    import json
    data = json.loads(path.read_text())
    for bad in ([0.5, 0.9], [0.5, 0.25, 1.0], [0.333, 1.0], "all"):
        path.write_text(json.dumps({**data, "region_share_bounds": bad}))
        with pytest.raises(CalibrationRejected, match="region_share_bounds"):
            RiskModel.load(path)
    path.write_text(json.dumps({**data, "thresholds": {**data["thresholds"], "other/60": {"0.05": -2.0}}}))
    with pytest.raises(CalibrationRejected, match="other/60"):
        RiskModel.load(path)


def test_every_budget_s_thresholds_are_reported_side_by_side():
    model = _certified(REGION_SHARE_BOUNDS)
    rows = {r["cell"]: r for r in CAL.thresholds_side_by_side(model)}
    assert set(rows) == set(model.thresholds)
    for key, row in rows.items():
        pairs = sorted((float(a), lam) for a, lam in row["thresholds"].items())
        same = [[f"{a1:g}", f"{a2:g}"] for (a1, l1), (a2, l2) in zip(pairs, pairs[1:]) if l1 == l2]
        assert row["coinciding_budgets"] == same
