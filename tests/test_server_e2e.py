"""End to end in the real ComfyUI server: only this pack enabled, workflows POSTed as a
client would, results read back from /history, a restart in the middle."""
import copy
import json
from pathlib import Path

import pytest
from server_harness import ComfyServer, carnator_outputs

REPO = Path(__file__).resolve().parent.parent
WORKFLOWS = REPO / "workflows"
NODE_IDS = {"CarnatorEarlyProbe", "CarnatorCacheLookup", "CarnatorCompatibilityGate",
            "CarnatorReuseSampler", "CarnatorSampler"}
BASE = "a red ball rolls left across a green field"


def api_workflow(name: str, prompt: str, seed: int) -> dict:
    wf = json.loads((WORKFLOWS / "api" / f"{name}.api.json").read_text())
    wf = copy.deepcopy(wf)
    wf["2"]["inputs"]["text"] = prompt
    for node in wf.values():
        if "seed" in node["inputs"]:
            node["inputs"]["seed"] = seed
            node["inputs"]["label"] = prompt
    return wf


def summary_of(server: ComfyServer, name: str, prompt: str, seed: int) -> dict:
    found = carnator_outputs(server.run(api_workflow(name, prompt, seed)))
    assert len(found) == 1, found
    return found[0]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ComfyServer(tmp_path_factory.mktemp("comfy")) as s:
        yield s


def test_object_info_lists_the_nodes_with_tooltips(server):
    info = server.get("/object_info")
    assert NODE_IDS <= set(info)
    for node_id in NODE_IDS:
        spec = info[node_id]
        assert spec["category"] == "Carnator"
        for group in ("required", "optional"):
            for name, (_, opts) in spec["input"].get(group, {}).items():
                assert opts.get("tooltip"), f"{node_id}.{name} has no tooltip"


def ui_to_api(ui: dict, object_info: dict) -> dict:
    """Convert the page's workflow format the way the front end does (widgets in order)."""
    links = {link[0]: link for link in ui["links"]}
    api = {}
    for node in ui["nodes"]:
        spec = object_info[node["type"]]
        linked = {i["name"]: [str(links[i["link"]][1]), links[i["link"]][2]]
                  for i in node["inputs"] if i.get("link") is not None}
        values, inputs = list(node["widgets_values"]), dict(linked)
        for group in ("required", "optional"):
            for name in spec.get("input_order", {}).get(group, []):
                if name in linked:
                    continue
                entry = spec["input"][group][name]
                kind, opts = entry[0], (entry[1] if len(entry) > 1 else {})
                is_widget = isinstance(kind, list) or kind in ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")
                if not is_widget:
                    continue
                inputs[name] = values.pop(0)
                if opts.get("control_after_generate"):
                    values.pop(0)
        assert not values, f"{node['type']}: widget values left over {values}"
        api[str(node["id"])] = {"class_type": node["type"], "inputs": inputs}
    return api


def test_ui_workflows_load_as_their_api_twins(server):
    info = server.get("/object_info")
    ui_files = sorted(WORKFLOWS.glob("*.json"))
    assert len(ui_files) >= 6
    for ui_file in ui_files:
        ui = json.loads(ui_file.read_text())
        twin = json.loads((WORKFLOWS / "api" / f"{ui_file.stem}.api.json").read_text())
        converted = ui_to_api(ui, info)
        assert converted == {k: {"class_type": v["class_type"], "inputs": v["inputs"]}
                             for k, v in twin.items()}, ui_file.name


@pytest.mark.parametrize("name", ["carnator_hunyuan_video_4node", "carnator_ltxv_4node",
                                  "carnator_wan21_sampler", "carnator_wan22_5b_4node",
                                  "carnator_hunyuan_video15_sampler", "carnator_wan22_a14b_4node",
                                  "carnator_wan22_a14b_sampler"])
def test_related_request_hits_through_the_server(server, name):
    seed = abs(hash(name)) % 10_000  # a fresh seed per workflow: no entry from other tests
    first = summary_of(server, name, BASE, seed)
    second = summary_of(server, name, BASE + " slowly", seed)
    assert first["outcome"] == "miss" and first["stored_id"]
    assert second["outcome"] == "hit", second["text"]
    assert second["steps_computed"] < second["steps_total"]
    assert second["entry_id"] == first["stored_id"]
    if "a14b" in name:  # the workflow's two UNETLoaders, switched at step 6 of 12
        assert first["expert_calls"] == {"high_noise": 6, "low_noise": 6}, first["expert_calls"]
        assert sum(second["expert_calls"].values()) == second["steps_computed"]
    # the model is named as it was loaded (both files of a pair), in the summary and the cache tab
    workflow = json.loads((WORKFLOWS / "api" / f"{name}.api.json").read_text())
    files = [n["inputs"]["unet_name"] for n in workflow.values() if n["class_type"] == "UNETLoader"]
    assert f"model: {' + '.join(files)}" in second["text"], second["text"]
    listed = {m["fingerprint"]: m for m in server.get("/carnator/calibration")["models"]}
    assert files in [m["names"] for m in listed.values()], listed


def test_hit_survives_a_server_restart(tmp_path):
    name, seed = "carnator_wan21_4node", 1234
    with ComfyServer(tmp_path) as s:
        first = summary_of(s, name, BASE, seed)
        second = summary_of(s, name, BASE + " slowly", seed)
        assert first["outcome"] == "miss"
        assert second["outcome"] == "hit" and second["steps_computed"] < second["steps_total"]
    assert (tmp_path / "user" / "carnator_cache" / "carnator.sqlite").is_file()
    with ComfyServer(tmp_path) as s:  # same user folder, new process
        third = summary_of(s, name, BASE + " gently", seed)
        assert third["outcome"] == "hit", third["text"]
        assert third["steps_computed"] < third["steps_total"]
        assert third["entry_id"] in (first["stored_id"], second["stored_id"])
