"""Calibrate the gate's risk model on the tiny world (DESIGN.md §2.4).

    nice -n 10 .venv/bin/python bench/calibrate.py                 # bench/workloads/calibration.jsonl
    .venv/bin/python bench/calibrate.py --limit-pairs 20 --cache /tmp/c   # a quick one

For each pair of requests in the calibration workload (same seed, lines grouped by
``group``) and in both directions (request ← candidate), it computes both requests in full,
takes the gate's evidence for the request against the candidate at the probe step exactly as
``carnator_core.gate.evidence`` does in the pipeline (same signatures, same region threshold),
then *actually reuses* the candidate at every stored depth k the gate may choose — the
candidate's x_k outside the region M, the request's own re-noised probe x̂0 inside it, as
``resume.start_from_candidate`` does — and finishes the request. The reuse is labelled
"exceeds tolerance" when its PSNR against the request's own full computation is below
--psnr-bound or the checker disagrees with the line's scene where the full computation agrees.

The fitted ``RiskModel`` is saved where the gate loads it, ``<cache>/calibration/<model
fingerprint>.json`` (``--cache``, default ComfyUI's Carnator cache folder), with a copy in
models/calibration/ (the bundled one: the nodes install it, the benchmark reads it; with
``--results DIR``, in DIR/calibration/ instead) and a report in
bench/results/calibration_report.json: held-out (by pair) false-accept rate of the gate's
decision rule at α ∈ {0.02, 0.05, 0.10}. Sparse attention is not used in these reuses (the
benchmark's Carnator runs dense by default as well).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (os.path.join(REPO, "tests"), REPO):
    if p not in sys.path:
        sys.path.insert(0, p)

from carnator_core.calibration import fit as CAL  # noqa: E402
from carnator_core.gate import RISK_FORMS  # noqa: E402

RESULTS = os.path.join(REPO, "bench", "results")
BUDGETS = (0.02, 0.05, 0.1)


def group_of(line: dict):
    """The pair a calibration line belongs to (lines without a group pair by seed)."""
    return line.get("group", line["seed"])


def groups_with_evidence(paths: list[str], klass: str) -> set[str]:
    """The pair groups with a direction of this evidence class in these measurement files."""
    from carnator_core.gate import evidence_class
    return {str(i["group"]) for path in paths for i in CAL.load_instances(path)
            if evidence_class(i["features"]) == klass}


def with_same_scene_from(measured: list[dict], base: list[dict]) -> list[dict]:
    """``base``'s instances with their other-evidence directions replaced by ``measured``'s
    (``--other-evidence-of``): a direction of base without its measured twin is an error."""
    from carnator_core.gate import evidence_class
    key = lambda i: (str(i["group"]), i["prompt"], i["candidate_prompt"])  # noqa: E731
    other = {key(i): i for i in measured if evidence_class(i["features"]) == "other"}
    out = []
    for inst in base:
        if evidence_class(inst["features"]) != "other":
            out.append(inst)
        elif key(inst) in other:
            out.append(other.pop(key(inst)))
        else:
            raise SystemExit(f"pair group {inst['group']} ({inst['prompt']!r}) has other evidence but "
                             "was not measured again: measure every shard of --other-evidence-of")
    if other:
        raise SystemExit(f"{len(other)} measured directions are not in the --same-scene-from files")
    return out


def measure_pairs(world, lines: list[dict], settings, psnr_bound: float, region_threshold: float,
                  log=print, finishes=None, ledger=None) -> list[dict]:
    """Instances (see carnator_core.calibration.fit) for every pair, both directions: the
    generic measurement (carnator_core.calibration.generic) labelled with the checker too;
    ``finishes`` as ``measure_direction`` takes it (None: every step and the guided finish).
    Each pair's model work, counted by the world's meter in generation-equivalents (its first
    full run = 1), goes to ``ledger`` (a ``calibration.meter.CostLedger``)."""
    from bench_tw import check_ok, psnr
    from carnator_core.calibration.generic import measure_direction
    from carnator_core.calibration.meter import PairCost
    steps = world.steps
    p = settings.probe_steps(steps)
    snaps = settings.snapshot_steps(steps)
    groups: dict = {}
    for ln in lines:
        groups.setdefault(group_of(ln), []).append(ln)
    instances = []
    if ledger is not None:
        ledger.pairs_planned += sum(len(m) >= 2 for m in groups.values())
    t0 = time.time()
    for gi, (g, members) in enumerate(groups.items()):
        if len(members) < 2:
            continue
        full, unit, rows0, t_pair = [], 0, world.meter.rows, time.time()
        for ln in members[:2]:
            policy = ln.get("seed_policy", "same_seed")
            before = world.meter.rows
            r = world.full(ln["prompt"], int(ln["seed"]), policy, snaps, p)
            unit = unit or world.meter.rows - before
            r["ok"] = check_ok(r["video"], ln["scene"])
            r["policy"] = policy
            full.append(r)
        for (a, la), (b, lb) in (((full[1], members[1]), (full[0], members[0])),
                                 ((full[0], members[0]), (full[1], members[1]))):
            def outcome(final, a=a, la=la) -> dict:  # request a (prompt la) reuses candidate b
                v = world.video(final)
                q, ok = psnr(v, a["video"]), check_ok(v, la["scene"])
                return {"psnr": q, "ok": ok, "ok_reference": a["ok"],
                        "label": CAL.exceeds_tolerance(q, a["ok"], ok, psnr_bound)}
            inst = measure_direction(a["full"], b["full"], lambda a=a, la=la: world.new_run(
                la["prompt"], int(la["seed"]), a["policy"]), settings, region_threshold, outcome, finishes)
            instances.append({"group": g, "kind": la.get("kind"), "prompt": la["prompt"],
                              "candidate_prompt": lb["prompt"], **inst})
        if ledger is not None:
            ledger.measured.append(PairCost((world.meter.rows - rows0) / unit, time.time() - t_pair) if unit
                                   else PairCost.of(None, instances[-2:], steps))
        if (gi + 1) % 10 == 0:
            spent = f", {ledger.spent:.0f} generation-equivalents" if ledger is not None else ""
            log(f"  {gi + 1}/{len(groups)} pairs, {time.time() - t0:.0f} s{spent}", flush=True)
    return instances


def add_guided_finish(world, lines: list[dict], settings, psnr_bound: float, region_threshold: float,
                      measured_files: list[str], klass: str = "other", ledger=None) -> list[dict]:
    """The measured instances of ``measured_files`` for these lines' pairs, with the guided
    finish of ``klass``'s reuses measured and added to their depths. Other evidence: the
    finish of ``settings.other_finish_calls`` is added (pairs measured with a finish already
    keep theirs). Same-scene evidence: the finish of ``settings.same_scene_finish_calls``
    *replaces* the stored one (a class has one guided finish, ``gate.option_key``). The
    evidence is measured again and must equal the stored one (the same model, the same pairs)."""
    from carnator_core.gate import evidence_class
    calls = settings.finish_calls_for(klass)
    if calls <= 0:
        raise SystemExit(f"--add-guided-finish needs a guided finish of {klass} evidence to measure "
                         "(--other-finish-calls N or --same-scene-finish-calls N)")
    stored = {(str(i["group"]), i["prompt"], i["candidate_prompt"]): i
              for path in measured_files for i in CAL.load_instances(path)}
    mine = {str(group_of(ln)) for ln in lines}

    def has_it(i: dict) -> bool:  # measured with this very finish already
        return any(d.get("finish_calls") == calls for d in i["depths"]) if klass == "same_scene" \
            else any(d.get("finish_calls") for d in i["depths"])
    needed = {g for (g, _, _), i in stored.items() if evidence_class(i["features"]) == klass
              and i["depths"] and not has_it(i)}
    todo = [ln for ln in lines if str(group_of(ln)) in needed]
    print(f"adding the {calls}-call guided finish to the {klass} reuses of "
          f"{len({group_of(ln) for ln in todo})} pairs …", flush=True)
    added = measure_pairs(world, todo, settings, psnr_bound, region_threshold,
                          finishes=lambda c: [calls] if c == klass else [], ledger=ledger)
    for inst in added:
        key = (str(inst["group"]), inst["prompt"], inst["candidate_prompt"])
        old = stored.get(key)
        if old is None or any(abs(old["features"][f] - v) > 1e-4 for f, v in inst["features"].items()):
            raise SystemExit(f"pair group {key[0]} measures other evidence than {measured_files} "
                             "stored: measure the whole calibration again instead")
        kept = old["depths"] if klass == "other" else [d for d in old["depths"] if not d.get("finish_calls")]
        old["depths"] = kept + inst["depths"]
    return [i for (g, _, _), i in stored.items() if g in mine]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description="Fit the gate's risk model on the tiny world")
    ap.add_argument("--workload", default="calibration")
    ap.add_argument("--limit-pairs", type=int, default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--cfg", type=float, default=4.0)
    ap.add_argument("--psnr-bound", type=float, default=30.0)
    ap.add_argument("--holdout", type=float, default=CAL.CERTIFY_SHARE,
                    help="share of the pairs kept out of the fit: the thresholds are certified on them")
    ap.add_argument("--delta", type=float, default=0.1,
                    help="1 − confidence of the certified thresholds (Learn-then-Test)")
    ap.add_argument("--cache", default=None, help="Carnator cache folder (default: ComfyUI's)")
    ap.add_argument("--results", default=RESULTS)
    ap.add_argument("--instances", nargs="+", default=None,
                    help="re-fit from saved measurement files instead of measuring")
    ap.add_argument("--stratum", nargs="+", action="append", default=None, metavar="JSONL",
                    help="with --instances: measurements of pairs drawn from another population (e.g. "
                         "worded as your traffic is); each use adds one stratum, and every threshold "
                         "is certified in each stratum and in --instances' pairs alike")
    ap.add_argument("--shard", default=None, metavar="I/N",
                    help="measure only pair groups i, i+N, … (run N of these in parallel, then "
                         "re-fit from their measurement files with --instances)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--size", default=None, metavar="FRAMESxPIXELS",
                    help="generate at this size (a size of tinyworld.world.SIZES for the multi-size model, "
                         "models/tinyworld_multisize/); default the bundled model's 4x32")
    ap.add_argument("--kinds", nargs="+", default=None, help="only pairs of these kinds")
    ap.add_argument("--groups-from", type=int, default=None, help="only pair groups from this number on")
    ap.add_argument("--fill-calls", type=int, default=None,
                    help="model steps filling region M on a reuse (ReuseSettings.region_fill_calls)")
    ap.add_argument("--fill-on-m", action="store_true",
                    help="fill region M by its own trajectory computed on its tokens "
                         "(ReuseSettings.region_fill_on_m; bench/studies/region_fill_study.py)")
    ap.add_argument("--region-margin", type=int, default=0, metavar="TILES",
                    help="widen region M of other evidence by this many tiles in space and time "
                         "before measuring (ReuseSettings.region_margin; bench/studies/region_dilation_study.py)")
    ap.add_argument("--same-scene-groups-of", nargs="+", default=None, metavar="JSONL",
                    help="only the pair groups with same-scene evidence in these measurement files "
                         "(re-measure them after changing the guided finish)")
    ap.add_argument("--other-evidence-of", nargs="+", default=None, metavar="JSONL",
                    help="measure only the other-evidence reuses of the pair groups that have any in "
                         "these measurement files (after changing how edits are filled); re-fit "
                         "with --instances and --same-scene-from")
    ap.add_argument("--same-scene-from", nargs="+", default=None, metavar="JSONL",
                    help="with --instances: every direction but the other-evidence ones measured "
                         "there, taken from these measurement files")
    ap.add_argument("--other-finish-calls", type=int, default=None,
                    help="also measure other-evidence reuses with a guided finish of this many calls "
                         "(ReuseSettings.other_finish_calls; off by default, see "
                         "bench/studies/region_finish_study.py)")
    ap.add_argument("--other-finish-region", action="store_true",
                    help="with --other-finish-calls: compute region M's tokens between the calls "
                         "(ReuseSettings.other_finish_region, carnator_core/reuse/region_compute.py)")
    ap.add_argument("--same-scene-finish-calls", type=int, default=None,
                    help="model calls of the same-scene reuses' guided finish "
                         "(ReuseSettings.same_scene_finish_calls, default 4)")
    ap.add_argument("--same-scene-guided-only", action="store_true",
                    help="measure same-scene reuses with their guided finish only (pairs added to "
                         "certify the guided finish; the every-step option keeps the pairs measured "
                         "before, each option is certified on the pairs measured with it)")
    ap.add_argument("--drop-guided-finish", choices=("same_scene", "other"), default=None,
                    help="with --instances: leave this class's guided-finish reuses out of the fit "
                         "(a finish measured but not adopted)")
    ap.add_argument("--add-guided-finish", nargs="+", default=None, metavar="JSONL",
                    help="measure only the guided finish of other-evidence reuses "
                         "(ReuseSettings.other_finish_calls) for the pairs of these measurement "
                         "files and write them with those reuses added (use with --shard; then "
                         "re-fit with --instances); with --same-scene-finish-calls, the same-scene "
                         "reuses' guided finish instead, replacing the stored one")
    ap.add_argument("--probe-fraction", type=float, default=None,
                    help="share of the steps the probe runs (ReuseSettings.probe_fraction; default: the "
                         "samplers' default): a calibration holds for the probe it was measured with")
    ap.add_argument("--easycache", type=float, default=None, metavar="THRESHOLD",
                    help="calibrate the model with ComfyUI's EasyCache applied at this threshold "
                         "(another fingerprint: what Carnator on an EasyCache'd model looks for)")
    ap.add_argument("--joint", action="store_true",
                    help="certify one threshold per evidence class on the gate's choice among its "
                         "finishes (calibration.certify_model(joint=True)) instead of one per finish "
                         "at δ split between them")
    ap.add_argument("--near-scene-cell", action="store_true",
                    help="certify near-scene evidence (other evidence within twice both same-scene "
                         "cut-offs, gate.NEAR_SCENE_CELL) as a cell of its own")
    ap.add_argument("--form", choices=RISK_FORMS, default="interaction",
                    help="risk model form (carnator_core.gate.RiskModel.fit)")
    a = ap.parse_args(argv)
    if a.stratum and not a.instances:
        ap.error("--stratum adds measured pairs to --instances' (measure each population first)")

    if "bench_tw" not in sys.modules:
        _load_bench()
    from bench_tw import DEFAULT_MODEL, World, eased, load_workload
    from carnator_core.gate import DEFAULT_PROBE_FRACTION, UNNAMED_PROBE_FRACTION, GateSettings, RiskModel, same_probe
    from carnator_core.pipeline import ReuseSettings
    a.probe_fraction = DEFAULT_PROBE_FRACTION if a.probe_fraction is None else a.probe_fraction
    world = World(a.model or DEFAULT_MODEL, steps=a.steps, cfg=a.cfg, threads=a.threads, size=a.size)
    if a.easycache is not None:  # every computation, the full ones included, with EasyCache
        world = eased(world, a.easycache)
    fp = world.fingerprint
    settings = ReuseSettings(probe_fraction=a.probe_fraction, gate=GateSettings())
    if a.fill_calls is not None:
        settings.region_fill_calls = a.fill_calls
    settings.region_fill_on_m = a.fill_on_m
    settings.region_margin = a.region_margin
    if a.other_finish_calls is not None:
        settings.other_finish_calls = a.other_finish_calls
    settings.other_finish_region = a.other_finish_region
    if a.same_scene_finish_calls is not None:
        settings.same_scene_finish_calls = a.same_scene_finish_calls
    region_threshold = RiskModel().region_threshold
    os.makedirs(a.results, exist_ok=True)
    shard = tuple(int(x) for x in a.shard.split("/")) if a.shard else None
    meas_path = os.path.join(a.results, "calibration_measurements.jsonl" if shard is None
                             else f"calibration_measurements.{shard[0]}-of-{shard[1]}.jsonl")
    t0 = time.time()
    from carnator_core.calibration.meter import CostLedger, PairCost
    ledger = CostLedger()
    if a.instances:
        instances = [i for path in a.instances for i in CAL.load_instances(path)]
        if a.stratum:  # --instances' pairs are stratum 0, each --stratum's the next
            instances = [dict(i, stratum="0") for i in instances] + [
                dict(i, stratum=str(number)) for number, paths in enumerate(a.stratum, 1)
                for path in paths for i in CAL.load_instances(path)]
        if a.same_scene_from:
            instances = with_same_scene_from(instances, [i for path in a.same_scene_from
                                                         for i in CAL.load_instances(path)])
        if a.drop_guided_finish:
            from carnator_core.gate import evidence_class
            for inst in instances:
                if evidence_class(inst["features"]) == a.drop_guided_finish:
                    inst["depths"] = [d for d in inst["depths"] if not d.get("finish_calls")]
    else:
        _, lines = load_workload(a.workload)
        if a.kinds:
            lines = [ln for ln in lines if ln.get("kind") in a.kinds]
        if a.groups_from is not None:  # measure only pairs added since the last measurement
            lines = [ln for ln in lines if int(group_of(ln)) >= a.groups_from]
        for paths, klass in ((a.same_scene_groups_of, "same_scene"), (a.other_evidence_of, "other")):
            if paths:
                keep = groups_with_evidence(paths, klass)
                lines = [ln for ln in lines if str(group_of(ln)) in keep]
        groups = list(dict.fromkeys(group_of(ln) for ln in lines))
        if a.limit_pairs:
            groups = groups[:a.limit_pairs]
        if shard:
            groups = groups[shard[0]::shard[1]]
        mine = set(groups)
        lines = [ln for ln in lines if group_of(ln) in mine]
        if a.add_guided_finish:
            instances = add_guided_finish(world, lines, settings, a.psnr_bound, region_threshold,
                                          a.add_guided_finish, "same_scene" if a.same_scene_finish_calls
                                          is not None else "other", ledger=ledger)
        else:
            print(f"measuring {len(lines)} requests …", flush=True)
            finishes = None
            if a.same_scene_guided_only:
                finishes = lambda klass: ([settings.same_scene_finish_calls] if klass == "same_scene"  # noqa: E731
                                          else [0] + [c for c in [settings.other_finish_calls] if c])
            if a.other_evidence_of:  # same-scene directions: no reuse measured (taken as they were)
                finishes = lambda klass: ([0] + [c for c in [settings.finish_calls_for(klass)] if c]
                                          if klass == "other" else [])  # noqa: E731
            instances = measure_pairs(world, lines, settings, a.psnr_bound, region_threshold,
                                      finishes=finishes, ledger=ledger)
        CAL.save_instances(instances, meas_path)
    max_region = settings.gate.max_region_fraction
    model, fitted = CAL.fit_and_certify(instances, region_threshold, delta=a.delta, holdout=a.holdout,
                                        form=a.form, max_region_fraction=max_region,
                                        tolerance={"psnr_bound": a.psnr_bound, "space": "frames",
                                                   "checker": True},
                                        alphas=BUDGETS, probe_fraction=a.probe_fraction,
                                        joint=a.joint, near_scene_cell=a.near_scene_cell)
    held = CAL.split(instances, a.holdout)[1]
    rows, labels = CAL.rows_of(instances)
    report = {
        "model_fingerprint": fp, "size": world.size, "psnr_bound": a.psnr_bound, "steps": a.steps, "cfg": a.cfg,
        "probe_fraction": a.probe_fraction, "easycache": a.easycache,
        **fitted,
        "risk_model": {"weights": model.weights, "depth_weights": model.depth_weights, "bias": model.bias,
                       "region_threshold": model.region_threshold, "thresholds": model.thresholds,
                       "confidence": model.confidence, "source": model.source},
        "prior_heldout": CAL.evaluate(RiskModel(), held, max_region_fraction=max_region),
        "by_kind": {},
        "seconds": round(time.time() - t0, 1),
    }
    if a.instances:  # refitted: what measuring these records cost, by the meter's rule
        by_group: dict = {}
        for inst in instances:
            by_group.setdefault(str(inst["group"]), []).append(inst)
        ledger.carried = [PairCost.of(None, insts, a.steps) for insts in by_group.values()]
    report["cost"] = ledger.as_dict()
    report["cost_generations"] = report["cost"]["cost_generations"]
    for inst in instances:
        k = inst.get("kind") or "?"
        d = report["by_kind"].setdefault(k, {"instances": 0, "reuses": 0, "exceeded": 0, "gated_out": 0})
        d["instances"] += 1
        d["reuses"] += len(inst["depths"])
        d["exceeded"] += sum(x["label"] for x in inst["depths"])
        d["gated_out"] += int(not inst["depths"])
    cache = a.cache
    if cache is None:
        from carnator_core.comfy_adapter import default_cache_folder
        cache = default_cache_folder()
    path = CAL.save(model, cache, fp)
    # the default results folder's copy is the bundled calibration (models/calibration/, the one
    # copy the nodes install and the benchmark reads); a study's --results folder keeps its own
    copy = CAL.save(model, os.path.join(REPO, "models") if os.path.abspath(a.results) == RESULTS
                    else a.results, fp)
    report["saved"] = [str(path), os.path.relpath(str(copy), REPO)]
    report_name = "calibration_report.json" if same_probe(a.probe_fraction, UNNAMED_PROBE_FRACTION) \
        else f"calibration_report.probe{a.probe_fraction:g}.json"
    with open(os.path.join(a.results, report_name), "w") as f:
        json.dump(report, f, indent=1)
    print(f"{len(instances)} candidate pairs, {len(rows)} measured reuses, "
          f"{sum(labels)} exceeded tolerance (PSNR < {a.psnr_bound} dB or checker)")
    how = "by the meter's rule on these records" if a.instances else "counted at the model"
    print(f"cost: {report['cost_generations']:.1f} generation-equivalents ({how}), {report['seconds']:.0f} s")
    print(f"risk model: {model.source}")
    print(f"certified thresholds ({1 - a.delta:.0%} confidence): "
          + "; ".join(f"{c}: " + ", ".join(f"α={k}: λ={v:.2f}" for k, v in t.items())
                      for c, t in model.thresholds.items()))
    print(f"{'alpha':>6s} {'accepted':>9s} {'accept%':>8s} {'FA rate':>8s} {'FA up95':>8s} holds")
    for k, v in report["heldout"].items():
        print(f"{v['alpha']:6.2f} {v['accepted']:9d} {100 * v['accept_rate']:7.1f}% "
              f"{100 * v['false_accept_rate']:7.1f}% {100 * v['false_accept_upper95']:7.1f}% {v['holds']}")
    print(f"saved {path} (gate loads it) and {copy}")
    return report


def _load_bench():
    """bench/tinyworld.py as a module (its name clashes with the tinyworld package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_tw", os.path.join(REPO, "bench", "tinyworld.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_tw"] = mod
    spec.loader.exec_module(mod)
    return mod


if __name__ == "__main__":
    main()
