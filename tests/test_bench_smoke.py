"""Smoke runs of the benchmarks: they run, engage the sparse kernel and write their JSON.

Speed is not asserted here (machines are noisy); the full runs are in the README.
"""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run(args, timeout=600):
    out = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


def test_sparse_attention_benchmark_smoke(tmp_path):
    target = tmp_path / "sparse_attention.json"
    run(["bench/sparse_attention.py", "--smoke", "--out", str(target)])
    rows = json.loads(target.read_text())["rows"]
    assert rows and {"tokens", "density", "attention_ratio", "step_ratio"} <= set(rows[0])
    assert all(r["attention_ratio"] > 0 for r in rows)


def test_wan_size_benchmark_script_runs_small_on_cpu(tmp_path):
    """The GPU script (Wan-2.1-1.3B shape) at a tiny size: the same code path, end to end."""
    target = tmp_path / "wan_sparse_gpu.json"
    printed = run(["bench/wan_sparse_gpu.py", "--small", "--repeats", "1", "--out", str(target)])
    result = json.loads(target.read_text())
    assert "one step" in printed and "whole miss" in printed
    assert result["sparse_calls_per_hit"] > 0          # the hit really ran block-sparse
    assert result["reuse_step"] > 0 and result["miss_seconds"] > 0


def test_real_size_costs_benchmark_runs_small(tmp_path):
    """The real-size cost benchmark at a tiny shape: every phase timed, bytes counted."""
    target = tmp_path / "real_size_costs.json"
    printed = run(["bench/real_size_costs.py", "--small", "--out", str(target)])
    r = json.loads(target.read_text())["after"]["sizes"]["small"]
    assert "miss host" in printed
    assert {"capture_pooling", "probe_selection", "packing", "store", "lookup", "hit_load",
            "hit_unpack_per_step"} <= set(r["phases"])
    assert r["entry_bytes"] > 0 and r["connectivity_bytes"] > 0
    assert r["entry_bytes_by_format"]["int8"] < r["entry_bytes_by_format"]["float32"]


def test_lookup_scale_benchmark_smoke(tmp_path):
    """Both backends at 300 synthetic entries: rows written, repeats found every time."""
    target = tmp_path / "lookup_scale.json"
    run(["bench/lookup_scale.py", "--sizes", "300", "--queries", "20", "--out", str(target)])
    rows = json.loads(target.read_text())["rows"]
    assert {r["backend"] for r in rows} >= {"sqlite"}
    for r in rows:
        assert {"backend", "entries", "classes", "p50_ms", "p99_ms", "store_ms", "rss_mb"} <= set(r)
        assert r["entries"] == 300 and r["top1_recall_repeat"] == 1.0
