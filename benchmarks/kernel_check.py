"""GPU check of the qattn Triton kernels: accuracy table and quick timings.

Usage (on the GPU machine, from the repository root)::

    PYTHONPATH=. python benchmarks/kernel_check.py --out kernel_check.json

1. Accuracy, a same-run comparison with the peers at equal bit widths: for every preset
   (plus ``int_flash``, ``fmha_int8`` and ``turbo`` with the papers' row range of P,
   ``int_flash paper`` = INT-FlashAttention's own math, and ``sage2_8b pv=fp16``) ×
   {N(0,1), K channel outliers} × D ∈ {64, 128} at N=2048 (B=1, H=8, bf16 inputs): cosine similarity, relative L1 and RMSE of the kernel and of the reference
   (:func:`qattn_compile.reference.reference_attention`) against fp64 exact attention, and
   SageAttention 1.0.6 (``sageattn``, when ``import sageattention`` works) on the same inputs.
   Each row names its peer at the same bit widths and says whether our kernel's rel-L1 is no
   worse: ``sage2_8b pv=fp16`` vs SageAttention 1.0.6 (INT8 Q·Kᵀ with K smoothing, fp16 P·V;
   measured in this run), the INT8 Q/K/P/V presets (``int_flash``, ``fmha_int8``, ``turbo``)
   vs INT-FlashAttention's reported figures at D=128 (:data:`INT_FA_REPORTED`); the FP8
   ones have no peer that runs here.
2. Speed: B=4, H=32, N=4096, D=128, bf16 (``--masks``: no mask, ``is_causal``, and/or the
   materialized bool causal mask transformers passes): median ``triton.testing.do_bench``
   time of the whole call (quantizers + attention), of the attention kernel alone on
   prepared operands, and of torch SDPA; TOPS = 4·B·H·N²·D / t (halved when causal).

Tile configs are swept by ``benchmarks/probes/sweep.py`` (which also checks every config's output).

A preset that fails is reported (error text in the JSON) and the others go on. The table is
printed last; the JSON holds every number plus the torch/triton versions and the device.
"""

from __future__ import annotations

import argparse
import json
import traceback

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from qattn_compile.kernels import kernel_attention, prepare_attention
from qattn_compile.reference import exact_attention, reference_attention

PRESETS = ("flash", "int_flash", "fmha_int8", "sage2_8b", "sage2_4b", "turbo", "fp8")
DATASETS = ("normal", "k_outliers")
SAGEATTN = "SageAttention 1.0.6"
INT_FA = "INT-FlashAttention (reported, D=128)"
NO_PEER = "none runnable here"
INT_FA_REPORTED = {"normal": 0.028, "k_outliers": 0.054}
"""INT-FlashAttention's reported rel-L1 at N=2048, D=128: N(0,1) inputs / K channel outliers
(INT8 Q/K per token, INT8 P = round(127·P), INT8 V)."""
VARIANTS: tuple[tuple[str, str, dict, str], ...] = (
    # (row label, preset, options, peer at the same bit widths)
    ("flash", "flash", {}, NO_PEER),
    ("int_flash", "int_flash", {}, INT_FA),
    ("int_flash p_scale=row", "int_flash", {"p_scale": "row"}, INT_FA),
    ("int_flash paper", "int_flash", {"p_scale": "row", "smooth_k": False}, INT_FA),
    ("fmha_int8", "fmha_int8", {}, INT_FA),
    ("fmha_int8 p_scale=row", "fmha_int8", {"p_scale": "row"}, INT_FA),
    ("sage2_8b", "sage2_8b", {}, NO_PEER),
    ("sage2_8b pv=fp16", "sage2_8b", {"pv": "fp16"}, SAGEATTN),
    ("sage2_4b", "sage2_4b", {}, NO_PEER),
    ("turbo", "turbo", {}, INT_FA),
    ("turbo p_scale=row", "turbo", {"p_scale": "row"}, INT_FA),
    ("fp8", "fp8", {}, NO_PEER),
)

def make_inputs(b, h, n, d, data, dtype=torch.bfloat16, seed=0):
    """q, k, v ``[b, h, n, d]`` on the GPU: N(0,1), or with K channel outliers (every 8th
    channel scaled ×3 and shifted by +10, the channel-wise bias real K shows)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", generator=gen) for _ in range(3))
    if data == "k_outliers":
        k[..., ::8] = k[..., ::8] * 3 + 10
    return q.to(dtype), k.to(dtype), v.to(dtype)


def metrics(out, exact) -> dict:
    """cos, rel-L1, RMSE of ``out`` against ``exact`` (float64)."""
    o, r = out.double().flatten(), exact.double().flatten()
    return {
        "cos": F.cosine_similarity(o, r, dim=0).item(),
        "rel_l1": ((o - r).abs().sum() / r.abs().sum()).item(),
        "rmse": (o - r).pow(2).mean().sqrt().item(),
    }


def sageattention():
    """``(fn, why)``: SageAttention 1.0.6's ``sageattn`` as ``fn(q, k, v) -> O`` (HND layout,
    not causal; given copies, as it may smooth K in place), or ``(None, why it is not
    importable)``."""
    try:
        from sageattention import sageattn
    except Exception as exc:  # an absent wheel, or one built against another triton/torch
        return None, f"{type(exc).__name__}: {exc}"

    def run(q, k, v):
        return sageattn(q.clone(), k.clone(), v.clone(), tensor_layout="HND", is_causal=False)

    return run, None


def peer_rel_l1(peer: str, data: str, d: int, measured: dict | None) -> float | None:
    """The peer's rel-L1 on ``data`` at head dim ``d``: SageAttention's from this run
    (``measured``: its row), INT-FlashAttention's reported figure (D=128 only), None when
    there is none."""
    if peer == SAGEATTN:
        return measured["kernel"]["rel_l1"] if measured and "kernel" in measured else None
    if peer == INT_FA and d == 128:
        return INT_FA_REPORTED[data]
    return None


def accuracy_rows(n: int) -> list[dict]:
    """The accuracy table: per D × data, one row per :data:`VARIANTS` entry (kernel and
    reference metrics, the peer at the same bit widths, ``ours_le_peer``) and one for
    SageAttention 1.0.6 (its output as ``kernel``, or why it did not run). Failures carry
    ``error``."""
    sage, why_not = sageattention()
    rows = []
    for d in (64, 128):
        for data in DATASETS:
            q, k, v = make_inputs(1, 8, n, d, data)
            exact = exact_attention(q, k, v)
            peer_row = {"preset": SAGEATTN, "variant": SAGEATTN, "options": {}, "data": data,
                        "d": d, "n": n}
            try:
                if sage is None:
                    raise RuntimeError(f"not importable ({why_not})")
                peer_row["kernel"] = metrics(sage(q, k, v), exact)
            except Exception as exc:
                peer_row["error"] = f"{type(exc).__name__}: {exc}"
            for label, preset, options, peer in VARIANTS:
                row = {"preset": preset, "variant": label, "options": options, "data": data,
                       "d": d, "n": n, "peer": peer,
                       "peer_rel_l1": peer_rel_l1(peer, data, d, peer_row)}
                try:
                    out = kernel_attention(q, k, v, preset=preset, options=options)
                    row["kernel"] = metrics(out, exact)
                    key_tile = prepare_attention(q, k, v, preset=preset,
                                                 options=options).cfg.block_n
                    ref = reference_attention(q, k, v, preset=preset, options=options,
                                              key_tile=key_tile)
                    row["reference"] = metrics(ref, exact)
                except Exception as exc:  # keep going: one broken preset must not hide the rest
                    row["error"] = f"{type(exc).__name__}: {exc}"
                    traceback.print_exc()
                if "kernel" in row and row["peer_rel_l1"] is not None:
                    row["ours_le_peer"] = row["kernel"]["rel_l1"] <= row["peer_rel_l1"]
                rows.append(row)
            rows.append(peer_row)
    return rows


def tops(b, h, n, d, ms, causal=False) -> float:
    """Attention TOPS: 4·B·H·N²·D operations (halved when causal) over ``ms`` milliseconds."""
    ops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
    return ops / (ms * 1e-3) / 1e12


def timing_rows(b: int, h: int, n: int, d: int, mode: str) -> list[dict]:
    """Median times of each preset (full call and kernel only) and of torch SDPA.

    ``mode``: ``none``; ``causal`` (``is_causal=True``); ``hf_mask`` (the materialized
    ``[B, 1, N, N]`` bool causal mask transformers passes under torch.compile).
    """
    q, k, v = make_inputs(b, h, n, d, "normal")
    kwargs = {}
    if mode == "causal":
        kwargs["is_causal"] = True
    elif mode == "hf_mask":
        causal = torch.ones(n, n, dtype=torch.bool, device="cuda").tril()
        kwargs["attn_mask"] = causal.expand(b, 1, n, n).contiguous()
    half = mode != "none"
    rows = []
    try:
        ms = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, **kwargs),
                      return_mode="median")
        rows.append({"impl": "torch_sdpa", "ms": ms, "tops": tops(b, h, n, d, ms, half)})
    except Exception as exc:
        rows.append({"impl": "torch_sdpa", "error": f"{type(exc).__name__}: {exc}"})
    for preset in PRESETS:
        row = {"impl": preset}
        try:
            ms = do_bench(lambda: kernel_attention(q, k, v, preset=preset, **kwargs),
                          return_mode="median")
            call = prepare_attention(q, k, v, preset=preset, **kwargs)
            ms_kernel = do_bench(call.run, return_mode="median")
            row.update(ms=ms, tops=tops(b, h, n, d, ms, half), kernel_ms=ms_kernel,
                       kernel_tops=tops(b, h, n, d, ms_kernel, half),
                       config=call.cfg.__dict__)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        rows.append(row)
    return rows


def profile_rows(b: int, h: int, n: int, d: int, presets: list[str]) -> dict:
    """torch.profiler tables (GPU time per kernel, host calls incl. any synchronization) of
    a few full calls per preset, and the host time per call measured without syncing."""
    import time

    from torch.profiler import ProfilerActivity, profile

    q, k, v = make_inputs(b, h, n, d, "normal")
    tables = {}
    for preset in presets:
        try:
            for _ in range(3):
                kernel_attention(q, k, v, preset=preset)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(10):
                kernel_attention(q, k, v, preset=preset)
            host_ms = (time.perf_counter() - start) / 10 * 1e3
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    kernel_attention(q, k, v, preset=preset)
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25)
            tables[preset] = {"host_ms_per_call_unsynced": host_ms, "table": table}
        except Exception as exc:
            tables[preset] = {"error": f"{type(exc).__name__}: {exc}"}
    return tables


def verdict(row: dict) -> str:
    """The "ours <= peer" column: yes / NO, or "-" without a peer figure."""
    if "ours_le_peer" not in row:
        return "-"
    return "yes" if row["ours_le_peer"] else "NO"


def print_accuracy(rows: list[dict]) -> None:
    """The accuracy table: kernel and reference against fp64 exact, peer, verdict."""
    print(f"\n{'variant':24s} {'data':10s} {'D':>3s} | {'kernel cos':>10s} {'rel-L1':>8s} "
          f"{'RMSE':>8s} | {'ref L1':>8s} | {'peer at same bit widths':36s} {'peer L1':>8s} "
          f"{'ours<=peer':>10s}")
    for r in rows:
        head = f"{r['variant']:24s} {r['data']:10s} {r['d']:3d} | "
        if "error" in r:
            print(head + "ERROR " + r["error"][:100])
            continue
        kern = r["kernel"]
        line = head + f"{kern['cos']:10.6f} {kern['rel_l1']:8.5f} {kern['rmse']:8.5f} | "
        if "reference" not in r:  # the peer itself
            print(line + f"{'':8s} | (measured peer)")
            continue
        peer_l1 = r["peer_rel_l1"]
        peer_text = "n/a" if peer_l1 is None else f"{peer_l1:8.5f}"
        print(line + f"{r['reference']['rel_l1']:8.5f} | {r['peer']:36s} {peer_text:>8s} "
              f"{verdict(r):>10s}")


def print_tables(result: dict) -> None:
    """The accuracy and timing tables as plain text."""
    print(f"\n{result['device']} | torch {result['torch']} | triton {result['triton']}")
    print_accuracy(result["accuracy"])
    for name, rows in result["timing"].items():
        print(f"\ntiming {name}")
        print(f"{'impl':11s} {'ms':>8s} {'TOPS':>7s} | {'kernel ms':>9s} {'TOPS':>7s}")
        for r in rows:
            if "error" in r:
                print(f"{r['impl']:11s} ERROR {r['error'][:80]}")
                continue
            line = f"{r['impl']:11s} {r['ms']:8.3f} {r['tops']:7.1f}"
            if "kernel_ms" in r:
                line += f" | {r['kernel_ms']:9.3f} {r['kernel_tops']:7.1f}"
            print(line)


def main() -> None:
    """Run the checks and write ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="path of the JSON result")
    parser.add_argument("--n", type=int, default=2048, help="sequence length of the accuracy table")
    parser.add_argument("--bench-n", type=int, default=4096, help="sequence length of the timings")
    parser.add_argument("--masks", default="none", help="comma list of timing modes: none, "
                        "causal, hf_mask (materialized [B,1,N,N] bool causal mask)")
    parser.add_argument("--profile", default="", help="comma list of presets to profile")
    parser.add_argument("--skip-accuracy", action="store_true", help="timings only")
    args = parser.parse_args()
    torch.manual_seed(0)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "accuracy": [],
        "timing": {},
    }

    def save() -> None:
        """Write what is measured so far (a later stage may run out of time)."""
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)

    if not args.skip_accuracy:
        result["accuracy"] = accuracy_rows(args.n)
        save()
    shape = (4, 32, args.bench_n, 128)
    name = f"B={shape[0]} H={shape[1]} N={shape[2]} D={shape[3]}"
    if args.profile:
        result["profile"] = profile_rows(*shape, args.profile.split(","))
        save()
        for preset, entry in result["profile"].items():
            host = entry.get("host_ms_per_call_unsynced", 0.0)
            print(f"\nprofile {preset}: {host:.3f} ms host/call")
            print(entry.get("table", entry.get("error")))
    for mode in [m for m in args.masks.split(",") if m]:
        result["timing"][f"{mode} {name}"] = timing_rows(*shape, mode)
        save()
    print_tables(result)

if __name__ == "__main__":
    main()
