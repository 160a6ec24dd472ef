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

import os
import threading
import time
from pathlib import Path

from .cache import DB_NAME, TrajectoryCache
from .cache_index import checked, file_identity
from .cache_repair import RECONCILE_EVERY_S

URL_ENV = "CARNATOR_CACHE_URL"  # an operator points every worker of a farm at one database
_opened: dict[str, object] = {}
_lock = threading.Lock()


def is_database_url(location: str | None) -> bool:
    return bool(location) and str(location).strip().lower().startswith(("postgresql://", "postgres://"))


def configured_location(location: str | None) -> str | None:
    """The node's URL, else the operator's environment variable, else None (a folder)."""
    if is_database_url(location):
        return str(location).strip()
    env = os.environ.get(URL_ENV, "").strip()
    return env or None


def open_cache(location: str, capacity_bytes: int | None):
    """The cache at ``location`` (a folder or a postgresql:// URL) for one request.
    Raises CacheError (or sqlite3/OS errors) with a message a person can act on."""
    if is_database_url(location):
        from .cache_pg import open_database  # psycopg is optional: only farms need it
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
