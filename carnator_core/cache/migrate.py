"""Copy a cache between backends: an SQLite folder into PostgreSQL, or back.

    .venv/bin/python scripts/migrate_cache.py SOURCE DESTINATION

SOURCE and DESTINATION are each a cache folder or a ``postgresql://`` URL. Every entry is
verified (entry id, checksums, finite values) before it is copied, so damage is never
carried across; a damaged entry is reported and skipped (the source is left as it is).
Pins, hits and steps saved travel with the rows. Copying again is safe: an entry already
in the destination is replaced by the same bytes. Capacity is applied afterwards by the
destination's own eviction, not during the copy.
"""
from __future__ import annotations

import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from .backend import is_database_url, open_cache
from .files import EntryDamaged, EntryUnreadable, read_entry_from, write_usage

BATCH = 64  # entries per destination transaction


@dataclass
class Migration:
    copied: int = 0
    skipped: list[str] = field(default_factory=list)


def _sqlite_entries(cache) -> Iterator[tuple[dict, bytes]]:
    """(row with signature, file bytes) of every entry in an SQLite folder, oldest first."""
    offset = 0
    while True:
        with cache._db() as db:
            rows = list(db.query("SELECT e.*, s.signature AS signature FROM entries e LEFT JOIN "
                                 "signatures s ON s.id = e.id ORDER BY e.created, e.id "
                                 "LIMIT ? OFFSET ?", [BATCH, offset]))
        if not rows:
            return
        offset += len(rows)
        for row in rows:
            try:
                data = cache.tensor_path(row["id"]).read_bytes()
            except OSError as e:
                yield row, e
                continue
            yield row, data


def _pg_entries(cache) -> Iterator[tuple[dict, bytes]]:
    from .postgres_schema import COLUMNS
    offset = 0
    while True:
        with cache._tx() as cur:
            cur.execute(f"SELECT {COLUMNS}, s.signature, b.data FROM carnator_entries e "
                        "LEFT JOIN carnator_signatures s USING (id) LEFT JOIN carnator_blobs b "
                        "USING (id) ORDER BY e.created, e.id LIMIT %s OFFSET %s", [BATCH, offset])
            rows = cache._rows(cur)
        if not rows:
            return
        offset += len(rows)
        for row in rows:
            data = row.pop("data")
            row["signature"] = None if row["signature"] is None else bytes(row["signature"])
            yield row, (bytes(data) if data is not None else FileNotFoundError("no blob"))


def _verified(row: dict, data) -> str | None:
    """Why this entry must not be copied, or None."""
    if isinstance(data, Exception):
        return f"its tensors could not be read ({data})"
    try:
        read_entry_from(io.BytesIO(data), len(data), Path(f"{row['id']}.safetensors"),
                        row["id"], row.get("checksum"))
    except (EntryDamaged, EntryUnreadable) as e:
        return str(e)
    if not isinstance(row.get("signature"), bytes):
        return "its index row has no signature"
    return None


def _put_files(cache, rows: list[dict], blobs: dict[str, bytes]) -> None:
    """SQLite destination: each file durable and in place before its row is indexed."""
    for row in rows:
        final = cache.tensor_path(row["id"])
        tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(blobs[row["id"]])
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(final)
        write_usage(final, row)  # pins and hits survive a later rebuild from the files
    cache.import_rows(rows)


def migrate(source: str, destination: str, progress=print) -> Migration:
    src, dst = open_cache(source, None), open_cache(destination, None)
    entries = _pg_entries(src) if is_database_url(source) else _sqlite_entries(src)
    result, rows, blobs = Migration(), [], {}

    def flush() -> None:
        if not rows:
            return
        if is_database_url(destination):
            dst.import_rows(rows, blobs)
        else:
            _put_files(dst, rows, blobs)
        result.copied += len(rows)
        progress(f"copied {result.copied} entries")
        rows.clear()
        blobs.clear()

    for row, data in entries:
        problem = _verified(row, data)
        if problem:
            result.skipped.append(row["id"])
            progress(f"skipped entry {row['id']}: {problem}")
            continue
        row["bytes"] = len(data)
        rows.append(row)
        blobs[row["id"]] = data
        if len(rows) >= BATCH:
            flush()
    flush()
    return result


__all__ = ["migrate", "Migration"]
