"""Where a joint attention call puts its image tokens, told from what the model does.

Joint (MMDiT-style) attention runs over image and text tokens concatenated in one sequence;
which part comes first is an implementation detail of the host release, not of the weights
(ComfyUI's HunyuanVideo blocks have been image-first behind an attribute that later releases
dropped; Flux's are text-first). Reading it from an attribute breaks silently when the
attribute goes, so it is observed instead: one block runs once with its image tokens changed
and once as sampled, and the value rows that moved between the two calls are the image
tokens. Values carry no positional rotation, and a block's text stream does not depend on its
image stream before attention, so the text rows stay put to the last bit on the same device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

IMAGE_FIRST = "image first"
TEXT_FIRST = "text first"

# a value row counts as moved above this share of the call's largest value: the text rows'
# difference is rounding at most, the image rows' is of the values' own size
_MOVED = 1e-3


def moved_image(img: torch.Tensor) -> torch.Tensor:
    """Image tokens that differ from ``img`` in every row (reversed and negated: no row maps
    onto itself, and a layer norm cannot cancel a sign)."""
    return -img.flip(1)


def order_from_values(sampled: torch.Tensor, moved: torch.Tensor, seq_dim: int,
                      n_img: int, n_txt: int) -> str | None:
    """IMAGE_FIRST or TEXT_FIRST from the value tensors of the same joint attention call made
    with the sampled and with moved image tokens; None when the rows that moved are not one
    contiguous image part at either end (then nobody should slice the call)."""
    diff = (sampled.float() - moved.float()).abs().movedim(seq_dim, 0).reshape(sampled.shape[seq_dim], -1)
    scale = float(sampled.float().abs().max()) or 1.0
    changed = diff.amax(dim=1) > _MOVED * scale
    if changed.numel() != n_img + n_txt:
        return None
    image_first = bool(changed[:n_img].all()) and not bool(changed[n_img:].any())
    text_first = bool(changed[n_txt:].all()) and not bool(changed[:n_txt].any())
    if image_first != text_first:
        return IMAGE_FIRST if image_first else TEXT_FIRST
    return None


@dataclass
class OrderProbe:
    """One block's two calls: ``phase`` says which one the attention calls belong to."""

    n_img: int
    n_txt: int
    phase: str = "moved"            # "moved" (the extra call), then "sampled" (the real one)
    moved_values: torch.Tensor | None = None
    order: str | None = None
    seen_joint: bool = False        # a call over image and text tokens together happened

    def is_joint(self, q_len: int, k_len: int) -> bool:
        return q_len == k_len == self.n_img + self.n_txt

    def observe(self, v: torch.Tensor, seq_dim: int) -> None:
        """The value tensor of a joint call (the first one of each phase counts)."""
        if self.phase == "moved":
            if self.moved_values is None:
                self.moved_values = v.detach().clone()
        elif not self.seen_joint and self.moved_values is not None:
            self.seen_joint = True
            self.order = order_from_values(v.detach(), self.moved_values, seq_dim,
                                           self.n_img, self.n_txt)
            self.moved_values = None
