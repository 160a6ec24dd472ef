"""The shared cache of a farm: index and tensors in one PostgreSQL database.

Same interface and promises as the SQLite cache (cache.py), settled by the database:

- An entry is one transaction: its row, signature, compact descriptor and safetensors
  bytes (``carnator_blobs``) commit together, so a worker killed mid-store leaves nothing
  half-visible and nothing committed is lost.
- Every blob carries its entry id and per-tensor checksums (the same safetensors metadata
  as a file, cache_files.read_entry_from); a mismatch moves it to ``carnator_quarantine``.
- Capacity is shared: the one ``carnator_totals`` row (kept by triggers) is locked by each
  storing or evicting transaction; victims are chosen along the utility index with
  ``FOR UPDATE SKIP LOCKED`` and deleted only if still unpinned, so a pin set by another
  worker is never evicted.
- Lookup scans the class's compact descriptor blocks (cache_descriptors.py) in one
  REPEATABLE READ snapshot, with a fixed-size block cache per worker: a worker's memory
  does not grow with the number of entries. Blocks are appended to and tombstoned while the
  totals row is locked, so writers never race on a block.
- Losing the server is a ``CacheError`` (the request runs as a miss with the message); the
  next operation reconnects by itself.
- Every transaction has a deadline (``deadline_s``, ``CARNATOR_DB_DEADLINE_S``): the server
  enforces it as a statement and lock timeout, and a watchdog on this side shuts the socket
  when it passes — a frozen server (SIGSTOP, a hung host) still ACKs TCP, so neither
  statement nor keepalive timeouts fire. After a call that ran out of time, calls fail at
  once for ``RETRY_AFTER_S`` instead of each waiting out its deadline again, and a request
  waits at most the deadline for the connection another request holds.

psycopg (3) is needed only here: ``pip install "psycopg[binary]"`` on farm workers.
"""
from __future__ import annotations

import io
import logging
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from .entry import (ENTRY_COLUMNS, LOG_ROWS_KEPT, Candidate, LookupResult, StoredEntry,
                          _entries, no_candidates, prepare_entry, row_problem)
from .descriptor_blocks import POSTGRES, drop_all
from .descriptors import shortlist
from .location import default_folder
from .files import (CacheError, EntryDamaged, EntryUnreadable, kill_point,
                          pause_point, read_entry_from, valid_entry_id)
from .postgres_schema import (COLUMNS, SCHEMA, UTILITY_ORDER, PgDescriptorSource,
                              fetch_one_and_free, migrate, put_entries, redact)

log = logging.getLogger("carnator")
CONNECT_TIMEOUT_S = 5
PING_AFTER_S = 1.0  # a connection idle longer is checked before use (requests take seconds)
DEADLINE_ENV = "CARNATOR_DB_DEADLINE_S"
DEFAULT_DEADLINE_S = 10.0  # storing a real-size entry (tens of MB) on a LAN takes ~1 s
RETRY_AFTER_S = 15.0  # after a timed-out call: fail fast this long, then try again
EVICT_BATCH = 256

_shared: dict[str, "PgState"] = {}
_shared_lock = threading.Lock()


class PgState:
    """Per process and URL: one connection (reconnected on loss)."""

    def __init__(self, url: str):
        self.url, self.conn, self.lock = url, None, threading.RLock()
        self.schema_ready = False
        self.capacity_written: int | None = None  # what this process last recorded
        self.last_used = 0.0
        self.folder = default_folder()  # calibration files stay on each machine
        self.blob_bytes_read = 0  # tensor bytes fetched (tests: range reads engage)
        self.deadline_s = deadline_s()
        self.timed_out_at: float | None = None  # when a call last ran out of time


def open_database(url: str, capacity_bytes: int | None) -> "PostgresCache":
    try:
        import psycopg  # noqa: F401
    except ImportError:
        raise CacheError("a postgresql:// cache needs the psycopg package: run "
                         "pip install \"psycopg[binary]\" in ComfyUI's Python; this request "
                         "runs without reuse") from None
    with _shared_lock:
        state = _shared.get(url) or _shared.setdefault(url, PgState(url))
    return PostgresCache(state, capacity_bytes)


class PostgresCache:
    def __init__(self, state: PgState, capacity_bytes: int | None):
        self.state = state
        self.url = redact(state.url)
        self.folder = state.folder  # calibration files stay on each machine
        self.reports: list[str] = []
        self.read_only: str | None = None
        if capacity_bytes is not None and state.capacity_written == int(capacity_bytes):
            self.capacity_bytes = int(capacity_bytes)  # recorded already: no round trip
            return
        with self._tx() as cur:
            stored = self._meta(cur, "capacity_bytes")
            if capacity_bytes is not None and stored != str(int(capacity_bytes)):
                self._set_meta(cur, "capacity_bytes", str(int(capacity_bytes)))
        if capacity_bytes is not None:
            state.capacity_written = int(capacity_bytes)
        self.capacity_bytes = (int(capacity_bytes) if capacity_bytes is not None else
                               int(stored) if stored and stored.isdigit() else 8 * 1024**3)

    # ---------------------------------------------------------------- connection
    @contextmanager
    def _tx(self) -> Iterator[Any]:
        """One transaction on the shared connection, within the deadline; a lost or silent
        server becomes CacheError (the request runs as a miss and says why)."""
        import psycopg
        st = self.state
        self._fail_fast_after_timeout()
        if not st.lock.acquire(timeout=st.deadline_s):
            raise CacheError(f"PostgreSQL cache {self.url} is busy: another request has held its "
                             f"connection for over {st.deadline_s:g} s; this request runs without reuse")
        watchdog = _Watchdog(st)
        try:
            self._fail_fast_after_timeout()  # again: the holder may have just timed out
            conn = self._connection()
            watchdog.arm(conn)
            with conn.transaction(), conn.cursor() as cur:
                yield cur
        except psycopg.OperationalError as e:
            self._drop_connection()
            late = watchdog.fired or isinstance(e, (psycopg.errors.QueryCanceled,
                                                    psycopg.errors.LockNotAvailable,
                                                    psycopg.errors.ConnectionTimeout))
            if late:
                st.timed_out_at = time.monotonic()
            why = f"no answer within {st.deadline_s:g} s" if late else _first_line(e)
            raise CacheError(f"PostgreSQL cache {self.url} is unreachable ({why}); "
                             "the request runs without reuse and reconnects by itself") from e
        except psycopg.Error as e:
            if st.conn is not None and st.conn.broken:
                self._drop_connection()
            raise CacheError(f"PostgreSQL cache {self.url}: {_first_line(e)}") from e
        else:
            st.timed_out_at = None
        finally:
            watchdog.disarm()
            st.lock.release()

    def _fail_fast_after_timeout(self) -> None:
        """Shortly after a call ran out of time, answer at once instead of waiting again."""
        at = self.state.timed_out_at
        if at is not None and time.monotonic() - at < RETRY_AFTER_S:
            raise CacheError(f"PostgreSQL cache {self.url} is unreachable (no answer within "
                             f"{self.state.deadline_s:g} s, {time.monotonic() - at:.0f} s ago); "
                             "the request runs without reuse and retries later by itself")

    def _connection(self):
        import psycopg
        st = self.state
        idle = time.monotonic() - st.last_used
        st.last_used = time.monotonic()
        if st.conn is not None and not (st.conn.closed or st.conn.broken) and idle > PING_AFTER_S:
            try:  # a server restarted since the last request leaves a dead connection behind
                with _Watchdog(st).armed(st.conn):
                    st.conn.execute("SELECT 1")
            except psycopg.OperationalError:
                self._drop_connection()
        if st.conn is None or st.conn.closed or st.conn.broken:
            st.conn = psycopg.connect(**connection_settings(st.url, st.deadline_s))
            if not st.schema_ready:
                with _Watchdog(st).armed(st.conn), st.conn.transaction(), st.conn.cursor() as cur:
                    cur.execute("SELECT pg_advisory_xact_lock(74218)")  # one creator at a time
                    for sql in SCHEMA:
                        cur.execute(sql)
                    migrate(cur)
                st.schema_ready = True
        return st.conn

    def _drop_connection(self) -> None:
        conn, self.state.conn = self.state.conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: BLE001 - already broken
                pass

    def _report(self, message: str) -> None:
        log.warning("Carnator: %s", message)
        self.reports.append(message)

    @staticmethod
    def _meta(cur, key: str) -> str | None:
        cur.execute("SELECT value FROM carnator_meta WHERE key = %s", [key])
        row = cur.fetchone()
        return row[0] if row else None

    @staticmethod
    def _set_meta(cur, key: str, value: str) -> None:
        cur.execute("INSERT INTO carnator_meta (key, value) VALUES (%s, %s) ON CONFLICT (key) "
                    "DO UPDATE SET value = excluded.value", [key, value])

    @staticmethod
    def _log_removal(cur, entry_id: str, reason: str) -> None:
        cur.execute("INSERT INTO carnator_removals (ts, entry_id, reason) VALUES (%s, %s, %s)",
                    [time.time(), entry_id, reason])

    @staticmethod
    def _rows(cur) -> list[dict[str, Any]]:
        names = [d.name for d in cur.description]
        return [dict(zip(names, r)) for r in cur.fetchall()]

    # ---------------------------------------------------------------- reading
    def get(self, entry_id: str) -> StoredEntry | None:
        if not valid_entry_id(entry_id):
            return None
        with self._tx() as cur:
            cur.execute(f"SELECT {COLUMNS} FROM carnator_entries e WHERE id = %s", [entry_id])
            rows = self._rows(cur)
        return StoredEntry(rows[0]) if rows else None

    def find_exact(self, exact_key: str) -> StoredEntry | None:
        with self._tx() as cur:
            cur.execute(f"SELECT {COLUMNS} FROM carnator_entries e WHERE exact_key = %s "
                        "ORDER BY created DESC LIMIT 1", [exact_key])
            rows = self._rows(cur)
        return StoredEntry(rows[0]) if rows else None

    def lookup(self, class_key: str, signature: torch.Tensor, top_k: int = 3) -> LookupResult:
        """As TrajectoryCache.lookup: a scan of the class's compact descriptor blocks, then
        exact cosine of the short list's full signatures."""
        query = signature.detach().float().reshape(-1).cpu().numpy()
        pause_point("pg.lookup")  # tests: the database goes away in the middle of a request
        with self._tx() as cur:
            cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")  # one snapshot
            ids, comparable = shortlist(PgDescriptorSource(cur), self.state.url, class_key,
                                        query, query.size)
            if not ids:
                return self._no_candidates(cur, class_key)
            cur.execute(f"SELECT {COLUMNS} FROM carnator_entries e WHERE e.id = ANY(%s)", [ids])
            rows = self._rows(cur)
            # the short list's signatures as ONE value, its result freed at once: one 3 MB
            # buffer per lookup instead of 64 values and 64 copies of 49 KB (hex text before)
            # kept alive until the garbage collector ran (fetch_one_and_free)
            cur.execute("SELECT array_agg(id ORDER BY id), string_agg(signature, ''::bytea ORDER "
                        "BY id) FROM carnator_signatures WHERE id = ANY(%s) AND "
                        "octet_length(signature) = %s", [ids, 4 * query.size], binary=True)
            sig_ids, blob = fetch_one_and_free(cur)
        # another signature layout is not comparable (filtered by length above)
        matrix = np.frombuffer(blob or b"", np.float32).reshape(-1, query.size)
        sims = dict(zip(sig_ids or [], (matrix @ query).tolist()))
        at = {entry_id: k for k, entry_id in enumerate(sig_ids or [])}
        scored = []
        for row in sorted((r for r in rows if r["id"] in sims), key=lambda r: -sims[r["id"]]):
            row["signature"] = matrix[at[row["id"]]].tobytes()  # only rows it keeps carry one
            if row_problem(row) is None:
                scored.append(Candidate(StoredEntry(row), sims[row["id"]]))
                if len(scored) == top_k:
                    break
            else:
                self._report(f"index row of cache entry {row['id']} is malformed; skipped")
        if not scored:
            return LookupResult([], "no comparable entries (signature layout differs)")
        return LookupResult(scored[:top_k], f"{_entries(comparable)} in this class, best "
                            f"similarity {scored[0].similarity:.3f}")

    @staticmethod
    def _no_candidates(cur, class_key: str) -> LookupResult:
        cur.execute("SELECT n FROM carnator_totals WHERE k = 0")
        total = cur.fetchone()[0]
        cur.execute("SELECT count(*), count(nullif(source_entry, '')) FROM carnator_entries "
                    "WHERE class_key = %s", [class_key])
        in_class, reused = cur.fetchone()
        return no_candidates(total, in_class, reused)

    def load_tensors(self, entry_id: str, names: list[str] | None = None) -> dict[str, torch.Tensor] | None:
        """Verified tensors of an entry, or None (reported). Damage quarantines it.

        Named tensors (the gate's tile maps, one snapshot) are read range by range from the
        blob, so a candidate's other tensors never cross the network."""
        if not valid_entry_id(entry_id):
            return None
        problem = None
        with self._tx() as cur:
            cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")  # one entry version
            cur.execute("SELECT e.checksum, octet_length(b.data) FROM carnator_entries e JOIN "
                        "carnator_blobs b USING (id) WHERE e.id = %s", [entry_id])
            found = cur.fetchone()
            if found is None:
                return None  # evicted or deleted meanwhile
            blob = _BlobFile(cur, entry_id, self.state) if names is not None else None
            if blob is None:
                cur.execute("SELECT data FROM carnator_blobs WHERE id = %s", [entry_id])
                blob = io.BytesIO(bytes(fetch_one_and_free(cur)[0]))
                self.state.blob_bytes_read += found[1]
            try:
                _, tensors, _ = read_entry_from(blob, found[1], Path(f"{entry_id}.safetensors"),
                                                entry_id, found[0], names)
            except EntryDamaged as e:
                problem = str(e)
            except EntryUnreadable as e:
                self._report(f"cache entry {entry_id} could not be read now ({e}); it is kept")
                return None
        if problem:
            self._quarantine_entry(entry_id, problem)
            return None
        return tensors

    def _quarantine_entry(self, entry_id: str, why: str) -> None:
        with self._tx() as cur:
            cur.execute("INSERT INTO carnator_quarantine (ts, entry_id, why, data) SELECT %s, id, %s, "
                        "data FROM carnator_blobs WHERE id = %s", [time.time(), why, entry_id])
            cur.execute("DELETE FROM carnator_entries WHERE id = %s", [entry_id])
            if cur.rowcount:
                self._log_removal(cur, entry_id, "quarantined")
        self._report(f"cache entry {entry_id} quarantined: {why}; the request runs without it")

    def list_entries(self, offset: int = 0, limit: int = 50) -> list[dict[str, Any]]:
        with self._tx() as cur:
            cur.execute(f"SELECT {COLUMNS} FROM carnator_entries e ORDER BY created DESC "
                        "LIMIT %s OFFSET %s", [int(limit), int(offset)])
            return self._rows(cur)

    def stats(self) -> dict[str, Any]:
        with self._tx() as cur:
            cur.execute("SELECT n, bytes FROM carnator_totals WHERE k = 0")
            n, size = cur.fetchone()
            cur.execute("SELECT outcome FROM carnator_requests ORDER BY seq DESC LIMIT 100")
            recent = [r[0] for r in cur.fetchall()]
        hits = sum(o in ("hit", "exact") for o in recent)
        return {"entries": n, "bytes": size, "capacity_bytes": self.capacity_bytes,
                "recent_requests": len(recent),
                "recent_hit_rate": hits / len(recent) if recent else None}

    def removals(self, limit: int = 1000) -> list[dict[str, Any]]:
        with self._tx() as cur:
            cur.execute("SELECT ts, entry_id, reason FROM carnator_removals ORDER BY seq DESC "
                        "LIMIT %s", [int(limit)])
            return self._rows(cur)

    # ---------------------------------------------------------------- writing
    def store(self, row: dict[str, Any], tensors: dict[str, torch.Tensor],
              signature: torch.Tensor) -> str | None:
        """One transaction: row, signature, descriptor, blob and the evictions it needs."""
        from safetensors.torch import save
        prepared = prepare_entry(row, tensors, signature)
        if isinstance(prepared, str):
            self._report(f"trajectory not stored: {prepared}")
            return None
        entry_id, row, payload, metadata = prepared
        data = save(payload, metadata=metadata)
        row["bytes"] = len(data)
        with self._tx() as cur:
            cur.execute("SELECT bytes FROM carnator_totals WHERE k = 0 FOR UPDATE")
            put_entries(cur, [row], {row["id"]: data})
            victims = self._choose_victims(cur, exclude=entry_id)
            if victims is None:
                cur.execute("DELETE FROM carnator_entries WHERE id = %s", [entry_id])
            kill_point("pg.store.inserted")  # tests: a worker dying before its commit
            pause_point("pg.store.inserted")
        if victims is None:
            self._report(f"trajectory not stored: its {row['bytes'] / 1e6:.1f} MB do not fit the "
                         f"cache capacity ({self.capacity_bytes / 1e6:.1f} MB) beside the pinned "
                         "entries; raise capacity_gb or unpin entries")
            return None
        if victims:
            log.info("Carnator: evicted %s to stay within %.1f MB", _entries(len(victims)),
                     self.capacity_bytes / 1e6)
        return entry_id

    def import_rows(self, rows: list[dict[str, Any]], blobs: dict[str, bytes] | None = None) -> int:
        """Bulk insert (migration, benchmarks): rows with ``signature`` bytes, and blobs."""
        with self._tx() as cur:
            cur.execute("SELECT bytes FROM carnator_totals WHERE k = 0 FOR UPDATE")
            put_entries(cur, rows, blobs or {})
        return len(rows)

    def _choose_victims(self, cur, exclude: str | None = None) -> list[str] | None:
        """Holding the totals row: delete the fewest lowest-utility unpinned entries that
        bring the total within capacity (as TrajectoryCache._choose_victims)."""
        cur.execute("SELECT bytes FROM carnator_totals WHERE k = 0")
        excess = cur.fetchone()[0] - self.capacity_bytes
        if excess <= 0:
            return []
        victims, freed = [], 0
        while freed < excess:
            cur.execute(f"SELECT id, bytes FROM carnator_entries WHERE pinned = 0 AND id <> %s "
                        f"ORDER BY {UTILITY_ORDER} LIMIT %s FOR UPDATE SKIP LOCKED",
                        [exclude or "", EVICT_BATCH])
            batch = cur.fetchall()
            for entry_id, size in batch:
                if freed >= excess:
                    break
                cur.execute("DELETE FROM carnator_entries WHERE id = %s AND pinned = 0", [entry_id])
                if cur.rowcount:
                    victims.append(entry_id)
                    freed += size or 0
                    self._log_removal(cur, entry_id, "evicted")
            if len(batch) < EVICT_BATCH:
                break
        if freed < excess and exclude is not None:
            return None
        return victims

    def record_use(self, entry_id: str, steps_saved: float) -> None:
        if valid_entry_id(entry_id):
            with self._tx() as cur:
                cur.execute("UPDATE carnator_entries SET hits = hits + 1, steps_saved = steps_saved "
                            "+ %s, last_used = %s WHERE id = %s",
                            [float(steps_saved), time.time(), entry_id])

    def log_request(self, outcome: str, entry_id: str | None, steps_computed: int,
                    steps_total: int, seconds: float, class_key: str) -> None:
        with self._tx() as cur:
            cur.execute("INSERT INTO carnator_requests (ts, outcome, entry_id, steps_computed, "
                        "steps_total, seconds, class_key) VALUES (%s, %s, %s, %s, %s, %s, %s) "
                        "RETURNING seq", [time.time(), outcome, entry_id, steps_computed,
                                          steps_total, seconds, class_key])
            seq = cur.fetchone()[0]
            if seq % 100 == 0:  # trimmed now and then, not on every request
                cur.execute("DELETE FROM carnator_requests WHERE seq <= %s", [seq - LOG_ROWS_KEPT])
                cur.execute("DELETE FROM carnator_removals WHERE seq <= (SELECT max(seq) FROM "
                            "carnator_removals) - %s", [LOG_ROWS_KEPT])

    def set_pinned(self, entry_id: str, pinned: bool) -> bool:
        if not valid_entry_id(entry_id):
            return False
        with self._tx() as cur:
            cur.execute("UPDATE carnator_entries SET pinned = %s WHERE id = %s",
                        [int(pinned), entry_id])
            return cur.rowcount > 0

    def delete(self, entry_id: str) -> bool:
        if not valid_entry_id(entry_id):
            return False
        with self._tx() as cur:
            cur.execute("SELECT 1 FROM carnator_totals WHERE k = 0 FOR UPDATE")
            cur.execute("DELETE FROM carnator_entries WHERE id = %s", [entry_id])
            existed = cur.rowcount > 0
            if existed:
                self._log_removal(cur, entry_id, "deleted")
            kill_point("pg.delete.deleted")  # tests: row, blob and log go in one commit or none
        kill_point("pg.delete.committed")
        return existed

    def clear(self) -> int:
        with self._tx() as cur:
            cur.execute("SELECT 1 FROM carnator_totals WHERE k = 0 FOR UPDATE")
            drop_all(cur.execute, POSTGRES)  # not a block update per deleted row
            cur.execute("DELETE FROM carnator_entries")
            n = cur.rowcount
            self._log_removal(cur, "*", "cleared")
        return n

    def evict_to_capacity(self) -> list[str]:
        with self._tx() as cur:
            cur.execute("SELECT 1 FROM carnator_totals WHERE k = 0 FOR UPDATE")
            victims = self._choose_victims(cur) or []
            kill_point("pg.evict.deleted")
        kill_point("pg.evict.committed")
        return victims


class _BlobFile:
    """A read-only file over one stored blob, fetched by ranges (the column's EXTERNAL
    storage lets substring() read only the chunks it needs): what read_entry_from reads."""

    def __init__(self, cur, entry_id: str, state: PgState):
        self.cur, self.entry_id, self.pos, self.state = cur, entry_id, 0, state

    def seek(self, pos: int) -> None:
        self.pos = pos

    def read(self, n: int) -> bytes:
        self.cur.execute("SELECT substring(data FROM %s FOR %s) FROM carnator_blobs WHERE id = %s",
                         [self.pos + 1, n, self.entry_id])
        row = self.cur.fetchone()
        data = bytes(row[0]) if row and row[0] is not None else b""
        self.pos += len(data)
        self.state.blob_bytes_read += len(data)
        return data


def deadline_s() -> float:
    """The operator's deadline for one database call (CARNATOR_DB_DEADLINE_S), else 10 s."""
    try:
        value = float(os.environ.get(DEADLINE_ENV, "") or DEFAULT_DEADLINE_S)
    except ValueError:
        value = DEFAULT_DEADLINE_S
    return value if 0.1 <= value <= 3600 else DEFAULT_DEADLINE_S


def connection_settings(url: str, deadline: float) -> dict[str, Any]:
    """psycopg.connect's arguments: the operator's URL with timeouts on every layer —
    connect, TCP keepalive and user timeout (a host that vanished), and the server's own
    statement and lock timeouts (a live server that is slow); the operator's own ``options``
    are kept."""
    from psycopg.conninfo import conninfo_to_dict
    params = conninfo_to_dict(url)
    ms = int(deadline * 1000)
    own = f"-c statement_timeout={ms} -c lock_timeout={ms} -c idle_in_transaction_session_timeout={4 * ms}"
    params["options"] = f"{params['options']} {own}" if params.get("options") else own
    params.setdefault("connect_timeout", max(1, min(CONNECT_TIMEOUT_S, int(deadline + 0.999))))
    params.setdefault("keepalives", 1)
    params.setdefault("keepalives_idle", max(1, int(deadline)))
    params.setdefault("keepalives_interval", 2)
    params.setdefault("keepalives_count", 3)
    params.setdefault("tcp_user_timeout", ms)
    return {**params, "autocommit": True, "application_name": "carnator"}


class _Watchdog:
    """Shuts a connection's socket when a call outlives the deadline. A stopped server's
    kernel still acknowledges packets, so only this side can decide it has waited enough;
    shutting the socket (not closing the descriptor, which psycopg still owns) makes the
    blocked call return with an OperationalError at once."""

    def __init__(self, state: PgState):
        self.state, self.timer, self.fired = state, None, False

    def arm(self, conn) -> None:
        self.timer = threading.Timer(self.state.deadline_s, self._fire, [conn])
        self.timer.daemon = True
        self.timer.start()

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()

    @contextmanager
    def armed(self, conn) -> Iterator[None]:
        self.arm(conn)
        try:
            yield
        finally:
            self.disarm()

    def _fire(self, conn) -> None:
        import socket
        self.fired = True
        try:
            fd = os.dup(conn.fileno())
        except Exception:  # noqa: BLE001 - already closed: nothing left to wait on
            return
        with socket.socket(fileno=fd) as sock:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        log.warning("Carnator: PostgreSQL cache %s gave no answer within %g s; connection dropped",
                    redact(self.state.url), self.state.deadline_s)


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


__all__ = ["PostgresCache", "open_database", "ENTRY_COLUMNS"]
