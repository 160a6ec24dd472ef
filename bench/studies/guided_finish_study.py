"""How many model calls a reuse's finish needs, and what guides the steps between.

    nice .venv/bin/python bench/studies/guided_finish_study.py      # bench/results/guided_finish_study.json

For pairs of the calibration workload (same seed), the request resumes from the
candidate's x_k at k = 4…16 of 20 (no region fill: the question is the finish, not M) and
finishes in one of these ways; PSNR of the decoded frames against the request's own full
computation, and the share of reuses within 30 dB:

- ``every_step``: every remaining step computed (what a hit did before the guided finish);
- ``guided_C``: C calls (``guided_finish.finish_steps``), the steps between predicted as the
  candidate's stored x̂0 (snapshot steps and N−1, interpolated in σ) plus the request's
  last measured offset (``GuidedFinish``, as a hit runs it);
- ``own_hold_C``: the same C calls, the steps between holding the request's own last x̂0 —
  a coarser sampler, what a step cache such as EasyCache amounts to.

Same-scene pairs (paraphrases) are where the guided finish is meant to run; edits are
listed to show why it is not used for them.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from study_paths import REPO  # noqa: E402 - sys.path for the repository, tests/ and bench/

RESULTS = os.path.join(REPO, "bench", "results")
KINDS = {"compatible_far": 24, "edit_chain": 8, "partial": 8, "incompatible_close": 8}
DEPTHS = (4, 8, 10, 12, 14, 16)
CALLS = (1, 2, 3, 4)


class OwnHold:
    """The comparison: at skipped steps, the request's own last computed x̂0."""

    def __init__(self, compute: set[int]):
        self.compute, self.last, self.predicted = compute, None, 0

    def predict(self, step):
        if step is None or step in self.compute or self.last is None:
            return None
        self.predicted += 1
        return self.last

    def observe(self, step, x0):
        self.last = x0


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--psnr-bound", type=float, default=30.0)
    ap.add_argument("--scale", type=float, default=1.0, help="share of the pairs per kind (smoke runs)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "guided_finish_study.json"))
    a = ap.parse_args(argv)
    from calibrate import _load_bench
    bench = _load_bench()
    from carnator_core.reuse.guided_finish import GuidedFinish, finish_steps
    from carnator_core.pipeline import ReuseSettings
    world = bench.World(bench.DEFAULT_MODEL, steps=a.steps)
    n = world.steps
    stored_steps = set(ReuseSettings().snapshot_steps(n)) | {n - 1}
    _, lines = bench.load_workload("calibration")
    groups: dict = {}
    for ln in lines:
        groups.setdefault(ln["group"], {})[ln["role"]] = ln
    want = {k: max(1, round(v * a.scale)) for k, v in KINDS.items()}
    rows, t0 = [], time.time()
    for g, pair in sorted(groups.items()):
        kind = pair["anchor"]["kind"]
        if want.get(kind, 0) <= 0 or "variant" not in pair:
            continue
        want[kind] -= 1
        traj = {}
        for role in ("anchor", "variant"):
            run = world.new_run(pair[role]["prompt"], int(pair[role]["seed"]), "same_seed")
            xs, x0s = {}, {}
            final = run.sample(0, n, None, on_step=lambda s, x, x0, xs=xs, x0s=x0s: (
                xs.__setitem__(s, x.clone()), x0s.__setitem__(s, x0.clone())))
            traj[role] = (run, xs, x0s, world.video(final))
        cand_run, cand_x, cand_x0, _ = traj["anchor"]
        req_run, _, _, reference = traj["variant"]
        stored = {s: cand_x0[s] for s in stored_steps}
        row = {"group": g, "kind": kind, "depths": {}}
        for k in DEPTHS:
            start = req_run.boundary_from_sampler_space(cand_x[k], k)
            out = {}

            def finish(guide, name, calls):
                before = req_run.model_calls
                v = world.video(req_run.sample(k, n, start, guide=guide))
                q = bench.psnr(v, reference)
                out[name] = {"psnr": round(q, 2), "ok": q >= a.psnr_bound, "calls": req_run.model_calls - before}

            finish(None, "every_step", n - k)
            for c in CALLS:
                finish(GuidedFinish(req_run.sigmas, stored, k, c), f"guided_{c}", c)
                finish(OwnHold(finish_steps(k, n, c)), f"own_hold_{c}", c)
            row["depths"][str(k)] = out
        rows.append(row)
        print(f"{len(rows)} pairs, {time.time() - t0:.0f} s", flush=True)
    summary: dict = {}
    for kind in KINDS:
        mine = [r for r in rows if r["kind"] == kind]
        for k in DEPTHS:
            for name in mine[0]["depths"][str(k)] if mine else ():
                got = [r["depths"][str(k)][name] for r in mine]
                summary.setdefault(kind, {}).setdefault(str(k), {})[name] = {
                    "within": sum(x["ok"] for x in got), "pairs": len(got),
                    "mean_psnr": round(sum(min(x["psnr"], 60.0) for x in got) / len(got), 2),
                    "calls": got[0]["calls"]}
    res = {"steps": n, "psnr_bound": a.psnr_bound, "stored_steps": sorted(stored_steps),
           "summary": summary, "pairs": rows, "seconds": round(time.time() - t0, 1)}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    for kind, by_k in summary.items():
        print(kind)
        for k, v in by_k.items():
            print(f"  k={k:>2} " + " | ".join(f"{m} {x['within']}/{x['pairs']} {x['mean_psnr']:.1f}dB"
                                            for m, x in v.items() if m in ("every_step", "guided_3", "own_hold_3", "guided_2")))
    return res


if __name__ == "__main__":
    main()
