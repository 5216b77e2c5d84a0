"""The ``qattn`` command: demo, explain, diff, eval, calibrate, tune.

Quantized attention for any PyTorch / Hugging Face model through
``torch.compile(model, backend="qattn", options={"policy": "policy.yaml"})``.
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from . import _compat
from .dynamo_backend import backend as make_backend
from .policy import DEFAULT_POLICY_PATH
from .debug.commands import add_subcommands as add_debug_subcommands
from .errors import QattnError
from .evaluation.commands import add_subcommands as add_eval_subcommands
from .metrics import compare
from .models import MINILM, minilm_available
from .presets import PRESET_METHODS, QUANTIZED_PRESETS
from .progress import step
from .report import REWRITTEN, format_table
from .specs import load_spec


def _device_and_dtype():
    if torch.cuda.is_available():
        return torch.device("cuda"), torch.float16
    return torch.device("cpu"), torch.float32


def _time_ms(fn) -> float:
    """Median wall time of ``fn()`` in ms on the GPU (events, after warm-up)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")


def _preset_table(bundle, reference, presets) -> str:
    width = max(len(PRESET_METHODS[p]) for p in presets)
    rows = [f"{'preset':<10} {'method':<{width}} {'cos':>9} {'rel-L1':>8}"]
    for preset in presets:
        _compat.reset_dynamo()
        be = make_backend({"qattn": 1, "default": preset}, compiler="eager")
        be.announce_reference = False  # said by the demo's own compile already
        out = bundle.run(torch.compile(bundle.model, backend=be))
        m = compare(out, reference)
        rows.append(f"{preset:<10} {PRESET_METHODS[preset]:<{width}} {m['cos']:9.6f} {m['rel_l1']:8.5f}")
    return "\n".join(rows)


def cmd_demo(args) -> int:
    policy = str(DEFAULT_POLICY_PATH) if args.policy is None else args.policy
    be = make_backend(policy, compiler=args.compiler)  # validates the policy before any work
    spec = args.model or (MINILM if minilm_available() else "tiny-llama")
    if args.model is None and spec != MINILM:
        print(f"({MINILM} is not installed: using a tiny random Llama instead)")
    with step(f"loading {spec}"):
        bundle = load_spec(spec)
    device, dtype = _device_and_dtype()
    with step("running the uncompiled fp32 model (reference)"):
        reference = bundle.to(device).run()
    if dtype != torch.float32:
        bundle.to(device, dtype)
    compiled = torch.compile(bundle.model, backend=be)
    with step(f"compiling with backend=qattn (compiler: {args.compiler}) and running"):
        out = bundle.run(compiled)
    print(f"\npolicy: {policy}\n")
    print(format_table(be.site_reports))
    rewritten = sum(r.status == REWRITTEN for r in be.site_reports)
    print(f"\n{rewritten} of {len(be.site_reports)} attention sites rewritten")
    for line in be.unmatched_rules():
        print(f"warning: {line}")
    m = compare(out, reference)
    what = bundle.output  # what the model's run compared: "logits", "embedding", "sample"...
    print(f"{what} vs uncompiled fp32 model: cos {m['cos']:.6f}  rel-L1 {m['rel_l1']:.5f}")
    if device.type == "cuda":
        eager_ms = _time_ms(lambda: bundle.run())
        qattn_ms = _time_ms(lambda: bundle.run(compiled))
        print(f"time: eager {eager_ms:.3f} ms, qattn {qattn_ms:.3f} ms ({torch.cuda.get_device_name()})")
    if not args.no_presets:
        with step("evaluating every quantized preset (compiler: eager)"):
            table = _preset_table(bundle, reference, QUANTIZED_PRESETS)
        print(f"\nevery attention site on one preset, {what} vs uncompiled fp32 model:\n{table}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qattn", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log every site decision")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="compile a bundled model with a policy and report")
    demo.add_argument("--model", help=f"MODEL_SPEC (default: {MINILM}, else tiny-llama)")
    demo.add_argument("--policy", help="policy YAML (default: the bundled sage2_8b policy)")
    demo.add_argument("--compiler", choices=("inductor", "eager"), default="inductor")
    demo.add_argument("--no-presets", action="store_true", help="skip the per-preset table")
    demo.set_defaults(func=cmd_demo)
    add_debug_subcommands(sub)
    add_eval_subcommands(sub)
    for command in sub.choices.values():  # `qattn explain ... -v` as well as `qattn -v explain ...`
        command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                             help="log every site decision")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        return args.func(args)
    except QattnError as exc:
        print(f"qattn: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
