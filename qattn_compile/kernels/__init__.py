"""Triton kernels of qattn: quantizers, smoothing and the templated flash-attention kernel.

Public API (same semantics as :func:`qattn_compile.reference.reference_attention`):

- :func:`kernel_attention` ``(q, k, v, attn_mask=None, is_causal=False, scale=None,
  preset="flash", options=None) -> Tensor``
- :func:`prepare_attention` / :class:`PreparedAttention`: the same, split into operand
  preparation (quantizers) and the attention launch (for benchmarks and cached operands).
- :func:`supports` ``(q_shape, k_shape, v_shape, dtype, device, preset, options) -> str | None``
  (None = supported, else the reason).

Modules: :mod:`.attention` (the one kernel template), :mod:`.quantize` (quantizer/smoothing
kernels), :mod:`.mask` (per-tile mask summary), :mod:`.heuristics` (the launch table),
:mod:`.autotune` (timed tile choice with an on-disk cache), :mod:`.layout` (where the output
is stored), :mod:`.launch` (per-preset operand preparation and the launcher),
:mod:`.primitives` (shared Triton helpers). The FlashQ decode kernel sits with its cache
(:mod:`qattn_compile.kvcache.kernel`). CPU tensors run under ``TRITON_INTERPRET=1`` (tests only).
"""

from .launch import PreparedAttention, kernel_attention, prepare_attention, supports

__all__ = ["PreparedAttention", "kernel_attention", "prepare_attention", "supports"]
