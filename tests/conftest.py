"""Shared pytest set-up: make the real ComfyUI host importable (CPU) before collection.

Needed because the repository root is itself a package (the custom node pack's
``__init__.py`` imports ``comfy_api``): pytest imports it while setting up the tests, so
ComfyUI must already be on sys.path. See tests/comfy_host.py for where the host is found.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from comfy_host import import_comfy  # noqa: E402

import_comfy()
