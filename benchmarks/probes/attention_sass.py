"""The attention kernel compiled for the H100 (sm_90) on a CPU machine: registers, shared
memory, and instructions per key tile by class. No GPU needed.

Run on the CPU machine from the repository root (about 3 s per variant)::

    .venv/bin/python benchmarks/probes/attention_sass.py [--presets int_flash sage2_8b fp8] \\
        [--dim 128] [--causal] [--traced] [--options '{"k_granularity": "block"}'] [--dump DIR] \\
        [NAME='{"block_m": 64, "block_n": 128, "num_warps": 4, "num_stages": 3, "tma": true}' ...]

Each ``NAME=JSON`` is an :class:`~qattn_compile.kernels.heuristics.AttentionConfig` (none: the
H100 table's entry for the preset, read from the table's internals: the entry for an eager
call without a mask, with ``--causal`` for a causal one, with ``--traced`` for a call under
torch.compile, which takes no register cap; a ``maxnreg`` field caps the registers). The
operands are random tensors with the dtypes, layouts and scale groups of the preset's options
(``--options`` as JSON, applied to every preset; none: the defaults; :func:`operands` covers
int_flash, fmha_int8, sage2_8b, fp8, flash, and ``sage2_8b_pv16``: sage2_8b with ``pv:
fp16``), B=1, H=2, N=1024. They go through
:func:`qattn_compile.kernels.launch._launch`, whose kernel call is intercepted and compiled as
:mod:`decode_sass` does (same caveats: Triton internals; install the GPU's Triton 3.6 for its
register counts). Counts are per loop iteration, i.e. per key tile, per warp. The backward
branches of the TMA barriers' retry loops make some listed ranges span several loops: the
main loop is a short range with one set of score MMAs and one of P·V MMAs (GMMA 8 at 64×128,
D=128). What it is good for: seeing what a kernel change does to the instructions of the
loop (NOTES, session 9: two adds per score folded into one) before spending device time on
it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import decode_sass  # noqa: E402  (pops TRITON_INTERPRET before triton is imported)
import torch

from qattn_compile.blocks import SMOOTH_Q_BLOCK, fp8_group_sizes, group_sizes, int_flash_group_sizes
from qattn_compile.kernels import attention as ak
from qattn_compile.kernels import launch
from qattn_compile.kernels.heuristics import AttentionConfig, _table_config
from qattn_compile.presets import resolve_options

PRESETS = ("int_flash", "fmha_int8", "sage2_8b", "fp8", "sage2_8b_pv16", "flash")
BATCH, HEADS, LENGTH = 1, 2, 1024


_NATIVE_PV_SUFFIX = "_pv16"
"""``sage2_8b_pv16``: sage2_8b with its ``pv: fp16`` option (16-bit P and V)."""


def _base_preset(preset: str) -> str:
    """The library's preset name of one of :data:`PRESETS`."""
    return preset.removesuffix(_NATIVE_PV_SUFFIX)


def _scale(group: int) -> torch.Tensor:
    """Float32 ``[B, H, n_groups]`` scales for groups of ``group`` tokens."""
    return torch.rand(BATCH, HEADS, -(-LENGTH // group)) + 0.5


def operands(preset: str, dim: int, options: dict | None = None) -> launch.Operands:
    """Random kernel-format operands of ``preset`` with ``options`` (none: the defaults) at head
    dim ``dim`` (what :mod:`qattn_compile.kernels.launch`'s ``_prepare_*`` would hand the
    kernel)."""
    opts = resolve_options(_base_preset(preset), options)
    shape = (BATCH, HEADS, LENGTH, dim)
    int8 = torch.randint(-127, 128, shape, dtype=torch.int8)
    v_t = torch.zeros(BATCH, HEADS, dim, LENGTH)  # K-major 8-bit V, [B, H, Dv, L_pad]
    if preset == "int_flash":
        gq, gk = int_flash_group_sizes(opts.k_granularity, LENGTH, LENGTH)
        _, gv = group_sizes(opts.v_granularity, LENGTH, LENGTH)
        ops = launch.Operands(int8, int8.clone(), v_t.to(torch.int8),
                              launch._switches(ak.QK_INT8, ak.P_INT8, ak.V_INT8,
                                               p_tile_max=opts.p_scale == "tile"),
                              v_scale=_scale(gv), v_group=gv, v_transposed=True)
    elif preset == "fmha_int8":
        gq, gk = group_sizes("tensor", LENGTH, LENGTH)
        ops = launch.Operands(int8, int8.clone(), v_t.to(torch.int8),
                              launch._switches(ak.QK_INT8, ak.P_UINT8, ak.V_INT8,
                                               p_tile_max=opts.p_scale == "tile"),
                              v_scale=_scale(gk), v_group=gk, v_transposed=True)
        ops.v_colsum = torch.zeros(BATCH, HEADS, LENGTH // launch.V_COLSUM_TOKENS, dim,
                                   dtype=torch.int32)
    elif preset == "sage2_8b":
        gq, gk = group_sizes(opts.qk_granularity, LENGTH, LENGTH)
        ops = launch.Operands(int8, int8.clone(), v_t.to(torch.float8_e4m3fn),
                              launch._switches(ak.QK_INT8, ak.P_FP8, ak.V_FP8),
                              v_scale=torch.rand(BATCH, HEADS, dim), v_per_channel=True,
                              v_transposed=True,
                              delta_s=torch.rand(BATCH, HEADS, LENGTH // SMOOTH_Q_BLOCK, LENGTH))
    elif preset == "sage2_8b_pv16":  # sage2_8b with `pv: fp16`: native P and V
        gq, gk = group_sizes(opts.qk_granularity, LENGTH, LENGTH)
        ops = launch.Operands(int8, int8.clone(), torch.randn(shape, dtype=torch.bfloat16),
                              launch._switches(ak.QK_INT8, ak.P_NATIVE, ak.V_NATIVE),
                              delta_s=torch.rand(BATCH, HEADS, LENGTH // SMOOTH_Q_BLOCK, LENGTH))
    elif preset == "flash":
        native = torch.randn(shape, dtype=torch.bfloat16)
        return launch.Operands(native, native.clone(), native.clone(),
                               launch._switches(ak.QK_NATIVE, ak.P_NATIVE, ak.V_NATIVE))
    elif preset == "fp8":
        gq, gk = fp8_group_sizes(opts.granularity, LENGTH, LENGTH)
        fp8 = int8.to(torch.float8_e4m3fn)
        ops = launch.Operands(fp8, fp8.clone(), v_t.to(torch.float8_e4m3fn),
                              launch._switches(ak.QK_FP8, ak.P_FP8, ak.V_FP8),
                              v_scale=_scale(gk), v_group=gk, v_transposed=True)
    else:
        raise ValueError(f"no operands for preset {preset!r}; choose from {PRESETS}")
    ops.q_scale, ops.q_group = _scale(gq), gq
    ops.k_scale, ops.k_group = _scale(gk), gk
    return ops


def compile_for_sm90(preset: str, dim: int, causal: bool, cfg: AttentionConfig,
                     options: dict | None = None):
    """The attention kernel as :func:`launch._launch` would run it for ``preset`` with
    ``options``, compiled for sm_90 (a ``CompiledKernel``)."""
    out = torch.empty(BATCH, HEADS, LENGTH, dim, dtype=torch.bfloat16)
    args, kwargs = decode_sass.capture_launch(
        launch,
        lambda: launch._launch(operands(preset, dim, options), out, (BATCH, HEADS, HEADS, LENGTH, LENGTH, dim),
                               None, causal, 0.1, cfg, "ieee"),
        launcher=lambda kernel, like: decode_sass.INTERCEPT, interpreted=lambda device: False,
        ensure_tma_allocator=lambda: None)
    return decode_sass.compile_launch(ak.attention_kernel, args, kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="*", help="NAME=JSON AttentionConfig fields (default: the table's)")
    parser.add_argument("--presets", nargs="+", choices=PRESETS, default=list(PRESETS))
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--dump", type=Path, help="write TTGIR/PTX/SASS of each variant here")
    parser.add_argument("--traced", action="store_true",
                        help="the table's entry for a traced call (no register cap)")
    parser.add_argument("--options", type=json.loads, default=None,
                        help="preset options as JSON, for every preset")
    args = parser.parse_args()
    for preset in args.presets:
        table = _table_config(_base_preset(preset), args.dim, "sm90", torch.bfloat16,
                              native_pv=preset.endswith(_NATIVE_PV_SUFFIX),
                              unmasked=not args.causal, causal_only=args.causal,
                              register_cap=not args.traced)
        variants = [v.partition("=") for v in args.variants] or [("table", "=", "")]
        for name, _, fields in variants:
            cfg = AttentionConfig(**json.loads(fields)) if fields else table
            kernel = compile_for_sm90(preset, args.dim, args.causal, cfg, args.options)
            title = f"{name} {preset} D={args.dim}{' causal' if args.causal else ''} {cfg}"
            print("\n".join(decode_sass.summary(kernel, title, args.dump, f"{name}.{preset}")))


if __name__ == "__main__":
    main()
