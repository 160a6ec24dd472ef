"""Which calibration pairs fill each share cell, and how their reuses fare at depth.

Reads calibration measurement files (bench/calibrate.py) and, for the other-evidence reuses the
gate could choose (its region finish where measured, else the plain reuse), counts the reuses
beyond tolerance by pair kind, share cell (the share of the tokens the reuse computes itself,
as the gate certifies other evidence: up to 25, 50, 75, 100%) and depth band (k below or from
0.7·N): is a cell's record made of the edits the gate will meet there?

    python bench/studies/share_cell_pairs.py \
        bench/results/studies/lang2_region4_n50_calibration/calibration_measurements.*.jsonl \
        bench/results/studies/lang2_region4_n50_scene_edits/calibration_measurements.*.jsonl \
        --out bench/results/studies/share_cell_pairs_n50.json
"""
from __future__ import annotations

import argparse
import json

import study_paths  # noqa: F401  (the repository's packages)
from carnator_core.calibration import fit as CAL
from carnator_core.gate import REGION_SHARE_BOUNDS, evidence_class, share_cell

DEEP = 0.7  # the depth share the failing reuses of unseen editing sessions resumed from or beyond


def tally(instances: list[dict], bounds=REGION_SHARE_BOUNDS) -> dict:
    """{cell: {kind: {"shallow"|"deep": [reuses, beyond tolerance]}}} over other evidence."""
    out: dict = {}
    for inst in instances:
        if evidence_class(inst["features"]) != "other":
            continue
        cell = share_cell("other", CAL.reuse_share(inst), bounds)
        finished = [d for d in inst["depths"] if d.get("finish_calls")]
        for d in finished or inst["depths"]:
            band = "deep" if d["depth_fraction"] >= DEEP - 1e-9 else "shallow"
            row = out.setdefault(cell, {}).setdefault(inst.get("kind") or "?", {}).setdefault(band, [0, 0])
            row[0] += 1
            row[1] += int(d["label"])
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("measurements", nargs="+", help="calibration_measurements*.jsonl files")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    result = {"files": a.measurements, "deep_from_depth_share": DEEP,
              "cells": tally([i for p in a.measurements for i in CAL.load_instances(p)])}
    for cell, kinds in sorted(result["cells"].items()):
        print(cell)
        for kind, bands in sorted(kinds.items()):
            print(f"  {kind:20s} " + "  ".join(f"{band}: {n[1]}/{n[0]} ({100 * n[1] / max(n[0], 1):.1f}%)"
                                                for band, n in sorted(bands.items(), reverse=True)))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
