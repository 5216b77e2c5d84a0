"""The simplest 8-bit attention loop Triton compiles, with and without warp specialization.

Run on the GPU machine from the repository root::

    PYTHONPATH=. python3 benchmarks/loop_ceiling.py --out $OUT/loop_ceiling.json

What it is for: a ceiling for the structure of qattn's attention kernel on the installed
Triton, and a check of Triton's automatic warp specialization (``tl.range(...,
warp_specialize=True)``), the Hopper technique our kernel does not use (benchmarks/NOTES.md,
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

HEADS = 128  # B·H
CONFIGS = [  # (block_m, block_n, num_warps, num_stages)
    (64, 128, 4, 2), (64, 128, 4, 3), (128, 128, 8, 2), (128, 128, 4, 2), (128, 64, 4, 3),
]
LOG2E = math.log2(math.e)
LOG2_448 = math.log2(448.0)


@triton.jit
def _8bit_attention_loop(q_ptr, k_ptr, vt_ptr, o_ptr, N, BH, qk_scale, log2_pmax,
                        D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        QK_INT8: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """Rows ``[pid_m·BLOCK_M, …)`` of head ``pid_bh``: q, k ``[B·H·N, D]`` and the transposed
    vt ``[B·H·D, N]`` (K-major for the FP8 P·V MMA), float8 e4m3; o float32 ``[B·H·N, D]``;
    ``BH`` = B·H. (Computing B·H as ``tl.num_programs(1)`` in the descriptors' shapes made the
    specialized 128×128 loop read out of bounds on Triton 3.6: an illegal address.)
    ``qk_scale`` = softmax scale · log2 e. ``QK_INT8``: q and k are int8 (int32 scores)."""
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
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    for start_n in tl.range(0, N, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        k = k_desc.load([bh * N + start_n, 0])
        if QK_INT8:
            s = tl.dot(q, tl.trans(k), out_dtype=tl.int32).to(tl.float32) * qk_scale
        else:
            s = tl.dot(q, tl.trans(k)) * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - (m_new - log2_pmax)[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.trans(v_desc.load([bh * D, start_n]))
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float8e4nv), v)
        m_i = m_new
    rows = bh * N + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, D)
    tl.store(o_ptr + rows[:, None] * D + cols[None, :], acc / l_i[:, None])


def _run(q, k, vt, n, d, cfg, warp_specialize, qk_scale) -> torch.Tensor:
    block_m, block_n, warps, stages = cfg
    out = torch.empty(HEADS * n, d, device=q.device, dtype=torch.float32)
    _8bit_attention_loop[(n // block_m, HEADS)](
        q, k, vt, out, n, HEADS, qk_scale * LOG2E, LOG2_448, D=d, BLOCK_M=block_m, BLOCK_N=block_n,
        QK_INT8=q.dtype == torch.int8, WARP_SPECIALIZE=warp_specialize, num_warps=warps,
        num_stages=stages)
    return out


def reference(q, k, v, n, d, qk_scale, heads=4) -> torch.Tensor:
    """float32 softmax attention of the first ``heads`` heads on the 8-bit values, ``[heads·n,
    d]``."""
    qf, kf, vf = (x[: heads * n].float().view(heads, n, d) for x in (q, k, v))
    probs = torch.softmax(qf @ kf.transpose(1, 2) * qk_scale, dim=-1)
    return (probs @ vf).reshape(heads * n, d)


def inputs(n: int, d: int, qk: str, device: str = "cuda"):
    """q, k ``[B·H·N, D]`` (FP8 of N(0, 1) values, or INT8 uniform in [−127, 127]), v as FP8
    and transposed ``[B·H·D, N]``, and the softmax scale that keeps the scores' spread alike."""
    if qk == "int8":
        q, k = (torch.randint(-127, 128, (HEADS * n, d), device=device, dtype=torch.int8)
                for _ in range(2))
        qk_scale = 1.0 / (math.sqrt(d) * 73.3 ** 2)  # 73.3: the std of uniform [−127, 127]
    else:
        q, k = (torch.randn(HEADS * n, d, device=device).to(torch.float8_e4m3fn)
                for _ in range(2))
        qk_scale = 1.0 / math.sqrt(d)
    v = torch.randn(HEADS * n, d, device=device).to(torch.float8_e4m3fn)
    vt = v.view(HEADS, n, d).transpose(1, 2).contiguous().view(HEADS * d, n)
    return q, k, v, vt, qk_scale


def _measure(qk: str, d: int, n: int, configs, with_reference: bool, variants) -> None:
    """Worker: time ``configs`` (each plain, then specialized, as ``variants`` lists) on one
    shape, printing one JSON row per variant as soon as it is measured."""
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8,
                                                                     device="cuda"))
    q, k, v, vt, qk_scale = inputs(n, d, qk)
    ref = reference(q, k, v, n, d, qk_scale) if with_reference else None
    for cfg in configs:
        plain = None
        for warp_specialize in variants:
            row = {"qk": qk, "n": n, "d": d, "config": list(cfg),
                   "warp_specialize": warp_specialize}
            try:
                out = _run(q, k, vt, n, d, cfg, warp_specialize, qk_scale)
                torch.cuda.synchronize()  # a fault shows here, on the config that caused it
                ms = triton.testing.do_bench(
                    lambda: _run(q, k, vt, n, d, cfg, warp_specialize, qk_scale), rep=200)
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


def _rows_of_shape(qk: str, d: int, n: int, with_reference: bool, configs,
                   variants) -> list[dict]:
    """Every config's rows for one shape, each worker in its own process: a kernel that
    faults (an illegal address loses the CUDA context) is recorded and the next worker
    goes on with the configs after it."""
    planned = [(tuple(cfg), ws) for cfg in configs for ws in variants]
    rows: list[dict] = []
    while len(rows) < len(planned):
        done = {(tuple(r["config"]), r["warp_specialize"]) for r in rows}
        todo = [cfg for cfg in configs if (tuple(cfg), variants[-1]) not in done]
        spec = json.dumps({"qk": qk, "d": d, "n": n, "configs": todo,
                           "reference": with_reference, "variants": variants})
        proc = subprocess.run([sys.executable, __file__, "--worker", spec], capture_output=True,
                              text=True)
        new = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        new = [r for r in new if (tuple(r["config"]), r["warp_specialize"]) not in done]
        rows += new
        for row in new:
            checks = "".join(f"  {name} {row[name]:.4g}" for name in
                             ("tops", "rel_l1", "max_diff_to_plain") if name in row)
            print(f"{qk} N={n} D={d} {tuple(row['config'])} warp_specialize="
                  f"{row['warp_specialize']:d}:{checks}  {row.get('error', '')}", flush=True)
        if not new:  # the worker reported nothing new (it died at once): give up on the rest
            tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
            rows += [{"qk": qk, "n": n, "d": d, "config": list(cfg), "warp_specialize": ws,
                      "error": f"worker died: {tail[:200]}"}
                     for cfg, ws in planned if (cfg, ws) not in done]
            print(qk, n, d, "worker died:", tail, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="loop_ceiling.json")
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--qk", nargs="+", choices=["fp8", "int8"], default=["fp8", "int8"])
    parser.add_argument("--configs", nargs="+", default=["x".join(map(str, c)) for c in CONFIGS],
                        help="launch configs as BLOCK_MxBLOCK_NxWARPSxSTAGES, e.g. 64x128x4x2")
    parser.add_argument("--plain-only", action="store_true",
                        help="time the loop without warp specialization only")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one shape's configs
    args = parser.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        _measure(spec["qk"], spec["d"], spec["n"], [tuple(c) for c in spec["configs"]],
                 spec["reference"], spec["variants"])
        return
    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs]
    variants = [False] if args.plain_only else [False, True]
    rows = []
    for qk, d, n in ((qk, d, n) for qk in args.qk for d in args.head_dims for n in args.seq):
        rows += _rows_of_shape(qk, d, n, n == min(args.seq), configs, variants)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "triton": triton.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
