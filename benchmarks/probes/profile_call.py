"""Where the time of one eager ``qattn_compile.attention`` call goes (torch.profiler).

    PYTHONPATH=. python3 benchmarks/probes/profile_call.py --preset int_flash --seq 1024 16384

Prints, per sequence length, the wall time of a call, the summed GPU kernel time, and the
kernels sorted by GPU time — the gap between wall and GPU time is host overhead.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

import qattn_compile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", nargs="+", default=["int_flash"])
    parser.add_argument("--seq", type=int, nargs="+", default=[1024, 16384])
    parser.add_argument("--dim", type=int, default=128)
    args = parser.parse_args()
    for preset in args.preset:
        for n in args.seq:
            q, k, v = (torch.randn(4, 32, n, args.dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            call = lambda: qattn_compile.attention(q, k, v, preset=preset)  # noqa: E731
            for _ in range(3):
                call()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(10):
                call()
            torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - start) * 100
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                call()
                torch.cuda.synchronize()
            events = [e for e in prof.key_averages() if e.device_time_total > 0]
            gpu_ms = sum(e.self_device_time_total for e in events) / 1e3
            print(f"\n== {preset} N={n} D={args.dim}: wall {wall_ms:.3f} ms/call, GPU kernels {gpu_ms:.3f} ms")
            print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
