"""Calibrated at the smallest size, served at the largest: does the gate's risk transfer across
size on the multi-size tiny world (models/tinyworld_multisize/), and what does a calibration at
the small size cost in generations of the served size?

Made of runs of the project's own tools (the recipe is the bundled calibration's: probe 0.05, M
filled on its tokens and widened by a tile, the 4-call region finish; N = 20), then read here:

    M=models/tinyworld_multisize/carnator_tinyworld_wan21.safetensors
    R="--probe-fraction 0.05 --form signed --joint --fill-on-m --region-margin 1 --other-finish-calls 4 --other-finish-region"
    # 1. the calibration pairs at 2x16, two processes:
    bench/calibrate.py --model $M --size 2x16 --workload calibration|calibration_edits $R --shard i/2 --results DIR
    # 2. fitted and certified on them (bench/results/studies/multisize_2x16_calibration/):
    bench/calibrate.py --model $M --size 2x16 $R --instances <1's files> --results bench/results/studies/multisize_2x16_calibration
    # 3. served at 8x48 with that calibration (bench/results/studies/multisize_8x48/<workload>.json):
    bench/tinyworld.py serve --model $M --size 8x48 --risk-model <2's calibration> --no-text-baseline --no-sparse-system
    # 4. some of the same pairs measured at 8x48 too (bench/results/studies/multisize_8x48_pairs/):
    bench/calibrate.py --model $M --size 8x48 --workload calibration $R --shard 0/16 --results DIR
    .venv/bin/python bench/studies/proxy_size.py     # -> bench/results/proxy_size.json, rows of calibration_cost.json

What it reports:
- **cost**: the calibration's generation-equivalents at 2x16 and at 8x48 (token rows:
  ``meter.at_served_size``), and the seconds of one full generation at each size timed here,
  side by side in this process (the CPU's overheads make the time ratio smaller than the rows').
- **served**: each workload served at 8x48 with the 2x16 calibration, per α: false accepts with
  their Clopper–Pearson 95% upper bound, hit rate, gate-hit steps speedup.
- **pairs at both sizes**: the same pairs' reuses labelled at each size (same depth, same
  finish): how often the labels agree, the failure rate per evidence class and depth at each
  size, and the proxy calibration's decisions replayed on the 8x48 measurements.
- **curve**: the calibration cut to 25, 50, 100, 200 generation-equivalents of the served size
  (pairs in a seeded random order), fitted and certified as the full one: what each certifies,
  and its decisions replayed on the 8x48 pairs.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import random
import time

from study_paths import REPO  # noqa: F401 - the repository, tests/ and bench/ on the path

from carnator_core.calibration import fit as CAL  # noqa: E402
from carnator_core.calibration.meter import at_served_size, pair_cost  # noqa: E402
from carnator_core.calibration.risk_control import clopper_pearson_upper  # noqa: E402
from carnator_core.gate import evidence_class  # noqa: E402

RESULTS = os.path.join(REPO, "bench", "results")
STUDIES = os.path.join(RESULTS, "studies")
MODEL = os.path.join(REPO, "models", "tinyworld_multisize", "carnator_tinyworld_wan21.safetensors")
SMALL, SERVED = "2x16", "8x48"
SMALL_PAIRS = os.path.join(STUDIES, "multisize_2x16")
CALIBRATION = os.path.join(STUDIES, "multisize_2x16_calibration")
SERVED_RUNS = os.path.join(STUDIES, "multisize_8x48")
SERVED_PAIRS = os.path.join(STUDIES, "multisize_8x48_pairs")
OUT = os.path.join(RESULTS, "proxy_size.json")
STEPS, PROBE, ALPHAS = 20, 0.05, (0.02, 0.05, 0.1)
CURVE = (25, 50, 100, 200)


def tokens(size: str) -> int:
    """Model tokens of a size: frames × (pixels / 2 latent / 2 patch)²."""
    frames, pixels = (int(x) for x in size.split("x"))
    return frames * (pixels // 4) ** 2


def load(folder: str) -> list[dict]:
    return [i for path in sorted(glob.glob(os.path.join(folder, "**", "*.jsonl"), recursive=True))
            for i in CAL.load_instances(path)]


def by_pair(instances: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for inst in instances:
        out.setdefault(key_of(inst), []).append(inst)
    return out


def key_of(inst: dict) -> str:
    """A pair across measurement files: its two prompts (groups repeat across workloads)."""
    return " || ".join(sorted((inst["prompt"], inst["candidate_prompt"])))


def replay(model, instances: list[dict], alpha: float) -> dict:
    """The gate's decisions at α on measured directions (fit.gate_decision), with their steps."""
    picks = [CAL.gate_decision(model, i, alpha, 0.5) for i in instances]
    hits = [d for d in picks if d is not None]
    bad = sum(int(d["label"]) for d in hits)
    steps = sum(1 + float(d.get("fill_steps") or 0.0) + CAL._cost(d) for d in hits)  # probe 1 of 20
    return {"alpha": alpha, "directions": len(instances), "accepted": len(hits),
            "accept_rate": len(hits) / len(instances) if instances else 0.0,
            "false_accepts": bad, "false_accept_rate": bad / len(hits) if hits else 0.0,
            "fa_upper95": clopper_pearson_upper(bad, len(hits), 0.05) if hits else None,
            "gate_hit_speedup": STEPS * len(hits) / steps if hits else None}


def label_transfer(small: list[dict], served: list[dict]) -> dict:
    """The same pairs' reuses labelled at both sizes: agreement and failure rates by class and
    depth (a reuse = one direction, depth k and finish measured at both)."""
    small_of = {(key_of(i), i["prompt"]): i for i in small}
    table: dict[str, dict] = {}
    both = agree = 0
    for inst in served:
        twin = small_of.get((key_of(inst), inst["prompt"]))
        if twin is None:
            continue
        klass = evidence_class(inst["features"])
        at_small = {(d["k"], d.get("finish_calls", 0)): d for d in twin["depths"]}
        for d in inst["depths"]:
            s = at_small.get((d["k"], d.get("finish_calls", 0)))
            if s is None:
                continue
            cell = table.setdefault(f"{klass} k={d['k']}" + (f" finish {d['finish_calls']}" if d.get("finish_calls") else ""),
                                    {"reuses": 0, "exceeded_small": 0, "exceeded_served": 0, "agree": 0})
            cell["reuses"] += 1
            cell["exceeded_small"] += int(s["label"])
            cell["exceeded_served"] += int(d["label"])
            cell["agree"] += int(s["label"]) == int(d["label"])
            both += 1
            agree += int(s["label"]) == int(d["label"])
    return {"reuses_at_both_sizes": both, "labels_agree": agree / both if both else None,
            "by_class_and_depth": dict(sorted(table.items()))}


def curve(small: list[dict], served: list[dict], ratio: float, seed: int = 0) -> list[dict]:
    """The calibration cut by served-size cost: pairs in a seeded random order, the first ones
    whose cost stays within each budget, fitted and certified as bench/calibrate.py does."""
    from carnator_core.gate import RiskModel
    pairs = list(by_pair(small).values())
    random.Random(seed).shuffle(pairs)
    out = []
    for budget in CURVE:
        part, spent = [], 0.0
        for p in pairs:
            c = pair_cost(p, STEPS) * ratio
            if spent + c > budget:
                break
            part.append(p)
            spent += c
        row = {"budget_generations": budget, "cost_generations": round(spent, 2), "pairs": len(part)}
        try:
            model, _ = CAL.fit_and_certify([i for p in part for i in p], RiskModel().region_threshold,
                                           form="signed", joint=True, probe_fraction=PROBE)
        except ValueError as e:
            out.append({**row, "certified": {}, "refused": str(e)})
            continue
        row["certified"] = {c: sorted(k for k, v in t.items() if v is not None)
                            for c, t in model.thresholds.items() if ":" not in c}
        if served:
            row["served_pairs"] = {f"{al:g}": replay(model, served, al) for al in ALPHAS}
        out.append(row)
    return out


def served_rows(folder: str) -> dict:
    """Each workload served at the large size: per α, from bench/tinyworld.py's sweep."""
    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        data = json.load(open(path))
        for name, sweep in data["sweeps"].items():
            rows = {}
            for m in sweep["carnator"]:
                hits = round(m["hit_rate"] * m["requests"])
                rows[f"{m['risk_budget']:g}"] = {
                    "requests": m["requests"], "hits": hits, "hit_rate": m["hit_rate"],
                    "false_accepts": m["false_accepts"], "false_accept_rate": m["false_accept_rate"],
                    "fa_upper95": clopper_pearson_upper(m["false_accepts"], hits, 0.05) if hits else None,
                    "gate_hit_steps_speedup": m.get("steps_speedup_hits"),
                    "workload_steps_speedup": m.get("compute_speedup_workload"),
                    "same_scene_hit_rate": m.get("same_scene_hit_rate")}
            out[name] = {"size": data["settings"].get("size"), "calibration": data["settings"].get("calibration"),
                         "seconds": data["settings"].get("seconds"), "by_alpha": rows}
    return out


def time_generations(model_path: str, sizes=(SMALL, SERVED), repeats: int = 3) -> dict:
    """Seconds of one full generation at each size, side by side in this process."""
    from calibrate import _load_bench
    bench = _load_bench()
    out = {}
    for size in sizes:
        world = bench.World(model_path, steps=STEPS, cfg=4.0, threads=1, size=size)
        world.full("a red circle moves left at the top", 1, "same_seed")  # warm-up
        t0 = time.perf_counter()
        for i in range(repeats):
            world.full("a red circle moves left at the top", 2 + i, "same_seed")
        out[size] = round((time.perf_counter() - t0) / repeats, 3)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-timing", action="store_true", help="leave out the side-by-side timing")
    ap.add_argument("--no-cost-rows", action="store_true", help="leave bench/results/calibration_cost.json alone")
    ap.add_argument("--out", default=OUT)
    a = ap.parse_args(argv)
    small, served = load(SMALL_PAIRS), load(SERVED_PAIRS)
    ratio = at_served_size(1.0, tokens(SMALL), tokens(SERVED))
    report = json.load(open(os.path.join(CALIBRATION, "calibration_report.probe0.05.json")))
    from carnator_core.gate import RiskModel
    model = RiskModel.load(glob.glob(os.path.join(CALIBRATION, "calibration", "*.json"))[0])
    cost_small = sum(pair_cost(p, STEPS) for p in by_pair(small).values())
    out = {
        "model": os.path.relpath(MODEL, REPO), "model_fingerprint": report["model_fingerprint"],
        "calibrated_size": SMALL, "served_size": SERVED, "steps": STEPS, "probe_fraction": PROBE,
        "tokens": {SMALL: tokens(SMALL), SERVED: tokens(SERVED)},
        "cost": {"pairs": len(by_pair(small)), "generations_at_calibrated_size": round(cost_small, 1),
                 "generations_at_served_size": round(cost_small * ratio, 1),
                 "rule": "token rows: generation-equivalents at the calibrated size × its tokens / the served size's"},
        "certified": {c: {k: v for k, v in t.items()} for c, t in model.thresholds.items() if ":" not in c},
        "calibration_heldout_at_calibrated_size": report["heldout"],
        "served": served_rows(SERVED_RUNS),
        "pairs_at_both_sizes": label_transfer(small, served),
        "served_pairs_replay": {f"{al:g}": replay(model, served, al) for al in ALPHAS} if served else None,
        "curve": curve(small, served, ratio),
    }
    if not a.no_timing:
        secs = time_generations(MODEL)
        out["seconds_per_generation"] = {**secs, "ratio": round(secs[SMALL] / secs[SERVED], 4),
                                         "note": "one full generation, N = 20, cfg 4, 1 thread, timed here"}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    if not a.no_cost_rows:
        _cost_rows(out)
    _print(out)
    print(f"wrote {os.path.relpath(a.out, REPO)}")
    return out


def _cost_rows(out: dict) -> None:
    from calibration_cost import merge
    note = (f"calibrated at {out['calibrated_size']} (frames x pixels) on the multi-size tiny world, served at "
            f"{out['served_size']} (bench/studies/proxy_size.py); cost counted at the served size by token rows; "
            "speedup_kept: none, no full calibration at the served size was measured")
    rows = []
    for name, w in out["served"].items():
        for al, v in w["by_alpha"].items():
            rows.append({"model": out["model_fingerprint"], "procedure": "proxy", "workload": name,
                         "alpha": float(al), "steps": STEPS, "budget_generations": None,
                         "cost_generations": out["cost"]["generations_at_served_size"],
                         "cost_generations_at_calibrated_size": out["cost"]["generations_at_calibrated_size"],
                         "calibrated_size": out["calibrated_size"], "served_size": out["served_size"],
                         "pairs": out["cost"]["pairs"], "false_accept_rate": v["false_accept_rate"],
                         "fa_upper95": v["fa_upper95"], "hit_rate": v["hit_rate"],
                         "gate_hit_speedup": v["gate_hit_steps_speedup"], "speedup_kept": None, "note": note})
    for c in out["curve"]:
        for al, v in (c.get("served_pairs") or {}).items():
            rows.append({"model": out["model_fingerprint"], "procedure": "proxy", "workload": "served_size_pairs",
                         "alpha": float(al), "steps": STEPS, "budget_generations": float(c["budget_generations"]),
                         "cost_generations": c["cost_generations"], "calibrated_size": out["calibrated_size"],
                         "served_size": out["served_size"], "pairs": c["pairs"],
                         "false_accept_rate": v["false_accept_rate"], "fa_upper95": v["fa_upper95"],
                         "gate_hit_speedup": v["gate_hit_speedup"], "speedup_kept": None,
                         "certified": c["certified"],
                         "note": note + "; a replay of the cut calibration's decisions on pairs measured at the served size"})
    merge(rows)


def _print(out: dict) -> None:
    c = out["cost"]
    print(f"calibrated at {out['calibrated_size']}: {c['pairs']} pairs, {c['generations_at_calibrated_size']} "
          f"generation-equivalents there = {c['generations_at_served_size']} at {out['served_size']}")
    for name, w in out["served"].items():
        for al, v in w["by_alpha"].items():
            up = "—" if v["fa_upper95"] is None else f"{v['fa_upper95']:.1%}"
            print(f"  {name:8s} α={al:>4}: hits {v['hit_rate']:.1%}, false accepts {v['false_accepts']} "
                  f"({v['false_accept_rate']:.1%}, up95 {up}), gate hits {v['gate_hit_steps_speedup'] or 0:.2f}× fewer steps")
    t = out["pairs_at_both_sizes"]
    if t["reuses_at_both_sizes"]:
        print(f"  labels agree on {t['labels_agree']:.1%} of {t['reuses_at_both_sizes']} reuses measured at both sizes")
    for row in out["curve"]:
        print(f"  cut to {row['budget_generations']}: {row['pairs']} pairs, certified {row['certified'] or 'nothing'}")


if __name__ == "__main__":
    main()
