"""Deterministic hashing "demo text encoder".

Used by the demo, the benchmarks and the tests in place of a real T5 / UMT5 / LLaMA text
encoder (no weights can be downloaded on these machines). Plain torch + hashlib; imports
nothing from ComfyUI.

How a prompt becomes conditioning
---------------------------------
* The prompt is lower-cased and split into words (``[a-z0-9']+``); at most ``max_tokens``
  words are kept. A prompt with no words encodes as the single word ``"<empty>"`` so that a
  blank negative prompt still has one real token (an all-padding sequence would leave
  LTXV's masked cross-attention nothing to attend to).
* Every word maps to a fixed unit-norm random vector, drawn from a ``torch.Generator`` seeded
  with the first 8 bytes of ``sha256(word)``: the same word always gives the same vector, on
  every machine and run, and different words give near-orthogonal vectors.
* Token ``i`` is ``sqrt(token_dim) * (word_vec + 0.1 * pos_vec_i)``, ``pos_vec_i`` a fixed
  unit vector seeded from ``sha256("<pos>i")``: a small positional component so word order
  matters a little. Per-element std is about 1, like a real encoder's hidden states.
* Tokens are padded with zeros to ``L = max_tokens`` (fixed length, so conditionings of
  different prompts can be batched and compared element-wise).
* ``pooled`` is the mean of the unit word vectors, truncated to its first ``pooled_dim``
  coordinates, re-normalised and scaled by ``sqrt(pooled_dim)`` (std about 1).

So prompts sharing most words give close conditioning (high cosine similarity) and prompts
with different words give clearly different conditioning.

What each backbone needs in the cond dict (ComfyUI 0.3.75, ``comfy/model_base.py``)
---------------------------------------------------------------------------------
``conditioning_for(prompt, backbone)`` returns ``[[tokens, extras]]``, the structure
ComfyUI's ``CLIPTextEncode`` produces. ``extras`` always has ``pooled_output`` (the brief's
contract), plus:

* ``wan21`` (``model_base.WAN21``): nothing else. WAN21.extra_conds reads only
  ``cross_attn`` (the tokens); ``pooled_output`` is ignored (``encode_adm`` is None).
  A real UMT5 encoding is zero beyond the prompt (``zero_out_masked``), as ours is.
* ``hunyuan_video`` (``model_base.HunyuanVideo``): ``pooled_output`` is REQUIRED —
  ``HunyuanVideo.encode_adm`` does ``kwargs["pooled_output"]`` (the 768-d CLIP-L vector fed
  to ``vector_in``); without it sampling raises KeyError. ``guidance`` (the embedded
  distilled-guidance scale, what ComfyUI's FluxGuidance node sets) defaults to 6.0 in
  extra_conds; we set 6.0 explicitly. No ``attention_mask``: ComfyUI's HunyuanVideo
  forward builds its joint mask with batch size 1 (``attn_mask[:, 0, img_len:] = txt_mask``)
  and fails as soon as cond and uncond are batched together (B=2) with a mask; the real
  HunyuanVideo 1.0 LLaMA path has no padding (min_length 1) and drops an all-ones mask, so
  real conditionings never carry one either. Our zero padding is therefore attended to
  (it becomes the txt_in bias vectors), which is harmless for a demo encoder.
* ``ltxv`` (``model_base.LTXV``): ``frame_rate`` (CONDConstant, default 25; the
  LTXVConditioning node sets it, it scales the temporal RoPE coordinates); we set 25.0.
  ``attention_mask`` (1, L) int64, 1 = word, 0 = padding, is REQUIRED in practice:
  ``LTXVModel.forward(x, timestep, context, attention_mask, ...)`` takes it as a positional
  argument without default and extra_conds only passes it when present, so a cond dict
  without it fails with ``TypeError: ... missing 1 required positional argument:
  'attention_mask'``. ComfyUI's real LTXV T5 path (``text_encoders.genmo`` T5 with
  ``attention_mask=True``, padded to 128 tokens) always returns one. LTXV turns it into an
  additive mask for cross-attention, and it batches fine (cond + uncond, B=2).

* ``wan22_5b`` (``model_base.WAN22``) and ``wan22_a14b`` (two ``WAN21`` experts): as
  ``wan21`` (the same UMT5 encoder).
* ``hunyuan_video15`` (``model_base.HunyuanVideo15``): tokens 3584 wide (Qwen2.5-VL-7B);
  no ``guidance`` (the release has no guidance embedding; cfg does the guiding) and no
  ``attention_mask`` (extra_conds drops an all-ones one; zero padding is attended to, as
  for HunyuanVideo). ``pooled_output`` is harmless: without ``vector_in`` it is unused.

``DEFAULT_LATENT_SHAPES`` gives the latent shape each tiny test model is run on (see
``scripts/make_tiny_models.py``).
"""
from __future__ import annotations

import functools
import hashlib
import math
import re

import torch

__all__ = ["encode_prompt", "conditioning_for", "canonical_backbone", "words_of",
           "BACKBONES", "DEFAULT_LATENT_SHAPES", "TOKEN_DIMS"]

_WORD_RE = re.compile(r"[a-z0-9']+")
_POS_SCALE = 0.1
_EMPTY_WORD = "<empty>"

#: canonical backbone name -> extra cond-dict entries (beside pooled_output)
BACKBONES = {
    "wan21": {},
    "hunyuan_video": {"guidance": 6.0},
    "ltxv": {"frame_rate": 25.0},
    "wan22_5b": {},
    "wan22_a14b": {},
    "hunyuan_video15": {},
}

#: token width of each backbone's real text encoder, where it is not UMT5/T5/LLaMA's 4096
TOKEN_DIMS = {"hunyuan_video15": 3584}  # Qwen2.5-VL-7B hidden states

#: latent shape (B, C, T, H, W) each tiny model in models/tiny/ is tested on
DEFAULT_LATENT_SHAPES = {
    "wan21": (1, 16, 3, 16, 16),
    "hunyuan_video": (1, 16, 3, 16, 16),
    "ltxv": (1, 128, 3, 8, 8),
    "wan22_5b": (1, 48, 3, 16, 16),        # 16x VAE: a 256×256 video; 192 tokens like the rest
    "wan22_a14b": (1, 16, 3, 16, 16),
    "hunyuan_video15": (1, 32, 3, 8, 8),   # 16x VAE, patch 1: 192 image tokens, like the rest
}

_ALIASES = {
    "wan": "wan21", "wan21": "wan21", "wan2.1": "wan21", "wan21t2v": "wan21",
    "hunyuan": "hunyuan_video", "hunyuanvideo": "hunyuan_video", "hunyuan_video": "hunyuan_video",
    "ltxv": "ltxv", "ltx": "ltxv", "ltxvideo": "ltxv", "ltx_video": "ltxv", "lightricks": "ltxv",
    "wan22": "wan22_5b", "wan22_5b": "wan22_5b", "wan225b": "wan22_5b", "wan22ti2v": "wan22_5b",
    "wan22_a14b": "wan22_a14b", "wan22a14b": "wan22_a14b", "wan22_a14b_high": "wan22_a14b",
    "wan22_a14b_low": "wan22_a14b",
    "hunyuanvideo15": "hunyuan_video15", "hunyuan_video15": "hunyuan_video15",
    "hunyuan_video_15": "hunyuan_video15",
}


def canonical_backbone(backbone: str) -> str:
    """'WAN21' / 'wan' -> 'wan21', 'HunyuanVideo' -> 'hunyuan_video', 'LTXV' -> 'ltxv'."""
    key = str(backbone).strip().lower().replace("-", "_")
    if key in _ALIASES:
        return _ALIASES[key]
    squashed = re.sub(r"[^a-z0-9]", "", key)
    if squashed in _ALIASES:
        return _ALIASES[squashed]
    raise ValueError(f"unknown backbone {backbone!r}; expected one of {sorted(BACKBONES)}")


def words_of(prompt: str, max_tokens: int = 32) -> list[str]:
    """The words the encoder sees (lower-cased, at most max_tokens, '<empty>' if none)."""
    words = _WORD_RE.findall(str(prompt).lower())[:max_tokens]
    return words or [_EMPTY_WORD]


def _seed(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "little") & ((1 << 63) - 1)


@functools.lru_cache(maxsize=4096)
def _unit_vector(key: str, dim: int) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(_seed(key))
    v = torch.randn(dim, generator=g, dtype=torch.float32)
    return v / v.norm()


def encode_prompt(prompt: str, token_dim: int = 4096, pooled_dim: int = 768,
                  max_tokens: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode ``prompt`` -> (tokens (1, max_tokens, token_dim), pooled (1, pooled_dim)), float32."""
    if max_tokens < 1 or token_dim < 1 or pooled_dim < 1:
        raise ValueError("token_dim, pooled_dim and max_tokens must be positive")
    if pooled_dim > token_dim:
        raise ValueError("pooled_dim must not exceed token_dim (pooled is a truncation)")
    words = words_of(prompt, max_tokens)
    tokens = torch.zeros(1, max_tokens, token_dim, dtype=torch.float32)
    scale = math.sqrt(token_dim)
    word_vecs = []
    for i, w in enumerate(words):
        wv = _unit_vector("word:" + w, token_dim)
        word_vecs.append(wv)
        tokens[0, i] = scale * (wv + _POS_SCALE * _unit_vector(f"<pos>{i}", token_dim))
    mean = torch.stack(word_vecs).mean(dim=0)[:pooled_dim]
    pooled = (mean / mean.norm().clamp_min(1e-12) * math.sqrt(pooled_dim)).unsqueeze(0)
    return tokens, pooled.to(torch.float32)


def conditioning_for(prompt: str, backbone: str, max_tokens: int = 32) -> list:
    """ComfyUI conditioning ``[[tokens, {...}]]`` for ``backbone`` (see module docstring)."""
    name = canonical_backbone(backbone)
    tokens, pooled = encode_prompt(prompt, token_dim=TOKEN_DIMS.get(name, 4096), pooled_dim=768,
                                   max_tokens=max_tokens)
    extras: dict = {"pooled_output": pooled}
    if name == "ltxv":
        mask = torch.zeros(1, max_tokens, dtype=torch.int64)
        mask[0, :len(words_of(prompt, max_tokens))] = 1
        extras["attention_mask"] = mask
    extras.update(BACKBONES[name])
    return [[tokens, extras]]
