"""What a request keeps and stores stays small, and a hit's result does not change.

- The capture allocates nothing of q's or k's size: no float32 (or padded) copies of them,
  one block at a time at most (allocations recorded by torch's profiler, by size).
- Connectivity is measured only when it will be used; it round-trips exactly through its
  compact stored form (deduplicated, deflated), the first stored format still loads, and the
  block-sparse kernel's output from a reloaded mask is the one from the measured mask.
- Entries store latents in float16: a hit from them is within 45 dB PSNR of the same hit
  from float32 entries (the former format), on the three bundled backbones and on the tiny
  world; older float32 entries still load.
"""
import math

import pytest
import torch
import repo_scripts
from conftest import BACKBONES, Requests
from torch.profiler import ProfilerActivity, profile

from carnator_core.reuse.connectivity import pack_mask
from carnator_core.reuse.sparse_reuse import AttentionPlan, Connectivity, SparseSettings

PROMPT = "a red ball rolls left across a green field"
RELATED = "a red ball rolls left across a green field slowly"


def psnr(x: torch.Tensor, reference: torch.Tensor) -> float:
    err = float((x.float() - reference.float()).pow(2).mean())
    peak = float(reference.max() - reference.min())
    return math.inf if err == 0 else 10 * math.log10(peak ** 2 / err)


# ------------------------------------------------------------------ capture
def test_capture_allocates_at_most_one_block_of_q_at_a_time():
    """Largest single allocation of a capture ≤ one block of q (all heads) in float32; q
    itself in float32 would be 20× that. q arrives as ComfyUI hands it: (B, L, H*D) bf16,
    viewed per head, with joint text tokens after the image tokens."""
    B, H, D, n_img, n_txt = 2, 4, 32, 1280, 40
    q = torch.randn(B, n_img + n_txt, H * D).bfloat16()
    k = torch.randn(B, n_img + n_txt, H * D).bfloat16()
    qh, kh = (x.view(B, -1, H, D).transpose(1, 2) for x in (q, k))
    plan = AttentionPlan(SparseSettings(), (5, 32, 32))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        plan.capture(0, qh, kh, n_img, step=3)
    block = plan.block_size
    one_block_f32 = B * H * block * D * 4
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert 0 < largest <= one_block_f32, (largest, one_block_f32)
    assert one_block_f32 * 20 <= B * H * n_img * D * 4           # a real bound, not a loose one
    assert plan.masks[0].dtype == torch.uint8                    # kept packed, nothing else
    assert plan.masks[0].shape == (H, math.ceil((n_img // block) ** 2 / 8))


def test_capture_at_a_new_step_replaces_and_at_the_same_step_adds():
    torch.manual_seed(0)
    plan = AttentionPlan(SparseSettings(keep_mass=0.5, min_density=0.0), (5, 32, 32))
    qh, kh, q2 = (torch.randn(1, 2, 1280, 16) for _ in range(3))
    plan.capture(0, qh, kh, 1280, step=1)
    first = plan.measured().mask.clone()
    plan.capture(0, q2, kh, 1280, step=1)                        # e.g. uncond in its own call
    both = plan.measured().mask
    assert (both >= first).all() and both.sum() > first.sum()
    plan.capture(0, q2, kh, 1280, step=2)
    again = plan.measured().mask
    plan.reset_measurement()
    plan.capture(0, q2, kh, 1280, step=2)
    assert torch.equal(again, plan.measured().mask)              # only step 2 counts


@pytest.mark.parametrize("enabled, store, measured", [(True, False, True), (False, False, False),
                                                      (False, True, True)])
def test_connectivity_is_measured_only_when_used_or_asked_for(tiny_models, tmp_path, enabled,
                                                              store, measured):
    from carnator_core.cache.folder import TrajectoryCache
    requests = Requests(tmp_path)
    requests.settings.sparse.enabled, requests.settings.sparse.store_connectivity = enabled, store
    requests.settings.sparse.keep_mass = 0.5
    _, s = requests(tiny_models["wan21"], "wan21", PROMPT)
    stored = TrajectoryCache(tmp_path).load_tensors(s.stored_id)
    assert ("connectivity_bits" in stored) == measured
    assert "connectivity" not in stored                          # the first format is not written


# ------------------------------------------------------------------ stored connectivity
def test_connectivity_round_trips_exactly_and_shares_identical_heads():
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(3, 4, 13, 13, generator=g) < 0.3           # 169 bits: rows not byte-aligned
    mask[1, 2] = mask[0, 1]                                      # two heads alike
    mask[2] = True                                               # a fully dense layer
    conn = Connectivity.from_mask(mask, 64)
    t = conn.to_tensors()
    back = Connectivity.from_tensors(t)
    assert torch.equal(back.mask, mask) and back.block_size == 64
    assert back.density == pytest.approx(mask.float().mean().item())
    distinct = len({bytes(r) for r in conn.bits.reshape(12, -1).numpy()})
    assert distinct == 12 - 1 - 3                                # stored once each
    for layer in range(3):
        assert torch.equal(back.layer_mask(layer, "cpu"), mask[layer])


def test_first_connectivity_format_and_density_only_entries_load():
    mask = torch.rand(2, 3, 9, 9) < 0.4
    packed, shape = pack_mask(mask)
    old = {"connectivity": packed, "connectivity_shape": torch.tensor(shape),
           "connectivity_block": torch.tensor([32])}
    assert torch.equal(Connectivity.from_tensors(old).mask, mask)
    dense_only = Connectivity.from_mask(mask, 32).to_tensors(with_mask=False)
    conn = Connectivity.from_tensors(dense_only)
    assert conn.bits is None and conn.density == pytest.approx(mask.float().mean().item())
    assert Connectivity.from_tensors({}) is None


def test_reloaded_connectivity_drives_the_kernel_to_the_same_output():
    torch.manual_seed(1)
    plan = AttentionPlan(SparseSettings(keep_mass=0.5, min_density=0.1), (5, 32, 32))
    q, k, v = (torch.randn(1, 2, 1280, 16) for _ in range(3))
    plan.capture(0, q, k, 1280, step=0)
    measured = plan.measured()
    plan.connectivity = measured
    out = plan.run_sparse(0, q, k, v, 1280, 0)
    plan.connectivity = Connectivity.from_tensors(measured.to_tensors())
    assert measured.density < 0.9 and torch.equal(plan.run_sparse(0, q, k, v, 1280, 0), out)


# ------------------------------------------------------------------ latents
def test_entry_precision_round_trip_and_overflow_fallback():
    from carnator_core.cache.precision import (from_entry, latent_keys, loaded_latent,
                                               stored_latent, to_entry)
    x = torch.randn(1, 16, 3, 8, 8)
    assert to_entry(x).dtype == torch.float16 and to_entry(x, "float32").dtype == torch.float32
    assert torch.equal(to_entry(x, "float32"), x) and to_entry(x, "float32") is not x
    torch.testing.assert_close(from_entry(to_entry(x)), x, rtol=2**-11, atol=1e-7)
    big = x * 1e5                                                # beyond float16's range
    assert to_entry(big).dtype == torch.float32
    assert from_entry(to_entry(x, "bfloat16")).dtype == torch.float32
    int8 = stored_latent("snapshot.3", x, "int8")
    assert set(int8) == set(latent_keys("snapshot.3")) and int8["snapshot.3"].dtype == torch.int8
    assert int8["snapshot.3.scale"].shape == (1, 16, 3, 1, 1)   # per channel and frame
    back = loaded_latent(int8, "snapshot.3")
    assert back.dtype == torch.float32
    assert ((back - x).abs() <= int8["snapshot.3.scale"] / 2 + 1e-7).all()  # half a step
    assert torch.equal(loaded_latent({"snapshot.3": x}, "snapshot.3"), x)  # float32 entries


def _hit(model, backbone, folder, entry_dtype, **sparse):
    requests = Requests(folder)
    requests.settings.entry_dtype = entry_dtype
    for name, value in sparse.items():
        setattr(requests.settings.sparse, name, value)
    _, first = requests(model, backbone, PROMPT)
    latent, s = requests(model, backbone, RELATED)
    assert first.outcome == "miss" and s.outcome == "hit", s.text()
    return latent, s


@pytest.mark.parametrize("backbone", BACKBONES)
def test_hit_from_compact_entries_matches_the_float32_path(backbone, tiny_models, tmp_path):
    """Sparse attention engaged (kept mass 0.5, no density limit): the mask is the same for
    all, so only the stored latents' precision differs."""
    model = tiny_models[backbone]
    sparse = dict(keep_mass=0.5, max_density=1.0)
    ref, s32 = _hit(model, backbone, tmp_path / "float32", "float32", **sparse)
    for dtype in ("float16", "int8"):
        out, s = _hit(model, backbone, tmp_path / dtype, dtype, **sparse)
        assert s.reuse_step == s32.reuse_step and s.sparse_calls == s32.sparse_calls > 0
        print(f"{backbone} {dtype}: {psnr(out, ref):.1f} dB")
        assert psnr(out, ref) >= 45, (dtype, psnr(out, ref))


def test_hit_from_float16_entries_on_the_tiny_world(tmp_path):
    """The trained model, decoded to video: a synonym edit's hit against the float32 path."""
    tw = repo_scripts.load("bench/tinyworld.py", "bench_tw")
    from carnator_core.comfy_adapter import run_request
    from carnator_core.gate import GateSettings
    from carnator_core.pipeline import ReuseSettings
    world = tw.World(steps=20)
    videos = {}
    for dtype in ("float32", "float16", "int8"):
        settings = ReuseSettings(gate=GateSettings(risk_budget=0.25), entry_dtype=dtype)
        for prompt in ("a green square in the top right moves down",
                       "a green block moves down in the top right"):
            samples, s = run_request(world.model, world.cond(prompt), world.negative,
                                     world.latent(), 100000, world.steps, world.cfg, world.sampler,
                                     world.scheduler, settings,
                                     {"folder": str(tmp_path / dtype), "capacity_bytes": 1 << 30})
        assert s.outcome == "hit", s.text()
        videos[dtype] = world.video(samples)
    for dtype in ("float16", "int8"):
        print(f"tiny world {dtype}: {tw.psnr(videos[dtype], videos['float32']):.1f} dB")
        assert tw.psnr(videos[dtype], videos["float32"]) >= 45, dtype
