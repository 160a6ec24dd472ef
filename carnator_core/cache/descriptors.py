"""Ranking a class's entries without reading their signatures, in memory that does not
grow with the cache: compact descriptors scanned block by block.

A stored signature's global vector is 10–50 KB (x̂0 and feature tiles). Reading every one of
them per lookup made lookup linear in the cache size. Instead each entry also
keeps a *compact descriptor*: the unit global vector through a fixed seeded random
projection to ``COMPACT_DIM`` floats (Johnson–Lindenstrauss: cosines survive up to about
1/√COMPACT_DIM), quantized to int8. Lookup ranks every entry of the class by that, then
re-ranks the best ``shortlist`` by the exact cosine of their full signatures, so what the
gate receives is ranked exactly as before (bench/lookup_scale.py measures the recall
against exhaustive ranking).

Where the descriptors live (cache_descriptor_blocks.py writes them): in the index itself,
``BLOCK_ROWS`` entries per block, append-only per class, with a per-slot alive mask that
the index's triggers clear when an entry goes. A lookup reads the class's block heads
(alive masks, a few hundred bytes each), then scans the blocks' packed rows
``READ_BATCH`` at a time, keeping only a running top ``shortlist``.

Why not a matrix per class in memory, as before: it cost ≈1.4 KB per entry in every worker
(+135 MB at 100k entries, and again per worker of a farm). Scanning int8 rows is cheap
(100k × 128 in ≈3 ms), so memory can be a constant instead: ``BlockCache`` keeps packed
blocks up to a fixed byte budget per process (``CARNATOR_DESCRIPTOR_CACHE_MB``, default 4)
and reads the rest from the index on each lookup. It admits blocks while the budget has
room and never evicts for a scan (a scan larger than the budget would flush an LRU every
time); a cached block is dropped when the index no longer has it. Rows are appended, never
rewritten in place (compaction writes new blocks), so a cached block of ``n`` rows stays
valid while the head says ``n``; when it says more, only the new rows are read.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Iterable, Protocol

import numpy as np

COMPACT_DIM = 128
SHORTLIST = 64       # entries re-ranked by their full signature
BLOCK_ROWS = 256     # descriptors per block: 32 KB of int8 rows + 8 KB of ids
ID_CHARS = 32        # entry ids are 32 hex digits (cache_files.ENTRY_ID_RE)
READ_BATCH = 32      # blocks per read query and per scoring product: ≈1.3 MB of rows
                     # (5 MB as float32) in flight, whatever the cache size
# A unit projection's components are N(0, 1/COMPACT_DIM) whatever the input (σ ≈ 0.088):
# one fixed scale maps ±0.508 (5.7σ) onto int8; the rounding moves a compact cosine by
# ≈0.001, against the projection's own ≈0.09.
QUANT_SCALE = 250.0
DEFAULT_CACHE_BYTES = int(float(os.environ.get("CARNATOR_DESCRIPTOR_CACHE_MB", "4")) * 2**20)

_projections: dict[int, np.ndarray] = {}


def _projection(width: int) -> np.ndarray:
    """Seeded, identical in every process and machine of a farm: no state to share."""
    p = _projections.get(width)
    if p is None:
        rng = np.random.default_rng(20141 + width)
        p = (rng.standard_normal((width, COMPACT_DIM)) / np.sqrt(COMPACT_DIM)).astype(np.float32)
        _projections[width] = p
    return p


def compact(vector: np.ndarray) -> np.ndarray:
    """Unit ``COMPACT_DIM`` descriptor of a (unit) global signature vector."""
    v = np.asarray(vector, dtype=np.float32).reshape(-1)
    c = v @ _projection(v.size)
    return (c / max(float(np.linalg.norm(c)), 1e-8)).astype(np.float32)


def quantized(vector: np.ndarray) -> bytes:
    """The stored form of a signature's compact descriptor: ``COMPACT_DIM`` int8."""
    return quantized_compact(compact(vector))


def quantized_compact(descriptor: np.ndarray) -> bytes:
    """int8 of an already compact descriptor (what schema 3 stored as float32)."""
    q = np.clip(np.rint(np.asarray(descriptor, np.float32) * QUANT_SCALE), -127, 127)
    return q.astype(np.int8).tobytes()


@dataclass(frozen=True)
class BlockHead:
    """A block's small row, read by every lookup: which slots hold live entries."""
    block: int
    width: int
    n: int          # rows written (append-only)
    live: int
    alive: str      # one '1' or '0' per row


@dataclass(frozen=True)
class Packed:
    """A block's first ``n`` rows as read from the index (immutable: shared by lookups)."""
    n: int
    ids: str
    vecs: np.ndarray  # (n, COMPACT_DIM) int8

    @property
    def nbytes(self) -> int:
        return len(self.ids) + self.vecs.nbytes + 200  # + object overhead, roughly

    def extended(self, ids: str, vecs) -> "Packed":
        """These rows and more; a view of ``vecs`` when there were none (no copy)."""
        more = np.frombuffer(vecs, np.int8).reshape(-1, COMPACT_DIM)
        if self.n == 0:
            return Packed(len(more), ids, more)
        return Packed(self.n + len(more), self.ids + ids, np.concatenate([self.vecs, more]))

    def owned(self) -> "Packed":
        """A copy that does not keep a whole read batch alive (what the cache keeps)."""
        return Packed(self.n, self.ids, self.vecs.copy())


EMPTY = Packed(0, "", np.zeros((0, COMPACT_DIM), np.int8))


class DescriptorSource(Protocol):
    """What a backend's index provides, inside one read snapshot."""

    def index_uid(self) -> str: ...
    def heads(self, class_key: str) -> list[BlockHead]: ...
    def rows_after(self, wanted: list[tuple[int, int]]) -> Iterable[tuple[int, str, bytes]]:
        """(block, ids, vecs) of each (block, skip): the rows after the first ``skip``."""
        ...


class BlockCache:
    """Packed blocks of every index this process reads, within one byte budget."""

    def __init__(self, budget_bytes: int = DEFAULT_CACHE_BYTES):
        self.budget = budget_bytes
        self.bytes = 0
        self._blocks: dict[tuple[str, str, int], Packed] = {}
        self._uids: dict[str, str] = {}
        self._lock = threading.Lock()
        self.rows_read = 0  # descriptor rows fetched from an index (tests: what is re-read)

    def rows_held(self) -> int:
        with self._lock:
            return sum(p.n for p in self._blocks.values())

    def cached(self, index: str, uid: str, class_key: str, heads: list[BlockHead]
               ) -> dict[int, Packed]:
        """What is held for this class's blocks; forgets blocks the index no longer has
        (emptied or compacted), so their budget goes to others."""
        with self._lock:
            if self._uids.get(index) != uid:  # a rebuilt index reuses block numbers
                self._drop(lambda key: key[0] == index)
                self._uids[index] = uid
            present = {h.block for h in heads}
            self._drop(lambda key: key[:2] == (index, class_key) and key[2] not in present)
            held = {h.block: self._blocks.get((index, class_key, h.block)) for h in heads}
            return {b: p for b, p in held.items() if p is not None}

    def keep(self, index: str, class_key: str, block: int, packed: Packed, read: int) -> None:
        with self._lock:
            self.rows_read += read
            old = self._blocks.pop((index, class_key, block), None)
            self.bytes -= old.nbytes if old else 0
            if self.bytes + packed.nbytes <= self.budget:
                self._blocks[(index, class_key, block)] = packed.owned()
                self.bytes += packed.nbytes

    def forget(self, index: str | None = None) -> None:
        with self._lock:
            self._drop(lambda key: index is None or key[0] == index)

    def _drop(self, which) -> None:
        for key in [k for k in self._blocks if which(k)]:
            self.bytes -= self._blocks.pop(key).nbytes


BLOCKS = BlockCache()  # one per process: the budget is per process, not per cache


class _RunningTop:
    """The ``k`` best (score, id) seen so far: memory O(k + one batch)."""

    def __init__(self, k: int):
        self.k = k
        self.scores = np.zeros(0, np.float32)
        self.ids: list[str] = []

    def add(self, blocks: list[tuple[Packed, np.ndarray]], query: np.ndarray) -> None:
        """Score a batch of (rows, alive mask) at once: one product and one partition per
        batch, not per block (a 100k PostgreSQL lookup: 69 → 61 ms, measured back to back)."""
        if not blocks:
            return
        vecs = np.concatenate([p.vecs for p, _ in blocks])
        alive = np.concatenate([a[:p.n] for p, a in blocks])
        scores = vecs.astype(np.float32) @ query
        scores[~alive] = -np.inf
        k = min(self.k, int(alive.sum()))
        if k == 0:
            return
        ids = "".join(p.ids for p, _ in blocks)
        best = np.argpartition(-scores, k - 1)[:k]
        self.scores = np.concatenate([self.scores, scores[best]])
        self.ids += [ids[i * ID_CHARS:(i + 1) * ID_CHARS] for i in best]
        if len(self.ids) > 4 * self.k:
            self._trim()

    def _trim(self) -> None:
        order = np.argsort(-self.scores, kind="stable")[:self.k]
        self.scores = self.scores[order]
        self.ids = [self.ids[i] for i in order]

    def result(self) -> list[str]:
        self._trim()
        return self.ids


def shortlist(source: DescriptorSource, index: str, class_key: str, query: np.ndarray,
              width: int, n: int = SHORTLIST, cache: BlockCache = BLOCKS) -> tuple[list[str], int]:
    """(ids of the ``n`` best entries by compact cosine, entries of this width in class).
    ``index`` names the index for the cache (its path or URL)."""
    heads = source.heads(class_key)
    held = cache.cached(index, source.index_uid(), class_key, heads)
    # another signature layout is not comparable
    live_heads = [h for h in heads if h.width == width and h.live > 0]
    comparable = sum(h.live for h in live_heads)
    if comparable == 0:
        return [], 0
    q = compact(query) / QUANT_SCALE
    top = _RunningTop(n)
    wanted, ready = [], []
    for h in live_heads:
        packed = held.get(h.block, EMPTY)
        if packed.n == h.n:
            ready.append((packed, _alive(h)))
        else:  # not held, or rows appended since: read what is missing
            wanted.append((h.block, packed.n if packed.n < h.n else 0))
    for i in range(0, len(ready), READ_BATCH):
        top.add(ready[i:i + READ_BATCH], q)
    by_block = {h.block: h for h in live_heads}
    for i in range(0, len(wanted), READ_BATCH):
        batch = wanted[i:i + READ_BATCH]
        skips, read = dict(batch), []
        for block, ids, vecs in source.rows_after(batch):
            base = held.get(block, EMPTY) if skips[block] else EMPTY
            packed = base.extended(ids, vecs)
            read.append((packed, _alive(by_block[block])))
            cache.keep(index, class_key, block, packed, read=packed.n - base.n)
        top.add(read, q)
    return top.result(), comparable


def _alive(head: BlockHead) -> np.ndarray:
    return np.frombuffer(head.alive.encode("ascii"), np.uint8) == ord("1")
