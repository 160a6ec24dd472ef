"""The tiny world at several sizes (frames x pixels): deterministic renders, the default size
unchanged bit for bit, the checker right on ground truth at every size, and one training step
of the tiny model at two sizes."""
import hashlib
import importlib.util
import os
import random
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tinyworld import checker as CH  # noqa: E402
from tinyworld import latent as LAT  # noqa: E402
from tinyworld import world as WD  # noqa: E402

# sha256 of the renders below, made by the world before it had sizes (4 frames, 32 px)
DEFAULT_RENDERS_SHA256 = "2a85035ffa38261906f23ee06c3cf0b572a765cf26fc1f41b5a9fa457405faa4"


def _default_renders_digest(**size):
    h = hashlib.sha256()
    rng = random.Random(7)
    for i in range(40):
        sc = WD.random_scene(rng)
        v, m = WD.render(sc, i * 7919 + 3, **size)
        h.update(v.numpy().tobytes())
        h.update(m.numpy().tobytes())
    for sc in WD.all_single_scenes()[:48]:
        v, m = WD.render(sc, 0, jitter=False, **size)
        h.update(v.numpy().tobytes())
        h.update(m.numpy().tobytes())
    return h.hexdigest()


def test_default_size_unchanged():
    assert _default_renders_digest() == DEFAULT_RENDERS_SHA256
    assert _default_renders_digest(frames=4, size=32) == DEFAULT_RENDERS_SHA256


@pytest.mark.parametrize("frames,size", WD.SIZES)
def test_each_size_renders_deterministically(frames, size):
    rng = random.Random(frames * 100 + size)
    scene = WD.random_scene(rng, 2)
    v1, m1 = WD.render(scene, 123, frames=frames, size=size)
    v2, m2 = WD.render(scene, 123, frames=frames, size=size)
    assert v1.shape == (3, frames, size, size) and m1.shape == (2, frames, size, size)
    assert torch.equal(v1, v2) and torch.equal(m1, m2)
    assert all(m1[i, t].any() for i in range(2) for t in range(frames))
    z = LAT.encode(v1)
    assert z.shape == (1, 16, frames, size // 2, size // 2)
    assert torch.allclose(LAT.decode(z)[0], v1, atol=1e-5)


def test_motion_spans_the_same_share_of_the_frame():
    obj = {"shape": "square", "colour": "red", "position": "top left", "motion": "right"}
    for frames, size in WD.SIZES:
        track = WD.object_track(obj, frames=frames, size=size)
        assert len(track) == frames
        span = track[-1][0] - track[0][0]
        assert span == pytest.approx(WD.SPAN * size / 32)
        mid = np.mean([x for x, _ in track])
        assert mid == pytest.approx(size / 4)  # the quadrant's centre


@pytest.mark.parametrize("frames,size", WD.SIZES)
def test_checker_judges_ground_truth_at_each_size(frames, size):
    rng = random.Random(size * 10 + frames)
    scenes = WD.all_single_scenes()
    picks = [scenes[i] for i in rng.sample(range(len(scenes)), 6)]
    picks += [WD.random_scene(rng, 2) for _ in range(3)]
    for i, sc in enumerate(picks):
        v, _ = WD.render(sc, i, frames=frames, size=size)
        assert CH.check(v, sc)["all"] == 1.0, (frames, size, sc)


def test_circle_and_square_differ_at_16px():
    sq = WD.shape_mask("square", 4.0, 4.0, 16)
    ci = WD.shape_mask("circle", 4.0, 4.0, 16)
    assert (sq != ci).any()


def test_bad_sizes_are_refused():
    for f, p in ((1, 32), (4, 30), (4, 0)):
        with pytest.raises(ValueError):
            WD.render({"objects": []}, frames=f, size=p)
    assert WD.parse_sizes("2x16, 8x48") == [(2, 16), (8, 48)]
    with pytest.raises(ValueError):
        WD.parse_sizes("4by32")


def _train_module():
    spec = importlib.util.spec_from_file_location("train_tinyworld", os.path.join(ROOT, "scripts", "train_tinyworld.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_size_mix_and_order():
    tr = _train_module()
    sizes = tr.parse_size_mix("2x16,8x48:8", 32)
    assert sizes == [(2, 16, 32), (8, 48, 8)]
    assert [tr.size_of_step(sizes, s, "cycle", 1) for s in range(3)] == [sizes[0], sizes[1], sizes[0]]
    drawn = [tr.size_of_step(sizes, s, "random", 1) for s in range(40)]
    assert drawn == [tr.size_of_step(sizes, s, "random", 1) for s in range(40)]  # fixed by the step
    assert set(drawn) == set(sizes)
    assert len(tr.parse_size_mix("all", 4)) == len(WD.SIZES)


def test_one_training_step_at_two_sizes():
    """The tiny Wan model (a 1-layer, 128-dim one) takes a flow-matching step at 2x16 and 6x48,
    with the batch code and loss weights of scripts/train_tinyworld.py."""
    tr = _train_module()
    torch.manual_seed(0)
    model = tr.build_model(tr.model_config(dim=128, layers=1, ffn=256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    class Bank:  # the slice of train_tinyworld.Bank that make_batch reads
        scenes = [WD.random_scene(random.Random(i)) for i in range(4)]
        states = torch.randn(4, 8, 384).half()
        empty = torch.zeros(8, 384)

    rng_np = np.random.RandomState(0)
    proj = torch.randn(384, 4096) * 0.05
    for frames, size in ((2, 16), (6, 48)):
        idx = np.arange(2)
        x0, st, masks = tr.make_batch(Bank, idx, rng_np, 0.0, with_masks=True, frames=frames, size=size)
        assert x0.shape == (2, 16, frames, size // 2, size // 2)
        assert masks.shape == (2, frames, size, size)
        sig = tr.sample_sigmas(2, rng_np)
        noise = torch.randn_like(x0)
        s5 = sig.view(-1, 1, 1, 1, 1)
        xt = (1 - s5) * x0 + s5 * noise
        coords = LAT.coords(frames, size // 2, size // 2, batch=2)
        out = model(torch.cat([xt, coords], 1), sig * 1000.0, st @ proj)
        assert out.shape == x0.shape
        w = tr.object_weight(masks, 3.0) + tr.motion_edge_weight(masks, 6.0)
        assert w.shape == (2, 1, frames, size // 2, size // 2)
        loss = ((out - (noise - x0)).pow(2) * w).mean() / w.mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert torch.isfinite(loss)
