"""End-to-end prefill of a Llama-3.2-1B-shaped model: eager vs Inductor vs backend="qattn".

Run on the GPU machine from the repository root::

    PYTHONPATH=. python3 benchmarks/e2e.py --out $OUT/e2e.json

The model: hidden 2048, 32 query / 8 key-value heads, head dim 64, MLP 8192, ``--layers``
decoder layers (8 by default, as in issue #8's anchor), random bf16 weights, batch 1, run as
``model.model(input_ids)`` (no LM head). Reported per sequence length: median latency
(``triton.testing.do_bench``), peak memory, and the cosine of the last hidden state against
eager. ``--options '{"pv": "fp16"}'`` passes preset options; mode ``qattn-autotune`` is qattn
with the backend option ``autotune`` (tiles timed at compile time), ``qattn-graphs`` qattn with
``mode="reduce-overhead"`` (CUDA graphs: no gaps between kernels for host launch work);
``--profile`` adds, per mode at the longest length, the torch.profiler table of one call (GPU
time per kernel).
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import torch
import triton.testing
from transformers import LlamaConfig, LlamaForCausalLM

import qattn_compile
from qattn_compile import _compat
from qattn_compile.metrics import compare

log = logging.getLogger("benchmarks.e2e")


def build_model(layers: int) -> torch.nn.Module:
    cfg = LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=65536,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval().model


def measure(fn, ids) -> dict:
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        # a copy: under CUDA graphs the next replay overwrites the graph's output buffer
        out = fn(input_ids=ids, use_cache=False).last_hidden_state.clone()
        ms = triton.testing.do_bench(
            lambda: fn(input_ids=ids, use_cache=False), warmup=1, rep=5, return_mode="median"
        )
    return {"ms": ms, "peak_gib": torch.cuda.max_memory_allocated() / 2**30}, out


def profile_table(fn, ids) -> str:
    """GPU time per kernel of one prefill call (after the measured warm-up)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(input_ids=ids, use_cache=False)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="e2e.json")
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--preset", default="sage2_8b")
    parser.add_argument("--options", default="{}", help="preset options as JSON")
    parser.add_argument("--modes", nargs="+", default=["eager", "inductor", "qattn"],
                        choices=["eager", "inductor", "qattn", "qattn-autotune", "qattn-graphs"])
    parser.add_argument("--profile", action="store_true", help="profile each mode at max --seq")
    args = parser.parse_args()
    options = json.loads(args.options)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model = build_model(args.layers)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d"), "preset": args.preset, "options": options,
               "rows": []}
    for n in args.seq:
        ids = torch.randint(0, 32000, (1, n), device="cuda")
        reference = None
        for mode in args.modes:
            _compat.reset_dynamo()
            if mode == "eager":
                fn = model
            elif mode == "inductor":
                fn = torch.compile(model)
            else:
                graphs = mode == "qattn-graphs"
                be = qattn_compile.backend({"qattn": 1, "default": args.preset,
                                            "default_options": options},
                                           autotune=mode == "qattn-autotune",
                                           mode="reduce-overhead" if graphs else None)
                fn = torch.compile(model, backend=be)
            row = {"mode": mode, "n": n}
            try:
                stats, out = measure(fn, ids)
                row.update(stats)
                if reference is None:
                    reference = out
                row["cos_vs_first"] = compare(out, reference)["cos"]
                if args.profile and n == max(args.seq):
                    row["profile"] = profile_table(fn, ids)
                    log.info("profile %s N=%d\n%s", mode, n, row["profile"])
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            results["rows"].append(row)
            log.info("N=%-6d %-9s %s", n, mode, row.get("error") or f"{row['ms']:8.2f} ms  peak {row['peak_gib']:.1f} GiB  cos {row['cos_vs_first']:.5f}")
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
