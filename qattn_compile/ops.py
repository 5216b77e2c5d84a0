"""The qattn graph ops (``torch.ops.qattn.*``) and where each one executes.

``torch.ops.qattn.attention(q, k, v, attn_mask, is_causal, scale, preset, options, softcap=0.0,
alibi_slopes=None)``

- q ``[B, Hq, Lq, D]``, k ``[B, Hkv, Lkv, D]``, v ``[B, Hkv, Lkv, Dv]`` with ``Hq % Hkv == 0``
  (grouped-query attention: K/V are never repeated).
- attn_mask: ``None``, bool (True = attend) or additive float, broadcastable to
  ``[B, Hq, Lq, Lkv]``. is_causal: key j visible to query i iff ``j <= i`` (top-left).
- scale: softmax scale, ``None`` = ``1/sqrt(D)``.
- preset: a name from :data:`qattn_compile.presets.PRESET_NAMES` other than ``none``;
  options: the preset's options as canonical JSON (``PresetOptions.to_json()``), so that the
  graph carries plain strings and the graph diff shows them.
- softcap: logit soft-capping ``cap·tanh(S/cap)`` of the scaled scores, before the mask
  (Gemma 2, Grok); 0 = off. alibi_slopes: ALiBi from one slope per query head (``[Hq]`` or
  ``[B, Hq]``), ``−slope·|i + Lkv − Lq − j|`` added to the scaled scores (FlashAttention's).
- returns ``[B, Hq, Lq, Dv]`` in q's dtype; fully masked rows are 0. Contiguous; the
  ``attention_triton`` op stores it ``[B, Lq, Hq, Dv]`` when q stores its heads inside each
  token (:func:`qattn_compile.kernels.layout.output_buffer`).

On CUDA the op runs the Triton kernels (:mod:`qattn_compile.kernels`); elsewhere the
plain-PyTorch reference (:mod:`qattn_compile.reference`). Compiled graphs get
``torch.ops.qattn.attention_triton`` for CUDA sites instead (same signature), a
``triton_op`` whose kernels Inductor inlines. Which one serves a site is decided
at rewrite time (:func:`execution_path`), so nothing falls back silently at run time.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .errors import PolicyError
from .support import shape_refusal
from .presets import PresetOptions, options_from_json

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
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
) -> Tensor:
    """Quantized flash attention of ``preset`` (see the module docstring for shapes); a
    contiguous output: Inductor may hand this op a q stored otherwise than the q its fake
    saw, so the layout cannot follow q's (the kernels write it contiguous, no copy)."""
    return _run(q, k, v, attn_mask, is_causal, scale, preset, options, softcap, alibi_slopes,
                output_like_q=False).contiguous()


def _run(q, k, v, attn_mask, is_causal, scale, preset, options, softcap, alibi_slopes, *,
         output_like_q: bool) -> Tensor:
    """The body of both ops: the Triton kernels on CUDA (output stored as
    ``kernels.layout.output_buffer`` says for q when ``output_like_q``, else contiguous), the reference
    elsewhere."""
    resolved = _op_options(preset, options)
    if q.device.type == "cuda":
        from .kernels import kernel_attention

        return kernel_attention(q, k, v, attn_mask, is_causal, scale, preset, resolved,
                                output_like_q=output_like_q, softcap=softcap,
                                alibi_slopes=alibi_slopes)
    from .reference import reference_attention

    return reference_attention(q, k, v, attn_mask, is_causal, scale, preset, resolved,
                               softcap=softcap, alibi_slopes=alibi_slopes)


def _op_options(preset: str, options: str) -> PresetOptions:
    """The op's ``preset`` and ``options`` validated (named errors, not a ``KeyError``, for a
    direct call of the op with a preset it does not serve or options that do not parse)."""
    if preset == "none":
        raise PolicyError("torch.ops.qattn.attention serves the presets other than 'none' "
                          "(for the original attention, call F.scaled_dot_product_attention)")
    return options_from_json(preset, options)


@attention.register_fake
def _attention_fake(q, k, v, attn_mask, is_causal, scale, preset, options, softcap=0.0,
                    alibi_slopes=None):
    _op_options(preset, options)  # a bad preset or options fail while tracing, not at run time
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


def _attention_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None,
    is_causal: bool,
    scale: float | None,
    preset: str,
    options: str,
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
) -> Tensor:
    """:func:`attention` on CUDA as a ``triton_op``: what the rewrite puts in compiled graphs.

    Its body is torch ops plus Triton launches that go through ``torch.library.wrap_triton``
    while torch traces it, so Inductor inlines the quantizer and attention kernels into its
    generated code (no opaque call, CUDA graphs keep working) instead of calling this op.
    The output is stored as ``kernels.layout.output_buffer`` says for q (traced with the body, so the
    layout Inductor plans is the one the kernels write).
    """
    from .kernels.layout import in_output_layout

    out = _run(q, k, v, attn_mask, is_causal, scale, preset, options, softcap, alibi_slopes,
               output_like_q=True)
    return in_output_layout(out, q)


# Registered only where CUDA exists: registering a triton_op pulls in torch's Triton-kernel
# tracing machinery, which on CPU-only machines breaks later Triton-interpreter runs in the
# same process (tl builtins resolve to JIT functions). CPU graphs never use this op.
if torch.cuda.is_available():
    torch.library.triton_op(f"{OP_NAMESPACE}::attention_triton", mutates_args=())(_attention_triton)


def graph_ops() -> tuple:
    """Every op overload the rewrite may insert (the triton_op only where it is registered)."""
    found = [torch.ops.qattn.attention.default]
    if hasattr(torch.ops.qattn, "attention_triton"):
        found.append(torch.ops.qattn.attention_triton.default)
    return tuple(found)


def graph_op(execution: str):
    """The op overload the rewrite inserts for a site served by ``execution``
    (:func:`execution_path`).

    ``"triton"`` (tier 1 on CUDA; any mask: none, bool, additive; ``is_causal`` or not):
    the inlinable ``attention_triton``, whose body (quantizers, mask planner, kernels) is
    torch ops that Inductor lowers plus Triton launches that it inlines. ``"gluon"`` (tier 2)
    and ``"reference"`` (other devices): the opaque custom op, which runs the Gluon kernel
    or the reference implementation.
    """
    if execution == "triton":
        return torch.ops.qattn.attention_triton.default
    return torch.ops.qattn.attention.default


def execution_path(device: torch.device | str, site: dict | None = None) -> tuple[str, str | None]:
    """Which implementation serves a site on ``device``, and why not tier 2 (a sentence, or
    None): ``("reference", None)`` off CUDA; on CUDA ``("gluon", None)`` when
    :func:`qattn_compile.kernels.tiers.tier2_refusal` finds nothing against ``site`` (a dict
    of its keyword arguments: preset, options, shapes, dtype, masked, scale, causal, softcap), else
    ``("triton", reason)`` (the reason only for presets that have a tier-2 kernel)."""
    if torch.device(device).type != "cuda":
        return "reference", None
    from .kernels.tiers import PRESETS, tier2_refusal

    if site is None or site["preset"] not in PRESETS:
        return "triton", None

    reason = tier2_refusal(site["preset"], site["options"], *site["shapes"], site["dtype"],
                           torch.device(device), masked=site["masked"], scale=site["scale"],
                           causal=site["causal"], softcap=site["softcap"])
    return ("gluon", None) if reason is None else ("triton", reason)


def unsupported_reason(
    q_shape, k_shape, v_shape, dtype: torch.dtype, device, preset: str, options
) -> str | None:
    """Why the op cannot serve these inputs on ``device``, or ``None`` when it can."""
    if tuple(q_shape[:-3]) != tuple(k_shape[:-3]) or tuple(k_shape[:-1]) != tuple(v_shape[:-1]):
        return (f"q {tuple(q_shape)}, k {tuple(k_shape)}, v {tuple(v_shape)} differ in batch "
                "dims or k/v in heads or length (broadcast batches are not served)")
    lead = math.prod(q_shape[:-3])
    reason = shape_refusal((lead, *q_shape[-3:]), (lead, *k_shape[-3:]), (lead, *v_shape[-3:]))
    if reason is not None:
        return reason
    if dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return f"dtype {dtype} (supported: float16, bfloat16, float32; float64 off CUDA)"
    if execution_path(device)[0] != "reference":
        from .kernels import supports

        return supports(q_shape, k_shape, v_shape, dtype, torch.device(device), preset, options)
    return None
