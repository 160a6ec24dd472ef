"""Compute only region M's tokens at the steps between a finish's full calls.

A reuse with other evidence (an edit) needs its own prediction only inside region M: outside
it, the candidate's stored trajectory guides it (``guided_finish.py``). A DiT can compute a
subset of its tokens: every block runs on M's tokens alone, and their self-attention attends
to M's fresh keys and values *plus* the outside's, kept per layer from the last full call.
Such a call costs about M's share of the tokens, not a model call.

``bench/studies/region_finish_study.py`` measured the best case of this (the whole frame computed and
only M's share kept): with 4–6 full calls it keeps the edits that a finish of every step
keeps, where the guided finish alone does not. This module is the real thing, so the study
can measure what stale outside keys and values cost.

Plain torch. The ComfyUI adapter applies these rules through its block patches and its
attention override (``comfy_adapter.ComfyRun.compute_region``); ``RegionFinish`` is the
guide a finish hands the sampler.
"""
from __future__ import annotations

import torch

from .guided_finish import GuidedFinish


def token_index(mask: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """The tokens (in a DiT's flattened frame-row-column order) that a latent mask
    (…, T, H, W) touches, for patches of ``patch`` latent cells (t, h, w)."""
    m = mask.reshape(-1, *mask.shape[-3:]).amax(0).float()[None, None]
    m = torch.nn.functional.max_pool3d(m, kernel_size=patch, stride=patch, ceil_mode=True)
    return m.flatten().nonzero().flatten()


def token_share(mask: torch.Tensor, patch: tuple[int, int, int]) -> float:
    """Share of a DiT's tokens a latent mask (…, T, H, W) touches: what computing region M
    alone costs per call, and the share the gate certifies a reuse's cell by."""
    n_tokens = 1
    for size, p in zip(mask.shape[-3:], patch):
        n_tokens *= -(-int(size) // int(p))
    return token_index(mask, patch).numel() / n_tokens


class RegionCompute:
    """One run's state: which tokens are M, the outside's keys and values per layer from the
    last full call, and that call's last block output (the outside rows a region call keeps).

    ``mode``: None (the model runs as usual), ``"record"`` (a full call; keep what a region
    call needs) or ``"region"`` (compute M's tokens only). Keys tell apart the chunks of a
    sampler step ComfyUI may run as separate calls (its cond/uncond order)."""

    def __init__(self, index: torch.Tensor, n_tokens: int):
        if index.numel() == 0 or index.numel() >= n_tokens:
            raise ValueError(f"region M must cover some but not all of the {n_tokens} tokens "
                             f"(it covers {index.numel()})")
        self.index = index.long()
        inside = torch.zeros(n_tokens, dtype=torch.bool)
        inside[self.index] = True
        self.outside = (~inside).nonzero().flatten()
        self.n_tokens = n_tokens
        self.mode: str | None = None
        self.kv: dict = {}
        self.last_out: dict = {}
        self.layer = 0
        self.expect_self = False  # a block started: its first attention is self-attention
        self.whole_call = False  # this call's input has tokens the latent does not account for
        self.region_calls = 0
        self.self_attention_extended = 0  # the test's evidence that the outside was attended

    @property
    def share(self) -> float:
        return self.index.numel() / self.n_tokens

    def begin_call(self) -> None:
        self.layer = 0

    def gather(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return t.index_select(dim, self.index.to(t.device))

    def takes(self, t) -> bool:
        """Is this block input per token (to be cut down to M's tokens)?"""
        return isinstance(t, torch.Tensor) and t.ndim >= 2 and t.shape[1] == self.n_tokens

    def self_attention(self, key, k: torch.Tensor, v: torch.Tensor, dim: int = 1):
        """A block's self-attention keys and values: kept (outside rows) on a full call,
        extended by the kept ones on a region call."""
        layer = self.layer
        self.layer += 1
        self.expect_self = False
        if self.mode == "record":
            out = self.outside.to(k.device)
            self.kv[(key, layer)] = (k.index_select(dim, out).detach(), v.index_select(dim, out).detach())
            return k, v
        kept = self.kv.get((key, layer))
        if kept is None:
            raise RuntimeError("a region call before any full call of this finish: nothing to attend outside M")
        self.self_attention_extended += 1
        return torch.cat([k, kept[0].to(k.dtype)], dim), torch.cat([v, kept[1].to(v.dtype)], dim)

    def keep_last(self, key, x: torch.Tensor) -> None:
        self.last_out[key] = x.detach()

    def scatter(self, key, x_region: torch.Tensor) -> torch.Tensor:
        """The last block's output for every token: M's computed rows, the rest from the
        last full call (the finish replaces the outside's prediction anyway)."""
        full = self.last_out[key].clone()
        full[:, self.index.to(full.device)] = x_region.to(full.dtype)
        return full


class RegionFinish:
    """A guided finish whose steps between the full calls compute region M's tokens: M takes
    the request's own prediction there, the rest the guided one."""

    def __init__(self, guided: GuidedFinish, mask: torch.Tensor):
        self.guided, self.mask = guided, mask.float()
        self.region_steps = 0

    @property
    def compute(self) -> set[int]:
        return self.guided.compute

    @property
    def predicted(self) -> int:
        """Steps whose outside the stored trajectory predicted: the region steps."""
        return self.guided.predicted

    def predict(self, step):
        return None  # every step runs the model: in full or on M's tokens

    def region_step(self, step) -> bool:
        return self.guided.can_predict(step)

    def observe(self, step, x0: torch.Tensor) -> None:
        if not self.region_step(step):
            self.guided.observe(step, x0)
            return
        outside = self.guided.predict(step)
        self.region_steps += 1
        x0.copy_(torch.lerp(outside.to(x0.device, x0.dtype), x0, self.mask.to(x0.device, x0.dtype)))


# The fill of region M that computes M's own trajectory on its tokens
# (bench/studies/region_fill_study.py): two segments of two steps, each a full call then a call on M's
# tokens alone. The first starts at the first stored snapshot after the probe (M there the
# probe's x̂0 re-noised), the second at the stored snapshot nearest the middle from there to
# k*; at each start the outside is the candidate's stored latent, so M is computed among the
# outside the hit will resume with. On the tiny world's 49 edit pairs it kept 44 within
# 30 dB at k = 14 of 20 where two coarse full steps kept 33, for about half a step more.
FILL_SEGMENT_STEPS = 2


def fill_segment_starts(probe_steps: int, k: int, snapshot_steps) -> list[int]:
    """Where the segments of a fill on M's tokens start (see above); empty when no stored
    snapshot lies after the probe and before k (the coarse fill serves there)."""
    after = sorted(s for s in snapshot_steps if probe_steps < s < k)
    if not after:
        return []
    first = after[0]
    inner = [s for s in after if s > first]
    if not inner:
        return [first]
    middle = min(inner, key=lambda s: abs(s - (first + k) / 2))
    return [first, middle]


class FillSegment:
    """The guide of one segment of that fill: its first step computes the whole frame (the
    outside's keys and values are kept), the later ones M's tokens alone. The outside's
    prediction is left as the model gives it: the fill keeps only M."""

    def __init__(self, first: int):
        self.compute, self.first = {first}, first
        self.full_calls = self.region_steps = 0

    def predict(self, step):
        return None

    def region_step(self, step) -> bool:
        return step is not None and step != self.first

    def observe(self, step, x0) -> None:
        region = self.region_step(step)
        self.region_steps += int(region)
        self.full_calls += int(not region)
