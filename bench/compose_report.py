"""Carnator, ComfyUI's EasyCache, and both, at matched quality (composition).

    python bench/compose_report.py bench/results/studies/tinyworld_compute_serve_probe1.json \
        bench/results/studies/tinyworld_compute_serve_default.json \
        bench/results/studies/tinyworld_compute_iterate_probe1.json

Reads result files of ``bench/tinyworld.py … --easycache T… --easycache-carnator T…`` and
puts every Carnator system (alone, and on the model with EasyCache) beside EasyCache alone at
the same workload PSNR (10·log10(1/mean MSE) over all requests), read off EasyCache's own
threshold sweep by linear interpolation between the two thresholds that bracket it (none when
the sweep does not reach that PSNR: nothing is extrapolated). Speed is the model's own work
(``compute_speedup_workload``: steps of full computation over the steps the compute meter
counted — EasyCache's skipped calls and Carnator's region calls included), which machine load
cannot move; wall-time ratios of the same runs are copied beside it. EasyCache alone is read
from every file's sweep for the workload at the same step count (it computes the same in every
run of that N), a threshold taken from the first file that has it. ``--sweeps FILE…`` adds
files read for EasyCache alone's sweep only: an older run whose Carnator rows another gate made.
Writes bench/results/easycache_compute.json and one plot per workload.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def easycache_curve(systems: dict) -> list[tuple[float, float, float]]:
    """(workload PSNR, compute speedup, threshold) of EasyCache alone, by PSNR."""
    pts = [(s["psnr_workload"], s["compute_speedup_workload"], s["easycache_threshold"])
           for name, s in systems.items() if name.startswith("easycache_")
           and s.get("compute_speedup_workload") is not None]
    return sorted(pts)


def curve_key(workload: str, settings: dict) -> str:
    """EasyCache alone is read only against runs of the same workload *and* step count
    (its skips, like Carnator's depths, depend on N); 20 steps keep the bare name."""
    steps = settings.get("steps", 20)
    return workload if steps == 20 else f"{workload}_n{steps}"


def at_psnr(curve: list[tuple[float, float, float]], psnr: float) -> dict | None:
    """EasyCache alone's speedup at ``psnr``, between the two thresholds that bracket it."""
    for (p0, s0, t0), (p1, s1, t1) in zip(curve, curve[1:]):
        if p0 <= psnr <= p1:
            w = (psnr - p0) / (p1 - p0) if p1 > p0 else 0.0
            return {"speedup": s0 + w * (s1 - s0), "between_thresholds": [t1, t0]}
    return None


def rows_for(label: str, probe, systems: dict, curve) -> list[dict]:
    rows = []
    for name, s in systems.items():
        if not (name == "carnator" or name.startswith("carnator_easycache_")):
            continue
        ec = at_psnr(curve, s["psnr_workload"])
        rows.append({
            "run": label, "probe_fraction": probe, "system": name, "risk_budget": s.get("risk_budget"),
            "easycache_threshold": s.get("easycache_threshold"),
            "compute_speedup": s["compute_speedup_workload"],
            "compute_speedup_gate_hits": s.get("compute_speedup_hits"),
            "psnr_workload": s["psnr_workload"], "psnr_mean": s["psnr_all_mean"],
            "false_accept_rate": s["false_accept_rate"],
            "checker": s["checker_accuracy"], "checker_full": s["checker_accuracy_full"],
            "wall_speedup": s["workload_speedup"], "risk_model": s.get("risk_model"),
            "easycache_alone_at_this_psnr": ec["speedup"] if ec else None,
            "easycache_bracket": ec["between_thresholds"] if ec else None,
            "over_easycache_alone": s["compute_speedup_workload"] / ec["speedup"] if ec else None})
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="bench/tinyworld.py result files")
    ap.add_argument("--sweeps", nargs="+", default=[], metavar="JSON",
                    help="result files read for EasyCache alone's sweep only (their Carnator rows are left out)")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "easycache_compute.json"))
    ap.add_argument("--no-plots", action="store_true")
    a = ap.parse_args(argv)
    rows, alone = [], {}
    runs = []
    for path in a.results + a.sweeps:
        with open(path) as f:
            data = json.load(f)
        if path in a.results:
            runs.append((path, data))
        for wl, systems in data["workloads"].items():
            key = curve_key(wl, data["settings"])
            known = {r["threshold"] for r in alone.get(key, [])}
            new = [pt for pt in easycache_curve(systems) if pt[2] not in known]
            if not new:
                continue
            alone.setdefault(key, []).extend(
                {"threshold": t, "compute_speedup": s, "psnr_workload": p,
                 "wall_speedup": systems[f"easycache_{t:g}"]["workload_speedup"],
                 "checker": systems[f"easycache_{t:g}"]["checker_accuracy"],
                 "from": os.path.relpath(path, REPO)} for p, s, t in new)
            alone[key].sort(key=lambda r: r["psnr_workload"])
    curves = {key: [(r["psnr_workload"], r["compute_speedup"], r["threshold"]) for r in points]
              for key, points in alone.items()}
    for path, data in runs:
        settings = data["settings"]
        probe, min_saving = settings.get("probe_fraction"), settings.get("min_saving", 0.0)
        label = f"{os.path.relpath(path, REPO)} (probe_fraction {probe}, min_saving {min_saving:g})"
        for wl, systems in data["workloads"].items():
            key = curve_key(wl, settings)
            if key in curves:
                rows += [{"workload": key, "steps": settings.get("steps", 20), "min_saving": min_saving,
                          **r} for r in rows_for(label, probe, systems, curves[key])]
    out = {"note": "speed = the model's own work (compute meter); EasyCache alone interpolated "
                   "in workload PSNR between the two thresholds that bracket it, never extrapolated",
           "easycache_alone": alone, "rows": rows,
           "command": " ".join(["python bench/compose_report.py", *(os.path.relpath(p, REPO) for p in a.results),
                                *(["--sweeps", *(os.path.relpath(p, REPO) for p in a.sweeps)] if a.sweeps else [])])}
    if not a.no_plots:
        out["plots"] = plots(curves, rows, os.path.splitext(os.path.abspath(a.out))[0])
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    for r in rows:
        ec = r["easycache_alone_at_this_psnr"]
        print(f"{r['workload']:8} {r['system']:26} {r['compute_speedup']:.2f}x at {r['psnr_workload']:.2f} dB"
              f"  EasyCache alone there: {'%.2fx' % ec if ec else '—'}"
              f"  ratio {'%.2f' % r['over_easycache_alone'] if ec else '—'}   [{r['run']}]")
    print(f"wrote {a.out}")
    return out


def plots(curves, rows, stem) -> list[str]:
    """One plot per workload, named after the report: <stem>_<workload>.png."""
    from calibrate import _load_bench
    bench = _load_bench()
    paths = []
    for wl, curve in curves.items():
        series, alone_done = [("EasyCache alone", [(p, s) for p, s, _ in curve])], set()
        for run in dict.fromkeys(r["run"] for r in rows if r["workload"] == wl):
            mine = [r for r in rows if r["workload"] == wl and r["run"] == run]
            probe = f"probe {mine[0]['probe_fraction']:g}"
            if mine[0]["min_saving"]:
                probe += f", min_saving {mine[0]['min_saving']:g}"
            both = [r for r in mine if r["system"] != "carnator"]
            own = any("easycache_calibration" in (r["risk_model"] or "") for r in both)
            if both:
                series.append((f"Carnator + EasyCache ({probe}{', own calibration' if own else ''})",
                               sorted((r["psnr_workload"], r["compute_speedup"]) for r in both)))
            if probe not in alone_done:  # Carnator alone computes the same in every run of its settings
                alone_done.add(probe)
                series.append((f"Carnator alone ({probe})", [(r["psnr_workload"], r["compute_speedup"])
                                                             for r in mine if r["system"] == "carnator"]))
        path = f"{stem}_{wl}.png"
        bench._pil_plot(series, "workload PSNR (dB)", "speedup in model work (x)", path,
                        from_zero=False, legend="bottom left")
        paths.append(os.path.relpath(path, REPO))
    return paths


if __name__ == "__main__":
    main()
