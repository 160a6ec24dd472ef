"""What would reading fresh wording's near misses as same-scene give, and could it be certified?

Two readings of committed files, nothing generated:

- **Speed.** The traffic-stratified calibration's runs of the fresh-wording workloads at α = 5%
  (bench/wording.py's parts): gate hits as served, and as if every hit whose scene was computed
  in full before but whose evidence read *other* had been a same-scene hit (the probe step and
  the guided finish's 4 calls: 5 steps computed).
- **Risk.** The scene pairs worded as that traffic (each scene worded twice): directions whose
  evidence lies outside the same-scene cut-offs but within twice both ("near"), against the
  same-scene ones, by depth of the guided 4-call finish: how often each misses tolerance.
- **A cell of its own.** The same fit with near-scene evidence certified apart
  (``bench/calibrate.py … --near-scene-cell``, ``CELL_FIT``): what each population certifies
  for it, and the run of ``serve_fresh_half`` and ``serve`` with a what-if file that takes the
  traffic population's own thresholds for the cell as if the bundled one had certified them
  too (``--whatif-model`` writes it; ``WHATIF`` holds it and its ``bench/wording.py`` run).

    .venv/bin/python bench/studies/near_scene.py   # → bench/results/studies/near_scene.json
    .venv/bin/python bench/studies/near_scene.py \
        --whatif-model bench/results/studies/near_scene_cell_whatif/calibration.json
    nice .venv/bin/python bench/wording.py --workloads serve_fresh_half --risk-model <that file> \
        --out bench/results/studies/near_scene_cell_whatif/wording.json   # and serve, ~12 min each
"""
from __future__ import annotations

import argparse
import json
import os

from study_paths import REPO

from carnator_core.evidence import (NEAR_SCENE_CELL, NEAR_SCENE_REACH, SAME_SCENE_GAP, SAME_SCENE_REGION,
                                    evidence_class, near_scene)
from certification_power import GUIDED_CALLS, STUDIES, guided_labels, measured
from wording import seen_before

ALPHA = "0.05"
PARTS = "held_out_half_more_scenes_parts"
WORKLOADS = ("serve_fresh_half", "iterate_fresh_half", "serve")
SAME_SCENE_STEPS = 5.0  # 1 probe step + 4 guided calls
CELL_FIT = "lang2_region4_stratified_near_scene_calibration"
TRAFFIC_FIT = [f"lang2_region4_held_out_half{part}/calibration_measurements.{i}-of-2.jsonl"
               for part in ("", "_scenes_more") for i in (0, 1)]  # its traffic population
WHATIF = "near_scene_cell_whatif"
SCENE_PAIRS = [f"lang2_region4_held_out_half_scenes{more}/calibration_measurements.{i}-of-2.jsonl"
               for more in ("", "_more") for i in (0, 1)]


def gate_hit_speed(workload: str) -> dict:
    with open(os.path.join(REPO, "bench", "workloads", f"{workload}.jsonl")) as f:
        lines = [json.loads(x) for x in f]
    with open(os.path.join(STUDIES, PARTS, f"{workload}_n20.json")) as f:
        records = json.load(f)["records"][workload][ALPHA]
    total = computed = as_same = 0.0
    read_other = 0
    for _, rec, seen in seen_before(lines, records):
        if rec["outcome"] != "hit":
            continue
        other = seen and rec.get("features") and evidence_class(rec["features"]) != "same_scene"
        read_other += bool(other)
        total += rec["steps_total"]
        computed += rec["steps_computed"]
        as_same += SAME_SCENE_STEPS if other else rec["steps_computed"]
    return {"gate_hit_speedup": total / computed, "seen_scene_hits_read_other": read_other,
            "gate_hit_speedup_if_same_scene": total / as_same}


def band(features: dict) -> str:
    if evidence_class(features) == "same_scene":
        return "same_scene"
    return "near" if near_scene(features) else "far"


def tally(files: list[str], band_of, labels_of=guided_labels) -> dict:
    """Per band of the evidence (``band_of``; None: left out), its directions in these files
    and, by depth, their reuses ``labels_of`` reads and how many are beyond tolerance."""
    out: dict = {}
    for inst in measured(files):
        name = band_of(inst["features"])
        if name is None:
            continue
        b = out.setdefault(name, {"directions": 0, "by_depth": {}})
        b["directions"] += 1
        for depth, label in labels_of(inst).items():
            t = b["by_depth"].setdefault(f"{depth:g}", {"reuses": 0, "beyond": 0})
            t["reuses"] += 1
            t["beyond"] += label
    return out


def guided_risk_by_band() -> dict:
    return tally(SCENE_PAIRS, band)


def _cell_fit() -> tuple[dict, str]:
    folder = os.path.join(STUDIES, CELL_FIT)
    with open(os.path.join(folder, "calibration_report.probe0.05.json")) as f:
        report = json.load(f)
    model = os.path.join(folder, "calibration", os.listdir(os.path.join(folder, "calibration"))[0])
    return report, model


def cell_certified() -> dict:
    """Per budget, the near-scene cell's threshold, and each population's own test of it."""
    report, _ = _cell_fit()
    budgets = report["certification"]["classes"][NEAR_SCENE_CELL]["budgets"]
    return {a: {"threshold": b["threshold"],
                "by_stratum": {s: {k: t[k] for k in ("threshold", "accepted", "failures", "tested")}
                               for s, t in b.get("by_stratum", {}).items()}}
            for a, b in budgets.items() if a in ("0.05", "0.1")}


def write_whatif_model(path: str) -> None:
    """The cell fit's file with the near-scene cell at 5% and 10% set to the thresholds the
    traffic population alone certifies (stratum "1"): not a calibration, a what-if."""
    _, model = _cell_fit()
    with open(model) as f:
        data = json.load(f)
    for a, row in cell_certified().items():
        lam = row["by_stratum"]["1"]["threshold"]
        for key in (NEAR_SCENE_CELL, f"{NEAR_SCENE_CELL}:guided"):
            data["thresholds"].setdefault(key, {})[a] = lam
    data["source"] += ("; WHAT-IF: the near-scene cell's thresholds at 5% and 10% are the traffic "
                       "population's alone, not certified in the bundled one")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2)


def whatif_decisions() -> dict:
    """The what-if file's gate decisions at 5% on the cell fit's traffic near-scene directions
    (``calibration.fit.gate_decision``): how many resume at each depth k, by finish."""
    from carnator_core.calibration import fit as CAL
    from carnator_core.gate import RiskModel
    model = RiskModel.load(os.path.join(STUDIES, WHATIF, "calibration.json"))
    out: dict = {}
    for inst in measured(TRAFFIC_FIT):
        if near_scene(inst["features"]):
            d = CAL.gate_decision(model, inst, float(ALPHA))
            key = "refused" if d is None else f"k={d['k']}, " + (
                f"{d['finish_calls']}-call guided finish" if d.get("finish_calls") else "every step")
            out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


def whatif_served(workload: str) -> dict:
    """The what-if run at 5%: gate hits (its bench/wording.py row), and its hits on near-scene
    evidence (depth, steps; its records)."""
    with open(os.path.join(STUDIES, WHATIF, "wording.json")) as f:
        row = json.load(f)["rows"][f"{workload}/n20"]["budgets"][ALPHA]
    with open(os.path.join(STUDIES, WHATIF, "wording_parts", f"{workload}_n20.json")) as f:
        records = json.load(f)["records"][workload][ALPHA]
    near = [r for r in records if r["outcome"] == "hit" and r.get("features") and near_scene(r["features"])]
    return {"gate_hit_speedup": row["gate_hit_speedup_steps"],
            "near_scene_hits": [{"k": r["reuse_step"], "steps_computed": r["steps_computed"]} for r in near]}


def wider_gap(features: dict) -> str | None:
    """Same-scene, or within twice the global gap with no more tiles moved ("wider")."""
    if evidence_class(features) == "same_scene":
        return "same_scene"
    wider = (features["region_fraction"] <= SAME_SCENE_REGION
             and features["similarity_gap"] <= NEAR_SCENE_REACH * SAME_SCENE_GAP)
    return "wider" if wider else None


def guided_risk_wider_gap() -> dict:
    """The cell fit's traffic pairs: guided-finish reuses beyond tolerance by depth, for
    same-scene directions and for those a twice-as-wide gap would add (where measured)."""
    return tally(TRAFFIC_FIT, wider_gap)


def other_finish_labels(inst: dict) -> dict[float, int]:
    """Per depth share, the label of the 4-call guided finish other evidence runs (computing
    region M between its calls where M has tiles)."""
    return {round(d["depth_fraction"], 2): int(d["label"]) for d in inst["depths"]
            if int(d.get("finish_calls", 0)) == GUIDED_CALLS}


def near_risk_as_other() -> dict:
    """The cell fit's traffic pairs, near-scene directions, with the finish other evidence runs:
    what the near-scene cell is certified on."""
    return tally(TRAFFIC_FIT, lambda f: "near" if near_scene(f) else None, other_finish_labels)["near"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(STUDIES, "near_scene.json"))
    ap.add_argument("--whatif-model", default=None, metavar="JSON", help="write the what-if file and stop")
    a = ap.parse_args(argv)
    if a.whatif_model:
        return write_whatif_model(a.whatif_model)
    result = {"alpha": float(ALPHA), "parts": f"bench/results/studies/{PARTS}",
              "speed": {w: gate_hit_speed(w) for w in WORKLOADS},
              "scene_pairs": SCENE_PAIRS, "guided_finish_by_band": guided_risk_by_band(),
              "cell": {"fit": f"bench/results/studies/{CELL_FIT}", "certified": cell_certified(),
                       "whatif_on_traffic_pairs": whatif_decisions(),
                       "whatif": {w: whatif_served(w) for w in ("serve_fresh_half", "serve")}},
              "traffic_fit_pairs": TRAFFIC_FIT, "near_scene_as_other": near_risk_as_other(),
              "guided_finish_wider_gap": guided_risk_wider_gap()}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    for w, r in result["speed"].items():
        print(f"{w}: gate hits {r['gate_hit_speedup']:.2f}x; {r['seen_scene_hits_read_other']} seen-scene hits read "
              f"other; as same-scene hits {r['gate_hit_speedup_if_same_scene']:.2f}x")
    for name, b in result["guided_finish_by_band"].items():
        depths = ", ".join(f"{d}: {t['beyond']}/{t['reuses']}" for d, t in sorted(b["by_depth"].items()))
        print(f"{name}: {b['directions']} directions; guided finish beyond tolerance {depths}")
    for w, r in result["cell"]["whatif"].items():
        print(f"what-if {w}: gate hits {r['gate_hit_speedup']:.2f}x; near-scene hits (k, steps) "
              f"{[(h['k'], round(h['steps_computed'], 1)) for h in r['near_scene_hits']]}")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
