"""Sweep the attention kernel's launch configs on the GPU: the data behind kernels/heuristics.py.

Usage (GPU machine, repository root)::

    PYTHONPATH=. python benchmarks/probes/sweep.py --out sweep.json [--n 8192] [--dims 128 64]
        [--causal no|yes|both] [--presets ...] [--configs ...] [--options '{"pv": "fp16"}']
        [--graph]

For every preset and head dim, each candidate :class:`AttentionConfig` (tile, warps, stages,
TMA descriptors) runs the attention kernel alone on prepared operands
(B=4, H=32, bf16 N(0,1) inputs): its output is compared with the pointer-load baseline
config (max abs difference; TMA must not change a bit) and its median ``do_bench`` time is
converted to TOPS = 4·B·H·N²·D / t (halved when causal). ``--graph`` times as the
autotuner does instead (:func:`~qattn_compile.kernels.autotune.time_call`: CUDA-graph
replays, L2 cleared before each), for short sequences, where the host's launch cost of an
eager call exceeds the kernel's time. A config that fails to compile or run is recorded
with its error and the sweep goes on. Prints one table per (D, causal).
"""

from __future__ import annotations

import argparse
import json
import traceback

import torch
import triton
from triton.testing import do_bench

from qattn_compile.kernels import autotune, prepare_attention
from qattn_compile.kernels.heuristics import AttentionConfig, attention_config

PRESETS = ("flash", "int_flash", "fmha_int8", "sage2_8b", "sage2_4b", "turbo", "fp8")
CANDIDATES = {
    "ptr 128x64 w8 s3": (128, 64, 8, 3, False),
    "ptr 128x128 w8 s2": (128, 128, 8, 2, False),
    "tma 128x64 w8 s3": (128, 64, 8, 3, True),
    "tma 128x128 w8 s2": (128, 128, 8, 2, True),
    "ptr 128x64 w4 s3": (128, 64, 4, 3, False),
    "ptr 64x64 w4 s3": (64, 64, 4, 3, False),
    "tma 128x64 w4 s3": (128, 64, 4, 3, True),
    "tma 128x128 w8 s3": (128, 128, 8, 3, True),
    "tma 128x128 w8 s4": (128, 128, 8, 4, True),
    "tma 64x128 w4 s2": (64, 128, 4, 2, True),
    "tma 64x128 w4 s3": (64, 128, 4, 3, True),
    "tma 64x64 w4 s3": (64, 64, 4, 3, True),
    "tma 64x64 w4 s4": (64, 64, 4, 4, True),
    "tma 64x128 w4 s2 r168": (64, 128, 4, 2, True, 168),
    "tma 64x128 w4 s3 r168": (64, 128, 4, 3, True, 168),
    "tma 64x128 w4 s3 r128": (64, 128, 4, 3, True, 128),
    "tma 64x256 w4 s1": (64, 256, 4, 1, True),
    "tma 64x256 w4 s2": (64, 256, 4, 2, True),
    "tma 128x256 w8 s2": (128, 256, 8, 2, True),
}
"""name -> (block_m, block_n, num_warps, num_stages, tma[, maxnreg]); ``rN``: at most N registers."""


def run_one(preset, options, q, k, v, causal, cfg, graph: bool) -> tuple[torch.Tensor, float]:
    """(output, median ms) of the attention kernel alone with launch config ``cfg``."""
    call = prepare_attention(q, k, v, None, causal, None, preset, options, config=cfg)
    out = call.run()
    if graph:
        return out, autotune.time_call(call.run, q.device)
    return out, do_bench(call.run, warmup=25, rep=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--dims", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--presets", nargs="+", default=list(PRESETS))
    parser.add_argument("--causal", default="no", help="no, yes or both")
    parser.add_argument("--configs", nargs="+", default=list(CANDIDATES), choices=CANDIDATES,
                        help="candidate names (the first is the baseline outputs compare to)")
    parser.add_argument("--options", default="{}", help="preset options as JSON (all presets)")
    parser.add_argument("--graph", action="store_true",
                        help="time CUDA-graph replays with a cold L2 (short sequences)")
    args = parser.parse_args()
    options = json.loads(args.options) or None
    b, h, n = 4, 32, args.n
    causal_modes = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    rows = []
    meta = {"torch": torch.__version__, "triton": triton.__version__,
            "device": torch.cuda.get_device_name(), "b": b, "h": h, "n": n, "options": options,
            "timing": "cuda graph, cold L2" if args.graph else "do_bench of the eager call"}
    for d in args.dims:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, h, n, d, device="cuda", generator=gen, dtype=torch.bfloat16)
                   for _ in range(3))
        for causal in causal_modes:
            for preset in args.presets:
                default = attention_config(preset, d, q.device, q.dtype, keys=n,
                                           unmasked=not causal, causal_only=causal,
                                           register_cap=True)
                base_out = None
                for name in args.configs:
                    bm, bn, warps, stages, tma, *cap = CANDIDATES[name]
                    cfg = AttentionConfig(bm, bn, warps, stages, tma=tma,
                                          maxnreg=cap[0] if cap else None)
                    row = {"d": d, "causal": causal, "preset": preset, "config": name,
                           "is_default": cfg == default}
                    try:
                        out, ms = run_one(preset, options, q, k, v, causal, cfg, args.graph)
                        if base_out is None:
                            base_out = out
                        row["max_diff_vs_first"] = (out.float() - base_out.float()).abs().max().item()
                        row["ms"] = ms
                        row["tops"] = 4 * b * h * n * n * d / ms / 1e9 / (2 if causal else 1)
                    except Exception as exc:  # noqa: BLE001 - a failing config is a result
                        row["error"] = f"{type(exc).__name__}: {exc}"[:400]
                        traceback.print_exc()
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    with open(args.out, "w") as f:
                        json.dump({"meta": meta, "rows": rows}, f, indent=1)
                print(f"default for {preset} D={d}: {default}", flush=True)
    names = args.configs
    for d in args.dims:
        for causal in causal_modes:
            print(f"\nD={d} causal={causal} N={n}: TOPS (kernel only)")
            print("preset".ljust(10) + "".join(x.rjust(22) for x in names))
            for preset in args.presets:
                cells = []
                for name in names:
                    r = next((r for r in rows if (r["d"], r["causal"], r["preset"], r["config"])
                              == (d, causal, preset, name)), {})
                    cells.append(f"{r['tops']:.0f}" if "tops" in r else "err")
                print(preset.ljust(10) + "".join(c.rjust(22) for c in cells))


if __name__ == "__main__":
    main()
