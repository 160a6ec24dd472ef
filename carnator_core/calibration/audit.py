"""Live audits of accepted reuses: is the risk budget α kept on *this* traffic?

A share of hits (the audit rate) is also computed in full, from the same noise, and the pair
is labelled with the calibration's own tolerance. Audits are kept per model fingerprint in
``<cache>/audits.sqlite`` (kept across restarts, apart from the trajectory index so a
damaged index never takes them along) and give a running false-accept estimate with an
exact (Clopper–Pearson) interval.

When the gate tightens: per evidence class, once the audits made at the current level are
as many as could certify α at all (``risk_control.min_accepted``: every one within
tolerance) and their false-accept rate is above α. The upper bound alone would tighten every
fresh deployment (with few audits it is near 1); the estimate alone would react to one
unlucky audit. Tightening moves the class one step down the ladder of budgets the
calibration certified (α = 5% then uses the thresholds certified at 2%, then 1%, then
nothing), or halves α for an uncalibrated model. Audits then count afresh at the new level.
It does not relax by itself: a relaxed budget has no audits behind it. A new calibration
(which may include the audits as data, ``audit_instances``) starts from level 0.

Certifying online (``AuditLog.online``, ``online_model``; the tests are sequential.py's):
per budget α and certified cell, the audits feed an anytime-valid Learn-then-Test over the
ladder of thresholds the calibration certified at any budget (strict → permissive). Each
audit feeds the threshold it was sampled for (``feeds``; an ordinary audit: the threshold
its gate ran at), clustered by the stored entry it reused. What the stream certifies may
*extend* the calibration's threshold at α — deeper depths, the thresholds of looser budgets
— and an alarm (risk > α shown) steps it back. Extending needs audits of reuses the gate
does not make yet: ``explore`` picks them (sequential.audit_plan). The gate reads the
certificate through ``online.read``, which keeps it between requests and feeds it only the
audits it has not seen.
"""
from __future__ import annotations

import copy
import hashlib
import json
import sqlite3
import time
from dataclasses import asdict
from pathlib import Path

from ..gate import (EVIDENCE_CLASSES, UNNAMED_PROBE_FRACTION, RiskModel, class_of_option,
                    evidence_class, same_probe)
from .risk_control import clopper_pearson_lower, clopper_pearson_upper, min_accepted
from .sequential import GridCertifier, audit_plan

DB_NAME = "audits.sqlite"
DELTA = 0.1  # intervals and the tightening rule at 90% confidence, as the certified thresholds
# Online certificate: audits of one stored entry count as one cluster of at most this many
# (sequential.py: a cluster of S labels is bet on as S/MAX_CLUSTER of a label's worth each, so
# S is kept near what a reference gets at a few % audits), closed after CLUSTER_HORIZON later
# audits of its threshold.
MAX_CLUSTER = 2
CLUSTER_HORIZON = 20

SCHEMA = """
CREATE TABLE IF NOT EXISTS audits (
    id INTEGER PRIMARY KEY, time REAL NOT NULL, fingerprint TEXT NOT NULL,
    calibration TEXT NOT NULL, alpha REAL NOT NULL, klass TEXT NOT NULL, level INTEGER NOT NULL,
    k INTEGER, steps INTEGER, score REAL, psnr REAL NOT NULL, label INTEGER NOT NULL,
    space TEXT NOT NULL, entry_id TEXT, request TEXT, features TEXT, probe_fraction REAL,
    feeds TEXT, explored INTEGER);
CREATE INDEX IF NOT EXISTS audits_by_model ON audits (fingerprint, calibration, alpha, klass, level);
CREATE TABLE IF NOT EXISTS audit_levels (
    fingerprint TEXT NOT NULL, calibration TEXT NOT NULL, alpha REAL NOT NULL, klass TEXT NOT NULL,
    level INTEGER NOT NULL, since REAL NOT NULL, reason TEXT,
    PRIMARY KEY (fingerprint, calibration, alpha, klass));
"""


def draw(key: str) -> float:
    """The request's uniform number in [0, 1): a hash of its key, so a re-run decides the same
    and no label can influence which requests are audited."""
    return int(hashlib.sha256(key.encode()).hexdigest()[:12], 16) / float(16 ** 12)


def sampled(rate: float, key: str) -> bool:
    """Whether the request with this key is audited: its ``draw`` against the rate, so the
    share audited is the rate and a re-run of the same request decides the same."""
    if rate <= 0:
        return False
    if rate >= 1:
        return True
    return draw(key) < rate


def explore(key: str, now, beyond, audit_rate: float, explore_rate: float) -> dict:
    """Which reuses of this candidate to label (``sequential.audit_plan`` with the request's
    ``draw``): ``now`` / ``beyond`` the reuse the gate would run at its threshold / one point
    of the online ladder beyond it (``AuditLog.online``'s ``explore``), None where it would
    not reuse. An explored candidate is computed and served in full, so exploring costs
    compute, not quality. Audits then pass ``feeds`` (the thresholds of "now" and "beyond")
    and ``explored`` (the reuse was not served) to ``AuditLog.record``."""
    return audit_plan(draw(key), now, beyond, audit_rate, explore_rate)


def calibration_id(model: RiskModel) -> str:
    """Which calibration the audits judge: the prior, or a digest of the fitted model."""
    if not model.calibrated:  # the prior's audits are kept apart per probe, as calibrations are
        return "prior" if same_probe(model.probe_fraction, UNNAMED_PROBE_FRACTION) \
            else f"prior@probe{model.probe_fraction:g}"
    fields = asdict(model)
    del fields["rejected"]  # set on priors only; never part of a calibration
    # fields added since at their old meaning leave the digest calibrations had before them,
    # so the levels their audits tightened hold
    if same_probe(fields["probe_fraction"], UNNAMED_PROBE_FRACTION):
        del fields["probe_fraction"]
    for name in ("region_fill_on_m", "region_margin", "measured_steps", "region_share_bounds",
                 "measured_latents", "ladders", "near_scene_cell"):
        if name in fields and not fields[name]:
            del fields[name]
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def should_tighten(audits: int, failures: int, alpha: float, delta: float = DELTA) -> bool:
    return audits >= min_accepted(alpha, delta) and failures > alpha * audits


def interval(failures: int, audits: int, delta: float = DELTA) -> dict:
    """Estimate and two-sided (1−δ) exact interval of a false-accept rate."""
    return {"audits": audits, "failures": failures,
            "rate": failures / audits if audits else None,
            "lower": clopper_pearson_lower(failures, audits, delta / 2) if audits else 0.0,
            "upper": clopper_pearson_upper(failures, audits, delta / 2) if audits else 1.0}


def tightened(model: RiskModel, alpha: float, levels: dict[str, int]) -> tuple[RiskModel, float]:
    """The model and budget the gate uses after audits tightened some classes: each class
    ``levels[class]`` steps down its certified ladder; an uncalibrated model's α halved per
    level of its most tightened class."""
    if not any(levels.values()):
        return model, alpha
    if not model.thresholds:
        return model, alpha / 2 ** max(levels.values())
    out = copy.copy(model)
    out.thresholds = {}
    for klass, table in model.thresholds.items():
        # the gate uses the largest certified budget ≤ α: drop that many from the top
        within = sorted((b for b in table if float(b) <= alpha + 1e-12), key=float)
        # a class's share cells and guided-finish thresholds tighten with it
        level = levels.get(class_of_option(klass), 0)
        dropped = set(within[max(0, len(within) - level):]) if level else set()
        out.thresholds[klass] = {b: lam for b, lam in table.items() if b not in dropped}
    return out, alpha


class AuditLog:
    """The audits of one cache folder."""

    def __init__(self, folder: str | Path):
        self.path = Path(folder) / DB_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(self.path), timeout=30, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.executescript(SCHEMA)
        self._add_columns()

    # columns added since the first audit files, with what their NULL means in older rows
    ADDED = {"probe_fraction": "REAL",  # NULL: made with the default probe
             "feeds": "TEXT",           # NULL: fed the threshold its gate ran at
             "explored": "INTEGER"}     # NULL: an ordinary audit of a served reuse

    def _add_columns(self) -> None:
        columns = {row[1] for row in self.db.execute("PRAGMA table_info(audits)")}
        for name, kind in self.ADDED.items():
            if name in columns:
                continue
            try:
                self.db.execute(f"ALTER TABLE audits ADD COLUMN {name} {kind}")
            except sqlite3.OperationalError as e:  # another worker added it in between
                if "duplicate column" not in str(e):
                    raise

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> "AuditLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def levels(self, fingerprint: str, calibration: str, alpha: float) -> dict[str, int]:
        rows = self.db.execute("SELECT klass, level FROM audit_levels WHERE fingerprint=? AND "
                               "calibration=? AND alpha=?", (fingerprint, calibration, alpha))
        return {k: int(v) for k, v in rows}

    def record(self, fingerprint: str, calibration: str, alpha: float, features: dict,
               score: float | None, k: int, steps: int, psnr: float, label: int, space: str,
               entry_id: str | None = None, request: str | None = None,
               probe_fraction: float = UNNAMED_PROBE_FRACTION, feeds: list[float] | None = None,
               explored: bool = False) -> dict:
        """Store one audit; tighten its class if the audits at its level now show α broken.
        Returns the class's state (``interval`` plus level and what changed).

        ``feeds``: the thresholds of the online ladder this labelled reuse was sampled for
        (``explore``; None: the one its gate ran at). ``explored``: the reuse was labelled
        but not served (the request was served in full): it feeds the online certificate
        only, not the served reuses' rate and the tightening rule."""
        klass = evidence_class(features)
        with self.db:  # one transaction: two workers never both tighten from one count
            self.db.execute("BEGIN IMMEDIATE")
            level = self.levels(fingerprint, calibration, alpha).get(klass, 0)
            self.db.execute(
                "INSERT INTO audits (time, fingerprint, calibration, alpha, klass, level, k, steps, "
                "score, psnr, label, space, entry_id, request, features, probe_fraction, feeds, "
                "explored) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (time.time(), fingerprint, calibration, alpha, klass, level, k, steps, score,
                 psnr, int(label), space, entry_id, request, json.dumps(features),
                 float(probe_fraction), None if feeds is None else json.dumps([float(f) for f in feeds]),
                 int(explored)))
            n, bad = self._served(fingerprint, calibration, alpha, klass, level)
            state = {"klass": klass, "level": level, **interval(bad, n), "tightened": False}
            if explored:
                return state
            if should_tighten(n, bad, alpha):
                state["reason"] = (f"audits: {bad} of {n} {klass.replace('_', '-')} reuses beyond "
                                   f"tolerance ({bad / n:.1%}) > α {alpha:.1%}; gate tightened "
                                   f"to level {level + 1}")
                self.db.execute(
                    "INSERT OR REPLACE INTO audit_levels VALUES (?,?,?,?,?,?,?)",
                    (fingerprint, calibration, alpha, klass, level + 1, time.time(), state["reason"]))
                state.update(tightened=True, level=level + 1)
        return state

    def _served(self, fingerprint: str, calibration: str, alpha: float, klass: str,
                level: int) -> tuple[int, int]:
        """Audits of served reuses at one level, and how many were beyond tolerance."""
        return self.db.execute(
            "SELECT COUNT(*), COALESCE(SUM(label),0) FROM audits WHERE fingerprint=? AND "
            "calibration=? AND alpha=? AND klass=? AND level=? AND NOT COALESCE(explored, 0)",
            (fingerprint, calibration, alpha, klass, level)).fetchone()

    def status(self, fingerprint: str, calibration: str | None = None,
               model: RiskModel | None = None) -> dict:
        """Per budget α audited so far: overall and per class, at each class's current level
        and over all levels (audits of served reuses). With the calibration's ``model``: also
        ``online``, its online certificate per cell (``online``)."""
        where, args = "fingerprint=? AND NOT COALESCE(explored, 0)", [fingerprint]
        if calibration is not None:
            where, args = where + " AND calibration=?", args + [calibration]
        out: dict = {}
        rows = self.db.execute(f"SELECT alpha, calibration, klass, level, COUNT(*), SUM(label) "
                               f"FROM audits WHERE {where} GROUP BY alpha, calibration, klass, level", args)
        for alpha, calib, klass, level, n, bad in rows:
            a = out.setdefault(f"{alpha:g}", {"alpha": alpha, "calibration": calib, "classes": {},
                                              "all": [0, 0]})
            c = a["classes"].setdefault(klass, {"level": 0, "current": [0, 0], "all": [0, 0]})
            c["all"] = [c["all"][0] + n, c["all"][1] + bad]
            a["all"] = [a["all"][0] + n, a["all"][1] + bad]
        for a in out.values():
            levels = self.levels(fingerprint, a["calibration"], a["alpha"])
            for klass, c in a["classes"].items():
                c["level"] = levels.get(klass, 0)
                n, bad = self._served(fingerprint, a["calibration"], a["alpha"], klass, c["level"])
                c["current"], c["all"] = interval(bad, n), interval(*c["all"][::-1])
            a["all"] = interval(*a["all"][::-1])
        if model is not None and model.thresholds:
            for key, cells in self.online(fingerprint, model).items():
                if key in out and out[key]["calibration"] == calibration_id(model):
                    out[key]["online"] = {cell: g.summary() for cell, g in cells.items()}
        return out

    def online(self, fingerprint: str, model: RiskModel, delta: float = DELTA,
               extra: dict[str, list[float]] | None = None) -> dict[str, dict[str, GridCertifier]]:
        """The online certificate of this calibration: per budget α audited (``f"{α:g}"``) and
        per certified cell, a ``sequential.GridCertifier`` fed with the audits in the order
        they were made.

        Its ladder (``ladder``) is the cell's thresholds the calibration certified at any
        budget, plus ``extra[cell]``; it starts at the threshold certified at α. Each audit
        feeds the ladder points it was sampled for (``feeds``; an ordinary audit: the threshold
        its gate ran at, after the tightening of its level), clustered by the stored entry it
        reused. Audits made at another α are another gate's traffic and do not count.
        (A request reads it through ``online.read``, which keeps it and feeds only new rows.)"""
        by_alpha: dict[str, list[tuple]] = {}
        for row in self.online_rows(fingerprint, calibration_id(model)):
            by_alpha.setdefault(f"{row[1]:g}", []).append(row)
        out: dict[str, dict[str, GridCertifier]] = {}
        for key, rows in by_alpha.items():
            feed(out.setdefault(key, {}), rows, model, rows[0][1], delta, extra)
        return {key: cells for key, cells in out.items() if cells}

    def online_rows(self, fingerprint: str, calibration: str, alpha: float | None = None,
                    after: int = 0) -> list[tuple]:
        """The audit rows the online certificate reads, in the order they were made (by id:
        writes are serialized, so ids grow in commit order), those with id > ``after``."""
        where, args = "fingerprint=? AND calibration=? AND id>?", [fingerprint, calibration, after]
        if alpha is not None:
            where, args = where + " AND alpha=?", args + [alpha]
        return self.db.execute(
            "SELECT id, alpha, klass, level, features, label, entry_id, feeds FROM audits WHERE "
            f"{where} ORDER BY id", args).fetchall()

    def audit_instances(self, fingerprint: str, tolerance,
                        probe_fraction: float = UNNAMED_PROBE_FRACTION) -> list[dict]:
        """The audits as calibration instances (one labelled depth each), to refit with:
        those measured in the tolerance's space with this probe, labelled by its bound."""
        rows = [r[:5] for r in self.db.execute(
            "SELECT id, features, k, steps, psnr, probe_fraction FROM audits WHERE "
            "fingerprint=? AND space=?", (fingerprint, tolerance.space))
            if same_probe(UNNAMED_PROBE_FRACTION if r[5] is None else r[5], probe_fraction)]
        out = []
        for i, feats, k, steps, psnr in rows:
            label = psnr < tolerance.psnr_bound
            f = json.loads(feats)
            depth = f.pop("depth_fraction", (k or 0) / max(steps or 1, 1))
            out.append({"group": f"audit-{i}", "kind": "audit", "features": {**f, "depth_fraction": 0.0},
                        "depths": [{"k": k, "depth_fraction": depth, "psnr": psnr, "label": int(label)}]})
        return out


def certifier(model: RiskModel, cell: str, alpha: float, delta: float = DELTA,
              extra=()) -> GridCertifier | None:
    """A fresh online certificate for one cell at budget α (None: the cell has no ladder)."""
    grid = ladder(model, cell, extra)
    if not grid:
        return None
    offline = model.threshold_for(alpha, cell)
    return GridCertifier(grid, _index(grid, offline and offline[1]), alpha, delta,
                         max_cluster=MAX_CLUSTER, horizon=CLUSTER_HORIZON)


def feed(cells: dict[str, GridCertifier], rows: list[tuple], model: RiskModel, alpha: float,
         delta: float = DELTA, extra: dict[str, list[float]] | None = None) -> None:
    """Feed audit rows (``AuditLog.online_rows``, all of one α, in id order) to the cells'
    certificates, making a cell's on its first audit. Feeding the rows in parts gives the
    certificate that feeding them at once gives."""
    for i, _, klass, level, feats, label, entry_id, feeds in rows:
        cell = model.cell(json.loads(feats))  # its thresholds table
        if cell not in cells:
            made = certifier(model, cell, alpha, delta, (extra or {}).get(cell, ()))
            if made is None:
                continue
            cells[cell] = made
        grid = cells[cell].grid
        if feeds is None:
            ran = tightened(model, alpha, {klass: level})[0].threshold_for(alpha, cell)
            thresholds = [ran[1]] if ran else []
        else:
            thresholds = json.loads(feeds)
        points = [at for at in (_index(grid, lam) for lam in thresholds) if at >= 0]
        if points:
            cells[cell].observe(points, label, entry_id or f"audit-{i}")


def _index(grid: list[float], lam: float | None) -> int:
    return next((i for i, g in enumerate(grid) if lam is not None and abs(g - lam) <= 1e-9), -1)


def ladder(model: RiskModel, cell: str, extra=()) -> list[float]:
    """The thresholds the online certificate walks for a cell: every threshold its calibration
    certified at any budget, the calibration's own further points (``model.ladders``) and
    ``extra`` (e.g. deeper depth shares), strict → permissive. Fixed before any audit, as
    fixed-sequence testing needs."""
    return sorted({float(v) for v in model.thresholds.get(cell, {}).values()}
                  | {float(v) for v in model.ladders.get(cell, ())} | {float(v) for v in extra})


def online_model(model: RiskModel, certificates: dict[str, dict[str, GridCertifier]]) -> RiskModel:
    """A copy of the model whose thresholds follow the online certificates (``AuditLog.online``):

    - where the stream certified a threshold looser than the calibration's at α, the gate at
      α — and at every looser budget whose threshold is stricter — uses it: risk < α at that
      threshold also answers any budget ≥ α;
    - where an alarm stepped the gate back, α uses the point below it, or reuses nothing in
      that cell at budgets ≤ α when there is none;
    - a cell or budget with no rejection and no alarm keeps the calibration's thresholds.

    Every finish of a cell (``cell`` and ``cell:guided``) whose table is the cell's own (a
    joint calibration: one threshold per cell) follows it; a finish certified apart keeps
    its own thresholds, as the audits do not record which finish ran. The levels of the
    served-rate rule (``tightened``) apply on top, as to the calibration."""
    out = copy.deepcopy(model)
    for budget, cells in certificates.items():
        for cell, cert in cells.items():
            grid, op = cert.grid, cert.operating()
            keys = [k for k, table in model.thresholds.items()
                    if k.split(":")[0] == cell and table == model.thresholds.get(cell)] or [cell]
            for key in keys:
                table = out.thresholds.setdefault(key, {})  # a cell certified at no budget offline has none
                if op > cert.offline:      # extended: budget and every looser one
                    for b in [b for b in table if float(b) >= float(budget)] + [budget]:
                        table[b] = max(table.get(b, grid[op]), grid[op])
                elif op < cert.offline:    # stepped back
                    if op >= 0:
                        table[budget] = grid[op]
                    else:
                        for b in [b for b in table if float(b) <= float(budget) + 1e-12]:
                            del table[b]
    return out


__all__ = ["AuditLog", "sampled", "draw", "explore", "online_model", "ladder", "certifier", "feed",
           "calibration_id", "should_tighten", "interval", "tightened", "EVIDENCE_CLASSES", "DB_NAME"]
