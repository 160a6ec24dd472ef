"""Write the example workflows in workflows/: UI format (what the page loads) and API twins.

One graph description per example produces both files, so the twins cannot drift apart;
tests/test_server_e2e.py also checks each UI file against the live server's /object_info.

    python scripts/make_workflows.py
"""
from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "workflows"
# the nodes' default (carnator_core.gate.DEFAULT_PROBE_FRACTION; this script runs without torch)
PROBE_FRACTION = 0.05

BACKBONES = {
    # backbone: (tiny model file, empty-latent node, its widgets [width, height, length, batch])
    # the trained tiny world (draws recognisable objects; its own text encoder): the first example
    "tinyworld": ("carnator_tinyworld_wan21.safetensors", "EmptyHunyuanLatentVideo", [128, 128, 13, 1]),
    # random-weight models of three real architectures: the mechanics (steps skipped), no pictures
    "wan21": ("carnator_tiny_wan21.safetensors", "EmptyHunyuanLatentVideo", [128, 128, 9, 1]),
    "hunyuan_video": ("carnator_tiny_hunyuan_video.safetensors", "EmptyHunyuanLatentVideo", [128, 128, 9, 1]),
    "ltxv": ("carnator_tiny_ltxv.safetensors", "EmptyLTXVLatentVideo", [256, 256, 17, 1]),
    # Wan 2.2 5B's VAE compresses 16x in space and 4x in time, as HunyuanVideo 1.5's does: that
    # node's empty latent has its shape, and ComfyUI widens the zero latent's 32 channels to the
    # model's 48 as KSampler does (Wan22ImageToVideoLatent would need the real VAE)
    "wan22_5b": ("carnator_tiny_wan22_5b.safetensors", "EmptyHunyuanVideo15Latent", [256, 256, 9, 1]),
    "hunyuan_video15": ("carnator_tiny_hunyuan_video15.safetensors", "EmptyHunyuanVideo15Latent", [128, 128, 9, 1]),
    # two experts: the high-noise file here, the low-noise one in LOW_NOISE_EXPERTS
    "wan22_a14b": ("carnator_tiny_wan22_a14b_high.safetensors", "EmptyHunyuanLatentVideo", [128, 128, 9, 1]),
}
LOW_NOISE_EXPERTS = {"wan22_a14b": "carnator_tiny_wan22_a14b_low.safetensors"}
PROMPT = "a red ball rolls left across a green field"
STEPS, CFG, SEED = 12, 4.0, 42
SWITCH_STEP = STEPS // 2  # where Wan 2.2 A14B's low-noise expert takes over (ComfyUI's template: 10 of 20)
# The bundled tiny models have random weights: their early states move more between related
# prompts than a trained model's, so the examples use a wider budget than the 5% default.
RISK_BUDGET = 0.25
# The tiny world: its own prompts, the step count it was calibrated at, the default budget.
TINYWORLD = {"prompt": "a red circle in the top left moves right", "steps": 20, "risk_budget": 0.05}
TEXT_ENCODER = {"tinyworld": "CarnatorTinyWorldTextEncode"}

# (output name, type) per node type, and the widget names in the order the page stores them
OUTPUTS = {
    "UNETLoader": [("MODEL", "MODEL")],
    "CarnatorDemoTextEncode": [("CONDITIONING", "CONDITIONING")],
    "CarnatorTinyWorldTextEncode": [("CONDITIONING", "CONDITIONING")],
    "EmptyHunyuanLatentVideo": [("LATENT", "LATENT")],
    "EmptyLTXVLatentVideo": [("LATENT", "LATENT")],
    "EmptyHunyuanVideo15Latent": [("LATENT", "LATENT")],
    "CarnatorEarlyProbe": [("probe", "CARNATOR_PROBE")],
    "CarnatorCacheLookup": [("candidates", "CARNATOR_CANDIDATES")],
    "CarnatorCompatibilityGate": [("plan", "CARNATOR_PLAN"), ("summary", "STRING")],
    "CarnatorReuseSampler": [("LATENT", "LATENT"), ("summary", "STRING")],
    "CarnatorSampler": [("LATENT", "LATENT"), ("summary", "STRING")],
    "CarnatorCalibrate": [("report", "STRING")],
    "SaveLatent": [],
    "CarnatorTinyWorldDecode": [("IMAGE", "IMAGE")],
    "SaveAnimatedWEBP": [],
}
SAMPLING_WIDGETS = ["seed", "steps", "cfg", "sampler_name", "scheduler"]
PROBE_WIDGETS = ["probe_fraction"]
PROBE_OPTIONAL = ["seed_policy", "snapshot_count", "label"]
GATE_WIDGETS = ["risk_budget"]
GATE_OPTIONAL = ["min_depth", "max_depth", "max_region"]
FINISH_OPTIONAL = ["guided_finish", "min_saving", "recurring_sources"]  # last on its nodes: older saved workflows keep their layout
SPARSE_OPTIONAL = ["sparse_attention", "keep_mass", "min_density", "refresh_every", "sparse_on_miss"]
AUDIT_OPTIONAL = ["audit_rate"]
EXPLORE_OPTIONAL = ["explore_rate"]  # last on its nodes: older saved workflows keep their layout
EXPERT_OPTIONAL = ["switch_step", "switch_sigma"]
CALIBRATE_WIDGETS = ["prompts", "pairs", "first_seed", "steps", "cfg", "sampler_name", "scheduler",
                     "psnr_bound", "include_audits"]
WIDGETS = {
    "UNETLoader": ["unet_name", "weight_dtype"],
    "CarnatorDemoTextEncode": ["text", "backbone"],
    "CarnatorTinyWorldTextEncode": ["text"],
    "EmptyHunyuanLatentVideo": ["width", "height", "length", "batch_size"],
    "EmptyLTXVLatentVideo": ["width", "height", "length", "batch_size"],
    "EmptyHunyuanVideo15Latent": ["width", "height", "length", "batch_size"],
    "CarnatorEarlyProbe": SAMPLING_WIDGETS + PROBE_WIDGETS + PROBE_OPTIONAL + EXPERT_OPTIONAL,
    "CarnatorCacheLookup": ["top_k"],
    "CarnatorCompatibilityGate": GATE_WIDGETS + GATE_OPTIONAL + FINISH_OPTIONAL,
    "CarnatorReuseSampler": SPARSE_OPTIONAL + AUDIT_OPTIONAL + EXPLORE_OPTIONAL,
    "CarnatorSampler": (SAMPLING_WIDGETS + PROBE_WIDGETS + GATE_WIDGETS + PROBE_OPTIONAL
                        + GATE_OPTIONAL + SPARSE_OPTIONAL + AUDIT_OPTIONAL + EXPERT_OPTIONAL
                        + FINISH_OPTIONAL + EXPLORE_OPTIONAL),
    "CarnatorCalibrate": CALIBRATE_WIDGETS + EXPERT_OPTIONAL + ["probe_fraction", "fill_region_on_its_tokens",
                                                                 "region_margin", "procedure", "budget_generations"],
    "SaveLatent": ["filename_prefix"],
    "CarnatorTinyWorldDecode": ["scale"],
    "SaveAnimatedWEBP": ["filename_prefix", "fps", "lossless", "quality", "method"],
}


def graph(backbone: str, single_node: bool) -> dict[str, dict]:
    """API-format graph: {id: {class_type, inputs}} with links as [node_id, output_index]."""
    model_file, latent_node, latent_widgets = BACKBONES[backbone]
    world = backbone == "tinyworld"
    prompt = TINYWORLD["prompt"] if world else PROMPT
    encoder = TEXT_ENCODER.get(backbone, "CarnatorDemoTextEncode")
    text = (lambda t: {"text": t}) if world else (lambda t: {"text": t, "backbone": backbone})
    g = {
        "1": ("UNETLoader", {"unet_name": model_file, "weight_dtype": "default"}),
        "2": (encoder, text(prompt)),
        "3": (encoder, text("")),
        "4": (latent_node, dict(zip(WIDGETS[latent_node], latent_widgets))),
    }
    # label "": the cache tab shows each request under its own prompt (read from node 2)
    sampling = {"model": ["1", 0], "positive": ["2", 0], "negative": ["3", 0],
                "latent_image": ["4", 0], "seed": SEED, "steps": TINYWORLD["steps"] if world else STEPS,
                "cfg": CFG, "sampler_name": "euler", "scheduler": "simple", "probe_fraction": PROBE_FRACTION,
                "seed_policy": "same_seed", "snapshot_count": 7, "label": "",
                "switch_step": 0, "switch_sigma": 0.875}
    if backbone in LOW_NOISE_EXPERTS:
        g["10"] = ("UNETLoader", {"unet_name": LOW_NOISE_EXPERTS[backbone], "weight_dtype": "default"})
        sampling.update({"low_noise_model": ["10", 0], "switch_step": SWITCH_STEP})
    gate = {"risk_budget": TINYWORLD["risk_budget"] if world else RISK_BUDGET, "min_depth": 0.2,
            "max_depth": 0.8, "max_region": 0.5, "guided_finish": True, "min_saving": 0.0,
            "recurring_sources": True}
    sparse = {"sparse_attention": True, "keep_mass": 0.9, "min_density": 0.1, "refresh_every": 0,
              "sparse_on_miss": False, "audit_rate": 0.0, "explore_rate": 0.0}
    if single_node:
        g["5"] = ("CarnatorSampler", {**sampling, **gate, **sparse})
        final = "5"
    else:
        g["5"] = ("CarnatorEarlyProbe", sampling)
        g["6"] = ("CarnatorCacheLookup", {"probe": ["5", 0], "top_k": 3})
        g["7"] = ("CarnatorCompatibilityGate", {"candidates": ["6", 0], **gate})
        g["8"] = ("CarnatorReuseSampler", {"plan": ["7", 0], **sparse})
        final = "8"
    if world:  # its frames, saved as an animated WEBP a person can open
        g["9"] = ("CarnatorTinyWorldDecode", {"samples": [final, 0], "scale": 4})
        g["10"] = ("SaveAnimatedWEBP", {"images": ["9", 0], "filename_prefix": f"carnator/{backbone}",
                                        "fps": 4.0, "lossless": True, "quality": 80, "method": "default"})
    else:
        g["9"] = ("SaveLatent", {"samples": [final, 0], "filename_prefix": f"carnator/{backbone}"})
    return {k: {"class_type": t, "inputs": i, "_meta": {"title": t}} for k, (t, i) in g.items()}


def calibration_graph(backbone: str) -> dict[str, dict]:
    """Calibrate the gate on the model: no text encoder (the demo one is used), no VAE
    (reuses judged on the latent), the built-in prompt list."""
    model_file, latent_node, latent_widgets = BACKBONES[backbone]
    g = {
        "1": ("UNETLoader", {"unet_name": model_file, "weight_dtype": "default"}),
        "4": (latent_node, dict(zip(WIDGETS[latent_node], latent_widgets))),
        "5": ("CarnatorCalibrate", {"model": ["1", 0], "latent_image": ["4", 0], "prompts": "",
                                    "pairs": 60, "first_seed": 0, "steps": STEPS, "cfg": CFG,
                                    "sampler_name": "euler", "scheduler": "simple",
                                    "psnr_bound": 30.0, "include_audits": True,
                                    "switch_step": 0, "switch_sigma": 0.875, "probe_fraction": PROBE_FRACTION,
                                    "fill_region_on_its_tokens": False, "region_margin": 0,
                                    "procedure": "full", "budget_generations": 0.0}),
    }
    return {k: {"class_type": t, "inputs": i, "_meta": {"title": t}} for k, (t, i) in g.items()}


def to_ui(api: dict[str, dict]) -> dict:
    """The page's format: nodes with widget values in order, and a link table."""
    links, nodes = [], []
    consumers: dict[tuple[str, int], list[int]] = {}
    for nid, node in api.items():
        for name, value in node["inputs"].items():
            if isinstance(value, list):
                link_id = len(links) + 1
                src_type = OUTPUTS[api[value[0]]["class_type"]][value[1]][1]
                links.append([link_id, int(value[0]), value[1], int(nid), name, src_type])
                consumers.setdefault((value[0], value[1]), []).append(link_id)
    for col, (nid, node) in enumerate(api.items()):
        t = node["class_type"]
        widgets = []
        for w in WIDGETS[t]:
            widgets.append(node["inputs"][w])
            if w == "seed":
                widgets.append("fixed")  # the page's control_after_generate value
        inputs = []
        for link in links:
            if link[3] == int(nid):
                inputs.append({"name": link[4], "type": link[5], "link": link[0]})
        outputs = [{"name": n, "type": ty, "links": consumers.get((nid, i), []), "slot_index": i}
                   for i, (n, ty) in enumerate(OUTPUTS[t])]
        # the nodes that show a result get room for its pictures (frame strips)
        width = 380 if t in ("CarnatorSampler", "CarnatorReuseSampler") else 300
        nodes.append({"id": int(nid), "type": t, "pos": [40 + 420 * (col % 5), 60 + 420 * (col // 5)],
                      "size": [width, 200], "flags": {}, "order": col, "mode": 0,
                      "inputs": inputs, "outputs": outputs, "properties": {"Node name for S&R": t},
                      "widgets_values": widgets})
    ui_links = []
    for link_id, src, src_slot, dst, name, ty in links:
        dst_slot = [i["name"] for i in next(n for n in nodes if n["id"] == dst)["inputs"]].index(name)
        ui_links.append([link_id, src, src_slot, dst, dst_slot, ty])
    return {"last_node_id": max(int(k) for k in api), "last_link_id": len(links),
            "nodes": nodes, "links": ui_links, "groups": [], "config": {}, "extra": {},
            "version": 0.4}


def main() -> None:
    (OUT / "api").mkdir(parents=True, exist_ok=True)
    for backbone in BACKBONES:
        for single, suffix in ((False, "4node"), (True, "sampler")):
            name = f"carnator_{backbone}_{suffix}"
            api = graph(backbone, single)
            (OUT / f"{name}.json").write_text(json.dumps(to_ui(api), indent=1) + "\n")
            (OUT / "api" / f"{name}.api.json").write_text(json.dumps(api, indent=1) + "\n")
            print("wrote", name)
    name = "carnator_wan21_calibrate"
    api = calibration_graph("wan21")
    (OUT / f"{name}.json").write_text(json.dumps(to_ui(api), indent=1) + "\n")
    (OUT / "api" / f"{name}.api.json").write_text(json.dumps(api, indent=1) + "\n")
    print("wrote", name)


if __name__ == "__main__":
    main()
