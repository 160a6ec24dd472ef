"""The cheap calibration (carnator_core/calibration/cheap.py) on the tiny world, read at growing
budgets and checked on the full calibration's held-out measured pairs.

    nice -n 10 .venv/bin/python bench/studies/cheap_calibration.py            # measure to 400, read, write
    .venv/bin/python bench/studies/cheap_calibration.py --budgets 25 50       # re-read (nothing measured again)
    # the same ranking on another model, read against that model's full calibration:
    S=bench/results/studies
    .venv/bin/python bench/studies/cheap_calibration.py --budgets 25 50 100 200 250 400 \
        --model models/tinyworld_caption/carnator_tinyworld_wan21.safetensors --folder $S/caption_cheap \
        --heldout $S/region_finish4_calibration/calibration_measurements.{0,1}-of-2.jsonl --heldout-is-full \
        --full $S/region_finish4_calibration/calibration/95bcddd80de138d9f8c7b1ce75fb36bb.probe0.05.json \
        --out $S/caption_cheap.json   # and --easycache 0.02 (to 250) with $S/lang2_region4_easycache_calibration/
    # the same with the ladder Carnator Calibrate transfers (the bundled calibration's own thresholds):
    #   … --bundled-ladder --no-cost-rows --folder $S/caption_cheap_bundled_ladder --out $S/caption_cheap_bundled_ladder.json
    # and with a shallower same-scene depth tested first (α = 5% and 10% walk 0.5 → 0.7 → 0.8):
    #   … --bundled-ladder --same-scene-ladder 0.5 0.7 0.8 --no-cost-rows --folder $S/caption_cheap_shallow_same_scene …

One calibration, continued budget by budget as a user would continue it (25, then the same
command at 50, 100, 200, 400: the progress file keeps what was measured), read after each: what
a run stopped by each budget certifies, for the cost of the largest alone. The recipe is the
deeper recipe's (probe 0.05, M filled on its tokens and widened by a tile, the 4-call region
finish for edits, the 4-call guided finish for same-scene), N = 20, and reuses are labelled as
bench/calibrate.py labels them (PSNR of the frames below 30 dB, or the checker disagreeing with
the request's scene where its full computation agrees).

- **Pairs**: drawn one at a time from the calibration workload's generators (tinyworld.world
  make_pair kinds, edit chains of 2–3 edits and session chains of 1–8), a paraphrase pair
  (`compatible_far`) with probability --paraphrase-share, else another kind in the workload's
  proportions; seeds 9,100,000 + i, disjoint from every workload's.
- **The transferred ranking**: the bundled calibration's weights and share cells, with the
  thresholds its ranking certifies on the full calibration's *fit* part (joint, as the bundled
  one): the ladder never saw a held-out label.
- **The check**: each budget's calibration decides every held-out pair of the full calibration
  (split as fit.fit_and_certify splits it) from its measured depths and finishes: false
  accepts with their Clopper–Pearson 95% upper bound, accept rate, the model steps of its hits
  (probe + fill of M + finish, fit._cost) and the share of the full calibration's saved steps it
  keeps on the same pairs. A replay on measured pairs, not a workload served. The full
  calibration's own numbers are in-sample for its thresholds (certified on those pairs).

Writes bench/results/cheap_calibration.json (the measurements and calibration in
bench/results/cheap_calibration/, each budget's calibration file in its at_<budget>/) and rows
of bench/results/calibration_cost.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import random
import sys
import time

from study_paths import REPO  # noqa: E402 - the repository, tests/ and bench/ on the path
if os.path.join(REPO, "scripts") not in sys.path:
    sys.path.append(os.path.join(REPO, "scripts"))

from carnator_core.calibration import cheap  # noqa: E402
from carnator_core.calibration import fit as CAL  # noqa: E402
from carnator_core.calibration.meter import CostLedger, PairCost  # noqa: E402
from carnator_core.calibration.risk_control import clopper_pearson_upper  # noqa: E402

RESULTS = os.path.join(REPO, "bench", "results")
OUT = os.path.join(RESULTS, "cheap_calibration.json")
FOLDER = os.path.join(RESULTS, "cheap_calibration")
FULL = os.path.join(RESULTS, "studies", "lang2_region4_calibration")
BUNDLED = os.path.join(REPO, "models", "calibration", "0706ef2962b7d36f497afe0f24c29ec0.probe0.05.json")
BUDGETS = (25, 50, 100, 200, 250, 400)
ALPHAS = (0.02, 0.05, 0.1, 0.2)  # 0.2: what the smaller budgets certify
SEED = 9_100_000
# the calibration workload's pairs other than paraphrases, by kind (scripts/make_workloads.py)
OTHER_KINDS = {"edit_chain": 240, "session_chain": 320, "partial": 120, "incompatible_close": 120,
               "unrelated": 120}
STEPS, PROBE, PSNR_BOUND = 20, 0.05, 30.0


def tinyworld_pairs(n: int, paraphrase_share: float, seed: int = 4545, lead: int = 0) -> list[dict]:
    """Pairs drawn independently, the first ``lead`` paraphrases (cheap.pool's order), each with
    its two scenes (the checker's truth)."""
    import make_workloads as MW
    from tinyworld import world as WD
    rng = random.Random(seed)
    kinds, weights = list(OTHER_KINDS), list(OTHER_KINDS.values())
    out = []
    for i in range(n):
        kind = "compatible_far" if i < lead or rng.random() < paraphrase_share else rng.choices(kinds, weights)[0]
        draw = rng.randrange(10 ** 9)
        if kind in ("edit_chain", "session_chain"):
            lengths, weight = ((2, 3), 1) if kind == "edit_chain" else (tuple(range(1, 9)), 2)
            lines = MW.edit_chains(1, seed=draw, first_group=i, lengths=lengths, object_change_weight=weight,
                                   kind_name=kind)
            (a, sa), (b, sb) = ((ln["prompt"], ln["scene"]) for ln in lines)
        else:
            pair = WD.make_pair(kind, draw)
            (sa, a), (sb, b) = pair["a"], pair["b"]
            sa, sb = MW.scene_field(sa), MW.scene_field(sb)
        out.append({"a": a, "b": b, "scene_a": sa, "scene_b": sb, "kind": kind, "group": i})
    return out


def workload_seeds() -> set[int]:
    seeds = set()
    for path in glob.glob(os.path.join(REPO, "bench", "workloads", "*.jsonl")):
        with open(path) as f:
            seeds |= {int(json.loads(x)["seed"]) for x in f if x.strip()}
    return seeds


def full_calibration() -> tuple[list[dict], list[dict]]:
    """The full checker-based calibration's measured pairs, split as fit.fit_and_certify splits them."""
    files = sorted(glob.glob(os.path.join(FULL, "calibration_measurements.*.jsonl")))
    instances = [i for path in files for i in CAL.load_instances(path)]
    return CAL.split(instances, CAL.CERTIFY_SHARE)


def transferred_model(train: list[dict], as_bundled: bool = False):
    """The bundled ranking with thresholds certified on the full calibration's fit part; with
    ``as_bundled`` the bundled calibration itself, as Carnator Calibrate transfers it."""
    from carnator_core.gate import RiskModel
    bundled = RiskModel.load(BUNDLED)
    if as_bundled:
        return bundled, bundled
    model = dataclasses.replace(bundled)
    CAL.certify_model(model, train, joint=True, max_region_fraction=0.5)
    model.source = ("the bundled tiny-world ranking (signed form, fitted on the full calibration's fit part), "
                    "thresholds certified on that part")
    return bundled, model


def with_same_scene_ladder(model, points: list[float]):
    """``model`` with its same-scene thresholds replaced so that ``cheap.ladder_of`` reads
    ``points`` as the same-scene ladder: the budgets up to 10% start at the first point (a
    riskier model than the one the ranking came from may only hold a shallower depth), 20% at
    the second, the looser budgets at the last."""
    points = sorted(float(p) for p in points)
    table = {}
    for a in cheap.CHEAP_BUDGETS:
        table[f"{a:g}"] = points[0] if a <= 0.1 else points[min(1, len(points) - 1)] if a <= 0.2 else points[-1]
    thresholds = {k: (dict(table) if cheap.class_of_option(k) == "same_scene" else v)
                  for k, v in model.thresholds.items()}
    out = dataclasses.replace(model, thresholds=thresholds)
    out.source = model.source + f"; same-scene ladder {points}"
    return out


def hit_steps(d: dict, probe_steps: int) -> float:
    """Model steps of a hit: the probe, the fill of M, and the finish after k (fit._cost)."""
    return probe_steps + float(d.get("fill_steps") or 0.0) + CAL._cost(d)


def replay(model, held: list[dict], alpha: float, probe_steps: int = 1) -> dict:
    """The gate's decisions at α on the held-out pairs, as fit.evaluate makes them, with steps."""
    picks = [CAL.gate_decision(model, i, alpha, 0.5) for i in held]
    hits = [d for d in picks if d is not None]
    bad = sum(int(d["label"]) for d in hits)
    steps = sum(hit_steps(d, probe_steps) for d in hits)
    total = steps + STEPS * (len(held) - len(hits))
    return {"alpha": alpha, "pairs": len(held), "accepted": len(hits), "accept_rate": len(hits) / len(held),
            "false_accepts": bad, "false_accept_rate": bad / len(hits) if hits else 0.0,
            "fa_upper95": clopper_pearson_upper(bad, len(hits), 0.05) if hits else None,
            "gate_hit_speedup": STEPS * len(hits) / steps if hits else None,
            "heldout_speedup": STEPS * len(held) / total, "saved_steps": STEPS * len(held) - total}


def prefix(rows: list[dict], budget: float) -> list[dict]:
    """The pairs a run stopped by this budget measured: pairs start while less than it is spent
    (the calibration was continued budget by budget, so each stop is one of these)."""
    out, spent = [], 0.0
    for row in rows:
        if spent >= budget:
            break
        out.append(row)
        spent += PairCost.of(row, row["instances"], STEPS).generations
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", type=float, nargs="+", default=list(BUDGETS))
    ap.add_argument("--paraphrase-share", type=float, default=cheap.PARAPHRASE_SHARE)
    ap.add_argument("--lead", type=int, default=None,
                    help="paraphrase pairs the pool opens with (default: cheap.paraphrase_lead(); 0: none)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-cost-rows", action="store_true", help="leave bench/results/calibration_cost.json alone")
    ap.add_argument("--bundled-ladder", action="store_true",
                    help="transfer the bundled calibration as it is (its thresholds the ladder), as Carnator "
                         "Calibrate does; only with --heldout of another model, whose labels it never saw")
    ap.add_argument("--folder", default=FOLDER, help="where the measurements and the calibration go")
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--model", default=None, help="calibrate this model (default: the bundled tiny world)")
    ap.add_argument("--easycache", type=float, default=None, metavar="THRESHOLD",
                    help="calibrate the model with ComfyUI's EasyCache at this threshold (its own fingerprint)")
    ap.add_argument("--size", default=None, metavar="FRAMESxPIXELS",
                    help="at this size (the multi-size model's; bench/studies/proxy_size.py)")
    ap.add_argument("--heldout", nargs="+", default=None, metavar="JSONL",
                    help="replay on these measurement files (e.g. pairs measured at the served size) "
                         "instead of the full calibration's held-out part")
    ap.add_argument("--heldout-is-full", action="store_true",
                    help="the --heldout files are the --full calibration's own measurements: its cost is "
                         "counted from them (another model's full calibration)")
    ap.add_argument("--full", default=None, metavar="JSON",
                    help="with --heldout: the calibration whose saved steps the kept share is counted "
                         "against (default: the bundled one)")
    ap.add_argument("--same-scene-ladder", type=float, nargs="+", default=None, metavar="DEPTH",
                    help="test these same-scene depth shares instead of the transferred ones: α = 5%% and "
                         "10%% walk them from the first (α = 20%% from the second, looser budgets from the "
                         "last). A guided finish computes the same calls from any of them")
    a = ap.parse_args(argv)
    if a.bundled_ladder and not a.heldout_is_full:
        raise SystemExit("--bundled-ladder: the bundled thresholds were certified on this model's held-out "
                         "pairs; give another model's full calibration (--heldout … --heldout-is-full)")
    t_start = time.time()
    from calibrate import _load_bench
    bench = _load_bench()
    from carnator_core.gate import GateSettings
    from carnator_core.pipeline import ReuseSettings
    world = bench.World(a.model or bench.DEFAULT_MODEL, steps=STEPS, cfg=4.0, threads=a.threads, size=a.size)
    if a.easycache is not None:  # every computation, the full ones included, with EasyCache
        world = bench.eased(world, a.easycache)
    fp = world.fingerprint
    settings = ReuseSettings(probe_fraction=PROBE, gate=GateSettings(), region_fill_on_m=True, region_margin=1,
                             other_finish_calls=4, other_finish_region=True)
    train, held = full_calibration()
    bundled, transferred = transferred_model(train, a.bundled_ladder)
    if a.same_scene_ladder:
        transferred = with_same_scene_ladder(transferred, a.same_scene_ladder)
    reference = bundled
    if a.heldout:  # checked elsewhere (another size), against another full calibration
        from carnator_core.gate import RiskModel
        held = [i for path in a.heldout for i in CAL.load_instances(path)]
        reference = RiskModel.load(a.full) if a.full else bundled
    top = max(a.budgets)
    lead = cheap.paraphrase_lead() if a.lead is None else a.lead
    pairs = tinyworld_pairs(cheap.pairs_for_budget(top), a.paraphrase_share, lead=lead)
    used = workload_seeds() & {SEED + p["group"] for p in pairs}
    assert not used, f"pair seeds {sorted(used)[:5]} are a workload's"

    def judge(pair, side, full):
        reference = world.video(full.final)
        scene = pair[f"scene_{side}"]
        ok_reference = bench.check_ok(reference, scene)

        def outcome(final):
            video = world.video(final)
            q, ok = bench.psnr(video, reference), bench.check_ok(video, scene)
            return {"psnr": q, "ok": ok, "ok_reference": ok_reference,
                    "label": CAL.exceeds_tolerance(q, ok_reference, ok, PSNR_BOUND)}
        return outcome

    make_run = lambda prompt, seed: world.new_run(prompt, seed, "same_seed")  # noqa: E731
    path = CAL.calibration_path(a.folder, fp, PROBE)
    ladder = cheap.ladder_of(transferred)
    for budget in sorted(a.budgets):  # one calibration continued budget by budget, as a user would
        rows = cheap.measure(pairs, make_run, settings, transferred, cheap.cheap_progress_path(path), STEPS, SEED,
                             judge, meter=world.meter, ledger=CostLedger(budget_generations=budget))
    full = {f"{al:g}": replay(reference, held, al) for al in ALPHAS}
    out = {"model_fingerprint": fp, "model": os.path.relpath(a.model, REPO) if a.model else None,
           "easycache": a.easycache, "size": world.size, "steps": STEPS,
           "heldout_files": [os.path.relpath(p, REPO) for p in a.heldout or []],
           "full_reference": os.path.relpath(a.full, REPO) if a.full else None, "probe_fraction": PROBE, "psnr_bound": PSNR_BOUND,
           "paraphrase_share": a.paraphrase_share, "paraphrase_lead": lead, "heldout_pairs": len(held) // 2, "heldout_directions": len(held),
           "transferred": {"ladder": ladder.points, "source": transferred.source,
                           "bundled_thresholds": {k: v for k, v in bundled.thresholds.items() if ":" not in k}},
           "full_calibration": {**_full_cost(fp, a.heldout if a.heldout_is_full else None), "heldout": full},
           "budgets": {}}
    for budget in sorted(a.budgets):
        part = prefix(rows, budget)
        model, rep = cheap.fit_rows(part, transferred, settings, STEPS, lead=lead,
                                    tolerance={"psnr_bound": PSNR_BOUND, "space": "frames", "checker": True})
        spent = sum(PairCost.of(r, r["instances"], STEPS).generations for r in part)
        seconds = sum(float((r.get("cost") or {}).get("seconds") or 0.0) for r in part)
        checks = {}
        for al in ALPHAS:
            got = replay(model, held, al)
            got["speedup_kept"] = (got["saved_steps"] / full[f"{al:g}"]["saved_steps"]
                                   if full[f"{al:g}"]["saved_steps"] else None)
            checks[f"{al:g}"] = got
        if any(rep["certified"].values()):  # each budget's file (bench/studies/cheap_served.py serves them)
            at = os.path.relpath(str(CAL.save(model, os.path.join(a.folder, f"at_{budget:g}"), fp)), REPO)
            if budget == top:  # the largest budget's file, also where the gate loads it
                out["saved"] = os.path.relpath(str(CAL.save(model, a.folder, fp)), REPO)
        else:
            at = None
        out["budgets"][f"{budget:g}"] = {
            "cost_generations": round(spent, 2), "pairs": len(part), "calibration_file": at,
            "measured_reuses": rep["measured_reuses"],
            "exceeded_tolerance": rep["exceeded_tolerance"], "measuring_seconds": round(seconds, 1),
            "certified": rep["certified"], "thresholds": {k: v for k, v in model.thresholds.items() if ":" not in k},
            "cells": rep["cells"], "heldout": checks,
            "report_text": cheap.report_text({**rep, "model_fingerprint": fp,
                                              "cost": _ledger(part).as_dict(), "seconds": seconds})}
    out["least_cost_certifying"] = least_cost(prefix(rows, top), transferred, settings)
    out["seconds"] = round(time.time() - t_start, 1)
    out["plots"] = plot(out, os.path.splitext(a.out)[0])
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    if not a.no_cost_rows:
        _cost_rows(out)
    _table(out)
    print(f"wrote {os.path.relpath(a.out, REPO)}")
    return out


def least_cost(rows: list[dict], transferred, settings) -> dict[str, dict[str, float]]:
    """Per cell and budget α the generation-equivalents spent when the pairs measured so far
    first certified it (read after every pair, as the anytime-valid test may be)."""
    out: dict[str, dict[str, float]] = {}
    spent = 0.0
    for n, row in enumerate(rows, 1):
        spent += PairCost.of(row, row["instances"], STEPS).generations
        for cell, budgets in cheap.fit_rows(rows[:n], transferred, settings, STEPS)[1]["certified"].items():
            for al in budgets:
                out.setdefault(cell, {}).setdefault(al, round(spent, 1))
    return out


def plot(out: dict, stem: str) -> list[str]:
    """The curve against the cost in generation-equivalents, per α: the share of the full
    calibration's saved steps kept on the held-out directions (the full one: 100% at its
    cost, off the axis), and the share of accepted reuses beyond tolerance."""
    from calibrate import _load_bench
    budgets = sorted(out["budgets"].values(), key=lambda b: b["cost_generations"])
    paths = []
    for name, field, label in (("", "speedup_kept", "share of the full calibration's saved steps kept"),
                               ("_false_accepts", "false_accept_rate", "accepted reuses beyond tolerance")):
        series = [(f"alpha {al}", [(b["cost_generations"], b["heldout"][al][field] or 0.0) for b in budgets])
                  for al in ("0.05", "0.1", "0.2")]
        full = out["full_calibration"].get("cost_generations")
        xlabel = "generation-equivalents" + (f" (full calibration: {full:,.0f})" if full else "")
        path = f"{stem}{name}.png"
        _load_bench()._pil_plot(series, xlabel, label, path, legend="top left")
        paths.append(os.path.relpath(path, REPO))
    return paths


def _ledger(rows: list[dict]) -> CostLedger:
    ledger = CostLedger(pairs_planned=len(rows))
    ledger.measured = [PairCost.of(r, r["instances"], STEPS) for r in rows]
    return ledger


def _full_cost(fingerprint: str, measurements: list[str] | None = None) -> dict:
    """The bundled full calibration's cost row (bench/studies/calibration_cost.py), for the
    bundled model; for another, its full calibration's ``measurements`` files
    (--heldout-is-full), costed as calibration_cost.py costs the bundled ones."""
    from calibration_cost import _pairs_of_measurements, bundled_cost, cost_row
    if not os.path.basename(BUNDLED).startswith(fingerprint):
        if not measurements:
            return {"cost_generations": None}
        row = cost_row(_pairs_of_measurements(measurements), STEPS, note="", source=[], procedure="full_checker")
        return {**{k: row[k] for k in ("cost_generations", "pairs", "measured_reuses", "generations_per_pair")},
                "workload": "the --heldout files, by the meter's rule"}
    row = bundled_cost(fingerprint, STEPS)
    return {k: row[k] for k in ("cost_generations", "pairs", "measured_reuses", "generations_per_pair", "workload")}


def _cost_rows(out: dict) -> None:
    from calibration_cost import merge
    note = ("a replay on the full checker-based calibration's held-out measured pairs (split as "
            "fit.fit_and_certify splits them): each calibration's gate decisions from their measured "
            "depths and finishes, not a workload run; speedup_kept: the share of the full calibration's "
            "saved model steps (probe + fill + finish per hit, the rest in full) kept on those pairs")
    if out["heldout_files"]:  # another model's (or size's) full calibration, all of its pairs
        note = (f"a replay on the measured pairs of {', '.join(out['heldout_files'])} (every pair; the full "
                f"calibration {out['full_reference']} was certified on part of them): each calibration's gate "
                "decisions from their measured depths and finishes, not a workload run; speedup_kept: the "
                "share of that full calibration's saved model steps kept on those pairs")
    rows = []
    for al, v in out["full_calibration"]["heldout"].items():
        rows.append({"model": out["model_fingerprint"], "procedure": "full_checker", "workload": "calibration_heldout",
                     "alpha": float(al), "steps": STEPS, "budget_generations": None,
                     **{k: out["full_calibration"].get(k) for k in ("cost_generations", "pairs", "measured_reuses",
                                                                 "generations_per_pair")},
                     "false_accept_rate": v["false_accept_rate"], "fa_upper95": v["fa_upper95"],
                     "accept_rate": v["accept_rate"], "gate_hit_speedup": v["gate_hit_speedup"],
                     "speedup_kept": 1.0, "note": note + "; the full calibration's thresholds were certified on "
                                                          "(part of) these same pairs (in-sample)"})
    for budget, b in out["budgets"].items():
        for al, v in b["heldout"].items():
            rows.append({"model": out["model_fingerprint"], "procedure": "cheap", "workload": "calibration_heldout",
                         "alpha": float(al), "steps": STEPS, "budget_generations": float(budget),
                         "cost_generations": b["cost_generations"], "pairs": b["pairs"],
                         "measured_reuses": b["measured_reuses"],
                         "generations_per_pair": round(b["cost_generations"] / max(1, b["pairs"]), 2),
                         "false_accept_rate": v["false_accept_rate"], "fa_upper95": v["fa_upper95"],
                         "accept_rate": v["accept_rate"], "gate_hit_speedup": v["gate_hit_speedup"],
                         "speedup_kept": v["speedup_kept"], "certified": b["certified"],
                         "measuring_seconds": b["measuring_seconds"], "note": note})
    merge(rows)


def _table(out: dict) -> None:
    print(f"{'budget':>6} {'spent':>6} {'pairs':>5}  {'α':>4} {'accept':>7} {'FA':>6} {'FA up95':>8} "
          f"{'hit×':>5} {'kept':>5}  certified")
    full = out["full_calibration"]["heldout"]
    for al, v in full.items():
        print(f"{'full':>6} {out['full_calibration']['cost_generations'] or 0:6.0f} {640:5d}  {al:>4} "
              f"{v['accept_rate']:7.1%} {v['false_accept_rate']:6.1%} {v['fa_upper95']:8.1%} "
              f"{v['gate_hit_speedup'] or 0:5.2f} {1.0:5.0%}")
    for budget, b in out["budgets"].items():
        cert = "; ".join(f"{c}: {','.join(v)}" for c, v in b["certified"].items() if v) or "nothing"
        for i, (al, v) in enumerate(b["heldout"].items()):
            print(f"{budget:>6} {b['cost_generations']:6.0f} {b['pairs']:5d}  {al:>4} {v['accept_rate']:7.1%} "
                  f"{v['false_accept_rate']:6.1%} {_pct(v['fa_upper95']):>8} {v['gate_hit_speedup'] or 0:5.2f} "
                  f"{v['speedup_kept'] or 0:5.0%}  {cert if i == 0 else ''}")


def _pct(v) -> str:
    return "—" if v is None else f"{v:.1%}"


if __name__ == "__main__":
    main()
