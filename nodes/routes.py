"""HTTP routes under ``/carnator/`` for the front end: browse, preview, pin, delete, clear.

Registered on ComfyUI's ``PromptServer`` when this module is imported inside a running
server (the pack's ``__init__`` imports it); importing it anywhere else does nothing.

Every route serves the default cache folder (``comfy_adapter.default_cache_folder``) and
nothing else. Input handling, because these answer anything that can reach the server:

- an entry id must match the cache's id pattern *and* name a row in the index; the file
  path is then built by the cache from the id read back from the database, never from the
  URL;
- page sizes and offsets are bounded integers; request bodies are small JSON objects with
  exactly-typed fields;
- every error is a JSON object ``{"error": "..."}`` with 400 (malformed), 403 (foreign
  origin), 404 (unknown), 413 (body too large), 415 (not JSON) or 503 (cache unusable);
- mutating routes (pin, delete, clear) accept only ``application/json`` from this server's
  own origin (``check_same_origin``): no other web page can clear or pin;
- the cache's SQLite and file work runs in a worker thread so a busy database never stalls
  the server's event loop (which also carries the progress websocket).
"""
from __future__ import annotations

import asyncio
import io
import json
import logging
import re
import sys
from urllib.parse import urlsplit
from typing import Any, Awaitable, Callable

import torch
from aiohttp import web

from ..carnator_core.cache.folder import ENTRY_ID_RE, CacheError, TrajectoryCache
from ..carnator_core.cache.backend import database_location
from ..carnator_core.cache.backend import open_cache as open_location
from ..carnator_core.comfy_adapter import (TINYWORLD_LATENT_FORMAT, default_cache_folder,
                                           latent_rgb_factors, model_space)
from ..carnator_core.gate import DEFAULT_PROBE_FRACTION
from ..carnator_core.preview import frame_strip_png

log = logging.getLogger("carnator")

PREFIX = "/carnator"
DEFAULT_PAGE = 50
MAX_PAGE = 200
MAX_OFFSET = 10**9
MAX_BODY_BYTES = 4096
PREVIEW_FRAMES = 4
PREVIEW_FRAME_PX = 96

# Columns a page may see. The signature blob and the internal keys stay on the server.
PUBLIC_COLUMNS = ("id", "prompt", "backbone", "latent_format", "latent_shape", "steps", "seed",
                  "cfg", "sampler", "scheduler", "probe_step", "hits", "steps_saved", "bytes",
                  "created", "last_used", "pinned", "source_entry")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class RequestError(Exception):
    """An answer to send instead of a result: status code and a message a person can act on."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def error_response(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def json_errors(handler: Handler) -> Handler:
    """Turn RequestError and cache problems into JSON answers; log anything unexpected."""
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except RequestError as e:
            return error_response(e.status, e.message)
        except CacheError as e:
            return error_response(503, str(e))
        except Exception:  # noqa: BLE001 - the page gets JSON, the log gets the traceback
            log.exception("Carnator: %s %s failed", request.method, request.path)
            return error_response(500, "internal error in the Carnator cache route; see the ComfyUI log")
    wrapped.__name__ = handler.__name__
    return wrapped


# ------------------------------------------------------------------ input validation
def open_cache() -> TrajectoryCache:
    """The cache the tab shows: the farm's database when CARNATOR_CACHE_URL is set, else the
    default folder (both backends answer the same methods)."""
    return open_location(database_location(None) or default_cache_folder(), None)


def query_int(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    if not re.fullmatch(r"[0-9]{1,10}", raw):
        raise RequestError(400, f"{name} must be a whole number from {low} to {high}, got {raw[:40]!r}")
    value = int(raw)
    if not low <= value <= high:
        raise RequestError(400, f"{name} must be from {low} to {high}, got {value}")
    return value


def entry_id_of(request: web.Request) -> str:
    raw = request.match_info.get("entry_id", "")
    if not ENTRY_ID_RE.fullmatch(raw):
        raise RequestError(400, "malformed entry id: expected 32 lowercase hexadecimal characters")
    return raw


def find_entry(cache: TrajectoryCache, entry_id: str) -> dict[str, Any]:
    entry = cache.get(entry_id)
    if entry is None:
        raise RequestError(404, f"no cache entry {entry_id} (deleted or evicted?)")
    return entry.row


def check_same_origin(request: web.Request) -> None:
    """Refuse what a foreign web page could send without a CORS preflight.

    ComfyUI's own origin check is skipped when ``Origin`` has no host (``null`` from a
    sandboxed frame, ``file://``), and a ``text/plain`` form post needs no preflight. So a
    mutating route demands ``Content-Type: application/json`` (never sendable cross-site
    without a preflight) and, when ``Origin`` is present, that it names this server.
    """
    ctype = request.headers.get("Content-Type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise RequestError(415, "send the request with Content-Type: application/json")
    origin = request.headers.get("Origin")
    if origin is None:
        return  # not sent by a browser page (scripts, curl)
    parsed = urlsplit(origin)
    if parsed.scheme not in ("http", "https") or not parsed.netloc or \
            parsed.netloc.lower() != request.host.lower():
        raise RequestError(403, f"refused a cross-origin request from {origin[:80]!r}")


async def json_body(request: web.Request) -> dict[str, Any]:
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        raise RequestError(413, f"request body over {MAX_BODY_BYTES} bytes")
    raw = b""
    while len(raw) <= MAX_BODY_BYTES:  # a body may arrive in several TCP packets
        chunk = await request.content.read(MAX_BODY_BYTES + 1 - len(raw))
        if not chunk:
            break
        raw += chunk
    if len(raw) > MAX_BODY_BYTES:
        raise RequestError(413, f"request body over {MAX_BODY_BYTES} bytes")
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise RequestError(400, "request body must be a JSON object") from None
    if not isinstance(body, dict):
        raise RequestError(400, "request body must be a JSON object")
    return body


def public_row(row: dict[str, Any]) -> dict[str, Any]:
    out = {k: row.get(k) for k in PUBLIC_COLUMNS}
    out["pinned"] = bool(out["pinned"])
    out["preview_url"] = f"{PREFIX}/entries/{row['id']}/preview.png"
    return out


def detail_row(row: dict[str, Any]) -> dict[str, Any]:
    out = public_row(row)
    out["snapshot_steps"] = _maybe_json(row.get("snapshot_steps"), [])
    # what makes requests comparable (model, shape, schedule, sampler, cfg, noise)
    out["compatibility_class"] = _maybe_json(row.get("class_json"), "")
    return out


def _maybe_json(text: str | None, empty: Any) -> Any:
    if not text:
        return empty
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


# ------------------------------------------------------------------ preview picture
def latent_to_rgb(latent: torch.Tensor, latent_format: str) -> torch.Tensor:
    """(B, C, T, H, W) or (B, C, H, W) latent → (T, H, W, 3) in [0, 1] for the first item."""
    x = latent.float()
    if x.ndim == 4:
        x = x.unsqueeze(2)
    if latent_format == TINYWORLD_LATENT_FORMAT:  # an exact pixel transform: the real frames
        from ..tinyworld import latent as tinyworld_latent
        return tinyworld_latent.decode_comfy(x[:1], clamp=True)[0].permute(1, 2, 3, 0)
    x = model_space(x[:1], latent_format)[0]            # (C, T, H, W)
    found = latent_rgb_factors(latent_format)
    if found is not None and found[0].shape[0] == x.shape[0]:
        factors, bias = found
        rgb = torch.einsum("cthw,ck->thwk", x, factors)
        if bias is not None:
            rgb = rgb + bias
        return ((rgb + 1.0) / 2.0).clamp(0, 1)
    # no factors for this format: the first three channels, each stretched to [0, 1]
    ch = x[:3] if x.shape[0] >= 3 else x[:1].expand(3, *x.shape[1:])
    lo = ch.amin(dim=(1, 2, 3), keepdim=True)
    hi = ch.amax(dim=(1, 2, 3), keepdim=True)
    return ((ch - lo) / (hi - lo).clamp_min(1e-6)).permute(1, 2, 3, 0)


def preview_png(latent: torch.Tensor, latent_format: str, region: torch.Tensor | None = None) -> bytes:
    """Up to PREVIEW_FRAMES frames, evenly spaced, side by side, nearest-neighbour enlarged;
    with ``region`` (a (T, H, W) latent-grid mask: region M of a hit) M's edges drawn."""
    frames = latent_to_rgb(latent, latent_format)        # (T, H, W, 3)
    return frame_strip_png(frames, region, PREVIEW_FRAMES, PREVIEW_FRAME_PX)


def render_preview(entry_id: str, with_region: bool = False) -> bytes:
    cache = open_cache()
    row = find_entry(cache, entry_id)
    tensors = cache.load_tensors(row["id"], ["final", "region"] if with_region else ["final"])
    if not tensors or "final" not in tensors:
        raise RequestError(404, f"cache entry {entry_id} has no stored latent (file lost or unreadable)")
    return preview_png(tensors["final"], row.get("latent_format") or "", tensors.get("region"))


# ------------------------------------------------------------------ handlers
def list_page(offset: int, limit: int) -> dict[str, Any]:
    cache = open_cache()
    rows = cache.list_entries(offset, limit)
    return {"entries": [public_row(r) for r in rows], "offset": offset, "limit": limit,
            "total": cache.stats()["entries"]}


@json_errors
async def get_entries(request: web.Request) -> web.Response:
    offset = query_int(request, "offset", 0, 0, MAX_OFFSET)
    limit = query_int(request, "limit", DEFAULT_PAGE, 1, MAX_PAGE)
    return web.json_response(await asyncio.to_thread(list_page, offset, limit))


@json_errors
async def get_entry(request: web.Request) -> web.Response:
    entry_id = entry_id_of(request)
    row = await asyncio.to_thread(lambda: find_entry(open_cache(), entry_id))
    return web.json_response(detail_row(row))


@json_errors
async def get_preview(request: web.Request) -> web.Response:
    entry_id = entry_id_of(request)
    with_region = request.query.get("region") == "1"
    png = await asyncio.to_thread(render_preview, entry_id, with_region)
    # an id never names other content, so the picture may be cached by the browser
    return web.Response(body=png, content_type="image/png",
                        headers={"Cache-Control": "private, max-age=86400"})


@json_errors
async def post_pin(request: web.Request) -> web.Response:
    entry_id = entry_id_of(request)
    check_same_origin(request)
    body = await json_body(request)
    pinned = body.get("pinned")
    if not isinstance(pinned, bool):
        raise RequestError(400, 'body must be {"pinned": true} or {"pinned": false}')

    def pin() -> dict[str, Any]:
        cache = open_cache()
        row = find_entry(cache, entry_id)
        if not cache.set_pinned(row["id"], pinned):
            raise RequestError(404, f"no cache entry {entry_id} (deleted meanwhile)")
        return {"id": row["id"], "pinned": pinned}
    return web.json_response(await asyncio.to_thread(pin))


@json_errors
async def delete_entry(request: web.Request) -> web.Response:
    entry_id = entry_id_of(request)
    check_same_origin(request)

    def delete() -> dict[str, Any]:
        cache = open_cache()
        row = find_entry(cache, entry_id)
        if not cache.delete(row["id"]):
            raise RequestError(404, f"no cache entry {entry_id} (deleted meanwhile)")
        return {"deleted": row["id"]}
    return web.json_response(await asyncio.to_thread(delete))


@json_errors
async def post_clear(request: web.Request) -> web.Response:
    check_same_origin(request)
    body = await json_body(request)
    if body.get("confirm") is not True:
        raise RequestError(400, 'clearing the cache deletes every entry, pinned ones too; '
                                'send {"confirm": true} to do it')
    deleted = await asyncio.to_thread(lambda: open_cache().clear())
    return web.json_response({"deleted": deleted})


@json_errors
async def get_stats(request: web.Request) -> web.Response:
    def stats() -> dict[str, Any]:
        cache = open_cache()
        # the folder's name only: an absolute path tells any page about the machine
        return {**cache.stats(), "folder": cache.folder.name}
    return web.json_response(await asyncio.to_thread(stats))


@json_errors
async def get_calibration(request: web.Request) -> web.Response:
    """Per model in this cache: calibrated or not, from what, and the live audits against α."""
    def status() -> dict[str, Any]:
        from ..carnator_core.calibration.status import known_fingerprints, model_status
        cache = open_cache()
        rows = cache.list_entries(0, 1000)  # newest first
        seen = [r["model_fingerprint"] for r in rows if r.get("model_fingerprint")]
        # each model as the samplers see it by default; its other probes' files are listed beside
        models = [model_status(cache.folder, fp, probe_fraction=DEFAULT_PROBE_FRACTION)
                  for fp in known_fingerprints(cache.folder, seen)]
        for m in models:  # what the page shows next to each model: its latest entry's prompt
            m["example"] = next((r.get("prompt") for r in rows
                                 if r.get("model_fingerprint") == m["fingerprint"]), None)
        return {"models": models}
    return web.json_response(await asyncio.to_thread(status))


async def not_found(request: web.Request) -> web.Response:
    return error_response(404, f"no Carnator route {request.method} {request.path}")


def add_routes(routes: web.RouteTableDef) -> None:
    entry = PREFIX + "/entries/{entry_id}"
    routes.get(PREFIX + "/entries")(get_entries)
    routes.get(entry)(get_entry)
    routes.get(entry + "/preview.png")(get_preview)
    routes.post(entry + "/pin")(post_pin)
    routes.delete(entry)(delete_entry)
    routes.post(PREFIX + "/clear")(post_clear)
    routes.get(PREFIX + "/stats")(get_stats)
    routes.get(PREFIX + "/calibration")(get_calibration)
    # anything else under /carnator/ (odd ids with slashes, traversal attempts): JSON 404
    routes.route("*", PREFIX + "/{tail:.*}")(not_found)


def register() -> bool:
    """Add the routes to the running PromptServer; False (and nothing done) outside one."""
    # Inside ComfyUI, main.py has imported its ``server`` module before loading packs; look
    # it up rather than import it, so that importing this module elsewhere costs nothing.
    server = sys.modules.get("server")
    instance = getattr(getattr(server, "PromptServer", None), "instance", None)
    if instance is None:
        return False
    add_routes(instance.routes)
    return True


register()
