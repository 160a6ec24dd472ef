"""Trajectory cache: an SQLite index (sqlite-utils, WAL) with tensors in safetensors files.

Layout of a cache folder::

    carnator.sqlite        index: one row per stored trajectory, plus a request log
    tensors/<id>.safetensors   snapshots x_k, final latent, signature maps
    quarantine/            broken files moved aside (never silently deleted)

Design choices:
- Entry ids are random hex generated here; a file path is only ever built from an id read
  back from the database and checked against ``ENTRY_ID_RE`` — never from user input.
- Every tensor file carries its own index row as JSON metadata, so a corrupt or lost
  database is *repaired* by re-indexing the files instead of losing the cache.
- A file is written to a temporary name and renamed into place before its row is inserted:
  a crash leaves at worst an orphan file (re-indexed on repair), never a row without data.
- Several ComfyUI processes may share one folder: WAL mode, a busy timeout, and
  ``BEGIN IMMEDIATE`` around read-modify-write sequences.
- Nothing is ever pickled: tensors go through safetensors, signatures are float32 bytes.
"""
from __future__ import annotations

import json
import logging
import os
import re
import sqlite3
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import sqlite_utils
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

log = logging.getLogger("carnator")

DB_NAME = "carnator.sqlite"
SCHEMA_VERSION = 1
DEFAULT_CAPACITY_BYTES = 8 * 1024**3
ENTRY_ID_RE = re.compile(r"^[0-9a-f]{32}$")

ENTRY_COLUMNS = {
    "id": str, "class_key": str, "exact_key": str, "model_fingerprint": str,
    "backbone": str, "latent_shape": str, "steps": int, "seed": int, "cfg": float,
    "sampler": str, "scheduler": str, "prompt": str, "probe_step": int,
    "snapshot_steps": str, "signature": bytes, "bytes": int, "created": float,
    "last_used": float, "hits": int, "steps_saved": float, "pinned": int,
    "source_entry": str, "class_json": str, "latent_format": str,
}


class CacheError(RuntimeError):
    """A cache problem a person can act on; the request still runs as a miss."""


@dataclass
class StoredEntry:
    """One index row, decoded."""

    row: dict[str, Any]

    @property
    def id(self) -> str:
        return self.row["id"]

    @property
    def snapshot_steps(self) -> list[int]:
        return json.loads(self.row["snapshot_steps"] or "[]")

    @property
    def signature(self) -> torch.Tensor:
        return torch.from_numpy(np.frombuffer(self.row["signature"], dtype=np.float32).copy())


@dataclass
class Candidate:
    entry: StoredEntry
    similarity: float


@dataclass
class LookupResult:
    candidates: list[Candidate]
    message: str  # why there are no candidates, or how many were considered
    reports: list[str] = field(default_factory=list)


def _entries(n: int) -> str:
    return f"{n} entr{'y' if n == 1 else 'ies'}"


class TrajectoryCache:
    """A cache folder. Cheap to construct; opens connections per operation (thread-safe)."""

    busy_timeout_s = 30.0  # how long to wait for another process's write lock

    def __init__(self, folder: str | os.PathLike, capacity_bytes: int = DEFAULT_CAPACITY_BYTES):
        self.folder = Path(folder).expanduser().resolve()
        self.capacity_bytes = int(capacity_bytes)
        self.tensor_dir = self.folder / "tensors"
        self.quarantine_dir = self.folder / "quarantine"
        self.db_path = self.folder / DB_NAME
        self.reports: list[str] = []  # problems found and handled, for the node summary
        self._ensure_folder()
        self._check_and_repair()

    # ---------------------------------------------------------------- set-up and repair
    def _ensure_folder(self) -> None:
        try:
            self.tensor_dir.mkdir(parents=True, exist_ok=True)
            probe = self.folder / f".write-test-{uuid.uuid4().hex}"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as e:
            raise CacheError(
                f"Carnator cache folder {self.folder} is not writable ({e.strerror or e}); "
                "the request runs without reuse. Choose another folder in the Carnator cache "
                "settings or fix its permissions."
            ) from e

    @contextmanager
    def _db(self) -> Iterator[sqlite_utils.Database]:
        conn = sqlite3.connect(str(self.db_path), timeout=self.busy_timeout_s,
                               isolation_level=None, check_same_thread=False)
        try:
            conn.execute(f"PRAGMA busy_timeout={int(self.busy_timeout_s * 1000)}")
            yield sqlite_utils.Database(conn)
        finally:
            conn.close()

    @contextmanager
    def _write(self) -> Iterator[sqlite_utils.Database]:
        """A write transaction that takes the lock up front (no upgrade deadlocks)."""
        with self._db() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def _create_schema(self) -> None:
        """Create what is missing. Read-only when the schema exists (opening must work while
        another process holds the write lock); when several processes create a new cache
        folder at once, IF NOT EXISTS / OR IGNORE make the second creator a no-op."""
        with self._db() as db:
            if db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                db.execute("PRAGMA journal_mode=WAL")
            tables = set(db.table_names())
            if "entries" not in tables:
                db["entries"].create(ENTRY_COLUMNS, pk="id", not_null={"class_key"},
                                     if_not_exists=True)
                db["entries"].create_index(["class_key"], if_not_exists=True)
                db["entries"].create_index(["exact_key"], if_not_exists=True)
            if "requests" not in tables:
                db["requests"].create({"ts": float, "outcome": str, "entry_id": str,
                                       "steps_computed": int, "steps_total": int,
                                       "seconds": float, "class_key": str}, if_not_exists=True)
            if "meta" not in tables:
                db["meta"].create({"key": str, "value": str}, pk="key", if_not_exists=True)
                db["meta"].insert({"key": "schema_version", "value": str(SCHEMA_VERSION)},
                                  pk="key", ignore=True)

    def _check_and_repair(self) -> None:
        """quick_check on every open: a request must not trust a file damaged meanwhile."""
        try:
            result = self._retry_while_locked(self._check_and_create)
            if result != "ok":
                raise sqlite3.DatabaseError(result)
        except sqlite3.OperationalError as e:
            # locked past the busy timeout, or an I/O error: not corruption, keep the file
            raise CacheError(f"Carnator cache index {self.db_path} is unavailable ({e}); the "
                             "request runs without reuse") from e
        except sqlite3.DatabaseError as e:
            self._quarantine_database(str(e))

    def _check_and_create(self) -> str:
        with self._db() as db:
            result = db.execute("PRAGMA quick_check").fetchone()[0]
        if result == "ok":
            self._create_schema()
        return result

    def _retry_while_locked(self, fn):
        """Run ``fn``, again while SQLite reports the file locked, up to the busy timeout.
        While another process switches a new file to WAL, SQLite answers busy at once
        instead of waiting in its busy handler, so opening a shared cache needs this."""
        deadline = time.monotonic() + self.busy_timeout_s
        while True:
            try:
                return fn()
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _quarantine_database(self, why: str) -> None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.quarantine_dir.mkdir(exist_ok=True)
        for suffix in ("", "-wal", "-shm"):
            p = Path(str(self.db_path) + suffix)
            if p.exists():
                p.replace(self.quarantine_dir / f"{p.name}.{stamp}.corrupt")
        self._create_schema()
        n = self.reindex_tensor_files()
        self._report(f"cache index {self.db_path} was unreadable ({why}); moved to "
                     f"{self.quarantine_dir} and rebuilt from {n} tensor file(s)")

    def reindex_tensor_files(self) -> int:
        """Insert a row for every valid tensor file the index does not know (repair)."""
        with self._db() as db:
            known = {r["id"] for r in db.query("SELECT id FROM entries")}
        added = 0
        for path in sorted(self.tensor_dir.glob("*.safetensors")):
            if path.stem in known or not ENTRY_ID_RE.match(path.stem):
                continue
            try:
                row = self._row_from_file(path)
            except Exception as e:  # noqa: BLE001 - any unreadable file is quarantined
                self._quarantine_file(path, f"unreadable during re-index: {e}")
                continue
            with self._write() as db:
                db["entries"].insert(row, pk="id", replace=True)
            added += 1
        return added

    def _row_from_file(self, path: Path) -> dict[str, Any]:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            sig = f.get_tensor("signature").numpy().astype(np.float32)
        row = json.loads(meta["carnator_entry"])
        row["signature"] = sig.tobytes()
        row["bytes"] = path.stat().st_size
        if row.get("id") != path.stem:
            raise ValueError("file name does not match its entry id")
        return row

    def _quarantine_file(self, path: Path, why: str) -> None:
        self.quarantine_dir.mkdir(exist_ok=True)
        if path.exists():
            path.replace(self.quarantine_dir / f"{path.name}.{time.strftime('%Y%m%d-%H%M%S')}")
        self._report(f"cache file {path.name} quarantined: {why}")

    def _report(self, message: str) -> None:
        log.warning("Carnator: %s", message)
        self.reports.append(message)

    # ---------------------------------------------------------------- reading
    def tensor_path(self, entry_id: str) -> Path:
        if not ENTRY_ID_RE.match(entry_id):
            raise CacheError(f"invalid cache entry id {entry_id!r}")
        return self.tensor_dir / f"{entry_id}.safetensors"

    def get(self, entry_id: str) -> StoredEntry | None:
        if not ENTRY_ID_RE.match(str(entry_id)):
            return None
        with self._db() as db:
            rows = list(db.query("SELECT * FROM entries WHERE id = ?", [entry_id]))
        return StoredEntry(rows[0]) if rows else None

    def find_exact(self, exact_key: str) -> StoredEntry | None:
        with self._db() as db:
            rows = list(db.query(
                "SELECT * FROM entries WHERE exact_key = ? ORDER BY created DESC", [exact_key]))
        for row in rows:
            entry = StoredEntry(row)
            if self.tensor_path(entry.id).exists():
                return entry
            self._drop_missing(entry.id)
        return None

    def lookup(self, class_key: str, signature: torch.Tensor, top_k: int = 3) -> LookupResult:
        """Entries of the same compatibility class that were computed in full, ranked by
        signature cosine. An entry that itself reused another (``source_entry`` set) is no
        reuse source: its snapshots carry that entry's trajectory and its own reuse error,
        which its signature does not describe (chained reuse broke the risk budget)."""
        with self._db() as db:
            rows = list(db.query("SELECT * FROM entries WHERE class_key = ?", [class_key]))
            total = db.execute("SELECT count(*) FROM entries").fetchone()[0]
        if not rows:
            msg = ("cache is empty" if total == 0 else
                   f"cache holds {_entries(total)}, none for this model, latent shape, sigma "
                   "schedule, sampler, cfg and seed")
            return LookupResult([], msg)
        reused = len(rows)
        rows = [r for r in rows if not r.get("source_entry")]
        if not rows:
            return LookupResult([], f"{_entries(reused)} in this class, all made by reuse "
                                "(kept for exact repeats, not as reuse sources)")
        query = signature.float().reshape(-1)
        scored = []
        for row in rows:
            entry = StoredEntry(row)
            stored = entry.signature
            if stored.numel() != query.numel():
                continue  # signature layout changed (e.g. another pack version): not comparable
            scored.append(Candidate(entry, float(torch.dot(query, stored))))
        scored.sort(key=lambda c: c.similarity, reverse=True)
        if not scored:
            return LookupResult([], "no comparable entries (signature layout differs)")
        return LookupResult(scored[:top_k], f"{_entries(len(rows))} in this class, best "
                            f"similarity {scored[0].similarity:.3f}")

    def load_tensors(self, entry_id: str, names: list[str] | None = None) -> dict[str, torch.Tensor] | None:
        """Tensors of an entry; a missing or corrupt file is quarantined and gives None."""
        path = self.tensor_path(entry_id)
        if not path.exists():
            self._drop_missing(entry_id)
            return None
        try:
            with safe_open(str(path), framework="pt") as f:
                keys = f.keys() if names is None else [n for n in names if n in f.keys()]
                return {k: f.get_tensor(k) for k in keys}
        except Exception as e:  # noqa: BLE001 - safetensors raises several error types
            self._quarantine_file(path, f"unreadable ({e})")
            self._delete_row(entry_id)
            return None

    def _drop_missing(self, entry_id: str) -> None:
        self._report(f"cache entry {entry_id} lost its tensor file; removed from the index")
        self._delete_row(entry_id)

    def _delete_row(self, entry_id: str) -> None:
        with self._write() as db:
            db.execute("DELETE FROM entries WHERE id = ?", [entry_id])

    def list_entries(self, offset: int = 0, limit: int = 50) -> list[dict[str, Any]]:
        with self._db() as db:
            rows = db.query("SELECT * FROM entries ORDER BY created DESC LIMIT ? OFFSET ?",
                            [int(limit), int(offset)])
            return [{k: v for k, v in r.items() if k != "signature"} for r in rows]

    def stats(self) -> dict[str, Any]:
        with self._db() as db:
            n, size = db.execute("SELECT count(*), coalesce(sum(bytes),0) FROM entries").fetchone()
            recent = list(db.query("SELECT outcome FROM requests ORDER BY ts DESC LIMIT 100"))
        hits = sum(r["outcome"] in ("hit", "exact") for r in recent)
        return {"entries": n, "bytes": size, "capacity_bytes": self.capacity_bytes,
                "recent_requests": len(recent),
                "recent_hit_rate": hits / len(recent) if recent else None}

    # ---------------------------------------------------------------- writing
    def new_id(self) -> str:
        return uuid.uuid4().hex

    def store(self, row: dict[str, Any], tensors: dict[str, torch.Tensor],
              signature: torch.Tensor) -> str | None:
        """Write one entry; returns its id, or None (reported) when it could not be stored."""
        entry_id = row.get("id") or self.new_id()
        row = {**row, "id": entry_id, "created": time.time(), "last_used": time.time(),
               "hits": 0, "steps_saved": 0.0, "pinned": 0}
        meta_row = {k: v for k, v in row.items() if k not in ("signature", "bytes")}
        payload = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        payload["signature"] = signature.detach().float().cpu().contiguous()
        final = self.tensor_path(entry_id)
        tmp = final.with_suffix(f".tmp-{os.getpid()}")
        try:
            save_file(payload, str(tmp), metadata={"carnator_entry": json.dumps(meta_row)})
            tmp.replace(final)
        except (OSError, SafetensorError) as e:  # safetensors wraps ENOSPC/EFBIG in its own type
            tmp.unlink(missing_ok=True)
            why = getattr(e, "strerror", None) or e
            self._report(f"trajectory not stored: {why} while writing {final.parent}"
                         " (disk full or read-only?); the result is unaffected")
            return None
        row["signature"] = payload["signature"].numpy().astype(np.float32).tobytes()
        row["bytes"] = final.stat().st_size
        try:
            with self._write() as db:
                db["entries"].insert(row, pk="id", replace=True)
        except sqlite3.Error:
            final.unlink(missing_ok=True)  # no row, no file: the folder stays consistent
            raise
        try:
            self.evict_to_capacity()
        except sqlite3.Error as e:  # the entry is stored; eviction runs again next time
            self._report(f"eviction postponed ({e})")
        return entry_id

    def record_use(self, entry_id: str, steps_saved: float) -> None:
        with self._write() as db:
            db.execute("UPDATE entries SET hits = hits + 1, steps_saved = steps_saved + ?, "
                       "last_used = ? WHERE id = ?", [float(steps_saved), time.time(), entry_id])

    def log_request(self, outcome: str, entry_id: str | None, steps_computed: int,
                    steps_total: int, seconds: float, class_key: str) -> None:
        with self._write() as db:
            db["requests"].insert({"ts": time.time(), "outcome": outcome, "entry_id": entry_id,
                                   "steps_computed": steps_computed, "steps_total": steps_total,
                                   "seconds": seconds, "class_key": class_key})

    def set_pinned(self, entry_id: str, pinned: bool) -> bool:
        with self._write() as db:
            cur = db.execute("UPDATE entries SET pinned = ? WHERE id = ?", [int(pinned), entry_id])
            return cur.rowcount > 0

    def delete(self, entry_id: str) -> bool:
        """Remove an entry: the row first (readers stop seeing it), then its file."""
        if not ENTRY_ID_RE.match(str(entry_id)):
            return False
        with self._write() as db:
            cur = db.execute("DELETE FROM entries WHERE id = ?", [entry_id])
            existed = cur.rowcount > 0
        self.tensor_path(entry_id).unlink(missing_ok=True)
        return existed

    def clear(self) -> int:
        with self._db() as db:
            ids = [r["id"] for r in db.query("SELECT id FROM entries")]
        return sum(self.delete(i) for i in ids)

    def evict_to_capacity(self) -> list[str]:
        """Evict lowest-utility unpinned entries until the folder fits the capacity.

        Utility = (steps saved + 1) × (hits + 1) / bytes: an entry that saved many steps
        for many requests per byte stays; recency breaks ties.
        """
        with self._db() as db:
            total = db.execute("SELECT coalesce(sum(bytes),0) FROM entries").fetchone()[0]
            if total <= self.capacity_bytes:
                return []
            rows = list(db.query(
                "SELECT id, bytes FROM entries WHERE pinned = 0 ORDER BY "
                "((steps_saved + 1.0) * (hits + 1.0) / max(bytes, 1)) ASC, last_used ASC"))
        evicted = []
        for row in rows:
            if total <= self.capacity_bytes:
                break
            if self.delete(row["id"]):
                total -= row["bytes"]
                evicted.append(row["id"])
        if evicted:
            log.info("Carnator: evicted %d entr%s to stay within %.1f MB", len(evicted),
                     "y" if len(evicted) == 1 else "ies", self.capacity_bytes / 1e6)
        return evicted

