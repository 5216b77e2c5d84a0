"""Exact attention (the fp64 oracle) and the simulated-quantization reference of every preset.

Layouts: q ``[B, Hq, Lq, D]``, k ``[B, Hkv, Lkv, D]``, v ``[B, Hkv, Lkv, Dv]`` with
``Hq % Hkv == 0`` (GQA: query head ``h`` reads kv head ``h // (Hq // Hkv)``; K/V are never
repeated in memory). ``attn_mask``: None, bool (True = attend) or floating (added to the
scores; ``-inf`` = masked), broadcastable to ``[B, Hq, Lq, Lkv]``. ``is_causal``: key ``j``
is visible to query ``i`` iff ``j <= i`` (top-left, as torch SDPA); it combines with a mask.
A row with no visible key outputs exactly 0. Only ``-inf`` masks a key: a finite additive
value, however negative, keeps it visible (as in SDPA).

:func:`reference_attention` follows the math in :mod:`qattn_compile.presets` on whole rows
(one global row max over the visible keys). The kernels keep an online max instead: in
exact arithmetic the same, but a P quantized against the running max (FP8 P, integer P with
``p_scale: row``) rounds differently, usually finer (a tile before the row's max is
quantized on a finer step): there the kernels' error is at or below this reference's (by
~20 % on N(0, 1) inputs at ``p_scale: row``), never the other way. How it computes, so that
kernel tests know what to compare:

- Q/K/V are converted to ``compute_dtype`` (float32 by default; float64 allowed); smoothing
  runs in ``compute_dtype``; quantizers compute in float32 (:mod:`.quant`).
- Both GEMMs on quantized operands run in float64 on the quantized *values*: INT dots
  (``Q̂·K̂ᵀ``, ``P̂·V̂``) are therefore exact integers, FP8 products are exact too.
- ``S = ((Q̂·K̂ᵀ)·s_q·s_k + ΔS)·τ + mask`` in ``compute_dtype`` (``ΔS`` only for
  SageAttention2 with ``smooth_q``; it is in raw dot units, so τ multiplies it too).
- Row max ``m`` over visible scores; ``x = S − m``; masked entries get ``x = −inf``, so their
  P is exactly 0 in every format.
- INT P (``int_flash``/``turbo``: 127, ``fmha_int8``: 255): ``P̂ = clamp(round(qmax·E(x)),
  0, qmax)`` with round half to even, ``l = ΣP̂`` (float64, exact). With ``p_scale: tile``
  (the default of all three) ``x`` is taken against the max ``m_t`` of the row's key
  tile (``key_tile`` keys, aligned at 0: the kernel's ``block_n``) and each P̂ carries the
  weight ``w = exp(m_t − m)``: ``O = ((P̂·w)·V̂s) / Σ(P̂·w)``. (The kernels take a tile
  lying more than 64 below the running max, in log2 units, against that floor: its P̂
  rounds to 0 where this reference's carries weights below 2^-64.) turbo's SAS also drops
  a key tile whose max lies below the running max of the row's earlier tiles +
  ``sas_threshold`` (the kernel drops it only when every row of its query tile does). FP8 P (``sage2_*``
  with ``pv: fp8``, ``fp8``): ``P̂ = fp8_e4m3(448·exp(x))``, ``l = Σ exp(x)`` (compute
  dtype). Native P (``flash``, ``sage2_*`` with ``pv: fp16``): ``P = exp(x)`` cast to V's
  dtype when that is fp16/bf16, ``l = Σ exp(x)`` before the cast; V is not quantized.
- ``O = (P̂·(V̂·s_v)) / (unit·l)`` with ``unit`` = 448 for FP8 P, else 1; the V scale is per
  tensor, per token group or per channel depending on the preset, and ``V̂·s_v`` is formed
  in float64 (exact), so this equals ``(P̂·V̂)·s_v/(unit·l)``. Native P·V runs in the
  compute dtype.

Choices where :mod:`qattn_compile.presets` leaves room (kept in sync with the report):

- "Per tensor" means one scale per (batch, head), as ``tensor`` granularity does everywhere.
- ``turbo`` with ``exp: hardware`` uses the exact exp and ignores ``sas_threshold`` (the
  threshold belongs to SAS). With the default -6 this changes nothing after INT8 rounding:
  ``round(127·e^x) = 0`` for every ``x < ln(0.5/127) ≈ −5.54``.
- ``fmha_int8`` static scales come from the ``static_scales`` keyword ``{"q": α_q, "k": α_k,
  "v": α_v, "o": α_o}`` (floats or tensors broadcastable to ``[B, H, 1]``; ``"o"`` only
  with ``quantize_output``), or, when that keyword is None, from the options' own
  ``static_scales`` (per-head α filled in per site from the calibration file, which is how
  the graph op receives them); dynamic ``α_o`` is ``amax(O)`` per (batch, query head).
- SageAttention2's ``ΔS`` uses the smoothed, *unquantized* K in ``compute_dtype``.
- K smoothing (``sage2_*`` and ``int_flash`` with ``smooth_k``) is
  :func:`.smooth.smooth_k` in ``compute_dtype``, before quantization.
"""

from __future__ import annotations

import math
from typing import Mapping, NamedTuple

import torch
from torch import Tensor

from ..blocks import (P_KEY_TILE, SMOOTH_Q_BLOCK, fp8_group_sizes, group_sizes,
                      int_flash_group_sizes, int_flash_v_group)
from ..presets import PresetOptions, resolve_options, resolve_static_scales
from ..support import alibi_refusal
from . import quant, smooth
from .sas import sas_exp

_CHUNK_ELEMENTS = 1 << 24
"""Score elements (B·Hq·rows·Lkv) processed at once; query rows are chunked above it."""

_ROW_ALIGN = SMOOTH_Q_BLOCK
_COMPUTE_DTYPES = (torch.float32, torch.float64)
_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FP8_P_UNIT = quant.FP8_E4M3_MAX
_SAGE2 = ("sage2_8b", "sage2_4b")
_SMOOTH_K_PRESETS = ("int_flash", *_SAGE2)


# --------------------------------------------------------------------------------------------
# input checks and masks
# --------------------------------------------------------------------------------------------


def _check_inputs(q: Tensor, k: Tensor, v: Tensor | None, compute_dtype: torch.dtype) -> None:
    """Validate ranks, dtypes and the shape relations of q, k (and v)."""
    tensors = {"q": q, "k": k} if v is None else {"q": q, "k": k, "v": v}
    for name, t in tensors.items():
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, H, L, D], got shape {tuple(t.shape)}")
        if t.dtype not in _INPUT_DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; expected fp16, bf16, fp32 or fp64")
    if compute_dtype not in _COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype must be float32 or float64, got {compute_dtype}")
    (b, hq, _, d), (bk, hkv, lkv, dk) = q.shape, k.shape
    if b != bk or d != dk:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or head dim")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    if v is not None and (v.shape[0] != b or v.shape[1] != hkv or v.shape[2] != lkv):
        raise ValueError(f"v {tuple(v.shape)} does not match k {tuple(k.shape)} in B, H or L")


def _broadcasts_to(src: torch.Size, shape: tuple[int, ...]) -> bool:
    """Whether a tensor of shape ``src`` broadcasts to exactly ``shape``."""
    try:
        return torch.broadcast_shapes(src, shape) == torch.Size(shape)
    except RuntimeError:
        return False


def mask_bias(
    attn_mask: Tensor | None,
    is_causal: bool,
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    device: torch.device,
) -> Tensor | None:
    """The mask and causality as one additive bias (0 or finite = visible, ``-inf`` = masked).

    shape: ``(B, Hq, Lq, Lkv)``. Returns None (nothing masked) or a 4-D tensor in ``dtype``
    broadcastable to ``shape`` (it keeps the mask's size-1 dims, so nothing is expanded).
    """
    lq, lkv = shape[-2:]
    bias = None
    if attn_mask is not None:
        if attn_mask.dim() > 4 or not _broadcasts_to(attn_mask.shape, shape):
            raise ValueError(
                f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to {shape}"
            )
        mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
        if mask.dtype == torch.bool:
            bias = torch.zeros(mask.shape, dtype=dtype, device=device)
            bias.masked_fill_(~mask.to(device), -math.inf)
        elif mask.is_floating_point():
            bias = mask.to(device=device, dtype=dtype)
        else:
            raise ValueError(f"attn_mask must be bool or floating, got {attn_mask.dtype}")
    if is_causal:
        visible = torch.ones(lq, lkv, dtype=torch.bool, device=device).tril()
        causal = torch.zeros(1, 1, lq, lkv, dtype=dtype, device=device)
        causal.masked_fill_(~visible, -math.inf)
        bias = causal if bias is None else bias + causal
    return bias


def with_alibi(bias: Tensor | None, alibi_slopes: Tensor | None,
               shape: tuple[int, int, int, int], dtype: torch.dtype) -> Tensor | None:
    """``bias`` (from :func:`mask_bias`) plus ALiBi ``−slope·|i + Lkv − Lq − j|`` (as
    FlashAttention: bottom-right aligned), ``alibi_slopes`` ``[Hq]`` or ``[B, Hq]``; shape
    ``(B, Hq, Lq, Lkv)``. Unchanged without slopes."""
    if alibi_slopes is None:
        return bias
    b, hq, lq, lkv = shape
    reason = alibi_refusal(alibi_slopes.shape, b, hq)
    if reason is not None:
        raise ValueError(reason)
    device = alibi_slopes.device
    rows = torch.arange(lq, device=device).view(lq, 1) + (lkv - lq)
    distance = (rows - torch.arange(lkv, device=device).view(1, lkv)).abs().to(dtype)
    slopes = alibi_slopes.to(dtype).reshape(-1, hq, 1, 1)
    alibi = -slopes * distance
    return alibi if bias is None else bias.to(device) + alibi


def _bias_5d(bias: Tensor | None, hkv: int) -> Tensor | None:
    """``[b, h, lq, lkv]`` (h = 1 or Hq) -> ``[b, Hkv or 1, G or 1, lq, lkv]`` (a view)."""
    if bias is None:
        return None
    b, h, lq, lkv = bias.shape
    if h == 1:
        return bias.reshape(b, 1, 1, lq, lkv)
    return bias.reshape(b, hkv, h // hkv, lq, lkv)


# --------------------------------------------------------------------------------------------
# exact attention (independent oracle)
# --------------------------------------------------------------------------------------------


def exact_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    compute_dtype: torch.dtype = torch.float64,
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
) -> Tensor:
    """Independent exact softmax attention (the fp64 oracle). Returns ``compute_dtype``.

    q ``[B, Hq, Lq, D]``, k ``[B, Hkv, Lkv, D]``, v ``[B, Hkv, Lkv, Dv]`` -> ``[B, Hq, Lq, Dv]``.
    Written separately from :func:`reference_attention` (K/V repeated per query head, plain
    softmax) so that it can check it. Fully masked rows give exactly 0. ``softcap`` (0 =
    off): ``cap·tanh(S/cap)`` of the scaled scores before the masks; ``alibi_slopes``: see
    :func:`with_alibi`.
    """
    _check_inputs(q, k, v, compute_dtype)
    b, hq, lq, d = q.shape
    lkv = k.shape[2]
    tau = 1.0 / math.sqrt(d) if scale is None else float(scale)
    heads_per_kv = hq // k.shape[1]
    keys = k.to(compute_dtype).repeat_interleave(heads_per_kv, dim=1)
    values = v.to(compute_dtype).repeat_interleave(heads_per_kv, dim=1)
    queries = q.to(compute_dtype)
    bias = with_alibi(mask_bias(attn_mask, is_causal, (b, hq, lq, lkv), compute_dtype, q.device),
                      alibi_slopes, (b, hq, lq, lkv), compute_dtype)
    rows = max(1, _CHUNK_ELEMENTS // max(1, b * hq * lkv))
    outs = []
    for r0 in range(0, lq if lkv else 0, rows):  # no keys: every row is fully masked
        scores = (queries[:, :, r0 : r0 + rows] @ keys.transpose(-1, -2)) * tau
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        if bias is not None:
            scores = scores + (bias if bias.shape[-2] == 1 else bias[:, :, r0 : r0 + rows])
        row_max = scores.amax(dim=-1, keepdim=True)
        empty = row_max == -math.inf
        weights = torch.exp(scores - torch.where(empty, 0.0, row_max))
        total = weights.sum(dim=-1, keepdim=True)
        out = (weights @ values) / torch.where(empty, 1.0, total)
        outs.append(out.masked_fill(empty, 0.0))
    if not outs:
        return q.new_zeros((b, hq, lq, v.shape[-1]), dtype=compute_dtype)
    return torch.cat(outs, dim=2)


# --------------------------------------------------------------------------------------------
# preparation of the quantized operands
# --------------------------------------------------------------------------------------------


class _Operands(NamedTuple):
    """Everything the row-chunked attention loop needs, in the grouped 5-D GQA layout.

    ``G = Hq // Hkv``. Scales are None when the operand is not quantized (``flash``).
    """

    q: Tensor  # [B, Hkv, G, Lq, D]   values entering the QK dot (dot dtype)
    q_scale: Tensor | None  # [B, Hkv, G, Lq, 1] float32 per-token scale
    k: Tensor  # [B, Hkv, 1, Lkv, D]  values entering the QK dot (dot dtype)
    k_scale: Tensor | None  # [B, Hkv, 1, 1, Lkv] float32 per-token scale
    delta_s: Tensor | None  # [B, Hkv, G, n_blocks, Lkv] ΔS per SMOOTH_Q_BLOCK block
    v: Tensor  # [B, Hkv, 1, Lkv, Dv] dequantized V (V̂·s_v, dot dtype)
    v_mean: Tensor | None  # [B, Hkv, 1, 1, Dv] added back to O (smooth_v)


def _quantize_values(x: Tensor, group: int, fmt: str, amax=None) -> tuple[Tensor, Tensor]:
    """Quantize ``[B, H, L, D]`` per token group; ``fmt`` in int8/int4/fp8.

    Returns (quantized values as float64 ``[B, H, L, D]``, per-token float32 scale
    ``[B, H, L, 1]``).
    """
    if fmt == "fp8":
        values, scale = quant.quantize_fp8(x, group, amax=amax)
    else:
        values, scale = quant.quantize_int(x, group, 8 if fmt == "int8" else 4, amax=amax)
    return values.to(torch.float64), quant.expand_scales(scale, group, x.shape[-2])


def _static_amax(static_scales: Mapping | None, key: str) -> Tensor | float | None:
    """α for ``key`` from the static scales (None in dynamic mode)."""
    return None if static_scales is None else static_scales[key]


def _qk_plan(preset: str, opts: PresetOptions, lq: int, lkv: int) -> tuple[str, int, int]:
    """(value format, Q group, K group) of a quantized preset's Q/K."""
    if preset == "int_flash":
        return ("int8", *int_flash_group_sizes(opts.k_granularity, lq, lkv))
    if preset == "fmha_int8":
        return ("int8", *group_sizes("tensor", lq, lkv))
    if preset in _SAGE2:
        fmt = "int8" if preset == "sage2_8b" else "int4"
        return (fmt, *group_sizes(opts.qk_granularity, lq, lkv))
    if preset == "turbo":
        return ("int8", *group_sizes("block", lq, lkv))
    if preset == "fp8":
        return ("fp8", *fp8_group_sizes(opts.granularity, lq, lkv))
    raise ValueError(f"preset {preset!r} has no quantized Q/K")


def _prepare_qk(q, k, preset, opts, compute_dtype, static_scales):
    """Smooth and quantize Q, K. Returns (q, q_scale, k, k_scale, delta_s) in 4-D layouts:
    q ``[B, Hq, Lq, D]``, q_scale ``[B, Hq, Lq, 1]``, k ``[B, Hkv, Lkv, D]``, k_scale
    ``[B, Hkv, Lkv, 1]``, delta_s ``[B, Hq, n_blocks, Lkv]`` or None."""
    qc, kc = q.to(compute_dtype), k.to(compute_dtype)
    if preset == "flash":
        return qc, None, kc, None, None
    delta = None
    if preset in _SMOOTH_K_PRESETS and opts.smooth_k:
        kc, _ = smooth.smooth_k(kc)
    if preset in _SAGE2 and opts.smooth_q:
        qc, q_mean = smooth.smooth_q(qc)
        delta = smooth.delta_s(q_mean, kc)
    fmt, q_group, k_group = _qk_plan(preset, opts, q.shape[2], k.shape[2])
    q_vals, q_scale = _quantize_values(qc, q_group, fmt, _static_amax(static_scales, "q"))
    k_vals, k_scale = _quantize_values(kc, k_group, fmt, _static_amax(static_scales, "k"))
    return q_vals, q_scale, k_vals, k_scale, delta


def _native_pv(preset: str, opts: PresetOptions) -> bool:
    """Whether P·V runs on the unquantized V in its own dtype (``flash``; SageAttention2
    with ``pv: fp16``)."""
    return preset == "flash" or (preset in _SAGE2 and opts.pv == "fp16")


def _prepare_v(v, preset, opts, compute_dtype, static_scales) -> tuple[Tensor, Tensor | None]:
    """Dequantized V ``[B, Hkv, Lkv, Dv]`` (float64, or compute dtype for a native P·V) and
    the smoothing mean ``[B, Hkv, 1, Dv]`` (or None)."""
    vc = v.to(compute_dtype)
    lkv = v.shape[2]
    if _native_pv(preset, opts):
        return vc, None
    if preset in _SAGE2:
        mean = None
        if opts.smooth_v:
            vc, mean = smooth.smooth_v(vc)
        values, scale = quant.quantize_fp8_per_channel(vc)
        return values.to(torch.float64) * scale.to(torch.float64).unsqueeze(-2), mean
    if preset == "int_flash":
        fmt, group = "int8", int_flash_v_group(opts.v_granularity, lkv)
    elif preset == "fmha_int8":
        fmt, group = "int8", group_sizes("tensor", 1, lkv)[1]
    elif preset == "turbo":
        fmt, group = "int8", group_sizes("block", 1, lkv)[1]
    elif preset == "fp8":
        fmt, group = "fp8", fp8_group_sizes(opts.granularity, 1, lkv)[1]
    else:
        raise ValueError(f"preset {preset!r} has no quantized V")
    values, scale = _quantize_values(vc, group, fmt, _static_amax(static_scales, "v"))
    return values * scale.to(torch.float64), None


def _grouped_q(x: Tensor | None, hkv: int) -> Tensor | None:
    """``[B, Hq, L, N]`` -> ``[B, Hkv, G, L, N]`` (a view)."""
    if x is None:
        return None
    b, hq, length, n = x.shape
    return x.reshape(b, hkv, hq // hkv, length, n)


def _prepare(q, k, v, preset, opts, compute_dtype, static_scales) -> _Operands:
    """All operands of ``preset`` in the 5-D GQA layout (see :class:`_Operands`)."""
    hkv = k.shape[1]
    q_vals, q_scale, k_vals, k_scale, delta = _prepare_qk(
        q, k, preset, opts, compute_dtype, static_scales
    )
    v_deq, v_mean = (None, None) if v is None else _prepare_v(
        v, preset, opts, compute_dtype, static_scales
    )
    return _Operands(
        q=_grouped_q(q_vals, hkv),
        q_scale=_grouped_q(q_scale, hkv),
        k=k_vals.unsqueeze(2),
        k_scale=None if k_scale is None else k_scale.transpose(-1, -2).unsqueeze(2),
        delta_s=_grouped_q(delta, hkv),
        v=None if v_deq is None else v_deq.unsqueeze(2),
        v_mean=None if v_mean is None else v_mean.unsqueeze(2),
    )


# --------------------------------------------------------------------------------------------
# scores, probabilities, output (per chunk of query rows)
# --------------------------------------------------------------------------------------------


def _dot_scores(ops: _Operands, r0: int, r1: int, compute_dtype) -> tuple[Tensor, Tensor]:
    """(raw dot, unmasked scaled-by-quantization scores without τ) for query rows r0:r1.

    Both ``[B, Hkv, G, r1 - r0, Lkv]``; the dot is in the operands' dtype (float64 for
    quantized presets, exact), the scores in ``compute_dtype``.
    """
    dot = ops.q[..., r0:r1, :] @ ops.k.transpose(-1, -2)
    scores = dot.to(compute_dtype)
    if ops.q_scale is not None:
        scores = scores * ops.q_scale[..., r0:r1, :].to(compute_dtype)
        scores = scores * ops.k_scale.to(compute_dtype)
    if ops.delta_s is not None:
        blocks = torch.arange(r0, r1, device=scores.device) // SMOOTH_Q_BLOCK
        scores = scores + ops.delta_s.index_select(-2, blocks)
    return dot, scores


def _rows(bias: Tensor | None, r0: int, r1: int) -> Tensor | None:
    """Rows r0:r1 of a broadcastable bias (unchanged if its row dim is 1)."""
    if bias is None or bias.shape[-2] == 1:
        return bias
    return bias[..., r0:r1, :]


def _shifted(scores: Tensor, tau: float, bias: Tensor | None,
             softcap: float = 0.0) -> tuple[Tensor, Tensor]:
    """``x = S − m`` (``-inf`` where masked) and the per-row "has a visible key" flag.

    scores ``[..., rows, Lkv]`` (before τ) -> ``x`` same shape, flag ``[..., rows, 1]`` bool.
    ``softcap`` (0 = off): ``cap·tanh(S/cap)`` after τ, before the bias.
    """
    s = scores * tau
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:  # a masked key's score is replaced, not added to (a NaN stays out)
        s = torch.where(bias == -math.inf, bias, s + bias)
    row_max = s.amax(dim=-1, keepdim=True)
    visible = row_max != -math.inf  # a NaN row (a NaN in Q or K) stays NaN, as in SDPA
    return s - torch.where(visible, row_max, 0.0), visible


def _tile_maxima(x: Tensor, key_tile: int) -> Tensor:
    """The max of each key tile of ``x`` ``[..., Lkv]`` (tiles of ``key_tile`` keys from 0):
    ``[..., ceil(Lkv / key_tile)]``, ``-inf`` for a masked tile."""
    tiles = torch.nn.functional.pad(x, (0, -x.shape[-1] % key_tile), value=-math.inf)
    return tiles.unflatten(-1, (-1, key_tile)).amax(-1)


def _per_key(per_tile: Tensor, key_tile: int, lkv: int) -> Tensor:
    """A per-tile value ``[..., n_tiles]`` repeated for each key: ``[..., lkv]``."""
    return per_tile.repeat_interleave(key_tile, dim=-1)[..., :lkv]


def _tile_max(x: Tensor, key_tile: int) -> Tensor:
    """Each entry's key-tile max of ``x`` ``[..., Lkv]``, same shape; 0 where the whole tile
    is ``-inf`` (masked)."""
    tile_max = _per_key(_tile_maxima(x, key_tile), key_tile, x.shape[-1])
    return torch.where(tile_max > -math.inf, tile_max, 0.0)


def _sas_skipped_tiles(x: Tensor, key_tile: int, threshold: float) -> Tensor:
    """Where ``x = S − m`` ``[..., Lkv]`` lies in a key tile that turbo's SAS skips: one whose
    max is below the running max of the row's earlier tiles + ``threshold`` (bool, same
    shape). The kernel skips a tile only when every row of its query tile would, so this
    per-row rule drops at least what the kernel drops."""
    maxima = _tile_maxima(x, key_tile)
    earlier = torch.cummax(maxima, dim=-1).values.roll(1, dims=-1)
    earlier[..., 0] = -math.inf
    return _per_key(maxima < earlier + threshold, key_tile, x.shape[-1])


def _probabilities(x: Tensor, preset: str, opts, p_dtype,
                   key_tile: int) -> tuple[Tensor, Tensor | None, Tensor, float]:
    """P from ``x = S − m`` per the preset: (P values, weight, row sum ``l`` ``[..., 1]``, unit).

    The output is ``((P·weight) @ V̂s) / (unit · l)``; P is float64 for quantized P formats.
    ``weight`` (``p_scale: tile`` only, else None) is ``exp(m_t − m)`` of each entry's key
    tile, and ``l`` is then ``Σ P·weight``.
    """
    if _native_pv(preset, opts):
        e = torch.exp(x)
        p = e.to(p_dtype).to(x.dtype) if p_dtype in (torch.float16, torch.bfloat16) else e
        return p, None, e.sum(dim=-1, keepdim=True), 1.0
    if preset in (*_SAGE2, "fp8"):
        e = torch.exp(x)
        p = quant.fp8_e4m3_values(_FP8_P_UNIT * e)
        return p.to(torch.float64), None, e.sum(dim=-1, keepdim=True), _FP8_P_UNIT
    weight, skipped = None, None
    if preset == "turbo" and opts.exp == "sas":
        skipped = _sas_skipped_tiles(x, key_tile, opts.sas_threshold)
    if opts.p_scale == "tile":
        shift = _tile_max(x, key_tile)
        x = x - shift
        weight = torch.exp(shift).to(torch.float64)
    if skipped is not None:
        e = sas_exp(x, opts.sas_threshold).masked_fill(skipped, 0.0)
    else:
        e = torch.exp(x)
    p_max = 255.0 if preset == "fmha_int8" else 127.0
    p = torch.round(p_max * e).clamp_(0.0, p_max).to(torch.float64)
    weighted = p if weight is None else p * weight
    return p, weight, weighted.sum(dim=-1, keepdim=True), 1.0


def _attention_rows(ops, bias, preset, opts, tau, p_dtype, compute_dtype, key_tile,
                    r0, r1, softcap) -> Tensor:
    """Output rows r0:r1, ``[B, Hkv, G, r1 - r0, Dv]`` in compute dtype (masked rows = 0)."""
    _, scores = _dot_scores(ops, r0, r1, compute_dtype)
    x, visible = _shifted(scores, tau, _rows(bias, r0, r1), softcap)
    p, weight, row_sum, unit = _probabilities(x, preset, opts, p_dtype, key_tile)
    if weight is not None:
        p = p * weight
    numerator = (p @ ops.v).to(compute_dtype)
    denominator = (unit * torch.where(visible, row_sum, 1.0)).to(compute_dtype)
    out = numerator / denominator
    if ops.v_mean is not None:
        out = out + ops.v_mean
    return torch.where(visible, out, 0.0)


def _row_chunk(b: int, hq: int, lq: int, lkv: int) -> int:
    """Query rows per chunk: all of them, or a multiple of SMOOTH_Q_BLOCK within budget."""
    rows = _CHUNK_ELEMENTS // max(1, b * hq * lkv)
    if rows >= lq:
        return max(lq, 1)
    return max(_ROW_ALIGN, rows // _ROW_ALIGN * _ROW_ALIGN)


def _quantize_output(out: Tensor, static_scales: Mapping | None) -> Tensor:
    """fmha_int8 ``quantize_output``: INT8 with α_o/127 per (batch, head), dequantized.

    out: ``[B, Hq, Lq, Dv]``; α_o = amax over (Lq, Dv) or the static ``"o"`` scale.
    """
    lq = out.shape[-2]
    amax = _static_amax(static_scales, "o")
    q_out, scale = quant.quantize_int(out, max(lq, 1), 8, amax=amax)
    return quant.dequantize(q_out, scale, max(lq, 1), out.dtype)


# --------------------------------------------------------------------------------------------
# public entry points
# --------------------------------------------------------------------------------------------


def _setup(q, k, v, preset, options, compute_dtype, static_scales, scale):
    """Shared validation: returns (options, static scales, τ)."""
    opts = resolve_options(preset, options)
    if preset == "none":
        raise ValueError("preset 'none' leaves the attention untouched; it has no reference")
    _check_inputs(q, k, v, compute_dtype)
    statics = resolve_static_scales(preset, opts, static_scales, q.device,
                                    heads=(q.shape[-3], k.shape[-3]))
    tau = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return opts, statics, tau


def reference_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    preset: str = "flash",
    options: dict | PresetOptions | None = None,
    *,
    compute_dtype: torch.dtype = torch.float32,
    static_scales: Mapping[str, float | Tensor] | None = None,
    key_tile: int = P_KEY_TILE,
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
) -> Tensor:
    """Simulated-quantization reference of ``preset`` (see the module docstring).

    q ``[B, Hq, Lq, D]``, k ``[B, Hkv, Lkv, D]``, v ``[B, Hkv, Lkv, Dv]`` -> ``[B, Hq, Lq,
    Dv]`` in ``q.dtype``. ``options``: dict, :class:`PresetOptions` or None (validated by
    :func:`~qattn_compile.presets.resolve_options`). ``static_scales``: fmha_int8's
    calibrated α (``{"q", "k", "v"[, "o"]}``), required with ``scales: static`` and refused
    otherwise. ``key_tile``: keys per tile of integer P's range under ``p_scale: tile``
    (pass the kernel's ``block_n`` to reproduce it). Query rows are processed in chunks when
    the score matrix is large. ``softcap`` and ``alibi_slopes`` as :func:`exact_attention`.
    """
    opts, statics, tau = _setup(q, k, v, preset, options, compute_dtype, static_scales, scale)
    b, hq, lq, _ = q.shape
    hkv, lkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    if q.numel() == 0 or k.numel() == 0:  # no query rows or no keys: as the kernels
        return q.new_zeros((b, hq, lq, dv))
    ops = _prepare(q, k, v, preset, opts, compute_dtype, statics)
    bias = mask_bias(attn_mask, is_causal, (b, hq, lq, lkv), compute_dtype, q.device)
    bias = _bias_5d(with_alibi(bias, alibi_slopes, (b, hq, lq, lkv), compute_dtype), hkv)
    step = _row_chunk(b, hq, lq, lkv)
    chunks = [
        _attention_rows(
            ops, bias, preset, opts, tau, v.dtype, compute_dtype, key_tile, r0,
            min(r0 + step, lq), softcap
        )
        for r0 in range(0, lq, step)
    ]
    out = torch.cat(chunks, dim=-2).reshape(b, hq, lq, dv)
    if preset == "fmha_int8" and opts.quantize_output:
        out = _quantize_output(out, statics)
    if q.dtype == torch.float16:  # saturate as the kernels do (FP8 P may pass max|V|)
        out = out.clamp(-torch.finfo(torch.float16).max, torch.finfo(torch.float16).max)
    return out.to(q.dtype)


class ScoreParts(NamedTuple):
    """The pieces of a preset's scores, all ``[B, Hq, ...]`` (GQA already broadcast).

    ``dot``: ``[B, Hq, Lq, Lkv]`` float64 ``Q̂·K̂ᵀ`` of the quantized values (exact integers
    for INT presets; for ``flash`` the plain ``Q·Kᵀ`` in the compute dtype).
    ``q_scale``: ``[B, Hq, Lq, 1]`` float32 per-row scale (None for ``flash``).
    ``k_scale``: ``[B, Hq, 1, Lkv]`` float32 per-column scale (None for ``flash``).
    ``delta_s``: ``[B, Hq, Lq, Lkv]`` ΔS of Q smoothing in raw dot units, or None.
    ``scale``: τ. The reference's scores (before the mask) are :meth:`scores`.
    """

    dot: Tensor
    q_scale: Tensor | None
    k_scale: Tensor | None
    delta_s: Tensor | None
    scale: float

    def scores(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """``(dot·q_scale·k_scale + delta_s)·τ`` in ``dtype``, as the reference computes it."""
        s = self.dot.to(dtype)
        if self.q_scale is not None:
            s = s * self.q_scale.to(dtype) * self.k_scale.to(dtype)
        if self.delta_s is not None:
            s = s + self.delta_s.to(dtype)
        return s * self.scale


def _ungroup(x: Tensor | None, shape5: tuple[int, ...]) -> Tensor | None:
    """Broadcast a 5-D ``[B, Hkv, G|1, ...]`` tensor to ``shape5`` and merge to ``[B, Hq, ...]``."""
    if x is None:
        return None
    full = x.expand(*shape5[:3], *x.shape[3:])
    return full.reshape(shape5[0], shape5[1] * shape5[2], *x.shape[3:])


def quantized_scores(
    q: Tensor,
    k: Tensor,
    preset: str,
    options: dict | PresetOptions | None = None,
    scale: float | None = None,
    *,
    compute_dtype: torch.dtype = torch.float32,
    static_scales: Mapping[str, float | Tensor] | None = None,
) -> ScoreParts:
    """Q/K side of ``preset`` exactly as :func:`reference_attention` computes it (no mask).

    For kernel tests: the integer ``Q̂·K̂ᵀ`` can be compared bit for bit, and the scales and
    ΔS separately. q ``[B, Hq, Lq, D]``, k ``[B, Hkv, Lkv, D]``; see :class:`ScoreParts`.
    """
    opts, statics, tau = _setup(q, k, None, preset, options, compute_dtype, static_scales, scale)
    b, hq, lq, _ = q.shape
    hkv = k.shape[1]
    ops = _prepare(q, k, None, preset, opts, compute_dtype, statics)
    dot, _ = _dot_scores(ops, 0, lq, compute_dtype)
    shape5 = (b, hkv, hq // hkv)
    delta = None
    if ops.delta_s is not None:
        rows = torch.arange(lq, device=q.device) // SMOOTH_Q_BLOCK
        delta = _ungroup(ops.delta_s.index_select(-2, rows), shape5)
    return ScoreParts(
        dot=_ungroup(dot, shape5),
        q_scale=_ungroup(ops.q_scale, shape5),
        k_scale=_ungroup(ops.k_scale, shape5),
        delta_s=delta,
        scale=tau,
    )


class ProbParts(NamedTuple):
    """A preset's softmax output: ``O = ((p·weight) @ V̂s) / (unit · l)``.

    ``p``: ``[B, Hq, Lq, Lkv]`` the P entering the PV GEMM (INT presets: integers in
    [0, 127] or [0, 255]; FP8 P: e4m3 values of ``448·P̃``; native P — flash, sage2 with
    ``pv: fp16`` — P̃ rounded to ``p_dtype``), float64 (compute dtype for native P).
    ``weight``: ``[B, Hq, Lq, Lkv]`` float64 ``exp(m_t − m)`` of each entry's key tile with
    ``p_scale: tile`` (integer P is then quantized against its tile's max), else None.
    ``l``: ``[B, Hq, Lq, 1]``: for integer P the row sums of ``p·weight``, for FP8 and native
    P the sums of the unrounded ``P̃ = exp(S − m)`` (0 for fully masked rows). ``unit``: 448
    for FP8 P, else 1.
    """

    p: Tensor
    weight: Tensor | None
    l: Tensor
    unit: float


def quantized_probs(
    q: Tensor,
    k: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    preset: str = "flash",
    options: dict | PresetOptions | None = None,
    *,
    compute_dtype: torch.dtype = torch.float32,
    static_scales: Mapping[str, float | Tensor] | None = None,
    p_dtype: torch.dtype = torch.float32,
    key_tile: int = P_KEY_TILE,
) -> ProbParts:
    """The P and l of ``preset`` exactly as :func:`reference_attention` computes them.

    ``p_dtype``: the V dtype a native P (``flash``, sage2 ``pv: fp16``) is rounded to
    (fp16/bf16 round, others not). ``key_tile`` as in :func:`reference_attention`.
    Whole rows at once (no chunking): meant for tests and small shapes.
    """
    opts, statics, tau = _setup(q, k, None, preset, options, compute_dtype, static_scales, scale)
    b, hq, lq, _ = q.shape
    hkv, lkv = k.shape[1], k.shape[2]
    ops = _prepare(q, k, None, preset, opts, compute_dtype, statics)
    bias = _bias_5d(mask_bias(attn_mask, is_causal, (b, hq, lq, lkv), compute_dtype, q.device), hkv)
    _, scores = _dot_scores(ops, 0, lq, compute_dtype)
    x, visible = _shifted(scores, tau, bias)
    p, weight, row_sum, unit = _probabilities(x, preset, opts, p_dtype, key_tile)
    row_sum = torch.where(visible, row_sum, 0.0)
    shape5 = (b, hkv, hq // hkv)
    return ProbParts(p=_ungroup(p, shape5), weight=_ungroup(weight, shape5),
                     l=_ungroup(row_sum, shape5), unit=unit)
