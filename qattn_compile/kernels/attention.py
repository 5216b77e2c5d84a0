"""The one flash-attention kernel template, specialised per preset by ``tl.constexpr`` switches.

One program computes a ``BLOCK_M`` tile of query rows of one (batch, query head) against all
visible key tiles with the online softmax in base 2 (scores are carried as ``S·log2(e)``; the
softmax scale and log2(e) are folded into Q's scale). Switches:

- ``QK_FMT``: :data:`QK_NATIVE` (fp16/bf16/fp32 dot), :data:`QK_INT8` (int8×int8→int32),
  :data:`QK_INT4` (packed bytes split into even/odd-channel int8 registers, two int8 dots),
  :data:`QK_FP8` (e4m3 dot). Scales: Q per row group ``Q_GROUP``, K per column group
  ``K_GROUP`` (a per-tensor scale is a group of :data:`PER_TENSOR_GROUP` tokens with stride
  0); a ``K_GROUP`` that ``BLOCK_N`` divides gives each key tile one scalar scale.
- ``HAS_DS``: add SageAttention2's Q-smoothing term ΔS (one row per ``DS_GROUP`` queries).
- ``POSITIVE_SCALE``: the softmax scale is positive (every row's score scale then is), so
  without ΔS or an additive mask the row max is taken before that scale and the exponent's
  multiply-add applies it (:func:`qk_scores`); a zero or negative scale (SDPA allows both)
  scales the scores first.
- ``P_FMT``: :data:`P_NATIVE` (P in V's dtype), :data:`P_INT8` (``round(127·P)``),
  :data:`P_UINT8` (``round(255·P)``, fed to the signed dot as ``P − 128`` plus an exact
  ``128·colsum(V̂)`` correction), :data:`P_FP8` (``fp8(448·P)``). ``l`` is summed from the
  quantized P for the integer formats, from the float P before quantization otherwise.
- ``P_TILE_MAX`` (integer P, ``p_scale: tile``): P is quantized against each tile's row max
  ``m_t`` instead of the running max (floored at ``m − P_TILE_FLOOR``); the tile's row sum
  is weighted by ``2^(m_t − m)``. Its ``P·V`` too for UINT8 P; INT8 P's enters unweighted,
  the accumulator being kept in units of its last tile's weight (``acc_shift``, see
  :func:`_tile_step` and :data:`P_TILE_FLOOR`).
- ``EXP_MODE``: :data:`EXP_HW` (``exp2``; P's scale folded into the exponent) or
  :data:`EXP_SAS` (TurboAttention's SAS: 2^floor by exponent bits × cubic on the fraction,
  scores below the threshold → 0, tiles with no score above it skipped).
- ``V_FMT``: :data:`V_NATIVE` (``[L, Dv]`` rows), :data:`V_INT8` / :data:`V_FP8`
  (transposed ``[Dv, L_pad]``, K-major for Hopper's 8-bit MMAs, tokens in the storage order
  of :mod:`.quantize`; the 8-bit P is relabelled to match by
  :func:`~.primitives.in_v_key_order`). ``V_SCALE``: :data:`VS_NONE`, :data:`VS_TILE` (one
  scale per ``V_GROUP`` tokens; ``BLOCK_N`` divides ``V_GROUP``; the accumulator is kept in
  the units of the last tile's scale and multiplied by it at the end) or :data:`VS_CHANNEL`
  (per channel, per tensor with stride 0, applied once at the end). ``SMOOTH_V`` adds the V
  mean back to O.
- ``SOFTCAP``: logit soft-capping ``cap·tanh(S/cap)`` on the scaled scores (Gemma 2, Grok),
  before ALiBi and the masks; ``ALIBI``: FlashAttention's ALiBi, ``−slope_h·|i + Lkv − Lq −
  j|`` added from one slope per (batch, query head). Both take the scores fully scaled (no
  row scale left for the exponent).
- ``MASK_MODE``: :data:`MASK_NONE`, :data:`MASK_BOOL`, :data:`MASK_ADD` (tensor masks read
  through the per-tile summary of :mod:`.mask`), combined with ``IS_CAUSAL`` (top-left).
  Key tiles run in two phases: tiles that need no bounds/causal masking, then the diagonal /
  ragged tail tiles with them.

Fully masked rows give 0. The accumulator is float32 and updated as ``acc·α + dot(P, V)``
(a fresh product added once per tile: SageAttention2's two-level accumulation for FP8).
Global loads go through :func:`~.primitives.load_tile`, or, with ``USE_TMA``, K and V tiles
through TMA descriptors (:func:`kv_descriptors`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .. import blocks
from . import mask as mask_codes
from .primitives import (
    additive_bias_log2,
    in_v_key_order,
    load_tile,
    rint_to_int32,
    split_int4,
    store_tile,
    to_fp8_e4m3,
)

QK_NATIVE = tl.constexpr(0)
QK_INT8 = tl.constexpr(1)
QK_INT4 = tl.constexpr(2)
QK_FP8 = tl.constexpr(3)

P_NATIVE = tl.constexpr(0)
P_INT8 = tl.constexpr(1)
P_UINT8 = tl.constexpr(2)
P_FP8 = tl.constexpr(3)

V_NATIVE = tl.constexpr(0)
V_INT8 = tl.constexpr(1)
V_FP8 = tl.constexpr(2)

P_TILE_FLOOR = tl.constexpr(64.0)
"""``P_TILE_MAX``: how far (log2 units) below the row's running max a key tile's P may be
quantized against. A tile whose max lies lower rounds to P = 0 (its true weight is below
2^-64 of the row's largest), and the accumulator, kept in units of ``2^(m_t − m)``, grows at
most 2^64 above the true sum (float32 holds 2^127)."""

FP16_MAX = tl.constexpr(65504.0)
"""The largest finite float16: float16 outputs saturate there (:func:`attention_kernel`)."""

PER_TENSOR_GROUP = 1 << 30
"""The token group of a per-tensor scale: longer than any sequence (its stride is 0)."""

VS_NONE = tl.constexpr(0)
VS_TILE = tl.constexpr(1)
VS_CHANNEL = tl.constexpr(2)

EXP_HW = tl.constexpr(0)
EXP_SAS = tl.constexpr(1)

MASK_NONE = tl.constexpr(0)
MASK_BOOL = tl.constexpr(1)
MASK_ADD = tl.constexpr(2)

TILE_SKIP = tl.constexpr(mask_codes.TILE_SKIP)
TILE_FULL = tl.constexpr(mask_codes.TILE_FULL)
TILE_MIXED = tl.constexpr(mask_codes.TILE_MIXED)

V_KEY_BLOCK = tl.constexpr(blocks.V_KEY_BLOCK)


# ----------------------------------------------------------------------------- loads


@triton.jit
def load_qk_tile(base, rows, stride_r, stride_c, n_rows, QK_FMT: tl.constexpr,
                 HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, MASK_ROWS: tl.constexpr):
    """A Q or K tile (row-major, channels contiguous) as two operands ``(a, b)``.

    INT4: the bytes ``[ROWS, BLOCK_D // 2]`` split into the even (``a``) and odd (``b``)
    channels as int8 (:func:`qk_scores` adds their two dots: no interleaving shuffle).
    Other formats: ``a = b`` = the ``[ROWS, BLOCK_D]`` tile. Channels beyond ``HEAD_D``
    (padding to a power of two) read as 0; ``MASK_ROWS`` bounds-checks the rows.
    """
    if QK_FMT == QK_INT4:
        cols = tl.arange(0, BLOCK_D // 2)
        tile = load_tile(base, rows, cols, stride_r, stride_c, n_rows, (HEAD_D + 1) // 2,
                         0.0, MASK_ROWS, (HEAD_D + 1) // 2 != BLOCK_D // 2)
    else:
        cols = tl.arange(0, BLOCK_D)
        tile = load_tile(base, rows, cols, stride_r, stride_c, n_rows, HEAD_D, 0.0, MASK_ROWS,
                         HEAD_D != BLOCK_D)
    return qk_operands(tile, QK_FMT)


@triton.jit
def qk_operands(tile, QK_FMT: tl.constexpr):
    """A loaded Q/K tile as the two operands of :func:`qk_scores`: INT4 bytes split into
    their even/odd channels (int8), any other format ``(tile, tile)``."""
    if QK_FMT == QK_INT4:
        a, b = split_int4(tile)
    else:
        a = tile
        b = tile
    return a, b


@triton.jit
def kv_descriptors(k_base, v_base, Lkv, skl, svl, svd, QK_FMT: tl.constexpr,
                   V_FMT: tl.constexpr, HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """TMA descriptors of one (batch, kv head)'s K and V (Hopper bulk tile copies).

    K: ``[Lkv, D]`` rows (INT4: ``ceil(D/2)`` bytes), boxes ``[BLOCK_N, BLOCK_D]``
    (``BLOCK_D / 2`` bytes for INT4). V: native ``[Lkv, Dv]`` rows, boxes ``[BLOCK_N,
    BLOCK_DV]``; 8-bit K-major ``[Dv, L_pad]`` (token stride 1; :func:`v_columns`), boxes
    ``[BLOCK_DV, BLOCK_N]``. Reads beyond the lengths or the head dim return 0, so ragged
    tiles need no bounds masks; the launcher guarantees the 16-byte alignment of bases and
    row strides.
    """
    if QK_FMT == QK_INT4:
        k_desc = tl.make_tensor_descriptor(k_base, shape=[Lkv, (HEAD_D + 1) // 2],
                                           strides=[skl, 1], block_shape=[BLOCK_N, BLOCK_D // 2])
    else:
        k_desc = tl.make_tensor_descriptor(k_base, shape=[Lkv, HEAD_D], strides=[skl, 1],
                                           block_shape=[BLOCK_N, BLOCK_D])
    if V_FMT == V_NATIVE:
        v_desc = tl.make_tensor_descriptor(v_base, shape=[Lkv, HEAD_DV], strides=[svl, 1],
                                           block_shape=[BLOCK_N, BLOCK_DV])
    else:
        v_desc = tl.make_tensor_descriptor(v_base, shape=[HEAD_DV, v_columns(Lkv)],
                                           strides=[svd, 1], block_shape=[BLOCK_DV, BLOCK_N])
    return k_desc, v_desc


@triton.jit
def v_columns(Lkv):
    """Columns of the 8-bit V ``[Dv, L_pad]`` that hold tokens or their zero padding: whole
    blocks of its storage order (the quantizer's ``L_pad`` is at least this)."""
    return tl.cdiv(Lkv, V_KEY_BLOCK) * V_KEY_BLOCK


@triton.jit
def load_v_tile(v_base, offs_n, svl, svd, Lkv, V_FMT: tl.constexpr, HEAD_DV: tl.constexpr,
                BLOCK_DV: tl.constexpr, MASK_ROWS: tl.constexpr):
    """V tile ``[BLOCK_N, BLOCK_DV]``: rows of ``[L, Dv]`` (native) or the transpose of a
    ``[BLOCK_DV, BLOCK_N]`` tile of the K-major ``[Dv, L_pad]`` 8-bit layout."""
    offs_dv = tl.arange(0, BLOCK_DV)
    if V_FMT == V_NATIVE:
        v = load_tile(v_base, offs_n, offs_dv, svl, svd, Lkv, HEAD_DV, 0.0, MASK_ROWS,
                      HEAD_DV != BLOCK_DV)
    else:
        v_t = load_tile(v_base, offs_dv, offs_n, svd, svl, HEAD_DV, v_columns(Lkv), 0.0,
                        HEAD_DV != BLOCK_DV, MASK_ROWS)
        v = tl.trans(v_t)
    return v


@triton.jit
def _load_v_colsum(cs_base, start_n, scsc, HEAD_DV: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_DV: tl.constexpr):
    """int32 ``[BLOCK_DV]`` channel sums of V̂ over key tile ``[start_n, start_n + BLOCK_N)``
    (one row of the launcher's per-tile sums, row stride ``scsc``)."""
    offs_dv = tl.arange(0, BLOCK_DV)
    return tl.load(cs_base + (start_n // BLOCK_N) * scsc + offs_dv, mask=offs_dv < HEAD_DV,
                   other=0)


@triton.jit
def _load_group_scale(base, offs, n, stride, GROUP: tl.constexpr, MASKED: tl.constexpr):
    """Per-token scales ``base[(offs // GROUP) * stride]`` (``[len(offs)]`` float32; 1 beyond
    ``n`` when ``MASKED``)."""
    if MASKED:
        scale = tl.load(base + (offs // GROUP) * stride, mask=offs < n, other=1.0)
    else:
        scale = tl.load(base + (offs // GROUP) * stride)
    return scale


# ----------------------------------------------------------------------------- tile math


@triton.jit
def qk_scores(q, q2, k, k2, q_scale, k_scale, qk_scale, QK_FMT: tl.constexpr,
              DOT_PRECISION: tl.constexpr, K_SCALES: tl.constexpr,
              ROW_SCALE_OUT: tl.constexpr = False):
    """Scores ``[BLOCK_M, BLOCK_N]`` in log2 units from Q and K tiles as returned by
    :func:`load_qk_tile` (``q2``/``k2``: the odd channels for INT4, else unused).

    Native: ``(Q·Kᵀ)·qk_scale`` (qk_scale = softmax scale·log2 e). Quantized:
    ``(Q̂·K̂ᵀ)·q_scale[:, None]·k_scale[None, :]`` with the softmax scale and log2 e already
    in ``q_scale``; integer formats accumulate in int32 (exact). ``K_SCALES``: how many
    scales ``k_scale`` holds for the tile (chosen by :func:`_tile_step`): 1, the tile's one
    scale (a scalar); ``BLOCK_N``, one per key; in between, one per ``BLOCK_N // K_SCALES``
    consecutive keys (``[K_SCALES]``). Fewer than ``BLOCK_N`` are folded into the row scales
    first (one multiply per score instead of two; the scores are viewed as ``[BLOCK_M,
    K_SCALES, BLOCK_N // K_SCALES]``, a relabelling of registers).

    Returns ``(s, 1.0)``, or with ``ROW_SCALE_OUT`` (``K_SCALES`` 1 or ``BLOCK_N``)
    ``(t, row_scale)``: the scores are ``t·row_scale[:, None]`` with ``row_scale`` float32
    ``[BLOCK_M]``, positive, left for the exponent's multiply-add (:func:`softmax_probs`),
    which saves one multiply per score.
    """
    M: tl.constexpr = q.shape[0]
    if QK_FMT == QK_NATIVE:
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if ROW_SCALE_OUT:
            row_scale = tl.zeros((M,), tl.float32) + qk_scale
        else:
            s = s * qk_scale
            row_scale = 1.0
    else:
        if QK_FMT == QK_FP8:
            raw = tl.dot(q, tl.trans(k))
        elif QK_FMT == QK_INT4:
            raw_int = tl.dot(q, tl.trans(k), out_dtype=tl.int32)
            raw = (raw_int + tl.dot(q2, tl.trans(k2), out_dtype=tl.int32)).to(tl.float32)
        else:
            raw = tl.dot(q, tl.trans(k), out_dtype=tl.int32).to(tl.float32)
        N: tl.constexpr = raw.shape[1]
        tl.static_assert(not ROW_SCALE_OUT or K_SCALES == 1 or K_SCALES == N)
        row_scale = 1.0
        if K_SCALES == 1:
            if ROW_SCALE_OUT:
                s = raw
                row_scale = q_scale * k_scale
            else:
                s = raw * (q_scale * k_scale)[:, None]
        elif K_SCALES == N:
            if ROW_SCALE_OUT:
                s = raw * k_scale[None, :]
                row_scale = q_scale
            else:
                s = raw * q_scale[:, None] * k_scale[None, :]
        else:
            by_group = tl.reshape(raw, (M, K_SCALES, N // K_SCALES))
            scale = q_scale[:, None] * k_scale[None, :]
            s = tl.reshape(by_group * scale[:, :, None], (M, N))
    return s, row_scale


@triton.jit
def sas_exp2(y, thr_log2, c0, c1, c2, c3):
    """TurboAttention's SAS ``2^y`` for ``y <= 0`` (log2 units): ``2^floor(y)`` built from
    exponent bits times ``((c3·f + c2)·f + c1)·f + c0`` on the fraction ``f``; ``y < thr_log2``
    (and ``-inf``) give exactly 0."""
    yc = tl.maximum(tl.minimum(y, 0.0), tl.floor(thr_log2) - 1.0)
    n = tl.floor(yc)
    f = yc - n
    poly = ((c3 * f + c2) * f + c1) * f + c0
    pow2n = tl.cast((n.to(tl.int32) + 127) << 23, tl.float32, bitcast=True)
    return tl.where(y < thr_log2, 0.0, poly * pow2n)


@triton.jit
def softmax_probs(s, row_scale, shift, thr_log2, c0, c1, c2, c3, P_FMT: tl.constexpr,
                  EXP_MODE: tl.constexpr, EXACT_FP8: tl.constexpr, ROW_SCALE: tl.constexpr):
    """Probabilities of scores ``s`` (``[BLOCK_M, BLOCK_N]``, log2 units; with ``ROW_SCALE``
    in units of the per-row ``row_scale`` ``[BLOCK_M]``, see :func:`qk_scores`) shifted by
    the per-row ``shift`` (``[BLOCK_M]``, log2 units, the max they are taken against).

    P = 1 maps to ``pmax`` = 127 (INT8), 255 (UINT8), 448 (FP8) or 1 (native). Returns
    ``(p, row_sum)``: ``p`` in the format the ``P·V`` dot takes (P_UINT8 already shifted by
    −128) and the per-row sum that ``l`` accumulates, in ``pmax`` units: of the quantized P
    for INT8/UINT8, of the float P before rounding for FP8/native (native P stays float32;
    :func:`pv_product` casts it to V's dtype). With the hardware exp, ``pmax`` and the shift
    are one per-row bias of the exponent: ``exp2(s + (log2 pmax − shift))``, one add per score
    (with ``ROW_SCALE``, one multiply-add: ``exp2(s·row_scale + (log2 pmax − shift))``).
    """
    if ROW_SCALE:
        s = s * row_scale[:, None]
    if P_FMT == P_INT8:
        log2_pmax = 6.988684686772166  # log2(127)
        pmax = 127.0
    elif P_FMT == P_UINT8:
        log2_pmax = 7.994353436858858  # log2(255)
        pmax = 255.0
    elif P_FMT == P_FP8:
        log2_pmax = 8.807354922057604  # log2(448)
        pmax = 448.0
    else:
        log2_pmax = 0.0
        pmax = 1.0
    if EXP_MODE == EXP_SAS:
        p = sas_exp2(s - shift[:, None], thr_log2, c0, c1, c2, c3) * pmax
    else:
        p = tl.math.exp2(s + (log2_pmax - shift)[:, None])
    if P_FMT == P_INT8:
        p_int = rint_to_int32(p)
        row_sum = tl.sum(p_int, axis=1).to(tl.float32)
        p_out = p_int.to(tl.int8)
    elif P_FMT == P_UINT8:
        p_shifted = rint_to_int32(p, 128)
        row_sum = (tl.sum(p_shifted, axis=1) + 128 * p.shape[1]).to(tl.float32)
        p_out = p_shifted.to(tl.int8)
    else:
        row_sum = tl.sum(p, axis=1)
        if P_FMT == P_FP8:
            p_out = to_fp8_e4m3(p, EXACT_FP8)
        else:
            p_out = p
    return p_out, row_sum


@triton.jit
def pv_product(p, v, v_colsum, P_FMT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``P·V`` of one tile as float32 ``[BLOCK_M, BLOCK_DV]`` (a fresh product, not yet
    accumulated). P_UINT8: ``(P − 128)·V̂ + 128·colsum(V̂)`` in int32, exactly ``P̂·V̂``
    (``v_colsum``: int32 ``[BLOCK_DV]`` channel sums of the tile's V̂, :func:`_load_v_colsum`).
    8-bit P is relabelled into the 8-bit V's token order first (:func:`in_v_key_order`)."""
    if P_FMT != P_NATIVE:
        p = in_v_key_order(p)
    if P_FMT == P_INT8:
        pv = tl.dot(p, v, out_dtype=tl.int32).to(tl.float32)
    elif P_FMT == P_UINT8:
        shifted = tl.dot(p, v, out_dtype=tl.int32)
        pv = (shifted + 128 * v_colsum[None, :]).to(tl.float32)
    elif P_FMT == P_FP8:
        pv = tl.dot(p, v)
    else:
        pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return pv


# ----------------------------------------------------------------------------- one key tile


@triton.jit
def soft_capped(s, cap_log2):
    """``cap·tanh(S/cap)`` of scores ``s`` in log2 units, with ``cap_log2`` = cap·log2 e:
    ``c·tanh(s/c) = c − 2c / (2^(2·log2(e)·s/c) + 1)`` (exact at ±inf, NaN stays NaN)."""
    t = tl.math.exp2(s * (2.8853900817779268 / cap_log2))  # 2·log2(e)
    return cap_log2 - 2.0 * cap_log2 / (t + 1.0)


@triton.jit
def alibi_log2(offs_m, offs_n, Lq, Lkv, slope_log2):
    """ALiBi ``−slope·|i + Lkv − Lq − j|`` in log2 units (``slope_log2`` = slope·log2 e),
    ``[BLOCK_M, BLOCK_N]`` float32: FlashAttention's bottom-right alignment, so a decode
    step's one query sits at the last key."""
    distance = offs_m[:, None] + (Lkv - Lq) - offs_n[None, :]
    return -slope_log2 * tl.abs(distance).to(tl.float32)


@triton.jit
def _add_tensor_mask(s, mask_base, offs_m, offs_n, smm, smn, Lq, Lkv, code,
                     MASK_MODE: tl.constexpr):
    """Apply the tensor mask to scores ``s`` ``[BLOCK_M, BLOCK_N]`` (log2 units): bool False
    → ``-inf``, additive values added in log2 units (:func:`additive_bias_log2`).
    ``mask_base`` points at the query tile's first row (``offs_m[0]``). The load is predicated
    on the tile's summary ``code`` being mixed (a full tile reads nothing and changes
    nothing), so no branch stops the loop's loads from being pipelined."""
    mixed = (tl.zeros_like(offs_n) + code) == TILE_MIXED  # the scalar code as a [BLOCK_N] row
    inside = (offs_m[:, None] < Lq) & ((offs_n < Lkv) & mixed)[None, :]
    rows = tl.arange(0, offs_m.shape[0])  # from the tile's first row (mask_base), so that
    # row offsets stay in 32 bits for masks of more than 2**31 elements
    ptrs = mask_base + rows[:, None] * smm + offs_n[None, :] * smn
    if MASK_MODE == MASK_BOOL:
        keep = tl.load(ptrs, mask=inside, other=1)
        s = tl.where(keep != 0, s, float("-inf"))
    else:
        s += additive_bias_log2(tl.load(ptrs, mask=inside, other=0.0))
    return s


@triton.jit
def _tile_step(
    acc, acc_unit, acc_shift, m_i, l_i, q, q2, q_scale, start_m, start_n,
    k_base, v_base, k_desc, v_desc, ks_base, vs_base, ds_row, mask_base, cs_base, code,
    Lq, Lkv, qk_scale, thr_log2, c0, c1, c2, c3, cap_log2, slope_log2,
    skl, skd, svl, svd, sksg, svsg, smm, smn, scsc,
    QK_FMT: tl.constexpr, P_FMT: tl.constexpr, P_TILE_MAX: tl.constexpr,
    ACC_TILE_UNITS: tl.constexpr, V_FMT: tl.constexpr,
    V_SCALE: tl.constexpr, EXP_MODE: tl.constexpr, MASK_MODE: tl.constexpr,
    BOUNDED: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_DS: tl.constexpr,
    POSITIVE_SCALE: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    K_GROUP: tl.constexpr, V_GROUP: tl.constexpr, EXACT_FP8: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Fold key tile ``[start_n, start_n + BLOCK_N)`` into the online-softmax state.

    State: ``acc`` float32 ``[BLOCK_M, BLOCK_DV]`` in units of the scalar ``acc_unit`` (the
    last tile's V scale with ``VS_TILE``, else 1) and, with ``ACC_TILE_UNITS``, of
    ``2^(acc_shift − m_i)`` per row (``acc_shift`` float32 ``[BLOCK_M]``: the max that the
    last tile's P was quantized against; unused otherwise), ``m_i``/``l_i`` float32
    ``[BLOCK_M]`` (running max in log2 units, running sum in units of the P format's scale).
    A tile's fresh ``P·V`` is added as it comes; the accumulator's per-row rescale moves it
    to the new tile's units first. ``code``: the tile's mask summary (a mixed tile reads the
    tensor mask). ``BOUNDED``: mask keys ``>= Lkv`` and, with ``IS_CAUSAL``, keys after the
    query. ``USE_TMA``: K and V tiles come from the descriptors ``k_desc``/``v_desc``
    (:func:`kv_descriptors`), else from pointers at ``k_base``/``v_base`` (the descriptor
    arguments are then unused). Returns
    ``(acc, acc_unit, acc_shift, m_i, l_i)``.
    """
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if V_SCALE == VS_TILE:
        # loaded first, used last: the load's latency passes under the tile's two products
        # instead of sitting on the critical path next to its use (docs/performance.md)
        v_scale = tl.load(vs_base + (start_n // V_GROUP) * svsg)
    if USE_TMA:
        k, k2 = qk_operands(k_desc.load([start_n, 0]), QK_FMT)
    else:
        k, k2 = load_qk_tile(k_base, offs_n, skl, skd, Lkv, QK_FMT, HEAD_D, BLOCK_D, BOUNDED)
    # K scales one key tile spans: 1 when a scale group holds the whole tile, BLOCK_N //
    # K_GROUP (at most 4) when the tile holds whole groups, else one per key.
    K_SCALES: tl.constexpr = (
        1 if K_GROUP % BLOCK_N == 0
        else BLOCK_N // K_GROUP if BLOCK_N % K_GROUP == 0 and K_GROUP * 4 >= BLOCK_N
        else BLOCK_N)
    if QK_FMT == QK_NATIVE:
        k_scale = 1.0  # native scores take qk_scale instead
    elif K_SCALES == 1:
        k_scale = tl.load(ks_base + (start_n // K_GROUP) * sksg)  # one scale for the tile
    elif K_SCALES < BLOCK_N:
        groups = start_n // K_GROUP + tl.arange(0, K_SCALES)
        if BOUNDED:
            k_scale = tl.load(ks_base + groups * sksg, mask=groups * K_GROUP < Lkv, other=1.0)
        else:
            k_scale = tl.load(ks_base + groups * sksg)
    else:
        k_scale = _load_group_scale(ks_base, offs_n, Lkv, sksg, K_GROUP, BOUNDED)
    # Without ΔS or an additive mask, the max is taken before the rows' scale is applied
    # (a positive factor per row: quantizer scales are, the softmax scale must be), and the
    # exponent's multiply-add applies it.
    ROW_SCALE: tl.constexpr = (POSITIVE_SCALE and not HAS_DS and MASK_MODE != MASK_ADD
                               and not SOFTCAP and not ALIBI
                               and (K_SCALES == 1 or K_SCALES == BLOCK_N or QK_FMT == QK_NATIVE))
    s, row_scale = qk_scores(q, q2, k, k2, q_scale, k_scale, qk_scale, QK_FMT, DOT_PRECISION,
                             K_SCALES if QK_FMT != QK_NATIVE else BLOCK_N, ROW_SCALE)
    if HAS_DS:
        if BOUNDED:
            s += tl.load(ds_row + offs_n, mask=offs_n < Lkv, other=0.0)[None, :]
        else:
            s += tl.load(ds_row + offs_n)[None, :]
    if SOFTCAP:
        s = soft_capped(s, cap_log2)
    if ALIBI:
        s += alibi_log2(offs_m, offs_n, Lq, Lkv, slope_log2)
    if MASK_MODE != MASK_NONE:
        s = _add_tensor_mask(s, mask_base, offs_m, offs_n, smm, smn, Lq, Lkv, code, MASK_MODE)
    if BOUNDED:
        keep = offs_n[None, :] < Lkv
        if IS_CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(keep, s, float("-inf"))
    # skips a NaN score (a NaN arrives through the scales instead): a NaN-keeping row max
    # here makes ptxas allocate more registers, a program per SM fewer (docs/performance.md)
    m_tile = tl.max(s, axis=1)
    if ROW_SCALE:
        m_tile = m_tile * row_scale  # exact: rounding is monotonic
    if EXP_MODE == EXP_SAS:
        # The tile matters only if some row has a score above the threshold relative to
        # the running max (m_i can only grow, so those below stay below).
        above = ((m_tile >= m_i + thr_log2) & (m_tile > float("-inf"))) | (m_tile != m_tile)
        live = tl.max(above.to(tl.int32), axis=0) > 0
    else:
        live = True
    if live:
        # a NaN max (a NaN Q or K scale: a NaN in the group's input) makes the row NaN
        m_new = tl.maximum(m_i, m_tile, propagate_nan=tl.PropagateNan.ALL)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_use)
        if P_TILE_MAX:
            # P against the tile's own max, at most P_TILE_FLOOR below the row's (a row with
            # no visible key in this tile: P = 0 whatever the shift).
            p_shift = tl.maximum(m_tile, m_use - P_TILE_FLOOR)
            weight = tl.math.exp2(p_shift - m_use)
        else:
            p_shift = m_use
        p, row_sum = softmax_probs(s, row_scale, p_shift, thr_log2, c0, c1, c2, c3, P_FMT,
                                   EXP_MODE, EXACT_FP8, ROW_SCALE)
        if USE_TMA and V_FMT == V_NATIVE:
            v = v_desc.load([start_n, 0])
        elif USE_TMA:
            v = tl.trans(v_desc.load([0, start_n]))
        else:
            v = load_v_tile(v_base, offs_n, svl, svd, Lkv, V_FMT, HEAD_DV, BLOCK_DV, BOUNDED)
        if P_FMT == P_UINT8:
            v_colsum = _load_v_colsum(cs_base, start_n, scsc, HEAD_DV, BLOCK_N, BLOCK_DV)
        else:
            v_colsum = 0
        pv = pv_product(p, v, v_colsum, P_FMT, DOT_PRECISION)
        # The accumulator moves to this tile's units with the per-row rescale it takes
        # anyway, so the fresh product needs no multiply per element.
        acc_alpha = alpha
        if P_TILE_MAX:
            row_sum = row_sum * weight
        if ACC_TILE_UNITS:
            acc_alpha = tl.math.exp2(acc_shift - p_shift)  # 0 on the first visible tile
            acc_shift = p_shift
        elif P_TILE_MAX:
            pv = pv * weight[:, None]
        if V_SCALE == VS_TILE:
            acc_alpha = acc_alpha * (acc_unit / v_scale)
            acc_unit = v_scale
        acc = acc * acc_alpha[:, None] + pv
        l_i = l_i * alpha + row_sum
        m_i = m_new
    return acc, acc_unit, acc_shift, m_i, l_i


# ----------------------------------------------------------------------------- the kernel


@triton.jit
def attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,
    qs_ptr, ks_ptr, vs_ptr, ds_ptr, vmean_ptr, mask_ptr, sum_ptr, tiles_ptr, cnt_ptr, cs_ptr,
    alibi_ptr,
    Lq, Lkv, n_heads_q, hq_per_kv, n_bh,
    qk_scale, thr_log2, c0, c1, c2, c3, cap_log2,
    sqb, sqh, sql, sqd,
    skb, skh, skl, skd,
    svb, svh, svl, svd,
    sob, soh, sol, sod,
    sqsb, sqsh, sqsg,
    sksb, sksh, sksg,
    svsb, svsh, svsg,
    sdsb, sdsh, sdsg,
    svmb, svmh,
    scsb, scsh, scsc,
    smb, smh, smm, smn,
    ssb, ssh, ssm, ssn,
    stb, sth, stm, stn,
    scnb, scnh, scnm,
    salb, salh,
    QK_FMT: tl.constexpr, P_FMT: tl.constexpr, P_TILE_MAX: tl.constexpr, V_FMT: tl.constexpr,
    V_SCALE: tl.constexpr, EXP_MODE: tl.constexpr, MASK_MODE: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_DS: tl.constexpr, SMOOTH_V: tl.constexpr, POSITIVE_SCALE: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    Q_GROUP: tl.constexpr, K_GROUP: tl.constexpr, V_GROUP: tl.constexpr, DS_GROUP: tl.constexpr,
    EXACT_FP8: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Attention of query rows ``[pid_m·BLOCK_M, …)`` of (batch, query head) ``pid_bh``.

    Grid ``(G, cdiv(Lq, BLOCK_M), cdiv(n_bh, G))``: groups of ``G`` consecutive (batch, query
    head) rows of the ``n_bh = B·Hq``, query tiles interleaved across a group's heads
    (:func:`~.heuristics.grid_head_group`), causal query tiles longest first; programs past
    ``n_bh`` (a last, partial group) exit. q ``[B, Hq, Lq, D]`` (INT4: ``[.., ceil(D/2)]``
    bytes), k ``[B, Hkv, Lkv, D]`` (likewise), v ``[B, Hkv, Lkv, Dv]`` native or ``[B, Hkv, Dv,
    L_pad]`` 8-bit (the launcher passes (token, channel) strides), o ``[B, Hq, Lq, Dv]``.
    Scales: qs ``[B, Hq, nq]``, ks ``[B, Hkv, nk]``, vs ``[B, Hkv, nv]`` or ``[B, Hkv, Dv]``;
    ds ``[B, Hq, n_blocks, Lkv]``; vmean ``[B, Hkv, 1, Dv]``; cs (P_UINT8) int32 ``[B, Hkv,
    cdiv(Lkv, BLOCK_N), Dv]`` channel sums of V̂ per key tile; mask ``[B, Hq, Lq, Lkv]`` and
    its summary codes / live-tile lists ``[B, Hq, n_m, n_n]`` and counts ``[B, Hq, n_m]``
    (:class:`.mask.MaskPlan`; stride 0 on broadcast dims). Query head ``h`` reads
    kv head ``h // hq_per_kv`` (GQA without repeating K/V). ``USE_TMA``: K/V tiles by TMA
    descriptors (Hopper; the launcher checks alignment).
    """
    # Float scalars as float32: Inductor's launches of this kernel may type Python floats
    # as fp64, which would turn the scores and the accumulator into fp64.
    qk_scale = tl.cast(qk_scale, tl.float32)
    thr_log2 = tl.cast(thr_log2, tl.float32)
    c0, c1 = tl.cast(c0, tl.float32), tl.cast(c1, tl.float32)
    c2, c3 = tl.cast(c2, tl.float32), tl.cast(c3, tl.float32)
    cap_log2 = tl.cast(cap_log2, tl.float32)
    # 64-bit (batch, head) offsets: operands, ΔS and masks may pass 2**31 elements
    pid_bh = (tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)).to(tl.int64)
    if pid_bh >= n_bh:
        return
    pid_m = tl.program_id(1)
    if IS_CAUSAL:
        pid_m = tl.num_programs(1) - 1 - pid_m
    b = pid_bh // n_heads_q
    hq = pid_bh % n_heads_q
    hkv = hq // hq_per_kv
    if ALIBI:
        slope_log2 = tl.load(alibi_ptr + b * salb + hq * salh).to(tl.float32) * 1.4426950408889634
    else:
        slope_log2 = tl.cast(0.0, tl.float32)  # unused
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)

    q, q2 = load_qk_tile(q_ptr + b * sqb + hq * sqh, offs_m, sql, sqd, Lq, QK_FMT, HEAD_D,
                         BLOCK_D, True)
    q_scale = _load_group_scale(qs_ptr + b * sqsb + hq * sqsh, offs_m, Lq, sqsg, Q_GROUP, True)
    k_base = k_ptr + b * skb + hkv * skh
    v_base = v_ptr + b * svb + hkv * svh
    ks_base = ks_ptr + b * sksb + hkv * sksh
    vs_base = vs_ptr + b * svsb + hkv * svsh
    ds_row = ds_ptr + b * sdsb + hq * sdsh + (start_m // DS_GROUP) * sdsg
    # the mask at the query tile's first row
    mask_base = mask_ptr + b * smb + hq * smh + start_m.to(tl.int64) * smm
    cs_base = cs_ptr + b * scsb + hkv * scsh
    if USE_TMA:
        k_desc, v_desc = kv_descriptors(k_base, v_base, Lkv, skl, svl, svd, QK_FMT, V_FMT,
                                        HEAD_D, HEAD_DV, BLOCK_N, BLOCK_D, BLOCK_DV)
    else:
        k_desc, v_desc = k_base, v_base  # unused by the pointer loads

    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    acc_unit = tl.cast(1.0, tl.float32)
    # Per-tile P weights kept in the accumulator's units rather than multiplied into each
    # P·V. Not for UINT8 P: there ptxas's register allocation costs fmha_int8's D=64 causal
    # loop a program per SM (the allocator's choice, not the loop's need; docs/performance.md).
    ACC_TILE_UNITS: tl.constexpr = P_TILE_MAX and P_FMT == P_INT8
    if ACC_TILE_UNITS:
        acc_shift = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    else:
        acc_shift = tl.cast(0.0, tl.float32)  # unused
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)

    if MASK_MODE == MASK_NONE:
        # Two phases (unrolled at compile time): key tiles that need neither bounds nor
        # causal masking, then the rest (BOUNDED). The second is at most one key tile (the
        # ragged end, or the causal diagonal) unless a causal query tile spans several key
        # tiles (BLOCK_N not a multiple of BLOCK_M); that one tile runs as straight-line code.
        # As a loop, ptxas gives the causal kernels more registers (one program per SM
        # fewer at D=64); UINT8 P keeps the loop, where the straight form is the one that
        # needs more (docs/performance.md).
        hi = Lkv
        full_hi = (Lkv // BLOCK_N) * BLOCK_N
        if IS_CAUSAL:
            hi = tl.minimum(Lkv, start_m + BLOCK_M)
            full_hi = tl.minimum(full_hi, ((start_m + 1) // BLOCK_N) * BLOCK_N)
        EDGE_TILE_INLINE: tl.constexpr = (P_FMT != P_UINT8
                                          and (not IS_CAUSAL or BLOCK_N % BLOCK_M == 0))
        for phase in tl.static_range(2):
            lo = 0 if phase == 0 else full_hi
            phase_hi = full_hi if phase == 0 else hi
            if phase == 1 and EDGE_TILE_INLINE:
                # the same step as the loop's below, without the loop around it
                if lo < phase_hi:
                    start_n = lo
                    acc, acc_unit, acc_shift, m_i, l_i = _tile_step(
                        acc, acc_unit, acc_shift, m_i, l_i, q, q2, q_scale, start_m, start_n,
                        k_base, v_base, k_desc, v_desc, ks_base, vs_base, ds_row, mask_base,
                        cs_base, TILE_FULL, Lq, Lkv, qk_scale, thr_log2, c0, c1, c2, c3, cap_log2,
                        slope_log2, skl,
                        skd, svl, svd, sksg, svsg, smm, smn, scsc,
                        QK_FMT, P_FMT, P_TILE_MAX, ACC_TILE_UNITS, V_FMT, V_SCALE, EXP_MODE,
                        MASK_MODE, phase == 1, IS_CAUSAL,
                        HAS_DS, POSITIVE_SCALE, SOFTCAP, ALIBI,
                        K_GROUP, V_GROUP, EXACT_FP8, DOT_PRECISION, USE_TMA,
                        HEAD_D, HEAD_DV, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV)
            else:
                for start_n in range(lo, phase_hi, BLOCK_N):
                    acc, acc_unit, acc_shift, m_i, l_i = _tile_step(
                        acc, acc_unit, acc_shift, m_i, l_i, q, q2, q_scale, start_m, start_n,
                        k_base, v_base, k_desc, v_desc, ks_base, vs_base, ds_row, mask_base,
                        cs_base, TILE_FULL, Lq, Lkv, qk_scale, thr_log2, c0, c1, c2, c3, cap_log2,
                        slope_log2, skl,
                        skd, svl, svd, sksg, svsg, smm, smn, scsc,
                        QK_FMT, P_FMT, P_TILE_MAX, ACC_TILE_UNITS, V_FMT, V_SCALE, EXP_MODE,
                        MASK_MODE, phase == 1, IS_CAUSAL,
                        HAS_DS, POSITIVE_SCALE, SOFTCAP, ALIBI,
                        K_GROUP, V_GROUP, EXACT_FP8, DOT_PRECISION, USE_TMA,
                        HEAD_D, HEAD_DV, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV)
    else:
        # Tensor mask: only the key tiles the summary does not skip, bounds always checked.
        n_live = tl.load(cnt_ptr + b * scnb + hq * scnh + pid_m * scnm)
        tile_base = tiles_ptr + b * stb + hq * sth + pid_m * stm
        code_base = sum_ptr + b * ssb + hq * ssh + pid_m * ssm
        for i in range(0, n_live):
            n_tile = tl.load(tile_base + i * stn)
            code = tl.load(code_base + n_tile * ssn)
            acc, acc_unit, acc_shift, m_i, l_i = _tile_step(
                acc, acc_unit, acc_shift, m_i, l_i, q, q2, q_scale, start_m, n_tile * BLOCK_N,
                k_base, v_base, k_desc, v_desc, ks_base, vs_base, ds_row, mask_base, cs_base, code,
                Lq, Lkv, qk_scale, thr_log2, c0, c1, c2, c3, cap_log2, slope_log2, skl, skd, svl,
                svd, sksg, svsg, smm, smn, scsc, QK_FMT, P_FMT, P_TILE_MAX, ACC_TILE_UNITS, V_FMT, V_SCALE, EXP_MODE,
                MASK_MODE, True,
                IS_CAUSAL,
                HAS_DS, POSITIVE_SCALE, SOFTCAP, ALIBI, K_GROUP, V_GROUP, EXACT_FP8, DOT_PRECISION,
                USE_TMA,
                HEAD_D, HEAD_DV, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV)

    if V_SCALE == VS_TILE:
        acc = acc * acc_unit
    elif V_SCALE == VS_CHANNEL:
        acc = acc * tl.load(vs_base + offs_dv * svsg, mask=offs_dv < HEAD_DV, other=0.0)[None, :]
    seen = l_i != 0  # no visible key: l = 0; a NaN row stays NaN
    denom = tl.where(seen, l_i, 1.0)
    if ACC_TILE_UNITS:  # acc in units of 2^(acc_shift − m_i), acc_shift ≥ m_i − P_TILE_FLOOR
        # (both finite on a seen row; an unseen row's may be -inf: kept out of the subtraction)
        denom = denom * tl.math.exp2(tl.where(seen, m_i, 0.0) - tl.where(seen, acc_shift, 0.0))
    o = acc / denom[:, None]
    if SMOOTH_V:
        vmean = tl.load(vmean_ptr + b * svmb + hkv * svmh + offs_dv, mask=offs_dv < HEAD_DV,
                        other=0.0)
        o += vmean[None, :]
    o = tl.where(seen[:, None], o, 0.0)
    if o_ptr.dtype.element_ty == tl.float16:
        # FP8 P's l is summed before rounding, so O may pass max|V| by up to ~6 %: where V
        # nears float16's max, saturate rather than overflow (NaN stays NaN)
        o = tl.clamp(o, -FP16_MAX, FP16_MAX, propagate_nan=tl.PropagateNan.ALL)
    store_tile(o_ptr + b * sob + hq * soh, o, offs_m, offs_dv, sol, sod, Lq, HEAD_DV, True,
               HEAD_DV != BLOCK_DV)

