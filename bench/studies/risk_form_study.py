"""How well does each risk form rank the edits that miss tolerance, depth by depth?

    .venv/bin/python bench/studies/risk_form_study.py bench/results/studies/fill_on_m_calibration/calibration_measurements.*-of-2.jsonl
    # → bench/results/studies/risk_forms.json

Within the *other* evidence class at one depth, every reuse has the same depth term, so what
decides which of them a certified threshold accepts is how the evidence ranks them. For each
depth: the AUC of each evidence feature alone (above 0.5: more of it, more misses; below: the
other way), and of each form's logit fitted on the calibration's fit side
(``calibration.split``), read on the held-out side.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from carnator_core.calibration import fit as CAL  # noqa: E402
from carnator_core.gate import EVIDENCE, RISK_FORMS, evidence_class  # noqa: E402


def auc(scores: list[float], labels: list[int]) -> float | None:
    """P(a reuse that misses scores above one that does not), ties halved."""
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    if not pos or not neg:
        return None
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return round(wins / (len(pos) * len(neg)), 3)


def other_reuses(instances: list[dict], k: int) -> tuple[list[dict], list[int]]:
    """(features with this depth, labels) of the other-evidence reuses finished every step."""
    rows, labels = [], []
    for inst in instances:
        if evidence_class(inst["features"]) != "other":
            continue
        for d in inst["depths"]:
            if d["k"] == k and not d.get("finish_calls"):
                rows.append({**inst["features"], "depth_fraction": d["depth_fraction"]})
                labels.append(int(d["label"]))
    return rows, labels


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("measurements", nargs="+", help="calibration measurement files (JSONL)")
    ap.add_argument("--depths", nargs="+", type=int, default=[10, 12, 14, 16])
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "studies", "risk_forms.json"))
    a = ap.parse_args(argv)
    instances = [i for path in a.measurements for i in CAL.load_instances(path)]
    fit_side, held = CAL.split(instances, CAL.CERTIFY_SHARE)
    models = {form: CAL.fit(fit_side, 0.35, form=form) for form in RISK_FORMS}
    res = {"measurements": a.measurements, "held_out_pairs": len(held), "depths": {}}
    for k in a.depths:
        rows, labels = other_reuses(held, k)
        res["depths"][str(k)] = {
            "reuses": len(rows), "beyond_tolerance": sum(labels),
            "feature_auc": {e: auc([r[e] for r in rows], labels) for e in EVIDENCE},
            "form_auc": {form: auc([m.logit(r) for r in rows], labels) for form, m in models.items()}}
        d = res["depths"][str(k)]
        print(f"k={k}: {d['beyond_tolerance']}/{d['reuses']} beyond; features {d['feature_auc']}; forms {d['form_auc']}")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
