"""Study: how many requests worded afresh *could* a same-scene reuse serve within tolerance —
the ceiling of the same-scene share on `serve_fresh`, and how much of it the evidence reaches.

    nice -n 10 .venv/bin/python bench/studies/wording_ceiling.py            # ~9 min on 2 cores
    .venv/bin/python bench/studies/wording_ceiling.py --reread   # summarise the committed rows again

Every request of the workload is computed in full (the bundled model, N = 20, its probe 0.05),
and every earlier request that drew the same scene (the checker's truth, whatever the prose) on
the same noise in other words is reused by it as a same-scene hit is: the whole frame from the
source's snapshot at k (a hit also computes the few tiles its probe moved; here none),
finished by the 4-call guided finish, at the depths the bundled
calibration certifies same-scene reuse at (k = 14 at α = 5%, 16 at 10%). Each reuse is labelled
as the calibration labels (PSNR of the frames against the request's own full computation below
30 dB, or the checker disagreeing with the request's scene where its full computation agrees),
and weighed by the gate's evidence (``calibration.generic.direction_evidence``): its class, its
global gap and the share of the tiles its probe moved.

A request is *servable* at k when some such source's reuse is within tolerance: no evidence,
however robust to wording, can give a same-scene hit within tolerance to the others. Two pools:
every earlier request (any policy could have made it a source), and the sources of the
committed benchmark run at α = 5% (requests it computed in full, ``bench/results/wording_parts``),
against which the benchmark's own same-scene share is counted. ``bands``: what a same-scene
class with wider cut-offs would take in, and how often those reuses miss tolerance.
``speed_at_0.05``: the run's gate hits, and as if every servable request of its pool had been a
same-scene hit: at the certified depth, at any measured depth, and per band at any measured depth.

Writes bench/results/studies/wording_ceiling.json; another run of the benchmark (its workload,
``bench/wording.py``'s parts and rows) with ``--workload``, ``--parts`` and ``--rows``:

    nice -n 10 .venv/bin/python bench/studies/wording_ceiling.py --workload serve_fresh_half \
        --parts bench/results/studies/held_out_half_more_scenes_parts \
        --rows bench/results/studies/wording_held_out_half_more_scenes.json --extra-depths 8 10 12 \
        --out bench/results/studies/wording_ceiling_fresh_half.json       # ~10 min
"""
from __future__ import annotations

import argparse
import json
import os
import time

from study_paths import REPO  # noqa: E402 - the repository, tests/ and bench/ on the path

OUT = os.path.join(REPO, "bench", "results", "studies", "wording_ceiling.json")
PARTS = os.path.join(REPO, "bench", "results", "wording_parts")
STEPS, PSNR_BOUND = 20, 30.0
DEPTHS = {"0.05": 14, "0.1": 16}  # the bundled calibration's same-scene depth at each α
FINISH_CALLS = 4                   # its same-scene guided finish


def same_scene_earlier(lines: list[dict], noise_of) -> dict[int, list[int]]:
    """For each request, the earlier requests of its scene and noise in other words."""
    from tinyworld import world as WD
    key = [(str(WD.scene_key(ln["scene"])), noise_of(ln)) for ln in lines]
    return {i: [j for j in range(i) if key[j] == key[i] and lines[j]["prompt"] != lines[i]["prompt"]]
            for i in range(len(lines))}


def measure(world, bench, lines: list[dict], earlier: dict[int, list[int]], log=print,
            extra_depths=()) -> list[dict]:
    """Every (request, same-scene source) reused at each depth of ``DEPTHS`` (and
    ``extra_depths``)."""
    import torch
    from carnator_core.calibration import fit as CAL
    from carnator_core.calibration.generic import Direction, direction_evidence, measure_reuse
    from carnator_core.pipeline import ReuseSettings
    settings = ReuseSettings(probe_fraction=0.05, region_fill_on_m=True, region_margin=1)
    p, snaps = settings.probe_steps(STEPS), settings.snapshot_steps(STEPS)
    needed = {i for i, js in earlier.items() if js} | {j for js in earlier.values() for j in js}
    full, t0 = {}, time.time()
    for i in sorted(needed):
        ln = lines[i]
        r = world.full(ln["prompt"], int(ln["seed"]), ln["seed_policy"], snaps, p)
        full[i] = {"full": r["full"], "video": r["video"], "ok": bench.check_ok(r["video"], ln["scene"])}
    log(f"  {len(full)} requests computed in full, {time.time() - t0:.0f} s", flush=True)
    rows = []
    for i, js in earlier.items():
        a, la = full.get(i), lines[i]
        for j in js:
            b = full[j]
            seen = direction_evidence(a["full"], b["full"], settings, 0.35)
            # reused as a same-scene hit is, whatever class the evidence gives: the whole frame
            whole = Direction(seen.inst, torch.zeros_like(seen.region), "same_scene", False)

            def outcome(final, a=a, la=la) -> dict:
                v = world.video(final)
                q, ok = bench.psnr(v, a["video"]), bench.check_ok(v, la["scene"])
                return {"psnr": round(q, 2), "label": CAL.exceeds_tolerance(q, a["ok"], ok, PSNR_BOUND)}
            new_run = lambda la=la: world.new_run(la["prompt"], int(la["seed"]), la["seed_policy"])  # noqa: E731
            depths = {str(k): measure_reuse(a["full"], b["full"], new_run, settings, whole, k, FINISH_CALLS,
                                            outcome) for k in sorted(set(DEPTHS.values()) | set(extra_depths))}
            f = seen.inst["features"]
            rows.append({"request": i, "source": j, "class": seen.klass,
                         "similarity_gap": round(f["similarity_gap"], 5),
                         "region_fraction": round(f["region_fraction"], 5),
                         "final_psnr": round(bench.psnr(b["video"], a["video"]), 2),
                         "depths": {k: {"psnr": d["psnr"], "label": d["label"]} for k, d in depths.items()}})
    log(f"  {len(rows)} same-scene reuses measured, {time.time() - t0:.0f} s", flush=True)
    return rows


def committed_run(workload: str, parts: str, rows_path: str, alpha: str) -> tuple[set[int], dict, list[dict]]:
    """The requests the committed benchmark run computed in full (its sources), its own
    same-scene share of the requests whose scene a source already held, and its records."""
    part = json.load(open(os.path.join(parts, f"{workload}_n20.json")))
    recs = part["records"][workload][alpha]
    sources = {i for i, r in enumerate(recs) if r.get("stored_id") and r["outcome"] == "miss"}
    rows = json.load(open(rows_path))["rows"]
    return sources, rows[f"{workload}/n20"]["budgets"][alpha]["seen_scene"], recs


def speed_ceiling(rows: list[dict], recs: list[dict], sources: set[int], ks: list[str]) -> dict:
    """Gate hits as served, and as if every request with a source in the run's pool whose
    same-scene reuse at one of the depths ``ks`` is within tolerance had been that same-scene hit
    (the probe step and the guided finish's calls computed, the same from any of them), every
    other request as served: the most same-scene evidence could give this run at those depths
    without accepting a reuse known to miss tolerance."""
    good = {r["request"] for r in rows if r["source"] in sources
            and any(k in r["depths"] and not r["depths"][k]["label"] for k in ks)}
    served = [(r["steps_total"], r["steps_computed"]) for r in recs if r["outcome"] == "hit"]
    ceiling = [(r["steps_total"], 1 + FINISH_CALLS) if i in good else (r["steps_total"], r["steps_computed"])
               for i, r in enumerate(recs) if i in good or r["outcome"] == "hit"]
    ratio = lambda hits: sum(t for t, _ in hits) / sum(c for _, c in hits)  # noqa: E731
    return {"servable_requests": len(good), "gate_hits": len(served), "gate_hit_speedup": ratio(served),
            "ceiling_gate_hits": len(ceiling), "ceiling_gate_hit_speedup": ratio(ceiling)}


def servable(rows: list[dict], requests, k: str, pool=None, same_scene_only: bool = False) -> int:
    """Requests with some source in ``pool`` (None: any earlier) whose reuse at k is within
    tolerance (and, with ``same_scene_only``, that the evidence classes same-scene)."""
    good = {r["request"] for r in rows
            if (pool is None or r["source"] in pool) and not r["depths"][k]["label"]
            and (not same_scene_only or r["class"] == "same_scene")}
    return len(good & set(requests))


# same-scene cut-offs (global gap, share of the tiles) a wider class could take: today's first
BANDS = ((0.005, 0.02), (0.01, 0.02), (0.02, 0.05), (0.03, 0.1), (0.05, 0.1), (1.0, 1.0))


def bands(rows: list[dict], sources: set[int], depths: list[str]) -> list[dict]:
    """What a same-scene class widened to each of ``BANDS`` would take in: its reuses, how
    many are beyond tolerance at each depth, and the requests of the benchmark's pool it
    could serve within tolerance."""
    pool = sorted({r["request"] for r in rows if r["source"] in sources})
    out = []
    for gap, region in BANDS:
        inside = [r for r in rows if r["similarity_gap"] <= gap and r["region_fraction"] <= region]
        out.append({"gap": gap, "region": region, "reuses": len(inside), "requests": len(pool),
                    **{f"k{k}": {"beyond": sum(r["depths"][str(k)]["label"] for r in inside),
                                 "servable": servable(inside, pool, str(k), sources)}
                       for k in depths}})
    return out


def summarise(rows: list[dict], earlier: dict[int, list[int]], sources: set[int], seen: dict,
              recs: list[dict]) -> dict:
    out = {"reuses": len(rows), "by_depth": {}}
    for alpha, k in DEPTHS.items():
        k = str(k)
        within = [r for r in rows if not r["depths"][k]["label"]]
        classed = [r for r in rows if r["class"] == "same_scene"]
        any_req = [i for i, js in earlier.items() if js]
        pool_req = sorted({i for i, js in earlier.items() if any(j in sources for j in js)})
        out["by_depth"][k] = {
            "alpha": float(alpha),
            "reuses_within_tolerance": len(within),
            "classed_same_scene": len(classed),
            "classed_same_scene_within": sum(not r["depths"][k]["label"] for r in classed),
            "other_within": sum(not r["depths"][k]["label"] for r in rows if r["class"] != "same_scene"),
            "any_earlier": {"requests": len(any_req), "servable": servable(rows, any_req, k),
                            "servable_classed_same_scene": servable(rows, any_req, k, same_scene_only=True)},
            "benchmark_sources": {"requests": len(pool_req),
                                  "servable": servable(rows, pool_req, k, sources),
                                  "servable_classed_same_scene": servable(rows, pool_req, k, sources, True)}}
    k = [str(DEPTHS["0.05"])]
    measured = sorted({d for r in rows for d in r["depths"]}, key=int)
    out["speed_at_0.05"] = {**speed_ceiling(rows, recs, sources, k), "depths": k,
                            "any_measured_depth": {"depths": measured,
                                                   **speed_ceiling(rows, recs, sources, measured)},
                            "by_band": [
        {"gap": gap, "region": region, **speed_ceiling(
            [r for r in rows if r["similarity_gap"] <= gap and r["region_fraction"] <= region], recs, sources,
            measured)} for gap, region in BANDS]}  # a class of its own may be certified at any depth
    out["bands"] = bands(rows, sources, measured)
    out["benchmark_at_0.05"] = {"seen_scene_requests": seen["requests"], "same_scene_hits": seen["same_scene_hits"],
                                "share": seen["share"]}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=None, help="the first N requests only (a smoke run)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workload", default="serve_fresh")
    ap.add_argument("--parts", default=PARTS, help="the benchmark run whose pool and records are read "
                    "(bench/wording.py --parts)")
    ap.add_argument("--rows", default=os.path.join(REPO, "bench", "results", "wording.json"),
                    help="that run's rows (bench/wording.py --out)")
    ap.add_argument("--extra-depths", type=int, nargs="*", default=[],
                    help="depths k to reuse at besides the certified ones (the ceiling over all of them)")
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--reread", action="store_true", help="summarise the rows of --out again, measuring nothing")
    a = ap.parse_args(argv)
    from calibrate import _load_bench
    bench = _load_bench()
    _, lines = bench.load_workload(a.workload, a.limit)
    earlier = same_scene_earlier(lines, lambda ln: bench.noise_frame(int(ln["seed"]), ln["seed_policy"]))
    if a.reread:
        result = json.load(open(a.out))
    else:
        world = bench.World(bench.DEFAULT_MODEL, steps=STEPS, threads=a.threads)
        result = {"workload": a.workload, "requests": len(lines), "steps": STEPS,
                  "finish_calls": FINISH_CALLS,
                  "psnr_bound": PSNR_BOUND, "rows": measure(world, bench, lines, earlier, extra_depths=a.extra_depths)}
    run = committed_run(a.workload, a.parts, a.rows, "0.05")
    result["summary"] = summarise(result["rows"], earlier, *run)
    for k, s in result["summary"]["by_depth"].items():
        e, b = s["any_earlier"], s["benchmark_sources"]
        print(f"k={k} (α={s['alpha']:g}): {s['reuses_within_tolerance']}/{len(result['rows'])} reuses within "
              f"tolerance; requests servable {e['servable']}/{e['requests']} (any earlier), {b['servable']}/"
              f"{b['requests']} (the benchmark's sources; evidence classes same-scene for "
              f"{b['servable_classed_same_scene']})")
    v = result["summary"]["speed_at_0.05"]
    print(f"gate hits at α=0.05: {v['gate_hit_speedup']:.2f}x as served; {v['ceiling_gate_hit_speedup']:.2f}x "
          f"had every servable request been a same-scene hit; "
          f"{v['any_measured_depth']['ceiling_gate_hit_speedup']:.2f}x at any of k = {v['any_measured_depth']['depths']}")
    with open(a.out, "w") as f:
        json.dump({k: result[k] for k in ("workload", "requests", "steps", "finish_calls", "psnr_bound",
                                          "summary", "rows")}, f, indent=1)
        f.write("\n")
    return result


if __name__ == "__main__":
    main()
