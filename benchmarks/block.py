"""One Llama attention block at short context: qattn (quantizers fused) vs SDPA cuDNN.

Run on the GPU machine from the repository root::

    PYTHONPATH=. python3 benchmarks/block.py --out $OUT/block.json

The block is transformers' ``LlamaAttention`` (Q/K/V projections, RoPE, causal attention,
output projection) of a Llama-3.2-1B-shaped layer (hidden 2048, 32/8 heads, head dim 64) and
of a Llama-3-8B-shaped one (hidden 4096, 32/8 heads, head dim 128), random bf16 weights,
``--batch`` × ``--seq`` tokens (4 × 1024 by default), no attention mask (transformers then
calls SDPA with ``is_causal``). Modes:

- ``eager-cudnn``: the block as is, SDPA restricted to the cuDNN backend;
- ``inductor-cudnn``: ``torch.compile`` (Inductor) of the block, SDPA restricted to cuDNN;
- ``inductor``: ``torch.compile`` with SDPA's own backend choice;
- ``qattn:<preset>[:key=value…]``: ``backend="qattn"`` with the preset (and those options)
  on the site (the quantizers are Inductor ops fused with RoPE, the attention kernel
  inlined); ``--autotune`` adds the same with the ``autotune`` option;
- ``qattn:fmha_int8:static`` (``--static``): ``fmha_int8`` with ``scales: static``, α
  calibrated on the block's own input (amax per head of the Q, K, V that the eager block
  hands SDPA): Q and K quantize pointwise with a constant scale, so Inductor writes RoPE
  and the rounding in one kernel per operand and no amax pass remains.

Each mode is timed as the autotuner times a kernel (:func:`qattn_compile.kernels.autotune.
time_call`: the median of ``triton.testing.do_bench`` over replays of a CUDA graph of one call,
L2 cleared before each), so launch overhead, which differs between eager and compiled code,
is out of the comparison. Every mode is compiled and captured first, then timed ``--rounds``
times in turn (each round times all modes), so that a drift of the clocks or the power cap
during the run reaches every mode alike; reported: each round, their median, and the cosine
to ``eager-cudnn``. ``--profile`` adds the GPU time per kernel of one call.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import time

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

import qattn_compile
from qattn_compile import _compat
from qattn_compile.kernels import autotune
from qattn_compile.metrics import compare

log = logging.getLogger("benchmarks.block")
SHAPES = {"1b": (2048, 64), "8b": (4096, 128)}  # hidden size, head dim (32 query / 8 kv heads)


def build_block(shape: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    hidden, head_dim = SHAPES[shape]
    cfg = LlamaConfig(hidden_size=hidden, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=head_dim, max_position_embeddings=65536, attn_implementation="sdpa")
    torch.manual_seed(0)
    block = LlamaAttention(cfg, layer_idx=0).to("cuda", torch.bfloat16).eval()
    return block, LlamaRotaryEmbedding(cfg).to("cuda")


def calibrated_scales(block: torch.nn.Module, hidden, cos_sin) -> dict:
    """``static_scales`` of ``fmha_int8`` for this block and input: amax per head of the
    Q ``[B, Hq, L, D]``, K and V ``[B, Hkv, L, D]`` that one eager call passes to SDPA."""
    seen = {}
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def record(q, k, v, *args, **kwargs):
        for name, x in zip("qkv", (q, k, v)):
            seen[name] = x.abs().amax(dim=(0, 2, 3)).float().tolist()
        return sdpa(q, k, v, *args, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = record
    try:
        with torch.no_grad():
            block(hidden, cos_sin, None)
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
    if len(seen) != 3:
        raise RuntimeError("the eager block did not call scaled_dot_product_attention")
    return seen


def compiled(mode: str, block: torch.nn.Module, hidden, cos_sin):
    """The block as ``mode`` runs it (see the module docstring)."""
    if mode.startswith("eager"):
        return block
    if mode.startswith("inductor"):
        return torch.compile(block)
    _, preset, *flags = mode.split(":")
    options = dict(flag.split("=", 1) for flag in flags if "=" in flag)
    if "static" in flags:
        alphas = calibrated_scales(block, hidden, cos_sin)
        options.update(scales="static", static_scales=alphas)
    policy = {"qattn": 1, "default": preset, "default_options": options}
    return torch.compile(block, backend=qattn_compile.backend(policy, autotune="autotune" in flags))


def profile_table(fn) -> str:
    """GPU time per kernel of one call (after the timed replays)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="block.json")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--presets", nargs="+", default=["sage2_8b", "int_flash", "fp8"],
                        help="presets, each optionally with options: fp8:granularity=block")
    parser.add_argument("--autotune", action="store_true", help="also time each preset autotuned")
    parser.add_argument("--static", action="store_true",
                        help="also time fmha_int8 with static scales calibrated on the input")
    parser.add_argument("--profile", action="store_true", help="log each mode's GPU time per kernel")
    parser.add_argument("--rounds", type=int, default=3,
                        help="times each mode is timed, all modes in turn (the median is reported)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "triton": triton.__version__, "date": time.strftime("%Y-%m-%d"),
               "batch": args.batch, "seq": args.seq, "rows": []}
    modes = ["eager-cudnn", "inductor-cudnn", "inductor"] + [f"qattn:{p}" for p in args.presets]
    if args.static:
        modes.append("qattn:fmha_int8:static")
    if args.autotune:
        modes += [f"qattn:{p}:autotune" for p in args.presets]
        modes += ["qattn:fmha_int8:static:autotune"] if args.static else []
    timed = []  # (row, replay) of each mode that ran, timed in rounds below
    for shape in args.shapes:
        block, rope = build_block(shape)
        hidden = torch.randn(args.batch, args.seq, SHAPES[shape][0], device="cuda", dtype=torch.bfloat16)
        positions = torch.arange(args.seq, device="cuda")[None].expand(args.batch, -1)
        cos_sin = rope(hidden, positions)
        reference = None
        for mode in modes:
            _compat.reset_dynamo()
            row = {"shape": shape, "mode": mode}
            results["rows"].append(row)
            cudnn = mode.endswith("cudnn")
            backend = sdpa_kernel(SDPBackend.CUDNN_ATTENTION) if cudnn else contextlib.nullcontext()
            try:
                fn = compiled(mode, block, hidden, cos_sin)
                with torch.no_grad(), backend:
                    call = lambda: fn(hidden, cos_sin, None)[0]  # noqa: E731
                    out = call()
                    replay = autotune.capture(call, hidden.device)
                    if args.profile:
                        row["profile"] = profile_table(call)
                        log.info("profile %s %s\n%s", shape, mode, row["profile"])
                reference = out if reference is None else reference
                row["cos_vs_eager_cudnn"] = compare(out, reference)["cos"]
                timed.append((row, replay))
            except Exception as exc:  # reported in the table; the other modes still run
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                log.info("%s %s: %s", shape, mode, row["error"])
    # rounds over all modes, so that a clock or power drift during the run reaches every mode
    for _ in range(args.rounds):
        for row, replay in timed:
            ms = autotune.time_captured(replay, torch.device("cuda"))
            row.setdefault("ms_rounds", []).append(ms)
    for row, _ in timed:
        row["ms"] = statistics.median(row["ms_rounds"])
        rounds = " / ".join(f"{ms * 1e3:.1f}" for ms in row["ms_rounds"])
        log.info("%s B=%d N=%d %-34s %8.1f us (rounds %s)  cos %.5f", row["shape"], args.batch,
                 args.seq, row["mode"], row["ms"] * 1e3, rounds, row["cos_vs_eager_cudnn"])
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
