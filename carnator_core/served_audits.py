"""What live audits and exploration do inside a request: the gate's model after the online
certificate and the audits' tightening, the reuse one ladder point beyond (exploration), and
the labels of served and explored reuses against the request's own full computation."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch

from .calibration import audit, online
from .gate import (GateSettings, Plan, RiskModel, decide,
                   option_key)
from .calibration.tolerance import psnr

from .request import ProbeResult, guarded, region_share_of
from .resume import reuse_apart


def after_audits(pr: ProbeResult, model: RiskModel, alpha: float) -> tuple[RiskModel, float, str, dict]:
    """The risk model and budget after live audits: thresholds extended or stepped back by
    the online certificate (calibration/online.py), then tightened by the served-rate rule;
    what that changed, in words; and per cell the threshold one ladder point beyond where
    the gate now runs (what exploring labels; {} for an uncalibrated model)."""
    if not (Path(pr.cache.folder) / audit.DB_NAME).exists():
        return model, alpha, "", {}  # never audited: no file made for users who do not audit
    fingerprint, calibration = pr.klass.model_fingerprint, audit.calibration_id(model)

    def read():
        with audit.AuditLog(pr.cache.folder) as log_:
            levels = log_.levels(fingerprint, calibration, alpha)
            if not model.thresholds:  # the prior: no ladder to certify
                return levels, model, "", {}
            return (levels, *online.read(log_, fingerprint, model, alpha, lambda cells: (
                *online.gate_model(model, alpha, cells), online.beyond(cells))))
    levels, extended, said, beyond = guarded(pr.cache, "reading the audits", read, default=None) \
        or ({}, model, "", {})
    notes = [said] if said else []
    tight, budget = audit.tightened(extended, alpha, levels)
    if any(levels.values()):
        notes.append("gate tightened by live audits (" + ", ".join(
            f"{k.replace('_', '-')} level {v}" for k, v in sorted(levels.items()) if v) + ")")
    return tight, budget, " · ".join(notes), beyond


@dataclass
class Exploring:
    """What the gate saw, kept to find the reuse one ladder point beyond it (``exploration``)."""
    candidates: list
    model: RiskModel            # the gate's model after audits
    settings: GateSettings      # with the budget it judged at
    beyond: dict[str, float]    # cell → the threshold one ladder point beyond its gate's


def _beyond_plan(pr: ProbeResult, ex: Exploring) -> Plan | None:
    """The reuse the gate would run with each cell one ladder point beyond (None: it would
    run none there, or only in a cell with no point beyond)."""
    alpha = ex.settings.risk_budget
    deeper = copy.deepcopy(ex.model)
    for cell, lam in ex.beyond.items():
        own = ex.model.thresholds.get(cell)
        deeper.thresholds.setdefault(cell, {})  # a cell certified at no budget yet: its first point
        for key, table in deeper.thresholds.items():
            # a finish certified with its cell's own table follows it (audit.online_model)
            if key.split(":")[0] == cell and ex.model.thresholds.get(key) == own:
                table[f"{alpha:g}"] = lam
    plan, _ = decide(pr.signature, ex.candidates, pr.run.steps, pr.probe_steps, deeper, ex.settings,
                     pr.settings.region_fill_calls, deeper.region_fill_on_m, region_share_of(pr))
    if not plan.accept or deeper.cell(plan.features) not in ex.beyond:
        return None
    return plan


def _ran_at(model: RiskModel, plan: Plan, alpha: float) -> float | None:
    """The threshold of the online ladder a plan's reuse was accepted at: its cell's at α
    (None: its finish has a table of its own, which the ladder does not walk)."""
    cell = model.cell(plan.features)
    if model.thresholds.get(option_key(cell, plan.finish_calls)) != model.thresholds.get(cell):
        return None
    at = model.threshold_for(alpha, cell)
    return at[1] if at else None


def _reuse_of(plan: Plan | None) -> tuple | None:
    return None if plan is None else (plan.entry_id, plan.reuse_step, plan.finish_calls)


def _draw_key(pr: ProbeResult, plan: Plan) -> str:
    """What the request's audit and exploration draw hashes (``audit.draw``)."""
    return f"{pr.exact_key}:{plan.entry_id}" if plan.accept else f"{pr.exact_key}:explore"


def exploration(pr: ProbeResult, plan: Plan) -> dict | None:
    """What this request explores (``audit.explore``), or None. A candidate the next ladder
    point accepts is explored at ``explore_rate``: where that reuse is not the one the gate
    serves, the request is computed and served in full and the reuse run and labelled apart."""
    ex, rate = pr.exploring, pr.settings.explore_rate
    if ex is None or rate <= 0 or pr.exact_latent is not None:
        return None
    key = _draw_key(pr, plan)
    if audit.draw(key) >= rate:  # decided before the second gate decision is paid for
        return None
    tol = (pr.gate_model or RiskModel()).tolerance or {}
    if tol.get("space") == "frames" and pr.decode is None:
        return None  # no label could be read: explore nothing rather than compute for nothing
    deeper = _beyond_plan(pr, ex)
    if deeper is None:
        return None
    now = plan if plan.accept else None
    alpha = pr.settings.gate.risk_budget
    got = audit.explore(key, _reuse_of(now), _reuse_of(deeper), pr.settings.audit_rate, rate)
    return {**got, "now": now, "beyond": deeper,
            "feeds": {"now": _ran_at(ex.model, now, alpha) if now else None,
                      "beyond": ex.beyond[ex.model.cell(deeper.features)]}}


def audit_served(pr: ProbeResult, plan: Plan, final: torch.Tensor, ex: dict | None) -> dict | None:
    """Audit a served hit when its draw says so: at ``audit_rate`` for the gate's threshold,
    and where exploring found this same reuse one ladder point beyond, for that point too."""
    alpha = pr.settings.gate.risk_budget
    if ex is not None:
        names = ex["label"].get(_reuse_of(plan), [])
    else:
        names = ["now"] if audit.sampled(pr.settings.audit_rate, _draw_key(pr, plan)) else []
    if not names:
        return None
    model = pr.gate_used or pr.gate_model or RiskModel()
    if not model.thresholds:
        feeds = None  # the prior: no ladder (audit.online skips it)
    else:
        ran = {"now": _ran_at(model, plan, alpha), "beyond": ex["feeds"]["beyond"] if ex else None}
        feeds = [ran[name] for name in names if ran[name] is not None]
    # labelled for the point beyond only: not drawn at audit_rate, so not in the served rate
    return _audit(pr, plan, final, feeds, explored="now" not in names)


def label_explored(pr: ProbeResult, ex: dict, final: torch.Tensor) -> dict:
    """Run and label the reuses an explored request was not served (``final``, its full
    result, is their reference): the one beyond, and the gate's own where its audit was drawn
    (``audit_rate``)."""
    run, labels, texts, calls = pr.run, [], [], 0
    for reuse_key, names in ex["label"].items():
        plan = ex["beyond"] if reuse_key == _reuse_of(ex["beyond"]) else ex["now"]
        feeds = [ex["feeds"][name] for name in names if ex["feeds"][name] is not None]
        before = run.model_calls
        reused = reuse_apart(pr, plan)
        if reused is None:
            texts.append(f"explored reuse of entry {plan.entry_id[:8]} could not be read: not measured")
            continue
        # the gate's own reuse, drawn at audit_rate, counts in its served rate as if served:
        # that rate's audits stay a uniform share of the reuses the gate accepts
        got = _audit(pr, plan, reused, feeds, explored="now" not in names, reference=final,
                     what=f"explored k*={plan.reuse_step}" if "beyond" in names else f"audited k*={plan.reuse_step}")
        calls += run.model_calls - before
        labels.append(got)
        texts.append(got["text"])
    return {"audited": bool(labels), "explored": True, "calls": calls, "labels": labels,
            "text": " · ".join(texts)}


def _audit(pr: ProbeResult, plan: Plan, final: torch.Tensor, feeds: list[float] | None = None,
           explored: bool = False, reference: torch.Tensor | None = None,
           what: str = "audited") -> dict:
    """Judge a reuse's result against the request computed in full (``reference``, else
    computed now: dense, from its own noise) with the calibration's tolerance; record it with
    the online ladder's thresholds it feeds (``feeds``), and say if the gate tightened."""
    run, n = pr.run, pr.run.steps
    model = pr.gate_model or RiskModel()
    tol = model.tolerance or {"psnr_bound": 30.0, "space": "latent"}
    if tol.get("space") == "frames" and pr.decode is None:
        return {"audited": False, "text": "audit skipped: this model was calibrated on decoded "
                "frames; connect its VAE to the sampler's vae input to audit"}
    calls = run.model_calls
    if reference is None:
        att = run.attention
        att.capture_steps, att.sparse_steps, att.connectivity = set(), set(), None
        reference = run.sample(0, n, None)
    if tol.get("space") == "frames":
        q = psnr(pr.decode(final), pr.decode(reference), peak=1.0)
    else:
        q = psnr(final, reference)
    label = int(q < float(tol["psnr_bound"]))
    fp, alpha = pr.klass.model_fingerprint, pr.settings.gate.risk_budget

    def record():
        with audit.AuditLog(pr.cache.folder) as log_:
            return log_.record(fp, audit.calibration_id(model), alpha, plan.features,
                               model.score(plan.features) if model.thresholds else plan.risk,
                               plan.reuse_step, n, q, label, tol["space"], plan.entry_id, pr.exact_key,
                               probe_fraction=model.probe_fraction, feeds=feeds, explored=explored)
    state = guarded(pr.cache, "recording the audit", record) or {}
    text = (f"{what}: PSNR {q:.1f} dB vs its full computation ({tol['space']}, bound "
            f"{tol['psnr_bound']:g} dB): {'BEYOND' if label else 'within'} tolerance")
    if state.get("audits") and not explored:
        text += (f" · {state['failures']}/{state['audits']} audits beyond "
                 f"({state['lower']:.0%}–{state['upper']:.0%}) at α {alpha:.0%}")
    if state.get("tightened"):
        text += f" · {state['reason']}"
    return {"audited": True, "psnr": q, "label": label, "space": tol["space"], "explored": explored,
            "feeds": feeds, "calls": run.model_calls - calls, "text": text,
            **{k: state[k] for k in ("klass", "level", "audits", "failures", "rate", "lower",
                                     "upper", "tightened") if k in state}}


