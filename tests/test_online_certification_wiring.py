"""The online certificate in the request flow (calibration/online.py, served_audits.after_audits).

Requests run on the bundled tiny Wan model through ComfyUI's own sampler; the calibration is
a file written for the model whose thresholds sit between the logits of the request's own
depths, so each ladder point is one snapshot deeper than the last. Audits that certify,
or alarm, are recorded by another ``AuditLog`` (another worker sharing audits.sqlite), with
failure rates known, so the tests say exactly where the gate must run.
"""
import json

import pytest
import torch

from carnator_core import pipeline
from carnator_core.calibration import audit, online
from carnator_core.calibration.status import model_status, status_line
from carnator_core.comfy_adapter import model_fingerprint, start_request
from carnator_core.gate import RiskModel, calibration_file

PROMPT = "a red ball rolls left across a green field"
RELATED = "a red ball rolls left across a green field slowly"
ALPHA = 0.2
BUDGETS = ("0.1", "0.2", "0.3", "0.5")  # the ladder: the request reuses at k = 2, 3, 4, 7 of 10


def probe(requests, model, prompt):
    pos, neg, latent = requests.inputs("wan21", prompt)
    return start_request(model, pos, neg, latent, 7, requests.steps, 4.0, "euler", "simple",
                         requests.settings, {"folder": requests.cache_folder, "capacity_bytes": 1 << 30},
                         label=prompt)


@pytest.fixture
def calibrated(tiny_models, requests_in):
    """PROMPT stored; a calibration whose thresholds at α 10/20/30/50% accept RELATED's reuse
    at depths 2, 3, 4 and 7; audits.sqlite made (a worker that audits)."""
    model = tiny_models["wan21"]
    requests_in.settings.gate.risk_budget = ALPHA
    first = requests_in(model, "wan21", PROMPT)[1]
    assert first.outcome == "miss"
    # RELATED's evidence against PROMPT, read by the gate on the prior
    plan, _ = pipeline.lookup_and_gate(probe(requests_in, model, RELATED))
    assert plan.accept and plan.features["region_fraction"] > 0.02, plan.reason  # other evidence
    prior = RiskModel()
    z = {k: prior.logit({**plan.features, "depth_fraction": k / 10}) for k in (2, 3, 4, 6, 7, 8)}
    lam = [(z[2] + z[3]) / 2, (z[3] + z[4]) / 2, (z[4] + z[6]) / 2, (z[7] + z[8]) / 2]
    probe_fraction = requests_in.settings.probe_fraction  # the calibration is for the requests' probe
    cal = RiskModel(calibrated=True, source="written for this test", measured_reuses=400, confidence=0.9,
                    probe_fraction=probe_fraction,
                    tolerance={"psnr_bound": 30.0, "space": "latent"},
                    thresholds={"other": dict(zip(BUDGETS, lam)), "same_scene": {"0.2": 0.3}})
    fp = model_fingerprint(model)
    path = calibration_file(requests_in.cache_folder, fp, probe_fraction)
    path.parent.mkdir(parents=True, exist_ok=True)
    cal.save(path)
    audit.AuditLog(requests_in.cache_folder).close()
    online.forget()
    return {"model": model, "fp": fp, "calibration": RiskModel.load(path), "lam": lam,
            "entry": first.stored_id}


def worker_records(requests_in, ctx, n, label, threshold, start, explored=True):
    """Another worker's audits at one ladder point: clusters of two audits per stored entry."""
    cal = ctx["calibration"]
    feats = {"outside_mean": 0.1, "outside_max": 0.3, "region_fraction": 0.05, "similarity_gap": 0.01,
             "depth_fraction": 0.4, "reuse_share": 0.05}
    with audit.AuditLog(requests_in.cache_folder) as log:
        for i in range(start, start + n):
            log.record(ctx["fp"], audit.calibration_id(cal), ALPHA, feats, None, 4, 10,
                       20.0 if label else 40.0, label, "latent", entry_id=f"w{i // 2}",
                       feeds=[threshold], explored=explored)


def certify_one_point_deeper(requests_in, ctx, start=0):
    """Audits within tolerance: 60 of served reuses at the calibration's threshold (the fixed
    sequence starts there) and 60 explored one point beyond."""
    worker_records(requests_in, ctx, 60, 0, ctx["lam"][1], start=start, explored=False)
    worker_records(requests_in, ctx, 60, 0, ctx["lam"][2], start=start + 500)


def gate_plan(requests_in, ctx, prompt=RELATED):
    plan, _ = pipeline.lookup_and_gate(probe(requests_in, ctx["model"], prompt))
    return plan


def test_audits_that_certify_a_deeper_threshold_extend_the_next_requests_gate(calibrated, requests_in):
    ctx, lam = calibrated, calibrated["lam"]
    before = gate_plan(requests_in, ctx)
    assert before.accept and before.reuse_step == 3 and "online" not in before.reason, before.reason
    # another worker's audits, all within tolerance: at the 20% threshold and explored at the 30%
    certify_one_point_deeper(requests_in, ctx)
    after = gate_plan(requests_in, ctx)
    assert after.accept and after.reuse_step == 4, after.reason
    assert "online: other certified to its 30% threshold at α 20% from 120 audits" in after.reason
    # the request itself: served at the deeper point, its summary says why
    _, hit = requests_in(ctx["model"], "wan21", RELATED)
    assert hit.outcome == "hit" and hit.reuse_step == 4, hit.text()
    assert "online: other certified" in hit.calibration, hit.calibration
    # and the cache tab's model status carries the same clause
    st = model_status(requests_in.cache_folder, ctx["fp"])
    assert "online: other certified to its 30% threshold" in st["online"]["0.2"]["text"]
    assert st["online"]["0.2"]["cells"]["other"]["operating"] == pytest.approx(lam[2])
    assert "online: other certified" in status_line(st, ALPHA)


def test_an_alarm_steps_the_gate_back(calibrated, requests_in):
    ctx, lam = calibrated, calibrated["lam"]
    certify_one_point_deeper(requests_in, ctx)
    assert gate_plan(requests_in, ctx).reuse_step == 4
    worker_records(requests_in, ctx, 40, 1, lam[2], start=1000)  # the traffic turns there
    back = gate_plan(requests_in, ctx)
    assert back.reuse_step == 3 and "online" not in back.reason, back.reason  # the calibration's again
    worker_records(requests_in, ctx, 40, 1, lam[1], start=2000)  # and at the calibration's own
    below = gate_plan(requests_in, ctx)
    assert below.accept and below.reuse_step == 2, below.reason
    assert "online alarm: other stepped back to its 10% threshold" in below.reason
    st = model_status(requests_in.cache_folder, ctx["fp"])
    assert "online alarm" in status_line(st, ALPHA)
    with audit.AuditLog(requests_in.cache_folder) as log:
        assert log.levels(ctx["fp"], audit.calibration_id(ctx["calibration"]), ALPHA) == {}


def test_the_kept_certificate_reads_only_new_rows_and_replays_when_rows_go(calibrated, requests_in,
                                                                          monkeypatch):
    ctx, lam = calibrated, calibrated["lam"]
    cal, fp = ctx["calibration"], ctx["fp"]
    fed = []
    real_feed = audit.feed

    def counting_feed(cells, rows, *args, **kw):
        fed.append(len(rows))
        return real_feed(cells, rows, *args, **kw)

    monkeypatch.setattr(audit, "feed", counting_feed)  # counts the rows each read feeds
    with audit.AuditLog(requests_in.cache_folder) as mine:
        read = lambda: online.read(mine, fp, cal, ALPHA, lambda cells: cells["other"].operating())  # noqa: E731
        assert read() == 1 and fed == []
        certify_one_point_deeper(requests_in, ctx)  # another connection writes
        assert read() == 2 and fed == [120]
        assert read() == 2 and fed == [120]  # nothing new: nothing replayed
        worker_records(requests_in, ctx, 2, 0, lam[2], start=2000)
        assert read() == 2 and fed == [120, 2]
        # the same as replaying every audit at once
        assert online.read(mine, fp, cal, ALPHA, lambda c: c["other"].summary()) == \
            mine.online(fp, cal)["0.2"]["other"].summary()
        fed.clear()
        mine.db.execute("DELETE FROM audits WHERE id <= 40")  # rows gone below what was fed
        read()
        assert fed == [82]  # replayed from the start


def test_exploring_serves_the_full_result_and_labels_the_deeper_reuse(calibrated, requests_in, tmp_path):
    """Explored and audited at once: the request is served in full; the reuse one point
    beyond (k = 4) and the gate's own (k = 3) are both run and judged against it."""
    ctx, lam = calibrated, calibrated["lam"]
    requests_in.settings.explore_rate = requests_in.settings.audit_rate = 1.0
    out, s = requests_in(ctx["model"], "wan21", RELATED)
    assert s.outcome == "miss" and "explored one point beyond" in s.reason, s.text()
    assert s.steps_computed == s.steps_total  # computed in full, and served
    assert s.audit["explored"] and len(s.audit["labels"]) == 2 and s.audit["calls"] > 0, s.audit
    assert "explored k*=4" in s.text() and "audited k*=3" in s.text()
    with audit.AuditLog(requests_in.cache_folder) as log:
        rows = log.db.execute("SELECT k, entry_id, feeds, explored FROM audits ORDER BY k").fetchall()
        assert [(k, e, json.loads(f), x) for k, e, f, x in rows] == [
            (3, ctx["entry"], [pytest.approx(lam[1])], 0),  # the gate's own: in its served rate
            (4, ctx["entry"], [pytest.approx(lam[2])], 1)]  # explored: the online certificate only
        st = log.status(ctx["fp"], audit.calibration_id(ctx["calibration"]))
        assert st["0.2"]["all"]["audits"] == 1
    # what the user got is the request computed in full
    from request_flow import Requests
    fresh = Requests(tmp_path / "fresh", risk_budget=ALPHA)
    full, miss = fresh(ctx["model"], "wan21", RELATED)
    assert miss.outcome == "miss" and torch.equal(out, full)


def test_explore_rate_zero_changes_nothing(calibrated, requests_in):
    """The plans with the online wiring and explore_rate 0 are the calibration's own (the
    gate's decision on the file's thresholds); audits are drawn as before and record the
    threshold they ran at."""
    ctx = calibrated
    cal = ctx["calibration"]
    requests_in.settings.audit_rate, requests_in.settings.explore_rate = 1.0, 0.0
    prompts = [RELATED, RELATED + " today", "a red ball rolls right across a green field"]
    for prompt in prompts:
        pr = probe(requests_in, ctx["model"], prompt)
        found = pipeline.lookup(pr)
        plan, _ = pipeline.gate(pr, found, cal)
        alone, _ = pipeline.decide(pr.signature, pipeline.comparable_candidates(pr, found), pr.run.steps,
                                   pr.probe_steps, cal, pr.settings.gate, pr.settings.region_fill_calls,
                                   False, pipeline.region_share_of(pr))
        assert (plan.accept, plan.reuse_step, plan.entry_id, plan.reason) == \
            (alone.accept, alone.reuse_step, alone.entry_id, alone.reason)
        _, s = pipeline.reuse(pr, plan)
        assert "explored" not in s.reason and (s.audit is None or not s.audit.get("explored"))
    with audit.AuditLog(requests_in.cache_folder) as log:
        rows = log.db.execute("SELECT feeds, explored FROM audits").fetchall()
    assert rows and all(x == 0 and len(json.loads(f)) == 1 for f, x in rows), rows
    assert {json.loads(f)[0] for f, _ in rows} <= {cal.threshold_for(ALPHA, "other")[1]}


def test_a_cell_certified_at_no_budget_is_explored_from_its_ladder_and_certified_by_audits(calibrated,
                                                                                          requests_in):
    """A cheap calibration that certified no other-evidence threshold but kept the transferred
    points as its ladder: the gate refuses RELATED's reuse; exploring runs it at the first
    point (k = 2) and records it for the online certificate only; audits within tolerance at
    that point then make the gate reuse there, and the summary says why."""
    ctx, lam = calibrated, calibrated["lam"]
    path = calibration_file(requests_in.cache_folder, ctx["fp"], requests_in.settings.probe_fraction)
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "thresholds": {"other": {}, "same_scene": {"0.2": 0.3}},
                                "ladders": {"other": lam}}))
    cal = RiskModel.load(path)
    ctx = {**ctx, "calibration": cal}
    refused = gate_plan(requests_in, ctx)
    assert not refused.accept and refused.why == "not_certified", refused.reason
    requests_in.settings.explore_rate = requests_in.settings.audit_rate = 1.0
    _, s = requests_in(ctx["model"], "wan21", RELATED)
    assert s.outcome == "miss" and s.steps_computed == s.steps_total and s.audit["explored"], s.text()
    assert "explored k*=2" in s.text()
    with audit.AuditLog(requests_in.cache_folder) as log:
        rows = log.db.execute("SELECT k, feeds, explored FROM audits").fetchall()
    assert [(k, json.loads(f), x) for k, f, x in rows] == [(2, [pytest.approx(lam[0])], 1)]
    worker_records(requests_in, ctx, 120, 0, lam[0], start=0)  # explored, within tolerance
    after = gate_plan(requests_in, ctx, RELATED + " today")  # RELATED itself is stored now
    assert after.accept and f"online: other certified to score {lam[0]:.2f} at α 20%" in after.reason, after.reason
    with audit.AuditLog(requests_in.cache_folder) as log:
        extended = online.read(log, ctx["fp"], cal, ALPHA, lambda cells: online.gate_model(cal, ALPHA, cells)[0])
    assert extended.threshold_for(ALPHA, "other") == (ALPHA, pytest.approx(lam[0]))
