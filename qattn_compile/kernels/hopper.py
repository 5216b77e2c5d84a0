"""Tier 2: Hopper warp-specialized attention in Gluon (FlashAttention-3's structure).

One program computes ``2·BLOCK_M`` query rows of one (batch, query head) as two consumer
warpgroups of ``BLOCK_M`` = 64 rows each. A one-warp producer fills a ring of ``STAGES`` K/V
tiles by TMA (a ``ready`` barrier per stage, armed by the copies; an ``empty`` barrier per
stage that both consumers arrive on), and registers move from the producer to the consumers
(``warp_specialize``'s register counts). Per consumer and key tile: ``S = Q̂·K̂ᵀ`` (FP8
wgmma), the online softmax in base 2 with the rows' scale folded into the exponent's
multiply-add, ``P = fp8(448·exp2(S − m))`` relabelled into the 8-bit V's token order
(:func:`~.primitives.v_column_of_token`) and handed to the ``P·V`` wgmma from registers, a
fresh product added to the float32 accumulator once per tile (as tier 1 does). Key tiles run
in two phases: those no row masks, then the diagonal / ragged tail with bounds and causal
masks.

It reads the operands tier 1's launchers prepare (:mod:`.launch`, the same quantizers, so
the math and the reference are tier 1's), in two formats (``QK_INT8``):

- ``fp8``: Q̂, K̂ e4m3; K scales per ``K_GROUP`` keys, a multiple of ``BLOCK_N`` (one scale
  per key tile, folded into the rows' scale); V̂ with one scale per ``V_GROUP`` keys (a
  multiple of ``BLOCK_N``; ``V_PER_CHANNEL`` off).
- ``sage2_8b``: Q̂, K̂ INT8 (int32 scores), K scales per ``K_GROUP`` keys (a divisor of
  ``BLOCK_N``: a scale per column) or per tile; SageAttention2's ΔS row added per key
  (``HAS_DS``; one row per 128 queries, a program's rows); V̂ e4m3 with a scale per channel
  (``V_PER_CHANNEL``, applied once at the end) and its smoothing mean added back
  (``SMOOTH_V``).

Layouts: Q̂ ``[B, Hq, Lq, D]``, K̂ ``[B, Hkv, Lkv, D]``, V̂ transposed ``[B, Hkv, D, L_pad]``;
Q scales per ``Q_GROUP`` queries with the softmax scale and log2 e folded in. Query head
``h`` reads kv head ``h // (Hq / Hkv)`` (GQA without repeating K/V). What tier 2 serves, and
why not otherwise, is :mod:`.tiers`'s to say.

Gluon is experimental and changes between Triton releases: this module is imported only on
the Triton versions :data:`.tiers.TESTED_TRITON` lists.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

BLOCK_M = 64
"""Query rows per consumer warpgroup (a Hopper ``m64`` wgmma); a program holds two."""
LOG2_448 = gl.constexpr(math.log2(448.0))
LN2 = gl.constexpr(math.log(2.0))
FP16_MAX = gl.constexpr(65504.0)


@gluon.jit
def _producer(k_desc, v_desc, k_smem, v_smem, ready, empty, k_row0, v_row0, n_tiles,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Fill the K/V ring: tile ``j`` goes to stage ``j % STAGES`` once both consumers have
    released that stage's previous tile; ``ready`` completes when its two copies land."""
    for j in range(n_tiles):
        stage = j % STAGES
        if j >= STAGES:
            mbarrier.wait(empty.index(stage), phase=((j // STAGES) & 1) ^ 1)
        bar = ready.index(stage)
        mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [k_row0 + j * BLOCK_N, 0], bar, k_smem.index(stage))
        tma.async_copy_global_to_shared(v_desc, [v_row0, j * BLOCK_N], bar, v_smem.index(stage))


@gluon.jit
def _in_v_key_order(p):
    """P ``[M, N]`` with its columns in the 8-bit V's stored token order (the map of
    :func:`~.primitives.v_column_of_token`: offset bits ``(h, j, t, e)`` within each block of
    32 become ``(h, t, j, e)``), so that each thread's P values sit where the register
    operand of the ``P·V`` wgmma reads them."""
    M: gl.constexpr = p.shape[0]
    N: gl.constexpr = p.shape[1]
    by_bits = gl.reshape(p, [M, N // 32, 2, 2, 4, 2])
    return gl.reshape(gl.permute(by_bits, [0, 1, 2, 4, 3, 5]), [M, N])


@gluon.jit
def _scores(s, j, q_scale, ks_base, sksg, ds_row, Lkv, K_GROUP: gl.constexpr,
            QK_INT8: gl.constexpr, HAS_DS: gl.constexpr, BLOCK_N: gl.constexpr):
    """The raw scores of key tile ``j`` as ``(t, row_scale)``: the scores in log2 units are
    ``t·row_scale[:, None]`` (``row_scale`` positive, left for the exponent's multiply-add),
    or, with ``HAS_DS``, ``t`` itself (ΔS added; ``row_scale`` then already applied)."""
    s_layout: gl.constexpr = s.type.layout
    start_n = j * BLOCK_N
    if QK_INT8:
        s = s.to(gl.float32)
    if K_GROUP % BLOCK_N == 0:
        row_scale = q_scale * gl.load(ks_base + (start_n // K_GROUP) * sksg)
    else:
        cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        k_scale = gl.load(ks_base + (cols // K_GROUP) * sksg, mask=cols < Lkv, other=1.0)
        s = s * gl.expand_dims(k_scale, 0)
        row_scale = q_scale
    if HAS_DS:
        cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        delta = gl.load(ds_row + cols, mask=cols < Lkv, other=0.0)
        s = s * gl.expand_dims(row_scale, 1) + gl.expand_dims(delta, 0)
    return s, row_scale


@gluon.jit
def _tile(j, acc, acc_unit, m_i, l_i, q_smem, k_smem, v_smem, ready, empty, q_scale, rows,
          ks_base, vs_base, ds_row, sksg, svsg, Lkv, zero_s, zero_o,
          BOUNDED: gl.constexpr, IS_CAUSAL: gl.constexpr, K_GROUP: gl.constexpr,
          V_GROUP: gl.constexpr, QK_INT8: gl.constexpr, HAS_DS: gl.constexpr,
          V_PER_CHANNEL: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Fold key tile ``j`` (from ring stage ``j % STAGES``) into one consumer's online-softmax
    state: ``acc`` float32 ``[BLOCK_M, D]`` in units of the scalar ``acc_unit`` (the last
    tile's V scale; 1 with ``V_PER_CHANNEL``), ``m_i`` (running max, log2 units) and ``l_i``
    (running sum of the unrounded P, in units of 448) float32 ``[BLOCK_M]``. ``BOUNDED``:
    mask keys ``>= Lkv`` and, with ``IS_CAUSAL``, keys after the row (top-left)."""
    o_layout: gl.constexpr = zero_o.type.layout
    stage = j % STAGES
    start_n = j * BLOCK_N
    if not V_PER_CHANNEL:
        v_scale = gl.load(vs_base + (start_n // V_GROUP) * svsg)
    mbarrier.wait(ready.index(stage), phase=(j // STAGES) & 1)
    s = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), zero_s, use_acc=False,
                      is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    s, row_scale = _scores(s, j, q_scale, ks_base, sksg, ds_row, Lkv, K_GROUP, QK_INT8, HAS_DS,
                           BLOCK_N)
    if BOUNDED:
        cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
        keep = gl.expand_dims(cols < Lkv, 0)
        if IS_CAUSAL:
            keep = keep & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1))
        s = gl.where(keep, s, float("-inf"))
    if HAS_DS:
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
    else:
        # the rows' scale is positive: the max of the scores times it is the scaled max
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * row_scale)
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    if HAS_DS:
        p = gl.exp2(s + gl.expand_dims(LOG2_448 - m_use, 1))
    else:
        p = gl.exp2(s * gl.expand_dims(row_scale, 1) + gl.expand_dims(LOG2_448 - m_use, 1))
    l_i = l_i * alpha + gl.sum(p, axis=1)
    p_op = gl.convert_layout(_in_v_key_order(p.to(gl.float8e4nv)),
                             gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4),
                             assert_trivial=True)
    pv = warpgroup_mma(p_op, v_smem.index(stage).permute((1, 0)), zero_o, use_acc=False,
                       is_async=True)
    pv = warpgroup_mma_wait(num_outstanding=0, deps=(pv,))
    mbarrier.arrive(empty.index(stage), count=1)
    # the accumulator moves to this tile's V units with the per-row rescale it takes anyway
    acc_alpha = alpha
    if not V_PER_CHANNEL:
        acc_alpha = alpha * (acc_unit / v_scale)
        acc_unit = v_scale
    acc = acc * gl.expand_dims(gl.convert_layout(acc_alpha, gl.SliceLayout(1, o_layout)), 1) + pv
    return acc, acc_unit, m_new, l_i


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, ready, empty, o_ptr, lse_ptr, qs_base, ks_base, vs_base,
              ds_row, vmean_base, first_row, Lq, Lkv, n_full, n_tiles, sqsg, sksg, svsg, sol,
              sod, lse_row0,
              D: gl.constexpr, IS_CAUSAL: gl.constexpr, Q_GROUP: gl.constexpr,
              K_GROUP: gl.constexpr, V_GROUP: gl.constexpr, QK_INT8: gl.constexpr,
              HAS_DS: gl.constexpr, V_PER_CHANNEL: gl.constexpr, SMOOTH_V: gl.constexpr,
              RETURN_LSE: gl.constexpr, SATURATE_FP16: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr):
    """One warpgroup's query rows ``[first_row, first_row + BLOCK_M)`` of its head against
    every key tile of the ring; writes their rows of ``o`` (``o_ptr`` at the head, row and
    channel strides ``sol``, ``sod``) and, with ``RETURN_LSE``, their natural-log
    log-sum-exp (float32, at ``lse_ptr + lse_row0 + row``). Rows past ``Lq`` are not
    written."""
    BLOCK_M: gl.constexpr = q_smem.shape[0]
    # INT8 score MMAs at most 128 keys wide (Triton 3.6 does not lower an n=256 int8 wgmma)
    S_INSTR_N: gl.constexpr = min(BLOCK_N, 128) if QK_INT8 else BLOCK_N
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, S_INSTR_N, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 32])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    rows = first_row + gl.arange(0, BLOCK_M, layout=row_s)
    q_scale = gl.load(qs_base + (rows // Q_GROUP) * sqsg, mask=rows < Lq, other=1.0)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
    acc = gl.zeros([BLOCK_M, D], gl.float32, layout=o_layout)
    acc_unit = gl.to_tensor(1.0)
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.int32 if QK_INT8 else gl.float32, layout=s_layout)
    zero_o = gl.zeros([BLOCK_M, D], gl.float32, layout=o_layout)
    for j in range(0, n_full):
        acc, acc_unit, m_i, l_i = _tile(j, acc, acc_unit, m_i, l_i, q_smem, k_smem, v_smem,
                                        ready, empty, q_scale, rows, ks_base, vs_base, ds_row,
                                        sksg, svsg, Lkv, zero_s, zero_o, False, IS_CAUSAL,
                                        K_GROUP, V_GROUP, QK_INT8, HAS_DS, V_PER_CHANNEL,
                                        BLOCK_N, STAGES)
    for j in range(n_full, n_tiles):
        acc, acc_unit, m_i, l_i = _tile(j, acc, acc_unit, m_i, l_i, q_smem, k_smem, v_smem,
                                        ready, empty, q_scale, rows, ks_base, vs_base, ds_row,
                                        sksg, svsg, Lkv, zero_s, zero_o, True, IS_CAUSAL,
                                        K_GROUP, V_GROUP, QK_INT8, HAS_DS, V_PER_CHANNEL,
                                        BLOCK_N, STAGES)
    seen = l_i != 0.0  # no visible key: l = 0 (a NaN row stays NaN)
    inv = gl.where(seen, acc_unit / l_i, 0.0)
    o = acc * gl.expand_dims(gl.convert_layout(inv, row_o), 1)
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    if V_PER_CHANNEL:
        o = o * gl.expand_dims(gl.load(vs_base + cols * svsg), 0)
    if SMOOTH_V:
        o = gl.where(gl.expand_dims(gl.convert_layout(seen, row_o), 1),
                     o + gl.expand_dims(gl.load(vmean_base + cols), 0), 0.0)
    if SATURATE_FP16:
        # l sums the unrounded P, so O may pass max|V| slightly: saturate, NaN stays NaN
        o = gl.where(o > FP16_MAX, FP16_MAX, gl.where(o < -FP16_MAX, -FP16_MAX, o))
    rows_o = first_row + gl.arange(0, BLOCK_M, layout=row_o)
    ptrs = o_ptr + gl.expand_dims(rows_o, 1) * sol + gl.expand_dims(cols, 0) * sod
    gl.store(ptrs, o.to(o_ptr.dtype.element_ty), mask=gl.expand_dims(rows_o < Lq, 1))
    if RETURN_LSE:
        lse = gl.where(seen, (m_i + gl.log2(l_i) - LOG2_448) * LN2, float("-inf"))
        gl.store(lse_ptr + lse_row0 + rows, lse, mask=rows < Lq)


@gluon.jit
def _attention_kernel(q_desc, k_desc, v_desc, o_ptr, lse_ptr, qs_ptr, ks_ptr, vs_ptr, ds_ptr,
                      vmean_ptr, Lq, Lkv, n_heads_q, hq_per_kv,
                      sob, soh, sol, sod, sqsb, sqsh, sqsg, sksb, sksh, sksg, svsb, svsh, svsg,
                      sdsb, sdsh, sdsg, svmb, svmh,
                      D: gl.constexpr, IS_CAUSAL: gl.constexpr, Q_GROUP: gl.constexpr,
                      K_GROUP: gl.constexpr, V_GROUP: gl.constexpr, QK_INT8: gl.constexpr,
                      HAS_DS: gl.constexpr, DS_GROUP: gl.constexpr, V_PER_CHANNEL: gl.constexpr,
                      SMOOTH_V: gl.constexpr, RETURN_LSE: gl.constexpr,
                      SATURATE_FP16: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                      CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                      num_warps: gl.constexpr):
    """Rows ``[pid_m·2·BLOCK_M, …)`` of (batch, query head) ``program_id(1)``; causal
    programs run longest first. Descriptors over the 2-D views q ``[B·Hq·Lq, D]``, k
    ``[B·Hkv·Lkv, D]``, vt ``[B·Hkv·D, L_pad]`` (reads past a head's rows take the next
    head's or TMA's zeros; the masks and the row bounds keep them out of the output)."""
    gl.static_assert(K_GROUP % BLOCK_N == 0 or BLOCK_N % K_GROUP == 0,
                     "K scales per tile or per column")
    gl.static_assert(V_PER_CHANNEL or V_GROUP % BLOCK_N == 0, "one V scale per key tile")
    gl.static_assert(BLOCK_N % 32 == 0, "P is relabelled in blocks of 32 keys")
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    gl.static_assert(not HAS_DS or DS_GROUP == 2 * BLOCK_M, "a program's rows share a ΔS row")
    pid_m = gl.program_id(0)
    if IS_CAUSAL:
        pid_m = gl.num_programs(0) - 1 - pid_m
    bh = gl.program_id(1)
    b = bh // n_heads_q
    hq = bh % n_heads_q
    bkv = bh // hq_per_kv  # (batch, kv head): heads of one batch are consecutive
    start_m = pid_m * 2 * BLOCK_M
    hi = Lkv
    n_full = Lkv // BLOCK_N
    if IS_CAUSAL:
        hi = gl.minimum(Lkv, start_m + 2 * BLOCK_M)
        n_full = gl.minimum(n_full, (start_m + 1) // BLOCK_N)
    n_tiles = gl.cdiv(hi, BLOCK_N)

    q0 = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, D], q_desc.layout)
    q1 = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, D, BLOCK_N], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers release each tile
    q_row0 = bh * Lq + start_m
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row0, 0], q_bar, q0)
    tma.async_copy_global_to_shared(q_desc, [q_row0 + BLOCK_M, 0], q_bar, q1)
    mbarrier.wait(q_bar, phase=0)

    o_head = o_ptr + b.to(gl.int64) * sob + hq.to(gl.int64) * soh
    qs_base = qs_ptr + b * sqsb + hq * sqsh
    ks_base = ks_ptr + b * sksb + (hq // hq_per_kv) * sksh
    vs_base = vs_ptr + b * svsb + (hq // hq_per_kv) * svsh
    ds_row = ds_ptr + b.to(gl.int64) * sdsb + hq.to(gl.int64) * sdsh + pid_m * sdsg
    vmean_base = vmean_ptr + b * svmb + (hq // hq_per_kv) * svmh
    lse_row0 = bh.to(gl.int64) * Lq
    gl.warp_specialize([
        (_consumer, (q0, k_smem, v_smem, ready, empty, o_head, lse_ptr, qs_base, ks_base,
                     vs_base, ds_row, vmean_base, start_m, Lq, Lkv, n_full, n_tiles, sqsg, sksg,
                     svsg, sol, sod, lse_row0, D, IS_CAUSAL, Q_GROUP, K_GROUP, V_GROUP,
                     QK_INT8, HAS_DS, V_PER_CHANNEL, SMOOTH_V, RETURN_LSE, SATURATE_FP16,
                     BLOCK_N, STAGES)),
        (_consumer, (q1, k_smem, v_smem, ready, empty, o_head, lse_ptr, qs_base, ks_base,
                     vs_base, ds_row, vmean_base, start_m + BLOCK_M, Lq, Lkv, n_full, n_tiles,
                     sqsg, sksg, svsg, sol, sod, lse_row0, D, IS_CAUSAL, Q_GROUP, K_GROUP,
                     V_GROUP, QK_INT8, HAS_DS, V_PER_CHANNEL, SMOOTH_V, RETURN_LSE,
                     SATURATE_FP16, BLOCK_N, STAGES)),
        (_producer, (k_desc, v_desc, k_smem, v_smem, ready, empty, bkv * Lkv, bkv * D,
                     n_tiles, BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def _descriptor(x: Tensor, block: list[int]) -> TensorDescriptor:
    """A TMA descriptor over the contiguous 2-D view ``x`` (int8 or e4m3) with boxes of
    ``block``."""
    dtype = gl.int8 if x.dtype == torch.int8 else gl.float8e4nv
    layout = gl.NVMMASharedLayout.get_default_for(block, dtype)
    return TensorDescriptor(x, list(x.shape), list(x.stride()), block, layout)


def run(q: Tensor, k: Tensor, vt: Tensor, q_scale: Tensor, q_group: int, k_scale: Tensor,
        k_group: int, v_scale: Tensor, v_group: int, out: Tensor, is_causal: bool, *,
        block_n: int, stages: int, consumer_regs: int, producer_regs: int,
        v_per_channel: bool = False, delta_s: Tensor | None = None, ds_group: int = 128,
        v_mean: Tensor | None = None, lse: Tensor | None = None) -> None:
    """Launch the kernel into ``out`` ``[B, Hq, Lq, D]`` (any strides; written in its dtype).

    q ``[B, Hq, Lq, D]``, k ``[B, Hkv, Lkv, D]`` (both e4m3, or both int8), vt ``[B, Hkv, D,
    L_pad]`` e4m3: contiguous. Scales float32 ``[B, H, n]`` with ``*_group`` tokens per scale
    (a per-tensor scale: one group, group ``1 << 30``); ``v_per_channel``: V's ``[B, Hkv,
    D]`` instead. ``delta_s``: float32 ``[B, Hq, n_blocks, Lkv]`` (keys contiguous), one row
    per ``ds_group`` queries; ``v_mean``: float32 ``[B, Hkv, 1, D]``. ``lse``: float32
    ``[B, Hq, Lq]`` contiguous, or None.
    """
    bsz, hq, lq, dim = q.shape
    hkv, lkv = k.shape[1], k.shape[2]
    q_desc = _descriptor(q.view(bsz * hq * lq, dim), [BLOCK_M, dim])
    k_desc = _descriptor(k.view(bsz * hkv * lkv, dim), [block_n, dim])
    v_desc = _descriptor(vt.view(bsz * hkv * dim, vt.shape[-1]), [dim, block_n])
    ds_strides = delta_s.stride()[:3] if delta_s is not None else (0, 0, 0)
    vm_strides = v_mean.stride()[:2] if v_mean is not None else (0, 0)
    grid = (-(-lq // (2 * BLOCK_M)), bsz * hq)
    _attention_kernel[grid](
        q_desc, k_desc, v_desc, out, out if lse is None else lse, q_scale, k_scale, v_scale,
        q_scale if delta_s is None else delta_s, q_scale if v_mean is None else v_mean,
        lq, lkv, hq, hq // hkv, *out.stride(), *q_scale.stride(), *k_scale.stride(),
        *v_scale.stride(), *ds_strides, *vm_strides,
        D=dim, IS_CAUSAL=bool(is_causal), Q_GROUP=q_group, K_GROUP=k_group, V_GROUP=v_group,
        QK_INT8=q.dtype == torch.int8, HAS_DS=delta_s is not None, DS_GROUP=ds_group,
        V_PER_CHANNEL=v_per_channel, SMOOTH_V=v_mean is not None,
        RETURN_LSE=lse is not None, SATURATE_FP16=out.dtype == torch.float16,
        BLOCK_N=block_n, STAGES=stages, CONSUMER_REGS=consumer_regs,
        PRODUCER_REGS=producer_regs, num_warps=4)
