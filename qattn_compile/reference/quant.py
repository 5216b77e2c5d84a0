"""Pure-PyTorch quantizers: the exact arithmetic the quantization kernels mirror.

Layout conventions (every function here): ``x`` is ``[B, H, L, D]`` (batch, head, tokens,
channels). A *token group* is ``group`` consecutive tokens of one (batch, head); it shares one
scale across all its tokens and all ``D`` channels. ``n_groups = ceil(L / group)``; the last
group may be partial (it then holds ``L - (n_groups - 1) * group`` tokens). Group sizes for
the named granularities (``token``/``warp``/``block``/``tensor``) come from
:func:`qattn_compile.blocks.group_sizes`; :func:`group_size` picks the Q or the K/V side.

Arithmetic, stated once so that kernels can match it bit for bit:

- Everything is computed in float32 whatever the input dtype (bf16/fp16/fp32/fp64 inputs are
  converted to float32 first).
- ``amax`` = max |x| over the group, clamped below to :data:`AMAX_MIN` so that an all-zero
  group gets a finite, non-zero scale (its values then quantize to 0).
- Symmetric INT: ``scale = amax / qmax`` (float32 division), ``q = clamp(round(x / scale),
  -qmax, qmax)`` with a true float32 division and ``round`` = round half to even
  (:func:`torch.round`; Triton ``libdevice.rint``, CUDA ``__float2int_rn``; *not*
  ``libdevice.round``, which rounds half away from zero). ``qmax`` is 127 for 8 bits, 7 for 4.
- FP8 e4m3 (``torch.float8_e4m3fn``, largest finite 448): ``scale = amax / 448``,
  ``q = fp8(clamp(x / scale, -448, 448))`` with round-to-nearest-even on the conversion
  (saturating: the clamp keeps values that round above 448 from turning into NaN).
- A value is dequantized as ``q * scale`` (``q`` read as float).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..blocks import group_sizes

INT_QMAX: dict[int, int] = {8: 127, 4: 7}
"""Largest magnitude of a symmetric signed integer of ``num_bits`` bits (the -128/-8 code is
never produced, so the range is symmetric)."""

FP8_E4M3_MAX = 448.0
"""Largest finite value of ``torch.float8_e4m3fn``."""

FP8_DTYPE = torch.float8_e4m3fn

AMAX_MIN = 1e-12
"""Lower clamp on every ``amax`` (float32), so all-zero groups never divide by zero; it is
large enough that ``AMAX_MIN / 448`` is still a normal float32 (kernels that flush
subnormals agree)."""


def ieee_div(numerator: Tensor, denominator: float) -> Tensor:
    """``numerator / denominator`` as a true IEEE division on every device.

    CUDA turns division by a Python number into a multiply by its rounded reciprocal,
    which differs in the last bit for ~1 in 1000 values; the kernels divide exactly.
    """
    return torch.div(numerator, torch.full_like(numerator, denominator))


def int_qmax(num_bits: int) -> int:
    """``qmax`` of a symmetric INT quantizer: 127 for ``num_bits=8``, 7 for ``num_bits=4``."""
    if num_bits not in INT_QMAX:
        raise ValueError(f"num_bits must be 8 or 4, got {num_bits!r}")
    return INT_QMAX[num_bits]


def group_size(granularity: str, side: str, length: int) -> int:
    """Tokens per scale for ``granularity`` on ``side`` (``"q"`` or ``"kv"``).

    ``length`` is the token count of that side (it only matters for ``tensor``, where the
    group is the whole length). Reads :func:`qattn_compile.blocks.group_sizes`.
    """
    if side not in ("q", "kv"):
        raise ValueError(f"side must be 'q' or 'kv', got {side!r}")
    q_group, kv_group = group_sizes(granularity, length, length)
    return q_group if side == "q" else kv_group


def num_groups(length: int, group: int) -> int:
    """Number of token groups of size ``group`` covering ``length`` tokens (last one partial)."""
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    return max(-(-length // group), 1)


def _grouped(x: Tensor, group: int) -> Tensor:
    """``[B, H, L, D]`` -> ``[B, H, n_groups, group, D]``, zero-padding the last group."""
    length = x.shape[-2]
    padded = num_groups(length, group) * group
    if padded != length:
        x = torch.nn.functional.pad(x, (0, 0, 0, padded - length))
    return x.reshape(*x.shape[:-2], padded // group, group, x.shape[-1])


def _amax_of_groups(grouped: Tensor) -> Tensor:
    """Max |x| of each group of ``grouped`` ``[B, H, n_groups, group, D]``, clamped."""
    return grouped.abs().amax(dim=(-2, -1)).clamp_min(AMAX_MIN)


def expand_scales(scale: Tensor, group: int, length: int) -> Tensor:
    """Per-group scales -> per-token scales.

    scale: ``[B, H, n_groups]``. Returns ``[B, H, length, 1]`` (same dtype) where token ``t``
    gets ``scale[..., t // group]``; broadcastable against ``[B, H, length, D]``.
    """
    per_token = scale.repeat_interleave(group, dim=-1)[..., :length]
    return per_token.unsqueeze(-1)


def _amax_or_given(grouped: Tensor, amax: Tensor | float | None) -> Tensor:
    """Dynamic amax of each group of ``grouped`` ``[B, H, n_groups, group, D]``, or a given
    one broadcast to ``[B, H, n_groups]`` (float32)."""
    if amax is None:
        return _amax_of_groups(grouped)
    given = torch.as_tensor(amax, dtype=torch.float32, device=grouped.device)
    return given.clamp_min(AMAX_MIN).broadcast_to(grouped.shape[:-2]).contiguous()


def quantize_int(
    x: Tensor, group: int, num_bits: int = 8, *, amax: Tensor | float | None = None
) -> tuple[Tensor, Tensor]:
    """Symmetric INT quantization over token groups.

    x: ``[B, H, L, D]``; ``group``: tokens per scale; ``num_bits``: 8 (values in [-127, 127])
    or 4 (values in [-7, 7]); ``amax``: optional calibrated amax (static quantization; a
    float or a tensor broadcastable to ``[B, H, n_groups]``), values beyond it saturate.

    Returns ``(q, scale)``: ``q`` int8 ``[B, H, L, D]`` (integer values, also for 4 bits:
    pack them with :func:`pack_int4`), ``scale`` float32 ``[B, H, n_groups]`` with
    ``x ≈ q * scale`` and ``|x - q * scale| <= scale / 2`` inside the range.
    """
    qmax = int_qmax(num_bits)
    # One padded, grouped view feeds both the amax and the division: under torch.compile
    # (qattn_compile.lowering) Inductor then fuses the producer of x (RoPE) into both.
    grouped = _grouped(x.float(), group)
    scale = ieee_div(_amax_or_given(grouped, amax), qmax)
    q = torch.round(grouped / scale[..., None, None]).clamp_(-qmax, qmax)
    return q.reshape(*x.shape[:-2], -1, x.shape[-1])[..., : x.shape[-2], :].to(torch.int8), scale


def quantize_int_granularity(
    x: Tensor, granularity: str, side: str, num_bits: int = 8
) -> tuple[Tensor, Tensor, int]:
    """:func:`quantize_int` with the group taken from ``granularity`` and ``side`` (q / kv).

    Returns ``(q, scale, group)``; shapes as in :func:`quantize_int`.
    """
    group = group_size(granularity, side, x.shape[-2])
    q, scale = quantize_int(x, group, num_bits)
    return q, scale, group


def dequantize(q: Tensor, scale: Tensor, group: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """``q * scale`` for token-group scales (INT or FP8 ``q``).

    q: ``[B, H, L, D]``; scale: ``[B, H, n_groups]``. Returns ``[B, H, L, D]`` in ``dtype``.
    """
    per_token = expand_scales(scale.to(dtype), group, q.shape[-2])
    return q.to(dtype) * per_token


def to_fp8_e4m3(x: Tensor) -> Tensor:
    """Saturating round-to-nearest-even cast to ``torch.float8_e4m3fn`` (same shape).

    Values are clamped to [-448, 448] first (in x's dtype; an unclamped cast would give NaN).
    """
    return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)


def fp8_e4m3_values(x: Tensor) -> Tensor:
    """``to_fp8_e4m3(x)`` read back in x's dtype: the representable e4m3 value nearest x."""
    return to_fp8_e4m3(x).to(x.dtype)


def quantize_fp8(
    x: Tensor, group: int, *, amax: Tensor | float | None = None
) -> tuple[Tensor, Tensor]:
    """FP8 e4m3 quantization over token groups (per tensor: ``group = L``; per block).

    x: ``[B, H, L, D]``. Returns ``(q, scale)``: ``q`` float8_e4m3fn ``[B, H, L, D]``,
    ``scale`` float32 ``[B, H, n_groups]`` = amax / 448; ``x ≈ q * scale``.
    """
    scale = ieee_div(_amax_or_given(_grouped(x.float(), group), amax), FP8_E4M3_MAX)
    per_token = expand_scales(scale, group, x.shape[-2])
    return to_fp8_e4m3(x.float() / per_token), scale


def quantize_fp8_per_channel(x: Tensor) -> tuple[Tensor, Tensor]:
    """FP8 e4m3 quantization with one scale per channel (SageAttention2's V).

    x: ``[B, H, L, D]``. ``scale[b, h, d] = max_t |x[b, h, t, d]| / 448`` (clamped amax).
    Returns ``(q, scale)``: ``q`` float8_e4m3fn ``[B, H, L, D]``, ``scale`` float32
    ``[B, H, D]``; ``x ≈ q * scale[..., None, :]``.
    """
    amax = x.float().abs().amax(dim=-2).clamp_min(AMAX_MIN)
    scale = ieee_div(amax, FP8_E4M3_MAX)
    return to_fp8_e4m3(x.float() / scale.unsqueeze(-2)), scale


def pack_int4(q: Tensor) -> Tensor:
    """Pack 4-bit signed integers two per byte.

    q: integer tensor ``[..., N]`` with values in [-8, 7] (the quantizers give [-7, 7]).
    Returns uint8 ``[..., ceil(N / 2)]``: byte ``i`` holds element ``2i`` in its low nibble
    and ``2i + 1`` in its high nibble, each as a 4-bit two's-complement code
    (``-1 -> 0xF``). An odd ``N`` is padded with a 0 nibble (give ``size=N`` to
    :func:`unpack_int4` to drop it).
    """
    if q.shape[-1] % 2:
        q = torch.nn.functional.pad(q, (0, 1))
    nibbles = q.to(torch.int16) & 0xF
    low, high = nibbles[..., 0::2], nibbles[..., 1::2]
    return (low | (high << 4)).to(torch.uint8)


def unpack_int4(packed: Tensor, size: int | None = None) -> Tensor:
    """Inverse of :func:`pack_int4`.

    packed: uint8 ``[..., M]``. Returns int8 ``[..., 2M]`` (or ``[..., size]``) with values in
    [-8, 7], sign-extended from each nibble (low nibble = even index).
    """
    as_int = packed.to(torch.int16)
    nibbles = torch.stack((as_int & 0xF, (as_int >> 4) & 0xF), dim=-1).flatten(-2)
    signed = torch.where(nibbles >= 8, nibbles - 16, nibbles).to(torch.int8)
    return signed if size is None else signed[..., :size]
