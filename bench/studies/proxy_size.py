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
    # 4. fresh pairs drawn like the calibration's, measured at 8x48 and at 2x16
    #    (bench/results/studies/multisize_8x48_pairs/ and multisize_2x16_fresh_pairs/):
    .venv/bin/python bench/studies/proxy_size.py --write-fresh-pairs bench/results/studies/multisize_fresh_pairs.jsonl
    bench/calibrate.py --model $M --size 8x48|2x16 --workload <that file> $R --shard i/2 --results DIR
    .venv/bin/python bench/studies/proxy_size.py     # -> bench/results/proxy_size.json, rows of calibration_cost.json

What it reports:
- **cost**: the calibration's generation-equivalents at 2x16 and at 8x48 (token rows:
  ``meter.at_served_size``), and the seconds of one full generation at each size timed here,
  side by side in this process (the CPU's overheads make the time ratio smaller than the rows').
- **served**: each workload served at 8x48 with the 2x16 calibration, per α: false accepts with
  their Clopper–Pearson 95% upper bound, hit rate, gate-hit steps speedup.
- **fresh pairs at both sizes**: pairs drawn by the calibration workload's generators with
  seeds no workload uses (``fresh_pairs``), their reuses labelled at each size (same depth, same
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
import sys
import time

from study_paths import REPO  # noqa: E402 - the repository, tests/ and bench/ on the path
if os.path.join(REPO, "scripts") not in sys.path:
    sys.path.append(os.path.join(REPO, "scripts"))

from carnator_core.calibration import fit as CAL  # noqa: E402
from carnator_core.calibration.meter import at_served_size, pair_cost  # noqa: E402
from carnator_core.calibration.risk_control import clopper_pearson_upper  # noqa: E402
from carnator_core.gate import evidence_class  # noqa: E402
from cheap_calibration import replay, workload_seeds  # noqa: E402 - the gate's decisions on measured pairs

RESULTS = os.path.join(REPO, "bench", "results")
STUDIES = os.path.join(RESULTS, "studies")
MODEL = os.path.join(REPO, "models", "tinyworld_multisize", "carnator_tinyworld_wan21.safetensors")
SMALL, SERVED = "2x16", "8x48"
SMALL_PAIRS = os.path.join(STUDIES, "multisize_2x16")
CALIBRATION = os.path.join(STUDIES, "multisize_2x16_calibration")
SERVED_RUNS = os.path.join(STUDIES, "multisize_8x48")
FRESH_PAIRS = os.path.join(STUDIES, "multisize_fresh_pairs.jsonl")  # the workload of both below
SERVED_PAIRS = os.path.join(STUDIES, "multisize_8x48_pairs")
SMALL_FRESH = os.path.join(STUDIES, "multisize_2x16_fresh_pairs")
CHEAP = os.path.join(STUDIES, "multisize_2x16_cheap.json")  # bench/studies/cheap_calibration.py at 2x16
OUT = os.path.join(RESULTS, "proxy_size.json")
STEPS, PROBE, ALPHAS = 20, 0.05, (0.02, 0.05, 0.1)
CURVE = (25, 50, 100, 200)
DRAWS = 5  # random orders of the pairs per cut: one small certificate can be lucky or not


FRESH_CALIBRATION_KIND_PAIRS, FRESH_SCENE_EDIT_PAIRS = 40, 24


def fresh_pairs() -> list[dict]:
    """Pairs drawn as the calibration workload's are (its kinds in turn, and scene edits), with
    their own seeds, for checking a calibration at the served size on pairs it never saw."""
    import make_workloads as MW
    lines = MW._pairs(MW.CALIBRATION_KINDS, FRESH_CALIBRATION_KIND_PAIRS, 7007, 7_700_000, 7_800_000)
    lines += MW.edit_pairs(FRESH_SCENE_EDIT_PAIRS, first_group=FRESH_CALIBRATION_KIND_PAIRS, seed=7171,
                           first_seed=7_900_000)
    clash = {ln["seed"] for ln in lines} & workload_seeds()
    assert not clash, f"fresh pairs reuse workload seeds {sorted(clash)[:5]}"
    return lines


def tokens(size: str) -> int:
    """Model tokens of a size: frames × (pixels / 2 latent / 2 patch)²."""
    frames, pixels = (int(x) for x in size.split("x"))
    return frames * (pixels // 4) ** 2


def load(folder: str) -> list[dict]:
    """A folder's measured directions, each with the workload folder it came from (pair groups
    are numbered per workload)."""
    out = []
    for path in sorted(glob.glob(os.path.join(folder, "**", "*.jsonl"), recursive=True)):
        out += [{**i, "workload": os.path.relpath(os.path.dirname(path), folder)} for i in CAL.load_instances(path)]
    return out


def by_pair(instances: list[dict]) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for inst in instances:
        out.setdefault((inst["workload"], str(inst["group"])), []).append(inst)
    return out


def label_transfer(small: list[dict], served: list[dict]) -> dict:
    """The same pairs' reuses labelled at both sizes: agreement and failure rates by class and
    depth (a reuse = one direction, depth k and finish measured at both)."""
    small_of = {(str(i["group"]), i["prompt"], i["candidate_prompt"]): i for i in small}
    table: dict[str, dict] = {}
    both = agree = 0
    for inst in served:
        twin = small_of.get((str(inst["group"]), inst["prompt"], inst["candidate_prompt"]))
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


def curve(small: list[dict], served: list[dict], ratio: float, full: dict, draws: int = DRAWS) -> list[dict]:
    """The calibration cut by served-size cost, in ``draws`` seeded random orders of its pairs:
    the first pairs whose cost stays within each budget, fitted and certified as
    bench/calibrate.py does, each draw's decisions replayed on the served-size pairs."""
    from carnator_core.gate import RiskModel
    measured, out = list(by_pair(small).values()), []
    for budget in CURVE:
        row = {"budget_generations": budget, "draws": []}
        for seed in range(draws):
            pairs = list(measured)
            random.Random(seed).shuffle(pairs)
            part, spent = [], 0.0
            for p in pairs:
                c = pair_cost(p, STEPS) * ratio
                if spent + c > budget:
                    break
                part.append(p)
                spent += c
            draw = {"seed": seed, "cost_generations": round(spent, 2), "pairs": len(part)}
            try:
                model, _ = CAL.fit_and_certify([i for p in part for i in p], RiskModel().region_threshold,
                                               form="signed", joint=True, probe_fraction=PROBE)
            except ValueError as e:
                row["draws"].append({**draw, "certified": {}, "refused": str(e)})
                continue
            draw["certified"] = {c: sorted(k for k, v in t.items() if v is not None)
                                 for c, t in model.thresholds.items() if ":" not in c}
            draw["served_pairs"] = {}
            for al in ALPHAS if served else ():
                got = replay(model, served, al)
                whole = full[f"{al:g}"]["saved_steps"]
                draw["served_pairs"][f"{al:g}"] = {**got, "speedup_kept": got["saved_steps"] / whole if whole else None}
            row["draws"].append(draw)
        row["pooled"] = _pooled(row["draws"]) if served else None
        out.append(row)
    return out


def _pooled(draws: list[dict]) -> dict:
    """Per α over the draws: false accepts of all their accepted reuses (the draws replay the same
    served pairs, so this is an average, not a larger sample), the worst draw's rate, and the mean
    share of the whole calibration's saved steps kept."""
    out = {}
    for al in ALPHAS:
        got = [d["served_pairs"][f"{al:g}"] for d in draws if d.get("served_pairs")]
        acc, bad = sum(g["accepted"] for g in got), sum(g["false_accepts"] for g in got)
        kept = [g["speedup_kept"] or 0.0 for g in got]
        steps = [g["gate_hit_speedup"] for g in got if g["gate_hit_speedup"]]
        out[f"{al:g}"] = {"draws": len(got), "accepted": acc, "false_accepts": bad,
                          "false_accept_rate": bad / acc if acc else 0.0,
                          "worst_draw_false_accept_rate": max((g["false_accept_rate"] for g in got), default=0.0),
                          "fa_upper95": clopper_pearson_upper(bad, acc, 0.05) if acc else None,
                          "gate_hit_speedup": sum(steps) / len(steps) if steps else None,
                          "speedup_kept": sum(kept) / len(kept) if kept else None,
                          "speedup_kept_range": [min(kept), max(kept)] if kept else None}
    return out


def cheap_at_small_size(ratio: float) -> dict | None:
    """The cheap calibration (the bundled model's ranking, thresholds certified here) run at the
    calibrated size, each budget's decisions replayed on the fresh served-size pairs, its saved
    steps against the full calibration at the calibrated size (bench/studies/cheap_calibration.py
    --size 2x16 --heldout <the 8x48 pairs> --full <the 2x16 calibration>)."""
    if not os.path.isfile(CHEAP):
        return None
    data = json.load(open(CHEAP))
    out = {"source": os.path.relpath(CHEAP, REPO), "full_reference": data.get("full_reference"),
           "full_reference_on_served_pairs": data["full_calibration"]["heldout"], "budgets": {}}
    for budget, b in data["budgets"].items():
        out["budgets"][budget] = {"cost_generations_at_calibrated_size": b["cost_generations"],
                                  "cost_generations_at_served_size": round(b["cost_generations"] * ratio, 2),
                                  "pairs": b["pairs"], "certified": b["certified"], "served_pairs": b["heldout"]}
    return out


def served_row(m: dict, hits: int, false_accepts: int, false_accept_rate: float, workload_speedup) -> dict:
    """One α of a bench/tinyworld.py sweep as a served row: the false accepts among ``hits``
    with their one-sided 95% bound, the speedups in model steps."""
    return {"requests": m["requests"], "hits": hits, "hit_rate": m["hit_rate"],
            "false_accepts": false_accepts, "false_accept_rate": false_accept_rate,
            "fa_upper95": clopper_pearson_upper(false_accepts, hits, 0.05) if hits else None,
            "gate_hit_steps_speedup": m.get("steps_speedup_hits"), "workload_steps_speedup": workload_speedup,
            "same_scene_hit_rate": m.get("same_scene_hit_rate")}


def served_rows(paths: list[str]) -> dict:
    """Each workload of these bench/tinyworld.py runs: per α, from its sweep."""
    out = {}
    for path in paths:
        data = json.load(open(path))
        for name, sweep in data["sweeps"].items():
            rows = {}
            for m in sweep["carnator"]:
                rows[f"{m['risk_budget']:g}"] = served_row(m, round(m["hit_rate"] * m["requests"]), m["false_accepts"],
                                                           m["false_accept_rate"], m.get("compute_speedup_workload"))
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
    ap.add_argument("--write-fresh-pairs", metavar="JSONL", nargs="?", const=FRESH_PAIRS, default=None,
                    help="write the fresh pairs as a workload for bench/calibrate.py (default: "
                         "bench/results/studies/multisize_fresh_pairs.jsonl) and stop")
    a = ap.parse_args(argv)
    if a.write_fresh_pairs:
        os.makedirs(os.path.dirname(os.path.abspath(a.write_fresh_pairs)), exist_ok=True)
        with open(a.write_fresh_pairs, "w") as f:
            f.writelines(json.dumps(ln) + "\n" for ln in fresh_pairs())
        print(f"wrote {a.write_fresh_pairs}")
        return {}
    small, served, small_fresh = load(SMALL_PAIRS), load(SERVED_PAIRS), load(SMALL_FRESH)
    ratio = at_served_size(1.0, tokens(SMALL), tokens(SERVED))
    report = json.load(open(os.path.join(CALIBRATION, "calibration_report.probe0.05.json")))
    from carnator_core.gate import RiskModel
    model = RiskModel.load(glob.glob(os.path.join(CALIBRATION, "calibration", "*.json"))[0])
    cost_small = sum(pair_cost(p, STEPS) for p in by_pair(small).values())
    full = {f"{al:g}": replay(model, served, al) for al in ALPHAS} if served else None
    out = {
        "model": os.path.relpath(MODEL, REPO), "model_fingerprint": report["model_fingerprint"],
        "calibrated_size": SMALL, "served_size": SERVED, "steps": STEPS, "probe_fraction": PROBE,
        "tokens": {SMALL: tokens(SMALL), SERVED: tokens(SERVED)},
        "cost": {"pairs": len(by_pair(small)), "generations_at_calibrated_size": round(cost_small, 1),
                 "generations_at_served_size": round(cost_small * ratio, 1),
                 "rule": "token rows: generation-equivalents at the calibrated size × its tokens / the served size's"},
        "certified": {c: dict(t) for c, t in model.thresholds.items() if ":" not in c},
        "calibration_heldout_at_calibrated_size": report["heldout"],
        "served": served_rows(sorted(glob.glob(os.path.join(SERVED_RUNS, "*.json")))),
        "fresh_pairs_at_both_sizes": label_transfer(small_fresh, served),
        "served_pairs_replay": full,
        "curve": curve(small, served, ratio, full),
        "cheap_at_calibrated_size": cheap_at_small_size(ratio),
    }
    if not a.no_timing:
        secs = time_generations(MODEL)
        out["seconds_per_generation"] = {**secs, "ratio": round(secs[SMALL] / secs[SERVED], 4),
                                         "note": "one full generation, N = 20, cfg 4, 1 thread, timed here"}
    elif os.path.isfile(a.out):  # read again without timing: the timing the file has stays
        before = json.load(open(a.out)).get("seconds_per_generation")
        if before:
            out["seconds_per_generation"] = before
    out["plot"] = os.path.relpath(plot(out, os.path.splitext(a.out)[0] + ".png"), REPO)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    if not a.no_cost_rows:
        _cost_rows(out)
    _print(out)
    print(f"wrote {os.path.relpath(a.out, REPO)}")
    return out


def plot(out: dict, path: str) -> str:
    """Share of the whole 2x16 calibration's saved steps kept on the served-size pairs against
    the cost in generation-equivalents of the served size, at α = 5% and 10%: the cut
    calibration (mean of its draws) and the cheap procedure, each ending at the whole one."""
    from calibrate import _load_bench
    whole = out["cost"]["generations_at_served_size"]
    series = []
    for al in ("0.05", "0.1"):
        cut = [(c["budget_generations"], c["pooled"][al]["speedup_kept"] or 0.0) for c in out["curve"] if c["pooled"]]
        series.append((f"cut, alpha {al}", cut + [(whole, 1.0)]))
        cheap = out.get("cheap_at_calibrated_size") or {"budgets": {}}
        pts = [(b["cost_generations_at_served_size"], b["served_pairs"][al]["speedup_kept"] or 0.0)
               for b in cheap["budgets"].values()]
        if pts:
            series.append((f"cheap, alpha {al}", pts))
    _load_bench()._pil_plot(series, f"generation-equivalents at {out['served_size']}",
                            "share of the whole calibration's saved steps kept", path, legend="bottom left")
    return path


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
        for al, v in (c.get("pooled") or {}).items():
            rows.append({"model": out["model_fingerprint"], "procedure": "proxy", "workload": "served_size_pairs",
                         "alpha": float(al), "steps": STEPS, "budget_generations": float(c["budget_generations"]),
                         "cost_generations": max(d["cost_generations"] for d in c["draws"]),
                         "calibrated_size": out["calibrated_size"], "served_size": out["served_size"],
                         "pairs": [d["pairs"] for d in c["draws"]], "draws": v["draws"],
                         "false_accept_rate": v["false_accept_rate"], "fa_upper95": v["fa_upper95"],
                         "worst_draw_false_accept_rate": v["worst_draw_false_accept_rate"],
                         "gate_hit_speedup": v["gate_hit_speedup"], "speedup_kept": v["speedup_kept"],
                         "speedup_kept_range": v["speedup_kept_range"],
                         "certified": [d["certified"] for d in c["draws"]],
                         "note": note.replace("none, no full calibration at the served size was measured",
                                              "against the whole calibration at the calibrated size, mean of the draws")
                         + f"; the calibration cut to the budget in {v['draws']} random orders of its pairs, each "
                           "cut's decisions replayed on pairs measured at the served size; false accepts pooled "
                           "over the draws (the same pairs, so not a larger sample)"})
    cheap = out.get("cheap_at_calibrated_size") or {"budgets": {}}
    for b in cheap["budgets"].values():
        for al, v in b["served_pairs"].items():
            rows.append({"model": out["model_fingerprint"], "procedure": "proxy_cheap", "workload": "served_size_pairs",
                         "alpha": float(al), "steps": STEPS,
                         "budget_generations": round(b["cost_generations_at_served_size"]),
                         "cost_generations": b["cost_generations_at_served_size"],
                         "cost_generations_at_calibrated_size": b["cost_generations_at_calibrated_size"],
                         "calibrated_size": out["calibrated_size"], "served_size": out["served_size"],
                         "pairs": b["pairs"], "false_accept_rate": v["false_accept_rate"],
                         "fa_upper95": v["fa_upper95"], "gate_hit_speedup": v["gate_hit_speedup"],
                         "speedup_kept": v["speedup_kept"], "certified": b["certified"],
                         "note": note.replace("speedup_kept: none, no full calibration at the served size was measured",
                                              "the cheap procedure (the bundled model's ranking) at the calibrated "
                                              "size; speedup_kept: against the full calibration at the calibrated "
                                              "size, both replayed on pairs measured at the served size")})
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
    t = out["fresh_pairs_at_both_sizes"]
    if t["reuses_at_both_sizes"]:
        print(f"  labels agree on {t['labels_agree']:.1%} of {t['reuses_at_both_sizes']} reuses measured at both sizes")
    for row in out["curve"]:
        print(f"  cut to {row['budget_generations']}: pairs {[d['pairs'] for d in row['draws']]}")
        for al, v in (row["pooled"] or {}).items():
            print(f"    α={al:>4}: accepted {v['accepted']}, false accepts {v['false_accept_rate']:.1%} "
                  f"(worst draw {v['worst_draw_false_accept_rate']:.1%}), kept {v['speedup_kept'] or 0:.0%} "
                  f"{[round(x, 2) for x in v['speedup_kept_range'] or []]}")


if __name__ == "__main__":
    main()
