"""Can region M follow the request's own trajectory to k*, computed on M's tokens alone?

    nice .venv/bin/python bench/studies/region_fill_study.py   # bench/results/studies/region_fill.json

A hit with *other* evidence (an edit) resumes from the candidate's stored x_k outside region M
and from its own estimate inside. Today that estimate is two coarse full steps of the request's
own trajectory from the probe to k* (``pipeline.fill_region``), and it is what limits edits'
depth: filled with the request's *true* x_k instead, edits stayed within tolerance far deeper
(bench/studies/depth_studies.py). This study measures fills that compute more of M's own trajectory at
M's token share, the outside following the stored trajectory:

- ``coarse_2``: today's fill (2 full calls on the whole frame, coarse steps);
- ``own_true``: the request's own x_k from its full computation (the oracle, not a method);
- the fills built here run coarse steps of the request's own trajectory in *segments*: each
  segment's first step is a full call (its keys and values are kept), the rest compute M's
  tokens alone (``carnator_core/reuse/region_compute.py``: M attends to its fresh keys and values
  plus the outside's kept). A segment that starts at a stored snapshot first replaces the
  outside by the candidate's stored latent there, so M is computed among the outside it will
  be resumed with. Cost: full calls + region calls × M's token share.
  - ``region_coarse_4``: one segment from p, 4 steps (the outside's keys and values stay
    those of step p);
  - ``swap_2``: a full step from p, another from the stored snapshot in the middle;
  - ``swap_region_C``: two segments of C/2 steps, from p and from the middle snapshot;
  - ``renoise_region_4``, ``renoise_swap_region_C``: the same from the first snapshot after
    p, M there the probe's x̂0 re-noised (no call at p).

Each fill is finished every step after k and by the 6-call region finish (from k ≥ 8, as the
gate allows it). On the 50 other-evidence calibration pairs of ``region_finish_study.py``:
PSNR of the decoded video against the request's own full computation, the share within
30 dB, the hit's steps speedup (probe + fill + finish), and per fill the *oracle* speedup:
each pair at its cheapest (depth, finish) within 30 dB.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

from study_paths import REPO  # noqa: E402 - sys.path for the repository, tests/ and bench/

from carnator_core.reuse.region_compute import FillSegment  # noqa: E402
from region_finish_study import merged_shards, other_evidence_pairs, pair_study_parser  # noqa: E402

RESULTS = os.path.join(REPO, "bench", "results")
DEPTHS = (8, 10, 12, 14, 16)
FINISH_CALLS = 6


def fill_variants(p: int, k: int, snapshots: list[int]) -> dict[str, list[tuple[int, int]]]:
    """Fills as segments (start step, model steps to the next segment or k; the first a full
    call, the rest on M's tokens: ``region_compute.FillSegment``): a segment that starts at a stored snapshot first replaces the outside by
    the candidate's stored latent there. A first segment after p starts M from the probe's
    x̂0 re-noised (the fill then computes nothing from p to there)."""
    def middle(lo):
        inner = [s for s in snapshots if lo < s < k]
        return min(inner, key=lambda s: abs(s - (lo + k) / 2)) if inner else None
    out = {"region_coarse_4": [(p, 4)]}
    m = middle(p)
    if m is not None:
        out.update({"swap_2": [(p, 1), (m, 1)],
                    "swap_region_4": [(p, 2), (m, 2)],
                    "swap_region_6": [(p, 3), (m, 3)]})
    first = min((s for s in snapshots if s > p), default=None)
    if first is not None and first < k:
        out["renoise_region_4"] = [(first, 4)]
        m = middle(first)
        if m is not None:
            out["renoise_swap_region_4"] = [(first, 2), (m, 2)]
            out["renoise_swap_region_6"] = [(first, 3), (m, 3)]
    return out


def fill_by_segments(run, mask, x_probe, x0_probe, p: int, k: int, segments, stored: dict,
                     token_share: float):
    """The request's own latent at k along ``segments`` (see ``fill_variants``); returns it
    in the resume form and its cost in model-call equivalents."""
    own, cost = x_probe, 0.0
    if segments[0][0] != p:
        a = segments[0][0]
        own = run.boundary_from_sampler_space(run.renoise(x0_probe, a), a)
    run.compute_region(mask)
    try:
        for i, (a, calls) in enumerate(segments):
            b = segments[i + 1][0] if i + 1 < len(segments) else k
            if a != p:  # the outside follows the stored trajectory, M its own
                outside = run.boundary_from_sampler_space(stored[a].float(), a)
                own = torch.lerp(outside, own.to(outside.device), mask.to(outside.device))
            guide = FillSegment(a)
            own = run.jump(a, b, own, min(calls, b - a), guide=guide)
            cost += guide.full_calls + guide.region_steps * token_share
    finally:
        run.compute_region(None)
    return own, cost


def main(argv=None) -> dict:
    ap = pair_study_parser(__doc__.splitlines()[0], "region_fill.json", sharded=True)
    a = ap.parse_args(argv)
    if a.merge:
        return write(merged_shards(a.merge, lambda rows, first: summarise(rows, first["depths"], first["steps"])),
                     a.out)
    shard, shards = (int(x) for x in a.shard.split("/"))
    from calibrate import _load_bench
    bench = _load_bench()
    from carnator_core.reuse.guided_finish import GuidedFinish
    from carnator_core.pipeline import ReuseSettings, fill_region
    from carnator_core.reuse.region_compute import RegionFinish
    from carnator_core.signature import tiles_to_latent_mask
    settings = ReuseSettings()
    world = bench.World(bench.DEFAULT_MODEL, steps=a.steps)
    n, p = world.steps, settings.probe_steps(a.steps)
    snaps = settings.snapshot_steps(n)
    depths = [k for k in DEPTHS if k in snaps]
    rows, t0, empty = [], time.time(), 0
    for i, (g, kind, line, req, cand, region) in enumerate(other_evidence_pairs(bench, world, settings, a.scale)):
        if i % shards != shard:
            continue
        if not bool(region.any()):
            empty += 1  # nothing to fill: the hit resumes the candidate's latent whole
            continue

        def new_run():
            return world.new_run(line["prompt"], int(line["seed"]), line.get("seed_policy", "same_seed"))
        run0 = new_run()
        mask = tiles_to_latent_mask(region, req["record"].grid, run0.latent_shape).float()
        token_share = run0.compute_region(mask).share
        stored_x0 = {s: x.float() for s, x in cand["record"].denoised.items()}
        row = {"group": str(g), "kind": kind, "token_share": round(token_share, 3), "depths": {}}
        for k in depths:
            x_k = cand["record"].snapshots[k].float()
            fills = {}
            run = new_run()
            got = fill_region(run, x_k, region, req["record"].grid, req["x0_probe"], req["x_probe"],
                              p, k, settings.region_fill_calls)
            fills["coarse_2"] = (got.latent, got.steps)
            own = run.boundary_from_sampler_space(req["record"].snapshots[k].float(), k)
            outside = run.boundary_from_sampler_space(x_k, k)
            fills["own_true"] = (torch.lerp(outside, own, mask), 0)
            for name, segments in fill_variants(p, k, snaps).items():
                run = new_run()
                own, cost = fill_by_segments(run, mask, req["x_probe"], req["x0_probe"], p, k, segments,
                                             cand["record"].snapshots, token_share)
                fills[name] = (torch.lerp(outside, own.to(outside.device), mask), cost)
            out = {}
            for name, (start, fill_cost) in fills.items():
                for finish in ("every_step", f"region_finish_{FINISH_CALLS}"):
                    run = new_run()
                    if finish == "every_step":
                        guide, finish_cost = None, n - k
                    else:
                        run.compute_region(mask)
                        guide = RegionFinish(GuidedFinish(run.sigmas, stored_x0, k, FINISH_CALLS), mask)
                    v = world.video(run.sample(k, n, start, guide=guide))
                    if guide is not None:
                        finish_cost = len(guide.compute) + guide.region_steps * token_share
                    q = bench.psnr(v, req["video"])
                    cost = p + fill_cost + finish_cost
                    out[f"{name}+{finish}"] = {"psnr": round(q, 2), "ok": q >= a.psnr_bound,
                                               "cost": round(cost, 2), "speedup": round(n / cost, 3)}
            row["depths"][str(k)] = out
        rows.append(row)
        print(f"{len(rows)} pairs ({kind}, M {token_share:.0%} of the tokens), {time.time() - t0:.0f} s", flush=True)
        write({"steps": n, "probe_steps": p, "psnr_bound": a.psnr_bound, "depths": depths,
               "finish_calls": FINISH_CALLS, "shard": a.shard, "pairs_without_region": empty,
               "summary": summarise(rows, depths, n), "pairs": rows,
               "seconds": round(time.time() - t0, 1)}, a.out, quiet=True)
    if not rows:
        raise SystemExit("no pair with a region M to fill")
    return write(json.load(open(a.out)), a.out)


def write(res: dict, out: str, quiet: bool = False) -> dict:
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    if quiet:
        return res
    for kind, s in res["summary"].items():
        print(f"{kind}: {s['pairs']} pairs, M {s['mean_token_share']:.0%} of the tokens")
        for fill, o in s["oracle"].items():
            print(f"  oracle {fill}: {o['speedup']:.2f}x ({o['within']} pairs within at some depth)")
        for k in res["depths"]:
            print(f"  k={k:>2} " + " | ".join(f"{m} {x['within']}/{x['pairs']} {x['mean_psnr']:.1f}dB {x['mean_speedup']:.2f}x"
                                            for m, x in s[str(k)].items()))
    return res


def summarise(rows: list[dict], depths: list[int], steps: int) -> dict:
    """Per kind and all: within / mean PSNR / mean speedup per depth and variant, and per
    fill the oracle: every pair at its cheapest variant of that fill within the bound (a pair
    none keeps is computed in full: speedup 1)."""
    summary: dict = {}
    for kind in sorted({r["kind"] for r in rows}) + ["all"]:
        mine = [r for r in rows if kind in (r["kind"], "all")]
        s = summary[kind] = {"pairs": len(mine),
                             "mean_token_share": round(sum(r["token_share"] for r in mine) / len(mine), 3)}
        names = list(mine[0]["depths"][str(depths[0])])
        for k in depths:
            for name in names:
                got = [r["depths"][str(k)][name] for r in mine]
                s.setdefault(str(k), {})[name] = {
                    "within": sum(x["ok"] for x in got), "pairs": len(got),
                    "mean_psnr": round(sum(min(x["psnr"], 60.0) for x in got) / len(got), 2),
                    "mean_speedup": round(len(got) / sum(1 / x["speedup"] for x in got), 3)}
        s["oracle"] = {}
        for fill in sorted({name.split("+")[0] for name in names}):
            costs = []
            for r in mine:
                ok = [x["cost"] for k in depths for name, x in r["depths"][str(k)].items()
                      if name.startswith(fill + "+") and x["ok"]]
                costs.append(min(ok) if ok else steps)
            s["oracle"][fill] = {"speedup": round(steps * len(costs) / sum(costs), 3),
                                 "within": sum(c < steps for c in costs)}
    return summary


if __name__ == "__main__":
    main()
