"""The one table of launch parameters (tile sizes, warps, pipeline stages) for every kernel.

Attention kernels are looked up by ``(preset, padded head dim, arch)``, with a few entries
for short key lengths (:data:`_SHORT_KEYS`) and for calls without any mask
(:data:`_UNMASKED`); quantizer kernels by ``(padded head dim, arch)``. ``arch`` is
``"sm90"`` (Hopper), ``"sm80"`` (Ampere/Ada and anything else with CUDA) or ``"interp"``
(the Triton interpreter on CPU tensors, where small tiles keep tests fast and still cover
several tiles per row). The candidates the autotuner times (:func:`attention_candidates`,
:mod:`.autotune`) live here too, under the same constraints, and the grid's order
(:func:`grid_head_group`: causal calls start the longest query tiles of a group of heads
first).

Constraints the launchers rely on (checked by :func:`attention_config`):

- ``block_n`` divides V's tokens per scale whenever V carries one scale per block of tokens
  (``v_block``: :data:`~qattn_compile.blocks.QUANT_BLOCK_KV`, or ``fp8``'s and
  ``int_flash``'s :data:`~qattn_compile.blocks.FP8_BLOCK`; a tile of V tokens then has one
  scale);
- ``block_m`` divides :data:`~qattn_compile.blocks.SMOOTH_Q_BLOCK` (a query tile then shares
  one Q-smoothing mean, so ΔS is one row per tile), and with ΔS ``block_n`` is at most twice
  it (a causal call's ΔS leaves unwritten the keys no such tile reaches,
  :func:`~.quantize.delta_s`);
- ``block_n`` is a multiple of :data:`~qattn_compile.blocks.V_KEY_BLOCK` (the 8-bit V's
  token permutation, which the kernel undoes per key tile) and of :data:`V_COLSUM_TOKENS`
  (fmha_int8's launcher adds that many tokens' V̂ sums up per key tile).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch

from ..blocks import SMOOTH_Q_BLOCK, V_KEY_BLOCK


V_COLSUM_TOKENS = 32
"""Tokens per int32 channel sum of V̂ written by the quantizer for fmha_int8's UINT8-P
correction; every ``block_n`` is a multiple of it (the launcher adds ``block_n / 32`` of them
up per key tile, which the kernel reads as one row)."""


MAX_GRID_AXIS = 65535
"""CUDA's limit on a grid's second and third axes, which hold the attention kernel's query
tiles and its groups of heads (:func:`grid_head_group`)."""
MIN_BLOCK_M = 32
"""The smallest query tile any config may have (:func:`attention_config` checks): with
:data:`MAX_GRID_AXIS` it bounds the query length a call may have."""


@dataclass(frozen=True)
class AttentionConfig:
    """Launch parameters of the attention kernel: a ``block_m`` × ``block_n`` score tile."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False
    """K/V tiles through TMA descriptors (Hopper; only where the operands are aligned)."""
    maxnreg: int | None = None
    """Registers per thread the compiler may allocate (ptxas ``.maxnreg``); None leaves it
    its own choice. A cap lets one more program share an SM's 64 K registers: 168 for three
    4-warp programs, 128 for four. Only a launch on real CUDA tensors can pass it
    (:func:`~.primitives.launch_takes_register_cap`): Inductor's code for a user Triton
    kernel does not carry it, so traced calls get uncapped tiles (``register_cap``)."""


@dataclass(frozen=True)
class QuantConfig:
    """Launch parameters of the quantizer kernels: ``block_t`` tokens per program step."""

    block_t: int
    num_warps: int


_PRESETS = ("flash", "int_flash", "fmha_int8", "sage2_8b", "sage2_4b", "turbo", "fp8")
_DIMS = (32, 64, 128, 256)

# Defaults per operand width (bytes of the dot operands) × padded head dim × arch.
# sm90: the tiles a kernel-alone sweep chose (benchmarks/probes/sweep.py; docs/performance.md).
# One warpgroup per program (4 warps, 64 query rows) wins at D=64 and D=128: a 64-row
# program's registers let two programs share an SM and run unsynchronised, so one's softmax
# overlaps the other's tensor-core work, where an 8-warp 128-row program keeps its two
# warpgroups in lockstep at the barriers that guard its shared buffers (our reading of an
# Nsight profile; the sweep is what chose the tiles). 64×64 tiles (three or four programs per
# SM) win for flash at D=128 and for turbo at D=64; sage2_4b keeps 128×64 pointer loads at
# D=64. 256-wide heads need 8 warps on a 64-row tile. Warp specialization is not used:
# Triton 3.6 miscompiles our loop with it (benchmarks/probes/loop_ceiling.py re-checks it).
_SM90_ONE_WARPGROUP = AttentionConfig(64, 128, 4, 3, tma=True)
_SM90_ONE_WARPGROUP_SQUARE = AttentionConfig(64, 64, 4, 3, tma=True)
_FAMILY_DEFAULTS: dict[tuple[str, int, str], AttentionConfig] = {
    ("8bit", 32, "sm90"): _SM90_ONE_WARPGROUP,
    ("8bit", 64, "sm90"): _SM90_ONE_WARPGROUP,
    ("8bit", 128, "sm90"): _SM90_ONE_WARPGROUP,
    ("8bit", 256, "sm90"): AttentionConfig(64, 32, 8, 2),
    ("16bit", 32, "sm90"): AttentionConfig(128, 64, 4, 3),
    ("16bit", 64, "sm90"): AttentionConfig(64, 128, 4, 2, tma=True),
    ("16bit", 128, "sm90"): _SM90_ONE_WARPGROUP_SQUARE,
    ("16bit", 256, "sm90"): AttentionConfig(64, 32, 8, 2),
    ("32bit", 32, "sm90"): AttentionConfig(64, 32, 4, 2),
    ("32bit", 64, "sm90"): AttentionConfig(64, 32, 4, 2),
    ("32bit", 128, "sm90"): AttentionConfig(64, 32, 4, 2),
    ("32bit", 256, "sm90"): AttentionConfig(32, 32, 4, 1),
    # Ampere-class and unknown CUDA GPUs: conservative shapes.
    ("8bit", 32, "sm80"): AttentionConfig(64, 64, 4, 2),
    ("8bit", 64, "sm80"): AttentionConfig(64, 64, 4, 2),
    ("8bit", 128, "sm80"): AttentionConfig(64, 64, 4, 2),
    ("8bit", 256, "sm80"): AttentionConfig(64, 32, 8, 1),
    ("16bit", 32, "sm80"): AttentionConfig(64, 64, 4, 2),
    ("16bit", 64, "sm80"): AttentionConfig(64, 64, 4, 2),
    ("16bit", 128, "sm80"): AttentionConfig(64, 32, 4, 2),
    ("16bit", 256, "sm80"): AttentionConfig(32, 32, 4, 1),
    ("32bit", 32, "sm80"): AttentionConfig(64, 32, 4, 1),
    ("32bit", 64, "sm80"): AttentionConfig(64, 32, 4, 1),
    ("32bit", 128, "sm80"): AttentionConfig(32, 32, 4, 1),
    ("32bit", 256, "sm80"): AttentionConfig(32, 32, 4, 1),
}

# Measured per-preset winners that differ from their family default (docs/performance.md):
# turbo takes 64×64 because its V blocks of 64 tokens forbid 128-key tiles; sage2_4b is
# faster with 128×64 pointer loads at D=64. D=32 (not measured) follows D=64. sage2_8b keeps
# the family's 64×128 at D=64 since its K scales apply per half tile instead of per key.
_MEASURED: dict[tuple[str, int, str], AttentionConfig] = {
    **{(preset, dim, "sm90"): cfg
       for preset, cfg in (("turbo", _SM90_ONE_WARPGROUP_SQUARE),
                           ("sage2_4b", AttentionConfig(128, 64, 4, 3)))
       for dim in (32, 64)},
    ("turbo", 128, "sm90"): _SM90_ONE_WARPGROUP_SQUARE,
}

# Quantized Q·Kᵀ with a native (16-bit) P·V, e.g. sage2 with ``pv: fp16``, where it differs
# from the preset's entry: sage2_8b at D=128 is faster with 128×64 TMA tiles and 4 warps than
# with the preset's 64×128; at D=64 the preset's tile wins (docs/performance.md).
_NATIVE_PV: dict[tuple[str, int, str], AttentionConfig] = {
    ("sage2_8b", 128, "sm90"): AttentionConfig(128, 64, 4, 3, tma=True),
}


# Short sequences, where the table's long-sequence tile loses (keys at most the first value:
# the second config), measured as CUDA-graph replays of the kernel alone
# (benchmarks/probes/sweep.py --graph; docs/performance.md). int_flash keeps its tile; a
# native P·V was not measured, so it keeps the table's. fp8 at D=64 and 1K takes 64×64
# pointer loads, faster for causal calls (the common short call) though slightly slower
# without a mask.
_SHORT_KEYS: dict[tuple[str, int, str], tuple[int, AttentionConfig]] = {
    ("sage2_8b", 128, "sm90"): (4096, _SM90_ONE_WARPGROUP_SQUARE),
    ("fp8", 128, "sm90"): (2048, _SM90_ONE_WARPGROUP_SQUARE),
    ("sage2_8b", 64, "sm90"): (1024, AttentionConfig(64, 64, 4, 3)),
    ("fp8", 64, "sm90"): (1024, AttentionConfig(64, 64, 4, 3)),
}


# Calls without any mask (no causal flag, no tensor mask), where another tile wins (long
# sequences; short ones keep :data:`_SHORT_KEYS`). fp8 at D=128 with two pipeline stages fits
# three programs per SM instead of two (registers and shared memory): faster without a mask,
# slower with a causal one (docs/performance.md). Tensor masks were not measured, so they
# keep the table's tile.
_UNMASKED: dict[tuple[str, int, str], AttentionConfig] = {
    ("fp8", 128, "sm90"): AttentionConfig(64, 128, 4, 2, tma=True),
}


# Register-capped tiles, for launches that can pass ``maxnreg`` (eager calls on CUDA
# tensors; ``register_cap``), by (preset, padded head dim, arch, mask kind: ``none`` without
# any mask, ``causal`` for the causal flag without a tensor mask), for at least
# :data:`_CAPPED_MIN_KEYS` keys. At D=128, two pipeline stages and 168 registers let three
# 4-warp programs share an SM where the uncapped tiles fit two; at D=64, 128 registers let
# four share it instead of three. A (preset, mask kind) has an entry only where the capped
# kernel measured faster, kernel alone, with little or no spilling under the cap
# (docs/performance.md). fp8 without a mask already fits three per SM uncapped
# (:data:`_UNMASKED`). Kernels that now compile within their cap uncapped keep it: the cap
# states the occupancy the entry was measured at. int_flash's D=64 causal tile stays at 168:
# at 128 it spills with per-token K.
_THREE_PER_SM = AttentionConfig(64, 128, 4, 2, tma=True, maxnreg=168)
_FOUR_PER_SM = AttentionConfig(64, 128, 4, 3, tma=True, maxnreg=128)
_THREE_PER_SM_D64 = AttentionConfig(64, 128, 4, 3, tma=True, maxnreg=168)
_REGISTER_CAPPED: dict[tuple[str, int, str, str], AttentionConfig] = {
    ("sage2_8b", 128, "sm90", "none"): _THREE_PER_SM,
    ("sage2_8b", 128, "sm90", "causal"): _THREE_PER_SM,
    ("fmha_int8", 128, "sm90", "none"): _THREE_PER_SM,
    ("fmha_int8", 128, "sm90", "causal"): _THREE_PER_SM,
    ("fp8", 128, "sm90", "causal"): _THREE_PER_SM,
    ("int_flash", 128, "sm90", "none"): _THREE_PER_SM,
    ("int_flash", 128, "sm90", "causal"): _THREE_PER_SM,
    ("sage2_8b", 64, "sm90", "none"): _FOUR_PER_SM,
    ("fp8", 64, "sm90", "causal"): _FOUR_PER_SM,
    ("sage2_8b", 64, "sm90", "causal"): _FOUR_PER_SM,
    ("int_flash", 64, "sm90", "causal"): _THREE_PER_SM_D64,
}
_CAPPED_MIN_KEYS = 4096
"""Keys from which :data:`_REGISTER_CAPPED` applies (before :data:`_SHORT_KEYS`): its tiles
were measured at 4K and 16K; shorter calls keep the table's and :data:`_SHORT_KEYS`'
uncapped tiles."""


def _family(preset: str, dtype: torch.dtype) -> str:
    """Operand width family: quantized presets use 8-bit dots, ``flash`` the input dtype."""
    if preset != "flash":
        return "8bit"
    return {torch.float32: "32bit"}.get(dtype, "16bit")


def _table_key_dtype(dtype: torch.dtype) -> str:
    """The dtype part of a table key: only ``flash`` tiles depend on the input dtype."""
    return "fp32" if dtype == torch.float32 else "16bit"


# THE table: (preset, input dtype class, padded head dim, arch) -> AttentionConfig.
_ATTENTION_TABLE: dict[tuple[str, str, int, str], AttentionConfig] = {
    (preset, dt, dim, arch): _MEASURED.get(
        (preset, dim, arch),
        _FAMILY_DEFAULTS[(_family(preset, torch.float32 if dt == "fp32" else torch.float16),
                          dim, arch)],
    )
    for preset in _PRESETS
    for dt in ("16bit", "fp32")
    for dim in _DIMS
    for arch in ("sm90", "sm80")
}

# The interpreter: every head dim, every family (tests cover several tiles per row).
_INTERP_ATTENTION = AttentionConfig(32, 32, 4, 1)

_QUANT_TABLE: dict[str, QuantConfig] = {
    "sm90": QuantConfig(block_t=64, num_warps=4),
    "sm80": QuantConfig(block_t=64, num_warps=4),
    "interp": QuantConfig(block_t=32, num_warps=4),
}


def capability(device: torch.device) -> tuple[int, int]:
    """Compute capability ``(major, minor)`` of a CUDA ``device`` (cached per GPU: launchers
    ask on every call, and the driver query costs microseconds of host time)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def arch_of(device: torch.device) -> str:
    """``"interp"`` for CPU tensors (Triton interpreter), else ``"sm90"`` / ``"sm80"``."""
    if device.type != "cuda":
        return "interp"
    major, _ = capability(device)
    return "sm90" if major == 9 else "sm80"


def padded_dim(d: int) -> int:
    """Head dim rounded up to a power of two, at least 32 (the smallest reduction extent of
    an 8-bit ``tl.dot``)."""
    return max(32, 1 << (int(d) - 1).bit_length())


def qk_block_dim(head_dim: int, packed_int4: bool) -> int:
    """``BLOCK_D`` of the Q·Kᵀ dot: the padded head dim; packed INT4 runs two dots over half
    the channels each, which must still reach the 32-wide reduction of an 8-bit dot."""
    return max(padded_dim(head_dim), 64) if packed_int4 else padded_dim(head_dim)


def _constrained(cfg: AttentionConfig, v_block: int, smooth_q: bool) -> AttentionConfig:
    """``cfg`` shrunk to meet the divisibility constraints that apply (module docstring)."""
    if v_block:
        cfg = replace(cfg, block_n=math.gcd(cfg.block_n, v_block))
    if smooth_q:
        cfg = replace(cfg, block_m=math.gcd(cfg.block_m, SMOOTH_Q_BLOCK))
    return cfg


def _table_config(preset: str, head_dim: int, arch: str, dtype: torch.dtype,
                  native_pv: bool = False, keys: int | None = None,
                  unmasked: bool = False, causal_only: bool = False,
                  register_cap: bool = False) -> AttentionConfig:
    """The table entry (or the interpreter's tile) before the constraints; ``native_pv``: the
    preset's P·V runs on native (16-bit) P and V (:data:`_NATIVE_PV`); ``keys``: the call's
    key length, when known (:data:`_SHORT_KEYS`); ``unmasked``: every key is visible to
    every query (no causal flag, no tensor mask; :data:`_UNMASKED`); ``causal_only``: the
    causal flag without a tensor mask; ``register_cap``: the launch can pass ``maxnreg``
    (:data:`_REGISTER_CAPPED`)."""
    if arch == "interp":
        return _INTERP_ATTENTION
    dim = padded_dim(head_dim)
    if native_pv and (preset, dim, arch) in _NATIVE_PV:
        return _NATIVE_PV[(preset, dim, arch)]
    # a capped tile first: sage2_8b's D=128 short tile reaches 4096 keys, where the capped
    # one is faster (docs/performance.md)
    mask_kind = "none" if unmasked else "causal" if causal_only else "tensor"
    capped = _REGISTER_CAPPED.get((preset, dim, arch, mask_kind))
    if (capped is not None and register_cap and not native_pv
            and (keys is None or keys >= _CAPPED_MIN_KEYS)):
        return capped
    short = _SHORT_KEYS.get((preset, dim, arch))
    if short is not None and not native_pv and keys is not None and keys <= short[0]:
        return short[1]
    if unmasked and not native_pv and (preset, dim, arch) in _UNMASKED:
        return _UNMASKED[(preset, dim, arch)]
    return _ATTENTION_TABLE[(preset, _table_key_dtype(dtype), dim, arch)]


def _fitted_table_config(preset, head_dim, arch, dtype, native_pv, keys, unmasked,
                         causal_only, register_cap, v_block, smooth_q) -> AttentionConfig:
    """:func:`_table_config` shrunk to the constraints (:func:`_constrained`). A capped tile
    that the constraints would change gives way to the uncapped entry: its cap was chosen
    for that tile's registers."""
    table = _table_config(preset, head_dim, arch, dtype, native_pv, keys, unmasked,
                          causal_only, register_cap)
    cfg = _constrained(table, v_block, smooth_q)
    if table.maxnreg is not None and cfg != table:
        return _fitted_table_config(preset, head_dim, arch, dtype, native_pv, keys, unmasked,
                                    causal_only, False, v_block, smooth_q)
    return cfg


def attention_config(
    preset: str,
    head_dim: int,
    device: torch.device,
    dtype: torch.dtype = torch.float16,
    *,
    v_block: int = 0,
    smooth_q: bool = False,
    native_pv: bool = False,
    keys: int | None = None,
    unmasked: bool = False,
    causal_only: bool = False,
    register_cap: bool = False,
    override: AttentionConfig | None = None,
) -> AttentionConfig:
    """Tile sizes for the attention kernel of ``preset`` at ``head_dim`` on ``device`` for
    inputs of ``dtype`` and ``keys`` keys (None: the long-sequence entry), ``unmasked`` when
    no mask of any kind applies, ``causal_only`` for the causal flag without a tensor mask
    (``override``: a caller's choice, e.g. a benchmark sweep or the autotuner's pick).
    ``register_cap``: the launch can pass a register cap (``maxnreg``), so the table may
    answer with a capped tile; without it an ``override`` with a cap raises ``ValueError``.

    ``v_block`` (V's tokens per scale when V has one scale per block of tokens, else 0) and
    ``smooth_q`` state which divisibility constraints (module docstring) apply: a table
    entry is shrunk to meet them (e.g. ``int_flash`` with per-block V keeps 64-token key
    tiles); an ``override`` that breaks one raises ``ValueError``.
    ``native_pv``: a quantized preset whose P·V runs in 16 bits (sage2's ``pv: fp16``).
    """
    if override is not None:
        cfg = override
    else:
        cfg = _fitted_table_config(preset, head_dim, arch_of(device), dtype, native_pv, keys,
                                   unmasked, causal_only, register_cap, v_block, smooth_q)
    if cfg.maxnreg is not None and not register_cap:
        raise ValueError(f"maxnreg={cfg.maxnreg} needs an eager launch on CUDA tensors: "
                         "Inductor's code for a user Triton kernel does not pass it")
    if cfg.block_m < MIN_BLOCK_M:
        raise ValueError(f"block_m={cfg.block_m} must be at least {MIN_BLOCK_M}")
    for unit in sorted({V_KEY_BLOCK, V_COLSUM_TOKENS}):
        if cfg.block_n % unit:
            raise ValueError(f"block_n={cfg.block_n} must be a multiple of {unit}")
    if v_block and v_block % cfg.block_n:
        raise ValueError(f"block_n={cfg.block_n} must divide V's {v_block} tokens per scale")
    if smooth_q and SMOOTH_Q_BLOCK % cfg.block_m:
        raise ValueError(f"block_m={cfg.block_m} must divide SMOOTH_Q_BLOCK={SMOOTH_Q_BLOCK}")
    if smooth_q and cfg.block_n > 2 * SMOOTH_Q_BLOCK:
        raise ValueError(f"block_n={cfg.block_n} must be at most 2·SMOOTH_Q_BLOCK="
                         f"{2 * SMOOTH_Q_BLOCK} with ΔS")
    return cfg


GRID_GROUP_KV_BYTES = 16 << 20
"""Most K + V bytes that one group of the causal grid reads (:func:`grid_head_group`): about
a third of the H100/H200's 50 MB L2."""


def grid_head_group(is_causal: bool, hq_per_kv: int, n_heads: int | None,
                    kv_bytes_per_head: int | None) -> int:
    """How many query heads (consecutive in the batch-major ``B·Hq`` order) the attention grid
    interleaves: programs start group by group, and within a group query tile by query tile
    across the group's heads (grid ``(group, n_m, cdiv(B·Hq, group))``).

    A causal row tile's work grows with its index, and programs start in grid order. One head
    at a time (longest query tile first within each head) leaves
    the last heads' longest tiles starting near the end of the launch, a tail on a few SMs;
    interleaving heads starts every head's longest tile before any of its shorter ones
    (longest-processing-time-first). The price is L2 reuse: the programs in flight read the
    K/V of every kv head of their group, so a group holds as many kv heads as fit
    :data:`GRID_GROUP_KV_BYTES` (at least one, with all its query heads; all ``n_heads`` when
    everything fits). Non-causal calls (equal work per program, no tail to shorten) take one
    head at a time. Against one head at a time these groups measured faster or level, and
    one group of all heads slower where the K/V outgrow the L2 budget (docs/performance.md).

    ``n_heads``: ``B·Hq``; ``kv_bytes_per_head``: K and V bytes of one (batch, kv head) in
    the kernel's formats. Either may be None (a size without a hint): one kv head's heads.
    """
    if not is_causal:
        return 1
    if n_heads is None or kv_bytes_per_head is None:
        return hq_per_kv
    kv_heads = max(1, GRID_GROUP_KV_BYTES // max(1, kv_bytes_per_head))
    return max(1, min(n_heads, kv_heads * hq_per_kv))


# Autotuning candidates per arch and padded head dim (besides the table entry, tried first).
# sm90: the tiles the sweep (benchmarks/probes/sweep.py) found competitive for some preset
# or dim.
_SM90_SMALL_CANDIDATES = (
    _SM90_ONE_WARPGROUP,
    _SM90_ONE_WARPGROUP_SQUARE,
    AttentionConfig(64, 128, 4, 2, tma=True),
    AttentionConfig(128, 64, 4, 3, tma=True),
    AttentionConfig(128, 64, 4, 3),
    AttentionConfig(128, 64, 8, 3),
    AttentionConfig(64, 64, 4, 3),
    AttentionConfig(128, 128, 8, 2, tma=True),
)
_CANDIDATES: dict[tuple[str, int], tuple[AttentionConfig, ...]] = {
    ("sm90", 32): _SM90_SMALL_CANDIDATES,
    ("sm90", 64): _SM90_SMALL_CANDIDATES,
    ("sm90", 128): (
        _SM90_ONE_WARPGROUP,
        _SM90_ONE_WARPGROUP_SQUARE,
        AttentionConfig(64, 128, 4, 2, tma=True),
        AttentionConfig(128, 128, 8, 2, tma=True),
        AttentionConfig(128, 128, 8, 3, tma=True),
        AttentionConfig(128, 64, 8, 3, tma=True),
        AttentionConfig(128, 64, 4, 3, tma=True),
        AttentionConfig(128, 64, 8, 2),
        AttentionConfig(64, 64, 4, 3),
    ),
    ("sm90", 256): (
        AttentionConfig(64, 32, 8, 2),
        AttentionConfig(64, 64, 8, 2),
        AttentionConfig(128, 32, 8, 2),
        AttentionConfig(64, 32, 4, 2),
    ),
    **{("sm80", dim): (
        AttentionConfig(64, 64, 4, 2),
        AttentionConfig(128, 64, 4, 2),
        AttentionConfig(64, 32, 4, 2),
        AttentionConfig(128, 32, 8, 2),
    ) for dim in _DIMS},
    # the interpreter: a couple of tiles, so that tests exercise a real choice
    **{("interp", dim): (AttentionConfig(32, 32, 4, 1), AttentionConfig(64, 32, 4, 1)) for dim in _DIMS},
}


def attention_candidates(
    preset: str,
    head_dim: int,
    device: torch.device,
    dtype: torch.dtype = torch.float16,
    *,
    v_block: int = 0,
    smooth_q: bool = False,
    native_pv: bool = False,
    keys: int | None = None,
    unmasked: bool = False,
    causal_only: bool = False,
    register_cap: bool = False,
) -> list[AttentionConfig]:
    """The configs :mod:`.autotune` times for ``preset`` at ``head_dim`` on ``device``: the
    table entry for the call (arguments as :func:`attention_config`) first, then the
    long-sequence entry (the register-capped one where the launch takes a cap) and the arch's
    candidates, each shrunk to the constraints that apply, without duplicates. Every call of
    one autotune key (lengths bucketed to powers of two) gets the same set, in whatever
    order. A candidate may still not fit the GPU's shared memory; the tuner skips those."""
    arch = arch_of(device)
    first = _fitted_table_config(preset, head_dim, arch, dtype, native_pv, keys, unmasked,
                                 causal_only, register_cap, v_block, smooth_q)
    long_sequence = _fitted_table_config(preset, head_dim, arch, dtype, native_pv, None,
                                         unmasked, causal_only, register_cap, v_block, smooth_q)
    out: list[AttentionConfig] = [first]
    for cfg in (long_sequence, *_CANDIDATES[(arch, padded_dim(head_dim))]):
        cfg = _constrained(cfg, v_block, smooth_q)
        if cfg not in out:
            out.append(cfg)
    return out


def quant_config(head_dim: int, device: torch.device, min_tokens: int = 1) -> QuantConfig:
    """Launch parameters of the quantizer/smoothing kernels for ``head_dim`` on ``device``.

    ``min_tokens``: token groups reduced inside one tile need a tile of at least that many
    tokens. Wide heads halve the token tile; warps grow with the tile (≈ 8K elements per 4
    warps, at most 16 warps).
    """
    return _quant_config(head_dim, device, min_tokens, elements_per_4_warps=8192)


def kv_quant_config(head_dim: int, device: torch.device, group: int) -> QuantConfig:
    """Launch parameters of fp8's K+V launch (:func:`~.quantize.quantize_fp8_kv`) over token
    groups of ``group``: as :func:`quant_config`, with twice the warps per tile (4K elements
    per 4 warps): its 128-token tiles run faster with more warps, while the same rule for the
    other quantizer kernels was slower (the one-pass smoothed INT8 quantizer, the statistics
    pass, ΔS; docs/performance.md)."""
    return _quant_config(head_dim, device, group, elements_per_4_warps=4096)


def _quant_config(head_dim: int, device: torch.device, min_tokens: int, *,
                  elements_per_4_warps: int) -> QuantConfig:
    base = _QUANT_TABLE[arch_of(device)]
    dim = padded_dim(head_dim)
    block_t = max(base.block_t // 2 if dim >= 256 else base.block_t, min_tokens)
    warps = min(16, max(base.num_warps, base.num_warps * block_t * dim // elements_per_4_warps))
    return QuantConfig(block_t=block_t, num_warps=warps)
