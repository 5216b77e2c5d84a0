"""Attention speed and accuracy on the GPU: every qattn preset next to the peers.

Run on the GPU machine from the repository root::

    PYTHONPATH=. python3 benchmarks/attention.py --out $OUT/attention.json

TOPS = 4·B·H·N²·D / t (halved for causal), t = median of ``triton.testing.do_bench``
(with ``--rounds R``: every contender is timed R times per shape, in turns, and t is the
median of the R medians; the JSON keeps each round's time, and the SM clock, power and
temperature ``nvidia-smi`` reads right after it);
qattn's time includes quantization (the eager functional API end to end). By default each
call is launched from Python, so short sequences time the host's launch work too (qattn's
eager call launches 8–10 Triton kernels); ``--cuda-graph`` times replays of one call captured
in a CUDA graph instead (as the autotuner and ``benchmarks/block.py`` do): the GPU time of
the same kernels, without the host's launch work (a compiled model's numbers, with its
quantizers fused into their producers, are ``benchmarks/block.py``'s). Accuracy is
measured on the first batch element and 4 heads against fp32 SDPA (math backend) on the
same inputs: cosine, relative L1, RMSE. Peers: SDPA flash, SDPA cuDNN, FlexAttention,
SageAttention 1.0.6 and FlashAttention-3 (the ``fa3-fwd`` wheel: bf16, and FP8 with its
per-head quantization timed; its kernel alone on pre-quantized inputs is
``benchmarks/tiers.py``'s) when importable. A failing entry is recorded with its error and the
run goes on.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import time

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

import qattn_compile
from qattn_compile.kernels.autotune import time_call
from qattn_compile.metrics import compare
from qattn_compile.presets import QUANTIZED_PRESETS

log = logging.getLogger("benchmarks.attention")


def _sdpa(backend):
    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def _flex():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # One compiled graph per shape: the run visits ~24 shapes (accuracy slices and full
    # batches), past dynamo's default recompile limit of 8, after which it would run the
    # unfused flex_attention (slow; its [B, H, N, N] scores do not fit at 16K). Static shapes,
    # as a model compiled for one length would have.
    torch._dynamo.config.recompile_limit = 64
    compiled = torch.compile(flex_attention, dynamic=False)
    masks = {}

    def run(q, k, v, causal):
        if not causal:
            return compiled(q, k, v)
        key = (q.shape[-2], k.shape[-2])
        if key not in masks:
            masks[key] = create_block_mask(
                lambda b, h, qi, ki: qi >= ki, None, None, q.shape[-2], k.shape[-2]
            )
        return compiled(q, k, v, block_mask=masks[key])

    return run


def _sageattention():
    from sageattention import sageattn

    return lambda q, k, v, causal: sageattn(q, k, v, is_causal=causal)


def fa3_fp8_inputs(q, k, v):
    """Q, K, V ``[B, N, H, D]`` in e4m3 with one scale per (batch, kv head) (FA3's descale
    layout ``[B, Hkv]``; Q's over each kv head's group of query heads), and those scales."""
    bsz, hq, hkv = q.shape[0], q.shape[2], k.shape[2]
    q_amax = q.abs().amax(dim=(1, 3)).float().view(bsz, hkv, hq // hkv).amax(-1)
    amaxes = [q_amax, k.abs().amax(dim=(1, 3)).float(), v.abs().amax(dim=(1, 3)).float()]
    scales = [a.clamp_min(1e-6) / 448 for a in amaxes]
    per_head = [scales[0].repeat_interleave(hq // hkv, 1), scales[1], scales[2]]
    quantized = [(x / s[:, None, :, None]).to(torch.float8_e4m3fn) for x, s in zip((q, k, v), per_head)]
    return (*quantized, [s.contiguous() for s in scales])


def _fa3(fp8: bool):
    """FlashAttention-3 (the ``fa3-fwd`` wheel) on [B, N, H, D] views; ``fp8``: its FP8
    kernel with the per-(batch, head) quantization of Q, K, V timed with it."""
    from fa3_fwd_interface import flash_attn_func

    def run(q, k, v, causal):
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        if not fp8:
            return flash_attn_func(qt, kt, vt, causal=causal).transpose(1, 2)
        q8, k8, v8, descales = fa3_fp8_inputs(qt, kt, vt)
        out = flash_attn_func(q8, k8, v8, causal=causal, q_descale=descales[0],
                              k_descale=descales[1], v_descale=descales[2])
        return out.transpose(1, 2)

    return run


def _qattn(preset):
    return lambda q, k, v, causal: qattn_compile.attention(q, k, v, is_causal=causal, preset=preset)


def contenders(selected: list[str] | None) -> dict:
    table = {
        "sdpa_flash": lambda: _sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa_cudnn": lambda: _sdpa(SDPBackend.CUDNN_ATTENTION),
        "flex": _flex,
        "sageattn_1.0.6": _sageattention,
        "fa3_bf16": lambda: _fa3(False),
        "fa3_fp8": lambda: _fa3(True),
        **{f"qattn_{p}": (lambda p=p: _qattn(p)) for p in ("flash", *QUANTIZED_PRESETS)},
    }
    return {k: v for k, v in table.items() if not selected or k in selected}


def accuracy(fn, q, k, v, causal) -> dict:
    """Errors on batch 0, heads 0..3 against fp32 SDPA math on the same inputs."""
    qs, ks, vs = (t[:1, :4].contiguous() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(qs.float(), ks.float(), vs.float(), is_causal=causal)
    return compare(fn(qs, ks, vs, causal), ref)


_GPU_STATE_FIELDS = ("clocks.sm", "power.draw", "temperature.gpu")


def gpu_state() -> dict:
    """SM clock (MHz), power (W) and temperature (°C) of GPU 0 from ``nvidia-smi`` right now,
    or {} where it cannot be read."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "-i", "0", f"--query-gpu={','.join(_GPU_STATE_FIELDS)}",
             "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True).stdout
        return dict(zip(("sm_mhz", "watts", "celsius"), (float(x) for x in out.split(","))))
    except (OSError, subprocess.SubprocessError, ValueError):
        return {}


def time_one(fn, q, k, v, causal, cuda_graph: bool) -> float:
    """Milliseconds per call: the median of ``do_bench`` (or of CUDA-graph replays)."""
    call = lambda: fn(q, k, v, causal)  # noqa: E731
    if cuda_graph:
        return time_call(call, q.device)
    return triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")


def timing_row(round_ms: list[float], shape: tuple[int, ...], causal: bool) -> dict:
    """``ms`` (median over rounds), ``tops`` from it, and each round's time."""
    b, h, n, d = shape
    ms = statistics.median(round_ms)
    flops = 4 * b * h * n * n * d / (2 if causal else 1)
    return {"ms": ms, "tops": flops / ms / 1e9, "ms_rounds": round_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="attention.json")
    parser.add_argument("--seq", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--only", nargs="*", help="contender names to run")
    parser.add_argument("--k-outliers", action="store_true", help="add channel outliers to K")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="time CUDA-graph replays of one call (GPU time, no host launch work)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time every contender this many times per shape, in turns, and "
                             "report the median (clock drift then hits all contenders alike)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "timing": "cuda-graph replays" if args.cuda_graph else "eager calls",
        "rounds": args.rounds,
        "rows": [],
    }
    runners = {}
    for name, make in contenders(args.only).items():
        try:
            runners[name] = make()
        except Exception as exc:  # a missing peer must not stop the run
            results["rows"].append({"name": name, "error": f"{type(exc).__name__}: {exc}"})
    for d in args.head_dims:
        for causal in (False, True):
            for n in args.seq:
                gen = torch.Generator(device="cuda").manual_seed(n + d)
                shape = (args.batch, args.heads, n, d)
                q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
                if args.k_outliers:
                    k[..., :: max(d // 8, 1)] += 8.0
                rows = {name: {"name": name, "d": d, "causal": causal, "n": n, "gpu_after": []}
                        for name in runners}
                round_ms: dict[str, list[float]] = {name: [] for name in runners}
                for turn in range(args.rounds):
                    for name, fn in runners.items():
                        row = rows[name]
                        if "error" in row:
                            continue
                        try:
                            if turn == 0:
                                row.update(accuracy(fn, q, k, v, causal))
                            round_ms[name].append(time_one(fn, q, k, v, causal, args.cuda_graph))
                            row["gpu_after"].append(gpu_state())
                        except Exception as exc:
                            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                for name, row in rows.items():
                    if "error" not in row:
                        row.update(timing_row(round_ms[name], shape, causal))
                    results["rows"].append(row)
                    log.info(
                        "%-18s D=%-3d causal=%-5s N=%-5d %s", name, d, causal, n,
                        row.get("error") or f"{row['tops']:7.1f} TOPS  rel-L1 {row['rel_l1']:.4f}  cos {row['cos']:.5f}",
                    )
                del q, k, v
                torch.cuda.empty_cache()
                with open(args.out, "w") as f:  # after every shape: a cut-off run keeps its rows
                    json.dump(results, f, indent=2)
    _plot(results, args.out.rsplit(".", 1)[0] + ".png")


def _plot(results: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib not installed: no plot")
        return
    rows = [r for r in results["rows"] if "tops" in r]
    panels = sorted({(r["d"], r["causal"]) for r in rows})
    names = sorted({r["name"] for r in rows})
    # one colour per contender in every panel (tab20: eleven contenders overflow tab10);
    # the peers dashed, qattn's presets solid
    colours = plt.get_cmap("tab20")
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (d, causal) in zip(axes[0], panels):
        for i, name in enumerate(names):
            pts = sorted((r["n"], r["tops"]) for r in rows if r["name"] == name and r["d"] == d and r["causal"] == causal)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name,
                        color=colours(i % colours.N),
                        linestyle="-" if name.startswith("qattn_") else "--")
        ax.set_xscale("log", base=2)
        ax.set_title(f"D={d} causal={causal} ({results['timing']})")
        ax.set_xlabel("N")
        ax.set_ylabel("TOPS")
    axes[0][-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")


if __name__ == "__main__":
    main()
