"""The cache fault-injection harness: real processes on one cache folder, kill -9, checks.

Used by tests/test_cache_faults.py (short, in CI) and scripts/cache_soak.py (long).

``kill_storm`` runs several worker processes (tests/cache_fault_worker.py) on one folder
with a small capacity, so eviction, pins and deletes race each other, and SIGKILLs one of
them at a random moment each round; some restarts carry a *kill point* and kill
themselves exactly at one of the cache's write points. ``point_sweep`` visits every write
point in turn. ``verify`` then checks the cache against what the workers journaled.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from cache_fault_worker import expected_tensors, read_journals, same  # noqa: E402

# in this order, point_sweep reaches each one: the orphan a kill after the rename leaves is
# what the next open re-indexes
KILL_POINTS = ["store.tmp_written", "store.renamed", "reconcile.indexed_one", "store.committed",
               "delete.committed", "evict.committed", "delete.set_aside", "evict.set_aside",
               "store.evict_set_aside"]
ENTRY_BYTES = 5_000  # about one worker entry on disk


@dataclass
class Counts:
    rounds: int = 0
    kills: int = 0                 # SIGKILLs sent by the harness
    point_kills: int = 0           # processes that killed themselves at a write point
    loads: int = 0                 # successful loads the workers checked byte for byte
    entries_checked: int = 0       # promised entries the final check examined
    present: int = 0
    evicted: int = 0               # missing, and the removal log says eviction
    deleted: int = 0               # missing after a worker deleted it
    wrong_served: int = 0          # loads that returned other bytes than stored
    resurrected: list[str] = field(default_factory=list)    # served after the log said removed
    lost: list[str] = field(default_factory=list)           # promised, gone, no reason
    pinned_evicted: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)       # folder-level inconsistencies

    def line(self) -> str:
        return (f"rounds {self.rounds} · kills {self.kills} (+{self.point_kills} at write points)"
                f" · worker loads checked {self.loads} · entries checked {self.entries_checked}"
                f" (present {self.present}, evicted {self.evicted}, deleted {self.deleted}) · "
                f"lost {len(self.lost)} · resurrected {len(self.resurrected)} · "
                f"pinned evicted {len(self.pinned_evicted)} · "
                f"wrong data served = {self.wrong_served}")

    def ok(self) -> bool:
        return not (self.wrong_served or self.lost or self.pinned_evicted or self.problems
                    or self.resurrected)


def start_worker(folder: Path, journal: Path, tag: str, capacity: int, seed: int,
                 kill_at: str | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("CARNATOR_TEST_KILL_AT", None)
    if kill_at:
        env["CARNATOR_TEST_KILL_AT"] = kill_at
    return subprocess.Popen([sys.executable, str(HERE / "cache_fault_worker.py"), str(folder),
                             str(journal), tag, str(capacity), str(seed)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _wait_ready(journal: Path, tag: str, proc: subprocess.Popen, limit_s: float = 120.0) -> None:
    deadline = time.monotonic() + limit_s
    while not (journal / f"{tag}.log").exists() and proc.poll() is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker {tag} did not start in {limit_s:.0f} s")
        time.sleep(0.05)


def _reap(proc: subprocess.Popen, counts: Counts, signalled_by_us: bool) -> None:
    rc = proc.wait(timeout=60)
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    if rc == -signal.SIGKILL and not signalled_by_us:
        counts.point_kills += 1
    elif rc not in (-signal.SIGKILL, 0):
        counts.problems.append(f"worker exited with {rc}: {err[-2000:]}")


def kill_storm(folder: Path, workdir: Path, workers: int = 3, rounds: int = 10,
               capacity: int = 60 * ENTRY_BYTES, seed: int = 0,
               pause: tuple[float, float] = (0.3, 1.2), point_share: float = 0.3) -> Counts:
    rng, counts = random.Random(seed), Counts()
    journal = workdir / "journal"
    journal.mkdir(parents=True, exist_ok=True)
    slots = [f"w{i}" for i in range(workers)]
    tags = {s: f"{s}-0" for s in slots}  # one journal per incarnation
    procs = {s: start_worker(folder, journal, tags[s], capacity, rng.getrandbits(32)) for s in slots}
    try:
        for r in range(rounds):
            victim = rng.choice(slots)
            _wait_ready(journal, tags[victim], procs[victim])
            time.sleep(rng.uniform(*pause))
            if procs[victim].poll() is None:
                procs[victim].send_signal(signal.SIGKILL)
                counts.kills += 1
            _reap(procs[victim], counts, signalled_by_us=True)
            for s in slots:  # restart the killed one, and any that died at a kill point
                if s == victim or procs[s].poll() is not None:
                    if s != victim:
                        _reap(procs[s], counts, signalled_by_us=False)
                    point = rng.choice(KILL_POINTS) if rng.random() < point_share else None
                    tags[s] = f"{s}-{r + 1}"
                    procs[s] = start_worker(folder, journal, tags[s], capacity,
                                            rng.getrandbits(32), point)
            counts.rounds += 1
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                counts.kills += 1
                _reap(p, counts, signalled_by_us=True)
            else:
                _reap(p, counts, signalled_by_us=False)
    return counts


def point_sweep(folder: Path, workdir: Path, capacity: int = 40 * ENTRY_BYTES,
                timeout_s: float = 90.0) -> Counts:
    """One worker per write point, each running until it kills itself there."""
    counts, journal = Counts(), workdir / "journal"
    journal.mkdir(parents=True, exist_ok=True)
    for i, point in enumerate(KILL_POINTS):
        proc = start_worker(folder, journal, f"p{i}", capacity, 1000 + i, point)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            counts.problems.append(f"kill point {point} was never reached in {timeout_s:.0f} s")
            continue
        if rc == -signal.SIGKILL:
            counts.point_kills += 1
        else:
            counts.problems.append(f"worker for {point} exited with {rc}: "
                                   f"{proc.stderr.read().decode(errors='replace')[-2000:]}")
        counts.rounds += 1
    return counts


def verify(folder: Path, workdir: Path, capacity: int, counts: Counts) -> Counts:
    """Every promise journaled by the workers, checked against the folder."""
    from carnator_core.cache.folder import TrajectoryCache
    lines = read_journals(workdir / "journal")
    stored = {p[1]: int(p[2]) for p in lines if p[0] == "S" and len(p) == 3}
    pinned = {p[1] for p in lines if p[0] == "P"}
    deleted = {p[1] for p in lines if p[0] == "D"}
    counts.wrong_served += sum(1 for p in lines if p[0] == "WRONG")
    counts.loads += sum(1 for p in lines if p[0] == "L" and p[-1] == "1")

    cache = TrajectoryCache(folder, capacity)
    cache.reindex_tensor_files()  # the sweep a later open would do: orphans, temporaries
    removed = {r["entry_id"]: r["reason"] for r in reversed(cache.removals(limit=10**7))}
    for entry_id, seed in stored.items():
        counts.entries_checked += 1
        got = cache.load_tensors(entry_id)
        reason = removed.get(entry_id)
        if got is not None:
            counts.present += 1
            if not same(got, expected_tensors(seed)):
                counts.wrong_served += 1
            if reason in ("evicted", "deleted"):  # committed as removed, yet served again
                counts.resurrected.append(f"{entry_id} ({reason})")
            continue
        if entry_id in pinned and entry_id not in deleted:
            counts.pinned_evicted.append(f"{entry_id} ({reason})")
        elif reason == "evicted" or (reason == "interrupted removal" and entry_id not in deleted):
            counts.evicted += 1
        elif reason in ("deleted", "interrupted removal") and entry_id in deleted:
            counts.deleted += 1
        else:
            counts.lost.append(f"{entry_id} ({reason})")
    _check_folder(cache, counts)
    return counts


def _check_folder(cache, counts: Counts) -> None:
    """Rows and files agree, no temporaries left, every indexed entry loads its own bytes."""
    from cache_fault_worker import expected_tensors as expected
    rows = {r["id"]: r for r in cache.list_entries(0, 10**7)}
    files = {p.name[:-len(".safetensors")] for p in cache.tensor_dir.glob("*.safetensors")}
    if set(rows) != files:
        counts.problems.append(f"rows without files {sorted(set(rows) - files)[:5]}, "
                               f"files without rows {sorted(files - set(rows))[:5]}")
    leftovers = [p.name for p in cache.tensor_dir.iterdir() if ".tmp-" in p.name or p.name.endswith(".removed")]
    leftovers += [p.name for p in cache.folder.glob(".write-test-*")]
    if leftovers:
        counts.problems.append(f"temporary files left: {leftovers[:5]}")
    for entry_id, row in rows.items():
        got = cache.load_tensors(entry_id)
        if got is None or not same(got, expected(int(row["prompt"]))):
            counts.wrong_served += got is not None
            if got is None:
                counts.problems.append(f"indexed entry {entry_id} does not load: {cache.reports[-1:]}")
    cache.evict_to_capacity()
    if cache.stats()["bytes"] > cache.capacity_bytes:
        pinned_bytes = sum(r["bytes"] for r in cache.list_entries(0, 10**7) if r["pinned"])
        if pinned_bytes <= cache.capacity_bytes:
            counts.problems.append("over capacity after eviction")
