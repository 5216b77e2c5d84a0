"""FlashQ decode attention vs SDPA on a bf16 cache, KV bytes per token, greedy agreement.

Run on the GPU machine from the repository root::

    PYTHONPATH=. python3 benchmarks/decode.py --out $OUT/decode.json

Decode attention (q_len 1, GQA) at the DESIGN §6 anchors: B=8 × 32K tokens and B=1 × 128K,
32 query / 8 kv heads, D=128. Times are medians of ``triton.testing.do_bench`` (launches
included) and of a CUDA graph replay of the same call (launch overhead excluded, what a
compiled ``reduce-overhead`` decode step sees). SDPA reads a bf16 cache with ``enable_gqa``
on each backend that accepts it. FlashQ runs the Triton kernel on a cache filled by
``FlashQLayer`` (prefill of the random K/V, one decode token) for INT4 on every head, the
2/4 mix (half the kv heads INT2) and INT2 on every head; a sweep over splits, warps and
stages picks the best launch configuration at the first shape. Bytes moved are counted
from the storage the kernel reads; GB/s = bytes / time. Accuracy: rel-L1 of the kernel
against the FlashQ reference and against exact attention on the unquantized K/V.

``--agreement`` adds the greedy-token agreement of the tests' copy-task Llama
(``tests/data``) with INT4 and with the 2/4 mix against the unquantized cache.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import platform
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from qattn_compile.kernels.decode import DecodeConfig, default_splits, flashq_decode_triton
from qattn_compile.kvcache import FlashQCache, FlashQLayer, flashq, kv_bytes_report
from qattn_compile.metrics import compare
from qattn_compile.policy import KVCacheLayer

log = logging.getLogger("benchmarks.decode")
REPO = Path(__file__).resolve().parents[1]
SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION}


def _bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _bench_graph(fn) -> float:
    """Median ms of a CUDA-graph replay of ``fn`` (captured after a warm-up call)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _bench(graph.replay)


def _storage_bytes_read(t: flashq.FlashQTensors, length: int) -> int:
    """Bytes the kernel reads for ``length`` tokens: codes, block metadata, buffer, scales."""
    n_b = t.buf.shape[-2]
    compressed = length // n_b * n_b
    blocks = compressed // 64
    _, b, h, _, d = t.step.shape
    codes = (t.codes4.shape[2] * d // 2 + t.codes2.shape[2] * d // 4) * compressed * 2 * b
    metadata = 2 * b * h * blocks * (2 * d + 4)
    buffered = 2 * b * h * (length - compressed) * d
    return codes + metadata + buffered


def _sdpa_entries(q, k, v) -> dict:
    out = {}
    for name, backend in SDPA_BACKENDS.items():
        def run(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        try:
            ms = _bench(run)
            out[name] = {"ms": ms, "graph_ms": _bench_graph(run)}
        except Exception as exc:  # a backend that refuses these inputs
            out[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    return out


def _sweep(q, t) -> list[dict]:
    h, n_blocks = t.step.shape[2], t.step.shape[3]
    b = t.step.shape[1]
    rows = []
    auto = default_splits(b, h, n_blocks)
    for splits, warps, stages in itertools.product(sorted({auto, 8, 16, 32, 64}), (4, 8), (2, 3, 4)):
        config = DecodeConfig(splits, warps, stages)
        try:
            ms = _bench(lambda: flashq_decode_triton(q, t, None, None, config))
            rows.append({"splits": splits, "num_warps": warps, "num_stages": stages, "ms": ms})
        except Exception as exc:
            rows.append({"splits": splits, "num_warps": warps, "num_stages": stages,
                         "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
    return rows


def run_shape(batch, context, heads, kv_heads, dim, sweep: bool, best: DecodeConfig | None):
    """Time SDPA and FlashQ at one shape; returns (result, best config) — the best is the
    INT4 sweep's fastest when sweeping, else ``best`` as given."""
    torch.manual_seed(0)
    dev = "cuda"
    k = torch.randn(batch, kv_heads, context, dim, device=dev, dtype=torch.bfloat16)
    k[..., :: dim // 4] = k[..., :: dim // 4] * 4 + 2  # outlier channels, as real K has
    v = torch.randn_like(k)
    q = torch.randn(batch, heads, 1, dim, device=dev, dtype=torch.bfloat16)
    sdpa = _sdpa_entries(q, k, v)
    sdpa_bytes = 2 * k.numel() * k.element_size()
    for entry in sdpa.values():
        if "ms" in entry:
            entry["GBps"] = sdpa_bytes / entry["ms"] / 1e6
    best_sdpa = min((e["ms"] for e in sdpa.values() if "ms" in e), default=math.nan)
    best_sdpa_graph = min((e["graph_ms"] for e in sdpa.values() if "graph_ms" in e), default=math.nan)
    exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
    result = {"shape": {"batch": batch, "context": context, "heads": heads, "kv_heads": kv_heads, "dim": dim},
              "sdpa_bf16": sdpa, "sdpa_bytes": sdpa_bytes, "flashq": {}}
    for label, int2 in (("int4", 0), ("mix_2_4", kv_heads // 2), ("int2", kv_heads)):
        layer = FlashQLayer(context + 64, int2)
        layer.append(k[..., :-1, :], v[..., :-1, :])
        layer.append(k[..., -1:, :], v[..., -1:, :])
        t = layer.tensors()
        entry = {"int2_heads": int2, "bytes": _storage_bytes_read(t, context)}
        config = best or DecodeConfig()
        if sweep:
            entry["sweep"] = _sweep(q, t)
            fastest = min((r for r in entry["sweep"] if "ms" in r), key=lambda r: r["ms"])
            config = DecodeConfig(fastest["splits"], fastest["num_warps"], fastest["num_stages"])
            best = best or config
        for name, cfg in (("default", DecodeConfig()), ("best", config)):
            ms = _bench(lambda cfg=cfg: flashq_decode_triton(q, t, None, None, cfg))
            graph_ms = _bench_graph(lambda cfg=cfg: flashq_decode_triton(q, t, None, None, cfg))
            entry[name] = {"config": cfg.__dict__, "ms": ms, "graph_ms": graph_ms,
                           "GBps": entry["bytes"] / ms / 1e6,
                           "speedup_vs_sdpa": best_sdpa / ms, "graph_speedup_vs_sdpa": best_sdpa_graph / graph_ms}
        entry["op_ms"] = _bench(lambda: torch.ops.qattn.flashq_decode(q, *t, None, None))  # dispatcher included
        mask = torch.ones(batch, 1, 1, context + 64, dtype=torch.bool, device=dev)  # as transformers passes it
        entry["with_bool_mask_ms"] = _bench(lambda: flashq_decode_triton(q, t, mask, None, config))
        out = flashq_decode_triton(q, t, None, None, config)
        reference = flashq.reference_decode(q, t)
        entry["kernel_vs_reference"] = compare(out, reference)
        entry["vs_exact_unquantized"] = compare(out, exact)
        entry["reference_vs_exact_unquantized"] = compare(reference, exact)
        result["flashq"][label] = entry
        log.info("%s %s: %s", result["shape"], label, {k2: v2 for k2, v2 in entry.items() if k2 != "sweep"})
    result["best_sdpa_ms"], result["best_sdpa_graph_ms"] = best_sdpa, best_sdpa_graph
    return result, best


def kv_bytes_llama8b() -> dict:
    """KV bytes per token of a Llama-3-8B-shaped model (32 layers, 8 kv heads, D=128)."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096)
    out = {}
    for label, int2 in (("int4", 0), ("mix_2_4", 4), ("int2", 8)):
        report = kv_bytes_report(FlashQCache(cfg, 8192, KVCacheLayer(int2_heads=int2)))
        out[label] = {k: report[k] for k in ("bytes_per_token", "bf16_bytes_per_token", "ratio", "fixed_bytes")}
    return out


def greedy_agreement(device: str) -> dict:
    """Greedy-token agreement of the copy-task Llama (tests/data) with FlashQ vs its own cache."""
    import importlib.util

    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    spec = importlib.util.spec_from_file_location("make_copy_llama", REPO / "tests" / "data" / "make_copy_llama.py")
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    model = LlamaForCausalLM(maker.copy_llama_config()).eval()
    model.load_state_dict({k: v.float() for k, v in load_file(str(maker.OUT)).items()})
    model.to(device).set_attn_implementation("qattn_kv")
    torch.manual_seed(1)
    ids = maker.periodic_batch(32, 40, 100).to(device)
    kwargs = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, attention_mask=torch.ones_like(ids),
                  pad_token_id=0, disable_compile=True)
    reference = model.generate(ids, **kwargs)[:, 100:]
    out = {"prompts": ids.shape[0], "tokens": 32}
    for label, int2 in (("int4", 0), ("mix_2_4", 1), ("int2", 2)):
        cache = FlashQCache(model.config, 160, KVCacheLayer(int2_heads=int2))
        tokens = model.generate(ids, past_key_values=cache, **kwargs)[:, 100:]
        same = tokens == reference
        first = [int(row.logical_not().nonzero()[0]) if not row.all() else 32 for row in same]
        out[label] = {"token_agreement": same.float().mean().item(),
                      "prompts_fully_matching": sum(f == 32 for f in first), "first_mismatch": first}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--no-sweep", action="store_true", help="skip the launch-config sweep")
    parser.add_argument("--agreement", action="store_true", help="add the copy-model greedy agreement")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import transformers

    report = {"device": torch.cuda.get_device_name(), "versions": {
        "torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
        "cuda": torch.version.cuda, "python": platform.python_version()}, "shapes": []}
    best = None
    for shape in ((8, 32768, 32, 8, 128), (1, 131072, 32, 8, 128)):
        result, best = run_shape(*shape, sweep=not args.no_sweep and best is None, best=best)
        report["shapes"].append(result)
        Path(args.out).write_text(json.dumps(report, indent=1))
    report["kv_bytes_llama3_8b"] = kv_bytes_llama8b()
    if args.agreement:
        report["greedy_agreement"] = greedy_agreement("cuda")
    Path(args.out).write_text(json.dumps(report, indent=1))
    log.info("wrote %s", args.out)
    print(summary(report))


def summary(report: dict) -> str:
    """A short table of the report: SDPA vs FlashQ per shape and format."""
    lines = [f"{report['device']}  {report['versions']}",
             f"{'shape':<22} {'format':<8} {'config':<14} {'ms':>7} {'graph':>7} {'GB/s':>6} {'x SDPA':>7} {'rel-L1 ref':>10}"]
    for shape in report["shapes"]:
        s = shape["shape"]
        name = f"B={s['batch']} L={s['context']}"
        lines.append(f"{name:<22} {'sdpa':<8} {'best bf16':<14} {shape['best_sdpa_ms']:7.4f} {shape['best_sdpa_graph_ms']:7.4f}")
        for label, entry in shape["flashq"].items():
            best = entry["best"]
            cfg = best["config"]
            text = f"s{cfg['splits']}/w{cfg['num_warps']}/st{cfg['num_stages']}"
            lines.append(f"{name:<22} {label:<8} {text:<14} {best['ms']:7.4f} {best['graph_ms']:7.4f} "
                         f"{best['GBps']:6.0f} {best['speedup_vs_sdpa']:7.2f} {entry['kernel_vs_reference']['rel_l1']:10.2e}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
