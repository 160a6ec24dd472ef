"""One request bound to a ComfyUI model (or a Wan 2.2 A14B pair): its sigma schedule, noise,
and the sampler run in segments through ``comfy.sample.sample_custom``."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

import comfy.model_management
import comfy.patcher_extension
import comfy.sample
import comfy.samplers
import comfy.utils

from ..reuse import experts
from ..keys import CompatibilityClass, digest, sigma_schedule_digest, tensor_digest
from ..reuse.region_compute import RegionCompute, token_index
from ..signature import VIDEO_PATCHES
from ..reuse.sparse_reuse import AttentionPlan, SparseSettings

from .identity import (backbone_name, check_expert_pair, cond_digest, marked_latent_format,
                       model_fingerprint, model_patch_size)
from .recording import (_EXTRA_TOKEN_CONDS, StepRecorder, _find_block_list, _fix_empty_latent_channels,
                        _install_region_blocks, patched_for_recording)


# ------------------------------------------------------------------ one request
def schedule(model, scheduler: str, sampler_name: str, steps: int) -> torch.Tensor:
    """The sigma schedule KSampler would use (including its penultimate-sigma rule)."""
    ms = model.get_model_object("model_sampling")
    if sampler_name in comfy.samplers.KSampler.DISCARD_PENULTIMATE_SIGMA_SAMPLERS:
        s = comfy.samplers.calculate_sigmas(ms, scheduler, steps + 1)
        s = torch.cat([s[:-2], s[-1:]])
    else:
        s = comfy.samplers.calculate_sigmas(ms, scheduler, steps)
    return s.cpu().float()


StepCallback = Callable[[int, torch.Tensor, torch.Tensor], None]


@dataclass
class Expert:
    """One model of the run: its name, the model as connected, the schedule its own
    KSamplerAdvanced would use, and the recording clone that runs it."""

    name: str
    model: Any
    sigmas: torch.Tensor
    patched: Any = None
    region_patched: bool = False  # its clone carries the region blocks (compute_region)


class ComfyRun:
    """One request bound to a ComfyUI model (or a Wan 2.2 A14B pair of experts): schedule,
    noise, and segment sampling."""

    def __init__(self, model, positive, negative, latent: dict, seed: int, steps: int,
                 cfg: float, sampler_name: str, scheduler: str, seed_policy: str = "same_seed",
                 noise_pool: int = 4, progress: bool = True, low_noise_model=None,
                 switch_step: int = 0, switch_sigma: float = experts.WAN22_SWITCH_SIGMA):
        if "samples" not in latent:
            raise ValueError("LATENT input has no 'samples' tensor")
        self.model = model
        self.positive, self.negative = positive, negative
        self.steps, self.cfg = int(steps), float(cfg)
        self.sampler_name, self.scheduler = sampler_name, scheduler
        self.seed, self.seed_policy = int(seed), seed_policy
        if seed_policy == "shared_noise":
            self.noise_seed, self.noise_frame = self.seed % noise_pool, f"pool:{self.seed % noise_pool}"
        else:
            self.noise_seed, self.noise_frame = self.seed, f"seed:{self.seed}"
        self.latent_image = _fix_empty_latent_channels(model, latent)
        self.batch_index = latent.get("batch_index")
        # image-to-video by a noise mask (Wan 2.2 5B TI2V's Wan22ImageToVideoLatent): the
        # masked-out frames are the given image in every step, so only requests with the same
        # mask and image latent share work
        self.noise_mask = latent.get("noise_mask")
        if self.noise_mask is not None:
            self.noise_frame += "|image:" + digest(tensor_digest(self.noise_mask, max_values=4096),
                                                   tensor_digest(self.latent_image, max_values=4096))[:16]
        self.noise = comfy.sample.prepare_noise(self.latent_image, self.noise_seed, self.batch_index)
        self._bind_experts(low_noise_model, switch_step, switch_sigma)
        self.recorder = StepRecorder(self.sigmas)
        patch = model_patch_size(model)
        self.token_patches = (patch,) if patch else None
        self.recorder.attention = AttentionPlan(SparseSettings(), tuple(self.latent_image.shape[-3:]),
                                                patches=self.token_patches or VIDEO_PATCHES)
        for e in self.experts:
            e.patched = patched_for_recording(e.model, self.recorder,
                                              e.name if len(self.experts) > 1 else None)
        # calibration runs hundreds of these under one node: it keeps its own bar
        self.progress = comfy.utils.ProgressBar(self.steps) if progress else None

    def _bind_experts(self, low_noise_model, switch_step: int, switch_sigma: float) -> None:
        """One model runs every step; a pair splits them at ``self.boundary`` (the first
        low-noise step) and the run's schedule is each expert's own on its side."""
        high = schedule(self.model, self.scheduler, self.sampler_name, self.steps)
        if low_noise_model is None:
            self.experts, self.boundary, self.sigmas = [Expert("model", self.model, high)], self.steps, high
            return
        check_expert_pair(self.model, low_noise_model)
        low = schedule(low_noise_model, self.scheduler, self.sampler_name, self.steps)
        self.boundary = experts.boundary_step(high.tolist(), self.steps, switch_step, switch_sigma)
        self.experts = [Expert(experts.HIGH_NOISE, self.model, high),
                        Expert(experts.LOW_NOISE, low_noise_model, low)]
        self.sigmas = torch.cat([high[:self.boundary], low[self.boundary:]])

    def _expert_at(self, step: int) -> Expert:
        return self.experts[0 if step < self.boundary else -1]

    # identity
    def fingerprint(self) -> str:
        """The model's, or for a pair both experts' and where the switch falls: another
        pairing or another boundary is another model. The switch is kept as a share of the
        steps (the step count is in the class anyway), so a calibration made at 12 steps
        switching at 6 serves 30 steps switching at 15, as it would a single model."""
        if len(self.experts) == 1:
            return model_fingerprint(self.model)
        return digest("experts", [model_fingerprint(e.model) for e in self.experts],
                      round(self.boundary / self.steps, 6))[:32]

    def compatibility_class(self) -> CompatibilityClass:
        return CompatibilityClass(
            model_fingerprint=self.fingerprint(),
            latent_shape=tuple(int(s) for s in self.latent_image.shape),
            sigma_digest=sigma_schedule_digest(self.sigmas.tolist()),
            sampler=self.sampler_name, cfg=round(self.cfg, 4), noise_frame=self.noise_frame)

    def exact_key(self, klass: CompatibilityClass) -> str:
        return digest(klass.key, cond_digest(self.positive), cond_digest(self.negative),
                      tensor_digest(self.latent_image, max_values=4096))[:32]

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return tuple(self.latent_image.shape)

    @property
    def patch_size(self) -> tuple[int, int, int] | None:
        """The (t, h, w) latent cells per token (None where the model keeps it elsewhere)."""
        return model_patch_size(self.model)

    @property
    def backbone(self) -> str:
        return "+".join(backbone_name(e.model) for e in self.experts)

    @property
    def latent_format(self) -> str:
        return (marked_latent_format(self.positive)
                or type(self.model.get_model_object("latent_format")).__name__)

    @property
    def attention(self) -> AttentionPlan:
        return self.recorder.attention

    @property
    def model_calls(self) -> int:
        return self.recorder.model_calls

    @property
    def expert_calls(self) -> dict[str, int]:
        """Model calls per expert so far ({} for a single model)."""
        return {e.name: self.recorder.expert_calls.get(e.name, 0)
                for e in self.experts} if len(self.experts) > 1 else {}

    # sampling
    def sample(self, start: int, end: int, boundary_latent: torch.Tensor | None,
               on_step: StepCallback | None = None, capture_steps: set[int] = frozenset(),
               guide=None) -> torch.Tensor:
        """Run steps start..end-1; returns the latent at step ``end`` in ComfyUI's
        between-samplers form (what KSamplerAdvanced passes on).

        ``boundary_latent`` None starts from the request's own noise (step 0).
        ``on_step(step, x, x0_hat)`` sees the sampler-space x at each step and the guided
        denoised estimate computed from it. ``guide`` (a ``GuidedFinish``) replaces the model
        at the steps it predicts.
        """
        if end <= start:
            return boundary_latent if boundary_latent is not None else self.latent_image
        fresh = boundary_latent is None
        latent = self.latent_image if fresh else boundary_latent
        noise = self.noise if fresh else torch.zeros_like(latent)
        self.recorder.capture_steps = set(capture_steps)

        def callback(step, x0, x):
            if on_step is not None:
                on_step(step, x.detach(), x0.detach())
            if self.progress is not None:
                self.progress.update_absolute(step + 1, self.steps)

        self.recorder.guide = guide
        try:
            return self._sample_path(list(range(start, end + 1)), latent, noise, callback, fresh)
        finally:
            self.recorder.guide = None

    def compute_region(self, mask: torch.Tensor | None) -> RegionCompute | None:
        """From now on, model calls a ``RegionFinish`` marks compute only the tokens of this
        latent mask (None: stop). Wan-layout models only (their blocks take per-token inputs
        by the names ComfyUI's block patches pass); others raise ValueError."""
        if mask is None:
            self.recorder.region = None
            return None
        from comfy.ldm.wan.model import WanModel
        patch = model_patch_size(self.model)
        net = self.model.get_model_object("diffusion_model")
        blocks = _find_block_list(net)
        if patch is None or blocks is None or not isinstance(net, WanModel):
            raise ValueError(f"computing region M alone needs a Wan-layout model, not {self.backbone}")
        extra = sorted({key for c in list(self.positive or ()) + list(self.negative or ())
                        if isinstance(c, (list, tuple)) and len(c) > 1 and isinstance(c[1], dict)
                        for key in c[1] if key in _EXTRA_TOKEN_CONDS})
        if extra:
            raise ValueError(f"computing region M alone cannot place the extra tokens that "
                             f"{', '.join(extra)} add to the model's input")
        shape = self.latent_image.shape[-3:]
        n_tokens = math.prod(-(-s // p) for s, p in zip(shape, patch))
        self.recorder.region = RegionCompute(token_index(mask, patch), n_tokens)
        for e in self.experts:
            if not getattr(e, "region_patched", False):
                _install_region_blocks(e.patched, self.recorder, len(blocks))
                e.region_patched = True
        return self.recorder.region

    def jump(self, start: int, end: int, boundary_latent: torch.Tensor, calls: int,
             guide=None) -> torch.Tensor:
        """The request's own trajectory from step ``start`` to ``end`` in ``calls`` model steps
        through the same schedule's sigmas (coarser steps): a cheap estimate of its own latent
        at ``end``, in the form ``sample`` returns. Costs ``calls`` model steps, or less where
        ``guide`` (as in ``sample``) has some of them compute region M's tokens alone."""
        idx = torch.linspace(start, end, max(1, calls) + 1).round().long().unique()
        self.recorder.capture_steps = set()
        self.recorder.guide = guide
        try:
            return self._sample_path(idx.tolist(), boundary_latent, torch.zeros_like(boundary_latent),
                                     None, fresh=False)
        finally:
            self.recorder.guide = None

    def _sample_path(self, indices: list[int], latent: torch.Tensor, noise: torch.Tensor,
                     callback, fresh: bool) -> torch.Tensor:
        """Sample through the schedule's steps ``indices``, one ``sample_custom`` per expert
        segment: the first adds ``noise``, later ones add none and continue from the
        leftover noise, exactly as chained KSamplerAdvanced nodes do."""
        sampler = comfy.samplers.sampler_object(self.sampler_name)
        for n, (which, idx) in enumerate(experts.segments(indices, self.boundary)):
            expert = self.experts[which]
            step_cb = None if callback is None else (
                lambda i, x0, x, total, idx=idx: callback(idx[i], x0, x))
            start, seg_noise = latent, (noise if n == 0 else torch.zeros_like(latent))
            if self.noise_mask is not None and not (fresh and n == 0):
                start, seg_noise = self._resume_around_image(expert, idx[0], latent)
            latent = comfy.sample.sample_custom(
                expert.patched, seg_noise, self.cfg, sampler, expert.sigmas[idx], self.positive,
                self.negative, start, noise_mask=self.noise_mask, callback=step_cb,
                disable_pbar=True, seed=self.noise_seed)
        return latent

    def _resume_around_image(self, expert: Expert, step: int, boundary_latent: torch.Tensor):
        """(latent, noise) that make ComfyUI's sampler resume from ``boundary_latent`` at
        ``step`` under a noise mask. Its sampler takes the latent it is given as the image the
        mask keeps (KSamplerX0Inpaint), so hand it the request's own latent and express where
        the trajectory is as noise around it: noise_scaling is affine in both."""
        ms = expert.model.get_model_object("model_sampling")
        to_model = expert.model.model.process_latent_in
        sigma = expert.sigmas[step]
        zeros = torch.zeros_like(boundary_latent)
        here = ms.noise_scaling(sigma, zeros, to_model(boundary_latent))
        image = ms.noise_scaling(sigma, zeros, to_model(self.latent_image.to(boundary_latent.device)))
        unit = ms.noise_scaling(sigma, torch.ones_like(zeros), zeros)
        return self.latent_image, (here - image) / unit

    def block_tokens(self, step: int) -> torch.Tensor | None:
        """The captured tokens of ``step`` (on the model's device), handed over once."""
        return self.recorder.block_tokens.pop(step, None)

    # latent-space conversions at segment boundaries (by the expert that owns the step)
    def _model_sampling(self, step: int):
        return self._expert_at(step).model.get_model_object("model_sampling")

    def boundary_from_sampler_space(self, x: torch.Tensor, step: int) -> torch.Tensor:
        """Sampler-space x at ``step`` → the form ``sample`` accepts to resume there."""
        sigma = self.sigmas[step].to(x.device)
        latent = self._model_sampling(step).inverse_noise_scaling(sigma, x.float())
        out = self._expert_at(step).model.model.process_latent_out(latent)
        return out.to(comfy.model_management.intermediate_device())

    def renoise(self, x0_hat: torch.Tensor, step: int) -> torch.Tensor:
        """The request's own estimate x̂0 brought to sigma_step with its own noise."""
        sigma = self.sigmas[step].to(x0_hat.device)
        return self._model_sampling(step).noise_scaling(sigma, self.noise.to(x0_hat.device),
                                                        x0_hat.float(), max_denoise=False)

    def finish_progress(self) -> None:
        if self.progress is not None:
            self.progress.update_absolute(self.steps, self.steps)
