"""The cheap calibration's report in words: what was certified per cell, what was refused and
why, and what it cost."""
from __future__ import annotations

from ..gate import share_bin_text
from .meter import cost_text


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

