"""Can edits be finished like paraphrases if region M is computed and the rest guided?

    nice .venv/bin/python bench/studies/region_finish_study.py   # bench/results/studies/region_finish.json

Hits with *other* evidence (edits, other scenes on the same noise) finish every step after
k* today: the guided finish (``carnator_core/reuse/guided_finish.py``) loses them, because the
changed object has to be drawn, and it is the object, inside region M, that the candidate's
trajectory cannot guide. This study asks what a finish that splits the frame would keep:
outside M the request follows the candidate's stored x̂0 plus its last measured offset (the
guided finish), inside M it follows its own model prediction. It runs on pairs of the
calibration workload through the hit path the calibration measures
(``self_calibration.measure_direction``: the gate's evidence and region M at the probe,
M filled by two coarse steps), and finishes each reuse at k = 4…14 of 20 in these ways:

- ``every_step``: every step after k computed (today's finish for these hits);
- ``guided_C``: today's same-scene guided finish with C calls, the whole frame guided;
- ``region_C``: C full calls (the guided finish's steps); at the steps between, M's cells
  take the request's own model prediction and the rest the guided one. The model is run on
  the whole frame here and only M's share of its output is kept, so this is the *best case*
  of computing M's tokens alone: a token-sparse step would attend to the outside's keys and
  values from the last full call instead of fresh ones. Its cost is counted as
  C + (steps between) × (M's share of the latent cells), in model-call equivalents;
- ``region_hold_C``: the same C calls, M holding the request's own last computed x̂0 between
  them (nothing computed between calls; cost C);
- ``tokens_C``: the real thing (``carnator_core/reuse/region_compute.py``): between the C full
  calls the model computes M's tokens alone, attending to the outside's keys and values
  kept from the last full call; cost C + (steps between) × (M's share of the tokens).

PSNR of the decoded frames against the request's own full computation, the share within
30 dB (the tolerance's PSNR part), and the hit's whole cost (probe + fill + finish) as a
steps speedup. Same-scene pairs are left out: the guided finish already serves them.

Then the calibration's verdict on the finish this study points to (6 calls), on all 1,280
calibration directions with the whole tolerance (PSNR and the checker):

    nice .venv/bin/python bench/calibrate.py --other-finish-calls 6 --shard 0/2 \
        --add-guided-finish bench/results/studies/caption_model/calibration_measurements.*-of-2.jsonl --results out/cal_other
    (the same with --shard 1/2; the guided reuses alone: bench/results/studies/other_guided_finish.jsonl)
    .venv/bin/python bench/studies/region_finish_study.py --calibration-labels \
        bench/results/studies/other_guided_finish.jsonl     # → studies/other_guided_finish.json

failure rates by pair kind and depth, both finishes, and what Learn-then-Test certifies for
the guided finish when the calibration includes it (the committed calibration does not).
The same for the finish that computes M's tokens between 5 calls: ``--other-finish-calls 5
--other-finish-region`` above, its reuses in ``studies/other_region_finish.jsonl``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from study_paths import REPO  # noqa: E402 - sys.path for the repository, tests/ and bench/

from carnator_core.reuse.region_compute import RegionFinish  # noqa: E402

RESULTS = os.path.join(REPO, "bench", "results")
KINDS = {"partial": 10, "incompatible_close": 10, "edit_chain": 10, "session_chain": 10, "unrelated": 10}
DEPTHS = (4, 6, 8, 10, 12, 14)
CALLS = (4, 5, 6)


def other_evidence_pairs(bench, world, settings, scale: float = 1.0):
    """(group, kind, request line, request, candidate, region M tiles) for KINDS' count of
    calibration pairs per kind (× ``scale``) whose probes give *other* evidence and a region
    the gate allows: the later request of each pair reuses the earlier, both computed in full
    with their trajectories recorded."""
    from calibrate import group_of
    from carnator_core.calibration.fit import RiskModel
    from carnator_core.calibration.generic import evidence, evidence_class
    n, p = world.steps, settings.probe_steps(world.steps)
    snaps = settings.snapshot_steps(n)
    _, lines = bench.load_workload("calibration")
    groups: dict = {}
    for ln in lines:
        groups.setdefault(group_of(ln), []).append(ln)
    want = {k: max(1, round(v * scale)) for k, v in KINDS.items()}
    for g, members in sorted(groups.items(), key=lambda kv: str(kv[0])):
        kind = members[0].get("kind")
        if want.get(kind, 0) <= 0 or len(members) < 2:
            continue
        full = [world.full(ln["prompt"], int(ln["seed"]), ln.get("seed_policy", "same_seed"), snaps, p)
                for ln in members[:2]]
        req, cand = full[1], full[0]  # the later request reuses the earlier
        new_sig, old_sig = req["record"].signature(p - 1), cand["record"].signature(p - 1)
        feats, region = evidence(new_sig, old_sig, new_sig.similarity(old_sig), RiskModel().region_threshold)
        if evidence_class(feats) == "same_scene" or feats["region_fraction"] > settings.gate.max_region_fraction:
            continue  # the guided finish serves the first; the gate rejects the second
        want[kind] -= 1
        yield g, kind, members[1], req, cand, region
        if not any(v > 0 for v in want.values()):
            return


class RegionGuided(RegionFinish):
    """The region finish's best case and a cheaper cousin, for the study. ``hold=False``: the
    model runs on the whole frame between the calls and only M's share of its output is kept
    (fresh keys and values outside M). ``hold=True``: M holds the request's own x̂0 of the last
    full call (nothing computed between the calls). No region of tokens is set on the run,
    so the adapter computes every token."""

    def __init__(self, guided, mask, hold: bool):
        super().__init__(guided, mask)
        self.hold, self.own_last = hold, None

    def predict(self, step):
        if not (self.hold and self.own_last is not None and self.region_step(step)):
            return None  # compute
        outside = self.guided.predict(step)
        return torch.lerp(outside, self.own_last.to(outside.device), self.mask.to(outside.device))

    def observe(self, step, x0):
        if not self.region_step(step):
            self.own_last = x0.detach().clone()
        super().observe(step, x0)


def calibration_verdict(guided_file: str, out: str) -> dict:
    """Failure rates of other-evidence reuses by kind and depth, finished every step (the
    committed calibration's measurements) and by the guided finish (``guided_file``), and the
    thresholds Learn-then-Test certifies when the calibration holds both."""
    from carnator_core.calibration import fit as CAL
    from carnator_core.gate import RiskModel, evidence_class
    paths = [os.path.join(RESULTS, "studies", "caption_model", f"calibration_measurements.{i}-of-2.jsonl")
             for i in (0, 1)]
    instances = [i for p in paths for i in CAL.load_instances(p)]
    guided = {(str(g["group"]), g["prompt"], g["candidate_prompt"]): g["depths"]
              for g in CAL.load_instances(guided_file)}
    rates: dict = {}
    for inst in instances:
        if evidence_class(inst["features"]) != "other":
            continue
        inst["depths"] = inst["depths"] + guided.get((str(inst["group"]), inst["prompt"], inst["candidate_prompt"]), [])
        for d in inst["depths"]:
            for kind in (inst["kind"], "all"):
                r = rates.setdefault(kind, {}).setdefault(str(d["k"]), {}).setdefault(
                    "guided" if d.get("finish_calls") else "every_step", {"reuses": 0, "beyond": 0, "psnr_below": 0})
                r["reuses"] += 1
                r["beyond"] += int(d["label"])
                r["psnr_below"] += int(d["psnr"] < 30.0)
    for by_k in rates.values():
        for by_f in by_k.values():
            for r in by_f.values():
                r["rate"] = round(r["beyond"] / r["reuses"], 4)
    model, report = CAL.fit_and_certify(instances, RiskModel().region_threshold)
    cert = {key: {a: {k: v for k, v in b.items() if k in ("threshold", "accepted", "failures", "upper_bound")}
                  for a, b in c["budgets"].items()}
            for key, c in report["certification"]["classes"].items() if key.startswith("other")}
    res = {"guided_calls": sorted({d["finish_calls"] for ds in guided.values() for d in ds}),
           "failure_rates": rates, "certified_with_both": cert, "finish_calls": model.finish_calls}
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    for k, v in rates["all"].items():
        print(f"k={k:>2}: every step {v['every_step']['rate']:.1%}, guided {v.get('guided', {}).get('rate', float('nan')):.1%}")
    for key, c in cert.items():
        print(key, {a: b["threshold"] for a, b in c.items()})
    return res


def pair_study_parser(description: str, out_name: str, sharded: bool = False) -> argparse.ArgumentParser:
    """The options every study on ``other_evidence_pairs`` takes (``sharded``: run in parts
    and merge them, see ``merged_shards``)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--psnr-bound", type=float, default=30.0)
    ap.add_argument("--scale", type=float, default=1.0, help="share of the pairs per kind (smoke runs)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "studies", out_name))
    if sharded:
        ap.add_argument("--shard", default="0/1", metavar="I/N", help="only pairs i, i+N, … (run N in parallel)")
        ap.add_argument("--merge", nargs="+", default=None, metavar="JSON", help="summarise shards' files into --out")
    return ap


def merged_shards(paths: list[str], summarise) -> dict:
    """The shards' result files as one: their pairs together, ``summarise(pairs, first part)``
    again, their seconds added."""
    parts = [json.load(open(f)) for f in paths]
    rows = [r for part in parts for r in part["pairs"]]
    return {**parts[0], "pairs": rows, "summary": summarise(rows, parts[0]), "merged": paths,
            "seconds": sum(part["seconds"] for part in parts)}


def main(argv=None) -> dict:
    ap = pair_study_parser(__doc__.splitlines()[0], "region_finish.json")
    ap.add_argument("--variants", nargs="+", default=None,
                    help="only these finishes (every_step, guided, region, region_hold, tokens)")
    ap.add_argument("--calls", nargs="+", type=int, default=list(CALLS))
    ap.add_argument("--calibration-labels", default=None, metavar="JSONL",
                    help="summarise the calibration's guided-finish measurements instead (see above)")
    a = ap.parse_args(argv)
    if a.calibration_labels:
        return calibration_verdict(a.calibration_labels, a.calibration_labels.replace(".jsonl", ".json"))
    from calibrate import _load_bench
    bench = _load_bench()
    from carnator_core.reuse.guided_finish import GuidedFinish
    from carnator_core.pipeline import ReuseSettings, fill_region
    from carnator_core.signature import tiles_to_latent_mask
    settings = ReuseSettings()
    world = bench.World(bench.DEFAULT_MODEL, steps=a.steps)

    def want_variant(name):
        return a.variants is None or name in a.variants
    n, p = world.steps, settings.probe_steps(a.steps)
    rows, t0 = [], time.time()
    for g, kind, line, req, cand, region in other_evidence_pairs(bench, world, settings, a.scale):
        run0 = world.new_run(line["prompt"], int(line["seed"]), line.get("seed_policy", "same_seed"))
        mask = tiles_to_latent_mask(region, req["record"].grid, run0.latent_shape).float()
        share = float(mask.mean())
        token_share = run0.compute_region(mask).share if want_variant("tokens") and bool(region.any()) else share
        run0.compute_region(None)
        stored_x0 = {s: x.float() for s, x in cand["record"].denoised.items()}
        row = {"group": str(g), "kind": kind, "region_share": round(share, 3),
               "token_share": round(token_share, 3), "depths": {}}
        for k in DEPTHS:
            out = {}

            def finish(name, make_guide, cost_of):
                run = world.new_run(line["prompt"], int(line["seed"]), line.get("seed_policy", "same_seed"))
                x_k = cand["record"].snapshots[k].float()
                if bool(region.any()):
                    got = fill_region(run, x_k, region, req["record"].grid, req["x0_probe"],
                                      req["x_probe"], p, k, settings.region_fill_calls)
                    start, fill = got.latent, got.steps
                else:
                    start, fill = run.boundary_from_sampler_space(x_k, k), 0
                guide = make_guide(run)
                v = world.video(run.sample(k, n, start, guide=guide))
                q = bench.psnr(v, req["video"])
                cost = p + fill + cost_of(guide)
                out[name] = {"psnr": round(q, 2), "ok": q >= a.psnr_bound, "cost": round(cost, 2),
                             "speedup": round(n / cost, 3)}

            def tokens(run, c):
                guided = GuidedFinish(run.sigmas, stored_x0, k, c)
                if not bool(region.any()):
                    return guided  # an empty M: the guided finish itself
                run.compute_region(mask)
                return RegionFinish(guided, mask)

            if want_variant("every_step"):
                finish("every_step", lambda run: None, lambda gd: n - k)
            for c in a.calls:
                if want_variant("guided"):
                    finish(f"guided_{c}", lambda run, c=c: GuidedFinish(run.sigmas, stored_x0, k, c),
                           lambda gd: n - k - gd.predicted)
                if want_variant("region"):
                    finish(f"region_{c}", lambda run, c=c: RegionGuided(GuidedFinish(run.sigmas, stored_x0, k, c), mask, False),
                           lambda gd: len(gd.guided.compute) + gd.region_steps * share)
                if want_variant("region_hold"):
                    finish(f"region_hold_{c}", lambda run, c=c: RegionGuided(GuidedFinish(run.sigmas, stored_x0, k, c), mask, True),
                           lambda gd: len(gd.guided.compute))
                if want_variant("tokens"):
                    finish(f"tokens_{c}", lambda run, c=c: tokens(run, c),
                           lambda gd: len(gd.compute) + getattr(gd, "region_steps", 0) * token_share)
            row["depths"][str(k)] = out
        rows.append(row)
        print(f"{len(rows)} pairs ({kind}, M {share:.0%}), {time.time() - t0:.0f} s", flush=True)
    summary: dict = {}
    for kind in list(KINDS) + ["all"]:
        mine = [r for r in rows if kind in (r["kind"], "all")]
        if not mine:
            continue
        summary[kind] = {"pairs": len(mine),
                         "mean_region_share": round(sum(r["region_share"] for r in mine) / len(mine), 3)}
        for k in DEPTHS:
            for name in mine[0]["depths"][str(k)]:
                got = [r["depths"][str(k)][name] for r in mine]
                summary[kind].setdefault(str(k), {})[name] = {
                    "within": sum(x["ok"] for x in got), "pairs": len(got),
                    "mean_psnr": round(sum(min(x["psnr"], 60.0) for x in got) / len(got), 2),
                    "mean_speedup": round(len(got) / sum(1 / x["speedup"] for x in got), 3)}
    res = {"steps": n, "probe_steps": p, "psnr_bound": a.psnr_bound, "calls": a.calls, "depths": DEPTHS,
           "fill_calls": settings.region_fill_calls, "summary": summary, "pairs": rows,
           "seconds": round(time.time() - t0, 1)}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    for kind, by_k in summary.items():
        print(f"{kind}: {by_k['pairs']} pairs, M {by_k['mean_region_share']:.0%} of the cells")
        for k in DEPTHS:
            v = by_k[str(k)]
            print(f"  k={k:>2} " + " | ".join(f"{m} {x['within']}/{x['pairs']} {x['mean_psnr']:.1f}dB "
                                            f"{x['mean_speedup']:.2f}x" for m, x in v.items()))
    return res


if __name__ == "__main__":
    main()
