"""The cheap calibration's report: what was certified per cell, what was refused, why, and
roughly what more a refused budget would need; what it cost."""
from __future__ import annotations

from ..gate import share_bin_text
from .meter import cost_text
from .sequential import RiskSequence


def refused_budget(seq: RiskSequence, alpha: float, delta: float, max_cluster: int, in_cell: int,
                   cost_per_cell_pair: float | None = None, limit: int = 3000) -> dict:
    """Why a budget is refused, and the pairs landing in this cell that would certify it if
    labels kept failing at the rate measured so far (none failed yet: at least that many), with
    what they would cost (``cost_per_cell_pair``: generation-equivalents the pool spends per pair
    landing here): a rough guide for the next budget, not a promise."""
    labels, fails, clusters = sum(seq.counts), sum(seq.fails), len(seq.counts)
    rate = fails / labels if labels else 0.0
    out = {"clusters": clusters, "labels": int(labels), "failures": int(round(fails))}
    if fails and rate >= alpha:
        return {**out, "why": "at this rate more pairs will not certify it"}
    size = max(1, min(max_cluster, round(labels / clusters))) if clusters else max_cluster
    seen = list(zip(seq.fails, seq.counts))

    def certifies(extra: int) -> bool:  # the capital's running peak only grows with more pairs
        return RiskSequence.of(seen + [(rate * size, size)] * extra, max_cluster).rejects(alpha, delta)
    if not certifies(limit):
        extra = limit
    else:
        lo, extra = 0, limit  # the fewest extra pairs that certify: lo fails, extra certifies
        while extra - lo > 1:
            mid = (lo + extra) // 2
            lo, extra = (lo, mid) if certifies(mid) else (mid, extra)
    if extra >= limit:
        return {**out, "why": f"too few labels: more than {limit} more pairs in this cell at the rate so far"}
    # pairs landed here but not labelled at this threshold: a budget this small could not have
    # certified it, so its (shallower, dearer) decisions were left for a larger one
    why = "not labelled at this budget" if in_cell and not clusters else "too few labels"
    out.update(why=why, more_cell_pairs=extra, landed=in_cell)
    if cost_per_cell_pair:
        out["more_generations"] = round(extra * cost_per_cell_pair, 1)
    return out


def report_text(report: dict) -> str:
    tol = report.get("tolerance") or {}
    bounds = report.get("region_share_bounds") or []
    lines = [f"cheap calibration of model {str(report.get('model_fingerprint', ''))[:12]}: "
             f"{report['pairs']} prompt pairs → {report['measured_reuses']} reuses labelled, "
             f"{report['exceeded_tolerance']} beyond tolerance (PSNR on {tol.get('space')} < "
             f"{tol.get('psnr_bound')} dB); ranking transferred, thresholds certified per cell at "
             f"{1 - report['delta']:.0%} confidence, each pair one cluster"]
    if report.get("paraphrase_lead"):
        lines.append(f"the first {_n(report['paraphrase_lead'], 'pair')} were paraphrases: same-scene evidence "
                     "is certified first, the edits' cells get the pairs after them")
    for cell, rep in report["cells"].items():
        lines += _cell_lines(share_bin_text(cell, bounds), rep, report["certified"].get(cell) or [])
    if not any(report["certified"].values()):
        lines.append("nothing certified: no calibration file written (the measurements are kept; run it "
                     "again with a larger budget and it continues)")
    else:
        lines.append("a budget refused in a cell reuses nothing there at that budget (the gate says so)")
    lines += [f"note: {diff}" for diff in report.get("recipe_differences", [])]
    return "\n".join(lines + cost_text(report))


def _cell_lines(what: str, rep: dict, certified: list[str]) -> list[str]:
    if not rep["points"]:
        return [f"{what}: refused (the transferred ranking offers no threshold here)"]
    lines = []
    by_threshold: dict[float, list[str]] = {}
    for a in certified:
        by_threshold.setdefault(rep["budgets"][a]["threshold"], []).append(f"{float(a):.0%}")
    if by_threshold:
        lines.append(f"{what}: certified α = " + "; ".join(
            f"{', '.join(budgets)} (threshold {lam:.3g})" for lam, budgets in by_threshold.items()))
    groups: dict[tuple, list[str]] = {}  # refused budgets with the same evidence, on one line
    for a, r in rep["budgets"].items():
        if r["threshold"] is None and "clusters" in r:
            more = (f"≈ {r['more_generations']:.0f}" if r.get("more_generations")
                    else f"at least {r['more_cell_pairs']} pairs like it" if r.get("more_cell_pairs") else "")
            groups.setdefault((r["why"], r["clusters"], r["labels"], r["failures"], r.get("landed", 0)), []).append(
                f"{float(a):.0%}" + (f" ({more})" if more else ""))
    for (why, clusters, labels, failures, landed), budgets in groups.items():
        seen = (f"{_n(clusters, 'pair')}, {failures} of {labels} beyond tolerance" if clusters
                else f"{_n(landed, 'pair')} landed here" if landed else "no pair landed here yet")
        unit = " more generation-equivalents" if any("≈" in b for b in budgets) else ""
        first = budgets[0].replace(")", f"{unit})", 1) if unit else budgets[0]
        lines.append(f"{what}: refused at {', '.join([first] + budgets[1:])}: {why} ({seen})")
    absent = [f"{float(a):.0%}" for a, r in rep["budgets"].items() if r["threshold"] is None and "clusters" not in r]
    if absent:
        lines.append(f"{what}: the transferred ranking offers no threshold at {', '.join(absent)}")
    return lines


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("s" if count != 1 else "")

