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

The math is the quantizer contract of :mod:`qattn_compile.reference.quant` (float32,
``amax`` clamped to ``AMAX_MIN``, ``scale = amax / 127`` as a true division, values
``clamp(round_half_even(x / scale), -127, 127)``); only the order of the sums in the
smoothing means may differ from the Triton kernels. Shapes: ``x`` ``[B, H, L, D]`` (any
float dtype, any strides); scales float32 ``[B, H, n_groups]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..reference.quant import AMAX_MIN, INT_QMAX

_QMAX = float(INT_QMAX[8])


def decomposed(x: Tensor) -> bool:
    """Whether quantizers of ``x`` take their torch form: ``x`` is a tracing subclass (fake or
    functional tensor, as inside ``torch.compile``)."""
    return type(x) is not torch.Tensor


def _rows_of(table: Tensor, rows_per_entry: int, length) -> Tensor:
    """Per-token rows of a ``[B, H, n, D]`` table whose row ``i`` serves tokens
    ``[i·rows_per_entry, (i+1)·rows_per_entry)``: ``[B, H, length, D]`` (or the table itself
    when one row serves every token)."""
    if table.shape[-2] == 1:
        return table
    return table.repeat_interleave(rows_per_entry, dim=-2)[..., :length, :]


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
    """Symmetric INT8 over groups of ``group`` tokens; ``(data, scale · scale_mul)``.

    ``mean`` (float32 ``[B, H, n, D]``, row ``t // mean_group`` for token ``t``) is
    subtracted first; ``amax`` is a static amax (float or broadcastable to ``[B, H,
    n_groups]``). ``data``: int8 ``[B, H, L, D]``, or with ``transposed_length`` int8 ``[B,
    H, D, transposed_length]`` (tokens contiguous, zero-padded: the 8-bit V layout).
    """
    bsz, heads, length, dim = x.shape
    values = x.float()
    if mean is not None:
        values = values - _rows_of(mean, mean_group or length, length)
    n_groups = -(-length // group)
    grouped = F.pad(values, (0, 0, 0, n_groups * group - length))
    grouped = grouped.reshape(bsz, heads, n_groups, group, dim)
    if amax is None:
        group_amax = grouped.abs().amax(dim=(-2, -1)).clamp_min(AMAX_MIN)
    else:
        given = torch.as_tensor(amax, dtype=torch.float32, device=x.device).clamp_min(AMAX_MIN)
        group_amax = given.broadcast_to((bsz, heads, n_groups))
    scale = torch.div(group_amax, torch.full_like(group_amax, _QMAX))
    q = torch.round(grouped / scale[..., None, None]).clamp(-_QMAX, _QMAX).to(torch.int8)
    data = q.reshape(bsz, heads, n_groups * group, dim)[:, :, :length]
    if transposed_length is not None:
        data = F.pad(data.transpose(-1, -2), (0, transposed_length - length))
    return data, scale * scale_mul


def smooth_mean(x: Tensor, group: int | None = None) -> Tensor:
    """Float32 channel mean per group of ``group`` tokens (default: all of them), ``[B, H,
    n_groups, D]``; the last group may be partial."""
    values = x.float()
    length = x.shape[-2]
    if group is None or group >= length:
        return values.mean(dim=-2, keepdim=True)
    n_groups = -(-length // group)
    padded = F.pad(values, (0, 0, 0, n_groups * group - length))
    sums = padded.reshape(*x.shape[:-2], n_groups, group, x.shape[-1]).sum(dim=-2)
    starts = torch.arange(n_groups, device=x.device, dtype=torch.float32) * group
    counts = (length - starts).clamp(max=group)
    return sums / counts[:, None]
