"""Trajectory cache: an SQLite index (sqlite-utils, WAL) with tensors in safetensors files.

Layout of a cache folder::

    carnator.sqlite              index: entries, signatures, compact descriptor blocks,
                                 totals, request log, removal log, settings (cache_index.py)
    tensors/<id>.safetensors     snapshots x_k, final latent, signature maps (+ checksums)
    tensors/<id>.usage.json      pins and hit counts, so a rebuilt index keeps them
    quarantine/                  damaged files moved aside (never silently deleted)

What the cache promises, and how (tests/test_cache_faults.py checks each under kill -9):
- It never serves wrong data: every load checks the file's entry id and per-tensor
  checksums against the index and that values are finite (cache_files.read_entry). A
  mismatch quarantines the entry and the request runs as a miss with a message.
- It never loses an entry whose ``store()`` returned, except by eviction policy (never a
  pinned one) or a person's delete: the file is renamed into place before its row commits;
  a lost or corrupt index is rebuilt from the files (cache_repair).
- Eviction is one write transaction (choose victims, check pins, delete rows) followed by
  unlinking their files, so concurrent evictors never take more than needed.
- Errors that are not evidence of damage (locks, file descriptors, memory) never
  quarantine anything: the entry stays and the request runs without it.
- Entry ids are random hex generated here; a file path is only ever built from an id that
  fully matches ``ENTRY_ID_RE`` — never from user input. Nothing is ever pickled.
- It stays fast when full: lookup scans compact descriptors packed in blocks
  in the index (a fixed-size cache of them per process: memory does not grow with the
  number of entries) and reads only a short list's signatures; sizes are counters;
  eviction walks an index. Requests open it through cache_backend.open_cache, which checks
  a folder once per process.

The PostgreSQL backend (cache_pg.py) offers the same methods for a farm of workers.
"""
from __future__ import annotations

import copy
import logging
import os
import sqlite3
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import sqlite_utils
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from .files import (ENTRY_ID_RE, CacheError, EntryDamaged, EntryUnreadable,  # noqa: F401
                          REMOVED_SUFFIX, FolderLock, kill_point, missing_reason, read_entry,
                          usage_path, valid_entry_id, write_usage)
from .descriptor_blocks import SQLITE, drop_all
from .descriptors import shortlist
from .entry import (DEFAULT_CAPACITY_BYTES, ENTRY_COLUMNS, LOG_ROWS_KEPT,  # noqa: F401
                          Candidate, LookupResult, StoredEntry, _entries, no_candidates, prepare_entry,
                          row_problem)
from .index import (UTILITY_ORDER, SqliteDescriptorSource, checked, file_identity,
                          forget_checked, put_entries, put_entry, totals)
from .index import SCHEMA_VERSION  # noqa: F401 - part of this module's interface
from .repair import IndexRepair

log = logging.getLogger("carnator")

DB_NAME = "carnator.sqlite"
EVICT_BATCH = 256  # victims read per query: eviction walks the utility index, never scans


class TrajectoryCache(IndexRepair):
    """A cache folder. Cheap to construct; opens connections per operation (thread-safe).

    ``capacity_bytes=None`` uses the capacity last set for this folder (the routes open it
    that way, so /carnator/stats shows what the Cache node set, not a default).
    """

    busy_timeout_s = 30.0  # how long to wait for another process's write lock

    def __init__(self, folder: str | os.PathLike, capacity_bytes: int | None = None):
        self.folder = Path(folder).expanduser().resolve()
        self.tensor_dir = self.folder / "tensors"
        self.quarantine_dir = self.folder / "quarantine"
        self.db_path = self.folder / DB_NAME
        self.reports: list[str] = []  # problems found and handled, for the node summary
        self.read_only: str | None = None  # why nothing can be written (disk full), or None
        self.lock = FolderLock(self.folder)
        self._ensure_folder()
        self._open_index()
        self.checked_at = time.monotonic()
        identity = file_identity(self.db_path)
        if identity is not None:
            checked[str(self.db_path)] = identity
        self.capacity_bytes = self._settle_capacity(capacity_bytes)

    def fresh_view(self, capacity_bytes: int | None) -> "TrajectoryCache":
        """This checked cache for one more request (cache_backend.open_cache): its own
        report list, writability probed again, no integrity check repeated."""
        view = copy.copy(self)
        view.reports, view.read_only = [], None
        view._ensure_folder()
        view.capacity_bytes = view._settle_capacity(capacity_bytes)
        return view

    # ---------------------------------------------------------------- connections
    @contextmanager
    def _db(self) -> Iterator[sqlite_utils.Database]:
        with self.lock():
            # a full disk cannot even hold WAL's shared-memory file: read the index as it
            # is on disk (immutable), so stored results are still served
            target, uri = (f"file:{self.db_path}?immutable=1", True) if self.read_only else (
                str(self.db_path), False)
            conn = sqlite3.connect(target, timeout=self.busy_timeout_s, uri=uri,
                                   isolation_level=None, check_same_thread=False)
            try:
                conn.execute(f"PRAGMA busy_timeout={int(self.busy_timeout_s * 1000)}")
                conn.execute("PRAGMA recursive_triggers=ON")  # a REPLACE's delete fires triggers
                yield sqlite_utils.Database(conn)
            except sqlite3.DatabaseError as e:
                if not isinstance(e, sqlite3.OperationalError):
                    forget_checked(self.db_path)  # damage: the next open checks it in full
                raise
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
                # a failed COMMIT (disk full) may have rolled back already: a second
                # ROLLBACK would raise "no transaction is active" and hide the real error
                if db.conn.in_transaction:
                    try:
                        db.execute("ROLLBACK")
                    except sqlite3.Error:
                        pass
                raise

    def _report(self, message: str) -> None:
        log.warning("Carnator: %s", message)
        self.reports.append(message)

    def _settle_capacity(self, requested: int | None) -> int:
        with self._db() as db:
            stored = self._meta(db, "capacity_bytes")
        if requested is None:
            return int(stored) if stored and stored.isdigit() else DEFAULT_CAPACITY_BYTES
        if stored != str(int(requested)) and not self.read_only:
            try:
                with self._write() as db:
                    self._set_meta(db, "capacity_bytes", str(int(requested)))
            except sqlite3.Error as e:  # only the stats page reads it: not worth a failure
                log.info("Carnator: capacity not recorded (%s)", e)
        return int(requested)

    @staticmethod
    def _meta(db, key: str) -> str | None:
        row = db.execute("SELECT value FROM meta WHERE key = ?", [key]).fetchone()
        return row[0] if row else None

    @staticmethod
    def _set_meta(db, key: str, value: str) -> None:
        db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", [key, value])

    @staticmethod
    def _log_removal(db, entry_id: str, reason: str) -> None:
        db.execute("INSERT INTO removals (ts, entry_id, reason) VALUES (?, ?, ?)",
                   [time.time(), entry_id, reason])
        db.execute("DELETE FROM removals WHERE rowid <= (SELECT max(rowid) FROM removals) - ?",
                   [LOG_ROWS_KEPT])

    # ---------------------------------------------------------------- reading
    def tensor_path(self, entry_id: str) -> Path:
        if not valid_entry_id(entry_id):
            raise CacheError(f"invalid cache entry id {entry_id!r}")
        return self.tensor_dir / f"{entry_id}.safetensors"

    def get(self, entry_id: str) -> StoredEntry | None:
        if not valid_entry_id(entry_id):
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
            self._handle_missing(entry.id)
        return None

    def lookup(self, class_key: str, signature: torch.Tensor, top_k: int = 3) -> LookupResult:
        """Entries of the same compatibility class that were computed in full, ranked by
        signature cosine. An entry that itself reused another (``source_entry`` set) is no
        reuse source: its snapshots carry that entry's trajectory and its own reuse error,
        which its signature does not describe (chained reuse broke the risk budget).

        Reads only what ranking needs: the class's compact descriptor blocks (scanned in
        bounded batches; a fixed-size cache per process), then the full signatures of a
        short list, re-ranked by exact cosine (cache_descriptors.py)."""
        query = signature.detach().float().reshape(-1).cpu()
        with self._db() as db:
            db.execute("BEGIN")  # one snapshot: block heads, packed rows and entries agree
            try:
                ids, comparable = shortlist(SqliteDescriptorSource(db), str(self.db_path),
                                            class_key, query.numpy(), query.numel())
                rows = self._shortlisted_rows(db, ids)
                if not ids:
                    return self._no_candidates(db, class_key)
            finally:
                db.execute("COMMIT")
        usable = [StoredEntry(r) for r in map(self._usable_row, rows) if r is not None]
        # signature layouts of another pack version are not comparable
        usable = [e for e in usable if len(e.row.get("signature") or b"") == 4 * query.numel()]
        scored = []
        if usable:  # one matrix product, not a dot per entry
            sigs = np.stack([np.frombuffer(e.row["signature"], dtype=np.float32) for e in usable])
            sims = sigs @ query.numpy()
            scored = [Candidate(e, float(s)) for e, s in zip(usable, sims)]
        scored.sort(key=lambda c: c.similarity, reverse=True)
        if not scored:
            return LookupResult([], "no comparable entries (signature layout differs)")
        return LookupResult(scored[:top_k], f"{_entries(comparable)} in this class, best "
                            f"similarity {scored[0].similarity:.3f}")

    @staticmethod
    def _shortlisted_rows(db, ids: list[str]) -> list[dict[str, Any]]:
        if not ids:
            return []
        marks = ",".join("?" * len(ids))
        return list(db.query(f"SELECT e.*, s.signature AS signature FROM entries e LEFT JOIN "
                             f"signatures s ON s.id = e.id WHERE e.id IN ({marks})", ids))

    @staticmethod
    def _no_candidates(db, class_key: str) -> LookupResult:
        total = totals(db)[0]
        in_class, reused = db.execute(
            "SELECT count(*), count(nullif(source_entry, '')) FROM entries WHERE class_key = ?",
            [class_key]).fetchone()
        return no_candidates(total, in_class, reused)

    def _usable_row(self, row: dict[str, Any]) -> dict[str, Any] | None:
        """The row, or its copy restored from the entry's own file when it is malformed."""
        problem = row_problem(row)
        if problem is None:
            return row
        restored = self.restore_row(row["id"])
        outcome = ("restored from its tensor file" if restored else
                   "skipped; delete the entry in the Carnator cache tab if this repeats")
        self._report(f"index row of cache entry {row['id']} was malformed ({problem}); {outcome}")
        return restored

    def load_tensors(self, entry_id: str, names: list[str] | None = None) -> dict[str, torch.Tensor] | None:
        """Verified tensors of an entry, or None (reported) when it cannot be used.

        Damage (checksum, entry id, NaN, truncation) quarantines the entry; a missing file
        whose row another process just removed is no news; a transient error (file
        descriptors, memory) leaves the entry alone.
        """
        if not valid_entry_id(entry_id):
            return None
        with self._db() as db:
            found = db.execute("SELECT checksum FROM entries WHERE id = ?", [entry_id]).fetchone()
        if found is None:
            return None  # evicted or deleted meanwhile
        path = self.tensor_path(entry_id)
        try:
            _, tensors, _ = read_entry(path, entry_id, found[0], names)
        except FileNotFoundError:
            self._handle_missing(entry_id)
            return None
        except EntryDamaged as e:
            self._quarantine_entry(entry_id, str(e))
            return None
        except EntryUnreadable as e:
            self._report(f"cache entry {entry_id} could not be read now ({e}); it is kept and "
                         "this request runs without it")
            return None
        return tensors

    def _handle_missing(self, entry_id: str) -> None:
        """A row whose file is gone. Eviction deletes the row before the file, so if the
        row is gone too another process evicted it: nothing was lost."""
        if self.read_only:
            return
        reason = missing_reason(self.tensor_path(entry_id))
        with self._write() as db:
            gone = db.execute("DELETE FROM entries WHERE id = ?", [entry_id]).rowcount
            if gone:
                self._log_removal(db, entry_id, reason)
        if gone and reason == "lost":
            self._report(f"cache entry {entry_id} lost its tensor file; removed from the index")

    def _quarantine_entry(self, entry_id: str, why: str) -> None:
        if self.read_only:  # cannot move anything now; a later open finds it again
            self._report(f"cache entry {entry_id} is damaged ({why}); not used")
            return
        with self._write() as db:  # the row first: other readers stop trusting it at once
            if db.execute("DELETE FROM entries WHERE id = ?", [entry_id]).rowcount:
                self._log_removal(db, entry_id, "quarantined")
        path = self.tensor_path(entry_id)
        self._move_to_quarantine(path)
        usage_path(path).unlink(missing_ok=True)
        self._report(f"cache entry {entry_id} quarantined: {why}; the request runs without it")

    def list_entries(self, offset: int = 0, limit: int = 50) -> list[dict[str, Any]]:
        with self._db() as db:
            rows = db.query("SELECT * FROM entries ORDER BY created DESC LIMIT ? OFFSET ?",
                            [int(limit), int(offset)])
            return list(rows)

    def stats(self) -> dict[str, Any]:
        with self._db() as db:
            n, size = totals(db)
            recent = list(db.query("SELECT outcome FROM requests ORDER BY rowid DESC LIMIT 100"))
        hits = sum(r["outcome"] in ("hit", "exact") for r in recent)
        return {"entries": n, "bytes": size, "capacity_bytes": self.capacity_bytes,
                "recent_requests": len(recent),
                "recent_hit_rate": hits / len(recent) if recent else None}

    def removals(self, limit: int = 1000) -> list[dict[str, Any]]:
        """Recent removals (evicted, deleted, quarantined, lost, cleared), newest first."""
        with self._db() as db:
            return list(db.query("SELECT ts, entry_id, reason FROM removals ORDER BY rowid DESC "
                                 "LIMIT ?", [int(limit)]))

    # ---------------------------------------------------------------- writing
    def new_id(self) -> str:
        return uuid.uuid4().hex

    def store(self, row: dict[str, Any], tensors: dict[str, torch.Tensor],
              signature: torch.Tensor) -> str | None:
        """Write one entry; returns its id once it is durable and indexed, or None
        (reported) when it was not stored. Never returns an id its own eviction removed."""
        if self.read_only:
            self._report(f"trajectory not stored: {self.read_only}")
            return None
        prepared = prepare_entry(row, tensors, signature)
        if isinstance(prepared, str):
            self._report(f"trajectory not stored: {prepared}")
            return None
        entry_id, row, payload, metadata = prepared
        final = self.tensor_path(entry_id)
        with self.lock():  # shared: a repair or Clear all waits until the row is in
            if not self._write_file(final, payload, metadata):
                return None
            kill_point("store.renamed")
            row["bytes"] = final.stat().st_size
            aside: list[Path] = []
            try:
                with self._write() as db:
                    put_entry(db, row)
                    victims = self._choose_victims(db, exclude=entry_id)
                    if victims is None:
                        db.execute("DELETE FROM entries WHERE id = ?", [entry_id])
                    else:
                        aside = self._set_aside(victims)
                        kill_point("store.evict_set_aside")
            except BaseException:
                self._put_back(aside)  # the rows are back: so are their files
                final.unlink(missing_ok=True)  # no row, no file: the folder stays consistent
                raise
            kill_point("store.committed")
            if victims is None:
                final.unlink(missing_ok=True)
                self._report(f"trajectory not stored: its {row['bytes'] / 1e6:.1f} MB do not fit "
                             f"the cache capacity ({self.capacity_bytes / 1e6:.1f} MB) beside the "
                             "pinned entries; raise capacity_gb or unpin entries")
                return None
            self._discard(aside, evicted=len(victims))
        return entry_id

    def import_rows(self, rows: list[dict[str, Any]]) -> int:
        """Index rows as they are (``signature`` bytes included) in one transaction, no
        files written: the benchmarks' bulk fill, and the migration command once it has
        put each entry's file in place (cache_migrate.py)."""
        with self.lock(), self._write() as db:
            put_entries(db, rows)
        return len(rows)

    def _write_file(self, final: Path, payload: dict, metadata: dict[str, str]) -> bool:
        tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
        try:
            save_file(payload, str(tmp), metadata=metadata)
            kill_point("store.tmp_written")
            with open(tmp, "rb") as f:  # durable before it becomes visible
                os.fsync(f.fileno())
            tmp.replace(final)
            return True
        except (OSError, SafetensorError) as e:  # safetensors wraps ENOSPC/EFBIG in its own type
            tmp.unlink(missing_ok=True)
            why = getattr(e, "strerror", None) or e
            self._report(f"trajectory not stored: {why} while writing {final.parent}"
                         " (disk full or read-only?); the result is unaffected")
            return False

    def _choose_victims(self, db, exclude: str | None = None) -> list[str] | None:
        """Inside a write transaction: delete the fewest lowest-utility unpinned rows that
        bring the total within capacity; their ids (files still to unlink), or None when
        even all of them would not be enough (nothing deleted then).

        Utility = (steps saved + 1) × (hits + 1) / bytes: an entry that saved many steps
        for many requests per byte stays; recency breaks ties. Totals are read inside the
        transaction, so a concurrent evictor's deletions are already counted.
        """
        excess = totals(db)[1] - self.capacity_bytes
        if excess <= 0:
            return []
        victims, freed, offset = [], 0, 0
        while freed < excess:  # batches along the utility index: no scan, no sort
            batch = db.execute(f"SELECT id, bytes FROM entries WHERE pinned = 0 AND id != ? "
                               f"ORDER BY {UTILITY_ORDER} LIMIT ? OFFSET ?",
                               [exclude or "", EVICT_BATCH, offset]).fetchall()
            for entry_id, size in batch:
                if freed >= excess:
                    break
                victims.append(entry_id)
                freed += size or 0
            if len(batch) < EVICT_BATCH:
                break
            offset += EVICT_BATCH
        if freed < excess and exclude is not None:
            return None
        for entry_id in victims:
            db.execute("DELETE FROM entries WHERE id = ? AND pinned = 0", [entry_id])
            self._log_removal(db, entry_id, "evicted")
        return victims

    def _set_aside(self, ids: list[str]) -> list[Path]:
        """Inside the transaction that deletes these rows, before it commits: rename each
        entry's file to ``<id>.safetensors.removed``. A re-index reads ``*.safetensors``
        only, so a crash at any later point can never bring a removed entry back; a crash
        before the commit leaves rows without files, which the next open drops. The renamed
        files are unlinked after the commit (``_discard``) or by the next sweep."""
        aside = []
        for entry_id in ids:
            path = self.tensor_path(entry_id)
            target = path.with_name(path.name + REMOVED_SUFFIX)
            try:
                path.replace(target)
            except FileNotFoundError:
                continue  # lost already: nothing to bring back
            aside.append(target)
        return aside

    def _put_back(self, aside: list[Path]) -> None:
        """The transaction rolled back: its rows are back, so are their files."""
        for target in aside:
            try:
                target.replace(target.with_name(target.name[: -len(REMOVED_SUFFIX)]))
            except OSError as e:  # the row now lacks its file: a later read drops it as lost
                log.warning("Carnator: could not restore %s after a rollback (%s)", target.name, e)

    def _discard(self, aside: list[Path], evicted: int = 0) -> None:
        for target in aside:
            target.unlink(missing_ok=True)
            usage_path(target.with_name(target.name[: -len(REMOVED_SUFFIX)])).unlink(missing_ok=True)
        if evicted:
            log.info("Carnator: evicted %s to stay within %.1f MB", _entries(evicted),
                     self.capacity_bytes / 1e6)

    def _update_usage(self, sql: str, args: list, entry_id: str) -> bool:
        """Change hits/pins in the index and mirror them beside the file, in one lock."""
        with self._write() as db:
            if db.execute(sql, args).rowcount == 0:
                return False
            usage = next(db.query("SELECT hits, steps_saved, last_used, pinned FROM entries "
                                  "WHERE id = ?", [entry_id]))
            try:
                write_usage(self.tensor_path(entry_id), usage)
            except OSError as e:  # the index has it; only a future rebuild would miss it
                log.info("Carnator: usage of %s not mirrored beside its file (%s)", entry_id, e)
        return True

    def record_use(self, entry_id: str, steps_saved: float) -> None:
        if self.read_only or not valid_entry_id(entry_id):
            return
        self._update_usage("UPDATE entries SET hits = hits + 1, steps_saved = steps_saved + ?, "
                           "last_used = ? WHERE id = ?", [float(steps_saved), time.time(), entry_id],
                           entry_id)

    def log_request(self, outcome: str, entry_id: str | None, steps_computed: int,
                    steps_total: int, seconds: float, class_key: str) -> None:
        if self.read_only:
            return
        with self._write() as db:
            db["requests"].insert({"ts": time.time(), "outcome": outcome, "entry_id": entry_id,
                                   "steps_computed": steps_computed, "steps_total": steps_total,
                                   "seconds": seconds, "class_key": class_key})
            db.execute("DELETE FROM requests WHERE rowid <= (SELECT max(rowid) FROM requests) - ?",
                       [LOG_ROWS_KEPT])

    def set_pinned(self, entry_id: str, pinned: bool) -> bool:
        if not valid_entry_id(entry_id):
            return False
        return self._update_usage("UPDATE entries SET pinned = ? WHERE id = ?",
                                  [int(pinned), entry_id], entry_id)

    def delete(self, entry_id: str) -> bool:
        """Remove an entry for good: its file set aside and its row deleted in one
        transaction (readers stop seeing it at the commit), then the file unlinked."""
        if not valid_entry_id(entry_id):
            return False
        with self.lock():
            aside: list[Path] = []
            try:
                with self._write() as db:
                    existed = db.execute("DELETE FROM entries WHERE id = ?", [entry_id]).rowcount > 0
                    if existed:
                        self._log_removal(db, entry_id, "deleted")
                        aside = self._set_aside([entry_id])
                        kill_point("delete.set_aside")
            except BaseException:
                self._put_back(aside)
                raise
            kill_point("delete.committed")
            self._discard(aside)
        return existed

    def clear(self) -> int:
        """Every entry, pinned ones too, plus orphaned and temporary files."""
        with self.lock(exclusive=True):
            with self._write() as db:
                drop_all(db.execute, SQLITE)  # not a block rewrite per deleted row
                n = db.execute("DELETE FROM entries").rowcount
                self._log_removal(db, "*", "cleared")
            self._sweep_files(keep=set(), everything=True)
        return n

    def evict_to_capacity(self) -> list[str]:
        """Evict lowest-utility unpinned entries until the folder fits the capacity."""
        with self.lock():
            aside: list[Path] = []
            try:
                with self._write() as db:
                    victims = self._choose_victims(db)
                    aside = self._set_aside(victims)
                    kill_point("evict.set_aside")
            except BaseException:
                self._put_back(aside)
                raise
            kill_point("evict.committed")
            self._discard(aside, evicted=len(victims))
        return victims
