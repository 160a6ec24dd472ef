"""Attention connectivity reused across requests, on each backbone through ComfyUI's loader.

The probe measures block connectivity through ``optimized_attention_override``; a hit runs
its remaining steps block-sparse with the candidate's stored mask. Counted, not timed.
"""
from contextlib import contextmanager

import pytest
import torch
from conftest import BACKBONES, Requests

from carnator_core.reuse.sparse_attention import reset_sparse_call_counts, sparse_call_counts

PROMPT = "a red ball rolls left across a green field"
RELATED = "a red ball rolls left across a green field slowly"


def sparse_hit(model, backbone, folder, **sparse):
    """Store the first request, then run the related one as a hit (not stored).

    The stored mask is binarised with the storing request's kept mass and minimum density,
    so each setting gets its own cache folder.
    """
    requests = Requests(folder)
    requests.settings.sparse.max_density = 1.0  # measure the kernel at every density
    for name, value in sparse.items():
        setattr(requests.settings.sparse, name, value)
    _, first = requests(model, backbone, PROMPT)
    assert first.outcome == "miss"
    requests.settings.store = False
    latent, summary = requests(model, backbone, RELATED)
    assert summary.outcome == "hit", summary.text()
    return latent, summary


@pytest.mark.parametrize("backbone", BACKBONES)
def test_hit_runs_block_sparse_with_the_stored_connectivity(backbone, tiny_models, tmp_path):
    reset_sparse_call_counts()
    _, s = sparse_hit(tiny_models[backbone], backbone, tmp_path, keep_mass=0.5, min_density=0.1)
    remaining = s.steps_total - s.reuse_step
    assert s.sparse_calls > 0 and s.sparse_calls % remaining == 0  # every layer, every step
    assert sum(sparse_call_counts().values()) == s.sparse_calls     # the kernel itself ran
    assert s.sparse_density < 1.0


@pytest.mark.parametrize("backbone", BACKBONES)
def test_full_density_equals_dense_and_error_grows_as_density_falls(backbone, tiny_models, tmp_path):
    model = tiny_models[backbone]
    dense, s0 = sparse_hit(model, backbone, tmp_path / "off", enabled=False)
    assert s0.sparse_calls == 0
    full, s1 = sparse_hit(model, backbone, tmp_path / "full", keep_mass=1.0, min_density=1.0)
    assert s1.sparse_calls > 0 and s1.sparse_density == 1.0
    torch.testing.assert_close(full, dense, rtol=1e-3, atol=1e-3)

    errors, densities = [], []
    for keep in (0.95, 0.7, 0.4, 0.1):
        out, s = sparse_hit(model, backbone, tmp_path / str(keep), keep_mass=keep, min_density=0.01)
        errors.append(float((out - dense).norm() / dense.norm()))
        densities.append(s.sparse_density)
    assert densities == sorted(densities, reverse=True) and densities[-1] < densities[0]
    # smooth: never a jump down by more than noise as density falls, and it does grow overall
    assert all(b >= a - 0.02 for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] > errors[0] or densities[-1] == densities[0], (errors, densities)
    assert errors[-1] < 1.0  # degrades, does not explode


def test_sparse_attention_chains_to_an_existing_attention_override(tiny_models, tmp_path):
    """A user's override (SageAttention, say) keeps running for everything we leave dense."""
    wan = tiny_models["wan21"].clone()
    seen = {"calls": 0}

    def users_override(func, *args, **kwargs):
        seen["calls"] += 1
        return func(*args, **kwargs)

    wan.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = users_override
    requests = Requests(tmp_path)
    requests.settings.sparse.keep_mass = 0.5
    requests.settings.sparse.max_density = 1.0
    requests(wan, "wan21", PROMPT)
    seen["calls"] = 0
    _, s = requests(wan, "wan21", RELATED)
    assert s.outcome == "hit" and s.sparse_calls > 0
    # every cross-attention call of the hit (one per layer and step) and the probe's
    # self-attention calls went through the user's override; the sparse ones did not
    remaining = s.steps_total - s.reuse_step
    layers = s.sparse_calls // remaining
    assert seen["calls"] == layers * (2 * s.steps_computed) - s.sparse_calls, (seen, s.sparse_calls)


def test_miss_can_run_sparse_with_its_own_probe_connectivity(tiny_models, requests_in):
    requests_in.settings.sparse.on_miss = True
    requests_in.settings.sparse.keep_mass = 0.5
    requests_in.settings.sparse.max_density = 1.0
    _, s = requests_in(tiny_models["ltxv"], "ltxv", PROMPT)
    assert s.outcome == "miss"
    assert s.sparse_calls > 0


def test_refresh_runs_dense_re_measurement_steps_between_sparse_ones(tiny_models, tmp_path):
    """refresh_every=2: steps k, k+2, ... run dense and re-measure; the others run sparse."""
    model = tiny_models["ltxv"]
    _, plain = sparse_hit(model, "ltxv", tmp_path / "plain", keep_mass=0.5, min_density=0.1)
    _, refreshed = sparse_hit(model, "ltxv", tmp_path / "refresh", keep_mass=0.5,
                              min_density=0.1, refresh_every=2)
    remaining = plain.steps_total - plain.reuse_step
    layers = plain.sparse_calls // remaining
    sparse_steps = sum(1 for i in range(remaining) if i % 2 != 0)
    assert refreshed.reuse_step == plain.reuse_step
    assert refreshed.sparse_calls == layers * sparse_steps < plain.sparse_calls


def test_dense_stored_connectivity_is_not_run_sparse(tiny_models, tmp_path):
    """Above max_density the kernel would not pay: the hit runs dense and says why."""
    _, s = sparse_hit(tiny_models["wan21"], "wan21", tmp_path, keep_mass=1.0, min_density=1.0,
                      max_density=0.6)
    assert s.sparse_calls == 0
    assert "sparse attention skipped" in s.reason and "100% dense" in s.reason


def test_only_video_self_attention_is_classified_for_sparse_reuse():
    """Text-only attention (HunyuanVideo's token refiner) must never be taken for video:
    32 text tokens happen to equal a (4, 8, 8)-patch grid of a 5×32×32 latent."""
    from carnator_core.reuse.sparse_reuse import AttentionPlan, SparseSettings
    plan = AttentionPlan(SparseSettings(), (5, 32, 32))
    assert plan.classify(32, 32, n_context=32) is None          # text refiner
    assert plan.classify(1280, 32, n_context=32) is None        # cross-attention
    assert plan.classify(1280, 1280, n_context=32) == (1280, 0)  # Wan / LTX self-attention
    assert plan.classify(1312, 1312, n_context=32) == (1280, 32)  # HunyuanVideo joint
    assert plan.classify(1312, 1312, n_context=32, text_first=None) is None  # order not told


def test_text_first_joint_attention_stays_dense(tiny_models, tmp_path):
    """A block that puts the text tokens first (ComfyUI's own text-then-image branch) is
    observed as such: the image-first slicing is not applied (it would mask the wrong tokens)."""
    hunyuan = tiny_models["hunyuan_video"]
    blocks = hunyuan.get_model_object("diffusion_model").double_blocks
    saved = [b.flipped_img_txt for b in blocks]
    try:
        for b in blocks:
            b.flipped_img_txt = False  # ComfyUI's own text-then-image branch of the block
        reset_sparse_call_counts()
        _, s = sparse_hit(hunyuan, "hunyuan_video", tmp_path, keep_mass=0.5, min_density=0.1)
        assert s.sparse_calls == 0 and sum(sparse_call_counts().values()) == 0
    finally:
        for b, flipped in zip(blocks, saved):
            b.flipped_img_txt = flipped


@contextmanager
def order_attribute_hidden(model):
    """HunyuanVideo's blocks as Carnator sees them on a release without ``flipped_img_txt``:
    nothing to read. ComfyUI 0.3.75's own forward still needs it, so each block answers it
    only from inside its own forward (still image-first, as ComfyUI builds HunyuanVideo)."""
    blocks = list(model.get_model_object("diffusion_model").double_blocks)
    saved = [(type(b), b.flipped_img_txt) for b in blocks]
    for b, (cls, flipped) in zip(blocks, saved):
        del b.flipped_img_txt
        b.__class__ = _hidden_order_class(cls, flipped)
    try:
        yield blocks
    finally:
        for b, (cls, flipped) in zip(blocks, saved):
            b.__class__ = cls
            b.flipped_img_txt = flipped


def _hidden_order_class(cls, flipped):
    class OrderHidden(cls):
        def forward(self, *args, **kwargs):
            self.__dict__["_inside"] = self.__dict__.get("_inside", 0) + 1
            try:
                return super().forward(*args, **kwargs)
            finally:
                self.__dict__["_inside"] -= 1

        @property
        def flipped_img_txt(self):
            if self.__dict__.get("_inside"):
                return flipped
            raise AttributeError("flipped_img_txt")

    return OrderHidden


@pytest.mark.parametrize("backbone", ["hunyuan_video", "hunyuan_video15"])
def test_hunyuan_hit_runs_sparse_with_the_order_observed_not_read(backbone, tiny_models, tmp_path):
    """The joint token order is told from what the block does: with ``flipped_img_txt``
    gone (as newer ComfyUI builds the blocks) a HunyuanVideo hit still runs block-sparse."""
    model = tiny_models[backbone]
    with order_attribute_hidden(model) as blocks:
        assert not hasattr(blocks[0], "flipped_img_txt")
        reset_sparse_call_counts()
        _, s = sparse_hit(model, backbone, tmp_path, keep_mass=0.5, min_density=0.1)
    remaining = s.steps_total - s.reuse_step
    assert s.sparse_calls > 0 and s.sparse_calls % remaining == 0
    assert sum(sparse_call_counts().values()) == s.sparse_calls  # the kernel itself ran
    assert s.sparse_density < 1.0


def test_joint_order_is_read_from_which_value_rows_move():
    from carnator_core.reuse.joint_order import IMAGE_FIRST, TEXT_FIRST, order_from_values
    img, txt = torch.randn(1, 2, 6, 4), torch.randn(1, 2, 3, 4)
    moved = -img.flip(2)
    assert order_from_values(torch.cat([img, txt], 2), torch.cat([moved, txt], 2), 2, 6, 3) == IMAGE_FIRST
    assert order_from_values(torch.cat([txt, img], 2), torch.cat([txt, moved], 2), 2, 6, 3) == TEXT_FIRST
    # rows that moved on both sides, or nowhere: not told, so nobody slices the call
    assert order_from_values(torch.cat([img, txt], 2), torch.cat([moved, -txt], 2), 2, 6, 3) is None
    assert order_from_values(torch.cat([img, txt], 2), torch.cat([img, txt], 2), 2, 6, 3) is None
