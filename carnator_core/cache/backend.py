"""Which cache a request gets: a folder (SQLite + files, one machine) or a PostgreSQL URL
(a farm of ComfyUI workers sharing one cache).

Both backends offer the same interface (``TrajectoryCache``'s public methods: lookup,
find_exact, get, load_tensors, store, record_use, log_request, set_pinned, delete, clear,
evict_to_capacity, list_entries, stats, removals, plus ``reports`` and ``folder``), so the
pipeline, the nodes and the cache tab never ask which one they hold.

Opening is cheap after the first time: each process keeps one checked cache per location
and hands each request a fresh view of it (its own report list). The full integrity check
(quick_check, rows vs files) runs once per process, again when the index file was replaced
or cut short, after damage was met, and every RECONCILE_EVERY_S — not per request.
"""
from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from pathlib import Path

from .folder import DB_NAME, TrajectoryCache
from .index import checked, file_identity
from .repair import RECONCILE_EVERY_S

URL_ENV = "CARNATOR_CACHE_URL"  # an operator points every worker of a farm at one database
# ...and may let workflows choose among a few more, by name: {"staging": "postgresql://…"}
DATABASES_ENV = "CARNATOR_CACHE_DATABASES"
DATABASE_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
log = logging.getLogger("carnator")
_opened: dict[str, object] = {}
_lock = threading.Lock()


def is_database_url(location: str | None) -> bool:
    return bool(location) and str(location).strip().lower().startswith(("postgresql://", "postgres://"))


def operator_databases() -> dict[str, str]:
    """The databases a workflow may name: the operator's CARNATOR_CACHE_DATABASES (a JSON
    object of name → postgresql:// URL). A malformed list allows none (and is logged)."""
    raw = os.environ.get(DATABASES_ENV, "").strip()
    if not raw:
        return {}
    try:
        named = json.loads(raw)
        if not (isinstance(named, dict) and all(
                isinstance(k, str) and DATABASE_NAME.fullmatch(k) and isinstance(v, str)
                and is_database_url(v) for k, v in named.items())):
            raise ValueError("not an object of name → postgresql:// URL")
    except ValueError as e:
        log.warning("Carnator: %s is unusable (%s); workflows may name no database", DATABASES_ENV, e)
        return {}
    return {k: v.strip() for k, v in named.items()}


def database_location(name: str | None) -> str | None:
    """Where a request's cache lives when its workflow names ``name``: the operator's
    database of that name, the operator's CARNATOR_CACHE_URL when it names none, else None
    (a folder). Where a worker connects — and so where its credentials (~/.pgpass, a
    service file, client certificates) go — is the operator's decision: a workflow that
    gives an address or connection parameters is refused (ValueError), never connected."""
    name = (name or "").strip()
    if not name:
        return os.environ.get(URL_ENV, "").strip() or None
    allowed = operator_databases()
    if name in allowed:
        return allowed[name]
    choices = (f"names this worker allows: {', '.join(sorted(allowed))}" if allowed else
               f"this worker allows none (its operator lists them in {DATABASES_ENV})")
    if not DATABASE_NAME.fullmatch(name):
        raise ValueError(f"database must be a name the operator set up, not an address or "
                         f"connection parameters (a workflow cannot choose where a worker "
                         f"connects); {choices}; leave it empty for the worker's default")
    raise ValueError(f"database {name!r} is not one this worker was set up for; {choices}")


def open_cache(location: str, capacity_bytes: int | None):
    """The cache at ``location`` (a folder or a postgresql:// URL) for one request.
    Raises CacheError (or sqlite3/OS errors) with a message a person can act on."""
    if is_database_url(location):
        from .postgres import open_database  # psycopg is optional: only farms need it
        return open_database(str(location).strip(), capacity_bytes)
    db_path = Path(location).expanduser().resolve() / DB_NAME
    key = str(db_path)
    with _lock:
        known = _opened.get(key)
    identity = file_identity(db_path)
    if (known is not None and identity is not None and checked.get(key) == identity
            and time.monotonic() - known.checked_at < RECONCILE_EVERY_S):
        return known.fresh_view(capacity_bytes)
    cache = TrajectoryCache(location, capacity_bytes)
    with _lock:
        _opened[key] = cache
    return cache
