"""The cache's files: verified safetensors entries, usage sidecars and the folder lock.

An entry file is a standard safetensors file. Its metadata carries

- ``carnator_entry``: the entry's index row as JSON (its id included), so a lost index can
  be rebuilt from the files;
- ``carnator_hashes``: a BLAKE2b hash per tensor over its name, dtype, shape and bytes.

The index row keeps ``checksum`` = a hash of the entry id and that hash table. A load checks
(before anything is used) that the file names the entry asked for, that its hash table is
the one the index recorded, that each tensor read hashes to its recorded value, and that
floating-point values are finite. Any mismatch is evidence of damage; an error of the
operating system (no file descriptors, no memory) is not, and never quarantines an entry.

Files are read with plain ``read()`` calls rather than a memory map: a file truncated by
another process while it is read then gives a short read (damage, reported) instead of
SIGBUS (a dead ComfyUI).
"""
from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

try:
    import fcntl
except ImportError:  # Windows: no flock; see FolderLock
    fcntl = None

ENTRY_ID_RE = re.compile(r"\A[0-9a-f]{32}\Z")  # \Z: "$" would accept a trailing newline
MAX_HEADER_BYTES = 64 * 1024 * 1024
TORCH_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


class CacheError(RuntimeError):
    """A cache problem a person can act on; the request still runs as a miss."""


def valid_entry_id(entry_id: Any) -> bool:
    return isinstance(entry_id, str) and ENTRY_ID_RE.fullmatch(entry_id) is not None


class EntryDamaged(Exception):
    """Evidence that an entry file is not what its index row promised: quarantine it."""


class EntryUnreadable(Exception):
    """The system could not read the file now (fds, memory, I/O): keep the entry."""


# ------------------------------------------------------------------ hashing
def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes safetensors stores for ``t`` (contiguous, little-endian, as on x86/ARM)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def tensor_hash(name: str, dtype: str, shape: list[int], data: bytes | memoryview) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps([name, dtype, list(shape)]).encode())
    h.update(data)
    return h.hexdigest()


def entry_checksum(entry_id: str, hashes_json: str, entry_json: str) -> str:
    """What the index row stores: binds the hash table and the file's own copy of the row
    (what a rebuild would index) to this entry id."""
    return hashlib.blake2b(f"{entry_id}\n{hashes_json}\n{entry_json}".encode(),
                           digest_size=16).hexdigest()


def hash_table(tensors: dict[str, torch.Tensor]) -> str:
    table = {}
    for name, t in tensors.items():
        if t.dtype not in DTYPE_NAMES:
            raise ValueError(f"tensor {name} has dtype {t.dtype}, which the cache does not store")
        table[name] = tensor_hash(name, DTYPE_NAMES[t.dtype], list(t.shape), tensor_bytes(t))
    return json.dumps(table, sort_keys=True)


def non_finite(tensors: dict[str, torch.Tensor]) -> list[str]:
    return [n for n, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]


# ------------------------------------------------------------------ reading
def _damage(path: Path, why: str) -> EntryDamaged:
    return EntryDamaged(f"{path.name}: {why}")


def read_header(f, path: Path, size: int) -> tuple[dict[str, Any], dict[str, str], int]:
    """(tensor table, metadata, offset of the data section) of an open safetensors file."""
    head = f.read(8)
    if len(head) < 8:
        raise _damage(path, "shorter than a safetensors header")
    n = int.from_bytes(head, "little")
    if n <= 0 or n > MAX_HEADER_BYTES or 8 + n > size:
        raise _damage(path, f"header length {n} does not fit the file ({size} bytes)")
    try:
        header = json.loads(f.read(n).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise _damage(path, f"header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise _damage(path, "header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise _damage(path, "metadata is not a JSON object")
    return header, meta, 8 + n


def _read_tensor(f, path: Path, name: str, info: Any, data_start: int, size: int,
                 expected_hash: str | None) -> torch.Tensor:
    try:
        dtype_name, shape, (begin, end) = info["dtype"], list(info["shape"]), info["data_offsets"]
        dtype = TORCH_DTYPES[dtype_name]
        count = math.prod(int(s) for s in shape)
    except (KeyError, TypeError, ValueError) as e:
        raise _damage(path, f"tensor {name} has a malformed header entry ({e!r})") from None
    width = torch.empty((), dtype=dtype).element_size()
    if not (0 <= begin <= end and data_start + end <= size and end - begin == count * width):
        raise _damage(path, f"tensor {name} lies outside the file (truncated?)")
    f.seek(data_start + begin)
    data = f.read(end - begin)
    if len(data) != end - begin:
        raise _damage(path, f"tensor {name} was cut short while reading (truncated meanwhile?)")
    if expected_hash is not None and tensor_hash(name, dtype_name, shape, data) != expected_hash:
        raise _damage(path, f"tensor {name} does not match its checksum (bit rot or edited)")
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    t = torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise _damage(path, f"tensor {name} holds NaN or infinite values")
    return t


def read_entry(path: Path, entry_id: str, checksum: str | None,
               names: list[str] | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor], str | None]:
    """(row from the file's metadata, tensors, the file's checksum) of entry ``entry_id``.

    ``checksum`` is what the index recorded (None for rows written before checksums: such
    a file is *unverified but usable* — its entry id, structure and finiteness are checked,
    its bytes cannot be; the returned checksum is None). ``names=None`` reads every tensor. Raises FileNotFoundError,
    EntryDamaged (quarantine) or EntryUnreadable (keep, run as a miss).
    """
    try:
        with open(path, "rb") as f:
            return read_entry_from(f, os.fstat(f.fileno()).st_size, path, entry_id, checksum, names)
    except FileNotFoundError:
        raise
    except (OSError, MemoryError) as e:
        if isinstance(e, OSError) and e.errno in (errno.EISDIR, errno.ELOOP):
            raise _damage(path, f"not a regular file ({e.strerror})") from None
        raise EntryUnreadable(f"{path.name}: {getattr(e, 'strerror', None) or e!r}") from None


def read_entry_from(f, size: int, path: Path, entry_id: str, checksum: str | None,
                    names: list[str] | None = None):
    """``read_entry`` on an open binary file object of ``size`` bytes (a file, or a blob
    the PostgreSQL backend read into memory); ``path`` only names it in messages."""
    header, meta, data_start = read_header(f, path, size)
    row = _row_of(path, meta, entry_id)
    hashes_json = meta.get("carnator_hashes")
    file_checksum = (None if hashes_json is None else
                     entry_checksum(entry_id, str(hashes_json), meta["carnator_entry"]))
    hashes = _hashes_of(path, hashes_json, file_checksum, checksum)
    wanted = list(header) if names is None else [n for n in names if n in header]
    tensors = {}
    for name in wanted:
        if hashes is not None and name not in hashes:
            raise _damage(path, f"tensor {name} has no recorded checksum")
        tensors[name] = _read_tensor(f, path, name, header[name], data_start, size,
                                     None if hashes is None else hashes[name])
    if hashes is not None and names is None and set(hashes) != set(header):
        raise _damage(path, "the file's tensors differ from its recorded checksums")
    return row, tensors, file_checksum


def _row_of(path: Path, meta: dict[str, str], entry_id: str) -> dict[str, Any]:
    try:
        row = json.loads(meta["carnator_entry"])
    except (KeyError, TypeError, json.JSONDecodeError, RecursionError):
        raise _damage(path, "has no readable Carnator entry metadata") from None
    if not isinstance(row, dict) or row.get("id") != entry_id:
        other = row.get("id") if isinstance(row, dict) else None
        raise _damage(path, f"holds entry {other!r}, not {entry_id} (file swapped or copied)")
    return row


def _hashes_of(path: Path, hashes_json: Any, file_checksum: str | None,
               checksum: str | None) -> dict | None:
    if hashes_json is None:
        if checksum:
            raise _damage(path, "has no checksums but its index row has one")
        return None  # written before checksums existed: unverified but usable
    if checksum and file_checksum != checksum:
        raise _damage(path, "its metadata or checksum table differs from what the index recorded")
    try:
        hashes = json.loads(hashes_json)
    except (TypeError, json.JSONDecodeError):
        raise _damage(path, "its checksum table is not valid JSON") from None
    if not isinstance(hashes, dict):
        raise _damage(path, "its checksum table is not a JSON object")
    return hashes


# ------------------------------------------------------------------ usage sidecars
USAGE_FIELDS = {"hits": int, "steps_saved": float, "last_used": float, "pinned": int}


# An entry file renamed inside the transaction that removes its row (delete, eviction): never
# re-indexed, swept later. Its presence beside a row without a file means the removal was
# interrupted by a crash before it committed.
REMOVED_SUFFIX = ".removed"


def missing_reason(tensor_path: Path) -> str:
    """Why a row has no file: its removal was interrupted, or the file was lost."""
    return "interrupted removal" if tensor_path.with_name(tensor_path.name + REMOVED_SUFFIX).exists() \
        else "lost"


def usage_path(tensor_path: Path) -> Path:
    return tensor_path.with_name(tensor_path.stem + ".usage.json")


def write_usage(tensor_path: Path, usage: dict[str, Any]) -> None:
    """Pins and hit counts beside the tensor file, so an index rebuild keeps them."""
    final = usage_path(tensor_path)
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    tmp.write_text(json.dumps({k: USAGE_FIELDS[k](usage[k]) for k in USAGE_FIELDS}))
    tmp.replace(final)


def read_usage(tensor_path: Path) -> dict[str, Any]:
    try:
        data = json.loads(usage_path(tensor_path).read_text())
        return {k: t(data[k]) for k, t in USAGE_FIELDS.items()}
    except (OSError, ValueError, KeyError, TypeError):
        return {}  # no sidecar (never used) or a damaged one: creation-time values stand


# ------------------------------------------------------------------ folder lock
class FolderLock:
    """Shared/exclusive lock on a cache folder, between processes and threads alike.

    Every index connection holds it shared; repair, re-index and clear hold it exclusive.
    That is what makes moving a corrupt index aside safe: SQLite deletes ``-wal`` by *name*
    when its last connection closes, so no connection to the old file may still be open.
    A second lock file gives waiting exclusive holders priority over new shared ones (flock
    alone lets a steady stream of readers starve a repair). flock is released by the kernel
    when a holder dies, kill -9 included. Re-entrant per thread. Without fcntl (Windows)
    this is a no-op and repairs racing other processes are not excluded.
    """

    _held = threading.local()

    def __init__(self, folder: Path):
        self.main = folder / ".carnator.lock"
        self.gate = folder / ".carnator.lock-gate"

    @contextmanager
    def __call__(self, exclusive: bool = False) -> Iterator[None]:
        held = getattr(self._held, "modes", None)
        if held is None:
            held = self._held.modes = {}
        key = str(self.main)
        mode = held.get(key)
        if mode is not None:
            if exclusive and mode != "ex":
                raise RuntimeError("cache lock: exclusive requested while held shared")
            yield
            return
        if fcntl is None:
            yield
            return
        fds = self._acquire(exclusive)
        held[key] = "ex" if exclusive else "sh"
        try:
            yield
        finally:
            del held[key]
            for fd in fds:
                os.close(fd)  # closing releases the flock

    @staticmethod
    def _open(path: Path) -> int | None:
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            try:  # a read-only folder or full disk: flock works on a read-only descriptor
                return os.open(path, os.O_RDONLY)
            except OSError:
                return None  # cannot even read it: nothing to protect here

    def _acquire(self, exclusive: bool) -> list[int]:
        gate, main = self._open(self.gate), self._open(self.main)
        if gate is None or main is None:
            for fd in (gate, main):
                if fd is not None:
                    os.close(fd)
            return []
        try:
            if exclusive:
                fcntl.flock(gate, fcntl.LOCK_EX)   # new shared holders now wait behind us
                fcntl.flock(main, fcntl.LOCK_EX)
                return [main, gate]
            fcntl.flock(gate, fcntl.LOCK_SH)
            fcntl.flock(main, fcntl.LOCK_SH)
            os.close(gate)
            return [main]
        except BaseException:
            for fd in (main, gate):
                try:
                    os.close(fd)
                except OSError:
                    pass
            raise


# ------------------------------------------------------------------ kill points for tests
_KILL_AT = os.environ.get("CARNATOR_TEST_KILL_AT", "")


def kill_point(name: str) -> None:
    """The fault-injection suite kills a process exactly here (SQLite's own testing habit:
    a crash at every write point, not only at random ones). Free when the variable is unset."""
    if _KILL_AT and _KILL_AT == name:
        import signal
        os.kill(os.getpid(), signal.SIGKILL)


_PAUSE_DIR = os.environ.get("CARNATOR_TEST_PAUSE_DIR", "")


def pause_point(name: str, limit_s: float = 120.0) -> None:
    """Tests stop the world exactly here (e.g. the database, mid-request): when the test has
    armed ``<dir>/<name>.arm``, this process disarms it, writes ``<name>.paused`` and waits
    until the test removes that file. Free when the variable is unset."""
    if not _PAUSE_DIR:
        return
    import time
    arm, paused = Path(_PAUSE_DIR) / f"{name}.arm", Path(_PAUSE_DIR) / f"{name}.paused"
    try:
        arm.unlink()
    except FileNotFoundError:
        return  # not armed: this request runs straight through
    paused.touch()
    deadline = time.monotonic() + limit_s
    while paused.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
