"""Triton quantizer and smoothing kernels, and their launchers.

The arithmetic is :mod:`qattn_compile.reference.quant`'s, bit for bit on the INT paths:
float32 everywhere, ``amax`` clamped below to ``AMAX_MIN``, ``scale = amax / qmax`` (IEEE
float32 division), ``q = clamp(round_half_even(x / scale), -qmax, qmax)`` with a correctly
rounded division (``tl.div_rn``); FP8 e4m3 ``q = fp8_rne(clamp(x / scale, -448, 448))``.

Layouts (every tensor is ``[B, H, L, D]`` on input, any strides):

- INT8 values: int8 ``[B, H, L, D]`` row-major (D contiguous: K-major for ``Q·Kᵀ``).
- INT4 values: uint8 ``[B, H, L, ceil(D / 2)]``, two per byte, low nibble = even channel.
- 8-bit V for the ``P·V`` dot: ``[B, H, D, L_pad]`` (transposed, token axis contiguous, the
  K-major layout Hopper's 8-bit MMAs need), ``L_pad`` = L rounded up to 32 tokens, tokens
  permuted within blocks of 32 (:func:`~.primitives.v_column_of_token`; the attention
  kernel relabels P the same way), padding tokens 0. :func:`v_in_token_order` undoes it.
- Scales: float32 ``[B, H, n_groups]`` per token group, ``[B, H, D]`` per channel.

Kernels:

- :func:`_token_stats_kernel`: partial channel sums / maxima / minima per chunk of a token
  group; :func:`_stats_finish_kernel` combines them into means and scales (amax / qmax).
  Both run in :func:`token_stats`: K/V smoothing means, large-group and per-channel scales.
- :func:`_quantize_kernel`: quantize a ``BLOCK_T``-token tile; scales either computed in the
  tile (groups that fit in it) or read (large groups, per channel, static amax); optional
  mean subtraction (smoothing; block means read or computed in the tile), INT4 packing,
  transposed output. Its body is :func:`_quantize_tile`, which :func:`_quantize_kv_kernel`
  also runs: fp8's K and transposed V, per in-tile group, in one launch.
- :func:`_delta_s_kernel`: SageAttention2's ``ΔS = q̄·(K − k̄)ᵀ`` per query block.

While torch traces (inside ``torch.compile``), the INT8 and FP8 quantizers and the
smoothing means take their torch form from :mod:`qattn_compile.lowering.quantize` instead,
so that Inductor fuses them with the ops that produce Q and K; the transposed 8-bit V,
:func:`quantize_int_smoothed` (smoothed Q, one pass) and ΔS stay Triton kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..blocks import SMOOTH_Q_BLOCK, V_KEY_BLOCK
from ..lowering import quantize as lowered
from ..reference.quant import AMAX_MIN, FP8_E4M3_MAX, ieee_div, num_groups
from ..reference.quant import INT_QMAX as REF_INT_QMAX
from .heuristics import kv_quant_config, padded_dim, quant_config
from .primitives import (
    interpreted,
    launcher,
    load_tile,
    max_keeping_nan,
    min_keeping_nan,
    pack_int4,
    rint_to_int32,
    store_tile,
    to_fp8_e4m3,
    v_column_of_token,
)

# The quantizer contract's constants come from the reference (one source of truth).
INT_QMAX = {bits: float(qmax) for bits, qmax in REF_INT_QMAX.items()}
FP8_MAX = float(FP8_E4M3_MAX)

# _quantize_kernel's scale sources.
_SCALE_IN_TILE = tl.constexpr(0)  # token groups that fit in one tile: amax computed in-kernel
_SCALE_PER_GROUP = tl.constexpr(1)  # precomputed scale per token group
_SCALE_PER_CHANNEL = tl.constexpr(2)  # precomputed scale per channel

# _quantize_kernel's smoothing: no mean, a given mean (one row per token, or one row for the
# whole tile), or block means computed in the tile.
_MEAN_NONE = tl.constexpr(0)
_MEAN_READ = tl.constexpr(1)
_MEAN_IN_TILE = tl.constexpr(2)
_MEAN_READ_TILE_ROW = tl.constexpr(3)

# _quantize_kernel's output formats.
_OUT_INT = tl.constexpr(0)
_OUT_INT4_PACKED = tl.constexpr(1)
_OUT_FP8 = tl.constexpr(2)

_MAX_TILE_GROUP = 256  # largest token group a quantizer tile reduces by itself
_STATS_CHUNKS = (1024, 512, 256)  # tokens per program of the statistics kernel, longest first
_MIN_PROGRAMS = 512  # the statistics and ΔS kernels split their work finer below this many
_STATS_TILE_ELEMENTS = 4096  # elements per loaded tile there (three running tiles of them)
_DS_KEY_TILES = 8  # key tiles per ΔS program, at most (its q̄ rows are loaded and split once)


@dataclass(frozen=True)
class Quantized:
    """A quantized operand as the attention kernel reads it.

    ``data``: int8 ``[B, H, L, D]``, uint8 packed ``[B, H, L, ceil(D/2)]`` or 8-bit
    transposed ``[B, H, D, L_pad]`` (see the module docstring). ``scale``: float32 ``[B, H,
    n_groups]`` (``group`` tokens per scale) or ``[B, H, D]`` (``per_channel``), already
    multiplied by the launcher's ``scale_mul``. ``mean``: the subtracted smoothing mean
    ``[B, H, n_mean_groups, D]`` (float32) or ``None``. ``colsum``: int32 ``[B, H, n_chunks,
    D]`` channel sums of the quantized values per chunk of tokens, or ``None``.
    """

    data: Tensor
    scale: Tensor
    group: int
    per_channel: bool = False
    transposed: bool = False
    mean: Tensor | None = None
    colsum: Tensor | None = None


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _token_stats_kernel(
    x_ptr, sum_ptr, max_ptr, min_ptr,
    L, D, group, chunks_per_group, n_chunks,
    sxb, sxh, sxl, sxd,
    n_heads,
    CHUNK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Partial channel statistics of one chunk of ≤ ``CHUNK`` tokens (grid ``(n_chunks,
    B*H)``); chunk ``c`` covers tokens ``[g·group + (c mod cpg)·CHUNK, …)`` of token group
    ``g = c // cpg`` (``cpg`` = chunks per group), never crossing a group boundary.

    x: ``[B, H, L, D]``. Writes float32 ``[B*H, n_chunks, D]`` column sums, maxima and
    minima; :func:`_stats_finish_kernel` combines the chunks of each group (a deterministic
    two-level reduction that keeps every SM busy even for one group per head).
    """
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # 64-bit offsets: tensors may pass 2**31 elements
    b = bh // n_heads
    h = bh % n_heads
    x_base = x_ptr + b * sxb + h * sxh
    cols = tl.arange(0, BLOCK_D)
    g = c // chunks_per_group
    start = g * group + (c % chunks_per_group) * CHUNK
    end = tl.minimum(tl.minimum(start + CHUNK, g * group + group), L)
    # Element-wise running sums/extrema over the chunk's tiles, reduced across tokens once at
    # the end (a reduction per tile moves data between threads every iteration).
    tile_sum = tl.zeros((BLOCK_T, BLOCK_D), tl.float32)
    tile_max = tl.full((BLOCK_T, BLOCK_D), float("-inf"), tl.float32)
    tile_min = tl.full((BLOCK_T, BLOCK_D), float("inf"), tl.float32)
    for t0 in range(start, end, BLOCK_T):
        rows = t0 + tl.arange(0, BLOCK_T)
        valid = (rows[:, None] < end) & (cols[None, :] < D)
        x = tl.load(x_base + rows[:, None] * sxl + cols[None, :] * sxd, mask=valid, other=0.0)
        x = x.to(tl.float32)
        tile_sum += x
        tile_max = tl.maximum(tile_max, tl.where(valid, x, float("-inf")),
                              propagate_nan=tl.PropagateNan.ALL)
        tile_min = tl.minimum(tile_min, tl.where(valid, x, float("inf")),
                              propagate_nan=tl.PropagateNan.ALL)
    col_sum = tl.sum(tile_sum, axis=0)
    col_max = max_keeping_nan(tile_max, 0)
    col_min = min_keeping_nan(tile_min, 0)
    out = (bh * n_chunks + c) * D + cols
    tl.store(sum_ptr + out, col_sum, mask=cols < D)
    tl.store(max_ptr + out, col_max, mask=cols < D)
    tl.store(min_ptr + out, col_min, mask=cols < D)


@triton.jit
def _stats_finish_kernel(
    sum_ptr, max_ptr, min_ptr, mean_ptr, scale_ptr,
    L, D, group, chunks_per_group, n_groups,
    CENTER: tl.constexpr, PER_CHANNEL: tl.constexpr, WRITE_SCALE: tl.constexpr,
    QMAX: tl.constexpr, AMAX_FLOOR: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Combine the chunk statistics of one token group (grid ``(n_groups, B*H)``).

    sum/max/min: float32 ``[B*H, n_groups, chunks_per_group, D]`` from
    :func:`_token_stats_kernel`. Writes the channel means ``mean`` float32 ``[B*H, n_groups,
    D]`` (sum over the group's tokens, the last group partial, divided correctly rounded)
    and, with ``WRITE_SCALE``, ``amax / QMAX`` (IEEE division) to ``scale``: ``[B*H,
    n_groups, D]`` per channel, else ``[B*H, n_groups]``; ``amax`` is ``max|x|`` (of ``x −
    mean`` with ``CENTER``) clamped below to ``AMAX_FLOOR``. ``max|x − c| = max(colmax − c,
    c − colmin)`` is exact in float32 (rounding is monotonic), so no second pass over x.
    """
    g = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # 64-bit offsets: tensors may pass 2**31 elements
    cols = tl.arange(0, BLOCK_D)
    base = (bh * n_groups + g) * chunks_per_group * D
    acc_sum = tl.zeros((BLOCK_C, BLOCK_D), tl.float32)
    acc_max = tl.full((BLOCK_C, BLOCK_D), float("-inf"), tl.float32)
    acc_min = tl.full((BLOCK_C, BLOCK_D), float("inf"), tl.float32)
    for c0 in range(0, chunks_per_group, BLOCK_C):
        rows = c0 + tl.arange(0, BLOCK_C)
        valid = (rows[:, None] < chunks_per_group) & (cols[None, :] < D)
        offs = base + rows[:, None] * D + cols[None, :]
        acc_sum += tl.load(sum_ptr + offs, mask=valid, other=0.0)
        acc_max = tl.maximum(acc_max, tl.load(max_ptr + offs, mask=valid, other=float("-inf")),
                             propagate_nan=tl.PropagateNan.ALL)
        acc_min = tl.minimum(acc_min, tl.load(min_ptr + offs, mask=valid, other=float("inf")),
                             propagate_nan=tl.PropagateNan.ALL)
    count = tl.minimum(L - g * group, group).to(tl.float32)
    mean = tl.div_rn(tl.sum(acc_sum, axis=0), tl.full((BLOCK_D,), 1.0, tl.float32) * count)
    out = (bh * n_groups + g) * D + cols
    tl.store(mean_ptr + out, mean, mask=cols < D)
    if WRITE_SCALE:
        col_max = max_keeping_nan(acc_max, 0)
        col_min = min_keeping_nan(acc_min, 0)
        if CENTER:
            amax = tl.maximum(col_max - mean, mean - col_min, propagate_nan=tl.PropagateNan.ALL)
        else:
            amax = tl.maximum(col_max, -col_min, propagate_nan=tl.PropagateNan.ALL)
        # padding channels: -inf, raised to the floor
        amax = tl.maximum(amax, AMAX_FLOOR, propagate_nan=tl.PropagateNan.ALL)
        scale = tl.div_rn(amax, tl.full((BLOCK_D,), QMAX, tl.float32))
        if PER_CHANNEL:
            tl.store(scale_ptr + out, scale, mask=cols < D)
        else:  # rounding is monotonic: the largest quotient is the largest amax's quotient
            tl.store(scale_ptr + bh * n_groups + g, max_keeping_nan(scale, 0))


@triton.jit
def _quantize_tile(
    x_ptr, mean_ptr, scale_in_ptr, q_ptr, scale_out_ptr, colsum_ptr,
    pid_t, bh,
    L, L_out, D, n_heads, mean_group, scale_group, scale_mul,
    sxb, sxh, sxl, sxd,
    smb, smh, smg,
    ssb, ssh, ssg,
    sqb, sqh, sql, sqd,
    n_groups_out, n_colsum,
    QMAX: tl.constexpr, AMAX_FLOOR: tl.constexpr,
    SCALE_MODE: tl.constexpr, GROUP: tl.constexpr,
    MEAN_MODE: tl.constexpr, MEAN_GROUP: tl.constexpr,
    OUT_FMT: tl.constexpr, EXACT_FP8: tl.constexpr, COLSUM: tl.constexpr,
    V_ORDER: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Quantize tokens ``[pid_t · BLOCK_T, (pid_t + 1) · BLOCK_T)`` of (batch, head) ``bh``
    (flattened ``b · n_heads + h``): the body of :func:`_quantize_kernel` and of
    :func:`_quantize_kv_kernel`.

    x: ``[B, H, L, D]``; mean ``[B, H, n, D]`` float32, token ``t`` subtracts row ``t //
    mean_group`` (strides ``smb, smh, smg``; channel stride 1): read per token (``MEAN_MODE``
    = ``_MEAN_READ``), read once per tile when all its tokens share one row
    (``_MEAN_READ_TILE_ROW``), or computed here and written (``_MEAN_IN_TILE``: blocks of
    ``MEAN_GROUP`` = ``mean_group`` tokens, a power of two dividing ``BLOCK_T``; the mean
    of a partial last block is over its tokens), so that smoothing reads x once.
    Scales (``SCALE_MODE``): in-tile groups of ``GROUP`` tokens (power of two dividing
    ``BLOCK_T``), written ``* scale_mul`` to ``scale_out`` ``[B*H, n_groups_out]``; or read
    from ``scale_in`` per group (token ``t`` → ``t // scale_group``, strides ``ssb, ssh,
    ssg``; also written ``* scale_mul`` to ``scale_out``) or per channel (channel ``d`` at
    ``ssg * d``).
    Output (``OUT_FMT``): INT (int8), INT4 packed (int8 bytes, ``sqd`` = 1 byte per pair of
    channels) or FP8 e4m3, at strides ``sqb, sqh, sql, sqd`` (transposed layouts are strides),
    tokens ``< L_out`` (``L_out`` > ``L``: padding tokens written as 0). ``V_ORDER``: token
    ``t`` goes to position :func:`~.primitives.v_column_of_token` ``(t)`` (the 8-bit V).
    ``COLSUM`` > 0 (INT only): also the int32 channel sums of the quantized values per chunk
    of ``COLSUM`` tokens, ``colsum[bh, chunk, d]`` (``[B*H, n_colsum, D]`` contiguous).
    """
    bh = bh.to(tl.int64)  # 64-bit offsets: tensors may pass 2**31 elements
    b = bh // n_heads
    h = bh % n_heads
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_D)
    valid = (rows[:, None] < L) & (cols[None, :] < D)
    x = load_tile(x_ptr + b * sxb + h * sxh, rows, cols, sxl, sxd, L, D, 0.0).to(tl.float32)
    if MEAN_MODE == _MEAN_READ:
        mean = load_tile(mean_ptr + b * smb + h * smh, rows // mean_group, cols, smg, 1,
                         tl.cdiv(L, mean_group), D, 0.0)
        x = tl.where(valid, x - mean, 0.0)
    elif MEAN_MODE == _MEAN_READ_TILE_ROW:
        row = (pid_t * BLOCK_T) // mean_group
        mean = tl.load(mean_ptr + b * smb + h * smh + row * smg + cols, mask=cols < D, other=0.0)
        x = tl.where(valid, x - mean[None, :], 0.0)
    elif MEAN_MODE == _MEAN_IN_TILE:
        blocks: tl.constexpr = BLOCK_T // MEAN_GROUP
        block_idx = pid_t * blocks + tl.arange(0, blocks)
        counts = tl.minimum(L - block_idx * MEAN_GROUP, MEAN_GROUP).to(tl.float32)
        sums = tl.sum(tl.reshape(x, (blocks, MEAN_GROUP, BLOCK_D)), axis=1)  # x is 0 off L
        block_mean = tl.div_rn(sums, tl.maximum(counts, 1.0)[:, None])
        store_tile(mean_ptr + b * smb + h * smh, block_mean, block_idx, cols, smg, 1,
                   tl.cdiv(L, MEAN_GROUP), D)
        mean = tl.reshape(tl.broadcast_to(block_mean[:, None, :], (blocks, MEAN_GROUP, BLOCK_D)),
                          (BLOCK_T, BLOCK_D))
        x = tl.where(valid, x - mean, 0.0)
    if SCALE_MODE == _SCALE_IN_TILE:
        groups: tl.constexpr = BLOCK_T // GROUP
        row_amax = max_keeping_nan(tl.abs(x), 1)
        amax = max_keeping_nan(tl.reshape(row_amax, (groups, GROUP)), 1)
        amax = tl.maximum(amax, AMAX_FLOOR, propagate_nan=tl.PropagateNan.ALL)
        scale_g = tl.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32))
        g_idx = pid_t * groups + tl.arange(0, groups)
        tl.store(scale_out_ptr + bh * n_groups_out + g_idx, scale_g * scale_mul,
                 mask=g_idx < n_groups_out)
        scale = tl.reshape(tl.broadcast_to(scale_g[:, None], (groups, GROUP)), (BLOCK_T,))
        scale = scale[:, None]
    elif SCALE_MODE == _SCALE_PER_GROUP:
        s_base = scale_in_ptr + b * ssb + h * ssh
        row_scale = tl.load(s_base + (rows // scale_group) * ssg, mask=rows < L, other=1.0)
        # Each group's first token writes the group's scale times scale_mul to scale_out.
        tl.store(scale_out_ptr + bh * n_groups_out + rows // scale_group, row_scale * scale_mul,
                 mask=(rows < L) & (rows % scale_group == 0))
        scale = row_scale[:, None]
    else:
        s_base = scale_in_ptr + b * ssb + h * ssh
        scale = tl.load(s_base + cols * ssg, mask=cols < D, other=1.0)
        scale = scale[None, :]
    y = tl.minimum(tl.maximum(tl.div_rn(x, scale), -QMAX), QMAX)
    q_base = q_ptr + b * sqb + h * sqh
    if V_ORDER:
        out_rows = v_column_of_token(rows)
    else:
        out_rows = rows
    if OUT_FMT == _OUT_FP8:
        store_tile(q_base, to_fp8_e4m3(y, EXACT_FP8), out_rows, cols, sql, sqd, L_out, D)
    elif OUT_FMT == _OUT_INT4_PACKED:
        packed = pack_int4(rint_to_int32(y).to(tl.int8), BLOCK_T, BLOCK_D)
        half_cols = tl.arange(0, BLOCK_D // 2)
        store_tile(q_base, packed, rows, half_cols, sql, sqd, L, (D + 1) // 2)
    else:
        q_int = rint_to_int32(y)
        store_tile(q_base, q_int.to(tl.int8), out_rows, cols, sql, sqd, L_out, D)
        if COLSUM > 0:
            chunks: tl.constexpr = BLOCK_T // COLSUM
            sums = tl.sum(tl.reshape(q_int, (chunks, COLSUM, BLOCK_D)), axis=1)
            c_idx = pid_t * chunks + tl.arange(0, chunks)
            store_tile(colsum_ptr + bh * n_colsum * D, sums, c_idx, cols, D, 1, n_colsum, D)


@triton.jit
def _quantize_kernel(
    x_ptr, mean_ptr, scale_in_ptr, q_ptr, scale_out_ptr, colsum_ptr,
    L, L_out, D, n_heads, mean_group, scale_group, scale_mul,
    sxb, sxh, sxl, sxd,
    smb, smh, smg,
    ssb, ssh, ssg,
    sqb, sqh, sql, sqd,
    n_groups_out, n_colsum,
    QMAX: tl.constexpr, AMAX_FLOOR: tl.constexpr,
    SCALE_MODE: tl.constexpr, GROUP: tl.constexpr,
    MEAN_MODE: tl.constexpr, MEAN_GROUP: tl.constexpr,
    OUT_FMT: tl.constexpr, EXACT_FP8: tl.constexpr, COLSUM: tl.constexpr,
    V_ORDER: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One tile of :func:`_quantize_tile` per program (grid ``(cdiv(L, BLOCK_T), B*H)``)."""
    _quantize_tile(
        x_ptr, mean_ptr, scale_in_ptr, q_ptr, scale_out_ptr, colsum_ptr,
        tl.program_id(0), tl.program_id(1),
        L, L_out, D, n_heads, mean_group, scale_group, scale_mul,
        sxb, sxh, sxl, sxd, smb, smh, smg, ssb, ssh, ssg, sqb, sqh, sql, sqd,
        n_groups_out, n_colsum,
        QMAX, AMAX_FLOOR, SCALE_MODE, GROUP, MEAN_MODE, MEAN_GROUP, OUT_FMT, EXACT_FP8, COLSUM,
        V_ORDER, BLOCK_T, BLOCK_D,
    )


@triton.jit
def _quantize_kv_kernel(
    k_ptr, v_ptr, kq_ptr, vq_ptr, k_scale_ptr, v_scale_ptr,
    L, L_pad, D, n_heads, n_groups,
    skb, skh, skl, skd,
    svb, svh, svl, svd,
    sqkb, sqkh, sqkl, sqkd,
    sqvb, sqvh, sqvl, sqvd,
    QMAX: tl.constexpr, AMAX_FLOOR: tl.constexpr, GROUP: tl.constexpr,
    OUT_FMT: tl.constexpr, EXACT_FP8: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """K row-major and V transposed (the 8-bit V) in one launch, scales per in-tile group of
    ``GROUP`` tokens, no smoothing (grid ``(cdiv(L, BLOCK_T) + cdiv(L_pad, BLOCK_T), B*H)``:
    K's tiles, then V's). K and V have one shape ``[B, H, L, D]``; two short passes are
    latency-bound, one launch of twice the programs is not (docs/performance.md).
    """
    n_tiles = tl.cdiv(L, BLOCK_T)
    pid = tl.program_id(0)
    if pid < n_tiles:
        _quantize_tile(
            k_ptr, k_scale_ptr, k_scale_ptr, kq_ptr, k_scale_ptr, k_scale_ptr,
            pid, tl.program_id(1),
            L, L, D, n_heads, 1, GROUP, 1.0,
            skb, skh, skl, skd, 0, 0, 0, 0, 0, 0, sqkb, sqkh, sqkl, sqkd,
            n_groups, 0,
            QMAX, AMAX_FLOOR, _SCALE_IN_TILE, GROUP, _MEAN_NONE, 1, OUT_FMT, EXACT_FP8, 0,
            False, BLOCK_T, BLOCK_D,
        )
    else:
        _quantize_tile(
            v_ptr, v_scale_ptr, v_scale_ptr, vq_ptr, v_scale_ptr, v_scale_ptr,
            pid - n_tiles, tl.program_id(1),
            L, L_pad, D, n_heads, 1, GROUP, 1.0,
            svb, svh, svl, svd, 0, 0, 0, 0, 0, 0, sqvb, sqvh, sqvl, sqvd,
            n_groups, 0,
            QMAX, AMAX_FLOOR, _SCALE_IN_TILE, GROUP, _MEAN_NONE, 1, OUT_FMT, EXACT_FP8, 0,
            True, BLOCK_T, BLOCK_D,
        )


@triton.jit
def _delta_s_kernel(
    qmean_ptr, k_ptr, kmean_ptr, out_ptr,
    Lkv, D, n_blocks, hq_per_kv, n_heads_q, scale_mul,
    skb, skh, skl, skd,
    SUB_K_MEAN: tl.constexpr, PRECISION: tl.constexpr, SPLIT_Q: tl.constexpr,
    CAUSAL: tl.constexpr,
    Q_BLOCK: tl.constexpr, TILES: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """SageAttention2's ΔS: ``ΔS[b, hq, blk, n] = scale_mul · Σ_d q̄[b, hq, blk, d] ·
    (k[b, hkv, n, d] − k̄[b, hkv, d])`` with ``hkv = hq // hq_per_kv``.

    qmean: float32 ``[B, Hq, n_blocks, D]`` contiguous; k: ``[B, Hkv, Lkv, D]`` (strides);
    kmean: float32 ``[B, Hkv, 1, D]`` contiguous (``SUB_K_MEAN``); out: float32 ``[B, Hq,
    n_blocks, Lkv]`` contiguous. Grid ``(cdiv(Lkv, TILES·BLOCK_T), cdiv(n_blocks, BLOCK_B),
    B*Hq)``: ``TILES`` ``[BLOCK_B, BLOCK_T]`` tiles of ΔS, ``q̄·Kᵀ − q̄·k̄`` (the mean's term
    one value per q̄ row), q̄ loaded once per program. The dot keeps float32 accuracy on
    tensor cores: ``SPLIT_Q`` (16-bit K, exact in its dtype): q̄ as the sum of three terms
    in K's dtype (24 significant bits), three 16-bit dots into one float32 accumulator;
    otherwise K in float32 and a dot of ``PRECISION`` (``tf32x3``; ``ieee`` under the
    interpreter).

    ``CAUSAL``: key tiles that start two query blocks (``Q_BLOCK`` tokens each) beyond the
    program's last block are not computed. A causal attention kernel reads block ``blk``'s
    row only for key tiles that start before ``(blk + 1)·Q_BLOCK`` (tiles of at most
    ``2·Q_BLOCK`` keys, aligned to their size), so those entries are never read and stay
    unwritten: half the output's writes at long lengths.
    """
    pid_t = tl.program_id(0)
    pid_b = tl.program_id(1)
    # 64-bit offsets: ΔS passes 2**31 elements from ~93K tokens (B=1, 32 heads)
    bhq = tl.program_id(2).to(tl.int64)
    b = bhq // n_heads_q
    hq = bhq % n_heads_q
    hkv = hq // hq_per_kv
    n_heads_kv = n_heads_q // hq_per_kv
    blocks = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = tl.arange(0, BLOCK_D)
    qm = load_tile(qmean_ptr + bhq * n_blocks * D, blocks, cols, D, 1, n_blocks, D, 0.0)
    if SUB_K_MEAN:
        kmean = tl.load(kmean_ptr + (b * n_heads_kv + hkv) * D + cols, mask=cols < D, other=0.0)
        row_term = tl.sum(qm * kmean[None, :], axis=1)
    else:
        row_term = tl.zeros((BLOCK_B,), tl.float32)
    if SPLIT_Q:
        q_hi = qm.to(k_ptr.dtype.element_ty)
        rest = qm - q_hi.to(tl.float32)
        q_mid = rest.to(k_ptr.dtype.element_ty)
        q_lo = (rest - q_mid.to(tl.float32)).to(k_ptr.dtype.element_ty)
    start = pid_t * (TILES * BLOCK_T)
    end = tl.minimum(start + TILES * BLOCK_T, Lkv)
    if CAUSAL:
        end = tl.minimum(end, (pid_b * BLOCK_B + BLOCK_B + 1) * Q_BLOCK)
    for t0 in range(start, end, BLOCK_T):
        rows = t0 + tl.arange(0, BLOCK_T)
        k = load_tile(k_ptr + b * skb + hkv * skh, rows, cols, skl, skd, Lkv, D, 0.0)
        if SPLIT_Q:
            k_t = tl.trans(k)
            ds = tl.dot(q_lo, k_t)
            ds = tl.dot(q_mid, k_t, ds)
            ds = tl.dot(q_hi, k_t, ds)
        else:
            ds = tl.dot(qm, tl.trans(k.to(tl.float32)), input_precision=PRECISION)
        ds = (ds - row_term[:, None]) * scale_mul
        store_tile(out_ptr + bhq * n_blocks * Lkv, ds, blocks, rows, Lkv, 1, n_blocks, Lkv)


# ----------------------------------------------------------------------------- launchers


def _stats_chunk(heads: int, length: int, group: int) -> int:
    """Tokens per program of :func:`_token_stats_kernel` for ``heads`` (batch × heads) of
    ``length`` tokens in groups of ``group``: the longest of :data:`_STATS_CHUNKS` that still
    makes :data:`_MIN_PROGRAMS` programs (else the shortest), at most the group rounded up to
    a power of two. Longer chunks spread each program's fixed work (three cross-warp
    reductions, three stores) over more loads; too few programs leave SMs idle."""
    n_groups = num_groups(length, group)
    for chunk in _STATS_CHUNKS:
        if n_groups * triton.cdiv(max(group, 1), chunk) * heads >= _MIN_PROGRAMS:
            break
    return min(chunk, triton.next_power_of_2(max(group, 1)))


def token_stats(
    x: Tensor, group: int, *, center: bool, per_channel: bool, qmax: float | None = None
) -> tuple[Tensor, Tensor | None]:
    """Channel means per token group and, given ``qmax``, the quantization scale ``amax /
    qmax`` (IEEE float32 division) of each group or channel. Two launches: the partial
    statistics per chunk of tokens, then their combination per group.

    x: ``[B, H, L, D]``; ``group``: tokens per group (``L`` = whole tensor). Returns
    ``(mean, scale)``: mean float32 ``[B, H, n_groups, D]``; scale float32 ``[B, H,
    n_groups, D]`` (``per_channel``) or ``[B, H, n_groups]`` from the absmax of ``x`` (of
    ``x - mean`` when ``center``) clamped below to ``AMAX_MIN``, or None without ``qmax``.
    """
    bsz, heads, length, dim = x.shape
    n_groups = num_groups(length, group)
    cfg = quant_config(dim, x.device)
    chunk = _stats_chunk(bsz * heads, length, group)
    chunks_per_group = triton.cdiv(max(group, 1), chunk)
    n_chunks = n_groups * chunks_per_group
    # Separate buffers, not views of one: under torch.compile a kernel writing into views
    # makes functionalization copy each view out of the base.
    sums, maxs, mins = (torch.empty((bsz, heads, n_chunks, dim), device=x.device,
                                    dtype=torch.float32) for _ in range(3))
    interpreted(x.device)
    launcher(_token_stats_kernel, x)[(n_chunks, bsz * heads)](
        x, sums, maxs, mins, length, dim, group, chunks_per_group, n_chunks,
        *x.stride(), heads, CHUNK=chunk,
        BLOCK_T=min(max(_STATS_TILE_ELEMENTS // padded_dim(dim), 1), chunk),
        BLOCK_D=padded_dim(dim), num_warps=cfg.num_warps,
    )
    mean = torch.empty((bsz, heads, n_groups, dim), device=x.device, dtype=torch.float32)
    # Without qmax the kernel writes no scale; a one-element stand-in of its own (one tensor
    # passed as two arguments is copied apart under torch.compile).
    scale_shape = (bsz, heads, n_groups, dim) if per_channel else (bsz, heads, n_groups)
    scale = torch.empty(scale_shape if qmax is not None else (1,), device=x.device,
                        dtype=torch.float32)
    block_c = min(triton.next_power_of_2(chunks_per_group),
                  max(_STATS_TILE_ELEMENTS // padded_dim(dim), 1))
    launcher(_stats_finish_kernel, x)[(n_groups, bsz * heads)](
        sums, maxs, mins, mean, scale,
        length, dim, group, chunks_per_group, n_groups,
        CENTER=center, PER_CHANNEL=per_channel, WRITE_SCALE=qmax is not None,
        QMAX=float(qmax or 1.0), AMAX_FLOOR=AMAX_MIN, BLOCK_C=block_c,
        BLOCK_D=padded_dim(dim), num_warps=cfg.num_warps,
    )
    return mean, None if qmax is None else scale


def _launch_quantize(
    x: Tensor,
    out: Tensor,
    out_strides: tuple[int, int, int, int],
    *,
    qmax: float,
    out_fmt: int,
    group: int,
    scale_in: Tensor | None,
    per_channel: bool,
    mean: Tensor | None,
    mean_group: int,
    scale_mul: float,
    mean_in_tile: bool = False,
    colsum: Tensor | None = None,
    colsum_chunk: int = 0,
    transposed: bool = False,
) -> Tensor:
    """Run :func:`_quantize_kernel` over ``x`` ``[B, H, L, D]`` into ``out`` (given strides;
    ``transposed``: ``out`` is the 8-bit V ``[B, H, D, L_pad]``, tokens in its order and the
    padding written as zeros).

    ``scale_in`` ``None``: scales computed per in-tile group of ``group`` tokens; otherwise
    ``scale_in`` (float32 ``[B, H, n_groups]``, or ``[B, H, D]`` with ``per_channel``) is
    used. Returns the group scales times ``scale_mul`` (float32 ``[B, H, n_groups]``), or
    ``None`` with ``per_channel``.
    ``mean``: float32 ``[B, H, n, D]`` subtracted per ``mean_group`` tokens; with
    ``mean_in_tile`` the kernel computes it (``mean_group`` a power of two) and writes it there.
    ``colsum``: int32 ``[B, H, n_chunks, D]`` filled with per-``colsum_chunk`` channel sums.
    """
    bsz, heads, length, dim = x.shape
    in_tile = scale_in is None
    min_tokens = max(group if in_tile else 1, colsum_chunk, mean_group if mean_in_tile else 1)
    cfg = quant_config(dim, x.device, min_tokens)
    block_t = cfg.block_t
    n_groups = num_groups(length, group)

    # Operands the kernel does not touch get one-element stand-ins of their own (one tensor
    # passed as several arguments is copied apart under torch.compile).
    def absent() -> Tensor:
        return torch.empty(1, device=x.device, dtype=torch.float32)

    scale_out = absent() if per_channel else torch.empty((bsz, heads, n_groups),
                                                          device=x.device, dtype=torch.float32)
    if in_tile:
        mode, sin, sin_strides = int(_SCALE_IN_TILE), absent(), (0, 0, 0)
    elif per_channel:
        mode, sin, sin_strides = int(_SCALE_PER_CHANNEL), scale_in, scale_in.stride()
    else:
        mode, sin, sin_strides = int(_SCALE_PER_GROUP), scale_in, scale_in.stride()
    mean_t = mean if mean is not None else absent()
    mean_strides = mean.stride()[:3] if mean is not None else (0, 0, 0)
    if mean is None:
        mean_mode = _MEAN_NONE
    elif mean_in_tile:
        mean_mode = _MEAN_IN_TILE
    elif not transposed and (mean_group % block_t == 0 or mean_group >= length):
        # Every tile's tokens share one mean row (K's mean over all tokens): one [D] load per
        # program instead of a [BLOCK_T, D] gather of the same row, faster for K. The
        # transposed 8-bit V (smooth_v) keeps the gather: there the row load was slower.
        mean_mode = _MEAN_READ_TILE_ROW
    else:
        mean_mode = _MEAN_READ
    exact = interpreted(x.device)
    out_length = out.shape[-1] if transposed else length  # the padding tokens get tiles too
    launcher(_quantize_kernel, x)[(triton.cdiv(out_length, block_t), bsz * heads)](
        x, mean_t, sin, out, scale_out, colsum if colsum is not None else absent(),
        length, out_length, dim, heads, mean_group, group,
        scale_mul, *x.stride(), *mean_strides, *sin_strides, *out_strides, n_groups,
        colsum.shape[2] if colsum is not None else 0,
        QMAX=qmax, AMAX_FLOOR=AMAX_MIN, SCALE_MODE=mode, GROUP=group if in_tile else 1,
        MEAN_MODE=int(mean_mode), MEAN_GROUP=mean_group if mean_in_tile else 1,
        OUT_FMT=out_fmt, EXACT_FP8=exact,
        COLSUM=colsum_chunk if colsum is not None else 0, V_ORDER=transposed,
        BLOCK_T=block_t, BLOCK_D=padded_dim(dim), num_warps=cfg.num_warps,
    )
    return None if per_channel else scale_out


def _fits_in_tile(group: int) -> bool:
    """Whether token groups of ``group`` tokens are reduced inside one quantizer tile (a
    power of two of at most :data:`_MAX_TILE_GROUP` tokens)."""
    return group <= _MAX_TILE_GROUP and group & (group - 1) == 0


def _group_scale(
    x: Tensor, group: int, qmax: float, mean: Tensor | None, amax: Tensor | float | None
) -> Tensor:
    """Per-group quantization scale ``amax / qmax`` (float32 ``[B, H, n_groups]``) for groups
    too large for one tile, or from a given (static, calibrated) ``amax``."""
    bsz, heads, length, _ = x.shape
    n_groups = num_groups(length, group)
    if amax is None:
        if mean is not None:
            raise NotImplementedError("large-group quantization of a smoothed tensor")
        return token_stats(x, group, center=False, per_channel=False, qmax=qmax)[1]
    amax_t = torch.as_tensor(amax, dtype=torch.float32, device=x.device)
    amax_t = amax_t.clamp_min(AMAX_MIN).broadcast_to((bsz, heads, n_groups)).contiguous()
    return ieee_div(amax_t, qmax)


def quantize_int(
    x: Tensor,
    group: int,
    num_bits: int = 8,
    *,
    scale_mul: float = 1.0,
    mean: Tensor | None = None,
    mean_group: int | None = None,
    amax: Tensor | float | None = None,
    transpose: bool = False,
    colsum_chunk: int = 0,
) -> Quantized:
    """Symmetric INT8/INT4 quantization over token groups (reference ``quantize_int``).

    x: ``[B, H, L, D]`` (fp16/bf16/fp32). ``group``: tokens per scale (``L`` for per tensor).
    ``num_bits=4`` packs two values per byte (uint8 ``[B, H, L, ceil(D/2)]``).
    ``scale_mul`` multiplies the stored scales (e.g. softmax scale · log2(e) folded into Q's
    scale); it does not change the quantized values. ``mean`` (float32 ``[B, H, n, D]``):
    subtracted first, token ``t`` using row ``t // mean_group`` (smoothing); ``amax``: a
    static amax (float or broadcastable to ``[B, H, n_groups]``). ``transpose``: write int8
    ``[B, H, D, L_pad]`` (the layout of V for the ``P·V`` dot). ``colsum_chunk`` > 0 (8 bits):
    also return the int32 channel sums of the quantized values per chunk of that many
    tokens, ``[B, H, ceil(L / chunk), D]`` (fmha_int8's UINT8-P correction).
    """
    if num_bits == 8 and not colsum_chunk and not transpose and lowered.decomposed(x):
        data, scale = lowered.quantize_int8(x, group, scale_mul=scale_mul, mean=mean,
                                            mean_group=mean_group, amax=amax)
        return Quantized(data, scale, group, mean=mean)
    qmax = INT_QMAX[num_bits]
    bsz, heads, length, dim = x.shape
    data, view, out_fmt = _alloc_int(x, num_bits, transpose)
    strides = _value_strides(view, transpose)
    in_tile = amax is None and _fits_in_tile(group)
    scale_in = None if in_tile else _group_scale(x, group, qmax, mean, amax)
    mean_group = mean_group or max(length, 1)
    colsum = None
    if colsum_chunk:
        n_chunks = triton.cdiv(max(length, 1), colsum_chunk)
        colsum = torch.empty((bsz, heads, n_chunks, dim), device=x.device, dtype=torch.int32)
    scale = _launch_quantize(
        x, view, strides, qmax=qmax, out_fmt=out_fmt, group=group, scale_in=scale_in,
        per_channel=False, mean=mean, mean_group=mean_group, scale_mul=scale_mul,
        colsum=colsum, colsum_chunk=colsum_chunk, transposed=transpose,
    )
    return Quantized(data, scale, group, transposed=transpose, mean=mean,
                     colsum=colsum)


def quantize_int_smoothed(
    x: Tensor, group: int, num_bits: int = 8, *, mean_group: int, scale_mul: float = 1.0
) -> Quantized:
    """:func:`quantize_int` of ``x`` minus its channel means per block of ``mean_group``
    tokens (SageAttention2's Q smoothing), the means computed by the quantizer itself: one
    read of ``x`` instead of a statistics pass and a quantizing pass. ``Quantized.mean``
    holds them, float32 ``[B, H, ceil(L / mean_group), D]`` (a partial last block averages
    its own tokens).

    ``group`` and ``mean_group`` are powers of two, ``group ≤ mean_group ≤``
    :data:`_MAX_TILE_GROUP` (SageAttention2's granularities: 1, 16 or 128 tokens per scale,
    128 per mean). This runs the Triton kernel also while torch traces: Inductor cannot do
    it in one pass (the block means and the group absmax are reductions over different token
    sets, so it wrote the rotated Q once and read it three times).
    """
    if not (_fits_in_tile(group) and _fits_in_tile(mean_group) and group <= mean_group):
        raise ValueError(f"smoothed quantization in one pass needs power-of-two groups with "
                         f"group ≤ mean_group ≤ {_MAX_TILE_GROUP}; got group={group}, "
                         f"mean_group={mean_group}")
    bsz, heads, length, dim = x.shape
    data, view, out_fmt = _alloc_int(x, num_bits, False)
    mean = torch.empty((bsz, heads, num_groups(length, mean_group), dim), device=x.device,
                       dtype=torch.float32)
    scale = _launch_quantize(
        x, view, _value_strides(view, False), qmax=INT_QMAX[num_bits], out_fmt=out_fmt,
        group=group, scale_in=None, per_channel=False, mean=mean, mean_group=mean_group,
        scale_mul=scale_mul, mean_in_tile=True,
    )
    return Quantized(data, scale, group, mean=mean)


def _fp8_decomposed(x: Tensor, group: int) -> bool:
    """Whether FP8 quantization of ``x`` over ``group`` tokens takes its torch form: while
    torch traces, per token (Inductor fuses RoPE, the amax over D and the rounding into one
    kernel) and for groups larger than a tile, i.e. per tensor (Inductor's split reduction
    beat :func:`token_stats`); other groups that fit a tile stay one pass of
    :func:`_quantize_kernel`, which Inductor's reduction kernel plus rounding kernel lost to
    in the 1K block (docs/performance.md)."""
    return lowered.decomposed(x) and (group == 1 or not _fits_in_tile(group))


def quantize_fp8(
    x: Tensor,
    group: int,
    *,
    scale_mul: float = 1.0,
    transpose: bool = False,
) -> Quantized:
    """FP8 e4m3 quantization over token groups (reference ``quantize_fp8``), scale amax/448.

    x: ``[B, H, L, D]``. Returns float8_e4m3fn ``[B, H, L, D]`` or, with ``transpose``,
    ``[B, H, D, L_pad]``; scales float32 ``[B, H, n_groups]`` times ``scale_mul``. While
    torch traces, the torch form where :func:`_fp8_decomposed` says.
    """
    if not transpose and _fp8_decomposed(x, group):
        data, scale = lowered.quantize_fp8(x, group, scale_mul=scale_mul)
        return Quantized(data, scale, group)
    data = _alloc_8bit(x, torch.float8_e4m3fn, transpose)
    in_tile = _fits_in_tile(group)
    scale_in = None if in_tile else _group_scale(x, group, FP8_MAX, None, None)
    scale = _launch_quantize(
        x, data, _value_strides(data, transpose), qmax=FP8_MAX, out_fmt=int(_OUT_FP8),
        group=group, scale_in=scale_in, per_channel=False, mean=None, mean_group=1,
        scale_mul=scale_mul, transposed=transpose,
    )
    return Quantized(data, scale, group, transposed=transpose)


def quantize_fp8_kv(k: Tensor, v: Tensor, group: int) -> tuple[Quantized, Quantized]:
    """:func:`quantize_fp8` of K (row-major) and of V (``transpose``, the 8-bit V) over
    groups of ``group`` tokens, in one launch of :func:`_quantize_kv_kernel` when the groups
    fit a tile, K and V have one shape (``[B, H, L, D]``) and K does not take its torch form
    (:func:`_fp8_decomposed`); otherwise two calls."""
    if k.shape != v.shape or not _fits_in_tile(group) or _fp8_decomposed(k, group):
        return quantize_fp8(k, group), quantize_fp8(v, group, transpose=True)
    bsz, heads, length, dim = k.shape
    k_data = _alloc_8bit(k, torch.float8_e4m3fn, False)
    v_data = _alloc_8bit(v, torch.float8_e4m3fn, True)
    n_groups = num_groups(length, group)
    k_scale, v_scale = (torch.empty((bsz, heads, n_groups), device=k.device, dtype=torch.float32)
                        for _ in range(2))
    cfg = kv_quant_config(dim, k.device, group)
    # K's tiles, then V's over its padded length (its padding tokens written as zeros)
    grid = (triton.cdiv(length, cfg.block_t) + triton.cdiv(v_data.shape[-1], cfg.block_t),
            bsz * heads)
    launcher(_quantize_kv_kernel, k)[grid](
        k, v, k_data, v_data, k_scale, v_scale, length, v_data.shape[-1], dim, heads, n_groups,
        *k.stride(), *v.stride(), *_value_strides(k_data, False), *_value_strides(v_data, True),
        QMAX=FP8_MAX, AMAX_FLOOR=AMAX_MIN, GROUP=group, OUT_FMT=int(_OUT_FP8),
        EXACT_FP8=interpreted(k.device), BLOCK_T=cfg.block_t, BLOCK_D=padded_dim(dim),
        num_warps=cfg.num_warps,
    )
    return Quantized(k_data, k_scale, group), Quantized(v_data, v_scale, group, transposed=True)


def quantize_fp8_per_channel(x: Tensor, *, smooth: bool = False) -> Quantized:
    """FP8 e4m3 with one scale per channel (SageAttention2's V; reference
    ``quantize_fp8_per_channel``), optionally smoothed first (``V − v̄``, v̄ over all tokens).

    x: ``[B, H, L, D]``. Returns float8_e4m3fn ``[B, H, D, L_pad]`` (transposed, K-major for
    the P·V MMA), scale float32 ``[B, H, D]`` = amax over tokens / 448, and the mean
    ``[B, H, 1, D]`` when ``smooth``.
    """
    length = x.shape[-2]
    mean, scale = token_stats(x, max(length, 1), center=smooth, per_channel=True, qmax=FP8_MAX)
    scale = scale[:, :, 0, :]
    data = _alloc_8bit(x, torch.float8_e4m3fn, True)
    _launch_quantize(
        x, data, _value_strides(data, True), qmax=FP8_MAX, out_fmt=int(_OUT_FP8),
        group=1, scale_in=scale, per_channel=True, mean=mean if smooth else None,
        mean_group=max(length, 1), scale_mul=1.0, transposed=True,
    )
    return Quantized(data, scale, 1, per_channel=True, transposed=True,
                     mean=mean if smooth else None)


def smooth_mean(x: Tensor, group: int | None = None) -> Tensor:
    """Channel mean per group of ``group`` tokens (default: all tokens), float32
    ``[B, H, n_groups, D]``. The launchers' K smoothing takes ``group=None``; SageAttention2's
    per-block Q means come from :func:`quantize_int_smoothed` in the same pass as Q's
    quantization (this function's per-group form checks them in the tests)."""
    if lowered.decomposed(x):
        return lowered.smooth_mean(x, group)
    mean, _ = token_stats(x, group or max(x.shape[-2], 1), center=True, per_channel=False)
    return mean


def delta_s(q_mean: Tensor, k: Tensor, k_mean: Tensor | None, scale_mul: float, *,
            causal: bool = False) -> Tensor:
    """SageAttention2's Q-smoothing correction ``ΔS = q̄·(K − k̄)ᵀ · scale_mul``.

    q_mean: float32 ``[B, Hq, n_blocks, D]``; k: ``[B, Hkv, Lkv, D]``; k_mean: float32
    ``[B, Hkv, 1, D]`` or None. Returns float32 ``[B, Hq, n_blocks, Lkv]`` (query token ``t``
    adds row ``t // SMOOTH_Q_BLOCK``). ``causal`` (top-left): entries that a causal
    attention kernel never reads (keys at least two query blocks past a block of
    :func:`_delta_s_kernel`'s program) are left unwritten.
    """
    bsz, hq, n_blocks, dim = q_mean.shape
    hkv, lkv = k.shape[1], k.shape[2]
    cfg = quant_config(dim, k.device)
    out = torch.empty((bsz, hq, n_blocks, lkv), device=k.device, dtype=torch.float32)
    exact = interpreted(k.device)
    kmean = k_mean.contiguous() if k_mean is not None else q_mean
    # q̄ rows per program: a dot needs at least 16; 64 covers 8K query tokens per tile.
    block_b = min(64, max(16, triton.next_power_of_2(n_blocks)))
    tiles = _DS_KEY_TILES
    while tiles > 1 and (triton.cdiv(max(lkv, 1), tiles * cfg.block_t)
                         * triton.cdiv(n_blocks, block_b) * bsz * hq) < _MIN_PROGRAMS:
        tiles //= 2  # short sequences: fewer key tiles per program, more programs
    grid = (triton.cdiv(max(lkv, 1), tiles * cfg.block_t), triton.cdiv(n_blocks, block_b), bsz * hq)
    launcher(_delta_s_kernel, k)[grid](
        q_mean.contiguous(), k, kmean, out, lkv, dim, n_blocks, hq // hkv, hq, scale_mul,
        *k.stride(), SUB_K_MEAN=k_mean is not None, PRECISION="ieee" if exact else "tf32x3",
        SPLIT_Q=not exact and k.dtype in (torch.bfloat16, torch.float16), CAUSAL=causal,
        Q_BLOCK=SMOOTH_Q_BLOCK, TILES=tiles, BLOCK_T=cfg.block_t, BLOCK_B=block_b,
        BLOCK_D=padded_dim(dim), num_warps=cfg.num_warps,
    )
    return out


def v_column_of_token_torch(token: Tensor) -> Tensor:
    """Torch form of :func:`qattn_compile.kernels.primitives.v_column_of_token`: the column of
    the transposed 8-bit V at which each token (int tensor) is stored."""
    offset = token % V_KEY_BLOCK
    return (token - offset) + (offset & 16) + (((offset >> 1) & 3) << 2) \
        + (((offset >> 3) & 1) << 1) + (offset & 1)


def v_in_token_order(data: Tensor, length: int) -> Tensor:
    """The values ``[B, H, length, D]`` of a transposed 8-bit V ``[B, H, D, L_pad]`` in token
    order (undoes the storage order of the module docstring; for tests and inspection)."""
    columns = v_column_of_token_torch(torch.arange(length, device=data.device))
    as_bytes = data.view(torch.uint8)  # gathers are not implemented for every 8-bit dtype
    return as_bytes.index_select(-1, columns).transpose(-1, -2).view(data.dtype)


def _padded_length(length: int) -> int:
    """``L_pad`` of a transposed 8-bit V: ``length`` rounded up to whole blocks of
    :data:`~qattn_compile.blocks.V_KEY_BLOCK` tokens (also 16-byte rows for TMA)."""
    return triton.cdiv(max(length, 1), V_KEY_BLOCK) * V_KEY_BLOCK


def _alloc_8bit(x: Tensor, dtype: torch.dtype, transpose: bool) -> Tensor:
    """Output buffer (``dtype``: int8 or float8_e4m3fn) for 8-bit values of ``x`` ``[B, H,
    L, D]``: ``[B, H, L, D]`` or, with ``transpose``, ``[B, H, D, L_pad]``."""
    bsz, heads, length, dim = x.shape
    if transpose:
        data = torch.empty((bsz, heads, dim, _padded_length(length)), device=x.device,
                           dtype=dtype)
    else:
        data = torch.empty((bsz, heads, length, dim), device=x.device, dtype=dtype)
    return data


def _alloc_int(x: Tensor, num_bits: int, transpose: bool) -> tuple[Tensor, Tensor, int]:
    """``(data, view, out_fmt)`` for INT values of ``x`` ``[B, H, L, D]``: INT8 as
    :func:`_alloc_8bit`; INT4 packed uint8 ``[B, H, L, ceil(D/2)]`` with its int8 view (the
    kernel writes bytes)."""
    if num_bits == 8:
        data = _alloc_8bit(x, torch.int8, transpose)
        return data, data, int(_OUT_INT)
    if transpose:
        raise ValueError("INT4 values are only stored row-major (Q and K)")
    bsz, heads, length, dim = x.shape
    data = torch.empty((bsz, heads, length, (dim + 1) // 2), device=x.device, dtype=torch.uint8)
    return data, data.view(torch.int8), int(_OUT_INT4_PACKED)


def _value_strides(view: Tensor, transpose: bool) -> tuple[int, int, int, int]:
    """Strides ``(batch, head, token, channel)`` of an output buffer (swapped when the
    buffer is stored transposed ``[B, H, D, L_pad]``)."""
    sb, sh, s2, s3 = view.stride()
    return (sb, sh, s3, s2) if transpose else (sb, sh, s2, s3)
