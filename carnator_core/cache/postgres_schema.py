"""PostgreSQL schema of the shared cache, and the statements that keep its parts in step.

The same split as the SQLite index (cache_index.py): small entry rows; full signatures
and tensor blobs in their own tables (``ON DELETE CASCADE``); compact descriptors packed in
blocks (cache_descriptor_blocks.py) whose alive masks, like the ``carnator_totals`` row, the
entries' delete trigger keeps. Every statement is idempotent (IF NOT EXISTS / OR REPLACE),
so workers starting at once, under an advisory lock, agree on one schema.

Why the worker scans blocks rather than the server ranking them: ``cube``'s GiST KNN is
limited to 100 dimensions (our descriptors have 128) and, at this dimensionality, visits
most of the index anyway; a SQL-side scan of 100k float arrays is far slower than numpy's
100k × 128 int8 in ≈3 ms. Reading the packed blocks costs ≈13 MB per lookup over loopback
at 100k entries, and the worker's memory stays constant (cache_descriptors.py).

A database of the previous layout (one ``carnator_descriptors`` row per entry and the
``carnator_gone`` log) is migrated on the first connection (``migrate``).
"""
from __future__ import annotations

import re
from typing import Any

import numpy as np

from .entry import ENTRY_COLUMNS
from .descriptor_blocks import POSTGRES, add_descriptors
from .descriptors import COMPACT_DIM, ID_CHARS, BlockHead, quantized_compact
from .index import descriptor_of

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
    # bigserial: a block number is never reused, so a worker's cached block stays its
    "CREATE TABLE IF NOT EXISTS carnator_descriptor_blocks (block bigserial PRIMARY KEY, "
    "class_key text NOT NULL, width integer NOT NULL, n integer NOT NULL, live integer NOT NULL, "
    "alive text NOT NULL)",
    "CREATE INDEX IF NOT EXISTS carnator_descriptor_blocks_class ON carnator_descriptor_blocks "
    "(class_key, width, n)",
    "CREATE TABLE IF NOT EXISTS carnator_descriptor_data (block bigint PRIMARY KEY, ids text NOT "
    "NULL, vecs bytea NOT NULL)",
    # uncompressed (int8 rows do not compress): substr() of the open block reads its tail
    "DO $$ BEGIN IF (SELECT attstorage FROM pg_attribute WHERE attrelid = "
    "'carnator_descriptor_data'::regclass AND attname = 'vecs') <> 'e' THEN "
    "ALTER TABLE carnator_descriptor_data ALTER COLUMN vecs SET STORAGE EXTERNAL; END IF; END $$",
    "CREATE TABLE IF NOT EXISTS carnator_descriptor_slots (id text PRIMARY KEY, block bigint NOT "
    "NULL, slot integer NOT NULL)",
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
      -- the removed entry's slot becomes '0' in its block's alive mask; an empty block goes
      UPDATE carnator_descriptor_blocks b SET live = b.live - 1,
             alive = overlay(b.alive PLACING '0' FROM s.slot + 1 FOR 1)
        FROM carnator_descriptor_slots s WHERE s.id = OLD.id AND b.block = s.block;
      DELETE FROM carnator_descriptor_data d USING carnator_descriptor_slots s,
             carnator_descriptor_blocks b
       WHERE s.id = OLD.id AND b.block = s.block AND b.live = 0 AND d.block = b.block;
      DELETE FROM carnator_descriptor_blocks b USING carnator_descriptor_slots s
       WHERE s.id = OLD.id AND b.block = s.block AND b.live = 0;
      DELETE FROM carnator_descriptor_slots WHERE id = OLD.id;
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
        cur.execute("INSERT INTO carnator_signatures (id, signature) VALUES (%s, %s)",
                    [row["id"], bytes(signature)])
    if data is not None:
        cur.execute("INSERT INTO carnator_blobs (id, data) VALUES (%s, %s)", [row["id"], data])


def put_entries(cur, rows: list[dict[str, Any]], blobs: dict[str, bytes]) -> None:
    """Inside a transaction holding the totals row: entries, then their descriptors
    appended once per call (a bulk import does not rewrite a block per row)."""
    for row in rows:
        put_entry(cur, row, blobs.get(row["id"]))
    descriptors = [descriptor_of(row, row.get("signature")) for row in rows]
    add_descriptors(cur.execute, POSTGRES, [d for d in descriptors if d is not None])


def migrate(cur) -> None:
    """Under the schema lock: pack a previous layout's per-entry descriptors into blocks."""
    cur.execute("SELECT to_regclass('carnator_descriptors') IS NOT NULL")
    if cur.fetchone()[0]:
        cur.execute("SELECT d.id, d.class_key, d.width, d.vec FROM carnator_descriptors d "
                    "ORDER BY d.seq")
        rows = [(i, c, w, quantized_compact(np.frombuffer(bytes(v), np.float32)))
                for i, c, w, v in cur.fetchall() if v and len(v) % 4 == 0]
        add_descriptors(cur.execute, POSTGRES, rows)
        cur.execute("DROP TABLE carnator_descriptors")
        # new tables number blocks from 1 again: no worker may keep a block it cached before
        cur.execute("UPDATE carnator_meta SET value = md5(random()::text) WHERE key = 'index_uid'")
    cur.execute("DROP TABLE IF EXISTS carnator_gone")


class PgDescriptorSource:
    """``DescriptorSource`` over a cursor inside one REPEATABLE READ transaction."""

    def __init__(self, cur):
        self.cur = cur

    def index_uid(self) -> str:
        self.cur.execute("SELECT value FROM carnator_meta WHERE key = 'index_uid'")
        row = self.cur.fetchone()
        return row[0] if row else ""

    def heads(self, class_key: str) -> list[BlockHead]:
        self.cur.execute("SELECT block, width, n, live, alive FROM carnator_descriptor_blocks "
                         "WHERE class_key = %s", [class_key])
        return [BlockHead(*r) for r in self.cur.fetchall()]

    def rows_after(self, wanted: list[tuple[int, int]]):
        """One query per batch, its rows concatenated server-side into one ids string and
        one bytea (binary: not hex text): two buffers per batch instead of two values and
        two copies per block, which left the worker's heap fragmented (as cache_pg.lookup's
        signatures did)."""
        blocks, skips = [b for b, _ in wanted], [s for _, s in wanted]
        self.cur.execute(
            f"SELECT array_agg(d.block ORDER BY r.ord), array_agg(octet_length(d.vecs) / "
            f"{COMPACT_DIM} - r.skip ORDER BY r.ord), string_agg(substr(d.ids, r.skip * {ID_CHARS} "
            f"+ 1), '' ORDER BY r.ord), string_agg(substr(d.vecs, r.skip * {COMPACT_DIM} + 1), "
            "''::bytea ORDER BY r.ord) FROM unnest(%s::bigint[], %s::int[]) WITH ORDINALITY AS "
            "r(block, skip, ord) JOIN carnator_descriptor_data d ON d.block = r.block",
            [blocks, skips], binary=True)
        got, counts, ids, vecs = fetch_one_and_free(self.cur)
        vecs, at = memoryview(vecs or b""), 0
        for block, count in zip(got or [], counts or []):
            yield (block, ids[at * ID_CHARS:(at + count) * ID_CHARS],
                   vecs[at * COMPACT_DIM:(at + count) * COMPACT_DIM])
            at += count


def fetch_one_and_free(cur) -> tuple:
    """The row, its result freed now: psycopg's per-query adapters form a reference cycle
    that keeps the last result alive until the garbage collector runs, and a worker doing
    lookups left tens of MB of finished 1–3 MB results waiting for it."""
    row = cur.fetchone()
    if cur.pgresult is not None:
        cur.pgresult.clear()
    return row


def redact(url: str) -> str:
    """The URL as messages may show it: no password."""
    return re.sub(r"(://[^:/@]+):[^@]*@", r"\1:***@", url)
