"""The generic calibration run on the tiny world, to check it against the
checker-based one (bench/calibrate.py).

    nice .venv/bin/python bench/studies/self_calibrate.py --shard 0/2 &   # measure (2 processes)
    nice .venv/bin/python bench/studies/self_calibrate.py --shard 1/2; wait
    .venv/bin/python bench/studies/self_calibrate.py                       # fit from the measurements

Only what a user's model offers is used: prompt pairs from ``carnator_core.calibration.pairs``
(``derived_pairs``: its English edit operators, single and chained, applied to base prompts — here the anchor prompts of
bench/workloads/calibration.jsonl, standing in for "the user's own prompt list"; none of the
tiny world's pair kinds, generator or checker), labels by PSNR of the decoded frames against
the request's own full computation (``--psnr-bound``, 30 dB as the benchmark's). Writes the
calibration file to bench/results/self_calibration/<fingerprint>.json and its report beside
it. ``--evaluate WORKLOAD`` then serves a workload through the real pipeline with this
calibration and with the checker-based one side by side (same process, same references) and
writes bench/results/self_calibration/evaluation.<workload>.json:

    nice .venv/bin/python bench/studies/self_calibrate.py --evaluate iterate &
    nice .venv/bin/python bench/studies/self_calibrate.py --evaluate serve; wait
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

from study_paths import REPO  # noqa: E402 - sys.path for the repository, tests/ and bench/

from carnator_core.calibration import fit as CAL  # noqa: E402
from carnator_core.calibration import pairs as PP  # noqa: E402
from carnator_core.calibration import generic as SC  # noqa: E402
from carnator_core.gate import RISK_FORMS  # noqa: E402

OUT = os.path.join(REPO, "bench", "results", "self_calibration")


def base_prompts() -> list[str]:
    path = os.path.join(REPO, "bench", "workloads", "calibration.jsonl")
    with open(path) as f:
        lines = [json.loads(x) for x in f if x.strip()]
    return sorted({ln["prompt"] for ln in lines if ln.get("role") == "anchor"})


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=720,
                    help="pairs to measure: 1/2 single edits, 1/4 chains of 2–3 edits, 1/4 sessions of 1–8 (prompt_pairs.derived_pairs)")
    ap.add_argument("--seed", type=int, default=700_000, help="pair i runs with seed + i")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--cfg", type=float, default=4.0)
    ap.add_argument("--psnr-bound", type=float, default=30.0)
    ap.add_argument("--builtin-prompts", action="store_true",
                    help="derive pairs from the pack's built-in prompt list instead")
    ap.add_argument("--shard", default=None, metavar="I/N", help="measure only pairs i, i+N, …")
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--evaluate", default=None, metavar="WORKLOAD",
                    help="measure the fitted calibration against the checker-based one on a workload")
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.02, 0.05, 0.1])
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--probe-fraction", type=float, default=0.1,
                    help="the probe to calibrate for (ReuseSettings.probe_fraction)")
    ap.add_argument("--fill-on-m", action="store_true",
                    help="fill region M by its own trajectory on its tokens (ReuseSettings.region_fill_on_m)")
    ap.add_argument("--region-margin", type=int, default=0, metavar="TILES",
                    help="widen an edit's region M by this many tiles (ReuseSettings.region_margin)")
    ap.add_argument("--form", choices=RISK_FORMS, default=None,
                    help="risk form (default: signed with --fill-on-m, else interaction)")
    ap.add_argument("--checker-model", default=None, metavar="JSON",
                    help="with --evaluate: the checker-based calibration to compare with "
                         "(default: the committed one for the generic file's probe)")
    a = ap.parse_args(argv)
    if a.evaluate:
        return evaluate(a)

    from calibrate import _load_bench
    bench = _load_bench()
    from carnator_core.gate import GateSettings
    from carnator_core.pipeline import ReuseSettings
    world = bench.World(bench.DEFAULT_MODEL, steps=a.steps, cfg=a.cfg, threads=a.threads)
    fp = world.fingerprint
    settings = ReuseSettings(probe_fraction=a.probe_fraction, gate=GateSettings(),
                             region_fill_on_m=a.fill_on_m, region_margin=a.region_margin)
    tolerance = SC.Tolerance(a.psnr_bound, "frames")
    pairs = PP.derived_pairs(PP.BUILTIN_PROMPTS if a.builtin_prompts else base_prompts(), a.pairs, seed=1)
    make_run = lambda prompt, seed: world.new_run(prompt, seed, "same_seed")  # noqa: E731
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()

    def on_pair(done, total):
        if done % 10 == 0:
            print(f"  {done}/{total} pairs, {time.time() - t0:.0f} s", flush=True)

    if a.shard:
        i, n = (int(x) for x in a.shard.split("/"))
        mine = pairs[i::n]
        SC.measure(mine, make_run, settings, tolerance, os.path.join(a.out, f"progress.{i}-of-{n}.jsonl"),
                   a.steps, a.seed, world.video, on_pair=on_pair, meter=world.meter)
        print(f"measured {len(mine)} pairs in {time.time() - t0:.0f} s")
        return {}
    # fit: the shards' measurements become the calibration's progress file, so nothing is re-measured
    cache = os.path.join(a.out, "cache")
    calibration = CAL.calibration_path(cache, fp, a.probe_fraction)
    progress = SC.progress_path(calibration)
    progress.parent.mkdir(parents=True, exist_ok=True)
    with open(progress, "w") as f:
        for name in sorted(os.listdir(a.out)):
            if name.startswith("progress.") and name.endswith(".jsonl"):
                with open(os.path.join(a.out, name)) as g:
                    f.write(g.read())
    model, report = SC.calibrate(make_run, pairs, settings, tolerance, cache, fp, a.steps, seed=a.seed,
                                 decode=world.video, include_audits=False, on_pair=on_pair, form=a.form,
                                 meter=world.meter)
    report["seconds_fit"] = round(time.time() - t0, 1)
    report["base_prompts"] = "builtin" if a.builtin_prompts else "calibration.jsonl anchors"
    report["pair_kinds"] = {k: sum(p["kind"] == k for p in pairs) for k in PP.KINDS + PP.MULTI_STEP}
    shutil.copy(calibration, os.path.join(a.out, calibration.name))
    with open(os.path.join(a.out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    shutil.rmtree(cache)
    print(f"{report['instances']} instances, {report['measured_reuses']} reuses, "
          f"{report['exceeded_tolerance']} beyond tolerance")
    print(f"risk model: {model.source}")
    for k, v in report["heldout"].items():
        print(f"α={k}: held-out accepted {v['accepted']}, false-accept {v['false_accept_rate']:.1%} "
              f"(upper95 {v['false_accept_upper95']:.1%})")
    print(f"wrote {os.path.join(a.out, calibration.name)}")
    return report


def evaluate(a) -> dict:
    """Carnator with the generic calibration and with the checker-based one, per budget."""
    import tempfile
    from calibrate import _load_bench
    bench = _load_bench()
    from carnator_core.pipeline import ReuseSettings
    world = bench.World(bench.DEFAULT_MODEL, steps=a.steps, cfg=a.cfg, threads=a.threads)
    fp = world.fingerprint
    models = {"generic": os.path.join(a.out, CAL.calibration_path(a.out, fp, a.probe_fraction).name),
              "checker": a.checker_model or bench.default_risk_model(fp, a.probe_fraction)}
    name, lines = bench.load_workload(a.evaluate, a.limit)
    settings = ReuseSettings(probe_fraction=a.probe_fraction)
    t0 = time.time()
    print(f"[{name}] {len(lines)} requests: reference …", flush=True)
    refs = bench.run_reference(world, lines, settings.snapshot_steps(a.steps), settings.probe_steps(a.steps))
    out = {"workload": name, "psnr_bound": a.psnr_bound, "steps": a.steps, "probe_fraction": a.probe_fraction,
           "risk_models": {k: os.path.relpath(v, REPO) for k, v in models.items()}, "budgets": {}}
    workdir = tempfile.mkdtemp(prefix="carnator_selfcal_")
    try:
        for b in a.budgets:
            for label, path in models.items():
                print(f"[{name}] α={b:g} {label} calibration …", flush=True)
                # recurring_sources off: the committed comparison was measured before the rule
                m, _ = bench.run_carnator(world, lines, refs, b, path, a.psnr_bound, False,
                                          os.path.join(workdir, label), settings.region_fill_calls,
                                          recurring=False, probe_fraction=a.probe_fraction)
                out["budgets"].setdefault(f"{b:g}", {})[label] = m
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    out["seconds"] = round(time.time() - t0, 1)
    path = os.path.join(a.out, f"evaluation.{name}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"{'α':>5} {'calibration':12} {'hit rate':>9} {'FA rate':>8} {'FA 95% CI':>15} {'hit steps×':>10} {'PSNR hits':>9}")
    for b, row in out["budgets"].items():
        for label, m in row.items():
            ci = m["false_accept_ci95"] or [0, 0]
            print(f"{b:>5} {label:12} {m['hit_rate']:9.1%} {m['false_accept_rate']:8.1%} "
                  f"{ci[0]:6.1%}–{ci[1]:6.1%} {m['steps_speedup_hits'] or 0:10.2f} {m['psnr_hits_mean'] or 0:9.1f}")
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
