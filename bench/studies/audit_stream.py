"""Live audits under drift: serve a stream the calibration never saw, audit a
share of the hits, and watch the running false-accept estimate, the moment the gate
tightens, and the false-accept rate after it.

    nice .venv/bin/python bench/studies/audit_stream.py                    # drift.jsonl, α 0.05, audits 50%
    .venv/bin/python bench/studies/audit_stream.py --limit 60 --out /tmp/a.json   # a quick one

The stream (bench/workloads/drift.jsonl, scripts/make_workloads.py) is editing sessions that
mix iterate's edits with edit kinds no calibration pair contains (two attributes at once,
colours swapped, objects added or removed, speed words). It is served twice through the real
pipeline, on the tiny world's model with its checker-based calibration: with audits off,
and with audits at --audit-rate (each audited hit computed again in full and labelled by
the calibration's tolerance, PSNR of decoded frames; the audit never sees the checker).
Every hit is also judged against the request's own full computation the way the benchmark
does (PSNR < 30 dB or the checker disagreeing where the full computation agrees): that is
the true false-accept rate, before and after the gate tightened. Writes
bench/results/audit_stream.json and audit_stream.png.
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

from carnator_core.calibration.risk_control import clopper_pearson_lower, clopper_pearson_upper  # noqa: E402

RESULTS = os.path.join(REPO, "bench", "results")


class TinyWorldVAE:
    """The tiny world's decoder in a VAE's place: ``decode(latent)`` → frames in 0..1."""

    def __init__(self, world):
        self.world = world

    def decode(self, latent):
        return self.world.video(latent)


def serve(world, lines, refs, budget, rm_path, audit_rate, psnr_bound, workdir) -> list[dict]:
    from bench_tw import check_ok, psnr
    from carnator_core.comfy_adapter import run_request
    from carnator_core.gate import GateSettings
    from carnator_core.pipeline import ReuseSettings
    folder = os.path.join(workdir, f"audit_{audit_rate:g}")
    os.makedirs(os.path.join(folder, "calibration"))
    shutil.copy(rm_path, os.path.join(folder, "calibration", f"{world.fingerprint}.json"))
    settings = ReuseSettings(probe_fraction=0.1, gate=GateSettings(risk_budget=budget),
                             audit_rate=audit_rate)
    settings.sparse.enabled = False
    vae, recs = TinyWorldVAE(world), []
    for i, ln in enumerate(lines):
        samples, s = run_request(world.model, world.cond(ln["prompt"]), world.negative, world.latent(),
                                 int(ln["seed"]), world.steps, world.cfg, world.sampler, world.scheduler,
                                 settings, {"folder": folder, "capacity_bytes": 1 << 30},
                                 seed_policy=refs[i]["policy"], label=ln["prompt"], vae=vae)
        v = world.video(samples)
        q, ok = psnr(v, refs[i]["video"]), check_ok(v, ln["scene"])
        rec = {"i": i, "edit": ln.get("edit"), "outcome": s.outcome, "reuse_step": s.reuse_step,
               "steps_computed": s.steps_computed, "steps_total": s.steps_total, "psnr": q,
               "false_accept": int(s.outcome == "hit" and (q < psnr_bound or (refs[i]["ok"] and not ok))),
               "tightened_note": "tightened by live audits" in (s.reason or "")}
        if s.audit and s.audit.get("audited"):
            rec["audit"] = {k: s.audit.get(k) for k in ("psnr", "label", "klass", "level", "audits",
                                                        "failures", "rate", "lower", "upper", "tightened")}
        recs.append(rec)
        if (i + 1) % 50 == 0:
            print(f"  audits {audit_rate:g}: {i + 1}/{len(lines)}", flush=True)
    return recs


def rates(recs: list[dict]) -> dict:
    hits = [r for r in recs if r["outcome"] == "hit"]
    bad = sum(r["false_accept"] for r in hits)
    n = len(hits)
    steps = sum(r["steps_total"] for r in recs) / max(1, sum(r["steps_computed"] for r in recs))
    return {"requests": len(recs), "gate_hits": n, "false_accepts": bad,
            "false_accept_rate": bad / n if n else None,
            "ci90": [clopper_pearson_lower(bad, n, 0.05), clopper_pearson_upper(bad, n, 0.05)] if n else None,
            "hit_rate": n / len(recs) if recs else None, "workload_steps_speedup": steps}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="drift")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--budget", type=float, default=0.05)
    ap.add_argument("--audit-rate", type=float, default=0.5)
    ap.add_argument("--risk-model", default=None, help="default: the bundled models/calibration/<fingerprint>.json")
    ap.add_argument("--psnr-bound", type=float, default=30.0)
    ap.add_argument("--out", default=os.path.join(RESULTS, "audit_stream.json"))
    ap.add_argument("--replot", action="store_true", help="redraw --out's plot from its JSON; run nothing")
    a = ap.parse_args(argv)
    from calibrate import _load_bench
    bench = _load_bench()
    if a.replot:
        return replot(a.out)
    from carnator_core.pipeline import ReuseSettings
    world = bench.World(bench.DEFAULT_MODEL)
    rm_path = a.risk_model or bench.default_risk_model(world.fingerprint)
    name, lines = bench.load_workload(a.workload, a.limit)
    settings = ReuseSettings(probe_fraction=0.1)
    t0 = time.time()
    print(f"[{name}] {len(lines)} requests: reference …", flush=True)
    refs = bench.run_reference(world, lines, (), settings.probe_steps(world.steps))
    workdir = tempfile.mkdtemp(prefix="carnator_audit_")
    try:
        plain = serve(world, lines, refs, a.budget, rm_path, 0.0, a.psnr_bound, workdir)
        audited = serve(world, lines, refs, a.budget, rm_path, a.audit_rate, a.psnr_bound, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    first_tight = next((r["i"] for r in audited if r.get("audit", {}).get("tightened")), None)
    running = [{"i": r["i"], **r["audit"]} for r in audited if "audit" in r]
    result = {
        "workload": name, "budget": a.budget, "audit_rate": a.audit_rate, "risk_model": os.path.relpath(rm_path, REPO),
        "tolerance": {"audit": f"PSNR of decoded frames ≥ {a.psnr_bound:g} dB (the calibration's, no checker)",
                      "truth": f"PSNR ≥ {a.psnr_bound:g} dB and the checker agreeing where the full computation does"},
        "tightening_rule": "a class tightens once its audits at the current level number at least "
                           "min_accepted(α, δ=0.1) and their false-accept rate exceeds α (carnator_core/calibration/audit.py)",
        "audits_off": rates(plain),
        "audits_on": rates(audited),
        "first_tightened_at_request": first_tight,
        "tightenings": [{"i": r["i"], "klass": r["audit"]["klass"], "level": r["audit"]["level"]}
                        for r in audited if r.get("audit", {}).get("tightened")],
        "before_tightening": rates([r for r in audited if first_tight is None or r["i"] <= first_tight]),
        "after_tightening": rates([r for r in audited if first_tight is not None and r["i"] > first_tight]),
        "same_stretch_audits_off": rates([r for r in plain if first_tight is not None and r["i"] > first_tight]),
        "audits": len([r for r in audited if "audit" in r]),
        "audit_steps_share": (sum(r["steps_total"] for r in audited if "audit" in r)
                              / max(1, sum(r["steps_computed"] for r in audited))),
        "running": running,
        "records": {"audits_off": plain, "audits_on": audited},
        "seconds": round(time.time() - t0, 1),
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    result["plot"] = plot(result, os.path.splitext(a.out)[0] + ".png")
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    for k in ("audits_off", "audits_on", "before_tightening", "after_tightening", "same_stretch_audits_off"):
        v = result[k]
        fa = "—" if v["false_accept_rate"] is None else f"{v['false_accept_rate']:.1%}"
        print(f"{k:26s} hits {v['gate_hits']:4d}  false accepts {v['false_accepts']:3d} ({fa})  "
              f"steps speedup {v['workload_steps_speedup']:.2f}x")
    print(f"first tightening at request {first_tight}; wrote {a.out}")
    return result


def plot(result: dict, path: str, cap: float = 0.3) -> str:
    """The audits of the class that tightened (else the most audited), with its interval
    (values above ``cap`` drawn at the cap), against α and the true cumulative false-accept
    rate with audits on and off."""
    from bench_tw import _pil_plot
    counts: dict = {}
    for r in result["running"]:
        counts[r["klass"]] = counts.get(r["klass"], 0) + 1
    tightened = [t["klass"] for t in result["tightenings"]]
    klass = tightened[0] if tightened else max(counts, key=counts.get)
    run = [r for r in result["running"] if r["klass"] == klass]
    c = lambda v: min(v, cap)  # noqa: E731
    series = [(f"audits ({klass}): estimate", [(r["i"], c(r["rate"])) for r in run if r["rate"] is not None]),
              ("audits: 90% upper", [(r["i"], c(r["upper"])) for r in run]),
              ("audits: 90% lower", [(r["i"], c(r["lower"])) for r in run])]
    n = result["audits_on"]["requests"]
    series.append((f"alpha = {result['budget']:g}", [(0, result["budget"]), (n, result["budget"])]))
    for label, recs in (("true FA, audits on (cumulative)", result["records"]["audits_on"]),
                        ("true FA, audits off (cumulative)", result["records"]["audits_off"])):
        pts, hits, bad = [], 0, 0
        for r in recs:
            if r["outcome"] == "hit":
                hits, bad = hits + 1, bad + r["false_accept"]
                pts.append((r["i"], c(bad / hits)))
        series.append((label, pts))
    if result["first_tightened_at_request"] is not None:
        t = result["first_tightened_at_request"]
        series.append(("gate tightened", [(t, 0.0), (t, cap)]))
    _pil_plot(series, "request", f"false-accept rate (audit counts restart at each level; capped at {cap:.0%})",
              path, size=(900, 520))
    return os.path.relpath(path, REPO)


def replot(path: str) -> None:
    """Redraw a result file's plot without serving anything."""
    with open(path) as f:
        result = json.load(f)
    plot(result, os.path.splitext(path)[0] + ".png")


if __name__ == "__main__":
    main()
