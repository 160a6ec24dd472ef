"""Opening a cache folder, and keeping its index and its files in agreement.

Every tensor file carries its own index row, so the files are the truth and the index can
always be rebuilt from them. On every open:

- ``PRAGMA quick_check``; a corrupt index is moved to ``quarantine/`` (unique names) and
  rebuilt from the files, under the folder's exclusive lock, by exactly one process while
  the others wait and then use the rebuilt index;
- a missing, emptied or partly lost index (deleted file, a rebuild killed part-way, a WAL
  frame that failed its checksum) is noticed because the files outnumber the rows, or the
  ``rebuild_pending`` mark is still set, and the missing rows are re-indexed;
- every ``RECONCILE_EVERY_S`` one process sweeps: files nobody indexes are re-indexed (so
  they count against capacity), temporary files of dead writers and stale sidecars are
  removed, rows whose file is gone are dropped.

Pins and hit counts survive a rebuild through the ``<id>.usage.json`` sidecars.
"""
from __future__ import annotations

import errno
import logging
import os
import sqlite3
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from .index import create_index_tables, put_entry, totals
from .files import (ENTRY_ID_RE, REMOVED_SUFFIX, CacheError, EntryDamaged, EntryUnreadable,
                          kill_point, missing_reason, read_entry, read_usage)

log = logging.getLogger("carnator")

RECONCILE_EVERY_S = 600.0
DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EROFS}


class IndexRepair:
    """Open-time checks and repair; mixed into TrajectoryCache (which defines _db/_write)."""

    # ---------------------------------------------------------------- folder
    def _ensure_folder(self) -> None:
        try:
            self.tensor_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise self._unwritable(e) from e
        probe = self.folder / f".write-test-{os.getpid()}"  # one name per process, not per request
        try:
            probe.write_bytes(b"ok")
        except OSError as e:
            if e.errno not in DISK_FULL or not self.db_path.exists():
                raise self._unwritable(e) from e
            # nothing can be written, but what is stored can still be served
            self.read_only = (f"{e.strerror} on {self.folder} (disk full or read-only); stored "
                              "results are still reused, new ones are not kept until space is freed")
            self._report(f"cache folder is not writable: {self.read_only}")
        finally:
            try:
                probe.unlink(missing_ok=True)
            except OSError:
                pass

    def _unwritable(self, e: OSError) -> CacheError:
        not_a_folder = next((p for p in (self.folder, *self.folder.parents)
                             if p.exists() and not p.is_dir()), None)
        if not_a_folder is not None or e.errno in (errno.ENOTDIR, errno.EEXIST):
            where = not_a_folder or self.folder
            return CacheError(f"Carnator cache folder {self.folder} cannot be used: {where} is a "
                              "file, not a folder; the request runs without reuse. Choose another "
                              "folder in the Carnator Cache node (or move that file away).")
        hint = ("free space on that disk" if e.errno in DISK_FULL else
                "choose another folder in the Carnator Cache node or fix its permissions")
        return CacheError(f"Carnator cache folder {self.folder} is not writable "
                          f"({e.strerror or e}); the request runs without reuse. {hint[0].upper()}"
                          f"{hint[1:]}.")

    # ---------------------------------------------------------------- open
    full_checks = 0  # how often this process ran the open-time checks (tests count them)

    def _open_index(self) -> None:
        IndexRepair.full_checks += 1
        try:
            state = self._retry_while_locked(self._inspect)
        except sqlite3.OperationalError as e:
            # locked past the busy timeout, or an I/O error: not corruption, keep the file
            raise CacheError(f"Carnator cache index {self.db_path} is unavailable ({e}); the "
                             "request runs without reuse") from e
        except sqlite3.DatabaseError as e:
            self._repair_index(str(e))
            return
        if state["check"] != "ok":
            self._repair_index(state["check"])
        elif state["needs_schema"]:
            if self.read_only:
                raise CacheError(f"Carnator cache index {self.db_path} cannot be created: "
                                 f"{self.read_only}")
            self._with_exclusive(self._create_schema)
            self._reconcile_if_needed()
        elif self._should_reconcile(state) and not self.read_only:
            self._reconcile_if_needed()

    def _inspect(self) -> dict[str, Any]:
        with self._db() as db:
            check = db.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                return {"check": check}
            tables = set(db.table_names())
            state = {"check": check, "needs_schema": not {"entries", "meta", "requests",
                                                          "removals"} <= tables}
            if state["needs_schema"]:
                return state
            columns = db["entries"].columns_dict
            if ("checksum" not in columns or "signature" in columns or "totals" not in tables
                    or "descriptor_blocks" not in tables):
                state["needs_schema"] = True  # an older schema: migrated in place
                return state
            state["rows"] = totals(db)[0]  # kept by triggers: no scan
            state["pending"] = self._meta(db, "rebuild_pending") == "1"
            state["last"] = float(self._meta(db, "last_reconcile") or 0)
        return state

    def _should_reconcile(self, state: dict[str, Any]) -> bool:
        if state["pending"] or time.time() - state["last"] > RECONCILE_EVERY_S:
            return True
        return self._count_entry_files() != state["rows"]

    def _count_entry_files(self) -> int:
        try:
            with os.scandir(self.tensor_dir) as it:
                return sum(1 for e in it if e.name.endswith(".safetensors"))
        except OSError:
            return 0

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

    def _with_exclusive(self, fn):
        with self.lock(exclusive=True):
            return self._retry_while_locked(fn)

    def _create_schema(self) -> None:
        """Create what is missing (IF NOT EXISTS: a second creator is a no-op)."""
        with self._db() as db:
            if db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                db.execute("PRAGMA journal_mode=WAL")
        from .index import SCHEMA_VERSION
        with self._write() as db:
            tables = set(db.table_names())
            if "meta" not in tables:
                db["meta"].create({"key": str, "value": str}, pk="key")
            create_index_tables(db)
            if "requests" not in tables:
                db["requests"].create({"ts": float, "outcome": str, "entry_id": str,
                                       "steps_computed": int, "steps_total": int,
                                       "seconds": float, "class_key": str})
            if "removals" not in tables:
                db["removals"].create({"ts": float, "entry_id": str, "reason": str})
            self._set_meta(db, "schema_version", str(SCHEMA_VERSION))

    # ---------------------------------------------------------------- corrupt index
    def _repair_index(self, why: str) -> None:
        """Quarantine a corrupt index and rebuild it from the files, once for everyone."""
        if self.read_only:
            raise CacheError(f"Carnator cache index {self.db_path} is damaged ({why}) and "
                             f"cannot be rebuilt: {self.read_only}")
        with self.lock(exclusive=True):
            try:  # another process may have repaired it while this one waited for the lock
                healthy = self._retry_while_locked(self._inspect)["check"] == "ok"
            except sqlite3.OperationalError:
                raise
            except sqlite3.DatabaseError:
                healthy = False
            if not healthy:
                moved = self._quarantine_index()
                kill_point("repair.moved")
                self._retry_while_locked(self._create_schema)
                with self._write() as db:
                    self._set_meta(db, "rebuild_pending", "1")
                self._report(f"cache index {self.db_path} was unreadable ({why}); moved to "
                             f"{moved} and rebuilt from the tensor files")
            self._reconcile_locked()

    def _quarantine_index(self) -> Path:
        self.quarantine_dir.mkdir(exist_ok=True)
        tag = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        target = self.quarantine_dir / f"{self.db_path.name}.{tag}.corrupt"
        for suffix in ("", "-wal", "-shm"):
            p = Path(str(self.db_path) + suffix)
            if p.exists():
                p.replace(Path(str(target) + suffix))
        return target

    def _move_to_quarantine(self, path: Path) -> None:
        self.quarantine_dir.mkdir(exist_ok=True)
        tag = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            path.replace(self.quarantine_dir / f"{path.name}.{tag}")
        except FileNotFoundError:
            pass  # another process moved it first

    # ---------------------------------------------------------------- files vs rows
    def _reconcile_if_needed(self) -> None:
        with self.lock(exclusive=True):
            state = self._retry_while_locked(self._inspect)  # again: someone may have done it
            if state["check"] == "ok" and not state["needs_schema"] and self._should_reconcile(state):
                self._reconcile_locked()

    def reindex_tensor_files(self) -> int:
        """Index every valid tensor file the index does not know (repair); how many."""
        with self.lock(exclusive=True):
            return self._reconcile_locked()

    def _reconcile_locked(self) -> int:
        """Holding the exclusive lock: make rows and files agree. Returns rows added."""
        with self._db() as db:
            known = {r[0] for r in db.execute("SELECT id FROM entries")}
        names = sorted(os.listdir(self.tensor_dir))
        present = {n[: -len(".safetensors")] for n in names if n.endswith(".safetensors")}
        added = 0
        for entry_id in sorted(present - known):
            if ENTRY_ID_RE.fullmatch(entry_id) and self._index_file(entry_id):
                added += 1
                kill_point("reconcile.indexed_one")
        lost = {e: missing_reason(self.tensor_dir / f"{e}.safetensors") for e in known - present}
        with self._write() as db:
            for entry_id, reason in lost.items():
                db.execute("DELETE FROM entries WHERE id = ?", [entry_id])
                self._log_removal(db, entry_id, reason)
            self._set_meta(db, "rebuild_pending", "0")
            self._set_meta(db, "last_reconcile", repr(time.time()))
        for entry_id in sorted(e for e, reason in lost.items() if reason == "lost"):
            self._report(f"cache entry {entry_id} lost its tensor file; removed from the index")
        self._sweep_files(keep=present)
        if added:
            self._report(f"re-indexed {added} tensor file(s) the cache index did not list")
        return added

    def _index_file(self, entry_id: str) -> bool:
        path = self.tensor_dir / f"{entry_id}.safetensors"
        try:
            row = self._row_from_file(path, entry_id)
        except FileNotFoundError:
            return False
        except EntryDamaged as e:
            self._move_to_quarantine(path)
            self._report(f"cache file {path.name} quarantined during re-index: {e}")
            return False
        except EntryUnreadable as e:
            self._report(f"cache file {path.name} not re-indexed now ({e}); kept for next time")
            return False
        with self._write() as db:
            put_entry(db, row)
        return True

    def _row_from_file(self, path: Path, entry_id: str) -> dict[str, Any]:
        """The index row an entry file describes, fully verified against its own checksums,
        with the pins and hits of its sidecar."""
        from .entry import ENTRY_COLUMNS
        meta_row, tensors, checksum = read_entry(path, entry_id, None, None)
        if "signature" not in tensors:
            raise EntryDamaged(f"{path.name}: has no signature tensor")
        row = {k: meta_row.get(k) for k in ENTRY_COLUMNS if k in meta_row}
        row.update(read_usage(path))
        row["signature"] = tensors["signature"].float().numpy().astype(np.float32).tobytes()
        row["bytes"] = path.stat().st_size
        row["checksum"] = checksum
        if not row.get("class_key"):
            raise EntryDamaged(f"{path.name}: its metadata has no compatibility class")
        return row

    def restore_row(self, entry_id: str) -> dict[str, Any] | None:
        """Replace a malformed index row by the one its file carries; None if impossible."""
        path = self.tensor_dir / f"{entry_id}.safetensors"
        try:
            row = self._row_from_file(path, entry_id)
        except FileNotFoundError:
            self._handle_missing(entry_id)
            return None
        except EntryDamaged as e:
            self._quarantine_entry(entry_id, str(e))
            return None
        except EntryUnreadable:
            return None
        with self._write() as db:
            if db.execute("SELECT 1 FROM entries WHERE id = ?", [entry_id]).fetchone() is None:
                return None  # removed meanwhile
            put_entry(db, row)
        return row

    def _sweep_files(self, keep: set[str], everything: bool = False) -> None:
        """Holding the exclusive lock, so no writer of this version is mid-write: remove
        temporary files, sidecars of entries not in ``keep``, stale write probes, and with
        ``everything`` (Clear all) every entry file, indexed or orphaned."""
        for name in os.listdir(self.tensor_dir):
            stem = name.split(".", 1)[0]
            temporary = ".tmp-" in name or name.endswith(REMOVED_SUFFIX)  # set aside by a removal
            orphan_side = name.endswith(".usage.json") and stem not in keep
            entry_file = everything and name.endswith(".safetensors") and ENTRY_ID_RE.fullmatch(stem)
            if temporary or orphan_side or entry_file:
                try:
                    (self.tensor_dir / name).unlink()
                except FileNotFoundError:
                    pass
        for probe in self.folder.glob(".write-test-*"):
            probe.unlink(missing_ok=True)
