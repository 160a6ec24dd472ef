"""The repo's scripts and benchmarks are files, not packages: tests load them by path."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load(relpath: str, name: str):
    """``REPO/relpath`` as module ``name``, loaded once per session. Registered in
    ``sys.modules`` before it runs: its dataclasses look their own module up there."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / relpath)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
