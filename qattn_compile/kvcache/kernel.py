"""Split-K decode attention over a FlashQ KV cache (packed INT4/INT2 blocks + INT8 buffer).

Semantics: :func:`qattn_compile.kvcache.flashq.reference_decode`; storage layout:
:class:`qattn_compile.kvcache.flashq.FlashQTensors`; arithmetic of the blocks:
:mod:`qattn_compile.kvcache.flashq`.

Work split. The grid is ``(splits + 1, B, H)``, the INT4 heads' slots first along axis 2.
Program ``(i, b, slot)`` with ``i < splits`` serves the ``GL = G·Lq`` query rows of the kv
head's query group (GQA) against the stored compressed tiles ``i, i + splits, i + 2·splits,
...``; program ``i = splits`` serves the same rows against the INT8 buffer. The stored length
is read on the device, so the launch never syncs with the host (CUDA-graph safe), and the
split count depends only on the capacity (:func:`default_splits`). A split's first tile does
not depend on the length, so its first loads (codes, block metadata, and the queries of a
single-format cache, whose head map is the identity) are issued before the length arrives
(faster than even contiguous shares, whose first tile needs the length). Each program merges its row
groups and writes one partial ``(m, l, acc)``; :func:`_combine_kernel` loads the
``splits + 1`` partials of a (batch, kv head) at once and merges them. The head slot is the
slowest grid axis, so a 2/4 mix's INT4 programs are dispatched before its INT2 ones and an SM
runs one format's loop at a time: with the slot fastest, the two loops alternated on every SM,
which was slower.

Tiles of one or several blocks, one row group per block. A tensor-core dot needs 16 rows
and a query group has few (``GL = 4`` for GQA 32/8 at ``Lq = 1``), so a loop iteration can
take ``BPI`` (:attr:`DecodeConfig.blocks_per_iter`) consecutive 64-token blocks as one
``BPI·64``-token tile and give block ``j`` of the tile its own row group, rows ``j·GLP + r``
(``GLP`` = ``GL`` rounded up to a power of two), each row with its own online-softmax state
over the tokens of its block slot (the other slots' scores are masked). The default is one
block per iteration in one-warp programs (:func:`default_warps`): the softmax stays in one
warp's registers, and many small programs per SM hide each other's latency. The codes are
loaded straight into registers (``num_stages = 1``); ``num_stages`` > 1 lets Triton copy the
codes of later tiles into shared memory asynchronously instead, which measured slower
(:class:`DecodeConfig`).

Dequantization folded into the scores and the output (per block and channel ``c``:
``x = s8·(code·step_c + lo_c)``, the storage arithmetic of :mod:`~qattn_compile.kvcache.flashq`):

    S[r, t] = s8 · (Σ_c (q_rc·step_c)·code_tc + Σ_c q_rc·lo_c)
    O[r, c] += s8_v · (step_c · (P·code)_rc + lo_c · Σ_t P_rt)

so per element only a code becomes an fp16 tensor-core operand, and ``step``/``lo`` scale a
``[BPI·GLP, D]`` tile once per tile (``q`` is scaled by ``τ·log2 e`` once, at the start).
``q·step`` enters the dot as two fp16 rows, ``hi = fp16(q·step)`` and ``fp16(q·step - hi)``
(~22 significant bits, more exact than the fp16 ``q`` of the reference-matching old kernel;
with ``BPI·GLP = 8`` the extra rows fill the dot's 16 for free). ``Σ_t P`` is summed from the
fp16 P the dot sees, so that the ``lo`` term matches it.

Codes become fp16 without int→float conversions (which run at a quarter of the ALU rate):
the packed row is read as int32 words, and a mask puts two codes into a word's two 16-bit
halves, which are then read as fp16. ``codes="subnormal"`` masks each code in place within
its byte, ``w & 0x00F000F0`` (INT4; after one ``w >> 8`` for the high bytes), and reads the
bits as the fp16 subnormal ``code·2^f·2⁻²⁴``, ``f`` the code's bit offset in its byte:
exact, one op per two codes, and ``2^-f`` is folded into the column's ``step``, ``2²⁴`` into
``s8`` (fewer instructions per tile, and faster, than shifting every code down to bit 0).
``codes="biased"`` shifts the codes down, ors in
the exponent of 1024 and subtracts ``1024 + 2^(bits-1)`` in fp16 (exact, centered codes),
for a GPU whose tensor cores would flush subnormal inputs. Rows that are not whole
int32 words (head dims not a multiple of 8 for INT4, 16 for INT2) are assembled from byte
loads.

Code tiles built in the dots' operand layout. The order of the channels along a dot's axis is
free (``q``, ``step`` and ``lo`` are gathered in the same order, the partial output is
scattered back to channel order), so each tile orders them such that the register layout the
unpacking produces *is* the mma operand layout: Triton then reads the packed words from shared
memory straight into it, with no fp16 round trip through shared memory (:func:`_key_tile`
for Q·Kᵀ, whose reduction axis is the channels; :func:`_value_tile` for P·V, whose reduction
axis is the tokens, so a thread reads one word of four consecutive tokens). Unpacked tiles
stored to and reloaded from shared memory instead cost each program more shared memory and
registers, so fewer programs share an SM (docs/performance.md).

Token rows are clamped per block (a ragged last tile re-reads the last block), so Triton
sees 64 consecutive rows, and the packed row stride is a compile-time constant.

Bytes read per token and kv head (D = 128): INT4 64 of codes + 4 of block metadata for K and
as much for V (136), INT2 72, against 512 for a bf16 cache: that ratio is the speed-up over
SDPA on a bf16 cache to aim at (what it reaches: docs/performance.md). The kernel still reads
its bytes below HBM's rate: with 8 resident one-warp programs per SM (the register file) each
program waits on its loads and its instructions per 64-token tile in turn.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..blocks import KV_CACHE_BLOCK
from ..kernels.primitives import additive_bias_log2, interpreted
from .flashq import check_decode_args

_LOG2E = 1.4426950408889634
_MASK_NONE, _MASK_BOOL, _MASK_ADD = 0, 1, 2
RESIDENT_WARPS_PER_SM = 8
"""Warps of the decode kernel an SM holds at once: 8 is what the one-warp program's 255
registers allow (65536 / (256·32)). One wave of programs is this times the SM count."""
WAVES = 2
""":func:`default_splits` sizes the grid to this many whole waves of resident programs.
Per-program costs (the first tiles' loads, the row-group merge and the partial's store, the
partials the merge kernel reads) are paid once per program, so fewer, longer programs win,
and a partly filled last wave idles SMs; two whole waves measured fastest for every format
(docs/performance.md)."""
MIN_TILES_PER_SPLIT = 4
"""A split gets at least this many tiles of the capacity (each program first loads its
queries and finally merges and stores its state: a few tiles' worth of latency)."""
MAX_SPLITS = 128
"""Split partials per (batch, kv head), all of which the merge loads at once (beside the
buffer's). A power of two: a 32K cache of 64-token tiles (512) then splits into 4 tiles each,
where 127 splits gave four of them 5, and a one-wave grid lasts as long as its longest
program."""
_DEFAULT_SMS = 132  # H100 SXM; what the heuristic assumes for tensors not on a CUDA device
BUFFER_N = tl.constexpr(16)
"""INT8 buffer tokens per row group and loop iteration (small: the buffer part's registers
count for the whole kernel)."""
_COMBINE_TILE = 8192  # partial values one merge program loads at once (64 per thread)
MAX_ROWS = 64
"""Row groups stop at this many rows per program (``blocks_per_iter`` is lowered for large
query groups, which fill the dot's rows by themselves)."""
PREFETCH_MODES = ("auto", "none", "l2", "keys")
"""How a split requests the codes of its next tile before it needs them
(:func:`_compressed_part`): ``none`` (each tile's codes are loaded where the tile uses them),
``l2`` (the next tile's key and value rows are asked into the L2 cache at the top of each
tile; needs a GPU: the interpreter runs it as ``none``), ``keys`` (the next tile's key words
are loaded into registers after this tile's score dot; INT4 rows of 16 words only, other
rows as ``none``), ``auto`` (:func:`default_prefetch`)."""
L2_PREFETCH_MIN_TILES = 8
""":func:`default_prefetch` prefetches into L2 when every split has at least this many tiles
of the capacity (measured gains at 16, losses at 4)."""
CODE_FORMATS = ("subnormal", "biased")
"""How codes become fp16 dot operands (module docstring): ``subnormal`` (the code's bits as an
fp16 subnormal) or ``biased`` (1024 + code, minus 1024)."""


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of :func:`flashq_decode_triton`.

    - ``splits``: programs per (batch, kv head) along the cache; ``None`` picks
      :func:`default_splits`.
    - ``blocks_per_iter``: 64-token blocks per loop iteration (1, 2 or 4), one row group
      each (module docstring); lowered so that a program has at most :data:`MAX_ROWS` rows.
    - ``codes``: one of :data:`CODE_FORMATS`.
    - ``num_warps``, ``num_stages``: Triton's (stages > 1: asynchronous copies of the codes
      of later tiles into shared memory); ``num_warps=None`` picks :func:`default_warps`.
    - ``prefetch``: how a split gets the next tile's codes early, one of
      :data:`PREFETCH_MODES`; ``"auto"`` picks :func:`default_prefetch`.

    The defaults are the fastest of the H100 sweeps (``benchmarks/decode.py --sweep``,
    Triton 3.6, with the code tiles built in the dots' operand layout): 1 block per
    iteration, 1 stage, the warps of :func:`default_warps` (one warp for GQA 32/8 at
    ``Lq = 1``), and the splits of :func:`default_splits` for them (two waves), for every
    format. More warps or blocks per iteration, capped registers (for more programs per SM)
    and more stages (the value codes then cross shared memory in 4-byte async copies, and the
    kernel uses every register a thread may hold) were slower (docs/performance.md).
    """

    splits: int | None = None
    blocks_per_iter: int = 1
    codes: str = "subnormal"
    num_warps: int | None = None
    num_stages: int = 1
    prefetch: str = "auto"

    def __post_init__(self):
        if self.blocks_per_iter not in (1, 2, 4):
            raise ValueError(f"blocks_per_iter must be 1, 2 or 4, got {self.blocks_per_iter}")
        if self.prefetch not in PREFETCH_MODES:
            raise ValueError(f"prefetch must be one of {PREFETCH_MODES}, got {self.prefetch!r}")
        if self.codes not in CODE_FORMATS:
            raise ValueError(f"codes must be one of {CODE_FORMATS}, got {self.codes!r}")
        if self.splits is not None and not 1 <= self.splits <= MAX_SPLITS:
            raise ValueError(f"splits must be in [1, {MAX_SPLITS}], got {self.splits}")


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _channel_of(col, BITS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Channel of code ``col`` (``(32/BITS)·j + i``: code ``i`` of word ``j`` of a token's packed
    row, in :func:`_load_codes` order), whether it is a real channel (codes past the row's
    bytes are padding) and its bit field in its byte (subnormal codes carry
    ``2^(field·BITS)``). Code ``i`` sits at bit ``(i // 2)·BITS + 16·(i % 2)`` of its word,
    i.e. byte ``4j + pos // 8`` and bit field ``(pos % 8) / BITS`` of the split layout (byte
    ``n`` holds channel ``n + field·D·BITS/8``)."""
    PER_WORD: tl.constexpr = 32 // BITS
    ROW_BYTES: tl.constexpr = HEAD_DIM * BITS // 8
    i = col % PER_WORD
    pos = (i // 2) * BITS + 16 * (i % 2)
    byte = 4 * (col // PER_WORD) + pos // 8
    field = (pos % 8) // BITS
    return byte + field * ROW_BYTES, byte < ROW_BYTES, field


@triton.jit
def _value_channels(BITS: tl.constexpr, WP: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Channel of each row ``[WP·32/BITS]`` of a value code tile (:func:`_value_tile`), whether
    it is a real channel, and its bit field (:func:`_channel_of`)."""
    col = tl.arange(0, WP * (32 // BITS))
    return _channel_of((col % WP) * (32 // BITS) + col // WP, BITS, HEAD_DIM)


@triton.jit
def _key_channels(BITS: tl.constexpr, WP: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Channel of each column ``[WP·32/BITS]`` of a key code tile (:func:`_key_tile`), whether
    it is a real channel, and its bit field (:func:`_channel_of`)."""
    PER_WORD: tl.constexpr = 32 // BITS
    R: tl.constexpr = WP // 4 if WP >= 4 else 1
    Q: tl.constexpr = WP // R
    k = tl.arange(0, WP * PER_WORD)
    low = k % 4
    q = (k // 4) % Q
    high = (k // (4 * Q)) % (PER_WORD // 4)
    r = k // (4 * Q * (PER_WORD // 4))
    return _channel_of((q * R + r) * PER_WORD + high * 4 + low, BITS, HEAD_DIM)


@triton.jit
def _field_weight(field, BITS: tl.constexpr, BIASED: tl.constexpr):
    """Per code column ``[C]`` float32: what a step multiplies so that a code that carries
    ``2^(field·BITS)`` (subnormal codes, :func:`_load_codes`) weighs as a code; 1 for biased
    codes."""
    if BIASED:
        return tl.full(field.shape, 1.0, tl.float32)
    return 1.0 / (1 << (field * BITS)).to(tl.float32)


@triton.jit
def _load_words(ptr, rows, live, stride_t: tl.constexpr, BITS: tl.constexpr, WP: tl.constexpr,
                HEAD_DIM: tl.constexpr, WORDS: tl.constexpr):
    """Packed rows ``rows`` ``[N]`` as int32 words ``[N, WP]`` (words past a row's bytes are 0;
    all 0 and nothing read unless the scalar ``live`` is 1).

    ``ptr`` points at packed rows of ``HEAD_DIM·BITS/8`` bytes, ``stride_t`` bytes apart.
    ``WORDS``: rows are whole, 4-byte aligned int32 words (one vector load per thread);
    otherwise the words are assembled from byte loads (head dims not a multiple of 32/BITS·4).
    """
    ROW_BYTES: tl.constexpr = HEAD_DIM * BITS // 8
    j = tl.arange(0, WP)
    ok = (rows * 0)[:, None] + (j * 0)[None, :] < live  # [N, WP]: the interpreter broadcasts no scalar mask
    if WORDS:
        words = ptr.to(tl.pointer_type(tl.int32)) + rows[:, None] * (stride_t // 4) + j[None, :]
        if WP * 4 == ROW_BYTES:
            w = tl.load(words, mask=ok, other=0)
        else:
            w = tl.load(words, mask=ok & (j < ROW_BYTES // 4)[None, :], other=0)
    else:
        base = ptr + rows[:, None] * stride_t + 4 * j[None, :]
        w = tl.zeros([rows.shape[0], WP], tl.int32)
        for k in tl.static_range(4):
            byte = tl.load(base + k, mask=ok & (4 * j + k < ROW_BYTES)[None, :], other=0)
            w = w | (byte.to(tl.int32) << (8 * k))
    return w


@triton.jit
def _unpack_codes(w, BITS: tl.constexpr, BIASED: tl.constexpr):
    """Words ``w`` ``[N, WP]`` (:func:`_load_words`) as fp16 codes ``[N, WP, 32/BITS]`` (code ``i``
    of word ``j``, see :func:`_channel_of`): ``code·2^(field·BITS)·2⁻²⁴`` (subnormal: masked in
    place within its byte, one op per two codes, so a code carries the weight of its bit field)
    or, ``BIASED``, ``code - 2^(BITS-1)``. Padding columns hold code 0."""
    # bit positions in column order: (i // 2)·BITS for i = 0, 2, 4, ...; the halves follow below
    if BIASED:  # codes shifted down to bit 0, exact once the exponent is or-ed in
        if BITS == 4:
            m: tl.constexpr = 0x000F000F
            p = tl.join(tl.join(w & m, (w >> 8) & m), tl.join((w >> 4) & m, (w >> 12) & m))
        else:
            m: tl.constexpr = 0x00030003
            p = tl.join(
                tl.join(tl.join(w & m, (w >> 8) & m), tl.join((w >> 4) & m, (w >> 12) & m)),
                tl.join(tl.join((w >> 2) & m, (w >> 10) & m), tl.join((w >> 6) & m, (w >> 14) & m)),
            )
    else:  # codes masked in place within their byte (the fp16 mantissa): code·2^(pos % 8)
        w8 = w >> 8
        if BITS == 4:
            p = tl.join(tl.join(w & 0x000F000F, w8 & 0x000F000F), tl.join(w & 0x00F000F0, w8 & 0x00F000F0))
        else:
            p = tl.join(
                tl.join(tl.join(w & 0x00030003, w8 & 0x00030003), tl.join(w & 0x00300030, w8 & 0x00300030)),
                tl.join(tl.join(w & 0x000C000C, w8 & 0x000C000C), tl.join(w & 0x00C000C0, w8 & 0x00C000C0)),
            )
    if BIASED:
        p = p | 0x64006400  # fp16 1024 + code in each half
    half = tl.join(p, p >> 16).to(tl.int16)
    codes = tl.reshape(half, [w.shape[0], w.shape[1], 32 // BITS]).to(tl.float16, bitcast=True)
    if BIASED:
        codes = codes - (1024.0 + (1 << (BITS - 1)))  # code - 8 (INT4) / code - 2 (INT2)
    return codes


@triton.jit
def _value_tile(codes):
    """Codes ``[N, WP, 32/BITS]`` (:func:`_load_codes`) as the token-major tile
    ``[N, WP·32/BITS]`` of a P·V dot, columns at :func:`_value_channels`: column
    ``i·WP + j`` is code ``i`` of word ``j``, so that a thread's codes of one word are the
    columns its dot operand registers hold (the dot's lanes and warps split the words)."""
    columns = tl.permute(codes, (0, 2, 1))
    return tl.reshape(columns, [codes.shape[0], codes.shape[1] * codes.shape[2]])


@triton.jit
def _key_tile(codes):
    """Codes ``[N, WP, 32/BITS]`` (:func:`_load_codes`) as the channel-major tile
    ``[WP·32/BITS, N]`` of a Q·Kᵀ dot, rows at :func:`_key_channels`.

    The rows are ordered so that the tile's register layout is the dot operand's: a thread
    reads ``R = WP/4`` consecutive words of a token (the ``Q = 4`` threads that share a token
    split its row), and the mma operand (kWidth 4) wants those ``Q`` threads on bits 2–3 of
    the reduction index and a thread's own codes on bits 0–1 and 4+. Row ``k`` is therefore
    code ``4·high + low`` of word ``q·R + r`` with ``k = ((r·(PER_WORD/4) + high)·Q + q)·4 +
    low``; no shared-memory round trip.
    """
    N: tl.constexpr = codes.shape[0]
    WP: tl.constexpr = codes.shape[1]
    PER_WORD: tl.constexpr = codes.shape[2]
    R: tl.constexpr = WP // 4 if WP >= 4 else 1
    x = tl.reshape(codes, [N, WP // R, R, PER_WORD // 4, 4])
    return tl.reshape(tl.permute(x, (2, 3, 1, 4, 0)), [WP * PER_WORD, N])


@triton.jit
def _split_fp16(x):
    """``x`` ``[M, K]`` float32 as fp16 ``[2M, K]``: rows ``[0, M)`` ``hi = fp16(x)``, rows
    ``[M, 2M)`` ``fp16(x - hi)`` (``hi + lo`` carries ~22 significant bits)."""
    hi = x.to(tl.float16)
    lo = (x - hi.to(tl.float32)).to(tl.float16)
    return tl.reshape(tl.permute(tl.join(hi, lo), (2, 0, 1)), [2 * x.shape[0], x.shape[1]])


@triton.jit
def _row_groups(x, GLP: tl.constexpr):
    """Per-block rows ``x`` ``[BPI, C]`` as float32 ``[BPI·GLP, C]``: row ``j`` repeated for the
    ``GLP`` rows of row group ``j``."""
    x = x.to(tl.float32)
    return tl.reshape(tl.broadcast_to(x[:, None, :], [x.shape[0], GLP, x.shape[1]]), [x.shape[0] * GLP, x.shape[1]])


@triton.jit
def _stored_block(blk, n_blocks):
    """Block index ``blk`` clamped to the ``n_blocks`` stored ones: blocks past the last (a
    ragged last tile, the tile after a split's last) re-read the last, and a cache with no
    stored block reads block 0, so every address stays inside the storage."""
    return tl.minimum(blk, tl.maximum(n_blocks - 1, 0))


@triton.jit
def _load_meta(ptr, tile, n_blocks, m_blk, ch, ch_ok, BPI: tl.constexpr):
    """Step or lo ``[BPI, C]`` (``ptr``'s dtype) of the blocks of tile ``tile`` at the code
    columns' channels ``ch``: ``ptr`` points at ``[NB, D]`` rows ``m_blk`` apart; blocks clamped
    by :func:`_stored_block`."""
    blk = _stored_block(tile * BPI + tl.arange(0, BPI), n_blocks)
    return tl.load(ptr + blk[:, None] * m_blk + ch[None, :], mask=ch_ok[None, :], other=0)


@triton.jit
def _tile_rows(tile, toks, n_blocks, BPI: tl.constexpr, BLOCK_N: tl.constexpr):
    """Token rows ``[BPI·BLOCK_N]`` of tile ``tile``'s codes, clamped per block
    (:func:`_stored_block`), so that Triton sees 64 consecutive rows (one base, constant
    offsets)."""
    blk = _stored_block(tile * BPI + toks // BLOCK_N, n_blocks)
    return blk * BLOCK_N + toks % BLOCK_N


@triton.jit
def _prefetch(lines, L1: tl.constexpr):
    """Ask the L1 (else the L2) cache for the 128-byte lines at the pointers ``lines``, holding
    no register."""
    if L1:
        tl.inline_asm_elementwise("prefetch.global.L1 [$1];\n\tmov.u32 $0, 0;", "=r,l", [lines],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [lines],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_tile(ptr, tile, n_blocks, stride_t: tl.constexpr, BPI: tl.constexpr, BLOCK_N: tl.constexpr,
                   LINES: tl.constexpr, L1: tl.constexpr):
    """Ask the L1 (else the L2) cache for the packed rows of tile ``tile``: ``LINES`` 128-byte
    lines from its first block's first row, clamped to the last stored block's."""
    first = _stored_block(tile * BPI, n_blocks) * BLOCK_N * stride_t
    end = tl.maximum(n_blocks, 1) * BLOCK_N * stride_t - 1
    _prefetch(ptr + tl.minimum(first + tl.arange(0, LINES) * 128, end), L1)


@triton.jit
def _visible(s, keys, qpos, row_ok, mask_row_ptr, sm_k, mask_len, MASK_KIND: tl.constexpr):
    """Scores ``s`` ``[M, N]`` (log2 units) of keys ``keys`` ``[N]`` for queries at positions
    ``qpos`` ``[M]``: causal, then the user mask; invisible → -inf."""
    vis = keys[None, :] <= qpos[:, None]
    if MASK_KIND != 0:
        ok = row_ok[:, None] & (keys[None, :] < mask_len)
        m = tl.load(mask_row_ptr[:, None] + keys[None, :] * sm_k, mask=ok, other=0)
        if MASK_KIND == 1:
            vis = vis & (m != 0)
        else:
            s = s + additive_bias_log2(m)
    return tl.where(vis, s, float("-inf"))


@triton.jit
def _softmax_step(s, m_i, l_i):
    """Online softmax in base 2 for a score tile ``s`` ``[M, N]``: returns the new max, the
    rescale factor of the old state, the new sum and P (fp32)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return m_new, alpha, l_i * alpha + tl.sum(p, 1), p


@triton.jit
def _query_rows(q_ptr, sq_b, sq_h, sq_l, b, h, qk_scale, ch, ch_ok,
                G: tl.constexpr, LQ: tl.constexpr, GLP: tl.constexpr, BPI: tl.constexpr):
    """The row layout of a program: ``BPI`` row groups of ``GLP`` rows, row ``j·GLP + r`` is
    query row ``r`` (head ``h·G + r // LQ``, position ``r % LQ``) for block slot ``j``.

    Returns ``q·qk_scale`` float32 ``[BPI·GLP, C]`` gathered at channels ``ch`` ``[C]`` (0 where
    ``ch_ok`` is False or the row is padding), the rows' validity, head, query index and slot.
    """
    rows = tl.arange(0, BPI * GLP)
    gq = rows % GLP
    row_ok = gq < G * LQ
    hq = h * G + gq // LQ
    qi = gq % LQ
    ptr = q_ptr + b * sq_b + hq[:, None] * sq_h + qi[:, None] * sq_l + ch[None, :]
    q = tl.load(ptr, mask=row_ok[:, None] & ch_ok[None, :], other=0.0).to(tl.float32) * qk_scale
    return q, row_ok, hq, qi, rows // GLP


@triton.jit
def _compressed_part(
    q_ptr, sq_b, sq_h, sq_l, qk_scale,
    codes_ptr, c_kv, c_t: tl.constexpr,
    step_ptr, lo_ptr, m_kv, m_blk,
    s8_ptr, s8_kv,
    mask_ptr, sm_b, sm_h, sm_q, sm_k, mask_len,
    b, h, split, n_splits, length, compressed, cap_blocks,
    BITS: tl.constexpr, WP: tl.constexpr, HEAD_DIM: tl.constexpr, G: tl.constexpr, LQ: tl.constexpr,
    GLP: tl.constexpr, BPI: tl.constexpr, BLOCK_N: tl.constexpr, MASK_KIND: tl.constexpr,
    WORDS: tl.constexpr, BIASED: tl.constexpr, LINES: tl.constexpr, CARRY_KEYS: tl.constexpr,
    L2_AHEAD: tl.constexpr,
):
    """Online-softmax state of split ``split`` of the compressed blocks of (batch ``b``, kv
    head ``h``), row layout of :func:`_query_rows`, columns in code order. The split takes
    tiles ``split``, ``split + n_splits``, ... below the stored ones; the cache holds
    ``cap_blocks`` blocks.

    Pointers are already offset to this (batch, head): ``codes_ptr`` ``[2, T, D·BITS/8]``
    uint8 (strides ``c_kv``, ``c_t``), ``step_ptr``/``lo_ptr`` ``[2, NB, D]`` (``m_kv``,
    ``m_blk``), ``s8_ptr`` ``[2, NB]`` (``s8_kv``). ``WP``: int32 words per packed row
    (:func:`padded_words`). Returns ``(m, l, acc, ch, ch_ok)``: ``[BPI·GLP]``, ``[BPI·GLP]``,
    ``[BPI·GLP, WP·32/BITS]`` and the channel of each column.

    Each tile's step/lo are loaded one iteration ahead and carried in registers: Triton does
    not pipeline these loads (one byte per thread, narrower than an async copy), and loaded
    where they are used, their latency was exposed twice per tile (carried, they are faster,
    and INT2 also needs fewer registers).

    The codes are loaded into registers where the tile starts (keys) and after its softmax
    (values). ``CARRY_KEYS`` requests the next tile's key words right after this tile's score
    dot instead and carries them to the next iteration, so their latency hides behind the
    softmax and the P·V dot. ``L2_AHEAD`` asks the L2 cache for the next tile's rows at the
    top of each tile (:data:`PREFETCH_MODES`, :func:`default_prefetch`). In every mode the top
    of a tile also asks the L1 cache for this tile's value rows, read after the softmax, and
    for the next tile's block metadata, read at the end of the tile; ``LINES`` is a tile's
    128-byte lines of codes, 0 for no prefetch instruction at all (the interpreter). A
    prefetch holds no register; the L1 requests made every cache measured faster or level,
    except INT4 with ``l2`` at long contexts, slightly slower.
    """
    BLOCK_M: tl.constexpr = BPI * GLP
    TILE: tl.constexpr = BPI * BLOCK_N
    UNIT: tl.constexpr = 1.0 if BIASED else 16777216.0  # 2**24: subnormal codes are code·2**-24
    CENTER: tl.constexpr = (1 << (BITS - 1)) if BIASED else 0  # biased codes are code - CENTER
    kch, kch_ok, k_field = _key_channels(BITS, WP, HEAD_DIM)
    ch, ch_ok, v_field = _value_channels(BITS, WP, HEAD_DIM)
    # folded into the steps below; the CENTER·step terms use the folded steps too, which is
    # right because CENTER is nonzero only for biased codes, whose weight is 1
    k_weight = _field_weight(k_field, BITS, BIASED)
    v_weight = _field_weight(v_field, BITS, BIASED)
    q, row_ok, hq, qi, slot = _query_rows(q_ptr, sq_b, sq_h, sq_l, b, h, qk_scale, kch, kch_ok, G, LQ, GLP, BPI)
    mask_row_ptr = mask_ptr + b * sm_b + hq * sm_h + qi * sm_q
    qpos = length - LQ + qi

    n_blocks = compressed // BLOCK_N
    n_tiles = tl.cdiv(n_blocks, BPI)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, WP * 32 // BITS], tl.float32)
    toks = tl.arange(0, TILE)
    own = (toks // BLOCK_N)[None, :] == slot[:, None]  # row group j reads block slot j
    meta_rows = tl.arange(0, 4)  # K step, K lo, V step, V lo
    # this split's tiles are split, split + n_splits, ...: its first tile's address does not
    # depend on the stored length, so its loads (clamped to the capacity) start before it arrives
    nk_step = _load_meta(step_ptr, split, cap_blocks, m_blk, kch, kch_ok, BPI)
    nk_lo = _load_meta(lo_ptr, split, cap_blocks, m_blk, kch, kch_ok, BPI)
    nv_step = _load_meta(step_ptr + m_kv, split, cap_blocks, m_blk, ch, ch_ok, BPI)
    nv_lo = _load_meta(lo_ptr + m_kv, split, cap_blocks, m_blk, ch, ch_ok, BPI)
    if CARRY_KEYS:
        rows = _tile_rows(split, toks, cap_blocks, BPI, BLOCK_N)
        nk_words = _load_words(codes_ptr, rows, tl.where(cap_blocks > 0, 1, 0), c_t, BITS, WP, HEAD_DIM, WORDS)
    for tile in range(split, n_tiles, n_splits):
        nxt = tile + n_splits
        blk = tile * BPI + slot
        blk_in = tl.minimum(blk, n_blocks - 1)  # a ragged last tile re-reads the last block
        key_rows = _tile_rows(tile, toks, n_blocks, BPI, BLOCK_N)
        if LINES > 0:
            # into L1: this tile's value rows (read after the softmax) and the next tile's block
            # metadata (read at the end of this one)
            _prefetch_tile(codes_ptr + c_kv, tile, n_blocks, c_t, BPI, BLOCK_N, LINES, True)
            nb = _stored_block(nxt * BPI, n_blocks) * m_blk + (meta_rows // 2) * m_kv
            _prefetch(tl.where(meta_rows % 2 == 0, step_ptr + nb, lo_ptr.to(step_ptr.dtype) + nb), True)
        if L2_AHEAD and LINES > 0:  # into L2: the next tile of this split (the last asks for itself)
            ahead = tl.where(nxt < n_tiles, nxt, tile)
            _prefetch_tile(codes_ptr + c_kv, ahead, n_blocks, c_t, BPI, BLOCK_N, LINES, False)
            if not CARRY_KEYS:
                _prefetch_tile(codes_ptr, ahead, n_blocks, c_t, BPI, BLOCK_N, LINES, False)
        if CARRY_KEYS:
            k_words = nk_words
        else:
            k_words = _load_words(codes_ptr, key_rows, 1, c_t, BITS, WP, HEAD_DIM, WORDS)
        # this tile's metadata, loaded in the previous iteration
        k_step = _row_groups(nk_step.to(tl.float32) * k_weight[None, :], GLP)
        k_lo = _row_groups(nk_lo, GLP)
        k_s8 = tl.load(s8_ptr + blk_in)
        bias = tl.sum(q * (k_lo + CENTER * k_step), 1)
        kc = _key_tile(_unpack_codes(k_words, BITS, BIASED))
        # q·step as fp16 hi + lo rows: one dot, ~22-bit q (the rows pad the dot's 16 anyway)
        s = tl.sum(tl.reshape(tl.dot(_split_fp16(q * k_step), kc), [2, BLOCK_M, TILE]), 0)
        if CARRY_KEYS:  # the next tile's, requested now that this tile's are in the dot
            rows = _tile_rows(nxt, toks, n_blocks, BPI, BLOCK_N)
            nk_words = _load_words(codes_ptr, rows, (nxt < n_tiles).to(tl.int32), c_t, BITS, WP, HEAD_DIM, WORDS)
        s = s * (k_s8 * UNIT)[:, None] + (bias * k_s8)[:, None]
        s = tl.where(own & (blk < n_blocks)[:, None], s, float("-inf"))
        s = _visible(s, tile * TILE + toks, qpos, row_ok, mask_row_ptr, sm_k, mask_len, MASK_KIND)
        m_i, alpha, l_i, p = _softmax_step(s, m_i, l_i)
        v_step = _row_groups(nv_step.to(tl.float32) * v_weight[None, :], GLP)
        v_lo = _row_groups(nv_lo, GLP)
        v_s8 = tl.load(s8_ptr + s8_kv + blk_in)
        v_words = _load_words(codes_ptr + c_kv, key_rows, 1, c_t, BITS, WP, HEAD_DIM, WORDS)
        vc = _value_tile(_unpack_codes(v_words, BITS, BIASED))
        p16 = p.to(tl.float16)
        p_sum = tl.sum(p16.to(tl.float32), 1)  # the P the dot sees, so that lo·ΣP matches it
        pv = tl.dot(p16, vc)
        acc = acc * alpha[:, None] + pv * ((v_s8 * UNIT)[:, None] * v_step)
        acc += (p_sum * v_s8)[:, None] * (v_lo + CENTER * v_step)
        nk_step = _load_meta(step_ptr, nxt, n_blocks, m_blk, kch, kch_ok, BPI)
        nk_lo = _load_meta(lo_ptr, nxt, n_blocks, m_blk, kch, kch_ok, BPI)
        nv_step = _load_meta(step_ptr + m_kv, nxt, n_blocks, m_blk, ch, ch_ok, BPI)
        nv_lo = _load_meta(lo_ptr + m_kv, nxt, n_blocks, m_blk, ch, ch_ok, BPI)
    return m_i, l_i, acc, ch, ch_ok


@triton.jit
def _buffer_part(
    q_ptr, sq_b, sq_h, sq_l, qk_scale,
    buf_ptr, buf_kv, buf_t, bs_ptr, bs_kv,
    mask_ptr, sm_b, sm_h, sm_q, sm_k, mask_len,
    b, h, length, compressed,
    DO: tl.constexpr, HEAD_DIM: tl.constexpr, G: tl.constexpr, LQ: tl.constexpr,
    GLP: tl.constexpr, BPI: tl.constexpr, BLOCK_N: tl.constexpr, MASK_KIND: tl.constexpr,
):
    """Online-softmax state of the INT8 buffer (tokens ``[compressed, length)``) of (batch
    ``b``, kv head ``h``), row layout of :func:`_query_rows` (slot ``j`` takes the ``j``-th
    ``BLOCK_N`` tokens of each ``BPI·BLOCK_N``-token tile; the kernel passes
    :data:`BUFFER_N`), columns in channel order ``[DO]``.

    ``buf_ptr`` ``[2, n_b, D]`` int8 (strides ``buf_kv``, ``buf_t``), ``bs_ptr`` ``[2]`` float32
    (``bs_kv``), offset to this (batch, head). Returns ``(m, l, acc, ch, ch_ok)`` like
    :func:`_compressed_part`.
    """
    BLOCK_M: tl.constexpr = BPI * GLP
    TILE: tl.constexpr = BPI * BLOCK_N
    ch = tl.arange(0, DO)
    ch_ok = ch < HEAD_DIM
    q, row_ok, hq, qi, slot = _query_rows(q_ptr, sq_b, sq_h, sq_l, b, h, qk_scale, ch, ch_ok, G, LQ, GLP, BPI)
    q16 = q.to(tl.float16)
    mask_row_ptr = mask_ptr + b * sm_b + hq * sm_h + qi * sm_q
    qpos = length - LQ + qi
    buffered = length - compressed
    k_scale = tl.load(bs_ptr)
    v_scale = tl.load(bs_ptr + bs_kv)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DO], tl.float32)
    toks = tl.arange(0, TILE)
    own = (toks // BLOCK_N)[None, :] == slot[:, None]
    for t0 in range(0, buffered, TILE):
        local = t0 + toks
        ok = local < buffered
        tile = buf_ptr + local[:, None] * buf_t + ch[None, :]
        kb = tl.load(tile, mask=ok[:, None] & ch_ok[None, :], other=0).to(tl.float16)
        s = tl.where(own & ok[None, :], tl.dot(q16, tl.trans(kb)) * k_scale, float("-inf"))
        s = _visible(s, compressed + local, qpos, row_ok, mask_row_ptr, sm_k, mask_len, MASK_KIND)
        m_i, alpha, l_i, p = _softmax_step(s, m_i, l_i)
        vb = tl.load(tile + buf_kv, mask=ok[:, None] & ch_ok[None, :], other=0).to(tl.float16)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), vb) * v_scale
    return m_i, l_i, acc, ch, ch_ok


@triton.jit
def _store_partial(m_i, l_i, acc, ch, ch_ok, part_o_ptr, part_ml_ptr, part,
                   DO: tl.constexpr, GLP: tl.constexpr, BPI: tl.constexpr):
    """Merge the ``BPI`` row groups of a state (rows ``j·GLP + r``, columns at channels ``ch``)
    into partial ``part`` of ``part_o`` ``[.., GLP, DO]`` (channel order) and ``part_ml``
    ``[.., GLP, 2]`` (max, sum)."""
    m_g = tl.reshape(m_i, [BPI, GLP])
    m = tl.max(m_g, 0)
    w = tl.exp2(m_g - tl.where(m == float("-inf"), 0.0, m)[None, :])
    l_out = tl.sum(tl.reshape(l_i, [BPI, GLP]) * w, 0)
    acc_out = tl.sum(tl.reshape(acc, [BPI, GLP, acc.shape[1]]) * w[:, :, None], 0)
    r = tl.arange(0, GLP)
    tl.store(part_o_ptr + (part * GLP + r[:, None]) * DO + ch[None, :], acc_out, mask=ch_ok[None, :])
    tl.store(part_ml_ptr + (part * GLP + r) * 2, m)
    tl.store(part_ml_ptr + (part * GLP + r) * 2 + 1, l_out)


@triton.jit
def _flashq_decode_kernel(
    q_ptr, sq_b, sq_h, sq_l,
    c4_ptr, c4_kv, c4_b, c4_h, c4_t: tl.constexpr,
    c2_ptr, c2_kv, c2_b, c2_h, c2_t: tl.constexpr,
    heads4_ptr, heads2_ptr, n4,
    step_ptr, lo_ptr, m_kv, m_b, m_h, m_blk,
    s8_ptr, s8_kv, s8_b, s8_h,
    buf_ptr, buf_kv, buf_b, buf_h, buf_t,
    bs_ptr, bs_kv, bs_b,
    len_ptr, cap_blocks,
    mask_ptr, sm_b, sm_h, sm_q, sm_k, mask_len,
    part_o_ptr, part_ml_ptr,
    qk_scale, NBUF,
    HEAD_DIM: tl.constexpr, DO: tl.constexpr, G: tl.constexpr, LQ: tl.constexpr, GLP: tl.constexpr,
    BPI: tl.constexpr, BLOCK_N: tl.constexpr, MASK_KIND: tl.constexpr,
    WP4: tl.constexpr, WP2: tl.constexpr, WORDS4: tl.constexpr, WORDS2: tl.constexpr, BIASED: tl.constexpr,
    HAS4: tl.constexpr, HAS2: tl.constexpr, LINES4: tl.constexpr, LINES2: tl.constexpr,
    CARRY4: tl.constexpr, L2_AHEAD: tl.constexpr,
):
    """Grid ``(splits + 1, B, H)``: axis 0 is the split of the compressed blocks, the last one
    the INT8 buffer; axis 2 the head slot (the ``n4`` INT4 slots first), the slowest, so that
    an SM runs one format's loop at a time. ``HAS4``/``HAS2``: the cache has INT4/INT2 heads
    (a single-format cache compiles one path). ``LINES4``/``LINES2``, ``CARRY4``, ``L2_AHEAD``:
    the prefetches of the INT4 / INT2 path (:func:`_compressed_part`, :func:`_launch_prefetch`).
    """
    split = tl.program_id(0)
    b = tl.program_id(1)
    slot = tl.program_id(2)
    n_heads = tl.num_programs(2)
    n_parts = tl.num_programs(0)
    if HAS4 and HAS2:
        h = tl.load(tl.where(slot < n4, heads4_ptr + slot, heads2_ptr + slot - n4))
    else:  # a single format's map is the identity (FlashQTensors), and needs no load to wait on
        h = slot
    length = tl.load(len_ptr).to(tl.int32)
    compressed = (length // NBUF) * NBUF
    part = (b * n_heads + h) * n_parts + split
    if split == n_parts - 1:
        m_i, l_i, acc, ch, ch_ok = _buffer_part(
            q_ptr, sq_b, sq_h, sq_l, qk_scale, buf_ptr + b * buf_b + h * buf_h, buf_kv, buf_t,
            bs_ptr + b * bs_b + h, bs_kv, mask_ptr, sm_b, sm_h, sm_q, sm_k, mask_len,
            b, h, length, compressed, DO, HEAD_DIM, G, LQ, GLP, BPI, BUFFER_N, MASK_KIND,
        )
        _store_partial(m_i, l_i, acc, ch, ch_ok, part_o_ptr, part_ml_ptr, part, DO, GLP, BPI)
    else:
        step = step_ptr + b * m_b + h * m_h
        lo = lo_ptr + b * m_b + h * m_h
        s8 = s8_ptr + b * s8_b + h * s8_h
        if HAS4 and slot < n4:
            m_i, l_i, acc, ch, ch_ok = _compressed_part(
                q_ptr, sq_b, sq_h, sq_l, qk_scale, c4_ptr + b * c4_b + slot * c4_h, c4_kv, c4_t,
                step, lo, m_kv, m_blk, s8, s8_kv, mask_ptr, sm_b, sm_h, sm_q, sm_k, mask_len,
                b, h, split, n_parts - 1, length, compressed, cap_blocks,
                4, WP4, HEAD_DIM, G, LQ, GLP, BPI, BLOCK_N, MASK_KIND, WORDS4, BIASED, LINES4, CARRY4, L2_AHEAD,
            )
            _store_partial(m_i, l_i, acc, ch, ch_ok, part_o_ptr, part_ml_ptr, part, DO, GLP, BPI)
        if HAS2 and slot >= n4:
            m_i, l_i, acc, ch, ch_ok = _compressed_part(
                q_ptr, sq_b, sq_h, sq_l, qk_scale, c2_ptr + b * c2_b + (slot - n4) * c2_h, c2_kv, c2_t,
                step, lo, m_kv, m_blk, s8, s8_kv, mask_ptr, sm_b, sm_h, sm_q, sm_k, mask_len,
                b, h, split, n_parts - 1, length, compressed, cap_blocks,
                2, WP2, HEAD_DIM, G, LQ, GLP, BPI, BLOCK_N, MASK_KIND, WORDS2, BIASED, LINES2, False, L2_AHEAD,
            )
            _store_partial(m_i, l_i, acc, ch, ch_ok, part_o_ptr, part_ml_ptr, part, DO, GLP, BPI)


@triton.jit
def _combine_kernel(
    part_o_ptr, part_ml_ptr, out_ptr, so_b, so_h, so_l,
    n_heads, n_parts,
    HEAD_DIM: tl.constexpr, DO: tl.constexpr, G: tl.constexpr, LQ: tl.constexpr, GLP: tl.constexpr,
    SPLITS: tl.constexpr, COLS: tl.constexpr,
):
    """Merge the ``n_parts`` partials of (kv head ``program_id(0)``, batch ``program_id(1)``)
    for channels ``[COLS·program_id(2), +COLS)``: ``part_o`` ``[B, H, n_parts, GLP, DO]``,
    ``part_ml`` ``[B, H, n_parts, GLP, 2]`` into ``out`` ``[B, Hq, Lq, D]``; a row no partial
    saw a visible key for gets 0. The ``n_parts - 1`` split partials are loaded at once
    (``SPLITS`` >= their count, a power of two) and the buffer's, the last, beside them, so
    the merge costs one memory latency however many splits there are."""
    h = tl.program_id(0)
    b = tl.program_id(1)
    parts = tl.arange(0, SPLITS)
    rows = tl.arange(0, GLP)
    cols = tl.program_id(2) * COLS + tl.arange(0, COLS)
    first = (b * n_heads + h) * n_parts
    part = first + parts
    ok = (parts < n_parts - 1)[:, None]
    col_ok = (cols < HEAD_DIM)[None, :]
    ml = part_ml_ptr + (part[:, None] * GLP + rows[None, :]) * 2
    buf_rows = (first + n_parts - 1) * GLP + rows  # the buffer's partial, the last
    ml_buf = part_ml_ptr + buf_rows * 2
    m_p = tl.load(ml, mask=ok, other=float("-inf"))  # [SPLITS, GLP]
    m_buf = tl.load(ml_buf)  # [GLP]
    m = tl.maximum(tl.max(m_p, 0), m_buf)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(m_p - m_safe[None, :])
    w_buf = tl.exp2(m_buf - m_safe)
    l = tl.sum(w * tl.load(ml + 1, mask=ok, other=0.0), 0) + w_buf * tl.load(ml_buf + 1)
    o_ptr = part_o_ptr + (part[:, None, None] * GLP + rows[None, :, None]) * DO + cols[None, None, :]
    o = tl.load(o_ptr, mask=ok[:, :, None] & col_ok[None, :, :], other=0.0)
    o_buf = tl.load(part_o_ptr + buf_rows[:, None] * DO + cols[None, :], mask=col_ok, other=0.0)
    acc = tl.sum(o * w[:, :, None], 0) + o_buf * w_buf[:, None]
    out = tl.where((l > 0)[:, None], acc / tl.where(l > 0, l, 1.0)[:, None], 0.0)
    g = rows // LQ
    qi = rows % LQ
    ptr = out_ptr + b * so_b + (h * G + g)[:, None] * so_h + qi[:, None] * so_l + cols[None, :]
    tl.store(ptr, out, mask=(rows < G * LQ)[:, None] & col_ok)


# ----------------------------------------------------------------------------- launcher


def default_splits(batch: int, kv_heads: int, n_blocks: int, blocks_per_iter: int, num_warps: int,
                   sms: int = _DEFAULT_SMS) -> int:
    """Splits per (batch, kv head): as many as :data:`WAVES` waves of ``num_warps``-warp
    programs (:data:`RESIDENT_WARPS_PER_SM`) hold with each (batch, kv head)'s buffer program,
    at most :data:`MAX_SPLITS`, and at least :data:`MIN_TILES_PER_SPLIT` tiles of
    ``blocks_per_iter`` blocks of the capacity ``n_blocks`` per split.

    Depends only on the capacity (not on the stored length), so a captured CUDA graph stays
    valid as the cache grows. GQA 32/8, 132 SMs, the defaults (one block per iteration, one
    warp): 32 splits at B=8 × 32K (2112 programs, 2 waves), 128 at B=1 × 128K and at
    B=1 × 32K (1032 programs, the cap).
    """
    wave = max(1, RESIDENT_WARPS_PER_SM // num_warps) * sms
    wanted = WAVES * wave // (batch * kv_heads) - 1
    tiles = triton.cdiv(n_blocks, blocks_per_iter)
    return max(1, min(wanted, MAX_SPLITS, tiles // MIN_TILES_PER_SPLIT))


@functools.lru_cache
def _sm_count(device: torch.device) -> int:
    """SMs of ``device`` (cached: the launcher asks on every call)."""
    if device.type != "cuda":
        return _DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def padded_words(head_dim: int, bits: int) -> int:
    """int32 words of a token's packed row (``head_dim·bits/8`` bytes), rounded up to a power
    of two with at least 16 codes: the kernel's code tiles are ``[tokens, words·32/bits]``."""
    return max(triton.next_power_of_2(triton.cdiv(head_dim * bits // 8, 4)), 16 * bits // 32)


def _mask_args(attn_mask: Tensor | None, q: Tensor, capacity: int):
    """(kind, tensor, strides b/h/q/k, key length) of an optional mask broadcast to
    ``[B, Hq, Lq, Lm]`` (a one-column mask to the cache's ``capacity``: it holds for every
    key); bool masks are read as bytes. The kernel treats keys from ``Lm`` on as masked:
    the mask must cover the stored length (the length is on the device: not checked here)."""
    if attn_mask is None:
        return _MASK_NONE, torch.empty(1, dtype=torch.uint8, device=q.device), (0, 0, 0, 0), 0
    mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    keys = capacity if mask.shape[-1] == 1 else mask.shape[-1]
    mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], keys)
    kind = _MASK_BOOL if mask.dtype == torch.bool else _MASK_ADD
    if kind == _MASK_BOOL:
        mask = mask.view(torch.uint8)
    return kind, mask, tuple(mask.stride()), mask.shape[-1]


def _carries_keys(head_dim: int) -> bool:
    """Whether ``prefetch="keys"`` carries the INT4 key words at this head dim: rows of 16
    int32 words only (:func:`default_prefetch`)."""
    return padded_words(head_dim, 4) == 16


def default_prefetch(int4_heads: int, int2_heads: int, head_dim: int, tiles_per_split: int) -> str:
    """The prefetch mode (:data:`PREFETCH_MODES`) for a cache with these heads whose splits get
    ``tiles_per_split`` tiles of the capacity.

    - ``l2`` for a single-format cache whose splits have at least
      :data:`L2_PREFETCH_MIN_TILES` tiles, where it was the fastest mode. With few tiles per
      split it lost: the first tile's loads then compete with the second tile's prefetch, and
      there are few tiles to win back.
    - ``keys`` for an INT4-only cache with rows of 16 words (head dims 72–128), where the
      carried words keep the layout :func:`_key_tile` reads. With 8-word rows (INT2 at
      D=128, INT4 at D=64) the carried words take another layout, which Triton converts with
      more shuffles per tile (slower); at D=256 they add spills.
    - ``none`` for the 2/4 mix: its kernel holds both loops, and with either prefetch it got
      slower (with ``keys`` its INT4 loop takes every register a thread may hold and spills).
    """
    if int4_heads and int2_heads:
        return "none"
    if tiles_per_split >= L2_PREFETCH_MIN_TILES:
        return "l2"
    return "keys" if int4_heads and _carries_keys(head_dim) else "none"


def _launch_prefetch(mode: str, head_dim: int, codes4: Tensor, codes2: Tensor, bpi: int,
                     device: torch.device) -> dict:
    """The kernel's prefetch constexprs for a resolved ``mode``: the 128-byte lines of a tile of
    each format's codes (0 under the interpreter, which runs no inline assembly: no prefetch
    instruction at all), ``CARRY4`` (``keys``, INT4 rows of 16 words) and ``L2_AHEAD``
    (``l2``)."""
    def lines(codes: Tensor) -> int:
        if interpreted(device):
            return 0
        return triton.next_power_of_2(max(1, bpi * KV_CACHE_BLOCK * codes.stride(3) // 128))

    carry = mode == "keys" and _carries_keys(head_dim)
    return {"LINES4": lines(codes4), "LINES2": lines(codes2), "CARRY4": carry, "L2_AHEAD": mode == "l2"}


def _word_rows(codes: Tensor) -> bool:
    """Whether packed rows ``codes`` ``[2, B, n, T, bytes]`` can be read as aligned int32 words."""
    return codes.shape[-1] % 4 == 0 and all(s % 4 == 0 for s in codes.stride()[:-1]) and codes.data_ptr() % 4 == 0


def default_warps(rows: int) -> int:
    """Warps per program for a dot of ``rows`` query rows (all row groups of a tile): one warp
    per 16 rows (one mma row tile), at least 1. Warps along the keys would share the softmax
    through shared memory and barriers; one warp keeps it in registers."""
    return max(1, rows // 16)


def resolve(config: DecodeConfig, q: Tensor, t) -> DecodeConfig:
    """``config`` as the launch for ``q`` ``[B, Hq, Lq, D]`` over the storage ``t`` uses it:
    ``blocks_per_iter`` lowered to :data:`MAX_ROWS` rows, ``num_warps`` from
    :func:`default_warps` and ``splits`` from :func:`default_splits` when None, ``prefetch``
    from :func:`default_prefetch` when ``"auto"``."""
    b, hq, lq, d = q.shape
    _, _, h, n_blocks, _ = t.step.shape
    rows = triton.next_power_of_2(hq // h * lq)
    bpi = min(config.blocks_per_iter, max(1, MAX_ROWS // rows))
    warps = config.num_warps or default_warps(bpi * rows)
    splits = config.splits or default_splits(b, h, n_blocks, bpi, warps, _sm_count(q.device))
    prefetch = config.prefetch
    if prefetch == "auto":
        tiles_per_split = triton.cdiv(n_blocks, bpi) // splits
        prefetch = default_prefetch(t.codes4.shape[2], t.codes2.shape[2], d, tiles_per_split)
    return dataclasses.replace(config, blocks_per_iter=bpi, num_warps=warps, splits=splits, prefetch=prefetch)


def flashq_decode_triton(q: Tensor, t, attn_mask: Tensor | None = None, scale: float | None = None,
                         config: DecodeConfig | None = None) -> Tensor:
    """Launch the decode kernel: ``q`` ``[B, Hq, Lq, D]`` over the FlashQ storage ``t``
    (:class:`~qattn_compile.kvcache.flashq.FlashQTensors`). Returns ``[B, Hq, Lq, D]`` in q's dtype.

    CPU tensors run under the Triton interpreter (``TRITON_INTERPRET=1``, tests).
    """
    interpreted(q.device)
    check_decode_args(q, t, attn_mask)
    config = resolve(config or DecodeConfig(), q, t)
    b, hq, lq, d = q.shape
    h = t.step.shape[2]
    group = hq // h
    if q.stride(-1) != 1:
        q = q.contiguous()
    glp = triton.next_power_of_2(group * lq)
    bpi, splits = config.blocks_per_iter, config.splits
    d_out = triton.next_power_of_2(d)
    capacity = t.step.shape[3] * KV_CACHE_BLOCK
    kind, mask, (sm_b, sm_h, sm_q, sm_k), mask_len = _mask_args(attn_mask, q, capacity)
    parts = splits + 1  # the last program along the split axis takes the INT8 buffer
    part_o = torch.empty(b, h, parts, glp, d_out, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(b, h, parts, glp, 2, dtype=torch.float32, device=q.device)
    tau = d**-0.5 if scale is None else scale
    c4, c2 = t.codes4, t.codes2
    # zero-size code tensors (no INT4 or no INT2 heads) are never read: pass the other one
    c4 = c4 if c4.numel() else c2
    c2 = c2 if c2.numel() else c4
    _flashq_decode_kernel[(parts, b, h)](
        q, q.stride(0), q.stride(1), q.stride(2),
        c4, c4.stride(0), c4.stride(1), c4.stride(2), c4.stride(3),
        c2, c2.stride(0), c2.stride(1), c2.stride(2), c2.stride(3),
        t.heads4, t.heads2, t.heads4.numel(),
        t.step, t.lo, t.step.stride(0), t.step.stride(1), t.step.stride(2), t.step.stride(3),
        t.scale8, t.scale8.stride(0), t.scale8.stride(1), t.scale8.stride(2),
        t.buf, t.buf.stride(0), t.buf.stride(1), t.buf.stride(2), t.buf.stride(3),
        t.buf_scale, t.buf_scale.stride(0), t.buf_scale.stride(1),
        t.length, t.step.shape[3],
        mask, sm_b, sm_h, sm_q, sm_k, mask_len,
        part_o, part_ml,
        tau * _LOG2E, t.buf.shape[-2],
        HEAD_DIM=d, DO=d_out, G=group, LQ=lq, GLP=glp, BPI=bpi, BLOCK_N=KV_CACHE_BLOCK, MASK_KIND=kind,
        WP4=padded_words(d, 4), WP2=padded_words(d, 2), WORDS4=_word_rows(c4), WORDS2=_word_rows(c2),
        BIASED=config.codes == "biased", HAS4=t.heads4.numel() > 0, HAS2=t.heads2.numel() > 0,
        **_launch_prefetch(config.prefetch, d, c4, c2, bpi, q.device),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    out = torch.empty(b, hq, lq, d, dtype=q.dtype, device=q.device)
    splits_p2 = triton.next_power_of_2(splits)
    cols = max(1, min(d_out, _COMBINE_TILE // (splits_p2 * glp)))
    _combine_kernel[(h, b, d_out // cols)](
        part_o, part_ml, out, out.stride(0), out.stride(1), out.stride(2),
        h, parts,
        HEAD_DIM=d, DO=d_out, G=group, LQ=lq, GLP=glp, SPLITS=splits_p2, COLS=cols, num_warps=4,
    )
    return out
