"""Why genuine hits on `serve` resume other scenes: were their own scenes served before?

Reads a benchmark's per-request records (bench/tinyworld.py --records) and its workload, and
counts, for every gate hit, whether an earlier request had the same scene and noise and
whether that request was computed in full (a reuse source) or was itself a hit (not a
source: cache.lookup never returns entries that reused another). Nothing is run.

    .venv/bin/python bench/studies/source_study.py                      # the committed results
    .venv/bin/python bench/studies/source_study.py --results FILE.json --out FILE.json
"""
from __future__ import annotations

import argparse
import collections
import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOISE_POOL = 4  # bench/tinyworld.py: shared_noise folds seeds onto 4 canonical noises


def noise_of(line: dict) -> int:
    seed = int(line["seed"])
    return seed % NOISE_POOL if line.get("seed_policy") == "shared_noise" else seed


def study(records: list[dict], lines: list[dict]) -> dict:
    """Counts of gate hits by what their own scene had in the cache before them."""
    if len(records) != len(lines):
        raise ValueError(f"{len(records)} records for {len(lines)} workload lines")
    earlier: dict[tuple, list[str]] = collections.defaultdict(list)  # key → outcomes before
    counts = collections.Counter()
    for rec, line in zip(records, lines):
        key = (json.dumps(line["scene"], sort_keys=True), noise_of(line))
        before = earlier[key]
        if rec["outcome"] == "hit":
            if rec["same_scene"]:
                what = "reused its own scene"
            elif "miss" in before:
                what = "resumed another scene though its own had a source"
            elif before:
                what = "resumed another scene; its own was served before, only as a reuse"
            else:
                what = "resumed another scene; its own scene was new"
            counts[what] += 1
        before.append(rec["outcome"])
    return {"gate_hits": sum(counts.values()), **dict(counts.most_common())}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=os.path.join(REPO, "bench/results/tinyworld.json"))
    ap.add_argument("--workloads", nargs="+", default=["serve", "iterate"])
    ap.add_argument("--budget", default="0.05")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    results = json.load(open(a.results))
    out = {"results": os.path.relpath(a.results, REPO), "budget": a.budget, "workloads": {}}
    for wl in a.workloads:
        if wl not in results.get("records", {}):
            continue
        path = os.path.join(REPO, "bench", "workloads", f"{wl}.jsonl")
        lines = [json.loads(x) for x in open(path) if x.strip()]
        out["workloads"][wl] = study(results["records"][wl][a.budget], lines)
    print(json.dumps(out, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
