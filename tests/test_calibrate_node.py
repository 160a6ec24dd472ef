"""Carnator Calibrate in the real ComfyUI server: the example workflow's node calibrates the
model it is given, the sampler then reports its gate as calibrated, and the cache tab's
route lists it."""
import copy
import json
from pathlib import Path

from server_harness import ComfyServer, carnator_outputs

REPO = Path(__file__).resolve().parent.parent
BASE = "a red ball rolls left across a green field"
PAIRS = "\n".join(f"{BASE} || {BASE} {word}" for word in ("slowly", "gently", "today", "again", "now"))


def calibrate_workflow() -> dict:
    wf = json.loads((REPO / "workflows" / "api" / "carnator_wan21_calibrate.api.json").read_text())
    wf = copy.deepcopy(wf)
    wf["4"]["inputs"].update(width=64, height=64, length=5)
    wf["5"]["inputs"].update(prompts=PAIRS, pairs=5, steps=8)
    return wf


def sampler_workflow(prompt: str, seed: int, audit_rate: float = 0.0) -> dict:
    wf = json.loads((REPO / "workflows" / "api" / "carnator_wan21_sampler.api.json").read_text())
    wf["2"]["inputs"]["text"] = prompt
    wf["4"]["inputs"].update(width=64, height=64, length=5)
    wf["5"]["inputs"].update(seed=seed, steps=8, label=prompt, audit_rate=audit_rate, risk_budget=0.5)
    return wf


def test_calibrate_node_writes_the_calibration_the_sampler_then_uses(tmp_path):
    with ComfyServer(tmp_path) as server:
        history = server.run(calibrate_workflow(), timeout=900)
        report = history["outputs"]["5"]["text"][0]
        assert "5 prompt pairs" in report and "reuses measured" in report, report
        assert "cost: " in report and "generation-equivalents" in report and "s wall" in report, report
        files = sorted(p.name for p in (server.cache_dir / "calibration").iterdir())
        # the node's default probe, 0.05, the samplers' default: <fingerprint>.probe0.05.json
        fingerprint = next(n.split(".")[0] for n in files if n.endswith(".probe0.05.json"))
        name = f"{fingerprint}.probe0.05"
        assert f"{name}.progress.jsonl" in files and f"{name}.report.json" in files
        saved = json.loads((server.cache_dir / "calibration" / f"{name}.json").read_text())
        assert saved["calibrated"] and saved["tolerance"] == {"psnr_bound": 30.0, "space": "latent"}

        # the same model through the sampler: its gate is the calibrated one, and says so
        first = carnator_outputs(server.run(sampler_workflow(BASE, 11)))[0]
        assert first["outcome"] == "miss"
        assert f"gate: calibrated ({saved['measured_reuses']:,} reuses measured" in first["text"]

        listed = server.get("/carnator/calibration")["models"]
        mine = next(m for m in listed if m["fingerprint"] == fingerprint)
        assert mine["calibrated"] and mine["measured_reuses"] == saved["measured_reuses"]
        assert mine["example"] == BASE
        assert mine["probe_fraction"] == 0.05 and mine["other_probes"] == []
        assert mine["measured_steps"] == 8  # the steps it was calibrated at (the cache tab says so)
        # a calibration for another probe is listed beside it, never used for this one
        other = dict(saved, probe_fraction=0.1)
        (server.cache_dir / "calibration" / f"{fingerprint}.json").write_text(json.dumps(other))
        mine = next(m for m in server.get("/carnator/calibration")["models"] if m["fingerprint"] == fingerprint)
        assert mine["calibrated"] and mine["other_probes"] == [0.1]

        # run again: the finished calibration refits from its measurements (no new pairs)
        progress = (server.cache_dir / "calibration" / f"{name}.progress.jsonl").read_text()
        wf = calibrate_workflow()
        wf["5"]["inputs"]["include_audits"] = False  # a changed input, so ComfyUI runs the node again
        again = server.run(wf, timeout=900)["outputs"]["5"]["text"][0]
        assert "5 prompt pairs" in again
        assert (server.cache_dir / "calibration" / f"{name}.progress.jsonl").read_text() == progress

        # the recipe for edits: M filled on its own tokens and widened; measured anew (the
        # measurements are kept per recipe), and the file the gate loads carries it
        wf = calibrate_workflow()
        wf["5"]["inputs"].update(fill_region_on_its_tokens=True, region_margin=1)
        recipe = server.run(wf, timeout=900)["outputs"]["5"]["text"][0]
        assert "filled on its own tokens, widened by 1 tile(s) for edits; signed risk form" in recipe, recipe
        saved = json.loads((server.cache_dir / "calibration" / f"{name}.json").read_text())
        assert saved["region_fill_on_m"] and saved["region_margin"] == 1
        assert (server.cache_dir / "calibration" / f"{name}.progress.jsonl").read_text() != progress



def test_the_cheap_procedure_keeps_the_bundled_ranking_within_its_budget(tmp_path):
    """procedure "cheap" in the real server: the bundled tiny world's ranking is kept with its
    recipe, the measurement stops at the budget, and the report is the cheap one (per cell,
    what was certified or refused and what it cost); asked for another probe it refuses with
    what to do instead."""
    import pytest
    with ComfyServer(tmp_path) as server:
        wf = calibrate_workflow()
        wf["5"]["inputs"].update(procedure="cheap", pairs=8, budget_generations=4.0)
        report = server.run(wf, timeout=900)["outputs"]["5"]["text"][0]
        assert report.startswith("cheap calibration of model"), report
        assert "ranking transferred, thresholds certified per cell" in report, report
        assert "stopped by the budget of 4 generation-equivalents" in report, report
        files = sorted(p.name for p in (server.cache_dir / "calibration").iterdir())
        # the ranking's probe, 0.05: its measurements are kept apart from a full calibration's
        assert any(n.endswith(".probe0.05.cheap.progress.jsonl") for n in files), files

        # measured at 64×64 px and served at 128×128 (four times the tokens): a budget of 1
        # generation of the served size stops the same pairs as 4 did at the measured one
        wf = calibrate_workflow()
        wf["9"] = {"class_type": "EmptyHunyuanLatentVideo",
                   "inputs": {**wf["4"]["inputs"], "width": 128, "height": 128}}
        wf["5"]["inputs"].update(procedure="cheap", pairs=8, budget_generations=1.0, served_latent=["9", 0])
        served = server.run(wf, timeout=900)["outputs"]["5"]["text"][0]
        assert "at the served size, latent 2×16×16" in served and "25.0% of its tokens" in served, served
        assert "stopped by the budget of 1 generation-equivalents of the served size" in served, served

        wf = calibrate_workflow()
        wf["5"]["inputs"].update(procedure="cheap", pairs=8, budget_generations=4.0, probe_fraction=0.1)
        with pytest.raises(RuntimeError, match="keeps a ranking learned with probe_fraction 0.05, not 0.1"):
            server.run(wf, timeout=300)
        # prompts worded as the traffic is are certified as their own population by the full
        # procedure only: asked of the cheap one, it says so rather than drop them
        wf = calibrate_workflow()
        wf["5"]["inputs"].update(procedure="cheap", pairs=8, budget_generations=4.0,
                                 traffic_prompts="a red ball moves left")
        with pytest.raises(RuntimeError, match="traffic_prompts works with procedure 'full'"):
            server.run(wf, timeout=300)
