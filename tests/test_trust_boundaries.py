"""Trust boundaries and liveness: what a workflow may choose, what a stalled database may
cost, what a calibration file may claim. Real ComfyUI model classes (the bundled tiny Wan),
a real PostgreSQL cluster frozen with SIGSTOP (tests/pg_cluster.py), real files."""
import json
import math
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from carnator_core.cache.backend import DATABASES_ENV, URL_ENV, database_location, open_cache
from carnator_core.cache.files import CacheError
from carnator_core.calibration.status import model_status, status_line
from carnator_core.gate import DEFAULT_PROBE_FRACTION, RiskModel, calibration_file
from pg_cluster import PgCluster, pg_bin

REPO = Path(__file__).resolve().parent.parent
PROMPT = "a red ball rolls left across a green field"
RELATED = "a red ball rolls left across a green field slowly"
TINY_WAN_FINGERPRINT = "e1e981db157de8b6fc458335ee9b14ca"  # models/calibration/demo_models.json


# ------------------------------------------------------------------ where a worker connects
def hostile_locations(port: int) -> list[str]:
    return [f"postgresql://carnator@db.internal:5432/carnator?hostaddr=127.0.0.1&port={port}",
            f"postgresql://carnator@127.0.0.1:{port}/carnator",
            f"postgresql:///carnator?host=127.0.0.1&port={port}",
            f"postgresql:///carnator?host=127.0.0.1&port={port}&passfile={Path.home()}/.pgpass",
            "postgresql:///carnator?service=farm",
            f"host=127.0.0.1 port={port} dbname=carnator",
            f"staging?hostaddr=127.0.0.1&port={port}"]


def test_a_workflow_supplied_address_never_leads_to_a_connection(tiny_models, requests_in, monkeypatch):
    """The operator's list names the databases a workflow may pick; an address or libpq
    parameters from a workflow are refused with a message saying whose decision it is, and
    nothing knocks on the port they point at — not at resolution, not through a request."""
    from carnator_core.comfy_adapter import run_request
    monkeypatch.setenv(DATABASES_ENV, json.dumps({"staging": "postgresql://carnator@10.0.0.5/carnator"}))
    monkeypatch.delenv(URL_ENV, raising=False)
    with socket.socket() as trap:
        trap.bind(("127.0.0.1", 0))
        trap.listen(8)
        trap.setblocking(False)
        port = trap.getsockname()[1]
        positive, negative, latent = requests_in.inputs("wan21", PROMPT)
        for hostile in hostile_locations(port):
            with pytest.raises(ValueError, match="operator"):
                database_location(hostile)
            with pytest.raises(ValueError, match="a workflow cannot choose where a worker connects"):
                run_request(tiny_models["wan21"], positive, negative, latent, 7, 4, 4.0, "euler",
                            "simple", requests_in.settings, {"folder": requests_in.cache_folder,
                                                             "capacity_bytes": 1 << 30,
                                                             "database": hostile})
        time.sleep(0.3)
        with pytest.raises(BlockingIOError):
            trap.accept()
    assert database_location("staging") == "postgresql://carnator@10.0.0.5/carnator"
    assert database_location("") is None  # no operator default: the folder
    monkeypatch.setenv(URL_ENV, "postgresql://carnator@10.0.0.6/carnator")
    assert database_location(None) == "postgresql://carnator@10.0.0.6/carnator"
    monkeypatch.setenv(DATABASES_ENV, "{not json")  # a malformed list allows nothing
    with pytest.raises(ValueError, match="allows none"):
        database_location("staging")


# ------------------------------------------------------------------ a frozen database
@pytest.fixture(scope="module")
def cluster():
    if pg_bin() is None:
        pytest.skip("PostgreSQL server not installed (.ci/run installs Debian's postgresql)")
    pytest.importorskip("psycopg", reason="psycopg[binary] is in requirements-test.txt")
    c = PgCluster().start()
    yield c
    c.thaw()
    c.stop(remove=True)


def test_a_frozen_database_costs_a_request_its_deadline_and_the_next_one_nothing(
        cluster, tiny_models, requests_in, monkeypatch):
    """The whole cluster is SIGSTOPped while a worker holds an open connection (the kernel
    still ACKs; nothing answers). A request finishes as a miss computed in full within the
    deadline plus its own computation; meanwhile the cache tab's call gets an answer (busy or
    unreachable) within the deadline instead of queueing behind it; the next request fails
    fast instead of waiting the deadline out again; once the server runs again, requests
    reconnect and hit."""
    from carnator_core.cache import postgres as cache_pg
    deadline = 3.0
    monkeypatch.setenv("CARNATOR_DB_DEADLINE_S", str(deadline))
    monkeypatch.setattr(cache_pg, "RETRY_AFTER_S", 8.0)
    url = cluster.url("frozen")
    monkeypatch.setenv(URL_ENV, url)
    model = tiny_models["wan21"]
    t0 = time.monotonic()
    _, first = requests_in(model, "wan21", PROMPT)
    full_s = time.monotonic() - t0
    assert first.outcome == "miss" and first.stored_id, first.text()

    cluster.freeze()
    try:
        result = {}

        def request():
            t = time.monotonic()
            result["summary"] = requests_in(model, "wan21", RELATED)[1]
            result["seconds"] = time.monotonic() - t
        worker = threading.Thread(target=request, daemon=True)
        worker.start()
        time.sleep(0.5)  # the request is waiting on the frozen server now
        t = time.monotonic()
        with pytest.raises(CacheError, match="busy|unreachable"):
            open_cache(url, None).stats()  # what the cache tab's /stats route does
        assert time.monotonic() - t < deadline + 1.5
        worker.join(timeout=full_s + 4 * deadline + 30)
        assert not worker.is_alive(), "the request hung on the frozen database"
        down = result["summary"]
        assert down.outcome == "miss" and down.steps_computed == down.steps_total, down.text()
        assert any("unreachable" in m and f"no answer within {deadline:g} s" in m
                   for m in down.messages), down.messages
        assert result["seconds"] < full_s + 2 * deadline + 10

        _, next_one = requests_in(model, "wan21", RELATED, seed=8)  # fails fast, waits nothing
        assert next_one.outcome == "miss", next_one.text()
        assert any(" s ago" in m for m in next_one.messages), next_one.messages
    finally:
        cluster.thaw()
    time.sleep(cache_pg.RETRY_AFTER_S)
    _, again = requests_in(model, "wan21", PROMPT + " gently")
    assert again.outcome == "hit" and again.entry_id == first.stored_id, again.text()


# ------------------------------------------------------------------ hostile calibration files
def _set(path, value):
    def change(d):
        *parents, last = path
        for key in parents:
            d = d[key]
        d[last] = value
    return change


def _all_thresholds(value):
    def change(d):
        for table in d["thresholds"].values():
            for alpha in table:
                table[alpha] = value
    return change


# what is wrong → the field the message must name (the bundled file certifies edits per share
# cell: "other/25" is those recomputing up to a quarter of the tokens)
MALFORMED = {
    "bias as text": (_set(["bias"], "x"), "'bias'"),
    "a weight null": (_set(["weights", "outside_mean"], None), "'weights.outside_mean'"),
    "a threshold as text": (_set(["thresholds", "other/25", "0.2"], "x"), "'thresholds.other/25.0.2'"),
    "thresholds as a list": (_set(["thresholds"], [0.1, 0.2]), "'thresholds'"),
    "tolerance as text": (_set(["tolerance"], "30 dB"), "'tolerance'"),
    "thresholds all infinite": (_all_thresholds(math.inf), "'thresholds.other/25.0.2'"),
    "bias NaN": (_set(["bias"], math.nan), "'bias'"),
    "thresholds not monotone": (_set(["thresholds", "other/25"], {"0.2": 5.0, "0.5": -5.0}), "'thresholds.other/25'"),
    "an unknown format": (_set(["format_version"], 99), "'format_version'"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_calibration_file_falls_back_to_the_prior_and_names_the_field(
        case, tiny_models, requests_in):
    """Each malformed file gives a completed request whose status says the gate ran on the
    uncalibrated prior and names the file's wrong field; nothing is called certified; the
    cache tab's model status says the same."""
    change, field = MALFORMED[case]
    model = tiny_models["wan21"]
    fingerprint = requests_in.run_obj(model, "wan21", PROMPT).fingerprint()
    assert fingerprint == TINY_WAN_FINGERPRINT  # the bundled calibration below is this model's
    requests_in.settings.probe_fraction = DEFAULT_PROBE_FRACTION  # the probe it is calibrated for
    bundled = calibration_file(REPO / "models", fingerprint, DEFAULT_PROBE_FRACTION)
    data = json.loads(bundled.read_text())
    change(data)
    calibration = Path(requests_in.cache_folder) / "calibration"
    calibration.mkdir(parents=True)
    (calibration / bundled.name).write_text(json.dumps(data))

    _, stored = requests_in(model, "wan21", PROMPT)
    _, asked = requests_in(model, "wan21", RELATED)
    for s in (stored, asked):
        assert s.outcome in ("miss", "hit"), s.text()
        assert "uncalibrated prior" in s.calibration and field in s.calibration, s.calibration
        assert bundled.name in s.calibration
        assert "certified" not in s.text()
    status = model_status(requests_in.cache_folder, fingerprint, probe_fraction=DEFAULT_PROBE_FRACTION)
    assert not status["calibrated"] and field in status["problem"]
    assert "uncalibrated prior" in status_line(status, 0.25)


def test_the_bundled_calibrations_pass_the_checks_and_a_saved_one_loads(tmp_path):
    for path in (REPO / "models" / "calibration").glob("*.json"):
        if path.name.endswith(".report.json") or path.name == "demo_models.json":
            continue
        RiskModel.load(path)  # raises naming the field if a bundled file were wrong
    RiskModel(calibrated=True, thresholds={"other": {"0.05": -3.0}}).save(tmp_path / "m.json")
    assert json.loads((tmp_path / "m.json").read_text())["format_version"] == 1
    assert RiskModel.load(tmp_path / "m.json").thresholds == {"other": {"0.05": -3.0}}
