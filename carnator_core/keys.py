"""Stable hashing for compatibility classes, exact-repeat keys and model fingerprints.

Two requests may share work only if they share the whole *compatibility class*: model
fingerprint (weights and applied patches), latent shape, the exact sigma schedule, sampler,
cfg and noise frame (DESIGN.md §2.1). Hashes are over canonical bytes so they are the same
in every process and across restarts.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, asdict
from typing import Any, Iterable

import torch


def tensor_digest(t: torch.Tensor, max_values: int = 0) -> str:
    """sha256 of a tensor's dtype, shape and values.

    With ``max_values`` > 0 only an evenly strided sample is hashed: fingerprinting a
    14B-parameter model must take milliseconds, and any real weight change (a LoRA merge, a
    fine-tune) moves far more than the sampled values.
    """
    t = t.detach()
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}".encode())
    try:
        h.update(_value_bytes(t, max_values))
    except (TypeError, RuntimeError, NotImplementedError):
        # a quantized tensor subclass whose storage is not plain values: hash what it stands for
        dequantize = getattr(t, "dequantize", None)
        if dequantize is None:
            raise
        h.update(_value_bytes(dequantize(), max_values))
    return h.hexdigest()


def weight_digest(t: torch.Tensor, max_values: int = 0) -> str:
    """A model weight's digest, whatever precision the host holds it in.

    Floating values are hashed as float32, which holds every 16- and 8-bit format exactly: a
    bf16 checkpoint held as bf16 on a GPU and as float32 on a CPU (or cast by another load
    mode) hashes the same, and float32 weights the same as ``tensor_digest`` always hashed
    them. Another precision on disk holds other values (rounded otherwise), so it differs.
    """
    t = t.detach()
    try:
        sample = _sample(t, max_values)
    except (TypeError, RuntimeError, NotImplementedError):
        dequantize = getattr(t, "dequantize", None)  # a quantized tensor subclass
        if dequantize is None:
            raise
        sample = _sample(dequantize(), max_values)
    if sample.is_floating_point() and sample.element_size() <= 4:
        sample = sample.float()
    h = hashlib.sha256(f"{sample.dtype}|{tuple(t.shape)}".encode())
    h.update(sample.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _sample(t: torch.Tensor, max_values: int) -> torch.Tensor:
    """An evenly strided sample of the values, on the CPU."""
    flat = t.reshape(-1)
    if max_values and flat.numel() > max_values:
        step = flat.numel() // max_values
        flat = flat[::step][:max_values]
    return flat.to("cpu", copy=True).contiguous()


def _value_bytes(t: torch.Tensor, max_values: int) -> bytes:
    flat = _sample(t, max_values)
    # the raw bytes, as numpy gives them for its own dtypes; float8 and bfloat16 have no numpy
    # type (an fp8 checkpoint's weights would otherwise fail the fingerprint)
    return flat.view(torch.uint8).numpy().tobytes()


def digest(*parts: Any) -> str:
    """sha256 over JSON-canonical parts (strings, numbers, lists, dicts)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def sigma_schedule_digest(sigmas: Iterable[float]) -> str:
    # rounded so the same schedule computed on another device/process hashes the same
    return digest([round(float(s), 6) for s in sigmas])


@dataclass(frozen=True)
class CompatibilityClass:
    """The hard key: only entries of the same class are ever candidates."""

    model_fingerprint: str
    latent_shape: tuple[int, ...]
    sigma_digest: str
    sampler: str
    cfg: float
    noise_frame: str  # "seed:<n>" under same_seed, "pool:<n>" under shared_noise

    @property
    def key(self) -> str:
        return digest(asdict(self))[:32]

    def describe_difference(self, other: "CompatibilityClass") -> list[str]:
        """Human-readable list of what differs, for 'no candidates' messages."""
        names = {
            "model_fingerprint": "model (weights or patches)",
            "latent_shape": "latent shape",
            "sigma_digest": "sigma schedule (steps/scheduler)",
            "sampler": "sampler",
            "cfg": "cfg",
            "noise_frame": "seed / noise frame",
        }
        mine, theirs = asdict(self), asdict(other)
        return [names[k] for k in names if mine[k] != theirs[k]]


def shape_str(shape: Iterable[int]) -> str:
    return "×".join(str(int(s)) for s in shape)
