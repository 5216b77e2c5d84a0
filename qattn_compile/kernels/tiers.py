"""Which kernel tier serves an attention call, and why: the one place for that rule.

- Tier 1 (``"triton"``): the Triton ``tl`` kernels of :mod:`.attention`. Every preset, every
  GPU, interpretable on CPU; Inductor inlines them into compiled graphs.
- Tier 2 (``"gluon"``): the Hopper warp-specialized Gluon kernels of :mod:`.hopper`. An
  opaque op in compiled graphs (Inductor cannot inline a Gluon kernel); they read the
  operands tier 1's quantizers prepare, so the preset's math and its reference are the same.

A call goes to tier 2 when :func:`tier2_refusal` finds nothing against it; the refusal is a
sentence that ``explain`` prints and the logs carry. :data:`TIER2_TABLE` holds where tier 2
is the faster one, from the measurements in ``docs/performance.md``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from ..presets import resolve_options

TESTED_TRITON = ("3.6.0",)
"""Triton releases tier 2 was compiled and checked on (Gluon's API changes between them)."""
PRESETS = ("fp8", "sage2_8b")
FP8_GRANULARITIES = ("block", "tensor")
"""fp8's granularities whose K and V scales span whole 256-key tiles (one scale per tile)."""


@dataclass(frozen=True)
class Tier2Config:
    """The Gluon kernel's tiles: keys per tile, K/V ring depth, registers per thread of the
    consumer warpgroups and of the producer warp after reallocation."""

    block_n: int = 256
    stages: int = 3
    consumer_regs: int = 232
    producer_regs: int = 24


@dataclass(frozen=True)
class Tier2Row:
    """Where tier 2 beats tier 1 (H200, Triton 3.6; ``docs/performance.md``): calls of this
    preset, head dim and causality with at least ``min_length`` queries and keys, and the
    kernel's tiles for them."""

    preset: str
    head_dim: int
    causal: bool
    min_length: int
    config: Tier2Config


TIER2_TABLE = (
    Tier2Row("fp8", 128, False, 2048, Tier2Config(block_n=256, stages=3, consumer_regs=232)),
    Tier2Row("fp8", 128, True, 16384, Tier2Config(block_n=256, stages=2, consumer_regs=240)),
)
"""One row per (preset, head dim, causal) that tier 2 serves: fp8 at D=128. Not in it (tier
1 is as fast or faster there on the H200): fp8 at D=64, and sage2_8b, whose formats the
kernel computes (``tier="gluon"`` runs them) at 0.65× tier 1's speed so far."""

FORCED_TILES = {"sage2_8b": Tier2Config(block_n=128, stages=3, consumer_regs=232)}
"""Tiles of a forced tier-2 call of a preset without a row (256-key tiles spill with
sage2_8b's per-key K scales and ΔS)."""


def _row(preset: str, head_dim: int, causal: bool) -> Tier2Row | None:
    return next((r for r in TIER2_TABLE if (r.preset, r.head_dim, r.causal) == (preset, head_dim, causal)),
                None)


def tier2_config(preset: str, head_dim: int, causal: bool) -> Tier2Config:
    """The Gluon kernel's tiles for a call that :func:`tier2_refusal` lets through (a forced
    call without a row takes :data:`FORCED_TILES`, else the D=128 row's tiles)."""
    row = _row(preset, head_dim, causal) or _row(preset, 128, causal)
    return row.config if row is not None else FORCED_TILES[preset]


@functools.lru_cache(maxsize=None)
def _gluon_available() -> str | None:
    """Why this process cannot run Gluon kernels (a sentence), or None."""
    if triton.__version__ not in TESTED_TRITON:
        return (f"Triton {triton.__version__} is not one tier 2 was tested on "
                f"({', '.join(TESTED_TRITON)})")
    try:
        from . import hopper  # noqa: F401
    except ImportError as exc:
        return f"Gluon does not import ({exc})"
    return None


def _format_refusal(preset: str, options) -> str | None:
    """Why the preset's options take formats tier 2 does not read (a sentence), or None."""
    opts = resolve_options(preset, options)
    if preset == "fp8" and opts.granularity not in FP8_GRANULARITIES:
        return (f"fp8 granularity {opts.granularity!r} (tier 2 takes one K and V scale per "
                f"256-key tile: {', '.join(FP8_GRANULARITIES)})")
    if preset == "sage2_8b" and opts.pv != "fp8":
        return "sage2_8b `pv: fp16` (tier 2 takes FP8 P and V)"
    return None


def tier2_refusal(preset: str, options, q_shape, k_shape, v_shape,
                  dtype: torch.dtype, device: torch.device, *, masked: bool,
                  scale: float | None, causal: bool, softcap: float = 0.0,
                  alibi: bool = False, forced: bool = False) -> str | None:
    """Why tier 2 does not serve this call (a sentence), or None when it does.

    Shapes ``[B, H, L, D]`` (ints, or size hints of symbolic sizes); ``options``: the
    preset's (dict, :class:`~qattn_compile.presets.PresetOptions` or None); ``masked``: a
    tensor mask remains after causality is taken out;
    ``scale``: the softmax scale (None = ``1/sqrt(D)``); ``causal``: top-left causal;
    ``softcap``: the soft cap (0 = none); ``alibi``: ALiBi slopes are given; ``forced``: the
    caller asks for tier 2, so only
    what it cannot compute counts, not where :data:`TIER2_TABLE` says tier 1 is the faster
    choice.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return f"device {device} (tier 2 runs on Hopper GPUs)"
    if preset not in PRESETS:
        return f"preset {preset!r} has no tier-2 kernel (tier 2 serves {', '.join(PRESETS)})"
    from .heuristics import capability

    if capability(device) != (9, 0):
        major, minor = capability(device)
        return f"sm_{major}{minor} (tier 2 is written for Hopper, sm_90)"
    format_refusal = _format_refusal(preset, options)
    if format_refusal is not None:
        return format_refusal
    d, dv = q_shape[-1], v_shape[-1]
    if d != dv or d not in (64, 128):
        return f"head dims {d}/{dv} (the tier-2 kernel takes 64 or 128, equal)"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {dtype} (tier 2 takes float16 or bfloat16)"
    if masked:
        return "a tensor mask (tier 2 takes causal or no mask)"
    if softcap or alibi:
        return "logit soft-capping or ALiBi (tier 2 applies neither)"
    if scale is not None and not scale > 0:
        return f"softmax scale {scale} (tier 2 folds a positive scale into the exponent)"
    reason = _gluon_available()
    if reason is not None or forced:
        return reason
    row = _row(preset, d, causal)
    kind = "causal" if causal else "non-causal"
    if row is None:
        return f"{preset} at head dim {d} {kind}: tier 1 is as fast or faster there"
    if min(q_shape[-2], k_shape[-2]) < row.min_length:
        return (f"sequence lengths {q_shape[-2]}/{k_shape[-2]} < {row.min_length} at head dim "
                f"{d} {kind}: tier 1 is as fast or faster there")
    return None
