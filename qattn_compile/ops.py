"""The qattn graph ops (``torch.ops.qattn.*``) and where each one executes.

``torch.ops.qattn.attention(q, k, v, attn_mask, is_causal, scale, preset, options)``

- q ``[B, Hq, Lq, D]``, k ``[B, Hkv, Lkv, D]``, v ``[B, Hkv, Lkv, Dv]`` with ``Hq % Hkv == 0``
  (grouped-query attention: K/V are never repeated).
- attn_mask: ``None``, bool (True = attend) or additive float, broadcastable to
  ``[B, Hq, Lq, Lkv]``. is_causal: key j visible to query i iff ``j <= i`` (top-left).
- scale: softmax scale, ``None`` = ``1/sqrt(D)``.
- preset: a name from :data:`qattn_compile.presets.PRESET_NAMES` other than ``none``;
  options: the preset's options as canonical JSON (``PresetOptions.to_json()``), so that the
  graph carries plain strings and the graph diff shows them.
- returns ``[B, Hq, Lq, Dv]`` in q's dtype; fully masked rows are 0.

On CUDA the op runs the Triton kernels (:mod:`qattn_compile.kernels`); elsewhere the
plain-PyTorch reference (:mod:`qattn_compile.reference`). Which one serves a site is decided
at rewrite time (:func:`execution_path`), so nothing falls back silently at run time.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .presets import options_from_json

OP_NAMESPACE = "qattn"


@torch.library.custom_op(f"{OP_NAMESPACE}::attention", mutates_args=())
def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None,
    is_causal: bool,
    scale: float | None,
    preset: str,
    options: str,
) -> Tensor:
    """Quantized flash attention of ``preset`` (see the module docstring for shapes)."""
    resolved = options_from_json(preset, options)
    if q.device.type == "cuda":
        from .kernels import kernel_attention

        out = kernel_attention(q, k, v, attn_mask, is_causal, scale, preset, resolved)
    else:
        from .reference import reference_attention

        out = reference_attention(q, k, v, attn_mask, is_causal, scale, preset, resolved)
    return out.contiguous()


@attention.register_fake
def _attention_fake(q, k, v, attn_mask, is_causal, scale, preset, options):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


def execution_path(device: torch.device | str) -> str:
    """Which implementation ``torch.ops.qattn.attention`` uses on ``device``."""
    return "triton" if torch.device(device).type == "cuda" else "reference"


def unsupported_reason(
    q_shape, k_shape, v_shape, dtype: torch.dtype, device, preset: str, options
) -> str | None:
    """Why the op cannot serve these inputs on ``device``, or ``None`` when it can."""
    if q_shape[-1] != k_shape[-1]:
        return f"query head dim {q_shape[-1]} != key head dim {k_shape[-1]}"
    if q_shape[-3] % k_shape[-3]:
        return f"query heads {q_shape[-3]} not a multiple of key/value heads {k_shape[-3]}"
    if dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return f"dtype {dtype} (supported: float16, bfloat16, float32)"
    if execution_path(device) == "triton":
        from .kernels import supports

        return supports(q_shape, k_shape, v_shape, dtype, torch.device(device), preset, options)
    return None
