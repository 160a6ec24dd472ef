"""The SQLite cache at scale reads only what it needs (issue 14): lookup ranks compact
descriptors kept in memory and refreshed incrementally, size totals are counters kept by
triggers, eviction walks an index, and the integrity check runs once per process.
Engagement is proven by counts and query plans, not by timings (bench/lookup_scale.py)."""
import sqlite3
from pathlib import Path

import numpy as np
import torch
from cache_fault_worker import CLASS_KEY, expected_tensors

from carnator_core.cache import EVICT_BATCH, TrajectoryCache, descriptor_index
from carnator_core.cache_backend import open_cache
from carnator_core.cache_index import UTILITY_ORDER
from carnator_core.cache_repair import IndexRepair

WIDTH = 512


def clustered(n: int, seed: int = 0) -> torch.Tensor:
    """Unit signatures around a few scene centres: many near neighbours, as in a workload."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.nn.functional.normalize(torch.randn(8, WIDTH, generator=g), dim=1)
    picks = torch.randint(0, 8, (n,), generator=g)
    return torch.nn.functional.normalize(centres[picks] + 0.5 * torch.randn(n, WIDTH, generator=g)
                                         / WIDTH ** 0.5, dim=1)


def fill(cache: TrajectoryCache, sigs: torch.Tensor) -> list[str]:
    return [cache.store({"class_key": CLASS_KEY, "exact_key": f"k{i}", "snapshot_steps": "[2]"},
                        expected_tensors(i), s) for i, s in enumerate(sigs)]


def totals_match(folder: Path) -> bool:
    with sqlite3.connect(folder / "carnator.sqlite") as db:
        kept = db.execute("SELECT n, bytes FROM totals").fetchone()
        real = db.execute("SELECT count(*), coalesce(sum(bytes), 0) FROM entries").fetchone()
    return kept == real


def test_lookup_returns_the_exhaustive_ranking_and_refreshes_incrementally(tmp_path):
    cache = TrajectoryCache(tmp_path / "c", 1 << 30)
    sigs = clustered(120)
    ids = fill(cache, sigs)
    queries = torch.nn.functional.normalize(sigs[::7] + 0.3 * torch.randn(18, WIDTH) / WIDTH ** 0.5, dim=1)
    index = descriptor_index(cache.db_path)
    for q in queries:
        found = open_cache(str(tmp_path / "c"), None).lookup(CLASS_KEY, q, 3)
        exhaustive = (sigs @ q).argsort(descending=True)[:3].tolist()
        assert [c.entry.id for c in found.candidates] == [ids[i] for i in exhaustive]
        assert abs(found.candidates[0].similarity - float(sigs[exhaustive[0]] @ q)) < 1e-5
    assert index.rows_read == 120  # every descriptor read once, not once per lookup
    extra = cache.store({"class_key": CLASS_KEY, "exact_key": "new", "snapshot_steps": "[2]"},
                        expected_tensors(500), queries[0])
    cache.delete(ids[0])
    found = cache.lookup(CLASS_KEY, queries[0], 3)
    assert found.candidates[0].entry.id == extra and index.rows_read == 121
    assert ids[0] not in {c.entry.id for c in cache.lookup(CLASS_KEY, sigs[0], 3).candidates}
    assert totals_match(cache.folder)


def test_a_rebuilt_index_reloads_the_descriptors(tmp_path):
    folder = tmp_path / "c"
    cache = TrajectoryCache(folder, 1 << 30)
    ids = fill(cache, clustered(10))
    cache.lookup(CLASS_KEY, clustered(10)[3], 1)
    for suffix in ("", "-wal", "-shm"):  # lost index: rebuilt from the files, new uid
        Path(str(folder / "carnator.sqlite") + suffix).unlink(missing_ok=True)
    again = TrajectoryCache(folder, 1 << 30)
    assert again.lookup(CLASS_KEY, clustered(10)[3], 1).candidates[0].entry.id == ids[3]


def test_integrity_is_checked_once_per_process_and_again_after_damage(tmp_path):
    folder = str(tmp_path / "c")
    first = open_cache(folder, 1 << 30)
    fill(first, clustered(3))
    checks = IndexRepair.full_checks
    for _ in range(5):
        assert open_cache(folder, 1 << 30).stats()["entries"] == 3
    assert IndexRepair.full_checks == checks  # no quick_check per request
    (tmp_path / "c" / "carnator.sqlite").write_bytes(b"not an index" * 500)
    repaired = open_cache(folder, 1 << 30)
    assert IndexRepair.full_checks == checks + 1
    assert repaired.stats()["entries"] == 3 and any("rebuilt" in m for m in repaired.reports)


def test_totals_are_counters_and_eviction_walks_the_utility_index(tmp_path):
    cache = TrajectoryCache(tmp_path / "c", 1 << 30)
    ids = fill(cache, clustered(12))
    cache.set_pinned(ids[0], True)
    size = cache.stats()["bytes"]
    small = TrajectoryCache(tmp_path / "c", size // 3)
    victims = small.evict_to_capacity()
    assert ids[0] not in victims and small.stats()["bytes"] <= size // 3
    assert totals_match(cache.folder)
    with sqlite3.connect(cache.db_path) as db:
        plan = " ".join(r[3] for r in db.execute(
            f"EXPLAIN QUERY PLAN SELECT id, bytes FROM entries WHERE pinned = 0 AND id != ? "
            f"ORDER BY {UTILITY_ORDER} LIMIT ? OFFSET ?", ["", EVICT_BATCH, 0]))
        assert "entries_utility" in plan and "TEMP B-TREE" not in plan, plan
        stats_plan = " ".join(r[3] for r in db.execute("EXPLAIN QUERY PLAN SELECT n, bytes FROM totals"))
        assert "entries" not in stats_plan


def test_a_version_2_index_is_migrated_in_place(tmp_path):
    """Signatures used to sit in each entries row: the first open moves them out."""
    folder = tmp_path / "c"
    cache = TrajectoryCache(folder, 1 << 30)
    sigs = clustered(4)
    ids = fill(cache, sigs)
    with sqlite3.connect(cache.db_path) as db:  # rebuild the v2 layout by hand
        db.execute("ALTER TABLE entries ADD COLUMN signature BLOB")
        for i, s in zip(ids, sigs):
            db.execute("UPDATE entries SET signature = ? WHERE id = ?", [s.numpy().tobytes(), i])
        for t in ("entries_added", "entries_resized", "entries_removed"):
            db.execute(f"DROP TRIGGER {t}")
        for t in ("signatures", "descriptors", "gone", "totals"):
            db.execute(f"DROP TABLE {t}")
        db.execute("DROP INDEX entries_utility")
    migrated = TrajectoryCache(folder, 1 << 30)
    assert migrated.lookup(CLASS_KEY, sigs[2], 1).candidates[0].entry.id == ids[2]
    assert migrated.stats()["entries"] == 4 and totals_match(folder)
    with sqlite3.connect(cache.db_path) as db:
        assert "signature" not in {r[1] for r in db.execute("PRAGMA table_info(entries)")}
    assert np.isclose(migrated.lookup(CLASS_KEY, sigs[1], 1).candidates[0].similarity, 1.0)
