"""Presets: the attention methods a policy can name, their options and defaults.

Every preset's math is stated here once; the reference implementations
(:mod:`qattn_compile.reference`) and the Triton kernels (:mod:`qattn_compile.kernels`) both
implement exactly this text. Notation, per (batch, query head): Q ``[Lq, D]``, K ``[Lkv, D]``,
V ``[Lkv, Dv]``, softmax scale ``τ`` (default ``1/sqrt(D)``), mask ``M`` (bool: True = attend;
float: added to the scores; causal: key j visible to query i iff ``j <= i``, top-left aligned
as in :func:`torch.nn.functional.scaled_dot_product_attention`). A fully masked row outputs 0.
Token-group sizes for ``warp``/``block`` granularities live in :mod:`qattn_compile.blocks`.

``flash``
    FlashAttention: exact softmax attention in the input dtype with fp32 accumulation.
``int_flash``
    INT-FlashAttention. With ``smooth_k`` (default), K is first smoothed as in SageAttention2:
    ``K ← K − mean_tokens(K)`` per channel, per (batch, kv head), over all ``Lkv`` tokens.
    This is exact math, not an approximation: it shifts every score of query row ``i`` by
    the same constant ``q_i·k̄``, to which softmax is invariant; it keeps K's channel
    outliers (a per-channel offset) from inflating K's INT8 scales.
    ``smooth_k: false, k_granularity: token, p_scale: row, v_granularity: tensor`` is the
    paper's math exactly. Q: symmetric INT8 per token (scale = amax/127); K likewise per
    block of 128 tokens (default; per token, the paper's, with ``k_granularity: token``).
    Scores ``S = (Q̂·K̂ᵀ)·s_q·s_k·τ`` (+ mask). With row max m,
    ``P̂ = round(127·exp(S − m))`` in [0, 127] and ``l = Σ P̂`` (summed from the quantized
    P). V: symmetric INT8 per block of 128 V tokens (default) or per tensor (the paper's,
    ``v_granularity: tensor``). ``O = (P̂·V̂)·s_v / l``. P's range, ``p_scale``:

    - ``tile`` (default): each key tile of a row is quantized against its own max
      ``m_t``: ``P̂ = round(127·exp(S − m_t))`` and the tile's ``P̂·V̂`` and ``ΣP̂`` enter
      O and l weighted by ``exp(m_t − m)``. A tile whose scores sit below the row max then
      keeps all 127 levels instead of a few (the kernel applies the weight to its
      accumulator, one multiply per output element per tile). The key tile is the
      kernel's ``block_n``.
    - ``row``: the paper's single range per row (the running max in a kernel).
``fmha_int8``
    INT8 FMHA. Q, K, V: symmetric INT8 per tensor with scales α/127 (α = amax, dynamic, or
    calibrated, static). ``P̂ = clamp(round(255·exp(S − m)), 0, 255)`` (UINT8 semantics),
    ``l = Σ P̂``, ``O = (P̂·V̂)·s_v / l``; ``p_scale`` as for ``int_flash`` (``tile``, the
    default, quantizes P per key tile against the tile's max); with ``quantize_output`` O is re-quantized to INT8
    with α_o/127 (α_o = amax(O), or calibrated) and dequantized. Dynamic α is taken per
    (batch, head); static α is one value per head (``static_scales``: ``q``/``o`` per query
    head, ``k``/``v`` per kv head), recorded by ``qattn calibrate`` and filled into each
    site's options from the ``calibration`` file by
    :func:`qattn_compile.scales.options_for_site`.
``sage2_8b``
    SageAttention2, 8-bit. K smoothing: ``K ← K − mean_tokens(K)`` per channel (exact: it
    shifts every score of a row by one constant). Q smoothing: per block of SMOOTH_Q_BLOCK
    query tokens, ``Q ← Q − q̄`` and ``ΔS = q̄·Kᵀ`` (fp32, on the smoothed K) is added back
    to the scores. Q, K: symmetric INT8 (amax/127) per ``qk_granularity``. ``P̃ = exp(S − m)``,
    ``l = Σ P̃`` (fp32, before quantization). ``P·V`` per ``pv`` (the paper has both kernels):

    - ``fp8`` (default): ``P̂ = fp8_e4m3(448·P̃)``; V: FP8 e4m3 per channel (scale = amax
      over tokens / 448), optionally smoothed (``smooth_v``: ``V ← V − mean_tokens(V)``,
      the mean added back to O). ``O = (P̂·V̂)/448·s_v / l`` with fp32 accumulation.
    - ``fp16``: P and V in the input's 16-bit dtype (fp16 or bf16; fp32 inputs stay fp32),
      ``P̂ = dtype(P̃)``, V unquantized, ``O = (P̂·V) / l`` with fp32 accumulation.
      ``smooth_v`` only serves the FP8 V scale and is refused with it.
``sage2_4b``
    As ``sage2_8b`` with Q, K symmetric INT4 (values in [−7, 7], scale amax/7), stored
    packed two per byte and multiplied with the INT8 dot.
``turbo``
    TurboAttention. FlashQ: Q, K, V symmetric INT8 per block (QUANT_BLOCK_Q query tokens,
    QUANT_BLOCK_KV key/value tokens). SAS softmax: ``exp(x)`` for ``x = S − m <= 0`` is
    ``2^y`` with ``y = x·log2(e)``, split into the integer part (built as a power of two)
    and the fractional part (degree-3 polynomial, coefficients in
    :mod:`qattn_compile.reference.sas`); ``x < sas_threshold`` gives 0 (and a tile whose
    scores are all below it is skipped). ``P̂ = round(127·P)`` (INT8), ``l = Σ P̂``,
    ``O = (P̂·V̂)·s_v / l``. With ``exp: hardware`` the exact exp is used instead of SAS.
    ``p_scale`` as for ``int_flash``; with ``tile`` (default) ``x`` is taken against the key
    tile's max, so the SAS threshold zeroes scores below the tile's max + threshold (a
    subset of those below the row's), and a tile is still skipped only when all its scores
    are below the running row max + threshold.
``fp8``
    FlashAttention-3-style FP8: Q, K, V FP8 e4m3 (scale amax/448) per ``granularity``:
    ``block`` (default; Q per token, K and V per :data:`~qattn_compile.blocks.FP8_KV_BLOCK` =
    256 tokens: one quantizer pass per operand, Q's fused with its RoPE in a compiled model,
    and a token outlier coarsens only its own block), ``tensor`` (one scale per (batch,
    head), FlashAttention-3's; a statistics pass per operand first), or ``q_token`` (as
    ``block`` with K and V per 64 tokens; slightly faster for short prefills in a compiled
    model, slower at long ones, where its per-64-token V caps the key tile at 64).
    ``P̃ = exp(S − m)``, ``l = Σ P̃``, ``P̂ = fp8_e4m3(448·P̃)``, ``O = (P̂·V̂)/448·s_v / l``.
``none``
    Leave the site as it is.

Every preset that runs a kernel also takes ``autotune`` (:class:`KernelOptions`): time the
kernel's tile candidates on the GPU and keep the fastest (:mod:`qattn_compile.kernels.autotune`)
instead of the built-in table. It changes launch parameters, not the math, except that
``p_scale: tile`` quantizes P over the chosen ``block_n`` keys.
"""

from __future__ import annotations

import functools
import json
import math
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictStr,
    ValidationError,
    model_validator,
)

from .errors import PolicyError
from .messages import describe_value, problem_sentence


class PresetOptions(BaseModel):
    """Base of every preset's options: immutable, unknown keys rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    def to_json(self) -> str:
        """Canonical JSON text of these options (what the graph op carries)."""
        return self.model_dump_json()


class NoOptions(PresetOptions):
    """The ``none`` preset's options (there are none)."""


class KernelOptions(PresetOptions):
    """Options every preset that runs a qattn kernel has (the base of their option classes)."""

    autotune: StrictBool = Field(
        False,
        description="Time the kernel's tile-size candidates on the GPU and keep the fastest "
        "(once per shape class, cached on disk; see qattn_compile.kernels.autotune) instead of "
        "the built-in table.",
    )


class FlashOptions(KernelOptions):
    """Options of ``flash`` (only the kernel's)."""


PScale = Literal["tile", "row"]
_P_SCALE_HELP = (
    "Integer P's range: per key tile against the tile's max, weighted by exp(m_tile − m) "
    "(tile), or per row against the row max (row: the paper's math)."
)


class IntFlashOptions(KernelOptions):
    """Options of ``int_flash`` (INT-FlashAttention)."""

    v_granularity: Literal["tensor", "block"] = Field(
        "block", description="INT8 V scale per block of 128 tokens (one scale per key tile, no "
        "statistics pass; a row over small V values keeps its INT8 levels) or per tensor (paper)."
    )
    k_granularity: Literal["token", "block"] = Field(
        "block", description="INT8 K scale per block of 128 tokens (one scale per key tile: no "
        "per-score multiply, fewer registers in the kernel) or per token (paper)."
    )
    smooth_k: StrictBool = Field(
        True, description="Subtract K's per-channel token mean (exact; false: the paper's math)."
    )
    p_scale: PScale = Field("tile", description=_P_SCALE_HELP)


def _amax_or_amaxes(value: object) -> float | tuple[float, ...]:
    """One calibrated amax for every head, or a list of them (one per head): finite numbers,
    at least 0 (0 for a head that was all zeros). Checked here rather than as a pydantic
    union, whose error would list every member of the union."""
    items = value if isinstance(value, (list, tuple)) else (value,)
    for item in items:
        if (isinstance(item, bool) or not isinstance(item, (int, float))
                or not math.isfinite(item) or item < 0):
            raise ValueError("must be an amax (a finite number, at least 0) or a list of them "
                             f"(one per head), got {describe_value(value)}")
    amaxes = tuple(float(item) for item in items)
    return amaxes if isinstance(value, (list, tuple)) else amaxes[0]


AmaxPerHead = Annotated[tuple[float, ...] | float, BeforeValidator(_amax_or_amaxes)]
"""A calibrated amax for every head (a float) or one per head (a tuple of floats)."""


class StaticScales(BaseModel):
    """Calibrated α of one ``fmha_int8`` site (static mode): amax values, not α/127.

    Each entry is one float per head (``q``/``o``: query heads, ``k``/``v``: kv heads) or a
    single float for every head. :meth:`tensors` gives the ``static_scales`` mapping of
    :func:`qattn_compile.reference.reference_attention` (tensors ``[1, H, 1]``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    q: AmaxPerHead = Field(description="α_q: amax of Q per query head.")
    k: AmaxPerHead = Field(description="α_k: amax of K per kv head.")
    v: AmaxPerHead = Field(description="α_v: amax of V per kv head.")
    o: AmaxPerHead | None = Field(
        None, description="α_o: amax of O per query head (used with quantize_output)."
    )

    def tensors(self, device=None) -> dict:
        """``{"q", "k", "v"[, "o"]}`` as float32 tensors ``[1, H, 1]`` (or floats)."""
        import torch

        def one(value):
            if isinstance(value, float):
                return value
            return torch.tensor(value, dtype=torch.float32, device=device).view(1, -1, 1)

        out = {name: one(getattr(self, name)) for name in ("q", "k", "v")}
        if self.o is not None:
            out["o"] = one(self.o)
        return out


class FmhaInt8Options(KernelOptions):
    """Options of ``fmha_int8`` (INT8 FMHA).

    Static mode: ``scales: static`` with ``calibration: <file of qattn calibrate>``. The
    policy names only the file; the per-site α are filled into ``static_scales`` when the
    site is rewritten (:func:`qattn_compile.scales.options_for_site`), so the
    graph op carries them in its options JSON and the reference/kernels read them there.
    Relative ``calibration`` paths are resolved against the working directory, then against
    the policy file's directory.
    """

    scales: Literal["dynamic", "static"] = Field(
        "dynamic", description="α from each call's amax (dynamic) or from a calibration file."
    )
    calibration: StrictStr | None = Field(
        None, description="Path of a scales file written by `qattn calibrate` (static mode)."
    )
    quantize_output: StrictBool = Field(False, description="Re-quantize O to INT8 with α_o/127.")
    p_scale: PScale = Field("tile", description=_P_SCALE_HELP)
    static_scales: StaticScales | None = Field(
        None,
        description="Per-site calibrated α (static mode), filled in from `calibration` when "
        "the site is rewritten; not meant to be written by hand.",
    )

    @model_validator(mode="after")
    def _static_needs_calibration(self) -> "FmhaInt8Options":
        if self.scales == "static" and not self.calibration and self.static_scales is None:
            raise ValueError("scales: static needs `calibration: <path to scales file>`")
        if self.static_scales is not None:
            if self.scales != "static":
                raise ValueError("static_scales are only read with `scales: static`")
            if self.quantize_output and self.static_scales.o is None:
                raise ValueError("static_scales lack `o` (α_o), needed by quantize_output")
        return self


class Sage2Options(KernelOptions):
    """Options of ``sage2_8b`` and ``sage2_4b`` (SageAttention2)."""

    qk_granularity: Literal["warp", "block", "token"] = Field(
        "warp", description="Tokens per Q/K scale (see qattn_compile.blocks)."
    )
    smooth_k: StrictBool = Field(True, description="Subtract K's per-channel token mean.")
    smooth_q: StrictBool = Field(True, description="Subtract Q's per-block mean, add ΔS back.")
    smooth_v: StrictBool = Field(False, description="Subtract V's channel mean, add it back to O.")
    pv: Literal["fp8", "fp16"] = Field(
        "fp8", description="P·V in FP8 e4m3 (P and per-channel V) or in the input's 16-bit dtype."
    )

    @model_validator(mode="after")
    def _smooth_v_needs_fp8_pv(self) -> "Sage2Options":
        if self.smooth_v and self.pv == "fp16":
            raise ValueError(
                "`smooth_v: true` does not go with `pv: fp16`: smoothing V only serves the "
                "per-channel FP8 scale of `pv: fp8`, and with fp16 V is not quantized "
                "(drop smooth_v, or use pv: fp8)"
            )
        return self


class TurboOptions(KernelOptions):
    """Options of ``turbo`` (TurboAttention)."""

    exp: Literal["sas", "hardware"] = Field(
        "sas", description="SAS polynomial exp (paper) or the hardware exp."
    )
    sas_threshold: StrictFloat = Field(
        -6.0, lt=0, ge=-80.0,
        description="Scores below max+threshold give P=0 (>= -80: the kernel builds 2^y from y's "
                    "integer part as a float32 exponent, which needs y >= -126).")
    p_scale: PScale = Field("tile", description=_P_SCALE_HELP)


class Fp8Options(KernelOptions):
    """Options of ``fp8`` (FlashAttention-3-style FP8)."""

    granularity: Literal["tensor", "block", "q_token"] = Field(
        "block", description="FP8 scales per token for Q with K and V per block of 128 tokens "
        "(block), per tensor, or per token for Q with K and V per 64 tokens (q_token)."
    )


PRESET_OPTIONS: dict[str, type[PresetOptions]] = {
    "none": NoOptions,
    "flash": FlashOptions,
    "int_flash": IntFlashOptions,
    "fmha_int8": FmhaInt8Options,
    "sage2_8b": Sage2Options,
    "sage2_4b": Sage2Options,
    "turbo": TurboOptions,
    "fp8": Fp8Options,
}
PRESET_NAMES: tuple[str, ...] = tuple(PRESET_OPTIONS)
QUANTIZED_PRESETS: tuple[str, ...] = tuple(p for p in PRESET_NAMES if p not in ("none", "flash"))

PRESET_METHODS: dict[str, str] = {
    "none": "leave the original attention untouched",
    "flash": "FlashAttention (bf16/fp16, exact)",
    "int_flash": "INT-FlashAttention (INT8 Q/K/P/V)",
    "fmha_int8": "INT8 FMHA (INT8 Q/K/V, UINT8 P)",
    "sage2_8b": "SageAttention2 8-bit (smoothed INT8 Q/K, FP8 or FP16 P/V)",
    "sage2_4b": "SageAttention2 4-bit (smoothed INT4 Q/K, FP8 or FP16 P/V)",
    "turbo": "TurboAttention (FlashQ INT8 + SAS softmax)",
    "fp8": "FlashAttention-3-style FP8",
}


def option_names(preset: str) -> str:
    """The options ``preset`` takes, for messages: ``autotune, v_granularity, ...`` or
    ``none (the preset takes no options)``."""
    return ", ".join(PRESET_OPTIONS[preset].model_fields) or "none (the preset takes no options)"


def resolve_options(preset: str, options: dict | PresetOptions | None = None) -> PresetOptions:
    """Validate ``options`` for ``preset`` and fill in the defaults.

    Raises :class:`PolicyError` naming the preset, the offending field and what is allowed.
    """
    if preset not in PRESET_OPTIONS:
        raise PolicyError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESET_NAMES)}")
    cls = PRESET_OPTIONS[preset]
    if isinstance(options, PresetOptions):
        if not isinstance(options, cls):
            raise PolicyError(
                f"options of type {type(options).__name__} do not belong to preset {preset!r}"
            )
        return options
    try:
        return cls(**(options or {}))
    except ValidationError as exc:
        problems = "; ".join(
            f"field `{'.'.join(str(p) for p in e['loc'])}`: "
            f"{problem_sentence(e, cls, str(e['loc'][-1]))}"
            if e["loc"] else f"options: {problem_sentence(e, cls, '')}"
            for e in exc.errors()
        )
        raise PolicyError(f"bad options for preset {preset!r}: {problems}") from None


@functools.lru_cache(maxsize=512)
def options_from_json(preset: str, text: str) -> PresetOptions:
    """Inverse of :meth:`PresetOptions.to_json` (used by the graph op on every call, hence
    cached: the options are frozen, and a graph holds a handful of distinct texts). Text
    that is not a JSON object of ``preset``'s options raises :class:`PolicyError` as
    :func:`resolve_options` does."""
    if preset not in PRESET_OPTIONS:
        raise PolicyError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESET_NAMES)}")
    try:
        settings = json.loads(text)
    except ValueError as exc:
        raise PolicyError(f"options of preset {preset!r} are not JSON ({exc}): {text!r}") from None
    if not isinstance(settings, dict):
        raise PolicyError(f"options of preset {preset!r} must be a JSON object, got {text!r}")
    return resolve_options(preset, settings)


def resolve_static_scales(preset: str, options: PresetOptions, explicit=None, device=None,
                          heads: tuple[int, int] | None = None):
    """The calibrated α a call of ``preset`` uses, or ``None`` in dynamic mode.

    ``explicit`` (a mapping ``{"q", "k", "v"[, "o"]}`` of floats or tensors broadcastable to
    ``[B, H, 1]``) wins over the options' own ``static_scales`` (filled in per site from the
    calibration file by the rewrite). ``heads``: the call's ``(query heads, kv heads)``, which
    per-head α must match (``q``/``o`` per query head, ``k``/``v`` per kv head). Raises
    ``ValueError`` when scales are given to a preset that does not use them, when static
    ``fmha_int8`` has none or lacks a key, or when a key's head count does not match.
    """
    static = preset == "fmha_int8" and options.scales == "static"
    if not static:
        if explicit is not None:
            raise ValueError(
                f"static_scales are only used by fmha_int8 with `scales: static` (preset {preset!r} got them)"
            )
        return None
    scales = explicit
    if scales is None and options.static_scales is not None:
        scales = options.static_scales.tensors(device)
    needed = ["q", "k", "v"] + (["o"] if options.quantize_output else [])
    if scales is None:
        raise ValueError(
            f"fmha_int8 with `scales: static` needs static_scales with keys {needed}: "
            + (f"the calibration file {options.calibration!r} is read per site by the "
               "torch.compile backend's rewrite; an eager call takes static_scales={...}"
               if options.calibration else "none were given")
        )
    missing = [key for key in needed if key not in scales]
    if missing:
        raise ValueError(f"static_scales lacks {missing}; fmha_int8 static needs keys {needed}")
    if heads is not None:
        for key in needed:
            _check_static_scale_heads(key, scales[key], heads[0] if key in ("q", "o") else heads[1])
    return scales


def _check_static_scale_heads(key: str, given, heads: int) -> None:
    """``given`` (α of ``key``: a float, or a tensor broadcastable to ``[B, H, 1]``) holds one
    value for every head or one per head of the call's ``heads``."""
    dims = tuple(getattr(given, "shape", ()))
    if dims and dims[-1] != 1:
        raise ValueError(f"static_scales[{key!r}] of shape {dims} must broadcast to [B, H, 1]")
    per_batch = dims[-2] if len(dims) >= 2 else 1
    if per_batch not in (1, heads):
        kind = "query" if key in ("q", "o") else "key/value"
        raise ValueError(f"static_scales[{key!r}] holds {per_batch} values per batch, for {kind} "
                         f"heads; this call has {heads} (give one per head, or one for all)")
