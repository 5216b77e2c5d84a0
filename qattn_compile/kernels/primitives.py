"""Small Triton helpers shared by the quantizer and attention kernels.

Everything here is exact in IEEE float32 arithmetic and behaves the same on the GPU and under
the Triton interpreter (``TRITON_INTERPRET=1``), except :func:`to_fp8_e4m3`'s hardware path
(see its docstring).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# 1.5 * 2**23: adding it to |x| < 2**22 leaves round-half-to-even(x) in the low mantissa bits.
_RINT_MAGIC = tl.constexpr(12582912.0)
_RINT_MAGIC_BITS = tl.constexpr(0x4B400000)
FP8_E4M3_MAX = tl.constexpr(448.0)


def launcher(kernel, like: torch.Tensor):
    """What to index with the grid to launch ``kernel`` on tensors like ``like``.

    Real tensors: the kernel itself. While torch traces (fake or functional tensor
    subclasses, i.e. inside ``torch.ops.qattn.attention_triton`` under torch.compile):
    ``torch.library.wrap_triton(kernel)``, so that Inductor sees the launch and inlines the
    kernel into its generated code.
    """
    if type(like) is torch.Tensor:
        return kernel
    return torch.library.wrap_triton(kernel)


def launch_takes_register_cap(like: torch.Tensor) -> bool:
    """Whether a launch on tensors like ``like`` can pass a register cap (Triton's
    ``maxnreg``): a plain launch on real CUDA tensors. While torch traces, the launch goes
    into Inductor's generated code, whose configs for a user Triton kernel keep only the
    warps and stages (``config_to_dict`` and the compile options of torch 2.13's
    ``triton_heuristics``), so a cap would be dropped without a word."""
    return type(like) is torch.Tensor and like.device.type == "cuda"


def tma_compatible(*tensors: torch.Tensor) -> bool:
    """Whether TMA descriptors can address every tensor: contiguous last dim, 16-byte aligned
    other strides and base (the storage offset; allocations themselves are aligned)."""
    for t in tensors:
        size = t.element_size()
        if t.stride(-1) != 1 or any((s * size) % 16 for s in t.stride()[:-1]):
            return False
        if (t.storage_offset() * size) % 16:
            return False
    return True


def ensure_tma_allocator() -> None:
    """Give Triton a global-scratch allocator (device-side TMA descriptors live there) when
    none is set; an allocator the user already installed is kept."""
    current = getattr(triton.runtime._allocation, "_allocator", None)
    if current is not None and type(current.get()).__name__ != "NullAllocator":
        return

    def allocate(size: int, alignment: int, stream):
        return torch.empty(size, dtype=torch.int8, device="cuda")

    triton.set_allocator(allocate)


def interpreted(device: torch.device) -> bool:
    """True when kernels on ``device`` run in the Triton interpreter (CPU tensors).

    Raises if CPU tensors reach a launcher without ``TRITON_INTERPRET=1`` (Triton cannot
    compile for the CPU).
    """
    if device.type == "cuda":
        return False
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"qattn Triton kernels need CUDA tensors (got {device}); set TRITON_INTERPRET=1 "
            "before importing triton to run them in the interpreter"
        )
    return True


@triton.jit
def rint_to_int32(x, MINUS: tl.constexpr = 0):
    """Round float32 ``x`` (|x| < 2**22) half-to-even to int32, minus the integer ``MINUS``
    (``0 <= MINUS < 2**22``), with no float→int instruction.

    Matches :func:`torch.round` bit for bit (adds 1.5·2**23 and reads the mantissa bits).
    ``MINUS`` rides in the same add (``1.5·2**23 − MINUS`` is even and the sum stays in the
    binade of unit steps, so the tie-breaking is unchanged): UINT8 P's ``round(P) − 128``
    costs no extra instruction.
    """
    biased = tl.cast(x + (_RINT_MAGIC - MINUS), tl.int32, bitcast=True)
    return biased - _RINT_MAGIC_BITS


_LOG2E = tl.constexpr(1.4426950408889634)
_FINITE_BIAS_MIN = tl.constexpr(-2.3e38)
"""Below this a float32 bias times log2 e would overflow to -inf (finfo.min·1.44 does)."""


@triton.jit
def additive_bias_log2(bias):
    """An additive mask value (any float dtype) in log2 units, float32. Only ``-inf`` gives
    ``-inf``: a finite bias, ``finfo(float32/bfloat16).min`` included, stays finite (clamped
    to ~-3.3e38), so a row whose every key carries it averages V as SDPA does, instead of
    counting as fully masked."""
    bias = bias.to(tl.float32)
    return tl.where(bias == float("-inf"), bias, tl.maximum(bias, _FINITE_BIAS_MIN) * _LOG2E)


@triton.jit
def round_to_e4m3_grid(x):
    """Round float32 ``x`` half-to-even onto the e4m3 grid, saturating at ±448 (stays fp32).

    e4m3 has 3 mantissa bits and a smallest normal exponent of -6 (subnormal step 2**-9):
    the grid step of ``|x|`` is ``2**(max(e, -6) - 3)`` with ``e`` the float32 exponent read
    from the bits, and adding/subtracting ``1.5·2**23·step`` rounds to that step exactly.
    """
    a = tl.abs(x)
    e = (tl.cast(a, tl.int32, bitcast=True) >> 23) - 127
    step = tl.cast((tl.maximum(e, -6) - 3 + 127) << 23, tl.float32, bitcast=True)
    magic = step * _RINT_MAGIC
    r = tl.minimum((a + magic) - magic, FP8_E4M3_MAX)
    return tl.where(x < 0, -r, r)


@triton.jit
def to_fp8_e4m3(x, EXACT: tl.constexpr):
    """float32 ``x`` (already within ±448) → ``tl.float8e4nv`` with round-to-nearest-even.

    ``EXACT=False``: the hardware conversion (``cvt.rn.satfinite``). ``EXACT=True``: round on
    the e4m3 grid first (:func:`round_to_e4m3_grid`), so the conversion itself is exact; the
    interpreter's float32→fp8 conversion mis-rounds values that cross a power of two, so
    launchers set ``EXACT`` under the interpreter.
    """
    if EXACT:
        x = round_to_e4m3_grid(x)
    return x.to(tl.float8e4nv)


@triton.jit
def v_column_of_token(token):
    """Column of the 8-bit transposed V at which ``token`` (int tensor) is stored: tokens keep
    their block of :data:`~qattn_compile.blocks.V_KEY_BLOCK` (32; the bit map below is for
    that size) and, within it, the bits ``(h, j, t1, t0, e)`` of the offset become
    ``(h, t1, t0, j, e)``.

    Why: a thread of a Hopper MMA's accumulator holds score columns ``8j + 2t + e`` (``t`` =
    lane mod 4), while an 8-bit MMA operand taken from registers wants four consecutive
    reduction indices ``4t … 4t + 3`` per thread. :func:`in_v_key_order` relabels P's columns
    by the same map, so each thread's P values already sit where the P·V MMA reads them.
    """
    block = token & -32
    offset = token & 31
    return (block | (offset & 16) | (((offset >> 1) & 3) << 2) | (((offset >> 3) & 1) << 1)
            | (offset & 1))


@triton.jit
def in_v_key_order(p):
    """P ``[M, N]`` (``N`` a multiple of 32) with its columns in the order of the 8-bit V's
    stored tokens: column ``c`` of the result is the token that :func:`v_column_of_token`
    stores at ``c``. A reshape and a permutation that Triton lowers without moving data
    between lanes when ``p`` is in a Hopper MMA accumulator layout (sm_90 SASS: half the
    shuffles and byte permutes of a 64×64 tile gone)."""
    M: tl.constexpr = p.shape[0]
    N: tl.constexpr = p.shape[1]
    # token offset bits (h, j, t, e) = (16, 8, 2·2, 1) -> column bits (h, t, j, e)
    by_bits = tl.reshape(p, (M, N // 32, 2, 2, 4, 2))
    return tl.reshape(tl.permute(by_bits, (0, 1, 2, 4, 3, 5)), (M, N))


@triton.jit
def max_keeping_nan(x, axis: tl.constexpr):
    """``tl.max(x, axis)``, NaN where a reduced value is NaN (``tl.max`` skips NaN, as C's
    ``fmax`` does): what lets a NaN input reach the output, as it does in SDPA. The NaN is
    read off a sum along the same axis (a ``tl.reduce`` with a NaN-keeping combine costs the
    GPU nothing more, but runs element by element in Python under the interpreter)."""
    total = tl.sum(x, axis)
    return tl.where(total != total, total, tl.max(x, axis))


@triton.jit
def min_keeping_nan(x, axis: tl.constexpr):
    """``tl.min(x, axis)``, NaN where a reduced value is NaN (see :func:`max_keeping_nan`)."""
    total = tl.sum(x, axis)
    return tl.where(total != total, total, tl.min(x, axis))


@triton.jit
def _tile_mask(rows, cols, n_rows, n_cols, MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr):
    """Bounds mask of an ``[R, C]`` tile (``[R, 1]`` / ``[1, C]`` / ``[R, C]``), or None."""
    if MASK_ROWS and MASK_COLS:
        mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    elif MASK_ROWS:
        mask = rows[:, None] < n_rows
    elif MASK_COLS:
        mask = cols[None, :] < n_cols
    else:
        mask = None
    return mask


@triton.jit
def load_tile(ptr, rows, cols, stride_r, stride_c, n_rows, n_cols, other,
              MASK_ROWS: tl.constexpr = True, MASK_COLS: tl.constexpr = True):
    """Load ``ptr[rows[:, None] * stride_r + cols[None, :] * stride_c]``; out of range → other.

    rows: ``[R]`` int, cols: ``[C]`` int; returns an ``[R, C]`` tile in the pointer's dtype.
    ``MASK_ROWS``/``MASK_COLS=False`` drop the bounds check of an axis known to be in range
    (fewer registers and predicates in the inner loop).
    """
    mask = _tile_mask(rows, cols, n_rows, n_cols, MASK_ROWS, MASK_COLS)
    ptrs = ptr + rows[:, None] * stride_r + cols[None, :] * stride_c
    if MASK_ROWS or MASK_COLS:
        tile = tl.load(ptrs, mask=mask, other=other)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def store_tile(ptr, value, rows, cols, stride_r, stride_c, n_rows, n_cols,
               MASK_ROWS: tl.constexpr = True, MASK_COLS: tl.constexpr = True):
    """Store an ``[R, C]`` tile at ``ptr[rows[:, None] * stride_r + cols[None, :] * stride_c]``
    (elements outside ``n_rows`` × ``n_cols`` are skipped); casts to the pointer's dtype."""
    mask = _tile_mask(rows, cols, n_rows, n_cols, MASK_ROWS, MASK_COLS)
    ptrs = ptr + rows[:, None] * stride_r + cols[None, :] * stride_c
    if MASK_ROWS or MASK_COLS:
        tl.store(ptrs, value, mask=mask)
    else:
        tl.store(ptrs, value)


@triton.jit
def split_int4(packed):
    """int8 bytes of two packed INT4 values → ``(low, high)`` int8 tensors of the same shape
    (the even and the odd channel of each byte), sign-extended by arithmetic shifts."""
    return (packed << 4) >> 4, packed >> 4


@triton.jit
def pack_int4(values, ROWS: tl.constexpr, COLS: tl.constexpr):
    """``[ROWS, COLS]`` int8 values in [-8, 7] → ``[ROWS, COLS // 2]`` int8 bytes, element
    ``2i`` in the low nibble of byte ``i`` and ``2i + 1`` in its high nibble."""
    even, odd = tl.split(tl.reshape(values, (ROWS, COLS // 2, 2)))
    return (even & 0xF) | (odd << 4)
