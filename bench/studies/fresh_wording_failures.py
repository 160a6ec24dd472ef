"""Study: where the budget breaks on requests worded afresh — the other-evidence gate hits of
the fresh-wording workloads against the calibration's own pairs with the same evidence.

    .venv/bin/python bench/studies/fresh_wording_failures.py     # ~1 min, nothing is generated

Reads ``bench/wording.py``'s per-request records (bench/results/wording_parts/) and the
measurements the bundled N = 20 calibration was fitted on (bench/results/studies/
lang2_region4_calibration/ and lang2_region4_scene_edits/), with the calibration's own pairs
worded in ignored words (lang2_region4_wording/, never fitted). Three questions:

1. What the failing hits resumed: the source's noise and scene against the request's.
2. Whether the evidence tells them apart: accepted reuses and how many missed tolerance, per
   cell of the share the reuse computes itself and band of the disagreement outside M
   (``outside_mean``), on the workloads' gate hits and on the calibration's pairs under the
   bundled gate's decisions (``calibration.fit.gate_decision``), at the same α.
3. Whether the text gap's free sign lets worded reuses through (a larger gap lowers the
   ``signed`` form's risk, and ignored words widen the gap without changing the scene): the
   bundled recipe refitted with that weight kept ≥ 0, certified the same way, on the worded pairs.

Writes bench/results/studies/fresh_wording_failures.json.
"""
from __future__ import annotations

import argparse
import glob
import json
import os

from study_paths import REPO  # noqa: E402 - the repository on the path

import carnator_core.risk_model as risk_model  # noqa: E402
from carnator_core.calibration import fit as CAL  # noqa: E402
from carnator_core.calibration.risk_control import clopper_pearson_upper  # noqa: E402
from carnator_core.evidence import evidence_class  # noqa: E402
from carnator_core.risk_model import RiskModel  # noqa: E402
from tinyworld import world as WD  # noqa: E402
from wording_evidence import noise_of  # noqa: E402 - the noise a request starts from

PARTS = os.path.join(REPO, "bench", "results", "wording_parts")
STUDIES = os.path.join(REPO, "bench", "results", "studies")
BUNDLED = os.path.join(REPO, "models", "calibration", "0706ef2962b7d36f497afe0f24c29ec0.probe0.05.json")
FITTED_ON = ("lang2_region4_calibration", "lang2_region4_scene_edits")
WORDED = "lang2_region4_wording"
OUT = os.path.join(STUDIES, "fresh_wording_failures.json")
SHARE_CELLS = ((0.0, 0.25, "<25%"), (0.25, 0.5, "25-50%"), (0.5, 0.75, "50-75%"), (0.75, 1.01, ">75%"))
OUTSIDE_BANDS = ((0.0, 0.05, "<0.05"), (0.05, 0.07, "0.05-0.07"), (0.07, 1.0, ">=0.07"))


def instances_of(*folders: str) -> list[dict]:
    return [i for folder in folders
            for path in sorted(glob.glob(os.path.join(STUDIES, folder, "calibration_measurements.*.jsonl")))
            for i in CAL.load_instances(path)]


def band(value: float, bands) -> str:
    return next(name for lo, hi, name in bands if lo <= value < hi)


def tally(rows: list[tuple[float, float, int]]) -> dict:
    """(reuse share, outside_mean, missed tolerance) → accepted and missed per cell and band."""
    out: dict = {}
    for share, outside, missed in rows:
        cell = out.setdefault(band(share, SHARE_CELLS), {})
        b = cell.setdefault(band(outside, OUTSIDE_BANDS), {"accepted": 0, "beyond_tolerance": 0})
        b["accepted"] += 1
        b["beyond_tolerance"] += int(missed)
    for cell in out.values():
        for b in cell.values():
            b["rate"] = round(b["beyond_tolerance"] / b["accepted"], 4)
            b["upper95"] = round(clopper_pearson_upper(b["beyond_tolerance"], b["accepted"], 0.05), 4)
    return out


def workload_hits(name: str, alpha: str, pool: int, psnr_bound: float) -> dict:
    """The workload's other-evidence gate hits: what their sources were and how they fared."""
    recs = json.load(open(os.path.join(PARTS, f"{name}_n20.json")))["records"][name][alpha]
    lines = [json.loads(x) for x in open(os.path.join(REPO, "bench", "workloads", f"{name}.jsonl")) if x.strip()]
    request_of = {r["stored_id"]: i for i, r in enumerate(recs) if r.get("stored_id")}
    rows, sources = [], {}
    for i, r in enumerate(recs):
        if r["outcome"] != "hit" or not r.get("features") or evidence_class(r["features"]) != "other":
            continue
        missed = CAL.exceeds_tolerance(r["psnr"], r["ok_full"], r["ok"], psnr_bound)
        rows.append((r["features"]["reuse_share"], r["features"]["outside_mean"], missed))
        j = request_of.get(r["entry_id"])
        if j is None:
            key = "source not in the records"
        else:
            noise = "same noise" if noise_of(lines[i], pool) == noise_of(lines[j], pool) else "other noise"
            scene = "same scene" if WD.scene_key(lines[i]["scene"]) == WD.scene_key(lines[j]["scene"]) \
                else "other scene"
            key = f"{noise}, {scene}"
        s = sources.setdefault(key, {"accepted": 0, "beyond_tolerance": 0})
        s["accepted"] += 1
        s["beyond_tolerance"] += missed
    return {"gate_hits": len(rows), "beyond_tolerance": sum(m for *_, m in rows),
            "by_source": sources, "by_cell": tally(rows)}


def calibration_decisions(model: RiskModel, instances: list[dict], alpha: float) -> dict:
    """The bundled gate's decisions on calibration pairs of other evidence, per cell and band."""
    rows = []
    for inst in instances:
        if evidence_class(inst["features"]) != "other":
            continue
        d = CAL.gate_decision(model, inst, alpha)
        if d is not None:
            rows.append((CAL.evidence_of(inst)["reuse_share"], inst["features"]["outside_mean"], d["label"]))
    return {"accepted": len(rows), "beyond_tolerance": sum(m for *_, m in rows), "by_cell": tally(rows)}


def refit(instances: list[dict], bundled: RiskModel, free: tuple[str, ...]) -> RiskModel:
    """The bundled recipe (one threshold per cell for all its finishes) fitted again with these
    weights of the signed form free in sign.
    The form reads its free weights from the module's constant: set for this one fit."""
    kept = risk_model.SIGNED_FREE
    risk_model.SIGNED_FREE = free
    try:
        model, _ = CAL.fit_and_certify(instances, bundled.region_threshold, form="signed",
                                       probe_fraction=bundled.probe_fraction, joint=True,
                                       region_share_bounds=bundled.region_share_bounds)
    finally:
        risk_model.SIGNED_FREE = kept
    return model


def held_out_and_worded(model: RiskModel, held: list[dict], worded: list[dict], alphas) -> dict:
    edits = [i for i in worded if evidence_class(i["features"]) == "other"]
    out = {"weights": {k: round(v, 4) for k, v in model.weights.items()},
           "depth_weights": {k: round(v, 4) for k, v in model.depth_weights.items()}}
    for label, insts in (("held_out", held), ("worded", worded), ("worded_other_evidence", edits)):
        out[label] = {a: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in e.items()
                          if k in ("accepted", "false_accepts", "false_accept_rate", "false_accept_upper95",
                                   "mean_depth_fraction")}
                      for a, e in CAL.evaluate(model, insts, alphas).items()}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--alpha", default="0.05")
    ap.add_argument("--noise-pool", type=int, default=4, help="bench/tinyworld.py NOISE_POOL")
    ap.add_argument("--psnr-bound", type=float, default=30.0)
    ap.add_argument("--no-refit", action="store_true", help="leave out question 3 (the refits)")
    ap.add_argument("--out", default=OUT)
    a = ap.parse_args(argv)
    bundled = RiskModel.load(BUNDLED)
    fitted_on, worded = instances_of(*FITTED_ON), instances_of(WORDED)
    alpha = float(a.alpha)
    result = {"alpha": a.alpha, "calibration": os.path.relpath(BUNDLED, REPO),
              "share_cells": [c for *_, c in SHARE_CELLS], "outside_bands": [b for *_, b in OUTSIDE_BANDS],
              "workloads": {name: workload_hits(name, a.alpha, a.noise_pool, a.psnr_bound)
                            for name in ("serve_fresh", "iterate_fresh")},
              # the bundled pairs are both sides of its fit: the ranking learned on some, certified on the rest
              "calibration_pairs": {"bundled": calibration_decisions(bundled, fitted_on, alpha),
                                    "worded_in_ignored_words": calibration_decisions(bundled, worded, alpha)}}
    if not a.no_refit:
        held = CAL.split(fitted_on, CAL.CERTIFY_SHARE)[1]
        alphas = (0.05, 0.1)
        result["text_gap_sign"] = {
            "free (the bundled recipe)": held_out_and_worded(
                refit(fitted_on, bundled, risk_model.SIGNED_FREE), held, worded, alphas),
            "kept >= 0": held_out_and_worded(
                refit(fitted_on, bundled, tuple(f for f in risk_model.SIGNED_FREE if f != "similarity_gap")),
                held, worded, alphas)}
    for name, w in result["workloads"].items():
        print(f"{name}: {w['beyond_tolerance']} of {w['gate_hits']} other-evidence gate hits beyond "
              f"tolerance; sources {w['by_source']}")
    for name, c in result["calibration_pairs"].items():
        print(f"calibration pairs {name}: {c['beyond_tolerance']} of {c['accepted']} accepted beyond tolerance")
    print("50-75% cell:", json.dumps({k: v["by_cell"].get("50-75%") for k, v in
                                      {**result["workloads"], **result["calibration_pairs"]}.items()}))
    for form, r in result.get("text_gap_sign", {}).items():
        print(f"text gap {form}: worded other evidence {r['worded_other_evidence']}")
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    return result


if __name__ == "__main__":
    main()
