"""The tiny random-weight checkpoints in models/tiny/ load and sample in the real ComfyUI host.

For each backbone: ComfyUI's own loader (comfy.sd.load_diffusion_model, what UNETLoader
uses) detects the right architecture, and comfy.sample.sample (euler / simple, 4 steps,
cfg 2.0) with the demo text encoder's conditioning gives a latent of the documented shape
that depends on the prompt and is reproducible. Also checks the demo text encoder itself.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
for p in (str(TESTS_DIR), str(REPO_ROOT)):
    if p not in sys.path:
        sys.path.insert(0, p)

import comfy_host  # noqa: E402
from carnator_core.demo_text import (  # noqa: E402
    DEFAULT_LATENT_SHAPES, canonical_backbone, conditioning_for, encode_prompt)

TINY = REPO_ROOT / "models" / "tiny"
# backbone -> (file, model_config class, model_base class)
MODELS = {
    "wan21": ("carnator_tiny_wan21.safetensors", "WAN21_T2V", "WAN21"),
    "hunyuan_video": ("carnator_tiny_hunyuan_video.safetensors", "HunyuanVideo", "HunyuanVideo"),
    "ltxv": ("carnator_tiny_ltxv.safetensors", "LTXV", "LTXV"),
    "wan22_5b": ("carnator_tiny_wan22_5b.safetensors", "WAN22_T2V", "WAN22"),
    # Wan 2.2 A14B's experts are the Wan 2.1 layout: ComfyUI detects the real files so too
    "wan22_a14b_high": ("carnator_tiny_wan22_a14b_high.safetensors", "WAN21_T2V", "WAN21"),
    "wan22_a14b_low": ("carnator_tiny_wan22_a14b_low.safetensors", "WAN21_T2V", "WAN21"),
    "hunyuan_video15": ("carnator_tiny_hunyuan_video15.safetensors", "HunyuanVideo15", "HunyuanVideo15"),
}
STEPS, CFG = 4, 2.0


@pytest.fixture(scope="module")
def comfy():
    try:
        comfy_host.import_comfy()
    except FileNotFoundError as e:  # no host provisioned on this machine
        pytest.skip(str(e))
    import comfy.sd
    import comfy.sample
    return comfy


@pytest.fixture(scope="module")
def loaded(comfy):
    cache = {}

    def get(backbone):
        if backbone not in cache:
            cache[backbone] = comfy.sd.load_diffusion_model(str(TINY / MODELS[backbone][0]))
        return cache[backbone]
    return get


def _sample(comfy, patcher, backbone, prompt, negative="", seed=0):
    shape = DEFAULT_LATENT_SHAPES[canonical_backbone(backbone)]
    latent = torch.zeros(shape)
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return comfy.sample.sample(patcher, noise, STEPS, CFG, "euler", "simple",
                               conditioning_for(prompt, backbone), conditioning_for(negative, backbone),
                               latent, disable_pbar=True, seed=seed)


@pytest.mark.parametrize("backbone", sorted(MODELS))
def test_file_is_small_and_documents_its_latent(backbone):
    from safetensors import safe_open
    path = TINY / MODELS[backbone][0]
    assert path.is_file(), f"{path} missing: run scripts/make_tiny_models.py"
    assert path.stat().st_size < 8_000_000
    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()["carnator"])
    assert meta["carnator_tiny_model"] == backbone
    assert tuple(meta["test_latent"]) == DEFAULT_LATENT_SHAPES[canonical_backbone(backbone)]


@pytest.mark.parametrize("backbone", sorted(MODELS))
def test_comfyui_detects_architecture(loaded, backbone):
    patcher = loaded(backbone)
    _, config_cls, base_cls = MODELS[backbone]
    assert type(patcher.model.model_config).__name__ == config_cls
    assert type(patcher.model).__name__ == base_cls
    channels = patcher.model.latent_format.latent_channels
    assert channels == DEFAULT_LATENT_SHAPES[canonical_backbone(backbone)][1]


@pytest.mark.parametrize("backbone", sorted(MODELS))
def test_sampling_shape_prompt_dependence_and_determinism(comfy, loaded, backbone):
    patcher = loaded(backbone)
    a = _sample(comfy, patcher, backbone, "a red fox running through snow")
    b = _sample(comfy, patcher, backbone, "a blue whale in the deep ocean")
    a2 = _sample(comfy, patcher, backbone, "a red fox running through snow")
    shape = DEFAULT_LATENT_SHAPES[canonical_backbone(backbone)]
    for out in (a, b):
        assert tuple(out.shape) == shape
        assert torch.isfinite(out).all()
        assert out.std() > 0.1  # not collapsed
    assert (a - b).norm() / a.norm() > 0.05, "output does not depend on the prompt"
    assert torch.equal(a, a2), "same prompt and seed must give the same latent"


# --- the demo text encoder itself (no ComfyUI needed) ---------------------------------------

def test_encode_prompt_shapes_and_scale():
    tokens, pooled = encode_prompt("A cat sitting on a red sofa")
    assert tokens.shape == (1, 32, 4096) and tokens.dtype == torch.float32
    assert pooled.shape == (1, 768) and pooled.dtype == torch.float32
    words = tokens[0, :7]
    assert 0.8 < words.std().item() < 1.2
    assert torch.count_nonzero(tokens[0, 7:]) == 0  # zero padding to max_tokens
    t2, p2 = encode_prompt("a CAT sitting on a red sofa!")  # case and punctuation ignored
    assert torch.equal(tokens, t2) and torch.equal(pooled, p2)


def test_encode_prompt_similarity_structure():
    def cos(x, y):
        return torch.nn.functional.cosine_similarity(x.flatten(), y.flatten(), dim=0).item()
    _, p_base = encode_prompt("a cat sitting on a red sofa in the sun")
    _, p_near = encode_prompt("a cat sitting on a blue sofa in the sun")
    _, p_far = encode_prompt("stormy ocean waves crashing against cliffs")
    assert cos(p_base, p_near) > 0.75
    assert abs(cos(p_base, p_far)) < 0.3
    t_base, _ = encode_prompt("a cat sitting on a red sofa")
    t_near, _ = encode_prompt("a cat sitting on a blue sofa")
    assert cos(t_base, t_near) > 0.7


def test_empty_prompt_has_one_token():
    tokens, pooled = encode_prompt("")
    assert torch.count_nonzero(tokens[0, 0]) > 0 and torch.count_nonzero(tokens[0, 1:]) == 0
    assert torch.isfinite(pooled).all() and pooled.norm() > 0


def test_conditioning_dicts():
    wan = conditioning_for("a fox", "WAN21")
    assert len(wan) == 1 and wan[0][0].shape == (1, 32, 4096)
    assert set(wan[0][1]) == {"pooled_output"}
    hy = conditioning_for("a fox", "HunyuanVideo")[0][1]
    assert hy["pooled_output"].shape == (1, 768) and hy["guidance"] == 6.0
    assert "attention_mask" not in hy
    lt = conditioning_for("a fox", "LTXV")[0][1]
    assert lt["frame_rate"] == 25.0
    assert lt["attention_mask"].dtype == torch.int64 and lt["attention_mask"].tolist()[0][:3] == [1, 1, 0]
    assert canonical_backbone("hunyuan-video") == "hunyuan_video"
    assert canonical_backbone("WAN22") == "wan22_5b"
    assert canonical_backbone("HunyuanVideo15") == "hunyuan_video15"
    assert canonical_backbone("wan22_a14b_low") == "wan22_a14b"
    hy15 = conditioning_for("a fox", "HunyuanVideo15")
    assert hy15[0][0].shape == (1, 32, 3584) and "guidance" not in hy15[0][1]
    with pytest.raises(ValueError):
        conditioning_for("x", "sdxl")
