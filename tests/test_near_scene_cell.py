"""Near-scene evidence (other evidence within twice both same-scene cut-offs) may be certified
as a cell of its own instead of in the bin of its token share.

Synthetic calibrations with a known answer: near-scene pairs and edits compute the same share
of the tokens (one share bin) and are ranked alike (by depth); the near-scene ones stay within
tolerance deep and the edits fail there. Pooled in the bin, the near-scene pairs are held to
the edits' shallow depth; in their own cell they are certified deep while the edits keep
theirs. A population with too few near-scene pairs to test refuses the cell for all, as every
cell is certified in each.
"""
import json
import random

import pytest

from carnator_core.calibration import fit as CAL
from carnator_core.calibration.audit import calibration_id
from carnator_core.gate import FEATURES, NEAR_SCENE_CELL, REGION_SHARE_BOUNDS, RiskModel, share_bin_text
from carnator_core.evidence import evidence_class, near_scene
from carnator_core.risk_model_check import CalibrationRejected

NEAR = {"outside_mean": 0.02, "outside_max": 0.2, "region_fraction": 0.03, "similarity_gap": 0.008}
EDIT = {"outside_mean": 0.05, "outside_max": 0.33, "region_fraction": 0.15, "similarity_gap": 0.1}
DEPTHS = (4, 8, 12, 16)


def _pair(evidence: dict, labels: list[int], stratum: str = "") -> dict:
    feats = {**evidence, "depth_fraction": 0.0, "reuse_share": 0.2}  # both in the 0–25% bin
    return {"kind": "pair", "stratum": stratum, "features": feats,
            "depths": [{"k": k, "depth_fraction": k / 20, "label": y} for k, y in zip(DEPTHS, labels)]}


def _calibration(seed: int, near: int = 200, edits: int = 200, stratum: str = "") -> list[dict]:
    rng = random.Random(seed)
    pairs = [_pair(NEAR, [int(rng.random() < 0.005) for _ in DEPTHS], stratum) for _ in range(near)]
    pairs += [_pair(EDIT, [0] + [int(rng.random() < 0.3) for _ in DEPTHS[1:]], stratum) for _ in range(edits)]
    return pairs


def _certified(pairs: list[dict], near_cell: bool) -> RiskModel:
    # a ranking by depth alone, as one that cannot tell these edits from near-scene pairs
    model = RiskModel(weights={k: 0.0 for k in FEATURES} | {"depth_fraction": 4.0}, bias=-4.0, calibrated=True)
    model.region_share_bounds = list(REGION_SHARE_BOUNDS)
    model.near_scene_cell = near_cell
    CAL.certify_model(model, pairs, delta=0.1)
    return model


def test_near_scene_is_other_evidence_within_twice_both_cut_offs():
    assert evidence_class(NEAR) == "other" and near_scene(NEAR)
    assert not near_scene({**NEAR, "region_fraction": 0.05})
    assert not near_scene({**NEAR, "similarity_gap": 0.011})
    assert not near_scene({**NEAR, "region_fraction": 0.01, "similarity_gap": 0.004})  # same-scene
    assert not near_scene(EDIT)


def test_its_own_cell_certifies_near_scene_pairs_deep_and_keeps_edits_shallow():
    pairs = _calibration(0)
    pooled, apart = _certified(pairs, False), _certified(pairs, True)
    near, edit = _pair(NEAR, [0] * 4), _pair(EDIT, [0] * 4)
    assert pooled.cell(CAL.evidence_of(near)) == "other/25"
    assert apart.cell(CAL.evidence_of(near)) == NEAR_SCENE_CELL
    assert apart.cell(CAL.evidence_of(edit)) == "other/25"
    assert NEAR_SCENE_CELL not in pooled.thresholds and NEAR_SCENE_CELL in apart.thresholds
    pooled_pick = CAL.gate_decision(pooled, near, 0.05)
    apart_pick = CAL.gate_decision(apart, near, 0.05)
    assert pooled_pick is None or pooled_pick["k"] <= 4  # held to the edits' record
    assert apart_pick is not None and apart_pick["k"] == 16
    edit_pick = CAL.gate_decision(apart, edit, 0.05)
    assert edit_pick is None or edit_pick["k"] <= 4
    for a, row in CAL.evaluate(apart, _calibration(1)).items():
        assert row["false_accept_rate"] <= float(a), (a, row)


def test_a_population_with_too_few_near_scene_pairs_refuses_the_cell():
    """Each population certifies each cell: one with 10 near-scene pairs cannot test 5%
    (clean, they bound the risk at 21% only), so the cell is refused though the other would
    certify it; the share bins the small population covers stay certified."""
    pairs = _calibration(0, stratum="traffic") + _calibration(2, near=10, edits=200, stratum="own")
    model = _certified(pairs, True)
    assert model.threshold_for(0.05, NEAR_SCENE_CELL) is None
    assert CAL.gate_decision(model, _pair(NEAR, [0] * 4), 0.05) is None
    alone = _certified(_calibration(0, stratum="traffic"), True)
    assert alone.threshold_for(0.05, NEAR_SCENE_CELL) is not None


def test_the_cell_survives_a_checked_load_and_needs_its_flag(tmp_path):
    model = _certified(_calibration(0), True)
    path = CAL.save(model, tmp_path, "f" * 32)
    loaded = RiskModel.load(path)
    assert loaded.near_scene_cell and loaded.thresholds == model.thresholds
    assert loaded.cell(CAL.evidence_of(_pair(NEAR, [0] * 4))) == NEAR_SCENE_CELL
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "near_scene_cell": False}))
    with pytest.raises(CalibrationRejected, match=NEAR_SCENE_CELL):
        RiskModel.load(path)  # thresholds for a cell the file says it has not
    path.write_text(json.dumps({**data, "near_scene_cell": "yes"}))
    with pytest.raises(CalibrationRejected, match="near_scene_cell"):
        RiskModel.load(path)
    assert "near-scene evidence" in share_bin_text(NEAR_SCENE_CELL, REGION_SHARE_BOUNDS)


def test_files_without_the_cell_keep_their_identity(tmp_path):
    """Audits are kept per calibration id: a file written before the cell, loaded, has the id
    it had, and the cell makes another calibration."""
    model = _certified(_calibration(0), False)
    path = CAL.save(model, tmp_path, "f" * 32)
    data = json.loads(path.read_text())
    del data["near_scene_cell"]
    path.write_text(json.dumps(data))
    before = RiskModel.load(path)
    assert calibration_id(before) == calibration_id(model)
    model.near_scene_cell = True
    assert calibration_id(model) != calibration_id(before)


def test_the_committed_fit_with_the_cell_loads_checked_and_refuses_the_cell_at_5_percent():
    """The fit docs/studies.md reports: a file the gate loads, the cell certified from 30% (its
    bundled population has too few near-scene pairs to test 5%), same-scene reuse as without it."""
    from pathlib import Path
    folder = Path(__file__).resolve().parents[1] / "bench" / "results" / "studies"
    path, = (folder / "lang2_region4_stratified_near_scene_calibration" / "calibration").glob("*.json")
    model = RiskModel.load(path)
    assert model.near_scene_cell and model.calibrated
    assert model.threshold_for(0.05, NEAR_SCENE_CELL) is None
    assert model.threshold_for(0.1, NEAR_SCENE_CELL) is None
    assert model.threshold_for(0.3, NEAR_SCENE_CELL) is not None
    assert model.threshold_for(0.05, "same_scene") == pytest.approx((0.05, 0.7))
    assert model.cell({**NEAR, "depth_fraction": 0.5, "reuse_share": 0.2}) == NEAR_SCENE_CELL
