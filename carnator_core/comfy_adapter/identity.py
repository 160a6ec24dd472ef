"""Which model, prompt and latent a request holds, as ComfyUI hands them over: the model's
fingerprint (weights, patches, options), its backbone and patch size, the conditioning digest,
the model file names a workflow loaded, and where the cache folder is."""
from __future__ import annotations

import os
import weakref
from typing import Any

import torch


from ..cache.location import default_folder, set_default_folder
from ..keys import digest, tensor_digest, weight_digest


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
