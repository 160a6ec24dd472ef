"""`make demo`: a short sequence of related requests through a real, headless ComfyUI.

Starts the server with only this pack, queues the bundled example workflows (the trained
tiny-world model with its text encoder first, then the three random-weight models with the demo
text encoder; a fresh SQLite cache under out/demo/) for each backbone, and prints one
row per request: hit or miss, steps computed, seconds, and the speedup against that
backbone's first (miss) request measured in the same process, after one untimed warm-up
pair per backbone (model load, kernel compile). Rows go to out/demo.json.

Quality, for the trained tiny world: each request is also computed in full by ComfyUI's own
KSampler (same prompt, seed and steps), and the row gives the PSNR of Carnator's frames
against it and the checker's verdict on both (does the video show what the prompt says?),
so a reuse of another scene can be told right or wrong at a glance.

A plain KSampler run of the same size per backbone gives the miss overhead (wall time).

The random-weight models show the mechanics and the step savings at a size where the model
dominates the time — their pictures are noise and their decisions mean nothing, so they are
printed in a section of their own; the tiny world shows pictures (its outcome as
frame strips: scripts/demo_pictures.py, which `make demo` runs first).
Their gates run calibrated: models/calibration/ holds each model's calibration by the generic
procedure (scripts/calibrate_model.py --demo-models), copied into the demo's cache folder.
"""
from __future__ import annotations

import argparse
import copy
import json
import re
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from server_harness import ComfyServer, carnator_outputs  # noqa: E402

BASE = "a red ball rolls left across a green field"
TINYWORLD_BASE = "a red circle in the top left moves right"
SEQUENCES = {  # backbone -> (what the request is, prompt, label suffix)
    # the trained tiny world first: it draws what the prompt says (scripts/demo_pictures.py
    # renders the same kind of sequence as pictures into docs/demo/)
    "tinyworld": [
        ("first request", TINYWORLD_BASE, ""),
        ("paraphrase", "a scarlet ball at the top left travels right", ""),
        ("object added", TINYWORLD_BASE + " and a blue square in the bottom right moves up", ""),
        ("exact repeat", TINYWORLD_BASE, " (again)"),  # a new label makes ComfyUI re-run the node
        ("unrelated", "a yellow triangle in the bottom right moves up", ""),
    ],
    # random-weight models of three real architectures: the mechanics, at a size where the
    # model dominates the time
    "default": [
        ("first request", BASE, ""),
        ("related edit", BASE + " slowly", ""),
        ("another edit", BASE + " gently in the sun", ""),
        ("exact repeat", BASE, " (again)"),
        ("unrelated", "a blue cube jumps up over a wooden fence at night", ""),
    ],
}
# latent sizes where model compute dominates per-request overhead on a CPU (the tiny world
# has one size: 4 frames of 32×32 pixels; 1280 video tokens each but LTX-Video's 1,440:
# Wan 2.2 5B and HunyuanVideo 1.5 have 16x VAEs)
DEMO_LATENTS = {"tinyworld": [128, 128, 13, 1], "wan21": [256, 256, 17, 1],
                "hunyuan_video": [256, 256, 17, 1], "ltxv": [384, 384, 33, 1],
                "wan22_5b": [512, 512, 17, 1], "wan22_a14b": [256, 256, 17, 1],
                "hunyuan_video15": [256, 256, 17, 1]}
STEPS = {"tinyworld": 20}  # the step count its calibration was made at; the others: --steps


def sequence(backbone: str) -> list[tuple[str, str, str]]:
    return SEQUENCES.get(backbone, SEQUENCES["default"])


def workflow(backbone: str, prompt: str, label: str, steps: int, seed: int) -> dict:
    wf = json.loads((ROOT / "workflows" / "api" / f"carnator_{backbone}_sampler.api.json").read_text())
    wf = copy.deepcopy(wf)
    wf["2"]["inputs"]["text"] = prompt
    wf["4"]["inputs"].update(dict(zip(["width", "height", "length", "batch_size"], DEMO_LATENTS[backbone])))
    wf["5"]["inputs"].update({"seed": seed, "steps": steps, "label": prompt + label})
    if "low_noise_model" in wf["5"]["inputs"]:  # Wan 2.2 A14B: the experts switch half way
        wf["5"]["inputs"]["switch_step"] = steps // 2
    return wf


def plain_ksampler(backbone: str, prompt: str, steps: int, seed: int) -> dict:
    """The same request through ComfyUI's own KSampler: the reference for miss overhead."""
    wf = workflow(backbone, prompt, "", steps, seed)
    i = wf["5"]["inputs"]
    common = {k: i[k] for k in ("model", "positive", "negative", "latent_image", "seed", "steps",
                                "cfg", "sampler_name", "scheduler")}
    if "low_noise_model" not in i:
        wf["5"] = {"class_type": "KSampler", "inputs": common | {"denoise": 1.0}}
        return wf
    # Wan 2.2 A14B as users run it: two KSamplerAdvanced nodes switching at the same step
    common["noise_seed"] = common.pop("seed")
    wf["5"] = {"class_type": "KSamplerAdvanced", "inputs": common | {
        "add_noise": "enable", "start_at_step": 0, "end_at_step": i["switch_step"],
        "return_with_leftover_noise": "enable"}}
    wf["11"] = {"class_type": "KSamplerAdvanced", "inputs": common | {
        "model": i["low_noise_model"], "latent_image": ["5", 0], "add_noise": "disable",
        "start_at_step": i["switch_step"], "end_at_step": 10000, "return_with_leftover_noise": "disable"}}
    wf["9"]["inputs"]["samples"] = ["11", 0]
    return wf


def tinyworld_frames(server, history: dict) -> "torch.Tensor":
    """The decoded frames a tiny-world workflow saved (lossless WEBP, enlarged ×scale by
    nearest neighbour) as the world's (3, T, 32, 32) video in 0..1."""
    import numpy as np
    import torch
    from PIL import Image, ImageSequence
    saved = next(o["images"][0] for o in history["outputs"].values() if o.get("images"))
    path = server.output_dir / saved.get("subfolder", "") / saved["filename"]
    with Image.open(path) as im:
        frames = [np.asarray(f.convert("RGB"), dtype=np.float32) / 255.0 for f in ImageSequence.Iterator(im)]
    video = torch.from_numpy(np.stack(frames)).permute(3, 0, 1, 2)  # (3, T, H·s, W·s)
    scale = video.shape[-1] // 32
    return video[..., ::scale, ::scale]


def quality(server, backbone: str, prompt: str, steps: int, seed: int, carnator_history: dict) -> dict:
    """PSNR against the request's own full computation and the checker on both."""
    sys.path.insert(0, str(ROOT))
    from tinyworld import checker, world
    from carnator_core.calibration.tolerance import psnr
    reference = tinyworld_frames(server, server.run(plain_ksampler(backbone, prompt, steps, seed), timeout=900))
    ours = tinyworld_frames(server, carnator_history)
    scene = world.parse_caption(prompt)
    verdict = lambda v: "right" if checker.check(v, scene)["all"] >= 1.0 else "wrong"  # noqa: E731
    return {"psnr_vs_full": round(psnr(ours, reference, peak=1.0), 1), "checker": verdict(ours),
            "checker_full": verdict(reference)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--backbones", nargs="+", default=list(DEMO_LATENTS))
    ap.add_argument("--out", default=str(ROOT / "out"))
    args = ap.parse_args()
    out = Path(args.out)
    work = out / "demo"
    shutil.rmtree(work, ignore_errors=True)  # a fresh cache: the first request must miss
    rows = []
    target = work / "user" / "carnator_cache" / "calibration"
    target.mkdir(parents=True)
    from install_models import bundled_calibrations  # beside this script: what a user installs
    for f in bundled_calibrations():
        shutil.copy(f, target / f.name)
    print(f"starting ComfyUI (headless, CPU) in {work} ...", flush=True)
    with ComfyServer(work) as server:
        for backbone in args.backbones:
            # warm-up on another seed (not shown): model load and the one-off compile of the
            # sparse kernel would otherwise be charged to the first rows
            steps = STEPS.get(backbone, args.steps)
            for _, prompt, _ in sequence(backbone)[:2]:
                server.run(workflow(backbone, prompt, "", steps, seed=1), timeout=900)
            miss_seconds = None
            t0 = time.perf_counter()
            server.run(plain_ksampler(backbone, sequence(backbone)[-1][1] + " today", steps, 2026), timeout=900)
            ksampler_wall = time.perf_counter() - t0
            for what, prompt, label in sequence(backbone):
                t0 = time.perf_counter()
                history = server.run(workflow(backbone, prompt, label, steps, seed=2026), timeout=900)
                wall = time.perf_counter() - t0
                summary = carnator_outputs(history)[0]
                judged = quality(server, backbone, prompt, steps, 2026, history) \
                    if backbone == "tinyworld" else {}
                if miss_seconds is None:
                    miss_seconds = summary["seconds"]
                rows.append({
                    "backbone": backbone, "request": what, "prompt": prompt,
                    "outcome": summary["outcome"], "reuse_step": summary["reuse_step"],
                    "steps_computed": summary["steps_computed"], "steps_total": summary["steps_total"],
                    "seconds": round(summary["seconds"], 3), "wall_seconds": round(wall, 3),
                    "speedup_vs_first": round(miss_seconds / max(summary["seconds"], 1e-6), 2),
                    "risk": summary["risk"], "entry_id": summary["entry_id"],
                    "gate": gate_words(summary.get("calibration", "")),
                    "ksampler_wall_seconds": round(ksampler_wall, 3), **judged})
                print_row(rows[-1], header=len(rows) == 1 or backbone != rows[-2]["backbone"]
                          and "tinyworld" in (backbone, rows[-2]["backbone"]))
    for r in rows:
        if r["outcome"] == "miss":
            r["miss_overhead_vs_ksampler"] = round(r["wall_seconds"] / r["ksampler_wall_seconds"], 2)
    misses = [r for r in rows if "miss_overhead_vs_ksampler" in r]
    print("\nmiss wall time / plain KSampler wall time (same size and steps, same process):")
    for r in misses:
        print(f"  {r['backbone']:14} {r['request']:15} {r['miss_overhead_vs_ksampler']:.2f}x")
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo.json").write_text(json.dumps({"steps": args.steps, "rows": rows}, indent=2))
    print(f"\nwrote {out / 'demo.json'}")
    return 0


def gate_words(line: str) -> str:
    """'calibrated (N reuses measured)' or 'uncalibrated prior', from the summary's line."""
    found = re.search(r"gate: calibrated \(([\d,]+ reuses measured)", line)
    if found:
        return f"calibrated ({found.group(1)})"
    return "uncalibrated prior" if "uncalibrated" in line else (line or "—")


def print_row(r: dict, header: bool) -> None:
    world = r["backbone"] == "tinyworld"
    if header:
        print("\nThe trained tiny world: decisions and their quality (PSNR against the request's own "
              "full computation; checker: does the video show the prompt?)" if world else
              "\nRandom-weight models of the real architectures: mechanics only (their pictures "
              "are noise, their decisions mean nothing)")
        print(f"{'backbone':14} {'request':15} {'outcome':7} {'k*':>3} {'steps':>7} "
              f"{'seconds':>8} {'speedup':>8}  " + (f"{'PSNR dB':>7} {'checker':>8} {'full':>6}  "
                                                    if world else "") + f"{'gate':34} prompt")
    k = "" if r["reuse_step"] is None else r["reuse_step"]
    judged = (f"{r['psnr_vs_full']:7.1f} {r['checker']:>8} {r['checker_full']:>6}  " if world else "")
    print(f"{r['backbone']:14} {r['request']:15} {r['outcome'].upper():7} {k:>3} "
          f"{r['steps_computed']:>3}/{r['steps_total']:<3} {r['seconds']:8.2f} "
          f"{r['speedup_vs_first']:7.2f}x  {judged}{r['gate']:34} {r['prompt']}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
