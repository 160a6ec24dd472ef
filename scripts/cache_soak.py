"""A longer run of the cache fault-injection harness (tests/cache_faults.py), outside CI.

    .venv/bin/python scripts/cache_soak.py [--minutes 10] [--workers 4] [--folder DIR]

Repeats kill storms (one SIGKILL per round, some restarts dying at a write point) and
write-point sweeps on one cache folder until the time is up, then checks every promise and
prints the counts. Exit status 1 if anything was lost, wrongly served or left inconsistent.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from cache_faults import ENTRY_BYTES, Counts, kill_storm, point_sweep, verify  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=20, help="kills per storm")
    ap.add_argument("--capacity-entries", type=int, default=80)
    ap.add_argument("--folder", type=Path, default=None, help="work folder (default: a temporary one)")
    args = ap.parse_args()
    work = args.folder or Path(tempfile.mkdtemp(prefix="carnator-soak-"))
    folder, capacity = work / "cache", args.capacity_entries * ENTRY_BYTES
    total, storms, t0 = Counts(), 0, time.monotonic()
    while time.monotonic() - t0 < args.minutes * 60:
        c = kill_storm(folder, work, workers=args.workers, rounds=args.rounds, capacity=capacity,
                       seed=storms)
        s = point_sweep(folder, work, capacity=capacity)
        total.rounds += c.rounds + s.rounds
        total.kills += c.kills
        total.point_kills += c.point_kills + s.point_kills
        total.problems += c.problems + s.problems
        storms += 1
        print(f"[{(time.monotonic() - t0) / 60:5.1f} min] storm {storms}: {c.line()}", flush=True)
    total = verify(folder, work, capacity, total)
    print(f"soak: {storms} storms in {(time.monotonic() - t0) / 60:.1f} min, {args.workers} processes")
    print("soak:", total.line())
    for what in (total.lost, total.pinned_evicted, total.problems):
        for line in what[:20]:
            print("  PROBLEM", line)
    return 0 if total.ok() else 1


if __name__ == "__main__":
    sys.exit(main())
