"""The FlashQ decode kernel compiled for the H100 (sm_90) on a CPU machine: registers, shared
memory, and what its loops spend their instructions on. No GPU needed.

Run on the CPU machine from the repository root (about 10 s per variant)::

    .venv/bin/python benchmarks/probes/decode_sass.py [--format int4|int2|mix] [--dump DIR] \\
        [NAME='{"blocks_per_iter": 2, "num_warps": 2}' ...]

Each ``NAME=JSON`` is a :class:`~qattn_compile.kvcache.kernel.DecodeConfig` (none: the
default). The launch of :func:`~qattn_compile.kvcache.kernel.flashq_decode_triton` for the
benchmark's head layout (GQA 32/8, D=128, bf16) is intercepted, and its arguments are
specialised the way Triton's JIT does (integer 1 → constexpr, divisibility by 16). The kernel
is then compiled for ``GPUTarget("cuda", 90, 32)`` with the ptxas/nvdisasm bundled in the
Triton wheel. A 2/4 mix is a single launch holding both code paths.

Printed per variant: registers per thread, shared memory per program, and for each loop
with tensor-core instructions the count of its instructions by class. These are per
iteration, so per tile of ``blocks_per_iter`` 64-token blocks, per warp. One of the loops is
the INT8 buffer's, which runs in one program per batch and kv head: the one with hundreds
of ``PRMT`` and no ``LOP3``/``SHF`` unpacking. Also printed: the
TTGIR ops in those loops that move data between layouts (``convert_layout``,
``local_alloc``/``local_load``). ``--dump DIR`` writes the TTGIR, PTX and SASS of each
variant.

This reads Triton internals (the JIT's binder, ``triton.compile`` on an ``ASTSource``).
Written against Triton 3.9; another version may need this file adapted. The GPU machine runs
Triton 3.6, so counts there can differ a little (session 6: 1593 against the GPU's own 1585).
What it is good for: seeing whether a change to the kernel removes shared-memory round trips
or register moves before spending device time on it (docs/archive/NOTES.md, session 5). What it
is not: a timing model. A variant with 22 % fewer instructions and 50 fewer registers ran
1.25× slower because it put two shared-memory round trips on the chain from scores to P·V
(NOTES, session 6); for where a one-warp program waits, profile on the GPU (Nsight Compute's
source counters).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

import qattn_compile.kvcache.kernel as decode  # noqa: E402
from qattn_compile.kvcache import FlashQLayer  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
INT2_HEADS = {"int4": 0, "mix": 4, "int2": 8}
CLASSES = {
    "HMMA": ("HMMA",),
    "GMMA": ("HGMMA", "IGMMA", "QGMMA"),
    "LDS/LDSM": ("LDS",),
    "STS/STSM": ("STS",),
    "LDGSTS": ("LDGSTS",),
    "LDG": ("LDG.",),
    "LDL/STL (spills)": ("LDL", "STL"),
    "BAR": ("BAR",),
    "SHFL": ("SHFL",),
    "MOV": ("IMAD.MOV", "MOV"),
    "LOP3/SHF": ("LOP3", "SHF"),
    "PRMT": ("PRMT",),
    "F*": ("FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "FSETP"),
    "MUFU": ("MUFU",),
    "I2F/F2I": ("I2F", "F2I"),
    "F2FP": ("F2FP",),
}
_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


class _Launch(Exception):
    """Raised in place of the kernel launch, carrying its arguments."""


class _Intercept:
    """Stands for a ``@triton.jit`` kernel: ``kernel[grid](...)`` raises :class:`_Launch`."""

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            raise _Launch(args, kwargs)
        return launch


INTERCEPT = _Intercept()


def capture_launch(module, run, **replacements):
    """``(args, kwargs)`` of the first kernel launch that ``run()`` makes with ``module``'s
    attributes replaced as given (the kernel, or what returns it, replaced by or returning
    :data:`INTERCEPT`); the attributes are restored afterwards."""
    saved = {name: getattr(module, name) for name in replacements}
    for name, value in replacements.items():
        setattr(module, name, value)
    try:
        run()
    except _Launch as call:
        return call.args
    finally:
        for name, value in saved.items():
            setattr(module, name, value)
    raise RuntimeError(f"no kernel was launched by {module.__name__}")


def launch_arguments(config: decode.DecodeConfig, int2_heads: int):
    """(args, kwargs) the launcher passes to the decode kernel for a small cache of the
    benchmark's head layout."""
    torch.manual_seed(0)
    layer = FlashQLayer(4096, int2_heads)
    k = torch.randn(2, 8, 2000, 128, dtype=torch.bfloat16)
    layer.append(k, torch.randn_like(k))
    q = torch.randn(2, 32, 1, 128, dtype=torch.bfloat16)
    return capture_launch(decode, lambda: decode.flashq_decode_triton(q, layer.tensors(), None, None, config),
                          _flashq_decode_kernel=INTERCEPT, interpreted=lambda device: None)


def compile_for_sm90(config: decode.DecodeConfig, int2_heads: int):
    """The decode kernel for ``config`` compiled for sm_90 (a ``CompiledKernel``)."""
    args, kwargs = launch_arguments(config, int2_heads)
    return compile_launch(decode._flashq_decode_kernel, args, kwargs)


def compile_launch(fn, args, kwargs):
    """The ``@triton.jit`` kernel ``fn`` compiled for sm_90 with the arguments of one launch
    (CPU tensors stand for device ones), specialised as Triton's JIT would."""
    backend = make_backend(TARGET)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET, options=options.__dict__)


def _cuobjdump(cubin: bytes, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(TOOLS / "cuobjdump"), flag, f.name], capture_output=True, text=True,
                              check=True).stdout


def mma_loops(sass: str) -> list[list[str]]:
    """Opcodes of each loop body (a backward branch's range) that holds tensor-core
    instructions, longest first."""
    matches = (_INSTRUCTION.search(line) for line in sass.splitlines())
    code = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in matches if m]
    index = {address: i for i, (address, _, _) in enumerate(code)}
    loops = []
    for i, (address, opcode, operands) in enumerate(code):
        target = re.search(r"0x([0-9a-f]+)", operands) if opcode.startswith("BRA") else None
        if target and int(target.group(1), 16) <= address and int(target.group(1), 16) in index:
            body = [op for _, op, _ in code[index[int(target.group(1), 16)]: i + 1]]
            if any(op.startswith(CLASSES["HMMA"] + CLASSES["GMMA"]) for op in body):
                loops.append(body)
    return sorted(loops, key=len, reverse=True)


def ttgir_movements(ttgir: str) -> Counter:
    """Layout-moving TTGIR ops inside ``scf.for`` bodies."""
    ops = ("ttg.convert_layout", "ttg.local_alloc", "ttg.local_load", "ttg.async_copy_global_to_local")
    inside, out = False, Counter()
    for line in ttgir.splitlines():
        inside = inside or "scf.for" in line
        if inside:
            out.update(op for op in ops if f"= {op} " in line)
    return out


def summary(kernel, title: str, dump: Path | None, dump_name: str) -> list[str]:
    """Registers, shared memory and, per loop with tensor-core instructions, its instruction
    counts by class (:data:`CLASSES`) and the layout moves of the TTGIR loops; ``dump``
    writes the TTGIR, PTX and SASS as ``dump_name.{ttgir,ptx,sass}``."""
    cubin = kernel.asm["cubin"]
    sass = _cuobjdump(cubin, "-sass")
    registers = re.search(r"REG:(\d+)", _cuobjdump(cubin, "--dump-resource-usage"))
    if dump:
        dump.mkdir(parents=True, exist_ok=True)
        for ext in ("ttgir", "ptx"):
            (dump / f"{dump_name}.{ext}").write_text(kernel.asm[ext])
        (dump / f"{dump_name}.sass").write_text(sass)
    lines = [f"{title}: {registers.group(1) if registers else '?'} registers, "
             f"{kernel.metadata.shared} B shared memory"]
    for body in mma_loops(sass):
        counts = {label: sum(op.startswith(prefixes) for op in body) for label, prefixes in CLASSES.items()}
        lines.append(f"  loop of {len(body)} instructions per warp: "
                     + ", ".join(f"{label} {n}" for label, n in counts.items() if n))
    moves = sorted(ttgir_movements(kernel.asm["ttgir"]).items())
    lines.append("  TTGIR in loops: " + ", ".join(f"{op} {n}" for op, n in moves))
    return lines


def report(name: str, config: decode.DecodeConfig, fmt: str, dump: Path | None) -> str:
    kernel = compile_for_sm90(config, INT2_HEADS[fmt])
    return "\n".join(summary(kernel, f"{name} [{fmt}] {config}", dump, f"{name}.{fmt}"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="*", help="NAME=JSON DecodeConfig fields (default: the default config)")
    parser.add_argument("--format", choices=sorted(INT2_HEADS), default="int4")
    parser.add_argument("--dump", type=Path, help="write TTGIR/PTX/SASS of each variant here")
    args = parser.parse_args()
    variants = [v.partition("=") for v in args.variants] or [("default", "=", "{}")]
    for name, _, fields in variants:
        print(report(name, decode.DecodeConfig(**json.loads(fields or "{}")), args.format, args.dump))


if __name__ == "__main__":
    main()
