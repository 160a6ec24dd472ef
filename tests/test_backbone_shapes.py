"""Wan 2.2 5B and HunyuanVideo 1.5: the tile grid, the signature and the sparse-attention
classification follow each model's own latent and token layout (loaded by ComfyUI's loader).

Wan 2.2 5B: 48 latent channels, a 16x VAE, patch (1, 2, 2). HunyuanVideo 1.5: 32 channels,
a 16x VAE, patch (1, 1, 1), and joint attention whose text part may carry image tokens
(``clip_vision_output``) beside the prompt's.
"""
from types import SimpleNamespace

import pytest
import torch
from conftest import Requests

from carnator_core.demo_text import DEFAULT_LATENT_SHAPES, conditioning_for
from carnator_core.signature import FEATURE_WIDTH, tile_grid_for
from carnator_core.reuse.sparse_reuse import AttentionPlan, SparseSettings

PROMPT = "a red ball rolls left across a green field"
RELATED = "a red ball rolls left across a green field slowly"
PATCHES = {"wan22_5b": (1, 2, 2), "hunyuan_video15": (1, 1, 1)}


@pytest.mark.parametrize("backbone", sorted(PATCHES))
def test_signature_and_tiles_follow_the_models_latent_and_patch(backbone, tiny_models, requests_in):
    from carnator_core import pipeline
    shape = DEFAULT_LATENT_SHAPES[backbone]
    run = requests_in.run_obj(tiny_models[backbone], backbone, PROMPT)
    assert run.token_patches == (PATCHES[backbone],)
    assert run.attention.patches == (PATCHES[backbone],)
    pr = pipeline.probe(run, None, requests_in.settings)
    sig = pr.signature
    grid = tile_grid_for(shape)
    assert sig.grid == grid and sig.xhat_tiles.shape == (shape[1], grid[0] * grid[1] * grid[2])
    # the middle block's tokens were pooled on the model's own token grid
    assert sig.feature_tiles is not None and sig.feature_tiles.shape == (FEATURE_WIDTH, sig.n_tiles)


def test_only_the_models_own_token_grid_counts_as_video():
    """With HunyuanVideo 1.5's patch (1,1,1) known, a (1,2,2)-sized sequence of its latent is
    not video (under the generic list it would be): e.g. 48 text-side tokens of a 3×8×8 latent."""
    hy15 = AttentionPlan(SparseSettings(), (3, 8, 8), patches=((1, 1, 1),))
    generic = AttentionPlan(SparseSettings(), (3, 8, 8))
    assert hy15.classify(192, 192, n_context=32) == (192, 0)
    assert hy15.classify(192 + 48, 192 + 48, n_context=48) == (192, 48)  # joint, image first
    assert hy15.classify(48, 48, n_context=20) is None
    assert generic.classify(48, 48, n_context=20) == (48, 0)
    wan5b = AttentionPlan(SparseSettings(), (3, 16, 16), patches=((1, 2, 2),))
    assert wan5b.classify(192, 192, n_context=32) == (192, 0)
    assert wan5b.classify(768, 768, n_context=32) is None  # a patch-1 grid is not the 5B's


def test_hunyuan15_image_tokens_join_the_text_part_of_joint_attention(tiny_models, tmp_path):
    """HunyuanVideo 1.5 appends image tokens (vision_in of a clip_vision_output) to the text
    tokens of its joint attention: the text length is read from the model's inputs, so the
    image part is still found and a hit runs block-sparse."""
    from carnator_core.comfy_adapter import run_request
    from carnator_core.reuse.sparse_attention import reset_sparse_call_counts, sparse_call_counts
    model, backbone = tiny_models["hunyuan_video15"], "hunyuan_video15"
    vision = SimpleNamespace(last_hidden_state=torch.randn(1, 16, 1152, generator=torch.Generator().manual_seed(3)))
    requests = Requests(tmp_path)
    requests.settings.sparse.keep_mass, requests.settings.sparse.max_density = 0.5, 1.0

    def ask(prompt):
        # as HunyuanVideo15ImageToVideo does: the same image tokens on both conditionings
        pos, neg = conditioning_for(prompt, backbone), conditioning_for("", backbone)
        for cond in (pos, neg):
            cond[0][1]["clip_vision_output"] = vision
        latent = {"samples": torch.zeros(DEFAULT_LATENT_SHAPES[backbone])}
        return run_request(model, pos, neg, latent, 7, requests.steps, 4.0, "euler", "simple",
                           requests.settings, {"folder": str(tmp_path), "capacity_bytes": 1 << 30})

    _, first = ask(PROMPT)
    assert first.outcome == "miss"
    reset_sparse_call_counts()
    requests.settings.store = False
    _, s = ask(RELATED)
    assert s.outcome == "hit", s.text()
    remaining = s.steps_total - s.reuse_step
    assert s.sparse_calls > 0 and s.sparse_calls % remaining == 0
    assert sum(sparse_call_counts().values()) == s.sparse_calls


def ti2v_latent(image_seed: int = 0) -> dict:
    """What Wan22ImageToVideoLatent makes of a start image (a fixed tensor stands in for its
    VAE encoding): the first latent frame is the image, kept by the noise mask."""
    import comfy.latent_formats
    shape = DEFAULT_LATENT_SHAPES["wan22_5b"]
    latent = torch.zeros(shape)
    latent[:, :, :1] = torch.randn(shape[:2] + (1,) + shape[3:],
                                   generator=torch.Generator().manual_seed(image_seed))
    mask = torch.ones(1, 1, *shape[2:])
    mask[:, :, :1] = 0.0
    latent = comfy.latent_formats.Wan22().process_out(latent) * mask + latent * (1.0 - mask)
    return {"samples": latent, "noise_mask": mask}


def test_wan22_5b_image_to_video_keeps_the_image_and_reuses_only_with_it(tiny_models, requests_in):
    """TI2V by a noise mask: a miss is what ComfyUI's own KSampler computes (image frame kept),
    a related prompt with the same image hits, another image finds no candidates."""
    from comfy_host import host_nodes
    nodes = host_nodes()
    from carnator_core.comfy_adapter import run_request
    model, backbone = tiny_models["wan22_5b"], "wan22_5b"
    negative = conditioning_for("", backbone)

    def ask(prompt, image_seed=0):
        return run_request(model, conditioning_for(prompt, backbone), negative, ti2v_latent(image_seed),
                           7, requests_in.steps, 4.0, "euler", "simple", requests_in.settings,
                           {"folder": requests_in.cache_folder, "capacity_bytes": 1 << 30})

    (reference,) = nodes.KSampler().sample(model, 7, requests_in.steps, 4.0, "euler", "simple",
                                           conditioning_for(PROMPT, backbone), negative, ti2v_latent())
    first, s1 = ask(PROMPT)
    assert s1.outcome == "miss"
    torch.testing.assert_close(first, reference["samples"], rtol=1e-4, atol=1e-4)
    image = ti2v_latent()["samples"][:, :, :1]
    torch.testing.assert_close(first[:, :, :1], image, rtol=1e-3, atol=1e-3)
    second, s2 = ask(RELATED)
    assert s2.outcome == "hit", s2.text()
    torch.testing.assert_close(second[:, :, :1], image, rtol=1e-3, atol=1e-3)  # still that image
    _, s3 = ask(RELATED, image_seed=1)
    assert s3.outcome == "miss" and "none for this model" in s3.lookup_message
