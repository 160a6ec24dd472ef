"""The certification-power study's bound: the most powerful test has exactly the level δ at a
rate of α, and no valid test it bounds (the cheap procedure's own) certifies more often."""
import importlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "studies"))
power = importlib.import_module("certification_power")


@pytest.mark.parametrize("n,alpha", [(30, 0.05), (120, 0.05), (77, 0.1)])
def test_the_most_powerful_test_certifies_a_rate_of_exactly_alpha_with_chance_delta(n, alpha):
    assert power.most_powerful(n, alpha, alpha) == pytest.approx(power.DELTA, abs=1e-9)
    # a lower true rate is certified more often, a higher one less
    assert power.most_powerful(n, alpha, alpha / 2) > power.DELTA > power.most_powerful(n, alpha, 1.5 * alpha)


def test_the_cheap_procedure_s_test_certifies_no_more_often_than_the_bound():
    for pairs, rate in [(60, 0.014), (90, 0.02), (45, 0.0)]:
        cheap = power.betting_power(pairs, 0.05, rate, draws=300)
        assert cheap <= power.most_powerful(2 * pairs, 0.05, rate) + 0.05
    # a clean stream of 45 pairs: the bound certifies it always; the clustered test needs more
    assert power.most_powerful(90, 0.05, 0.0) == pytest.approx(1.0)
    assert power.betting_power(45, 0.05, 0.0, draws=10) == 0.0
    assert power.betting_power(70, 0.05, 0.0, draws=10) == 1.0
