"""A/B of the attention kernel alone between source trees, one process per tree and round.

On the GPU machine, from each tree's root (its ``qattn_compile`` first on ``PYTHONPATH``)::

    PYTHONPATH=.:/tmp/site python3 <this repo>/benchmarks/probes/kernel_ab.py run --arm NAME \\
        --out ab_NAME_1.json [--n 16384] [--presets int_flash sage2_8b] [--dims 64 128]
    python3 benchmarks/probes/kernel_ab.py table ab_*.json

``run`` prepares the operands once per shape (quantizers outside the timing) and times
``prepare_attention(...).run()`` with the table's tile for an eager launch (``capped``: a
register cap allowed) and, where it differs, for a traced one (what compiled models get),
B=4, H=32, bf16 N(0, 1) inputs, causal and not; it records TOPS (4·B·H·N²·D / t, halved
when causal; median of ``do_bench``) and a fingerprint of the output (sum, sum of |o|).
``table`` prints the median TOPS per arm, the last arm over the first, and whether the
arms' outputs agree. Arms in separate processes (Triton caches kernels by source, so the
trees never share a compiled kernel); interleave rounds (base, new, base, new), since
single rounds on one GPU differ by several percent.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics


def run(args) -> None:
    import torch
    from triton.testing import do_bench

    from qattn_compile.kernels import launch, prepare_attention

    b, h, n = 4, 32, args.n
    rows = []
    eager_cap = launch.launch_takes_register_cap
    for d in args.dims:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, h, n, d, device="cuda", generator=gen, dtype=torch.bfloat16)
                   for _ in range(3))
        for causal in (False, True):
            for preset in args.presets:
                seen = set()
                for capped in (True, False):
                    launch.launch_takes_register_cap = eager_cap if capped else (lambda like: False)
                    try:
                        call = prepare_attention(q, k, v, None, causal, None, preset, None)
                    finally:
                        launch.launch_takes_register_cap = eager_cap
                    if call.cfg in seen:
                        continue  # the traced launch gets the same tile
                    seen.add(call.cfg)
                    out = call.run().float()
                    ms = do_bench(call.run, warmup=50, rep=300)
                    row = dict(arm=args.arm, d=d, causal=causal, preset=preset, capped=capped,
                               cfg=str(call.cfg), ms=ms,
                               tops=4 * b * h * n * n * d / ms / 1e9 / (2 if causal else 1),
                               fingerprint=[out.sum().item(), out.abs().sum().item()])
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    with open(args.out, "w") as f:
                        json.dump(rows, f, indent=1)


def table(args) -> None:
    rows = [r for path in args.files for r in json.load(open(path))]
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    tops, prints = collections.defaultdict(list), collections.defaultdict(dict)
    for r in rows:
        key = (r["d"], r["causal"], r["preset"], "eager" if r["capped"] else "traced")
        tops[key, r["arm"]].append(r["tops"])
        prints[key][r["arm"]] = tuple(r["fingerprint"])
    print("D, causal, preset, launch | " + " | ".join(arms) + " | last/first | outputs agree")
    for key in sorted({k for k, _ in tops}):
        med = [statistics.median(tops[key, a]) if tops[key, a] else float("nan") for a in arms]
        same = len(set(prints[key].values())) == 1
        cells = " | ".join(f"{m:.0f}" for m in med)
        print(f"{key} | {cells} | {med[-1] / med[0]:.3f} | {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("run", help="time this tree's kernels")
    one.add_argument("--arm", required=True)
    one.add_argument("--out", required=True)
    one.add_argument("--n", type=int, default=16384)
    one.add_argument("--presets", nargs="+",
                     default=["int_flash", "fp8", "sage2_8b", "fmha_int8", "flash"])
    one.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    many = sub.add_parser("table", help="compare the arms of JSON files from `run`")
    many.add_argument("files", nargs="+")
    args = parser.parse_args()
    if args.command == "run":
        run(args)
    else:
        table(args)


if __name__ == "__main__":
    main()
