"""How often can a calibration of a given cost certify α at all? The most any test can do.

A certificate "risk < α at confidence 1 − δ" from n labels is a level-δ test of the null
"risk ≥ α". For n independent labels of a true rate p the most powerful such test is the
(randomised) one-sided binomial test (the likelihood ratio is monotone in the failures), so
its power — the chance that a calibration certifies α at all — bounds every valid procedure
from above: Learn-then-Test's fixed sequence, the cheap procedure's anytime-valid betting test
(stopped at n it is a level-δ test too), any ordering or ladder. Labels that share a pair's
two full runs are positively dependent, which lowers the power further; counting them as
independent keeps this an upper bound.

The rates are measured, not assumed: per model, the share of same-scene reuses beyond
tolerance at each depth with the guided 4-call finish, over every pair of its full calibration
(every depth of every pair was measured there). The cost of a label is the cheap procedure's
measured cost per pair at a budget of 200 (two full runs and the ladder's decisions), two
labels a pair.

    .venv/bin/python bench/studies/certification_power.py   # → bench/results/studies/certification_power.json
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np
from study_paths import REPO

from carnator_core.calibration.risk_control import binomial_cdf
from carnator_core.calibration.sequential import RiskSequence
from carnator_core.evidence import evidence_class

DELTA = 0.1
DRAWS = 2000  # simulated calibrations per row for the cheap procedure's own test
ALPHAS = (0.05, 0.1)
BUDGETS = (100, 150, 200, 250, 300, 400, 600)
GUIDED_CALLS = 4
STUDIES = os.path.join(REPO, "bench", "results", "studies")
MODELS = {
    # model: its full calibration's measurements, and a cheap run at 200 from the start (cost per pair)
    "tinyworld_caption": (["region_finish4_calibration/calibration_measurements.0-of-2.jsonl",
                           "region_finish4_calibration/calibration_measurements.1-of-2.jsonl"],
                          "caption_cheap_shallow_same_scene_at200.json"),
    "tinyworld (bundled)": (["lang2_region4_calibration/calibration_measurements.0-of-2.jsonl",
                             "lang2_region4_calibration/calibration_measurements.1-of-2.jsonl"],
                            "cheap_shallow_same_scene_at200.json"),
}


def most_powerful(n: int, alpha: float, rate: float, delta: float = DELTA) -> float:
    """Power of the randomised one-sided binomial test of "rate ≥ α" at level δ on n labels:
    reject below c, and at c with the chance γ that makes the level exactly δ."""
    cdf = lambda k, p: binomial_cdf(k, n, p) if k >= 0 else 0.0  # noqa: E731
    c = 0
    while c <= n and cdf(c, alpha) <= delta:
        c += 1
    if c > n:
        return 1.0
    at_c = cdf(c, alpha) - cdf(c - 1, alpha)
    gamma = (delta - cdf(c - 1, alpha)) / at_c if at_c > 0 else 0.0
    return cdf(c - 1, rate) + gamma * (cdf(c, rate) - cdf(c - 1, rate))


def betting_power(pairs: int, alpha: float, rate: float, draws: int = DRAWS, seed: int = 0) -> float:
    """Share of simulated calibrations whose clustered anytime-valid test (the cheap
    procedure's: a pair one cluster of its two labels) certifies α, labels independent at
    ``rate`` (the most favourable case for it)."""
    rng = np.random.default_rng(seed)
    fails = rng.random((draws, pairs, 2)) < rate
    return float(np.mean([RiskSequence.of([(int(f), 2) for f in run.sum(1)], max_cluster=2).rejects(alpha, DELTA)
                          for run in fails]))


def guided_labels(inst: dict) -> dict[float, int]:
    """Per depth share, the label of this direction's reuse with the guided 4-call finish and
    no region finish."""
    return {round(d["depth_fraction"], 2): int(d["label"]) for d in inst["depths"]
            if int(d.get("finish_calls", 0)) == GUIDED_CALLS and not d.get("token_share")}


def measured(files: list[str]):
    """Every measured direction of these files (under bench/results/studies)."""
    for name in files:
        with open(os.path.join(STUDIES, name)) as f:
            yield from (json.loads(line) for line in f)


def same_scene_rates(files: list[str]) -> dict:
    """Per depth share: guided-finish same-scene reuses measured, how many beyond tolerance, and
    pairs (groups) with both directions beyond tolerance there."""
    tally: dict[float, dict] = {}
    for inst in measured(files):
        if evidence_class(inst["features"]) != "same_scene":
            continue
        for depth, label in guided_labels(inst).items():
            t = tally.setdefault(depth, {"reuses": 0, "beyond": 0, "groups": {}})
            t["reuses"] += 1
            t["beyond"] += label
            t["groups"][inst["group"]] = t["groups"].get(inst["group"], 0) + label
    out = {}
    for depth, t in sorted(tally.items()):
        out[f"{depth:g}"] = {"reuses": t["reuses"], "beyond": t["beyond"], "rate": t["beyond"] / t["reuses"],
                             "pairs_both_beyond": sum(v >= 2 for v in t["groups"].values()),
                             "pairs_any_beyond": sum(v >= 1 for v in t["groups"].values())}
    return out


def study() -> dict:
    rows = []
    for model, (files, cheap) in MODELS.items():
        with open(os.path.join(STUDIES, cheap)) as f:
            run = json.load(f)["budgets"]["200"]
        per_pair = run["cost_generations"] / run["pairs"]
        rates = same_scene_rates(files)
        for depth, r in rates.items():
            for alpha in ALPHAS:
                pairs = {b: int(b // per_pair) for b in BUDGETS}
                rows.append({"model": model, "depth_fraction": float(depth), "alpha": alpha,
                             "rate": r["rate"], "reuses": r["reuses"], "beyond": r["beyond"],
                             "pairs_both_beyond": r["pairs_both_beyond"], "generations_per_pair": per_pair,
                             "power_by_budget": {f"{b}": most_powerful(2 * n, alpha, r["rate"]) for b, n in pairs.items()},
                             "power_one_label_a_pair": {f"{b}": most_powerful(n, alpha, r["rate"])
                                                        for b, n in pairs.items()},
                             "power_cheap_test": {f"{b}": betting_power(n, alpha, r["rate"]) for b, n in pairs.items()}})
    return {"delta": DELTA, "draws": DRAWS, "what": {
        "power_by_budget": "the chance that any level-δ certification from a calibration of this many "
                           "generation-equivalents certifies α for same-scene reuse at this depth, if the model's "
                           "rate there is the one its full calibration measured and a pair's two labels were "
                           "independent (the most powerful test: an upper bound)",
        "power_one_label_a_pair": "the same for a test that must hold however a pair's two labels depend on each "
                                  "other (at worst they are one label): the most powerful test on one label a pair",
        "power_cheap_test": "the cheap procedure's own test (clustered, anytime-valid), simulated with independent "
                            "labels at the rate"}, "rows": rows}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(STUDIES, "certification_power.json"))
    a = ap.parse_args(argv)
    result = study()
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    for r in result["rows"]:
        if r["depth_fraction"] in (0.5, 0.7, 0.8):
            p = r["power_by_budget"]
            q, c = r["power_one_label_a_pair"], r["power_cheap_test"]
            print(f"{r['model']:>20} depth {r['depth_fraction']:.1f} α {r['alpha']:.2f}: rate "
                  f"{r['beyond']}/{r['reuses']} = {r['rate']:.1%}; at 100/200/400 certified at best "
                  + " / ".join(f"{p[b]:.0%}" for b in ("100", "200", "400")) + ", clustered at best "
                  + " / ".join(f"{q[b]:.0%}" for b in ("100", "200", "400")) + ", by the cheap test "
                  + " / ".join(f"{c[b]:.0%}" for b in ("100", "200", "400")))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
