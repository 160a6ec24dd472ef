"""Where a cache folder may live: a workflow must not make ComfyUI write anywhere it can.

A workflow is data anyone can share (or post to the server's API), and its Cache node's
``folder`` becomes directories and files. So a folder must resolve — symlinks followed —
inside one of the allowed roots: ComfyUI's user and output directories, plus any the
operator lists in ``CARNATOR_CACHE_ROOTS`` (separated like PATH) or names as the default
in ``CARNATOR_CACHE_DIR``. A relative folder is taken inside the first root.
"""
from __future__ import annotations

import os
from pathlib import Path

ROOTS_ENV = "CARNATOR_CACHE_ROOTS"
_default_folder = None  # the host's choice, registered by the ComfyUI adapter


def set_default_folder(provider) -> None:
    """The host says where this process keeps its cache by default (the ComfyUI adapter:
    ComfyUI's user directory); the cache itself never asks the host."""
    global _default_folder
    _default_folder = provider


def default_folder() -> Path:
    """This process's local cache folder: the operator's CARNATOR_CACHE_DIR, else the host's
    default (ComfyUI's user directory, when the host has one), else ~/.cache/carnator (the
    migration command and benchmarks outside ComfyUI)."""
    if os.environ.get("CARNATOR_CACHE_DIR"):
        return Path(os.environ["CARNATOR_CACHE_DIR"])
    hosted = _default_folder() if _default_folder is not None else None
    return Path(hosted) if hosted else Path("~/.cache/carnator").expanduser()


def operator_roots() -> list[str]:
    roots = [p for p in os.environ.get(ROOTS_ENV, "").split(os.pathsep) if p.strip()]
    if os.environ.get("CARNATOR_CACHE_DIR"):
        roots.append(os.environ["CARNATOR_CACHE_DIR"])
    return roots


def allowed_cache_folder(folder: str, roots: list[str]) -> str:
    """``folder`` resolved, when inside an allowed root; ValueError saying what is allowed."""
    if "\x00" in folder:
        raise ValueError("the cache folder name contains a NUL character")
    path = Path(folder).expanduser()
    if not path.is_absolute():
        path = Path(roots[0]) / path
    resolved = path.resolve()
    for root in roots:
        if resolved.is_relative_to(Path(root).expanduser().resolve()):
            return str(resolved)
    raise ValueError(
        f"cache folder {folder!r} is outside the folders Carnator may write to (ComfyUI's user "
        f"and output directories); use a folder inside them, or leave it empty for the "
        f"default. An operator can allow more folders with the {ROOTS_ENV} environment variable.")
