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

import pytest  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(1, str(REPO))

from request_flow import BACKBONES, Requests  # noqa: E402,F401 - shared with the benchmarks


@pytest.fixture(scope="session")
def tiny_models():
    """The bundled tiny checkpoints, loaded by ComfyUI's own loader (UNETLoader's path)."""
    import comfy.sd
    return {b: comfy.sd.load_diffusion_model(str(REPO / "models" / "tiny" / f"carnator_tiny_{b}.safetensors"))
            for b in BACKBONES}


@pytest.fixture
def requests_in(tmp_path):
    return Requests(tmp_path / "cache")
