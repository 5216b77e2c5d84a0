"""Split-K decode attention over a FlashQ KV cache (packed INT4/INT2 blocks + INT8 buffer).

Semantics: :func:`qattn_compile.kvcache.flashq.reference_decode`; storage layout:
:class:`qattn_compile.kvcache.flashq.FlashQTensors`; arithmetic of the blocks:
:mod:`qattn_compile.kvcache.flashq`.

One program serves one (batch, kv head, split): the ``G·Lq`` query rows of the kv head's
query group (GQA; padded to ``BLOCK_M >= 16`` rows for the tensor-core dot) against the
split's share of the compressed blocks; the last split also takes the INT8 buffer. Channels
are handled as four quarters of ``Q = D/4``: the split packing puts each quarter in one bit
field of contiguous bytes, so a quarter's codes come from a contiguous byte load and one
shift and mask. Per 64-token block and quarter the kernel rebuilds the INT8 integers
``code·step + lo`` with one fp16 multiply-add (exact: integers below 256) and runs

    S = Σ_quarters (q·τ·log2 e) · q8'ᵀ · s8          (fp16 dots, fp32 accumulation)
    online softmax in base 2;  acc_quarter += (P · v8'_quarter) · s8_v

so no float copy of the cache exists anywhere. The grid is ``(H, splits, B)`` with the INT4
heads' slots first; the stored length is read on the device, each split takes
``[split·n/S, (split+1)·n/S)`` of the ``n`` compressed blocks, and the launch never syncs
with the host (CUDA-graph safe). :func:`_combine_kernel` merges the splits' ``(m, l, acc)``.

Bytes moved per token and kv head (D = 128): INT4 68 for K and as much for V, INT2 36,
against 256 for bf16. Measured on the H100 (torch 2.11, triton 3.6; ``benchmarks/decode.py``,
GQA 32/8, D=128): B=8 × 32K 0.322 ms (INT4), 0.321 (2/4 mix), 0.318 (INT2) against SDPA's
0.366 on a bf16 cache (1.14×); B=1 × 128K 0.267 against 0.195. INT2 is no faster than INT4,
so the kernel is not memory-bound yet (887 GB/s for INT4): the per-block chain of code
extraction, dequantization, the two dots and the online softmax bounds it (a CTA spends
about 2 µs per 64-token block), not the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..blocks import KV_CACHE_BLOCK
from .primitives import interpreted

_LOG2E = 1.4426950408889634
_MASK_NONE, _MASK_BOOL, _MASK_ADD = 0, 1, 2


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters; ``splits=None`` picks :func:`default_splits`. The defaults are the
    fastest of the sweep in ``benchmarks/decode.py`` on the H100 (torch 2.11, triton 3.6) at
    B=8 × 32K and B=1 × 128K alike (8 warps took twice as long)."""

    splits: int | None = None
    num_warps: int = 4
    num_stages: int = 3


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _code_quarters(codes_ptr, rows, c_t, Q, QB: tl.constexpr, BITS: tl.constexpr):
    """Codes of rows ``rows`` ``[N]`` as four ``[N, QB]`` int32 tiles, one per channel quarter
    (channels ``[jQ, jQ + Q)``, columns ``>= Q`` zero). Split layout: INT4 byte ``i < 2Q``
    holds channel ``i`` (low nibble) and ``i + 2Q``; INT2 byte ``i < Q`` holds ``i + jQ`` at
    bits ``2j``. Contiguous byte loads, one shift and mask per code, no register shuffles."""
    cols = tl.arange(0, QB)
    ok = (cols < Q)[None, :]
    base = codes_ptr + rows[:, None] * c_t + cols[None, :]
    a = tl.load(base, mask=ok, other=0).to(tl.int32)
    if BITS == 4:
        b = tl.load(base + Q, mask=ok, other=0).to(tl.int32)
        return a & 15, b & 15, a >> 4, b >> 4
    else:
        return a & 3, (a >> 2) & 3, (a >> 4) & 3, a >> 6


@triton.jit
def _dequant(codes, step_ptr, lo_ptr, quarter, Q, QB: tl.constexpr):
    """``code·step + lo`` for one quarter ``[N, QB]``, in fp16 (integers <= 255 in magnitude:
    exact)."""
    cols = tl.arange(0, QB)
    ok = cols < Q
    step = tl.load(step_ptr + quarter * Q + cols, mask=ok, other=0).to(tl.float16)
    lo = tl.load(lo_ptr + quarter * Q + cols, mask=ok, other=0).to(tl.float16)
    return codes.to(tl.float16) * step[None, :] + lo[None, :]


@triton.jit
def _int8_quarter(ptr, rows, ok_rows, stride_t, quarter, Q, QB: tl.constexpr):
    """Quarter ``quarter`` of INT8 rows (the decode buffer) as fp16 ``[N, QB]``."""
    cols = tl.arange(0, QB)
    ok = ok_rows[:, None] & (cols < Q)[None, :]
    return tl.load(ptr + rows[:, None] * stride_t + quarter * Q + cols[None, :], mask=ok, other=0).to(tl.float16)


@triton.jit
def _visible_scores(s, keys, qpos, row_ok, mask_row_ptr, sm_k, mask_len, MASK_KIND: tl.constexpr):
    """Scores ``s`` ``[M, N]`` (log2 units) of keys ``keys`` ``[N]`` for queries at positions
    ``qpos`` ``[M]``: causal, then the user mask; invisible → -inf."""
    vis = keys[None, :] <= qpos[:, None]
    if MASK_KIND != 0:
        ok = row_ok[:, None] & (keys[None, :] < mask_len)
        m = tl.load(mask_row_ptr[:, None] + keys[None, :] * sm_k, mask=ok, other=0)
        if MASK_KIND == 1:
            vis = vis & (m != 0)
        else:
            s = s + m.to(tl.float32) * 1.4426950408889634
    return tl.where(vis, s, float("-inf"))


@triton.jit
def _softmax_step(s, m_i, l_i):
    """Online softmax in base 2 for a score tile ``s`` ``[M, N]``: returns the new max, the
    rescale factor of the old state, the sum and P as fp16."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return m_new, alpha, l_i * alpha + tl.sum(p, 1), p.to(tl.float16)


@triton.jit
def _decode_head(
    q_ptr, sq_b, sq_h, sq_l,
    codes_ptr, c_kv, c_t,
    step_ptr, lo_ptr, m_kv, m_blk,
    s8_ptr, s8_kv,
    buf_ptr, buf_kv, buf_t, bs_ptr, bs_kv,
    len_ptr,
    mask_ptr, sm_b, sm_h, sm_q, sm_k, mask_len,
    part_o_ptr, part_ml_ptr, part,
    b, h, split, n_splits, qk_scale, G, LQ, Q, NBUF,
    BITS: tl.constexpr, BLOCK_M: tl.constexpr, QB: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_KIND: tl.constexpr,
):
    """Partial attention of kv head ``h`` of batch ``b`` over split ``split`` (module doc).

    Pointers are already offset to this (batch, head): ``codes_ptr`` ``[2, T, D·BITS/8]``
    (strides ``c_kv``, ``c_t``), ``step_ptr``/``lo_ptr`` ``[2, NB, D]`` (``m_kv``, ``m_blk``),
    ``s8_ptr`` ``[2, NB]`` (``s8_kv``), ``buf_ptr`` ``[2, n_b, D]`` (``buf_kv``, ``buf_t``),
    ``bs_ptr`` ``[2]`` (``bs_kv``). Channels are processed as four quarters of ``Q = D/4``
    (padded to ``QB``). Writes partials ``part`` of ``part_o`` ``[.., BLOCK_M, 4, QB]`` and
    ``part_ml`` ``[.., BLOCK_M, 2]``.
    """
    rows = tl.arange(0, BLOCK_M)
    g = rows // LQ
    qi = rows % LQ
    row_ok = rows < G * LQ
    hq = h * G + g
    cols = tl.arange(0, QB)
    q_tile = q_ptr + b * sq_b + hq[:, None] * sq_h + qi[:, None] * sq_l + cols[None, :]
    q_ok = row_ok[:, None] & (cols < Q)[None, :]
    q0 = (tl.load(q_tile, mask=q_ok, other=0.0).to(tl.float32) * qk_scale).to(tl.float16)
    q1 = (tl.load(q_tile + Q, mask=q_ok, other=0.0).to(tl.float32) * qk_scale).to(tl.float16)
    q2 = (tl.load(q_tile + 2 * Q, mask=q_ok, other=0.0).to(tl.float32) * qk_scale).to(tl.float16)
    q3 = (tl.load(q_tile + 3 * Q, mask=q_ok, other=0.0).to(tl.float32) * qk_scale).to(tl.float16)
    mask_row_ptr = mask_ptr + b * sm_b + hq * sm_h + qi * sm_q

    length = tl.load(len_ptr).to(tl.int32)
    compressed = (length // NBUF) * NBUF
    n_blocks = compressed // BLOCK_N
    first = split * n_blocks // n_splits
    last = (split + 1) * n_blocks // n_splits
    qpos = length - LQ + qi

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc0 = tl.zeros([BLOCK_M, QB], tl.float32)
    acc1 = tl.zeros([BLOCK_M, QB], tl.float32)
    acc2 = tl.zeros([BLOCK_M, QB], tl.float32)
    acc3 = tl.zeros([BLOCK_M, QB], tl.float32)
    toks = tl.arange(0, BLOCK_N)
    for blk in range(first, last):
        keys = blk * BLOCK_N + toks
        k_step = step_ptr + blk * m_blk
        k_lo = lo_ptr + blk * m_blk
        c0, c1, c2, c3 = _code_quarters(codes_ptr, keys, c_t, Q, QB, BITS)
        s = tl.dot(q0, tl.trans(_dequant(c0, k_step, k_lo, 0, Q, QB)))
        s = tl.dot(q1, tl.trans(_dequant(c1, k_step, k_lo, 1, Q, QB)), s)
        s = tl.dot(q2, tl.trans(_dequant(c2, k_step, k_lo, 2, Q, QB)), s)
        s = tl.dot(q3, tl.trans(_dequant(c3, k_step, k_lo, 3, Q, QB)), s)
        s = _visible_scores(s * tl.load(s8_ptr + blk), keys, qpos, row_ok, mask_row_ptr, sm_k, mask_len, MASK_KIND)
        m_i, alpha, l_i, p = _softmax_step(s, m_i, l_i)
        v_scale = tl.load(s8_ptr + s8_kv + blk)
        v_step = k_step + m_kv
        v_lo = k_lo + m_kv
        c0, c1, c2, c3 = _code_quarters(codes_ptr + c_kv, keys, c_t, Q, QB, BITS)
        acc0 = acc0 * alpha[:, None] + tl.dot(p, _dequant(c0, v_step, v_lo, 0, Q, QB)) * v_scale
        acc1 = acc1 * alpha[:, None] + tl.dot(p, _dequant(c1, v_step, v_lo, 1, Q, QB)) * v_scale
        acc2 = acc2 * alpha[:, None] + tl.dot(p, _dequant(c2, v_step, v_lo, 2, Q, QB)) * v_scale
        acc3 = acc3 * alpha[:, None] + tl.dot(p, _dequant(c3, v_step, v_lo, 3, Q, QB)) * v_scale

    if split == n_splits - 1:
        buffered = length - compressed
        k_scale = tl.load(bs_ptr)
        v_scale = tl.load(bs_ptr + bs_kv)
        for t0 in range(0, buffered, BLOCK_N):
            local = t0 + toks
            ok = local < buffered
            s = tl.dot(q0, tl.trans(_int8_quarter(buf_ptr, local, ok, buf_t, 0, Q, QB)))
            s = tl.dot(q1, tl.trans(_int8_quarter(buf_ptr, local, ok, buf_t, 1, Q, QB)), s)
            s = tl.dot(q2, tl.trans(_int8_quarter(buf_ptr, local, ok, buf_t, 2, Q, QB)), s)
            s = tl.dot(q3, tl.trans(_int8_quarter(buf_ptr, local, ok, buf_t, 3, Q, QB)), s)
            s = tl.where(ok[None, :], s * k_scale, float("-inf"))
            s = _visible_scores(s, compressed + local, qpos, row_ok, mask_row_ptr, sm_k, mask_len, MASK_KIND)
            m_i, alpha, l_i, p = _softmax_step(s, m_i, l_i)
            v = buf_ptr + buf_kv
            acc0 = acc0 * alpha[:, None] + tl.dot(p, _int8_quarter(v, local, ok, buf_t, 0, Q, QB)) * v_scale
            acc1 = acc1 * alpha[:, None] + tl.dot(p, _int8_quarter(v, local, ok, buf_t, 1, Q, QB)) * v_scale
            acc2 = acc2 * alpha[:, None] + tl.dot(p, _int8_quarter(v, local, ok, buf_t, 2, Q, QB)) * v_scale
            acc3 = acc3 * alpha[:, None] + tl.dot(p, _int8_quarter(v, local, ok, buf_t, 3, Q, QB)) * v_scale

    out = part_o_ptr + part * BLOCK_M * 4 * QB + rows[:, None] * (4 * QB) + cols[None, :]
    tl.store(out, acc0)
    tl.store(out + QB, acc1)
    tl.store(out + 2 * QB, acc2)
    tl.store(out + 3 * QB, acc3)
    tl.store(part_ml_ptr + (part * BLOCK_M + rows) * 2, m_i)
    tl.store(part_ml_ptr + (part * BLOCK_M + rows) * 2 + 1, l_i)


@triton.jit
def _flashq_decode_kernel(
    q_ptr, sq_b, sq_h, sq_l,
    c4_ptr, c4_kv, c4_b, c4_h, c4_t,
    c2_ptr, c2_kv, c2_b, c2_h, c2_t,
    heads4_ptr, heads2_ptr, n4,
    step_ptr, lo_ptr, m_kv, m_b, m_h, m_blk,
    s8_ptr, s8_kv, s8_b, s8_h,
    buf_ptr, buf_kv, buf_b, buf_h, buf_t,
    bs_ptr, bs_kv, bs_b,
    len_ptr,
    mask_ptr, sm_b, sm_h, sm_q, sm_k, mask_len,
    part_o_ptr, part_ml_ptr,
    qk_scale, G, LQ, Q, NBUF,
    BLOCK_M: tl.constexpr, QB: tl.constexpr, BLOCK_N: tl.constexpr, MASK_KIND: tl.constexpr,
):
    """Grid ``(H, splits, B)``: axis 0 is the head slot, the ``n4`` INT4 slots first."""
    slot = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    n_heads = tl.num_programs(0)
    n_splits = tl.num_programs(1)
    is4 = slot < n4
    h = tl.load(tl.where(is4, heads4_ptr + slot, heads2_ptr + slot - n4))
    step = step_ptr + b * m_b + h * m_h
    lo = lo_ptr + b * m_b + h * m_h
    s8 = s8_ptr + b * s8_b + h * s8_h
    buf = buf_ptr + b * buf_b + h * buf_h
    bs = bs_ptr + b * bs_b + h
    part = (b * n_heads + h) * n_splits + split
    if is4:
        _decode_head(
            q_ptr, sq_b, sq_h, sq_l, c4_ptr + b * c4_b + slot * c4_h, c4_kv, c4_t,
            step, lo, m_kv, m_blk, s8, s8_kv, buf, buf_kv, buf_t, bs, bs_kv, len_ptr,
            mask_ptr, sm_b, sm_h, sm_q, sm_k, mask_len, part_o_ptr, part_ml_ptr, part,
            b, h, split, n_splits, qk_scale, G, LQ, Q, NBUF,
            4, BLOCK_M, QB, BLOCK_N, MASK_KIND,
        )
    else:
        _decode_head(
            q_ptr, sq_b, sq_h, sq_l, c2_ptr + b * c2_b + (slot - n4) * c2_h, c2_kv, c2_t,
            step, lo, m_kv, m_blk, s8, s8_kv, buf, buf_kv, buf_t, bs, bs_kv, len_ptr,
            mask_ptr, sm_b, sm_h, sm_q, sm_k, mask_len, part_o_ptr, part_ml_ptr, part,
            b, h, split, n_splits, qk_scale, G, LQ, Q, NBUF,
            2, BLOCK_M, QB, BLOCK_N, MASK_KIND,
        )


@triton.jit
def _combine_kernel(
    part_o_ptr, part_ml_ptr, out_ptr, so_b, so_h, so_l,
    n_heads, n_splits, G, LQ, Q,
    BLOCK_M: tl.constexpr, QB: tl.constexpr,
):
    """Merge the splits of (kv head ``program_id(0)``, batch ``program_id(1)``) into ``out``
    ``[B, Hq, Lq, D]``; a row no split saw a visible key for gets 0."""
    h = tl.program_id(0)
    b = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, 4 * QB)  # quarter cols // QB, channel (cols // QB)·Q + cols % QB
    first = (b * n_heads + h) * n_splits
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(n_splits):
        m = tl.maximum(m, tl.load(part_ml_ptr + ((first + s) * BLOCK_M + rows) * 2))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, 4 * QB], tl.float32)
    for s in range(n_splits):
        ml = part_ml_ptr + ((first + s) * BLOCK_M + rows) * 2
        w = tl.exp2(tl.load(ml) - m_safe)
        l += w * tl.load(ml + 1)
        o = tl.load(part_o_ptr + (first + s) * BLOCK_M * 4 * QB + rows[:, None] * (4 * QB) + cols[None, :])
        acc += w[:, None] * o
    out = tl.where((l > 0)[:, None], acc / tl.where(l > 0, l, 1.0)[:, None], 0.0)
    g = rows // LQ
    qi = rows % LQ
    channel = (cols // QB) * Q + cols % QB
    ok = (rows < G * LQ)[:, None] & (cols % QB < Q)[None, :]
    ptr = out_ptr + b * so_b + (h * G + g)[:, None] * so_h + qi[:, None] * so_l + channel[None, :]
    tl.store(ptr, out, mask=ok)


# ----------------------------------------------------------------------------- launcher


DEFAULT_SPLITS = 16
"""Splits per (batch, kv head): the sweep's best on the H100 for 64 and for 8 (batch, kv
head) pairs alike (more splits only add partials to merge)."""


def default_splits(batch: int, kv_heads: int, n_blocks: int) -> int:
    """:data:`DEFAULT_SPLITS`, with at least four blocks of the capacity ``n_blocks`` each.

    Depends only on the capacity (not on the stored length), so a captured CUDA graph stays
    valid as the cache grows.
    """
    return max(1, min(DEFAULT_SPLITS, n_blocks // 4))


def _mask_args(attn_mask: Tensor | None, q: Tensor, device: torch.device):
    """(kind, tensor, strides b/h/q/k, key length) of an optional mask broadcast to
    ``[B, Hq, Lq, Lm]``; bool masks are read as bytes."""
    if attn_mask is None:
        return _MASK_NONE, torch.empty(1, dtype=torch.uint8, device=device), (0, 0, 0, 0), 0
    mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], mask.shape[-1])
    kind = _MASK_BOOL if mask.dtype == torch.bool else _MASK_ADD
    if kind == _MASK_BOOL:
        mask = mask.view(torch.uint8)
    return kind, mask, tuple(mask.stride()), mask.shape[-1]


def flashq_decode_triton(q: Tensor, t, attn_mask: Tensor | None = None, scale: float | None = None,
                         config: DecodeConfig | None = None) -> Tensor:
    """Launch the decode kernel: ``q`` ``[B, Hq, Lq, D]`` over the FlashQ storage ``t``
    (:class:`~qattn_compile.kvcache.flashq.FlashQTensors`). Returns ``[B, Hq, Lq, D]`` in q's dtype.

    CPU tensors run under the Triton interpreter (``TRITON_INTERPRET=1``, tests).
    """
    interpreted(q.device)
    config = config or DecodeConfig()
    b, hq, lq, d = q.shape
    _, _, h, n_blocks, _ = t.step.shape
    group = hq // h
    if q.stride(-1) != 1:
        q = q.contiguous()
    block_m = max(16, triton.next_power_of_2(group * lq))
    quarter = d // 4
    quarter_block = max(16, triton.next_power_of_2(quarter))
    splits = config.splits or default_splits(b, h, n_blocks)
    kind, mask, (sm_b, sm_h, sm_q, sm_k), mask_len = _mask_args(attn_mask, q, q.device)
    part_o = torch.empty(b, h, splits, block_m, 4, quarter_block, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(b, h, splits, block_m, 2, dtype=torch.float32, device=q.device)
    tau = d**-0.5 if scale is None else scale
    c4, c2 = t.codes4, t.codes2
    # zero-size code tensors (no INT4 or no INT2 heads) are never read: pass the other one
    c4 = c4 if c4.numel() else c2
    c2 = c2 if c2.numel() else c4
    _flashq_decode_kernel[(h, splits, b)](
        q, q.stride(0), q.stride(1), q.stride(2),
        c4, c4.stride(0), c4.stride(1), c4.stride(2), c4.stride(3),
        c2, c2.stride(0), c2.stride(1), c2.stride(2), c2.stride(3),
        t.heads4, t.heads2, t.heads4.numel(),
        t.step, t.lo, t.step.stride(0), t.step.stride(1), t.step.stride(2), t.step.stride(3),
        t.scale8, t.scale8.stride(0), t.scale8.stride(1), t.scale8.stride(2),
        t.buf, t.buf.stride(0), t.buf.stride(1), t.buf.stride(2), t.buf.stride(3),
        t.buf_scale, t.buf_scale.stride(0), t.buf_scale.stride(1),
        t.length,
        mask, sm_b, sm_h, sm_q, sm_k, mask_len,
        part_o, part_ml,
        tau * _LOG2E, group, lq, quarter, t.buf.shape[-2],
        BLOCK_M=block_m, QB=quarter_block, BLOCK_N=KV_CACHE_BLOCK, MASK_KIND=kind,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    out = torch.empty(b, hq, lq, d, dtype=q.dtype, device=q.device)
    _combine_kernel[(h, b)](
        part_o, part_ml, out, out.stride(0), out.stride(1), out.stride(2),
        h, splits, group, lq, quarter,
        BLOCK_M=block_m, QB=quarter_block, num_warps=4,
    )
    return out
