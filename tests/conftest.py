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

BACKBONES = ("wan21", "hunyuan_video", "ltxv")


@pytest.fixture(scope="session")
def tiny_models():
    """The bundled tiny checkpoints, loaded by ComfyUI's own loader (UNETLoader's path)."""
    import comfy.sd
    return {b: comfy.sd.load_diffusion_model(str(REPO / "models" / "tiny" / f"carnator_tiny_{b}.safetensors"))
            for b in BACKBONES}


class Requests:
    """Build and run requests through the core pipeline against a real ComfyUI model."""

    def __init__(self, cache_folder, risk_budget=0.25, steps=10):
        from carnator_core.gate import GateSettings
        from carnator_core.pipeline import ReuseSettings
        self.cache_folder = str(cache_folder)
        self.steps = steps
        self.settings = ReuseSettings(probe_fraction=0.1, snapshot_count=6,
                                      gate=GateSettings(risk_budget=risk_budget))

    def run_obj(self, model, backbone, prompt, seed=7, shape=None, scheduler="simple", steps=None):
        from carnator_core.comfy_adapter import ComfyRun
        from carnator_core.demo_text import DEFAULT_LATENT_SHAPES, conditioning_for
        latent = {"samples": torch.zeros(shape or DEFAULT_LATENT_SHAPES[backbone])}
        return ComfyRun(model, conditioning_for(prompt, backbone), conditioning_for("", backbone),
                        latent, seed, steps or self.steps, 4.0, "euler", scheduler)

    def __call__(self, model, backbone, prompt, cache_folder=None, **kw):
        from carnator_core import pipeline
        from carnator_core.gate import risk_model_for
        run = self.run_obj(model, backbone, prompt, **kw)
        cache, message = pipeline.open_cache(cache_folder or self.cache_folder, 1 << 30)
        pr = pipeline.probe(run, cache, self.settings, cache_message=message, prompt=prompt)
        found = pipeline.lookup(pr)
        plan = pipeline.Plan(False, reason=message or "")
        if cache is not None:
            plan, _ = pipeline.gate(pr, found, risk_model_for(cache.folder, pr.klass.model_fingerprint))
        latent, summary = pipeline.reuse(pr, plan)
        summary.lookup_message = found.message
        return latent, summary


@pytest.fixture
def requests_in(tmp_path):
    return Requests(tmp_path / "cache")
