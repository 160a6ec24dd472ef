"""Risk control with a stated guarantee (DESIGN.md §5): Learn-then-Test for the gate.

The gate accepts a candidate at the deepest stored depth k whose score (``RiskModel.score``:
the depth share for same-scene evidence, the risk-model logit otherwise) is ≤ λ. The score
only has to *rank* reuses well; this module chooses λ for each risk budget α
from measured reuses so that, with probability ≥ 1−δ over the calibration draw,

    P(reuse misses tolerance | the gate accepted it) ≤ α

for requests and candidates drawn like the calibration pairs (Angelopoulos et al., "Learn
then Test", 2021, selective risk). How: for a grid of λ from strict to permissive, the null
"risk among accepted > α" is tested with the exact binomial p-value of the accepted reuses'
failures; fixed-sequence testing walks the grid in order and stops at the first λ it cannot
reject, so no multiplicity correction is needed (family-wise error ≤ δ). λ values that accept
too few reuses for the test to have power (``min_tested``) are skipped before testing: that
choice looks only at the evidence, never at the labels, so it keeps the guarantee.
"""
from __future__ import annotations

import math
from typing import Callable


def binomial_cdf(k: int, n: int, p: float) -> float:
    """P(X ≤ k) for X ~ Binomial(n, p), summed in log space (n up to many thousands)."""
    if k >= n or p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    lp, lq = math.log(p), math.log1p(-p)
    terms = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq
             for i in range(k + 1)]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


def clopper_pearson_upper(k: int, n: int, delta: float) -> float:
    """One-sided exact upper confidence bound (level 1−δ) on a binomial rate, by bisection."""
    if n == 0 or k >= n:
        return 1.0
    lo, hi = k / n, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if binomial_cdf(k, n, mid) > delta else (lo, mid)
    return hi


def clopper_pearson_lower(k: int, n: int, delta: float) -> float:
    """One-sided exact lower confidence bound (level 1−δ)."""
    return 0.0 if k == 0 else 1.0 - clopper_pearson_upper(n - k, n, delta)


def min_accepted(alpha: float, delta: float) -> int:
    """The fewest accepted reuses that can certify α at all (all of them within tolerance)."""
    return math.ceil(math.log(delta) / math.log1p(-alpha))


def min_tested(alpha: float, delta: float, limit: int = 100_000) -> int:
    """The fewest accepted reuses at which a failure rate of α/2 would be certified.

    Fixed-sequence testing stops at its first failure, so a test on a handful of reuses
    (where one unlucky failure cannot be rejected) would end the walk before the thresholds
    with enough evidence are reached. Thresholds that accept fewer reuses than this are not
    tested; the count depends on the evidence only, never on labels."""
    n = min_accepted(alpha, delta)
    while n < limit and binomial_cdf(math.floor(alpha * n / 2), n, alpha) > delta:
        n += 1
    return n


def certify(decisions: Callable[[float], list[int]], grid: list[float], alpha: float,
            delta: float) -> dict:
    """Learn-then-Test with fixed-sequence testing over ``grid`` (strict → permissive).

    ``decisions(λ)`` returns the labels (1 = missed tolerance) of the reuses the rule accepts
    at λ. Returns the most permissive certified λ (None if none) and its evidence.
    """
    need = min_tested(alpha, delta)
    best = {"alpha": alpha, "delta": delta, "threshold": None, "accepted": 0, "failures": 0,
            "p_value": None, "upper_bound": None, "tested": 0}
    for lam in sorted(grid):
        labels = decisions(lam)
        n, bad = len(labels), sum(labels)
        if n < need:
            continue  # decided by the evidence alone: cannot reject, so not tested
        p = binomial_cdf(bad, n, alpha)  # P(this few failures | risk = α)
        best["tested"] += 1
        if p > delta:
            break
        best.update(threshold=lam, accepted=n, failures=bad, p_value=p,
                    upper_bound=clopper_pearson_upper(bad, n, delta))
    return best
