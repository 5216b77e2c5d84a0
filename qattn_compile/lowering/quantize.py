"""The quantizers as torch ops, for Inductor to fuse with their producers.

While torch traces the ``attention_triton`` op (fake or functional tensors: inside
``torch.compile``), :mod:`qattn_compile.kernels.quantize` hands the quantizers that have a
torch form to this module instead of launching its Triton kernels (:func:`decomposed`).
Inductor then generates them and fuses them with what produces Q and K: RoPE, the K
smoothing mean, the per-group INT8 quantization of K and the per-token FP8 quantization
of Q read the projection's output in the same kernels instead of a materialized rotated
tensor. The transposed 8-bit V stays the
Triton quantizer (a projection output straight from cuBLAS has no producer to fuse with,
and its token permutation as torch ops was a gather, 3× slower). SageAttention2 keeps two Triton
kernels of :mod:`qattn_compile.kernels.quantize` (inlined too): its ΔS GEMM (as torch ops it
became an fp32 cuBLAS GEMM plus a pass over its large fp32 output, over twice as slow), which
reads the rotated K, and its smoothed Q quantizer
(:func:`~qattn_compile.kernels.quantize.quantize_int_smoothed`: block means and group
scales in one pass; in torch form Inductor wrote the rotated Q and read it three times).

The math is the reference's own code (:mod:`qattn_compile.reference.quant` and
:mod:`~qattn_compile.reference.smooth`, plain torch ops): the Triton kernels match it bit
for bit on the INT8 and FP8 values; only the order of the sums in the smoothing means may
differ (on CUDA, Inductor's code may also round a scale differently in its last bit).
Shapes: ``x`` ``[B, H, L, D]`` (any float dtype, any strides); scales float32 ``[B, H,
n_groups]``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..reference import quant, smooth


def decomposed(x: Tensor) -> bool:
    """Whether quantizers of ``x`` take their torch form: ``x`` is not a plain tensor, i.e.
    (in practice) a fake or functional tensor while ``torch.compile`` traces."""
    return type(x) is not torch.Tensor


def quantize_int8(
    x: Tensor,
    group: int,
    *,
    scale_mul: float = 1.0,
    mean: Tensor | None = None,
    mean_group: int | None = None,
    amax: Tensor | float | None = None,
) -> tuple[Tensor, Tensor]:
    """Symmetric INT8 over groups of ``group`` tokens (:func:`~qattn_compile.reference.quant.
    quantize_int`); ``(data, scale · scale_mul)``.

    ``mean`` (float32 ``[B, H, n, D]``, row ``t // mean_group`` for token ``t``) is
    subtracted first; ``amax`` is a static amax (float or broadcastable to ``[B, H,
    n_groups]``). ``data``: int8 ``[B, H, L, D]``.
    """
    length = x.shape[-2]
    values = x.float()
    if mean is not None:
        values = values - smooth.expand_blocks(mean, mean_group or length, length)
    data, scale = quant.quantize_int(values, group, 8, amax=amax)
    return data, scale * scale_mul


def quantize_fp8(x: Tensor, group: int, *, scale_mul: float = 1.0) -> tuple[Tensor, Tensor]:
    """FP8 e4m3 over groups of ``group`` tokens (:func:`~qattn_compile.reference.quant.
    quantize_fp8`, scale amax/448); ``(data, scale · scale_mul)``, data float8_e4m3fn
    ``[B, H, L, D]``. Per token, Inductor writes RoPE, the token's amax and the rounding in
    one kernel (a persistent reduction over D), and the scales follow ``x``'s memory: of a
    projection output viewed per head (``[B, L, H, D]`` memory) they are a ``[B, H, L]``
    view of ``[B, L, H]`` memory, which that kernel writes in the order it reads its rows
    (not one float every ``L`` floats, which cost time in the 1K block). On CUDA, Inductor folds the division by 448 into a multiply by its reciprocal, so a
    scale can differ from the kernels' in its last bit (as the INT8 quantizers' can)."""
    if group == 1 and x.stride(1) < x.stride(2):
        # One scale per row of D values: the same rows, named in memory order.
        data, scale = quant.quantize_fp8(x.transpose(1, 2), 1)
        return data.transpose(1, 2), scale.transpose(1, 2) * scale_mul
    data, scale = quant.quantize_fp8(x, group)
    return data, scale * scale_mul


def smooth_mean(x: Tensor, group: int | None = None) -> Tensor:
    """Float32 channel mean per group of ``group`` tokens (default: all of them), ``[B, H,
    n_groups, D]``; the last group may be partial."""
    length = x.shape[-2]
    if group is None or group >= length:
        return x.float().mean(dim=-2, keepdim=True)
    return smooth.block_means(x.float(), group)
