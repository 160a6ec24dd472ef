"""The cheap calibration served: each workload run through the pipeline with the cheap
calibration stopped at a budget, against the full calibration's run of the same workload.

    nice .venv/bin/python bench/studies/cheap_served.py             # the runs not made yet (2 at a time), then the rows
    .venv/bin/python bench/studies/cheap_served.py --merge-only     # read the runs again
    .venv/bin/python bench/studies/cheap_served.py --budgets 200 --workloads serve --limit 12 \\
        --folder /tmp/cs --out /tmp/cs.json --no-cost-rows          # a quick one

The calibrations: the file each budget certified in bench/studies/cheap_calibration.py's one
calibration continued budget by budget (``calibration_file`` of each budget in
bench/results/cheap_calibration.json). Each workload runs with it through bench/tinyworld.py
(``--risk-model``, N = 20, probe 0.05, the bundled model, every other setting as the full
calibration's run) at α = 5% and 10%, each request against its own full computation, →
bench/results/studies/cheap_served/at_<budget>/<workload>.json. α = 2% is not offered by the
cheap procedure (nothing is certified there, so the gate reuses nothing but exact repeats) and
is not run. The full calibration's run of each workload is bench/results/tinyworld.json (the
bundled calibration, the same settings and requests).

Per workload and α: hit rate, false accepts among hits with the one-sided 95% Clopper–Pearson
bound, gate-hit steps speedup and its share of the full calibration's (``speedup_kept``), and
the whole workload's saved steps as a share of the full calibration's (``workload_kept``): a
cheap calibration that certifies only same-scene reuse keeps those hits as fast as the full
one (4.0×) but reuses far less often, and that shows in the whole workload, not in its hits.

Writes bench/results/cheap_served.json and the rows of bench/results/calibration_cost.json
with procedure "cheap" and the workload's name.

With ``--easycache T`` the same on the bundled model with ComfyUI's EasyCache at threshold T
(its own fingerprint, its own calibrations): the cheap calibration of
bench/studies/cheap_calibration.py --easycache T (bench/results/studies/easycache_cheap.json)
and that model's full calibration each serve the workloads with EasyCache on (bench/tinyworld.py
--easycache-carnator T --easycache-budgets 0.05 0.1), every hit judged against the EasyCache'd
model's own full computation, what both calibrations certify against →
bench/results/studies/cheap_served_easycache/{full,at_<budget>}/<workload>.json and
bench/results/cheap_served_easycache.json:

    nice .venv/bin/python bench/studies/cheap_served.py --easycache 0.02 --budgets 200 --workloads serve iterate
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from study_paths import REPO  # noqa: E402 - the repository, tests/ and bench/ on the path
from proxy_size import served_row, served_rows  # noqa: E402 - per workload and α, from bench/tinyworld.py's sweeps

RESULTS = os.path.join(REPO, "bench", "results")
CHEAP = os.path.join(RESULTS, "cheap_calibration.json")
EASYCACHE_CHEAP = os.path.join(RESULTS, "studies", "easycache_cheap.json")
FULL = os.path.join(RESULTS, "tinyworld.json")
FOLDER = os.path.join(RESULTS, "studies", "cheap_served")
OUT = os.path.join(RESULTS, "cheap_served.json")
WORKLOADS = ("serve", "serve_reworded", "iterate", "iterate_replicate", "novel")
ALPHAS = (0.05, 0.1)


def run_command(workload: str, risk_model: str, out: str, limit: int | None,
                easycache: float | None = None) -> list[str]:
    """The plain model served with ``risk_model``; with ``easycache``, the EasyCache'd model with
    the calibration folder ``risk_model`` (the plain model at the first α alone, unused)."""
    alphas = [f"{a:g}" for a in ALPHAS]
    cmd = [sys.executable, os.path.join(REPO, "bench", "tinyworld.py"), workload, "--steps", "20",
           "--probe-fraction", "0.05", "--no-sparse-system", "--no-text-baseline", "--no-plots", "--threads", "1",
           "--out", out]
    if easycache is None:
        cmd += ["--budgets", *alphas, "--risk-model", risk_model]
    else:
        cmd += ["--budgets", alphas[0], "--main-budget", alphas[0], "--easycache-carnator", f"{easycache:g}",
                "--easycache-risk-model", risk_model, "--easycache-budgets", *alphas]
    return cmd + (["--limit", str(limit)] if limit else [])


def easycache_rows(paths: list[str], threshold: float) -> dict:
    """Each workload of these runs: per α, Carnator on the EasyCache'd model, false accepts
    against that model's own full computation, the workload's saving against EasyCache alone."""
    out = {}
    for path in paths:
        data = json.load(open(path))
        for name, sweep in data["sweeps"].items():
            rows = {}
            alone = data["workloads"][name][f"easycache_{threshold:g}"]["compute_speedup_workload"]
            for m in sweep.get(f"carnator_easycache_{threshold:g}", []):
                hits, fa = m["judged_own_model"], m["false_accepts_own_model"] or 0
                # the workload's speedup: Carnator's own saving, the model's work against EasyCache alone's
                rows[f"{m['risk_budget']:g}"] = {
                    **served_row(m, hits, fa, fa / hits if hits else 0.0, m["compute_speedup_workload"] / alone),
                    "false_accept_rate_plain_model": m["false_accept_rate"],
                    "workload_speedup_over_full": m["compute_speedup_workload"], "easycache_alone_speedup": alone}
            out[name] = {"calibration": (data["workloads"][name].get(f"carnator_easycache_{threshold:g}") or {})
                         .get("risk_model"), "seconds": data["settings"].get("seconds"), "by_alpha": rows}
    return out


def ratio(a, b):
    return a / b if a and b else None


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", type=float, nargs="+", default=[200, 250],
                    help="the cheap calibration's budgets whose files are served")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    ap.add_argument("--limit", type=int, default=None, help="first N requests of each workload")
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time (one core each)")
    ap.add_argument("--merge-only", action="store_true", help="run nothing; read the runs there are")
    ap.add_argument("--easycache", type=float, default=None, metavar="THRESHOLD",
                    help="the model with EasyCache at this threshold: its cheap and full calibrations")
    ap.add_argument("--folder", default=None, help=f"default {os.path.relpath(FOLDER, REPO)}[_easycache]")
    ap.add_argument("--out", default=None, help=f"default {os.path.relpath(OUT, REPO)} (…_easycache.json)")
    ap.add_argument("--no-cost-rows", action="store_true", help="leave bench/results/calibration_cost.json alone")
    a = ap.parse_args(argv)
    eased = a.easycache is not None
    a.folder = a.folder or (FOLDER + "_easycache" if eased else FOLDER)
    a.out = a.out or (OUT.replace(".json", "_easycache.json") if eased else OUT)
    source = EASYCACHE_CHEAP if eased else CHEAP
    cheap = json.load(open(source))
    if eased and abs(float(cheap.get("easycache") or -1) - a.easycache) > 1e-12:
        raise SystemExit(f"{os.path.relpath(source, REPO)} is the cheap calibration at EasyCache "
                         f"{cheap.get('easycache')}, not {a.easycache:g}")
    missing = [f"{b:g}" for b in a.budgets if f"{b:g}" not in cheap["budgets"]]
    if missing:
        raise SystemExit(f"no cheap calibration at budget(s) {', '.join(missing)} in {os.path.relpath(source, REPO)} "
                         f"(it has {', '.join(cheap['budgets'])}): run bench/studies/cheap_calibration.py "
                         f"--budgets … with them first")
    todo = {os.path.join(a.folder, "full"): cheap["full_reference"]} if eased else {}
    for budget in a.budgets:
        b = cheap["budgets"][f"{budget:g}"]
        if not b.get("calibration_file"):
            print(f"budget {budget:g}: nothing certified, nothing to serve")
            continue
        todo[os.path.join(a.folder, f"at_{budget:g}")] = b["calibration_file"]
    jobs = []
    for folder, calibration in todo.items():
        # the plain model is served with the calibration file, the EasyCache'd one with the
        # folder holding it (found there by that model's fingerprint)
        served_with = os.path.join(REPO, calibration)
        served_with = os.path.dirname(os.path.dirname(served_with)) if eased else served_with
        for wl in a.workloads:
            out = os.path.join(folder, f"{wl}.json")
            if not os.path.exists(out) and not a.merge_only:
                os.makedirs(folder, exist_ok=True)
                jobs.append(run_command(wl, served_with, out, a.limit, a.easycache))
    with ThreadPoolExecutor(max(1, a.jobs)) as pool:
        for cmd, done in zip(jobs, pool.map(lambda c: subprocess.run(c, cwd=REPO).returncode, jobs)):
            if done:
                raise SystemExit(f"failed ({done}): {' '.join(cmd)}")
    if eased:  # the full calibration's runs
        rows_of = lambda paths: easycache_rows(paths, a.easycache)  # noqa: E731
        full_runs = sorted(glob.glob(os.path.join(a.folder, "full", "*.json")))
    else:
        rows_of, full_runs = served_rows, [FULL]
    full = {wl: w["by_alpha"] for wl, w in rows_of(full_runs).items()}
    result = {"what": __doc__.splitlines()[0], "easycache": a.easycache,
              "full_reference": [os.path.relpath(p, REPO) for p in full_runs] if eased else os.path.relpath(FULL, REPO),
              "full_calibration_cost": cheap["full_calibration"].get("cost_generations"),
              "model_fingerprint": cheap["model_fingerprint"], "steps": cheap["steps"],
              "not_run": {"0.02": "not offered by the cheap procedure: nothing certified, no reuse but exact repeats"},
              "budgets": {}}
    for budget in a.budgets:
        folder = os.path.join(a.folder, f"at_{budget:g}")
        if not os.path.isdir(folder):
            continue
        b = cheap["budgets"][f"{budget:g}"]
        served = rows_of(sorted(glob.glob(os.path.join(folder, "*.json"))))
        for wl, w in served.items():
            for al, v in w["by_alpha"].items():
                ref = full.get(wl, {}).get(al, {})
                v.update(full_gate_hit_speedup=ref.get("gate_hit_steps_speedup"),
                         full_false_accept_rate=ref.get("false_accept_rate"),
                         full_workload_speedup=ref.get("workload_steps_speedup"), full_hit_rate=ref.get("hit_rate"),
                         speedup_kept=ratio(v["gate_hit_steps_speedup"], ref.get("gate_hit_steps_speedup")),
                         workload_kept=ratio((v["workload_steps_speedup"] or 1.0) - 1.0,
                                             (ref.get("workload_steps_speedup") or 1.0) - 1.0))
        result["budgets"][f"{budget:g}"] = {"cost_generations": b["cost_generations"], "pairs": b["pairs"],
                                            "certified": b["certified"], "calibration_file": b["calibration_file"],
                                            "served": served}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    if not a.no_cost_rows:
        _cost_rows(result)
    _print(result)
    print(f"wrote {os.path.relpath(a.out, REPO)}")
    return result


def _cost_rows(result: dict) -> None:
    from calibration_cost import merge
    rows = []
    eased = result.get("easycache") is not None
    full = ("the same workloads served with that model's full calibration, bench/results/studies/"
            "cheap_served_easycache/full/" if eased else "bench/results/tinyworld.json")
    for budget, b in result["budgets"].items():
        for wl, w in b["served"].items():
            for al, v in w["by_alpha"].items():
                rows.append({"model": result["model_fingerprint"], "procedure": "cheap", "workload": wl,
                             **({"easycache": result["easycache"]} if eased else {}),
                             "alpha": float(al), "steps": result["steps"], "budget_generations": float(budget),
                             "cost_generations": b["cost_generations"], "pairs": b["pairs"],
                             "requests": v["requests"], "hit_rate": v["hit_rate"],
                             "false_accept_rate": v["false_accept_rate"], "fa_upper95": v["fa_upper95"],
                             "gate_hit_speedup": v["gate_hit_steps_speedup"], "speedup_kept": v["speedup_kept"],
                             "workload_speedup": v["workload_steps_speedup"], "workload_kept": v["workload_kept"],
                             "full_gate_hit_speedup": v["full_gate_hit_speedup"], "full_hit_rate": v["full_hit_rate"],
                             "note": "the cheap calibration stopped at this budget, the workload served with it "
                                     "(bench/studies/cheap_served.py"
                                     + (f" --easycache {result['easycache']:g}; false accepts against the EasyCache'd "
                                        "model's own full computation" if eased else "")
                                     + "); speedups in model steps; speedup_kept: gate-hit speedup over the full "
                                     f"calibration's on the same workload and alpha ({full}); workload_kept: the "
                                     "same for the steps the whole workload saves"})
    merge(rows)


def _print(result: dict) -> None:
    for budget, b in result["budgets"].items():
        print(f"cheap calibration at {budget} ({b['cost_generations']} generation-equivalents, {b['pairs']} pairs)")
        for wl, w in b["served"].items():
            for al, v in w["by_alpha"].items():
                kept = lambda x: "—" if x is None else f"{x:.0%}"  # noqa: E731
                print(f"  {wl:18s} α={al:4s} hits {v['hit_rate']:.1%} (full {v['full_hit_rate'] or 0:.1%}), "
                      f"false accepts {v['false_accepts']} ({v['false_accept_rate']:.1%}, up95 "
                      f"{v['fa_upper95'] if v['fa_upper95'] is None else round(v['fa_upper95'] * 100, 1)}%), "
                      f"gate hits {v['gate_hit_steps_speedup'] or 0:.2f}× (kept {kept(v['speedup_kept'])}), "
                      f"workload {v['workload_steps_speedup'] or 0:.2f}× (kept {kept(v['workload_kept'])})")


if __name__ == "__main__":
    main()
