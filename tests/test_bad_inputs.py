"""Broken caches and wrong inputs: the request still completes, the damage is reported and
quarantined or repaired, never silently dropped."""
import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

PROMPT = "a red ball rolls left across a green field"
RELATED = "a red ball rolls left across a green field slowly"
REPO = Path(__file__).resolve().parent.parent


def _rows(folder: Path) -> list[str]:
    with sqlite3.connect(folder / "carnator.sqlite") as db:
        return [r[0] for r in db.execute("SELECT id FROM entries")]


def test_corrupt_database_is_quarantined_and_rebuilt_from_tensor_files(tiny_models, requests_in):
    wan, folder = tiny_models["wan21"], Path(requests_in.cache_folder)
    _, s1 = requests_in(wan, "wan21", PROMPT)
    db = folder / "carnator.sqlite"
    db.write_bytes(b"this is not an SQLite database" * 100)

    latent, s2 = requests_in(wan, "wan21", RELATED)
    assert torch.isfinite(latent).all()
    assert any("unreadable" in m and "rebuilt" in m for m in s2.messages), s2.messages
    assert list((folder / "quarantine").glob("carnator.sqlite.*.corrupt"))
    # repaired, not emptied: the first trajectory was re-indexed from its file and reused
    assert s2.outcome == "hit" and s2.entry_id == s1.stored_id
    assert s1.stored_id in _rows(folder)


def test_truncated_database_file(tiny_models, requests_in):
    wan, folder = tiny_models["wan21"], Path(requests_in.cache_folder)
    _, s1 = requests_in(wan, "wan21", PROMPT)
    for suffix in ("-wal", "-shm"):
        Path(str(folder / "carnator.sqlite") + suffix).unlink(missing_ok=True)
    db = folder / "carnator.sqlite"
    db.write_bytes(db.read_bytes()[:1500])
    latent, s2 = requests_in(wan, "wan21", RELATED)
    assert torch.isfinite(latent).all()
    assert s2.messages, "the repair must be reported"
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA quick_check").fetchone()[0] == "ok"
    assert s1.stored_id in _rows(folder)


def test_missing_tensor_file_runs_as_miss_and_drops_the_row(tiny_models, requests_in):
    wan, folder = tiny_models["wan21"], Path(requests_in.cache_folder)
    _, s1 = requests_in(wan, "wan21", PROMPT)
    (folder / "tensors" / f"{s1.stored_id}.safetensors").unlink()
    latent, s2 = requests_in(wan, "wan21", RELATED)
    assert s2.outcome == "miss" and torch.isfinite(latent).all()
    assert any("lost its tensor file" in m for m in s2.messages), s2.messages
    assert s1.stored_id not in _rows(folder)


def test_truncated_tensor_file_is_quarantined(tiny_models, requests_in):
    wan, folder = tiny_models["wan21"], Path(requests_in.cache_folder)
    _, s1 = requests_in(wan, "wan21", PROMPT)
    f = folder / "tensors" / f"{s1.stored_id}.safetensors"
    f.write_bytes(f.read_bytes()[:200])
    latent, s2 = requests_in(wan, "wan21", RELATED)
    assert s2.outcome == "miss" and torch.isfinite(latent).all()
    assert any("quarantined" in m for m in s2.messages), s2.messages
    assert list((folder / "quarantine").glob(f"{s1.stored_id}.safetensors.*"))
    assert s1.stored_id not in _rows(folder)


def test_unwritable_cache_folder_runs_without_reuse(tiny_models, requests_in, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")  # works as root too, unlike chmod
    latent, s = requests_in(tiny_models["wan21"], "wan21", PROMPT, cache_folder=blocker / "cache")
    assert s.outcome == "miss" and s.stored_id is None and torch.isfinite(latent).all()
    # said once (reason or messages, not both), naming what is wrong: a file where a folder must be
    said = [t for t in [s.reason, *s.messages] if "cannot be used" in t]
    assert len(said) == 1 and f"{blocker} is a file, not a folder" in said[0], (s.reason, s.messages)
    assert "permissions" not in said[0], said
    assert sum(t.count("cannot be used") for t in [s.reason, *s.messages]) == 1, (s.reason, s.messages)


def test_gate_messages_say_what_to_change():
    from carnator_core.gate import GateSettings, depth_reason, region_reason
    swapped = depth_reason(GateSettings(min_depth=0.8, max_depth=0.2), 16, 4, 2, 20)
    assert "swapped" in swapped and "min_depth (0.80)" in swapped and "max_depth (0.20)" in swapped
    short = depth_reason(GateSettings(min_depth=0.05, max_depth=0.05), 2, 1, 2, 20)
    assert "before the probe's 2 steps" in short and "raise max_depth" in short
    assert "mostly a new video" not in region_reason(0.12, 0.0)
    assert "max_region is 0" in region_reason(0.12, 0.0)
    assert "mostly a new video" not in region_reason(0.3, 0.2)
    assert "mostly a new video" in region_reason(0.8, 0.5)


def test_an_exact_repeat_is_not_called_a_rejection(tiny_models, requests_in):
    from carnator_core import pipeline
    from carnator_core.comfy_adapter import start_request
    model = tiny_models["wan21"]
    requests_in(model, "wan21", PROMPT)
    positive, negative, latent = requests_in.inputs("wan21", PROMPT)
    pr = start_request(model, positive, negative, latent, 7, requests_in.steps, 4.0, "euler",
                       "simple", requests_in.settings, {"folder": requests_in.cache_folder})
    plan, _ = pipeline.lookup_and_gate(pr)
    assert pr.exact_latent is not None and "exact repeat" in plan.reason, plan.reason
    assert "returned" in plan.reason and "reject" not in plan.reason, plan.reason


def test_cache_written_by_another_model(tiny_models, requests_in):
    _, s1 = requests_in(tiny_models["hunyuan_video"], "hunyuan_video", PROMPT)
    latent, s2 = requests_in(tiny_models["wan21"], "wan21", PROMPT)
    assert s1.outcome == s2.outcome == "miss"
    assert "none for this model" in s2.lookup_message
    assert torch.isfinite(latent).all()


def test_full_disk_while_storing_keeps_the_cache_consistent(tmp_path):
    """A real write failure: the file-size limit makes the tensor write fail with EFBIG."""
    folder = tmp_path / "cache"
    script = textwrap.dedent(f"""
        import resource, signal, sys, torch
        sys.path.insert(0, {str(REPO)!r})
        from carnator_core.cache.folder import TrajectoryCache
        cache = TrajectoryCache({str(folder)!r})
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
        big = {{"final": torch.zeros(1, 16, 8, 64, 64)}}  # 2 MB, over the limit
        entry = cache.store({{"class_key": "k", "exact_key": "e"}}, big, torch.ones(8))
        print("STORED", entry)
        print("REPORTS", cache.reports)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "STORED None" in out.stdout
    assert "trajectory not stored" in out.stdout
    assert _rows(folder) == []
    assert not [p for p in (folder / "tensors").iterdir()], "temporary file left behind"


def test_two_processes_share_one_cache(tmp_path):
    folder = tmp_path / "cache"
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(REPO)!r})
        from carnator_core.cache.folder import TrajectoryCache
        for i in range(15):
            c = TrajectoryCache({str(folder)!r})
            c.store({{"class_key": "k", "exact_key": sys.argv[1] + str(i)}},
                    {{"final": torch.randn(1, 4, 2, 8, 8)}}, torch.randn(8))
            c.log_request("miss", None, 1, 1, 0.1, "k")
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, tag]) for tag in ("a", "b")]
    assert [p.wait(timeout=180) for p in procs] == [0, 0]
    assert len(_rows(folder)) == 30
    with sqlite3.connect(folder / "carnator.sqlite") as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert db.execute("PRAGMA quick_check").fetchone()[0] == "ok"
    assert len(list((folder / "tensors").glob("*.safetensors"))) == 30


def test_eviction_by_utility_keeps_pinned_and_useful_entries(tmp_path):
    from carnator_core.cache.folder import TrajectoryCache
    cache = TrajectoryCache(tmp_path / "cache", capacity_bytes=10**9)
    ids = [cache.store({"class_key": "k", "exact_key": str(i)},
                       {"final": torch.randn(1, 4, 4, 16, 16)}, torch.randn(8)) for i in range(4)]
    size = cache.stats()["bytes"] // 4
    cache.set_pinned(ids[0], True)            # oldest, never used, but pinned
    cache.record_use(ids[1], steps_saved=20)  # useful
    cache.capacity_bytes = 2 * size + size // 2
    evicted = cache.evict_to_capacity()
    assert sorted(evicted) == sorted(ids[2:])
    assert {r["id"] for r in cache.list_entries()} == set(ids[:2])
    assert not cache.tensor_path(ids[2]).exists()


def test_a_locked_index_is_not_mistaken_for_corruption(tmp_path, monkeypatch):
    """Another process holding the write lock past the busy timeout: readers still work
    (WAL), the write is reported and rolled back, nothing is quarantined."""
    from carnator_core.cache.folder import TrajectoryCache
    from carnator_core.pipeline import guarded
    folder = tmp_path / "cache"
    cache = TrajectoryCache(folder)
    kept = cache.store({"class_key": "k", "exact_key": "a"}, {"final": torch.zeros(1, 4, 2, 8, 8)},
                       torch.ones(8))
    monkeypatch.setattr(TrajectoryCache, "busy_timeout_s", 0.2)
    holder = sqlite3.connect(folder / "carnator.sqlite", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # a writer that does not let go
    try:
        reopened = TrajectoryCache(folder)          # reading is not blocked
        assert reopened.get(kept) is not None
        stored = guarded(reopened, "storing the trajectory", reopened.store,
                         {"class_key": "k", "exact_key": "b"}, {"final": torch.zeros(1, 4, 2, 8, 8)},
                         torch.ones(8))
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert stored is None
    assert any("locked" in m for m in reopened.reports), reopened.reports
    assert not (folder / "quarantine").exists()
    assert _rows(folder) == [kept]
    assert [p.stem for p in (folder / "tensors").glob("*.safetensors")] == [kept]


def test_a_damaged_calibration_file_never_fails_a_request(tiny_models, requests_in):
    """The request completes: an exact repeat is still served, a new one runs on the
    uncalibrated prior, and the summary names the file and what to do."""
    wan, folder = tiny_models["wan21"], Path(requests_in.cache_folder)
    _, s1 = requests_in(wan, "wan21", PROMPT)
    fingerprint = next(iter(_rows_full(folder).values()))["model_fingerprint"]
    calibration = folder / "calibration" / f"{fingerprint}.json"
    calibration.parent.mkdir(exist_ok=True)
    calibration.write_text('{"weights": {"similarity": ')  # cut short
    _, again = requests_in(wan, "wan21", PROMPT)
    assert again.outcome == "exact" and again.entry_id == s1.stored_id
    latent, s2 = requests_in(wan, "wan21", RELATED)
    assert s2.outcome in ("miss", "hit") and torch.isfinite(latent).all()
    assert "uncalibrated prior" in s2.calibration, s2.calibration
    assert str(calibration) in s2.calibration and "re-run calibration" in s2.calibration


def test_malformed_index_rows_are_restored_from_their_files(tiny_models, requests_in):
    """Valid SQLite, wrong content (snapshot_steps not JSON, a signature of odd length):
    the request completes, the row is restored from its file and the entry reused."""
    wan, folder = tiny_models["wan21"], Path(requests_in.cache_folder)
    _, s1 = requests_in(wan, "wan21", PROMPT)
    with sqlite3.connect(folder / "carnator.sqlite") as db:
        db.execute("UPDATE entries SET snapshot_steps = '[1, 2' WHERE id = ?", [s1.stored_id])
        # the full signature lives beside the row (cache/index.py)
        db.execute("UPDATE signatures SET signature = x'00ff00' WHERE id = ?", [s1.stored_id])
    latent, s2 = requests_in(wan, "wan21", RELATED)
    assert torch.isfinite(latent).all()
    assert any(s1.stored_id in m and "restored from its tensor file" in m for m in s2.messages), s2.messages
    assert s2.outcome == "hit" and s2.entry_id == s1.stored_id
    assert _rows_full(folder)[s1.stored_id]["snapshot_steps"].startswith("[")


def _rows_full(folder: Path) -> dict[str, dict]:
    with sqlite3.connect(folder / "carnator.sqlite") as db:
        db.row_factory = sqlite3.Row
        return {r["id"]: dict(r) for r in db.execute("SELECT * FROM entries")}
