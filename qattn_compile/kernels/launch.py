"""Launchers: prepare each preset's operands (smooth, quantize) and run the attention kernel.

Each preset maps to one :class:`Operands` — the kernel-format Q/K/V, their scales and the
``tl.constexpr`` switches of :func:`.attention.attention_kernel` — built by one small
``_prepare_*`` function that states the preset's math (:mod:`qattn_compile.presets`); each
takes ``(q, k, v, options, qk_mul, static scales, causal)``. Token-group sizes come from
:func:`qattn_compile.blocks.group_sizes`; tile sizes from :mod:`.heuristics`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Mapping

import torch
from torch import Tensor

from .. import _compat
from ..blocks import (SMOOTH_Q_BLOCK, fp8_group_sizes, group_sizes, int_flash_group_sizes,
                      int_flash_v_group)
from ..lowering.quantize import decomposed as lowered_decomposed
from ..presets import PresetOptions, resolve_options, resolve_static_scales
from ..reference.sas import SAS_POLY
from ..support import alibi_refusal, shape_refusal
from . import attention as ak
from . import autotune
from .heuristics import (
    MAX_GRID_AXIS,
    MIN_BLOCK_M,
    V_COLSUM_TOKENS,
    AttentionConfig,
    arch_of,
    attention_candidates,
    attention_config,
    capability,
    grid_head_group,
    padded_dim,
    qk_block_dim,
)
from .layout import heads_inside_tokens, output_buffer
from .mask import MaskPlan, plan_mask
from .primitives import (ensure_tma_allocator, interpreted, launch_takes_register_cap, launcher,
                         tma_compatible)
from .quantize import (
    Quantized,
    delta_s,
    quantize_fp8,
    quantize_fp8_kv,
    quantize_fp8_per_channel,
    quantize_int,
    quantize_int_smoothed,
    smooth_mean,
)
from .tiers import Tier2Config, tier2_config, tier2_refusal

logger = logging.getLogger(__name__)

LOG2E = math.log2(math.e)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FP8_PRESETS = ("sage2_8b", "sage2_4b", "fp8")


@dataclass
class Operands:
    """What the kernel reads for one call (see :func:`.attention.attention_kernel`).

    ``q``/``k``/``v``: kernel-format data; ``v_transposed``: V stored ``[B, H, Dv, L_pad]``.
    ``q_scale``/``k_scale``: float32 ``[B, H, n_groups]`` with ``q_group``/``k_group`` tokens
    per scale (None: native operands). ``v_scale``: float32 per V token group (``v_group``
    tokens, applied per tile) or per channel (``v_per_channel``); None for native V.
    ``delta_s``: float32 ``[B, Hq, n_blocks, Lkv]``; ``v_mean``: float32 ``[B, Hkv, 1, Dv]``;
    ``v_colsum``: int32 ``[B, Hkv, n, Dv]`` channel sums of V̂, per ``V_COLSUM_TOKENS`` tokens
    from the quantizer, per key tile once :func:`prepare_attention` has chosen the tile.
    ``switches``: the format constexprs (QK_FMT, P_FMT, P_TILE_MAX, V_FMT, EXP_MODE).
    """

    q: Tensor
    k: Tensor
    v: Tensor
    switches: dict
    q_scale: Tensor | None = None
    q_group: int = 1
    k_scale: Tensor | None = None
    k_group: int = 1
    v_scale: Tensor | None = None
    v_group: int = 1
    v_per_channel: bool = False
    v_transposed: bool = False
    delta_s: Tensor | None = None
    v_mean: Tensor | None = None
    v_colsum: Tensor | None = None
    sas_threshold: float = -6.0


# ----------------------------------------------------------------------------- presets


def _switches(qk: int, p: int, v: int, exp: int = 0, p_tile_max: bool = False) -> dict:
    """The format constexprs of the kernel."""
    return {"QK_FMT": qk, "P_FMT": p, "P_TILE_MAX": p_tile_max, "V_FMT": v, "EXP_MODE": exp}


def _with_q(ops: Operands, qq: Quantized, kq: Quantized) -> Operands:
    """Fill Q/K scales and groups from quantizer outputs."""
    ops.q_scale, ops.q_group = qq.scale, qq.group
    ops.k_scale, ops.k_group = kq.scale, kq.group
    return ops


def _with_v(ops: Operands, vq: Quantized) -> Operands:
    """Fill V's scale description from a quantizer output (per group or per channel)."""
    ops.v_scale, ops.v_group = vq.scale, vq.group
    ops.v_per_channel, ops.v_transposed = vq.per_channel, vq.transposed
    return ops


def _prepare_flash(q, k, v, opts, qk_mul, static, causal) -> Operands:
    """FlashAttention: native operands, exact softmax."""
    return Operands(q, k, v, _switches(ak.QK_NATIVE, ak.P_NATIVE, ak.V_NATIVE))


def _prepare_int_flash(q, k, v, opts, qk_mul, static, causal) -> Operands:
    """INT-FlashAttention: K optionally smoothed (``smooth_k``), Q INT8 per token, K per
    token or block (``k_granularity``); P = round(127·P) against the tile's or the running
    max (``p_scale``); V INT8 per 128 tokens or per tensor (``v_granularity``)."""
    lq, lkv = q.shape[2], k.shape[2]
    gq, gk = int_flash_group_sizes(opts.k_granularity, lq, lkv)
    qq = quantize_int(q, gq, 8, scale_mul=qk_mul)
    kq = quantize_int(k, gk, 8, mean=smooth_mean(k) if opts.smooth_k else None)
    vq = quantize_int(v, int_flash_v_group(opts.v_granularity, lkv), 8, transpose=True)
    ops = Operands(qq.data, kq.data, vq.data, _switches(ak.QK_INT8, ak.P_INT8, ak.V_INT8,
                                                        p_tile_max=opts.p_scale == "tile"))
    return _with_v(_with_q(ops, qq, kq), vq)


def _prepare_fmha_int8(q, k, v, opts, qk_mul, static, causal) -> Operands:
    """INT8 FMHA: Q, K, V INT8 per tensor (dynamic or static α); P = round(255·P) (UINT8)."""
    lq, lkv = q.shape[2], k.shape[2]
    gq, gk = group_sizes("tensor", lq, lkv)
    amax = (lambda key: None) if static is None else static.get
    qq = quantize_int(q, gq, 8, scale_mul=qk_mul, amax=amax("q"))
    kq = quantize_int(k, gk, 8, amax=amax("k"))
    vq = quantize_int(v, gk, 8, amax=amax("v"), transpose=True, colsum_chunk=V_COLSUM_TOKENS)
    ops = Operands(qq.data, kq.data, vq.data, _switches(ak.QK_INT8, ak.P_UINT8, ak.V_INT8,
                                                        p_tile_max=opts.p_scale == "tile"))
    ops.v_colsum = vq.colsum
    return _with_v(_with_q(ops, qq, kq), vq)


def _prepare_sage2(q, k, v, opts, qk_mul, causal, num_bits: int) -> Operands:
    """SageAttention2: smoothed INT8/INT4 Q, K (ΔS added back); ``pv: fp8``: FP8 P and FP8
    per-channel V (optionally smoothed), ``pv: fp16``: P and V in the input dtype."""
    lq, lkv = q.shape[2], k.shape[2]
    gq, gk = group_sizes(opts.qk_granularity, lq, lkv)
    k_mean = smooth_mean(k) if opts.smooth_k else None
    if opts.smooth_q:
        qq = quantize_int_smoothed(q, gq, num_bits, mean_group=SMOOTH_Q_BLOCK, scale_mul=qk_mul)
    else:
        qq = quantize_int(q, gq, num_bits, scale_mul=qk_mul)
    q_mean = qq.mean
    kq = quantize_int(k, gk, num_bits, mean=k_mean)
    qk_fmt = ak.QK_INT8 if num_bits == 8 else ak.QK_INT4
    # Packed INT4 bytes are read as int8 so that arithmetic shifts sign-extend the nibbles.
    q_data, k_data = qq.data.view(torch.int8), kq.data.view(torch.int8)
    if opts.pv == "fp16":
        ops = Operands(q_data, k_data, v, _switches(qk_fmt, ak.P_NATIVE, ak.V_NATIVE))
    else:
        vq = quantize_fp8_per_channel(v, smooth=opts.smooth_v)
        ops = Operands(q_data, k_data, vq.data, _switches(qk_fmt, ak.P_FP8, ak.V_FP8))
        ops.v_mean = vq.mean
        _with_v(ops, vq)
    if q_mean is not None:
        ops.delta_s = delta_s(q_mean, k, k_mean, qk_mul, causal=causal)
    return _with_q(ops, qq, kq)


def _prepare_sage2_8b(q, k, v, opts, qk_mul, static, causal) -> Operands:
    """SageAttention2 8-bit (INT8 Q, K)."""
    return _prepare_sage2(q, k, v, opts, qk_mul, causal, 8)


def _prepare_sage2_4b(q, k, v, opts, qk_mul, static, causal) -> Operands:
    """SageAttention2 4-bit (INT4 Q, K packed two per byte)."""
    return _prepare_sage2(q, k, v, opts, qk_mul, causal, 4)


def _prepare_turbo(q, k, v, opts, qk_mul, static, causal) -> Operands:
    """TurboAttention: FlashQ blockwise INT8 Q, K, V; SAS (or hardware) exp; P = round(127·P)
    against the tile's or the running max (``p_scale``)."""
    lq, lkv = q.shape[2], k.shape[2]
    gq, gk = group_sizes("block", lq, lkv)
    qq = quantize_int(q, gq, 8, scale_mul=qk_mul)
    kq = quantize_int(k, gk, 8)
    vq = quantize_int(v, gk, 8, transpose=True)
    exp = ak.EXP_SAS if opts.exp == "sas" else ak.EXP_HW
    ops = Operands(qq.data, kq.data, vq.data, _switches(ak.QK_INT8, ak.P_INT8, ak.V_INT8, exp,
                                                        p_tile_max=opts.p_scale == "tile"))
    ops.sas_threshold = opts.sas_threshold
    return _with_v(_with_q(ops, qq, kq), vq)


def _prepare_fp8(q, k, v, opts, qk_mul, static, causal) -> Operands:
    """FlashAttention-3-style FP8: Q, K, V e4m3 per tensor/block/q_token; P = fp8(448·P)."""
    lq, lkv = q.shape[2], k.shape[2]
    gq, gk = fp8_group_sizes(opts.granularity, lq, lkv)
    qq = quantize_fp8(q, gq, scale_mul=qk_mul)
    kq, vq = quantize_fp8_kv(k, v, gk)
    ops = Operands(qq.data, kq.data, vq.data, _switches(ak.QK_FP8, ak.P_FP8, ak.V_FP8))
    return _with_v(_with_q(ops, qq, kq), vq)


_PREPARE = {
    "flash": _prepare_flash,
    "int_flash": _prepare_int_flash,
    "fmha_int8": _prepare_fmha_int8,
    "sage2_8b": _prepare_sage2_8b,
    "sage2_4b": _prepare_sage2_4b,
    "turbo": _prepare_turbo,
    "fp8": _prepare_fp8,
}


# ----------------------------------------------------------------------------- launch


def _scale_args(
    scale: Tensor | None, group: int, device: torch.device
) -> tuple[Tensor, int, tuple]:
    """(pointer, constexpr group, (stride_b, stride_h, stride_group)) of a ``[B, H, n]``
    scale; one group (per tensor) is :data:`~.attention.PER_TENSOR_GROUP` tokens with stride
    0, no scale a float32 1.0 at stride 0."""
    if scale is None:
        return torch.ones(1, device=device, dtype=torch.float32), 1, (0, 0, 0)
    sb, sh, sg = scale.stride()
    if scale.shape[-1] == 1:
        return scale, ak.PER_TENSOR_GROUP, (sb, sh, 0)
    return scale, group, (sb, sh, sg)


def _v_scale_args(ops: Operands, absent) -> tuple[Tensor, int, int, tuple]:
    """(pointer, V_SCALE mode, V_GROUP, strides) of V's scale (see the kernel's docstring);
    ``absent()`` makes the stand-in of an absent scale."""
    if ops.v_scale is None:
        return absent(), int(ak.VS_NONE), 1, (0, 0, 0)
    sb, sh, sg = ops.v_scale.stride()
    if ops.v_per_channel:
        return ops.v_scale, int(ak.VS_CHANNEL), 1, (sb, sh, sg)
    if ops.v_scale.shape[-1] == 1:  # per tensor: a per-channel scale with channel stride 0
        return ops.v_scale, int(ak.VS_CHANNEL), 1, (sb, sh, 0)
    return ops.v_scale, int(ak.VS_TILE), ops.v_group, (sb, sh, sg)


def _colsum_per_tile(colsum: Tensor, block_n: int) -> Tensor:
    """The quantizer's int32 channel sums of V̂ per ``V_COLSUM_TOKENS`` tokens ``[B, H,
    n_chunks, Dv]`` added up per key tile of ``block_n`` tokens: ``[B, H, cdiv(n_chunks,
    block_n / V_COLSUM_TOKENS), Dv]`` (the kernel then loads one row per tile, already in
    the layout its accumulator adds it to)."""
    per_tile = block_n // V_COLSUM_TOKENS
    if per_tile == 1:
        return colsum
    bsz, heads, n_chunks, dv = colsum.shape
    padded = torch.nn.functional.pad(colsum, (0, 0, 0, (-n_chunks) % per_tile))
    return padded.reshape(bsz, heads, -1, per_tile, dv).sum(dim=3, dtype=torch.int32)


def loads_by_tma(ops: Operands, cfg: AttentionConfig) -> bool:
    """Whether the attention kernel reads K and V through TMA descriptors: the tile asks for
    them and both tensors are TMA-addressable (:func:`.primitives.tma_compatible`; else
    pointer loads, logged at debug level)."""
    return cfg.tma and tma_compatible(ops.k, ops.v)


def _launch(
    ops: Operands,
    out: Tensor,
    shape: tuple[int, int, int, int, int, int],
    mask: MaskPlan | None,
    is_causal: bool,
    qk_scale: float,
    cfg: AttentionConfig,
    dot_precision: str,
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
) -> None:
    """Run :func:`.attention.attention_kernel` on prepared operands into ``out``.

    shape: ``(B, Hq, Hkv, Lq, Lkv, D)``; out: ``[B, Hq, Lq, Dv]``; ``softcap`` (0 = off) and
    ``alibi_slopes`` (float32 ``[B, Hq]``, stride 0 on a broadcast batch) as
    :func:`kernel_attention`.
    """
    bsz, hq, hkv, lq, lkv, dim = shape
    dv = out.shape[-1]
    # Absent operands: the kernel never reads them (constexpr switches). Each gets its own
    # uninitialised one-element tensor: under Inductor an initialised one is a fill kernel,
    # and one tensor passed as several arguments is copied once per extra argument.
    def absent() -> Tensor:
        return torch.empty(1, device=out.device, dtype=torch.float32)

    exact = interpreted(out.device)
    qs, q_group, qs_strides = _scale_args(ops.q_scale, ops.q_group, out.device)
    ks, k_group, ks_strides = _scale_args(ops.k_scale, ops.k_group, out.device)
    vs, v_mode, v_group, vs_strides = _v_scale_args(ops, absent)
    vsb, vsh, vs1, vs2 = ops.v.stride()
    v_strides = (vsb, vsh, vs2, vs1) if ops.v_transposed else (vsb, vsh, vs1, vs2)
    ds = ops.delta_s if ops.delta_s is not None else absent()
    ds_strides = ops.delta_s.stride()[:3] if ops.delta_s is not None else (0, 0, 0)
    vmean = ops.v_mean if ops.v_mean is not None else absent()
    vm_strides = ops.v_mean.stride()[:2] if ops.v_mean is not None else (0, 0)
    colsum = ops.v_colsum if ops.v_colsum is not None else absent()
    cs_strides = ops.v_colsum.stride()[:3] if ops.v_colsum is not None else (0, 0, 0)
    if mask is None:
        mode = int(ak.MASK_NONE)
        mvals, msum, mtiles, mcount = absent(), absent(), absent(), absent()
        m_strides = s_strides = t_strides = (0, 0, 0, 0)
        c_strides = (0, 0, 0)
    else:
        mode = int(ak.MASK_BOOL) if mask.is_bool else int(ak.MASK_ADD)
        mvals, msum, mtiles, mcount = mask.values, mask.summary, mask.tiles, mask.counts
        m_strides, s_strides = mask.values.stride(), mask.summary.stride()
        t_strides, c_strides = mask.tiles.stride(), mask.counts.stride()
    use_tma = loads_by_tma(ops, cfg)
    if cfg.tma and not use_tma:
        logger.debug("qattn kernel: K %s / V %s strides (storage offsets %s, %s) not TMA-addressable; "
                     "pointer loads instead", tuple(ops.k.stride()), tuple(ops.v.stride()),
                     ops.k.storage_offset(), ops.v.storage_offset())
    if use_tma and not exact:
        ensure_tma_allocator()
    c0, c1, c2, c3 = SAS_POLY
    kv_row_bytes = ops.k.shape[-1] * ops.k.element_size() + dv * ops.v.element_size()
    group = grid_head_group(bool(is_causal), hq // hkv, _compat.size_hint(bsz * hq),
                            _compat.size_hint(lkv * kv_row_bytes))
    grid = (group, -(-lq // cfg.block_m), -(-(bsz * hq) // group))
    alibi = alibi_slopes if alibi_slopes is not None else absent()
    al_strides = alibi_slopes.stride() if alibi_slopes is not None else (0, 0)
    launcher(ak.attention_kernel, ops.q)[grid](
        ops.q, ops.k, ops.v, out, qs, ks, vs, ds, vmean, mvals, msum, mtiles, mcount, colsum,
        alibi, lq, lkv, hq, hq // hkv, bsz * hq,
        qk_scale, ops.sas_threshold * LOG2E, c0, c1, c2, c3, softcap * LOG2E,
        *ops.q.stride(), *ops.k.stride(), *v_strides, *out.stride(),
        *qs_strides, *ks_strides, *vs_strides, *ds_strides, *vm_strides, *cs_strides,
        *m_strides, *s_strides, *t_strides, *c_strides, *al_strides,
        V_SCALE=v_mode, MASK_MODE=mode, IS_CAUSAL=bool(is_causal),
        HAS_DS=ops.delta_s is not None, SMOOTH_V=ops.v_mean is not None,
        POSITIVE_SCALE=bool(qk_scale > 0), SOFTCAP=softcap > 0, ALIBI=alibi_slopes is not None,
        Q_GROUP=q_group, K_GROUP=k_group, V_GROUP=v_group, DS_GROUP=SMOOTH_Q_BLOCK,
        EXACT_FP8=exact, DOT_PRECISION=dot_precision, USE_TMA=use_tma,
        HEAD_D=dim, HEAD_DV=dv,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_D=qk_block_dim(dim, ops.switches["QK_FMT"] == int(ak.QK_INT4)),
        BLOCK_DV=padded_dim(dv), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg is not None else {}),
        **{name: int(value) for name, value in ops.switches.items()},
    )


def _quantize_output(out: Tensor, static: Mapping | None) -> Tensor:
    """fmha_int8 ``quantize_output``: O → INT8 with α_o/127 per (batch, head) → float.

    out: float32 ``[B, Hq, Lq, Dv]``; α_o = amax(O) or the static ``"o"``. Same shape back.
    """
    lq = max(out.shape[2], 1)
    oq = quantize_int(out, lq, 8, amax=None if static is None else static["o"])
    return oq.data.to(torch.float32) * oq.scale[..., None]


# ----------------------------------------------------------------------------- public API


def supports(q_shape, k_shape, v_shape, dtype, device, preset, options) -> str | None:
    """Why the kernels cannot serve these inputs (a sentence), or None when they can.

    Shapes as in :func:`kernel_attention`; ``device`` a torch device (CUDA, or CPU under
    ``TRITON_INTERPRET=1``); ``options`` a dict, :class:`PresetOptions` or None.
    """
    if preset not in _PREPARE:
        return f"preset {preset!r} has no kernel"
    opts = resolve_options(preset, options)
    static = preset == "fmha_int8" and opts.scales == "static"
    if static and getattr(opts, "static_scales", None) is None:
        return "fmha_int8 `scales: static` without calibrated static_scales in its options"
    return _unsupported(q_shape, k_shape, v_shape, dtype, torch.device(device), preset)


def _unsupported(q_shape, k_shape, v_shape, dtype, device: torch.device, preset: str) -> str | None:
    """:func:`supports` without the options checks: :func:`qattn_compile.support.shape_refusal`
    plus the kernels' own limits (grid, dtype, device, arch)."""
    reason = shape_refusal(q_shape, k_shape, v_shape)
    if reason is not None:
        return reason
    if q_shape[0] * q_shape[1] > MAX_GRID_AXIS or q_shape[2] > MAX_GRID_AXIS * MIN_BLOCK_M:
        return (f"q {tuple(q_shape)}: the kernel's grid holds at most {MAX_GRID_AXIS} batch × "
                f"query heads and {MAX_GRID_AXIS} query tiles of {MIN_BLOCK_M} rows")
    if dtype not in _DTYPES:
        return f"dtype {dtype} (kernels take float16, bfloat16, float32)"
    if device.type == "cuda":
        major, minor = capability(device)
        if (major, minor) < (8, 0):
            return f"compute capability {major}.{minor} < 8.0"
        if preset in _FP8_PRESETS and (major, minor) < (8, 9):
            return f"preset {preset!r} needs FP8 tensor cores (sm_89+), got sm_{major}{minor}"
    elif not _interpreter_on():
        return f"device {device} (Triton kernels need CUDA, or TRITON_INTERPRET=1 on CPU)"
    return None


def _interpreter_on() -> bool:
    """Whether the Triton interpreter is enabled (CPU tensors can run)."""
    try:
        return interpreted(torch.device("cpu"))
    except RuntimeError:
        return False


@dataclass
class PreparedAttention:
    """One attention call with its operands already smoothed and quantized.

    :meth:`run` launches only the attention kernel (benchmarks time it apart from the
    quantizers); :func:`kernel_attention` is :func:`prepare_attention` + :meth:`run` + the
    fmha_int8 output re-quantization.
    """

    ops: Operands
    mask: MaskPlan | None
    is_causal: bool
    qk_scale: float
    cfg: AttentionConfig
    dot_precision: str
    shape: tuple[int, int, int, int, int, int]  # (B, Hq, Hkv, Lq, Lkv, D)
    out_shape: tuple[int, int, int, int]  # (B, Hq, Lq, Dv)
    out_dtype: torch.dtype
    out_heads_inside_tokens: bool  # the output stored [B, Lq, Hq, Dv] (see output_buffer)
    tier2: Tier2Config | None = None  # the Gluon kernel's tiles when tier 2 serves the call
    softcap: float = 0.0  # logit soft-capping cap (0 = off)
    alibi_slopes: Tensor | None = None  # float32 [B, Hq] ALiBi slopes (stride 0: broadcast)

    @property
    def loads_by_tma(self) -> bool:
        """Whether :meth:`run` reads K and V through TMA descriptors (:func:`loads_by_tma`)."""
        return loads_by_tma(self.ops, self.cfg)

    @property
    def tier(self) -> str:
        """``"gluon"`` (tier 2, :mod:`.hopper`) or ``"triton"`` (tier 1, :mod:`.attention`)."""
        return "triton" if self.tier2 is None else "gluon"

    def run(self, lse: Tensor | None = None) -> Tensor:
        """Launch the attention kernel; returns a fresh ``[B, Hq, Lq, Dv]`` in ``out_dtype``
        (stored as :func:`output_buffer` says). ``lse``: a float32 ``[B, Hq, Lq]`` contiguous
        buffer that tier 2 fills with each row's natural-log log-sum-exp of the scaled
        scores (``-inf`` for a row with no visible key)."""
        out = output_buffer(self.out_shape, self.out_dtype, self.ops.q.device,
                            self.out_heads_inside_tokens)
        if lse is not None and (self.tier2 is None or self.ops.switches["QK_FMT"] != int(ak.QK_FP8)):
            raise ValueError("the log-sum-exp comes from tier 2's fp8 calls only (sage2_8b's "
                             "smoothed K shifts each row's scores by q·mean(K))")
        if self.tier2 is not None:
            _launch_tier2(self.ops, out, self.is_causal, self.tier2, lse)
        else:
            _launch(self.ops, out, self.shape, self.mask, self.is_causal, self.qk_scale,
                    self.cfg, self.dot_precision, self.softcap, self.alibi_slopes)
        return out


def _launch_tier2(ops: Operands, out: Tensor, is_causal: bool, cfg: Tier2Config,
                  lse: Tensor | None) -> None:
    """Run :func:`.hopper.run` on prepared operands (fp8's or sage2_8b's) into ``out``."""
    from . import hopper

    device = out.device
    qs, q_group, _ = _scale_args(ops.q_scale, ops.q_group, device)
    ks, k_group, _ = _scale_args(ops.k_scale, ops.k_group, device)
    if ops.v_per_channel:
        vs, v_group = ops.v_scale, 1
    else:
        vs, v_group, _ = _scale_args(ops.v_scale, ops.v_group, device)
    hopper.run(ops.q.contiguous(), ops.k.contiguous(), ops.v.contiguous(), qs, q_group, ks,
               k_group, vs, v_group, out, is_causal, block_n=cfg.block_n, stages=cfg.stages,
               consumer_regs=cfg.consumer_regs, producer_regs=cfg.producer_regs,
               v_per_channel=ops.v_per_channel, delta_s=ops.delta_s, ds_group=SMOOTH_Q_BLOCK,
               v_mean=ops.v_mean, lse=lse)


def _resolve(
    preset: str, options, static_scales, q: Tensor, k: Tensor
) -> tuple[PresetOptions, Mapping | None]:
    """Validated options of ``preset`` and the static scales it uses: fmha_int8 with
    ``scales: static`` reads the ``static_scales`` argument, else the options' own
    ``static_scales`` (filled in per site from the calibration file), per head of ``q``/``k``."""
    if preset not in _PREPARE:
        raise ValueError(f"qattn kernels cannot run preset {preset!r}: it has no kernel")
    opts = resolve_options(preset, options)
    heads = (q.shape[1], k.shape[1]) if q.dim() == k.dim() == 4 else None  # else refused later
    return opts, resolve_static_scales(preset, opts, static_scales, q.device, heads=heads)


def _check_call(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, preset: str) -> None:
    """Raise ``ValueError`` naming the culprit when the kernels cannot run this call: the
    shapes, dtype, device and arch of :func:`_unsupported`, plus what only the tensors tell:
    k and v on q's device, k in q's dtype where Q·Kᵀ is a native dot (``flash``; the
    quantized presets quantize each operand on its own), a bool or floating-point mask on
    q's device."""
    reason = _unsupported(q.shape, k.shape, v.shape, q.dtype, q.device, preset)
    if reason is None:
        for name, t in (("k", k), ("v", v)):
            if t.device != q.device:
                reason = f"{name} is on {t.device}, q on {q.device}"
                break
    if reason is None and preset == "flash" and k.dtype != q.dtype:
        reason = f"k is {k.dtype}, q {q.dtype} (flash's Q·Kᵀ dot needs one dtype)"
    if reason is None and attn_mask is not None:
        if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
            reason = (f"attn_mask of dtype {attn_mask.dtype} (bool keep-masks or additive "
                      "floating-point masks only)")
        elif attn_mask.device != q.device:
            reason = f"attn_mask is on {attn_mask.device}, q on {q.device}"
    if reason is not None:
        raise ValueError(f"qattn kernels cannot run preset {preset!r}: {reason}")


def prepare_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    preset: str = "flash",
    options: dict | PresetOptions | None = None,
    *,
    static_scales: Mapping[str, float | Tensor] | None = None,
    config: AttentionConfig | None = None,
    output_like_q: bool = True,
    tier: str | None = None,
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
) -> PreparedAttention:
    """Validate, smooth/quantize the operands of ``preset`` and plan the launch (tiles from
    ``config`` if given, else from :mod:`.autotune` when the options say ``autotune``, else
    from the table of :mod:`.heuristics`; mask summary from :mod:`.mask`).
    Arguments as :func:`kernel_attention`; ``Lq`` and ``Lkv`` must be positive. ``tier``:
    ``"triton"`` or ``"gluon"`` to force a kernel tier (``ValueError`` when tier 2 cannot
    serve the call), None for :mod:`.tiers`'s choice."""
    opts, static = _resolve(preset, options, static_scales, q, k)
    _check_call(q, k, v, attn_mask, preset)
    slopes = _alibi_slopes(alibi_slopes, q)
    use_tier2 = _serves_tier2(preset, opts, q, k, v, attn_mask, is_causal, scale, tier,
                              softcap=softcap, alibi=slopes is not None)
    bsz, hq, lq, dim = q.shape
    hkv, lkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    tau = 1.0 / math.sqrt(dim) if scale is None else float(scale)
    qk_mul = tau * LOG2E
    ops = _PREPARE[preset](q, k, v, opts, qk_mul, static, bool(is_causal))
    tier2 = tier2_config(preset, dim, bool(is_causal)) if use_tier2 else None
    per_block_v = ops.v_scale is not None and not ops.v_per_channel and ops.v_scale.shape[-1] > 1
    v_block = ops.v_group if per_block_v else 0  # V's tokens per scale, for the tile constraint
    smooth_q = ops.delta_s is not None
    native_pv = preset != "flash" and int(ops.switches["P_FMT"]) == int(ak.P_NATIVE)
    table_args = dict(v_block=v_block, smooth_q=smooth_q, native_pv=native_pv, keys=lkv,
                      unmasked=attn_mask is None and not is_causal,
                      causal_only=attn_mask is None and bool(is_causal),
                      register_cap=launch_takes_register_cap(q))
    if config is None and getattr(opts, "autotune", False):
        candidates = attention_candidates(preset, max(dim, dv), q.device, q.dtype, **table_args)
        config = _autotuned(preset, opts, static_scales, q, k, v, attn_mask, is_causal, scale,
                            candidates)
    cfg = attention_config(preset, max(dim, dv), q.device, q.dtype, **table_args, override=config)
    mask = plan_mask(attn_mask, (bsz, hq, lq, lkv), cfg.block_m, cfg.block_n, bool(is_causal))
    if ops.v_colsum is not None:  # once per call, not per run of the prepared call
        ops.v_colsum = _colsum_per_tile(ops.v_colsum, cfg.block_n)
    quantize_out = preset == "fmha_int8" and opts.quantize_output
    logger.debug("qattn kernel %s on %s: cfg=%s", preset, arch_of(q.device), cfg)
    return PreparedAttention(
        ops=ops, mask=mask, is_causal=bool(is_causal), qk_scale=qk_mul, cfg=cfg, tier2=tier2,
        softcap=float(softcap), alibi_slopes=slopes,
        dot_precision="ieee" if q.dtype == torch.float32 else "tf32",
        shape=(bsz, hq, hkv, lq, lkv, dim), out_shape=(bsz, hq, lq, dv),
        out_dtype=torch.float32 if quantize_out else q.dtype,
        out_heads_inside_tokens=output_like_q and heads_inside_tokens(q),
    )


def _alibi_slopes(slopes: Tensor | None, q: Tensor) -> Tensor | None:
    """ALiBi slopes ``[Hq]`` or ``[B, Hq]`` as float32 ``[B, Hq]`` on q's device (a view with
    batch stride 0 for ``[Hq]``); ``ValueError`` naming the shape otherwise."""
    if slopes is None:
        return None
    bsz, hq = q.shape[0], q.shape[1]
    reason = alibi_refusal(slopes.shape, bsz, hq)
    if reason is None and slopes.device != q.device:
        reason = f"alibi_slopes on {slopes.device}, q on {q.device}"
    if reason is not None:
        raise ValueError(reason)
    return slopes.to(torch.float32).expand(bsz, hq)


def _serves_tier2(preset, opts, q, k, v, attn_mask, is_causal, scale, tier: str | None, *,
                  softcap: float, alibi: bool) -> bool:
    """Whether tier 2 serves this call (:func:`.tiers.tier2_refusal`); ``tier`` forces a
    tier. Never while torch traces (compiled graphs reach tier 2 through the opaque op,
    :func:`qattn_compile.ops.graph_op`)."""
    if tier not in (None, "triton", "gluon"):
        raise ValueError(f"tier {tier!r}: expected 'triton', 'gluon' or None")
    if tier == "triton":
        return False
    reason = ("traced by torch.compile (tier 1 is inlined)" if lowered_decomposed(q) else
              tier2_refusal(preset, opts, q.shape, k.shape, v.shape, q.dtype, q.device,
                            masked=attn_mask is not None, scale=scale, causal=bool(is_causal),
                            softcap=softcap, alibi=alibi, forced=tier == "gluon"))
    if reason is None:
        return True
    if tier == "gluon":
        raise ValueError(f"tier 2 cannot serve this {preset} call: {reason}")
    logger.debug("qattn kernel %s: tier 1 (%s)", preset, reason)
    return False


def _autotuned(preset, opts, static_scales, q, k, v, attn_mask, is_causal, scale,
               candidates: list[AttentionConfig]) -> AttentionConfig | None:
    """The fastest of ``candidates`` for this call (:func:`.autotune.tuned_config`), timed on
    random inputs of the call's shapes and memory layouts (an all-visible mask of the same
    shape and kind for a masked call); None (the table decides) when a size has no hint to
    tune at."""
    shapes = [tuple(_compat.size_hint(s) for s in t.shape) for t in (q, k, v)]
    strides = [tuple(_compat.size_hint(s) for s in t.stride()) for t in (q, k, v)]
    mask_shape = () if attn_mask is None else tuple(_compat.size_hint(s) for s in attn_mask.shape)
    if None in mask_shape or any(None in shape for shape in shapes + strides):
        logger.warning("qattn autotune: %s has a data-dependent size (q %s); using the table's tiles",
                       preset, tuple(q.shape))
        return None
    key = autotune.TuneKey.of(preset, opts, shapes, strides, q.dtype, attn_mask, is_causal, scale,
                              register_cap=launch_takes_register_cap(q))

    def make_inputs():
        q_, k_, v_ = (autotune.random_like_layout(shape, stride, q.dtype, q.device)
                      for shape, stride in zip(shapes, strides))
        mask = None
        if attn_mask is not None:
            fill = torch.ones if attn_mask.dtype == torch.bool else torch.zeros
            mask = fill(mask_shape, dtype=attn_mask.dtype, device=q.device)
        return q_, k_, v_, mask, _timing_scales(static_scales, q_, k_, v_)

    def measure(cfg: AttentionConfig, inputs) -> float:
        call = prepare_attention(*inputs[:4], is_causal, scale, preset, opts,
                                 static_scales=inputs[4], config=cfg)
        return autotune.time_call(call.run, q.device)

    return autotune.tuned_config(key, q.device, candidates, make_inputs, measure)


def _timing_scales(static: Mapping | None, q: Tensor, k: Tensor, v: Tensor) -> dict | None:
    """Static α for timing a static call on the tuner's random inputs: each operand's amax
    (O's bounded by V's). The call's own α cannot serve: while torch traces they are fake
    tensors, which a kernel launch cannot read; the kernels' speed does not depend on them."""
    if static is None:
        return None
    amax = {"q": q.abs().amax().item(), "k": k.abs().amax().item(), "v": v.abs().amax().item()}
    return {name: amax.get(name, amax["v"]) for name in static}


def kernel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    preset: str = "flash",
    options: dict | PresetOptions | None = None,
    *,
    static_scales: Mapping[str, float | Tensor] | None = None,
    output_like_q: bool = True,
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
) -> Tensor:
    """Quantized flash attention of ``preset`` with the Triton kernels.

    q ``[B, Hq, Lq, D]``, k ``[B, Hkv, Lkv, D]``, v ``[B, Hkv, Lkv, Dv]`` (fp16/bf16/fp32,
    any strides), ``Hq % Hkv == 0``; attn_mask None / bool (True = attend) / additive float,
    broadcastable to ``[B, Hq, Lq, Lkv]``; ``is_causal`` top-left; ``scale`` default
    ``1/sqrt(D)``. Returns ``[B, Hq, Lq, Dv]`` in q's dtype; fully masked rows are 0.
    ``static_scales``: fmha_int8's calibrated α ``{"q", "k", "v"[, "o"]}`` for
    ``scales: static`` (as :func:`qattn_compile.reference.reference_attention`).
    ``output_like_q``: store the output ``[B, Lq, Hq, Dv]`` when q stores its heads inside
    each token (:func:`.layout.output_buffer`), except fmha_int8's re-quantized
    output (``quantize_output``) and an empty one, which come back contiguous (the compiled
    op copies them into q's layout); False: always contiguous.
    ``softcap``: logit soft-capping ``cap·tanh(S/cap)`` of the scaled scores before the
    masks (0 = off); ``alibi_slopes``: ALiBi, ``−slope·|i + Lkv − Lq − j|`` added to the
    scaled scores, one slope per query head (``[Hq]`` or ``[B, Hq]``), as FlashAttention's.
    """
    opts, static = _resolve(preset, options, static_scales, q, k)
    if q.numel() == 0 or k.numel() == 0:  # no launch: checked here, then zeros
        _check_call(q, k, v, attn_mask, preset)
        return q.new_zeros((*q.shape[:3], v.shape[-1]))
    call = prepare_attention(q, k, v, attn_mask, is_causal, scale, preset, opts,
                             static_scales=static, output_like_q=output_like_q,
                             softcap=softcap, alibi_slopes=alibi_slopes)
    out = call.run()
    if preset == "fmha_int8" and opts.quantize_output:
        out = _quantize_output(out, static)
    return out.to(q.dtype)
