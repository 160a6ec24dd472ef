"""What a request's bookkeeping costs at real model sizes, with tensors of the real shapes.

No real weights are needed: the costs measured here are those of Carnator's own work around
the model (measuring connectivity, converting snapshots, writing and reading an entry), which
depend on shapes, not on what the weights compute. q and k are built with a space-time
locality (random Fourier features of each token's (t, y, x) position, one length scale per
head) so that the block masks have the structure of video attention rather than noise.

    python bench/real_size_costs.py                     # all sizes, CPU, this code
    python bench/real_size_costs.py --before DIR        # the same work with the code in DIR
    python bench/real_size_costs.py --device cuda       # on a lent GPU

``--before DIR`` imports ``carnator_core`` from DIR (e.g. ``git archive fa6faf8 carnator_core
| tar -x -C DIR``) and times the same phases through that code's own API. Results go to
``bench/results/real_size_costs.json`` under the key "after" or "before" (the other key is
kept), so one file holds the comparison.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "results" / "real_size_costs.json"

# latent (B, C, T, H, W) with patch (1, 2, 2): tokens = T * H/2 * W/2
SIZES = {
    "wan_1.3b_480p_81": dict(layers=30, heads=12, head_dim=128, dim=1536, latent=(1, 16, 21, 60, 104)),
    "wan_14b_720p_81": dict(layers=40, heads=40, head_dim=128, dim=5120, latent=(1, 16, 21, 90, 160)),
    "hunyuan_720p_129": dict(layers=60, heads=24, head_dim=128, dim=3072, latent=(1, 16, 33, 90, 160)),
}
STEPS, BATCH, MODEL_DTYPE = 50, 2, torch.bfloat16


# ------------------------------------------------------------------ measuring tools
def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeats=1):
    """(median seconds, last result)."""
    times, out = [], None
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


class PeakMemory:
    """Peak extra resident CPU memory (Linux VmHWM, reset per phase) and device memory."""

    def __init__(self, device):
        self.device = device

    @staticmethod
    def _status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
        return 0

    def __enter__(self):
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
        self.rss0 = self._status("VmRSS:")
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            self.dev0 = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc):
        self.cpu_extra = self._status("VmHWM:") - self.rss0
        self.device_extra = (torch.cuda.max_memory_allocated() - self.dev0
                             if self.device.type == "cuda" else None)


def local_qk(size, device, seed=0):
    """q, k (B, L, heads*head_dim) in the model dtype with space-time locality per head."""
    _, _, t, h, w = size["latent"]
    heads, d = size["heads"], size["head_dim"]
    g = torch.Generator().manual_seed(seed)
    coords = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h // 2), torch.arange(w // 2),
                                        indexing="ij"), -1).reshape(-1, 3).float()
    scales = torch.stack([torch.empty(heads).uniform_(1, 4, generator=g),   # frames
                          torch.empty(heads).uniform_(4, 16, generator=g),  # rows
                          torch.empty(heads).uniform_(20, 60, generator=g)], -1)  # columns
    freqs = torch.randn(heads, 3, d // 2, generator=g) / scales[:, :, None]
    freqs = freqs.permute(1, 0, 2).reshape(3, heads * d // 2).to(device)
    amp = math.sqrt(24.0 / d)
    q = torch.empty(BATCH, coords.shape[0], heads * d, dtype=MODEL_DTYPE, device=device)
    k = torch.empty_like(q)
    for s in range(0, coords.shape[0], 8192):  # a chunk at a time: float32 whole is 3 GB at 14B
        phase = coords[s:s + 8192].to(device) @ freqs
        feats = (torch.cat([phase.cos(), phase.sin()], -1) * amp).view(-1, 2, heads, d // 2)
        feats = feats.transpose(1, 2).reshape(-1, heads * d)
        q[:, s:s + 8192] = feats + 0.3 * amp * torch.randn(feats.shape, generator=g).to(device)
        k[:, s:s + 8192] = feats + 0.3 * amp * torch.randn(feats.shape, generator=g).to(device)
    return q, k


def heads_view(x, heads):
    """(B, L, H*D) -> (B, H, L, D) as ComfyUI's attention override sees it (a view)."""
    return x.view(x.shape[0], x.shape[1], heads, -1).transpose(1, 2)


class ShapeOnlyRun:
    """The two things TrajectoryRecord asks of a run: the latent shape and a step's tokens."""

    def __init__(self, latent_shape, tokens=None):
        self.latent_shape, self.tokens = tuple(latent_shape), tokens

    def block_tokens(self, step):
        return self.tokens


def layer_variants(qp, kp, layers, seed=1):
    """Per-layer pooled q/k that differ like layers do: heads permuted and perturbed."""
    g = torch.Generator().manual_seed(seed)
    for layer in range(layers):
        perm = torch.randperm(qp.shape[1], generator=g).to(qp.device)
        noise = 0.1 * qp.std() * torch.randn(qp.shape, generator=g).to(qp.device)
        yield layer, qp[:, perm] + noise, kp[:, perm]


# ------------------------------------------------------------------ one size
def measure(name, size, device, core_is_new, sample_layers):
    from carnator_core.cache import TrajectoryCache
    from carnator_core.connectivity import block_pool, pooled_scores
    from carnator_core.pipeline import ReuseSettings, TrajectoryRecord
    from carnator_core.sparse_reuse import AttentionPlan, Connectivity, SparseSettings

    settings = ReuseSettings()
    probe_steps, last = settings.probe_steps(STEPS), settings.probe_steps(STEPS) - 1
    layers, heads = size["layers"], size["heads"]
    latent = torch.randn(size["latent"], device=device)
    q, k = local_qk(size, device)
    qh, kh = heads_view(q, heads), heads_view(k, heads)
    n_img = qh.shape[2]
    plan = AttentionPlan(SparseSettings(), tuple(size["latent"][-3:]))
    r = {"tokens": n_img, "layers": layers, "heads": heads, "probe_steps": probe_steps}

    # capture of one layer in one model call, pooling included (the q·k block mass)
    with PeakMemory(device) as mem:
        t_capture, _ = timed(lambda: [plan.capture(i, qh, kh, n_img, *([last] if core_is_new else []))
                                      for i in range(sample_layers)], device)
    r["capture_per_layer_s"] = t_capture / sample_layers
    r["capture_peak_extra_cpu_bytes"], r["capture_peak_extra_device_bytes"] = mem.cpu_extra, mem.device_extra
    bs = plan.block_size
    qp, _ = block_pool(qh, bs)
    kp, kcounts = block_pool(kh, bs)
    del q, k, qh, kh
    calls = 1 if core_is_new else probe_steps  # model calls whose capture is kept per layer

    # every layer's measurement, as a request makes it
    with PeakMemory(device) as mem:
        t0 = time.perf_counter()
        for layer, qpl, kpl in layer_variants(qp, kp, layers):
            if core_is_new:  # the mask, on the device, right away
                plan.capture_pooled(layer, qpl, kpl, kcounts, last)
            else:            # the batch mean added to a CPU running total, once per probe step
                s = pooled_scores(qpl, kpl, kcounts).mean(0)
                for _ in range(calls):
                    plan.scores[layer] = plan.scores.get(layer, 0) + s.cpu()
                plan.score_counts[layer] = calls
        sync(device)
        r["probe_layers_s"] = time.perf_counter() - t0
        r["mask_measurement_s"], conn = timed(plan.measured, device)
    r["probe_peak_extra_cpu_bytes"], r["probe_peak_extra_device_bytes"] = mem.cpu_extra, mem.device_extra
    r["connectivity_density"] = conn.density

    # snapshots, final latent and signature tiles, as the record keeps them
    tokens = torch.randn(n_img, size["dim"], dtype=MODEL_DTYPE, device=device)
    with PeakMemory(device) as mem:
        record = TrajectoryRecord(ShapeOnlyRun(size["latent"]), settings.snapshot_steps(STEPS))
        t0 = time.perf_counter()
        for step in range(STEPS):
            record.run.tokens = (tokens if core_is_new else tokens.float().cpu()) if step < probe_steps else None
            record.on_step(step, latent, latent)
        r["record_steps_s"] = time.perf_counter() - t0
        r["packing_s"], tensors = timed(lambda: {**record.tensors(latent), **conn.to_tensors()}, device)
    r["record_peak_extra_cpu_bytes"] = mem.cpu_extra

    with tempfile.TemporaryDirectory() as folder:
        cache = TrajectoryCache(folder, 1 << 40)
        row = {"class_key": "bench", "exact_key": "bench", "model_fingerprint": name,
               "latent_shape": "x".join(map(str, size["latent"])), "steps": STEPS,
               "snapshot_steps": str(sorted(record.snapshots)), "probe_step": probe_steps}
        sig = torch.randn(512)
        r["store_s"], entry_id = timed(lambda: cache.store(row, tensors, sig), device)
        r["entry_bytes"] = cache.get(entry_id).row["bytes"]
        conn_keys = [key for key in tensors if key.startswith("connectivity")]
        r["connectivity_bytes"] = sum(tensors[key].numel() * tensors[key].element_size() for key in conn_keys)
        r["snapshot_bytes"] = sum(x.numel() * x.element_size() for x in record.snapshots.values())
        r["lookup_s"], _ = timed(lambda: cache.lookup("bench", sig, 3), device, repeats=3)

        def hit():
            loaded = cache.load_tensors(entry_id, conn_keys + [f"snapshot.{max(record.snapshots)}"])
            c = Connectivity.from_tensors(loaded)
            if core_is_new:  # what one sampling step unpacks: each layer, on the device
                for layer in range(layers):
                    c.layer_mask(layer, device)
            loaded[f"snapshot.{max(record.snapshots)}"].to(device, torch.float32)
            return c
        with PeakMemory(device) as mem:
            r["hit_unpack_s"], _ = timed(hit, device)
        r["hit_peak_extra_cpu_bytes"] = mem.cpu_extra
    probe_host = r["probe_layers_s"] * (1 if core_is_new else 1)  # already all probe calls
    r["miss_bookkeeping_s"] = (probe_host + r["mask_measurement_s"] + r["record_steps_s"]
                               + r["packing_s"] + r["store_s"] + r["lookup_s"])
    r["miss_peak_extra_cpu_bytes"] = max(r["probe_peak_extra_cpu_bytes"], r["record_peak_extra_cpu_bytes"])
    # capture pooling reads q and k once per kept call; attention reads them ~L/block times
    r["capture_pooling_s_per_request"] = r["capture_per_layer_s"] * layers * calls
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sizes", nargs="*", default=list(SIZES))
    ap.add_argument("--before", help="folder holding an older carnator_core to time instead")
    ap.add_argument("--sample-layers", type=int, default=2,
                    help="layers whose full capture (pooling q and k) is timed and scaled up")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--small", action="store_true", help="a tiny shape, for the smoke test")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(args.before).resolve()) if args.before else str(REPO))
    import carnator_core
    from carnator_core import sparse_reuse
    core_is_new = hasattr(sparse_reuse.AttentionPlan, "capture_pooled")
    torch.set_grad_enabled(False)
    device = torch.device(args.device)
    sizes = ({"small": dict(layers=2, heads=2, head_dim=32, dim=64, latent=(1, 16, 3, 32, 32))}
             if args.small else {n: SIZES[n] for n in args.sizes})
    results = {}
    for name, size in sizes.items():
        r = measure(name, size, device, core_is_new, args.sample_layers)
        results[name] = r
        print(f"{name}: miss bookkeeping {r['miss_bookkeeping_s']:.2f} s "
              f"(mask {r['probe_layers_s'] + r['mask_measurement_s']:.2f} s, store {r['store_s']:.2f} s), "
              f"peak extra CPU {r['miss_peak_extra_cpu_bytes'] / 2**30:.2f} GiB, "
              f"entry {r['entry_bytes'] / 1e6:.1f} MB, hit unpack {r['hit_unpack_s']:.2f} s, "
              f"density {r['connectivity_density']:.0%}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = json.loads(out.read_text()) if out.exists() else {}
    key = "before" if args.before else "after"
    doc[key] = {"device": str(device), "torch": torch.__version__, "threads": torch.get_num_threads(),
                "code": str(Path(carnator_core.__file__).parent), "sizes": results}
    if "before" in doc and "after" in doc:
        doc["ratios"] = {n: {"miss_bookkeeping": doc["before"]["sizes"][n]["miss_bookkeeping_s"]
                             / doc["after"]["sizes"][n]["miss_bookkeeping_s"],
                             "entry_bytes": doc["after"]["sizes"][n]["entry_bytes"]
                             / doc["before"]["sizes"][n]["entry_bytes"]}
                         for n in doc["after"]["sizes"] if n in doc["before"]["sizes"]}
        for n, ratio in doc["ratios"].items():
            print(f"{n}: miss bookkeeping before/after {ratio['miss_bookkeeping']:.1f}x, "
                  f"entry bytes after/before {ratio['entry_bytes']:.0%}")
    out.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
