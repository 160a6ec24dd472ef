"""Compact descriptors stored in the index in fixed-size blocks (both backends).

Three tables (``carnator_`` prefixed on PostgreSQL)::

    descriptor_blocks  block, class_key, width, n, live, alive   small: read by every lookup
    descriptor_data    block → ids (n × 32 hex), vecs (n × 128 int8)   append-only rows
    descriptor_slots   entry id → (block, slot)   where the index's delete trigger tombstones

Why blocks: a row per descriptor costs a lookup one Python row per entry (≈100k rows at
100k entries, more than the whole time budget); a block packs ``BLOCK_ROWS`` of them into
one value. Why the split head/data: a removal (eviction, delete, repair) flips one byte of
the small head (``alive``) in the delete trigger, without rewriting 40 KB of packed rows,
and a process's cached packed rows stay valid (cache_descriptors.BlockCache).

Everything here runs inside the caller's write transaction (store, import, migration):
the descriptor, its slot and the entry row commit or vanish together, so a crash
mid-store leaves nothing half-visible. Writers are serialised by that transaction (SQLite's
write lock; PostgreSQL's totals row lock), so the open block has one appender at a time.

Compaction: a sealed block at most half alive is rewritten into the open block by the next
store of its class (``BLOCK_ROWS // 2`` rows at most, in the same transaction), and a block
with nothing alive is deleted by the trigger. A cache at capacity evicts about one entry per
store, so one compaction per store keeps pace and lookups do not scan mostly-dead blocks
for long; deletes with no store after them leave sparse blocks that are still correct, only
scanned (their dead slots are masked).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

from .descriptors import BLOCK_ROWS, COMPACT_DIM, ID_CHARS


class Dialect:
    """The few places SQLite and PostgreSQL differ for these statements."""

    def __init__(self, prefix: str, param: str, concat_blob: str):
        self.prefix, self.param, self.concat_blob = prefix, param, concat_blob

    def sql(self, text: str) -> str:
        return text.replace("{p}", self.prefix).replace("?", self.param)


SQLITE = Dialect("", "?", "CAST(vecs || ? AS BLOB)")  # blob || blob is text in SQLite
POSTGRES = Dialect("carnator_", "%s", "vecs || ?")

Execute = Callable[[str, list], Any]  # db.execute / cursor.execute: returns a cursor


def add_descriptors(execute: Execute, dialect: Dialect,
                    rows: list[tuple[str, str, int, bytes]]) -> None:
    """Append (entry id, class key, width, quantized vec) rows to their classes' open
    blocks, then compact one sparse block per class touched."""
    groups: dict[tuple[str, int], list[tuple[str, bytes]]] = defaultdict(list)
    for entry_id, class_key, width, vec in rows:
        if len(entry_id) != ID_CHARS or len(vec) != COMPACT_DIM:
            continue  # not an id this cache makes: it stays out of ranking, as before
        groups[(class_key, width)].append((entry_id, vec))
    for (class_key, width), items in groups.items():
        _append(execute, dialect, class_key, width, items)
        _compact_one(execute, dialect, class_key, width)


def _append(ex: Execute, d: Dialect, class_key: str, width: int,
            items: list[tuple[str, bytes]]) -> None:
    q = d.sql
    while items:
        open_block = ex(q("SELECT block, n FROM {p}descriptor_blocks WHERE class_key = ? AND "
                          "width = ? AND n < ? ORDER BY block DESC LIMIT 1"),
                        [class_key, width, BLOCK_ROWS]).fetchone()
        if open_block is None:
            block = ex(q("INSERT INTO {p}descriptor_blocks (class_key, width, n, live, alive) "
                         "VALUES (?, ?, 0, 0, '') RETURNING block"), [class_key, width]).fetchone()[0]
            ex(q("INSERT INTO {p}descriptor_data (block, ids, vecs) VALUES (?, '', ?)"),
               [block, b""])
            n = 0
        else:
            block, n = open_block
        take, items = items[:BLOCK_ROWS - n], items[BLOCK_ROWS - n:]
        ids = "".join(i for i, _ in take)
        ex(q("UPDATE {p}descriptor_blocks SET n = n + ?, live = live + ?, alive = alive || ? "
             "WHERE block = ?"), [len(take), len(take), "1" * len(take), block])
        ex(q(f"UPDATE {{p}}descriptor_data SET ids = ids || ?, vecs = {d.concat_blob} "
             "WHERE block = ?"), [ids, b"".join(v for _, v in take), block])
        # one statement for all slots: a compaction moves up to 128 rows, and on PostgreSQL
        # each statement is a round trip
        values = ", ".join(["(?, ?, ?)"] * len(take))
        ex(q(f"INSERT INTO {{p}}descriptor_slots (id, block, slot) VALUES {values} ON CONFLICT "
             "(id) DO UPDATE SET block = excluded.block, slot = excluded.slot"),
           [x for slot, (entry_id, _) in enumerate(take, start=n) for x in (entry_id, block, slot)])


def _compact_one(ex: Execute, d: Dialect, class_key: str, width: int) -> None:
    """Rewrite one sealed, at most half-alive block of the class into the open block."""
    q = d.sql
    sparse = ex(q("SELECT block, alive FROM {p}descriptor_blocks WHERE class_key = ? AND "
                  "width = ? AND n = ? AND live * 2 <= ? ORDER BY live LIMIT 1"),
                [class_key, width, BLOCK_ROWS, BLOCK_ROWS]).fetchone()
    if sparse is None:
        return
    block, alive = sparse
    ids, vecs = ex(q("SELECT ids, vecs FROM {p}descriptor_data WHERE block = ?"),
                   [block]).fetchone()
    vecs = bytes(vecs)
    keep = [(ids[i * ID_CHARS:(i + 1) * ID_CHARS], vecs[i * COMPACT_DIM:(i + 1) * COMPACT_DIM])
            for i, flag in enumerate(alive) if flag == "1"]
    ex(q("DELETE FROM {p}descriptor_data WHERE block = ?"), [block])
    ex(q("DELETE FROM {p}descriptor_blocks WHERE block = ?"), [block])
    _append(ex, d, class_key, width, keep)  # their slots move with them (upsert)


def drop_all(execute: Execute, dialect: Dialect) -> None:
    """Before deleting every entry (Clear all): one statement each instead of a trigger
    firing per row."""
    for table in ("descriptor_slots", "descriptor_data", "descriptor_blocks"):
        execute(dialect.sql(f"DELETE FROM {{p}}{table}"), [])
