"""Same scene, any wording: does same-scene reuse survive how people write?

    # the fresh-wording workloads at N = 20, every budget, one run after the other (~1 h on 2
    # cores as two processes: --workloads serve_fresh, then --workloads iterate_fresh)
    .venv/bin/python bench/wording.py --workloads serve_fresh iterate_fresh
    # rows from runs already made (bench/tinyworld.py --records results), nothing measured:
    .venv/bin/python bench/wording.py --from bench/results/tinyworld.json
    .venv/bin/python bench/wording.py --workloads serve_fresh --limit 12 --out /tmp/w.json  # a look
    # served with another calibration (a study's): --risk-model DIR/calibration/<fingerprint>.probe0.05.json

Each workload runs as bench/tinyworld.py with per-request records (probe 0.05, the bundled
calibration for N, budgets 0.02 / 0.05 / 0.1, no sparse system, no plots) into ``--parts``.
Rows per workload and α: hit rate, false accepts among accepted reuses with a Clopper–Pearson
95% interval, the gate-hit and whole-workload speedups in steps, and the question this asks —
of the requests whose scene had been **computed in full before in the same noise pool** (the
same pool noise under ``shared_noise``, the same seed otherwise), the share served by a gate
hit on same-scene evidence — with the requests not served by a gate hit counted by why
(``gate.WHY_NOT``), and whether the hit rate falls as α loosens.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (os.path.join(REPO, "tests"), REPO):  # REPO first: the packages, not bench/ (tinyworld.py)
    if _p not in sys.path:
        sys.path.insert(0, _p)
RESULTS = os.path.join(REPO, "bench", "results")


def _script(name: str):
    """bench/<name>.py as a module (bench/tinyworld.py's name would shadow the tinyworld package)."""
    import importlib.util
    module = f"bench_{name}_for_wording"
    if module not in sys.modules:
        spec = importlib.util.spec_from_file_location(module, os.path.join(REPO, "bench", f"{name}.py"))
        sys.modules[module] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[module])
    return sys.modules[module]


def seen_before(lines: list[dict], records: list[dict]):
    """(line, record, seen) in workload order; seen: the request's scene was computed in full
    earlier in the same noise pool (records as bench/tinyworld.py writes them)."""
    from tinyworld.world import scene_key
    noise_frame = _script("tinyworld").noise_frame
    if len(lines) != len(records):
        raise ValueError(f"{len(records)} records for {len(lines)} requests: not one run of this workload")
    computed = set()
    for line, rec in zip(lines, records):
        key = (scene_key(line["scene"]), noise_frame(int(line["seed"]), line.get("seed_policy", "same_seed")))
        yield line, rec, key in computed
        if rec["outcome"] == "miss":  # computed in full: a reuse source from now on
            computed.add(key)


def seen_scene_hits(lines: list[dict], records: list[dict]) -> dict:
    """Among requests whose scene was computed in full earlier in the same noise pool: how many,
    how many a same-scene gate hit served, and why the others were not."""
    from carnator_core.gate import evidence_class
    seen, same, why = 0, 0, Counter()
    for _, rec, before in seen_before(lines, records):
        if before:
            seen += 1
            if rec["outcome"] == "hit" and rec.get("features") and evidence_class(rec["features"]) == "same_scene":
                same += 1
            else:
                why[rec.get("why") or ("other_evidence" if rec["outcome"] == "hit" else rec["outcome"])] += 1
    return {"requests": seen, "same_scene_hits": same, "share": same / seen if seen else None,
            "not_same_scene_by_why": dict(why.most_common())}


def rows_of(result: dict, workload: str, lines: list[dict]) -> dict:
    """{α: row} for one workload of a bench/tinyworld.py result with records."""
    budget_row = _script("many_steps").budget_row
    out = {}
    for alpha, records in sorted(result["records"][workload].items(), key=lambda kv: float(kv[0])):
        row = budget_row(records, {}, result["settings"]["psnr_bound"], float(alpha), 30)
        out[f"{float(alpha):g}"] = {
            **{k: row[k] for k in ("requests", "accepted_reuses", "gate_hits", "false_accepts",
                                   "false_accept_rate", "ci95", "holds", "hit_rate",
                                   "gate_hit_speedup_steps", "workload_speedup_steps")},
            "seen_scene": seen_scene_hits(lines, records),
            "not_reused_by_why": _script("tinyworld").not_reused(records)}
    rates = [r["hit_rate"] for r in out.values()]
    for row in out.values():
        row["hit_rate_non_decreasing_in_alpha"] = all(b >= a - 1e-12 for a, b in zip(rates, rates[1:]))
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="*", default=[], help="workloads to run (e.g. serve_fresh iterate_fresh)")
    ap.add_argument("--from", dest="given", nargs="*", default=[], metavar="JSON",
                    help="bench/tinyworld.py results with --records to read rows from (every workload in them)")
    ap.add_argument("--steps", type=int, default=20)
    runner = _script("many_steps")  # runs each workload as many_steps does: same command, same settings
    ap.add_argument("--model", default=runner.DEFAULT_MODEL)
    ap.add_argument("--risk-model", default="auto", metavar="JSON",
                    help="the calibration to serve with (default: the bundled one for this model, probe and N)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--out", default=os.path.join(RESULTS, "wording.json"))
    ap.add_argument("--parts", default=None, help="default: beside --out, <out name>_parts/")
    ap.set_defaults(probe_fraction=0.05, budgets=list(runner.BUDGETS))
    a = ap.parse_args(argv)
    load_workload = _script("tinyworld").load_workload
    parts = a.parts or os.path.splitext(os.path.abspath(a.out))[0] + "_parts"
    sources = []
    for wl in a.workloads:
        os.makedirs(parts, exist_ok=True)
        part = os.path.join(parts, f"{wl}_n{a.steps}.json")
        runner.measure(wl, a.steps, a, part)
        sources.append(part)
    sources += a.given
    results = {}
    if os.path.isfile(a.out):
        with open(a.out) as f:
            results = json.load(f)
    for path in sources:
        with open(path) as f:
            result = json.load(f)
        for wl in result.get("records", {}):
            _, lines = load_workload(wl, result["settings"].get("limit"))
            key = f"{wl}/n{result['settings']['steps']}"
            results.setdefault("rows", {})[key] = {"source": os.path.relpath(path, REPO),
                                                  "calibration": result["settings"].get("calibration"),
                                                  "budgets": rows_of(result, wl, lines)}
            for alpha, row in results["rows"][key]["budgets"].items():
                s = row["seen_scene"]
                print(f"{key:24s} α={alpha:5s} hits {100 * row['hit_rate']:5.1f}%  false accepts "
                      f"{row['false_accepts']}/{row['accepted_reuses']}  gate hits {row['gate_hit_speedup_steps'] or 0:.2f}×  "
                      f"same-scene on seen scenes {s['same_scene_hits']}/{s['requests']}  "
                      f"{'' if row['hit_rate_non_decreasing_in_alpha'] else 'hit rate falls as α loosens'}")
    with open(a.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {a.out}")
    return results


if __name__ == "__main__":
    main()
