"""The SQLite cache at scale reads only what it needs: lookup scans compact
descriptor blocks kept in the index, holding at most a fixed budget of them in memory and
re-reading only rows appended since, size totals are counters kept by triggers, eviction
walks an index, and the integrity check runs once per process. Engagement is proven by
counts and query plans, not by timings (bench/lookup_scale.py)."""
import sqlite3
from pathlib import Path

import numpy as np
import torch
from cache_fault_worker import CLASS_KEY, expected_tensors

from carnator_core.cache.folder import EVICT_BATCH, TrajectoryCache
from carnator_core.cache.descriptors import BLOCK_ROWS, BLOCKS, Packed, compact
from carnator_core.cache.backend import open_cache
from carnator_core.cache.index import UTILITY_ORDER
from carnator_core.cache.repair import IndexRepair

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


def test_lookup_returns_the_exhaustive_ranking_and_rereads_only_what_changed(tmp_path):
    cache = TrajectoryCache(tmp_path / "c", 1 << 30)
    sigs = clustered(120)
    ids = fill(cache, sigs)
    queries = torch.nn.functional.normalize(sigs[::7] + 0.3 * torch.randn(18, WIDTH) / WIDTH ** 0.5, dim=1)
    start = BLOCKS.rows_read
    for q in queries:
        found = open_cache(str(tmp_path / "c"), None).lookup(CLASS_KEY, q, 3)
        exhaustive = (sigs @ q).argsort(descending=True)[:3].tolist()
        assert [c.entry.id for c in found.candidates] == [ids[i] for i in exhaustive]
        assert abs(found.candidates[0].similarity - float(sigs[exhaustive[0]] @ q)) < 1e-5
    # within the block budget: every descriptor read once, not once per lookup
    assert BLOCKS.rows_read - start == 120
    extra = cache.store({"class_key": CLASS_KEY, "exact_key": "new", "snapshot_steps": "[2]"},
                        expected_tensors(500), queries[0])
    cache.delete(ids[0])
    found = cache.lookup(CLASS_KEY, queries[0], 3)
    # the appended row only; the removal is a byte of the block head, read every lookup
    assert found.candidates[0].entry.id == extra and BLOCKS.rows_read - start == 121
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


def filled_cache(tmp_path, n: int):
    """(folder, cache, signatures, ids): a cache of ``n`` clustered entries, to age by hand."""
    folder = tmp_path / "c"
    cache = TrajectoryCache(folder, 1 << 30)
    sigs = clustered(n)
    return folder, cache, sigs, fill(cache, sigs)


def test_a_version_2_index_is_migrated_in_place(tmp_path):
    """Signatures used to sit in each entries row: the first open moves them out."""
    folder, cache, sigs, ids = filled_cache(tmp_path, 4)
    with sqlite3.connect(cache.db_path) as db:  # rebuild the v2 layout by hand
        db.execute("ALTER TABLE entries ADD COLUMN signature BLOB")
        for i, s in zip(ids, sigs):
            db.execute("UPDATE entries SET signature = ? WHERE id = ?", [s.numpy().tobytes(), i])
        for t in ("entries_added", "entries_resized", "entries_removed"):
            db.execute(f"DROP TRIGGER {t}")
        for t in ("signatures", "descriptor_blocks", "descriptor_data", "descriptor_slots", "totals"):
            db.execute(f"DROP TABLE {t}")
        db.execute("DROP INDEX entries_utility")
    migrated = TrajectoryCache(folder, 1 << 30)
    assert migrated.lookup(CLASS_KEY, sigs[2], 1).candidates[0].entry.id == ids[2]
    assert migrated.stats()["entries"] == 4 and totals_match(folder)
    with sqlite3.connect(cache.db_path) as db:
        assert "signature" not in {r[1] for r in db.execute("PRAGMA table_info(entries)")}
    assert np.isclose(migrated.lookup(CLASS_KEY, sigs[1], 1).candidates[0].similarity, 1.0)


# schema 3's descriptor tables and delete trigger, as that version created them
V3_SQL = [
    "CREATE TABLE descriptors (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, "
    "class_key TEXT NOT NULL, width INTEGER, vec BLOB)",
    "CREATE TABLE gone (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT)",
    "CREATE TRIGGER entries_removed AFTER DELETE ON entries BEGIN "
    "UPDATE totals SET n = n - 1, bytes = bytes - coalesce(old.bytes, 0); "
    "DELETE FROM signatures WHERE id = old.id; DELETE FROM descriptors WHERE id = old.id; "
    "INSERT INTO gone (id) VALUES (old.id); END",
]


def test_a_version_3_index_is_migrated_in_place(tmp_path):
    """Schema 3 kept one float32 descriptor row per entry: the first open packs them into
    blocks, drops the old tables and its trigger, and deletes then tombstone as they should."""
    folder, cache, sigs, ids = filled_cache(tmp_path, 6)
    with sqlite3.connect(cache.db_path) as db:  # rebuild the v3 layout by hand
        db.execute("DROP TRIGGER entries_removed")
        for t in ("descriptor_blocks", "descriptor_data", "descriptor_slots"):
            db.execute(f"DROP TABLE {t}")
        for sql in V3_SQL:
            db.execute(sql)
        for i, s in zip(ids, sigs):
            db.execute("INSERT INTO descriptors (id, class_key, width, vec) VALUES (?, ?, ?, ?)",
                       [i, CLASS_KEY, WIDTH, compact(s.numpy()).tobytes()])
        db.execute("UPDATE meta SET value = '3' WHERE key = 'schema_version'")
    BLOCKS.forget()
    migrated = TrajectoryCache(folder, 1 << 30)
    assert migrated.lookup(CLASS_KEY, sigs[2], 1).candidates[0].entry.id == ids[2]
    migrated.delete(ids[2])
    assert migrated.lookup(CLASS_KEY, sigs[2], 1).candidates[0].entry.id != ids[2]
    with sqlite3.connect(cache.db_path) as db:
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        assert "descriptors" not in tables and "gone" not in tables
        assert db.execute("SELECT n, live, alive FROM descriptor_blocks").fetchall() == [(6, 5, "110111")]
        assert db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == ("4",)
    assert totals_match(folder)


def bulk(cache: TrajectoryCache, sigs: torch.Tensor, start: int = 0) -> list[str]:
    """Index rows with signatures, no files (lookup never reads them): many entries fast."""
    ids = [f"{start + i + 1:032x}" for i in range(len(sigs))]
    cache.import_rows([{"id": i, "class_key": CLASS_KEY, "exact_key": i, "snapshot_steps": "[2]",
                        "bytes": 1000, "created": 0.0, "last_used": 0.0, "hits": 0,
                        "steps_saved": 0.0, "pinned": 0, "signature": s.numpy().tobytes()}
                       for i, s in zip(ids, sigs)])
    return ids


def test_lookup_memory_is_bounded_by_the_block_budget_not_the_entries(tmp_path, monkeypatch):
    """Descriptor rows held in the process after lookups over N entries stay within the
    configured budget (two blocks here) for N = 300 and N = 3,000; the rest is read from
    the index on every lookup, and ranking is still the exhaustive one."""
    budget = 2 * Packed(BLOCK_ROWS, "0" * 32 * BLOCK_ROWS, np.zeros((BLOCK_ROWS, 128), np.int8)).nbytes
    monkeypatch.setattr(BLOCKS, "budget", budget)
    held = {}
    for n in (300, 3000):
        BLOCKS.forget()
        cache = TrajectoryCache(tmp_path / f"c{n}", 1 << 40)
        sigs = clustered(n, seed=n)
        ids = bulk(cache, sigs)
        start = BLOCKS.rows_read
        for i in range(0, n, n // 10):
            q = torch.nn.functional.normalize(sigs[i] + 0.3 * torch.randn(WIDTH) / WIDTH ** 0.5, dim=0)
            found = cache.lookup(CLASS_KEY, q, 1)
            assert found.candidates[0].entry.id == ids[int((sigs @ q).argmax())]
        assert BLOCKS.bytes <= budget
        held[n] = BLOCKS.rows_held()
        # whatever is not held is read again by each lookup: scanned, not accumulated
        assert BLOCKS.rows_read - start == n + 9 * (n - held[n])
    assert held[300] == 300 and held[3000] <= 2 * BLOCK_ROWS


def test_removals_tombstone_and_stores_compact_sparse_blocks(tmp_path):
    """Evicted or deleted entries leave ranking at once (the trigger clears their slot);
    a block at most half alive is rewritten by the next store, an empty one disappears."""
    cache = TrajectoryCache(tmp_path / "c", 1 << 40)
    sigs = clustered(3 * BLOCK_ROWS)
    ids = bulk(cache, sigs)
    with cache._write() as db:  # the first block: all but 10 gone; the second: all gone
        db.execute("DELETE FROM entries WHERE id IN (SELECT id FROM descriptor_slots WHERE "
                   "block = (SELECT min(block) FROM descriptor_blocks) AND slot >= 10)")
        db.execute(f"DELETE FROM entries WHERE id IN ({','.join('?' * BLOCK_ROWS)})",
                   ids[BLOCK_ROWS:2 * BLOCK_ROWS])
    gone = ids[10:2 * BLOCK_ROWS]
    assert cache.lookup(CLASS_KEY, sigs[20], 1).candidates[0].entry.id not in gone
    with sqlite3.connect(cache.db_path) as db:
        assert db.execute("SELECT count(*), sum(live) FROM descriptor_blocks").fetchone() == (2, 10 + BLOCK_ROWS)
    bulk(cache, clustered(1, seed=9), start=10_000)  # a store compacts the sparse block
    with sqlite3.connect(cache.db_path) as db:
        heads = db.execute("SELECT n, live FROM descriptor_blocks ORDER BY block").fetchall()
        assert heads == [(BLOCK_ROWS, BLOCK_ROWS), (11, 11)], heads
        assert db.execute("SELECT count(*) FROM descriptor_data").fetchone() == (2,)
        assert db.execute("SELECT count(*) FROM descriptor_slots").fetchone() == (BLOCK_ROWS + 11,)
    for i in (3, 2 * BLOCK_ROWS + 5):
        assert cache.lookup(CLASS_KEY, sigs[i], 1).candidates[0].entry.id == ids[i]
    assert totals_match(cache.folder)
