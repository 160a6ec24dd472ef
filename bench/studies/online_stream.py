"""Certifying online on a live stream: a cheap calibration, audits and exploration at a few
percent, and what the gate is allowed over 2,000+ requests served through the real pipeline.

    S=bench/results/studies
    nice .venv/bin/python bench/studies/online_stream.py --alphas 0.05 --start-budget 173 --out $S/online_stream_a5.json &
    nice .venv/bin/python bench/studies/online_stream.py --alphas 0.1 --start-budget 70 --out $S/online_stream_a10.json
    # the baseline: the same stream under the bundled full calibration, no audits
    nice .venv/bin/python bench/studies/online_stream.py --start full --audit-rate 0 --explore-rate 0 \
        --alphas 0.05 --out $S/online_stream_full_a5.json &   # and --alphas 0.1 … full_a10.json
    .venv/bin/python bench/studies/online_stream.py --merge $S/online_stream_a5.json $S/online_stream_a10.json \
        $S/online_stream_full_a5.json $S/online_stream_full_a10.json   # + rows of calibration_cost.json
    .venv/bin/python bench/studies/online_stream.py --limit 40 --alphas 0.1 --out /tmp/s.json   # a quick one

The stream: the tiny world's own workloads interleaved line by line, each file's order kept
(editing sessions stay sessions) — first ``serve``, ``serve_reworded``, ``iterate`` and
``iterate_replicate`` (1,182 requests), then the drift: ``serve_fresh`` and ``iterate_fresh``
(every scene worded anew from held-out sentence families and ignored words) and ``drift``
(edit kinds no calibration pair has), 1,174 requests.

The gate starts from the cheapest certified calibration: the cheap procedure's committed pairs
(bench/results/cheap_calibration/; --pool mixed: those drawn without the paraphrase lead,
bench/results/studies/cheap_mixed_pool/) cut to --start-budget generation-equivalents (173 and
70 are the least that certify α = 5% and 10% there) and certified
as the cheap procedure does, with the transferred ranking's points kept as each cell's ladder
(so a cell certified at no budget may be certified online). Requests run through
``run_request`` at α with ``audit_rate`` and ``explore_rate`` (each audited or explored request
is computed in full once: one generation-equivalent), the audit labelling decoded frames by
the calibration's PSNR bound. Every request is also computed in full apart, as the truth: a
hit is a false accept when its PSNR against that is below 30 dB or the checker flips where the
full computation is right (the benchmark's rule; the audits never see the checker).

Written per α: per request its outcome, cell, depth, audit or exploration and truth; every
--every requests the online certificate per cell (the threshold the gate runs at, the
calibration's, audits and their cost); the running false-accept rate with its 95%
Clopper–Pearson upper bound at every prefix; JSON and a PNG (--merge: one JSON for both α
and the plot, bench/results/online_stream.json and .png).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

from study_paths import REPO  # noqa: E402 - sys.path for the repository, tests/ and bench/

from carnator_core.calibration.risk_control import clopper_pearson_upper  # noqa: E402

RESULTS = os.path.join(REPO, "bench", "results")
OUT = os.path.join(RESULTS, "online_stream.json")
# a cheap pool without the paraphrase lead (bench/studies/cheap_calibration.py --lead 0, to 400)
MIXED_POOL = os.path.join(RESULTS, "studies", "cheap_mixed_pool")
CALM = ("serve", "serve_reworded", "iterate", "iterate_replicate")
DRIFT = ("serve_fresh", "iterate_fresh", "drift")
STEPS, PROBE, PSNR_BOUND = 20, 0.05, 30.0


def interleave(names: tuple[str, ...], load) -> list[dict]:
    """Lines of several workloads, one from each in turn, each file's order kept."""
    queues = [[{**ln, "workload": name} for ln in load(name)[1]] for name in names]
    out = []
    while any(queues):
        for q in queues:
            if q:
                out.append(q.pop(0))
    return out


def start_calibration(budget: float, folder: str, fingerprint: str, pool: str):
    """The cheap procedure's committed pairs in ``pool`` (a cheap_calibration.py folder) cut to
    ``budget``, certified as it certifies them (with its ladders), saved where the gate looks in
    ``folder``. Returns (model, report), the report with what the pairs cost."""
    import cheap_calibration as CC
    from carnator_core.calibration import cheap
    from carnator_core.calibration import fit as CAL
    from carnator_core.calibration.generic import _progress_rows
    from carnator_core.gate import GateSettings
    from carnator_core.pipeline import ReuseSettings
    settings = ReuseSettings(probe_fraction=PROBE, gate=GateSettings(), region_fill_on_m=True, region_margin=1,
                             other_finish_calls=4, other_finish_region=True)
    progress = cheap.cheap_progress_path(CAL.calibration_path(pool, fingerprint, PROBE))
    rows = CC.prefix(list(_progress_rows(progress).values()), budget)
    _, transferred = CC.transferred_model(CC.full_calibration()[0])
    model, report = cheap.fit_rows(rows, transferred, settings, STEPS,
                                   tolerance={"psnr_bound": PSNR_BOUND, "space": "frames"})
    CAL.save(model, folder, fingerprint)
    report["cost_generations"] = round(sum(CC.PairCost.of(r, r["instances"], STEPS).generations for r in rows), 2)
    return model, report


def bundled_calibration(bench, folder: str, fingerprint: str):
    """The bundled full calibration for this probe and N, where the gate looks in ``folder``."""
    from carnator_core.gate import RiskModel, calibration_file
    path = calibration_file(folder, fingerprint, PROBE)
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(bench.default_risk_model(fingerprint, PROBE, STEPS), path)
    from calibration_cost import bundled_cost
    cost = bundled_cost(fingerprint, STEPS)["cost_generations"]
    model = RiskModel.load(path)
    return model, {"procedure": "full_checker", "cost_generations": cost,
                   "thresholds": {k: v for k, v in model.thresholds.items() if ":" not in k}}


def serve(world, bench, lines, refs, alpha, folder, audit_rate, explore_rate, every) -> tuple[list, list]:
    from audit_stream import TinyWorldVAE
    from carnator_core.calibration.status import model_status
    from carnator_core.comfy_adapter import run_request
    from carnator_core.gate import GateSettings, RiskModel, calibration_file
    from carnator_core.pipeline import ReuseSettings
    settings = ReuseSettings(probe_fraction=PROBE, gate=GateSettings(risk_budget=alpha),
                             audit_rate=audit_rate, explore_rate=explore_rate)
    settings.sparse.enabled = False
    model = RiskModel.load(calibration_file(folder, world.fingerprint, PROBE))
    vae, recs, timeline = TinyWorldVAE(world), [], []
    for i, ln in enumerate(lines):
        with bench.PlanTap() as tap:
            samples, s = run_request(world.model, world.cond(ln["prompt"]), world.negative, world.latent(),
                                     int(ln["seed"]), world.steps, world.cfg, world.sampler, world.scheduler,
                                     settings, {"folder": folder, "capacity_bytes": 1 << 31},
                                     seed_policy=refs[i]["policy"], label=ln["prompt"], vae=vae)
        features = tap.features()
        v = world.video(samples)
        q, ok = bench.psnr(v, refs[i]["video"]), bench.check_ok(v, ln["scene"])
        audit = s.audit or {}
        recs.append({"i": i, "workload": ln["workload"], "outcome": s.outcome, "why": s.why,
                     "reuse_step": s.reuse_step, "steps_total": s.steps_total,
                     "steps_computed": s.step_equivalents,
                     "cell": model.cell(features) if features else None,
                     "psnr": round(q, 2),
                     "false_accept": int(s.outcome == "hit" and (q < PSNR_BOUND or (refs[i]["ok"] and not ok))),
                     "audited": bool(audit.get("audited")), "explored": bool(audit.get("explored")),
                     "online": "online" in (s.calibration or "")})
        if (i + 1) % every == 0 or i + 1 == len(lines):
            st = model_status(folder, world.fingerprint, model, PROBE, STEPS)["online"].get(f"{alpha:g}", {})
            timeline.append({"i": i + 1, "text": st.get("text", ""), "cells": st.get("cells", {})})
            print(f"  α {alpha:g}: {i + 1}/{len(lines)} {st.get('text', '')}", flush=True)
    return recs, timeline


def running(recs: list[dict]) -> list[dict]:
    """After each hit: false accepts so far, their rate and 95% upper bound."""
    out, hits, bad = [], 0, 0
    for r in recs:
        if r["outcome"] == "hit":
            hits, bad = hits + 1, bad + r["false_accept"]
            out.append({"i": r["i"], "hits": hits, "false_accepts": bad, "rate": bad / hits,
                        "upper95": clopper_pearson_upper(bad, hits, 0.05)})
    return out


def summary(recs: list[dict], alpha: float, half: int) -> dict:
    def part(rs):
        hits = [r for r in rs if r["outcome"] == "hit"]
        bad = sum(r["false_accept"] for r in hits)
        return {"requests": len(rs), "gate_hits": len(hits), "false_accepts": bad,
                "false_accept_rate": bad / len(hits) if hits else None,
                "upper95": clopper_pearson_upper(bad, len(hits), 0.05) if hits else None,
                "steps_speedup": sum(r["steps_total"] for r in rs) / max(1e-9, sum(r["steps_computed"] for r in rs)),
                "gate_hit_speedup": (sum(r["steps_total"] for r in hits) / sum(r["steps_computed"] for r in hits)
                                     if hits else None),
                "saved_steps": sum(r["steps_total"] - r["steps_computed"] for r in rs),
                "audited": sum(r["audited"] for r in rs), "explored": sum(r["explored"] for r in rs)}
    run = running(recs)
    late = [p for p in run if p["hits"] >= 50]  # a rate over a handful of hits says little
    return {"all": part(recs), "before_drift": part(recs[:half]), "after_drift": part(recs[half:]),
            "max_running_rate_after_50_hits": max((p["rate"] for p in late), default=None),
            "prefixes_over_alpha_after_50_hits": sum(p["rate"] > alpha for p in late),
            "audit_cost_generations": sum(r["audited"] or r["explored"] for r in recs)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--alphas", type=float, nargs="+", default=[0.05, 0.1])
    ap.add_argument("--audit-rate", type=float, default=0.05)
    ap.add_argument("--explore-rate", type=float, default=0.05)
    ap.add_argument("--start-budget", type=float, default=200.0,
                    help="generation-equivalents of the cheap calibration the gate starts from")
    ap.add_argument("--pool", choices=("lead", "mixed"), default="lead",
                    help="the cheap pairs it starts from: the committed pool (lead) or the one without the lead")
    ap.add_argument("--start", choices=("cheap", "full"), default="cheap",
                    help="full: the bundled (full) calibration instead, the baseline the cheap one is compared with "
                         "(run it with --audit-rate 0 --explore-rate 0)")
    ap.add_argument("--limit", type=int, default=None, help="first requests of each half")
    ap.add_argument("--every", type=int, default=25, help="read the online certificate every this many requests")
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="merge per-α result files into --out and plot")
    ap.add_argument("--no-cost-rows", action="store_true", help="with --merge: leave calibration_cost.json alone")
    a = ap.parse_args(argv)
    if a.merge:
        return merge(a.merge, a.out, cost=not a.no_cost_rows)
    from calibrate import _load_bench
    bench = _load_bench()
    world = bench.World(bench.DEFAULT_MODEL, steps=STEPS)
    calm, drift = interleave(CALM, bench.load_workload), interleave(DRIFT, bench.load_workload)
    if a.limit:
        calm, drift = calm[:a.limit], drift[:a.limit]
    lines = calm + drift
    t0 = time.time()
    print(f"{len(lines)} requests ({len(calm)} before the drift): reference …", flush=True)
    refs = []
    for start in range(0, len(lines), 100):  # keep only what the truth needs (a run's record is large)
        refs += [{k: r[k] for k in ("video", "ok", "policy")}
                 for r in bench.run_reference(world, lines[start:start + 100], (), 1)]
    out = {"what": "a live stream through run_request on the tiny world (not a replay)", "start": a.start,
           "model_fingerprint": world.fingerprint,
           "requests": len(lines), "drift_at": len(calm), "calm": list(CALM), "drift": list(DRIFT),
           "audit_rate": a.audit_rate, "explore_rate": a.explore_rate, "steps": STEPS, "probe_fraction": PROBE,
           "truth": f"PSNR ≥ {PSNR_BOUND:g} dB against the request's own full computation and the checker agreeing "
                    "where that is right", "alphas": {}}
    workdir = tempfile.mkdtemp(prefix="carnator_stream_")
    try:
        for alpha in a.alphas:
            folder = os.path.join(workdir, f"a{alpha:g}")
            if a.start == "full":
                model, start = bundled_calibration(bench, folder, world.fingerprint)
            else:
                import cheap_calibration as CC
                pool = CC.FOLDER if a.pool == "lead" else MIXED_POOL
                model, report = start_calibration(a.start_budget, folder, world.fingerprint, pool)
                start = {"procedure": "cheap", "budget_generations": a.start_budget,
                         "pool": os.path.relpath(pool, REPO),
                         "cost_generations": report["cost_generations"], "pairs": report["pairs"],
                         "certified": report["certified"], "ladders": model.ladders,
                         "thresholds": {k: v for k, v in model.thresholds.items() if ":" not in k}}
            recs, timeline = serve(world, bench, lines, refs, alpha, folder, a.audit_rate, a.explore_rate, a.every)
            out["alphas"][f"{alpha:g}"] = {"start_calibration": start, "summary": summary(recs, alpha, len(calm)),
                                           "timeline": timeline, "running": running(recs), "records": recs}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    out["seconds"] = round(time.time() - t0, 1)
    write(out, a.out)
    return out


def write(out: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    for alpha, r in out["alphas"].items():
        s = r["summary"]
        for k in ("before_drift", "after_drift", "all"):
            v = s[k]
            fa = "—" if v["false_accept_rate"] is None else f"{v['false_accept_rate']:.1%} (≤ {v['upper95']:.1%})"
            print(f"α {alpha} {k:13s} hits {v['gate_hits']:4d}/{v['requests']:4d}  false accepts {v['false_accepts']:3d} "
                  f"{fa}  steps {v['steps_speedup']:.2f}x  audited {v['audited']} explored {v['explored']}")
        print(f"α {alpha}: audit cost {s['audit_cost_generations']} generations; last: {r['timeline'][-1]['text']!r}")
    print(f"wrote {os.path.relpath(path, REPO)}")


def merge(paths: list[str], out_path: str, cost: bool = True) -> dict:
    parts = [json.load(open(p)) for p in paths]
    for p in parts:  # summaries read again from the records (the same rules for every part)
        for a, r in p["alphas"].items():
            r["summary"] = summary(r["records"], float(a), p["drift_at"])
    full = {a: {"start_calibration": r["start_calibration"], "summary": r["summary"]}
            for p in parts if p.get("start") == "full" for a, r in p["alphas"].items()}
    fingerprint = next((p["model_fingerprint"] for p in parts if p.get("model_fingerprint")), None)
    parts = [p for p in parts if p.get("start") != "full"]
    out = {k: v for k, v in parts[0].items() if k not in ("alphas", "seconds")}
    out["model_fingerprint"] = fingerprint
    # the per-request records stay in the parts; the certificate over time, per cell, in brief
    out["alphas"] = {a: {**{k: v for k, v in r.items() if k not in ("records", "timeline")},
                         "timeline": [{"i": t["i"], "text": t["text"], "cells": {
                             c: {k: v[k] for k in ("offline", "operating", "explore", "audits", "cost_generations")}
                             for c, v in t["cells"].items()}} for t in r["timeline"]]}
                     for p in parts for a, r in p["alphas"].items()}
    out["seconds"] = sum(p.get("seconds", 0) for p in parts)
    out["parts"] = [os.path.relpath(p, REPO) for p in paths]
    if full:  # the same stream under the full calibration, no audits: what the cheap start keeps
        out["full_calibration"] = full
        for a, r in out["alphas"].items():
            if a in full:
                mine, theirs = r["summary"]["all"], full[a]["summary"]["all"]
                r["summary"]["kept_of_full"] = {
                    "gate_hit_speedup": mine["gate_hit_speedup"] / theirs["gate_hit_speedup"],
                    "saved_steps": mine["saved_steps"] / theirs["saved_steps"]}
        if cost:
            cost_rows(out)
    out["plot"] = plot(out, os.path.splitext(out_path)[0] + ".png")
    write(out, out_path)
    return out


def cost_rows(out: dict) -> None:
    """The stream's rows of bench/results/calibration_cost.json: the cheap start and the full
    calibration, each α, on this served stream (audits and exploration on for the cheap one)."""
    from calibration_cost import merge as merge_rows
    note = ("a live stream of the tiny world's workloads with a drift half-way (bench/studies/online_stream.py); "
            "the cheap start with 5% audits and 5% exploration, the full calibration without; speedup_kept: the cheap "
            "start's gate-hit steps speedup over the full calibration's on the same stream (saved_steps_kept: its "
            "saved steps over theirs, the workload as a whole)")
    rows = []
    for a, r in out["alphas"].items():
        start, mine = r["start_calibration"], r["summary"]
        theirs = out["full_calibration"][a]
        for procedure, s, cost, budget, kept in (
                ("cheap", mine, start["cost_generations"], start.get("budget_generations"), mine.get("kept_of_full")),
                ("full_checker", theirs["summary"], theirs["start_calibration"]["cost_generations"], None,
                 {"gate_hit_speedup": 1.0, "saved_steps": 1.0})):
            al = s["all"]
            rows.append({"model": out["model_fingerprint"], "procedure": procedure, "workload": "online_stream", "alpha": float(a),
                         "steps": STEPS, "budget_generations": budget, "cost_generations": cost,
                         "requests": al["requests"], "gate_hits": al["gate_hits"],
                         "false_accept_rate": al["false_accept_rate"], "fa_upper95": al["upper95"],
                         "gate_hit_speedup": al["gate_hit_speedup"], "workload_speedup": al["steps_speedup"],
                         "speedup_kept": kept["gate_hit_speedup"], "saved_steps_kept": kept["saved_steps"],
                         "note": note})
    merge_rows(rows)


def plot(out: dict, path: str, cap: float = 0.3) -> str:
    """Per α: the running false-accept rate of gate hits and its 95% upper bound (capped),
    against α, with the drift marked."""
    from calibrate import _load_bench
    _pil_plot = _load_bench()._pil_plot
    series = []
    for alpha, r in out["alphas"].items():
        run = [p for p in r["running"] if p["hits"] >= 10]
        series += [(f"alpha {alpha}: running FA", [(p["i"], min(cap, p["rate"])) for p in run]),
                   (f"alpha {alpha}: 95% upper", [(p["i"], min(cap, p["upper95"])) for p in run]),
                   (f"alpha = {alpha}", [(0, float(alpha)), (out["requests"], float(alpha))])]
    series.append(("drift", [(out["drift_at"], 0.0), (out["drift_at"], cap)]))
    _pil_plot(series, "request", f"false-accept rate of gate hits (capped at {cap:.0%})", path, size=(900, 520))
    return os.path.relpath(path, REPO)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
