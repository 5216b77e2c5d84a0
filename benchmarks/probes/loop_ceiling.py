"""The simplest 8-bit attention loop Triton compiles, with and without warp specialization.

Run on the GPU machine from the repository root::

    PYTHONPATH=. python3 benchmarks/probes/loop_ceiling.py --out $OUT/loop_ceiling.json

What it is for: a ceiling for the structure of qattn's attention kernel on the installed
Triton, and a check of Triton's automatic warp specialization (``tl.range(...,
warp_specialize=True)``), the Hopper technique our kernel does not use (docs/archive/NOTES.md,
sessions 2 and 15). The loop here has none of the kernel's features: Q and K are already
FP8 e4m3 or INT8 (``--qk``; INT8 scores are converted to float32, as sage2_8b's are), V FP8
e4m3, with no scales; every length is a multiple of the tiles (no bounds or masks), the loop
is non-causal, and every load is a TMA box. P is ``fp8(448·exp2(S − m))`` and each tile's
``P·V`` is a fresh product, as in the kernel. Per launch config (tile, warps, stages) it
prints TOPS (4·B·H·N²·D / t, median of ``triton.testing.do_bench``) with and without warp
specialization, the rel-L1 of the output against float32 softmax attention on the same FP8
values (first 4 heads, at the shortest length) and the largest difference between the two
variants' outputs (a specialized loop must compute the same thing). Each shape runs in worker
processes: a kernel that faults (Triton 3.6 miscompiles some specialized loops into illegal
addresses, which lose the CUDA context) is recorded as an error and the configs after it go on
in a fresh process.

``--pv`` adds variants of the P·V step (NOTES, session 17), to see what the 8-bit P formats
and the online softmax's bookkeeping cost in this loop:

- ``fp8``: the loop above (FP8 P and V, a fresh product per tile, ``acc·α + P·V``);
- ``int8-row``: INT8 ``round(127·2^(S − m))`` against the running max, INT8 V, the int32
  product converted per tile (int_flash / fmha_int8 with ``p_scale: row``);
- ``int8-tile``: INT8 P against each tile's own max, the product weighted by ``2^(m_t − m)``
  (their default ``p_scale: tile``);
- ``oracle-max``: INT8 P against each row's exact max computed beforehand on the host, the
  int32 product accumulated in place in the tensor core, no max, no ``α``: what the loop
  would cost if the online softmax's bookkeeping were free (not an algorithm: it needs the
  scores before the loop);
- ``two-pass``: the same loop after a first pass on the GPU (:func:`_row_max_pass`: the
  score MMA and a max per score, nothing else) that computes each row's exact max: the
  algorithm that the ``oracle-max`` bound suggests, timed with both passes (NOTES, session 18).

B·H = 128 (B=4, H=32), N ∈ ``--seq``, D ∈ ``--head-dims``; re-run it after a Triton upgrade
before trying warp specialization in the kernel again.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys

import torch
import triton
import triton.language as tl

from qattn_compile.kernels.primitives import rint_to_int32

HEADS = 128  # B·H
CONFIGS = [  # (block_m, block_n, num_warps, num_stages)
    (64, 128, 4, 2), (64, 128, 4, 3), (128, 128, 8, 2), (128, 128, 4, 2), (128, 64, 4, 3),
]
LOG2E = math.log2(math.e)
LOG2_448 = math.log2(448.0)
LOG2_127 = math.log2(127.0)
PV_MODES = {"fp8": 0, "int8-row": 1, "int8-tile": 2, "oracle-max": 3, "two-pass": 3}
"""``--pv`` name → the loop's ``PV`` switch (module docstring; ``two-pass`` runs the
``oracle-max`` loop after :func:`_row_max_pass`)."""
ORACLE_MARGIN = 0.01
"""log2 units added to each row's max (the host's or the first pass's): the FP8 MMA's
accumulation may round a score above the float32 product's, and INT8 P must stay ≤ 127
(``127·2^−0.01`` = 126.1)."""
MAX_PASS_CONFIG = (128, 128, 4, 3)
"""``two-pass``'s first pass (BLOCK_M, BLOCK_N, warps, stages): the fastest of the eight
measured at D ∈ {64, 128}, N ∈ {4K, 16K} (RESULTS, session 18)."""
PV_FP8 = tl.constexpr(PV_MODES["fp8"])
PV_INT8_ROW = tl.constexpr(PV_MODES["int8-row"])
PV_INT8_TILE = tl.constexpr(PV_MODES["int8-tile"])
PV_ORACLE_MAX = tl.constexpr(PV_MODES["oracle-max"])


@triton.jit
def _raw_scores(q, k, QK_INT8: tl.constexpr):
    """``q·kᵀ`` of one tile before any scale: int32 for INT8 operands, float32 for FP8."""
    if QK_INT8:
        return tl.dot(q, tl.trans(k), out_dtype=tl.int32)
    return tl.dot(q, tl.trans(k))


@triton.jit
def _8bit_attention_loop(q_ptr, k_ptr, vt_ptr, o_ptr, mref_ptr, N, BH, qk_scale, log2_pmax,
                        D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        QK_INT8: tl.constexpr, PV: tl.constexpr,
                        WARP_SPECIALIZE: tl.constexpr):
    """Rows ``[pid_m·BLOCK_M, …)`` of head ``pid_bh``: q, k ``[B·H·N, D]`` and the transposed
    vt ``[B·H·D, N]`` (K-major for the 8-bit P·V MMA), float8 e4m3 or int8 (``QK_INT8``: q and
    k int8, int32 scores; ``PV``: vt is FP8 for :data:`PV_FP8`, int8 otherwise); o float32
    ``[B·H·N, D]``; ``BH`` = B·H; ``mref_ptr``: float32 ``[B·H·N]`` row maxes of the scores
    in log2 units (read by :data:`PV_ORACLE_MAX` only). (Computing B·H as
    ``tl.num_programs(1)`` in the descriptors' shapes made the specialized 128×128 loop read
    out of bounds on Triton 3.6: an illegal address.) ``qk_scale`` = softmax scale · log2 e;
    ``log2_pmax`` = log2 of P's largest code (448 for FP8, 127 for INT8)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    rows_total = BH * N
    q_desc = tl.make_tensor_descriptor(q_ptr, shape=[rows_total, D], strides=[D, 1],
                                       block_shape=[BLOCK_M, D])
    k_desc = tl.make_tensor_descriptor(k_ptr, shape=[rows_total, D], strides=[D, 1],
                                       block_shape=[BLOCK_N, D])
    v_desc = tl.make_tensor_descriptor(vt_ptr, shape=[BH * D, N],
                                       strides=[N, 1], block_shape=[D, BLOCK_N])
    q = q_desc.load([bh * N + pid_m * BLOCK_M, 0])
    rows = bh * N + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if PV == PV_ORACLE_MAX:
        m_i = tl.load(mref_ptr + rows)
        acc = tl.zeros((BLOCK_M, D), tl.int32)
        l_i = tl.zeros((BLOCK_M,), tl.int32)
    else:
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        acc = tl.zeros((BLOCK_M, D), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
    for start_n in tl.range(0, N, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        k = k_desc.load([bh * N + start_n, 0])
        s = _raw_scores(q, k, QK_INT8).to(tl.float32) * qk_scale
        v = tl.trans(v_desc.load([bh * D, start_n]))
        if PV == PV_ORACLE_MAX:
            p = rint_to_int32(tl.math.exp2(s - (m_i - log2_pmax)[:, None]))
            l_i += tl.sum(p, 1)
            acc = tl.dot(p.to(tl.int8), v, acc, out_dtype=tl.int32)
        else:
            m_tile = tl.max(s, 1)
            m_new = tl.maximum(m_i, m_tile)
            alpha = tl.math.exp2(m_i - m_new)
            if PV == PV_FP8:
                p = tl.math.exp2(s - (m_new - log2_pmax)[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + tl.dot(p.to(tl.float8e4nv), v)
            elif PV == PV_INT8_ROW:
                p = rint_to_int32(tl.math.exp2(s - (m_new - log2_pmax)[:, None]))
                l_i = l_i * alpha + tl.sum(p, 1).to(tl.float32)
                pv = tl.dot(p.to(tl.int8), v, out_dtype=tl.int32).to(tl.float32)
                acc = acc * alpha[:, None] + pv
            else:
                weight = tl.math.exp2(m_tile - m_new)
                p = rint_to_int32(tl.math.exp2(s - (m_tile - log2_pmax)[:, None]))
                l_i = l_i * alpha + tl.sum(p, 1).to(tl.float32) * weight
                pv = tl.dot(p.to(tl.int8), v, out_dtype=tl.int32).to(tl.float32)
                acc = acc * alpha[:, None] + pv * weight[:, None]
            m_i = m_new
    cols = tl.arange(0, D)
    o = acc.to(tl.float32) / l_i.to(tl.float32)[:, None]
    tl.store(o_ptr + rows[:, None] * D + cols[None, :], o)


@triton.jit
def _row_max_pass(q_ptr, k_ptr, mref_ptr, N, BH, qk_scale, margin, D: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QK_INT8: tl.constexpr):
    """``two-pass``'s first pass: mref float32 ``[B·H·N]`` = each row's largest score in log2
    units (``max_j q_i·k_j · qk_scale``) plus ``margin``, from the same q, k ``[B·H·N, D]`` as
    :func:`_8bit_attention_loop`. The max is taken on the raw dot (int32 for INT8) and scaled
    once: ``qk_scale`` is positive, so it is the max of the loop's scaled scores."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    q_desc = tl.make_tensor_descriptor(q_ptr, shape=[BH * N, D], strides=[D, 1],
                                       block_shape=[BLOCK_M, D])
    k_desc = tl.make_tensor_descriptor(k_ptr, shape=[BH * N, D], strides=[D, 1],
                                       block_shape=[BLOCK_N, D])
    q = q_desc.load([bh * N + pid_m * BLOCK_M, 0])
    if QK_INT8:
        m_i = tl.full((BLOCK_M,), -2147483647, tl.int32)
    else:
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    for start_n in tl.range(0, N, BLOCK_N):
        k = k_desc.load([bh * N + start_n, 0])
        m_i = tl.maximum(m_i, tl.max(_raw_scores(q, k, QK_INT8), 1))
    rows = bh * N + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    tl.store(mref_ptr + rows, m_i.to(tl.float32) * qk_scale + margin)


def row_max_on_device(q, k, n, d, qk_scale, out=None) -> torch.Tensor:
    """:func:`_row_max_pass` over all ``HEADS`` heads with :data:`MAX_PASS_CONFIG`: float32
    ``[B·H·N]``, the same values as :func:`row_max_log2` (written into ``out`` if given)."""
    block_m, block_n, warps, stages = MAX_PASS_CONFIG
    if out is None:
        out = torch.empty(HEADS * n, device=q.device, dtype=torch.float32)
    _row_max_pass[(n // block_m, HEADS)](
        q, k, out, n, HEADS, qk_scale * LOG2E, ORACLE_MARGIN, D=d, BLOCK_M=block_m,
        BLOCK_N=block_n, QK_INT8=q.dtype == torch.int8, num_warps=warps, num_stages=stages)
    return out


def _run(q, k, vt, n, d, cfg, warp_specialize, qk_scale, pv="fp8", m_ref=None) -> torch.Tensor:
    """The loop over all ``HEADS`` heads with launch config ``cfg`` and P·V variant ``pv``
    (``m_ref``: :func:`row_max_log2` for ``oracle-max``; ``two-pass`` fills it, or a new
    buffer when None, with :func:`row_max_on_device` first); float32 ``[B·H·N, D]``."""
    block_m, block_n, warps, stages = cfg
    out = torch.empty(HEADS * n, d, device=q.device, dtype=torch.float32)
    if pv == "two-pass":
        m_ref = row_max_on_device(q, k, n, d, qk_scale, m_ref)
    if m_ref is None:
        m_ref = out  # never read by the other variants
    _8bit_attention_loop[(n // block_m, HEADS)](
        q, k, vt, out, m_ref, n, HEADS, qk_scale * LOG2E,
        LOG2_448 if pv == "fp8" else LOG2_127, D=d, BLOCK_M=block_m, BLOCK_N=block_n,
        QK_INT8=q.dtype == torch.int8, PV=PV_MODES[pv], WARP_SPECIALIZE=warp_specialize,
        num_warps=warps, num_stages=stages)
    return out


def _scores(q, k, n, qk_scale, head):
    """float32 ``[N, N]`` scores of one head on the 8-bit values (no softmax)."""
    rows = slice(head * n, (head + 1) * n)
    return (q[rows].float() @ k[rows].float().T) * qk_scale


def reference(q, k, v, n, qk_scale, heads=4) -> torch.Tensor:
    """float32 softmax attention of the first ``heads`` heads on the 8-bit values, ``[heads·n,
    d]``."""
    out = [torch.softmax(_scores(q, k, n, qk_scale, h), dim=-1)
           @ v[h * n: (h + 1) * n].float() for h in range(heads)]
    return torch.cat(out)


def row_max_log2(q, k, n, qk_scale) -> torch.Tensor:
    """float32 ``[B·H·N]`` row maxes of the scores in log2 units plus :data:`ORACLE_MARGIN`
    (the ``oracle-max`` variant's reference)."""
    return torch.cat([_scores(q, k, n, qk_scale * LOG2E, h).amax(dim=1)
                      for h in range(HEADS)]) + ORACLE_MARGIN


def inputs(n: int, d: int, qk: str, pv: str = "fp8", device: str = "cuda"):
    """q, k ``[B·H·N, D]`` (FP8 of N(0, 1) values, or INT8 uniform in [−127, 127]), v ``[B·H·N,
    D]`` (FP8 of N(0, 1) values for ``pv="fp8"``, else INT8 uniform in [−127, 127]) and its
    transpose ``[B·H·D, N]``, and the softmax scale that keeps the scores' spread alike."""
    if qk == "int8":
        q, k = (torch.randint(-127, 128, (HEADS * n, d), device=device, dtype=torch.int8)
                for _ in range(2))
        qk_scale = 1.0 / (math.sqrt(d) * 73.3 ** 2)  # 73.3: the std of uniform [−127, 127]
    else:
        q, k = (torch.randn(HEADS * n, d, device=device).to(torch.float8_e4m3fn)
                for _ in range(2))
        qk_scale = 1.0 / math.sqrt(d)
    if pv == "fp8":
        v = torch.randn(HEADS * n, d, device=device).to(torch.float8_e4m3fn)
    else:
        v = torch.randint(-127, 128, (HEADS * n, d), device=device, dtype=torch.int8)
    vt = v.view(HEADS, n, d).transpose(1, 2).contiguous().view(HEADS * d, n)
    return q, k, v, vt, qk_scale


def _measure(qk: str, pv: str, d: int, n: int, configs, with_reference: bool, variants) -> None:
    """Worker: time ``configs`` (each plain, then specialized, as ``variants`` lists) on one
    shape, printing one JSON row per variant as soon as it is measured."""
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8,
                                                                     device="cuda"))
    q, k, v, vt, qk_scale = inputs(n, d, qk, pv)
    m_ref = None
    if pv == "oracle-max":
        m_ref = row_max_log2(q, k, n, qk_scale)
    elif pv == "two-pass":  # NaN until each call's first pass fills it
        m_ref = torch.full((HEADS * n,), float("nan"), device=q.device)
    ref = reference(q, k, v, n, qk_scale) if with_reference else None
    for cfg in configs:
        plain = None
        for warp_specialize in variants:
            row = {"qk": qk, "pv": pv, "n": n, "d": d, "config": list(cfg),
                   "warp_specialize": warp_specialize}

            def call():
                return _run(q, k, vt, n, d, cfg, warp_specialize, qk_scale, pv, m_ref)

            try:
                out = call()
                torch.cuda.synchronize()  # a fault shows here, on the config that caused it
                ms = triton.testing.do_bench(call, rep=200)
            except Exception as exc:  # a config Triton cannot compile is a result too
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                print(json.dumps(row), flush=True)
                if "illegal" in row["error"]:
                    raise  # the CUDA context is lost: the parent starts a fresh worker
                continue
            row.update(ms=ms, tops=4 * HEADS * n * n * d / ms / 1e9)
            if ref is not None:
                head = out[: ref.shape[0]]
                row["rel_l1"] = ((head - ref).abs().sum() / ref.abs().sum()).item()
            if plain is None:
                plain = out
            else:
                row["max_diff_to_plain"] = (out - plain).abs().max().item()
            print(json.dumps(row), flush=True)


def _rows_of_shape(qk: str, pv: str, d: int, n: int, with_reference: bool, configs,
                   variants) -> list[dict]:
    """Every config's rows for one shape, each worker in its own process: a kernel that
    faults (an illegal address loses the CUDA context) is recorded and the next worker
    goes on with the configs after it."""
    planned = [(tuple(cfg), ws) for cfg in configs for ws in variants]
    rows: list[dict] = []
    while len(rows) < len(planned):
        done = {(tuple(r["config"]), r["warp_specialize"]) for r in rows}
        todo = [cfg for cfg in configs if (tuple(cfg), variants[-1]) not in done]
        spec = json.dumps({"qk": qk, "pv": pv, "d": d, "n": n, "configs": todo,
                           "reference": with_reference, "variants": variants})
        proc = subprocess.run([sys.executable, __file__, "--worker", spec], capture_output=True,
                              text=True)
        new = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        new = [r for r in new if (tuple(r["config"]), r["warp_specialize"]) not in done]
        rows += new
        for row in new:
            checks = "".join(f"  {name} {row[name]:.4g}" for name in
                             ("tops", "rel_l1", "max_diff_to_plain") if name in row)
            print(f"{qk} P·V {pv} N={n} D={d} {tuple(row['config'])} warp_specialize="
                  f"{row['warp_specialize']:d}:{checks}  {row.get('error', '')}", flush=True)
        if not new:  # the worker reported nothing new (it died at once): give up on the rest
            tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
            rows += [{"qk": qk, "pv": pv, "n": n, "d": d, "config": list(cfg),
                      "warp_specialize": ws,
                      "error": f"worker died: {tail[:200]}"}
                     for cfg, ws in planned if (cfg, ws) not in done]
            print(qk, pv, n, d, "worker died:", tail, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="loop_ceiling.json")
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--qk", nargs="+", choices=["fp8", "int8"], default=["fp8", "int8"])
    parser.add_argument("--configs", nargs="+", default=["x".join(map(str, c)) for c in CONFIGS],
                        help="launch configs as BLOCK_MxBLOCK_NxWARPSxSTAGES, e.g. 64x128x4x2")
    parser.add_argument("--pv", nargs="+", choices=list(PV_MODES), default=["fp8"],
                        help="P·V variants (module docstring)")
    parser.add_argument("--plain-only", action="store_true",
                        help="time the loop without warp specialization only")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one shape's configs
    args = parser.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        _measure(spec["qk"], spec["pv"], spec["d"], spec["n"], [tuple(c) for c in spec["configs"]],
                 spec["reference"], spec["variants"])
        return
    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs]
    variants = [False] if args.plain_only else [False, True]
    rows = []
    for qk, d, n, pv in ((qk, d, n, pv) for qk in args.qk for d in args.head_dims
                         for n in args.seq for pv in args.pv):
        rows += _rows_of_shape(qk, pv, d, n, n == min(args.seq), configs, variants)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "triton": triton.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
