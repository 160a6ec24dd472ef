"""A user's first hour: the pictures the README opens with regenerate byte for byte,
the example workflows label each request with its own prompt, and the first example is the
trained tiny world with its own text encoder."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_demo_pictures_regenerate_identically():
    """`make demo` writes docs/demo/ with scripts/demo_pictures.py; a fresh run on this machine
    (CPU, one thread, fixed seed) must give the committed bytes."""
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "demo_pictures.py"), "--check"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "identical to docs/demo/" in out.stdout  # or but for one-level rounding on ≤ 0.1%
    rows = json.loads((REPO / "docs" / "demo" / "demo.json").read_text())
    assert [r["outcome"] for r in rows] == ["miss", "hit", "hit", "exact"], rows
    assert rows[1]["region_fraction"] == 0.0 and rows[2]["region_fraction"] > 0, rows  # M shown on the edit


def test_the_readme_opens_with_the_demo_picture():
    head = (REPO / "README.md").read_text().split("\n## ")[0]
    assert "docs/demo/carnator-demo.png" in head


def test_example_workflows_label_requests_with_their_own_prompt():
    for path in sorted((REPO / "workflows").glob("*.json")):
        wf = json.loads(path.read_text())
        for node in wf["nodes"]:
            if node["type"] in ("CarnatorEarlyProbe", "CarnatorSampler"):
                values = node["widgets_values"]
                # the label widget is empty: the node reads the prompt of the encoder feeding it
                assert "" in values and "a red" not in " ".join(str(v) for v in values), (path.name, values)


def test_the_first_example_is_the_tiny_world_with_its_text_encoder():
    api = json.loads((REPO / "workflows" / "api" / "carnator_tinyworld_sampler.api.json").read_text())
    assert api["1"]["inputs"]["unet_name"] == "carnator_tinyworld_wan21.safetensors"
    assert api["2"]["class_type"] == "CarnatorTinyWorldTextEncode"
    assert api["5"]["class_type"] == "CarnatorSampler" and api["5"]["inputs"]["label"] == ""


def test_the_label_is_read_from_the_prompt_graph():
    from carnator_core.comfy_adapter import prompt_text_of
    graph = {
        "2": {"class_type": "CLIPTextEncode", "inputs": {"text": "a cat", "clip": ["1", 1]}},
        "3": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["2", 0]}},
        "4": {"class_type": "PrimitiveString", "inputs": {"value": "a dog"}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": ["4", 0], "clip": ["1", 1]}},
        "5": {"class_type": "CarnatorSampler", "inputs": {"positive": ["2", 0], "negative": ["3", 0]}},
        "7": {"class_type": "CarnatorSampler", "inputs": {"positive": ["3", 0]}},
        "8": {"class_type": "CarnatorSampler", "inputs": {"positive": ["6", 0]}},
    }
    assert prompt_text_of(graph, "5") == "a cat"
    assert prompt_text_of(graph, "7") == "a cat"          # through a conditioning pass-through
    assert prompt_text_of(graph, "8") == "a dog"          # a text widget fed by a string node
    assert prompt_text_of(graph, "9") == "" and prompt_text_of(None, "5") == ""


def test_the_model_is_named_by_the_files_it_was_loaded_from():
    from carnator_core.comfy_adapter import model_file_names
    graph = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": "wan2.2_high.safetensors"}},
        "2": {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["1", 0], "lora_name": "style.safetensors"}},
        "3": {"class_type": "UNETLoader", "inputs": {"unet_name": "wan2.2_low.safetensors"}},
        "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "ltxv.safetensors"}},
        "5": {"class_type": "CarnatorSampler", "inputs": {"model": ["2", 0], "low_noise_model": ["3", 0]}},
        "6": {"class_type": "CarnatorSampler", "inputs": {"model": ["4", 0]}},
    }
    assert model_file_names(graph, "5") == ["wan2.2_high.safetensors", "wan2.2_low.safetensors"]
    assert model_file_names(graph, "6") == ["ltxv.safetensors"]  # through the LoRA, not its file
    assert model_file_names(graph, "7") == [] and model_file_names(None, "5") == []


def test_the_cache_tab_names_models_and_lists_no_stray_file(tmp_path):
    from carnator_core.calibration.status import known_fingerprints, model_status, remember_model_names
    fp = "0" * 32
    remember_model_names(tmp_path, fp, ["wan2.1_t2v_1.3B_fp16.safetensors"])
    (tmp_path / "calibration").mkdir()
    (tmp_path / "calibration" / "demo_models.json").write_text("{}")  # not a calibration
    assert model_status(tmp_path, fp)["names"] == ["wan2.1_t2v_1.3B_fp16.safetensors"]
    assert known_fingerprints(tmp_path) == []
    (tmp_path / "model_names.json").write_text("not json")  # damaged: names unknown, nothing fails
    assert model_status(tmp_path, fp)["names"] == []
