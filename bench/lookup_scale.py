"""Benchmark: cache lookup and store at 1k, 10k and 100k entries in one class, per backend.

    python bench/lookup_scale.py                      # sqlite (+ postgresql if installed)
    python bench/lookup_scale.py --sizes 1000 --queries 50 --out /tmp/x.json   # smoke

Entries are SYNTHETIC: index rows plus full signatures of the tiny world's real width
(12,288 float32 = 49 KB: 16 x̂0 channels and 32 feature channels on a 4×8×8 tile grid),
drawn around scene centres whose popularity is Zipf-distributed (a few scenes with
thousands of entries, many with a handful). They have no tensor files: lookup never reads
those. Each size runs in its own processes: one fills the cache and computes the exhaustive
answers, a second one *serves* (lookups and stores, through the same entry point a request
uses: ``cache_backend.open_cache`` then ``lookup``) and reports its own memory, so
``rss_mb`` is what a worker serving a cache of that size holds, not what filling it left
behind (before this split the fill's 100 MB signature chunks stayed in the same heap).
``rss_open_mb`` is the same process after importing and opening the cache, before the
first lookup; on PostgreSQL it is the worker's (client's) memory, not the server's.

Two query kinds, 50/50: *repeat* (a stored entry plus small noise: a paraphrase, the
candidate the gate should get) and *fresh* (a new point of a popular scene: many nearly
equal candidates). Recall = share of queries whose top candidate is the exhaustive
ranking's (every stored signature, exact cosine); ``regret`` = how much lower the returned
top similarity is when it differs. Stores are real ``store()`` calls (tensor file, fsync,
row, eviction of one entry since the cache is held at capacity), interleaved with lookups
so the in-memory descriptors are refreshed incrementally while timed.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

WIDTH = 16 * 256 + 32 * 256
CLASS = "bench-class"
ENTRY_BYTES = 50_000
NOISE = 0.75      # entry = centre + noise: members of one scene at cosine ≈ 0.64
REPEAT_NOISE = 0.3
# one BLAS/torch thread: on a shared 2-core machine spinning pools, not the cache, set the
# time (a 12k-float dot product took 4 ms with two threads under load, 0.01 ms with one)
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def unit(m: np.ndarray) -> np.ndarray:
    return m / np.linalg.norm(m, axis=-1, keepdims=True)


class World:
    """Deterministic synthetic entries, generated chunk by chunk (100k × 49 KB = 4.9 GB)."""

    def __init__(self, n: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.n, self.seed = n, seed
        n_scenes = max(10, n // 10)
        self.centres = unit(rng.standard_normal((min(n_scenes, 2000), WIDTH), dtype=np.float32))
        weights = 1.0 / np.arange(1, len(self.centres) + 1) ** 1.1
        self.scene = rng.choice(len(self.centres), size=n, p=weights / weights.sum())

    def chunk(self, start: int, stop: int) -> np.ndarray:
        noise = np.stack([np.random.default_rng([self.seed, i]).standard_normal(WIDTH, dtype=np.float32)
                          for i in range(start, stop)]) * (NOISE / np.sqrt(WIDTH))
        return unit(self.centres[self.scene[start:stop]] + noise).astype(np.float32)

    def queries(self, q: int) -> tuple[np.ndarray, list[str]]:
        rng = np.random.default_rng(self.seed + 99)
        picks = rng.integers(0, self.n, size=q)
        out, kinds = [], []
        for i, idx in enumerate(picks):
            if i % 2 == 0:  # a repeat of a stored entry
                base = self.chunk(int(idx), int(idx) + 1)[0]
                noise = REPEAT_NOISE / np.sqrt(WIDTH)
                kinds.append("repeat")
            else:           # a fresh point of that entry's scene
                base = self.centres[self.scene[idx]]
                noise = NOISE / np.sqrt(WIDTH)
                kinds.append("fresh")
            out.append(unit(base + rng.standard_normal(WIDTH, dtype=np.float32) * noise))
        return np.stack(out).astype(np.float32), kinds


def row_for(i: int, now: float) -> dict:
    return {"id": uuid.UUID(int=i + 1).hex, "class_key": CLASS, "exact_key": f"e{i}",
            "model_fingerprint": "bench", "backbone": "wan21", "latent_shape": "1x16x5x32x32",
            "steps": 30, "seed": 7, "cfg": 4.0, "sampler": "euler", "scheduler": "simple",
            "prompt": f"synthetic {i}", "probe_step": 3, "snapshot_steps": "[6, 12, 18, 24]",
            "bytes": ENTRY_BYTES, "created": now - 1e6 + i, "last_used": now - 1e6 + i,
            "hits": 0, "steps_saved": 0.0, "pinned": 0, "source_entry": None,
            "class_json": "{}", "latent_format": "Wan21", "checksum": None}


def fill(cache, world: World, queries: np.ndarray) -> np.ndarray:
    """Insert every entry in bulk; return each query's exhaustive (best id index, best sim)."""
    best = np.full(len(queries), -2.0, np.float32)
    arg = np.zeros(len(queries), np.int64)
    now = time.time()
    step = 2000
    for start in range(0, world.n, step):
        stop = min(world.n, start + step)
        sigs = world.chunk(start, stop)
        rows = []
        for j, i in enumerate(range(start, stop)):
            rows.append({**row_for(i, now), "signature": sigs[j].tobytes()})
        cache.import_rows(rows)
        sims = sigs @ queries.T  # exhaustive ranking, exact cosine, chunk by chunk
        top = sims.argmax(axis=0)
        better = sims[top, np.arange(len(queries))] > best
        best[better] = sims[top, np.arange(len(queries))][better]
        arg[better] = start + top[better]
    return arg, best


def open_backend(backend: str, where: str, capacity: int):
    from carnator_core.cache.backend import open_cache
    return open_cache(where, capacity)


def fill_one(backend: str, n: int, q: int, where: str, answers: str) -> None:
    """The filling process: every entry, and each query's exhaustive answer."""
    world = World(n)
    queries, kinds = world.queries(q)
    cache = open_backend(backend, where, 1 << 50)
    t0 = time.perf_counter()
    exact_arg, exact_best = fill(cache, world, queries)
    if backend == "sqlite":
        # an empty placeholder per entry: a fresh process's first open counts the files
        # against the rows and would drop rows without one as lost (lookup never reads them)
        for i in range(n):
            (cache.tensor_dir / f"{uuid.UUID(int=i + 1).hex}.safetensors").touch()
    np.savez(answers, queries=queries, kinds=np.array(kinds), exact_arg=exact_arg,
             exact_best=exact_best, fill_s=time.perf_counter() - t0)


def run_one(backend: str, n: int, where: str, answers: str) -> dict:
    """The serving process: lookups and stores on the filled cache, and its memory."""
    import psutil
    import torch
    with np.load(answers) as a:
        queries, kinds, exact_arg, exact_best = a["queries"], list(a["kinds"]), a["exact_arg"], a["exact_best"]
        fill_s = float(a["fill_s"])
    q = len(queries)
    load_start = os.getloadavg()[0]  # the machine is shared: say how busy it was
    cache = open_backend(backend, where, n * ENTRY_BYTES)  # at capacity: each store evicts
    rss_open = psutil.Process().memory_info().rss
    t0 = time.perf_counter()
    cache.lookup(CLASS, torch.from_numpy(queries[0]), 3)
    cold_ms = (time.perf_counter() - t0) * 1e3
    lookup_ms, hit, regrets = [], [], []
    for i in range(q):
        t0 = time.perf_counter()
        c = open_backend(backend, where, n * ENTRY_BYTES)
        found = c.lookup(CLASS, torch.from_numpy(queries[i]), 3)
        lookup_ms.append((time.perf_counter() - t0) * 1e3)
        top = found.candidates[0]
        hit.append(top.entry.id == uuid.UUID(int=int(exact_arg[i]) + 1).hex)
        if not hit[-1]:
            regrets.append(float(exact_best[i]) - top.similarity)
    store_ms, churn_ms = [], []
    rng = np.random.default_rng(5)
    for i in range(max(10, q // 4)):
        c = open_backend(backend, where, n * ENTRY_BYTES)
        sig = torch.from_numpy(unit(rng.standard_normal(WIDTH, dtype=np.float32)))
        tensors = {"final": torch.randn(1, 16, 5, 32, 32), "snapshot.6": torch.randn(1, 16, 5, 32, 32)}
        row = {k: v for k, v in row_for(n + 10 + i, time.time()).items()
               if k not in ("id", "bytes", "created", "last_used", "hits", "steps_saved", "pinned", "checksum")}
        t0 = time.perf_counter()
        assert c.store(row, tensors, sig) is not None, c.reports
        store_ms.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()  # a lookup right after: the refresh picks up add + eviction
        c = open_backend(backend, where, n * ENTRY_BYTES)
        c.lookup(CLASS, torch.from_numpy(queries[i % q]), 3)
        churn_ms.append((time.perf_counter() - t0) * 1e3)
    all_ms = lookup_ms + churn_ms
    del queries, exact_arg, exact_best  # the benchmark's own data is not the cache's
    gc.collect()
    return {"backend": backend, "entries": n, "classes": 1,
            "p50_ms": round(float(np.percentile(all_ms, 50)), 2),
            "p99_ms": round(float(np.percentile(all_ms, 99)), 2),
            "store_ms": round(statistics.median(store_ms), 2),
            "store_p99_ms": round(float(np.percentile(store_ms, 99)), 2),
            "rss_mb": round(psutil.Process().memory_info().rss / 2**20, 1),
            "rss_open_mb": round(rss_open / 2**20, 1),
            "load_avg_1min": [round(load_start, 2), round(os.getloadavg()[0], 2)],
            "cold_lookup_ms": round(cold_ms, 1), "fill_s": round(fill_s, 1),
            "queries": q, "top1_recall": round(sum(hit) / q, 4),
            **{f"top1_recall_{k}": round(sum(h for h, kk in zip(hit, kinds) if kk == k)
                                         / max(1, kinds.count(k)), 4) for k in ("repeat", "fresh")},
            "top1_within_0.01": round(1 - sum(r > 0.01 for r in regrets) / q, 4),
            "max_regret": round(max(regrets), 4) if regrets else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 100000])
    ap.add_argument("--backends", nargs="+", default=["sqlite", "postgresql"])
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "lookup_scale.json"))
    ap.add_argument("--fill", nargs=4, metavar=("BACKEND", "N", "WHERE", "NPZ"), help=argparse.SUPPRESS)
    ap.add_argument("--one", nargs=4, metavar=("BACKEND", "N", "WHERE", "NPZ"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.fill:
        backend, n, where, answers = args.fill
        fill_one(backend, int(n), args.queries, where, answers)
        return
    if args.one:
        backend, n, where, answers = args.one
        print(json.dumps(run_one(backend, int(n), where, answers)))
        return
    rows = []
    from pg_cluster import pg_bin
    if "postgresql" in args.backends and pg_bin() is None:
        print("PostgreSQL server binaries not found: postgresql rows skipped", file=sys.stderr)
        args.backends = [b for b in args.backends if b != "postgresql"]
    for backend in args.backends:
        for n in args.sizes:
            with tempfile.TemporaryDirectory(prefix="carnator-scale-") as tmp:
                with location(backend, Path(tmp)) as where:
                    answers = str(Path(tmp) / "answers.npz")
                    for step in ("--fill", "--one"):  # fill, then serve in a fresh process
                        out = subprocess.run([sys.executable, __file__, step, backend, str(n), where,
                                              answers, "--queries", str(args.queries)],
                                             capture_output=True, text=True, env=ONE_THREAD)
                        if out.returncode != 0:
                            print(out.stderr[-3000:], file=sys.stderr)
                            raise SystemExit(f"{backend} at {n} entries failed ({step})")
                    row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"{row['backend']:>10} {row['entries']:>7} entries: lookup p50 {row['p50_ms']:7.2f} ms "
                  f"p99 {row['p99_ms']:7.2f} ms · store {row['store_ms']:6.2f} ms · "
                  f"rss {row['rss_mb']:7.1f} MB · recall {row['top1_recall']:.3f}", flush=True)
    Path(args.out).write_text(json.dumps({"synthetic_entries": True, "signature_floats": WIDTH,
                                          "threads": 1, "cpu": f"{os.cpu_count()} cores, shared",
                                          "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


class location:
    """A cache location for one run: a folder, or a database in a private PostgreSQL cluster."""

    def __init__(self, backend: str, tmp: Path):
        self.backend, self.tmp, self.cluster = backend, tmp, None

    def __enter__(self) -> str:
        if self.backend == "sqlite":
            return str(self.tmp / "cache")
        from pg_cluster import PgCluster
        self.cluster = PgCluster().start()
        return self.cluster.url("carnator")

    def __exit__(self, *exc) -> None:
        if self.cluster is not None:
            self.cluster.stop(remove=True)


if __name__ == "__main__":
    main()
