"""Farm benchmark: N worker processes serve the tiny world's ``serve`` workload, once sharing
one PostgreSQL cache and once each with a private SQLite cache, side by side.

    nice -n 10 .venv/bin/python bench/farm.py --workers 3 --records   # the whole serve workload
    # the same with the gate's recurring_sources off in both modes
    nice -n 10 .venv/bin/python bench/farm.py --workers 3 --records --no-recurring-sources \
        --out bench/results/farm_no_recurring_sources.json

Request i goes to worker i mod N (a load balancer's round robin); the workers run at the
same time, each on one thread, the committed tiny-world model and its bundled calibration for
the samplers' probe, at α = 5%. Written to bench/results/farm.json: per mode, hit rate (gate
hits and exact repeats), the share of denoising steps computed, the wall time of the whole
workload, and ``explained``: the requests grouped by what served them (a hit's source the same
scene or not, stored by this worker or another) or the gate's reason for none, each group with
its steps; ``--records`` keeps every request's record. The speedup is private wall time over
shared wall time, measured in the same run. It also checks lookup on real tiny-world
signatures: every stored entry queries the shared cache (leave one out) and the top candidate
is compared with the exhaustive ranking's.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"


def worker(location: str, lines: list[dict], local: str, probe_fraction: float,
           recurring_sources: bool = True) -> list[dict]:
    """Serve ``lines`` in order against the cache at ``location``; one record per request,
    with the gate's reason where no reuse served it and the entry each hit resumed from."""
    import importlib.util  # bench/tinyworld.py, not the tinyworld package it shares a name with
    spec = importlib.util.spec_from_file_location("tinyworld_bench", ROOT / "bench" / "tinyworld.py")
    tw = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tw)
    World, default_risk_model = tw.World, tw.default_risk_model
    world = World()  # imports the ComfyUI host first
    from tinyworld import world as WD  # the scene as the checker reads it, whatever the prose
    from carnator_core.comfy_adapter import run_request
    from carnator_core.gate import GateSettings, calibration_file
    from carnator_core.pipeline import ReuseSettings
    from carnator_core.reuse.sparse_reuse import SparseSettings
    model_file = default_risk_model(world.fingerprint, probe_fraction, world.steps)
    # the same calibrated gate in both modes (the calibration carries its recipe, fill of M and
    # finishes, which hits then run): a SQLite cache reads calibration files in its own folder,
    # a PostgreSQL one in this machine's local folder (cache/postgres.py)
    for folder in ([local] + ([location] if "://" not in location else [])) if model_file else []:
        dst = calibration_file(folder, world.fingerprint, probe_fraction)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(model_file, dst)
    settings = ReuseSettings(probe_fraction=probe_fraction,
                             gate=GateSettings(risk_budget=0.05, recurring_sources=recurring_sources),
                             sparse=SparseSettings(enabled=False))
    out = []
    for ln in lines:
        t0 = time.perf_counter()
        _, s = run_request(world.model, world.cond(ln["prompt"]), world.negative, world.latent(),
                           int(ln["seed"]), world.steps, world.cfg, world.sampler, world.scheduler,
                           settings, {"folder": location, "capacity_bytes": 1 << 32},
                           seed_policy=ln.get("seed_policy", "same_seed"), label=ln["prompt"])
        out.append({"i": ln["i"], "outcome": s.outcome, "t": time.perf_counter() - t0,
                    "steps_total": s.steps_total, "steps_computed": s.step_equivalents,
                    "why": s.why, "entry_id": s.entry_id, "stored_id": s.stored_id,
                    "reuse_step": s.reuse_step, "calibrated": s.calibration.startswith("gate: calibrated"),
                    "scene": str(WD.scene_key(ln["scene"])) if ln.get("scene") else None})
    return out


def run_mode(mode: str, lines: list[dict], n: int, tmp: Path, url: str | None,
             probe_fraction: float, recurring_sources: bool = True) -> tuple[dict, list[dict]]:
    procs = []
    t0 = time.perf_counter()
    for w in range(n):
        share = [ln for ln in lines if ln["i"] % n == w]
        job = tmp / f"{mode}-{w}.json"
        job.write_text(json.dumps({"lines": share, "recurring_sources": recurring_sources}))
        location = url if mode == "shared" else str(tmp / f"private-{w}")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CARNATOR_CACHE_DIR": str(tmp / f"local-{mode}-{w}")}
        procs.append(subprocess.Popen([sys.executable, __file__, "--one", location, str(job), f"{probe_fraction:g}"],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    recs = []
    for w, p in enumerate(procs):
        out, err = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"{mode} worker failed:\n{err[-3000:]}")
        recs.extend({**r, "worker": w} for r in json.loads(out.strip().splitlines()[-1]))
    wall = time.perf_counter() - t0
    recs.sort(key=lambda r: r["i"])
    hits = sum(r["outcome"] in ("hit", "exact") for r in recs)
    row = {"mode": mode, "workers": n, "requests": len(recs), "hit_rate": round(hits / len(recs), 4),
           "gate_hits": sum(r["outcome"] == "hit" for r in recs),
           "exact_repeats": sum(r["outcome"] == "exact" for r in recs),
           "steps_computed_share": round(sum(r["steps_computed"] for r in recs)
                                         / sum(r["steps_total"] for r in recs), 4),
           "wall_s": round(wall, 1), "request_s_mean": round(sum(r["t"] for r in recs) / len(recs), 3),
           "explained": explain(recs)}
    return row, recs


def explain(recs: list[dict]) -> dict:
    """Where the steps went: hits by whether their source drew the same scene (the checker's
    truth) and whether another worker stored it, each with its steps computed; requests no
    reuse served by the gate's reason (gate.WHY_NOT)."""
    from collections import Counter
    stored = {r["stored_id"]: r for r in recs if r.get("stored_id")}
    groups: dict[str, list[dict]] = {}
    for r in recs:
        if r["outcome"] == "hit":
            src = stored.get(r["entry_id"])
            scene = "same_scene" if src and src["scene"] == r["scene"] else "other_scene"
            where = "another_worker" if src and src["worker"] != r["worker"] else "own_worker"
            groups.setdefault(f"hit/{scene}/{where}", []).append(r)
        else:
            groups.setdefault(f"{r['outcome']}/{r.get('why') or '?'}", []).append(r)
    total = sum(r["steps_total"] for r in recs)
    return {k: {"requests": len(v), "steps_computed_mean": round(sum(r["steps_computed"] for r in v) / len(v), 2),
                "share_of_all_steps": round(sum(r["steps_computed"] for r in v) / total, 4),
                **({"reuse_steps": dict(sorted(Counter(r["reuse_step"] for r in v).items()))}
                   if k.startswith("hit/") else {})}
            for k, v in sorted(groups.items())}


def leave_one_out_recall(url: str) -> dict:
    """Real tiny-world signatures: every stored entry's signature queries the cache as its
    request did; is the top candidate (itself left out) the exhaustive ranking's? Only
    entries computed in full are candidates, as in every lookup."""
    import numpy as np
    import torch
    from carnator_core.cache.backend import open_cache
    cache = open_cache(url, None)
    with cache._tx() as cur:
        cur.execute("SELECT e.id, e.class_key, coalesce(e.source_entry, '') = '', s.signature "
                    "FROM carnator_entries e JOIN carnator_signatures s USING (id)")
        rows = [(i, k, full, np.frombuffer(bytes(sig), np.float32)) for i, k, full, sig in cur.fetchall()]
    same, total = 0, 0
    for entry_id, klass, _, vec in rows:
        pool = [(i, v) for i, k, full, v in rows if k == klass and full and i != entry_id]
        if len(pool) < 2:
            continue
        best = pool[int(np.argmax(np.stack([v for _, v in pool]) @ vec))][0]
        found = [c.entry.id for c in cache.lookup(klass, torch.from_numpy(vec.copy()), 2).candidates
                 if c.entry.id != entry_id]
        same += bool(found) and found[0] == best
        total += 1
    return {"queries": total, "top1_recall": round(same / total, 4) if total else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--limit", type=int, default=240, help="first requests of serve.jsonl (240: all)")
    ap.add_argument("--probe-fraction", type=float, default=None,
                    help="the samplers' probe (default theirs); the bundled calibration for it gates both modes")
    ap.add_argument("--out", default=str(RESULTS / "farm.json"))
    ap.add_argument("--records", action="store_true", help="also write every request's record to the JSON")
    ap.add_argument("--recurring-sources", action=argparse.BooleanOptionalAction, default=True,
                    help="the gate's recurring_sources in both modes (default on, as the samplers')")
    ap.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        location, job, probe = args.one
        job = json.loads(Path(job).read_text())
        print(json.dumps(worker(location, job["lines"], os.environ["CARNATOR_CACHE_DIR"], float(probe),
                                job["recurring_sources"])))
        return
    from carnator_core.gate import DEFAULT_PROBE_FRACTION
    probe = DEFAULT_PROBE_FRACTION if args.probe_fraction is None else args.probe_fraction
    raw = (ROOT / "bench" / "workloads" / "serve.jsonl").read_text().splitlines()[: args.limit]
    lines = [{**json.loads(x), "i": i} for i, x in enumerate(raw)]
    from pg_cluster import PgCluster
    with tempfile.TemporaryDirectory(prefix="carnator-farm-") as tmp:
        cluster = PgCluster().start()
        try:
            shared, shared_recs = run_mode("shared", lines, args.workers, Path(tmp), cluster.url("farm"), probe,
                                           args.recurring_sources)
            recall = leave_one_out_recall(cluster.url("farm"))
        finally:
            cluster.stop(remove=True)
        private, private_recs = run_mode("private", lines, args.workers, Path(tmp), None, probe,
                                         args.recurring_sources)
    result = {"workload": "serve", "limit": args.limit, "probe_fraction": probe, "alpha": 0.05,
              "recurring_sources": args.recurring_sources,
              "rows": [shared, private], "lookup_recall_real_signatures": recall,
              "speedup_shared_vs_private": round(private["wall_s"] / shared["wall_s"], 3),
              "steps_shared_over_private": round(shared["steps_computed_share"]
                                                 / private["steps_computed_share"], 3)}
    if args.records:
        result["records"] = {"shared": shared_recs, "private": private_recs}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for r in (shared, private):
        print(f"{r['mode']:>8}: {r['workers']} workers, {r['requests']} requests, hit rate "
              f"{r['hit_rate']:.1%}, steps computed {r['steps_computed_share']:.1%}, wall {r['wall_s']} s")
    for r in (shared, private):
        print(f"{r['mode']:>8} by kind (requests, mean steps computed, share of all steps):")
        for k, g in r["explained"].items():
            print(f"          {k:<40} {g['requests']:>4}  {g['steps_computed_mean']:>5.1f}  {g['share_of_all_steps']:.1%}")
    print(f"steps computed, shared over private: {result['steps_shared_over_private']}")
    print(f"lookup top-1 recall on the stored tiny-world signatures (leave one out): {recall}")
    print(f"speedup shared vs private: {result['speedup_shared_vs_private']}×  → {args.out}")


if __name__ == "__main__":
    main()
