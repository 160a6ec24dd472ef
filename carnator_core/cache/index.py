"""The SQLite index's schema, and the few statements that must keep its parts in step.

An entry's index row is small and fixed-size; what is large lives apart:

    entries      one row per entry: keys, sizes, usage, pins (no signature: it made every
                 row span overflow pages, and every scan of ``bytes`` walk them)
    signatures   id → the full global signature (read only for a lookup's shortlist)
    descriptor_blocks, descriptor_data, descriptor_slots
                 int8 compact descriptors packed in blocks per class
                 (cache_descriptor_blocks.py). Entries computed in full, the only reuse
                 sources, under their class; reuses under ``served_class`` of it, searched
                 only to see whether a scene was asked before (pipeline.recurring_scene).
                 Lookup scans them; no process holds them all in memory
    totals       one row: entry count and bytes, kept by triggers in the same transaction
                 as each insert and delete — capacity checks never scan

Triggers keep ``totals``, ``signatures`` and the descriptors' alive masks right whoever
deletes a row (eviction, repair, another process, a person with the sqlite3 shell).

Schema 4 (memory flat in the number of entries) replaced schema 3's one-row-per-entry
``descriptors`` table (float32, read into a per-process matrix) and its ``gone`` log; a
schema-3 index is migrated in place on first open (``_move_descriptors_into_blocks``).
"""
from __future__ import annotations

import os
import uuid
from typing import Any

import numpy as np

from .descriptor_blocks import SQLITE, add_descriptors
from .descriptors import COMPACT_DIM, ID_CHARS, BlockHead, quantized, quantized_compact

# 3: signatures and compact descriptors apart from the rows
# 4: descriptors packed in blocks in the index, not a matrix per process (memory)
SCHEMA_VERSION = 4

# the eviction order, written exactly as the expression index so SQLite walks the index
UTILITY_EXPR = "((steps_saved + 1.0) * (hits + 1.0) / max(bytes, 1))"
UTILITY_ORDER = f"{UTILITY_EXPR} ASC, last_used ASC"

SCHEMA_SQL = [
    "CREATE TABLE IF NOT EXISTS signatures (id TEXT PRIMARY KEY, signature BLOB)",
    # AUTOINCREMENT: a block number is never reused, so a process's cached block stays its
    "CREATE TABLE IF NOT EXISTS descriptor_blocks (block INTEGER PRIMARY KEY AUTOINCREMENT, "
    "class_key TEXT NOT NULL, width INTEGER NOT NULL, n INTEGER NOT NULL, live INTEGER NOT NULL, "
    "alive TEXT NOT NULL)",
    "CREATE INDEX IF NOT EXISTS descriptor_blocks_class ON descriptor_blocks (class_key, width, n)",
    "CREATE TABLE IF NOT EXISTS descriptor_data (block INTEGER PRIMARY KEY, ids TEXT NOT NULL, "
    "vecs BLOB NOT NULL)",
    "CREATE TABLE IF NOT EXISTS descriptor_slots (id TEXT PRIMARY KEY, block INTEGER NOT NULL, "
    "slot INTEGER NOT NULL) WITHOUT ROWID",
    "CREATE TABLE IF NOT EXISTS totals (k INTEGER PRIMARY KEY CHECK (k = 0), n INTEGER, "
    "bytes INTEGER)",
    f"CREATE INDEX IF NOT EXISTS entries_utility ON entries (pinned, {UTILITY_EXPR}, last_used)",
    "CREATE INDEX IF NOT EXISTS entries_created ON entries (created)",
    "CREATE TRIGGER IF NOT EXISTS entries_added AFTER INSERT ON entries BEGIN "
    "UPDATE totals SET n = n + 1, bytes = bytes + coalesce(new.bytes, 0); END",
    "CREATE TRIGGER IF NOT EXISTS entries_resized AFTER UPDATE OF bytes ON entries BEGIN "
    "UPDATE totals SET bytes = bytes - coalesce(old.bytes, 0) + coalesce(new.bytes, 0); END",
    "CREATE TRIGGER IF NOT EXISTS entries_removed AFTER DELETE ON entries BEGIN "
    "UPDATE totals SET n = n - 1, bytes = bytes - coalesce(old.bytes, 0); "
    "DELETE FROM signatures WHERE id = old.id; "
    # the removed entry's slot becomes '0' in its block's alive mask; an empty block goes
    "UPDATE descriptor_blocks SET live = live - 1, alive = substr(alive, 1, s.slot) || '0' || "
    "substr(alive, s.slot + 2) FROM (SELECT block, slot FROM descriptor_slots WHERE id = old.id) "
    "AS s WHERE descriptor_blocks.block = s.block; "
    "DELETE FROM descriptor_data WHERE block = (SELECT s.block FROM descriptor_slots s JOIN "
    "descriptor_blocks b ON b.block = s.block WHERE s.id = old.id AND b.live = 0); "
    "DELETE FROM descriptor_blocks WHERE live = 0 AND block = "
    "(SELECT block FROM descriptor_slots WHERE id = old.id); "
    "DELETE FROM descriptor_slots WHERE id = old.id; END",
]


def reusable(row: dict[str, Any]) -> bool:
    """Only entries computed in full are reuse sources (see TrajectoryCache.lookup)."""
    return not row.get("source_entry")


SERVED_SUFFIX = "#served"


def served_class(class_key: str) -> str:
    """The descriptor class of a class's reuses: a lookup of ``class_key`` never sees them,
    one of this key sees only them (no snapshots: they show that a scene was asked before)."""
    return class_key + SERVED_SUFFIX


def create_index_tables(db) -> None:
    """Inside a write transaction: the compact-row tables, migrating a v2 index in place."""
    from .entry import ENTRY_COLUMNS
    tables = set(db.table_names())
    if "entries" not in tables:
        db["entries"].create({k: v for k, v in ENTRY_COLUMNS.items() if k != "signature"},
                             pk="id", not_null={"class_key"})
        db["entries"].create_index(["class_key"])
        db["entries"].create_index(["exact_key"])
    elif "checksum" not in db["entries"].columns_dict:
        # rows written before checksums stay usable: their files are checked for entry
        # id, structure and finite values, but their bytes are unverified
        db.execute("ALTER TABLE entries ADD COLUMN checksum TEXT")
    fresh_totals = "totals" not in tables
    if "descriptors" in tables:  # schema 3: its delete trigger wrote the tables dropped here
        db.execute("DROP TRIGGER IF EXISTS entries_removed")
    for sql in SCHEMA_SQL:
        db.execute(sql)
    if "descriptors" in tables:
        _move_descriptors_into_blocks(db)
    if "signature" in db["entries"].columns_dict:
        _move_signatures_out(db)
    if fresh_totals:
        n, size = db.execute("SELECT count(*), coalesce(sum(bytes), 0) FROM entries").fetchone()
        db.execute("INSERT INTO totals (k, n, bytes) VALUES (0, ?, ?)", [n, size])
    # new block tables number blocks from 1 again: no process may keep a block it cached
    if "descriptor_blocks" not in tables or db.execute(
            "SELECT 1 FROM meta WHERE key = 'index_uid'").fetchone() is None:
        db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('index_uid', ?)",
                   [uuid.uuid4().hex])


def _move_signatures_out(db) -> None:
    """A v1/v2 index kept the signature in each entries row: move it to its own tables
    (once, under the exclusive lock), then drop the column."""
    cur = db.execute("SELECT id, class_key, source_entry, signature FROM entries")
    descriptors = []
    for entry_id, class_key, source, sig in cur.fetchall():
        row = {"id": entry_id, "class_key": class_key, "source_entry": source}
        put_signature(db, row, sig)
        descriptors.append(descriptor_of(row, sig))
    add_descriptors(db.execute, SQLITE, [d for d in descriptors if d is not None])
    db.execute("ALTER TABLE entries DROP COLUMN signature")


def _move_descriptors_into_blocks(db) -> None:
    """A schema-3 index kept one float32 descriptor row per entry (and a removal log for
    the in-memory matrices): pack them into blocks, in insertion order, then drop both."""
    rows = db.execute("SELECT d.id, d.class_key, d.width, d.vec FROM descriptors d JOIN entries "
                      "e ON e.id = d.id ORDER BY d.seq").fetchall()
    add_descriptors(db.execute, SQLITE, [(i, c, w, quantized_compact(np.frombuffer(v, np.float32)))
                                         for i, c, w, v in rows if v and len(v) % 4 == 0])
    db.execute("DROP TABLE descriptors")
    db.execute("DROP TABLE IF EXISTS gone")


def put_signature(db, row: dict[str, Any], signature: bytes | None) -> None:
    """The signature of a row just inserted (its descriptor: ``descriptor_of``)."""
    if isinstance(signature, bytes):
        db.execute("INSERT OR REPLACE INTO signatures (id, signature) VALUES (?, ?)",
                   [row["id"], signature])


def descriptor_of(row: dict[str, Any], signature) -> tuple[str, str, int, bytes] | None:
    """The block row of an entry's compact descriptor: a reuse source's under its class, a
    reuse's under ``served_class`` (None without a usable signature)."""
    if not isinstance(signature, (bytes, bytearray, memoryview)):
        return None
    signature = bytes(signature)
    if not signature or len(signature) % 4:
        return None
    vec = np.frombuffer(signature, dtype=np.float32)
    klass = row["class_key"] if reusable(row) else served_class(row["class_key"])
    return row["id"], klass, vec.size, quantized(vec)


def put_entries(db, rows: list[dict[str, Any]]) -> None:
    """Inside a write transaction: insert or replace entry rows with their signatures and
    descriptors (appended to their blocks once per call: a bulk import does not rewrite a
    block per row). The delete is explicit (not INSERT OR REPLACE) so the triggers see it."""
    descriptors = []
    for row in rows:
        signature = row.get("signature")
        db.execute("DELETE FROM entries WHERE id = ?", [row["id"]])
        db["entries"].insert({k: v for k, v in row.items() if k != "signature"}, pk="id")
        put_signature(db, row, signature)
        descriptors.append(descriptor_of(row, signature))
    add_descriptors(db.execute, SQLITE, [d for d in descriptors if d is not None])


def put_entry(db, row: dict[str, Any]) -> None:
    put_entries(db, [row])


class SqliteDescriptorSource:
    """``DescriptorSource`` over one open connection inside a read transaction
    (cache_descriptors.py)."""

    def __init__(self, db):
        self.db = db

    def index_uid(self) -> str:
        row = self.db.execute("SELECT value FROM meta WHERE key = 'index_uid'").fetchone()
        return row[0] if row else ""

    def heads(self, class_key: str) -> list[BlockHead]:
        return [BlockHead(*r) for r in self.db.execute(
            "SELECT block, width, n, live, alive FROM descriptor_blocks WHERE class_key = ?",
            [class_key])]

    def rows_after(self, wanted: list[tuple[int, int]]):
        values = ", ".join(["(?, ?)"] * len(wanted))
        return self.db.execute(
            f"WITH r(block, skip) AS (VALUES {values}) SELECT d.block, "
            f"substr(d.ids, r.skip * {ID_CHARS} + 1), substr(d.vecs, r.skip * {COMPACT_DIM} + 1) "
            "FROM r JOIN descriptor_data d ON d.block = r.block", [x for w in wanted for x in w])


def totals(db) -> tuple[int, int]:
    row = db.execute("SELECT n, bytes FROM totals WHERE k = 0").fetchone()
    return (int(row[0]), int(row[1])) if row else (0, 0)


# ------------------------------------------------------------------ checked once per process
# Index files this process has fully checked (quick_check, rows vs files), by path, with
# the file's identity then. A request reopening the cache skips the check unless the file
# was replaced or looks truncated (cache_backend.open_cache); damage met during an
# operation drops the mark, so the next open checks in full.
checked: dict[str, tuple[int, int]] = {}


def forget_checked(db_path) -> None:
    checked.pop(str(db_path), None)


def file_identity(db_path) -> tuple[int, int] | None:
    """(device, inode) of an index file whose header looks whole, else None: the cheap
    test that stands in for quick_check on every request."""
    try:
        with open(db_path, "rb") as f:
            st = os.fstat(f.fileno())
            head = f.read(100)
    except OSError:
        return None
    if len(head) < 100 or not head.startswith(b"SQLite format 3\x00"):
        return None
    page = int.from_bytes(head[16:18], "big")
    page = 65536 if page == 1 else page
    pages = int.from_bytes(head[28:32], "big")
    if st.st_size < page * pages:  # cut short
        return None
    return (st.st_dev, st.st_ino)
