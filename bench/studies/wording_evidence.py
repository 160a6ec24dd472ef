"""Study: why requests worded afresh miss same-scene reuse — the gate's evidence against a
source that drew the same scene on the same noise, read from the committed records.

    .venv/bin/python bench/studies/wording_evidence.py            # reads bench/results/wording_parts/

Nothing is run: ``bench/wording.py``'s per-request records (``--records``) carry every candidate
the gate weighed with its evidence features. For each request, a candidate stored by a request
computed in full whose scene (the checker's truth, whatever the prose) and noise (the seed, or
the shared pool's draw) are the request's own is a source whose reuse is same-scene by
construction. The question is whether the evidence says so: how many such candidates fall in
the same-scene class (probes that differ on ≤ 2% of the tiles and by ≤ 0.5% globally), and how
far the rest sit from those cut-offs. Writes bench/results/studies/wording_evidence.json.
"""
from __future__ import annotations

import argparse
import json
import os

from study_paths import REPO  # noqa: E402 - the repository on the path

from carnator_core.evidence import SAME_SCENE_GAP, SAME_SCENE_REGION  # noqa: E402
from tinyworld import world as WD  # noqa: E402

PARTS = os.path.join(REPO, "bench", "results", "wording_parts")
OUT = os.path.join(REPO, "bench", "results", "studies", "wording_evidence.json")


def noise_of(line: dict, pool: int) -> str:
    """The noise a request starts from (bench/tinyworld.py noise_frame)."""
    seed = int(line["seed"])
    return f"pool:{seed % pool}" if line.get("seed_policy") == "shared_noise" else f"seed:{seed}"


def same_scene_sources(lines: list[dict], recs: list[dict], pool: int) -> list[dict]:
    """Every (request, candidate) where the candidate was computed in full from the request's
    own scene and noise, with the evidence the gate read."""
    key = lambda ln: (str(WD.scene_key(ln["scene"])), noise_of(ln, pool))  # noqa: E731
    source = {r["stored_id"]: key(ln) for ln, r in zip(lines, recs)
              if r.get("stored_id") and r["outcome"] == "miss"}
    out = []
    for ln, r in zip(lines, recs):
        for c in r.get("candidates") or []:
            if source.get(c["entry_id"]) == key(ln):
                f = c["features"]
                out.append({"class": c["class"], "region_fraction": f["region_fraction"],
                            "similarity_gap": f["similarity_gap"], "outside_mean": f["outside_mean"],
                            "accepted": c["accept"], "reuse_step": c.get("reuse_step"),
                            "outcome": r["outcome"], "why": r.get("why") or ""})
    return out


def quantiles(values: list[float]) -> dict:
    v = sorted(values)
    return {q: round(v[min(len(v) - 1, int(q * len(v)))], 4) for q in (0.0, 0.25, 0.5, 0.75, 1.0)} if v else {}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--alpha", default="0.05")
    ap.add_argument("--noise-pool", type=int, default=4, help="bench/tinyworld.py NOISE_POOL")
    ap.add_argument("--out", default=OUT)
    a = ap.parse_args(argv)
    result = {"alpha": a.alpha, "same_scene_region": SAME_SCENE_REGION, "same_scene_gap": SAME_SCENE_GAP,
              "workloads": {}}
    for name in ("serve_fresh", "iterate_fresh"):
        recs = json.load(open(os.path.join(PARTS, f"{name}_n20.json")))["records"][name][a.alpha]
        lines = [json.loads(x) for x in open(os.path.join(REPO, "bench", "workloads", f"{name}.jsonl")) if x.strip()]
        pairs = same_scene_sources(lines, recs, a.noise_pool)
        other = [p for p in pairs if p["class"] != "same_scene"]
        result["workloads"][name] = {
            "pairs": len(pairs), "classed_same_scene": len(pairs) - len(other), "classed_other": len(other),
            "other_within_twice_the_gap": sum(p["similarity_gap"] <= 2 * SAME_SCENE_GAP for p in other),
            "other_within_twice_both": sum(p["similarity_gap"] <= 2 * SAME_SCENE_GAP
                                           and p["region_fraction"] <= 2 * SAME_SCENE_REGION for p in other),
            "other_gap_quantiles": quantiles([p["similarity_gap"] for p in other]),
            "other_region_quantiles": quantiles([p["region_fraction"] for p in other])}
        w = result["workloads"][name]
        print(f"{name}: {w['pairs']} same-scene sources weighed, {w['classed_same_scene']} classed same-scene, "
              f"{w['classed_other']} other (gap {w['other_gap_quantiles']}, region {w['other_region_quantiles']}; "
              f"{w['other_within_twice_both']} within twice both cut-offs)")
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    return result


if __name__ == "__main__":
    main()
