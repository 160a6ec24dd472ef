"""The model patches that collect a run's evidence and compute its regions: the step recorder,
the meter of model work, the joint-attention order probe, and the attention override chained
to whatever override the model already had."""
from __future__ import annotations

import inspect
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

import comfy.model_management
import comfy.patcher_extension
import comfy.sample
import comfy.samplers
import comfy.utils

from ..reuse.joint_order import TEXT_FIRST, OrderProbe, moved_image
from ..reuse.sparse_reuse import AttentionPlan

from .identity import _BLOCK_LISTS, WRAPPER_KEY, backbone_name

log = logging.getLogger("carnator")


# ------------------------------------------------------------------ evidence collection
@dataclass
class StepRecorder:
    """Per-run state shared by the block patch and the model wrapper."""

    sigmas: torch.Tensor
    capture_steps: set[int] = field(default_factory=set)
    block_tokens: dict[int, torch.Tensor] = field(default_factory=dict)
    model_calls: int = 0
    expert_calls: dict[str, int] = field(default_factory=dict)  # two-expert models, per expert
    attention: AttentionPlan | None = None  # what self-attention does at each step
    n_context: int = 0                       # text tokens of the current model call
    attention_layer: int = 0                 # self-attention calls seen in this model call
    joint_order: str | None = None           # joint_order.IMAGE_FIRST / TEXT_FIRST, None: not told
    order_probe: Any = None                  # joint_order.OrderProbe while the order is observed
    order_probed: bool = False               # observed once per run (the first block call)
    guide: Any = None                        # guided_finish.GuidedFinish of a reuse's finish
    region: Any = None                       # region_compute.RegionCompute: M's tokens only
    region_calls: int = 0                    # model calls that computed M's tokens only

    def step_of(self, sigma: torch.Tensor | None) -> int | None:
        if sigma is None:
            return None
        s = float(sigma.reshape(-1)[0])
        idx = int(torch.argmin((self.sigmas - s).abs()))
        return idx if abs(float(self.sigmas[idx]) - s) <= 1e-4 * max(1.0, abs(s)) else None


def _cond_row(tensor: torch.Tensor, transformer_options: dict) -> torch.Tensor:
    """First row of the positive-conditioning chunk of a batched (cond, uncond) call."""
    order = transformer_options.get("cond_or_uncond") or [0]
    chunk = tensor.shape[0] // max(len(order), 1)
    idx = order.index(0) if 0 in order else 0
    return tensor[idx * chunk]


def _find_block_list(diffusion_model: torch.nn.Module) -> torch.nn.ModuleList | None:
    for name in _BLOCK_LISTS:
        blocks = getattr(diffusion_model, name, None)
        if isinstance(blocks, torch.nn.ModuleList) and len(blocks) > 0:
            return blocks
    return None


def attach_meter(models, meter) -> Callable[[], None]:
    """Count the token rows entering each model's last transformer block into ``meter`` (a
    ``calibration.meter.ComputeMeter``): a forward pre-hook on the block module, which every
    clone of the model shares. It sees what bookkeeping may not: a call EasyCache skipped
    never reaches the block, a call on region M's tokens brings only those. The last block,
    not the first: the joint-order check re-runs the first block alone once per loaded model.
    ``models``: one ModelPatcher or several (a Wan 2.2 pair's experts); a module shared by
    two is hooked once. Returns the function that removes the hooks."""
    handles, seen = [], set()
    for model in models if isinstance(models, (list, tuple)) else [models]:
        blocks = _find_block_list(model.get_model_object("diffusion_model"))
        if blocks is None or id(blocks[-1]) in seen:
            continue
        seen.add(id(blocks[-1]))
        handles.append(blocks[-1].register_forward_pre_hook(
            lambda module, args, kwargs: meter.add(_token_rows(args, kwargs)), with_kwargs=True))
    meter.available = meter.available or bool(handles)

    def detach() -> None:
        for h in handles:
            h.remove()
    return detach


def _token_rows(args, kwargs) -> int:
    """batch × tokens of a block's first input (the image tokens, whatever its name)."""
    x = args[0] if args else next((v for k, v in kwargs.items() if k in ("x", "img", "hidden_states")),
                                  next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None))
    return int(x.shape[0] * x.shape[1]) if isinstance(x, torch.Tensor) and x.dim() >= 2 else 0


# inputs a joint-attention model appends to its text tokens (HunyuanVideo 1.5: ByT5 glyph
# tokens and image tokens), so the text part of a joint attention call is their sum
_TEXT_TOKEN_INPUTS = ("context", "txt_byt5", "clip_fea")


def _call_inputs(executor, args, kwargs) -> dict:
    """One diffusion-model call's inputs by name."""
    try:
        return inspect.signature(executor.original).bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError, AttributeError):
        return {"context": args[2] if len(args) > 2 else kwargs.get("context"), **kwargs}


def _text_tokens(bound: dict) -> int:
    """Text-side tokens of one diffusion-model call, read from its named inputs."""
    return sum(int(bound[k].shape[1]) for k in _TEXT_TOKEN_INPUTS
               if isinstance(bound.get(k), torch.Tensor) and bound[k].ndim == 3)


def _call_options(bound: dict) -> dict | None:
    opts = bound.get("transformer_options")
    if not isinstance(opts, dict):
        opts = (bound.get("kwargs") or {}).get("transformer_options")
    return opts if isinstance(opts, dict) else None


# models whose first block made no joint attention call: never probed again
_without_joint_attention: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def _install_order_probe(m, recorder: StepRecorder) -> None:
    """A patch on the first block that, on the run's first call, tells the order of the
    model's joint attention (image or text tokens first) by running the block once more with
    its image tokens changed (``joint_order.py``): read from what the block does, not from an
    attribute a release may drop. Costs that one block once per run of a model with joint
    attention, once per loaded model without; chains to the patch that was there before."""
    replace = m.model_options.get("transformer_options", {}).get("patches_replace", {})
    previous = replace.get("dit", {}).get(("double_block", 0))
    net = m.get_model_object("diffusion_model")

    def tell_order(args, extra):
        def run(a):
            return previous(a, extra) if previous is not None else extra["original_block"](a)

        img, txt = args.get("img"), args.get("txt")
        plan = recorder.attention
        if (recorder.order_probed or net in _without_joint_attention
                or recorder.region is not None or plan is None
                or not plan.settings.measuring or not all(isinstance(t, torch.Tensor) and t.ndim == 3
                                                          for t in (img, txt))):
            return run(args)
        recorder.order_probed = True
        probe = OrderProbe(int(img.shape[1]), int(txt.shape[1]))
        recorder.order_probe = probe
        try:
            # the block updates its inputs in place: the extra call gets copies
            moved = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
            moved["img"] = moved_image(img)
            run(moved)
            probe.phase = "sampled"
            out = run(args)
            if probe.moved_values is None and not probe.seen_joint:
                _without_joint_attention.add(net)  # its blocks attend image and text apart
            return out
        finally:
            recorder.order_probe = None
            recorder.joint_order = probe.order
            if probe.seen_joint and probe.order is None:
                log.info("Carnator: the order of %s's joint attention could not be told; "
                         "its joint calls run dense", backbone_name(m))

    m.set_model_patch_replace(tell_order, "dit", "double_block", 0)


# ComfyUI 0.38's Model Sparse Attention node (comfy_extras/nodes_sparse_attention.py) puts its
# override on the hook when applied and again from an ON_PREPARE_STATE callback under this key
# before every step's model calls, on top of whatever is there unless that is one of its own
# (install_override). The one it put there when applied is complete (same options, same state),
# so Carnator keeps its own on top for every model call and chains to that one.
_REINSTALLING_OVERRIDES = {"block_sparse_attention": "ComfyUI's Model Sparse Attention"}
_OVERRIDE = "optimized_attention_override"


def _reinstalling_node(model) -> str | None:
    for keyed in (getattr(model, "callbacks", None) or {}).values():
        for key in keyed:
            if key in _REINSTALLING_OVERRIDES:
                return _REINSTALLING_OVERRIDES[key]
    return None


def _function_name(fn) -> str:
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    module = getattr(fn, "__module__", None)
    return f"{module}.{name}" if module else name


# how ComfyUI names the block lists' kinds in transformer_options["block_type"]
_BLOCK_KINDS = tuple((name, "double") for name in _BLOCK_LISTS) + (("single_blocks", "single"),)


@dataclass
class LayerAttention:
    """A checkpoint's own attention per layer. ComfyUI 0.38 gives each attention layer a
    ``comfy_attention`` module (ComfyAttention) whose ``function`` the checkpoint sets (its
    ``<layer>.comfy_attention.config``: ``comfy_kitchen_int8``) and passes it as
    ``preferred_attention``; its ``wrap_attn`` drops that whenever an attention override is on
    the hook, so the override must call it itself. Looked up by the call's ``block_type`` and
    ``block_index``; a block whose layers choose differently is not guessed (``mixed``)."""

    by_block: dict = field(default_factory=dict)
    everywhere: Callable | None = None
    mixed: int = 0

    @classmethod
    def of(cls, net: torch.nn.Module) -> "LayerAttention":
        found = cls()
        seen: set = set()
        for list_name, kind in _BLOCK_KINDS:
            blocks = getattr(net, list_name, None)
            if not isinstance(blocks, torch.nn.ModuleList) or id(blocks) in seen:
                continue
            seen.add(id(blocks))
            for i, block in enumerate(blocks):
                chosen = {getattr(m.comfy_attention, "function", None) for m in block.modules()
                          if isinstance(getattr(m, "comfy_attention", None), torch.nn.Module)}
                if len(chosen) == 1 and None not in chosen:
                    found.by_block[(kind, i)] = chosen.pop()
                elif len(chosen) > 1:
                    found.mixed += 1
        fns = set(found.by_block.values())
        if len(fns) == 1 and not found.mixed:
            found.everywhere = next(iter(fns))
        return found

    @property
    def name(self) -> str | None:
        fns = sorted({getattr(f, "__name__", "?") for f in self.by_block.values()})
        return f"the checkpoint's per-layer attention ({', '.join(fns)})" if fns else None

    def choice(self, opts: dict | None) -> Callable | None:
        if not self.by_block:
            return None
        index = (opts or {}).get("block_index")
        if index is None:
            return self.everywhere
        return self.by_block.get(((opts or {}).get("block_type") or "double", index))


def patched_for_recording(model, recorder: StepRecorder, expert: str | None = None):
    """A clone that records model calls (per ``expert`` too, when it is one of a pair) and
    one block's tokens at the capture steps."""
    m = model.clone()
    ours = install_attention_override(m, recorder)

    def count_calls(executor, *args, **kwargs):
        region = recorder.region
        if region is not None and region.mode == "region":
            recorder.region_calls += 1
            region.region_calls += 1
        else:
            recorder.model_calls += 1
        if expert is not None:
            recorder.expert_calls[expert] = recorder.expert_calls.get(expert, 0) + 1
        recorder.attention_layer = 0
        bound = _call_inputs(executor, args, kwargs)
        recorder.n_context = _text_tokens(bound)
        opts = _call_options(bound)
        if opts is not None and opts.get(_OVERRIDE) not in (None, ours):
            # a node re-installed its override on top of ours before this step (ComfyUI 0.38's
            # sparse node does, every step): ours goes back on top for this call and chains to
            # the override that was there when ours was installed
            opts[_OVERRIDE] = ours
        return executor(*args, **kwargs)

    m.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY,
                           count_calls)

    def guided_prediction(executor, x, timestep, model_options={}, seed=None):  # noqa: B006 - ComfyUI's signature
        # the guided (CFG-combined) x̂0 of one sampler evaluation: predicted from the stored
        # trajectory at the steps a guided finish skips, computed (and observed) at the others
        guide, step = recorder.guide, recorder.step_of(timestep)
        if guide is not None:
            predicted = guide.predict(step)
            if predicted is not None:
                return predicted.to(device=x.device, dtype=x.dtype)
        region = recorder.region
        if region is not None:  # a region finish: M's tokens only between its full calls
            wants = getattr(guide, "region_step", None)
            region.mode = "region" if wants is not None and wants(step) else "record"
        try:
            out = executor(x, timestep, model_options, seed)
        finally:
            if region is not None:
                region.mode = None
        if guide is not None:
            guide.observe(step, out)
        return out

    m.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.PREDICT_NOISE, WRAPPER_KEY,
                           guided_prediction)
    blocks = _find_block_list(m.get_model_object("diffusion_model"))
    if blocks is None:
        log.info("Carnator: no known block list on %s; signature uses x̂0 only", backbone_name(m))
        return m
    index = len(blocks) // 2
    replace = m.model_options.get("transformer_options", {}).get("patches_replace", {})
    previous = replace.get("dit", {}).get(("double_block", index))

    def record_block(args, extra):
        # chain: another pack's patch on this block keeps working
        out = previous(args, extra) if previous is not None else extra["original_block"](args)
        opts = args.get("transformer_options", {})
        step = recorder.step_of(opts.get("sigmas"))
        if step in recorder.capture_steps and isinstance(out.get("img"), torch.Tensor):
            # kept on the model's device in its dtype until the step callback pools it to
            # tiles: a float32 CPU copy is 1.5 GB a step at Wan 14B 720p
            recorder.block_tokens[step] = _cond_row(out["img"], opts).detach().clone()
        return out

    m.set_model_patch_replace(record_block, "dit", "double_block", index)
    _install_order_probe(m, recorder)
    return m


# conditioning that makes Wan append or prepend tokens of its own (a reference image; newer
# releases' in-context latents): region calls index the latent's tokens only
_EXTRA_TOKEN_CONDS = ("reference_latents", "context_latents")


def _install_region_blocks(m, recorder: StepRecorder, n_blocks: int) -> None:
    """Block patches that, on a region call, run every block on region M's tokens alone
    (the first cuts the sequence down, the last puts it back) and otherwise pass through;
    each chains to the patch that was on its block before (ours, or another pack's)."""
    replace = m.model_options.get("transformer_options", {}).get("patches_replace", {}).get("dit", {})
    for i in range(n_blocks):
        previous = replace.get(("double_block", i))

        def region_block(args, extra, previous=previous, first=(i == 0), last=(i == n_blocks - 1)):
            def run(a):
                return previous(a, extra) if previous is not None else extra["original_block"](a)

            region = recorder.region
            if region is None or region.mode is None:
                return run(args)
            if first:
                # tokens the latent does not account for (another pack's extra inputs): the
                # region cannot be placed among them, so this call is computed whole
                region.whole_call = args["img"].shape[1] != region.n_tokens
            if region.whole_call:
                return run(args)
            chunk = tuple(args.get("transformer_options", {}).get("cond_or_uncond") or ())
            if first:
                region.begin_call()
            region.expect_self = True
            if region.mode == "record":
                out = run(args)
                if last:
                    region.keep_last(chunk, out["img"])
                return out
            cut = {name: (region.gather(t) if region.takes(t) else t) for name, t in args.items()
                   if name in ("img", "pe", "vec")}
            out = dict(run({**args, **cut}))
            if last:
                out["img"] = region.scatter(chunk, out["img"])
            return out

        m.set_model_patch_replace(region_block, "dit", "double_block", i)


# newer ComfyUI also resizes an empty latent by its downscale ratios, as KSampler passes them
_FIX_LATENT_KEYS = [k for k in ("downscale_ratio_spacial", "downscale_ratio_temporal")
                    if k in inspect.signature(comfy.sample.fix_empty_latent_channels).parameters]


def _fix_empty_latent_channels(model, latent: dict) -> torch.Tensor:
    """As KSampler does."""
    extra = {k: latent[k] for k in _FIX_LATENT_KEYS if k in latent}
    return comfy.sample.fix_empty_latent_channels(model, latent["samples"], **extra)


def install_attention_override(m, recorder: StepRecorder) -> Callable:
    """Route self-attention through the run's AttentionPlan; everything else, and every
    dense call, goes to the override that was already there (a user's SageAttention, ComfyUI's
    Model Sparse Attention, ...) with the checkpoint's own per-layer attention as its function,
    else to that per-layer attention or ComfyUI's own attention function: chained, never
    replaced. Records what it chains to on the plan, for the request's summary."""
    opts = m.model_options.setdefault("transformer_options", {})
    previous = opts.get(_OVERRIDE)
    layers = LayerAttention.of(m.get_model_object("diffusion_model"))
    others = [n for n in (_reinstalling_node(m) or (previous is not None and
                                                   f"the attention override {_function_name(previous)}"),
                          layers.name) if n]
    chained = ", then ".join(others) or None
    if recorder.attention is not None and chained:
        recorder.attention.chained_to = chained
    if layers.mixed:
        log.info("Carnator: %d blocks of %s choose their attention layer by layer differently; "
                 "they run ComfyUI's attention function where Carnator leaves them dense",
                 layers.mixed, backbone_name(m))

    def override(func, *args, **kwargs):
        func = layers.choice(kwargs.get("transformer_options")) or func

        def handed_on(*call_args):
            if chained and recorder.attention is not None:
                recorder.attention.chained_calls += 1
            return (previous(func, *call_args, **kwargs) if previous is not None
                    else func(*call_args, **kwargs))

        def dense():
            return handed_on(*args)

        region = recorder.region
        if region is not None and region.mode and region.expect_self and len(args) >= 3:
            # a block's self-attention under a region finish (region_compute.py)
            q, k, v = args[:3]
            dim = 2 if kwargs.get("skip_reshape", False) else 1
            chunk = tuple(kwargs.get("transformer_options", {}).get("cond_or_uncond") or ())
            k, v = region.self_attention(chunk, k, v, dim)
            if region.mode == "region":
                return handed_on(*((q, k, v) + tuple(args[3:])))

        probe = recorder.order_probe
        if probe is not None and len(args) >= 3:
            split = kwargs.get("skip_reshape", False)
            seq = 2 if split else 1
            if probe.is_joint(args[0].shape[seq], args[1].shape[seq]):
                probe.observe(args[2], seq)
                recorder.joint_order = probe.order
            if probe.phase == "moved":
                return dense()  # the extra call that tells the order: counted nowhere

        plan = recorder.attention
        heads = args[3] if len(args) > 3 else kwargs.get("heads")  # Wan passes heads= by name
        if (plan is None or len(args) < 3 or heads is None or kwargs.get("mask") is not None
                or kwargs.get("scale") is not None or kwargs.get("enable_gqa")):
            return dense()  # masks, custom scales and grouped heads: only the dense path knows them
        q, k, v = args[:3]
        split = kwargs.get("skip_reshape", False)
        q_len, k_len = (q.shape[2], k.shape[2]) if split else (q.shape[1], k.shape[1])
        order = recorder.joint_order
        kind = plan.classify(q_len, k_len, recorder.n_context,
                             None if order is None else order == TEXT_FIRST)
        if kind is None:
            return dense()
        layer = recorder.attention_layer
        recorder.attention_layer += 1
        step = recorder.step_of(kwargs.get("transformer_options", {}).get("sigmas"))
        mode = plan.mode(step)
        if mode == "dense":
            return dense()
        b = q.shape[0]
        qh, kh, vh = (q, k, v) if split else (
            t.view(b, -1, heads, t.shape[-1] // heads).transpose(1, 2) for t in (q, k, v))
        if mode == "capture":
            plan.capture(layer, qh, kh, kind[0], step)
            return dense()
        out = plan.run_sparse(layer, qh, kh, vh, *kind)
        if out is None:
            plan.dense_calls += 1
            return dense()
        if kwargs.get("skip_output_reshape", False):
            return out
        return out.transpose(1, 2).reshape(b, -1, heads * out.shape[-1])

    opts[_OVERRIDE] = override
    return override
