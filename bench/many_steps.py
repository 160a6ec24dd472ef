"""Does the risk budget hold at many steps on editing sessions no calibration saw?

    # unseen_edits (scripts/make_workloads.py) at N = 20, 30 and 50, each N with its own
    # committed calibration, then the committed editing and serving workloads at N = 50, into
    # one file, one run after the other on one thread, in the background:
    setsid nohup sh -c '.venv/bin/python bench/many_steps.py && .venv/bin/python bench/many_steps.py \
        --workloads iterate serve iterate_replicate novel --steps 50' > /tmp/many_steps.log 2>&1 &
    .venv/bin/python bench/many_steps.py --limit 12 --steps 20 --out /tmp/many.json  # a quick look
    # one N served with another calibration (e.g. refitted with --delta: every cell at once)
    .venv/bin/python bench/many_steps.py --steps 30 --risk-model DIR/calibration/<fingerprint>.probe0.05.json \
        --out bench/results/studies/many_steps_n30_simultaneous.json

Each (workload, N) is one run of bench/tinyworld.py in a subprocess (probe 0.05, ``--risk-model
auto``: the bundled calibration measured at that N, budgets 0.02 / 0.05 / 0.1, per-request
records, no sparse system, no plots); its result file goes to ``--parts`` and its summary into
``--out`` as soon as it ends, so a run cut short keeps what it measured, and a run started
again skips the parts already summarised under the same calibration, gate code and limit
(``--force`` measures them again).

The summary, per (workload, N) and budget α: requests, accepted reuses (gate hits and exact
repeats), false accepts (beyond tolerance, as bench/tinyworld.py judges them) with a
Clopper–Pearson 95% interval, the same over gate hits alone, and the gate-hit speedup in
steps; then the gate hits split by the share of the tokens the reuse computes itself (region
M after widening, the plan's ``features["reuse_share"]``) into < 25%, 25–50%, 50–75% and
> 75%, each bin flagged where it holds at least ``--min-bin-hits`` hits and its rate is above
α. Records without ``reuse_share`` (a gate before the share cells) give the bins as
"unknown"; the widened region's share of the tiles (``region_fraction``, every gate) is
binned beside as a stand-in. Beside each: the calibration file (path, sha256) and its
certified thresholds at that α, cell by cell, and where an earlier measurement of the
same workload and N is known (``--baseline``, or the committed results of
bench/results/studies/ for the four committed workloads) the speed given up against it.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (os.path.join(REPO, "tests"), REPO):  # REPO first: the packages, not bench/ (tinyworld.py)
    if _p not in sys.path:
        sys.path.insert(0, _p)
RESULTS = os.path.join(REPO, "bench", "results")
DEFAULT_MODEL = os.path.join(REPO, "models", "tinyworld", "carnator_tinyworld_wan21.safetensors")
BUDGETS = (0.02, 0.05, 0.1)
SHARE_BINS = ((0.0, 0.25, "<25%"), (0.25, 0.5, "25-50%"), (0.5, 0.75, "50-75%"), (0.75, 1.0, ">75%"))
# Earlier measurements of the committed workloads with the probe-0.05 calibration of each N
# (docs/results.md, "The deeper recipe" and "More steps"): the speed the change gives up.
STUDY_BASELINES = {20: "tinyworld_lang2_region4_{}.json", 30: "tinyworld_lang2_region4_{}_n30_cal30.json",
                   50: "tinyworld_lang2_region4_{}_n50_cal50.json"}
GATE_CODE = ("carnator_core/gate.py", "carnator_core/pipeline.py")


def _bench():
    """bench/tinyworld.py as a module (its name would shadow the tinyworld package)."""
    name = "bench_tinyworld_for_many_steps"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "bench", "tinyworld.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def gate_code() -> dict:
    """The gate's code a part was measured with (a change there makes a part stale)."""
    return {p: sha256(os.path.join(REPO, p))[:16] for p in GATE_CODE}


def git_state() -> dict:
    def git(*args):
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
        return out.stdout.rstrip() if out.returncode == 0 else None
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "carnator_core", "bench/tinyworld.py")
    return {"commit": git("rev-parse", "HEAD"), "uncommitted": dirty.splitlines() if dirty else []}


# ------------------------------------------------------------------ calibration
def calibration_for(fingerprint: str, probe: float, steps: int) -> str | None:
    """The file ``--risk-model auto`` picks for this model, probe and N."""
    return _bench().default_risk_model(fingerprint, probe, steps)


def certified(thresholds: dict, alpha: float) -> dict:
    """Each cell's certified (budget α' ≤ α, threshold) the gate would use at α, side by side
    (RiskModel.threshold_for: the largest certified α' not above α); None: nothing certified."""
    out = {}
    for key in sorted(thresholds):
        fits = [(float(a), lam) for a, lam in thresholds[key].items() if float(a) <= alpha + 1e-12]
        out[key] = list(max(fits)) if fits else None
    return out


def calibration_block(path: str | None, budgets) -> dict | None:
    if not path:
        return None
    with open(path) as f:
        cal = json.load(f)
    return {"path": os.path.relpath(path, REPO), "sha256": sha256(path),
            "measured_steps": cal.get("measured_steps"),
            "region_share_bounds": cal.get("region_share_bounds"),
            "certified_at": {f"{b:g}": certified(cal.get("thresholds", {}), b) for b in budgets}}


# ------------------------------------------------------------------ summaries
def interval(k: int, n: int) -> list[float] | None:
    from carnator_core.calibration.risk_control import clopper_pearson_lower, clopper_pearson_upper
    return [clopper_pearson_lower(k, n, 0.025), clopper_pearson_upper(k, n, 0.025)] if n else None


def beyond(r: dict, psnr_bound: float) -> bool:
    """bench/tinyworld.py's false accept: PSNR to the full computation below the bound, or the
    checker wrong where the full computation is right."""
    return r["psnr"] < psnr_bound or (r["ok_full"] and not r["ok"])


def p_at_alpha(k: int, n: int, alpha: float) -> float | None:
    """P(at least k false accepts in n | a rate of exactly α): one-sided, exact. A bin whose
    rate sits above α with a large p is what a rate at α gives by chance; a small p says the
    rate is above α."""
    from carnator_core.calibration.risk_control import binomial_cdf
    return (1.0 - binomial_cdf(k - 1, n, alpha) if k else 1.0) if n else None


def rate_block(recs: list[dict], psnr_bound: float, alpha: float) -> dict:
    k = sum(beyond(r, psnr_bound) for r in recs)
    return {"count": len(recs), "false_accepts": k, "rate": k / len(recs) if recs else None,
            "ci95": interval(k, len(recs)), "above_alpha": bool(recs) and k / len(recs) > alpha,
            "p_at_alpha": p_at_alpha(k, len(recs), alpha)}


def share_of(r: dict, key: str) -> float | None:
    if key == "region_fraction":
        return r.get("region_fraction")
    return (r.get("features") or {}).get(key)


def share_bin(share: float) -> str:
    return next((name for _, hi, name in SHARE_BINS if share <= hi + 1e-9), SHARE_BINS[-1][2])


def share_bins(hits: list[dict], key: str, psnr_bound: float, alpha: float, min_hits: int) -> dict:
    """Gate hits by the share ``key`` of each: per bin its count, false accepts, rate and
    interval, and ``over_alpha_with_30_hits`` (``min_hits`` or more hits, rate above α)."""
    if any(share_of(r, key) is None for r in hits):
        return {"status": "unknown", "why": f"{sum(share_of(r, key) is None for r in hits)} of "
                f"{len(hits)} gate hits carry no {key} (measured before the gate recorded it)"}
    bins = {}
    for lo, hi, name in SHARE_BINS:  # (lo, hi], the first from 0: the gate's share_cell bins
        inside = [r for r in hits if name == share_bin(share_of(r, key))]
        block = rate_block(inside, psnr_bound, alpha)
        block["other_evidence"] = sum(r.get("same_scene") is False for r in inside)
        block["over_alpha_with_30_hits"] = block["count"] >= min_hits and block["above_alpha"]
        bins[name] = block
    return {"status": "measured", "bins": bins,
            "holds": not any(b["over_alpha_with_30_hits"] for b in bins.values())}


def budget_row(recs: list[dict], sweep_row: dict, psnr_bound: float, alpha: float, min_hits: int) -> dict:
    accepted = [r for r in recs if r["outcome"] in ("hit", "exact")]
    hits = [r for r in recs if r["outcome"] == "hit"]
    acc, gate = rate_block(accepted, psnr_bound, alpha), rate_block(hits, psnr_bound, alpha)
    fast = speed(recs, psnr_bound)
    deep = [r for r in hits if r.get("same_scene") is False]
    return {
        "requests": len(recs), "accepted_reuses": len(accepted), "gate_hits": len(hits),
        "exact_repeats": len(accepted) - len(hits),
        "false_accepts": acc["false_accepts"], "false_accept_rate": acc["rate"], "ci95": acc["ci95"],
        "holds": not acc["above_alpha"],
        "gate_hit_false_accepts": gate["false_accepts"], "gate_hit_false_accept_rate": gate["rate"],
        "gate_hit_ci95": gate["ci95"],
        "hit_rate": fast["hit_rate"],
        # steps of a full computation over the steps computed (bench/tinyworld.py's
        # steps_speedup_hits), and the same from the model's metered work
        "gate_hit_speedup_steps": fast["gate_hit_speedup_steps"],
        "gate_hit_speedup_measured": sweep_row.get("compute_speedup_hits"),
        "workload_speedup_steps": fast["workload_speedup_steps"],
        "gate_hit_speedup_wall": sweep_row.get("gate_hit_speedup"),
        "mean_reuse_step": sweep_row.get("mean_reuse_step"),
        "other_evidence_hits": len(deep),
        "psnr_hits_mean": sweep_row.get("psnr_hits_mean"),
        "by_reuse_share": share_bins(hits, "reuse_share", psnr_bound, alpha, min_hits),
        # every gate records the widened region's share of the tiles: the stand-in above
        "by_widened_tile_share": share_bins(hits, "region_fraction", psnr_bound, alpha, min_hits),
    }


def summarise(part: dict, workload: str, budgets, min_hits: int) -> dict:
    bound = part["settings"]["psnr_bound"]
    sweep = {f"{p['risk_budget']:g}": p for p in part["sweeps"][workload]["carnator"]}
    records = part.get("records", {}).get(workload)
    if not records:
        raise SystemExit(f"the part for {workload} has no per-request records (--records)")
    return {f"{b:g}": budget_row(records[f"{b:g}"], sweep[f"{b:g}"], bound, b, min_hits) for b in budgets}


def edits_of(part: dict, workload: str, psnr_bound: float) -> dict:
    """Per budget, the accepted reuses and false accepts of each edit kind."""
    out = {}
    for b, recs in part["records"][workload].items():
        kinds: dict = {}
        for r in recs:
            if r["outcome"] in ("hit", "exact"):
                k = kinds.setdefault(r.get("edit") or "?", [0, 0])
                k[0], k[1] = k[0] + 1, k[1] + int(beyond(r, psnr_bound))
        out[b] = {k: {"accepted": n, "false_accepts": f} for k, (n, f) in sorted(kinds.items())}
    return out


# ------------------------------------------------------------------ baselines
def speed(recs: list[dict], psnr_bound: float) -> dict:
    """The figures a run is compared on: hit rate, steps of a full computation over the steps
    computed (gate hits alone, as bench/tinyworld.py's steps_speedup_hits; the whole
    workload), false-accept rate."""
    hits = [r for r in recs if r["outcome"] == "hit"]
    accepted = [r for r in recs if r["outcome"] in ("hit", "exact")]

    def ratio(rs):
        done = sum(r["steps_computed"] for r in rs)
        return sum(r["steps_total"] for r in rs) / done if rs and done > 0 else None
    return {"hit_rate": len(accepted) / len(recs) if recs else None,
            "gate_hit_speedup_steps": ratio(hits), "workload_speedup_steps": ratio(recs),
            "false_accept_rate": (sum(beyond(r, psnr_bound) for r in accepted) / len(accepted)
                                  if accepted else None)}


def baseline_rows(path: str, workload: str, steps: int, limit: int | None) -> dict | None:
    """α -> an earlier run's figures (``speed``) on the same workload, N and requests: from a
    many_steps JSON (its part's records) or a bench/tinyworld.py result with records (the
    first ``limit`` of them: a request's outcome depends on the requests before it only)."""
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        data = json.load(f)
    if "runs" in data:  # a many_steps.json: read its part
        run = data["runs"].get(f"{workload}/n{steps}")
        if not run or run.get("limit") != limit or not os.path.isfile(os.path.join(REPO, run["part"])):
            return None
        return baseline_rows(os.path.join(REPO, run["part"]), workload, steps, limit)
    records = data.get("records", {}).get(workload)
    if data.get("settings", {}).get("steps") != steps or not records:
        return None
    bound = data["settings"]["psnr_bound"]
    return {a: speed(recs[:limit] if limit else recs, bound) for a, recs in records.items()}


def given_up(now: dict, before: dict | None, source: str | None) -> dict | None:
    """The speed the change gave up against an earlier run: before, after, and 1 − after/before."""
    if not before:
        return None
    out = {"baseline": source}
    for key in ("gate_hit_speedup_steps", "workload_speedup_steps", "hit_rate", "false_accept_rate"):
        b, a = before.get(key), now.get(key)
        out[key] = {"before": b, "after": a}
        if key.endswith("speedup_steps") and a and b:
            out[key]["given_up"] = 1.0 - a / b
    return out


def find_baseline(workload: str, steps: int, limit: int | None,
                  extra: list[str]) -> tuple[dict | None, str | None]:
    candidates = list(extra)
    if steps in STUDY_BASELINES:
        candidates.append(os.path.join(RESULTS, "studies", STUDY_BASELINES[steps].format(workload)))
    for path in candidates:
        rows = baseline_rows(path, workload, steps, limit)
        if rows:
            return rows, os.path.relpath(path, REPO)
    return None, None


# ------------------------------------------------------------------ running
def load(path: str) -> dict:
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    return {"runs": {}}


def save(results: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
    os.replace(tmp, path)


def save_run(path: str, key: str, run: dict, settings: dict) -> dict:
    """Put one part's summary into ``path`` as it is on disk now (another runner writing the
    same file keeps its parts), atomically; the file as written."""
    results = load(path)
    results["settings"] = settings
    results.setdefault("runs", {})[key] = run
    save(results, path)
    return results


def workload_file(given: str) -> str:
    return given if os.path.isfile(given) else os.path.join(REPO, "bench", "workloads", f"{given}.jsonl")


def stale(run: dict | None, calibration: dict | None, limit: int | None, requests: str) -> str | None:
    """Why a summarised part must be measured again; None: it still stands."""
    if run is None:
        return "not measured yet"
    if run.get("workload_sha256") != requests:
        return "its workload file changed"
    if (run.get("calibration") or {}).get("sha256") != (calibration or {}).get("sha256"):
        return "its calibration file changed"
    if run.get("gate_code") != gate_code():
        return "the gate's code changed"
    if run.get("limit") != limit:
        return f"it was measured with --limit {run.get('limit')}"
    return None


def measure(workload: str, steps: int, a, part_path: str) -> float:
    """One bench/tinyworld.py run in a subprocess; its seconds."""
    cmd = [sys.executable, os.path.join(REPO, "bench", "tinyworld.py"), workload,
           "--model", a.model, "--steps", str(steps), "--probe-fraction", f"{a.probe_fraction:g}",
           "--risk-model", a.risk_model, "--budgets", *[f"{b:g}" for b in a.budgets],
           "--main-budget", f"{a.budgets[len(a.budgets) // 2]:g}", "--records", "--no-plots",
           "--no-sparse-system", "--threads", str(a.threads), "--out", part_path,
           # the text-similarity baseline at one threshold only: this question needs none, and
           # its sweep of eleven thresholds costs a third of the run
           "--thresholds", "0.9"]
    if a.limit:
        cmd += ["--limit", str(a.limit)]
    print("$ " + " ".join(os.path.relpath(c, REPO) if c.startswith(REPO) else c for c in cmd), flush=True)
    t0 = time.time()
    subprocess.run(cmd, cwd=REPO, check=True)
    return time.time() - t0


def measured_before(part_path: str, code: dict, limit: int | None, steps: int,
                    requests: str) -> float | None:
    """The seconds of a part already measured with this gate code, limit, N and workload file
    (a run that stopped after measuring it), else None."""
    try:
        with open(part_path + ".meta") as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    same = ((meta.get("gate_code"), meta.get("limit"), meta.get("steps"), meta.get("workload_sha256"))
            == (code, limit, steps, requests))
    return meta.get("seconds") if same and os.path.isfile(part_path) else None


def fingerprint_of(results: dict, model: str) -> str | None:
    """The model's fingerprint (names its calibrations) from an earlier part; None before any."""
    return next((run["fingerprint"] for run in results.get("runs", {}).values()
                 if run.get("model") == os.path.relpath(model, REPO) and run.get("fingerprint")), None)


def table(results: dict) -> str:
    head = (f"{'workload/N':22s} {'α':>5s} {'req':>4s} {'acc':>4s} {'FA':>3s} {'rate':>6s} "
            f"{'95% CI':>14s} {'hits×':>6s} {'share bins (hits/FA)':s}")
    out = [head, "-" * len(head)]
    for key, run in results["runs"].items():
        for a, row in run["budgets"].items():
            ci = row["ci95"]
            bins = row["by_reuse_share"]
            if bins["status"] == "measured":
                text = " ".join(f"{n}:{b['count']}/{b['false_accepts']}" + ("!" if b["over_alpha_with_30_hits"] else "")
                                for n, b in bins["bins"].items())
            else:
                tiles = row["by_widened_tile_share"]
                text = "unknown; tiles " + " ".join(f"{n}:{b['count']}/{b['false_accepts']}"
                                                    for n, b in tiles.get("bins", {}).items())
            rate = row["false_accept_rate"]
            out.append(f"{key:22s} {a:>5s} {row['requests']:4d} {row['accepted_reuses']:4d} "
                       f"{row['false_accepts']:3d} {'—' if rate is None else f'{100 * rate:5.1f}%':>6s} "
                       f"{'—' if ci is None else f'[{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]':>14s} "
                       f"{row['gate_hit_speedup_steps'] or 0:6.2f} {text}")
    return "\n".join(out)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="+", default=["unseen_edits"],
                    help="workload names under bench/workloads or .jsonl paths (default: unseen_edits)")
    ap.add_argument("--steps", type=int, nargs="+", default=[20, 30, 50], help="the N to measure at")
    ap.add_argument("--budgets", type=float, nargs="+", default=list(BUDGETS))
    ap.add_argument("--probe-fraction", type=float, default=0.05)
    ap.add_argument("--risk-model", default="auto", metavar="JSON",
                    help="the calibration to serve with at every N in --steps (default auto: the bundled one "
                         "for each N); at an N it was not measured at, the gate carries its depths over "
                         "by share of the steps, as it does for a request of an N with no file of its "
                         "own. The run records the file's measured_steps")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each run")
    ap.add_argument("--limit", type=int, default=None, help="first requests of each workload only")
    ap.add_argument("--min-bin-hits", type=int, default=30,
                    help="a share bin is judged against α from this many gate hits")
    ap.add_argument("--baseline", nargs="*", default=[], metavar="JSON",
                    help="earlier results to report the speed given up against (a many_steps JSON or a "
                         "bench/tinyworld.py result); the committed studies' results are looked up too")
    ap.add_argument("--out", default=os.path.join(RESULTS, "many_steps.json"))
    ap.add_argument("--parts", default=None,
                    help="folder of each run's bench/tinyworld.py result (default: beside --out, "
                         "<out name>_parts/)")
    ap.add_argument("--force", action="store_true", help="measure parts already in --out again")
    a = ap.parse_args(argv)
    a.budgets = sorted(a.budgets)
    parts = a.parts or os.path.splitext(os.path.abspath(a.out))[0] + "_parts"
    os.makedirs(parts, exist_ok=True)
    results = load(a.out)
    results["settings"] = {"model": os.path.relpath(a.model, REPO), "probe_fraction": a.probe_fraction,
                           "budgets": a.budgets, "threads": a.threads, "min_bin_hits": a.min_bin_hits,
                           "share_bins": [name for _, _, name in SHARE_BINS],
                           "share": "features.reuse_share of each gate hit's plan: the share of the "
                                    "tokens the reuse computes itself (region M after widening)",
                           "parts": os.path.relpath(parts, REPO)}
    for steps in a.steps:
        for given in a.workloads:
            workload = os.path.splitext(os.path.basename(given))[0]  # bench/tinyworld.py's name for it
            key = f"{workload}/n{steps}"
            fingerprint = fingerprint_of(results, a.model)  # None: no part yet, nothing to skip
            if a.risk_model != "auto":
                expected = calibration_block(os.path.abspath(a.risk_model), a.budgets)
            else:
                expected = calibration_block(calibration_for(fingerprint, a.probe_fraction, steps),
                                             a.budgets) if fingerprint else None
            requests = sha256(workload_file(given))
            why = "--force" if a.force else stale(results["runs"].get(key), expected, a.limit, requests)
            if why is None:
                print(f"[{key}] already measured with this calibration and gate: skipped", flush=True)
                continue
            print(f"[{key}] measuring ({why}); calibration "
                  f"{expected['path'] if expected else 'as --risk-model auto finds it'}", flush=True)
            part_path = os.path.join(parts, f"{workload}_n{steps}.json")
            code = gate_code()  # as it ran: a change during the run makes the part stale
            seconds = measured_before(part_path, code, a.limit, steps, requests) if not a.force else None
            if seconds is None:
                seconds = measure(given, steps, a, part_path)
                save({"gate_code": code, "limit": a.limit, "steps": steps, "workload_sha256": requests,
                      "seconds": seconds}, part_path + ".meta")
            else:
                print(f"[{key}] summarising the part measured before ({part_path})", flush=True)
            with open(part_path) as f:
                part = json.load(f)
            used = part["settings"].get("calibration")
            calibration = calibration_block(os.path.join(REPO, used["path"]), a.budgets) if used else None
            if calibration is None or (expected and expected["sha256"] != calibration["sha256"]):
                raise SystemExit(f"[{key}] bench/tinyworld.py ran with calibration {used}, expected "
                                 f"{expected and expected['path']}: no calibration for N = {steps} and probe "
                                 f"{a.probe_fraction:g} in models/calibration/?")
            budgets = summarise(part, workload, a.budgets, a.min_bin_hits)
            before, source = find_baseline(workload, steps, a.limit, a.baseline)
            for alpha, row in budgets.items():
                row["speed_given_up"] = given_up(row, (before or {}).get(alpha), source)
            n = budgets[f"{a.budgets[0]:g}"]["requests"]
            results["runs"][key] = {
                "workload": workload, "workload_sha256": requests, "steps": steps, "limit": a.limit,
                "requests": n,
                "model": os.path.relpath(a.model, REPO), "fingerprint": part["settings"]["fingerprint"],
                "calibration": calibration, "gate_code": code, "git": git_state(),
                "part": os.path.relpath(part_path, REPO), "seconds": round(seconds, 1),
                "seconds_per_request": round(seconds / n, 2) if n else None,
                "holds": {alpha: {"false_accepts_within_alpha": row["holds"],
                                  "no_share_bin_over_alpha": row["by_reuse_share"].get("holds", "unknown")}
                          for alpha, row in budgets.items()},
                "budgets": budgets, "edits": edits_of(part, workload, part["settings"]["psnr_bound"])}
            results = save_run(a.out, key, results["runs"][key], results["settings"])
            print(table({"runs": {key: results["runs"][key]}}), flush=True)
            print(f"[{key}] {seconds:.0f} s; wrote {a.out}", flush=True)
    print(table(results))
    return results


if __name__ == "__main__":
    main()
