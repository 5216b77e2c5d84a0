"""FlashQ decode attention vs SDPA on a bf16 cache: the kernel's variants, bytes, GB/s.

Run on the GPU machine from the repository root (about a minute and a half on the H100)::

    PYTHONPATH=. python benchmarks/decode.py --out $OUT/decode.json --sweep

Decode attention (q_len 1, GQA 32 query / 8 kv heads, D=128) at B=8 × 32K tokens, B=1 × 128K
and B=1 × 32K. SDPA (flash and cuDNN backends, ``enable_gqa``) reads a bf16 cache; FlashQ
runs :func:`~qattn_compile.kvcache.kernel.flashq_decode_triton` on a cache filled by
``FlashQLayer`` (prefill of the random K/V, one decode token) for INT4 on every head, the
2/4 mix (half the kv heads INT2) and INT2 on every head.

Every variant (:data:`variants`: blocks per iteration, code format, stages, prefetch mode,
warps, half and twice the default split count) is first checked against
``reference_decode`` on a small cache of the same head layout (which also compiles it), then
timed at every shape and format. Times are medians of ``triton.testing.do_bench`` over a
CUDA-graph replay of one call (the host's launch overhead excluded, as a compiled
``reduce-overhead`` decode step sees it, but the graph's own launch, several µs on the GPU,
charged to the one call), after one untimed timing of the default; the default
configuration and SDPA are also timed in a graph of :data:`STEP_LAYERS` calls over as many
copies of the cache (per call: a model's decode step, where the graph launch is shared by
all layers), and the default eagerly, through the op, and with the bool mask transformers
passes. GB/s = bytes the kernel must read (codes, per-block step/lo/scale, the
INT8 buffer; the bf16 K/V for SDPA) / time. Accuracy: rel-L1 of the default and the fastest
variant against the FlashQ reference and against exact attention on the unquantized K/V.

``--agreement`` adds the greedy-token agreement of the tests' copy-task Llama
(``tests/data``) with INT4 and with the 2/4 mix against the unquantized cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import math
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from qattn_compile.blocks import KV_CACHE_BLOCK
from qattn_compile.kernels import autotune
from qattn_compile.kvcache.kernel import MAX_SPLITS, DecodeConfig, flashq_decode_triton, resolve
from qattn_compile.kvcache import FlashQCache, FlashQLayer, flashq, kv_bytes_report
from qattn_compile.metrics import compare
from qattn_compile.policy import KVCacheLayer

log = logging.getLogger("benchmarks.decode")
REPO = Path(__file__).resolve().parents[1]
SHAPES = ((8, 32768), (1, 131072), (1, 32768))  # (batch, context tokens)
HEADS, KV_HEADS, DIM = 32, 8, 128
DEVICE = "cuda"
FORMATS = (("int4", 0), ("mix_2_4", KV_HEADS // 2), ("int2", KV_HEADS))  # (label, INT2 kv heads)
SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
CHECK_TOKENS = 3000
"""Prompt tokens of the check cache (B=2; then 4 decode steps, so its buffer is partly full)."""
CHECK_MARGIN = 1e-3
"""A variant whose rel-L1 against ``reference_decode`` on the check cache exceeds the error of
rounding the reference to the output dtype (bf16: ~1.4e-3) by more than this is reported as
failing (and still timed)."""
STEP_LAYERS = 8
"""Calls of the in-step timing (:func:`_bench_step`): one per layer, each over its own copy
of the cache."""
TIME_BUDGET_S = 170.0
"""Variants left when this much time has passed are skipped (and listed as skipped)."""


def variants(sweep: bool) -> list[tuple[str, dict]]:
    """(name, DecodeConfig fields) of the variants to time; ``splits`` given as ``"half"`` /
    ``"double"`` is relative to the default count at each shape (:func:`_config`)."""
    out = [("default", {})]
    if sweep:
        out += [
            ("bpi2", {"blocks_per_iter": 2}),
            ("bpi2_warps2", {"blocks_per_iter": 2, "num_warps": 2}),
            ("bpi4", {"blocks_per_iter": 4}),
            ("biased", {"codes": "biased"}),
            ("stages2", {"num_stages": 2}),
            ("prefetch_none", {"prefetch": "none"}),
            ("prefetch_l2", {"prefetch": "l2"}),
            ("prefetch_keys", {"prefetch": "keys"}),
            ("warps2", {"num_warps": 2}),
            ("warps4", {"num_warps": 4}),
            ("splits_half", {"splits": "half"}),
            ("splits_double", {"splits": "double"}),
        ]
    return out


def _config(fields: dict, q, t: flashq.FlashQTensors) -> DecodeConfig:
    """The variant ``fields`` as launched for ``q`` over ``t`` (:func:`resolve`), relative
    split counts (``"half"``, ``"double"``) applied to the default ones; an integer count is
    taken as is."""
    fields = dict(fields)
    splits = fields.pop("splits", None)
    if isinstance(splits, int):
        fields["splits"] = splits
    config = resolve(DecodeConfig(**fields), q, t)
    if splits == "half":
        return dataclasses.replace(config, splits=max(1, config.splits // 2))
    if splits == "double":
        return dataclasses.replace(config, splits=min(MAX_SPLITS, config.splits * 2))
    return config


def _bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def _bench_graph(fn) -> float:
    """Median ms of CUDA-graph replays of ``fn`` (:func:`~qattn_compile.kernels.autotune.time_call`)."""
    return autotune.time_call(fn, torch.device(DEVICE))


def _bench_step(calls) -> float:
    """Median ms per call of a CUDA graph that replays ``calls`` back to back: a decode step's
    attention calls, one per layer over that layer's own cache, so no call finds another's
    data in L2, and the graph's launch cost is shared among them as in a model's captured
    step. :func:`_bench_graph` captures one call per graph and so charges the whole graph
    launch to it."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    ms = triton.testing.do_bench(graph.replay, warmup=5, rep=25, return_mode="median")
    return ms / len(calls)


def _storage_bytes_read(t: flashq.FlashQTensors, length: int) -> int:
    """Bytes the kernel reads for ``length`` tokens: codes, block metadata, buffer."""
    n_b = t.buf.shape[-2]
    compressed = length // n_b * n_b
    blocks = compressed // KV_CACHE_BLOCK
    _, b, h, _, d = t.step.shape
    codes = (t.codes4.shape[2] * d // 2 + t.codes2.shape[2] * d // 4) * compressed * 2 * b
    metadata = 2 * b * h * blocks * (2 * d + 4)
    buffered = 2 * b * h * (length - compressed) * d
    return codes + metadata + buffered


def _rel_l1(out, ref) -> float:
    return ((out.float() - ref).abs().sum() / ref.abs().sum()).item()


def _kv(batch: int, context: int, seed: int = 0):
    torch.manual_seed(seed)
    k = torch.randn(batch, KV_HEADS, context, DIM, device=DEVICE, dtype=torch.bfloat16)
    k[..., :: DIM // 4] = k[..., :: DIM // 4] * 4 + 2  # outlier channels, as real K has
    return k, torch.randn_like(k), torch.randn(batch, HEADS, 1, DIM, device=DEVICE, dtype=torch.bfloat16)


def _layer(k, v, int2_heads: int) -> FlashQLayer:
    layer = FlashQLayer(k.shape[-2] + KV_CACHE_BLOCK, int2_heads)
    layer.append(k[..., :-1, :], v[..., :-1, :])
    layer.append(k[..., -1:, :], v[..., -1:, :])
    return layer


def check_variants(names: list[tuple[str, dict]]) -> dict:
    """rel-L1 of each variant against ``reference_decode`` on the check cache
    (:data:`CHECK_TOKENS`) for each format, and the error of the reference rounded to bf16 (the
    floor for a bf16 output)."""
    k, v, q = _kv(2, CHECK_TOKENS, seed=1)
    out = {}
    for label, int2 in FORMATS:
        layer = _layer(k, v, int2)
        for _ in range(4):
            layer.append(*(torch.randn_like(k[..., :1, :]) for _ in range(2)))
        t = layer.tensors()
        ref = flashq.reference_decode(q, t)
        out.setdefault("bf16 rounding", {})[label] = _rel_l1(ref.to(q.dtype), ref)
        for name, fields in names:
            try:
                err = _rel_l1(flashq_decode_triton(q, t, None, None, _config(fields, q, t)), ref)
            except Exception as exc:  # reported in the table, the variant then fails to time too
                log.warning("%s %s: %s: %s", name, label, type(exc).__name__, exc)
                err = math.inf
            out.setdefault(name, {})[label] = err
    return out


def _sdpa_entries(q, k, v) -> dict:
    out = {}
    nbytes = 2 * k.numel() * k.element_size()
    for name, backend in SDPA_BACKENDS.items():
        def sdpa_call(k, v, backend=backend):
            def call():
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            return call

        try:
            run = sdpa_call(k, v)
            ms = _bench(run)
            graph_ms = _bench_graph(run)
            copies = [(k.clone(), v.clone()) for _ in range(STEP_LAYERS)]
            step_ms = _bench_step([sdpa_call(*kv) for kv in copies])
            del copies
            out[name] = {"ms": ms, "graph_ms": graph_ms, "GBps": nbytes / graph_ms / 1e6, "step_ms": step_ms}
        except Exception as exc:  # a backend that refuses these inputs
            out[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    return out


def _time_format(k, v, q, int2: int, exact, best_sdpa: float, names, deadline: float) -> dict:
    """Time every variant on a FlashQ cache of ``k``/``v`` with ``int2`` INT2 kv heads; the
    default and the fastest are also checked against the reference and exact attention."""
    batch, _, context, _ = k.shape
    t = _layer(k, v, int2).tensors()
    nbytes = _storage_bytes_read(t, context)
    entry = {"int2_heads": int2, "bytes": nbytes, "variants": {}, "skipped": []}
    # untimed: the first timing of a new cache read up to 11 % slow at B=8 × 32K and B=1 × 128K
    # (the same configuration timed twice in a row, H100, session 8)
    _bench_graph(lambda: flashq_decode_triton(q, t, None, None))
    for name, fields in names:
        if time.monotonic() > deadline:
            entry["skipped"].append(name)
            continue
        config = _config(fields, q, t)
        try:
            ms = _bench_graph(lambda config=config: flashq_decode_triton(q, t, None, None, config))
        except Exception as exc:  # e.g. a variant that needs more shared memory than the GPU has
            entry["variants"][name] = {"config": dataclasses.asdict(config), "error": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        entry["variants"][name] = {"config": dataclasses.asdict(config), "graph_ms": ms,
                                   "GBps": nbytes / ms / 1e6, "speedup_vs_sdpa": best_sdpa / ms}
    timed = [n for n, e in entry["variants"].items() if "graph_ms" in e]
    if not timed:  # the time budget ran out before this format: nothing to compare
        return entry
    entry["best"] = best = min(timed, key=lambda n: entry["variants"][n]["graph_ms"])
    reference = flashq.reference_decode(q, t)
    for name in dict.fromkeys(("default", best)):
        out = flashq_decode_triton(q, t, None, None, DecodeConfig(**entry["variants"][name]["config"]))
        entry["variants"][name]["kernel_vs_reference"] = compare(out, reference)
        entry["variants"][name]["vs_exact_unquantized"] = compare(out, exact)
    entry["reference_vs_exact_unquantized"] = compare(reference, exact)
    mask = torch.ones(batch, 1, 1, context + KV_CACHE_BLOCK, dtype=torch.bool, device=DEVICE)  # as transformers
    entry["default_eager_ms"] = _bench(lambda: flashq_decode_triton(q, t, None, None))
    entry["default_op_ms"] = _bench(lambda: torch.ops.qattn.flashq_decode(q, *t, None, None))
    entry["default_bool_mask_graph_ms"] = _bench_graph(lambda: flashq_decode_triton(q, t, mask, None))
    layers = [t] + [_layer(k, v, int2).tensors() for _ in range(STEP_LAYERS - 1)]
    entry["default_step_ms"] = _bench_step([lambda t=t: flashq_decode_triton(q, t, None, None) for t in layers])
    return entry


def run_shape(batch: int, context: int, names: list[tuple[str, dict]], deadline: float) -> dict:
    """Time SDPA and every variant of FlashQ at one shape."""
    k, v, q = _kv(batch, context)
    sdpa = _sdpa_entries(q, k, v)
    best_sdpa = min((e["graph_ms"] for e in sdpa.values() if "graph_ms" in e), default=math.nan)
    exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
    result = {"shape": {"batch": batch, "context": context, "heads": HEADS, "kv_heads": KV_HEADS, "dim": DIM},
              "sdpa_bf16": sdpa, "sdpa_bytes": 2 * k.numel() * k.element_size(), "best_sdpa_graph_ms": best_sdpa,
              "flashq": {}}
    for label, int2 in FORMATS:
        entry = _time_format(k, v, q, int2, exact, best_sdpa, names, deadline)
        result["flashq"][label] = entry
        if "best" in entry:
            log.info("B=%d L=%d %s: best %s %.4f ms", batch, context, label, entry["best"],
                     entry["variants"][entry["best"]]["graph_ms"])
        gc.collect()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()  # the previous format's cache
    return result


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


def summary(report: dict) -> str:
    """The report as text: the correctness check, then per shape SDPA and every variant
    (CUDA-graph ms, GB/s, speed-up over the faster SDPA) for each format."""
    lines = [f"{report['device']}  {report['versions']}", "",
             f"check vs reference_decode (B=2, {CHECK_TOKENS + 4} tokens, rel-L1; fails above bf16 rounding"
             f" + {CHECK_MARGIN:g}):"]
    floor = report["check"]["bf16 rounding"]
    for name, errs in report["check"].items():
        flag = "" if all(err <= floor[k] + CHECK_MARGIN for k, err in errs.items()) else "  FAIL"
        lines.append(f"  {name:<14} " + "  ".join(f"{k} {v:.1e}" for k, v in errs.items()) + flag)
    for shape in report["shapes"]:
        s = shape["shape"]
        lines += ["", f"B={s['batch']} L={s['context']} (GQA {s['heads']}/{s['kv_heads']}, D={s['dim']}), "
                      f"CUDA-graph ms / GB/s / x SDPA"]
        for name, e in shape["sdpa_bf16"].items():
            lines.append(f"  sdpa {name:<9} bf16  " + (f"{e['graph_ms']:8.4f} {e['GBps']:6.0f}" if "graph_ms" in e
                                                       else e["error"][:80]))
        lines.append("  bytes read: " + ", ".join(f"{label} {e['bytes'] / 1e6:.0f} MB" for label, e in shape["flashq"].items())
                     + f", bf16 {shape['sdpa_bytes'] / 1e6:.0f} MB")
        header = f"  {'variant':<14} {'splits':>6}" + "".join(f" | {label:^22}" for label in shape["flashq"])
        lines.append(header)
        for name in report["variants"]:
            row = []
            splits = ""
            for entry in shape["flashq"].values():
                v = entry["variants"].get(name)
                if v is None or "error" in v:
                    row.append(f" | {'skipped' if v is None else 'error':^22}")
                    continue
                splits = v["config"]["splits"]
                mark = "*" if entry.get("best") == name else " "
                row.append(f" | {v['graph_ms']:7.4f}{mark}{v['GBps']:6.0f} {v['speedup_vs_sdpa']:5.2f}x")
            lines.append(f"  {name:<14} {splits!s:>6}" + "".join(row))
        sdpa_steps = {n: e["step_ms"] for n, e in shape["sdpa_bf16"].items() if "step_ms" in e}
        step_sdpa = min(sdpa_steps.values(), default=math.nan)
        lines.append(f"  in a graph of {STEP_LAYERS} layers' calls, ms per call: "
                     + ", ".join(f"sdpa {n} {ms:.4f}" for n, ms in sdpa_steps.items())
                     + "".join(f"; {label} {e['default_step_ms']:.4f} ({step_sdpa / e['default_step_ms']:.2f}x)"
                               for label, e in shape["flashq"].items() if "default_step_ms" in e))
        for label, entry in shape["flashq"].items():
            if "best" not in entry:
                lines.append(f"  {label}: not timed (time budget)")
                continue
            best = entry["variants"][entry["best"]]
            lines.append(f"  {label}: best {entry['best']} rel-L1 vs reference {best['kernel_vs_reference']['rel_l1']:.1e}"
                         f", vs exact {best['vs_exact_unquantized']['rel_l1']:.3f} (reference vs exact "
                         f"{entry['reference_vs_exact_unquantized']['rel_l1']:.3f}); default eager "
                         f"{entry['default_eager_ms']:.4f} ms, op {entry['default_op_ms']:.4f}, "
                         f"bool mask (graph) {entry['default_bool_mask_graph_ms']:.4f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--sweep", action="store_true", help="time every variant, not only the default")
    parser.add_argument("--variants", type=json.loads, default=None,
                        help='JSON object {name: DecodeConfig fields} to time instead of the built-in list')
    parser.add_argument("--budget", type=float, default=TIME_BUDGET_S,
                        help="seconds after which the remaining variants are skipped")
    parser.add_argument("--agreement", action="store_true", help="add the copy-model greedy agreement")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import transformers

    start = time.monotonic()
    names = list(args.variants.items()) if args.variants else variants(args.sweep)
    report = {"device": torch.cuda.get_device_name(), "versions": {
        "torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
        "cuda": torch.version.cuda, "python": platform.python_version()}, "variants": dict(names), "shapes": []}
    report["check"] = check_variants(names)
    log.info("checked %d variants in %.0f s", len(names), time.monotonic() - start)
    for batch, context in SHAPES:
        report["shapes"].append(run_shape(batch, context, names, start + args.budget))
        Path(args.out).write_text(json.dumps(report, indent=1))
    report["kv_bytes_llama3_8b"] = kv_bytes_llama8b()
    if args.agreement:
        report["greedy_agreement"] = greedy_agreement("cuda")
    report["seconds"] = time.monotonic() - start
    Path(args.out).write_text(json.dumps(report, indent=1))
    log.info("wrote %s in %.0f s", args.out, report["seconds"])
    print(summary(report))


if __name__ == "__main__":
    main()
