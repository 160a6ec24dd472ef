"""The one module that knows ComfyUI's API.

Everything ComfyUI-specific lives here so that a ComfyUI release that moves an API breaks
one file: model fingerprints (ModelPatcher weights and patches), sigma schedules, running a
segment of the sampler through ``comfy.sample.sample_custom``, latent-space conversions at
segment boundaries, and the model patches that collect evidence. Patches use only public
surfaces: ``ModelPatcher.clone()``, ``patcher_extension`` wrappers and
``transformer_options["patches_replace"]["dit"]`` block patches, each chained to whatever
was there before. A Wan 2.2 A14B pair is two such clones, sampled in segments cut at the
boundary step as two chained KSamplerAdvanced nodes would (``experts.py``).
"""
from __future__ import annotations

import logging
import os
from typing import Any

import torch

import comfy.samplers

from ..reuse import experts

# what the nodes, scripts and benchmarks import from the adapter
from .identity import (TINYWORLD_LATENT_FORMAT, backbone_name, default_cache_folder, mark_latent_format,
                       model_file_names, model_fingerprint, prompt_text_of)
from .recording import attach_meter
from .run import ComfyRun

__all__ = ["ComfyRun", "SAMPLER_NAMES", "SCHEDULER_NAMES", "TINYWORLD_LATENT_FORMAT", "attach_meter",
           "audit_rate_default", "backbone_name", "calibrate_model", "default_cache_folder", "encode_text",
           "frames_decoder", "latent_rgb_factors", "mark_latent_format", "model_file_names",
           "model_fingerprint", "model_space", "notify", "prompt_text_of", "run_request", "start_request"]

log = logging.getLogger("carnator")


# ------------------------------------------------------------------ node-facing helpers
SAMPLER_NAMES = comfy.samplers.KSampler.SAMPLERS
SCHEDULER_NAMES = comfy.samplers.KSampler.SCHEDULERS


def notify(event: str, data: dict, node_id: str | None = None) -> None:
    """Send a websocket message to the page (phase changes, results); no-op headless."""
    try:
        from server import PromptServer
        instance = getattr(PromptServer, "instance", None)
        if instance is not None:
            instance.send_sync(f"carnator.{event}", {**data, "node": node_id})
    except Exception:  # noqa: BLE001 - never let UI messaging break sampling
        pass


def start_request(model, positive, negative, latent: dict, seed: int, steps: int, cfg: float,
                  sampler_name: str, scheduler: str, settings, cache_config: dict | None = None,
                  seed_policy: str = "same_seed", label: str = "", node_id: str | None = None,
                  vae=None, low_noise_model=None, switch_step: int = 0,
                  switch_sigma: float = experts.WAN22_SWITCH_SIGMA, model_names: list[str] = ()):
    """Build the run, open the cache (or explain why not) and run the Early Probe.
    ``low_noise_model``: Wan 2.2 A14B's second expert, switched to at ``switch_step`` (or,
    when 0, at the first step below ``switch_sigma``)."""
    from ..pipeline import open_cache, probe  # local: pipeline imports nothing of ComfyUI
    cache_config = cache_config or {}
    from ..cache.backend import database_location
    # the operator's database (the one the node names from the operator's list, else
    # CARNATOR_CACHE_URL) wins over the folder; a workflow never gives an address
    location = (database_location(cache_config.get("database"))
                or cache_config.get("folder") or default_cache_folder())
    capacity = int(cache_config.get("capacity_bytes") or 8 * 1024**3)
    run = ComfyRun(model, positive, negative, latent, seed, steps, cfg, sampler_name, scheduler,
                   seed_policy=seed_policy, low_noise_model=low_noise_model,
                   switch_step=switch_step, switch_sigma=switch_sigma)
    cache, message = open_cache(location, capacity)
    notify("phase", {"phase": "probe", "steps": run.steps}, node_id)
    result = probe(run, cache, settings, cache_message=message, prompt=label)
    result.decode = frames_decoder(vae)
    result.model_names = list(model_names)  # what the summary and the cache tab call the model
    return result


def audit_rate_default() -> float:
    """The audit rate a farm operator sets once for every worker (CARNATOR_AUDIT_RATE, a
    share 0..1); 0 (off) for a single user."""
    try:
        return min(1.0, max(0.0, float(os.environ.get("CARNATOR_AUDIT_RATE", "0") or 0)))
    except ValueError:
        log.warning("Carnator: CARNATOR_AUDIT_RATE=%r is not a number; audits off",
                    os.environ.get("CARNATOR_AUDIT_RATE"))
        return 0.0


def frames_decoder(vae):
    """A VAE as ``latent → frames in 0..1`` (what a tolerance on frames compares), or None."""
    if vae is None:
        return None
    return lambda latent: vae.decode(latent).float().clamp(0, 1)


def encode_text(clip, text: str, model=None):
    """CONDITIONING for ``text``: the CLIP's encoder as CLIPTextEncode does it; without a
    CLIP, the pack's demo text encoder shaped for the model's backbone (bundled demo models
    only: real models need their own text encoder)."""
    if clip is not None:
        return clip.encode_from_tokens_scheduled(clip.tokenize(text))
    from ..demo_text import conditioning_for
    return conditioning_for(text, backbone_name(model))


def calibrate_model(model, clip, latent: dict, pairs: list[dict], steps: int, cfg: float,
                    sampler_name: str, scheduler: str, tolerance, cache_folder: str,
                    settings, vae=None, seed: int = 0, include_audits: bool = True,
                    node_id: str | None = None, budget_generations: float = 0.0, log=None,
                    procedure: str = "generic", transferred=None, served_latent: dict | None = None,
                    **pair):
    """Run the generic calibration (``self_calibration``) on a ComfyUI model with ComfyUI's
    progress bar; resumable. Returns (RiskModel, report dict). ``pair``: low_noise_model,
    switch_step, switch_sigma — a Wan 2.2 A14B pair is calibrated as the one model it is.
    The model's work is metered at its last block (``attach_meter``); ``budget_generations``
    (0: none) stops measuring new pairs once that many generation-equivalents are spent.
    ``procedure`` "cheap": ``calibration.cheap`` — the ranking of ``transferred`` (a calibrated
    RiskModel), only its thresholds certified on this model. ``served_latent``: the size you
    generate when ``latent`` is a smaller proxy; the budget and the report count generations
    of that size."""
    from ..calibration.generic import calibrate
    if procedure not in ("generic", "cheap"):
        raise ValueError(f"unknown calibration procedure {procedure!r} (generic or cheap)")
    if procedure == "cheap" and transferred is None:
        raise ValueError("the cheap calibration needs a calibrated model to transfer its ranking from")
    from ..calibration.meter import ComputeMeter, ServedSize
    served = None if served_latent is None else ServedSize.of(latent_cells(latent), latent_cells(served_latent))
    negative = encode_text(clip, "", model)
    conds: dict[str, Any] = {}

    def make_run(prompt: str, pair_seed: int) -> ComfyRun:
        if prompt not in conds:
            conds[prompt] = encode_text(clip, prompt, model)
        return ComfyRun(model, conds[prompt], negative, latent, pair_seed, steps, cfg,
                        sampler_name, scheduler, progress=False, **pair)

    bar = comfy.utils.ProgressBar(len(pairs))

    def on_pair(done: int, total: int) -> None:
        bar.update_absolute(done, total)
        notify("calibration", {"done": done, "total": total}, node_id)

    fingerprint = make_run("", seed).fingerprint()  # the pair's, with its switch, for two experts
    meter = ComputeMeter()
    detach = attach_meter([model] + [m for m in [pair.get("low_noise_model")] if m is not None], meter)
    try:
        if procedure == "cheap":
            from ..calibration import cheap
            return cheap.calibrate(make_run, pairs, settings, tolerance, cache_folder, fingerprint, steps,
                                   transferred, seed=seed, decode=frames_decoder(vae), meter=meter,
                                   budget_generations=budget_generations, log=log, on_pair=on_pair,
                                   served=served)
        return calibrate(make_run, pairs, settings, tolerance, cache_folder, fingerprint, steps,
                         seed=seed, decode=frames_decoder(vae), include_audits=include_audits,
                         on_pair=on_pair, meter=meter, budget_generations=budget_generations, log=log,
                         served=served)
    finally:
        detach()


def latent_cells(latent: dict) -> tuple[int, int, int]:
    """A LATENT's size as frames × height × width in latent units (an image latent: 1 frame)."""
    shape = tuple(latent["samples"].shape)
    return (int(shape[2]), int(shape[3]), int(shape[4])) if len(shape) == 5 else (1, int(shape[2]), int(shape[3]))


def _latent_format_class(name: str):
    """ComfyUI's LatentFormat class of that name (as stored with each entry), or None."""
    import comfy.latent_formats
    cls = getattr(comfy.latent_formats, str(name or ""), None)
    if isinstance(cls, type) and issubclass(cls, comfy.latent_formats.LatentFormat):
        return cls
    return None


def model_space(latent: torch.Tensor, latent_format: str) -> torch.Tensor:
    """A stored LATENT (ComfyUI's between-nodes form) → what the model and its preview
    factors see (``process_in``), exactly as ComfyUI's own sampler previews do."""
    cls = _latent_format_class(latent_format)
    if cls is None:
        return latent
    try:
        return cls().process_in(latent)
    except Exception:  # noqa: BLE001 - a format whose constants don't fit: raw latent
        return latent


def latent_rgb_factors(latent_format: str) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """ComfyUI's latent→RGB preview factors for a latent format class name (e.g. 'Wan21').

    Returns (factors (C, 3), bias (3,) or None), or None when the format has none.
    """
    cls = _latent_format_class(latent_format)
    if cls is None:
        return None
    fmt = cls()
    factors = getattr(fmt, "latent_rgb_factors", None)
    if factors is None:
        return None
    bias = getattr(fmt, "latent_rgb_factors_bias", None)
    return torch.tensor(factors, dtype=torch.float32), (
        torch.tensor(bias, dtype=torch.float32) if bias is not None else None)


def run_request(model, positive, negative, latent: dict, seed: int, steps: int, cfg: float,
                sampler_name: str, scheduler: str, settings, cache_config: dict | None = None,
                seed_policy: str = "same_seed", label: str = "", vae=None, **pair):
    """The whole flow in one call (what CarnatorSampler does): for scripts and benchmarks.

    Returns (latent samples, Summary); the Summary also carries ``lookup_message``.
    """
    from .. import pipeline
    pr = start_request(model, positive, negative, latent, seed, steps, cfg, sampler_name,
                       scheduler, settings, cache_config, seed_policy, label, vae=vae, **pair)
    plan, found = pipeline.lookup_and_gate(pr)
    samples, summary = pipeline.reuse(pr, plan)
    summary.lookup_message = found.message
    return samples, summary
