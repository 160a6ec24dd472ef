"""The generic calibration (issue 11) run on the tiny world, to check it against the
checker-based one (bench/calibrate.py).

    nice .venv/bin/python bench/self_calibrate.py --shard 0/2 &   # measure (2 processes)
    nice .venv/bin/python bench/self_calibrate.py --shard 1/2; wait
    .venv/bin/python bench/self_calibrate.py                       # fit from the measurements

Only what a user's model offers is used: prompt pairs from ``carnator_core.prompt_pairs``
(its English edit operators applied to base prompts — here the anchor prompts of
bench/workloads/calibration.jsonl, standing in for "the user's own prompt list"; none of the
tiny world's pair kinds, generator or checker), labels by PSNR of the decoded frames against
the request's own full computation (``--psnr-bound``, 30 dB as the benchmark's). Writes the
calibration file to bench/results/self_calibration/<fingerprint>.json and its report beside
it; ``bench/tinyworld.py --risk-model`` that file measures it on the workloads.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (os.path.join(REPO, "tests"), REPO):
    if p not in sys.path:
        sys.path.insert(0, p)

from carnator_core import prompt_pairs as PP  # noqa: E402
from carnator_core import self_calibration as SC  # noqa: E402

OUT = os.path.join(REPO, "bench", "results", "self_calibration")


def base_prompts() -> list[str]:
    path = os.path.join(REPO, "bench", "workloads", "calibration.jsonl")
    with open(path) as f:
        lines = [json.loads(x) for x in f if x.strip()]
    return sorted({ln["prompt"] for ln in lines if ln.get("role") == "anchor"})


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=360)
    ap.add_argument("--seed", type=int, default=700_000, help="pair i runs with seed + i")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--cfg", type=float, default=4.0)
    ap.add_argument("--psnr-bound", type=float, default=30.0)
    ap.add_argument("--builtin-prompts", action="store_true",
                    help="derive pairs from the pack's built-in prompt list instead")
    ap.add_argument("--shard", default=None, metavar="I/N", help="measure only pairs i, i+N, …")
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)

    from calibrate import _load_bench
    bench = _load_bench()
    from carnator_core.gate import GateSettings
    from carnator_core.pipeline import ReuseSettings
    world = bench.World(bench.DEFAULT_MODEL, steps=a.steps, cfg=a.cfg, threads=a.threads)
    fp = world.fingerprint
    settings = ReuseSettings(probe_fraction=0.1, gate=GateSettings())
    tolerance = SC.Tolerance(a.psnr_bound, "frames")
    pairs = PP.pairs(PP.BUILTIN_PROMPTS if a.builtin_prompts else base_prompts(), a.pairs, seed=1)
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
                   a.steps, a.seed, world.video, on_pair=on_pair)
        print(f"measured {len(mine)} pairs in {time.time() - t0:.0f} s")
        return {}
    # fit: the shards' measurements become the calibration's progress file, so nothing is re-measured
    cache = os.path.join(a.out, "cache")
    progress = SC.progress_path(os.path.join(cache, "calibration", f"{fp}.json"))
    progress.parent.mkdir(parents=True, exist_ok=True)
    with open(progress, "w") as f:
        for name in sorted(os.listdir(a.out)):
            if name.startswith("progress.") and name.endswith(".jsonl"):
                with open(os.path.join(a.out, name)) as g:
                    f.write(g.read())
    model, report = SC.calibrate(make_run, pairs, settings, tolerance, cache, fp, a.steps, seed=a.seed,
                                 decode=world.video, include_audits=False, on_pair=on_pair)
    report["seconds_fit"] = round(time.time() - t0, 1)
    report["base_prompts"] = "builtin" if a.builtin_prompts else "calibration.jsonl anchors"
    report["pair_kinds"] = {k: sum(p["kind"] == k for p in pairs) for k in PP.KINDS}
    shutil.copy(os.path.join(cache, "calibration", f"{fp}.json"), os.path.join(a.out, f"{fp}.json"))
    with open(os.path.join(a.out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    shutil.rmtree(cache)
    print(f"{report['instances']} instances, {report['measured_reuses']} reuses, "
          f"{report['exceeded_tolerance']} beyond tolerance")
    print(f"risk model: {model.source}")
    for k, v in report["heldout"].items():
        print(f"α={k}: held-out accepted {v['accepted']}, false-accept {v['false_accept_rate']:.1%} "
              f"(upper95 {v['false_accept_upper95']:.1%})")
    print(f"wrote {os.path.join(a.out, fp + '.json')}")
    return report


if __name__ == "__main__":
    main()
