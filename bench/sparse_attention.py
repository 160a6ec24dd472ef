"""Benchmark: dense SDPA vs Carnator block-sparse attention (flex and fallback backends).

    python bench/sparse_attention.py            # full run, writes bench/results/sparse_attention.json
    python bench/sparse_attention.py --smoke    # one small size, < 60 s, for CI

For each size, dense and sparse are timed side by side in the same process (warm-up, then the
median of repeats), both for the attention op alone and for a small transformer block
(LayerNorm, qkv projection, attention, output projection, GELU MLP) in plain torch.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from carnator_core.reuse.connectivity import mask_density, num_blocks  # noqa: E402
from carnator_core.reuse.sparse_attention import (  # noqa: E402
    backend_report, select_backend, sparse_attention, sparse_call_counts)

# (tokens, heads, head_dim, repeats)
FULL_SIZES = [(2048, 12, 64, 7), (8192, 8, 64, 5), (32768, 2, 64, 3)]
SMOKE_SIZES = [(2048, 4, 64, 5)]
DENSITIES = (0.25, 0.5)


def timed_round_robin(fns: dict, repeats: int) -> dict:
    """Median wall time (ms) per function; one warm-up each, then the functions are called in
    turn, so load from other processes on the machine hits all of them alike."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def local_mask(heads: int, nb: int, density: float, seed: int) -> torch.Tensor:
    """(H, nb, nb) mask with exactly round(density*nb) blocks per row: the diagonal, its
    neighbours (locality) and random far blocks, as captured connectivity tends to look."""
    g = torch.Generator().manual_seed(seed)
    per_row = max(1, round(density * nb))
    idx = torch.arange(nb)
    dist = (idx[None, :] - idx[:, None]).abs().float()
    mask = torch.zeros(heads, nb, nb, dtype=torch.bool)
    for h in range(heads):
        prio = torch.where(dist <= 1, -1.0, torch.rand(nb, nb, generator=g))
        keep = prio.argsort(dim=-1)[:, :per_row]
        mask[h].scatter_(-1, keep, True)
    return mask


class Block(torch.nn.Module):
    def __init__(self, heads: int, head_dim: int):
        super().__init__()
        dim = heads * head_dim
        self.heads, self.head_dim = heads, head_dim
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(),
                                       torch.nn.Linear(4 * dim, dim))

    def forward(self, x, attn):
        B, L, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, L, 3, self.heads, self.head_dim) \
            .permute(2, 0, 3, 1, 4).unbind(0)
        x = x + self.proj(attn(q, k, v).transpose(1, 2).reshape(B, L, -1))
        return x + self.mlp(self.norm2(x))


def sampled_error(q, k, v, out, mask, block_size, n_rows=256):
    """Max abs error against masked dense SDPA on the first and last query rows (a full
    token-level reference would need an L x L mask)."""
    L = q.shape[-2]
    rows = torch.cat([torch.arange(min(n_rows, L)), torch.arange(max(0, L - n_rows), L)])
    tok = mask[:, rows // block_size].repeat_interleave(block_size, -1)[..., :L]
    ref = F.scaled_dot_product_attention(q[:, :, rows], k, v, attn_mask=tok)
    return (out[:, :, rows] - ref).abs().max().item()


def bench_size(tokens, heads, head_dim, repeats, block_size, backends, step=True):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, heads, tokens, head_dim) for _ in range(3))
    block = Block(heads, head_dim).eval()
    x = torch.randn(1, tokens, heads * head_dim)
    rows = []
    with torch.no_grad():
        for density in DENSITIES:
            mask = local_mask(heads, num_blocks(tokens, block_size), density, seed=tokens)
            first, err, before = {}, {}, sparse_call_counts()
            for be in backends:  # first call (compiles flex for a new shape) and accuracy
                t0 = time.perf_counter()
                out = sparse_attention(q, k, v, mask, block_size, backend=be)
                first[be] = time.perf_counter() - t0
                err[be] = sampled_error(q, k, v, out, mask, block_size)
            attn = {"dense": lambda: F.scaled_dot_product_attention(q, k, v)}
            stepf = {"dense": lambda: block(x, F.scaled_dot_product_attention)}
            for be in backends:
                attn[be] = lambda be=be: sparse_attention(q, k, v, mask, block_size, backend=be)
                stepf[be] = lambda be=be: block(x, lambda a, b, c: sparse_attention(
                    a, b, c, mask, block_size, backend=be))
            ta = timed_round_robin(attn, repeats)
            ts = timed_round_robin(stepf, repeats) if step else None
            after = sparse_call_counts()
            for be in backends:
                row = {
                    "tokens": tokens, "heads": heads, "head_dim": head_dim,
                    "block_size": block_size, "density": density,
                    "actual_density": round(mask_density(mask), 4), "backend": be,
                    "dense_ms": round(ta["dense"], 2), "sparse_ms": round(ta[be], 2),
                    "attention_ratio": round(ta["dense"] / ta[be], 3),
                    "dense_step_ms": round(ts["dense"], 2) if ts else None,
                    "sparse_step_ms": round(ts[be], 2) if ts else None,
                    "step_ratio": round(ts["dense"] / ts[be], 3) if ts else None,
                    "first_call_s": round(first[be], 2), "max_abs_err": err[be],
                    "sparse_calls_engaged": after[be] - before[be],
                }
                rows.append(row)
                print_row(row)
    return rows


HEADER = (f"{'tokens':>7} {'H':>3} {'D':>4} {'bs':>4} {'dens':>5} {'backend':>8} "
          f"{'dense ms':>9} {'sparse ms':>10} {'attn x':>7} {'step x':>7} {'err':>8}")


def print_row(r):
    step = "-" if r["step_ratio"] is None else f"{r['step_ratio']:.2f}"
    print(f"{r['tokens']:>7} {r['heads']:>3} {r['head_dim']:>4} {r['block_size']:>4} "
          f"{r['actual_density']:>5.2f} {r['backend']:>8} {r['dense_ms']:>9.1f} "
          f"{r['sparse_ms']:>10.1f} {r['attention_ratio']:>7.2f} {step:>7} "
          f"{r['max_abs_err']:>8.1e}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="one small size, quick")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--backends", default="auto",
                    help="comma list of flex,fallback; 'auto' = selected backend + fallback")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--out", default=None,
                    help="JSON path (default bench/results/sparse_attention.json; smoke: none)")
    args = ap.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    chosen = select_backend("cpu")
    probe_s = time.perf_counter() - t0
    backends = ([chosen] + (["fallback"] if chosen != "fallback" else [])
                if args.backends == "auto" else args.backends.split(","))
    print(f"backend: {chosen} ({backend_report()['devices']['cpu']['reason']}; "
          f"probe {probe_s:.1f} s), torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(HEADER)
    rows = []
    for tokens, heads, head_dim, repeats in (SMOKE_SIZES if args.smoke else FULL_SIZES):
        rows += bench_size(tokens, heads, head_dim, repeats, args.block_size, backends)
    report = backend_report()
    result = {
        "rows": rows,
        "machine": {
            "platform": platform.platform(), "processor": platform.processor(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(),
            "loadavg_at_end": os.getloadavg(),
            "device": "cpu",
        },
        "backend_report": report,
        "smoke": args.smoke,
        "total_seconds": round(time.perf_counter() - t0, 1),
    }
    if args.smoke and not args.out:  # never overwrite the full results with a smoke run
        print(f"smoke run done in {result['total_seconds']} s (pass --out to keep the JSON)")
        return result
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / "sparse_attention.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out} in {result['total_seconds']} s")
    return result


if __name__ == "__main__":
    main()
