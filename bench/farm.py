"""Farm benchmark: N worker processes serve the tiny world's ``serve`` workload, once sharing
one PostgreSQL cache and once each with a private SQLite cache, side by side.

    nice -n 10 .venv/bin/python bench/farm.py --workers 3            # the whole serve workload

Request i goes to worker i mod N (a load balancer's round robin); the workers run at the
same time, each on one thread, the committed tiny-world model and its calibration. Written
to bench/results/farm.json: per mode, hit rate (gate hits and exact repeats), the share of
denoising steps computed, and the wall time of the whole workload; the speedup is private
wall time over shared wall time, measured in the same run. It also checks lookup on real
tiny-world signatures: every entry computed in full queries the shared cache (leave one
out) and the top candidate is compared with the exhaustive ranking's.
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


def worker(location: str, lines: list[dict], local: str) -> list[dict]:
    """Serve ``lines`` in order against the cache at ``location``; one record per request."""
    import importlib.util  # bench/tinyworld.py, not the tinyworld package it shares a name with
    spec = importlib.util.spec_from_file_location("tinyworld_bench", ROOT / "bench" / "tinyworld.py")
    tw = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tw)
    World, default_risk_model = tw.World, tw.default_risk_model
    world = World()  # imports the ComfyUI host first
    from carnator_core.comfy_adapter import run_request
    from carnator_core.gate import GateSettings
    from carnator_core.pipeline import ReuseSettings
    from carnator_core.reuse.sparse_reuse import SparseSettings
    model_file = default_risk_model(world.fingerprint)
    if model_file:  # the same calibrated gate in both modes, read from the local folder
        dst = Path(local) / "calibration" / Path(model_file).name
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(model_file, dst)
    settings = ReuseSettings(probe_fraction=0.1, gate=GateSettings(risk_budget=0.05),
                             sparse=SparseSettings(enabled=False))
    out = []
    for ln in lines:
        t0 = time.perf_counter()
        _, s = run_request(world.model, world.cond(ln["prompt"]), world.negative, world.latent(),
                           int(ln["seed"]), world.steps, world.cfg, world.sampler, world.scheduler,
                           settings, {"folder": location, "capacity_bytes": 1 << 32},
                           seed_policy=ln.get("seed_policy", "same_seed"), label=ln["prompt"])
        out.append({"i": ln["i"], "outcome": s.outcome, "t": time.perf_counter() - t0,
                    "steps_total": s.steps_total, "steps_computed": s.steps_computed})
    return out


def run_mode(mode: str, lines: list[dict], n: int, tmp: Path, url: str | None) -> dict:
    procs = []
    t0 = time.perf_counter()
    for w in range(n):
        share = [ln for ln in lines if ln["i"] % n == w]
        job = tmp / f"{mode}-{w}.json"
        job.write_text(json.dumps(share))
        location = url if mode == "shared" else str(tmp / f"private-{w}")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CARNATOR_CACHE_DIR": str(tmp / f"local-{mode}-{w}")}
        procs.append(subprocess.Popen([sys.executable, __file__, "--one", location, str(job)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    recs = []
    for p in procs:
        out, err = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"{mode} worker failed:\n{err[-3000:]}")
        recs.extend(json.loads(out.strip().splitlines()[-1]))
    wall = time.perf_counter() - t0
    hits = sum(r["outcome"] in ("hit", "exact") for r in recs)
    return {"mode": mode, "workers": n, "requests": len(recs), "hit_rate": round(hits / len(recs), 4),
            "gate_hits": sum(r["outcome"] == "hit" for r in recs),
            "exact_repeats": sum(r["outcome"] == "exact" for r in recs),
            "steps_computed_share": round(sum(r["steps_computed"] for r in recs)
                                          / sum(r["steps_total"] for r in recs), 4),
            "wall_s": round(wall, 1), "request_s_mean": round(sum(r["t"] for r in recs) / len(recs), 3)}


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
    ap.add_argument("--out", default=str(RESULTS / "farm.json"))
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        location, job = args.one
        print(json.dumps(worker(location, json.loads(Path(job).read_text()),
                                os.environ["CARNATOR_CACHE_DIR"])))
        return
    raw = (ROOT / "bench" / "workloads" / "serve.jsonl").read_text().splitlines()[: args.limit]
    lines = [{**json.loads(x), "i": i} for i, x in enumerate(raw)]
    from pg_cluster import PgCluster
    with tempfile.TemporaryDirectory(prefix="carnator-farm-") as tmp:
        cluster = PgCluster().start()
        try:
            shared = run_mode("shared", lines, args.workers, Path(tmp), cluster.url("farm"))
            recall = leave_one_out_recall(cluster.url("farm"))
        finally:
            cluster.stop(remove=True)
        private = run_mode("private", lines, args.workers, Path(tmp), None)
    result = {"workload": "serve", "limit": args.limit, "rows": [shared, private],
              "lookup_recall_real_signatures": recall,
              "speedup_shared_vs_private": round(private["wall_s"] / shared["wall_s"], 3)}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for r in (shared, private):
        print(f"{r['mode']:>8}: {r['workers']} workers, {r['requests']} requests, hit rate "
              f"{r['hit_rate']:.1%}, steps computed {r['steps_computed_share']:.1%}, wall {r['wall_s']} s")
    print(f"lookup top-1 recall on the stored tiny-world signatures (leave one out): {recall}")
    print(f"speedup shared vs private: {result['speedup_shared_vs_private']}×  → {args.out}")


if __name__ == "__main__":
    main()
