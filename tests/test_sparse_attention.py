"""Connectivity masks and block-sparse attention (carnator_core.reuse.connectivity / sparse_attention)."""
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from carnator_core.reuse import sparse_attention as sa # noqa: E402
from carnator_core.reuse.connectivity import (  # noqa: E402
    block_scores, connectivity_mask, effective_block_mask, expand_block_mask, mask_density,
    num_blocks, pack_mask, unpack_mask)
from carnator_core.reuse.sparse_attention import (  # noqa: E402
    backend_report, reset_sparse_call_counts, select_backend, sparse_attention,
    sparse_call_counts)

BS = 64  # one block size and (B, H) = (2, 2) for flex tests: CPU flex compiles per variant
TOL = 2e-5


def rand_qkv(B=2, H=2, L=300, D=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, L, D, generator=g) for _ in range(3))


def local_qkv(L=512, H=2, D=32, seed=0):
    """q/k whose attention is concentrated near the diagonal (smooth positional features)."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(L, dtype=torch.float32)[:, None]
    freqs = torch.linspace(0.002, 0.05, D // 2)[None, :]
    feat = torch.cat([torch.sin(pos * freqs * math.tau), torch.cos(pos * freqs * math.tau)], -1)
    q = 1.5 * feat + 0.15 * torch.randn(H, L, D, generator=g)
    k = 1.5 * feat + 0.15 * torch.randn(H, L, D, generator=g)
    v = torch.randn(H, L, D, generator=g)
    return q[None], k[None], v[None]


def masked_reference(q, k, v, eff_mask):
    lq, lk = q.shape[-2], k.shape[-2]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=expand_block_mask(eff_mask, BS, lq, lk))


@pytest.fixture(scope="module")
def flex_ok():
    """Skip flex tests only when flex_attention genuinely cannot compile here."""
    try:
        name = select_backend("cpu", refresh=True)
    except Exception as exc:  # e.g. CARNATOR_SPARSE_BACKEND=flex on a machine without it
        pytest.skip(f"flex unavailable: {exc}")
    if name != "flex":
        rep = backend_report()["devices"]["cpu"]
        pytest.skip(f"flex_attention unavailable on this machine: {rep['reason']} {rep['error']}")
    return True


def backends_param():
    return pytest.mark.parametrize("backend", ["flex", "fallback"])


def _need(backend, request):
    if backend == "flex":
        request.getfixturevalue("flex_ok")


# ------------------------------------------------------------------------- connectivity
def test_block_scores_shape_and_mass():
    q, k, _ = rand_qkv(B=2, H=3, L=300)
    s = block_scores(q, k, BS)
    assert s.shape == (2, 3, 5, 5)
    assert torch.allclose(s.sum(-1), torch.ones(2, 3, 5), atol=1e-5)
    assert block_scores(q[0], k[0], BS).shape == (3, 5, 5)  # batchless input
    # identical keys: mass is proportional to block sizes (last block holds 300 - 256 = 44)
    s = block_scores(q, torch.ones_like(k), BS)
    assert torch.allclose(s[0, 0, 0], torch.tensor([64, 64, 64, 64, 44.0]) / 300, atol=1e-5)


def test_connectivity_mask_rules():
    scores = torch.softmax(torch.randn(2, 4, 10, 10) * 3, -1)
    m = connectivity_mask(scores, keep_mass=0.9, min_density=0.3)
    assert m.shape == (4, 10, 10) and m.dtype == torch.bool
    assert m.sum(-1).min() >= 3                                  # ceil(0.3 * 10)
    assert m.diagonal(dim1=-2, dim2=-1).all()
    avg = scores.mean(0)
    assert ((avg * m).sum(-1) >= 0.9 - 1e-5).all()               # reaches keep_mass
    # minimal: dropping the weakest kept non-diagonal block (beyond the floor) loses the mass
    loose = connectivity_mask(scores, keep_mass=0.5, min_density=0.0, include_diagonal=False)
    kept_mass = (avg * loose).sum(-1)
    weakest = torch.where(loose, avg, torch.inf).amin(-1)
    assert ((kept_mass - weakest) < 0.5 + 1e-5).all()
    assert connectivity_mask(scores, keep_mass=1.0).all()


@pytest.mark.parametrize("shape", [(3, 7, 7), (1, 5, 13), (2, 1, 16, 16)])
def test_pack_unpack_round_trip(shape):
    mask = torch.rand(shape) < 0.37
    packed, got_shape = pack_mask(mask)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(mask.numel() / 8)
    assert got_shape == shape
    assert torch.equal(unpack_mask(packed, got_shape), mask)
    assert abs(mask_density(mask) - mask.float().mean().item()) < 1e-7


# ------------------------------------------------------------------------- execution
@backends_param()
def test_full_mask_equals_dense(backend, request):
    _need(backend, request)
    q, k, v = rand_qkv(L=300)   # L not a multiple of the block size
    full = connectivity_mask(block_scores(q, k, BS), keep_mass=1.0)
    out = sparse_attention(q, k, v, full, BS, backend=backend)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), atol=TOL, rtol=0)


@backends_param()
def test_sparse_matches_masked_reference(backend, request):
    _need(backend, request)
    q, k, v = rand_qkv(L=450)
    nb = num_blocks(450, BS)
    mask = torch.rand(2, nb, nb, generator=torch.Generator().manual_seed(1)) < 0.3
    out = sparse_attention(q, k, v, mask, BS, backend=backend)
    eff = effective_block_mask(mask, BS, 450, 450)
    torch.testing.assert_close(out, masked_reference(q, k, v, eff), atol=TOL, rtol=0)


def test_error_grows_as_keep_mass_falls():
    q, k, v = local_qkv()
    dense = F.scaled_dot_product_attention(q, k, v)
    scores = block_scores(q, k, BS)
    densities, errors = [], []
    for keep in (1.0, 0.7, 0.4, 0.2):
        mask = connectivity_mask(scores, keep_mass=keep, min_density=0.0)
        out = sparse_attention(q, k, v, mask, BS, backend="fallback")
        densities.append(mask_density(mask))
        errors.append((out - dense).norm().item() / dense.norm().item())
    assert errors[0] < 1e-5 and densities[0] == 1.0
    assert densities == sorted(densities, reverse=True) and densities[-1] < 0.2
    for a, b in zip(errors, errors[1:]):
        assert b >= a * 0.9, (densities, errors)                 # monotone-ish
    assert errors[-1] > errors[1] and errors[-1] > 1e-3
    assert errors[1] < 0.5                                       # 70% of mass is a fair copy


@backends_param()
def test_dense_query_blocks_equal_dense_rows(backend, request):
    _need(backend, request)
    q, k, v = rand_qkv(L=320)
    nb = num_blocks(320, BS)
    mask = torch.eye(nb, dtype=torch.bool).expand(2, nb, nb)     # very sparse: diagonal only
    out = sparse_attention(q, k, v, mask, BS, dense_query_blocks=[1, 4], backend=backend)
    dense = F.scaled_dot_product_attention(q, k, v)
    for b in (1, 4):
        rows = slice(b * BS, min((b + 1) * BS, 320))
        torch.testing.assert_close(out[..., rows, :], dense[..., rows, :], atol=TOL, rtol=0)
    assert (out[..., :BS, :] - dense[..., :BS, :]).abs().max() > 1e-2   # others stay sparse
    flags = torch.zeros(nb, dtype=torch.bool)
    flags[[1, 4]] = True
    torch.testing.assert_close(sparse_attention(q, k, v, mask, BS, dense_query_blocks=flags,
                                                backend=backend), out, atol=TOL, rtol=0)


@backends_param()
def test_dense_token_range(backend, request):
    _need(backend, request)
    n_img, n_txt = 256, 77                      # joint sequence [image | text], text at the end
    L = n_img + n_txt
    q, k, v = rand_qkv(L=L, seed=3)
    nb = num_blocks(L, BS)
    mask = torch.eye(nb, dtype=torch.bool)
    out = sparse_attention(q, k, v, mask, BS, dense_token_range=(n_img, L), backend=backend)
    dense = F.scaled_dot_product_attention(q, k, v)
    # text queries see every key
    torch.testing.assert_close(out[..., n_img:, :], dense[..., n_img:, :], atol=TOL, rtol=0)
    # image queries see their own block plus every text key (text starts on a block boundary)
    tok = expand_block_mask(mask, BS, L, L)
    tok[:, n_img:] = True
    tok[n_img:, :] = True
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=tok)
    torch.testing.assert_close(out, ref, atol=TOL, rtol=0)
    assert (out[..., :n_img, :] - dense[..., :n_img, :]).abs().max() > 1e-2


@backends_param()
def test_call_counter_increments(backend, request):
    _need(backend, request)
    q, k, v = rand_qkv(L=200)
    mask = torch.ones(num_blocks(200, BS), num_blocks(200, BS), dtype=torch.bool)
    reset_sparse_call_counts()
    for _ in range(3):
        sparse_attention(q, k, v, mask, BS, backend=backend)
    counts = sparse_call_counts()
    assert counts[backend] == 3 and sum(counts.values()) == 3
    assert backend_report()["calls"][backend] == 3


def test_backend_report_and_env_override(monkeypatch):
    monkeypatch.setenv(sa.ENV_VAR, "fallback")
    assert select_backend("cpu", refresh=True) == "fallback"
    rep = backend_report()
    assert rep["backend"] == "fallback" and "forced" in rep["devices"]["cpu"]["reason"]
    q, k, v = rand_qkv(L=128)
    reset_sparse_call_counts()
    sparse_attention(q, k, v, torch.ones(2, 2, dtype=torch.bool), BS)   # default backend
    assert sparse_call_counts()["fallback"] == 1
    monkeypatch.setenv(sa.ENV_VAR, "bogus")
    with pytest.raises(ValueError):
        select_backend("cpu", refresh=True)
    monkeypatch.delenv(sa.ENV_VAR)
    name = select_backend("cpu", refresh=True)                         # auto again
    rep = backend_report()
    assert name in sa.BACKENDS and rep["backend"] == name and rep["devices"]["cpu"]["reason"]


def test_flex_under_inference_mode(flex_ok):
    """ComfyUI samples under torch.inference_mode(); flex must run there without failing over."""
    q, k, v = rand_qkv(L=260)
    mask = torch.rand(2, 5, 5, generator=torch.Generator().manual_seed(4)) < 0.5
    failures = len(backend_report()["flex_runtime_failures"])
    reset_sparse_call_counts()
    with torch.inference_mode():
        out = sparse_attention(q, k, v, mask, BS, backend="flex")
    ref = masked_reference(q, k, v, effective_block_mask(mask, BS, 260, 260))
    torch.testing.assert_close(out, ref, atol=TOL, rtol=0)
    assert sparse_call_counts()["flex"] == 1
    assert len(backend_report()["flex_runtime_failures"]) == failures


def test_bad_inputs():
    q, k, v = rand_qkv(L=128)
    with pytest.raises(ValueError):
        sparse_attention(q, k, v, torch.ones(3, 3, dtype=torch.bool), BS, backend="fallback")
    with pytest.raises(IndexError):
        sparse_attention(q, k, v, torch.ones(2, 2, dtype=torch.bool), BS,
                         dense_query_blocks=[5], backend="fallback")
    # an empty row is never an empty softmax: it becomes dense
    empty = torch.zeros(2, 2, dtype=torch.bool)
    out = sparse_attention(q, k, v, empty, BS, backend="fallback")
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), atol=TOL, rtol=0)


def test_flex_failure_is_remembered_per_signature(monkeypatch):
    """A shape flex cannot compile goes to the fallback once and for all, not one compile per call."""
    real_flex, tried = sa._flex_run, []

    def flex_failing_on_head_dim_32(q, k, v, mask, block_size, scale):
        tried.append(q.shape[-1])
        if q.shape[-1] == 32:
            raise RuntimeError("no kernel for this head dim")
        return real_flex(q, k, v, mask, block_size, scale)

    monkeypatch.setattr(sa, "_flex_run", flex_failing_on_head_dim_32)
    select_backend("cpu", refresh=True)          # forgets earlier refusals on this device
    tried.clear()                                # (its probe ran flex at head dim 16)
    q, k, v = rand_qkv(L=200)                    # head dim 32
    mask = torch.rand(2, 4, 4, generator=torch.Generator().manual_seed(5)) < 0.5
    ref = masked_reference(q, k, v, effective_block_mask(mask, BS, 200, 200))
    reset_sparse_call_counts()
    for _ in range(3):
        out = sparse_attention(q, k, v, mask, BS, backend="flex")
        torch.testing.assert_close(out, ref, atol=TOL, rtol=0)
    assert tried == [32]                         # tried once, then refused
    assert sparse_call_counts() == {"flex": 0, "fallback": 3}
    assert any("head_dim 32/32 block 64" in r for r in backend_report()["flex_refused"])
    q16 = torch.randn(2, 2, 200, 16, generator=torch.Generator().manual_seed(6))
    sparse_attention(q16, q16, q16, mask, BS, backend="flex")  # another signature still tries
    assert tried == [32, 16]
    select_backend("cpu", refresh=True)
    assert backend_report()["flex_refused"] == []


def test_fallback_chunks_with_ragged_rows_and_keys():
    """Rows keeping different block counts share a chunk, and the last key block is partial."""
    q, k, v = rand_qkv(L=333, seed=7)
    nb = num_blocks(333, BS)
    mask = torch.rand(2, nb, nb, generator=torch.Generator().manual_seed(8)) < 0.4
    eff = effective_block_mask(mask, BS, 333, 333)
    assert len(set(eff.sum(-1).flatten().tolist())) > 2     # ragged rows really occur
    out = sparse_attention(q, k, v, mask, BS, backend="fallback")
    torch.testing.assert_close(out, masked_reference(q, k, v, eff), atol=TOL, rtol=0)
