"""Fault injection on the trajectory cache: real processes, kill -9, races, corruption.

Each test states the promise it checks. The harness (tests/cache_faults.py) prints its
counts; ``scripts/cache_soak.py`` runs the same harness for longer.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from cache_fault_worker import CLASS_KEY, expected_tensors, same, signature_of  # noqa: E402
from cache_faults import ENTRY_BYTES, kill_storm, point_sweep, verify  # noqa: E402

from carnator_core.cache.folder import ENTRY_ID_RE, TrajectoryCache  # noqa: E402


def fill(folder: Path, n: int, capacity: int = 10**9, start: int = 0) -> tuple[TrajectoryCache, dict[str, int]]:
    cache = TrajectoryCache(folder, capacity)
    seeds = {}
    for seed in range(start, start + n):
        row = {"class_key": CLASS_KEY, "exact_key": f"e{seed}", "prompt": str(seed),
               "snapshot_steps": "[2]"}
        seeds[cache.store(row, expected_tensors(seed), signature_of(seed))] = seed
    assert all(seeds)
    return cache, seeds


def in_processes(n: int, code: str, *args: str, timeout: float = 180) -> list[str]:
    """Run ``code`` in n real processes released together where it calls ``go()``."""
    go = Path(args[0]).parent / f"go-{random.getrandbits(32)}"
    script = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {str(REPO)!r}); sys.path.insert(0, {str(HERE)!r})
        from carnator_core.cache.folder import TrajectoryCache
        def go():
            while not os.path.exists({str(go)!r}):
                time.sleep(0.002)
    """) + textwrap.dedent(code)
    procs = [subprocess.Popen([sys.executable, "-c", script, *args, str(i)], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(n)]
    time.sleep(4.0)  # past the torch import
    go.touch()
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err[-3000:]
        outs.append(out)
    return outs


def rows(folder: Path) -> dict[str, dict]:
    with sqlite3.connect(folder / "carnator.sqlite") as db:
        db.row_factory = sqlite3.Row
        return {r["id"]: dict(r) for r in db.execute("SELECT * FROM entries")}


# ------------------------------------------------------------------ kill -9 storm
def test_kill_storm_keeps_every_promise_and_serves_nothing_wrong(tmp_path):
    """Three processes store, load, pin, use, delete and evict on one small cache; one is
    SIGKILLed every round, some restarts kill themselves at a write point; then every
    write point once more. Every entry whose store() returned is present and byte-identical
    or was evicted by policy (never a pinned one) or deleted; no load ever returned other
    bytes; rows and files agree and no temporary file is left."""
    folder, capacity = tmp_path / "cache", 60 * ENTRY_BYTES
    counts = kill_storm(folder, tmp_path, workers=3, rounds=8, capacity=capacity, seed=12)
    sweep = point_sweep(folder, tmp_path, capacity=capacity)
    counts.point_kills += sweep.point_kills
    counts.problems += sweep.problems
    counts = verify(folder, tmp_path, capacity, counts)
    print("\ncache fault storm:", counts.line())
    assert counts.ok(), (counts.lost, counts.pinned_evicted, counts.problems)
    assert counts.kills >= 8 and counts.point_kills >= 6 and counts.entries_checked > 50
    assert counts.present > 0 and counts.evicted > 0 and counts.loads > 0


# ------------------------------------------------------------------ eviction races
def test_concurrent_eviction_takes_only_what_it_needs(tmp_path):
    """4 processes evicting 30 of 120 equal entries at once evict exactly 30 (each once
    computed the total alone and kept deleting: most of the cache went)."""
    folder = tmp_path / "cache"
    cache, seeds = fill(folder, 120)
    size = cache.stats()["bytes"] // 120
    outs = in_processes(4, """
        c = TrajectoryCache(sys.argv[1], int(sys.argv[2]))
        go()
        print(len(c.evict_to_capacity()))
    """, str(folder), str(90 * size))
    evicted = sum(int(o) for o in outs)
    left = rows(folder)
    left_bytes = sum(r["bytes"] for r in left.values())
    print(f"\nconcurrent eviction: 4 processes evicted {evicted} of 120 (about 30 needed), "
          f"{len(left)} left")
    # within capacity, and not one entry more taken than needed (sizes differ by a few bytes)
    assert left_bytes <= 90 * size < left_bytes + min(r["bytes"] for r in left.values())
    assert evicted == 120 - len(left) <= 31


def test_pins_racing_eviction_are_never_evicted(tmp_path):
    """A process pins entries while three others evict everything unpinned: every pin
    that set_pinned() confirmed survives (the victims were once chosen in one read and
    deleted later without looking at pins again)."""
    folder = tmp_path / "cache"
    cache, seeds = fill(folder, 40)
    size = cache.stats()["bytes"] // 40
    order = sorted(seeds, key=lambda i: rows(folder)[i]["last_used"])  # eviction order
    started = tmp_path / "pinner-started"
    outs = in_processes(4, """
        c = TrajectoryCache(sys.argv[1])
        started = sys.argv[4]
        go()
        if sys.argv[-1] == "0":
            for entry_id in sys.argv[2].split(","):
                if c.set_pinned(entry_id, True):
                    print(entry_id, flush=True)
                    open(started, "w").close()
        else:  # one entry at a time, so pins and evictions interleave
            while not os.path.exists(started):
                time.sleep(0.001)
            for k in range(40, -1, -1):
                c.capacity_bytes = k * int(sys.argv[3])
                c.evict_to_capacity()
    """, str(folder), ",".join(order), str(size), str(started))
    confirmed = set(outs[0].split())
    left = rows(folder)
    print(f"\npins racing eviction: {len(confirmed)} pins confirmed, {len(left)} entries left")
    assert confirmed and confirmed <= set(left)
    assert all(left[i]["pinned"] for i in left)
    cache = TrajectoryCache(folder)
    assert all(same(cache.load_tensors(i), expected_tensors(seeds[i])) for i in confirmed)


def test_store_never_returns_an_id_its_eviction_removed(tmp_path):
    cache = TrajectoryCache(tmp_path / "cache", capacity_bytes=ENTRY_BYTES // 2)
    row = {"class_key": CLASS_KEY, "exact_key": "x", "snapshot_steps": "[2]"}
    assert cache.store(row, expected_tensors(1), signature_of(1)) is None  # larger than capacity
    assert any("do not fit" in m for m in cache.reports), cache.reports
    cache.capacity_bytes = 3 * ENTRY_BYTES
    ids = [cache.store({**row, "exact_key": str(i)}, expected_tensors(i), signature_of(i))
           for i in range(6)]
    assert all(cache.get(i) is not None for i in ids[-1:])  # the newest is always kept
    assert all(i is None or cache.get(i) is not None or i != ids[-1] for i in ids)


def test_an_entry_another_process_evicted_is_not_reported_lost(tmp_path):
    folder = tmp_path / "cache"
    cache, seeds = fill(folder, 3)
    reader = TrajectoryCache(folder)
    victim = next(iter(seeds))
    entry = reader.get(victim)                       # the reader saw the row ...
    cache.delete(victim)                             # ... another process evicted it
    assert reader.load_tensors(entry.id) is None
    assert not reader.reports, reader.reports        # nothing was lost: no alarm


# ------------------------------------------------------------------ corrupt index
def _corrupt_index(folder: Path) -> None:
    for suffix in ("-wal", "-shm"):
        Path(str(folder / "carnator.sqlite") + suffix).unlink(missing_ok=True)
    (folder / "carnator.sqlite").write_bytes(b"not an index" * 500)


def _usage_before(cache: TrajectoryCache, ids: list[str]) -> dict[str, tuple]:
    cache.set_pinned(ids[0], True)
    cache.set_pinned(ids[1], True)
    cache.record_use(ids[2], 7)
    cache.record_use(ids[2], 7)
    return {i: (r["pinned"], r["hits"], r["steps_saved"]) for i, r in rows(cache.folder).items()}


def test_concurrent_repair_of_a_corrupt_shared_index_loses_nothing(tmp_path):
    """Four processes open a corrupt index at once: one rebuilds it from the files while
    the others wait, every entry comes back with its pins and hits, each process stores
    its own entry, and only one index copy is quarantined."""
    folder = tmp_path / "cache"
    cache, seeds = fill(folder, 20)
    before = _usage_before(cache, list(seeds))
    _corrupt_index(folder)
    outs = in_processes(4, """
        from cache_fault_worker import expected_tensors, signature_of
        go()
        c = TrajectoryCache(sys.argv[1])
        i = 1000 + int(sys.argv[-1])
        print(c.store({"class_key": "fault-class", "exact_key": str(i), "prompt": str(i),
                       "snapshot_steps": "[2]"}, expected_tensors(i), signature_of(i)))
    """, str(folder))
    after = rows(folder)
    new = [o.strip() for o in outs]
    assert all(ENTRY_ID_RE.fullmatch(i) for i in new) and set(new) <= set(after)
    assert {i: (r["pinned"], r["hits"], r["steps_saved"]) for i, r in after.items()
            if i in before} == before
    assert len(after) == 24
    assert len(list((folder / "quarantine").glob("carnator.sqlite.*.corrupt"))) == 1
    reopened = TrajectoryCache(folder)
    assert all(same(reopened.load_tensors(i), expected_tensors(s)) for i, s in seeds.items())


def test_a_rebuild_killed_part_way_is_finished_by_the_next_open(tmp_path):
    folder = tmp_path / "cache"
    _, seeds = fill(folder, 8)
    _corrupt_index(folder)
    env = {**os.environ, "CARNATOR_TEST_KILL_AT": "reconcile.indexed_one"}
    code = f"import sys; sys.path.insert(0, {str(REPO)!r}); from carnator_core.cache.folder import TrajectoryCache; TrajectoryCache({str(folder)!r})"
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == -9
    assert len(rows(folder)) < 8  # it died after indexing one file
    cache = TrajectoryCache(folder)
    assert set(rows(folder)) == set(seeds)
    assert all(same(cache.load_tensors(i), expected_tensors(s)) for i, s in seeds.items())


@pytest.mark.parametrize("damage", ["deleted", "emptied"])
def test_a_lost_or_emptied_index_is_rebuilt_with_pins_and_hits(tmp_path, damage):
    folder = tmp_path / "cache"
    cache, seeds = fill(folder, 6)
    before = _usage_before(cache, list(seeds))
    if damage == "deleted":
        for suffix in ("", "-wal", "-shm"):
            Path(str(folder / "carnator.sqlite") + suffix).unlink(missing_ok=True)
    else:
        with sqlite3.connect(folder / "carnator.sqlite") as db:
            db.execute("DELETE FROM entries")
    reopened = TrajectoryCache(folder)
    assert any("re-indexed 6" in m for m in reopened.reports), reopened.reports
    assert {i: (r["pinned"], r["hits"], r["steps_saved"]) for i, r in rows(folder).items()} == before


def test_a_bit_flipped_in_the_wal_loses_no_entry(tmp_path):
    """SQLite drops WAL frames from the first bad checksum on; the files bring them back."""
    folder = tmp_path / "cache"
    cache, first = fill(folder, 3)
    holder = sqlite3.connect(folder / "carnator.sqlite")  # keeps the WAL from being checkpointed
    holder.execute("SELECT count(*) FROM entries").fetchone()
    _, later = fill(folder, 3, start=100)
    crashed = tmp_path / "crashed"  # the folder as a crash would leave it
    shutil.copytree(folder, crashed)
    holder.close()
    (crashed / "carnator.sqlite-shm").unlink(missing_ok=True)
    wal = crashed / "carnator.sqlite-wal"
    data = bytearray(wal.read_bytes())
    assert len(data) > 5000
    data[32 + 24 + 100] ^= 0x10  # inside the first frame's page
    wal.write_bytes(bytes(data))
    reopened = TrajectoryCache(crashed)
    assert set(rows(crashed)) == set(first) | set(later)
    assert all(same(reopened.load_tensors(i), expected_tensors(s)) for i, s in {**first, **later}.items())


# ------------------------------------------------------------------ damaged entries
def _flip(path: Path, offset_from_end: int) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) - offset_from_end] ^= 0x01
    path.write_bytes(bytes(data))


def _header_edit(path: Path, old: bytes, new: bytes) -> None:
    data = path.read_bytes()
    assert len(old) == len(new) and old in data
    path.write_bytes(data.replace(old, new, 1))


def _nan_with_valid_checksums(path: Path, entry_id: str) -> None:
    """A writer that stored NaN and hashed it correctly: only the finiteness check sees it."""
    from safetensors.torch import save_file
    from carnator_core.cache.files import entry_checksum, hash_table, read_entry
    row, tensors, _ = read_entry(path, entry_id, None)
    tensors["final"][0, 0, 0, 0, 0] = float("nan")
    hashes, meta = hash_table(tensors), json.dumps(row)
    save_file(tensors, str(path), metadata={"carnator_entry": meta, "carnator_hashes": hashes})
    with sqlite3.connect(path.parent.parent / "carnator.sqlite") as db:
        db.execute("UPDATE entries SET checksum = ? WHERE id = ?",
                   [entry_checksum(entry_id, hashes, meta), entry_id])


DAMAGES = {
    "bit flip in the final latent": lambda p, a, b: _flip(p, 3),              # final is stored last
    "bit flip in a snapshot": lambda p, a, b: _flip(p, 5 * 512 - 7),
    "bit flip in the metadata": lambda p, a, b: _header_edit(p, b'"prompt', b'"prompT'),
    "NaN with valid checksums": lambda p, a, b: _nan_with_valid_checksums(p, a),
    "files swapped": lambda p, a, b: (p.rename(p.with_suffix(".x")), p.with_name(f"{b}.safetensors").rename(p),
                                      p.with_suffix(".x").rename(p.with_name(f"{b}.safetensors"))),
    "another entry copied over it": lambda p, a, b: shutil.copyfile(p.with_name(f"{b}.safetensors"), p),
    "symlinked to another entry": lambda p, a, b: (p.unlink(), p.symlink_to(p.with_name(f"{b}.safetensors"))),
    "truncated": lambda p, a, b: p.write_bytes(p.read_bytes()[:1000]),
    "header garbage": lambda p, a, b: p.write_bytes(b"\xff" * 64 + p.read_bytes()[64:]),
    "a directory in its place": lambda p, a, b: (p.unlink(), p.mkdir()),
    "entry id edited in the metadata": lambda p, a, b: _header_edit(p, a.encode(), b.encode()),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damaged_entries_are_never_served(tmp_path, damage):
    """Verified on every load: the damaged entry gives None, is quarantined and reported;
    every other entry still loads its own bytes."""
    folder = tmp_path / "cache"
    cache, seeds = fill(folder, 3)
    a, b, c = list(seeds)
    DAMAGES[damage](cache.tensor_path(a), a, b)
    reader = TrajectoryCache(folder)
    assert reader.load_tensors(a) is None
    assert reader.load_tensors(a, ["final"]) is None
    assert a not in rows(folder)
    assert any(a in m and "quarantined" in m for m in reader.reports), reader.reports
    for other in (b, c):
        got = reader.load_tensors(other)
        # a swap damages both files; whatever loads must be its own bytes
        assert got is None or same(got, expected_tensors(seeds[other]))
    assert reader.load_tensors(c) is not None or damage == "files swapped"


def test_store_refuses_non_finite_values(tmp_path):
    cache = TrajectoryCache(tmp_path / "cache")
    bad = expected_tensors(1)
    bad["final"][0, 0, 0, 0, 0] = float("inf")
    assert cache.store({"class_key": CLASS_KEY, "exact_key": "x"}, bad, signature_of(1)) is None
    assert any("NaN or infinite" in m for m in cache.reports)
    assert rows(cache.folder) == {}


def test_a_transient_read_error_keeps_the_entry(tmp_path):
    """Out of memory while reading is not damage: no quarantine, the entry stays."""
    folder = tmp_path / "cache"
    cache = TrajectoryCache(folder)
    big = cache.store({"class_key": CLASS_KEY, "exact_key": "big"},
                      {"final": torch.ones(24 * 1024 * 1024)}, signature_of(1))  # 96 MB
    code = textwrap.dedent(f"""
        import resource, sys
        sys.path.insert(0, {str(REPO)!r})
        from carnator_core.cache.folder import TrajectoryCache
        c = TrajectoryCache({str(folder)!r})
        vm = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize")).split()[1]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + 48 * 2**20, resource.RLIM_INFINITY))
        print(c.load_tensors({big!r}) is None)
        print(c.reports)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("True") and "could not be read now" in out.stdout, out.stdout
    assert big in rows(folder) and cache.tensor_path(big).exists()
    assert not (folder / "quarantine").exists()
    assert torch.equal(TrajectoryCache(folder).load_tensors(big)["final"], torch.ones(24 * 1024 * 1024))


# ------------------------------------------------------------------ orphans and leftovers
def test_orphans_and_temporary_files_are_swept_and_cleared(tmp_path):
    folder = tmp_path / "cache"
    _, seeds = fill(folder, 2)
    env = {**os.environ, "CARNATOR_TEST_KILL_AT": "store.renamed"}
    code = textwrap.dedent(f"""
        import sys, torch; sys.path.insert(0, {str(REPO)!r}); sys.path.insert(0, {str(HERE)!r})
        from cache_fault_worker import expected_tensors, signature_of
        from carnator_core.cache.folder import TrajectoryCache
        TrajectoryCache({str(folder)!r}).store({{"class_key": "fault-class", "exact_key": "o",
            "prompt": "77", "snapshot_steps": "[2]"}}, expected_tensors(77), signature_of(77))
    """)
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == -9
    (folder / "tensors" / f"{'e' * 32}.safetensors.tmp-999999").write_bytes(b"half a file")
    (folder / ".write-test-999999").write_bytes(b"ok")
    assert len(list((folder / "tensors").glob("*.safetensors"))) == 3  # one orphan
    cache = TrajectoryCache(folder)        # files outnumber rows: reconciled on open
    assert len(rows(folder)) == 3          # the orphan is indexed, so it counts and can be evicted
    assert not list((folder / "tensors").glob("*.tmp-*"))
    assert not list(folder.glob(".write-test-*"))
    (folder / "tensors" / f"{'e' * 32}.safetensors.tmp-999999").write_bytes(b"half a file")
    assert cache.clear() == 3
    assert sorted(p.name for p in (folder / "tensors").iterdir()) == []


def test_entry_ids_with_a_trailing_newline_are_refused(tmp_path):
    cache, seeds = fill(tmp_path / "cache", 1)
    (entry_id,) = seeds
    assert ENTRY_ID_RE.match(entry_id + "\n") is None
    assert cache.get(entry_id + "\n") is None and cache.load_tensors(entry_id + "\n") is None
    assert cache.delete(entry_id + "\n") is False and cache.get(entry_id) is not None


def test_request_and_removal_logs_are_trimmed(tmp_path, monkeypatch):
    import carnator_core.cache.folder as cache_module
    monkeypatch.setattr(cache_module, "LOG_ROWS_KEPT", 50)
    cache = TrajectoryCache(tmp_path / "cache")
    for _ in range(120):
        cache.log_request("miss", None, 1, 1, 0.1, "k")
    with sqlite3.connect(cache.db_path) as db:
        assert db.execute("SELECT count(*) FROM requests").fetchone()[0] == 50


def test_full_disk_is_reported_as_full_and_exact_repeats_still_load(tmp_path):
    """A real full file system (a 3 MB tmpfs): stored entries are still served, a new one
    is reported as not stored for lack of space, no write-test file is left behind."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        folder = mnt / "cache"
        cache, seeds = fill(folder, 3)
        filler = mnt / "filler"
        with open(filler, "wb") as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        full = TrajectoryCache(folder)
        assert full.read_only and "disk full" in full.read_only
        assert all(same(full.load_tensors(i), expected_tensors(s)) for i, s in seeds.items())
        assert full.store({"class_key": CLASS_KEY, "exact_key": "new"}, expected_tensors(9),
                          signature_of(9)) is None
        assert not any("permission" in m for m in full.reports), full.reports
        assert not list(folder.glob(".write-test-*"))
        filler.unlink()
        assert TrajectoryCache(folder).read_only is None
    finally:
        subprocess.run(["umount", str(mnt)])


def test_a_cache_folder_written_before_checksums_still_opens(tmp_path):
    """Rows without a checksum (schema 1) stay usable, unverified: their file must still
    name the entry and hold finite values; new entries beside them are verified."""
    folder = tmp_path / "cache"
    (folder / "tensors").mkdir(parents=True)
    from safetensors.torch import save_file
    entry_id = "a" * 32
    row = {"id": entry_id, "class_key": CLASS_KEY, "exact_key": "old", "snapshot_steps": "[2]",
           "created": 1.0, "last_used": 1.0, "hits": 3, "steps_saved": 9.0, "pinned": 1}
    tensors = {**expected_tensors(5), "signature": signature_of(5)}
    save_file(tensors, str(folder / "tensors" / f"{entry_id}.safetensors"),
              metadata={"carnator_entry": json.dumps(row)})
    from carnator_core.cache.folder import ENTRY_COLUMNS
    with sqlite3.connect(folder / "carnator.sqlite") as db:  # the schema-1 table, no checksum
        cols = ", ".join(f"{c} {'BLOB' if t is bytes else 'TEXT'}" for c, t in ENTRY_COLUMNS.items()
                         if c != "checksum")
        db.execute(f"CREATE TABLE entries ({cols}, PRIMARY KEY (id))")
        db.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)")
        db.execute("CREATE TABLE requests (ts FLOAT, outcome TEXT, entry_id TEXT, steps_computed "
                   "INTEGER, steps_total INTEGER, seconds FLOAT, class_key TEXT)")
        db.execute("INSERT INTO entries (id, class_key, exact_key, snapshot_steps, signature, bytes, "
                   "pinned, hits) VALUES (?, ?, 'old', '[2]', ?, 100, 1, 3)",
                   [entry_id, CLASS_KEY, signature_of(5).numpy().tobytes()])
    cache = TrajectoryCache(folder)
    assert same(cache.load_tensors(entry_id), expected_tensors(5))
    assert cache.lookup(CLASS_KEY, signature_of(5)).candidates[0].entry.id == entry_id
    new = cache.store({"class_key": CLASS_KEY, "exact_key": "new"}, expected_tensors(6), signature_of(6))
    assert rows(folder)[new]["checksum"] and rows(folder)[entry_id]["checksum"] is None


# ------------------------------------------------------------------ removals are final
REMOVER = """
import sys
sys.path.insert(0, {repo!r}); sys.path.insert(0, {here!r})
from carnator_core.cache.folder import TrajectoryCache
from cache_fault_worker import CLASS_KEY, expected_tensors, signature_of
folder, op, arg = sys.argv[1], sys.argv[2], sys.argv[3]
if op == "delete":
    TrajectoryCache(folder, 10**9).delete(arg)
elif op == "evict":
    TrajectoryCache(folder, int(arg)).evict_to_capacity()
else:  # a store whose own eviction makes room
    row = {{"class_key": CLASS_KEY, "exact_key": "new", "prompt": "999", "snapshot_steps": "[2]"}}
    TrajectoryCache(folder, int(arg)).store(row, expected_tensors(999), signature_of(999))
"""


@pytest.mark.parametrize("op,point", [("delete", "delete.set_aside"), ("delete", "delete.committed"),
                                      ("evict", "evict.set_aside"), ("evict", "evict.committed"),
                                      ("store", "store.evict_set_aside"), ("store", "store.committed")])
def test_a_removal_killed_at_any_point_never_comes_back(tmp_path, op, point):
    """A process is SIGKILLed at each point of a delete and of an eviction. Whatever its
    removal reached — the file set aside, the row's deletion committed, or both — the next
    open (its re-index included) never serves a removed entry again, and after an eviction
    the cache is within its capacity: a removal is final once it started to take effect."""
    folder = tmp_path / "cache"
    cache, seeds = fill(folder, 8)
    target = sorted(seeds)[3]
    capacity = 4 * cache.stats()["bytes"] // 8 + 100  # room for about four entries
    arg = target if op == "delete" else str(capacity)
    code = REMOVER.format(repo=str(REPO), here=str(HERE))
    proc = subprocess.run([sys.executable, "-c", code, str(folder), op, arg], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "CARNATOR_TEST_KILL_AT": point})
    assert proc.returncode == -9, proc.stderr[-2000:]  # killed exactly at the point
    set_aside = {p.name.split(".")[0] for p in (folder / "tensors").glob("*.removed")}
    committed = {r["entry_id"] for r in TrajectoryCache(folder, 10**9).removals()}
    removed = set_aside | committed
    assert removed, "the kill came before the removal took any effect"
    if op == "delete":
        assert removed == {target}

    again = TrajectoryCache(folder, 10**9)
    again.reindex_tensor_files()  # what the next open's reconcile does after a crash
    listed = {r["id"] for r in again.list_entries(0, 100)}
    for entry_id in removed:
        assert entry_id not in listed and again.load_tensors(entry_id) is None, (point, entry_id)
        assert all(c.entry.id != entry_id for c in
                   again.lookup(CLASS_KEY, signature_of(seeds[entry_id]), 8).candidates)
    assert not list((folder / "tensors").glob("*.removed"))  # swept
    files = {p.name[:-len(".safetensors")] for p in (folder / "tensors").glob("*.safetensors")}
    assert files == listed
    for entry_id in listed & set(seeds):  # what stayed is intact
        assert same(again.load_tensors(entry_id), expected_tensors(seeds[entry_id]))
    if op != "delete":
        assert again.stats()["bytes"] <= capacity
