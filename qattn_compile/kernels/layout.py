"""Where the attention output is stored: in q's own layout, so the caller's way back to
``[B, L, H·D]`` stays a view.

q arrives ``[B, H, L, D]``; transformers passes a ``[B, L, H, D]`` projection output viewed
per head (heads inside each token). The kernels then write the output ``[B, H, Lq, Dv]``
into a ``[B, Lq, H, Dv]`` buffer viewed per head (:func:`output_buffer`), and the
``attention_triton`` op hands it on in that layout (:func:`in_output_layout`).
"""

from __future__ import annotations

import torch
from torch import Tensor


def heads_inside_tokens(q: Tensor) -> bool:
    """Whether ``q`` ``[B, H, L, D]`` stores its heads inside each token (a ``[B, L, H, D]``
    projection output viewed per head, as transformers passes Q): the attention output is
    then stored the same way, so the caller's ``transpose(1, 2)`` back to ``[B, L, H·D]``
    for the output projection is a view, not a copy."""
    return q.shape[1] > 1 and q.shape[2] > 1 and q.stride(1) < q.stride(2)


def output_buffer(shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device,
                  heads_inside: bool) -> Tensor:
    """An uninitialised attention output ``[B, H, Lq, Dv]``: a ``[B, Lq, H, Dv]`` tensor
    viewed per head when ``heads_inside``, else contiguous."""
    bsz, heads, length, dv = shape
    if heads_inside:
        return torch.empty((bsz, length, heads, dv), dtype=dtype, device=device).transpose(1, 2)
    return torch.empty(shape, dtype=dtype, device=device)


def in_output_layout(out: Tensor, q: Tensor) -> Tensor:
    """``out`` ``[B, H, Lq, Dv]`` stored as :func:`output_buffer` stores the output for ``q``
    (copied only if it is not already)."""
    if heads_inside_tokens(q):
        return out.transpose(1, 2).contiguous().transpose(1, 2)
    return out.contiguous()
