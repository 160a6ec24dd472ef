"""Localization check: on partly compatible pairs, does the region M cover the changed object?

    .venv/bin/python bench/studies/localization.py                 # all 'partial' pairs of the calibration workload
    .venv/bin/python bench/studies/localization.py --limit 4       # a quick look

A partly compatible pair is a two-object scene and the same scene with one object's colour,
shape or motion changed (same seed). For each pair the anchor runs through Carnator into a
fresh cache (a miss, stored), then the variant's probe and gate run against it. The gate's
region M (the tiles it would recompute) is compared with two masks on the same tile grid:

- ``world``: where the tiny world puts the changed object (its rendered mask over all frames,
  from the caption, dilated by the ±1 px position jitter). This is the ground truth the issue
  asks about, and only meaningful when the model places objects where the caption says.
- ``observed``: where the two full-computation videos actually differ (same seed, so the
  difference is the edit). This is what the model changed, whatever it made of the caption.

Per pair it reports IoU(M, changed object) and the share of the unchanged object's tiles left
outside M (reused), plus whether the gate accepted. Writes bench/results/localization.json.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.nn.functional as F


def _load_bench():
    """bench/tinyworld.py (World, load_workload, RESULTS) as ``bench_tw``, the name
    bench/calibrate.py and the tests give it, so a process loads it once; a plain import
    would find the ``tinyworld`` package of the repo instead."""
    name = "bench_tw"
    if name not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tinyworld.py")
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


bench = _load_bench()

DIFF_THRESHOLD = 0.15  # per-pixel max-channel difference that counts as "changed"


def tile_mask(pixel_mask: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
    """(T, H, W) bool pixel mask -> (tiles,) bool: a tile is covered if any pixel is."""
    m = pixel_mask.float()[None, None]
    return (F.adaptive_max_pool3d(m, grid) > 0).reshape(-1)


def iou(a: torch.Tensor, b: torch.Tensor) -> float | None:
    union = (a | b).sum().item()
    return (a & b).sum().item() / union if union else None


def world_masks(sa: dict, sb: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(changed object's mask in either version, unchanged object's mask), (T, H, W) bool,
    from two workload lines' scenes."""
    from tinyworld import world as WD
    if len(sa["objects"]) != 2 or len(sb["objects"]) != 2:
        return None
    by_pos_b = {o["position"]: o for o in sb["objects"]}
    changed, kept = None, None
    for i, oa in enumerate(sa["objects"]):
        ob = by_pos_b.get(oa["position"])
        if ob is None:
            return None
        if oa != ob:
            changed = (i, oa, ob)
        else:
            kept = i
    if changed is None or kept is None:
        return None
    _, ma = WD.render(sa, jitter=False)
    _, mb = WD.render({"objects": [changed[2]]}, jitter=False)
    grow = lambda m: F.max_pool2d(m.float(), 3, 1, 1) > 0  # noqa: E731  (±1 px jitter)
    return grow(ma[changed[0]] | mb[0]), grow(ma[kept])


def pairs_from(lines: list[dict]) -> list[tuple[dict, dict]]:
    groups: dict = {}
    for ln in lines:
        if ln.get("kind") == "partial":
            groups.setdefault(ln["group"], {})[ln["role"]] = ln
    return [(g["anchor"], g["variant"]) for g in groups.values() if "anchor" in g and "variant" in g]


def run(world, pairs, budget: float, risk_model_path: str | None, workdir: str) -> list[dict]:
    from carnator_core import pipeline
    from carnator_core.comfy_adapter import run_request, start_request
    from carnator_core.gate import GateSettings
    from carnator_core.pipeline import ReuseSettings
    from carnator_core.reuse.sparse_reuse import SparseSettings
    settings = ReuseSettings(probe_fraction=0.1, gate=GateSettings(risk_budget=budget),
                             sparse=SparseSettings(enabled=False))
    out = []
    for n, (a, b) in enumerate(pairs):
        folder = os.path.join(workdir, f"pair{n}")
        os.makedirs(os.path.join(folder, "calibration"))
        if risk_model_path:
            shutil.copy(risk_model_path, os.path.join(folder, "calibration", f"{world.fingerprint}.json"))
        cache = {"folder": folder, "capacity_bytes": 1 << 30}
        seed, policy = int(a["seed"]), a.get("seed_policy", "same_seed")
        # a miss in the fresh cache: the anchor's full computation (probe + continuation equals
        # one full run, tests/test_pipeline.py), so it doubles as the reference video
        samples_a, _ = run_request(world.model, world.cond(a["prompt"]), world.negative, world.latent(),
                                   seed, world.steps, world.cfg, world.sampler, world.scheduler,
                                   settings, cache, seed_policy=policy, label=a["prompt"])
        pr = start_request(world.model, world.cond(b["prompt"]), world.negative, world.latent(), seed,
                           world.steps, world.cfg, world.sampler, world.scheduler, settings, cache,
                           seed_policy=policy, label=b["prompt"])
        plan, _ = pipeline.lookup_and_gate(pr)
        grid = pr.record.grid
        row = {"anchor": a["prompt"], "variant": b["prompt"], "accepted": plan.accept,
               "reuse_step": plan.reuse_step, "risk": plan.risk, "reason": plan.reason,
               "region_fraction": plan.region_fraction}
        if plan.region_tiles is None:
            out.append(row)
            continue
        region = plan.region_tiles.bool().reshape(-1).cpu()
        va = world.video(samples_a)
        vb = world.full(b["prompt"], seed, policy)["video"]
        observed = tile_mask((va - vb).abs().amax(0) > DIFF_THRESHOLD, grid)
        row["iou_observed"] = iou(region, observed)
        masks = world_masks(a["scene"], b["scene"])
        if masks is not None:
            changed, kept = (tile_mask(m, grid) for m in masks)
            row["iou_world"] = iou(region, changed)
            row["kept_reused_world"] = 1.0 - (region & kept).sum().item() / max(1, kept.sum().item())
        out.append(row)
        print(f"pair {n}: accept={plan.accept} M={plan.region_fraction:.0%} "
              f"IoU observed={row['iou_observed']} world={row.get('iou_world')}", flush=True)
    return out


def summarise(rows: list[dict]) -> dict:
    def mean(key, rs=rows):
        xs = [r[key] for r in rs if r.get(key) is not None]
        return sum(xs) / len(xs) if xs else None

    def share(key, bound, rs=rows):
        xs = [r[key] for r in rs if r.get(key) is not None]
        return sum(x >= bound for x in xs) / len(xs) if xs else None

    acc = [r for r in rows if r["accepted"]]
    return {"pairs": len(rows), "accepted": len(acc),
            "iou_observed_mean": mean("iou_observed"), "iou_observed_ge_0_5": share("iou_observed", 0.5),
            "iou_world_mean": mean("iou_world"), "iou_world_ge_0_5": share("iou_world", 0.5),
            "kept_reused_world_mean": mean("kept_reused_world"),
            "accepted_iou_observed_mean": mean("iou_observed", acc),
            "accepted_iou_world_mean": mean("iou_world", acc)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="calibration")
    ap.add_argument("--limit", type=int, default=None, help="first N pairs")
    ap.add_argument("--model", default=bench.DEFAULT_MODEL)
    ap.add_argument("--budget", type=float, default=0.05)
    ap.add_argument("--risk-model", default="auto")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(bench.RESULTS, "localization.json"))
    a = ap.parse_args(argv)
    world = bench.World(a.model, threads=a.threads)
    rm = (bench.default_risk_model(world.fingerprint) if a.risk_model == "auto"
          else None if a.risk_model == "prior" else a.risk_model)
    _, lines = bench.load_workload(a.workload)
    pairs = pairs_from(lines)[:a.limit] if a.limit else pairs_from(lines)
    workdir = tempfile.mkdtemp(prefix="carnator_loc_")
    t0 = time.time()
    try:
        rows = run(world, pairs, a.budget, rm, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result = {"summary": summarise(rows), "pairs": rows,
              "settings": {"model": os.path.relpath(a.model, bench.REPO), "fingerprint": world.fingerprint,
                           "workload": a.workload, "risk_budget": a.budget, "risk_model": rm,
                           "diff_threshold": DIFF_THRESHOLD, "seconds": round(time.time() - t0, 1)}}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {a.out}")
    return result


if __name__ == "__main__":
    main()
