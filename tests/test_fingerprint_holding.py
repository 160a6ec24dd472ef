"""A model's fingerprint is its checkpoint's, not how the host happens to hold the weights.

Hosts hold the same file differently: float32 on a CPU, bf16 on a GPU, partly offloaded, or
with the originals kept in ``ModelPatcher.backup`` while a changed copy runs (a merged LoRA;
newer releases keep originals there too). None of that may change the fingerprint, or the
bundled calibrations stop matching and stored entries stop being reused; two models, or one
model quantised differently on disk, must still never share one.
"""
import collections

import pytest
import torch
from conftest import REPO
from safetensors.torch import load_file, save_file

import comfy.sd
from carnator_core.comfy_adapter import model_fingerprint

TINY = REPO / "models" / "tiny"


def load(path, **model_options):
    """A fresh load each time: fingerprints are cached per loaded module."""
    return comfy.sd.load_diffusion_model(str(path), model_options=model_options)


def held_dtypes(model) -> set:
    return {t.dtype for t in model.model.diffusion_model.state_dict().values() if t.is_floating_point()}


@pytest.mark.parametrize("backbone", ["hunyuan_video", "ltxv"])
def test_the_precision_the_host_holds_weights_in_does_not_matter(backbone):
    """The bundled bf16 files: float32 as a CPU host holds them, bf16 as a GPU host does."""
    plain = load(TINY / f"carnator_tiny_{backbone}.safetensors")
    as_gpu = load(TINY / f"carnator_tiny_{backbone}.safetensors", dtype=torch.bfloat16)
    assert held_dtypes(plain) == {torch.float32} and held_dtypes(as_gpu) == {torch.bfloat16}
    assert model_fingerprint(as_gpu) == model_fingerprint(plain)


def test_offloaded_weights_give_the_same_fingerprint():
    """ComfyUI's low-VRAM load: weights stay on the offload device, cast as each layer runs."""
    path = TINY / "carnator_tiny_wan21.safetensors"
    plain = model_fingerprint(load(path))
    offloaded = load(path)
    offloaded.patch_model(device_to=offloaded.offload_device, lowvram_model_memory=1)
    try:
        assert any(getattr(m, "comfy_cast_weights", False) for m in offloaded.model.modules())
        assert model_fingerprint(offloaded) == plain
    finally:
        offloaded.unpatch_model()


def test_originals_kept_in_backup_give_the_same_fingerprint():
    """A clone whose weights were changed in place by ComfyUI, the originals kept in
    ``backup`` (and, as a release that keeps them there for its own reasons, no patch listed):
    the originals are what is hashed."""
    path = TINY / "carnator_tiny_wan21.safetensors"
    plain = load(path)
    expected = model_fingerprint(plain)
    changed = load(path).clone()
    key = "diffusion_model.blocks.0.self_attn.q.weight"
    weight = changed.model.state_dict()[key]
    changed.add_patches({key: (torch.full_like(weight, 0.5),)}, 1.0)
    changed.patch_model()
    try:
        assert key in changed.backup
        assert not torch.equal(changed.model.state_dict()[key], plain.model.state_dict()[key])
        changed.patches = {}
        assert model_fingerprint(changed) == expected
    finally:
        changed.unpatch_model()


@pytest.mark.parametrize("kept", ["tensor", "tuple"])
def test_a_backup_entry_is_read_as_a_tensor_or_a_tuple(kept):
    """ComfyUI 0.3.x keeps (weight, inplace_update); a bare tensor is read as the original too."""
    path = TINY / "carnator_tiny_wan21.safetensors"
    expected = model_fingerprint(load(path))
    model = load(path)
    key = "diffusion_model.blocks.0.ffn.0.weight"
    original = model.model.state_dict()[key].clone()
    with torch.no_grad():
        model.model.state_dict()[key].mul_(-1)
    entry = collections.namedtuple("Kept", ["weight", "inplace_update"])(original, True)
    model.backup = {key: original if kept == "tensor" else entry}
    assert model_fingerprint(model) == expected


def test_two_models_never_share_a_fingerprint(tiny_models):
    prints = {b: model_fingerprint(m) for b, m in tiny_models.items()}
    assert len(set(prints.values())) == len(prints), prints


def test_two_precisions_on_disk_never_share_a_fingerprint(tmp_path):
    """One float32 master saved as float32, bf16, fp16 and fp8: four checkpoints, four
    fingerprints; each still the same whatever precision the host loads it in."""
    master = {k: v.float() + 1e-3 * torch.randn(v.shape, generator=torch.Generator().manual_seed(i))
              for i, (k, v) in enumerate(load_file(str(TINY / "carnator_tiny_wan21.safetensors")).items())}
    prints = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        path = tmp_path / f"wan21_{str(dtype).split('.')[-1]}.safetensors"
        save_file({k: v.to(dtype) for k, v in master.items()}, str(path))
        prints[dtype] = model_fingerprint(load(path))
        if dtype is not torch.float32:  # the values fit float32 exactly: held there, same print
            assert model_fingerprint(load(path, dtype=torch.float32)) == prints[dtype]
    assert len(set(prints.values())) == 4, prints
