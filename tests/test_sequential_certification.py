"""Certifying online (carnator_core/calibration/sequential.py, audit.py's online certificate).

Synthetic streams with known failure rates, seeded: the tests say when the anytime-valid
certificate must (and must not) claim risk ≤ α, over many seeds where the claim is about a
probability. Slack on a share of seeds: three binomial standard deviations.
"""
import json
import math
import random

import numpy as np
import pytest

from carnator_core.calibration import audit
from carnator_core.calibration import online as online_cert
from carnator_core.calibration.sequential import GridCertifier, RiskSequence, audit_plan
from carnator_core.gate import RiskModel

DELTA = 0.1
OTHER = {"outside_mean": 0.2, "outside_max": 0.5, "region_fraction": 0.2, "similarity_gap": 0.05,
         "depth_fraction": 0.5}


def slack(seeds: int, p: float = DELTA) -> float:
    return 3 * math.sqrt(p * (1 - p) / seeds)


def labels(rate: float, n: int, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).random(n) < rate).astype(int)


# ------------------------------------------------------------------ (i) too little data
def test_with_too_little_data_nothing_is_certified():
    seq = RiskSequence()
    for _ in range(40):  # no failure at all, but fewer labels than 1/δ can be earned with
        seq.observe(0)
    assert not seq.rejects(0.05, DELTA) and seq.upper(DELTA) > 0.05
    grid = GridCertifier([-3.0, -2.0], offline=-1, alpha=0.05, delta=DELTA)
    for _ in range(40):
        grid.observe([0, 1], 0)
    assert grid.certified() is None and grid.operating() == -1
    assert RiskSequence().upper(DELTA) == 1.0


# ------------------------------------------------------------------ (ii) certifies when it should
def test_a_stream_well_below_alpha_is_certified_within_a_few_hundred_labels():
    for seed in range(5):
        seq, at = RiskSequence(), None
        for i, y in enumerate(labels(0.01, 600, seed), 1):
            seq.observe(y)
            if seq.rejects(0.05, DELTA):
                at = i
                break
        assert at is not None and at <= 400, (seed, at)
        assert seq.upper(DELTA) <= 0.05


def clean_to_certify(alpha: float, before: tuple[int, ...] = (), **options) -> int:
    """Observations until risk < α is certified: ``before``, then clean ones."""
    seq, n = RiskSequence(**options), 0
    for y in before:
        seq.observe(y)
        n += 1
    while not seq.rejects(alpha, DELTA):
        seq.observe(0)
        n += 1
    return n


def test_the_bold_half_of_the_capital_certifies_a_clean_stream_sooner_and_a_failure_costs_little():
    for alpha in (0.05, 0.1):
        cautious, split = clean_to_certify(alpha, bold_bet=None), clean_to_certify(alpha)
        assert split <= 0.7 * cautious, (alpha, split, cautious)
        # all-in from the start would need log(1/δ)/log(1/(1−α)) clean labels: the split pays
        # log 2 more for keeping half the capital cautious
        assert split >= math.log(1 / DELTA) / -math.log(1 - alpha)
        # a failure once the bets are on: the bold half is all but gone, the cautious half
        # carries the test on, and the whole is not slower than the cautious bet alone
        failed = (0,) * 20 + (1,)
        assert clean_to_certify(alpha, failed) <= clean_to_certify(alpha, failed, bold_bet=None)


# ------------------------------------------------------------------ (iii) anytime validity
def test_the_certificate_ever_claims_risk_below_alpha_in_at_most_delta_of_streams_at_alpha():
    seeds, alpha = 300, 0.05
    for rate in (alpha, 0.06):
        ever = 0
        for seed in range(seeds):
            seq = RiskSequence()
            for y in labels(rate, 1500, seed):
                seq.observe(y)
            ever += seq.rejects(alpha, DELTA)  # rejections are sticky: "at any prefix"
        assert ever / seeds <= DELTA + slack(seeds), (rate, ever)


# ------------------------------------------------------------------ (iv) the grid's family-wise error
def test_the_grid_certifier_certifies_a_threshold_over_alpha_in_at_most_delta_of_streams():
    risks, alpha, seeds = [0.01, 0.03, 0.055, 0.08, 0.15], 0.05, 200  # risk grows along the grid
    bad = certified_first = 0
    for seed in range(seeds):
        grid = GridCertifier([float(i) for i in range(len(risks))], offline=0, alpha=alpha, delta=DELTA)
        rng = np.random.default_rng(seed)
        for ys in rng.random((600, len(risks))) < np.array(risks):
            for i, y in enumerate(ys):
                grid.observe(i, int(y))
        top = grid.certified()
        bad += top is not None and risks[top] > alpha
        certified_first += top is not None
    assert bad / seeds <= DELTA + slack(seeds), bad
    assert certified_first / seeds >= 0.8  # and it has power where the risk is well below α


# ------------------------------------------------------------------ (v) clusters
def test_clustered_labels_keep_the_cluster_test_valid_where_a_label_test_is_not():
    """Clusters of four labels that fail together (one bad reference run fails every reuse of
    it), at a pooled rate of exactly α: the label-level test treats four copies of one coin
    as four coins and claims risk < α far more often than δ; counted as clusters it does not."""
    seeds, alpha = 200, 0.1
    naive = clustered = 0
    for seed in range(seeds):
        rng = random.Random(seed)
        by_label, by_cluster = RiskSequence(), RiskSequence(max_cluster=4)
        for c in range(300):
            bad = int(rng.random() < alpha)
            for _ in range(4):
                by_label.observe(bad)
                by_cluster.observe(bad, cluster=c)
        by_cluster.close_all()
        naive += by_label.rejects(alpha, DELTA)
        clustered += by_cluster.rejects(alpha, DELTA)
    assert clustered / seeds <= DELTA + slack(seeds), clustered
    assert naive > 2 * clustered and naive / seeds > DELTA + slack(seeds)  # shown, not asserted as a bound


def test_clusters_close_by_size_or_age_and_a_closed_key_is_not_reopened():
    seq = RiskSequence(max_cluster=2, horizon=3)
    seq.observe(1, "a")
    seq.observe(0, "a")           # two labels: closed
    seq.observe(1, "a")           # its key is done: not counted
    seq.observe(0, "b")
    assert (seq.fails, seq.counts, seq.dropped) == ([1.0], [2], 1)
    seq.observe(0, "c")
    seq.observe(0, "d")
    assert seq.counts == [2]
    seq.observe(0, "e")           # three labels since "b" came: it closes alone
    assert seq.counts == [2, 1] and seq.summary(DELTA)["open_clusters"] == 3
    seq.close_all()
    assert seq.counts == [2, 1, 1, 1, 1] and seq.summary(DELTA)["rate"] == 1 / 6


# ------------------------------------------------------------------ (vi) tightening
def test_a_stream_whose_rate_jumps_above_alpha_makes_the_certifier_step_back():
    grid = GridCertifier([-3.0, -2.0, -1.0], offline=0, alpha=0.1, delta=DELTA)
    rng = np.random.default_rng(0)
    for _ in range(500):  # calm: every point well below α
        for i, p in enumerate((0.01, 0.02, 0.03)):
            grid.observe(i, int(rng.random() < p))
    assert grid.certified() == 2 and grid.operating() == 2 and grid.beyond() is None
    steps = None
    for t in range(1, 1001):  # drift: the two loosest points fail a third of the time
        for i, p in enumerate((0.01, 0.35, 0.35)):
            grid.observe(i, int(rng.random() < p))
        if grid.operating() == 0:
            steps = t
            break
    assert steps is not None and steps < 200, steps  # the alarm is quick after a long calm
    assert grid.certified() == 2  # what was certified stays on record; the alarm overrides it
    for _ in range(300):  # the calibration's own threshold breaks too: no reuse
        grid.observe(0, int(rng.random() < 0.4))
    assert grid.operating() == -1 and grid.summary()["operating"] is None


def test_the_alarm_stays_quiet_on_a_stream_at_alpha():
    quiet = sum(not _alarm(seed) for seed in range(100))
    assert quiet >= 100 * (1 - DELTA - slack(100))


def _alarm(seed: int) -> bool:
    seq = RiskSequence()
    for y in labels(0.1, 1000, seed):
        seq.observe(y)
    return seq.exceeds(0.1, DELTA)


# ------------------------------------------------------------------ exploration
def test_exploration_labels_a_uniform_share_of_each_point_and_serves_in_full_when_deeper():
    rng = random.Random(0)
    fed = {"now": 0, "beyond": 0}
    for _ in range(20000):
        plan = audit_plan(rng.random(), now=8, beyond=12, audit_rate=0.03, explore_rate=0.05)
        for reuse, feeds in plan["label"].items():
            for f in feeds:
                fed[f] += 1
        assert plan["serve"] == ("full" if 12 in plan["label"] else "reuse")
    assert abs(fed["now"] / 20000 - 0.03) < 0.006 and abs(fed["beyond"] / 20000 - 0.05) < 0.008
    same = audit_plan(0.01, now=8, beyond=8, audit_rate=0.03, explore_rate=0.05)
    assert same == {"serve": "reuse", "label": {8: ["now", "beyond"]}}  # one label, both points
    miss = audit_plan(0.01, now=None, beyond=8, audit_rate=0.03, explore_rate=0.05)
    assert miss == {"serve": "full", "label": {8: ["beyond"]}}
    assert audit_plan(0.5, now=8, beyond=12, audit_rate=0.03, explore_rate=0.05)["label"] == {}
    assert audit.explore("request-1", 8, 12, 1.0, 0.0) == {"serve": "reuse", "label": {8: ["now"]}}


# ------------------------------------------------------------------ in the audit log
def _model() -> RiskModel:
    return RiskModel(calibrated=True, source="test", measured_reuses=100,
                     thresholds={"other": {"0.1": -3.0, "0.2": -2.0}, "same_scene": {"0.1": 0.7}})


def test_audits_extend_the_gate_online_and_an_alarm_steps_it_back(tmp_path):
    model, fp = _model(), "f" * 32
    calib = audit.calibration_id(model)
    log = audit.AuditLog(tmp_path)

    def add(n, label, feeds=None, explored=False, start=0):
        for i in range(start, start + n):
            log.record(fp, calib, 0.1, OTHER, None, 10, 20, 20.0 if label else 40.0, label, "latent",
                       entry_id=f"e{i // 2}", feeds=feeds, explored=explored)

    add(30, 0)  # ordinary audits at the gate's threshold: too few to certify anything online
    assert audit.online_model(model, log.online(fp, model)).thresholds == model.thresholds
    add(200, 0, start=30)
    add(200, 0, feeds=[-2.0], explored=True, start=1000)  # explored one ladder point beyond
    online = log.online(fp, model)
    assert online["0.1"]["other"].operating() == 1
    wider = audit.online_model(model, online)
    assert wider.threshold_for(0.1, "other") == (0.1, -2.0)  # the 20% threshold now holds at 10%
    assert wider.thresholds["same_scene"] == model.thresholds["same_scene"]  # no audits: unchanged
    assert model.threshold_for(0.1, "other") == (0.1, -3.0)  # the loaded model is not changed
    status = log.status(fp, calib, model)["0.1"]
    assert status["all"]["audits"] == 230  # explored reuses were not served: not in the rate
    assert status["online"]["other"]["operating"] == -2.0
    assert status["online"]["other"]["cost_generations"] == 430
    add(60, 1, feeds=[-2.0], explored=True, start=2000)  # the traffic turns at -2.0
    back = audit.online_model(model, log.online(fp, model))
    assert back.threshold_for(0.1, "other") == (0.1, -3.0)
    assert log.levels(fp, calib, 0.1) == {}  # explored failures never trip the served-rate rule
    log.close()


def test_a_cell_certified_at_no_budget_is_walked_online_from_its_ladder_points(tmp_path):
    """A cheap calibration certifies nothing for other evidence but keeps the transferred
    ranking's points as its ladder: the gate refuses that cell, the online certificate starts
    below the first point, and explored audits at it, enough and within α, certify it — in a
    file saved and loaded back, whether the cell's table is empty or absent."""
    for thresholds in ({"other": {}, "same_scene": {"0.1": 0.7}}, {"same_scene": {"0.1": 0.7}}):
        path = tmp_path / f"cal{len(thresholds)}.json"
        RiskModel(calibrated=True, source="test", measured_reuses=40, thresholds=thresholds,
                  ladders={"other": [-2.0, -3.0]}).save(path)
        model, fp = RiskModel.load(path), "e" * 32
        assert model.ladders == {"other": [-2.0, -3.0]} and model.threshold_for(0.1, "other") is None
        assert not model.accepts({**OTHER, "depth_fraction": 0.1}, 0.1)
        assert audit.ladder(model, "other") == [-3.0, -2.0]
        log = audit.AuditLog(tmp_path / path.stem)
        calib = audit.calibration_id(model)
        assert online_cert.certificates(model, 0.1)["other"].operating() == -1  # below its first point
        for i in range(300):  # explored reuses at the first point, one cluster per two audits
            log.record(fp, calib, 0.1, OTHER, None, 10, 20, 40.0, 0, "latent", entry_id=f"e{i // 2}",
                       feeds=[-3.0], explored=True)
        online = audit.online_model(model, log.online(fp, model))
        assert online.threshold_for(0.1, "other") == (0.1, -3.0)
        assert model.threshold_for(0.1, "other") is None  # the loaded model is not changed
        log.close()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**json.loads(path.read_text()), "ladders": {"other": ["x"]}}))
    with pytest.raises(ValueError, match="ladders.other"):
        RiskModel.load(bad)
