"""One process of the cache fault-injection harness (tests/cache_faults.py starts several).

    python tests/cache_fault_worker.py FOLDER JOURNAL_DIR TAG CAPACITY SEED

Loops over what ComfyUI processes do to a shared cache — store, load, pin, record a hit,
delete, look up — opening the cache afresh for each operation as a request does. Every
promise the cache makes is written to ``JOURNAL_DIR/TAG.log`` *after* the call returned
(``S id seed`` stored, ``P id`` pinned), every intent before it (``D id`` deleting), so
the checker knows what must still be there. A load that returns anything but the bytes
the entry was stored with is journaled as ``WRONG``. The harness kills this process with
SIGKILL at random moments; nothing here cleans up.
"""
from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from carnator_core.cache.folder import TrajectoryCache  # noqa: E402

CLASS_KEY = "fault-class"


def expected_tensors(seed: int) -> dict[str, torch.Tensor]:
    """What entry ``seed`` holds: anyone can recompute it to check a load byte for byte."""
    g = torch.Generator().manual_seed(seed)
    return {"final": torch.randn(1, 4, 2, 8, 8, generator=g),
            "snapshot.2": torch.randn(1, 4, 2, 8, 8, generator=g),
            "tile_steps": torch.arange(3, dtype=torch.int64)}


def signature_of(seed: int) -> torch.Tensor:
    return torch.nn.functional.normalize(torch.randn(8, generator=torch.Generator().manual_seed(seed + 1)), dim=0)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(k in a and a[k].dtype == v.dtype and torch.equal(a[k], v) for k, v in b.items())


def read_journals(journal_dir: Path) -> list[tuple[str, ...]]:
    lines = []
    for path in sorted(journal_dir.glob("*.log")):
        for line in path.read_text().splitlines():
            parts = tuple(line.split())
            if len(parts) >= 2:  # a line cut by a kill has no newline-terminated twin
                lines.append(parts)
    return lines


class Worker:
    def __init__(self, folder: str, journal_dir: str, tag: str, capacity: int, seed: int):
        self.folder, self.tag, self.capacity = folder, tag, capacity
        self.rng = random.Random(seed)
        self.journal_dir = Path(journal_dir)
        self.journal = open(self.journal_dir / f"{tag}.log", "a", buffering=1)
        self.seeds: dict[str, int] = {}
        self.note("R", os.getpid())  # ready: the harness kills only processes past start-up

    def note(self, *parts) -> None:
        self.journal.write(" ".join(str(p) for p in parts) + "\n")
        self.journal.flush()
        os.fsync(self.journal.fileno())

    def refresh(self) -> None:
        for parts in read_journals(self.journal_dir):
            if parts[0] == "S" and len(parts) == 3:
                self.seeds[parts[1]] = int(parts[2])

    def cache(self) -> TrajectoryCache:
        return TrajectoryCache(self.folder, self.capacity)

    def step(self) -> None:
        op = self.rng.choices(["store", "load", "pin", "use", "delete", "lookup", "evict"],
                              [40, 33, 8, 7, 4, 6, 2])[0]
        if op == "store" or not self.seeds:
            seed = self.rng.getrandbits(48)
            row = {"class_key": CLASS_KEY, "exact_key": f"{self.tag}-{seed}", "prompt": str(seed),
                   "snapshot_steps": "[2]", "steps": 10}
            entry = self.cache().store(row, expected_tensors(seed), signature_of(seed))
            if entry:
                self.seeds[entry] = seed
                self.note("S", entry, seed)
            return
        entry = self.rng.choice(sorted(self.seeds))
        cache = self.cache()
        if op == "load":
            got = cache.load_tensors(entry)
            if got is not None and not same(got, expected_tensors(self.seeds[entry])):
                self.note("WRONG", entry)
            self.note("L", entry, int(got is not None))
        elif op == "pin":
            if cache.set_pinned(entry, True):
                self.note("P", entry)
        elif op == "use":
            cache.record_use(entry, 5)
        elif op == "evict":
            cache.evict_to_capacity()
        elif op == "delete":
            self.note("D", entry)
            cache.delete(entry)
        else:
            for cand in cache.lookup(CLASS_KEY, signature_of(self.seeds[entry]), 3).candidates:
                got = cache.load_tensors(cand.entry.id, ["final"])
                seed = self.seeds.get(cand.entry.id)
                if got is not None and seed is not None and not torch.equal(
                        got["final"], expected_tensors(seed)["final"]):
                    self.note("WRONG", cand.entry.id)

    def run(self) -> None:
        parent, n = os.getppid(), 0
        while True:
            if n % 20 == 0:
                if os.getppid() != parent:  # the test run that started us is gone: stop
                    return
                self.refresh()
            self.step()
            n += 1


if __name__ == "__main__":
    folder, journal_dir, tag, capacity, seed = sys.argv[1:6]
    Worker(folder, journal_dir, tag, int(capacity), int(seed)).run()
