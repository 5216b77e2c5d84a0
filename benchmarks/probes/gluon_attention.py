"""A warp-specialized 8-bit attention loop in Gluon (Hopper): what FA3's structure gives here.

Run on the GPU machine from the repository root::

    PYTHONPATH=. python3 benchmarks/probes/gluon_attention.py --out $OUT/gluon_attention.json

What it is for: the step after ``loop_ceiling.py`` (beside it). Triton's automatic pipeline caps
the simplest 8-bit loop near 800 TOPS at D=128 on the H100, and its automatic warp
specialization does not help (docs/archive/NOTES.md, session 15). This loop is written in Gluon
(``triton.experimental.gluon``, Triton's explicit-layout dialect) with FlashAttention-3's
structure: one program holds 128 query rows as two consumer warpgroups of 64 rows (the default
partition and a 4-warp worker), which share a ring of ``--stages`` K/V tiles that a 1-warp
producer fills by TMA (``ready`` barriers armed by the copies, ``empty`` barriers that both
consumers arrive on), with register reallocation between the partitions. Per consumer and key
tile: ``S = Q·Kᵀ`` (FP8 wgmma), the online softmax in base 2, ``P = fp8(448·exp2(S − m))``,
a fresh ``P·V`` product (FP8 wgmma) added to the float32 accumulator, as in qattn's kernel.

Variants (each timed, then checked against float32 attention on the same 8-bit values):

- ``p_operand``: P reaches the P·V MMA through shared memory (a store and a fence per tile) or
  as its register operand (a layout conversion);
- ``overlap`` (FA3's intra-warpgroup pipelining): the next tile's Q·Kᵀ is issued before this
  tile's softmax and this tile's P·V is waited for one tile later; it holds two score tiles
  and a product in registers at once, and a stage is released one tile later, so it needs at
  least three stages (with two, the ring would deadlock).

``--qk int8`` takes INT8 Q and K (int32 scores converted to float32); ``--pv int8`` INT8 P and V
(``P = round(127·exp2(S − m))`` against the running max, the int32 product converted per tile).
INT8 for both are int_flash's formats with ``p_scale: row``; INT8 Q·Kᵀ with FP8 P·V are
sage2_8b's (no scales here, no ΔS).
``--keys`` sets the key tile (FA3 takes 224 keys for FP8 at D=128, with 240 registers per
consumer thread).

Non-causal, no masks, every length a multiple of the tiles (128 query rows, ``--keys`` keys),
B·H = 128 (B=4, H=32), Q/K/V FP8 e4m3 or INT8, without scales. Written against Triton 3.6's
Gluon (the H100's); Gluon is experimental and its API changes between Triton versions.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

import loop_ceiling  # benchmarks/probes/, the script's own directory: inputs, reference, B·H
from loop_ceiling import HEADS, LOG2_127, LOG2_448, LOG2E

ROWS = 64  # query rows per consumer warpgroup (two per program)
CONSUMER_REGS = 232  # registers per thread of the consumer worker after reallocation
PRODUCER_REGS = 24


@gluon.jit
def _producer(k_desc, v_desc, k_smem, v_smem, ready, empty, bh, N,
              D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Fill the K/V ring: tile ``j`` goes to stage ``j % STAGES`` once both consumers have
    released that stage's previous tile; ``ready`` completes when its copies land."""
    for j in range(N // BLOCK_N):
        stage = j % STAGES
        if j >= STAGES:
            mbarrier.wait(empty.index(stage), phase=((j // STAGES) & 1) ^ 1)
        bar = ready.index(stage)
        mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [bh * N + j * BLOCK_N, 0], bar, k_smem.index(stage))
        tma.async_copy_global_to_shared(v_desc, [bh * D, j * BLOCK_N], bar, v_smem.index(stage))


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale, log2_pmax):
    """Online softmax of one score tile (float32, or int32 from INT8 Q and K): ``(p, alpha,
    m_new, l_new)`` with ``p = pmax·exp2(S − m_new)`` (``pmax`` = 448 for FP8 P, 127 for INT8)
    and ``alpha = exp2(m_old − m_new)``."""
    s = s.to(gl.float32) * qk_scale
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - gl.expand_dims(m_new - log2_pmax, 1))
    return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)


@gluon.jit
def _pv_product(p, p_smem, v_tile, zero_o, P_IN_REGISTERS: gl.constexpr):
    """Issue the fresh 8-bit ``P·V`` MMA of one tile (asynchronous): P as the register operand,
    or stored to ``p_smem`` first. FP8 P for a float32 ``zero_o``; for an int32 one, INT8 P
    rounded half to even (the low byte of ``p + 1.5·2²³``, as qattn's kernel rounds)."""
    if zero_o.dtype == gl.int32:
        p8 = (p + 12582912.0).to(gl.int32, bitcast=True).to(gl.int8)
    else:
        p8 = p.to(gl.float8e4nv)
    if P_IN_REGISTERS:
        operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=zero_o.type.layout,
                                                    k_width=4)
        pv = warpgroup_mma(gl.convert_layout(p8, operand), v_tile, zero_o, use_acc=False,
                           is_async=True)
    else:
        p_smem.store(p8)
        fence_async_shared()
        pv = warpgroup_mma(p_smem, v_tile, zero_o, use_acc=False, is_async=True)
    return pv


@gluon.jit
def _consumer(q_smem, p_smem, k_smem, v_smem, ready, empty, o_ptr, row0, N, qk_scale, log2_pmax,
              D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, P_IN_REGISTERS: gl.constexpr, OVERLAP: gl.constexpr,
              QK_INT8: gl.constexpr, PV_INT8: gl.constexpr):
    """One warpgroup's 64 query rows (``q_smem``) against every key tile of the ring; writes
    float32 ``o[row0 : row0 + BLOCK_M]``. ``QK_INT8`` / ``PV_INT8``: that product's operands
    are int8, its result int32."""
    s_dtype: gl.constexpr = gl.int32 if QK_INT8 else gl.float32
    pv_dtype: gl.constexpr = gl.int32 if PV_INT8 else gl.float32
    # INT8 score MMAs at most 128 keys wide: Triton 3.6 failed to lower an n=256 int8 wgmma.
    s_instr_n: gl.constexpr = min(BLOCK_N, 128) if QK_INT8 else BLOCK_N
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, s_instr_n, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 32])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
    acc = gl.zeros([BLOCK_M, D], gl.float32, layout=o_layout)
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], s_dtype, layout=s_layout)
    zero_o = gl.zeros([BLOCK_M, D], pv_dtype, layout=o_layout)
    n_tiles = N // BLOCK_N
    if OVERLAP:
        # In flight at the top of iteration j: S_j, then P·V of tile j − 1 (a zero product
        # before the first tile), completing in that order.
        mbarrier.wait(ready.index(0), phase=0)
        s_next = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False,
                               is_async=True)
        pv = _pv_product(zero_s, p_smem, v_smem.index(0).permute((1, 0)), zero_o, P_IN_REGISTERS)
        alpha_prev = gl.full([BLOCK_M], 1.0, gl.float32, layout=row_s)
        for j in range(n_tiles):
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s_next,))
            if j + 1 < n_tiles:
                nxt = (j + 1) % STAGES
                mbarrier.wait(ready.index(nxt), phase=((j + 1) // STAGES) & 1)
                s_next = warpgroup_mma(q_smem, k_smem.index(nxt).permute((1, 0)), zero_s,
                                       use_acc=False, is_async=True)
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale, log2_pmax)
            if j + 1 < n_tiles:
                pv_done = warpgroup_mma_wait(num_outstanding=1, deps=(pv,))
            else:
                pv_done = warpgroup_mma_wait(num_outstanding=0, deps=(pv,))
            if j >= 1:
                mbarrier.arrive(empty.index((j - 1) % STAGES), count=1)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha_prev, row_o), 1) + pv_done
            pv = _pv_product(p, p_smem, v_smem.index(j % STAGES).permute((1, 0)), zero_o,
                             P_IN_REGISTERS)
            alpha_prev = alpha
        pv_done = warpgroup_mma_wait(num_outstanding=0, deps=(pv,))
        mbarrier.arrive(empty.index((n_tiles - 1) % STAGES), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha_prev, row_o), 1) + pv_done
    else:
        for j in range(n_tiles):
            stage = j % STAGES
            mbarrier.wait(ready.index(stage), phase=(j // STAGES) & 1)
            s = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), zero_s, use_acc=False,
                              is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale, log2_pmax)
            pv = _pv_product(p, p_smem, v_smem.index(stage).permute((1, 0)), zero_o,
                             P_IN_REGISTERS)
            pv = warpgroup_mma_wait(num_outstanding=0, deps=(pv,))
            mbarrier.arrive(empty.index(stage), count=1)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1) + pv.to(gl.float32)
    o = acc / gl.expand_dims(gl.convert_layout(l_i, row_o), 1)
    rows = row0 + gl.arange(0, BLOCK_M, layout=row_o)
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    gl.store(o_ptr + gl.expand_dims(rows, 1) * D + gl.expand_dims(cols, 0), o)


@gluon.jit
def _attention_kernel(q_desc, k_desc, v_desc, o_ptr, N, qk_scale, log2_pmax,
                      D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      STAGES: gl.constexpr, P_IN_REGISTERS: gl.constexpr, OVERLAP: gl.constexpr,
                      QK_INT8: gl.constexpr, PV_INT8: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                      PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """Rows ``[pid_m·2·BLOCK_M, …)`` of head ``pid_bh``: q, k ``[B·H·N, D]``, the transposed
    vt ``[B·H·D, N]`` (K-major for the P·V MMA), FP8 e4m3 or int8 (``QK_INT8``, ``PV_INT8``),
    through TMA descriptors; o float32 ``[B·H·N, D]``. ``qk_scale`` = softmax scale · log2 e."""
    gl.static_assert(not OVERLAP or STAGES >= 3, "overlap releases stages a tile late")
    gl.static_assert(not (OVERLAP and (QK_INT8 or PV_INT8)), "the overlap variant is FP8 only")
    pid_m = gl.program_id(0)
    bh = gl.program_id(1)
    p_dtype: gl.constexpr = gl.int8 if PV_INT8 else gl.float8e4nv
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], p_dtype)
    q0 = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, D], q_desc.layout)
    q1 = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, D], q_desc.layout)
    p0 = gl.allocate_shared_memory(p_dtype, [BLOCK_M, BLOCK_N], p_layout)
    p1 = gl.allocate_shared_memory(p_dtype, [BLOCK_M, BLOCK_N], p_layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, D, BLOCK_N], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers release each tile
    row0 = bh * N + pid_m * 2 * BLOCK_M
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row0, 0], q_bar, q0)
    tma.async_copy_global_to_shared(q_desc, [row0 + BLOCK_M, 0], q_bar, q1)
    mbarrier.wait(q_bar, phase=0)
    gl.warp_specialize([
        (_consumer, (q0, p0, k_smem, v_smem, ready, empty, o_ptr, row0, N, qk_scale, log2_pmax,
                     D, BLOCK_M, BLOCK_N, STAGES, P_IN_REGISTERS, OVERLAP, QK_INT8, PV_INT8)),
        (_consumer, (q1, p1, k_smem, v_smem, ready, empty, o_ptr, row0 + BLOCK_M, N, qk_scale,
                     log2_pmax, D, BLOCK_M, BLOCK_N, STAGES, P_IN_REGISTERS, OVERLAP, QK_INT8,
                     PV_INT8)),
        (_producer, (k_desc, v_desc, k_smem, v_smem, ready, empty, bh, N, D, BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def attention(q, k, vt, n: int, d: int, qk_scale: float, stages: int, p_in_registers: bool,
              overlap: bool, keys: int = 128,
              consumer_regs: int = CONSUMER_REGS) -> tuple[torch.Tensor, object]:
    """Run the kernel on q, k ``[B·H·N, D]`` and vt ``[B·H·D, N]`` (FP8 or INT8; q and k alike)
    with ``keys`` per tile and softmax scale ``qk_scale``; returns (float32 output ``[B·H·N,
    D]``, the compiled kernel)."""
    qk_int8, pv_int8 = q.dtype == torch.int8, vt.dtype == torch.int8
    out = torch.empty(HEADS * n, d, device=q.device, dtype=torch.float32)
    descs = [TensorDescriptor(x, list(x.shape), list(x.stride()), block,
                              gl.NVMMASharedLayout.get_default_for(
                                  block, gl.int8 if x.dtype == torch.int8 else gl.float8e4nv))
             for x, block in ((q, [ROWS, d]), (k, [keys, d]), (vt, [d, keys]))]
    kernel = _attention_kernel[(n // (2 * ROWS), HEADS)](
        *descs, out, n, qk_scale * LOG2E, LOG2_127 if pv_int8 else LOG2_448, D=d, BLOCK_M=ROWS,
        BLOCK_N=keys, STAGES=stages, P_IN_REGISTERS=p_in_registers, OVERLAP=overlap,
        QK_INT8=qk_int8, PV_INT8=pv_int8,
        CONSUMER_REGS=consumer_regs, PRODUCER_REGS=PRODUCER_REGS, num_warps=4)
    return out, kernel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gluon_attention.json")
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3],
                        help="K/V ring depths (the overlap variant runs with three or more)")
    parser.add_argument("--keys", type=int, nargs="+", default=[128],
                        help="keys per tile (FA3 takes 224 for FP8 at D=128; Gluon tiles are "
                             "powers of two)")
    parser.add_argument("--qk", choices=["fp8", "int8"], default="fp8", help="Q and K format")
    parser.add_argument("--pv", choices=["fp8", "int8"], help="P and V format (default: --qk's)")
    parser.add_argument("--consumer-regs", type=int, default=CONSUMER_REGS,
                        help="registers per consumer thread after reallocation (at most 240)")
    args = parser.parse_args()
    args.pv = args.pv or args.qk
    rows = []
    for d, n in itertools.product(args.head_dims, args.seq):
        q, k, v, vt, qk_scale = loop_ceiling.inputs(n, d, args.qk, pv=args.pv)
        ref = loop_ceiling.reference(q, k, v, n, qk_scale)  # the first 4 heads
        for keys, stages, p_in_registers, overlap in itertools.product(
                args.keys, args.stages, (False, True), (False, True)):
            if overlap and (stages < 3 or "int8" in (args.qk, args.pv)):
                continue
            row = {"n": n, "d": d, "qk": args.qk, "pv": args.pv, "keys": keys, "stages": stages,
                   "p_in_registers": p_in_registers, "overlap": overlap,
                   "consumer_regs": args.consumer_regs}
            run = functools.partial(attention, q, k, vt, n, d, qk_scale, stages, p_in_registers,
                                    overlap, keys, args.consumer_regs)
            try:
                out, kernel = run()
                ms = triton.testing.do_bench(run, rep=200)
            except Exception as exc:  # a variant that does not compile is a result too
                row["error"] = f"{type(exc).__name__}: {str(exc)[-300:]}"
                print(row, flush=True)
                rows.append(row)
                continue
            head = out[: ref.shape[0]]
            row.update(ms=ms, tops=4 * HEADS * n * n * d / ms / 1e9,
                       rel_l1=((head - ref).abs().sum() / ref.abs().sum()).item(),
                       registers=kernel.n_regs, spills=kernel.n_spills,
                       shared_bytes=kernel.metadata.shared)
            rows.append(row)
            p_operand = "registers" if p_in_registers else "smem"
            print(f"{args.qk}/{args.pv} N={n} D={d} keys={keys} stages={stages} P {p_operand}"
                  f"{' overlap' if overlap else ''}: {row['tops']:6.1f} TOPS  rel-L1 "
                  f"{row['rel_l1']:.4f}  spills {row['spills']}", flush=True)
        del q, k, v, vt, ref
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "triton": triton.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
