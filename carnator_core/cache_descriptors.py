"""Ranking a class's entries without reading their signatures: compact descriptors.

A stored signature's global vector is 10–50 KB (x̂0 and feature tiles). Reading every one of
them per lookup made lookup linear in the cache size (issue 14). Instead each entry also
keeps a *compact descriptor*: the unit global vector through a fixed seeded random
projection to ``COMPACT_DIM`` floats (Johnson–Lindenstrauss: cosines survive up to about
1/√COMPACT_DIM). Lookup ranks every entry of the class by that, then re-ranks the best
``shortlist`` by the exact cosine of their full signatures, so what the gate receives is
ranked exactly as before (bench/lookup_scale.py measures the recall against exhaustive
ranking).

The descriptors live in memory per process (``DescriptorIndex``), refreshed incrementally
from the index: rows added since the last refresh (``seq`` grows with every insert) and
rows removed since then (the ``gone`` log the index keeps). A changed ``index_uid`` (the
index was rebuilt) or a trimmed ``gone`` log means a full reload.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

COMPACT_DIM = 128
SHORTLIST = 64  # entries re-ranked by their full signature


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


def compact_bytes(vector: np.ndarray) -> bytes:
    return compact(vector).tobytes()


@dataclass
class _ClassMatrix:
    uid: str = ""
    seq: int = 0          # highest descriptor seq seen
    gone_seq: int = 0     # highest gone-log seq seen
    ids: list[str] = field(default_factory=list)
    rows: dict[str, int] = field(default_factory=dict)
    widths: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    matrix: np.ndarray = field(default_factory=lambda: np.zeros((0, COMPACT_DIM), np.float32))

    def add(self, entry_id: str, vec: np.ndarray, width: int) -> None:
        if entry_id in self.rows:
            self.matrix[self.rows[entry_id]] = vec
            return
        n = len(self.ids)
        if n == self.matrix.shape[0]:  # grow by doubling: amortised O(1) per insert
            grown = np.zeros((max(64, 2 * n), COMPACT_DIM), np.float32)
            grown[:n] = self.matrix[:n]
            self.matrix = grown
            w = np.zeros(grown.shape[0], np.int32)
            w[:n] = self.widths[:n]
            self.widths = w
        self.matrix[n], self.widths[n] = vec, width
        self.ids.append(entry_id)
        self.rows[entry_id] = n

    def remove(self, entry_id: str) -> None:
        i = self.rows.pop(entry_id, None)
        if i is None:
            return
        last = len(self.ids) - 1
        if i != last:  # move the last row into the hole
            moved = self.ids[last]
            self.ids[i], self.matrix[i], self.widths[i] = moved, self.matrix[last], self.widths[last]
            self.rows[moved] = i
        self.ids.pop()


class DescriptorSource:
    """What a backend's index provides to keep a ``DescriptorIndex`` current."""

    def index_uid(self) -> str: ...
    def descriptors_after(self, class_key: str, seq: int) -> Iterable[tuple[int, str, bytes, int]]: ...
    def gone_after(self, seq: int) -> tuple[list[tuple[int, str]], int]:
        """(removed (seq, id) after ``seq``, lowest seq still logged or 0)."""
        ...
    def gone_tail(self) -> int:
        """Highest seq in the removal log (0 when empty)."""
        ...


class DescriptorIndex:
    """In-memory descriptor matrices per class, shared by every request of a process."""

    def __init__(self) -> None:
        self._classes: dict[str, _ClassMatrix] = {}
        self._lock = threading.Lock()
        self.rows_read = 0  # descriptor rows fetched from the index (tests: incremental)

    def refresh(self, source: DescriptorSource, class_key: str) -> _ClassMatrix:
        with self._lock:
            m = self._classes.get(class_key)
            uid = source.index_uid()
            if m is not None and m.uid == uid:
                gone, lowest = source.gone_after(m.gone_seq)
                if lowest > m.gone_seq + 1:  # the log was trimmed past what we saw: reload
                    m = None
                else:
                    for seq, entry_id in gone:
                        m.remove(entry_id)
                        m.gone_seq = max(m.gone_seq, seq)
            if m is None or m.uid != uid:
                # the log's tail first: a removal after it is applied by the next refresh
                m = self._classes[class_key] = _ClassMatrix(uid=uid, gone_seq=source.gone_tail())
            for seq, entry_id, blob, width in source.descriptors_after(class_key, m.seq):
                self.rows_read += 1
                vec = np.frombuffer(blob, dtype=np.float32)
                if vec.size == COMPACT_DIM:
                    m.add(entry_id, vec, width)
                m.seq = max(m.seq, seq)
            return m

    def shortlist(self, source: DescriptorSource, class_key: str, query: np.ndarray,
                  width: int, n: int = SHORTLIST) -> tuple[list[str], int]:
        """(ids of the ``n`` best entries by compact cosine, entries of this width in class)."""
        m = self.refresh(source, class_key)
        with self._lock:
            count = len(m.ids)
            if count == 0:
                return [], 0
            same = m.widths[:count] == width  # another signature layout is not comparable
            scores = m.matrix[:count] @ compact(query)
            scores[~same] = -np.inf
            comparable = int(same.sum())
            k = min(n, comparable)
            if k == 0:
                return [], 0
            top = np.argpartition(-scores, k - 1)[:k]
            top = top[np.argsort(-scores[top])]
            return [m.ids[i] for i in top], comparable

    def forget(self, class_key: str | None = None) -> None:
        with self._lock:
            if class_key is None:
                self._classes.clear()
            else:
                self._classes.pop(class_key, None)

