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

import inspect
import logging
import math
import os
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

import comfy.model_management
import comfy.patcher_extension
import comfy.sample
import comfy.samplers
import comfy.utils

from .cache.location import default_folder, set_default_folder
from .reuse import experts
from .keys import CompatibilityClass, digest, sigma_schedule_digest, tensor_digest, weight_digest
from .reuse.joint_order import TEXT_FIRST, OrderProbe, moved_image
from .reuse.region_compute import RegionCompute, token_index
from .signature import VIDEO_PATCHES
from .reuse.sparse_reuse import AttentionPlan, SparseSettings

log = logging.getLogger("carnator")

WRAPPER_KEY = "carnator"
_BLOCK_LISTS = ("blocks", "double_blocks", "transformer_blocks", "joint_blocks", "layers")
_base_digests: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()


# ------------------------------------------------------------------ identity of a model
def _digest_patch_value(value: Any) -> Any:
    """Digest whatever a weight patch holds (tensors, LoRA adapter objects, tuples)."""
    if isinstance(value, torch.Tensor):
        return tensor_digest(value, max_values=4096)
    if isinstance(value, (list, tuple)):
        return [_digest_patch_value(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    weights = getattr(value, "weights", None)  # comfy.weight_adapter LoRA/LoHa/... objects
    if weights is not None:
        return [type(value).__name__, _digest_patch_value(weights)]
    return type(value).__name__


def model_fingerprint(model) -> str:
    """Weights *and* applied patches: a LoRA-patched clone gets another fingerprint.

    The weights are hashed as the checkpoint holds them, not as the host happens to: the
    original where ``backup`` keeps one (merged LoRA, or a release that keeps originals there),
    wherever it is offloaded to, and in any precision that holds its values exactly
    (``keys.weight_digest``)."""
    module = model.model
    if module not in _base_digests:
        backup = getattr(model, "backup", {}) or {}
        parts = [type(module).__name__, type(module.diffusion_model).__name__]
        for name, tensor in module.diffusion_model.state_dict().items():
            t = _original_weight(backup.get("diffusion_model." + name), tensor)
            if t.is_meta:
                raise ValueError(f"{name} of {type(module).__name__} is not in memory (meta device) "
                                 "and no original is kept: load the model before sampling with it")
            parts.append((name, weight_digest(t, max_values=64)))
        _base_digests[module] = digest(parts)
    patches = [_behaviour_patches(model)]
    injected = _injections(model)
    if injected:  # only then: every fingerprint (and calibration file name) before them stays
        patches.append(["injections", injected])
    settings = _option_settings(model)
    if settings:  # likewise: only models that carry another pack's settings change
        patches.append(["settings", settings])
    for key in sorted(getattr(model, "patches", {})):
        for p in model.patches[key]:
            strength_patch, value, strength_model = p[0], p[1], p[2]
            patches.append((key, float(strength_patch), float(strength_model),
                            _digest_patch_value(value)))
    return digest(_base_digests[module], patches)[:32]


def _original_weight(kept, held: torch.Tensor) -> torch.Tensor:
    """The original a ``backup`` entry keeps (ComfyUI 0.3.x: a (weight, inplace_update)
    tuple), else the weight as held."""
    if kept is None:
        return held
    if isinstance(kept, torch.Tensor):
        return kept
    original = getattr(kept, "weight", None)
    if original is None and isinstance(kept, (tuple, list)) and kept:
        original = kept[0]
    return original if isinstance(original, torch.Tensor) else held


def _injections(model) -> list:
    """What ``ModelPatcher.injections`` add to the model's forward (ComfyUI's *bypass* LoRAs:
    adapters run beside a layer, weights untouched, so neither weights nor ``patches`` show
    them). A bypass manager's adapters and strengths are hashed like weight patches; an
    injection whose content cannot be read gets this instance's identity, so its trajectories
    are never taken for another model's (reused only while the same injection is loaded)."""
    parts = []
    for key in sorted(getattr(model, "injections", None) or {}):
        for injection in model.injections[key]:
            adapters = _injected_adapters(injection)
            if adapters is None:
                parts.append([key, f"unreadable {type(injection).__name__} {id(injection):x}"])
                continue
            parts.append([key, sorted([name, float(strength), _digest_patch_value(adapter)]
                                      for name, (adapter, strength) in adapters.items())])
    return parts


def _injected_adapters(injection) -> dict | None:
    """The ``{layer: (adapter, strength)}`` of the bypass manager an injection closes over."""
    inject = getattr(injection, "inject", None)
    holders = [getattr(inject, "__self__", None)]
    for cell in getattr(inject, "__closure__", None) or ():
        try:
            holders.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    for holder in holders:
        adapters = getattr(holder, "adapters", None)
        if isinstance(adapters, dict) and all(isinstance(v, tuple) and len(v) == 2
                                              for v in adapters.values()):
            return adapters
    return None


def _behaviour_patches(model) -> list:
    """Names of wrappers, object patches and callbacks other packs put on the model (EasyCache, ...).

    They change what the model computes without touching weights, so trajectories made with
    and without them are not interchangeable. Functions are hashed by name only; the settings
    packs keep beside them are read by ``_option_settings``.
    """
    names = []
    for wrappers in (getattr(model, "wrappers", {}),
                     model.model_options.get("transformer_options", {}).get("wrappers", {})):
        names += [f"{kind}:{key}" for kind, keyed in wrappers.items() for key in keyed
                  if key != WRAPPER_KEY]
    names = sorted(set(names))
    names += sorted(f"object:{k}" for k in getattr(model, "object_patches", {}))
    names += sorted(f"callback:{kind}:{key}" for kind, keyed in (getattr(model, "callbacks", None) or {}).items()
                    for key in keyed)
    names += sorted(k for k in ("model_function_wrapper", "sampler_cfg_function")
                    if k in model.model_options)
    return names


# transformer_options entries that are hashed elsewhere (patches, wrappers, callbacks) or
# are functions, whose identity we cannot read (attention overrides: ours and what it chains)
_STRUCTURAL_OPTIONS = frozenset({"patches", "patches_replace", "wrappers", "callbacks"})
# settings that change a log, not what the model computes
_COSMETIC_SETTINGS = frozenset({"verbose", "name"})


def _option_settings(model) -> list:
    """The settings other packs keep in ``transformer_options`` beside their wrappers:
    EasyCache's holder (``transformer_options["easycache"]``) carries its reuse threshold and
    step range, ComfyUI's ScaleROPE node its ``rope_options``; EasyCache at 0.02 and at 0.2 are
    different models to reuse between. Wrapper *names* alone told them apart from no cache,
    not from each other. Functions are left out (their identity cannot be read)."""
    opts = model.model_options.get("transformer_options", {})
    return [[key, _setting_value(opts[key])]
            for key in sorted(k for k in opts if isinstance(k, str) and k not in _STRUCTURAL_OPTIONS)
            if not callable(opts[key])]


def _setting_value(value, depth: int = 0):
    """A canonical form of a setting: dicts and lists element by element, a settings object by
    its type and public scalar attributes (EasyCache samples with a clone of its holder, so the
    one on the model keeps its settings, not run state; a log switch such as ``verbose`` is
    left out), and scalars and tensors as weight patches digest them."""
    if depth >= 3:
        return _digest_patch_value(value)
    if isinstance(value, dict):
        return [[str(k), _setting_value(v, depth + 1)] for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))
                if not callable(v)]
    if isinstance(value, (list, tuple)):
        return [_setting_value(v, depth + 1) for v in value]
    if hasattr(value, "__dict__") and not isinstance(value, torch.Tensor):
        attrs = sorted((name, v) for name, v in vars(value).items()
                       if not name.startswith("_") and name not in _COSMETIC_SETTINGS
                       and (v is None or isinstance(v, (int, float, str, bool))))
        return [type(value).__name__, [list(a) for a in attrs]]
    return _digest_patch_value(value)


def backbone_name(model) -> str:
    return type(model.model).__name__


def model_patch_size(model) -> tuple[int, int, int] | None:
    """The (t, h, w) patch the diffusion model tokenizes its latent with, when it says so
    (Wan, HunyuanVideo); None for models that keep it elsewhere (LTX-Video's patchifier)."""
    size = getattr(model.get_model_object("diffusion_model"), "patch_size", None)
    if isinstance(size, (list, tuple)) and len(size) == 3 and all(isinstance(v, int) for v in size):
        return tuple(size)
    return None


def check_expert_pair(high, low) -> None:
    """A clear error for a second model that cannot be the first one's low-noise expert."""
    hm, lm = high.model, low.model
    if type(hm) is not type(lm) or type(hm.diffusion_model) is not type(lm.diffusion_model):
        raise ValueError(f"low_noise_model is a {type(lm).__name__} model but model is a "
                         f"{type(hm).__name__}: both experts of a pair must be one architecture "
                         "(Wan 2.2 A14B: its high-noise file to model, its low-noise file to "
                         "low_noise_model)")
    hf, lf = (type(m.get_model_object("latent_format")).__name__ for m in (high, low))
    if hf != lf:
        raise ValueError(f"the experts use different latent formats ({hf} and {lf}); connect "
                         "two experts of the same release")
    hs = {k: tuple(v.shape) for k, v in hm.diffusion_model.state_dict().items()}
    ls = {k: tuple(v.shape) for k, v in lm.diffusion_model.state_dict().items()}
    if hs != ls:
        key = next(k for k in sorted(set(hs) | set(ls)) if hs.get(k) != ls.get(k))
        raise ValueError(f"expert layouts differ: {key} is {hs.get(key, 'missing')} in model and "
                         f"{ls.get(key, 'missing')} in low_noise_model; a pair must be the high- "
                         "and low-noise experts of one release (e.g. both Wan 2.2 A14B T2V)")
    if model_fingerprint(high) == model_fingerprint(low):
        raise ValueError("low_noise_model is the same model as model (same weights and patches): "
                         "connect Wan 2.2's low-noise expert, or leave low_noise_model empty to "
                         "run one model")


def cond_digest(conditioning) -> str:
    """Digest of a CONDITIONING list: tensors and the plain values beside them."""
    parts = []
    for item in conditioning or []:
        tensor, extras = item[0], item[1] if len(item) > 1 else {}
        parts.append(tensor_digest(tensor))
        for k in sorted(extras):
            v = extras[k]
            if isinstance(v, torch.Tensor):
                parts.append((k, tensor_digest(v)))
            elif isinstance(v, (int, float, str, bool)) or v is None:
                parts.append((k, v))
            else:
                parts.append((k, type(v).__name__))  # hooks, control objects: type only
    return digest(parts)


# A conditioning whose extras carry this key names how the request's latents become pictures
# (the cache's previews), where the model's own latent format would be wrong: the tiny world's
# latent is an exact pixel transform in Wan 2.1's channel layout, not Wan's VAE space. The
# model never sees the key (ComfyUI passes only the keys a model's extra_conds asks for).
LATENT_FORMAT_KEY = "carnator_latent_format"
TINYWORLD_LATENT_FORMAT = "TinyWorld"


def mark_latent_format(conditioning: list, latent_format: str) -> list:
    """The conditioning with its preview format named (see LATENT_FORMAT_KEY)."""
    return [[c[0], {**(c[1] if len(c) > 1 else {}), LATENT_FORMAT_KEY: latent_format}] for c in conditioning]


def marked_latent_format(conditioning) -> str | None:
    for item in conditioning or []:
        found = item[1].get(LATENT_FORMAT_KEY) if len(item) > 1 else None
        if found:
            return str(found)
    return None


PROMPT_TEXT_INPUTS = ("text", "prompt", "string", "value", "text_g", "text_l")


def prompt_text_of(prompt_graph: dict | None, node_id: str | None, input_name: str = "positive",
                   depth: int = 6) -> str:
    """The text behind a node's conditioning input, read from ComfyUI's prompt (the API-format
    graph the executor runs): follow ``input_name``'s link to the node that made it and take
    its text widget (CLIPTextEncode's ``text``, the pack's encoders' ``text``), through
    conditioning pass-through nodes and string primitives. "" when there is none."""
    if not isinstance(prompt_graph, dict) or node_id is None:
        return ""
    node = prompt_graph.get(str(node_id))
    link = (node or {}).get("inputs", {}).get(input_name)
    for _ in range(depth):
        if not (isinstance(link, list) and len(link) == 2):
            return ""
        inputs = (prompt_graph.get(str(link[0])) or {}).get("inputs", {})
        for name in PROMPT_TEXT_INPUTS:
            value = inputs.get(name)
            if isinstance(value, str):
                return value
        link = next((inputs[n] for n in PROMPT_TEXT_INPUTS + ("conditioning", "conditioning_to", "positive")
                     if isinstance(inputs.get(n), list)), None)
    return ""


MODEL_FILE_INPUTS = ("unet_name", "ckpt_name", "model_name")  # UNETLoader, checkpoint loaders


def model_file_names(prompt_graph: dict | None, node_id: str | None, depth: int = 12) -> list[str]:
    """The file names a person loaded for a node's model (and a Wan 2.2 pair's second
    expert), read from ComfyUI's prompt: follow ``model`` links through patch nodes (LoRA,
    EasyCache, …) to the loader. [] where none can be found."""
    names = []
    node = (prompt_graph or {}).get(str(node_id)) if isinstance(prompt_graph, dict) else None
    for input_name in ("model", "low_noise_model"):
        link = (node or {}).get("inputs", {}).get(input_name)
        for _ in range(depth):
            if not (isinstance(link, list) and len(link) == 2):
                break
            inputs = (prompt_graph.get(str(link[0])) or {}).get("inputs", {})
            found = next((inputs[k] for k in MODEL_FILE_INPUTS if isinstance(inputs.get(k), str)), None)
            if found:
                names.append(found)
                break
            link = inputs.get("model")
    return names


def _comfyui_cache_folder() -> str | None:
    """Under ComfyUI's user directory, so it survives restarts and updates of the pack."""
    try:
        import folder_paths
        return os.path.join(folder_paths.get_user_directory(), "carnator_cache")
    except Exception:  # noqa: BLE001 - outside a ComfyUI process
        return None


set_default_folder(_comfyui_cache_folder)  # the cache (a database's local files too) asks no host


def default_cache_folder() -> str:
    """CARNATOR_CACHE_DIR, else ComfyUI's user directory, else ~/.cache/carnator."""
    return str(default_folder())


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
    from .pipeline import open_cache, probe  # local: pipeline imports nothing of ComfyUI
    cache_config = cache_config or {}
    from .cache.backend import database_location
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
    from .demo_text import conditioning_for
    return conditioning_for(text, backbone_name(model))


def calibrate_model(model, clip, latent: dict, pairs: list[dict], steps: int, cfg: float,
                    sampler_name: str, scheduler: str, tolerance, cache_folder: str,
                    settings, vae=None, seed: int = 0, include_audits: bool = True,
                    node_id: str | None = None, budget_generations: float = 0.0, log=None,
                    procedure: str = "generic", transferred=None, **pair):
    """Run the generic calibration (``self_calibration``) on a ComfyUI model with ComfyUI's
    progress bar; resumable. Returns (RiskModel, report dict). ``pair``: low_noise_model,
    switch_step, switch_sigma — a Wan 2.2 A14B pair is calibrated as the one model it is.
    The model's work is metered at its last block (``attach_meter``); ``budget_generations``
    (0: none) stops measuring new pairs once that many generation-equivalents are spent.
    ``procedure`` "cheap": ``calibration.cheap`` — the ranking of ``transferred`` (a calibrated
    RiskModel), only its thresholds certified on this model."""
    from .calibration.generic import calibrate
    if procedure not in ("generic", "cheap"):
        raise ValueError(f"unknown calibration procedure {procedure!r} (generic or cheap)")
    if procedure == "cheap" and transferred is None:
        raise ValueError("the cheap calibration needs a calibrated model to transfer its ranking from")
    from .calibration.meter import ComputeMeter
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
            from .calibration import cheap
            return cheap.calibrate(make_run, pairs, settings, tolerance, cache_folder, fingerprint, steps,
                                   transferred, seed=seed, decode=frames_decoder(vae), meter=meter,
                                   budget_generations=budget_generations, log=log, on_pair=on_pair)
        return calibrate(make_run, pairs, settings, tolerance, cache_folder, fingerprint, steps,
                         seed=seed, decode=frames_decoder(vae), include_audits=include_audits,
                         on_pair=on_pair, meter=meter, budget_generations=budget_generations, log=log)
    finally:
        detach()


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
    from . import pipeline
    pr = start_request(model, positive, negative, latent, seed, steps, cfg, sampler_name,
                       scheduler, settings, cache_config, seed_policy, label, vae=vae, **pair)
    plan, found = pipeline.lookup_and_gate(pr)
    samples, summary = pipeline.reuse(pr, plan)
    summary.lookup_message = found.message
    return samples, summary
