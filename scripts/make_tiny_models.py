#!/usr/bin/env python3
"""Write Carnator's tiny random-weight video diffusion checkpoints to models/tiny/.

Real architectures, built from ComfyUI's own model classes with tiny sizes, with
deterministic random weights (fixed seed, per-tensor generators; same bytes on every run),
stored as bf16 safetensors. ComfyUI's own loader ``comfy.sd.load_diffusion_model(path)``
(and so the UNETLoader node, from models/diffusion_models/) detects each one exactly as it
would a real release file:

===============  =======================================  ============  ============  =========  ========  ================
backbone         file (models/tiny/)                      model_config  model_base    params     bytes     test latent BCTHW
===============  =======================================  ============  ============  =========  ========  ================
wan21            carnator_tiny_wan21.safetensors          WAN21_T2V     WAN21         1,105,344  2.22 MB   1x16x3x16x16
hunyuan_video    carnator_tiny_hunyuan_video.safetensors  HunyuanVideo  HunyuanVideo  3,523,904  7.06 MB   1x16x3x16x16
ltxv             carnator_tiny_ltxv.safetensors           LTXV          LTXV          1,252,864  2.51 MB   1x128x3x8x8
wan22_5b         carnator_tiny_wan22_5b.safetensors       WAN22_T2V     WAN22         1,138,240  2.28 MB   1x48x3x16x16
wan22_a14b_high  carnator_tiny_wan22_a14b_high...         WAN21_T2V     WAN21         1,105,344  2.22 MB   1x16x3x16x16
wan22_a14b_low   carnator_tiny_wan22_a14b_low...          WAN21_T2V     WAN21         1,105,344  2.22 MB   1x16x3x16x16
hunyuan_video15  carnator_tiny_hunyuan_video15...         HunyuanVideo15 HunyuanVideo15 3,614,240 7.24 MB  1x32x3x8x8
===============  =======================================  ============  ============  =========  ========  ================

Wan 2.2 A14B is two Wan-2.1-layout experts (high noise, low noise): ComfyUI detects each real
A14B file as WAN21_T2V too; Carnator pairs them (comfy_adapter.ExpertPair). HunyuanVideo
1.5's file is 7.2 MB on disk but 3.4 MB deflated (git stores it so): its ``vision_in``
image-token path, 1.5 M weights the detector requires and text-to-video never feeds, is
stored as zeros. Its text reaches the video only through joint attention (no ``vector_in``,
no ``guidance_in``, as in the release): with one random block the prompt barely showed
(relative difference 0.03), so its text values are scaled by TEXT_VALUE_SCALE (0.16, as the
Wan files' ~0.2).

8 euler steps, simple scheduler, cfg 2.0 (cond + uncond batched: 8 model calls of batch 2),
on the 2-core CPU box with torch 2.14.1, fp32 compute (ComfyUI never computes in bf16 on
the CPU), box nearly idle: wan21 0.06-0.27 s, hunyuan_video 0.14-0.18 s, ltxv 0.14-0.28 s;
load ~0.01 s each; importing ComfyUI ~3 s. With other jobs saturating the two cores the
same runs took 1-14 s (torch's 2 threads fight for the cores), so time on a quiet box.

* wan21: WanModel t2v, dim 128 with ONE head of 128 (ComfyUI's detector derives
  num_heads = dim // 128 from the file, so a dim-128 Wan is always built with one head;
  a file made with 2 heads would load without error and silently run with 1), ffn 256,
  2 blocks, text_dim 4096, freq_dim 256, patch (1,2,2). Latent 1x16xTxHxW, T any,
  H and W even; 1x16x3x16x16 = 192 image tokens.
* hunyuan_video: HunyuanVideo T2V, hidden 128 = one head of 128 (detector: num_heads =
  hidden // 128; the RoPE axes [16, 56, 56] it sets must sum to the head dim, so 128 is the
  smallest possible hidden size), 2 double + 2 single blocks, token refiner (always 2
  blocks), context_in_dim 4096, vec_in_dim 768 (``vector_in`` present: without it the file
  is detected as HunyuanImage21), ``guidance_in`` present (embedded guidance, as in real
  HunyuanVideo 1.0), patch (1,2,2). Latent as Wan. Over the 3 MB target: the text path
  alone (txt_in input_embedder + c_embedder 4096->128 + refiner) is 1.5 M parameters
  (3.2 MB in bf16) at the minimum hidden size; each double block adds 1.2 MB, each single
  0.5 MB.
* ltxv: LTXVModel, 32 heads x 4 = inner 128 (the detector hard-codes 32 heads:
  attention_head_dim = attn2.to_k.out_features // 32, unless the file's metadata carries a
  "config" JSON, which we avoid), cross_attention_dim 128, 2 blocks, caption_channels
  4096, 128 latent channels in and out. Its patchifier has patch size 1, so any T, H, W
  works; 1x128x3x8x8 = 192 tokens, like the others.

Weights: every tensor is drawn from its own ``torch.Generator`` seeded from
sha256(f"{SEED}:{model}:{tensor name}"), so the result does not depend on module
construction order. Linear/conv weights ~ N(0, 1/fan_in); biases ~ N(0, 0.02^2); 1-D norm
scales = 1; Wan/LTXV modulation tables ~ N(0, 1/dim) (as the real models are initialised).
Nothing is zero-initialised: the original training code zero-inits output heads and
adaLN gates (which would make the output independent of the input and the prompt), and
ComfyUI itself initialises nothing (comfy.ops.disable_weight_init; some tables are
``torch.empty``), so every tensor is set here explicitly.

Usage::

    .venv/bin/python scripts/make_tiny_models.py [--comfyui DIR] [--out models/tiny]
                                                 [--no-verify] [--steps 8]

``--comfyui`` defaults to the first line of .host/path, then .host/ComfyUI. After writing,
the script (unless --no-verify) loads each file through comfy.sd.load_diffusion_model,
checks the detected classes and that every tensor was used, runs ``--steps`` euler steps
with the demo text encoder (carnator_core.demo_text) and prints size, parameter count,
latent shape and timing. A file whose bytes would not change is left untouched.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save

REPO_ROOT = Path(__file__).resolve().parent.parent
SEED = 20251129
STORE_DTYPE = torch.bfloat16
TEXT_VALUE_SCALE = 8.0  # HunyuanVideo 1.5's text values (see its spec)

# name -> how to build it, what ComfyUI must detect, what to test it on
SPECS = {
    "wan21": {
        "file": "carnator_tiny_wan21.safetensors",
        "module": "comfy.ldm.wan.model",
        "cls": "WanModel",
        "kwargs": dict(model_type="t2v", patch_size=(1, 2, 2), in_dim=16, dim=128, ffn_dim=256,
                       freq_dim=256, text_dim=4096, out_dim=16, num_heads=1, num_layers=2,
                       window_size=(-1, -1), qk_norm=True, cross_attn_norm=True, eps=1e-6),
        "model_config": "WAN21_T2V",
        "model_base": "WAN21",
        "latent": (1, 16, 3, 16, 16),
    },
    "hunyuan_video": {
        "file": "carnator_tiny_hunyuan_video.safetensors",
        "module": "comfy.ldm.hunyuan_video.model",
        "cls": "HunyuanVideo",
        "kwargs": dict(image_model="hunyuan_video", in_channels=16, out_channels=16,
                       vec_in_dim=768, context_in_dim=4096, hidden_size=128, mlp_ratio=4.0,
                       num_heads=1, depth=2, depth_single_blocks=2, axes_dim=[16, 56, 56],
                       theta=256, patch_size=[1, 2, 2], qkv_bias=True, guidance_embed=True,
                       byt5=False, meanflow=False, use_cond_type_embedding=False,
                       vision_in_dim=None),
        "model_config": "HunyuanVideo",
        "model_base": "HunyuanVideo",
        "latent": (1, 16, 3, 16, 16),
    },
    # Wan 2.2 TI2V 5B: the Wan 2.1 layout with 48 latent channels in and out (its VAE
    # compresses 16x in space, so a 48-channel latent of a given video is 4x smaller)
    "wan22_5b": {
        "file": "carnator_tiny_wan22_5b.safetensors",
        "module": "comfy.ldm.wan.model",
        "cls": "WanModel",
        "kwargs": dict(model_type="t2v", patch_size=(1, 2, 2), in_dim=48, dim=128, ffn_dim=256,
                       freq_dim=256, text_dim=4096, out_dim=48, num_heads=1, num_layers=2,
                       window_size=(-1, -1), qk_norm=True, cross_attn_norm=True, eps=1e-6),
        "model_config": "WAN22_T2V",
        "model_base": "WAN22",
        "latent": (1, 48, 3, 16, 16),
    },
    # Wan 2.2 A14B: two experts of the Wan 2.1 layout (ComfyUI detects each as WAN21_T2V, as
    # it does the real files); same shapes, their own weights (the seed names the expert)
    "wan22_a14b_high": {
        "file": "carnator_tiny_wan22_a14b_high.safetensors",
        "module": "comfy.ldm.wan.model",
        "cls": "WanModel",
        "kwargs": dict(model_type="t2v", patch_size=(1, 2, 2), in_dim=16, dim=128, ffn_dim=256,
                       freq_dim=256, text_dim=4096, out_dim=16, num_heads=1, num_layers=2,
                       window_size=(-1, -1), qk_norm=True, cross_attn_norm=True, eps=1e-6),
        "model_config": "WAN21_T2V",
        "model_base": "WAN21",
        "latent": (1, 16, 3, 16, 16),
    },
    "wan22_a14b_low": {
        "file": "carnator_tiny_wan22_a14b_low.safetensors",
        "module": "comfy.ldm.wan.model",
        "cls": "WanModel",
        "kwargs": dict(model_type="t2v", patch_size=(1, 2, 2), in_dim=16, dim=128, ffn_dim=256,
                       freq_dim=256, text_dim=4096, out_dim=16, num_heads=1, num_layers=2,
                       window_size=(-1, -1), qk_norm=True, cross_attn_norm=True, eps=1e-6),
        "model_config": "WAN21_T2V",
        "model_base": "WAN21",
        "latent": (1, 16, 3, 16, 16),
    },
    # HunyuanVideo 1.5: patch (1,1,1) over a 32-channel latent (16x VAE), 65 input channels
    # (latent + image-condition latent + mask), Qwen2.5-VL text width 3584, only double
    # blocks (the release has no single blocks; one here), cond-type embedding, vision_in for image
    # tokens (what ComfyUI's detector keys HunyuanVideo15 on), no guidance embedding
    "hunyuan_video15": {
        "file": "carnator_tiny_hunyuan_video15.safetensors",
        "module": "comfy.ldm.hunyuan_video.model",
        "cls": "HunyuanVideo",
        "kwargs": dict(image_model="hunyuan_video", in_channels=65, out_channels=32,
                       vec_in_dim=None, context_in_dim=3584, hidden_size=128, mlp_ratio=4.0,
                       num_heads=1, depth=1, depth_single_blocks=0, axes_dim=[16, 56, 56],
                       theta=256, patch_size=[1, 1, 1], qkv_bias=True, guidance_embed=False,
                       byt5=False, meanflow=False, use_cond_type_embedding=True,
                       vision_in_dim=1152),
        "model_config": "HunyuanVideo15",
        "model_base": "HunyuanVideo15",
        "latent": (1, 32, 3, 8, 8),
        # the image-token path (1.5 M weights, never fed in text-to-video) is stored as
        # zeros so the committed blob deflates to almost nothing; its tokens still join
        # the joint attention when a clip_vision_output is given
        "zero": ("vision_in.proj.1.weight", "vision_in.proj.3.weight"),
        # one random block lets the prompt barely show (text enters only through joint
        # attention, q and k RMS-normed): larger text values make prompts tell apart, as
        # the release's 54 trained blocks do
        "scale": {"double_blocks.0.txt_attn.qkv.weight": TEXT_VALUE_SCALE},
    },
    "ltxv": {
        "file": "carnator_tiny_ltxv.safetensors",
        "module": "comfy.ldm.lightricks.model",
        "cls": "LTXVModel",
        "kwargs": dict(in_channels=128, cross_attention_dim=128, attention_head_dim=4,
                       num_attention_heads=32, caption_channels=4096, num_layers=2),
        "model_config": "LTXV",
        "model_base": "LTXV",
        "latent": (1, 128, 3, 8, 8),
    },
}


def default_comfyui() -> Path:
    marker = REPO_ROOT / ".host" / "path"
    if marker.is_file():
        lines = marker.read_text().strip().splitlines()
        if lines and lines[0].strip():
            return Path(lines[0].strip())
    return REPO_ROOT / ".host" / "ComfyUI"


def import_comfy(comfyui: Path) -> None:
    """Host first on sys.path, CPU selected before comfy.model_management is imported."""
    root = str(Path(comfyui).resolve())
    if not (Path(root) / "comfy" / "model_management.py").is_file():
        raise SystemExit(f"no ComfyUI at {root} (pass --comfyui DIR)")
    if root not in sys.path:
        sys.path.insert(0, root)
    from comfy.cli_args import args
    args.cpu = True
    import comfy.model_management  # noqa: F401


def _gen(model: str, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{SEED}:{model}:{name}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def init_tensor(model: str, name: str, t: torch.Tensor) -> torch.Tensor:
    """Deterministic, non-degenerate value for one state-dict entry (float32)."""
    g = _gen(model, name)
    shape = tuple(t.shape)
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "modulation" or leaf == "scale_shift_table":
        return torch.randn(shape, generator=g) / math.sqrt(shape[-1])
    if leaf == "bias":
        return torch.randn(shape, generator=g) * 0.02
    if t.ndim == 1:
        if "norm" in name:
            return torch.ones(shape)
        return torch.randn(shape, generator=g) * 0.02
    fan_in = math.prod(shape[1:])
    return torch.randn(shape, generator=g) / math.sqrt(fan_in)


def build_state_dict(name: str) -> dict[str, torch.Tensor]:
    import importlib
    import comfy.ops
    spec = SPECS[name]
    cls = getattr(importlib.import_module(spec["module"]), spec["cls"])
    torch.manual_seed(SEED)  # nothing should depend on it; belt and braces
    with torch.device("meta"):
        model = cls(**spec["kwargs"], dtype=torch.float32, device="meta",
                    operations=comfy.ops.disable_weight_init)
    sd = {}
    for k, t in sorted(model.state_dict().items()):
        value = torch.zeros(t.shape) if k in spec.get("zero", ()) else init_tensor(name, k, t)
        value = value * spec.get("scale", {}).get(k, 1.0)
        sd[k] = value.to(STORE_DTYPE).contiguous()
    return sd


def metadata_for(name: str) -> dict[str, str]:
    spec = SPECS[name]
    desc = {"carnator_tiny_model": name, "class": f"{spec['module']}.{spec['cls']}",
            "kwargs": spec["kwargs"], "seed": SEED, "test_latent": list(spec["latent"]),
            "note": "random weights, for tests only; produced by scripts/make_tiny_models.py"}
    # NB: no "config" key: ComfyUI's LTXV detector would merge metadata["config"]["transformer"].
    # ONE key only: safetensors writes the metadata map in hash order, so two keys would
    # come out in either order and the file bytes would differ between runs.
    return {"carnator": json.dumps(desc, sort_keys=True)}


def write_if_changed(path: Path, data: bytes) -> bool:
    if path.is_file() and path.read_bytes() == data:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=str(path.parent), prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it 0600
    os.replace(tmp, path)
    return True


def verify(name: str, path: Path, steps: int) -> dict:
    """Load through ComfyUI's loader, check detection and key use, time `steps` euler steps."""
    import comfy.sd
    import comfy.sample
    sys.path.insert(0, str(REPO_ROOT))
    from carnator_core.demo_text import conditioning_for

    spec = SPECS[name]
    t0 = time.perf_counter()
    patcher = comfy.sd.load_diffusion_model(str(path))
    load_s = time.perf_counter() - t0
    mc = type(patcher.model.model_config).__name__
    mb = type(patcher.model).__name__
    if mc != spec["model_config"] or mb != spec["model_base"]:
        raise SystemExit(f"{name}: detected {mc}/{mb}, expected {spec['model_config']}/{spec['model_base']}")
    saved = load_file(str(path))
    loaded = patcher.model.diffusion_model.state_dict()
    if set(saved) != set(loaded):
        raise SystemExit(f"{name}: key mismatch: missing {sorted(set(saved) - set(loaded))[:5]}, "
                         f"unexpected {sorted(set(loaded) - set(saved))[:5]}")
    for k, v in saved.items():
        if tuple(v.shape) != tuple(loaded[k].shape) or not torch.equal(v.float(), loaded[k].float()):
            raise SystemExit(f"{name}: tensor {k} not loaded as saved")

    latent = torch.zeros(spec["latent"])
    noise = torch.randn(spec["latent"], generator=torch.Generator().manual_seed(0))
    neg = conditioning_for("", name)
    outs, times = [], []
    for prompt in ("a red fox running through snow", "a blue whale in the deep ocean"):
        t0 = time.perf_counter()
        out = comfy.sample.sample(patcher, noise, steps, 2.0, "euler", "simple",
                                  conditioning_for(prompt, name), neg, latent,
                                  disable_pbar=True, seed=0)
        times.append(time.perf_counter() - t0)
        outs.append(out)
    if not all(torch.isfinite(o).all() for o in outs):
        raise SystemExit(f"{name}: non-finite output")
    rel = ((outs[0] - outs[1]).norm() / outs[0].norm()).item()
    if rel < 1e-3:
        raise SystemExit(f"{name}: output does not depend on the prompt (rel diff {rel:.2e})")
    return {"model_config": mc, "model_base": mb, "load_s": load_s,
            "sample_s": min(times), "out_std": outs[0].std().item(), "prompt_rel_diff": rel}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--comfyui", type=Path, default=None, help="ComfyUI folder (default: .host/path)")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "models" / "tiny")
    ap.add_argument("--only", choices=sorted(SPECS), action="append", help="build only these")
    ap.add_argument("--no-verify", action="store_true", help="skip loading/sampling check")
    ap.add_argument("--steps", type=int, default=8, help="euler steps timed in the check")
    a = ap.parse_args(argv)

    import_comfy(a.comfyui or default_comfyui())
    for name in a.only or list(SPECS):
        spec = SPECS[name]
        sd = build_state_dict(name)
        data = save(sd, metadata=metadata_for(name))
        path = a.out / spec["file"]
        changed = write_if_changed(path, data)
        n_params = sum(t.numel() for t in sd.values())
        line = (f"{name:14s} {path.name:40s} {'written' if changed else 'unchanged':9s} "
                f"{len(data) / 1e6:6.2f} MB  params {n_params:,}  sha256 {hashlib.sha256(data).hexdigest()[:12]}  "
                f"latent {'x'.join(map(str, spec['latent']))}")
        print(line, flush=True)
        if not a.no_verify:
            r = verify(name, path, a.steps)
            print(f"{'':14s} detected {r['model_config']}/{r['model_base']}; load {r['load_s']:.2f} s; "
                  f"{a.steps} euler steps cfg 2.0: {r['sample_s']:.2f} s; out std {r['out_std']:.3f}; "
                  f"prompt rel diff {r['prompt_rel_diff']:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
