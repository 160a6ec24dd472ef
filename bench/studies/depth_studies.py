"""What limits reuse depth, from calibration measurements: no model runs here.

    .venv/bin/python bench/studies/depth_studies.py                       # bench/results/depth_studies.json
    .venv/bin/python bench/studies/depth_studies.py --fill out/fill2/calibration_measurements.jsonl

Every study fits the risk model on one half of the pairs and certifies it on the other
(bench/calibrate.py's split and Learn-then-Test), then reports, on the certification half, what
the certified gate would do at each budget: accepted share, false accepts, and the steps
speedup of its accepted reuses, cost = probe + region-fill steps + (N − k*).

- ``oracle``: the deepest depth within tolerance per pair (what a perfect gate could reach).
- ``probe``: today's probe (2 of 20 steps) against a 1-step probe whose evidence is the
  signature at step 0. The labels were measured with the 2-step probe's fill of region M, so
  the 1-step row is optimistic where M matters (edits); same-scene pairs have no M.
- ``fill``: region M filled by the request's own coarse trajectory (``--fill`` files,
  measured by ``bench/calibrate.py --fill-calls C``) against the re-noised probe x̂0, on the
  same pairs.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from carnator_core.calibration import fit as CAL  # noqa: E402
from carnator_core.gate import RiskModel  # noqa: E402

RESULTS = os.path.join(REPO, "bench", "results")
BUDGETS = (0.02, 0.05, 0.1)
SAME_SCENE = ("compatible_far",)


def cost(inst: dict, k: int | None, steps: int, probe: int) -> int:
    if k is None:
        return steps
    d = next(d for d in inst["depths"] if d["k"] == k)
    fill = d.get("fill_steps", 0) if inst["features"]["region_fraction"] > 0 else 0  # M empty: no fill
    return probe + fill + steps - k


def gate_rows(instances: list[dict], steps: int, probe: int, delta: float, form: str) -> dict:
    fit_part, cert_part = CAL.split(instances, CAL.CERTIFY_SHARE)
    model = CAL.fit(fit_part, RiskModel().region_threshold, form=form)
    CAL.certify_model(model, cert_part, delta=delta)
    cert = [i for i in cert_part if i.get("kind") != "identical"]
    out = {"certified_budgets": {c: sorted(float(a) for a in t) for c, t in model.thresholds.items()},
           "pairs": len(cert)}
    for a in BUDGETS:
        picks = [(i, CAL.gate_decision(model, i, a)) for i in cert]
        acc = [(i, d) for i, d in picks if d is not None]
        same = [(i, d) for i, d in acc if i.get("kind") in SAME_SCENE]
        out[f"{a:g}"] = {
            "accepted": len(acc), "accept_rate": len(acc) / len(cert) if cert else 0.0,
            "false_accepts": sum(d["label"] for _, d in acc),
            "steps_speedup": _speedup(acc, steps, probe),
            "steps_speedup_same_scene": _speedup(same, steps, probe),
            "mean_k": sum(d["k"] for _, d in acc) / len(acc) if acc else None}
    return out


def _speedup(acc, steps, probe):
    total = sum(cost(i, d["k"], steps, probe) for i, d in acc)
    return len(acc) * steps / total if total else None


def oracle(instances: list[dict], steps: int, probe: int) -> dict:
    by_kind: dict = {}
    for i in instances:
        ok = [d["k"] for d in i["depths"] if not d["label"]]
        k = max(ok) if ok else None
        by_kind.setdefault(i.get("kind"), []).append(steps / cost(i, k, steps, probe))
    return {kind: sum(v) / len(v) for kind, v in sorted(by_kind.items())}


def label_rates(instances: list[dict]) -> dict:
    out: dict = {}
    for i in instances:
        for d in i["depths"]:
            out.setdefault(i.get("kind"), {}).setdefault(str(d["k"]), []).append(d["label"])
    return {kind: {k: round(sum(v) / len(v), 3) for k, v in ks.items()} for kind, ks in out.items()}


def with_step0(instances: list[dict]) -> list[dict]:
    return [{**i, "features": i["features_step0"]} for i in instances if "features_step0" in i]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", nargs="+",
                    default=sorted(glob.glob(os.path.join(RESULTS, "studies", "caption_model",
                                                       "calibration_measurements.*.jsonl"))))
    ap.add_argument("--fill", nargs="*", default=[], help="measurements with a region fill")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--probe", type=int, default=2)
    ap.add_argument("--delta", type=float, default=0.1)
    ap.add_argument("--form", default="interaction")
    ap.add_argument("--out", default=os.path.join(RESULTS, "depth_studies.json"))
    a = ap.parse_args(argv)
    base = [i for p in a.instances for i in CAL.load_instances(p)]
    n, p = a.steps, a.probe
    res = {"instances": len(base), "steps": n, "probe_steps": p, "delta": a.delta,
           "oracle": oracle(base, n, p), "label_rates": label_rates(base),
           "probe": {f"{p}_steps": gate_rows(base, n, p, a.delta, a.form)}}
    step0 = with_step0(base)
    if step0:
        res["probe"]["1_step"] = gate_rows(step0, n, 1, a.delta, a.form)
        res["probe"]["note"] = "1-step labels measured with the 2-step fill of M: optimistic for edits"
    if a.fill:
        filled = [i for path in a.fill for i in CAL.load_instances(path)]
        keys = {(i["group"], i["prompt"]) for i in filled}
        same_pairs = [i for i in base if (i["group"], i["prompt"]) in keys]
        calls = {d.get("fill_steps", 0) for i in filled for d in i["depths"]}
        res["fill"] = {"pairs": len(filled), "fill_steps_seen": sorted(calls),
                       "renoise": {"oracle": oracle(same_pairs, n, p), "label_rates": label_rates(same_pairs)},
                       "own_trajectory": {"oracle": oracle(filled, n, p), "label_rates": label_rates(filled)}}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "label_rates"}, indent=1))
    return res


if __name__ == "__main__":
    main()
