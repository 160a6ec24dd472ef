"""What the committed calibrations cost, in generation-equivalents, from their measurement records.

    .venv/bin/python bench/studies/calibration_cost.py        # → bench/results/calibration_cost.json

One generation-equivalent is one full generation at the calibration's size and steps
(``carnator_core/calibration/meter.py``). Per pair: its two full runs (request and candidate)
plus, for every measured reuse, the steps after its depth it computed, its fill of region M and
its calls on M's tokens at their share (``meter.pair_cost``, the rule the calibrations' own
meter falls back to). Rows are keyed by model + procedure + workload + alpha + steps + budget
(bench/studies/cheap_calibration.py adds the cheap calibration's, one per budget): rows of other
procedures already in the file are kept, rows of these keys replaced.
"""
from __future__ import annotations

import glob
import json
import os

from study_paths import REPO  # noqa: E402,F401 - the repository on the path first

from carnator_core.calibration.meter import pair_cost  # noqa: E402

RESULTS = os.path.join(REPO, "bench", "results")
OUT = os.path.join(RESULTS, "calibration_cost.json")
KEY = ("model", "procedure", "workload", "alpha", "steps", "budget_generations")
# The bundled calibration files of each N were fitted on the recipe's pairs of the workload
# `calibration` and on pairs of edits over the whole scene grammar measured apart: both count.
BUNDLED_WORKLOAD = "calibration + calibration_edits"
RECIPE = (("lang2_region4_calibration", "lang2_region4_scene_edits", 20),
          ("lang2_region4_n30_calibration", "lang2_region4_n30_scene_edits", 30),
          ("lang2_region4_n50_calibration", "lang2_region4_n50_scene_edits", 50))
RECIPE_NOTE = ("the checker-based calibration of the deeper recipe (probe 0.05, M filled on its tokens with "
               "a 1-tile margin, guided finishes and the other-evidence region finish), every depth and finish")


def _pairs_of_progress(paths: list[str]) -> list[list[dict]]:
    """The generic calibration's progress files: one line per measured pair."""
    return [json.loads(line)["instances"] for p in paths for line in open(p) if line.strip()]


def _pairs_of_measurements(paths: list[str]) -> list[list[dict]]:
    """bench/calibrate.py's measurement files: one line per direction, a pair's two by group."""
    pairs: dict[tuple, list[dict]] = {}
    for p in paths:
        for line in open(p):
            if line.strip():
                inst = json.loads(line)
                pairs.setdefault((p, str(inst["group"])), []).append(inst)
    return list(pairs.values())


def cost_row(pairs: list[list[dict]], steps: int, **row) -> dict:
    odd = [len(p) for p in pairs if len(p) != 2]
    if odd:  # a pair measured twice would need two pairs' full runs
        raise SystemExit(f"{row['procedure']}: pairs with {odd[:5]} directions, not 2")
    costs = [pair_cost(p, steps) for p in pairs]
    reuses = sum(len(i["depths"]) for p in pairs for i in p)
    total = sum(costs)
    note, source = row.pop("note"), row.pop("source")
    return {**row, "steps": steps, "cost_generations": round(total, 1), "pairs": len(pairs),
            "measured_reuses": reuses, "full_runs": 2 * len(pairs),
            "cost_full_runs": 2.0 * len(pairs), "cost_reuses": round(total - 2.0 * len(pairs), 1),
            "generations_per_pair": round(total / len(pairs), 2), "by": "rule on the measurement records",
            "source": source, "note": note}


def baseline_rows() -> list[dict]:
    rows = []
    folder = os.path.join(RESULTS, "self_calibration")
    report = json.load(open(os.path.join(folder, "report.json")))
    files = sorted(glob.glob(os.path.join(folder, "progress.*.jsonl")))
    pairs = _pairs_of_progress(files)
    ids = [json.loads(line)["pair_id"] for p in files for line in open(p) if line.strip()]
    rows.append(cost_row(
        pairs, int(report["steps"]), model=report["model_fingerprint"], procedure="full_generic",
        workload=report.get("base_prompts", "calibration.jsonl anchors"), alpha=None,
        probe_fraction=0.1, source=[os.path.relpath(f, REPO) for f in files],
        note=(f"the generic calibration (PSNR on frames, no checker), every depth and the same-scene "
              f"guided finish; {len(pairs)} pair lines in the two shards ({len(set(ids))} distinct pairs: "
              f"{len(ids) - len(set(ids))} measured by both shards, counted twice as they were computed); "
              f"its report counts {report['pairs']} pairs and {report['measured_reuses']} reuses")))
    for name, edits, steps in RECIPE:
        folder = os.path.join(RESULTS, "studies", name)
        report = json.load(open(os.path.join(folder, "calibration_report.probe0.05.json")))
        assert int(report["steps"]) == steps, (name, report["steps"])
        files = sorted(glob.glob(os.path.join(folder, "*.jsonl")))
        edit_files = sorted(glob.glob(os.path.join(RESULTS, "studies", edits, "*.jsonl")))
        common = dict(model=report["model_fingerprint"], procedure="full_checker", alpha=None,
                      probe_fraction=report["probe_fraction"])
        rows.append(cost_row(
            _pairs_of_measurements(files), steps, workload="calibration", **common,
            source=[os.path.relpath(f, REPO) for f in files],
            note=RECIPE_NOTE + "; bench/calibrate.py's workload `calibration`"))
        rows.append(cost_row(
            _pairs_of_measurements(files + edit_files), steps, workload=BUNDLED_WORKLOAD, **common,
            source=[os.path.relpath(f, REPO) for f in files + edit_files],
            note=RECIPE_NOTE + "; the bundled calibration file of this N: the workload `calibration`'s pairs "
                               "and those of `calibration_edits`, measured apart and fitted together"))
    return rows


def bundled_cost(model: str, steps: int, path: str = OUT) -> dict:
    """The cost row of the bundled full calibration of this model at N = ``steps``."""
    rows = json.load(open(path))["rows"] if os.path.isfile(path) else []
    for r in rows:
        if (r["model"], r["procedure"], r["workload"], r["steps"]) == (model, "full_checker", BUNDLED_WORKLOAD, steps):
            return r
    raise SystemExit(f"no cost of the bundled calibration of {model} at N = {steps} in {path}: "
                     "run bench/studies/calibration_cost.py")


def merge(rows: list[dict], path: str = OUT) -> dict:
    """The file's rows with these replacing those of the same key; others are kept."""
    data = json.load(open(path)) if os.path.isfile(path) else {}
    key = lambda r: tuple(json.dumps(r.get(k)) for k in KEY)  # noqa: E731
    mine = {key(r): r for r in rows}
    kept = [mine.pop(key(r), r) for r in data.get("rows", [])]
    data.update(
        unit=("generation-equivalents: 1.0 = one full generation at the calibration's size and steps "
              "(N steps × all tokens × the cond/uncond passes the sampler runs)"),
        rule=("per pair: its two full runs + for each measured reuse at depth k of N, (N − k − steps a "
              "guided finish predicted)/N, a region finish's calls on M's tokens at their token share, "
              "and its fill of M (full calls + calls on M's tokens at their share)/N "
              "(carnator_core/calibration/meter.py pair_cost)"),
        rows=kept + list(mine.values()))
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    return data


def _count(value) -> str:
    """A row's pair or reuse count (rows of the streams and proxies carry none, or several)."""
    return str(value) if isinstance(value, int) else "—"


def main(argv=None) -> dict:
    import argparse
    ap = argparse.ArgumentParser(description="What each committed calibration cost, in "
                                 "generation-equivalents, read from its measurement files.")
    ap.add_argument("--out", default=OUT, help="the JSON the rows are merged into")
    a = ap.parse_args(argv)
    data = merge(baseline_rows(), a.out)
    print(f"{'model':14s} {'procedure':13s} {'workload':20s} {'α':>5s} {'N':>3s} {'pairs':>6s} {'reuses':>7s} "
          f"{'cost (gen-eq)':>14s} {'per pair':>9s}")
    for r in data["rows"]:
        alpha = "" if r.get("alpha") is None else f"{r['alpha']:g}"
        print(f"{str(r['model'])[:12]:14s} {r['procedure']:13s} {str(r['workload'])[:20]:20s} {alpha:>5s} "
              f"{r['steps']:3d} {_count(r.get('pairs')):>6s} {_count(r.get('measured_reuses')):>7s} "
              f"{r['cost_generations']:14,.1f} "
              f"{r.get('generations_per_pair') or 0:9.2f}")
    print(f"wrote {os.path.relpath(a.out, REPO)}")
    return data


if __name__ == "__main__":
    main()
