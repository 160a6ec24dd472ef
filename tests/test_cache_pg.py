"""The PostgreSQL backend against a real server (tests/pg_cluster.py): the migration
command copies a cache SQLite → PostgreSQL → SQLite with every entry, pin and hit, verified
on the way (damage never travels); named tensors are read by byte ranges."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cache_fault_worker import CLASS_KEY, expected_tensors, same, signature_of
from pg_cluster import PgCluster, pg_bin

from carnator_core.cache.folder import TrajectoryCache
from carnator_core.cache.backend import open_cache

pytest.importorskip("psycopg", reason="psycopg[binary] is in requirements-test.txt")
pytestmark = pytest.mark.skipif(pg_bin() is None, reason="PostgreSQL server not installed")
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def cluster():
    c = PgCluster().start()
    yield c
    c.stop(remove=True)


def migrate(src: str, dst: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / "migrate_cache.py"), src, dst],
                          capture_output=True, text=True, timeout=300)


def test_a_cache_goes_to_postgresql_and_back(cluster, tmp_path):
    folder = tmp_path / "sqlite"
    cache = TrajectoryCache(folder, 1 << 30)
    ids = {cache.store({"class_key": CLASS_KEY, "exact_key": str(i), "snapshot_steps": "[2]"},
                       expected_tensors(i), signature_of(i)): i for i in range(6)}
    keep, used, damaged = list(ids)[:3]
    cache.set_pinned(keep, True)
    cache.record_use(used, 7)
    path = cache.tensor_path(damaged)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # bit rot in one entry: it must not travel
    path.write_bytes(bytes(data))

    url = cluster.url("migrated")
    out = migrate(str(folder), url)
    assert out.returncode == 1, out.stderr  # one entry skipped
    assert "5 entries copied, 1 skipped" in out.stdout and damaged in out.stdout
    pg = open_cache(url, 1 << 30)
    assert pg.stats()["entries"] == 5 and pg.get(damaged) is None
    assert pg.get(keep).row["pinned"] == 1 and pg.get(used).row["hits"] == 1
    for entry_id, seed in ids.items():
        if entry_id != damaged:
            assert same(pg.load_tensors(entry_id), expected_tensors(seed))
            assert pg.lookup(CLASS_KEY, signature_of(seed), 1).candidates[0].entry.id == entry_id

    back = tmp_path / "back"
    out = migrate(url, str(back))
    assert out.returncode == 0 and "5 entries copied, 0 skipped" in out.stdout, out.stdout + out.stderr
    again = TrajectoryCache(back, 1 << 30)
    assert again.stats()["entries"] == 5 and again.get(keep).row["pinned"] == 1
    for entry_id, seed in ids.items():
        if entry_id != damaged:
            assert same(again.load_tensors(entry_id), expected_tensors(seed))
    for suffix in ("", "-wal", "-shm"):  # the copied files alone rebuild it, pins included
        Path(str(back / "carnator.sqlite") + suffix).unlink(missing_ok=True)
    rebuilt = TrajectoryCache(back, 1 << 30)
    assert rebuilt.stats()["entries"] == 5 and rebuilt.get(keep).row["pinned"] == 1
    assert migrate(url, str(back)).returncode == 0  # copying again is safe
    assert TrajectoryCache(back, 1 << 30).stats()["entries"] == 5


def test_postgresql_reads_only_the_tensors_asked_for(cluster):
    """A candidate's tile maps are read by byte ranges: the blob's other tensors stay in the
    database (counted in bytes fetched, not timed), and damage to a tensor read that way
    is still caught and quarantined."""
    import io

    import psycopg

    from carnator_core.cache.files import read_header
    url = cluster.url("ranges")
    cache = open_cache(url, 1 << 30)
    big = {**expected_tensors(3), "snapshot.9": torch.randn(1, 16, 8, 64, 64)}  # 2 MB
    entry_id = cache.store({"class_key": CLASS_KEY, "exact_key": "r", "snapshot_steps": "[2]"},
                           big, signature_of(3))
    fetched = cache.state.blob_bytes_read
    got = cache.load_tensors(entry_id, ["tile_steps", "final"])
    assert same(got, {k: big[k] for k in ("tile_steps", "final")}) and "snapshot.9" not in got
    assert 0 < cache.state.blob_bytes_read - fetched < 100_000  # not the 2 MB snapshot

    with psycopg.connect(url, autocommit=True) as conn:  # flip one byte inside snapshot.9
        data = bytes(conn.execute("SELECT data FROM carnator_blobs WHERE id = %s", [entry_id]).fetchone()[0])
        header, _, start = read_header(io.BytesIO(data), Path("x"), len(data))
        at = start + header["snapshot.9"]["data_offsets"][0] + 100
        conn.execute("UPDATE carnator_blobs SET data = overlay(data PLACING %s FROM %s FOR 1) "
                     "WHERE id = %s", [bytes([data[at] ^ 0xFF]), at + 1, entry_id])
    assert same(cache.load_tensors(entry_id, ["final"]), {"final": big["final"]})
    assert cache.load_tensors(entry_id, ["snapshot.9"]) is None
    assert any(entry_id in m and "quarantined" in m for m in cache.reports), cache.reports
    assert open_cache(url, 1 << 30).get(entry_id) is None


def test_postgresql_lookup_holds_a_fixed_budget_and_migrates_the_previous_layout(cluster, monkeypatch):
    """Lookup scans the class's descriptor blocks from the database: the worker holds at
    most its block budget (one block here) whatever the entries, ranking stays exhaustive,
    a delete leaves ranking at once; a database of the previous layout (one descriptor row
    per entry) is packed into blocks on the first connection."""
    import numpy as np
    import psycopg

    from carnator_core.cache.descriptors import BLOCK_ROWS, BLOCKS, Packed, compact
    from test_cache_scale import WIDTH, clustered
    budget = Packed(BLOCK_ROWS, "0" * 32 * BLOCK_ROWS, np.zeros((BLOCK_ROWS, 128), np.int8)).nbytes
    monkeypatch.setattr(BLOCKS, "budget", budget)
    BLOCKS.forget()
    url = cluster.url("blocks")
    cache = open_cache(url, 1 << 40)
    sigs = clustered(700, seed=4)
    ids = [f"{i + 1:032x}" for i in range(len(sigs))]
    cache.import_rows([{"id": i, "class_key": CLASS_KEY, "exact_key": i, "bytes": 1000,
                        "created": 0.0, "last_used": 0.0, "hits": 0, "steps_saved": 0.0,
                        "pinned": 0, "signature": s.numpy().tobytes()} for i, s in zip(ids, sigs)])

    def ranks_exhaustively(skip=()):
        for i in range(0, len(sigs), 70):
            q = torch.nn.functional.normalize(sigs[i] + 0.3 * torch.randn(WIDTH) / WIDTH ** 0.5, dim=0)
            best = [j for j in (sigs @ q).argsort(descending=True).tolist() if ids[j] not in skip][0]
            assert cache.lookup(CLASS_KEY, q, 1).candidates[0].entry.id == ids[best]
    ranks_exhaustively()
    assert BLOCKS.bytes <= budget and BLOCKS.rows_held() <= BLOCK_ROWS
    assert cache.delete(ids[70])
    ranks_exhaustively(skip={ids[70]})

    with psycopg.connect(url, autocommit=True) as conn:  # back to the previous layout
        for t in ("blocks", "data", "slots"):
            conn.execute(f"DROP TABLE carnator_descriptor_{t}")
        conn.execute("CREATE TABLE carnator_descriptors (seq bigserial PRIMARY KEY, id text NOT NULL "
                     "UNIQUE, class_key text NOT NULL, width integer, vec bytea)")
        conn.execute("CREATE TABLE carnator_gone (seq bigserial PRIMARY KEY, id text)")
        with conn.cursor() as cur:
            cur.executemany("INSERT INTO carnator_descriptors (id, class_key, width, vec) VALUES "
                            "(%s, %s, %s, %s)", [(i, CLASS_KEY, WIDTH, compact(s.numpy()).tobytes())
                                                 for i, s in zip(ids, sigs) if i != ids[70]])
    cache.state.schema_ready = False  # as a worker of the new version starting
    cache._drop_connection()
    ranks_exhaustively(skip={ids[70]})
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT to_regclass('carnator_descriptors'), to_regclass('carnator_gone')"
                            ).fetchone() == (None, None)
        assert conn.execute("SELECT sum(live) FROM carnator_descriptor_blocks").fetchone() == (699,)


PG_REMOVER = """
import sys
sys.path.insert(0, {repo!r})
from carnator_core.cache.backend import open_cache
url, op, arg = sys.argv[1:4]
if op == "delete":
    open_cache(url, 1 << 30).delete(arg)
else:
    open_cache(url, int(arg)).evict_to_capacity()
"""


@pytest.mark.parametrize("op,point", [("delete", "pg.delete.deleted"), ("delete", "pg.delete.committed"),
                                      ("evict", "pg.evict.deleted"), ("evict", "pg.evict.committed")])
def test_a_postgresql_removal_killed_at_any_point_is_all_or_nothing_and_final(cluster, op, point):
    """A worker SIGKILLed inside a delete or an eviction (before its commit) removed nothing;
    killed after it, what the removal log says is gone stays gone for every later worker:
    row, blob and signature go in one transaction, and nothing re-indexes them."""
    import psycopg
    url = cluster.url(f"removal_{point.replace('.', '_')}")
    cache = open_cache(url, 1 << 30)
    seeds = {cache.store({"class_key": CLASS_KEY, "exact_key": f"k{s}", "snapshot_steps": "[2]"},
                         expected_tensors(s), signature_of(s)): s for s in range(8)}
    target = sorted(seeds)[3]
    capacity = cache.stats()["bytes"] // 2
    proc = subprocess.run([sys.executable, "-c", PG_REMOVER.format(repo=str(REPO)), url, op,
                           target if op == "delete" else str(capacity)], capture_output=True,
                          text=True, timeout=120, env={**__import__("os").environ,
                                                      "CARNATOR_TEST_KILL_AT": point})
    assert proc.returncode == -9, proc.stderr[-2000:]
    later = open_cache(url, 1 << 30)
    removed = {r["entry_id"] for r in later.removals()}
    if point.endswith(".deleted"):  # killed before the commit: nothing happened
        assert not removed and later.stats()["entries"] == 8
    else:
        assert removed and (removed == {target} if op == "delete" else later.stats()["bytes"] <= capacity)
    for entry_id, seed in seeds.items():
        got = later.load_tensors(entry_id)
        assert (got is None) == (entry_id in removed), (point, entry_id)
        if got is not None:
            assert same(got, expected_tensors(seed))
    with psycopg.connect(url) as conn:  # no blob or signature outlives its row
        orphans = conn.execute("SELECT (SELECT count(*) FROM carnator_blobs) + (SELECT count(*) FROM "
                               "carnator_signatures) - 2 * (SELECT count(*) FROM carnator_entries)").fetchone()
    assert orphans == (0,)
