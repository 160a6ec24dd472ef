"""What both cache backends share: the entry row, how a new entry is prepared (checksums,
the row its tensors carry), and what a lookup returns. Neither SQLite nor PostgreSQL here.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .files import entry_checksum, hash_table, non_finite, valid_entry_id

DEFAULT_CAPACITY_BYTES = 8 * 1024**3
LOG_ROWS_KEPT = 10_000  # request and removal logs are trimmed to this many rows

ENTRY_COLUMNS = {
    "id": str, "class_key": str, "exact_key": str, "model_fingerprint": str,
    "backbone": str, "latent_shape": str, "steps": int, "seed": int, "cfg": float,
    "sampler": str, "scheduler": str, "prompt": str, "probe_step": int,
    "snapshot_steps": str, "signature": bytes, "bytes": int, "created": float,
    "last_used": float, "hits": int, "steps_saved": float, "pinned": int,
    "source_entry": str, "class_json": str, "latent_format": str, "checksum": str,
}


def row_problem(row: dict[str, Any]) -> str | None:
    """Why an index row cannot be used as it is (valid SQLite, wrong content), or None."""
    try:
        steps = json.loads(row.get("snapshot_steps") or "[]")
        if not isinstance(steps, list) or not all(type(s) is int for s in steps):
            return "snapshot_steps is not a list of step numbers"
    except (TypeError, ValueError, RecursionError):
        return "snapshot_steps is not valid JSON"
    sig = row.get("signature")
    if not isinstance(sig, bytes) or len(sig) == 0 or len(sig) % 4:
        return "signature is not a float32 vector"
    return None


def prepare_entry(row: dict[str, Any], tensors: dict[str, torch.Tensor], signature: torch.Tensor):
    """(entry id, index row, tensors to save, safetensors metadata) for a new entry, or why
    it cannot be stored. Shared by both backends: the checksums and the row the file
    carries are the same whether the bytes go to a file or to PostgreSQL."""
    entry_id = row.get("id") if valid_entry_id(row.get("id")) else uuid.uuid4().hex
    now = time.time()
    row = {**row, "id": entry_id, "created": now, "last_used": now,
           "hits": 0, "steps_saved": 0.0, "pinned": 0}
    payload = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    payload["signature"] = signature.detach().float().cpu().contiguous()
    try:  # the dtype check first: isfinite does not exist for every dtype
        hashes = hash_table(payload)
    except ValueError as e:  # a dtype this cache cannot checksum and read back
        return str(e)
    bad = non_finite(payload)
    if bad:
        return f"NaN or infinite values in {', '.join(bad)}"
    meta_json = json.dumps({k: v for k, v in row.items()
                            if k not in ("signature", "bytes", "checksum")})
    row["checksum"] = entry_checksum(entry_id, hashes, meta_json)
    row["signature"] = payload["signature"].numpy().astype(np.float32).tobytes()
    return entry_id, row, payload, {"carnator_entry": meta_json, "carnator_hashes": hashes}


@dataclass
class StoredEntry:
    """One index row, decoded."""

    row: dict[str, Any]

    @property
    def id(self) -> str:
        return self.row["id"]

    @property
    def snapshot_steps(self) -> list[int]:
        return json.loads(self.row["snapshot_steps"] or "[]")

    @property
    def source_entry(self) -> str | None:
        """The entry this one's result reused (None: computed in full, a reuse source)."""
        return self.row.get("source_entry") or None

    @property
    def signature(self) -> torch.Tensor | None:
        """The full global signature (only rows a lookup returned carry it)."""
        sig = self.row.get("signature")
        return None if sig is None else torch.from_numpy(np.frombuffer(sig, dtype=np.float32).copy())


@dataclass
class Candidate:
    entry: StoredEntry
    similarity: float


@dataclass
class LookupResult:
    candidates: list[Candidate]
    message: str  # why there are no candidates, or how many were considered
    reports: list[str] = field(default_factory=list)


def _entries(n: int) -> str:
    return f"{n} entr{'y' if n == 1 else 'ies'}"


def no_candidates(total: int, in_class: int, reused: int) -> LookupResult:
    """Why a lookup found nothing, from the cache's counts (both backends)."""
    if in_class == 0:
        return LookupResult([], "cache is empty" if total == 0 else
                            f"cache holds {_entries(total)}, none for this model, latent "
                            "shape, sigma schedule, sampler, cfg and seed")
    if reused == in_class:
        return LookupResult([], f"{_entries(in_class)} in this class, all made by reuse "
                            "(kept for exact repeats, not as reuse sources)")
    return LookupResult([], "no comparable entries (signature layout differs)")
