"""What a person needs to know about a model's gate: calibrated or not, from what, what
live audits measured against α, and what the online certificate changed. Read by the node
summary and the cache tab."""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

from . import audit, online
from ..keys import shape_str
from ..gate import (CALIBRATION_NAME, DEFAULT_PROBE_FRACTION, UNNAMED_PROBE_FRACTION, RiskModel, calibrated_probes,
                   calibrated_steps, calibration_in_use, gate_model_for, same_probe)


FINGERPRINT = re.compile(r"[0-9a-f]{32}")  # comfy_adapter.model_fingerprint's form


def model_status(cache_folder: str | Path, fingerprint: str, model: RiskModel | None = None,
                 probe_fraction: float = UNNAMED_PROBE_FRACTION, steps: int = 0) -> dict:
    """The gate's calibration and audits for one model fingerprint and probe (``model``: the
    risk model already loaded for them, so a request does not read the file twice; ``steps``:
    the request's N, where a calibration measured at that N is the one in use)."""
    folder = Path(cache_folder)
    where = "cache" if calibration_in_use(folder, fingerprint, probe_fraction, steps).is_file() else None
    if model is None:
        model = gate_model_for(folder, fingerprint, probe_fraction, steps)
    problem = model.rejected  # the file is there but unusable: the prior stands in, and says why
    out = {"fingerprint": fingerprint, "calibrated": bool(model.calibrated and where and not problem),
           "where": where, "source": model.source, "measured_reuses": model.measured_reuses,
           "tolerance": model.tolerance, "confidence": model.confidence,
           "certified_budgets": sorted({float(a) for t in model.thresholds.values() for a in t}),
           "measured_steps": model.measured_steps, "measured_latents": model.measured_latents,
           "problem": problem, "audits": {}, "online": {}, "probe_fraction": float(probe_fraction),
           "other_probes": other_probes(folder, fingerprint, probe_fraction),
           # calibrations measured at one N, each used instead of the general one at its N
           "calibrated_steps": calibrated_steps(folder, fingerprint),
           "names": model_names(folder).get(fingerprint, [])}
    if (folder / audit.DB_NAME).exists():
        with audit.AuditLog(folder) as log:
            out["audits"] = log.status(fingerprint, audit.calibration_id(model))
            # per α: each cell's online certificate and the clause saying what it changed
            # (kept in memory and fed only new audits: online.read)
            out["online"] = online.status(log, fingerprint, model)
    return out


def other_probes(folder: Path, fingerprint: str, probe_fraction: float) -> list[float]:
    """The probes this model was calibrated with besides this one (to say which to use)."""
    return [f for f in calibrated_probes(folder, fingerprint) if not same_probe(f, probe_fraction)]


NAMES_FILE = "model_names.json"  # fingerprint → the file names people loaded it from


def remember_model_names(cache_folder: str | Path, fingerprint: str, names: list[str]) -> None:
    """Record which files a model fingerprint was loaded from, so the cache tab and summaries
    can name it as the person did (a Wan 2.2 pair: both files). Written atomically."""
    names = [str(n) for n in names if n]
    if not names:
        return
    path = Path(cache_folder) / NAMES_FILE
    known = model_names(cache_folder)
    if known.get(fingerprint) == names:
        return
    known[fingerprint] = names
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(known, indent=1, sort_keys=True))
    tmp.replace(path)


def model_names(cache_folder: str | Path) -> dict[str, list[str]]:
    """{fingerprint: [file names]}; {} when none were recorded or the file is unreadable."""
    try:
        data = json.loads((Path(cache_folder) / NAMES_FILE).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: [str(n) for n in v] for k, v in data.items()
            if FINGERPRINT.fullmatch(str(k)) and isinstance(v, list)}


def known_fingerprints(cache_folder: str | Path, from_entries: list[str] = ()) -> list[str]:
    """Models with entries, a calibration file or audits in this cache folder."""
    folder = Path(cache_folder)
    found = set(from_entries)
    cal = folder / "calibration"
    if cal.is_dir():  # a calibration for any probe or N (gate.calibration_file's names) of a
        # model fingerprint: not a stray JSON someone copied there (e.g. demo_models.json)
        found |= {m.group(1) for p in cal.glob("*.json") if (m := CALIBRATION_NAME.fullmatch(p.name))
                  and FINGERPRINT.fullmatch(m.group(1))}
    if (folder / audit.DB_NAME).exists():
        with audit.AuditLog(folder) as log:
            found |= {r[0] for r in log.db.execute("SELECT DISTINCT fingerprint FROM audits")}
    return sorted(found)


def size_clause(measured: list[list[int]], latent: tuple[int, ...] | None) -> str:
    """What the summary says of a request whose latent size the calibration was not measured
    at: nothing where it was, or where either size is unknown."""
    if not measured or not latent or [int(v) for v in latent] in measured:
        return ""
    size = shape_str(measured[-1])
    share = math.prod(measured[-1]) / max(1, math.prod(latent))
    if share < 1:
        # measured on the multi-size tiny world: calibrated at 1/36 of the served tokens, α = 5%
        # and 10% held at the served size on five workloads (docs/calibration.md)
        return (f" · measured at latent {size}, {share:.0%} of this request's tokens: a smaller-size "
                "calibration (on the tiny world its α = 5% and 10% held at 36 times the tokens), "
                "not certified at this size (calibrate at this size to make it a promise)")
    return (f" · measured at latent {size}, not this request's {shape_str(latent)}: "
            "α is not certified at this size")


def status_line(status: dict, alpha: float | None = None, steps: int | None = None,
                latent: tuple[int, ...] | None = None) -> str:
    """One line for a node summary (``steps``, ``latent``: the request's N and latent size
    [frames, height, width], to say when the calibration was measured at another)."""
    if status["problem"]:
        return f"gate: uncalibrated prior, α is not a promise — {status['problem']}"
    if not status["calibrated"]:
        others = status.get("other_probes") or []
        if others:
            line = (f"gate: uncalibrated prior for probe_fraction {status['probe_fraction']:g} (this "
                    f"model was calibrated with probe_fraction {', '.join(f'{f:g}' for f in others)}: "
                    "use that probe, or calibrate with this one, to make α a promise)")
        else:
            line = ("gate: uncalibrated prior (α is a relative knob here; run Carnator Calibrate "
                    "on this model to make it a promise)")
    else:
        tol = status["tolerance"] or {}
        probe = status.get("probe_fraction", DEFAULT_PROBE_FRACTION)
        line = ("gate: calibrated"
                + ("" if same_probe(probe, DEFAULT_PROBE_FRACTION) else f" for probe_fraction {probe:g}")
                + f" ({status['measured_reuses']:,} reuses measured"
                + (f", PSNR on {tol.get('space')} ≥ {tol.get('psnr_bound'):g} dB" if tol else "")
                + ")")
        measured = status.get("measured_steps") or 0
        if steps and measured and steps != measured:
            # Depths transfer by their share of the steps, but the risk at a share was measured
            # at one N only: on the tiny world, α = 10% calibrated at 20 steps measured 10-11%
            # at 50 (docs/results.md, "Every budget at N = 30 and 50").
            line += (f" · measured at {measured} steps: at {steps} the depths carry over by their "
                     f"share and α is not certified (calibrate at {steps} steps to make it a promise)")
        line += size_clause(status.get("measured_latents") or [], latent)
    a = status["audits"].get(f"{alpha:g}") if alpha is not None else None
    if a:
        al = a["all"]
        line += (f" · audits at α {alpha:.0%}: {al['failures']} of {al['audits']} beyond tolerance "
                 f"({al['rate']:.1%}, 90% interval {al['lower']:.1%}–{al['upper']:.1%})")
        tight = {k: c["level"] for k, c in a["classes"].items() if c["level"]}
        if tight:
            line += " · tightened: " + ", ".join(f"{k.replace('_', '-')} level {v}" for k, v in tight.items())
    said = (status.get("online") or {}).get(f"{alpha:g}", {}).get("text") if alpha is not None else ""
    if said:
        line += f" · {said}"
    return line
