"""The SQLite index's schema, and the few statements that must keep its parts in step.

Since issue 14 an entry's index row is small and fixed-size; what is large lives apart:

    entries      one row per entry: keys, sizes, usage, pins (no signature: it made every
                 row span overflow pages, and every scan of ``bytes`` walk them)
    signatures   id → the full global signature (read only for a lookup's shortlist)
    descriptors  seq, id, class → compact descriptor (cache_descriptors.py); only for
                 entries computed in full, the only reuse sources
    gone         seq, id of every removed entry (trimmed), so each process's in-memory
                 descriptor matrix can follow removals incrementally
    totals       one row: entry count and bytes, kept by triggers in the same transaction
                 as each insert and delete — capacity checks never scan

Triggers keep ``totals``, ``signatures``, ``descriptors`` and ``gone`` right whoever
deletes a row (eviction, repair, another process, a person with the sqlite3 shell).
"""
from __future__ import annotations

import os
import uuid
from typing import Any

import numpy as np

from .cache_descriptors import compact_bytes

GONE_KEPT = 100_000  # removal-log rows kept for processes catching up

# the eviction order, written exactly as the expression index so SQLite walks the index
UTILITY_EXPR = "((steps_saved + 1.0) * (hits + 1.0) / max(bytes, 1))"
UTILITY_ORDER = f"{UTILITY_EXPR} ASC, last_used ASC"

SCHEMA_SQL = [
    "CREATE TABLE IF NOT EXISTS signatures (id TEXT PRIMARY KEY, signature BLOB)",
    "CREATE TABLE IF NOT EXISTS descriptors (seq INTEGER PRIMARY KEY AUTOINCREMENT, "
    "id TEXT NOT NULL UNIQUE, class_key TEXT NOT NULL, width INTEGER, vec BLOB)",
    "CREATE INDEX IF NOT EXISTS descriptors_class ON descriptors (class_key, seq)",
    "CREATE TABLE IF NOT EXISTS gone (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT)",
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
    "DELETE FROM descriptors WHERE id = old.id; "
    "INSERT INTO gone (id) VALUES (old.id); "
    f"DELETE FROM gone WHERE seq <= (SELECT max(seq) FROM gone) - {GONE_KEPT}; END",
]


def reusable(row: dict[str, Any]) -> bool:
    """Only entries computed in full are reuse sources (see TrajectoryCache.lookup)."""
    return not row.get("source_entry")


def create_index_tables(db) -> None:
    """Inside a write transaction: the issue-14 tables, migrating a v2 index in place."""
    from .cache_entry import ENTRY_COLUMNS
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
    for sql in SCHEMA_SQL:
        db.execute(sql)
    if "signature" in db["entries"].columns_dict:
        _move_signatures_out(db)
    if fresh_totals:
        n, size = db.execute("SELECT count(*), coalesce(sum(bytes), 0) FROM entries").fetchone()
        db.execute("INSERT INTO totals (k, n, bytes) VALUES (0, ?, ?)", [n, size])
    if db.execute("SELECT 1 FROM meta WHERE key = 'index_uid'").fetchone() is None:
        db.execute("INSERT INTO meta (key, value) VALUES ('index_uid', ?)", [uuid.uuid4().hex])


def _move_signatures_out(db) -> None:
    """A v1/v2 index kept the signature in each entries row: move it to its own tables
    (once, under the exclusive lock), then drop the column."""
    cur = db.execute("SELECT id, class_key, source_entry, signature FROM entries")
    for entry_id, class_key, source, sig in cur.fetchall():
        put_signature(db, {"id": entry_id, "class_key": class_key, "source_entry": source}, sig)
    db.execute("ALTER TABLE entries DROP COLUMN signature")


def put_signature(db, row: dict[str, Any], signature: bytes | None) -> None:
    """The signature and (for reuse sources) the compact descriptor of a row just inserted."""
    if not isinstance(signature, bytes):
        return
    db.execute("INSERT OR REPLACE INTO signatures (id, signature) VALUES (?, ?)",
               [row["id"], signature])
    if reusable(row) and signature and len(signature) % 4 == 0:
        vec = np.frombuffer(signature, dtype=np.float32)
        db.execute("INSERT OR REPLACE INTO descriptors (id, class_key, width, vec) "
                   "VALUES (?, ?, ?, ?)", [row["id"], row["class_key"], vec.size,
                                           compact_bytes(vec)])


def put_entry(db, row: dict[str, Any]) -> None:
    """Inside a write transaction: insert or replace an entry row with its signature.
    The delete is explicit (not INSERT OR REPLACE) so the triggers see it."""
    signature = row.get("signature")
    db.execute("DELETE FROM entries WHERE id = ?", [row["id"]])
    db["entries"].insert({k: v for k, v in row.items() if k != "signature"}, pk="id")
    put_signature(db, row, signature)


class SqliteDescriptorSource:
    """``DescriptorSource`` over one open connection (cache_descriptors.py)."""

    def __init__(self, db):
        self.db = db

    def index_uid(self) -> str:
        row = self.db.execute("SELECT value FROM meta WHERE key = 'index_uid'").fetchone()
        return row[0] if row else ""

    def descriptors_after(self, class_key: str, seq: int):
        return self.db.execute("SELECT seq, id, vec, width FROM descriptors WHERE class_key = ? "
                               "AND seq > ? ORDER BY seq", [class_key, seq]).fetchall()

    def gone_after(self, seq: int):
        gone = self.db.execute("SELECT seq, id FROM gone WHERE seq > ? ORDER BY seq",
                               [seq]).fetchall()
        lowest = self.db.execute("SELECT min(seq) FROM gone").fetchone()[0] or 0
        return gone, lowest

    def gone_tail(self) -> int:
        return self.db.execute("SELECT max(seq) FROM gone").fetchone()[0] or 0


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
