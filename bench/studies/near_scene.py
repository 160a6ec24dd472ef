"""What would reading fresh wording's near misses as same-scene give, and could it be certified?

Two readings of committed files, nothing generated:

- **Speed.** The traffic-stratified calibration's runs of the fresh-wording workloads at α = 5%
  (bench/wording.py's parts): gate hits as served, and as if every hit whose scene was computed
  in full before but whose evidence read *other* had been a same-scene hit (the probe step and
  the guided finish's 4 calls: 5 steps computed).
- **Risk.** The scene pairs worded as that traffic (each scene worded twice): directions whose
  evidence lies outside the same-scene cut-offs but within twice both ("near"), against the
  same-scene ones, by depth of the guided 4-call finish: how often each misses tolerance.

    .venv/bin/python bench/studies/near_scene.py   # → bench/results/studies/near_scene.json
"""
from __future__ import annotations

import argparse
import json
import os

from study_paths import REPO

from carnator_core.evidence import SAME_SCENE_GAP, SAME_SCENE_REGION, evidence_class
from certification_power import STUDIES, guided_labels, measured
from wording import seen_before

ALPHA = "0.05"
PARTS = "held_out_half_more_scenes_parts"
WORKLOADS = ("serve_fresh_half", "iterate_fresh_half", "serve")
SAME_SCENE_STEPS = 5.0  # 1 probe step + 4 guided calls
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
    near = (features["region_fraction"] <= 2 * SAME_SCENE_REGION
            and features["similarity_gap"] <= 2 * SAME_SCENE_GAP)
    return "near" if near else "far"


def guided_risk_by_band() -> dict:
    out: dict = {}
    for inst in measured(SCENE_PAIRS):
        b = out.setdefault(band(inst["features"]), {"directions": 0, "by_depth": {}})
        b["directions"] += 1
        for depth, label in guided_labels(inst).items():
            t = b["by_depth"].setdefault(f"{depth:g}", {"reuses": 0, "beyond": 0})
            t["reuses"] += 1
            t["beyond"] += label
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(STUDIES, "near_scene.json"))
    a = ap.parse_args(argv)
    result = {"alpha": float(ALPHA), "parts": f"bench/results/studies/{PARTS}",
              "speed": {w: gate_hit_speed(w) for w in WORKLOADS},
              "scene_pairs": SCENE_PAIRS, "guided_finish_by_band": guided_risk_by_band()}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    for w, r in result["speed"].items():
        print(f"{w}: gate hits {r['gate_hit_speedup']:.2f}x; {r['seen_scene_hits_read_other']} seen-scene hits read "
              f"other; as same-scene hits {r['gate_hit_speedup_if_same_scene']:.2f}x")
    for name, b in result["guided_finish_by_band"].items():
        depths = ", ".join(f"{d}: {t['beyond']}/{t['reuses']}" for d, t in sorted(b["by_depth"].items()))
        print(f"{name}: {b['directions']} directions; guided finish beyond tolerance {depths}")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
