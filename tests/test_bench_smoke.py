"""Smoke runs of the benchmarks: they run, engage the sparse kernel and write their JSON.

Speed is not asserted here (machines are noisy); the full runs are in the README.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def run(args, timeout=600):
    out = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


def test_sparse_attention_benchmark_smoke(tmp_path):
    target = tmp_path / "sparse_attention.json"
    run(["bench/sparse_attention.py", "--smoke", "--out", str(target)])
    rows = json.loads(target.read_text())["rows"]
    assert rows and {"tokens", "density", "attention_ratio", "step_ratio"} <= set(rows[0])
    assert all(r["attention_ratio"] > 0 for r in rows)


def test_wan_size_benchmark_script_runs_small_on_cpu(tmp_path):
    """The GPU script (Wan-2.1-1.3B shape) at a tiny size: the same code path, end to end."""
    target = tmp_path / "wan_sparse_gpu.json"
    printed = run(["bench/wan_sparse_gpu.py", "--small", "--repeats", "1", "--out", str(target)])
    result = json.loads(target.read_text())
    assert "one step" in printed and "whole miss" in printed
    assert result["sparse_calls_per_hit"] > 0          # the hit really ran block-sparse
    assert result["reuse_step"] > 0 and result["miss_seconds"] > 0
    op = result["attention_op"]                         # the op alone, every backend timed
    assert op["dense_seconds"] > 0 and len(op["sparse"]) == 2
    assert all(row["fallback_seconds"] > 0 and ("flex_seconds" in row or "flex_error" in row)
               for row in op["sparse"])
    assert result["complete"] and list(result["elapsed_seconds"])[0] == "attention op"
    # a budget that cannot hold a miss stops before it and still saves what it measured
    stopped = tmp_path / "stopped.json"
    run(["bench/wan_sparse_gpu.py", "--small", "--repeats", "1", "--budget-seconds", "0",
         "--out", str(stopped)])
    cut = json.loads(stopped.read_text())
    assert not cut["complete"] and cut["stopped_before"].startswith("miss")
    assert "attention_op" in cut and "miss_seconds" not in cut


def test_real_size_costs_benchmark_runs_small(tmp_path):
    """The real-size cost benchmark at a tiny shape: every phase timed, bytes counted."""
    target = tmp_path / "real_size_costs.json"
    printed = run(["bench/real_size_costs.py", "--small", "--out", str(target)])
    r = json.loads(target.read_text())["after"]["sizes"]["small"]
    assert "miss host" in printed
    assert {"capture_pooling", "probe_selection", "packing", "store", "lookup", "hit_load",
            "hit_unpack_per_step"} <= set(r["phases"])
    assert r["entry_bytes"] > 0 and r["connectivity_bytes"] > 0
    assert r["entry_bytes_by_format"]["int8"] < r["entry_bytes_by_format"]["float32"]


def test_self_calibration_benchmark_smoke(tmp_path):
    """The generic calibration on the tiny world: measure a shard, fit, evaluate — a few pairs."""
    out = tmp_path / "selfcal"
    run(["bench/studies/self_calibrate.py", "--pairs", "9", "--shard", "0/1", "--out", str(out)])
    assert len((out / "progress.0-of-1.jsonl").read_text().splitlines()) == 9
    printed = run(["bench/studies/self_calibrate.py", "--pairs", "9", "--out", str(out)])
    report = json.loads((out / "report.json").read_text())
    assert report["pairs"] == 9 and report["measured_reuses"] > 0 and "reuses" in printed
    assert report["tolerance"] == {"psnr_bound": 30.0, "space": "frames"}
    model_file = next(p for p in out.glob("*.json") if p.name != "report.json")
    assert json.loads(model_file.read_text())["calibrated"]
    run(["bench/studies/self_calibrate.py", "--evaluate", "serve", "--limit", "6", "--budgets", "0.05",
         "--out", str(out)])
    ev = json.loads((out / "evaluation.serve.json").read_text())
    assert set(ev["budgets"]["0.05"]) == {"generic", "checker"}
    assert ev["budgets"]["0.05"]["generic"]["requests"] == 6


def test_audit_stream_benchmark_smoke(tmp_path):
    """Every hit audited on a short stretch of the drift stream: audits happen and are counted."""
    target = tmp_path / "audit_stream.json"
    run(["bench/studies/audit_stream.py", "--limit", "12", "--audit-rate", "1", "--out", str(target)])
    r = json.loads(target.read_text())
    assert r["audits_on"]["gate_hits"] > 0
    assert r["audits"] == r["audits_on"]["gate_hits"] == len(r["running"])  # every hit audited
    assert r["running"][-1]["audits"] >= 1 and (tmp_path / "audit_stream.png").is_file()
    assert r["audits_off"]["requests"] == 12


def test_farm_benchmark_explains_every_request_by_its_records(tmp_path):
    """Two workers, eight requests, shared PostgreSQL then private SQLite: every request not
    served by a reuse carries the gate's reason, every hit names an entry this run stored,
    the explanation's groups partition the requests, and both modes ran the calibrated gate."""
    sys.path.insert(0, str(REPO / "tests"))
    from pg_cluster import pg_bin
    if pg_bin() is None:
        pytest.skip("PostgreSQL server not installed (.ci/run installs it)")
    from carnator_core.gate import WHY_NOT
    target = tmp_path / "farm.json"
    run(["bench/farm.py", "--workers", "2", "--limit", "8", "--records", "--out", str(target)])
    got = json.loads(target.read_text())
    assert got["probe_fraction"] == 0.05 and got["steps_shared_over_private"] > 0
    assert got["recurring_sources"] is True  # the samplers' default gate, said in the result
    for row in got["rows"]:
        recs = got["records"][row["mode"]]
        assert len(recs) == row["requests"] == 8 and {r["worker"] for r in recs} == {0, 1}
        stored = {r["stored_id"] for r in recs if r["stored_id"]}
        for r in recs:
            assert r["calibrated"] or r["outcome"] == "exact", (row["mode"], r)  # a repeat asks no gate
            assert (r["outcome"] == "hit") == (not r["why"]) and (not r["why"] or r["why"] in WHY_NOT), r
            assert r["outcome"] != "hit" or r["entry_id"] in stored, r
        assert sum(g["requests"] for g in row["explained"].values()) == 8
        assert sum(g["requests"] for k, g in row["explained"].items() if k.startswith("hit/")) == row["gate_hits"]


def test_lookup_scale_benchmark_smoke(tmp_path):
    """Both backends at 300 synthetic entries: rows written, repeats found every time."""
    target = tmp_path / "lookup_scale.json"
    run(["bench/lookup_scale.py", "--sizes", "300", "--queries", "20", "--out", str(target)])
    rows = json.loads(target.read_text())["rows"]
    assert {r["backend"] for r in rows} >= {"sqlite"}
    for r in rows:
        assert {"backend", "entries", "classes", "p50_ms", "p99_ms", "store_ms", "rss_mb"} <= set(r)
        assert r["entries"] == 300 and r["top1_recall_repeat"] == 1.0


def test_checker_gap_splits_wrong_results_by_how_they_were_made(tmp_path):
    """A miss, a wrong gate hit on it, an exact repeat re-serving that hit, a fixed request."""
    def rec(outcome, ok, ok_full, entry=None, stored=None, edit=None, psnr=100.0):
        return {"outcome": outcome, "ok": ok, "ok_full": ok_full, "entry_id": entry,
                "stored_id": stored, "edit": edit, "psnr": psnr}
    records = [rec("miss", True, True, stored="a"),
               rec("hit", False, True, entry="a", stored="b", edit="flip_position", psnr=33.0),
               rec("hit", False, True, entry="a", stored="d", edit="object_change_colour", psnr=27.0),
               rec("exact", False, True, entry="b", edit="repeat"),
               rec("hit", True, False, entry="a", stored="c"),
               rec("exact", True, True, entry="a")]
    source = tmp_path / "bench.json"
    source.write_text(json.dumps({"records": {"iterate": {"0.05": records}},
                                  "settings": {"psnr_bound": 30.0}}))
    target = tmp_path / "gap.json"
    run(["bench/studies/checker_gap.py", str(source), "--out", str(target)])
    row = json.loads(target.read_text())["bench.json"]["iterate"]["0.05"]
    assert row["broke"] == {"gate_hit": 2, "exact_reserving_hit": 1, "other": 0}
    assert row["fixed"] == 1 and row["exact_repeats_of_hit_results"] == 1
    assert row["gap_points"] == 100.0 * (5 - 3) / 6            # full 5 right, Carnator 3
    assert row["gap_points_decisions_once"] == 100.0 * (2 - 1) / 6  # 2 broken decisions, 1 fixed
    assert row["broke_gate_hits_by_edit"] == {"flip_position": 1, "object_change_colour": 1}
    assert row["broke_gate_hits_above_psnr_bound"] == 1         # 33 dB; the other at 27 dB


def test_text_states_replay_a_workloads_prompts_bit_for_bit_without_minilm(tmp_path):
    """scripts/text_states.py: the states a lent machine replays are the ones encoding here gives
    (one prompt at a time, one thread), and a prompt that was not exported fails with a message
    instead of loading MiniLM."""
    prompts = ["a red square moves left at the top", "a blue circle in the centre spins"]
    workload = tmp_path / "w.jsonl"
    scene = {"objects": [{"shape": "triangle", "colour": "green", "position": "bottom left", "motion": "right"}]}
    workload.write_text("".join(json.dumps({"prompt": p, "candidate_prompt": prompts[0], "scene": scene}) + "\n"
                                for p in prompts))
    states = tmp_path / "states.safetensors"
    assert "3 prompts" in run(["scripts/text_states.py", "export", str(workload), str(states)])
    encode = ("import sys, torch; sys.path.insert(0, {repo!r}); from tinyworld import text as T;"
              "from safetensors.torch import save_file; {setup}"
              "save_file({{'s': torch.cat([T.encode_states([p]) for p in {prompts!r}])}}, {out!r})")
    check = tmp_path / "check.py"
    check.write_text(encode.format(repo=str(REPO), prompts=prompts, out=str(tmp_path / "replayed"),
                                   setup="") + "\ntry:\n    T.encode_states(['a prompt nobody exported'])\n"
                     "except RuntimeError as e:\n    print('refused:', e)\n")
    printed = run(["scripts/text_states.py", "run", str(states), str(check)])
    assert "refused: a prompt's text state is not in" in printed
    run(["-c", encode.format(repo=str(REPO), prompts=prompts, out=str(tmp_path / "encoded"),
                             setup="torch.set_num_threads(1);")])
    from safetensors.torch import load_file
    import torch
    assert torch.equal(load_file(tmp_path / "replayed")["s"], load_file(tmp_path / "encoded")["s"])


def test_many_steps_runner_parses_its_arguments():
    """bench/many_steps.py starts: its options parse."""
    printed = run(["bench/many_steps.py", "--help"], timeout=180)
    assert printed.startswith("usage:") and "--workloads" in printed and "--force" in printed
    assert "--risk-model" in printed


def test_online_certification_benchmark_smoke(tmp_path):
    """The replay of online certification: its options parse, and a short stream writes its JSON."""
    assert run(["bench/studies/online_certification.py", "--help"], timeout=180).startswith("usage:")
    target = tmp_path / "online.json"
    run(["bench/studies/online_certification.py", "--requests", "2000", "--budgets", "0.1", "--out", str(target)])
    r = json.loads(target.read_text())
    assert "REPLAY" in r["what"] and r["budgets"][0]["series"] and r["budgets"][0]["cost_generations"] > 0


def test_calibration_cost_counts_the_bundled_files_with_their_edit_pairs(tmp_path):
    """The bundled calibration of each N costs its recipe's pairs plus the edit pairs it was
    fitted with, and the studies that compare against it find that row."""
    target = tmp_path / "calibration_cost.json"
    run(["bench/studies/calibration_cost.py", "--out", str(target)])
    sys.path.insert(0, str(REPO / "bench" / "studies"))
    import calibration_cost as CC
    rows = json.loads(target.read_text())["rows"]
    for plain_folder, edits_folder, steps in CC.RECIPE:
        plain = next(r for r in rows if (r["procedure"], r["workload"], r["steps"]) == ("full_checker", "calibration", steps))
        bundled = CC.bundled_cost(plain["model"], steps, str(target))
        edit_files = sorted(str(p) for p in (REPO / "bench" / "results" / "studies" / edits_folder).glob("*.jsonl"))
        edits = CC.cost_row(CC._pairs_of_measurements(edit_files), steps, procedure="edits", note="", source=[])
        assert bundled["pairs"] == plain["pairs"] + edits["pairs"] and edits["pairs"] > 0
        assert bundled["cost_generations"] == pytest.approx(plain["cost_generations"] + edits["cost_generations"], abs=0.2)


def test_cheap_calibration_benchmark_parses_its_arguments():
    """bench/studies/cheap_calibration.py starts: its options parse."""
    printed = run(["bench/studies/cheap_calibration.py", "--help"], timeout=180)
    assert printed.startswith("usage:") and "--budgets" in printed and "--paraphrase-share" in printed


def test_cheap_calibration_same_scene_ladder_walks_the_strict_budgets_from_its_first_point():
    """--same-scene-ladder: the same-scene points are the ones given, α = 5% and 10% start at the
    shallowest, and the edits' ladder is the transferred one."""
    sys.path.insert(0, str(REPO / "bench" / "studies"))
    import cheap_calibration as CCAL
    from carnator_core.calibration import cheap
    from carnator_core.gate import RiskModel
    bundled = RiskModel.load(CCAL.BUNDLED)
    got, was = cheap.ladder_of(CCAL.with_same_scene_ladder(bundled, [0.7, 0.5, 0.8])), cheap.ladder_of(bundled)
    assert got.points["same_scene"] == [0.5, 0.7, 0.8] != was.points["same_scene"]
    assert got.start["same_scene"]["0.05"] == got.start["same_scene"]["0.1"] == 0
    assert {c: p for c, p in got.points.items() if c != "same_scene"} == \
        {c: p for c, p in was.points.items() if c != "same_scene"}


def test_cheap_calibration_refuses_the_bundled_ladder_on_the_bundled_model_s_own_pairs(tmp_path):
    """The bundled calibration's thresholds were certified on the bundled model's held-out
    pairs: transferring them as they are is only checked against another model's calibration."""
    out = subprocess.run([sys.executable, "bench/studies/cheap_calibration.py", "--bundled-ladder", "--no-cost-rows",
                          "--budgets", "1", "--folder", str(tmp_path), "--out", str(tmp_path / "x.json")],
                         cwd=REPO, capture_output=True, text=True, timeout=180)
    assert out.returncode != 0 and "--heldout-is-full" in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "x.json").exists()


def test_cheap_served_runs_a_workload_on_a_budgets_calibration_and_compares_it_with_the_full(tmp_path):
    """bench/studies/cheap_served.py serves a workload with the file the cheap calibration
    certified at 100 generation-equivalents: at α = 5%, where that file certifies nothing, the
    gate reuses nothing (the refusal engaged, not a miss for want of candidates); each row
    carries the full calibration's gate-hit speedup it is measured against."""
    cheap = json.loads((REPO / "bench" / "results" / "cheap_calibration.json").read_text())
    assert cheap["budgets"]["100"]["certified"]["same_scene"][0] == "0.1"  # not 5%: what is asserted below
    target, folder = tmp_path / "served.json", tmp_path / "runs"
    run(["bench/studies/cheap_served.py", "--budgets", "100", "--workloads", "serve", "--limit", "8",
         "--folder", str(folder), "--out", str(target), "--no-cost-rows"])
    run_file = json.loads((folder / "at_100" / "serve.json").read_text())
    assert "cheap calibration" in run_file["settings"]["risk_model"]
    at5 = next(m for m in run_file["sweeps"]["serve"]["carnator"] if m["risk_budget"] == 0.05)
    assert at5["gate_hit_rate"] == 0.0 and at5["not_reused"].get("not_certified", 0) > 0
    rows = json.loads(target.read_text())["budgets"]["100"]["served"]["serve"]["by_alpha"]
    assert set(rows) == {"0.05", "0.1"} and rows["0.1"]["full_gate_hit_speedup"] > 1.0
    assert all(r["requests"] == 8 for r in rows.values())


def test_cheap_served_on_the_easycache_model_judges_its_hits_against_that_model_and_rereads_its_runs(tmp_path):
    """bench/studies/cheap_served.py --easycache 0.02 serves the EasyCache'd model with its own
    cheap and full calibrations (each found in its folder by that model's fingerprint) at α = 5%
    and 10%, every hit judged against that model's own full computation; the committed rows
    are what the committed runs give when read again."""
    ec = json.loads((REPO / "bench" / "results" / "studies" / "easycache_cheap.json").read_text())
    target, folder = tmp_path / "served.json", tmp_path / "runs"
    run(["bench/studies/cheap_served.py", "--easycache", "0.02", "--budgets", "200", "--workloads", "serve",
         "--limit", "4", "--folder", str(folder), "--out", str(target), "--no-cost-rows"])
    for part, calibration in (("full", ec["full_reference"]), ("at_200", ec["budgets"]["200"]["calibration_file"])):
        sweep = json.loads((folder / part / "serve.json").read_text())["sweeps"]["serve"]["carnator_easycache_0.02"]
        assert [m["risk_budget"] for m in sweep] == [0.05, 0.1]
        assert all(m["risk_model"] == calibration and ec["model_fingerprint"] in calibration for m in sweep)
        assert all(m["judged_own_model"] == round(m["hit_rate"] * 4) for m in sweep)
    rows = json.loads(target.read_text())["budgets"]["200"]["served"]["serve"]["by_alpha"]
    assert set(rows) == {"0.05", "0.1"} and all(r["requests"] == 4 for r in rows.values())
    again = tmp_path / "again.json"
    run(["bench/studies/cheap_served.py", "--easycache", "0.02", "--budgets", "200", "--merge-only",
         "--folder", "bench/results/studies/cheap_served_easycache", "--out", str(again), "--no-cost-rows"])
    committed = json.loads((REPO / "bench" / "results" / "cheap_served_easycache.json").read_text())
    assert json.loads(again.read_text())["budgets"] == committed["budgets"]


def test_proxy_size_study_reproduces_its_committed_numbers_from_the_committed_runs(tmp_path):
    """bench/results/proxy_size.json is read from the committed runs, not typed in: reading
    them again (nothing measured, no timing) gives the same served rows, label agreement and
    cut curve, and the cost at the served size is the calibrated size's by its token share."""
    target = tmp_path / "proxy_size.json"
    run(["bench/studies/proxy_size.py", "--no-timing", "--no-cost-rows", "--out", str(target)], timeout=600)
    got = json.loads(target.read_text())
    committed = json.loads((REPO / "bench" / "results" / "proxy_size.json").read_text())
    for key in ("cost", "certified", "served", "fresh_pairs_at_both_sizes", "served_pairs_replay", "curve",
                "cheap_at_calibrated_size"):
        assert got[key] == committed[key], key
    assert got["cost"]["generations_at_served_size"] == pytest.approx(
        got["cost"]["generations_at_calibrated_size"] * 32 / 1152, abs=0.05)
    assert set(got["served"]) == {"serve", "serve_reworded", "iterate", "iterate_replicate", "novel"}
    assert all(w["size"] == "8x48" for w in got["served"].values())


def test_wording_evidence_reads_every_same_scene_source_from_the_committed_records(tmp_path):
    """Each source that drew the request's own scene on its own noise is counted once, in one
    class, and the classes follow the same-scene cut-offs."""
    target = tmp_path / "wording_evidence.json"
    run(["bench/studies/wording_evidence.py", "--out", str(target)])
    got = json.loads(target.read_text())
    for w in got["workloads"].values():
        assert w["pairs"] > 50 and w["classed_same_scene"] + w["classed_other"] == w["pairs"]
        assert 0 < w["classed_other"] and w["other_within_twice_both"] <= w["classed_other"]
        # a candidate classed other sits beyond one of the cut-offs
        assert w["other_gap_quantiles"]["0.0"] > 0 or w["other_region_quantiles"]["1.0"] > got["same_scene_region"]


def test_near_scene_reads_its_committed_numbers_again_from_the_records_and_pairs(tmp_path):
    """bench/results/studies/near_scene.json is read from committed runs and pairs, not typed
    in: each scene pair's direction lies in one band, and treating a hit as a same-scene one
    never computes more steps (a same-scene hit computes the fewest)."""
    target = tmp_path / "near_scene.json"
    run(["bench/studies/near_scene.py", "--out", str(target)])
    got = json.loads(target.read_text())
    assert got == json.loads((REPO / "bench" / "results" / "studies" / "near_scene.json").read_text())
    lines = sum(len((REPO / "bench" / "results" / "studies" / f).read_text().splitlines()) for f in got["scene_pairs"])
    assert sum(b["directions"] for b in got["guided_finish_by_band"].values()) == lines
    for w in got["speed"].values():
        assert w["gate_hit_speedup_if_same_scene"] >= w["gate_hit_speedup"]
        assert (w["seen_scene_hits_read_other"] == 0) == (w["gate_hit_speedup_if_same_scene"] == w["gate_hit_speedup"])


def test_fresh_wording_failures_tally_the_workloads_hits_and_the_calibrations_decisions(tmp_path):
    """Every other-evidence gate hit is tallied once, by its source and by its cell, and the
    bundled gate's decisions on its own pairs are tallied the same way."""
    target = tmp_path / "fresh_wording_failures.json"
    run(["bench/studies/fresh_wording_failures.py", "--no-refit", "--out", str(target)])
    got = json.loads(target.read_text())
    for w in got["workloads"].values():
        by_cell = [b for cell in w["by_cell"].values() for b in cell.values()]
        assert w["gate_hits"] > 50 and sum(b["accepted"] for b in by_cell) == w["gate_hits"]
        assert sum(s["accepted"] for s in w["by_source"].values()) == w["gate_hits"]
        assert sum(b["beyond_tolerance"] for b in by_cell) == w["beyond_tolerance"] > 0
    for c in got["calibration_pairs"].values():
        by_cell = [b for cell in c["by_cell"].values() for b in cell.values()]
        assert sum(b["accepted"] for b in by_cell) == c["accepted"] > 0
        assert all(0 <= b["beyond_tolerance"] <= b["accepted"] for b in by_cell)
    assert "text_gap_sign" not in got


def test_online_stream_audits_and_explores_a_short_live_stream(tmp_path):
    """Eight requests a side from the cheap start, everything audited and explored: audits ran,
    every request has a truth, and the certificate was read along the stream."""
    target = tmp_path / "stream.json"
    run(["bench/studies/online_stream.py", "--limit", "8", "--alphas", "0.1", "--audit-rate", "1",
         "--explore-rate", "1", "--every", "4", "--out", str(target)])
    got = json.loads(target.read_text())["alphas"]["0.1"]
    recs, s = got["records"], got["summary"]
    assert len(recs) == 16 and s["all"]["requests"] == 16 and s["audit_cost_generations"] > 0
    assert s["all"]["audited"] + s["all"]["explored"] > 0 and len(got["timeline"]) == 4
    assert got["start_calibration"]["certified"]["same_scene"] and got["start_calibration"]["ladders"]
    assert all(r["false_accept"] in (0, 1) and (r["outcome"] == "hit" or not r["false_accept"]) for r in recs)


def test_online_stream_summary_is_read_again_from_its_committed_parts(tmp_path):
    parts = sorted(str(p) for p in (REPO / "bench" / "results" / "studies").glob("online_stream*_a*.json"))
    target = tmp_path / "online_stream.json"
    run(["bench/studies/online_stream.py", "--merge", *parts, "--no-cost-rows", "--out", str(target)])
    got = json.loads(target.read_text())
    committed = json.loads((REPO / "bench" / "results" / "online_stream.json").read_text())
    assert got["full_calibration"] == committed["full_calibration"]
    for alpha, r in committed["alphas"].items():
        assert got["alphas"][alpha]["summary"] == r["summary"], alpha


STUDIES = sorted(p.name for p in (REPO / "bench" / "studies").glob("*.py") if p.name != "study_paths.py")


@pytest.mark.parametrize("study", STUDIES)
def test_every_study_still_runs(study):
    """The studies that shaped the method stay runnable where they now live (their --help
    parses its arguments after every import the study needs has run)."""
    printed = run([f"bench/studies/{study}", "--help"], timeout=180)
    assert printed.startswith("usage:")


def test_bench_holds_the_benchmarks_people_run_and_the_studies_apart():
    """Every script at the top of bench/ is a benchmark the contributor guide lists; one-off
    studies live in bench/studies/."""
    top = sorted(p.name for p in (REPO / "bench").glob("*.py"))
    guide = (REPO / "docs" / "development.md").read_text()
    listed = guide.split("### Benchmarks")[1].split("bench/studies/")[0]
    assert [name for name in top if f"bench/{name}" not in listed] == [], \
        "a script at the top of bench/ that docs/development.md does not list as a benchmark"
    assert len(STUDIES) >= 10 and not set(top) & set(STUDIES)


def test_wording_counts_same_scene_hits_on_scenes_computed_before_in_the_same_pool():
    """bench/wording.py's question: a request whose scene was computed in full before in its
    noise pool counts; a hit on other evidence, a miss or a scene computed in another pool does
    not count as served; every one not served carries its why."""
    import repo_scripts
    wording = repo_scripts.load("bench/wording.py", "bench_wording")
    red = {"objects": [{"shape": "circle", "colour": "red", "position": "top left", "motion": "left"}]}
    blue = {"objects": [{"shape": "circle", "colour": "blue", "position": "top left", "motion": "left"}]}
    same_scene = {"outside_mean": 0.0, "outside_max": 0.0, "region_fraction": 0.0, "similarity_gap": 0.0}
    other = {**same_scene, "region_fraction": 0.3, "outside_max": 0.5}
    lines = [{"scene": red, "seed": 4, "seed_policy": "shared_noise"},   # pool 0: computed in full
             {"scene": red, "seed": 8, "seed_policy": "shared_noise"},   # pool 0 again: same-scene hit
             {"scene": red, "seed": 5, "seed_policy": "shared_noise"},   # pool 1: not seen there
             {"scene": red, "seed": 12, "seed_policy": "shared_noise"},  # pool 0: other evidence
             {"scene": blue, "seed": 0, "seed_policy": "shared_noise"},  # another scene
             {"scene": red, "seed": 0, "seed_policy": "shared_noise"}]   # pool 0: ran in full
    records = [{"outcome": "miss", "why": "no_candidate"}, {"outcome": "hit", "features": same_scene},
               {"outcome": "miss", "why": "risk"}, {"outcome": "hit", "features": other},
               {"outcome": "hit", "features": other}, {"outcome": "miss", "why": "min_saving"}]
    got = wording.seen_scene_hits(lines, records)
    assert (got["requests"], got["same_scene_hits"]) == (3, 1)
    assert got["not_same_scene_by_why"] == {"other_evidence": 1, "min_saving": 1}
    with pytest.raises(ValueError, match="records for"):
        wording.seen_scene_hits(lines, records[:-1])


def test_wording_serves_a_workload_and_writes_its_rows(tmp_path):
    """bench/wording.py --workloads runs bench/tinyworld.py with the bundled calibration and
    writes a row per α with the seen-scene count and the why of every request not reused."""
    target = tmp_path / "wording.json"
    run(["bench/wording.py", "--workloads", "serve_fresh_half", "--limit", "4", "--out", str(target)], timeout=600)
    rows = json.loads(target.read_text())["rows"]["serve_fresh_half/n20"]
    assert rows["calibration"] and set(rows["budgets"]) == {"0.02", "0.05", "0.1"}
    for row in rows["budgets"].values():
        assert row["requests"] == 4 and "not_same_scene_by_why" in row["seen_scene"]


def test_wording_ceiling_labels_same_scene_reuses_and_rereads_its_committed_summary(tmp_path):
    """A short live run reuses each earlier same-scene request at the certified depths and
    labels every reuse; re-read, the committed rows give the committed summary, and no pool
    serves more requests than it has or more than the ceiling of any evidence."""
    smoke = tmp_path / "smoke.json"
    run(["bench/studies/wording_ceiling.py", "--limit", "30", "--out", str(smoke)])
    got = json.loads(smoke.read_text())
    assert got["rows"], "no request of the first 30 had an earlier same-scene request"
    for r in got["rows"]:
        assert r["source"] < r["request"] and r["class"] in ("same_scene", "other")
        for d in r["depths"].values():  # below 30 dB is beyond tolerance whatever the checker says
            assert d["psnr"] >= 30.0 or d["label"] == 1
    studies = REPO / "bench" / "results" / "studies"
    half = ["--workload", "serve_fresh_half", "--parts", str(studies / "held_out_half_more_scenes_parts"),
            "--rows", str(studies / "wording_held_out_half_more_scenes.json")]
    for name, args in (("wording_ceiling.json", []), ("wording_ceiling_fresh_half.json", half)):
        committed, again = studies / name, tmp_path / name
        again.write_text(committed.read_text())
        run(["bench/studies/wording_ceiling.py", "--reread", "--out", str(again), *args])
        before, after = json.loads(committed.read_text())["summary"], json.loads(again.read_text())["summary"]
        assert after == before, name
        for s in after["by_depth"].values():
            for pool in (s["any_earlier"], s["benchmark_sources"]):
                assert pool["servable_classed_same_scene"] <= pool["servable"] <= pool["requests"]
        speed = after["speed_at_0.05"]  # servable requests as same-scene hits: more hits, fewer steps
        assert speed["ceiling_gate_hits"] >= speed["gate_hits"]
        assert speed["ceiling_gate_hit_speedup"] >= speed["gate_hit_speedup"]


def test_calibrate_certifies_each_stratum_of_committed_measurements(tmp_path):
    """bench/calibrate.py --instances A --stratum B: one fit, every threshold certified in both
    populations, the report naming them with a held-out check each (no model run: the
    measurements are the committed ones)."""
    studies = REPO / "bench" / "results" / "studies"
    base = studies / "lang2_region4_held_out_half" / "calibration_measurements.0-of-2.jsonl"
    other = studies / "lang2_region4_held_out_half_scenes" / "calibration_measurements.0-of-2.jsonl"
    run(["bench/calibrate.py", "--probe-fraction", "0.05", "--instances", str(base), "--stratum", str(other),
         "--form", "signed", "--joint", "--cache", str(tmp_path / "cache"), "--results", str(tmp_path)])
    report = json.loads((tmp_path / "calibration_report.probe0.05.json").read_text())
    assert report["certification"]["strata"] == ["0", "1"] and set(report["heldout_by_stratum"]) == {"0", "1"}
    for alpha in ("0.05", "0.1"):
        res = report["certification"]["classes"]["same_scene"]["budgets"][alpha]
        found = [r["threshold"] for r in res["by_stratum"].values()]
        assert set(res["by_stratum"]) == {"0", "1"}
        assert res["threshold"] == (None if None in found else min(found))
