"""Where do deep edits fail once region M follows its own trajectory, and does a wider M help?

    nice .venv/bin/python bench/studies/region_dilation_study.py --shard 0/2   # and 1/2, in parallel
    .venv/bin/python bench/studies/region_dilation_study.py --merge <the two shard files>
    # → bench/results/studies/region_dilation.json

With M filled on its own tokens (``pipeline.fill_region(..., stored=…)``), the calibration's
edits still miss tolerance at depth (k = 14 of 20: 12.9% of the reuses with a region M), and
most where the probe put *little* in M. This study asks where the error sits and whether the
probe's M, widened, keeps deeper reuses within tolerance:

- ``m``: M as the gate reads it (tiles whose early evidence disagrees);
- ``m+1``: M widened by one tile in each frame (3×3 neighbourhood);
- ``m+1t``: also by one tile in time (3×3×3).

Each is filled on its own tokens from the candidate's stored snapshots and finished every
step. Per pair, depth and variant: PSNR of the decoded video against the request's own full
computation, the checker (the whole tolerance, as the calibration labels it), and the cost in
model steps (probe + fill at M's token share + finish). For ``m``, the final latent's squared
error against the request's own, split between M, the one-tile ring around it, and the rest.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.nn.functional as F

from study_paths import REPO  # noqa: E402 - sys.path for the repository, tests/ and bench/

from region_finish_study import merged_shards, other_evidence_pairs, pair_study_parser  # noqa: E402

DEPTHS = (12, 14, 16)
VARIANTS = {"m": None, "m+1": (1, 3, 3), "m+1t": (3, 3, 3)}  # max-pool kernel on the tile grid


def widen(region: torch.Tensor, grid: tuple[int, int, int], kernel) -> torch.Tensor:
    """The tile region (tiles,) widened by a max-pool of ``kernel`` (frames, rows, cols)."""
    if kernel is None:
        return region
    vol = region.float().reshape(1, 1, *grid)
    pad = tuple(k // 2 for k in kernel)
    return F.max_pool3d(vol, kernel, stride=1, padding=pad).reshape(-1) > 0.5


def error_shares(final: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor,
                 ring: torch.Tensor) -> dict[str, float]:
    """Shares of the squared error inside M, in the ring around it, and elsewhere."""
    err = (final.float() - reference.float()).pow(2).sum(dim=1, keepdim=True)
    total = float(err.sum()) or 1.0
    inside = float((err * mask).sum())
    around = float((err * ring).sum())
    return {"inside": round(inside / total, 3), "ring": round(around / total, 3),
            "rest": round(max(0.0, total - inside - around) / total, 3)}


def main(argv=None) -> dict:
    ap = pair_study_parser(__doc__.splitlines()[0], "region_dilation.json", sharded=True)
    a = ap.parse_args(argv)
    if a.merge:
        return write(merged_shards(a.merge, lambda rows, first: summarise(rows)), a.out)
    shard, shards = (int(x) for x in a.shard.split("/"))
    from calibrate import _load_bench
    bench = _load_bench()
    from carnator_core.calibration.fit import exceeds_tolerance
    from carnator_core.pipeline import ReuseSettings, fill_region
    from carnator_core.signature import tiles_to_latent_mask
    settings = ReuseSettings()
    world = bench.World(bench.DEFAULT_MODEL, steps=a.steps)
    n, p = world.steps, settings.probe_steps(a.steps)
    depths = [k for k in DEPTHS if k in settings.snapshot_steps(n)]
    rows, t0 = [], time.time()
    for i, (g, kind, line, req, cand, region) in enumerate(other_evidence_pairs(bench, world, settings, a.scale)):
        if i % shards != shard or not bool(region.any()):
            continue
        grid = req["record"].grid
        ok_reference = bench.check_ok(req["video"], line["scene"])

        def new_run():
            return world.new_run(line["prompt"], int(line["seed"]), line.get("seed_policy", "same_seed"))
        shape = new_run().latent_shape
        row = {"group": str(g), "kind": kind, "ok_reference": ok_reference, "depths": {},
               "region_fraction": round(float(region.float().mean()), 4)}
        for k in depths:
            out = {}
            for name, kernel in VARIANTS.items():
                tiles = widen(region, grid, kernel)
                run = new_run()
                fill = fill_region(run, cand["record"].snapshots[k].float(), tiles, grid, req["x0_probe"],
                                   req["x_probe"], p, k, settings.region_fill_calls,
                                   stored=cand["record"].snapshots)
                final = run.sample(k, n, fill.latent)
                video = world.video(final)
                q = bench.psnr(video, req["video"])
                ok = bench.check_ok(video, line["scene"])
                got = {"psnr": round(q, 2), "ok": ok, "on_m": fill.on_m,
                       "label": exceeds_tolerance(q, ok_reference, ok, a.psnr_bound),
                       "token_share": round(fill.token_share, 3), "cost": round(p + fill.steps + n - k, 2)}
                if kernel is None:
                    mask = tiles_to_latent_mask(tiles, grid, shape).to(final.device)
                    ring = tiles_to_latent_mask(widen(tiles, grid, (3, 3, 3)), grid, shape).to(final.device) - mask
                    got["error"] = error_shares(final, req["final"].to(final.device), mask, ring)
                out[name] = got
            row["depths"][str(k)] = out
        rows.append(row)
        print(f"{len(rows)} pairs ({kind}, M {row['region_fraction']:.0%} of the tiles), "
              f"{time.time() - t0:.0f} s", flush=True)
        write({"steps": n, "probe_steps": p, "psnr_bound": a.psnr_bound, "depths": depths,
               "variants": {k: v for k, v in VARIANTS.items()}, "shard": a.shard, "pairs": rows,
               "summary": summarise(rows), "seconds": round(time.time() - t0, 1)}, a.out, quiet=True)
    if not rows:
        raise SystemExit("no pair with a region M")
    return write(json.load(open(a.out)), a.out)


def summarise(rows: list[dict]) -> dict:
    """Per kind and all, per depth and variant: beyond tolerance / pairs, mean PSNR (capped
    at 60 dB), mean cost in steps; and for ``m`` the mean error shares."""
    summary: dict = {}
    for kind in sorted({r["kind"] for r in rows}) + ["all"]:
        mine = [r for r in rows if kind in (r["kind"], "all")]
        s = summary[kind] = {"pairs": len(mine)}
        for k in mine[0]["depths"]:
            for name in mine[0]["depths"][k]:
                got = [r["depths"][k][name] for r in mine]
                entry = {"beyond": sum(x["label"] for x in got), "pairs": len(got),
                         "mean_psnr": round(sum(min(x["psnr"], 60.0) for x in got) / len(got), 2),
                         "mean_cost": round(sum(x["cost"] for x in got) / len(got), 2)}
                if "error" in got[0]:
                    bad = [x["error"] for x in got if x["label"]] or [x["error"] for x in got]
                    entry["error_of_beyond"] = {w: round(sum(e[w] for e in bad) / len(bad), 3)
                                                for w in ("inside", "ring", "rest")}
                s.setdefault(k, {})[name] = entry
    return summary


def write(res: dict, out: str, quiet: bool = False) -> dict:
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    if not quiet:
        for kind, s in res["summary"].items():
            print(f"{kind}: {s['pairs']} pairs")
            for k in res["depths"]:
                print(f"  k={k:>2} " + " | ".join(
                    f"{m} {x['beyond']}/{x['pairs']} beyond, {x['mean_psnr']:.1f} dB, {x['mean_cost']:.1f} steps"
                    + (f", error in M/ring/rest {x['error_of_beyond']}" if "error_of_beyond" in x else "")
                    for m, x in s[str(k)].items()))
    return res


if __name__ == "__main__":
    main()
