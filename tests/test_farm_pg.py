"""A farm: three real ComfyUI servers sharing one cache in a real PostgreSQL started by this
test run (tests/pg_cluster.py), each pointed at it the way an operator would
(CARNATOR_CACHE_URL). Nothing is mocked: requests go through /prompt and /history."""
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from pg_cluster import PgCluster, pg_bin
from server_harness import ComfyServer, carnator_outputs
from test_server_e2e import WORKFLOWS, api_workflow, summary_of

psycopg = pytest.importorskip("psycopg", reason="psycopg[binary] is in requirements-test.txt")
pytestmark = pytest.mark.skipif(pg_bin() is None, reason="PostgreSQL server not installed "
                                "(.ci/run installs Debian's postgresql)")

REPO = Path(__file__).resolve().parent.parent
NAME = "carnator_wan21_4node"
BASE = "a red ball rolls left across a green field"


@pytest.fixture(scope="module")
def farm(tmp_path_factory):
    cluster = PgCluster().start()
    url = cluster.url("farm")
    # a second database the operator lets workflows pick by name
    named = json.dumps({"staging": cluster.url("farm_node")})
    workers = []
    for i in range(3):
        folder = tmp_path_factory.mktemp(f"worker{i}")
        (folder / "pauses").mkdir()
        workers.append(ComfyServer(folder, env={"CARNATOR_CACHE_URL": url,
                                                "CARNATOR_CACHE_DATABASES": named,
                                                "CARNATOR_TEST_PAUSE_DIR": str(folder / "pauses")}))
    errors = []

    def start(w):
        try:
            w.start()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=start, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors, errors
        yield cluster, url, workers
    finally:
        for w in workers:
            w.stop()
        cluster.stop(remove=True)


def db_rows(url: str, sql: str, args=()):
    with psycopg.connect(url) as conn:
        return conn.execute(sql, args).fetchall()


def test_a_trajectory_stored_by_one_worker_is_a_hit_on_another(farm):
    _, url, (w0, w1, w2) = farm
    first = summary_of(w0, NAME, BASE, 11)
    assert first["outcome"] == "miss" and first["stored_id"]
    second = summary_of(w1, NAME, BASE + " slowly", 11)
    assert second["outcome"] == "hit", second["text"]
    assert second["entry_id"] == first["stored_id"]
    third = summary_of(w2, NAME, BASE, 11)
    assert third["outcome"] == "exact" and third["entry_id"] == first["stored_id"]
    # one shared index: no worker wrote a private SQLite cache
    assert not any((w.cache_dir / "carnator.sqlite").exists() for w in (w0, w1, w2))
    stats = w2.get("/carnator/stats")
    assert stats["entries"] == 2 and stats["recent_requests"] == 3
    hits = db_rows(url, "SELECT hits FROM carnator_entries WHERE id = %s", [first["stored_id"]])
    assert hits == [(2,)]  # the hit and the exact repeat, counted by different workers


def test_the_database_stopped_mid_request_is_a_miss_with_a_message_then_hits_again(farm):
    """Worker 1 is paused inside its request, after its probe and exact-repeat check used
    the database and before lookup (carnator_core.cache.files.pause_point); the database
    stops there, the request finishes as a miss that says so, and once the database is
    back the worker reconnects by itself and hits."""
    cluster, _, (w0, w1, _) = farm
    stored = summary_of(w0, NAME, BASE, 22)
    assert stored["outcome"] == "miss" and stored["stored_id"]
    pauses = Path(w1.extra_env["CARNATOR_TEST_PAUSE_DIR"])
    (pauses / "pg.lookup.arm").touch()
    prompt_id = w1.queue(api_workflow(NAME, BASE + " slowly", 22))
    paused = pauses / "pg.lookup.paused"
    deadline = time.monotonic() + 120
    while not paused.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert paused.exists(), w1.log_tail()
    cluster.stop()  # mid-request: the worker's open connection dies under it
    try:
        paused.unlink()
        down = carnator_outputs(w1.wait(prompt_id))[0]
        assert down["outcome"] == "miss", down["text"]
        assert any("PostgreSQL cache" in m and "unreachable" in m for m in down["messages"]), down["messages"]
    finally:
        cluster.start()
    again = summary_of(w1, NAME, BASE + " gently", 22)  # reconnected by itself
    assert again["outcome"] == "hit", again["text"]
    assert again["entry_id"] == stored["stored_id"]


EVICTOR = """
import sys
sys.path.insert(0, {repo!r})
from carnator_core.cache.backend import open_cache
print(len(open_cache(sys.argv[1], 1).evict_to_capacity()))
"""


def test_eviction_by_several_workers_never_takes_a_pinned_entry(farm):
    _, url, workers = farm
    summaries = [summary_of(w, NAME, f"{BASE} number {i}", 33) for i, w in enumerate(workers)]
    stored = [s["stored_id"] for s in summaries]
    assert all(stored), [s["text"] for s in summaries]
    keep = stored[1]
    answer = workers[0].request("POST", f"/carnator/entries/{keep}/pin", {"pinned": True})
    assert answer == {"id": keep, "pinned": True}
    # three processes evict to a capacity of one byte at once: only the pin may stay
    code = EVICTOR.format(repo=str(REPO))
    procs = [subprocess.Popen([sys.executable, "-c", code, url], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    left = {r[0] for r in db_rows(url, "SELECT id FROM carnator_entries")}
    assert left == {keep}
    evicted = sum(int(o[0].strip()) for o in outs)
    removed = db_rows(url, "SELECT count(*) FROM carnator_removals WHERE reason = 'evicted'")[0][0]
    assert evicted == removed > 0  # each victim taken by exactly one evictor
    n, size = db_rows(url, "SELECT n, bytes FROM carnator_totals")[0]
    assert (n, size) == db_rows(url, "SELECT count(*), coalesce(sum(bytes), 0) FROM carnator_entries")[0]
    again = summary_of(workers[2], NAME, f"{BASE} number 1", 33)
    assert again["outcome"] == "exact" and again["entry_id"] == keep


STORER = """
import sys
sys.path.insert(0, {repo!r}); sys.path.insert(0, {tests!r})
from cache_fault_worker import CLASS_KEY, expected_tensors, signature_of
from carnator_core.cache.backend import open_cache
cache = open_cache(sys.argv[1], 1 << 30)
print(cache.store({{"class_key": CLASS_KEY, "exact_key": sys.argv[2], "snapshot_steps": "[2]"}},
                  expected_tensors(int(sys.argv[2])), signature_of(int(sys.argv[2]))))
"""


def test_a_worker_killed_mid_store_leaves_nothing_half_visible(farm):
    _, url, _ = farm
    code = STORER.format(repo=str(REPO), tests=str(REPO / "tests"))
    env = {**os.environ, "CARNATOR_TEST_KILL_AT": "pg.store.inserted"}
    killed = subprocess.run([sys.executable, "-c", code, url, "901"], env=env, capture_output=True)
    assert killed.returncode == -9, killed.stderr[-2000:]
    ok = subprocess.run([sys.executable, "-c", code, url, "902"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert db_rows(url, "SELECT count(*) FROM carnator_entries WHERE exact_key = '901'") == [(0,)]
    kept = ok.stdout.strip()
    assert db_rows(url, "SELECT count(*) FROM carnator_blobs WHERE id = %s", [kept]) == [(1,)]
    orphans = db_rows(url, "SELECT (SELECT count(*) FROM carnator_blobs) + (SELECT count(*) FROM "
                      "carnator_signatures) - 2 * (SELECT count(*) FROM carnator_entries)")
    assert orphans == [(0,)]
    n, size = db_rows(url, "SELECT n, bytes FROM carnator_totals")[0]
    assert (n, size) == db_rows(url, "SELECT count(*), coalesce(sum(bytes), 0) FROM carnator_entries")[0]
    from carnator_core.cache.backend import open_cache
    from cache_fault_worker import expected_tensors, same
    assert same(open_cache(url, 1 << 30).load_tensors(kept), expected_tensors(902))


def test_a_workflow_picks_a_database_the_operator_named_and_never_gives_an_address(farm):
    """Where a worker connects is the operator's decision: a workflow naming an address or
    libpq parameters (hostaddr, host, passfile, service) is refused before it runs and no
    connection is ever attempted (a listener stands where the address points); a name from
    the operator's CARNATOR_CACHE_DATABASES is used."""
    import socket
    cluster, url, (w0, _, _) = farm
    other = cluster.url("farm_node")
    prompt = json.loads((WORKFLOWS / "api" / f"{NAME}.api.json").read_text())
    prompt["2"]["inputs"]["text"] = BASE + " (node url)"
    prompt["5"]["inputs"]["cache"] = ["20", 0]
    with socket.socket() as trap:
        trap.bind(("127.0.0.1", 0))
        trap.listen(8)
        trap.setblocking(False)
        port = trap.getsockname()[1]
        for hostile in (f"postgresql://postgres@db.internal:5432/farm?hostaddr=127.0.0.1&port={port}",
                        f"postgresql://postgres@127.0.0.1:{port}/farm",
                        f"postgresql:///farm?host=127.0.0.1&port={port}&passfile=/root/.pgpass",
                        "postgresql:///farm?service=carnator", f"host=127.0.0.1 port={port}"):
            prompt["20"] = {"class_type": "CarnatorCache",
                            "inputs": {"folder": "", "capacity_gb": 1.0, "database": hostile}}
            with pytest.raises(RuntimeError, match="not an address or connection parameters"):
                w0.queue(prompt)
        time.sleep(0.5)
        with pytest.raises(BlockingIOError):
            trap.accept()  # nobody ever knocked
    prompt["20"]["inputs"]["database"] = "nope"
    with pytest.raises(RuntimeError, match="names this worker allows: staging"):
        w0.queue(prompt)
    prompt["20"]["inputs"]["database"] = "staging"
    summary = carnator_outputs(w0.run(prompt))[0]
    assert summary["stored_id"]
    assert db_rows(other, "SELECT id FROM carnator_entries") == [(summary["stored_id"],)]
    assert db_rows(url, "SELECT count(*) FROM carnator_entries WHERE id = %s", [summary["stored_id"]]) == [(0,)]


def test_a_comfyui_worker_killed_inside_its_store_leaves_nothing_half_visible(farm):
    """Worker 2 is paused inside its store transaction (row, signature, descriptor and
    blob written, not committed), then SIGKILLed: nothing of it was ever visible, the
    totals still match the rows, and the other workers store and hit as before.
    Last in this module: worker 2 stays dead."""
    _, url, (w0, w1, w2) = farm
    prompt = BASE + " (killed mid-store)"
    pauses = Path(w2.extra_env["CARNATOR_TEST_PAUSE_DIR"])
    (pauses / "pg.store.inserted.arm").touch()
    w2.queue(api_workflow(NAME, prompt, 44))
    paused = pauses / "pg.store.inserted.paused"
    deadline = time.monotonic() + 120
    while not paused.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert paused.exists(), w2.log_tail()
    visible = "SELECT count(*) FROM carnator_entries WHERE prompt = %s"
    assert db_rows(url, visible, [prompt]) == [(0,)]  # written, not yet committed
    w2.proc.kill()  # SIGKILL
    w2.proc.wait(timeout=30)
    assert db_rows(url, visible, [prompt]) == [(0,)]
    n, size = db_rows(url, "SELECT n, bytes FROM carnator_totals")[0]
    assert (n, size) == db_rows(url, "SELECT count(*), coalesce(sum(bytes), 0) FROM carnator_entries")[0]
    assert db_rows(url, "SELECT (SELECT count(*) FROM carnator_blobs) - (SELECT count(*) FROM "
                   "carnator_entries)") == [(0,)]
    first = summary_of(w0, NAME, prompt, 44)  # its locks went with it: others store at once
    assert first["outcome"] == "miss" and first["stored_id"]
    second = summary_of(w1, NAME, prompt + " slowly", 44)
    assert second["outcome"] == "hit" and second["entry_id"] == first["stored_id"]
