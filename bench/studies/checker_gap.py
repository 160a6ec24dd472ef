"""Where the checker gap between Carnator and full computation comes from, per workload and budget.

Reads benchmark result files written with ``--records`` and splits the requests whose full
computation the checker judged right but whose Carnator result it judged wrong by how the
result was made: a gate hit (a reuse decision), an exact repeat that re-served a stored hit's
result (the same decision served again), or anything else; beside them, the requests Carnator
got right where full computation did not.

    python bench/studies/checker_gap.py bench/results/studies/tinyworld_lang2_region4_iterate.json \
        --out bench/results/studies/checker_gap_lang2.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def decompose(records: list[dict], psnr_bound: float = 30.0) -> dict:
    """``psnr_bound``: the run's PSNR bound, to tell a broken gate hit whose PSNR fell below
    it from one whose PSNR stayed above it (only the checker's verdict changed). Tolerance
    counts both as beyond it (calibration.exceeds_tolerance): each is a false accept."""
    made_by = {r["stored_id"]: r for r in records if r.get("stored_id")}

    def re_serves_hit(r: dict) -> bool:  # an exact repeat returning a stored hit's result
        return r["outcome"] == "exact" and made_by.get(r.get("entry_id"), {}).get("outcome") == "hit"

    broke = {"gate_hit": 0, "exact_reserving_hit": 0, "other": 0}
    broke_edits: dict[str, int] = {}
    above = 0
    for r in records:
        if not (r["ok_full"] and not r["ok"]):
            continue
        if r["outcome"] == "hit":
            kind = "gate_hit"
            edit = r.get("edit") or "?"
            broke_edits[edit] = broke_edits.get(edit, 0) + 1
            above += r.get("psnr", 0.0) >= psnr_bound
        else:
            kind = "exact_reserving_hit" if re_serves_hit(r) else "other"
        broke[kind] += 1
    fixed = sum(1 for r in records if r["ok"] and not r["ok_full"])
    n = len(records)
    right, right_full = sum(r["ok"] for r in records), sum(r["ok_full"] for r in records)
    return {
        "requests": n,
        "checker": right / n,
        "checker_full": right_full / n,
        "gap_points": 100.0 * (right_full - right) / n,
        "broke": broke, "broke_gate_hits_by_edit": broke_edits, "fixed": fixed,
        "broke_gate_hits_above_psnr_bound": above, "psnr_bound": psnr_bound,
        # the gap if each reuse decision counted once (its exact repeats left out)
        "gap_points_decisions_once": 100.0 * (broke["gate_hit"] + broke["other"] - fixed) / n,
        "exact_repeats_of_hit_results": sum(1 for r in records if re_serves_hit(r)),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="bench/tinyworld.py result files with records")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    report = {}
    for path in args.results:
        data = json.loads(Path(path).read_text())
        for workload, by_budget in data.get("records", {}).items():
            for budget, records in by_budget.items():
                row = decompose(records, float(data.get("settings", {}).get("psnr_bound", 30.0)))
                report.setdefault(Path(path).name, {}).setdefault(workload, {})[budget] = row
                b = row["broke"]
                print(f"{Path(path).name} {workload} α={budget}: checker {row['checker']:.1%} vs full "
                      f"{row['checker_full']:.1%} (gap {row['gap_points']:.1f} pts of {row['requests']}): "
                      f"broke {b['gate_hit']} gate hits ({row['broke_gate_hits_above_psnr_bound']} above the "
                      f"PSNR bound) + {b['exact_reserving_hit']} exact repeats of "
                      f"them + {b['other']} other, fixed {row['fixed']}; decisions once: "
                      f"{row['gap_points_decisions_once']:.1f} pts")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
