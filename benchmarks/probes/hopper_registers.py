"""Tier 2's Gluon kernel compiled for the H100/H200 (sm_90) on a CPU machine: registers,
stack (spills) and shared memory per variant. No GPU needed.

Gluon has no interpreter and its API moves between Triton releases, so compile against the
GPU machine's Triton (3.6.0) in a side environment, from the repository root::

    python3 -m venv /tmp/g36 && /tmp/g36/bin/pip install -q triton==3.6.0 torch==2.13.0 \\
        pydantic pyyaml transformers
    PYTHONPATH=. /tmp/g36/bin/python benchmarks/probes/hopper_registers.py

Each row is one constexpr variant of :func:`qattn_compile.kernels.hopper._attention_kernel`
(format, head dim, key tile, stages, consumer registers, causal). A ``STACK`` above 0 means
spills: the 256-key tiles of sage2_8b's formats spill 600–900 bytes, fp8's causal variant at
240 registers about 200 (docs/performance.md). This reads Triton internals (a stand-in driver
that names the target, ``JITFunction.warmup``); the bundled ``cuobjdump`` reports the usage.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

from qattn_compile.kernels import hopper


class _Sm90:
    """The parts of a GPU driver the JIT asks for when it only compiles."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


driver.set_active(_Sm90())

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
LENGTH = 1000


def compile_variant(fmt: str, d: int, block_n: int, stages: int, causal: bool, regs: int):
    """The compiled kernel of one variant on empty CPU tensors of the kernel's layouts."""
    sage = fmt == "sage2_8b"
    dtype = torch.int8 if sage else torch.float8_e4m3fn
    q = torch.empty(1, 2, LENGTH, d, dtype=dtype)
    k = torch.empty(1, 1, LENGTH, d, dtype=dtype)
    vt = torch.empty(1, 1, d, 1024, dtype=torch.float8_e4m3fn)
    q_scale, k_scale = torch.empty(1, 2, LENGTH), torch.empty(1, 1, 16)
    v_scale = torch.empty(1, 1, d) if sage else torch.empty(1, 1, 4)
    delta_s, v_mean = torch.empty(1, 2, 8, LENGTH), torch.empty(1, 1, 1, d)
    out = torch.empty(1, 2, LENGTH, d, dtype=torch.bfloat16)
    descs = (hopper._descriptor(q.view(-1, d), [hopper.BLOCK_M, d]),
             hopper._descriptor(k.view(-1, d), [block_n, d]),
             hopper._descriptor(vt.view(-1, vt.shape[-1]), [d, block_n]))
    return hopper._attention_kernel.warmup(
        *descs, out, out, q_scale, k_scale, v_scale, delta_s, v_mean, LENGTH, LENGTH, 2, 2,
        *out.stride(), *q_scale.stride(), *k_scale.stride(), *v_scale.stride(),
        *delta_s.stride()[:3], *v_mean.stride()[:2],
        D=d, IS_CAUSAL=causal, Q_GROUP=16 if sage else 1, K_GROUP=64 if sage else 256,
        V_GROUP=1 if sage else 256, QK_INT8=sage, HAS_DS=sage, DS_GROUP=128,
        V_PER_CHANNEL=sage, SMOOTH_V=False, RETURN_LSE=False, SATURATE_FP16=False,
        BLOCK_N=block_n, STAGES=stages, CONSUMER_REGS=regs, PRODUCER_REGS=24, num_warps=4,
        grid=(1,))


def usage(kernel) -> str:
    """``REG:n STACK:n`` of a compiled kernel's cubin, from ``cuobjdump``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        report = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name],
                                capture_output=True, text=True, check=True).stdout
    return " ".join(re.findall(r"(REG:\d+|STACK:\d+)", report))


def main() -> None:
    variants = itertools.product(["fp8", "sage2_8b"], [128, 64], [256, 128], [2, 3],
                                 [False, True], [232, 240])
    for fmt, d, block_n, stages, causal, regs in variants:
        kernel = compile_variant(fmt, d, block_n, stages, causal, regs)
        print(f"{fmt:8s} D={d:3d} keys={block_n} stages={stages} causal={causal!s:5s} "
              f"regs={regs}: {usage(kernel)} shared={kernel.metadata.shared}", flush=True)


if __name__ == "__main__":
    main()
