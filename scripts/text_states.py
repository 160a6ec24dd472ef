"""Run a tiny-world benchmark where MiniLM cannot travel (a lent GPU machine: its weights are
88 MB, a call carries 64 MiB): encode a workload's prompts here, carry their text states, and
replay them there (``tinyworld.text.preload_states``), so the states are the ones this machine's
fp32 MiniLM gives, bit for bit (not a smaller re-encoded copy).

    python scripts/text_states.py export calibration out/states.safetensors
    python scripts/text_states.py run out/states.safetensors bench/calibrate.py --steps 30 …

``run`` fails with a message (instead of loading MiniLM) if a prompt was not exported.
"""
from __future__ import annotations

import json
import os
import runpy
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (os.path.join(REPO, "tests"), REPO):
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from tinyworld import text as TXT  # noqa: E402


def workload_prompts(name: str) -> list[str]:
    """Every prompt of the workload as the benchmarks read it (a name or a path), and the negative."""
    import repo_scripts  # tests/: bench/tinyworld.py by path (its name clashes with the package)
    _, lines = repo_scripts.load("bench/tinyworld.py", "bench_tw").load_workload(name)
    texts = {""}
    for ln in lines:
        texts.update(v for k, v in ln.items() if k.endswith("prompt") and isinstance(v, str))
    return sorted(texts)


def export(workload: str, path: str) -> None:
    texts = workload_prompts(workload)
    torch.set_num_threads(1)  # as the benchmarks run (--threads 1): the sums' order changes the bits
    tensors = {}
    for i, t in enumerate(texts):
        row, pooled = TXT.cached_states(t)
        # fill_padding repeated the real rows (pooled row + tokens kept) cyclically: keep those
        used = 1 + min(TXT.token_counts([t])[0], TXT.TEXT_LEN - 1)
        tensors[f"s{i}"] = row[:used].contiguous()
        tensors[f"p{i}"] = pooled.contiguous()
        assert torch.equal(restore(tensors[f"s{i}"]), row), t
    save_file(tensors, path, metadata={"texts": json.dumps(texts), "workload": workload})
    print(f"{len(texts)} prompts → {path} ({os.path.getsize(path) / 2**20:.1f} MiB)")


def restore(rows: torch.Tensor) -> torch.Tensor:
    full = torch.zeros(TXT.TEXT_LEN, TXT.STATE_DIM)
    full[:len(rows)] = rows
    return TXT.fill_padding(full)


def load(path: str) -> int:
    with safe_open(path, "pt") as f:
        texts = json.loads(f.metadata()["texts"])
        states = {t: (restore(f.get_tensor(f"s{i}")), f.get_tensor(f"p{i}")) for i, t in enumerate(texts)}
    TXT.preload_states(states, offline=f"a prompt's text state is not in {path}: "
                                       "export the workload it came from")
    return len(texts)


if __name__ == "__main__":
    verb, *rest = sys.argv[1:]
    if verb == "export":
        export(*rest)
    elif verb == "run":
        path, script, *args = rest
        print(f"{load(path)} text states from {path}", flush=True)
        sys.argv = [script, *args]
        runpy.run_path(script, run_name="__main__")
    else:
        raise SystemExit(__doc__)
