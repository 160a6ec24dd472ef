"""Requests through the whole Carnator flow on a real ComfyUI model, with demo conditioning.

Shared by the tests (via conftest) and the benchmark scripts; needs no pytest.
"""
import torch

BACKBONES = ("wan21", "hunyuan_video", "ltxv", "wan22_5b", "hunyuan_video15")
# Wan 2.2 A14B is a pair of models: tests/test_two_experts.py


class Requests:
    """Build and run requests through the core pipeline against a real ComfyUI model."""

    def __init__(self, cache_folder, risk_budget=0.25, steps=10, text_tokens=32):
        from carnator_core.gate import GateSettings
        from carnator_core.pipeline import ReuseSettings
        self.cache_folder = str(cache_folder)
        self.steps, self.text_tokens = steps, text_tokens
        self.settings = ReuseSettings(probe_fraction=0.1, snapshot_count=6,
                                      gate=GateSettings(risk_budget=risk_budget))

    def inputs(self, backbone, prompt, shape=None):
        from carnator_core.demo_text import DEFAULT_LATENT_SHAPES, conditioning_for
        latent = {"samples": torch.zeros(shape or DEFAULT_LATENT_SHAPES[backbone])}
        return (conditioning_for(prompt, backbone, max_tokens=self.text_tokens),
                conditioning_for("", backbone, max_tokens=self.text_tokens), latent)

    def run_obj(self, model, backbone, prompt, seed=7, shape=None, scheduler="simple", steps=None,
                **pair):
        """``pair``: low_noise_model, switch_step, switch_sigma (Wan 2.2 A14B)."""
        from carnator_core.comfy_adapter import ComfyRun
        positive, negative, latent = self.inputs(backbone, prompt, shape)
        return ComfyRun(model, positive, negative, latent, seed, steps or self.steps, 4.0,
                        "euler", scheduler, **pair)

    def __call__(self, model, backbone, prompt, cache_folder=None, seed=7, shape=None,
                 scheduler="simple", steps=None, **pair):
        from carnator_core.comfy_adapter import run_request
        positive, negative, latent = self.inputs(backbone, prompt, shape)
        return run_request(model, positive, negative, latent, seed, steps or self.steps, 4.0,
                           "euler", scheduler, self.settings,
                           {"folder": cache_folder or self.cache_folder, "capacity_bytes": 1 << 30},
                           label=prompt, **pair)
