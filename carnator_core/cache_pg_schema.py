"""PostgreSQL schema of the shared cache, and the statements that keep its parts in step.

The same split as the SQLite index (cache_index.py): small entry rows; full signatures,
compact descriptors and tensor blobs in their own tables (``ON DELETE CASCADE``); a
``carnator_gone`` removal log and a ``carnator_totals`` row kept by triggers. Every
statement is idempotent (IF NOT EXISTS / OR REPLACE), so workers starting at once, under
an advisory lock, agree on one schema.
"""
from __future__ import annotations

import re
from typing import Any

import numpy as np

from .cache_entry import ENTRY_COLUMNS
from .cache_descriptors import compact_bytes
from .cache_index import GONE_KEPT, reusable

_PG_TYPES = {str: "text", int: "bigint", float: "double precision"}
ROW_COLUMNS = [c for c in ENTRY_COLUMNS if c != "signature"]
COLUMNS = ", ".join(f"e.{c}" for c in ROW_COLUMNS)
UTILITY_EXPR = "((steps_saved + 1.0) * (hits + 1.0) / greatest(bytes, 1))"
UTILITY_ORDER = f"{UTILITY_EXPR} ASC, last_used ASC"

_entry_cols = ", ".join(f"{c} {_PG_TYPES[t]}" + (" PRIMARY KEY" if c == "id" else "")
                        for c, t in ENTRY_COLUMNS.items() if c != "signature")
_child = "id text PRIMARY KEY REFERENCES carnator_entries (id) ON DELETE CASCADE"

SCHEMA = [
    f"CREATE TABLE IF NOT EXISTS carnator_entries ({_entry_cols})",
    "CREATE INDEX IF NOT EXISTS carnator_entries_class ON carnator_entries (class_key)",
    "CREATE INDEX IF NOT EXISTS carnator_entries_exact ON carnator_entries (exact_key)",
    "CREATE INDEX IF NOT EXISTS carnator_entries_created ON carnator_entries (created)",
    f"CREATE INDEX IF NOT EXISTS carnator_entries_utility ON carnator_entries "
    f"(pinned, {UTILITY_EXPR}, last_used)",
    f"CREATE TABLE IF NOT EXISTS carnator_signatures ({_child}, signature bytea)",
    f"CREATE TABLE IF NOT EXISTS carnator_blobs ({_child}, data bytea)",
    # uncompressed out-of-line: substring() reads one tensor without the rest of the blob
    "DO $$ BEGIN IF (SELECT attstorage FROM pg_attribute WHERE attrelid = "
    "'carnator_blobs'::regclass AND attname = 'data') <> 'e' THEN "
    "ALTER TABLE carnator_blobs ALTER COLUMN data SET STORAGE EXTERNAL; END IF; END $$",
    "CREATE TABLE IF NOT EXISTS carnator_descriptors (seq bigserial PRIMARY KEY, id text NOT NULL "
    "UNIQUE REFERENCES carnator_entries (id) ON DELETE CASCADE, class_key text NOT NULL, "
    "width integer, vec bytea)",
    "CREATE INDEX IF NOT EXISTS carnator_descriptors_class ON carnator_descriptors (class_key, seq)",
    "CREATE TABLE IF NOT EXISTS carnator_gone (seq bigserial PRIMARY KEY, id text)",
    "CREATE TABLE IF NOT EXISTS carnator_totals (k integer PRIMARY KEY CHECK (k = 0), "
    "n bigint NOT NULL, bytes bigint NOT NULL)",
    "INSERT INTO carnator_totals (k, n, bytes) VALUES (0, 0, 0) ON CONFLICT DO NOTHING",
    "CREATE TABLE IF NOT EXISTS carnator_meta (key text PRIMARY KEY, value text)",
    "INSERT INTO carnator_meta (key, value) VALUES ('index_uid', md5(random()::text)) "
    "ON CONFLICT DO NOTHING",
    "CREATE TABLE IF NOT EXISTS carnator_requests (seq bigserial PRIMARY KEY, ts double precision, "
    "outcome text, entry_id text, steps_computed integer, steps_total integer, "
    "seconds double precision, class_key text)",
    "CREATE TABLE IF NOT EXISTS carnator_removals (seq bigserial PRIMARY KEY, ts double precision, "
    "entry_id text, reason text)",
    "CREATE TABLE IF NOT EXISTS carnator_quarantine (ts double precision, entry_id text, "
    "why text, data bytea)",
    # totals first, then the log: the totals row lock orders the log's sequence numbers
    f"""CREATE OR REPLACE FUNCTION carnator_entry_changed() RETURNS trigger AS $$
    BEGIN
      IF TG_OP = 'INSERT' THEN
        UPDATE carnator_totals SET n = n + 1, bytes = bytes + coalesce(NEW.bytes, 0) WHERE k = 0;
        RETURN NEW;
      END IF;
      UPDATE carnator_totals SET n = n - 1, bytes = bytes - coalesce(OLD.bytes, 0) WHERE k = 0;
      INSERT INTO carnator_gone (id) VALUES (OLD.id);
      IF random() < 0.001 THEN
        DELETE FROM carnator_gone WHERE seq <= (SELECT max(seq) FROM carnator_gone) - {GONE_KEPT};
      END IF;
      RETURN OLD;
    END $$ LANGUAGE plpgsql""",
    "CREATE OR REPLACE TRIGGER carnator_entries_count AFTER INSERT OR DELETE ON carnator_entries "
    "FOR EACH ROW EXECUTE FUNCTION carnator_entry_changed()",
]


def put_entry(cur, row: dict[str, Any], data: bytes | None) -> None:
    """Inside a transaction holding the totals row: one entry with everything it owns."""
    cur.execute("DELETE FROM carnator_entries WHERE id = %s", [row["id"]])
    cols = [c for c in ROW_COLUMNS if c in row]
    cur.execute(f"INSERT INTO carnator_entries ({', '.join(cols)}) VALUES "
                f"({', '.join(['%s'] * len(cols))})", [row[c] for c in cols])
    signature = row.get("signature")
    if isinstance(signature, (bytes, bytearray, memoryview)):
        signature = bytes(signature)
        cur.execute("INSERT INTO carnator_signatures (id, signature) VALUES (%s, %s)",
                    [row["id"], signature])
        if reusable(row) and signature and len(signature) % 4 == 0:
            vec = np.frombuffer(signature, dtype=np.float32)
            cur.execute("INSERT INTO carnator_descriptors (id, class_key, width, vec) VALUES "
                        "(%s, %s, %s, %s)", [row["id"], row["class_key"], vec.size, compact_bytes(vec)])
    if data is not None:
        cur.execute("INSERT INTO carnator_blobs (id, data) VALUES (%s, %s)", [row["id"], data])


class PgDescriptorSource:
    """``DescriptorSource`` over a cursor inside one REPEATABLE READ transaction."""

    def __init__(self, cur):
        self.cur = cur

    def index_uid(self) -> str:
        self.cur.execute("SELECT value FROM carnator_meta WHERE key = 'index_uid'")
        row = self.cur.fetchone()
        return row[0] if row else ""

    def descriptors_after(self, class_key: str, seq: int):
        self.cur.execute("SELECT seq, id, vec, width FROM carnator_descriptors WHERE class_key = %s "
                         "AND seq > %s ORDER BY seq", [class_key, seq])
        return [(s, i, bytes(v), w) for s, i, v, w in self.cur.fetchall()]

    def gone_after(self, seq: int):
        self.cur.execute("SELECT seq, id FROM carnator_gone WHERE seq > %s ORDER BY seq", [seq])
        gone = self.cur.fetchall()
        self.cur.execute("SELECT coalesce(min(seq), 0) FROM carnator_gone")
        return gone, self.cur.fetchone()[0]

    def gone_tail(self) -> int:
        self.cur.execute("SELECT coalesce(max(seq), 0) FROM carnator_gone")
        return self.cur.fetchone()[0]


def redact(url: str) -> str:
    """The URL as messages may show it: no password."""
    return re.sub(r"(://[^:/@]+):[^@]*@", r"\1:***@", url)
