"""Eager functional API: a drop-in for ``F.scaled_dot_product_attention``.

For users who do not compile: ``qattn_compile.attention(query, key, value, ...,
preset="sage2_8b")`` takes the arguments (by position or by name) and layouts of
:func:`torch.nn.functional.scaled_dot_product_attention` — query ``[..., Hq, Lq, D]``, key
``[..., Hkv, Lkv, D]``, value ``[..., Hkv, Lkv, Dv]``, broadcast as SDPA broadcasts them (2-D
inputs, leading dims, one head) — and returns ``[..., Hq, Lq, Dv]``. Bad arguments raise the
exception types SDPA raises for them.
"""

from __future__ import annotations

import difflib
import math
import numbers
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from . import ops
from .errors import AttentionInputError
from .presets import PRESET_OPTIONS, resolve_options

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
SDPA_ARGUMENTS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
                  "enable_gqa")
"""The arguments of ``F.scaled_dot_product_attention``, in its order: :func:`attention`'s."""


def _is_float_like(x: Any) -> bool:
    """What SDPA's argument parser takes for a float: a real number or a 0-d tensor."""
    return isinstance(x, numbers.Real) or (isinstance(x, Tensor) and x.dim() == 0)


def _check_argument_types(arguments: dict[str, Any]) -> None:
    """TypeError naming the argument, as SDPA's argument parser raises, for one of SDPA's
    arguments (by name) whose type SDPA does not take (``is_causal="False"``, a list mask)."""
    for name, value in arguments.items():
        if value is None and name in ("attn_mask", "scale"):
            continue
        if name in ("query", "key", "value", "attn_mask"):
            wanted, ok = "Tensor", isinstance(value, Tensor)
        elif name in ("is_causal", "enable_gqa"):
            wanted, ok = "bool", type(value) is bool  # not 1, "False", numpy.bool_ or a tensor
        else:  # dropout_p, scale
            wanted, ok = "float", _is_float_like(value)
        if not ok:
            kind = type(value)
            shown = kind.__qualname__ if kind.__module__ == "builtins" else \
                f"{kind.__module__}.{kind.__qualname__}"
            raise TypeError(f"qattn attention: argument '{name}' must be {wanted}, not {shown}")


def _check_misspelled_arguments(options: dict[str, Any]) -> None:
    """TypeError, as Python raises for an unexpected keyword, for an option of no preset's
    that looks like a misspelled SDPA argument (``is_casual=True``): without it, the typo
    would read as an unknown option of the preset."""
    options_of_presets = {name for cls in PRESET_OPTIONS.values() for name in cls.model_fields}
    for name in options:
        close = difflib.get_close_matches(name, SDPA_ARGUMENTS, n=1)
        if close and name not in options_of_presets:  # fmha_int8's `scales` is no typo
            raise TypeError(f"qattn attention got an unexpected keyword argument {name!r} "
                            f"(did you mean {close[0]!r}?)")


def _check_inputs(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Raise SDPA's exception types for tensors qattn cannot take (an
    :class:`AttentionInputError`, both RuntimeError and ValueError, where SDPA raises
    RuntimeError); messages name the tensors and their shapes."""
    if min(q.dim(), k.dim(), v.dim()) < 2:
        raise AttentionInputError(
            f"Expected query, key, and value to all be at least 2 dimensional ([..., length, "
            f"head_dim]), got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise AttentionInputError(
            "Expected query, key, and value to have the same dtype, but got "
            f"query.dtype: {q.dtype} key.dtype: {k.dtype} and value.dtype: {v.dtype} instead."
        )
    if q.dtype not in _FLOAT_DTYPES:
        raise AttentionInputError(f"Expected floating point query/key/value, got {q.dtype}")
    if not (q.device == k.device == v.device):
        raise AttentionInputError(
            "Expected query, key, and value to have the same device type, but got "
            f"query.device: {q.device} key.device: {k.device} and value.device: {v.device} instead."
        )
    if q.shape[-1] != k.shape[-1]:
        raise AttentionInputError(
            f"Expected query and key to have the same head dim (last dim), got "
            f"query {tuple(q.shape)} and key {tuple(k.shape)}"
        )
    if k.shape[-2] != v.shape[-2] or k.shape[:-2] != v.shape[:-2]:
        raise AttentionInputError(
            f"Expected key and value to have the same leading dims, heads and length, got key "
            f"{tuple(k.shape)} and value {tuple(v.shape)}"
        )


def _broadcast(q: Tensor, k: Tensor, v: Tensor, enable_gqa: bool) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v as SDPA broadcasts them: ``[*B, Hq, L, D]``, ``[*B, Hkv, S, D]``,
    ``[*B, Hkv, S, Dv]`` (views) with one leading shape B, a 2-D input read as one head.

    Heads: equal; or, with ``enable_gqa``, Hkv dividing Hq (grouped-query attention); or
    Hkv = 1, which SDPA broadcasts over the query's heads (served as one group); or Hq = 1,
    broadcast over the key's heads.
    """
    dims = max(q.dim(), k.dim(), v.dim(), 3)
    q, k, v = (t.reshape((1,) * (dims - t.dim()) + tuple(t.shape)) for t in (q, k, v))
    hq, hkv = q.shape[-3], k.shape[-3]
    if hq == 1 and hkv > 1 and not enable_gqa:
        hq = hkv
    elif hq != hkv and (enable_gqa or hkv == 1):
        if hkv == 0 or hq % hkv:
            raise AttentionInputError(
                f"Number of heads in key and value must divide the number of heads in query "
                f"(query {hq}, key/value {hkv})"
            )
    elif hq != hkv:
        raise AttentionInputError(
            f"query has {hq} heads and key/value {hkv}: pass enable_gqa=True for "
            "grouped-query attention"
        )
    try:
        lead = torch.broadcast_shapes(q.shape[:-3], k.shape[:-3])
    except RuntimeError:
        raise AttentionInputError(
            f"Expected the leading (batch) dims of query and key/value to broadcast, got "
            f"shapes {tuple(q.shape)} and {tuple(k.shape)}"
        ) from None
    return (q.expand(*lead, hq, *q.shape[-2:]), k.expand(*lead, *k.shape[-3:]),
            v.expand(*lead, *v.shape[-3:]))


def _check_mask(attn_mask: Tensor, q: Tensor, kv_len: int, dims: int) -> None:
    """SDPA's exception types for a mask that does not fit the scores ``[..., Lq, Lkv]`` of
    the broadcast ``q`` (:func:`_broadcast`) of an output of ``dims`` dims."""
    if attn_mask.dim() < 2:  # SDPA indexes the mask's last two dims: an IndexError
        raise IndexError(
            f"attn_mask must have at least 2 dims ([..., query length, key length]), got "
            f"shape {tuple(attn_mask.shape)}"
        )
    if attn_mask.dim() > dims:
        raise AttentionInputError(
            f"attn_mask of shape {tuple(attn_mask.shape)} has more dims than the output "
            f"({dims}: those of query, key and value)"
        )
    if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
        raise AttentionInputError(
            f"Expected attn_mask dtype to be bool or floating point, got {attn_mask.dtype}"
        )
    target = (*q.shape[:-1], kv_len)
    try:
        broadcast = torch.broadcast_shapes(attn_mask.shape, target)
    except RuntimeError:
        broadcast = None
    if broadcast != torch.Size(target):
        raise AttentionInputError(
            f"attn_mask of shape {tuple(attn_mask.shape)} is not broadcastable to the "
            f"attention scores' shape {target}"
        )
    if attn_mask.device != q.device:
        raise AttentionInputError(f"attn_mask is on {attn_mask.device}, query on {q.device}")


def _check_score_terms(softcap, alibi_slopes, preset: str) -> None:
    """``softcap`` a number ≥ 0 and ``alibi_slopes`` None or a floating tensor (TypeError
    otherwise, as SDPA's argument checks); neither with ``preset="none"`` (SDPA has neither)."""
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a number, got {type(softcap).__name__}")
    if not softcap >= 0:
        raise ValueError(f"softcap must be >= 0 (0 = off), got {softcap}")
    if alibi_slopes is not None and not (isinstance(alibi_slopes, Tensor)
                                         and alibi_slopes.is_floating_point()):
        raise TypeError("alibi_slopes must be a floating-point Tensor, got "
                        f"{type(alibi_slopes).__name__}")
    if preset == "none" and (softcap or alibi_slopes is not None):
        raise ValueError("preset 'none' calls F.scaled_dot_product_attention, which takes no "
                         "softcap or alibi_slopes")


def _slopes_2d(slopes: Tensor, q: Tensor) -> Tensor:
    """ALiBi slopes ``[Hq]`` or ``[..., Hq]`` (q's leading dims) as the op's ``[Hq]`` or
    ``[B, Hq]`` (leading dims folded into B); :class:`AttentionInputError` naming the shape
    otherwise."""
    hq, lead = q.shape[-3], tuple(q.shape[:-3])
    if tuple(slopes.shape) == (hq,):
        return slopes
    if tuple(slopes.shape) == (*lead, hq):
        return slopes.reshape(math.prod(lead), hq)
    raise AttentionInputError(
        f"alibi_slopes of shape {tuple(slopes.shape)}: expected [{hq}] or {[*lead, hq]} for "
        f"query {tuple(q.shape)}")


def _to_4d(t: Tensor) -> Tensor:
    """``[..., H, L, E]`` -> ``[B, H, L, E]`` with all leading dims folded into B (sized
    explicitly: an empty tensor cannot infer a ``-1``)."""
    return t.reshape(math.prod(t.shape[:-3]), *t.shape[-3:])


def _mask_to_4d(mask: Tensor, q: Tensor, kv_len: int) -> Tensor:
    """Broadcast-compatible mask -> 4-D ``[B|1, Hq|1, Lq|1, Lkv|1]``: a view when the mask's
    leading (batch) dims are all 1, else a copy expanded over q's leading dims (folded into
    B as :func:`_to_4d` folds q's)."""
    target = (*q.shape[:-1], kv_len)
    full = mask.reshape((1,) * (len(target) - mask.dim()) + tuple(mask.shape))
    lead = full.shape[:-3]
    if all(s == 1 for s in lead):
        return full.reshape(1, *full.shape[-3:])
    return full.expand(*target[:-3], *full.shape[-3:]).reshape(math.prod(target[:-3]),
                                                                *full.shape[-3:])


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    preset: str = "sage2_8b",
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    **options,
) -> Tensor:
    """Quantized attention with the semantics and arguments of
    ``F.scaled_dot_product_attention``, which it can replace by name:
    ``functools.partial(qattn_compile.attention, preset="sage2_8b")``.

    Beyond SDPA, as FlashAttention takes them: ``softcap`` (> 0) caps the scaled scores to
    ``softcap·tanh(S/softcap)`` before the mask (Gemma 2, Grok); ``alibi_slopes`` (float,
    ``[Hq]`` or ``[..., Hq]`` with query's leading dims) adds ALiBi, ``−slope·|i + Lkv − Lq −
    j|`` for query ``i`` and key ``j``.

    ``preset`` names a method (see :mod:`qattn_compile.presets`); ``**options`` are that
    preset's options. ``preset="none"`` calls PyTorch's SDPA (dropout and backward
    included). The other presets are inference only: a non-zero ``dropout_p``, or inputs
    that require grad while grad mode is on, raise (there is no backward). A float mask may
    have any float dtype (it is added in float32). With both ``attn_mask`` and
    ``is_causal=True`` both apply, as in SDPA's CPU math path.
    """
    _check_argument_types(dict(query=query, key=key, value=value, attn_mask=attn_mask,
                               dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                               enable_gqa=enable_gqa))
    _check_misspelled_arguments(options)
    _check_score_terms(softcap, alibi_slopes, preset)
    resolved = resolve_options(preset, options)
    _check_inputs(query, key, value)
    q, k, v = _broadcast(query, key, value, enable_gqa)
    dims = max(query.dim(), key.dim(), value.dim())  # of SDPA's output
    if attn_mask is not None:
        _check_mask(attn_mask, q, k.shape[-2], dims)
    if preset == "none":
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
            enable_gqa=enable_gqa
        )
    if dropout_p:
        raise ValueError(f"qattn attention is inference-only: dropout_p must be 0, got {dropout_p}")
    if torch.is_grad_enabled():
        needs_grad = [name for name, t in (("query", q), ("key", k), ("value", v),
                                           ("attn_mask", attn_mask))
                      if t is not None and t.requires_grad]
        if needs_grad:
            raise ValueError(
                f"qattn attention is inference-only: {', '.join(needs_grad)} requires grad. "
                "Call it under torch.no_grad() or torch.inference_mode(), or detach the inputs; "
                "for training use F.scaled_dot_product_attention (preset='none')")
    out_shape = (*q.shape[:-1], v.shape[-1])
    if math.prod(out_shape) == 0:  # an empty output, as SDPA's: nothing to compute
        return q.new_zeros(out_shape[-dims:])
    # the op (and its support check) take 4-D [B, H, L, D]: leading dims folded into B
    q4, k4, v4 = _to_4d(q), _to_4d(k), _to_4d(v)
    reason = ops.unsupported_reason(q4.shape, k4.shape, v4.shape, q.dtype, q.device, preset,
                                    resolved)
    if reason:
        raise ValueError(f"preset {preset!r} cannot serve these inputs: {reason}")
    lead = q.shape[:-3]
    mask4 = None if attn_mask is None else _mask_to_4d(attn_mask, q, k.shape[-2])
    out = ops.attention(
        q4,
        k4,
        v4,
        mask4,
        is_causal,
        None if scale is None else float(scale),
        preset,
        resolved.to_json(),
        float(softcap),
        None if alibi_slopes is None else _slopes_2d(alibi_slopes, q),
    )
    return out.reshape(*lead, *out.shape[-3:])[(0,) * (3 - dims)]  # 2-D inputs: 2-D output

