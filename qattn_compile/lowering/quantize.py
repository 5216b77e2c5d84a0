"""The quantizers as torch ops, for Inductor to fuse with their producers.

While torch traces the ``attention_triton`` op (fake or functional tensors: inside
``torch.compile``), :mod:`qattn_compile.kernels.quantize` hands the quantizers that have a
torch form to this module instead of launching its Triton kernels (:func:`decomposed`).
Inductor then generates them and fuses them with what produces Q and K: RoPE, the K
smoothing mean and the per-group INT8 quantization of K read the projection's output in
the same kernels instead of a materialized rotated K. SageAttention2's ΔS stays the Triton
GEMM of :mod:`qattn_compile.kernels.quantize` (inlined too): as torch ops it became an fp32
cuBLAS GEMM plus a pass over its 1 GiB output at 32K tokens, 1.8 ms per layer instead of
0.7 (H100).

The math is the reference's own code (:mod:`qattn_compile.reference.quant` and
:mod:`~qattn_compile.reference.smooth`, plain torch ops): the Triton kernels match it bit
for bit on the INT8 values; only the order of the sums in the smoothing means may differ.
Shapes: ``x`` ``[B, H, L, D]`` (any float dtype, any strides); scales float32 ``[B, H,
n_groups]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..blocks import V_KEY_BLOCK
from ..reference import quant, smooth


def decomposed(x: Tensor) -> bool:
    """Whether quantizers of ``x`` take their torch form: ``x`` is a tracing subclass (fake or
    functional tensor, as inside ``torch.compile``)."""
    return type(x) is not torch.Tensor


def quantize_int8(
    x: Tensor,
    group: int,
    *,
    scale_mul: float = 1.0,
    mean: Tensor | None = None,
    mean_group: int | None = None,
    amax: Tensor | float | None = None,
    transposed_length: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Symmetric INT8 over groups of ``group`` tokens (:func:`~qattn_compile.reference.quant.
    quantize_int`); ``(data, scale · scale_mul)``.

    ``mean`` (float32 ``[B, H, n, D]``, row ``t // mean_group`` for token ``t``) is
    subtracted first; ``amax`` is a static amax (float or broadcastable to ``[B, H,
    n_groups]``). ``data``: int8 ``[B, H, L, D]``, or with ``transposed_length`` int8 ``[B,
    H, D, transposed_length]`` (tokens contiguous in the 8-bit V's storage order, zero-padded:
    the layout of :mod:`qattn_compile.kernels.quantize`).
    """
    length = x.shape[-2]
    values = x.float()
    if mean is not None:
        values = values - smooth.expand_blocks(mean, mean_group or length, length)
    data, scale = quant.quantize_int(values, group, 8, amax=amax)
    if transposed_length is not None:
        # the kernels' storage order of V's tokens, padding zeros; contiguous (TMA-addressable)
        padded = F.pad(data.transpose(-1, -2), (0, transposed_length - length))
        tokens = v_token_of_column(torch.arange(transposed_length, device=data.device))
        data = padded.index_select(-1, tokens).contiguous()
    return data, scale * scale_mul


def v_column_of_token(token: Tensor) -> Tensor:
    """Torch form of :func:`qattn_compile.kernels.primitives.v_column_of_token`: the column of
    the transposed 8-bit V at which each token (int tensor) is stored."""
    offset = token % V_KEY_BLOCK
    return (token - offset) + (offset & 16) + (((offset >> 1) & 3) << 2) \
        + (((offset >> 3) & 1) << 1) + (offset & 1)


def v_token_of_column(column: Tensor) -> Tensor:
    """The inverse of :func:`v_column_of_token`: the token stored at each column."""
    offset = column % V_KEY_BLOCK
    return (column - offset) + (offset & 16) + (((offset >> 1) & 1) << 3) \
        + (((offset >> 2) & 3) << 1) + (offset & 1)


def smooth_mean(x: Tensor, group: int | None = None) -> Tensor:
    """Float32 channel mean per group of ``group`` tokens (default: all of them), ``[B, H,
    n_groups, D]``; the last group may be partial."""
    length = x.shape[-2]
    if group is None or group >= length:
        return x.float().mean(dim=-2, keepdim=True)
    return smooth.block_means(x.float(), group)
