"""The /carnator/ HTTP routes against the real ComfyUI server with the pack.

One server for the module: one real request fills the cache (a MISS that stores an entry),
further entries are copies written through the cache API (another process sharing the
folder, as the design allows). Every hostile request must get a 4xx JSON answer and leave
the cache — index rows and tensor files — exactly as it was.
"""
from __future__ import annotations

import copy
import hashlib
import http.client
import io
import json
import sqlite3
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from server_harness import ComfyServer, carnator_outputs  # noqa: E402

from carnator_core.cache.folder import TrajectoryCache  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WORKFLOW = REPO / "workflows" / "api" / "carnator_wan21_4node.api.json"
PROMPT = "a red ball rolls left across a green field"
SECRET = "carnator-route-test-secret-3f9a"


# ------------------------------------------------------------------ helpers
class Answer:
    def __init__(self, status: int, headers: dict, body: bytes):
        self.status, self.headers, self.body = status, headers, body

    def json(self):
        return json.loads(self.body)

    def __repr__(self) -> str:
        return f"Answer({self.status}, {self.body[:200]!r})"


def raw(server: ComfyServer, method: str, path: str, body: bytes | None = None,
        headers: dict | None = None) -> Answer:
    """Send the path byte for byte (no client-side normalisation of '..' or escapes)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        if body is not None:
            hdrs.setdefault("Content-Length", str(len(body)))
        for k, v in hdrs.items():
            conn.putheader(k, v)
        conn.endheaders(body)
        resp = conn.getresponse()
        return Answer(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


def call(server, method, path, payload=None) -> Answer:
    return raw(server, method, path, None if payload is None else json.dumps(payload).encode())


def db_rows(cache_dir: Path) -> dict[str, tuple]:
    con = sqlite3.connect(f"file:{cache_dir / 'carnator.sqlite'}?mode=ro", uri=True, timeout=30)
    try:
        return {r[0]: r[1:] for r in con.execute("SELECT id, pinned, hits, bytes FROM entries")}
    finally:
        con.close()


def cache_state(cache_dir: Path) -> tuple:
    """Rows and tensor files (name + content hash): what 'the cache unharmed' means."""
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
             for p in sorted((cache_dir / "tensors").iterdir())}
    return db_rows(cache_dir), files


def assert_json_error(answer: Answer, *statuses: int) -> None:
    assert answer.status in statuses, answer
    assert "json" in answer.headers.get("content-type", ""), answer
    assert isinstance(answer.json().get("error"), str) and answer.json()["error"], answer


def assert_no_leak(answer: Answer) -> None:
    for marker in (SECRET.encode(), b"SQLite format", b"root:x:0:0", b"carnator_entry"):
        assert marker not in answer.body, (marker, answer)


# ------------------------------------------------------------------ the shared server
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("web_routes")
    (workdir / "secret.txt").write_text(SECRET)  # beside the user dir: must never be served
    with ComfyServer(workdir) as srv:
        prompt = json.loads(WORKFLOW.read_text())
        prompt["2"]["inputs"]["text"] = PROMPT
        summaries = carnator_outputs(srv.run(prompt))
        assert summaries and summaries[0]["outcome"] == "miss" and summaries[0]["stored_id"]
        srv.first_id = summaries[0]["stored_id"]
        (srv.cache_dir / "secret.txt").write_text(SECRET)  # inside the folder, not an entry
        yield srv


def add_copies(server, n: int, **overrides) -> list[str]:
    """More entries, written by this process through the cache API (fast, no sampling)."""
    cache = TrajectoryCache(server.cache_dir)
    source = cache.get(server.first_id)
    tensors = cache.load_tensors(server.first_id)
    signature = tensors.pop("signature")
    ids = []
    for i in range(n):
        row = {k: v for k, v in source.row.items() if k not in ("id", "signature", "bytes")}
        row["prompt"] = f"{PROMPT} (copy {i})"
        row.update(overrides)
        ids.append(cache.store(row, tensors, signature))
    assert all(ids)
    return ids


# ------------------------------------------------------------------ happy paths
def test_list_and_detail(server):
    page = call(server, "GET", "/carnator/entries").json()
    assert page["total"] >= 1 and page["offset"] == 0 and page["limit"] == 50
    entry = next(e for e in page["entries"] if e["id"] == server.first_id)
    assert entry["prompt"] == PROMPT
    assert entry["backbone"] == "WAN21" and entry["latent_format"] == "Wan21"
    assert entry["steps"] == 12 and entry["pinned"] is False and entry["bytes"] > 0
    assert entry["preview_url"] == f"/carnator/entries/{server.first_id}/preview.png"
    assert "signature" not in entry and "class_key" not in entry

    detail = call(server, "GET", f"/carnator/entries/{server.first_id}").json()
    assert detail["id"] == server.first_id and detail["latent_shape"] == entry["latent_shape"]
    assert detail["compatibility_class"] and isinstance(detail["snapshot_steps"], list)
    # the /api twin ComfyUI adds for every route answers the same
    assert call(server, "GET", f"/api/carnator/entries/{server.first_id}").json() == detail


def test_paging(server):
    add_copies(server, 2)
    total = call(server, "GET", "/carnator/entries").json()["total"]
    assert total >= 3
    seen = []
    for offset in range(total):
        page = call(server, "GET", f"/carnator/entries?offset={offset}&limit=1").json()
        assert len(page["entries"]) == 1 and page["total"] == total
        seen.append(page["entries"][0]["id"])
    assert len(set(seen)) == total
    assert call(server, "GET", f"/carnator/entries?offset={total}&limit=200").json()["entries"] == []


def test_preview_is_a_png_of_the_frames(server):
    from PIL import Image
    answer = call(server, "GET", f"/carnator/entries/{server.first_id}/preview.png")
    assert answer.status == 200 and answer.headers["content-type"] == "image/png"
    img = Image.open(io.BytesIO(answer.body)).convert("RGB")
    # 1×16×3×16×16 latent: three frames side by side, each enlarged to 96 px
    assert img.size == (3 * 96, 96), img.size
    colours = img.getcolors(maxcolors=1 << 16)
    assert colours is None or len(colours) > 8, "preview is (nearly) uniform"


def test_preview_without_factors_and_with_a_lost_file(server):
    from PIL import Image
    (plain,) = add_copies(server, 1, latent_format="NoSuchFormat")
    answer = call(server, "GET", f"/carnator/entries/{plain}/preview.png")
    assert answer.status == 200  # first three channels, stretched, instead of factors
    assert Image.open(io.BytesIO(answer.body)).size == (3 * 96, 96)

    (lost,) = add_copies(server, 1)
    (server.cache_dir / "tensors" / f"{lost}.safetensors").unlink()
    assert_json_error(call(server, "GET", f"/carnator/entries/{lost}/preview.png"), 404)
    assert lost not in db_rows(server.cache_dir)  # the cache dropped the row it cannot serve
    assert call(server, "DELETE", f"/carnator/entries/{plain}").status == 200


def test_pin_and_unpin(server):
    before = db_rows(server.cache_dir)[server.first_id]
    answer = call(server, "POST", f"/carnator/entries/{server.first_id}/pin", {"pinned": True})
    assert answer.status == 200 and answer.json() == {"id": server.first_id, "pinned": True}
    assert db_rows(server.cache_dir)[server.first_id][0] == 1
    assert call(server, "GET", f"/carnator/entries/{server.first_id}").json()["pinned"] is True
    answer = call(server, "POST", f"/carnator/entries/{server.first_id}/pin", {"pinned": False})
    assert answer.json()["pinned"] is False
    assert db_rows(server.cache_dir)[server.first_id] == before


def test_stats(server):
    stats = call(server, "GET", "/carnator/stats").json()
    rows = db_rows(server.cache_dir)
    assert stats["entries"] == len(rows)
    assert stats["bytes"] == sum(r[2] for r in rows.values())
    assert stats["capacity_bytes"] > stats["bytes"]
    assert stats["recent_requests"] >= 1 and stats["recent_hit_rate"] == 0.0  # one MISS so far
    assert stats["folder"] == "carnator_cache"  # its name only: no absolute path to any page
    assert str(server.workdir) not in json.dumps(stats)


def test_stats_show_the_capacity_the_cache_node_set(server):
    TrajectoryCache(server.cache_dir, capacity_bytes=3 * 1024**3 + 5)  # as a request opens it
    assert call(server, "GET", "/carnator/stats").json()["capacity_bytes"] == 3 * 1024**3 + 5
    TrajectoryCache(server.cache_dir, capacity_bytes=8 * 1024**3)


# ------------------------------------------------------------------ hostile input
UNKNOWN = "0" * 32
MALFORMED = ["abc", "0" * 31, "0" * 33, "G" * 32, "A" * 32, "%20" + "0" * 32,
             "0" * 32 + "%00", "0" * 16 + "%2F" + "0" * 15, "..", "%2e%2e", "secret.txt",
             "carnator.sqlite", "-1", "0x" + "0" * 30]


@pytest.mark.parametrize("method,suffix,payload", [
    ("GET", "", None), ("GET", "/preview.png", None), ("POST", "/pin", {"pinned": True}),
    ("DELETE", "", None)])
def test_unknown_and_malformed_ids(server, method, suffix, payload):
    state = cache_state(server.cache_dir)
    assert_json_error(call(server, method, f"/carnator/entries/{UNKNOWN}{suffix}", payload), 404)
    for bad in MALFORMED:
        answer = call(server, method, f"/carnator/entries/{bad}{suffix}", payload)
        assert_json_error(answer, 400, 404)
        assert_no_leak(answer)
    assert cache_state(server.cache_dir) == state


TRAVERSALS = [
    "/carnator/entries/..%2F..%2Fetc%2Fpasswd",
    "/carnator/entries/..%2F..%2Fetc%2Fpasswd/preview.png",
    "/carnator/entries/..%2f..%2fsecret.txt",
    "/carnator/entries/..%2F..%2F..%2Fsecret.txt/preview.png",
    "/carnator/entries/%2e%2e%2f%2e%2e%2fcarnator.sqlite",
    "/carnator/entries/%2e%2e%2fcarnator.sqlite/preview.png",
    "/carnator/entries/..%5C..%5Csecret.txt",
    "/carnator/entries/%252e%252e%252fsecret.txt",
    "/carnator/entries/{id}%2F..%2F..%2Fcarnator.sqlite",
    "/carnator/entries/{id}%2F..%2F..%2Fsecret.txt/preview.png",
    "/carnator/entries/{id}/..%2F..%2Fsecret.txt",
    "/carnator/entries/{id}/preview.png%2F..%2F..%2Fcarnator.sqlite",
    "/carnator/entries/../../secret.txt",
    "/carnator/entries/{id}/../../../secret.txt",
    "/carnator/..%2Fcarnator_cache%2Fcarnator.sqlite",
    "/api/carnator/entries/..%2F..%2Fetc%2Fpasswd",
    "/api/carnator/entries/%2e%2e%2f%2e%2e%2fsecret.txt/preview.png",
]


def test_path_traversal_attempts(server):
    state = cache_state(server.cache_dir)
    for template in TRAVERSALS:
        path = template.replace("{id}", server.first_id)
        for method in ("GET", "DELETE", "POST"):
            answer = raw(server, method, path, b'{"pinned": true, "confirm": true}')
            assert_json_error(answer, 400, 404)  # routed by Carnator (aiohttp keeps '..')
            assert_no_leak(answer)
    assert cache_state(server.cache_dir) == state
    assert (server.workdir / "secret.txt").read_text() == SECRET
    assert (server.cache_dir / "secret.txt").read_text() == SECRET


@pytest.mark.parametrize("query", [
    "limit=201", "limit=100000", "limit=99999999999999999999", "limit=-1", "limit=0",
    "limit=abc", "limit=1e3", "limit=5.5", "limit=%2B5", "limit=0x10", "offset=-1",
    "offset=99999999999", "offset=1.0", "offset=nan", "limit=10&offset=-5"])
def test_bad_page_parameters(server, query):
    answer = call(server, "GET", f"/carnator/entries?{query}")
    assert_json_error(answer, 400)


def test_page_size_at_the_cap(server):
    answer = call(server, "GET", "/carnator/entries?limit=200&offset=0")
    assert answer.status == 200 and answer.json()["limit"] == 200


@pytest.mark.parametrize("body", [
    b"", b"not json", b"[true]", b'"pinned"', b"null", b"{", b'{"pinned": "yes"}',
    b'{"pinned": 1}', b'{"pinned": null}', b'{"unpinned": true}', b"\xff\xfe{}"])
def test_bad_pin_bodies(server, body):
    state = cache_state(server.cache_dir)
    answer = raw(server, "POST", f"/carnator/entries/{server.first_id}/pin", body)
    assert_json_error(answer, 400)
    assert cache_state(server.cache_dir) == state


def test_oversized_body(server):
    state = cache_state(server.cache_dir)
    big = json.dumps({"pinned": True, "pad": "x" * 20000}).encode()
    assert_json_error(raw(server, "POST", f"/carnator/entries/{server.first_id}/pin", big), 413)
    assert_json_error(raw(server, "POST", "/carnator/clear", json.dumps(
        {"confirm": True, "pad": "x" * 20000}).encode()), 413)
    assert cache_state(server.cache_dir) == state


@pytest.mark.parametrize("body", [
    b"", b"yes", b"{}", b'{"confirm": "true"}', b'{"confirm": 1}', b'{"confirm": false}',
    b"[true]", b'{"confirm": [true]}'])
def test_clear_needs_an_explicit_confirmation(server, body):
    state = cache_state(server.cache_dir)
    assert_json_error(raw(server, "POST", "/carnator/clear", body), 400)
    assert cache_state(server.cache_dir) == state


def test_unknown_routes_and_methods_answer_json(server):
    for method, path in [("GET", "/carnator/nothing"), ("PUT", f"/carnator/entries/{server.first_id}"),
                         ("GET", "/carnator/clear"), ("DELETE", "/carnator/entries")]:
        assert_json_error(call(server, method, path), 404, 405)


# ------------------------------------------------------------------ cross-site requests
def test_mutating_routes_refuse_what_another_page_could_send(server):
    """No preflight is needed for a text/plain POST, and ComfyUI skips its origin check for
    ``Origin: null``: both are refused, with the cache untouched; the page's own JSON works."""
    (victim,) = add_copies(server, 1)
    state = cache_state(server.cache_dir)
    pin, host = f"/carnator/entries/{victim}/pin", f"127.0.0.1:{server.port}"
    for path, body in [(pin, b'{"pinned": true}'), ("/carnator/clear", b'{"confirm": true}')]:
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
            assert_json_error(raw(server, "POST", path, body, {"Content-Type": ctype}), 415)
        for origin in ("null", "file://", "http://evil.example", "https://127.0.0.1.evil.example"):
            answer = raw(server, "POST", path, body, {"Origin": origin})
            assert answer.status == 403, (origin, answer)  # ComfyUI's check or ours
    assert_json_error(raw(server, "DELETE", f"/carnator/entries/{victim}", None,
                          {"Content-Type": "text/plain"}), 415)
    assert_json_error(raw(server, "DELETE", f"/carnator/entries/{victim}", None,
                          {"Origin": "null"}), 403)
    assert cache_state(server.cache_dir) == state
    answer = raw(server, "POST", pin, b'{"pinned": true}', {"Origin": f"http://{host}"})
    assert answer.status == 200, answer
    assert raw(server, "DELETE", f"/carnator/entries/{victim}", None,
               {"Origin": f"http://{host}"}).status == 200


def test_a_body_in_two_packets_is_read_whole(server):
    import socket
    body = json.dumps({"pinned": False}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(f"POST /carnator/entries/{server.first_id}/pin HTTP/1.1\r\n"
                     f"Host: 127.0.0.1:{server.port}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                     + body[:5])
        import time
        time.sleep(0.3)
        sock.sendall(body[5:])
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 200"), reply[:300]


def test_deeply_nested_json_is_a_400(server):
    state = cache_state(server.cache_dir)
    for body in (b"[" * 4000, b'{"pinned": ' + b"[" * 2000 + b"]" * 2000 + b"}"):
        answer = raw(server, "POST", f"/carnator/entries/{server.first_id}/pin", body)
        assert_json_error(answer, 400)
    assert cache_state(server.cache_dir) == state


# ------------------------------------------------------------------ the Cache node's folder
def _workflow_with_cache_folder(folder: str) -> dict:
    prompt = json.loads(WORKFLOW.read_text())
    prompt["2"]["inputs"]["text"] = PROMPT + " (folder test)"
    prompt["20"] = {"class_type": "CarnatorCache", "inputs": {"folder": folder, "capacity_gb": 1.0}}
    prompt["5"]["inputs"]["cache"] = ["20", 0]
    return prompt


def test_the_cache_node_refuses_folders_outside_comfyui(server, tmp_path):
    outside = tmp_path / "elsewhere" / "cache"
    for folder in (str(outside), "../../elsewhere", "/etc/carnator"):
        with pytest.raises(RuntimeError, match="outside the folders Carnator may write to"):
            server.queue(_workflow_with_cache_folder(folder))
    assert not outside.exists() and not Path("/etc/carnator").exists()
    summaries = carnator_outputs(server.run(_workflow_with_cache_folder("carnator_other")))
    assert summaries and summaries[0]["outcome"] in ("miss", "exact")
    assert list((server.user_dir / "carnator_other" / "tensors").glob("*.safetensors"))


# ------------------------------------------------------------------ deleting
def test_delete_racing_list(server):
    """A delete while pages are being read: every list answers 200 and consistent JSON,
    exactly one of several concurrent deletes of an entry succeeds, the rest get 404, and
    the other entries (rows and files) are untouched."""
    victims = add_copies(server, 2)
    rows_before = db_rows(server.cache_dir)
    keep = set(rows_before) - set(victims)
    answers: dict[str, list] = {"list": [], "delete": []}
    lock = threading.Lock()
    start = threading.Barrier(6)

    def lister():
        start.wait()
        for _ in range(15):
            a = call(server, "GET", "/carnator/entries?limit=200")
            with lock:
                answers["list"].append(a)

    def deleter(entry_id):
        start.wait()
        a = call(server, "DELETE", f"/carnator/entries/{entry_id}")
        with lock:
            answers["delete"].append((entry_id, a))

    threads = [threading.Thread(target=lister) for _ in range(2)]
    threads += [threading.Thread(target=deleter, args=(v,)) for v in victims for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)

    for a in answers["list"]:
        assert a.status == 200, a
        ids = {e["id"] for e in a.json()["entries"]}
        assert keep <= ids  # entries nobody deleted are always listed
    for victim in victims:
        statuses = sorted(a.status for v, a in answers["delete"] if v == victim)
        assert statuses == [200, 404], statuses
    rows_after = db_rows(server.cache_dir)
    assert set(rows_after) == keep
    assert {k: rows_after[k] for k in keep} == {k: rows_before[k] for k in keep}
    files = {p.stem for p in (server.cache_dir / "tensors").glob("*.safetensors")}
    assert files == keep
    for victim in victims:
        assert_json_error(call(server, "GET", f"/carnator/entries/{victim}/preview.png"), 404)


def test_delete_then_clear(server):
    extra = add_copies(server, 1)[0]
    answer = call(server, "DELETE", f"/carnator/entries/{extra}")
    assert answer.status == 200 and answer.json() == {"deleted": extra}
    assert extra not in db_rows(server.cache_dir)
    assert not (server.cache_dir / "tensors" / f"{extra}.safetensors").exists()
    assert_json_error(call(server, "DELETE", f"/carnator/entries/{extra}"), 404)

    n = len(db_rows(server.cache_dir))
    call(server, "POST", f"/carnator/entries/{server.first_id}/pin", {"pinned": True})
    answer = call(server, "POST", "/carnator/clear", {"confirm": True})
    assert answer.status == 200 and answer.json() == {"deleted": n}  # pinned ones too
    assert db_rows(server.cache_dir) == {}
    assert list((server.cache_dir / "tensors").glob("*.safetensors")) == []
    assert (server.cache_dir / "secret.txt").read_text() == SECRET  # only entries removed
    assert call(server, "GET", "/carnator/stats").json()["entries"] == 0

