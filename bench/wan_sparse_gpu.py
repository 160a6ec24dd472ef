"""Sparse-attention reuse at real size: a Wan-2.1-1.3B-shaped model with random weights.

Through ComfyUI's own WanModel and loader (dim 1536, 30 layers, 12 heads) at a 480p ×
81-frame latent (1×16×21×60×104, 32,760 tokens), measured side by side in one process:

- the attention op alone at the model's shape: dense SDPA vs block-sparse on each backend
  (flex's first call, its compile, timed apart; a flex error is recorded, not hidden),
- one denoising step dense vs block-sparse (the candidate's stored connectivity),
- a whole miss vs a whole hit end to end (probe, lookup, gate, reuse; sparse on and off).

    python bench/wan_sparse_gpu.py            # on a GPU machine
    python bench/wan_sparse_gpu.py --small    # the same code at a tiny size, on the CPU

Writes bench/results/wan_sparse_gpu.json (or --out) after each phase (attention op, miss,
dense hit, first sparse step with its compile, steps, sparse hits), each with the seconds
elapsed, so a run cut short keeps what it measured; ``complete`` says whether every phase ran;
``--budget-seconds`` stops before a phase that would not fit. Random weights: timing only.
"""
from __future__ import annotations

import argparse
import atexit
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(1, str(ROOT))

REAL = dict(dim=1536, ffn_dim=8960, num_heads=12, num_layers=30, latent=(1, 16, 21, 60, 104),
            steps=30, text_tokens=512)
SMALL = dict(dim=256, ffn_dim=512, num_heads=2, num_layers=2, latent=(1, 16, 3, 16, 16),
             steps=8, text_tokens=32)
PROMPT = "a red ball rolls left across a green field"
RELATED = PROMPT + " slowly"


def build_model(cfg: dict, device):
    """Random Wan 2.1 T2V weights, detected and loaded by ComfyUI like a real file."""
    import torch
    import comfy.ops
    import comfy.sd
    from comfy.ldm.wan.model import WanModel
    with torch.device("meta"):
        meta = WanModel(model_type="t2v", patch_size=(1, 2, 2), in_dim=16, out_dim=16,
                        dim=cfg["dim"], ffn_dim=cfg["ffn_dim"], freq_dim=256, text_dim=4096,
                        num_heads=cfg["num_heads"], num_layers=cfg["num_layers"],
                        window_size=(-1, -1), qk_norm=True, cross_attn_norm=True, eps=1e-6,
                        operations=comfy.ops.disable_weight_init)
    g = torch.Generator(device="cpu").manual_seed(0)
    sd = {}
    for name, t in meta.state_dict().items():
        if t.ndim >= 2:
            w = torch.randn(t.shape, generator=g) / math.sqrt(math.prod(t.shape[1:]))
        else:
            w = torch.ones(t.shape) if "norm" in name else torch.randn(t.shape, generator=g) * 0.02
        sd[name] = w.to(torch.bfloat16)
    return comfy.sd.load_diffusion_model_state_dict(sd)


def timed(fn, sync) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def attention_op(cfg: dict, device, sync, densities=(0.25, 0.5), repeats=3) -> dict:
    """Self-attention of one layer at the model's size: dense SDPA vs block-sparse per backend."""
    import torch
    import torch.nn.functional as F
    from carnator_core.reuse import sparse_attention as sa
    from carnator_core.reuse.sparse_reuse import block_size_for
    tokens = math.prod(cfg["latent"][2:]) // 4
    heads, head_dim = cfg["num_heads"], cfg["dim"] // cfg["num_heads"]
    bs = block_size_for(tokens)
    nb = math.ceil(tokens / bs)
    g = torch.Generator(device="cpu").manual_seed(1)
    q, k, v = (torch.randn(2, heads, tokens, head_dim, generator=g).to(device, torch.bfloat16)
               for _ in range(3))  # batch 2: cond and uncond together, as ComfyUI runs CFG

    def median_time(fn):
        fn()  # warm
        return statistics.median(timed(fn, sync) for _ in range(repeats))

    report = {"tokens": tokens, "heads": heads, "head_dim": head_dim, "block_size": bs,
              "dtype": "bfloat16", "dense_seconds": median_time(
                  lambda: F.scaled_dot_product_attention(q, k, v)), "sparse": []}
    for density in densities:
        # the diagonal (every block sees itself) plus random blocks up to the density
        mask = torch.rand(heads, nb, nb, generator=g) < density
        mask |= torch.eye(nb, dtype=torch.bool)
        row = {"density": round(mask.float().mean().item(), 3)}
        mask = mask.to(device)
        for backend in sa.BACKENDS:
            if backend == "flex":
                try:  # straight to the kernel: an error here is reported, not failed over
                    row["flex_first_call_seconds"] = timed(
                        lambda: sa._flex_run(q, k, v, mask, bs, None), sync)
                except Exception as exc:  # noqa: BLE001 - the report is the point
                    row["flex_error"] = f"{type(exc).__name__}: {str(exc)[:800]}"
                    continue
            row[f"{backend}_seconds"] = median_time(
                lambda: sa.sparse_attention(q, k, v, mask, bs, backend=backend))
            row[f"{backend}_speedup"] = report["dense_seconds"] / row[f"{backend}_seconds"]
        report["sparse"].append(row)
        print(f"attention op density {row['density']:.0%}: {row}", flush=True)
    del q, k, v
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny size on the CPU (a smoke run)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--keep-mass", type=float, default=0.5)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "wan_sparse_gpu.json"))
    ap.add_argument("--budget-seconds", type=float, default=None,
                    help="stop (saving what was measured) before a phase that would not fit")
    args = ap.parse_args()
    cfg = SMALL if args.small else REAL
    if not args.small:
        os.environ.setdefault("CARNATOR_COMFY_GPU", "1")
    from comfy_host import import_comfy
    import_comfy()
    import torch
    import comfy.model_management as mm
    from request_flow import Requests  # the same request flow the tests drive
    from carnator_core.reuse.sparse_attention import backend_report, select_backend

    started = time.perf_counter()
    device = mm.get_torch_device()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    workdir = tempfile.mkdtemp(prefix="carnator-bench-")
    atexit.register(shutil.rmtree, workdir, True)  # the cache is this run's alone: leave nothing in /tmp
    requests = Requests(workdir, steps=cfg["steps"],
                        text_tokens=cfg["text_tokens"])
    requests.settings.sparse.keep_mass = args.keep_mass
    out = Path(args.out)
    result = {"complete": False, "config": dict(cfg), "device": str(device),
              "tokens": math.prod(cfg["latent"][2:]) // 4, "keep_mass": args.keep_mass,
              "steps": cfg["steps"]}

    def save(phase: str) -> None:
        """Write what is measured so far: a run cut short by a device's time limit keeps it."""
        result["last_phase"] = phase
        result.setdefault("elapsed_seconds", {})[phase] = round(time.perf_counter() - started, 1)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2, default=str))
        print(f"[{phase}] saved {out}", flush=True)

    def fits(phase: str, seconds: float) -> bool:
        """Whether a phase expected to take about ``seconds`` fits the budget; saves if not."""
        budget = math.inf if args.budget_seconds is None else args.budget_seconds
        left = budget - (time.perf_counter() - started)
        if seconds <= left:
            return True
        result["stopped_before"] = f"{phase} (~{seconds:.0f} s expected, {left:.0f} s left)"
        save("stopped")
        return False

    select_backend(device)  # probes flex on this device now, outside every timed phase
    result["backend_choice"] = backend_report()
    result["attention_op"] = attention_op(cfg, device, sync)
    save("attention op")
    model = build_model(cfg, device)

    def request(prompt, **kw):
        return requests(model, "wan21", prompt, shape=cfg["latent"], **kw)

    # a short unstored request first: the device's first-call costs (allocator, kernel choice)
    # would otherwise land in the timed miss and inflate every hit's ratio
    requests.settings.store = False
    result["warmup_seconds"] = timed(lambda: request("a warm-up scene", steps=4), sync)
    requests.settings.store = True
    if not fits("miss", 1.5 * result["warmup_seconds"] * cfg["steps"] / 4):
        return 0
    # whole miss (stores the trajectory and its probe connectivity)
    t_miss = timed(lambda: request(PROMPT), sync)
    result["miss_seconds"] = t_miss
    save("miss")
    requests.settings.store = False
    # dense hits first: they need no compiled kernel, so their ratio survives a cut-short run
    requests.settings.sparse.enabled = False
    hits = {False: [], True: []}

    def timed_hit(sparse_on):
        holder = []
        t = timed(lambda: holder.append(request(RELATED)[1]), sync)  # (latent, summary)
        hits[sparse_on].append((t, holder[0]))
        print(f"hit sparse={sparse_on} {t:.2f}s: {holder[0].text()}", flush=True)

    if not fits("dense hit", t_miss):
        return 0
    timed_hit(False)
    summary = hits[False][-1][1]
    assert summary.outcome == "hit", summary.text()
    result.update(reuse_step=summary.reuse_step, hit_seconds={"dense": hits[False][0][0]},
                  hit_speedup={"dense": t_miss / hits[False][0][0]})
    save("dense hit")
    # one step dense vs sparse, from the same state, with the stored connectivity; the first
    # sparse call compiles the kernel and is timed on its own
    run = requests.run_obj(model, "wan21", RELATED, shape=cfg["latent"])
    from carnator_core.pipeline import TrajectoryRecord
    from carnator_core.reuse.sparse_reuse import CONNECTIVITY_KEYS, Connectivity
    from carnator_core.cache.folder import TrajectoryCache
    k = summary.reuse_step
    record = TrajectoryRecord(run, [k])
    run.sample(0, k + 1, None, record.on_step)
    start = run.boundary_from_sampler_space(record.snapshots[k], k)
    cache = TrajectoryCache(requests.cache_folder)
    conn = Connectivity.from_tensors(cache.load_tensors(summary.entry_id, CONNECTIVITY_KEYS))
    result["connectivity_density"] = conn.density

    def one_step(mode):
        run.attention.connectivity = conn if mode == "sparse" else None
        run.attention.sparse_steps = {k} if mode == "sparse" else set()
        return timed(lambda: run.sample(k, k + 1, start), sync)

    if not fits("first sparse step", 3 * t_miss / cfg["steps"] + 60):  # a step, run, compile
        return 0
    result["first_sparse_step_seconds"] = one_step("sparse")  # includes the kernel's compile
    result["backend"] = backend_report()
    save("first sparse step")
    step_times = {"dense": [], "sparse": []}
    for _ in range(args.repeats):
        for mode in ("dense", "sparse"):
            step_times[mode].append(one_step(mode))
    dense_step, sparse_step = (statistics.median(step_times[m]) for m in ("dense", "sparse"))
    result.update(step_seconds={"dense": dense_step, "sparse": sparse_step},
                  step_ratio=dense_step / sparse_step)
    print(f"one step   dense {dense_step:.3f}s  sparse {sparse_step:.3f}s  ratio {result['step_ratio']:.2f}x",
          flush=True)
    save("steps")
    if not fits("sparse hits", 3 * result["hit_seconds"]["dense"]
                + cfg["steps"] * max(0.0, sparse_step - dense_step)):
        return 0
    for sparse_on in (True, False, True):  # interleaved: drift hits both equally
        requests.settings.sparse.enabled = sparse_on
        timed_hit(sparse_on)
    hit_dense = statistics.median(t for t, _ in hits[False])
    hit_sparse = statistics.median(t for t, _ in hits[True])
    result.update(complete=True, hit_seconds={"dense": hit_dense, "sparse": hit_sparse},
                  hit_speedup={"dense": t_miss / hit_dense, "sparse": t_miss / hit_sparse},
                  sparse_calls_per_hit=hits[True][-1][1].sparse_calls, backend=backend_report())
    print(f"device {device}  tokens {result['tokens']}  density {conn.density:.0%}  k*={k}/{cfg['steps']}")
    print(f"whole miss {t_miss:.2f}s  hit dense {hit_dense:.2f}s ({result['hit_speedup']['dense']:.2f}x)"
          f"  hit sparse {hit_sparse:.2f}s ({result['hit_speedup']['sparse']:.2f}x)")
    save("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
