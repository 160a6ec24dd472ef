"""Certifying online: anytime-valid tests of a failure rate, from audits as they come.

A fixed-n test repeated after every audit is not a test: looked at often enough it will
claim risk ≤ α by chance. Here each claim is a *test by betting* (Waudby-Smith & Ramdas,
"Estimating means of bounded random variables by betting", JRSS-B 2023): a gambler starts
with capital 1 and, before each observation, stakes a share of it on "the failure rate is
below α" at odds that are fair when the rate is exactly α. While the rate is ≥ α the capital
is a nonnegative supermartingale, so by Ville's inequality it ever reaches 1/δ with
probability ≤ δ — at *any* moment of the stream, however often it is looked at. Reaching 1/δ
certifies risk < α at level δ; the smallest α it certifies is an anytime-valid upper
confidence bound (the betting confidence sequence). The mirror bet, on "the rate is above α",
raises the alarm that makes the gate step back when the evidence turns.

**Clusters.** Labels that share a reference run or a prompt family are not independent (a
bad stored trajectory fails for every request that reuses it). Labels are therefore grouped
by a cluster key, and one *closed cluster* — its failures F and its labels n — is one
observation. The guarantee is on the **pooled rate** E[F] / E[n], the share of audited
reuses beyond tolerance — the quantity the budget α promises — assuming the clusters, not the
labels, are i.i.d. (or: each cluster's E[F − α·n] given the earlier ones has the null's sign).
The bet's payoff is (α·n − F)/S with S = ``max_cluster``, so a cluster of up to S labels that
all fail loses a bounded share of the capital. (The cluster-*averaged* rate E[F/n] would bet
on each cluster as on one label and need fewer labels, but weighs a cluster of one audit as
much as one of four: when popular references fail more often it would certify a rate the
reuses do not have. The cost of the pooled form is power: a singleton cluster moves the
capital S times less than a label would. ``add(fraction, 1)`` gives the averaged form to a
caller who wants it.)

A cluster closes when it holds ``max_cluster`` labels or when ``horizon`` labels have
arrived since its first: rules that look at arrivals, never at labels. Labels of a key whose
cluster has closed are not counted (a new cluster under the same key would depend on the
old one). ``cluster=None``: the label is its own cluster (labels i.i.d.).

**Bets.** The stake is a predictable plug-in (aGRAPA, WSR §5.3): mean payoff over mean
squared payoff of the observations so far, with one neutral pseudo-observation (a label
failing with probability α: no stake before the first observation), clipped so one
observation never loses more than a cap of the capital. The certifying capital is split in
two halves that bet alike but for their cap: ``max_bet`` (1/2: near the Kelly bet for rates
near α/2, and a failure costs at most half) and ``bold_bet`` (0.95: on a clean stream nearly
the whole capital, which is where the cells a calibration certifies live). The average of two
test supermartingales is one, so Ville's bound holds for the sum as for either; a clean
stream reaches 1/δ in ~2/3 of the observations the cautious half alone needs (α = 5%, δ = 0.1:
58 clean clusters instead of 90), and an early failure costs the bold half, not the test. The
alarm bets with ``max_bet`` alone, on the last ``window`` observations only, so it reacts to a
change after a long good stretch.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Hashable

import numpy as np

# budgets at which the upper and lower confidence bounds are read (finer where α lives)
ALPHA_GRID = np.concatenate([np.arange(0.0025, 0.1, 0.0025), np.arange(0.1, 1.0, 0.01)])


class _Capital:
    """The capital of the bets against one null, for several budgets α at once.

    ``alarm`` False: the null is "pooled rate ≥ α" (payoff (α·n − F)/S, certifies risk < α);
    True: "pooled rate ≤ α" (payoff (F − α·n)/S, shows risk > α)."""

    def __init__(self, alphas, alarm: bool, scale: int, max_bets: tuple[float, ...], window: int | None):
        self.alphas = np.atleast_1d(np.asarray(alphas, dtype=float))
        self.sign = -1.0 if alarm else 1.0
        self.scale, self.window = float(scale), window
        # the most a unit stake can lose on one observation: all S labels fail (certifying),
        # none of S fails (alarm); one row per share of the capital, each with its own cap
        worst = (1.0 - self.alphas) if not alarm else self.alphas
        self.max_stake = np.asarray(max_bets, dtype=float)[:, None] / worst[None, :]
        self.log_capital = np.zeros_like(self.max_stake)
        self.peak = np.zeros_like(self.alphas)  # the running maximum: "ever reached 1/δ"
        self.seen = 0

    def advance(self, fails: np.ndarray, counts: np.ndarray) -> None:
        """Bet on the observations after the first ``seen`` of these (the whole history)."""
        total = len(fails)
        if total <= self.seen:
            return
        a, s = self.alphas[None, :], self.scale
        # prefix sums of the statistics a bet needs: observations, n, F, n², F·n, F²
        stats = np.stack([np.ones(total), counts, fails, counts ** 2, fails * counts, fails ** 2], 1)
        prefix = np.vstack([np.zeros(6), np.cumsum(stats, 0)])
        t = np.arange(self.seen, total)
        before = prefix[t] - (prefix[np.maximum(t - self.window, 0)] if self.window else 0.0)
        m, n, f, nn, fn, ff = (before[:, i:i + 1] for i in range(6))
        # one neutral pseudo-observation: a single label failing with probability α
        m, n, f, nn, fn, ff = m + 1, n + 1, f + a, nn + 1, fn + a, ff + a
        mean = self.sign * (a * n - f) / s / m
        square = (a * a * nn - 2 * a * fn + ff) / (s * s) / m
        kelly = mean / np.maximum(square, 1e-12)
        stake = np.clip(kelly[None], 0.0, self.max_stake[:, None, :])  # (shares, observations, α)
        payoff = self.sign * (a * counts[t, None] - fails[t, None]) / s
        path = self.log_capital[:, None, :] + np.cumsum(np.log1p(stake * payoff[None]), 1)
        # the capital is the shares' average (each share starts at 1 / shares)
        whole = np.logaddexp.reduce(path, axis=0) - math.log(len(path))
        self.peak = np.maximum(self.peak, whole.max(0))
        self.log_capital, self.seen = path[:, -1, :], total


class RiskSequence:
    """An anytime-valid test and confidence sequence for a failure rate in [0, 1].

    Feed labels with ``observe`` (1 = beyond tolerance, with a cluster key) or closed clusters
    with ``add``; ask at any moment ``rejects(α, δ)`` — risk < α certified at level δ — or
    ``exceeds(α, δ)`` — risk > α shown. Both stay true once true (Ville's inequality bounds
    the chance that they *ever* become true under their null by δ), so asking after every
    audit costs nothing in validity. Only closed clusters count (see the module's note).
    """

    def __init__(self, max_cluster: int = 1, horizon: int = 20, max_bet: float = 0.5,
                 window: int = 100, bold_bet: float | None = 0.95):
        self.max_cluster, self.horizon = max(1, int(max_cluster)), horizon
        self.max_bet, self.window = max_bet, window
        # bold_bet None: the cautious bet alone
        self.certify_bets = (max_bet,) if bold_bet is None else (max_bet, bold_bet)
        self.fails: list[float] = []   # per closed cluster, in closing order
        self.counts: list[int] = []
        self.labels = 0                # labels observed (counted or not)
        self.dropped = 0               # labels of a key whose cluster had closed
        self._open: OrderedDict = OrderedDict()  # key → [failures, labels, arrival of first]
        self._closed_keys: set = set()
        self._capital: dict = {}

    @classmethod
    def of(cls, clusters, max_cluster: int = 1) -> "RiskSequence":
        """A sequence of these closed clusters, (failures, labels) each, in order."""
        seq = cls(max_cluster=max_cluster)
        for failures, count in clusters:
            seq.add(failures, count)
        return seq

    # ---------------------------------------------------------------- data
    def observe(self, label: float, cluster: Hashable | None = None) -> None:
        self.labels += 1
        if cluster is None:
            self.add(float(label), 1)
        elif cluster in self._closed_keys:
            self.dropped += 1
        else:
            c = self._open.setdefault(cluster, [0.0, 0, self.labels])
            c[0], c[1] = c[0] + float(label), c[1] + 1
            if c[1] >= self.max_cluster:
                self._close(cluster)
        while self._open:  # clusters open for `horizon` labels close, oldest first
            key, c = next(iter(self._open.items()))
            if self.labels - c[2] < self.horizon:
                break
            self._close(key)

    def close_all(self) -> None:
        """Count every open cluster now (at a moment chosen without looking at labels)."""
        for key in list(self._open):
            self._close(key)

    def add(self, failures: float, count: int = 1) -> None:
        """One closed cluster: ``failures`` (0…count, fractions allowed) of ``count`` labels."""
        if not 0 <= failures <= count or not 1 <= count <= self.max_cluster:
            raise ValueError(f"a cluster of {count} labels (at most {self.max_cluster}) with "
                             f"{failures} failures is not an observation")
        self.fails.append(float(failures))
        self.counts.append(int(count))

    def _close(self, key: Hashable) -> None:
        failures, count, _ = self._open.pop(key)
        self._closed_keys.add(key)
        self.add(failures, count)

    # ---------------------------------------------------------------- tests
    def _peak(self, alphas, alarm: bool) -> np.ndarray:
        key = (tuple(np.atleast_1d(alphas).tolist()), alarm)
        if key not in self._capital:
            bets = (self.max_bet,) if alarm else self.certify_bets
            self._capital[key] = _Capital(alphas, alarm, self.max_cluster, bets,
                                          self.window if alarm else None)
        cap = self._capital[key]
        cap.advance(np.asarray(self.fails, float), np.asarray(self.counts, float))
        return cap.peak

    def rejects(self, alpha: float, delta: float) -> bool:
        """Pooled risk < α, certified at level δ at this (or any) moment of the stream."""
        return bool(self._peak(alpha, False)[0] >= math.log(1.0 / delta))

    def exceeds(self, alpha: float, delta: float) -> bool:
        """Pooled risk > α shown at level δ (the alarm: the evidence has turned)."""
        return bool(self._peak(alpha, True)[0] >= math.log(1.0 / delta))

    def upper(self, delta: float) -> float:
        """Anytime-valid upper confidence bound on the pooled risk, read on ``ALPHA_GRID``: the
        smallest grid budget from which every looser one is rejected (1.0 if none). If the
        true rate μ were above it, the grid budget just below μ — a true null — was rejected."""
        rejected = self._peak(ALPHA_GRID, False) >= math.log(1.0 / delta)
        kept = np.nonzero(~rejected)[0]
        if not len(kept):
            return float(ALPHA_GRID[0])
        return float(ALPHA_GRID[kept[-1] + 1]) if kept[-1] + 1 < len(ALPHA_GRID) else 1.0

    def lower(self, delta: float) -> float:
        """Anytime-valid lower confidence bound (from the alarm's bets; 0.0 if none)."""
        shown = self._peak(ALPHA_GRID, True) >= math.log(1.0 / delta)
        below = np.nonzero(~shown)[0]
        top = below[0] if len(below) else len(ALPHA_GRID)
        return float(ALPHA_GRID[top - 1]) if top else 0.0

    def summary(self, delta: float) -> dict:
        n = sum(self.counts)
        return {"labels": self.labels, "counted": n, "clusters": len(self.counts),
                "open_clusters": len(self._open), "dropped": self.dropped,
                "failures": sum(self.fails), "rate": sum(self.fails) / n if n else None,
                "upper": self.upper(delta), "lower": self.lower(delta)}


class GridCertifier:
    """Online Learn-then-Test over a grid of thresholds λ (strict → permissive) at budget α.

    Each grid point has its own ``RiskSequence``, fed with the audits *sampled for it*: a
    reuse the gate would run at that λ, drawn at random from the candidates that λ accepts
    (``audit_plan``). The fixed sequence starts at ``offline`` — the threshold a calibration
    certified, fixed before the stream — and walks towards permissive points; what is
    certified online is the longest run of grid points from there whose nulls ("risk at λ
    ≥ α") are all rejected.

    Why the family-wise error stays ≤ δ at every moment: suppose at some time a certified
    point has risk > α. Let λ* be the *first* point of the order whose null is true; every
    certified run that reaches a true null passes λ* (the order is fixed), so λ*'s null was
    rejected — its capital reached 1/δ — and by Ville that happens, ever, with probability
    ≤ δ. No correction for the number of points or of looks is needed.

    Tightening: when the alarm at a point shows its risk > α (``RiskSequence.exceeds``), the
    gate runs one point below it from then on (``operating``), below the calibration's own
    threshold if the alarm is there. An alarm is not withdrawn by later audits; a new
    calibration starts afresh.
    """

    def __init__(self, grid: list[float], offline: int, alpha: float, delta: float, **options):
        if list(grid) != sorted(set(grid)):
            raise ValueError("the grid must be strictly increasing (strict → permissive)")
        if not -1 <= offline < len(grid):
            raise ValueError(f"offline index {offline} is outside the grid of {len(grid)} points")
        self.grid, self.offline, self.alpha, self.delta = list(grid), offline, alpha, delta
        self.start = max(offline, 0)  # the first point of the fixed sequence
        self.tests = [RiskSequence(**options) for _ in self.grid]
        self.audits = 0  # labelled reuses (one may feed two points): each cost a full run

    def observe(self, index: int | list[int], label: float, cluster: Hashable | None = None) -> None:
        """One labelled reuse, fed to the grid point(s) it was sampled for."""
        self.audits += 1
        for i in [index] if isinstance(index, int) else index:
            self.tests[i].observe(label, cluster)

    def certified(self) -> int | None:
        """Index of the loosest point certified online (None: not even the first)."""
        last = None
        for i in range(self.start, len(self.grid)):
            if not self.tests[i].rejects(self.alpha, self.delta):
                break
            last = i
        return last

    def alarmed(self) -> list[int]:
        return [i for i, t in enumerate(self.tests) if t.labels and t.exceeds(self.alpha, self.delta)]

    def operating(self) -> int:
        """Where the gate runs now: the loosest certified point (or the calibration's), below
        the first alarmed point; -1: no reuse."""
        top = max(self.offline, -1 if self.certified() is None else self.certified())
        alarms = self.alarmed()
        return min(top, min(alarms) - 1) if alarms else top

    def beyond(self) -> int | None:
        """The point to explore: one step beyond where the gate runs (None: none left, or it
        raised the alarm)."""
        nxt = self.operating() + 1
        return nxt if nxt < len(self.grid) and nxt not in self.alarmed() else None

    def summary(self) -> dict:
        cert, op, nxt = self.certified(), self.operating(), self.beyond()
        at = lambda i: None if i is None or i < 0 else self.grid[i]  # noqa: E731
        return {"alpha": self.alpha, "delta": self.delta, "grid": self.grid,
                "offline": at(self.offline), "certified": at(cert), "operating": at(op),
                "explore": at(nxt), "alarms": [self.grid[i] for i in self.alarmed()],
                "audits": self.audits, "cost_generations": self.audits,
                "points": [{"threshold": lam, "rejects": t.rejects(self.alpha, self.delta),
                            **t.summary(self.delta)} for lam, t in zip(self.grid, self.tests) if t.labels]}


def audit_plan(draw: float, now, beyond, audit_rate: float, explore_rate: float) -> dict:
    """Which reuses of one candidate to label, and what the request is served.

    ``draw``: the request's uniform number in [0, 1) (``audit.draw``, a hash: decided before
    any label); ``now`` / ``beyond``: the reuse (e.g. its depth k) the gate would run at its
    operating threshold / one grid point beyond, None where it would not reuse.

    - an accepted reuse is audited when ``draw < audit_rate``: it feeds the operating point;
    - a candidate the next point accepts is explored when ``draw < explore_rate``: the reuse
      that point would run is labelled and feeds it. Where it is not the reuse the gate runs
      now (deeper, or the gate would not reuse at all), the request is computed in full and
      *served in full*: exploring costs compute (a full run and the explored reuse), never
      quality.

    Each point's labels are then a uniform sample of the candidates it accepts, so its test
    measures the risk the gate would have there. Returns ``{"serve": "reuse" | "full",
    "label": {reuse: ["now"] | ["beyond"] | ["now", "beyond"]}}``.
    """
    label: dict = {}
    if now is not None and draw < audit_rate:
        label.setdefault(now, []).append("now")
    explore = beyond is not None and draw < explore_rate
    if explore:
        label.setdefault(beyond, []).append("beyond")
    serve = "reuse" if now is not None and not (explore and beyond != now) else "full"
    return {"serve": serve, "label": label}


__all__ = ["RiskSequence", "GridCertifier", "audit_plan", "ALPHA_GRID"]
