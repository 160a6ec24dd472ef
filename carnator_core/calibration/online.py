"""The online certificate as a request reads it: kept in memory, fed only new audits.

``AuditLog.online`` replays every audit of a calibration; a request cannot pay for that. The
certificates of one audit file, model, calibration and budget α are kept here and brought up
to date on each read with the rows whose id is above the last one fed (``AuditLog.online_rows``).
Writes to ``audits.sqlite`` are serialized (``AuditLog.record`` holds the write lock from the
insert to the commit), so ids grow in commit order and a row never appears below an id
already read: workers sharing the file each keep their own copy and each reads every
worker's rows. A copy that finds a different number of rows at or below its last id than it
fed (the file was replaced or pruned) replays from the start.

What the gate takes from it (``gate_model``): ``audit.online_model`` — thresholds extended
where the stream certified a looser one at α, stepped back where an alarm fired — and one
clause saying so (``clause``), shown in the plan's reason, the node summary and the cache tab.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, TypeVar

from ..gate import RiskModel, class_of_option
from . import audit
from .sequential import GridCertifier

T = TypeVar("T")
MAX_KEPT = 64  # certificates kept (file, model, calibration, α); the least recently read go


@dataclass
class _Kept:
    cells: dict[str, GridCertifier]
    last_id: int = 0   # the highest audit id fed
    rows: int = 0      # audit rows of this key with id ≤ last_id, as fed
    lock: threading.Lock = field(default_factory=threading.Lock)


_kept: OrderedDict[tuple, _Kept] = OrderedDict()
_kept_lock = threading.Lock()


def certificates(model: RiskModel, alpha: float, delta: float = audit.DELTA) -> dict[str, GridCertifier]:
    """A fresh certificate per certified cell of the model at α, audited or not (so the point
    one beyond the calibration's is known before the first audit)."""
    cells = {}
    # a finish's table (``cell:guided``): its cell's certificate covers it (online_model); a
    # cell with ladder points only is certified at no budget yet, and may be online
    for key in dict.fromkeys([k for k in model.thresholds if ":" not in k] + list(model.ladders)):
        made = audit.certifier(model, key, alpha, delta)
        if made is not None:
            cells[key] = made
    return cells


def read(log: audit.AuditLog, fingerprint: str, model: RiskModel, alpha: float,
         use: Callable[[dict[str, GridCertifier]], T], delta: float = audit.DELTA) -> T:
    """``use(cells)`` on this calibration's certificates at α, brought up to date with the audit
    rows not fed yet; under the certificates' lock (a route may read while a request does)."""
    calibration = audit.calibration_id(model)
    key = (str(log.path.resolve()), fingerprint, calibration, float(alpha), float(delta))
    with _kept_lock:
        kept = _kept.pop(key, None) or _Kept(certificates(model, alpha, delta))
        _kept[key] = kept
        while len(_kept) > MAX_KEPT:
            _kept.popitem(last=False)
    with kept.lock:
        with log.db:  # one read snapshot for the count and the new rows
            log.db.execute("BEGIN")
            seen = log.db.execute(
                "SELECT COUNT(*) FROM audits WHERE fingerprint=? AND calibration=? AND alpha=? "
                "AND id<=?", (fingerprint, calibration, alpha, kept.last_id)).fetchone()[0]
            if seen != kept.rows:  # rows went missing below what was fed: start afresh
                kept.cells, kept.last_id, kept.rows = certificates(model, alpha, delta), 0, 0
            rows = log.online_rows(fingerprint, calibration, alpha, after=kept.last_id)
        if rows:
            audit.feed(kept.cells, rows, model, alpha, delta)
            kept.last_id, kept.rows = rows[-1][0], kept.rows + len(rows)
        return use(kept.cells)


def forget() -> None:
    """Drop every kept certificate (the next read replays its audits)."""
    with _kept_lock:
        _kept.clear()


def gate_model(model: RiskModel, alpha: float, cells: dict[str, GridCertifier]) -> tuple[RiskModel, str]:
    """The model the gate uses at α after the online certificate (``audit.online_model``) and
    the clause that says what it changed ("" and the model itself: nothing)."""
    changed = {cell: c for cell, c in cells.items() if c.operating() != c.offline}
    if not changed:
        return model, ""
    return audit.online_model(model, {f"{alpha:g}": changed}), clause(model, changed, alpha)


def beyond(cells: dict[str, GridCertifier]) -> dict[str, float]:
    """Per cell, the threshold one ladder point beyond where its gate runs (what exploring
    labels); cells with none left, or alarmed there, are absent."""
    out = {}
    for cell, c in cells.items():
        at = c.beyond()
        if at is not None:
            out[cell] = c.grid[at]
    return out


def clause(model: RiskModel, cells: dict[str, GridCertifier], alpha: float) -> str:
    """One short clause: "online: same-scene certified to 0.8·N at α 5% from 212 audits (212
    generations)", "online alarm: other stepped back to its 2% threshold"."""
    extended, alarms = [], []
    for cell, c in sorted(cells.items()):
        op = c.operating()
        name = cell.replace("_", "-")
        if op > c.offline:
            extended.append(f"{name} certified to {_threshold_text(model, cell, c.grid[op])} at "
                            f"α {alpha:.0%} from {c.audits} audits ({c.audits} generations)")
        elif op < c.offline:
            alarms.append(f"{name} stepped back to "
                          + (_threshold_text(model, cell, c.grid[op]) if op >= 0 else "no reuse"))
    parts = (["online: " + ", ".join(extended)] if extended else []) \
        + (["online alarm: " + ", ".join(alarms)] if alarms else [])
    return " · ".join(parts)


def _threshold_text(model: RiskModel, cell: str, lam: float) -> str:
    """A same-scene threshold is a depth share (``0.8·N``); another cell's, the budget whose
    certified threshold it is (``its 20% threshold``)."""
    if class_of_option(cell) == "same_scene":
        return f"{lam:g}·N"
    budgets = sorted(float(b) for b, v in model.thresholds.get(cell, {}).items() if abs(v - lam) <= 1e-9)
    return f"its {budgets[0]:.0%} threshold" if budgets else f"score {lam:.2f}"


def status(log: audit.AuditLog, fingerprint: str, model: RiskModel) -> dict[str, dict]:
    """Per budget α this calibration was audited at (``f"{α:g}"``): the certificate of each
    cell that has audits or changed the gate (``GridCertifier.summary``) and ``text``, the
    clause ("" when it changed nothing)."""
    if not model.thresholds:
        return {}
    alphas = [a for (a,) in log.db.execute(
        "SELECT DISTINCT alpha FROM audits WHERE fingerprint=? AND calibration=?",
        (fingerprint, audit.calibration_id(model)))]
    out = {}
    for alpha in sorted(alphas):
        def summarise(cells, alpha=alpha):
            shown = {cell: c for cell, c in cells.items() if c.audits or c.operating() != c.offline}
            return {"alpha": alpha, "cells": {cell: c.summary() for cell, c in shown.items()},
                    "text": clause(model, shown, alpha)}
        out[f"{alpha:g}"] = read(log, fingerprint, model, alpha, summarise)
    return out


__all__ = ["read", "gate_model", "beyond", "clause", "status", "certificates", "forget"]
