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
AMPLITUDE = (100.0, 250.0)  # range of q·k of a token with itself per head, before 1/sqrt(d)


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


def _release_freed_memory():
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: peaks may read low
        pass


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
        _release_freed_memory()  # else freed pages are reused unseen and the peak reads low
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
    amp = (torch.empty(heads).uniform_(*AMPLITUDE, generator=g) / d).sqrt().to(device)
    amp = amp.repeat_interleave(d // 2).repeat(2)  # the (cos, sin) halves of every head
    q = torch.empty(BATCH, coords.shape[0], heads * d, dtype=MODEL_DTYPE, device=device)
    k = torch.empty_like(q)
    for s in range(0, coords.shape[0], 8192):  # a chunk at a time: float32 whole is 3 GB at 14B
        phase = coords[s:s + 8192].to(device) @ freqs
        feats = (torch.cat([phase.cos(), phase.sin()], -1) * amp).view(-1, 2, heads, d // 2)
        feats = feats.transpose(1, 2).reshape(-1, heads * d)
        noise = 0.3 * feats.abs().mean()
        q[:, s:s + 8192] = feats + noise * torch.randn(feats.shape, generator=g).to(device)
        k[:, s:s + 8192] = feats + noise * torch.randn(feats.shape, generator=g).to(device)
    return q, k


def heads_view(x, heads):
    """(B, L, H*D) -> (B, H, L, D) as ComfyUI's attention override sees it (a view)."""
    return x.view(x.shape[0], x.shape[1], heads, -1).transpose(1, 2)


class ShapeOnlyRun:
    """What TrajectoryRecord asks of a run: the latent shape, the step count and a step's tokens."""

    def __init__(self, latent_shape, tokens=None, steps=None):
        self.latent_shape, self.tokens, self.steps = tuple(latent_shape), tokens, steps or STEPS

    def block_tokens(self, step):
        return self.tokens


def pooled(qh, kh, block_size):
    """Block means of q and k and key-block token counts (inputs for every layer's variant;
    written here so that --before can use it with code that has no such function)."""
    def pool(x):
        n = -(-x.shape[2] // block_size)
        return torch.stack([x[:, :, i * block_size:(i + 1) * block_size].float().mean(2)
                            for i in range(n)], 2)
    counts = torch.full((-(-kh.shape[2] // block_size),), float(block_size), device=kh.device)
    counts[-1] = kh.shape[2] - (counts.numel() - 1) * block_size
    return pool(qh), pool(kh), counts


def pooled_scores(qp, kp, kcounts):
    logits = (qp @ kp.transpose(-1, -2)) * qp.shape[-1] ** -0.5 + torch.log(kcounts)
    return torch.softmax(logits, -1)


def layer_variants(qp, kp, layers, seed=1):
    """Per-layer pooled q/k that differ like layers do: heads permuted and perturbed."""
    g = torch.Generator().manual_seed(seed)
    for layer in range(layers):
        perm = torch.randperm(qp.shape[1], generator=g).to(qp.device)
        noise = 0.1 * qp.std() * torch.randn(qp.shape, generator=g).to(qp.device)
        yield layer, qp[:, perm] + noise, kp[:, perm]


# ------------------------------------------------------------------ one size
class Phases:
    """Seconds per phase of one request, each marked where it runs: on the host CPU, or on
    the model's device (here the CPU too, unless --device cuda)."""

    def __init__(self, device):
        self.device, self.rows = device, {}

    def time(self, name, where, fn, times=1.0, repeats=1):
        seconds, out = timed(fn, self.device, repeats)
        self.rows[name] = {"seconds": seconds * times, "where": where}
        return out

    def total(self, names, where):
        return sum(self.rows[n]["seconds"] for n in names if self.rows[n]["where"] == where)


MISS = ["capture_pooling", "probe_scores", "probe_selection", "measured", "signature_tiles", "snapshots",
        "packing", "store", "lookup"]
HIT = ["hit_load", "hit_unpack_per_step"]


def measure(name, size, device, core_is_new, sample_layers):
    from carnator_core.cache.folder import TrajectoryCache
    from carnator_core.pipeline import ReuseSettings, TrajectoryRecord
    from carnator_core.reuse.sparse_reuse import AttentionPlan, Connectivity, SparseSettings

    settings = ReuseSettings()
    probe_steps, last = settings.probe_steps(STEPS), settings.probe_steps(STEPS) - 1
    layers, heads, thw = size["layers"], size["heads"], tuple(size["latent"][-3:])
    calls = 1 if core_is_new else probe_steps  # model calls per layer whose capture is kept
    ph, mem = Phases(device), {}
    q, k = local_qk(size, device)
    qh, kh = heads_view(q, heads), heads_view(k, heads)
    n_img = qh.shape[2]
    plan = AttentionPlan(SparseSettings(), thw)
    step_arg = [last] if core_is_new else []

    # the q·k block mass of one layer in one model call (pooling), scaled to a request
    with PeakMemory(device) as m:
        ph.time("capture_pooling", "device", lambda: [plan.capture(i, qh, kh, n_img, *step_arg)
                                                     for i in range(sample_layers)],
                times=layers * calls / sample_layers)
    mem["capture"] = (m.cpu_extra, m.device_extra)
    qp, kp, kcounts = pooled(qh, kh, plan.block_size)
    del q, k, qh, kh

    if core_is_new:  # the sampled captures above are not part of the request's masks
        plan.reset_measurement()
    else:
        plan.scores, plan.score_counts = {}, {}

    def select_every_layer():
        scores_s = 0.0  # old code only: the scores themselves, computed on the device
        for layer, qpl, kpl in layer_variants(qp, kp, layers):
            if core_is_new:  # scores, mask and packing, on the device, right away
                plan.capture_pooled(layer, qpl, kpl, kcounts, last)
                continue
            t0 = time.perf_counter()  # old capture: batch mean added to a CPU running total
            s = pooled_scores(qpl, kpl, kcounts).mean(0)  # computed once here, once a call there
            sync(device)
            scores_s += time.perf_counter() - t0
            for _ in range(calls):
                plan.scores[layer] = plan.scores.get(layer, 0) + s.cpu()
            plan.score_counts[layer] = calls
        return scores_s
    with PeakMemory(device) as m:
        scores_s = ph.time("probe_selection", "device" if core_is_new else "host", select_every_layer)
        ph.rows["probe_selection"]["seconds"] -= scores_s
        ph.rows["probe_scores"] = {"seconds": scores_s * calls, "where": "device"}
        conn = ph.time("measured", "host", plan.measured)
    mem["probe"] = (m.cpu_extra, m.device_extra)

    latent = torch.randn(size["latent"], device=device)
    tokens = torch.randn(n_img, size["dim"], dtype=MODEL_DTYPE, device=device)
    record = TrajectoryRecord(ShapeOnlyRun(size["latent"]), settings.snapshot_steps(STEPS),
                              *([settings.entry_dtype] if core_is_new else []))
    snapshot_steps = sorted(record.snapshot_steps)
    record.snapshot_steps = set()  # tiles only; the snapshots are timed on their own below

    def tiles_of_one_step(with_tokens):
        # before: the adapter copied the block's tokens to the CPU as float32, then pooled
        record.run.tokens = None if not with_tokens else tokens if core_is_new else tokens.float().cpu()
        record.on_step(0, latent, latent)
    t_plain, _ = timed(lambda: tiles_of_one_step(False), device, 3)
    t_tokens, _ = timed(lambda: tiles_of_one_step(True), device, 1)
    ph.rows["signature_tiles"] = {"seconds": t_plain * (STEPS - probe_steps) + t_tokens * probe_steps,
                                  "where": "device" if core_is_new else "host"}
    record.snapshot_steps, record.run.tokens = set(snapshot_steps), None
    with PeakMemory(device) as m:
        ph.time("snapshots", "host", lambda: [record.on_step(s, latent, latent) for s in snapshot_steps])
        tensors = ph.time("packing", "host", lambda: {**record.tensors(latent), **conn.to_tensors()})
    mem["record"] = (m.cpu_extra, m.device_extra)
    ph.rows["snapshots"]["seconds"] -= t_plain * len(snapshot_steps)  # tiles counted above

    r = {"tokens": n_img, "blocks": plan.block_size and -(-n_img // plan.block_size),
         "layers": layers, "heads": heads, "probe_steps": probe_steps,
         "snapshots": len(snapshot_steps), "connectivity_density": conn.density}
    with tempfile.TemporaryDirectory() as folder:
        cache = TrajectoryCache(folder, 1 << 40)
        row = {"class_key": "bench", "exact_key": "bench", "model_fingerprint": name,
               "latent_shape": "x".join(map(str, size["latent"])), "steps": STEPS,
               "snapshot_steps": str(snapshot_steps), "probe_step": probe_steps}
        sig = torch.randn(512)
        with PeakMemory(device) as m:
            entry_id = ph.time("store", "host", lambda: cache.store(row, tensors, sig))
        mem["store"] = (m.cpu_extra, m.device_extra)
        r["entry_bytes"] = cache.get(entry_id).row["bytes"]
        conn_keys = [key for key in tensors if key.startswith("connectivity")]
        r["connectivity_bytes"] = sum(tensors[key].numel() * tensors[key].element_size() for key in conn_keys)
        r["snapshot_bytes"] = sum(x.numel() * x.element_size() for key, x in tensors.items()
                                  if key.startswith(("snapshot.", "final")))
        if core_is_new:  # what the other formats would store (the file holds ~the tensor bytes)
            from carnator_core.cache.precision import ENTRY_DTYPES
            other = r["entry_bytes"] - r["snapshot_bytes"]
            r["entry_bytes_by_format"] = {}
            for fmt in ENTRY_DTYPES:
                record.dtype = fmt
                latents = {k: x for k, x in record.tensors(latent).items() if k.startswith(("snapshot.", "final"))}
                r["entry_bytes_by_format"][fmt] = other + sum(x.numel() * x.element_size() for x in latents.values())
            record.dtype = settings.entry_dtype
        ph.time("lookup", "host", lambda: cache.lookup("bench", sig, 3), repeats=3)
        snap = f"snapshot.{snapshot_steps[-1]}"

        def load():
            loaded = cache.load_tensors(entry_id, conn_keys + [snap])
            loaded[snap].to(device, torch.float32)
            return Connectivity.from_tensors(loaded)
        with PeakMemory(device) as m:
            c = ph.time("hit_load", "host", load)
            # what each sampling step then unpacks, layer by layer where it runs
            def unpack_each_layer():  # one at a time, as the sampler holds them
                for i in range(layers):
                    c.layer_mask(i, device) if core_is_new else c.mask[i].to(device)
            ph.time("hit_unpack_per_step", "device", unpack_each_layer)
        mem["hit"] = (m.cpu_extra, m.device_extra)
    r["phases"] = ph.rows
    r["miss_host_s"], r["miss_device_s"] = ph.total(MISS, "host"), ph.total(MISS, "device")
    r["hit_host_s"], r["hit_device_s"] = ph.total(HIT, "host"), ph.total(HIT, "device")
    r["peak_extra_cpu_bytes"] = {k: v[0] for k, v in mem.items()}
    r["peak_extra_device_bytes"] = {k: v[1] for k, v in mem.items()}
    r["miss_peak_extra_cpu_bytes"] = max(mem[k][0] for k in ("capture", "probe", "record", "store"))
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sizes", nargs="*", default=list(SIZES))
    ap.add_argument("--before", help="folder holding an older carnator_core to time instead")
    ap.add_argument("--sample-layers", type=int, default=2,
                    help="layers whose full capture (pooling q and k) is timed and scaled up")
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU threads (1: comparable on a shared machine, as the issue measured)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--small", action="store_true", help="a tiny shape, for the smoke test")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(args.before).resolve()) if args.before else str(REPO))
    import carnator_core
    from carnator_core.reuse import sparse_reuse
    core_is_new = hasattr(sparse_reuse.AttentionPlan, "capture_pooled")
    torch.set_grad_enabled(False)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sizes = ({"small": dict(layers=2, heads=2, head_dim=32, dim=64, latent=(1, 16, 3, 32, 32))}
             if args.small else {n: SIZES[n] for n in args.sizes})
    results = {}
    for name, size in sizes.items():
        r = measure(name, size, device, core_is_new, args.sample_layers)
        results[name] = r
        print(f"{name}: miss host {r['miss_host_s']:.2f} s + device {r['miss_device_s']:.2f} s, "
              f"peak extra CPU {r['miss_peak_extra_cpu_bytes'] / 2**30:.2f} GiB, "
              f"entry {r['entry_bytes'] / 1e6:.1f} MB (connectivity {r['connectivity_bytes'] / 1e6:.1f} MB), "
              f"hit host {r['hit_host_s']:.2f} s + device {r['hit_device_s']:.2f} s, "
              f"density {r['connectivity_density']:.0%}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = json.loads(out.read_text()) if out.exists() else {}
    key = "before" if args.before else "after"
    doc[key] = {"device": str(device), "torch": torch.__version__, "threads": torch.get_num_threads(),
                "code": str(Path(carnator_core.__file__).parent), "sizes": results}
    if "before" in doc and "after" in doc:
        doc["ratios"] = {n: {"miss_host": doc["before"]["sizes"][n]["miss_host_s"]
                             / doc["after"]["sizes"][n]["miss_host_s"],
                             "entry_bytes": doc["after"]["sizes"][n]["entry_bytes"]
                             / doc["before"]["sizes"][n]["entry_bytes"]}
                         for n in doc["after"]["sizes"] if n in doc["before"]["sizes"]}
        for n, ratio in doc["ratios"].items():
            print(f"{n}: miss host bookkeeping before/after {ratio['miss_host']:.1f}x, "
                  f"entry bytes after/before {ratio['entry_bytes']:.0%}")
    out.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
