"""Smoke run of the tiny-world benchmark and calibration.

A handful of requests on the committed tiny-world model: the JSON has the documented shape,
Carnator hits on a workload of exact pairs, and the calibration pieces fit, save and load a
risk model the gate uses. The full runs stay out of CI (README, Results).
"""
import json
import os
import math
import random
from pathlib import Path

import pytest
import repo_scripts

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "models" / "tinyworld" / "carnator_tinyworld_wan21.safetensors"
MULTISIZE = REPO / "models" / "tinyworld_multisize" / "carnator_tinyworld_wan21.safetensors"
METRICS = {"hit_rate", "false_accept_rate", "hit_speedup", "workload_speedup", "miss_overhead",
           "psnr_hits_mean", "ssim_hits_mean", "checker_accuracy", "checker_accuracy_full"}


def _bench():
    return repo_scripts.load("bench/tinyworld.py", "bench_tw")


def _scene(*objects):
    """A workload line's scene from (shape, colour, position, motion) tuples."""
    return {"objects": [dict(zip(("shape", "colour", "position", "motion"), o)) for o in objects]}


def test_workload_files_shipped():
    for name, policy in (("iterate", "same_seed"), ("serve", "shared_noise"), ("calibration", "same_seed")):
        lines = [json.loads(x) for x in (REPO / "bench" / "workloads" / f"{name}.jsonl").read_text().splitlines()]
        assert len(lines) >= 200
        assert all(isinstance(x["prompt"], str) and isinstance(x["seed"], int) for x in lines)
        assert {x["seed_policy"] for x in lines} == {policy}
    cal = [json.loads(x) for x in (REPO / "bench" / "workloads" / "calibration.jsonl").read_text().splitlines()]
    other = [json.loads(x) for n in ("iterate", "serve")
             for x in (REPO / "bench" / "workloads" / f"{n}.jsonl").read_text().splitlines()]
    assert not {x["prompt"] for x in cal} & {x["prompt"] for x in other}
    assert not {x["seed"] for x in cal} & {x["seed"] for x in other}
    # editing-session pairs many edits apart are part of the calibration (without
    # them the budget broke on iterate), and the replicate of iterate shares no seed with it
    chains = [x for x in cal if x["kind"] == "session_chain" and x["role"] == "variant"]
    assert len(chains) >= 100 and max(len(x["edits"].split("+")) for x in chains) >= 6
    replicate = [json.loads(x) for x in (REPO / "bench" / "workloads" / "iterate_replicate.jsonl")
                 .read_text().splitlines()]
    assert not {x["seed"] for x in replicate} & {x["seed"] for x in cal + other}


def test_calibration_fit_save_load_and_gate_rule(tmp_path):
    from carnator_core.calibration import fit as CAL
    from carnator_core.gate import risk_model_for
    rng = random.Random(0)
    instances = []
    for g in range(60):
        dev = rng.random()
        feats = {"outside_mean": dev * 0.3, "outside_max": dev * 0.6, "region_fraction": 0.1 * dev,
                 "depth_fraction": 0.0, "similarity_gap": dev * 0.2}
        depths = [{"k": k, "depth_fraction": k / 20, "psnr": 40 - 30 * dev * k / 14,
                   "label": int(dev * k / 14 > 0.4)} for k in (4, 8, 14)]
        instances.append({"group": g, "features": feats, "depths": depths})
    train, held = CAL.split(instances, 0.3)
    assert train and held and not ({i["group"] for i in train} & {i["group"] for i in held})
    model = CAL.fit(train, 0.35)
    assert model.calibrated
    rep = CAL.evaluate(model, held)
    assert set(rep) == {"0.02", "0.05", "0.1"}
    assert all(0.0 <= v["false_accept_rate"] <= 1.0 for v in rep.values())
    CAL.save(model, tmp_path, "fp123")
    loaded = risk_model_for(tmp_path, "fp123")
    assert loaded.calibrated and loaded.weights == pytest.approx(model.weights)
    assert model.depth_weights == {} and model.evidence_scale is None  # the linear default
    assert not risk_model_for(tmp_path, "other").calibrated
    # a file written before the depth × evidence terms existed loads and scores as before
    older = json.loads(CAL.calibration_path(tmp_path, "fp123").read_text())
    del older["depth_weights"], older["evidence_scale"]
    CAL.calibration_path(tmp_path, "fp_older").write_text(json.dumps(older))
    f = {**instances[0]["features"], "depth_fraction": 0.5}
    z = older["bias"] + sum(older["weights"][k] * f[k] for k in older["weights"])
    assert risk_model_for(tmp_path, "fp_older").risk(f) == pytest.approx(1 / (1 + math.exp(-z)))
    # a damaged file: an error that names it and says what to do
    CAL.calibration_path(tmp_path, "fp_bad").write_text('{"weights": ')
    with pytest.raises(ValueError, match="fp_bad.json is unreadable.*re-run calibration"):
        risk_model_for(tmp_path, "fp_bad")

    inter = CAL.fit(train, 0.35, form="interaction")
    CAL.save(inter, tmp_path, "fp_inter")
    loaded = risk_model_for(tmp_path, "fp_inter")
    assert loaded.depth_weights == pytest.approx(inter.depth_weights) and loaded.evidence_scale
    # monotone: every fitted weight ≥ 0, so deeper reuse or more disagreement never lowers risk
    assert min(inter.weights.values()) >= 0 and min(inter.depth_weights.values()) >= 0
    agree = dict(instances[0]["features"], outside_mean=0.0, outside_max=0.0,
                 region_fraction=0.0, similarity_gap=0.0)
    edit = dict(agree, outside_mean=0.25, outside_max=0.5, region_fraction=0.08, similarity_gap=0.15)
    risks = [[inter.risk({**f, "depth_fraction": k / 20}) for k in (4, 8, 14)] for f in (agree, edit)]
    assert all(r == sorted(r) for r in risks) and all(a < e for a, e in zip(*risks))
    # agreeing evidence reaches a deeper k* than an edit
    depths = [{"k": k, "depth_fraction": k / 20, "label": 0} for k in (4, 8, 14)]
    picks = [CAL.gate_decision(inter, {"features": f, "depths": depths}, 0.05) for f in (agree, edit)]
    assert picks[0] is not None and (picks[1] is None or picks[1]["k"] < picks[0]["k"]), picks
    with pytest.raises(ValueError, match="form"):
        CAL.fit(train, 0.35, form="cubic")
    assert CAL.exceeds_tolerance(25.0, True, True, 30.0) == 1
    assert CAL.exceeds_tolerance(35.0, True, False, 30.0) == 1
    assert CAL.exceeds_tolerance(35.0, False, False, 30.0) == 0


@pytest.mark.skipif(not MODEL.is_file(), reason="tiny-world model not committed")
def test_benchmark_smoke_exact_pairs(tmp_path):
    wl = tmp_path / "exact_pairs.jsonl"
    red = _scene(("square", "red", "top left", "right"))
    blue = _scene(("circle", "blue", "bottom right", "up"))
    lines = []
    for p, s, scene in (("a red square in the top left moves right", 11, red),
                        ("a blue circle in the bottom right moves up", 12, blue)):
        lines += [{"prompt": p, "seed": s, "seed_policy": "same_seed", "edit": "exact", "scene": scene}] * 2
    lines.append({"prompt": "a crimson box in the top left slides to the right", "seed": 11,
                  "seed_policy": "same_seed", "edit": "synonym", "scene": red})
    wl.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "results" / "tinyworld.json"
    res = _bench().main([str(wl), "--budgets", "0.05", "--main-budget", "0.05",
                         "--thresholds", "0.8", "0.95", "--risk-model", "prior", "--steps", "10",
                         "--records", "--out", str(out)])
    data = json.loads(out.read_text())
    # every request no gate hit served says why, in the gate's codes: the first found nothing
    # stored, the repeats were exact; the counts are what the report groups misses by
    from carnator_core.gate import WHY_NOT
    records = data["records"]["exact_pairs"]["0.05"]
    assert records[0]["why"] == "no_candidate" and records[0]["reason"]
    for r in records:
        assert (r["why"] == "") == (r["outcome"] == "hit"), r
        assert r["outcome"] == "hit" or (r["why"] in WHY_NOT and r["reason"]), r
    assert [r["why"] for r in records if r["outcome"] == "exact"] == ["exact_repeat", "exact_repeat"]
    # the reworded request weighed the stored ones: each candidate with its class and verdict
    reworded = records[-1]
    assert reworded["candidates"] and all(c["class"] in ("same_scene", "other") for c in reworded["candidates"])
    assert all(c["accept"] or c["why"] in WHY_NOT for c in reworded["candidates"]), reworded["candidates"]
    assert records[0]["candidates"] == []  # nothing stored yet
    not_reused = data["workloads"]["exact_pairs"]["carnator"]["not_reused"]
    assert sum(not_reused.values()) == sum(r["outcome"] != "hit" for r in records)
    assert set(data["workloads"]) == {"exact_pairs"}
    systems = data["workloads"]["exact_pairs"]
    assert set(systems) == {"full", "text", "carnator", "carnator_sparse"}
    assert {"sparse_hit_share", "sparse_calls", "sparse_density_mean"} <= set(systems["carnator_sparse"])
    assert systems["carnator_sparse"]["exact_rate"] >= 2 / len(lines)
    for m in systems.values():
        assert METRICS <= set(m)
        assert 0.0 <= m["hit_rate"] <= 1.0 and 0.0 <= m["false_accept_rate"] <= 1.0
    assert systems["full"]["hit_rate"] == 0.0
    assert systems["carnator"]["hit_rate"] >= 2 / len(lines)  # both exact repeats at least
    assert systems["carnator"]["exact_rate"] >= 2 / len(lines)
    sw = data["sweeps"]["exact_pairs"]
    assert [p["threshold"] for p in sw["text"]] == [0.8, 0.95]
    assert [p["risk_budget"] for p in sw["carnator"]] == [0.05]
    for p in data["plots"]:
        path = Path(p) if Path(p).is_absolute() else REPO / p
        assert path.is_file() and path.stat().st_size > 0
    assert res["settings"]["fingerprint"] and not math.isnan(systems["carnator"]["workload_speedup"])
    merged = _bench().main(["--merge", str(out), "--out", str(tmp_path / "merged.json"), "--no-plots"])
    assert merged["workloads"] == data["workloads"] and merged["settings"]["merged_from"] == ["tinyworld.json"]


@pytest.mark.skipif(not MODEL.is_file(), reason="tiny-world model not committed")
def test_benchmark_meters_the_model_work_of_every_system(tmp_path):
    """The compute meter counts what the model really ran: a full computation is N steps,
    EasyCache's skipped calls are missing from it, and a Carnator request's own accounting
    (probe, fill, finish; 0 for an exact repeat) is exactly what the model computed."""
    wl = tmp_path / "pairs.jsonl"
    red = _scene(("square", "red", "top left", "right"))
    lines = [{"prompt": "a red square in the top left moves right", "seed": 11,
              "seed_policy": "same_seed", "edit": "exact", "scene": red}] * 2
    lines.append({"prompt": "a crimson box in the top left slides to the right", "seed": 11,
                  "seed_policy": "same_seed", "edit": "synonym", "scene": red})
    wl.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "meter.json"
    _bench().main([str(wl), "--budgets", "0.05", "--thresholds", "0.9", "--steps", "20",
                   "--no-sparse-system", "--no-plots", "--records", "--easycache", "0.2",
                   "--out", str(out)])
    data = json.loads(out.read_text())
    systems = data["workloads"]["pairs"]
    assert systems["full"]["compute_speedup_workload"] == pytest.approx(1.0)
    assert systems["easycache_0.2"]["compute_speedup_workload"] > 1.2  # calls it skipped
    recs = data["records"]["pairs"]["0.05"]
    assert [r["outcome"] for r in recs][:2] == ["miss", "exact"]
    assert recs[1]["steps_measured"] == 0
    for r in recs:
        assert r["steps_measured"] == pytest.approx(r["steps_computed"], abs=1e-6)
    assert recs[2]["steps_measured"] < 20 if recs[2]["outcome"] == "hit" else recs[2]["steps_measured"] == 20
    # the gate's plan is in each record: no features where it decided nothing, the evidence of a hit
    assert recs[0]["features"] is None and recs[1]["features"] is None
    assert recs[2]["outcome"] != "hit" or {"region_fraction", "depth_fraction"} <= set(recs[2]["features"])


def _localization():
    return repo_scripts.load("bench/studies/localization.py", "bench_loc")


def test_localization_masks_follow_the_changed_object():
    loc = _localization()
    a = _scene(("square", "red", "top left", "right"), ("circle", "blue", "bottom right", "up"))
    b = _scene(("square", "red", "top left", "right"), ("circle", "green", "bottom right", "up"))
    changed, kept = loc.world_masks(a, b)
    grid = (4, 8, 8)
    tc, tk = loc.tile_mask(changed, grid).reshape(grid), loc.tile_mask(kept, grid).reshape(grid)
    assert tc[:, 4:, 4:].any() and not tc[:, :3, :3].any()  # the circle: bottom right only
    assert tk[:, :3, :3].any() and not tk[:, 5:, 5:].any()  # the square: top left only
    assert loc.iou(tc.reshape(-1), tc.reshape(-1)) == 1.0
    assert loc.iou(tc.reshape(-1), tk.reshape(-1)) == 0.0
    assert loc.world_masks(a, a) is None  # nothing changed: no changed object


@pytest.mark.skipif(not MODEL.is_file(), reason="tiny-world model not committed")
def test_localization_smoke(tmp_path):
    out = tmp_path / "localization.json"
    res = _localization().main(["--limit", "1", "--risk-model", "prior", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["summary"]["pairs"] == 1 and res["summary"] == data["summary"]
    row = data["pairs"][0]
    assert " and " in row["anchor"] or ";" in row["anchor"] or "while" in row["anchor"]
    if row["region_fraction"] > 0:
        assert 0.0 <= row["iou_observed"] <= 1.0 and 0.0 <= row["iou_world"] <= 1.0


@pytest.mark.skipif(not MODEL.is_file(), reason="tiny-world model not committed")
def test_committed_model_follows_colour_and_position_words():
    """The committed weights are the trained ones and match the text encoder: through
    ComfyUI's own loader and sampler, one-object captions come out in the right colour and
    quadrant (motion and shape are measured by the benchmark, not asserted here)."""
    from tinyworld import checker as CH
    from tinyworld import world as WD
    world = _bench().World(str(MODEL), steps=20)
    rng = random.Random(5)
    agree = {"colour": 0, "position": 0}
    n = 8
    for i in range(n):
        scene = WD.random_scene(rng, 1)
        prompt = WD.caption(scene, rng)
        video = world.full(prompt, 1000 + i, "same_seed")["video"]
        res = CH.check(video, prompt)
        for k in agree:
            agree[k] += int(res[k] >= 1.0)
    assert agree["colour"] >= n - 1 and agree["position"] >= n - 1, agree


@pytest.mark.parametrize("size", ["2x16", "8x48"])
def test_multisize_model_follows_colour_and_position_words_at_its_smallest_and_largest_size(size):
    """The committed multi-size weights (models/tinyworld_multisize/, scripts/
    train_tinyworld_multisize.sh) generate at the proxy size a calibration runs at and the size
    it serves: the benchmark's World makes a video of that size (latent and coordinate frames
    alike) and its colour and quadrant follow the caption, through ComfyUI's loader and sampler."""
    from tinyworld import checker as CH
    from tinyworld import world as WD
    world = _bench().World(str(MULTISIZE), steps=20, size=size)
    frames, pixels = WD.parse_sizes(size)[0]
    rng = random.Random(7)
    agree, n = {"colour": 0, "position": 0}, 4
    for i in range(n):
        scene = WD.random_scene(rng, 1)
        prompt = WD.caption(scene, rng)
        video = world.full(prompt, 2000 + i, "same_seed")["video"]
        assert tuple(video.shape) == (3, frames, pixels, pixels)
        res = CH.check(video, prompt)
        for k in agree:
            agree[k] += int(res[k] >= 1.0)
    assert agree == {"colour": n, "position": n}, agree


def test_compose_report_matches_quality_on_easycache_s_own_sweep():
    """EasyCache alone is read at a system's workload PSNR between the two thresholds that
    bracket it, never extrapolated past its sweep."""
    mod = repo_scripts.load("bench/compose_report.py", "bench_compose")
    systems = {f"easycache_{t:g}": {"psnr_workload": p, "compute_speedup_workload": s, "easycache_threshold": t}
               for t, p, s in ((0.02, 43.0, 1.4), (0.05, 37.0, 1.8), (0.2, 29.0, 2.4))}
    curve = mod.easycache_curve(systems)
    assert [t for _, _, t in curve] == [0.2, 0.05, 0.02]
    mid = mod.at_psnr(curve, 40.0)
    assert mid["speedup"] == pytest.approx(1.6) and mid["between_thresholds"] == [0.02, 0.05]
    assert mod.at_psnr(curve, 37.0)["speedup"] == pytest.approx(1.8)
    assert mod.at_psnr(curve, 45.0) is None and mod.at_psnr(curve, 28.0) is None


def _carnator_system() -> dict:
    """A Carnator system of a bench/tinyworld.py result, as compose_report reads it."""
    return {"psnr_workload": 40.0, "compute_speedup_workload": 1.9, "psnr_all_mean": 45.0,
            "false_accept_rate": 0.02, "checker_accuracy": 0.96, "checker_accuracy_full": 0.97,
            "workload_speedup": 1.5, "risk_budget": 0.05}


def _easycache_sweep() -> dict:
    """EasyCache alone at two thresholds: 43 dB at 1.4x, 37 dB at 1.8x."""
    return {f"easycache_{t:g}": {"psnr_workload": p, "compute_speedup_workload": s, "easycache_threshold": t,
                                 "workload_speedup": s, "checker_accuracy": 0.95}
            for t, p, s in ((0.02, 43.0, 1.4), (0.05, 37.0, 1.8))}


def test_compose_report_reads_easycache_only_at_the_run_s_step_count(tmp_path):
    """A 30-step run is never put beside EasyCache's 20-step sweep: both skip differently at
    another N, so without a 30-step sweep its rows say nothing about EasyCache. Sweeps of the
    same N in several files make one curve."""
    mod = repo_scripts.load("bench/compose_report.py", "bench_compose")
    carnator, sweep = _carnator_system(), _easycache_sweep()
    denser = {"easycache_0.04": {**sweep["easycache_0.05"], "psnr_workload": 40.0, "compute_speedup_workload": 1.5,
                                 "easycache_threshold": 0.04}}
    files = []
    for i, (steps, systems) in enumerate(((20, {"carnator": carnator, **sweep}), (30, {"carnator": carnator}),
                                          (20, {"carnator": carnator, **denser}))):
        path = tmp_path / f"run{i}_n{steps}.json"
        path.write_text(json.dumps({"workloads": {"serve": systems},
                                    "settings": {"steps": steps, "probe_fraction": 0.05}}))
        files.append(str(path))
    out = mod.main(files + ["--no-plots", "--out", str(tmp_path / "report.json")])
    assert {r["steps"] for r in out["rows"]} == {20}  # the 30-step run has no sweep of its own: no row
    assert list(out["easycache_alone"]) == ["serve"]
    # the 20-step sweeps of both files make one curve: 0.04 brackets 40 dB exactly
    assert [r["threshold"] for r in out["easycache_alone"]["serve"]] == [0.05, 0.04, 0.02]
    assert all(r["easycache_alone_at_this_psnr"] == pytest.approx(1.5) for r in out["rows"])


def test_compose_report_reads_only_the_sweep_of_files_given_as_sweeps(tmp_path):
    """An older run given with --sweeps lends EasyCache alone's curve (EasyCache alone computes
    the same whatever gate ran beside it) but none of its Carnator rows, which another gate made."""
    mod = repo_scripts.load("bench/compose_report.py", "bench_compose")
    carnator, sweep = _carnator_system(), _easycache_sweep()
    new, old = tmp_path / "new.json", tmp_path / "old.json"
    new.write_text(json.dumps({"workloads": {"serve": {"carnator": carnator}}, "settings": {"probe_fraction": 0.05}}))
    old.write_text(json.dumps({"workloads": {"serve": {"carnator": {**carnator, "compute_speedup_workload": 1.2},
                                                       **sweep}}, "settings": {"probe_fraction": 0.05}}))
    out = mod.main([str(new), "--sweeps", str(old), "--no-plots", "--out", str(tmp_path / "report.json")])
    assert [r["compute_speedup"] for r in out["rows"]] == [1.9]  # the new run's row alone
    assert out["rows"][0]["easycache_alone_at_this_psnr"] == pytest.approx(1.6)  # on the old run's sweep
    assert out["command"].endswith(f"--sweeps {os.path.relpath(str(old), mod.REPO)}")


def test_the_session_interval_widens_when_failures_cluster_in_sessions():
    """Records of one editing session share a seed and its sources: an interval that resamples
    whole sessions must be wider when the same failure count sits in few sessions."""
    b = _bench()

    def recs(failures_by_session):
        return [{"session": s, "failed": i < f} for s, f in enumerate(failures_by_session) for i in range(10)]
    spread = recs([1] * 10)                # 10 failures in 100 records, one per session
    clustered = recs([5, 5] + [0] * 8)     # the same 10, in two sessions
    lo_s, hi_s = b.session_interval(spread, lambda r: r["failed"])
    lo_c, hi_c = b.session_interval(clustered, lambda r: r["failed"])
    assert lo_s == hi_s == pytest.approx(0.1)  # every session alike: nothing to resample
    assert lo_c < 0.05 and hi_c > 0.15 and lo_c <= 0.1 <= hi_c
    assert b.session_interval([{"failed": True}], lambda r: r["failed"]) is None  # no sessions


def test_the_easycache_calibration_is_found_in_either_folder_or_refused(tmp_path):
    """--easycache-risk-model takes a results folder or the calibration/ folder inside it, and
    a folder without the EasyCache'd model's calibration stops the run instead of quietly
    gating with the plain model's (a study once did, unnoticed)."""
    from carnator_core.calibration import fit as CAL
    from carnator_core.gate import RiskModel
    tw = _bench()
    model = RiskModel(probe_fraction=0.05)
    saved = CAL.save(model, tmp_path / "ec", "fp_eased")
    for given in (tmp_path / "ec", tmp_path / "ec" / "calibration", f"{tmp_path / 'ec' / 'calibration'}/"):
        assert tw.easycache_risk_model(str(given), "fp_eased", 0.05) == str(saved)
    assert tw.easycache_risk_model(None, "fp_eased", 0.05) is None  # no option: none asked for
    with pytest.raises(SystemExit, match="no calibration of the EasyCache'd model"):
        tw.easycache_risk_model(str(tmp_path / "ec"), "fp_plain", 0.05)
    with pytest.raises(SystemExit, match="probe 0.1"):
        tw.easycache_risk_model(str(tmp_path / "ec"), "fp_eased", 0.1)


def test_the_readme_results_table_is_the_one_the_result_file_gives():
    """The README's headline table is bench/report.py --headline on bench/results/tinyworld.json,
    which holds the bundled model at the default settings."""
    report = repo_scripts.load("bench/report.py", "bench_report")
    res = json.loads((REPO / "bench" / "results" / "tinyworld.json").read_text())
    from carnator_core.gate import DEFAULT_PROBE_FRACTION, calibration_in_use
    settings = res["settings"]
    assert settings["fingerprint"] == "0706ef2962b7d36f497afe0f24c29ec0"  # the bundled tiny world
    assert settings["probe_fraction"] == DEFAULT_PROBE_FRACTION
    used = REPO / settings["calibration"]["path"]
    assert used == calibration_in_use(REPO / "models", settings["fingerprint"], DEFAULT_PROBE_FRACTION,
                                      settings["steps"])
    import hashlib
    assert hashlib.sha256(used.read_bytes()).hexdigest() == settings["calibration"]["sha256"]
    table = report.headline_table(res)
    readme = (REPO / "README.md").read_text()
    assert table in readme, table
    assert len(table.splitlines()) >= 4  # header, rule and at least serve and iterate


@pytest.mark.skipif(not MODEL.is_file(), reason="tiny-world model not committed")
def test_an_ignored_word_keeps_a_paraphrase_same_scene_and_an_edit_never_is(tmp_path):
    """The bundled model with its calibration for the default probe: a stored request's
    paraphrases with words the world ignores (speed, filler, a reordered sentence) are read as
    same-scene evidence; a direction flip, a colour change or an added object never is."""
    import shutil
    from carnator_core import pipeline
    from carnator_core.comfy_adapter import run_request, start_request
    from carnator_core.gate import DEFAULT_PROBE_FRACTION, GateSettings, calibration_file, evidence_class
    bench = _bench()
    world = bench.World(str(MODEL), steps=20)
    folder = tmp_path / "cache"
    bundled = calibration_file(REPO / "models", world.fingerprint, DEFAULT_PROBE_FRACTION)
    calibration_file(folder, world.fingerprint, DEFAULT_PROBE_FRACTION).parent.mkdir(parents=True)
    shutil.copy(bundled, calibration_file(folder, world.fingerprint, DEFAULT_PROBE_FRACTION))
    settings = pipeline.ReuseSettings(gate=GateSettings(risk_budget=0.05))
    base = "a red circle in the top left moves right"

    def request(prompt):
        return (world.cond(prompt), world.negative, world.latent(), 7, 20, 4.0, "euler", "simple", settings,
                {"folder": str(folder)})
    assert run_request(world.model, *request(base), label=base)[1].outcome == "miss"

    def evidence_of(prompt):  # the gate's reading against the stored request, nothing stored
        plan, _ = pipeline.lookup_and_gate(start_request(world.model, *request(prompt), label=prompt))
        assert plan.features is not None, plan.reason
        return evidence_class(plan.features)
    for reworded in (base + " slowly", base + ", slowly and gently",
                     "slowly, a crimson circle at the top left drifts to the right"):
        assert evidence_of(reworded) == "same_scene", reworded
    for edit in ("a red circle in the top left moves left", "a blue circle in the top left moves right",
                 base + " and a green square in the bottom right moves up"):
        assert evidence_of(edit) == "other", edit
