"""Replay a tiny-world workload to see which requests become reuse sources, and what a policy
for making them would save. Steps only: no reference computations, PSNR or checker (those
are bench/tinyworld.py's).

For every request it logs the lookup's candidates and whether one of them was an entry of the
request's own scene (same noise): the measurement behind `min_saving` (docs/results.md).
``--policy second_sight`` simulates a rule that needs no setting: a request whose best reuse
has *other* evidence runs in full when its own scene was asked before and served by reuse. The
workload's ground-truth scene stands in for recognising that (an oracle: an upper bound on
such a rule, which would have to find the scene among entries that are not sources).

    .venv/bin/python bench/studies/source_policy_replay.py serve --min-saving 0
    .venv/bin/python bench/studies/source_policy_replay.py iterate --policy second_sight --out FILE.json
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
from calibrate import _load_bench  # noqa: E402 - bench/tinyworld.py, once per process

TWB = _load_bench()


def scene_key(line: dict) -> tuple:
    noise = TWB.noise_frame(int(line["seed"]), line.get("seed_policy", "same_seed"))
    return json.dumps(line["scene"], sort_keys=True), noise


def replay(workload: str, budget: float, min_saving: float, policy: str, risk_model: str | None,
           limit: int | None = None) -> dict:
    world = TWB.World(threads=1)
    import carnator_core.pipeline as pipeline
    from carnator_core.comfy_adapter import run_request
    from carnator_core.gate import GateSettings, Plan, evidence_class
    from carnator_core.pipeline import ReuseSettings
    from carnator_core.reuse.sparse_reuse import SparseSettings
    _, lines = TWB.load_workload(workload, limit)
    folder = tempfile.mkdtemp(prefix="carnator_replay_")
    path = risk_model or TWB.default_risk_model(world.fingerprint)
    os.makedirs(os.path.join(folder, "calibration"))
    shutil.copy(path, os.path.join(folder, "calibration", f"{world.fingerprint}.json"))
    seen = {"candidates": [], "asked_as_reuse": False}
    decide = pipeline.decide

    def logged_decide(new, candidates, *args, **kw):  # the replay's window on the gate
        plan, verdicts = decide(new, candidates, *args, **kw)
        seen["candidates"] = [c[0] for c in candidates]
        if (policy == "second_sight" and plan.accept and evidence_class(plan.features) == "other"
                and seen["asked_as_reuse"]):
            plan = Plan(False, reason="second sight: this scene was asked before, served by reuse")
        return plan, verdicts

    pipeline.decide = logged_decide
    settings = ReuseSettings(probe_fraction=0.1, gate=GateSettings(risk_budget=budget, min_saving=min_saving),
                             sparse=SparseSettings(enabled=False))
    key_of, reused_keys, rows = {}, set(), []
    try:
        for line in lines:
            key = scene_key(line)
            own = {e for e, k in key_of.items() if k == key}
            seen["candidates"], seen["asked_as_reuse"] = [], key in reused_keys
            _, s = run_request(world.model, world.cond(line["prompt"]), world.negative, world.latent(),
                               int(line["seed"]), world.steps, world.cfg, world.sampler, world.scheduler,
                               settings, {"folder": folder, "capacity_bytes": 1 << 30},
                               seed_policy=line.get("seed_policy", "same_seed"), label=line["prompt"])
            rows.append({"outcome": s.outcome, "steps": s.step_equivalents, "own_scene_entries": len(own),
                         "own_scene_candidate": bool(own & set(seen["candidates"])),
                         "reused_own_scene": s.entry_id in own if s.outcome == "hit" else None})
            if s.stored_id:
                key_of[s.stored_id] = key
            if s.outcome == "hit":
                reused_keys.add(key)
    finally:
        pipeline.decide = decide
        shutil.rmtree(folder, ignore_errors=True)
    return summarise(rows, world.steps)


def summarise(rows: list[dict], steps: int) -> dict:
    hits = [r for r in rows if r["outcome"] == "hit"]
    hit_kinds = collections.Counter(
        "reused its own scene" if r["reused_own_scene"] else
        "another scene; an own-scene entry was a candidate" if r["own_scene_candidate"] else
        "another scene; own-scene entries existed, none a candidate" if r["own_scene_entries"] else
        "another scene; its own scene was new" for r in hits)
    return {"requests": len(rows), "outcomes": dict(collections.Counter(r["outcome"] for r in rows)),
            "gate_hits": dict(hit_kinds.most_common()),
            "whole_workload_steps_speedup": len(rows) * steps / sum(r["steps"] for r in rows),
            "gate_hit_steps_speedup": (len(hits) * steps / sum(r["steps"] for r in hits)) if hits else None}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workload")
    ap.add_argument("--budget", type=float, default=0.05)
    ap.add_argument("--min-saving", type=float, default=0.0)
    ap.add_argument("--policy", choices=["gate", "second_sight"], default="gate")
    ap.add_argument("--risk-model", default=None, help="default: the committed calibration")
    ap.add_argument("--limit", type=int, default=None, help="first N requests only (a smoke run)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    result = {"workload": a.workload, "budget": a.budget, "min_saving": a.min_saving, "policy": a.policy,
              **replay(a.workload, a.budget, a.min_saving, a.policy, a.risk_model, a.limit)}
    print(json.dumps(result, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
