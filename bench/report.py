"""Markdown tables for the README from the tiny-world result files.

    .venv/bin/python bench/report.py             # reads bench/results/{tinyworld,calibration_report,localization}.json
    .venv/bin/python bench/report.py --headline  # the README's results table, from bench/results/tinyworld.json
    .venv/bin/python bench/report.py --budgets   # every workload at every budget (docs/results.md)
    .venv/bin/python bench/report.py --why       # the requests no gate hit served, by why

Prints; writes nothing. The numbers are whatever the last runs of bench/tinyworld.py,
bench/calibrate.py and bench/studies/localization.py measured.
"""
from __future__ import annotations

import json
import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _load(name: str) -> dict | None:
    path = os.path.join(RESULTS, name)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def pct(v) -> str:
    return "—" if v is None else f"{100 * v:.1f}%"


def num(v, unit: str = "") -> str:
    return "—" if v is None else f"{v:.2f}{unit}"


def markdown(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def systems_table(res: dict) -> str:
    rows = []
    for wl, systems in res["workloads"].items():
        for name, m in systems.items():
            extra = f" (τ={m['threshold']})" if "threshold" in m else (
                f" (α={m['risk_budget']})" if "risk_budget" in m else "")
            rows.append([wl, name + extra, pct(m["hit_rate"]), pct(m["false_accept_rate"]),
                         num(m["hit_speedup"], "×"), num(m["workload_speedup"], "×"),
                         pct(m["miss_overhead"]), num(m["psnr_hits_mean"], " dB"),
                         num(m["ssim_hits_mean"]),
                         f"{pct(m['checker_accuracy'])} / {pct(m['checker_accuracy_full'])}"])
    return markdown(["workload", "system", "hit rate", "false accepts", "speedup on hits",
                     "workload speedup", "miss overhead", "PSNR on hits", "SSIM on hits",
                     "checker (system / full)"], rows)


def attributes_table(res: dict) -> str:
    attrs = ("shape", "colour", "position", "motion", "count")
    rows = [[wl] + [pct((systems["full"].get("checker_attributes_full") or {}).get(k)) for k in attrs]
            for wl, systems in res["workloads"].items()]
    return markdown(["workload", *attrs], rows)


def matched_table(res: dict) -> str:
    rows = [[wl, m["risk_budget"], pct(m["carnator_hit_rate"]), pct(m["carnator_false_accept_rate"]),
             f"τ={m['text_threshold_at_matched_hit_rate']}, {pct(m['text_hit_rate_at_matched_hit_rate'])}, "
             f"{pct(m['text_false_accept_rate_at_matched_hit_rate'])}",
             pct(m["text_best_hit_rate_at_matched_false_accept"])]
            for wl, comp in res["comparison"].items() for m in comp["matched"]]
    return markdown(["workload", "α", "Carnator hit rate", "Carnator false accepts",
                     "text at matched hit rate (τ, hit rate, false accepts)",
                     "text's best hit rate at ≤ Carnator's false accepts"], rows)


def ci(m: dict) -> str:
    c = m.get("false_accept_ci95")
    return "—" if not c else f"{pct(m['false_accept_rate'])} [{pct(c[0])}, {pct(c[1])}]"


def depth_table(res: dict, budgets=(0.02, 0.05, 0.1)) -> str:
    """Per workload and budget, what the gate reused and how deep."""
    rows = []
    for wl, sweep in res["sweeps"].items():
        for m in sweep["carnator"]:
            if m["risk_budget"] not in budgets:
                continue
            rows.append([wl, m["risk_budget"], pct(m["hit_rate"]), pct(m["gate_hit_rate"]), ci(m),
                         num(m.get("mean_reuse_step")), num(m["steps_speedup_hits"], "×"),
                         num(m.get("steps_speedup_same_scene_hits"), "×"),
                         num(m.get("steps_speedup_other_hits"), "×"), num(m["gate_hit_speedup"], "×"),
                         num(m["workload_speedup"], "×"), num(m["psnr_hits_mean"], " dB"),
                         f"{pct(m['checker_accuracy'])} / {pct(m['checker_accuracy_full'])}"])
    return markdown(["workload", "α", "hit rate", "gate hits", "false accepts [95% CI]", "mean k*",
                     "steps speedup, gate hits", "same-scene hits", "other hits",
                     "wall speedup, gate hits", "workload wall speedup", "PSNR on gate hits",
                     "checker (system / full)"], rows)


def easycache_table(res: dict) -> str:
    rows = []
    for wl, systems in res["workloads"].items():
        for name, m in systems.items():
            if name in ("full", "text") or name.startswith("carnator_sparse"):
                continue
            rows.append([wl, name, num(m["workload_speedup"], "×"), num(m.get("psnr_workload"), " dB"),
                         num(m.get("psnr_all_mean"), " dB"), pct(m["hit_rate"]),
                         f"{pct(m['checker_accuracy'])} / {pct(m['checker_accuracy_full'])}"])
    return markdown(["workload", "system", "workload wall speedup", "workload PSNR (1/mean MSE)",
                     "mean PSNR", "hit rate", "checker (system / full)"], rows)


def certification_table(rep: dict) -> str:
    cert = rep.get("certification")
    if not cert:
        return ""
    rows = [[klass.replace("_", "-"), f"{c['instances']}", a, num(r["threshold"]), r["accepted"],
             r["failures"], num(r["p_value"]), pct(r["upper_bound"])]
            for klass, c in cert["classes"].items() for a, r in c["budgets"].items()]
    return markdown(["evidence class", "pairs", "α", "certified threshold (same-scene: depth share; other: logit)", "accepted",
                     "beyond tolerance", "p-value", f"upper {1 - cert['delta']:.0%} bound"], rows)


# The README's headline rows, in its order, with what each workload is (docs/tinyworld.md)
HEADLINE_WORKLOADS = {
    "serve": "`serve` (popular prompts, paraphrases)",
    "serve_reworded": "`serve_reworded` (wording never trained on)",
    "iterate": "`iterate` (editing sessions)",
    "iterate_replicate": "`iterate_replicate` (52 more sessions)",
    "novel": "`novel` (edit kinds never calibrated)",
}


def ci_text(m: dict) -> str:
    lo, hi = m.get("false_accept_ci95") or (None, None)
    return pct(m["false_accept_rate"]) + (f" [{100 * lo:.1f}, {100 * hi:.1f}]" if lo is not None else "")


def headline_table(res: dict) -> str:
    """Carnator at the main budget on each workload beside text similarity at the nearest hit
    rate: the README's results table (tests/test_tinyworld_bench.py checks they agree)."""
    rows = []
    for wl, label in HEADLINE_WORKLOADS.items():
        if wl not in res["workloads"]:
            continue
        m = res["workloads"][wl]["carnator"]
        text = (res.get("comparison") or {}).get(wl, {}).get("text_false_accept_rate")
        rows.append([label, pct(m["hit_rate"]), ci_text(m), pct(text),
                     f"**{m['steps_speedup_hits']:.2f}×**" if wl in ("serve", "iterate") else num(m["steps_speedup_hits"], "×"),
                     num(m["compute_speedup_workload"], "×"), f"{m['psnr_hits_mean']:.1f} dB",
                     f"{pct(m['checker_accuracy'])} / {pct(m['checker_accuracy_full'])}"])
    return markdown(["workload", "hit rate", "false accepts [95% CI]", "text similarity",
                     "steps saved on gate hits", "whole workload", "PSNR on hits",
                     "checker (Carnator / full)"], rows)


def budget_table(res: dict) -> str:
    """Every workload at every budget (docs/results.md): hits, false accepts over all hits and
    gate hits alone, depth, steps saved by kind of hit, the whole workload, quality."""
    rows = []
    for wl in [w for w in HEADLINE_WORKLOADS if w in res["sweeps"]]:
        for m in res["sweeps"][wl]["carnator"]:
            same = m.get("steps_speedup_same_scene_hits")
            rows.append([wl, f"{m['risk_budget']:g}", pct(m["hit_rate"]),
                         f"{ci_text(m)} ({pct(m['gate_false_accept_rate'])})",
                         "—" if m.get("mean_reuse_step") is None else f"{m['mean_reuse_step']:.1f}",
                         num(m["steps_speedup_hits"], "×"), num(m.get("steps_speedup_other_hits"), "×"),
                         f"{num(same, '×')} ({pct(m.get('same_scene_hit_rate'))})",
                         num(m["compute_speedup_workload"], "×"), f"{m['psnr_hits_mean']:.1f} dB",
                         f"{pct(m['checker_accuracy'])} / {pct(m['checker_accuracy_full'])}"])
    return markdown(["workload", "α", "hit rate", "false accepts [95% CI] (gate hits alone)", "mean k*",
                     "steps saved, gate hits", "other hits", "same-scene hits (share)", "whole workload",
                     "PSNR on hits", "checker (system / full)"], rows)


def why_table(res: dict) -> str:
    """Per workload and budget, the requests no gate hit served, by why (gate.WHY_NOT), from
    the results of runs that recorded it."""
    rows = []
    for wl, sweep in res["sweeps"].items():
        for m in sweep["carnator"]:
            if "not_reused" in m:
                rows.append([wl, f"{m['risk_budget']:g}", m["requests"],
                             ", ".join(f"{why} {n}" for why, n in m["not_reused"].items())])
    return markdown(["workload", "α", "requests", "not served by a gate hit, by why"], rows)


def calibration_table(rep: dict) -> str:
    rows = [[v["alpha"], v["accepted"], pct(v["false_accept_rate"]), pct(v["false_accept_upper95"]),
             v["holds"]] for v in rep["heldout"].values()]
    return markdown(["α", "accepted (held out)", "false-accept rate", "upper 95%", "holds"], rows)


def main() -> None:
    import sys
    res = _load("tinyworld.json")
    if "--headline" in sys.argv[1:]:
        print(headline_table(res))
        return
    if "--budgets" in sys.argv[1:]:
        print(budget_table(res))
        return
    if "--why" in sys.argv[1:]:
        print(why_table(res))
        return
    if res:
        s = res["settings"]
        print(f"Model {s['model']} (fingerprint {s['fingerprint'][:12]}), {s['steps']} steps, "
              f"cfg {s['cfg']}, {s['sampler']}; {s.get('seconds')} s\n")
        print(systems_table(res), "\n")
        print("Checker agreement of full computation, per attribute:\n")
        print(attributes_table(res), "\n")
        print(matched_table(res), "\n")
        print("Depth and speed by risk budget:\n")
        print(depth_table(res), "\n")
        if any(k.startswith(("easycache", "carnator_easycache")) for w in res["workloads"].values() for k in w):
            print("Carnator, EasyCache, and both:\n")
            print(easycache_table(res), "\n")
    rep = _load("calibration_report.json")
    if rep:
        print(f"Calibration: {rep['instances']} candidate pairs, {rep['measured_reuses']} measured "
              f"reuses, {rep['exceeded_tolerance']} beyond tolerance; held out by pair:\n")
        print(calibration_table(rep), "\n")
        print("Certified thresholds (Learn-then-Test):\n")
        print(certification_table(rep), "\n")
    loc = _load("localization.json")
    if loc:
        print("Localization:", json.dumps(loc["summary"]))


if __name__ == "__main__":
    main()
