#!/usr/bin/env python
"""Train (and evaluate) the tiny-world Wan 2.1-layout text-to-video DiT.

    python scripts/train_tinyworld.py --minutes 90            # train (resumes with --resume)
    python scripts/train_tinyworld.py --export                # write the ComfyUI checkpoint
    python scripts/train_tinyworld.py --eval 64               # checker accuracy via ComfyUI
    python scripts/train_tinyworld.py --diag                  # layout-word separation, no sampling

Language: ``--language broad`` draws ``--broad-share`` of the bank's captions from
tinyworld.language's training families of revision 1, ``broad2`` from every training family
(revision 2) (the rest stay world.caption()'s); the held-out
families are for bench/studies/phrasing.py only. The default, ``caption``, is the caption-trained model's.

Curriculum / recipe options: ``--objects 1`` trains on the 1-object scenes of the bank only
(and makes --eval use 1-object prompts); ``--p-high``/``--high-lo`` add samples at nearly pure
noise, where position and motion can only come from the caption; ``--obj-weight`` up-weights the
loss on latent cells an object covers; ``--rewarm`` re-warms the lr after a resume.

The model is ComfyUI's own ``comfy.ldm.wan.model.WanModel(model_type="t2v")``, trained with
rectified-flow matching exactly as ComfyUI's WAN21 samples it (ModelType.FLOW, CONST:
x_t = (1 - s) x0 + s noise, output = noise - x0, timestep = 1000 s; WAN21's sampling shift
8.0). Caption dropout (to the empty caption's encoding) makes classifier-free guidance work.
Timesteps: a mixture of the shift-8 schedule the sampler uses (u ~ U(0,1), s = 8u/(1+7u))
and uniform s, so both the early layout steps and the late detail steps are trained.

Sizes: ``--sizes 2x16,4x32,8x48`` (frames x pixels, or ``all`` for world.SIZES) trains on a
mix of sizes, one size per batch, in turn (``--size-order cycle``) or drawn at random
(``random``), both fixed by the step number so a resume continues the same sequence; a size may
carry its own batch (``8x48:16``). The default is the world's 4-frame 32-px clip only. The
Wan model is size-agnostic (patch tokens with RoPE; the coordinate frames are normalised to
the clip), so ``--init-from`` the bundled model and fine-tune. ``--eval-size 8x48`` evaluates
at a size. scripts/train_tinyworld_multisize.sh is the multi-size model's recipe.

Conditioning is tinyworld.text (all-MiniLM-L6-v2 states -> 4096) plus the fixed coordinate
frames passed as ``concat_latent_image`` into 16 extra input channels (in_dim = 32; see
tinyworld/latent.py for why).

Checkpoints (resumable, nothing pickled): <ckpt-dir>/ckpt.safetensors (weights + EMA),
<ckpt-dir>/ckpt_optim.safetensors (AdamW moments, not for committing), <ckpt-dir>/ckpt.json.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
HOST = os.environ.get("CARNATOR_COMFY", os.path.join(ROOT, ".host", "ComfyUI"))
if HOST not in sys.path:
    sys.path.insert(1, HOST)

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tinyworld import language as LANG
from tinyworld import latent as LAT
from tinyworld import text as TXT
from tinyworld import world as WD

DEFAULT_DIR = os.path.join(ROOT, "models", "tinyworld")
EXPORT_NAME = "carnator_tinyworld_wan21.safetensors"
SHIFT = 8.0  # WAN21_T2V.sampling_settings["shift"] in ComfyUI


def force_cpu():
    from comfy.cli_args import args
    args.cpu = True


def model_config(dim=128, layers=4, ffn=512, in_dim=32):
    return dict(model_type="t2v", patch_size=(1, 2, 2), text_len=512, in_dim=in_dim, dim=dim, ffn_dim=ffn,
                freq_dim=256, text_dim=TXT.TEXT_DIM, out_dim=16, num_heads=dim // 128, num_layers=layers,
                window_size=(-1, -1), qk_norm=True, cross_attn_norm=True, eps=1e-6)


def build_model(cfg):
    force_cpu()
    import comfy.ops
    from comfy.ldm.wan.model import WanModel
    m = WanModel(**cfg, device="cpu", dtype=torch.float32, operations=comfy.ops.disable_weight_init)
    init_weights(m)
    return m


@torch.no_grad()
def init_weights(m):
    """Wan 2.1's init (ComfyUI's ops leave parameters uninitialised)."""
    g = torch.Generator().manual_seed(0)
    for name, p in m.named_parameters():
        if name.endswith("modulation"):
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        elif name.startswith("head.head."):
            p.zero_()
        elif name.endswith("bias"):
            p.zero_()
        elif ".norm" in name or name.startswith("norm"):
            p.fill_(1.0)
        elif name.startswith(("text_embedding", "time_embedding")) and name.endswith("weight"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        elif name.endswith("weight") and p.ndim >= 2:
            fan_out = p.shape[0]
            fan_in = p[0].numel()
            a = math.sqrt(6.0 / (fan_in + fan_out))
            p.copy_((torch.rand(p.shape, generator=g) * 2 - 1) * a)
        else:
            raise RuntimeError(f"no init rule for {name}")


# --------------------------------------------------------------------------- data
def bank_captions(n, seed, language="caption", broad_share=0.5):
    """The bank's scenes and training captions. ``caption``: world.caption()'s paraphrases
    (the caption-trained model's bank, unchanged); ``broad``: a share ``broad_share`` of
    tinyworld.language's training-family phrasings, the rest caption()'s (the
    held-out families never enter)."""
    rng = random.Random(seed)
    scenes, captions = [], []
    for _ in range(n):
        s = WD.random_scene(rng)
        scenes.append(s)
        if language == "caption":
            captions.append(WD.caption(s, rng))
        else:
            captions.append(LANG.training_caption(s, rng, broad_share, language_families(language)))
    return scenes, captions


def language_families(language):
    """The training families a broad language draws from: ``broad`` is revision 1 (the steps
    trained on it stay reproducible), ``broad2`` every training family."""
    families = {"broad": LANG.TRAIN_FAMILIES_REVISION_1, "broad2": LANG.TRAIN_FAMILIES}
    if language not in families:
        raise ValueError(f"--language {language!r}: use 'caption', 'broad' or 'broad2'")
    return families[language]


def bank_path(cache_dir, n, seed, language, captions):
    """Cached states of a bank. A broad bank's name carries a digest of its captions, so an
    edit of the language never reuses stale states."""
    if language == "caption":
        return os.path.join(cache_dir, f"bank_{n}_{seed}_v3.safetensors")
    digest = hashlib.sha1("\n".join(captions).encode()).hexdigest()[:12]
    return os.path.join(cache_dir, f"bank_{n}_{seed}_{language}_{digest}_v3.safetensors")


class Bank:
    """Scenes with paraphrased captions and their MiniLM states (cached under /tmp)."""

    def __init__(self, n, seed, cache_dir="/tmp/carnator_tinyworld", language="caption", broad_share=0.5,
                 second_phrasing=False):
        os.makedirs(cache_dir, exist_ok=True)
        self.scenes, self.captions = bank_captions(n, seed, language, broad_share)
        self.states = self._states(cache_dir, n, seed, language, self.captions)
        self.second_states = None
        if second_phrasing:  # another phrasing of every scene, for the consistency loss
            self.second_captions = second_captions(self.scenes, seed, language, broad_share)
            self.second_states = self._states(cache_dir, n, seed, language, self.second_captions)
        self.empty = TXT.encode_states([""])[0]

    @staticmethod
    def _states(cache_dir, n, seed, language, captions):
        path = bank_path(cache_dir, n, seed, language, captions)
        if os.path.exists(path):
            return TXT.fill_padding(load_file(path)["states"])
        t0 = time.time()
        states = torch.zeros(n, TXT.TEXT_LEN, TXT.STATE_DIM, dtype=torch.float16)
        for s in range(0, n, 256):
            states[s:s + 256] = TXT.encode_states(captions[s:s + 256]).half()
            TXT._state_cache.clear()
            print(f"bank {min(s + 256, n)}/{n} {time.time() - t0:.0f}s", flush=True)
        save_file({"states": states}, path)
        return TXT.fill_padding(states)


def second_captions(scenes, seed, language, broad_share):
    """A second phrasing of each bank scene, drawn like the first (its own random stream), so
    the consistency loss sees pairs as different as the bank's own phrasings are."""
    rng = random.Random(f"second-phrasing-{seed}")
    if language == "caption":
        return [WD.caption(s, rng) for s in scenes]
    return [LANG.training_caption(s, rng, broad_share, language_families(language)) for s in scenes]


def make_batch(bank, idx, rng_np, drop_p, with_masks=False, frames=WD.T, size=WD.H):
    vids, masks = [], []
    for i in idx:
        v, m = WD.render(bank.scenes[i], int(rng_np.randint(0, 2**31 - 1)), frames=frames, size=size)
        vids.append(v)
        masks.append(m.any(0))
    x0 = LAT.encode(torch.stack(vids))
    st = bank.states[idx].float()
    drop = torch.from_numpy(rng_np.rand(len(idx)) < drop_p)
    st[drop] = bank.empty
    if with_masks:
        return x0, st, torch.stack(masks)  # (B, T, H, W) union of the objects' pixels
    return x0, st


def object_weight(masks, weight, dilate=1):
    """(B, T, H, W) pixel masks -> (B, 1, T, H/2, W/2) loss weights 1 + weight on latent cells
    covered by an object (dilated by ``dilate`` cells), so the few object cells -- where position,
    motion and shape live -- are not drowned by the background."""
    m = masks.float().unsqueeze(1)  # B,1,T,H,W
    m = torch.nn.functional.max_pool3d(m, (1, 2, 2))
    if dilate:
        k = 2 * dilate + 1
        m = torch.nn.functional.max_pool3d(m, (1, k, k), stride=1, padding=(0, dilate, dilate))
    return 1.0 + weight * m


def motion_edge_weight(masks, weight):
    """(B, T, H, W) masks -> (B, 1, T, H/2, W/2) extra weight on the cells an object enters or
    leaves between neighbouring frames: the few pixels that tell the motion direction (the
    object overlaps itself across frames, so a plain loss hardly notices a wrong direction)."""
    m = masks.bool()
    edge = torch.zeros_like(m)
    edge[:, 1:] |= m[:, 1:] ^ m[:, :-1]
    edge[:, :-1] |= m[:, :-1] ^ m[:, 1:]
    return weight * torch.nn.functional.max_pool3d(edge.float().unsqueeze(1), (1, 2, 2))


def parse_size_mix(text, batch):
    """``--sizes`` -> [(frames, pixels, batch)]: '2x16,4x32:24' (an optional per-size batch
    after a colon; --batch otherwise), or 'all' for every size of world.SIZES."""
    if text.strip() == "all":
        return [(f, p, batch) for f, p in WD.SIZES]
    out = []
    for part in text.split(","):
        size, _, b = part.partition(":")
        (f, p), = WD.parse_sizes(size)
        out.append((f, p, int(b) if b.strip() else batch))
    return out


def size_of_step(sizes, step, order, seed):
    """The size of a step's batch: in turn, or drawn at random from the step number (so a
    resume continues the same sequence)."""
    if order == "cycle":
        return sizes[step % len(sizes)]
    return sizes[random.Random(f"size-{seed}-{step}").randrange(len(sizes))]


def sample_sigmas(n, rng_np, p_shift=0.7, p_high=0.0, high_lo=0.9):
    """Mixture of the sampler's shift-8 schedule (p_shift), uniform s, and -- with p_high > 0 --
    extra samples at s ~ U(high_lo, 1): the nearly pure-noise steps where the noisy input says
    nothing about the layout, so position and motion can only come from the caption."""
    u = torch.from_numpy(rng_np.rand(n)).float()
    shifted = SHIFT * u / (1 + (SHIFT - 1) * u)
    use = torch.from_numpy(rng_np.rand(n) < p_shift)
    s = torch.where(use, shifted, u)
    if p_high > 0:
        hi = torch.from_numpy(high_lo + (1 - high_lo) * rng_np.rand(n)).float()
        s = torch.where(torch.from_numpy(rng_np.rand(n) < p_high), hi, s)
    return s.clamp(1e-3, 1.0)


# --------------------------------------------------------------------------- checkpoints
def save_ckpt(d, model, ema, opt, state):
    os.makedirs(d, exist_ok=True)
    tensors = {f"model.{k}": v.detach().contiguous() for k, v in model.state_dict().items()}
    tensors.update({f"ema.{k}": v.detach().contiguous() for k, v in ema.items()})
    save_file(tensors, os.path.join(d, "ckpt.safetensors.tmp"))
    os.replace(os.path.join(d, "ckpt.safetensors.tmp"), os.path.join(d, "ckpt.safetensors"))
    names = {id(p): n for n, p in model.named_parameters()}
    ot = {}
    for group in opt.param_groups:
        for p in group["params"]:
            stt = opt.state.get(p, {})
            for k in ("exp_avg", "exp_avg_sq"):
                if k in stt:
                    ot[f"{names[id(p)]}.{k}"] = stt[k].contiguous()
            if "step" in stt:
                state["adam_step"] = float(stt["step"])
    save_file(ot, os.path.join(d, "ckpt_optim.safetensors.tmp"))
    os.replace(os.path.join(d, "ckpt_optim.safetensors.tmp"), os.path.join(d, "ckpt_optim.safetensors"))
    with open(os.path.join(d, "ckpt.json.tmp"), "w") as f:
        json.dump(state, f, indent=1)
    os.replace(os.path.join(d, "ckpt.json.tmp"), os.path.join(d, "ckpt.json"))


def load_ckpt(d, model, opt):
    t = load_file(os.path.join(d, "ckpt.safetensors"))
    model.load_state_dict({k[6:]: v for k, v in t.items() if k.startswith("model.")})
    ema = {k[4:]: v.clone() for k, v in t.items() if k.startswith("ema.")}
    with open(os.path.join(d, "ckpt.json")) as f:
        state = json.load(f)
    op = os.path.join(d, "ckpt_optim.safetensors")
    if os.path.exists(op) and opt is not None:
        ot = load_file(op)
        for n, p in model.named_parameters():
            if f"{n}.exp_avg" in ot:
                opt.state[p] = {"step": torch.tensor(state.get("adam_step", state["step"])),
                                "exp_avg": ot[f"{n}.exp_avg"], "exp_avg_sq": ot[f"{n}.exp_avg_sq"]}
    return ema, state


def export(d, out_path=None, use_ema=True):
    t = load_file(os.path.join(d, "ckpt.safetensors"))
    pre = "ema." if use_ema else "model."
    sd = {k[len(pre):]: v.to(torch.float16).contiguous() for k, v in t.items() if k.startswith(pre)}
    out_path = out_path or os.path.join(d, EXPORT_NAME)
    with open(os.path.join(d, "ckpt.json")) as f:
        st = json.load(f)
    meta = {"carnator_tinyworld": json.dumps({"config": st["config"], "step": st["step"],
                                               "samples": st["samples"], "text_len": TXT.TEXT_LEN,
                                               "latent": "tinyworld.latent v1", "shift": SHIFT})}
    save_file(sd, out_path + ".tmp", metadata=meta)
    os.replace(out_path + ".tmp", out_path)
    return out_path


@torch.no_grad()
def init_from(model, d):
    """Warm start from another checkpoint's weights — a training dir, or an exported model
    file such as the committed one (its EMA weights); extra input channels keep their init."""
    if os.path.isfile(d):
        src = {k: v.float() for k, v in load_file(d).items()}
    else:
        t = load_file(os.path.join(d, "ckpt.safetensors"))
        src = {k[6:]: v for k, v in t.items() if k.startswith("model.")}
    own = model.state_dict()
    for k, v in src.items():
        if k not in own:
            continue
        if own[k].shape == v.shape:
            own[k].copy_(v)
        elif k == "patch_embedding.weight":
            own[k][:, :v.shape[1]].copy_(v)
    print(f"warm start from {d}", flush=True)


# --------------------------------------------------------------------------- training
def train(a):
    torch.set_num_threads(a.threads)
    cfg = model_config(a.dim, a.layers, a.ffn, a.in_dim)
    model = build_model(cfg)
    nparam = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.99), weight_decay=0.01)
    state = {"step": 0, "samples": 0, "config": {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()},
             "seconds": 0.0, "recipe": vars(a).copy()}
    ema = None
    if a.init_from and not (a.resume and os.path.exists(os.path.join(a.dir, "ckpt.json"))):
        init_from(model, a.init_from)
    if a.resume and os.path.exists(os.path.join(a.dir, "ckpt.json")):
        ema, st = load_ckpt(a.dir, model, opt)
        state.update({k: st[k] for k in ("step", "samples", "seconds") if k in st})
        state["recipe"] = vars(a).copy()
        print(f"resumed at step {state['step']}", flush=True)
    if ema is None:
        ema = {k: v.detach().clone() for k, v in model.state_dict().items()}
    bank = Bank(a.bank, a.seed, language=a.language, broad_share=a.broad_share,
                second_phrasing=a.consistency > 0)
    pool = np.arange(len(bank.captions))
    if a.objects:  # curriculum: train on n-object scenes only (a filter of the same cached bank)
        pool = np.array([i for i, sc in enumerate(bank.scenes) if len(sc["objects"]) == a.objects])
    sizes = parse_size_mix(a.sizes, a.batch)
    print(f"params {nparam/1e6:.2f}M bank {len(bank.captions)} pool {len(pool)} sizes "
          + ",".join(f"{f}x{p}:{b}" for f, p, b in sizes) + f" ({a.size_order})", flush=True)
    step0 = state["step"]
    rng_np = np.random.RandomState(a.seed * 7919 + state["step"])
    coords_of = {}
    per_size = {}  # (frames, pixels) -> [losses, seconds] since the last log line
    proj = TXT.projection()
    t_start = time.time()
    t_last_ckpt = time.time()
    t_log = time.time()
    losses, consistency_gaps = [], []
    deadline = t_start + a.minutes * 60
    model.train()
    while time.time() < deadline and (a.steps <= 0 or state["step"] < a.steps):
        step = state["step"]
        t_step = time.time()
        frames, pixels, batch = size_of_step(sizes, step, a.size_order, a.seed)
        lr = a.lr * min(1.0, (step + 1) / a.warmup)
        if a.rewarm > 0:  # warm up again from the resume point (new lr / new optimizer moments)
            lr = min(lr, a.lr * (step - step0 + 1) / a.rewarm)
        for gp in opt.param_groups:
            gp["lr"] = lr
        if a.consistency > 0:
            # half the batch's scenes, each told twice (bank phrasing, second phrasing) with
            # the same clip, noise and sigma: the two predictions should be one prediction.
            half = batch // 2
            idx = pool[rng_np.randint(0, len(pool), size=half)]
            x0, st, masks = make_batch(bank, idx, rng_np, a.drop, with_masks=True, frames=frames, size=pixels)
            st2 = bank.second_states[idx].float()
            dropped = (st == bank.empty).flatten(1).all(1)
            st2[dropped] = bank.empty
            x0, masks, st = torch.cat([x0, x0]), torch.cat([masks, masks]), torch.cat([st, st2])
            sig = sample_sigmas(half, rng_np, a.p_shift, a.p_high, a.high_lo).repeat(2)
            noise = torch.from_numpy(rng_np.randn(*x0[:half].shape).astype(np.float32)).repeat(2, 1, 1, 1, 1)
        else:
            idx = pool[rng_np.randint(0, len(pool), size=batch)]
            x0, st, masks = make_batch(bank, idx, rng_np, a.drop, with_masks=True, frames=frames, size=pixels)
            sig = sample_sigmas(batch, rng_np, a.p_shift, a.p_high, a.high_lo)
            noise = torch.from_numpy(rng_np.randn(*x0.shape).astype(np.float32))
        ctx = st @ proj
        key = (frames, pixels, x0.shape[0])
        if key not in coords_of:
            coords_of[key] = LAT.coords(frames, pixels // 2, pixels // 2, batch=x0.shape[0])
        coords = coords_of[key]
        s5 = sig.view(-1, 1, 1, 1, 1)
        xt = (1 - s5) * x0 + s5 * noise
        target = noise - x0
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16):
            out = model(torch.cat([xt, coords], dim=1), sig * 1000.0, ctx)
        err = (out.float() - target).pow(2)
        if a.obj_weight > 0 or a.edge_weight > 0:
            w = object_weight(masks, a.obj_weight)
            if a.edge_weight > 0:
                w = w + motion_edge_weight(masks, a.edge_weight)
            loss = (err * w).mean() / w.mean()
        else:
            w = torch.ones_like(err[:, :1])
            loss = err.mean()
        if a.consistency > 0:
            half = out.shape[0] // 2
            gap = (out[:half].float() - out[half:].float()).pow(2)
            loss = loss + a.consistency * (gap * w[:half]).mean() / w[:half].mean()
            consistency_gaps.append(gap.mean().item())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            dec = min(a.ema, (1 + step) / (10 + step))
            for k, v in model.state_dict().items():
                ema[k].mul_(dec).add_(v.detach(), alpha=1 - dec)
        state["step"] += 1
        state["samples"] += batch
        losses.append(loss.item())
        ps = per_size.setdefault((frames, pixels), [[], 0.0, 0])
        ps[0].append(loss.item())
        ps[1] += time.time() - t_step
        ps[2] += batch
        if time.time() - t_log > a.log_every:
            el = time.time() - t_start
            state["seconds_run"] = el
            print(f"step {state['step']} samples {state['samples']} loss {np.mean(losses):.4f} lr {lr:.2e} "
                  f"{sum(v[2] for v in per_size.values()) / (time.time() - t_log):.1f} samples/s"
                  + (f" phrasing gap {np.mean(consistency_gaps):.4f}" if consistency_gaps else ""), flush=True)
            if len(sizes) > 1:
                print("  by size: " + "  ".join(f"{f}x{p} loss {np.mean(v[0]):.4f} {v[1] / len(v[0]):.2f}s/step"
                                                 for (f, p), v in sorted(per_size.items())), flush=True)
            losses, consistency_gaps, per_size = [], [], {}
            t_log = time.time()
        if time.time() - t_last_ckpt > a.ckpt_every:
            state["seconds"] = state.get("seconds", 0.0) + (time.time() - t_last_ckpt)
            save_ckpt(a.dir, model, ema, opt, state)
            t_last_ckpt = time.time()
            print(f"checkpoint at step {state['step']}", flush=True)
    state["seconds"] = state.get("seconds", 0.0) + (time.time() - t_last_ckpt)
    save_ckpt(a.dir, model, ema, opt, state)
    print(f"done: step {state['step']} samples {state['samples']}", flush=True)


# --------------------------------------------------------------------------- evaluation
def comfy_generate(model_patcher, captions, seeds, steps=20, cfg=4.0, sampler="euler", scheduler="simple",
                   frames=WD.T, size=WD.H):
    """Generate with ComfyUI's own sampler path; returns pixel videos (N, 3, frames, size, size)."""
    import comfy.sample
    frames, size = WD.check_size(frames, size)
    neg = TXT.conditioning("", frames, size // 2, size // 2)
    vids = []
    for cap, seed in zip(captions, seeds):
        latent = torch.zeros(1, 16, frames, size // 2, size // 2)
        noise = comfy.sample.prepare_noise(latent, seed)
        out = comfy.sample.sample(model_patcher, noise, steps, cfg, sampler, scheduler,
                                  TXT.conditioning(cap, frames, size // 2, size // 2), neg,
                                  latent, denoise=1.0, disable_pbar=True, seed=seed)
        vids.append(LAT.decode_comfy(out.float(), clamp=True)[0])
    return torch.stack(vids)


def load_comfy(path):
    force_cpu()
    import comfy.sd
    return comfy.sd.load_diffusion_model(path)


def evaluate(a):
    torch.set_num_threads(a.threads)
    from tinyworld import checker as CH
    path = a.model
    if path is None:
        path = export(a.dir, os.path.join("/tmp", "carnator_tinyworld_eval.safetensors"), use_ema=not a.no_ema)
    mp = load_comfy(path)
    print("loaded", type(mp.model).__name__, type(mp.model.model_config).__name__, flush=True)
    rng = random.Random(a.eval_seed)
    caps, scenes, seeds = [], [], []
    for i in range(a.eval):
        n = 1 if (a.objects == 1 or (a.objects == 0 and i % 2 == 0)) else 2
        s = WD.random_scene(rng, n)
        scenes.append(s)
        caps.append(WD.caption(s, rng))
        seeds.append(rng.randrange(2**31))
    t0 = time.time()
    (frames, pixels), = WD.parse_sizes(a.eval_size)
    vids = comfy_generate(mp, caps, seeds, steps=a.eval_steps, cfg=a.cfg, sampler=a.sampler, frames=frames,
                          size=pixels)
    dt = time.time() - t0
    res = CH.evaluate(vids, scenes)
    print(json.dumps({"n": a.eval, "size": f"{frames}x{pixels}", "cfg": a.cfg, "steps": a.eval_steps, "sampler": a.sampler,
                      "seconds_per_video": dt / a.eval, **res["summary"]}, indent=1))
    by_n = {}
    for s, r in zip(scenes, res["per_video"]):
        by_n.setdefault(len(s["objects"]), []).append(r["all"])
    for k, v in sorted(by_n.items()):
        print(f"{k}-object scenes: all-attributes-correct {np.mean(v):.3f} (n={len(v)})")
    if a.save_png:
        save_grid(vids, a.save_png)
        with open(a.save_png + ".txt", "w") as f:
            f.write("\n".join(caps))
    return res


@torch.no_grad()
def diagnose(a):
    """Cheap progress signal for the layout words (no sampling): how far the model's text
    embedding and cross-attention outputs separate captions that differ only in colour,
    position or motion (at s = 1, pure noise), and the s = 1 loss with true / shuffled / empty
    captions on 1-object scenes. Position and motion are a caption x coordinate interaction;
    while their separations stay near 0 the model cannot follow those words."""
    torch.set_num_threads(a.threads)
    t = load_file(os.path.join(a.dir, "ckpt.safetensors"))
    pre = "model." if a.no_ema else "ema."
    with open(os.path.join(a.dir, "ckpt.json")) as f:
        st = json.load(f)
    m = build_model(st["config"])
    m.load_state_dict({k[len(pre):]: v for k, v in t.items() if k.startswith(pre)})
    m.eval()
    base = {"shape": "square", "colour": "red", "position": "top left", "motion": "right"}
    variants = {"colour": dict(base, colour="blue"), "position": dict(base, position="bottom right"),
                "motion": dict(base, motion="down")}
    caps = [WD.caption({"objects": [base]}, canonical=True)]
    caps += [WD.caption({"objects": [v]}, canonical=True) for v in variants.values()]
    ctx = TXT.encode_batch(caps)
    emb = m.text_embedding(ctx)
    outs = {}
    hooks = [blk.cross_attn.register_forward_hook(lambda mod, i, o, k=k: outs.__setitem__(k, o.detach()))
             for k, blk in enumerate(m.blocks)]
    noise = torch.randn(1, 16, WD.T, WD.H // 2, WD.W // 2, generator=torch.Generator().manual_seed(0))
    n = len(caps)
    m(torch.cat([noise.repeat(n, 1, 1, 1, 1), LAT.coords(WD.T, WD.H // 2, WD.W // 2, batch=n)], 1),
      torch.full((n,), 1000.0), ctx)
    for h in hooks:
        h.remove()
    rep = {"text_embedding": {k: float((emb[0] - emb[j + 1]).norm() / emb[0].norm())
                              for j, k in enumerate(variants)}}
    for b, o in outs.items():
        rep[f"block{b}_cross_attn"] = {k: float((o[0] - o[j + 1]).norm() / o[0].norm()) for j, k in enumerate(variants)}
    bank = Bank(a.bank, a.seed, language=a.language, broad_share=a.broad_share,
                second_phrasing=a.consistency > 0)
    idx = np.array([i for i, sc in enumerate(bank.scenes) if len(sc["objects"]) == 1][:48])
    rng = np.random.RandomState(0)
    x0, stt = make_batch(bank, idx, rng, 0.0)
    proj = TXT.projection()
    conds = {"true": stt @ proj, "shuffled": stt[torch.randperm(len(idx), generator=torch.Generator().manual_seed(1))] @ proj,
             "empty": bank.empty.expand(len(idx), -1, -1) @ proj}
    noise = torch.from_numpy(rng.randn(*x0.shape).astype(np.float32))
    co = LAT.coords(WD.T, WD.H // 2, WD.W // 2, batch=len(idx))
    for sv in (1.0, 0.9):
        xt = (1 - sv) * x0 + sv * noise
        rep[f"loss_s{sv}"] = {k: float((m(torch.cat([xt, co], 1), torch.full((len(idx),), sv * 1000.0), c) -
                                         (noise - x0)).pow(2).mean()) for k, c in conds.items()}
    print(json.dumps({"step": st["step"], "samples": st["samples"], "weights": pre[:-1], "relative_separation": rep},
                     indent=1))
    return rep


def save_grid(vids, path):
    from PIL import Image
    n = vids.shape[0]
    rows = []
    for i in range(n):
        rows.append(torch.cat([vids[i, :, t] for t in range(vids.shape[2])], dim=2))
    g = torch.cat(rows, dim=1)
    arr = (g.permute(1, 2, 0).numpy() * 255).clip(0, 255).astype(np.uint8)
    Image.fromarray(arr).resize((arr.shape[1] * 2, arr.shape[0] * 2), Image.NEAREST).save(path)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=DEFAULT_DIR)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--minutes", type=float, default=60)
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--ema", type=float, default=0.999)
    p.add_argument("--drop", type=float, default=0.12)
    p.add_argument("--p-shift", type=float, default=0.7)
    p.add_argument("--p-high", type=float, default=0.0,
                   help="extra fraction of samples at s ~ U(--high-lo, 1) (layout-deciding noise levels)")
    p.add_argument("--high-lo", type=float, default=0.9)
    p.add_argument("--edge-weight", type=float, default=0.0,
                   help="extra loss weight on the cells an object enters or leaves between frames")
    p.add_argument("--obj-weight", type=float, default=0.0,
                   help="extra loss weight on latent cells covered by an object (0: plain MSE)")
    p.add_argument("--rewarm", type=int, default=0, help="linear lr warm-up over this many steps after resuming")
    p.add_argument("--bank", type=int, default=8192)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--language", choices=("caption", "broad", "broad2"), default="caption",
                   help="training captions: world.caption()'s paraphrases (the caption-trained model), or "
                        "'broad' / 'broad2': tinyworld.language's training families of revision 1 / 2 mixed "
                        "with them")
    p.add_argument("--broad-share", type=float, default=0.5,
                   help="with --language broad, the share of captions from the training families")
    p.add_argument("--consistency", type=float, default=0.0,
                   help="weight of a loss tying the predictions for two phrasings of one scene (same "
                        "clip, noise and sigma) together; half the batch's scenes, each told twice")
    p.add_argument("--sizes", default=f"{WD.T}x{WD.H}",
                   help="training sizes, frames x pixels, one per batch: '2x16,4x32,8x48' (a size may carry "
                        "its own batch: '8x48:16'), or 'all' (world.SIZES); default the world's 4x32")
    p.add_argument("--size-order", choices=("cycle", "random"), default="cycle",
                   help="the sizes in turn, or one drawn at random per step (both fixed by the step number)")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ckpt-every", type=float, default=180)
    p.add_argument("--log-every", type=float, default=30)
    p.add_argument("--in-dim", type=int, default=32)
    p.add_argument("--init-from", default=None,
                   help="checkpoint dir or exported model file to warm-start from (input channels adapted)")
    p.add_argument("--export", action="store_true")
    p.add_argument("--eval", type=int, default=0)
    p.add_argument("--model", default=None, help="evaluate this exported .safetensors instead of the checkpoint")
    p.add_argument("--no-ema", action="store_true")
    p.add_argument("--objects", type=int, default=0,
                   help="1 or 2: only scenes with that many objects, in training (curriculum) and in --eval "
                        "(0: training uses the whole bank, eval alternates)")
    p.add_argument("--cfg", type=float, default=4.0)
    p.add_argument("--eval-steps", type=int, default=20)
    p.add_argument("--eval-size", default=f"{WD.T}x{WD.H}", help="frames x pixels of the --eval videos")
    p.add_argument("--sampler", default="euler")
    p.add_argument("--eval-seed", type=int, default=12345)
    p.add_argument("--save-png", default=None)
    p.add_argument("--diag", action="store_true", help="print the layout-word separation diagnostics and exit")
    a = p.parse_args()
    if a.export:
        path = export(a.dir, use_ema=not a.no_ema)
        print(path, os.path.getsize(path))
        force_cpu()
        import comfy.sd
        mp = comfy.sd.load_diffusion_model(path)
        print("ComfyUI detects:", type(mp.model.model_config).__name__, mp.model.model_config.unet_config)
        return
    if a.diag:
        diagnose(a)
        return
    if a.eval:
        evaluate(a)
        return
    train(a)


if __name__ == "__main__":
    main()
