"""Tier 2 (the Gluon kernel) against tier 1 and FlashAttention-3: correctness, then speed.

Run on the GPU machine from the repository root (FA3 from the ``fa3-fwd`` wheel when
importable; see benchmarks/README.md for carrying wheels)::

    PYTHONPATH=. python3 benchmarks/tiers.py --out $OUT/tiers.json

Correctness: for each case (odd lengths, GQA, Lq ≠ Lkv, D = 64 / 128, causal or not) the
preset's operands (``--preset``: fp8 or sage2_8b) are prepared once and run by both tiers; printed: each tier's rel-L1
against float64 attention, the largest difference between the tiers, and tier 2's
log-sum-exp against float64. Speed (B=4, H=32, bf16; TOPS = 4·B·H·N²·D / t, halved when
causal; t = median of interleaved rounds of ``do_bench`` medians): the attention kernel
alone for both tiers (operands prepared outside the timing; ``--tier2-configs`` adds tier-2
tile variants), qattn's eager call with its quantizers (the tier :mod:`.tiers` picks),
FA3's FP8 kernel on inputs quantized per head outside the timing, FA3 bf16 and SDPA cuDNN.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

import qattn_compile
from attention import fa3_fp8_inputs  # benchmarks/, the script's own directory
from qattn_compile.kernels.launch import prepare_attention
from qattn_compile.kernels.tiers import Tier2Config

CASES = [  # (B, Hq, Hkv, Lq, Lkv, D, causal)
    (1, 2, 2, 4096, 4096, 128, False),
    (1, 2, 2, 4096, 4096, 128, True),
    (2, 4, 2, 3001, 3001, 128, True),
    (2, 4, 1, 2177, 4099, 64, False),
    (1, 3, 3, 4099, 2177, 64, True),
    (1, 2, 2, 2048, 2048, 64, True),
]


def exact(q, k, v, causal):
    """float64 attention and its natural-log log-sum-exp (top-left causal, GQA by repeat)."""
    g = q.shape[1] // k.shape[1]
    q64, k64, v64 = q.double(), k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = q64 @ k64.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        lq, lkv = s.shape[-2:]
        s = s.masked_fill(torch.ones(lq, lkv, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v64, torch.logsumexp(s, -1)


def rel_l1(out, ref):
    return ((out.double() - ref).abs().sum() / ref.abs().sum()).item()


def check(cases, preset) -> list[dict]:
    rows = []
    for bsz, hq, hkv, lq, lkv, d, causal in cases:
        q = torch.randn(bsz, hq, lq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(bsz, hkv, lkv, d, device="cuda", dtype=torch.bfloat16)
        k[..., 3] += 8.0  # a K channel outlier
        v = torch.randn(bsz, hkv, lkv, d, device="cuda", dtype=torch.bfloat16)
        ref, ref_lse = exact(q, k, v, causal)
        call1 = prepare_attention(q, k, v, None, causal, None, preset, None, tier="triton")
        call2 = prepare_attention(q, k, v, None, causal, None, preset, None, tier="gluon")
        out1 = call1.run()
        lse = torch.empty(bsz, hq, lq, device="cuda", dtype=torch.float32) if preset == "fp8" else None
        out2 = call2.run(lse=lse)
        row = {"case": [bsz, hq, hkv, lq, lkv, d, causal], "tier1_rel_l1": rel_l1(out1, ref),
               "tier2_rel_l1": rel_l1(out2, ref),
               "max_tier_diff": (out1.float() - out2.float()).abs().max().item(),
               "lse_max_err": None if lse is None else (lse.double() - ref_lse).abs().max().item(),
               "tier2_nan": bool(out2.isnan().any())}
        print(row, flush=True)
        rows.append(row)
    return rows


def _fa3():
    try:
        from fa3_fwd_interface import flash_attn_func
    except ImportError as exc:
        print(f"FA3 not importable: {exc}")
        return None
    return flash_attn_func


def contenders(q, k, v, causal, tier2_configs, fa3, preset, options) -> dict:
    """name -> zero-argument callable, every input prepared outside it."""
    runs = {}
    call1 = prepare_attention(q, k, v, None, causal, None, preset, options, tier="triton")
    runs[f"tier1 {preset} kernel"] = call1.run
    for name, cfg in tier2_configs.items():
        call2 = prepare_attention(q, k, v, None, causal, None, preset, options, tier="gluon")
        if cfg is not None:
            call2.tier2 = cfg
        runs[f"tier2 {preset} kernel {name}"] = call2.run
    runs[f"qattn {preset} eager"] = lambda: qattn_compile.attention(q, k, v, is_causal=causal,
                                                                    preset=preset, **options)
    runs["qattn int_flash eager"] = lambda: qattn_compile.attention(q, k, v, is_causal=causal,
                                                                    preset="int_flash")

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    runs["sdpa cudnn"] = cudnn
    if fa3 is not None:
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        runs["fa3 bf16"] = lambda: fa3(qt, kt, vt, causal=causal)
        q8, k8, v8, descale = fa3_fp8_inputs(qt, kt, vt)
        runs["fa3 fp8 kernel"] = lambda: fa3(q8, k8, v8, causal=causal, q_descale=descale[0],
                                             k_descale=descale[1], v_descale=descale[2])
    return runs


def speed(shapes, rounds, tier2_configs, preset, options) -> list[dict]:
    fa3 = _fa3()
    rows = []
    for (bsz, heads, n, d), causal in shapes:
        q, k, v = (torch.randn(bsz, heads, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        runs = contenders(q, k, v, causal, tier2_configs, fa3, preset, options)
        times = {name: [] for name in runs}
        for _ in range(rounds):
            for name, fn in runs.items():
                try:
                    times[name].append(triton.testing.do_bench(fn, rep=100, return_mode="median"))
                except Exception as exc:  # a contender that fails is a result too
                    times[name].append(float("nan"))
                    print(f"{name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        flops = 4 * bsz * heads * n * n * d / (2 if causal else 1)
        for name, ts in times.items():
            ms = statistics.median(ts)
            row = {"shape": [bsz, heads, n, d], "causal": causal, "name": name, "ms": ms,
                   "tops": flops / ms / 1e9, "rounds_ms": ts}
            rows.append(row)
            print(f"N={n} D={d} causal={int(causal)} {name:28s} {row['tops']:7.1f} TOPS  "
                  f"({ms:.3f} ms)", flush=True)
        del q, k, v, runs
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="tiers.json")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seq", type=int, nargs="+", default=[16384, 4096])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--batch-heads", type=int, nargs=2, default=[4, 32])
    parser.add_argument("--tier2-configs", nargs="*", default=[],
                        help="NAME=stages,consumer_regs[,block_n] tile variants of tier 2 "
                             "(none: its table's)")
    parser.add_argument("--preset", default="fp8", choices=["fp8", "sage2_8b"])
    parser.add_argument("--options", default="{}", help="the preset's options as JSON")
    parser.add_argument("--skip-check", action="store_true")
    args = parser.parse_args()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__}
    if not args.skip_check:
        result["check"] = check(CASES, args.preset)
    bsz, heads = args.batch_heads
    shapes = list(itertools.product([(bsz, heads, n, d) for n in args.seq for d in args.head_dims],
                                    [False, True]))
    configs = {}
    for spec in args.tier2_configs:
        name, values = spec.split("=")
        stages, regs, *block_n = (int(x) for x in values.split(","))
        configs[name] = Tier2Config(stages=stages, consumer_regs=regs, block_n=(block_n or [128])[0])
    if not configs:
        configs["table"] = None
    result["speed"] = speed(shapes, args.rounds, configs, args.preset, json.loads(args.options))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
