"""Benchmark: certifying online from audits, replayed on measured reuses.

    python bench/studies/online_certification.py                       # the full replay (~1 min)
    python bench/studies/online_certification.py --requests 4000 --out /tmp/x.json   # smoke

Question: starting from a cheap calibration, do audits of live hits *extend* the gate's
certified thresholds (deeper reuse) while the traffic allows it, step back when it drifts,
and keep the anytime-valid bound honest throughout — and what do the audits cost?

A REPLAY OF MEASURED PAIRS, NOT LIVE MODEL RUNS. Every request is one candidate pair of the
tiny-world calibration measurements (bench/results/studies/lang2_region4_calibration/
calibration_measurements.*.jsonl: evidence features and, per depth, whether the reuse
finished every step missed tolerance). The pairs are split by group: a ranking is fitted on
one part (``fit.fit``, signed form), thresholds are certified on a small part
(``fit.certify_model``, Learn-then-Test at 90%: the cheap calibration), and the stream draws
the rest with replacement, in request order: the first half from the kinds that are
mostly paraphrases and unrelated scenes, the second half from editing sessions (the drift).
The gate, the audits (``--audit-rate`` of the hits) and the exploration one ladder point
beyond (``--explore-rate`` of the candidates, ``sequential.audit_plan``) run as
``audit.AuditLog.online`` would run them, with one ``sequential.GridCertifier`` per evidence
class, clustered by pair group: a group drawn again is the same measurement, so its labels
count as one cluster (at most ``--max-cluster``), and the evidence is the number of distinct
groups, not of draws. Because every depth of every pair was measured, the true risk of each
threshold on each half's traffic is known exactly and is written beside what was certified.
A request audited or explored costs one full generation (generation-equivalents below).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import random
from pathlib import Path

from study_paths import REPO  # noqa: E402 - the repository on the path

ROOT = Path(REPO)

from carnator_core.calibration import fit  # noqa: E402
from carnator_core.calibration.audit import ladder  # noqa: E402
from carnator_core.calibration.sequential import GridCertifier, audit_plan  # noqa: E402

MEASURED = ROOT / "bench" / "results" / "studies" / "lang2_region4_calibration"
CALM = ("compatible_far", "incompatible_close", "unrelated", "partial")  # first half
EDITING = ("edit_chain", "session_chain")                               # second half
# deeper same-scene reuses the ladder offers besides the certified thresholds (depth shares;
# the measured pairs stop at 0.8)
SAME_SCENE_DEPTHS = (0.5, 0.7, 0.8)


def load(folder: Path) -> list[dict]:
    """The measured pairs the gate could see (M within the region limit, finished depths)."""
    out = []
    for path in sorted(folder.glob("calibration_measurements.*.jsonl")):
        for line in path.read_text().splitlines():
            inst = json.loads(line)
            if (inst.get("kind") != "identical" and inst["features"]["region_fraction"] <= 0.5
                    and any(not d.get("finish_calls") for d in inst["depths"])):
                out.append(inst)
    return out


def split(instances: list[dict], seed: int, fit_share: float, calibration_share: float):
    groups = sorted({i["group"] for i in instances})
    random.Random(seed).shuffle(groups)
    a, b = int(fit_share * len(groups)), int((fit_share + calibration_share) * len(groups))
    part = {g: (0 if n < a else 1 if n < b else 2) for n, g in enumerate(groups)}
    return [[i for i in instances if part[i["group"]] == p] for p in range(3)]


def choices(model, inst: dict, grid: list[float]) -> list[tuple | None]:
    """Per ladder point, the reuse the gate runs there: the deepest finished depth whose score
    is ≤ the threshold, as (k, label, depth share), or None."""
    depths = sorted((d for d in inst["depths"] if not d.get("finish_calls")), key=lambda d: -d["k"])
    scored = [(model.score({**inst["features"], "depth_fraction": d["depth_fraction"]}), d) for d in depths]
    return [next(((d["k"], int(d["label"]), d["depth_fraction"]) for z, d in scored if z <= lam + 1e-9), None)
            for lam in grid]


def truth(pool: list[dict], grid: list[float]) -> list[dict]:
    """The exact risk at each ladder point on traffic drawn uniformly from ``pool``."""
    out = []
    for i in range(len(grid)):
        picked = [p["choices"][i] for p in pool if p["choices"][i] is not None]
        out.append({"threshold": grid[i], "accept_rate": len(picked) / len(pool) if pool else 0.0,
                    "risk": sum(c[1] for c in picked) / len(picked) if picked else None,
                    "mean_depth": sum(c[2] for c in picked) / len(picked) if picked else None})
    return out


def replay(model, pools: list[list[dict]], grids: dict, offline: dict, alpha: float, a) -> dict:
    rng = random.Random(a.seed + 1)
    certs = {c: GridCertifier(grids[c], offline[c], alpha, a.delta, max_cluster=a.max_cluster,
                              horizon=a.horizon) for c in grids}
    where = {c: (g.operating(), g.beyond()) for c, g in certs.items()}
    truths = [{c: truth([p for p in pool if p["cell"] == c], grids[c]) for c in grids} for pool in pools]
    served = [[0, 0, 0.0], [0, 0, 0.0]]  # per half: reuses served, beyond tolerance, depth sum
    cost, labelled, series, changes = 0, 0, [], []
    window = [0, 0]
    for t in range(a.requests):
        half = 0 if t < a.requests // 2 else 1
        inst = rng.choice(pools[half])
        c = inst["cell"]
        op, nxt = where[c]
        now = inst["choices"][op] if op >= 0 else None
        beyond = inst["choices"][nxt] if nxt is not None else None
        plan = audit_plan(rng.random(), now, beyond, a.audit_rate, a.explore_rate)
        if plan["serve"] == "reuse":
            served[half][0] += 1
            served[half][1] += now[1]
            served[half][2] += now[2]
            window[0] += 1
            window[1] += now[1]
        for reuse, feeds in plan["label"].items():
            certs[c].observe([op if f == "now" else nxt for f in feeds], reuse[1], inst["group"])
            labelled += 1
        if plan["label"]:  # the request is computed in full once, whatever it labels
            cost += 1
            was, where[c] = where[c], (certs[c].operating(), certs[c].beyond())
            if was[0] != where[c][0]:
                changes.append({"request": t + 1, "class": c, "from": _at(grids[c], was[0]),
                                "to": _at(grids[c], where[c][0]), "audits": certs[c].audits})
        if (t + 1) % a.every == 0 or t + 1 == a.requests:
            series.append(_point(t + 1, half, certs, where, truths[half], served[half], window, cost))
            window = [0, 0]
    halves = [{"traffic": kinds, "reuses_served": s[0], "beyond_tolerance": s[1],
               "false_accept_rate": s[1] / s[0] if s[0] else None,
               "mean_depth_served": s[2] / s[0] if s[0] else None,
               "static_cheap_calibration": {c: _static(truths[h][c], offline[c]) for c in grids},
               # what the cheap calibration alone would serve on this half, in expectation
               "static_reuses_expected": round(sum(
                   _static(truths[h][c], offline[c])["accept_rate"] * (a.requests // 2)
                   * sum(p["cell"] == c for p in pools[h]) / len(pools[h]) for c in grids))}
              for h, (kinds, s) in enumerate(zip((CALM, EDITING), served))]
    return {"alpha": alpha, "halves": halves, "labelled": labelled, "cost_generations": cost,
            "threshold_changes": changes, "series": series,
            "final": {c: g.summary() for c, g in certs.items()},
            "truth": {f"half_{h + 1}": truths[h] for h in range(2)}}


def _at(grid, i):
    return None if i is None or i < 0 else grid[i]


def _static(table: list[dict], offline: int) -> dict:
    """What the cheap calibration alone would give on this half (no online certificate)."""
    return table[offline] if offline >= 0 else {"threshold": None, "accept_rate": 0.0, "risk": None}


def _point(t, half, certs, where, truths, served, window, cost) -> dict:
    point = {"request": t, "half": half + 1, "cost_generations": cost,
             "false_accept_rate_half": served[1] / served[0] if served[0] else None,
             "false_accept_rate_window": window[1] / window[0] if window[0] else None, "classes": {}}
    for c, g in certs.items():
        op = where[c][0]
        test = g.tests[op] if op >= 0 else None
        point["classes"][c] = {
            "operating": _at(g.grid, op), "certified": _at(g.grid, g.certified()),
            "true_risk": truths[c][op]["risk"] if op >= 0 else None,
            "mean_depth": truths[c][op]["mean_depth"] if op >= 0 else None,
            "upper": test.upper(g.delta) if test is not None and test.counts else None,
            "audits": g.audits}
    return point


def plot(result: dict, path: Path) -> str:
    """Per budget (a row) two panels, drawn with Pillow (matplotlib is not in the environment):
    the true risk and the anytime upper bound at each class's operating threshold against α,
    and the mean depth share of the reuse there."""
    try:
        spec = importlib.util.spec_from_file_location("bench_tinyworld", ROOT / "bench" / "tinyworld.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)  # its Pillow line plot
        from PIL import Image
    except Exception as e:  # the plot is a convenience; the JSON is the result
        return f"PNG skipped: {e!r}"
    rows = []
    for budget in result["budgets"]:
        alpha, series = budget["alpha"], budget["series"]
        x = [p["request"] / 1000 for p in series]
        risk, depth = [], []
        for c in series[0]["classes"]:
            ys = [p["classes"][c] for p in series]
            risk.append((f"{c} true risk", [(a, y["true_risk"]) for a, y in zip(x, ys) if y["true_risk"] is not None]))
            risk.append((f"{c} upper bound", [(a, min(y["upper"], 0.3)) for a, y in zip(x, ys) if y["upper"] is not None]))
            depth.append((f"{c}", [(a, y["mean_depth"] or 0.0) for a, y in zip(x, ys)]))
        risk.append((f"alpha {alpha:g}", [(0, alpha), (x[-1], alpha)]))
        panels = []
        for name, lines, ylabel in (("risk", risk, f"risk at the threshold used (alpha={alpha:g}; bound capped at 0.3)"),
                                    ("depth", depth, f"mean depth share of the reuse (alpha={alpha:g}; 0 = none)")):
            tmp = path.with_suffix(f".{name}.png")
            mod._pil_plot(lines, "requests, thousands (drift at half)", ylabel, tmp,
                          legend="bottom left" if name == "depth" else "top right")
            panels.append(Image.open(tmp))
            tmp.unlink()
        rows.append(panels)
    w, h = sum(p.width for p in rows[0]), rows[0][0].height
    canvas = Image.new("RGB", (w, h * len(rows)), "white")
    for r, panels in enumerate(rows):
        for c, panel in enumerate(panels):
            canvas.paste(panel, (c * panels[0].width, r * h))
    canvas.save(path)
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=60_000, help="requests in the stream (drift at half)")
    ap.add_argument("--audit-rate", type=float, default=0.05, help="share of served hits audited")
    ap.add_argument("--explore-rate", type=float, default=0.05,
                    help="share of candidates explored one ladder point beyond the gate")
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.05, 0.1])
    ap.add_argument("--delta", type=float, default=0.1)
    ap.add_argument("--fit-share", type=float, default=0.25, help="share of pair groups the ranking is fitted on")
    ap.add_argument("--calibration-share", type=float, default=0.1,
                    help="share of pair groups the cheap calibration certifies on")
    ap.add_argument("--max-cluster", type=int, default=2,
                    help="labels per cluster (a pair group: its two directions)")
    ap.add_argument("--horizon", type=int, default=100, help="labels after which a cluster closes")
    ap.add_argument("--every", type=int, default=1000, help="requests between points of the series")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "online_certification.json"))
    a = ap.parse_args()

    instances = load(MEASURED)
    fit_part, cal_part, pool = split(instances, a.seed, a.fit_share, a.calibration_share)
    model = fit.fit(fit_part, region_threshold=0.35, form="signed")
    report = fit.certify_model(model, cal_part, delta=a.delta)
    cells = sorted({model.cell(i["features"]) for i in pool})
    grids = {c: ladder(model, c, SAME_SCENE_DEPTHS if c == "same_scene" else ()) for c in cells}
    grids = {c: g for c, g in grids.items() if g}
    for inst in pool:
        inst["cell"] = model.cell(inst["features"])
        inst["choices"] = choices(model, inst, grids.get(inst["cell"], []))
    pools = [[i for i in pool if i["kind"] in kinds and i["cell"] in grids] for kinds in (CALM, EDITING)]
    budgets = []
    for alpha in a.budgets:
        offline = {}
        for c, g in grids.items():
            got = model.threshold_for(alpha, c)
            offline[c] = g.index(got[1]) if got else -1
        budgets.append(replay(model, pools, grids, offline, alpha, a))
    result = {
        "what": "a REPLAY of measured candidate pairs (tiny-world calibration measurements), not "
                "live model runs: each request is a measured pair drawn with replacement, its "
                "reuse labels are the measured ones; the true risk of every threshold on each half "
                "of the stream is computed exactly from the pairs",
        "measurements": str(MEASURED.relative_to(ROOT)),
        "settings": {k: v for k, v in vars(a).items() if k != "out"},
        "pairs": {"fit": len(fit_part), "cheap_calibration": len(cal_part), "stream_pool": len(pool),
                  "stream_groups": [len({i["group"] for i in p}) for p in pools],
                  "stream_pool_per_half": [len(p) for p in pools]},
        "cheap_calibration": {c: {b: r["threshold"] for b, r in v["budgets"].items()}
                              for c, v in report["classes"].items()},
        "ladders": grids,
        "cost_unit": "generation-equivalents: a request with a labelled reuse (audit or exploration) "
                     "is computed in full once (the explored reuse's own partial finish is not counted)",
        "budgets": budgets,
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result["plot"] = plot(result, out.with_suffix(".png"))
    out.write_text(json.dumps(result, indent=1))
    print(summary(result))


def summary(result: dict) -> str:
    lines = [result["what"], f"pairs {result['pairs']}; cheap calibration {result['cheap_calibration']}"]
    for b in result["budgets"]:
        lines.append(f"α = {b['alpha']:g}: {b['labelled']} reuses labelled in {b['cost_generations']} "
                     f"requests computed in full besides (generation-equivalents)")
        for h, half in enumerate(b["halves"]):
            static = "; ".join(f"{c} λ={s['threshold'] if s['threshold'] is None else round(s['threshold'], 3)} "
                               f"risk {_pct(s['risk'])}" for c, s in half["static_cheap_calibration"].items())
            lines.append(f"  half {h + 1} ({'/'.join(half['traffic'])}): {half['reuses_served']} reuses served, "
                         f"false accepts {_pct(half['false_accept_rate'])}, mean depth "
                         f"{_num(half['mean_depth_served'])} | cheap calibration alone: "
                         f"{half['static_reuses_expected']} reuses; {static}")
        for ch in b["threshold_changes"]:
            lines.append(f"  request {ch['request']}: {ch['class']} {_num(ch['from'])} → {_num(ch['to'])} "
                         f"after {ch['audits']} labelled reuses")
    lines.append(f"plot: {result['plot']}")
    return "\n".join(lines)


def _pct(v):
    return "—" if v is None else f"{v:.1%}"


def _num(v):
    return "none" if v is None else f"{v:.3g}"


if __name__ == "__main__":
    main()
