"""Calibrating on the user's own model, and live audits of its gate.

The calibration and the audits run on the bundled tiny models through ComfyUI's own
loader; the audit log is a real SQLite file; tightening is driven by synthetic streams
whose failure rate is known, so the tests say exactly when it must (and must not) happen.
"""
import json
import random
from pathlib import Path

import pytest
import torch

from carnator_core.calibration import audit

from carnator_core.calibration import pairs as prompt_pairs
from carnator_core.calibration.status import known_fingerprints, model_status, status_line
from carnator_core.gate import UNNAMED_PROBE_FRACTION, RiskModel, calibrated_steps, evidence_class, risk_model_for
from carnator_core.calibration.risk_control import min_accepted
from carnator_core.calibration.generic import Tolerance, calibrate, load_progress, progress_path, report_text

PROMPT = "a red ball rolls left across a green field"
RELATED = "a red ball rolls left across a green field slowly"
OTHER = {"outside_mean": 0.2, "outside_max": 0.5, "region_fraction": 0.2, "similarity_gap": 0.05,
         "depth_fraction": 0.5}


# ------------------------------------------------------------------ prompt pairs
def test_prompt_pairs_apply_each_operator_and_keep_given_pairs():
    got = prompt_pairs.pairs(n=18, seed=3)
    assert [p["kind"] for p in got[:9]] == list(prompt_pairs.KINDS)
    assert all(p["a"] != p["b"] for p in got)
    mirror = next(p for p in got if p["kind"] == "left_right")
    assert ("left" in mirror["a"]) == ("right" in mirror["b"])
    assert prompt_pairs.pairs(n=18, seed=3) == got  # deterministic
    mixed = prompt_pairs.pairs_from_text("a cat || a dog\n# comment\na red car drives to the left", 5)
    assert mixed[0] == {"a": "a cat", "b": "a dog", "kind": "given", "group": 0}
    assert len(mixed) == 5 and {p["group"] for p in mixed} == set(range(5))
    chains = prompt_pairs.pairs(n=12, kinds=("chain",), seed=2)
    changed = [sum(x != y for x, y in zip(p["a"].split(), p["b"].split())) + abs(len(p["a"].split()) - len(p["b"].split()))
               for p in chains]
    assert all(c >= 1 for c in changed) and sum(c >= 2 for c in changed) >= 9  # edits in a row
    derived = prompt_pairs.derived_pairs(prompt_pairs.BUILTIN_PROMPTS, 40, seed=4)
    assert [p["group"] for p in derived] == list(range(40))
    kinds = [p["kind"] for p in derived]
    assert kinds.count("chain") == kinds.count("session") == 10 and kinds[-10:] == ["session"] * 10
    # sessions drift further than two or three edits: some pairs differ in many words
    sessions = [p for p in derived if p["kind"] == "session"]
    assert max(len(set(p["b"].split()) ^ set(p["a"].split())) for p in sessions) >= 8
    with pytest.raises(ValueError, match="base prompts"):
        prompt_pairs.pairs(["zzz"], n=20, kinds=("colour",))


# ------------------------------------------------------------------ audits
def test_audits_are_sampled_at_the_set_rate():
    keys = [f"request-{i}" for i in range(4000)]
    for rate in (0.02, 0.1, 0.5):
        n = sum(audit.sampled(rate, k) for k in keys)
        sd = (4000 * rate * (1 - rate)) ** 0.5
        assert abs(n - 4000 * rate) < 4 * sd, (rate, n)
    assert not any(audit.sampled(0.0, k) for k in keys)
    assert all(audit.sampled(1.0, k) for k in keys)
    assert [audit.sampled(0.3, k) for k in keys[:50]] == [audit.sampled(0.3, k) for k in keys[:50]]


def _record(log, label, alpha=0.05, fp="fpA", calib="c1", features=OTHER):
    return log.record(fp, calib, alpha, features, 1.0, 10, 20, 25.0 if label else 40.0, label,
                      "latent")


def test_audits_and_levels_survive_a_restart(tmp_path):
    log = audit.AuditLog(tmp_path)
    for label in (0, 1, 0):
        _record(log, label)
    log.close()
    again = audit.AuditLog(tmp_path)
    st = again.status("fpA", "c1")["0.05"]
    assert st["all"]["audits"] == 3 and st["all"]["failures"] == 1
    assert st["classes"]["other"]["current"]["audits"] == 3
    assert again.status("fpB") == {}  # another model's audits are its own


@pytest.mark.parametrize("rate,alpha,must_tighten", [(0.25, 0.05, True), (0.0, 0.05, False),
                                                     (0.01, 0.1, False)])
def test_tightening_follows_a_stream_with_a_known_failure_rate(tmp_path, rate, alpha, must_tighten):
    rng = random.Random(0)
    log = audit.AuditLog(tmp_path)
    need = min_accepted(alpha, audit.DELTA)
    tightened_at, failures = None, 0
    for i in range(1, 301):
        label = int(rng.random() < rate)
        failures += label
        state = _record(log, label, alpha)
        if state["tightened"]:
            tightened_at = i
            break
        assert state["audits"] == i  # counted at the current level
    if must_tighten:
        # the first moment the rule allows: enough audits to certify α, and over α
        assert tightened_at is not None and tightened_at >= need
        assert failures > alpha * tightened_at
        assert log.levels("fpA", "c1", alpha) == {"other": 1}
        after = _record(log, 0, alpha)
        assert after["level"] == 1 and after["audits"] == 1  # counting starts afresh
    else:
        assert tightened_at is None and log.levels("fpA", "c1", alpha) == {}


def test_tightening_walks_down_the_certified_ladder():
    model = RiskModel(calibrated=True, thresholds={"other": {"0.02": -3.0, "0.05": -2.0, "0.1": -1.0},
                                                   "same_scene": {"0.05": 0.6}})
    tight, alpha = audit.tightened(model, 0.05, {"other": 1})
    assert alpha == 0.05 and tight.threshold_for(0.05, "other") == (0.02, -3.0)
    assert tight.threshold_for(0.05, "same_scene") == (0.05, 0.6)  # the other class untouched
    assert audit.tightened(model, 0.05, {"other": 2})[0].threshold_for(0.05, "other") is None
    assert model.threshold_for(0.05, "other") == (0.05, -2.0)  # the loaded model is not changed
    assert audit.tightened(RiskModel(), 0.2, {"other": 2}) == (RiskModel(), 0.05)  # the prior: α/4


def test_a_sampled_hit_is_audited_and_tightened_levels_reach_the_gate(tiny_models, requests_in):
    model = tiny_models["wan21"]
    requests_in.settings.audit_rate = 1.0
    _, miss = requests_in(model, "wan21", PROMPT)
    _, hit = requests_in(model, "wan21", RELATED)
    assert miss.outcome == "miss" and miss.audit is None  # only hits are audited
    assert hit.outcome == "hit" and hit.audit["audited"], hit.text()
    assert hit.audit["calls"] == hit.steps_total  # the request computed once more, in full
    assert hit.audit["audits"] == 1 and "audited: PSNR" in hit.text()
    log = audit.AuditLog(requests_in.cache_folder)
    fp = next(iter(json.loads(r[0]) for r in log.db.execute("SELECT features FROM audits")))
    assert set(fp) >= {"region_fraction", "depth_fraction"}
    fingerprint = log.db.execute("SELECT fingerprint FROM audits").fetchone()[0]
    # the audits broke the budget: the prior's α is halved per level until nothing passes
    log.db.execute("INSERT INTO audit_levels VALUES (?,?,?,?,?,?,?)",
                   (fingerprint, "prior", requests_in.settings.gate.risk_budget, "other", 30, 0.0, "test"))
    log.db.execute("INSERT INTO audit_levels VALUES (?,?,?,?,?,?,?)",
                   (fingerprint, "prior", requests_in.settings.gate.risk_budget, "same_scene", 30, 0.0, "test"))
    log.close()
    _, tight = requests_in(model, "wan21", RELATED + " today", seed=7)
    assert tight.outcome == "miss" and "tightened by live audits" in tight.reason, tight.text()
    assert "audits at α" in tight.calibration


# ------------------------------------------------------------------ calibration on the model
class Interrupted(Exception):
    pass


def _tiny_runs(model, requests, steps=8):
    made = []

    def make_run(prompt, seed):
        made.append(prompt)
        return requests.run_obj(model, "wan21", prompt, seed=seed, shape=(1, 16, 3, 8, 8), steps=steps)
    return make_run, made


def test_calibration_resumes_after_an_interruption_and_writes_the_gates_file(tiny_models, requests_in, tmp_path):
    model = tiny_models["wan21"]
    from carnator_core.comfy_adapter import model_fingerprint
    fp = model_fingerprint(model)
    pairs = prompt_pairs.pairs(n=4, seed=0)
    make_run, made = _tiny_runs(model, requests_in)
    settings = requests_in.settings
    tol = Tolerance(30.0, "latent")

    def stop_after_two(done, total):
        if done == 2:
            raise Interrupted

    with pytest.raises(Interrupted):
        calibrate(make_run, pairs, settings, tol, tmp_path, fp, 8, on_pair=stop_after_two)
    progress = progress_path(tmp_path / "calibration" / f"{fp}.json")
    assert len(load_progress(progress)) == 2 and not (tmp_path / "calibration" / f"{fp}.json").exists()
    first = len(made)
    per_pair = first // 2
    cal, report = calibrate(make_run, pairs, settings, tol, tmp_path, fp, 8)
    assert len(made) - first == 2 * per_pair  # only the two pairs not measured yet
    assert report["pairs"] == 4 and report["measured_reuses"] > 0
    loaded = risk_model_for(tmp_path, fp)
    assert loaded.calibrated and loaded.tolerance == {"psnr_bound": 30.0, "space": "latent"}
    assert loaded.measured_reuses == report["measured_reuses"]
    made.clear()
    calibrate(make_run, pairs, settings, tol, tmp_path, fp, 8)
    assert made == []  # a finished calibration refits without measuring
    st = model_status(tmp_path, fp)
    assert st["calibrated"] and st["where"] == "cache"
    assert "calibrated for probe_fraction 0.1 (" in status_line(st, 0.05)  # not the samplers' default


def test_the_cache_tab_lists_calibrations_by_the_names_the_gate_reads(tmp_path):
    """A file counts as a calibration at one N only under the name calibration_file gives it
    (the gate reads no other); reports, progress files and other models' files do not."""
    cal = tmp_path / "calibration"
    cal.mkdir()
    fp, fpx, other = "a" * 32, "b" * 32, "c" * 32  # model fingerprints are 32 hex digits
    for name in (f"{fp}.json", f"{fp}.n30.json", f"{fp}.probe0.05.n50.json", f"{fp}.probe0.050.n40.json",
                 f"{fp}.n30.report.json", f"{fp}.progress.jsonl", f"{fpx}.n20.json",
                 f"{other}.probe0.05.json", "demo_models.json"):
        (cal / name).write_text("{}")
    assert calibrated_steps(tmp_path, fp) == [{"probe_fraction": 0.05, "steps": 50},
                                              {"probe_fraction": 0.1, "steps": 30}]
    assert known_fingerprints(tmp_path) == [fp, fpx, other]  # not "demo_models"


def test_a_calibration_for_another_fingerprint_is_never_used(tmp_path):
    fitted = RiskModel(calibrated=True, source="fitted elsewhere", measured_reuses=10,
                       thresholds={"other": {"0.05": -2.0}})
    (tmp_path / "calibration").mkdir()
    fitted.save(tmp_path / "calibration" / "fp_other.json")
    assert risk_model_for(tmp_path, "fp_other").calibrated
    mine = risk_model_for(tmp_path, "fp_mine")
    assert not mine.calibrated and not mine.thresholds
    assert not model_status(tmp_path, "fp_mine")["calibrated"]
    assert "uncalibrated prior" in status_line(model_status(tmp_path, "fp_mine"))


def test_a_latent_psnr_tolerance_labels_by_its_bound():
    ref = torch.linspace(-1, 1, 1000)
    from carnator_core.calibration.tolerance import psnr
    assert psnr(ref, ref) == 100.0
    noisy = ref + 0.02 * torch.randn(1000, generator=torch.Generator().manual_seed(0))
    assert 35 < psnr(noisy, ref) < 45  # peak 2, rms 0.02 → 40 dB
    with pytest.raises(ValueError):
        Tolerance(30, "pixels")
    assert evidence_class(OTHER) == "other"


def test_a_farm_sets_the_audit_rate_once_in_the_environment(monkeypatch):
    from carnator_core.comfy_adapter import audit_rate_default
    monkeypatch.delenv("CARNATOR_AUDIT_RATE", raising=False)
    assert audit_rate_default() == 0.0  # a single user: off
    monkeypatch.setenv("CARNATOR_AUDIT_RATE", "0.02")
    assert audit_rate_default() == 0.02
    monkeypatch.setenv("CARNATOR_AUDIT_RATE", "lots")
    assert audit_rate_default() == 0.0  # not a number: off, with a warning in the log


# ------------------------------------------------------------------ a calibration per N
def test_a_calibration_at_another_n_is_kept_beside_the_first_and_used_at_its_n(tiny_models, requests_in):
    """Calibrating at 10 steps after 8 keeps the 8-step file (used at any other N, depths by
    their share) and writes the 10-step one beside it; a request at 10 steps is gated by the
    10-step calibration, so its summary states α as certified there."""
    model = tiny_models["wan21"]
    from carnator_core.comfy_adapter import model_fingerprint
    fp, folder = model_fingerprint(model), Path(requests_in.cache_folder)
    pairs, tol = prompt_pairs.pairs(n=4, seed=0), Tolerance(30.0, "latent")
    calibrate(_tiny_runs(model, requests_in, 8)[0], pairs, requests_in.settings, tol, folder, fp, 8)
    general = folder / "calibration" / f"{fp}.json"
    first = general.read_text()
    calibrate(_tiny_runs(model, requests_in, 10)[0], pairs, requests_in.settings, tol, folder, fp, 10)
    assert general.read_text() == first  # the 8-step calibration was not replaced
    at_ten = folder / "calibration" / f"{fp}.n10.json"
    assert at_ten.is_file() and (folder / "calibration" / f"{fp}.n10.report.json").is_file()
    assert risk_model_for(folder, fp, steps=10).measured_steps == 10
    assert risk_model_for(folder, fp, steps=8).measured_steps == 8
    assert risk_model_for(folder, fp, steps=12).measured_steps == 8 and risk_model_for(folder, fp).measured_steps == 8
    # the cache tab lists it with the model (the route's model_status)
    assert model_status(folder, fp)["calibrated_steps"] == [{"probe_fraction": 0.1, "steps": 10}]

    _, request = requests_in(model, "wan21", PROMPT)  # these requests sample 10 steps
    assert request.steps_total == 10
    assert "gate: calibrated for probe_fraction 0.1 (" in request.calibration, request.text()
    assert "measured at 8 steps" not in request.calibration and "measured at 10 steps" not in request.calibration
    at_twelve = status_line(model_status(folder, fp, steps=12), 0.05, 12)
    assert "measured at 8 steps: at 12 the depths carry over" in at_twelve

    # recalibrating at 8 steps replaces the general file, not the 10-step one
    ten = at_ten.read_text()
    calibrate(_tiny_runs(model, requests_in, 8)[0], prompt_pairs.pairs(n=5, seed=0), requests_in.settings,
              tol, folder, fp, 8)
    assert general.read_text() != first and at_ten.read_text() == ten
    # a file named for one N that holds another is refused; the request still runs, on the
    # uncalibrated prior, and says why
    at_ten.write_text(first)
    with pytest.raises(ValueError, match="measured at 8 steps, not 10"):
        risk_model_for(folder, fp, steps=10)
    _, refused = requests_in(model, "wan21", RELATED)
    assert "uncalibrated prior" in refused.calibration and "measured at 8 steps, not 10" in refused.calibration


def test_a_calibration_records_its_latent_size_and_a_larger_request_is_told_it_is_not_certified(
        tiny_models, requests_in):
    """Calibrated at 3×8×8 latents, served at 3×16×16: the file and the report name the size
    measured, and a request of the larger size is told that α was measured at a quarter of its
    tokens and is not certified there; one of the measured size is told nothing of size."""
    model = tiny_models["wan21"]
    from carnator_core.comfy_adapter import model_fingerprint
    fp, folder = model_fingerprint(model), Path(requests_in.cache_folder)
    cal, report = calibrate(_tiny_runs(model, requests_in, 10)[0], prompt_pairs.pairs(n=4, seed=0),
                            requests_in.settings, Tolerance(30.0, "latent"), folder, fp, 10)
    assert cal.measured_latents == [[3, 8, 8]] and report["latents"] == [[3, 8, 8]]
    assert "latent 3×8×8" in report_text(report)
    assert risk_model_for(folder, fp, steps=10).measured_latents == [[3, 8, 8]]  # saved and read back

    _, larger = requests_in(model, "wan21", PROMPT)  # the default latent, 3×16×16
    assert "gate: calibrated" in larger.calibration, larger.text()
    assert "measured at latent 3×8×8, 25% of this request's tokens" in larger.calibration
    assert "not certified at this size" in larger.calibration
    _, same = requests_in(model, "wan21", PROMPT, seed=8, shape=(1, 16, 3, 8, 8))
    assert "gate: calibrated" in same.calibration and "measured at latent" not in same.calibration, same.text()
    smaller = status_line(model_status(folder, fp, steps=10), 0.05, 10, (2, 8, 8))
    assert "measured at latent 3×8×8, not this request's 2×8×8" in smaller

    # a size that is not three positive counts is refused by name; the request runs on the prior
    path = folder / "calibration" / f"{fp}.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "measured_latents": [[3, 0, 8]]}))
    with pytest.raises(ValueError, match="measured_latents"):
        risk_model_for(folder, fp)


# ------------------------------------------------------------------ a calibration per probe
def test_a_calibration_holds_for_the_probe_it_was_measured_with(tiny_models, requests_in):
    """Evidence read after one probe step is not the evidence read after two: a calibration
    measured with one probe is found only by requests with that probe; another probe gets
    the prior and a status line that names the calibrated one."""
    import copy
    model = tiny_models["wan21"]
    from carnator_core.comfy_adapter import model_fingerprint
    fp, folder = model_fingerprint(model), requests_in.cache_folder
    make_run, _ = _tiny_runs(model, requests_in)
    two_steps = copy.deepcopy(requests_in.settings)
    two_steps.probe_fraction = 0.25  # 2 of 8 steps; the requests below probe 1 of 10 by default
    cal, report = calibrate(make_run, prompt_pairs.pairs(n=4, seed=0), two_steps,
                            Tolerance(30.0, "latent"), folder, fp, 8)
    assert report["probe_fraction"] == 0.25 and "probe_fraction 0.25" in report_text(report)
    assert (Path(folder) / "calibration" / f"{fp}.probe0.25.json").is_file()
    assert not (Path(folder) / "calibration" / f"{fp}.json").exists()
    assert fp in known_fingerprints(folder)  # the cache tab lists a model calibrated for one probe only
    assert risk_model_for(folder, fp, 0.25).calibrated and risk_model_for(folder, fp, 0.25).probe_fraction == 0.25
    assert not risk_model_for(folder, fp).calibrated  # the default probe: the prior

    _, other_probe = requests_in(model, "wan21", PROMPT)
    assert "uncalibrated prior for probe_fraction 0.1" in other_probe.calibration, other_probe.text()
    assert "calibrated with probe_fraction 0.25" in other_probe.calibration
    requests_in.settings.probe_fraction = 0.25
    _, same_probe = requests_in(model, "wan21", PROMPT, seed=8)
    assert "gate: calibrated for probe_fraction 0.25" in same_probe.calibration, same_probe.text()
    # measured at 8 steps, these requests sample 10: the summary says α is not certified here
    assert same_probe.steps_total == 10 and risk_model_for(folder, fp, 0.25).measured_steps == 8
    assert "measured at 8 steps: at 10 the depths carry over" in same_probe.calibration
    at_eight = status_line(model_status(folder, fp, probe_fraction=0.25), 0.05, 8)
    assert "gate: calibrated" in at_eight and "measured at" not in at_eight

    # a file whose name and content disagree is refused: the request runs on the uncalibrated
    # prior and says why
    (Path(folder) / "calibration" / f"{fp}.json").write_text(
        (Path(folder) / "calibration" / f"{fp}.probe0.25.json").read_text())
    with pytest.raises(ValueError, match="measured with probe_fraction 0.25, not 0.1"):
        risk_model_for(folder, fp)
    requests_in.settings.probe_fraction = 0.1
    _, refused = requests_in(model, "wan21", RELATED)
    assert "uncalibrated prior" in refused.calibration, refused.calibration
    assert "measured with probe_fraction 0.25" in refused.calibration


def test_audits_are_kept_apart_per_probe_and_an_older_file_gains_the_column(tmp_path):
    import sqlite3
    old = sqlite3.connect(str(tmp_path / audit.DB_NAME))  # an audit file from before the probe column
    old.executescript(audit.SCHEMA.replace(", probe_fraction REAL", ""))
    old.execute("INSERT INTO audits (time, fingerprint, calibration, alpha, klass, level, k, steps, "
                "score, psnr, label, space, features) VALUES (0,'fpA','prior',0.05,'other',0,8,20,"
                "NULL,35.0,0,'latent',?)", (json.dumps(OTHER),))
    old.commit()
    old.close()
    tol = Tolerance(30.0, "latent")
    with audit.AuditLog(tmp_path) as log:
        log.record("fpA", "c1", 0.05, OTHER, None, 8, 20, 20.0, 1, "latent", probe_fraction=0.05)
        unnamed = log.audit_instances("fpA", tol, UNNAMED_PROBE_FRACTION)
        short = log.audit_instances("fpA", tol, 0.05)
    assert [i["depths"][0]["psnr"] for i in unnamed] == [35.0]  # the older audit: the probe of then
    assert [i["depths"][0]["psnr"] for i in short] == [20.0]
    assert audit.calibration_id(RiskModel(probe_fraction=UNNAMED_PROBE_FRACTION)) == "prior"
    assert audit.calibration_id(RiskModel(probe_fraction=0.05)) == "prior@probe0.05"
    # a calibration of the probe files were measured with before probes were recorded keeps
    # the id it had then (taken from that version), so the levels its audits tightened still apply
    before = RiskModel(calibrated=True, source="fitted before probes were recorded", measured_reuses=10,
                       thresholds={"other": {"0.05": -2.0}}, probe_fraction=UNNAMED_PROBE_FRACTION)
    assert audit.calibration_id(before) == "8ffb30875a8fc0ef"
    assert audit.calibration_id(RiskModel(**{**before.__dict__, "probe_fraction": 0.05})) != "8ffb30875a8fc0ef"


# ------------------------------------------------------------------ the recipe for edits
def test_a_calibration_with_m_filled_on_its_tokens_measures_it_and_hands_it_to_the_gate(tiny_models, requests_in):
    """Calibrated with M filled on its own tokens and widened by a tile: every reuse with a
    region computed M's own trajectory (model calls on M's tokens), the edits' M was widened,
    the fit took the signed form, and the file the gate loads carries the recipe so hits do
    what was measured."""
    import copy
    from carnator_core.calibration.fit import calibration_path
    model = tiny_models["wan21"]
    from carnator_core.comfy_adapter import model_fingerprint
    fp, folder = model_fingerprint(model), requests_in.cache_folder
    make_run, _ = _tiny_runs(model, requests_in)
    recipe = copy.deepcopy(requests_in.settings)
    recipe.region_fill_on_m, recipe.region_margin = True, 1
    pairs = prompt_pairs.pairs(n=6, seed=0, kinds=("colour", "left_right", "add_object"))
    _, report = calibrate(make_run, pairs, recipe, Tolerance(30.0, "latent"), folder, fp, 8)
    measured = load_progress(progress_path(calibration_path(folder, fp, recipe.probe_fraction)))
    reuses = [(evidence_class(i["features"]), d) for insts in measured.values() for i in insts
              for d in i["depths"]]
    with_region = [d for _, d in reuses if d["fill_steps"] > 0]
    assert with_region, "no reuse had a region M to fill: the pairs did not exercise the recipe"
    assert all(d["fill"] == "on_m" for d in with_region)
    # deep enough, part of M's trajectory ran on M's tokens alone: calls at M's share of a step
    on_tokens = [d for d in with_region if d["fill_region_calls"] > 0]
    assert on_tokens and all(d["fill_calls"] < d["fill_steps"] < d["fill_calls"] + d["fill_region_calls"]
                             for d in on_tokens)
    assert all(d.get("margin") == 1 for k, d in reuses if k == "other" and d["fill_steps"] > 0)
    assert report["form"] == "signed" and report["region_fill_on_m"] and report["region_margin"] == 1
    assert "filled on its own tokens, widened by 1 tile" in report_text(report)
    loaded = risk_model_for(folder, fp)
    assert loaded.calibrated and loaded.region_fill_on_m and loaded.region_margin == 1


def test_a_region_finish_is_measured_only_at_depths_the_gate_may_start_it(tiny_models, requests_in):
    """A calibration that also measures a region finish for edits measures it only from
    gate.finish_allows' depth on (shallower, no hit could run it), and there on M's tokens;
    finishing every step is still measured at every depth."""
    import copy
    from carnator_core.comfy_adapter import model_fingerprint
    from carnator_core.calibration.fit import calibration_path
    from carnator_core.gate import finish_allows
    from carnator_core.calibration.generic import reuse_depths
    model = tiny_models["wan21"]
    fp, folder = model_fingerprint(model), requests_in.cache_folder
    make_run, _ = _tiny_runs(model, requests_in)
    recipe = copy.deepcopy(requests_in.settings)
    recipe.other_finish_calls, recipe.other_finish_region = 2, True
    steps = 8
    depths = reuse_depths(recipe, steps)
    allowed = [k for k in depths if finish_allows(k, steps, 2, region=True)]
    assert allowed and len(allowed) < len(depths), "the depths must straddle the region finish's floor"
    pairs = prompt_pairs.pairs(n=4, seed=0, kinds=("colour", "left_right"))
    calibrate(make_run, pairs, recipe, Tolerance(30.0, "latent"), folder, fp, steps)
    measured = load_progress(progress_path(calibration_path(folder, fp, recipe.probe_fraction)))
    other = [i for insts in measured.values() for i in insts
             if evidence_class(i["features"]) == "other" and i["depths"]]
    assert other, "no pair gave other evidence: the test did not exercise the region finish"
    for inst in other:
        region = sorted(d["k"] for d in inst["depths"] if d.get("finish_calls") == 2)
        every = sorted(d["k"] for d in inst["depths"] if not d.get("finish_calls"))
        assert region == allowed and every == depths
        assert all("region_steps" in d for d in inst["depths"] if d.get("finish_calls"))
