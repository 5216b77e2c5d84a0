"""Tests of the plain-PyTorch reference: exact oracle, preset math, quantizers, SAS, smoothing.

Inputs are fresh seeded random tensors (conftest seeds 0 before every test), never zeros.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from qattn_compile.blocks import (
    QUANT_BLOCK_KV, QUANT_BLOCK_Q, QUANT_WARP_Q, SMOOTH_Q_BLOCK, int_flash_group_sizes)
from qattn_compile.errors import PolicyError
from qattn_compile.presets import QUANTIZED_PRESETS, Sage2Options, resolve_options
from qattn_compile.reference import (
    SAS_POLY,
    exact_attention,
    quantized_probs,
    quantized_scores,
    reference_attention,
    sas_exp,
)
from qattn_compile.reference import attention as attention_mod
from qattn_compile.reference import quant, smooth
from qattn_compile.reference.sas import SAS_MAX_REL_ERROR, fit_sas_poly, sas_poly

ALL_PRESETS = ("flash",) + QUANTIZED_PRESETS


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------


def qkv(b=1, hq=2, hkv=None, lq=37, lkv=None, d=64, dv=None, dtype=torch.float32):
    """Fresh N(0, 1) q, k, v."""
    hkv, lkv, dv = hkv or hq, lkv or lq, dv or d
    return (
        torch.randn(b, hq, lq, d, dtype=dtype),
        torch.randn(b, hkv, lkv, d, dtype=dtype),
        torch.randn(b, hkv, lkv, dv, dtype=dtype),
    )


def rel_l1(out, ref):
    """Σ|o − r| / Σ|r| in float64."""
    out, ref = out.double(), ref.double()
    return ((out - ref).abs().sum() / ref.abs().sum()).item()


def cos_sim(out, ref):
    return F.cosine_similarity(out.double().flatten(), ref.double().flatten(), dim=0).item()


def naive_attention(q, k, v, keep, bias, scale):
    """Loop-per-row softmax attention in float64 (GQA by index); ``keep``/``bias`` full-size."""
    b, hq, lq, _ = q.shape
    group = hq // k.shape[1]
    out = torch.zeros(b, hq, lq, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for h in range(hq):
            kh, vh = k[bi, h // group].double(), v[bi, h // group].double()
            for i in range(lq):
                idx = [j for j in range(k.shape[2]) if keep[bi, h, i, j]]
                if not idx:
                    continue
                qi = q[bi, h, i].double()
                s = torch.stack([qi @ kh[j] * scale + bias[bi, h, i, j] for j in idx])
                w = torch.exp(s - s.max())
                out[bi, h, i] = (w[:, None] * vh[idx]).sum(0) / w.sum()
    return out


def random_bool_mask(shape, p_keep=0.7, keep_diag=True):
    mask = torch.rand(shape) < p_keep
    if keep_diag:
        n = min(shape[-2], shape[-1])
        mask[..., torch.arange(n), torch.arange(n)] = True
    return mask


# ------------------------------------------------------------------------------------------
# exact_attention: the oracle
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [32, 64, 80, 96, 128, 256])
def test_exact_matches_sdpa_head_dims(d):
    q, k, v = qkv(b=2, hq=2, lq=19, lkv=23, d=d, dtype=torch.float64)
    ref = F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(exact_attention(q, k, v), ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "case",
    ["bool", "additive", "causal", "causal_rect", "gqa_4_2", "gqa_8_2", "gqa_mask", "odd", "scale"],
)
def test_exact_matches_sdpa(case):
    hq, hkv, lq, lkv = 2, 2, 37, 37
    if case.startswith("gqa"):
        hq, hkv = (8, 2) if case == "gqa_8_2" else (4, 2)
    if case in ("causal_rect", "odd"):
        lq, lkv = 37, 71
    q, k, v = qkv(b=2, hq=hq, hkv=hkv, lq=lq, lkv=lkv, d=64, dtype=torch.float64)
    kwargs, mask = {}, None
    if case in ("bool", "gqa_mask"):
        mask = random_bool_mask((2, 1, lq, lkv))
    if case == "additive":
        mask = torch.randn(2, hq, lq, lkv, dtype=torch.float64)
        mask[random_bool_mask((2, hq, lq, lkv), p_keep=0.8).logical_not()] = -math.inf
    if case.startswith("causal"):
        kwargs["is_causal"] = True
    if case == "scale":
        kwargs["scale"] = 0.3
    ref = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, enable_gqa=hq != hkv, **kwargs
    )
    out = exact_attention(q, k, v, attn_mask=mask, **kwargs)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_exact_matches_naive_loop_causal_plus_masks_gqa():
    b, hq, hkv, lq, lkv = 2, 4, 2, 9, 13
    q, k, v = qkv(b=b, hq=hq, hkv=hkv, lq=lq, lkv=lkv, d=16, dv=8)
    bool_mask = random_bool_mask((b, 1, lq, lkv), p_keep=0.6, keep_diag=False)
    bool_mask[0, 0, 3] = False  # a fully masked row
    causal = torch.ones(lq, lkv, dtype=torch.bool).tril()
    keep = (bool_mask & causal).expand(b, hq, lq, lkv)
    zero_bias = torch.zeros(b, hq, lq, lkv, dtype=torch.float64)
    want = naive_attention(q, k, v, keep, zero_bias, 0.25)
    got = exact_attention(q, k, v, attn_mask=bool_mask, is_causal=True, scale=0.25)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)

    additive = torch.randn(b, hq, lq, lkv, dtype=torch.float64)
    additive[~random_bool_mask((b, hq, lq, lkv), keep_diag=False)] = -math.inf
    keep = (additive > -math.inf) & causal
    want = naive_attention(q, k, v, keep, additive, 1 / 4)
    got = exact_attention(q, k, v, attn_mask=additive, is_causal=True)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_exact_fully_masked_rows_are_zero():
    q, k, v = qkv(b=1, hq=2, lq=8, lkv=8, d=32)
    bool_mask = torch.ones(1, 2, 8, 8, dtype=torch.bool)
    bool_mask[0, 0, 2] = False
    additive = torch.zeros(1, 2, 8, 8)
    additive[0, 1, 5] = -math.inf
    causal_mask = torch.ones(8, 8, dtype=torch.bool)
    causal_mask[0, 0] = False  # row 0 sees only key 0 under causal: now nothing
    for kwargs, (h, row) in [
        ({"attn_mask": bool_mask}, (0, 2)),
        ({"attn_mask": additive}, (1, 5)),
        ({"attn_mask": causal_mask, "is_causal": True}, (0, 0)),
    ]:
        out = exact_attention(q, k, v, **kwargs)
        assert not out.isnan().any()
        assert torch.equal(out[0, h, row], torch.zeros_like(out[0, h, row]))
        assert out[0, h, row + 1].abs().sum() > 0


# ------------------------------------------------------------------------------------------
# flash reference
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mask_kind", [None, "bool", "causal", "gqa"])
def test_flash_reference_matches_exact(mask_kind):
    hkv = 1 if mask_kind == "gqa" else 2
    q, k, v = qkv(b=2, hq=2, hkv=hkv, lq=45, lkv=71, d=80)
    mask = random_bool_mask((2, 1, 45, 71)) if mask_kind in ("bool", "gqa") else None
    causal = mask_kind == "causal"
    out = reference_attention(q, k, v, attn_mask=mask, is_causal=causal, preset="flash")
    assert out.dtype == torch.float32
    ref = exact_attention(q, k, v, attn_mask=mask, is_causal=causal)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flash_half_inputs_round_p(dtype):
    """Half inputs: flash's P is rounded to the input dtype before P·V (as the kernel's 16-bit
    dot does), l sums the unrounded P, O = (P̂·V) / l."""
    q, k, v = qkv(lq=64, d=64, dtype=dtype)
    parts = quantized_probs(q, k, preset="flash", p_dtype=dtype)
    scores = quantized_scores(q, k, "flash").scores()
    p_float = torch.exp(scores - scores.amax(-1, keepdim=True))
    assert torch.equal(parts.p, p_float.to(dtype).float())
    torch.testing.assert_close(parts.l, p_float.sum(-1, keepdim=True))
    out = reference_attention(q, k, v, preset="flash")
    assert out.dtype == dtype
    # the output is that of the rounded P: nearer (P̂·V) / l than (P·V) / l, beyond the
    # output's own rounding
    rounded, unrounded = ((p @ v.float()) / parts.l for p in (parts.p, p_float))
    assert rel_l1(out, rounded) < 0.8 * rel_l1(out, unrounded)


# ------------------------------------------------------------------------------------------
# quantized presets: accuracy against the exact oracle
# ------------------------------------------------------------------------------------------

# rel-L1 bounds on N(0, 1) data, B=1, H=2, L=256, D=64 (measured values in the comments)
NORMAL_BOUNDS = {
    ("int_flash", None): (0.01, 0.04),  # 1.8 % (K per 128 tokens)
    ("int_flash", (("v_granularity", "tensor"),)): (0.01, 0.04),  # 1.8 % (the paper's V)
    ("int_flash", (("smooth_k", False),)): (0.01, 0.04),  # 1.8 %
    ("int_flash", (("k_granularity", "token"),)): (0.01, 0.04),  # 1.7 % (the paper's K)
    ("fmha_int8", None): (0.01, 0.04),  # 1.9 %
    ("fmha_int8", (("quantize_output", True),)): (0.01, 0.045),  # 2.3 %
    ("sage2_8b", None): (0.02, 0.06),  # 3.8 %
    ("sage2_8b", (("smooth_v", True),)): (0.02, 0.06),  # 3.8 %
    ("sage2_8b", (("pv", "fp16"),)): (0.005, 0.02),  # 1.2 % (fp32 inputs: INT8 Q/K only)
    ("sage2_4b", None): (0.12, 0.35),  # 22 %
    ("sage2_4b", (("pv", "fp16"),)): (0.12, 0.35),  # 21 %
    ("turbo", None): (0.01, 0.04),  # 2.3 %
    ("turbo", (("exp", "hardware"),)): (0.01, 0.04),  # 2.3 %
    ("fp8", None): (0.03, 0.09),  # 5.3 %
    ("fp8", (("granularity", "block"),)): (0.03, 0.09),  # 5.4 %
    ("fp8", (("granularity", "q_token"),)): (0.03, 0.09),  # 5.2 %
}


@pytest.fixture(scope="module")
def normal_errors():
    """rel-L1 and cos of every preset variant on one N(0, 1) problem."""
    torch.manual_seed(1)
    q, k, v = qkv(b=1, hq=2, lq=256, d=64)
    ref = exact_attention(q, k, v)
    errors = {}
    for preset, opts in NORMAL_BOUNDS:
        out = reference_attention(q, k, v, preset=preset, options=dict(opts or ()))
        errors[preset, opts] = (rel_l1(out, ref), cos_sim(out, ref))
    return errors


@pytest.mark.parametrize("variant", list(NORMAL_BOUNDS), ids=str)
def test_preset_error_in_plausible_range(normal_errors, variant):
    low, high = NORMAL_BOUNDS[variant]
    err, cos = normal_errors[variant]
    assert low < err < high
    assert cos > 1 - 4 * err * err - 1e-4  # small rel-L1 comes with cos near 1


def test_preset_error_orderings(normal_errors):
    e = {key: val[0] for key, val in normal_errors.items()}
    assert e["int_flash", None] < e["fp8", None] * 0.6  # INT-FlashAttention's claim vs FP8
    assert e["sage2_8b", None] < e["sage2_4b", None] / 3
    assert e["sage2_8b", (("pv", "fp16"),)] < e["sage2_8b", None] / 2  # FP8 P·V dominates
    assert e["fmha_int8", None] < e["fmha_int8", (("quantize_output", True),)]
    assert abs(e["turbo", None] - e["turbo", (("exp", "hardware"),)]) < 0.05 * e["turbo", None]


def test_int4_finer_groups_are_more_accurate():
    q, k, v = qkv(lq=256, d=64)
    ref = exact_attention(q, k, v)
    errs = [
        rel_l1(reference_attention(q, k, v, preset="sage2_4b", options={"qk_granularity": g}), ref)
        for g in ("token", "warp", "block")
    ]
    assert errs[0] < errs[1] < errs[2]


def test_uniform_data_int8_beats_fp8_by_far():
    q, k, v = (torch.rand(1, 2, 256, 64) - 0.5 for _ in range(3))
    ref = exact_attention(q, k, v)
    int_err = rel_l1(reference_attention(q, k, v, preset="int_flash"), ref)
    fp8_err = rel_l1(reference_attention(q, k, v, preset="fp8"), ref)
    assert int_err < 0.01 and int_err < fp8_err / 3


def test_int_flash_default_v_keeps_its_levels_where_v_is_small():
    """V's magnitude growing 100x along the sequence (0.1 to 10 per token), causal: with one
    V scale per tensor the early rows, which see only small V, get a few INT8 levels; the
    default, one scale per 128 tokens, stays near its error on plain N(0, 1) V."""
    q, k, v = qkv(lq=512, d=64)
    v_spread = v * torch.logspace(-1, 1, 512).view(1, 1, -1, 1)
    errors = {}
    for name, values in (("plain", v), ("spread", v_spread)):
        ref = exact_attention(q, k, values, is_causal=True)
        for v_granularity in ("block", "tensor"):
            out = reference_attention(q, k, values, preset="int_flash", is_causal=True,
                                      options={"v_granularity": v_granularity})
            errors[name, v_granularity] = rel_l1(out, ref)
    default = resolve_options("int_flash", {}).v_granularity
    assert errors["spread", default] < 1.5 * errors["plain", default]
    assert errors["spread", "tensor"] > 4 * errors["spread", "block"]


def _with_k_outliers(k, magnitude=20.0):
    """K plus a per-channel constant on a few channels (the outliers real K has)."""
    k = k.clone()
    k[..., :4] += magnitude
    k[..., 10] -= magnitude
    return k


@pytest.mark.parametrize("preset", ["sage2_8b", "sage2_4b"])
def test_k_smoothing_removes_channel_outliers(preset):
    q, k, v = qkv(lq=256, d=64)
    k_out = _with_k_outliers(k)
    clean = rel_l1(reference_attention(q, k, v, preset=preset), exact_attention(q, k, v))
    ref = exact_attention(q, k_out, v)
    smoothed = rel_l1(reference_attention(q, k_out, v, preset=preset), ref)
    raw = rel_l1(reference_attention(q, k_out, v, preset=preset, options={"smooth_k": False}), ref)
    assert smoothed < (0.7 if preset == "sage2_8b" else 0.35) * raw
    assert abs(smoothed - clean) < 0.1 * clean  # a channel bias is removed exactly


def test_k_outliers_hurt_unsmoothed_int8():
    paper = {"smooth_k": False, "k_granularity": "token"}  # INT-FlashAttention's Q/K quantization
    q, k, v = qkv(lq=256, d=64)
    k_out = _with_k_outliers(k)
    clean = rel_l1(reference_attention(q, k, v, preset="int_flash", options=paper),
                   exact_attention(q, k, v))
    ref = exact_attention(q, k_out, v)
    outl = rel_l1(reference_attention(q, k_out, v, preset="int_flash", options=paper), ref)
    sage = rel_l1(reference_attention(q, k_out, v, preset="sage2_8b"), ref)
    assert outl > 1.5 * clean and sage < outl


def test_int_flash_smooth_k_makes_outliers_harmless():
    """With ``smooth_k`` (default) a per-channel K offset no longer costs accuracy: rel-L1
    with outliers stays within 1.3× of the clean error, and K + c gives the output of K."""
    q, k, v = qkv(lq=256, d=64)
    k_out = _with_k_outliers(k)
    clean = rel_l1(reference_attention(q, k, v, preset="int_flash"), exact_attention(q, k, v))
    ref = exact_attention(q, k_out, v)
    smoothed = rel_l1(reference_attention(q, k_out, v, preset="int_flash"), ref)
    raw = rel_l1(reference_attention(q, k_out, v, preset="int_flash",
                                     options={"smooth_k": False}), ref)
    assert smoothed < 1.3 * clean and raw > 1.5 * clean
    kw = {"preset": "int_flash", "compute_dtype": torch.float64}
    same = reference_attention(q.double(), k_out.double(), v.double(), **kw)
    assert rel_l1(same, reference_attention(q.double(), k.double(), v.double(), **kw)) < 1e-3


# ------------------------------------------------------------------------------------------
# preset math
# ------------------------------------------------------------------------------------------


def _mask_with_empty_row(lq, lkv):
    mask = random_bool_mask((1, 1, lq, lkv), p_keep=0.6)
    mask[..., 4, :] = False
    return mask


@pytest.mark.parametrize(
    "preset,options,p_max",
    [
        ("int_flash", {"p_scale": "row"}, 127),
        ("int_flash", {"p_scale": "tile"}, 127),
        ("turbo", {"p_scale": "row"}, 127),
        ("turbo", {"p_scale": "tile"}, 127),
        ("fmha_int8", {"p_scale": "row"}, 255),
        ("fmha_int8", {"p_scale": "tile"}, 255),
    ],
)
def test_integer_p(preset, options, p_max):
    q, k, _ = qkv(lq=70, lkv=90, d=64)
    mask = _mask_with_empty_row(70, 90)
    parts = quantized_probs(q, k, attn_mask=mask, is_causal=True, preset=preset,
                            options=options, key_tile=32)
    p, row_sum = parts.p, parts.l
    visible = mask & torch.ones(70, 90, dtype=torch.bool).tril()
    assert parts.unit == 1.0
    assert torch.equal(p, p.round()) and p.min() >= 0 and p.max() <= p_max
    assert torch.equal(p[~visible.expand_as(p)], torch.zeros_like(p[~visible.expand_as(p)]))
    has_key = visible.any(-1).expand(p.shape[:-1])
    assert torch.equal(p.amax(-1)[has_key], torch.full_like(p.amax(-1)[has_key], p_max))
    weighted = p if parts.weight is None else p * parts.weight
    assert (parts.weight is not None) == ((options or {}).get("p_scale") == "tile")
    assert torch.equal(row_sum[..., 0], weighted.sum(-1))
    assert torch.equal(row_sum[0, :, 4], torch.zeros_like(row_sum[0, :, 4]))


@pytest.mark.parametrize("preset,p_max", [("int_flash", 127), ("fmha_int8", 255), ("turbo", 127)])
def test_tile_p_scale_quantizes_each_key_tile_against_its_max(preset, p_max):
    """``p_scale: tile``: every key tile with a visible key reaches ``p_max`` at its own
    max, and its weight is ``exp(m_t − m)``: 1 on the tile holding the row max, below 1
    elsewhere, constant within a tile."""
    q, k, _ = qkv(lq=40, lkv=100, d=64)
    mask = _mask_with_empty_row(40, 100)
    parts = quantized_probs(q, k, attn_mask=mask, preset=preset, key_tile=32)
    x = quantized_scores(q, k, preset).scores(torch.float64)
    x = x.masked_fill(~mask, -math.inf)
    p, w = parts.p[0], parts.weight[0]
    for t0 in range(0, 100, 32):
        tile_p, tile_w, tile_x = p[..., t0:t0 + 32], w[..., t0:t0 + 32], x[0, ..., t0:t0 + 32]
        live = (tile_x > -math.inf).any(-1)
        assert torch.equal(tile_p.amax(-1)[live], torch.full_like(tile_p.amax(-1)[live], p_max))
        assert torch.equal(tile_w.amin(-1)[live], tile_w.amax(-1)[live])
        want = torch.exp(tile_x.amax(-1) - x[0].amax(-1))[live]
        torch.testing.assert_close(tile_w[..., 0][live], want, rtol=1e-5, atol=0)
    assert torch.equal(w.amax(-1)[mask[0, 0].any(-1).expand(w.shape[:-1])],
                       torch.ones_like(w.amax(-1)[mask[0, 0].any(-1).expand(w.shape[:-1])]))


@pytest.mark.parametrize("preset", ["int_flash", "fmha_int8", "turbo"])
def test_tile_p_scale_beats_row_scale_on_long_rows(preset):
    """Over rows of many key tiles most tiles sit below the row max; quantizing each against
    its own max keeps P's resolution there (the default); the paper's row range loses it."""
    q, k, v = qkv(hq=2, lq=64, lkv=1024, d=64)
    exact = exact_attention(q, k, v)
    tile = rel_l1(reference_attention(q, k, v, preset=preset, key_tile=64), exact)
    row = rel_l1(reference_attention(q, k, v, preset=preset, options={"p_scale": "row"}), exact)
    # fmha_int8's per-tensor Q/K/V scales leave P a smaller share of its error.
    assert tile < {"int_flash": 0.8, "fmha_int8": 0.9, "turbo": 0.8}[preset] * row, (tile, row)


def test_turbo_sas_threshold_zeroes_p_against_the_tile_max():
    """``p_scale: tile`` (default): the SAS threshold applies to scores minus their key tile's
    max, in the tiles that SAS does not skip."""
    q, k, _ = qkv(lq=64, lkv=96, d=64)
    q = q * 3
    opts = {"sas_threshold": -2.0}
    s = quantized_scores(q, k, "turbo", opts).scores()
    tile_max = s.unflatten(-1, (3, 32)).amax(-1, keepdim=True).expand(-1, -1, -1, -1, 32)
    x_tile = s - tile_max.flatten(-2)
    p = quantized_probs(q, k, preset="turbo", options=opts, key_tile=32).p
    earlier_max = torch.cummax(tile_max[..., 0], dim=-1).values.roll(1, dims=-1)
    earlier_max[..., 0] = -math.inf
    live = (tile_max >= earlier_max[..., None] - 2.0).flatten(-2)  # tiles SAS does not skip
    assert (x_tile < -2.0).sum() > 100 and (~live).sum() > 100
    assert torch.equal(p[(x_tile < -2.0) | ~live], torch.zeros_like(p[(x_tile < -2.0) | ~live]))
    assert (p[(x_tile > -1.9) & live] > 0).all()
    x_row = s - s.amax(-1, keepdim=True)
    assert (p[x_row < -2.0] > 0).any()  # kept: below the row max + threshold, not the tile's


def test_turbo_sas_drops_key_tiles_below_the_running_max():
    """A key tile whose max lies below the running max of the row's earlier tiles + the
    threshold gives P = 0 (as the kernel skips it), even where its own max would keep it;
    without SAS (``exp: hardware``) it is kept."""
    q = torch.zeros(1, 1, 8, 16)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, 96, 16)
    k[..., 0] = -6.5  # 6.5 below the row max at key 0 ...
    k[..., 0, 0] = 0.0
    k[..., 70, 0] = -5.0  # ... but for one key in the third tile
    opts = {"sas_threshold": -6.0}
    p = quantized_probs(q, k, scale=1.0, preset="turbo", options=opts, key_tile=32).p[0, 0]
    assert torch.equal(p[:, 1:64], torch.zeros_like(p[:, 1:64]))  # SAS in tile 0, tile 1 skipped
    assert (p[:, 64:] > 0).all()  # tile 2's max is above the running max + threshold
    hw = quantized_probs(q, k, scale=1.0, preset="turbo", options={**opts, "exp": "hardware"}, key_tile=32).p
    assert (hw[0, 0, :, 32:64] > 0).all()


def test_exact_attention_without_keys_gives_zeros():
    q = torch.randn(1, 2, 5, 16)
    kv = torch.randn(1, 2, 0, 16)
    out = exact_attention(q, kv, kv)
    assert out.shape == (1, 2, 5, 16) and torch.equal(out, torch.zeros_like(out))


def test_turbo_sas_threshold_zeroes_p():
    q, k, _ = qkv(lq=64, d=64)
    q = q * 3  # peaky rows: many scores below max − 2
    opts = {"sas_threshold": -2.0, "p_scale": "row"}
    s = quantized_scores(q, k, "turbo", opts).scores()
    x = s - s.amax(-1, keepdim=True)
    p = quantized_probs(q, k, preset="turbo", options=opts).p
    assert (x < -2.0).sum() > 100
    assert torch.equal(p[x < -2.0], torch.zeros_like(p[x < -2.0]))
    assert (p[x > -1.9] > 0).all()
    hw = quantized_probs(q, k, preset="turbo", options={**opts, "exp": "hardware"}).p
    assert (hw[x < -2.0] > 0).any()  # the threshold belongs to SAS only


@pytest.mark.parametrize("preset", ["sage2_8b", "sage2_4b", "fp8"])
def test_fp8_p(preset):
    q, k, _ = qkv(lq=40, lkv=100, d=32)
    parts = quantized_probs(q, k, preset=preset)
    p = parts.p
    assert parts.unit == 448.0
    assert torch.equal(p, p.to(torch.float8_e4m3fn).double())
    assert torch.equal(p.amax(-1), torch.full_like(p.amax(-1), 448.0))
    assert p.min() >= 0
    assert (parts.l >= 1).all()  # l sums the unquantized P̃ (max element is exp(0) = 1)


def test_integer_scores_are_exact_integers():
    q, k, _ = qkv(hq=4, hkv=2, lq=50, lkv=70, d=96)
    for preset, bound in [("int_flash", 127), ("sage2_8b", 127), ("sage2_4b", 7), ("turbo", 127)]:
        parts = quantized_scores(q, k, preset)
        assert parts.dot.dtype == torch.float64 and parts.dot.shape == (1, 4, 50, 70)
        assert torch.equal(parts.dot, parts.dot.round())
        assert parts.dot.abs().max() <= 96 * bound * bound
        assert parts.q_scale.shape == (1, 4, 50, 1) and parts.k_scale.shape == (1, 4, 1, 70)
        assert (parts.delta_s is not None) == preset.startswith("sage2")


def test_int_flash_scores_close_to_exact():
    q, k, _ = qkv(lq=64, d=64)
    s = quantized_scores(q, k, "int_flash", {"smooth_k": False}).scores(torch.float64)
    exact = (q.double() @ k.double().transpose(-1, -2)) / 8
    assert (s - exact).abs().max() < 0.05


@pytest.mark.parametrize("k_granularity", ["block", "token"])
@pytest.mark.parametrize("smooth_k", [True, False])
def test_int_flash_smooth_k_scores_math(smooth_k, k_granularity):
    """Q̂·K̂ᵀ of per-token INT8 Q and of K (paper) or K − k̄ (``smooth_k``), K per 128 tokens
    or per token, and against fp64: the smoothed scores are the exact ones shifted by the
    row constant q_i·k̄·τ."""
    q, k, _ = qkv(hq=4, hkv=2, lq=50, lkv=70, d=64)
    k = _with_k_outliers(k)
    parts = quantized_scores(q, k, "int_flash", {"smooth_k": smooth_k,
                                                 "k_granularity": k_granularity})
    k_used, k_mean = smooth.smooth_k(k) if smooth_k else (k, torch.zeros_like(k[..., :1, :]))
    q_group, k_group = int_flash_group_sizes(k_granularity, 50, 70)
    q_int, _ = quant.quantize_int(q, q_group, 8)
    k_int, _ = quant.quantize_int(k_used, k_group, 8)
    want = q_int.double() @ k_int.double().repeat_interleave(2, 1).transpose(-1, -2)
    assert torch.equal(parts.dot, want)
    k_rep, mean_rep = k.double().repeat_interleave(2, 1), k_mean.double().repeat_interleave(2, 1)
    shift = (q.double() @ mean_rep.transpose(-1, -2)) / 8  # [B, Hq, Lq, 1]: one per row
    exact = (q.double() @ k_rep.transpose(-1, -2)) / 8
    err = (parts.scores(torch.float64) - (exact - shift)).abs().max()
    assert err < (0.06 if smooth_k else 0.5)  # unsmoothed: the offset inflates the K scale


def test_int_flash_output_formula():
    """O = (P̂·V̂)·s_v / l with per-tensor INT8 V, recomputed from the public pieces."""
    q, k, v = qkv(lq=33, lkv=47, d=32)
    p = quantized_probs(q, k, preset="int_flash", key_tile=32)
    v_q, v_scale = quant.quantize_int(v, v.shape[2], 8)
    want = ((p.p * p.weight) @ v_q.double()) * v_scale.double()[..., None] / p.l
    got = reference_attention(q, k, v, preset="int_flash", key_tile=32)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sage2_fp16_pv_formula(dtype):
    """``pv: fp16``: P̂ = P̃ rounded to the input dtype, l = Σ P̃, V unquantized,
    O = (P̂·V) / l; the Q/K side is that of ``pv: fp8``."""
    q, k, v = qkv(hq=4, hkv=2, lq=33, lkv=47, d=32, dtype=dtype)
    opts = {"pv": "fp16"}
    parts = quantized_probs(q, k, preset="sage2_8b", options=opts, p_dtype=dtype)
    scores = quantized_scores(q, k, "sage2_8b", opts).scores()
    p_float = torch.exp(scores - scores.amax(-1, keepdim=True))
    assert parts.unit == 1.0
    assert torch.equal(parts.p, p_float.to(dtype).float())
    torch.testing.assert_close(parts.l, p_float.sum(-1, keepdim=True))
    fp8_scores = quantized_scores(q, k, "sage2_8b").scores()
    assert torch.equal(scores, fp8_scores)
    want = (parts.p @ v.float().repeat_interleave(2, 1)) / parts.l
    got = reference_attention(q, k, v, preset="sage2_8b", options=opts)
    torch.testing.assert_close(got.float(), want.to(dtype).float())


def test_sage2_fp16_pv_rejects_smooth_v():
    with pytest.raises(ValueError, match="smooth_v.*pv: fp16"):
        Sage2Options(pv="fp16", smooth_v=True)
    with pytest.raises(PolicyError) as info:
        resolve_options("sage2_4b", {"pv": "fp16", "smooth_v": True})
    assert "`smooth_v: true`" in str(info.value) and "`pv: fp16`" in str(info.value)
    with pytest.raises(PolicyError, match="field `pv`"):
        resolve_options("sage2_8b", {"pv": "fp4"})


def test_sage2_output_formula_per_channel_fp8_v():
    q, k, v = qkv(lq=33, lkv=47, d=32)
    p = quantized_probs(q, k, preset="sage2_8b")
    v_q, v_scale = quant.quantize_fp8_per_channel(v)
    want = (p.p @ v_q.double()) / 448 * v_scale.double()[:, :, None, :] / p.l
    got = reference_attention(q, k, v, preset="sage2_8b")
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("preset", ALL_PRESETS)
def test_gqa_equals_repeated_kv(preset):
    q, k, v = qkv(b=2, hq=8, hkv=2, lq=40, lkv=52, d=32)
    mask = random_bool_mask((2, 1, 40, 52))
    # float64 compute: fp32 GEMMs of different batch layouts round differently, and a last-bit
    # difference can flip a quantizer's rounding
    kw = {"attn_mask": mask, "preset": preset, "compute_dtype": torch.float64}
    out = reference_attention(q, k, v, **kw)
    rep = reference_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), **kw)
    torch.testing.assert_close(out, rep, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("preset", ALL_PRESETS)
def test_bool_and_additive_masks_agree(preset):
    q, k, v = qkv(lq=30, lkv=41, d=32)
    mask = random_bool_mask((1, 2, 30, 41))
    additive = torch.zeros(mask.shape).masked_fill(~mask, -math.inf)
    a = reference_attention(q, k, v, attn_mask=mask, preset=preset)
    b = reference_attention(q, k, v, attn_mask=additive, preset=preset)
    assert torch.equal(a, b)


@pytest.mark.parametrize("preset", ALL_PRESETS)
def test_fully_masked_rows_zero_every_preset(preset):
    q, k, v = qkv(b=2, hq=4, hkv=2, lq=37, lkv=29, d=32)
    mask = random_bool_mask((2, 1, 37, 29))
    mask[1, 0, 7] = False
    opts = {"smooth_v": True} if preset.startswith("sage2") else None
    out = reference_attention(q, k, v, attn_mask=mask, is_causal=True, preset=preset, options=opts)
    assert not out.isnan().any()
    assert torch.equal(out[1, :, 7], torch.zeros_like(out[1, :, 7]))
    assert (out[0, :, 7].abs().sum(-1) > 0).all()
    ref = exact_attention(q, k, v, attn_mask=mask, is_causal=True)
    assert rel_l1(out, ref) < 0.3


@pytest.mark.parametrize("preset", ["int_flash", "sage2_8b", "sage2_4b", "turbo", "fp8"])
def test_row_chunking_is_invisible(preset, monkeypatch):
    q, k, v = qkv(b=1, hq=2, lq=300, lkv=90, d=32)
    mask = random_bool_mask((1, 1, 300, 90))
    whole = reference_attention(q, k, v, attn_mask=mask, is_causal=True, preset=preset)
    monkeypatch.setattr(attention_mod, "_CHUNK_ELEMENTS", 2 * 90 * 100)  # 128-row chunks
    chunked = reference_attention(q, k, v, attn_mask=mask, is_causal=True, preset=preset)
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("preset", ["int_flash", "sage2_8b", "fp8"])
def test_input_dtypes(dtype, preset):
    q, k, v = qkv(lq=64, d=64, dtype=dtype)
    out = reference_attention(q, k, v, preset=preset)
    out64 = reference_attention(q, k, v, preset=preset, compute_dtype=torch.float64)
    assert out.dtype == dtype and out64.dtype == dtype
    assert rel_l1(out, exact_attention(q, k, v)) < 0.08


@pytest.mark.parametrize("causal", [False, True])
def test_transformers_style_padding_mask_and_rectangular_causal(causal):
    """A left-padding mask ``[B, 1, 1, Lkv]``, alone and with a rectangular causal mask (5
    queries, 71 keys). Bounds: ~1.3–2× each preset's error here, below the error of ignoring
    the padding (0.22–0.35) or, causal, the causal mask (~1.2)."""
    b, lq, lkv = 2, 5, 71
    q, k, v = qkv(b=b, hq=4, hkv=1, lq=lq, lkv=lkv, d=64)
    pad = torch.ones(b, 1, 1, lkv, dtype=torch.bool)
    pad[1, ..., :10] = False
    bounds = {"flash": 1e-5, "sage2_4b": 0.25, "fp8": 0.1}
    exact = exact_attention(q, k, v, attn_mask=pad, is_causal=causal)
    for preset in ALL_PRESETS:
        out = reference_attention(q, k, v, attn_mask=pad, is_causal=causal, preset=preset)
        assert rel_l1(out, exact) < bounds.get(preset, 0.05), preset


def test_empty_lengths():
    q, k, v = qkv(lq=4, lkv=1, d=32)
    out = reference_attention(q, k[:, :, :0], v[:, :, :0], preset="int_flash")
    assert out.shape == (1, 2, 4, 32) and torch.equal(out, torch.zeros_like(out))


def test_fmha_static_scales():
    q, k, v = qkv(lq=40, d=32)
    static = {"scales": "static", "calibration": "scales.json"}
    with pytest.raises(ValueError, match="static_scales"):
        reference_attention(q, k, v, preset="fmha_int8", options=static)
    with pytest.raises(ValueError, match="lacks"):
        reference_attention(q, k, v, preset="fmha_int8", options=static, static_scales={"q": 1})
    with pytest.raises(ValueError, match="only used by fmha_int8"):
        reference_attention(q, k, v, preset="int_flash", static_scales={"q": 1.0})
    amax = {name: t.abs().amax().item() for name, t in zip("qkv", (q, k, v))}
    # α per (batch, head) equal to each head's amax reproduces dynamic mode exactly
    alphas = {n: t.abs().amax(dim=(-2, -1)).unsqueeze(-1) for n, t in zip("qkv", (q, k, v))}
    dyn = reference_attention(q, k, v, preset="fmha_int8")
    sta = reference_attention(q, k, v, preset="fmha_int8", options=static, static_scales=alphas)
    assert torch.equal(dyn, sta)
    # the static α are what quantizes: coarser α (twice the amax) change the output, and
    # saturating α (a quarter of it) make the error far larger than dynamic mode's
    exact = exact_attention(q, k, v)
    coarse = {n: 2 * a for n, a in alphas.items()}
    out = reference_attention(q, k, v, preset="fmha_int8", options=static, static_scales=coarse)
    assert not torch.equal(out, dyn)
    clipped = {n: a / 4 for n, a in amax.items()}
    out = reference_attention(q, k, v, preset="fmha_int8", options=static, static_scales=clipped)
    assert not out.isnan().any() and rel_l1(out, exact) > 5 * rel_l1(dyn, exact)
    with_o = {**amax, "o": 0.5}
    opts = {**static, "quantize_output": True}
    out = reference_attention(q, k, v, preset="fmha_int8", options=opts, static_scales=with_o)
    assert out.abs().max() <= 0.5 + 1e-6


def test_bad_options_and_shapes():
    q, k, v = qkv(lq=8, d=32)
    with pytest.raises(PolicyError):
        reference_attention(q, k, v, preset="sage2_8b", options={"qk_granularity": "thread"})
    with pytest.raises(PolicyError):
        reference_attention(q, k, v, preset="nope")
    with pytest.raises(ValueError, match="multiple"):
        reference_attention(q, k[:, :1].expand(1, 3, 8, 32), v[:, :1].expand(1, 3, 8, 32))
    with pytest.raises(ValueError, match="broadcast"):
        reference_attention(q, k, v, attn_mask=torch.ones(3, 8, 8, dtype=torch.bool))
    out = reference_attention(q, k, v, preset="sage2_8b", options=Sage2Options(smooth_v=True))
    assert out.shape == q.shape


# ------------------------------------------------------------------------------------------
# quantizers
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_bits", [8, 4])
@pytest.mark.parametrize("granularity", ["token", "warp", "block", "tensor"])
@pytest.mark.parametrize("side", ["q", "kv"])
def test_int_quantizer_round_trip(num_bits, granularity, side):
    x = torch.randn(2, 3, 203, 40) * torch.rand(2, 3, 203, 1) * 5
    q, scale, group = quant.quantize_int_granularity(x, granularity, side, num_bits)
    expected_group = {
        "token": 1,
        "warp": QUANT_WARP_Q if side == "q" else QUANT_BLOCK_KV,
        "block": QUANT_BLOCK_Q if side == "q" else QUANT_BLOCK_KV,
        "tensor": 203,
    }[granularity]
    assert group == expected_group
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert scale.shape == (2, 3, math.ceil(203 / group))
    qmax = quant.INT_QMAX[num_bits]
    assert q.abs().max() <= qmax
    per_token = quant.expand_scales(scale, group, 203)
    err = (quant.dequantize(q, scale, group) - x).abs()
    assert (err <= per_token / 2 * (1 + 1e-5)).all()
    # every group's amax element lands on ±qmax
    grouped_max = quant._grouped(q.abs().to(torch.int16), group).amax(dim=(-2, -1))
    assert (grouped_max == qmax).all()


def test_int_quantizer_rounds_half_to_even_and_handles_zeros():
    x = torch.tensor([2.5, -0.5, 1.5, 127.0, 0.49]).view(1, 1, 5, 1)
    q, scale = quant.quantize_int(x, 5, 8)
    assert scale.item() == 1.0
    assert q.flatten().tolist() == [2, 0, 2, 127, 0]
    zeros = torch.zeros(1, 1, 4, 8)
    q0, s0 = quant.quantize_int(zeros, 2, 4)
    assert torch.equal(q0, torch.zeros_like(q0)) and (s0 > 0).all() and s0.isfinite().all()


def test_fp8_quantizers():
    x = torch.randn(2, 2, 150, 64) * 3
    for group in (150, QUANT_BLOCK_KV):
        q, scale = quant.quantize_fp8(x, group)
        assert q.dtype == torch.float8_e4m3fn and scale.shape == (2, 2, math.ceil(150 / group))
        assert q.float().abs().max() == 448.0
        deq = quant.dequantize(q, scale, group)
        big = x.abs() > quant.expand_scales(scale, group, 150) * 2**-6 * 4  # normal range
        assert ((deq - x).abs()[big] <= x.abs()[big] * 2**-4 * (1 + 1e-6)).all()
    q, scale = quant.quantize_fp8_per_channel(x)
    assert scale.shape == (2, 2, 64)
    torch.testing.assert_close(scale, x.abs().amax(-2) / 448)
    assert torch.equal(q.float().abs().amax(-2), torch.full((2, 2, 64), 448.0))
    assert quant.to_fp8_e4m3(torch.tensor([1e6, -1e6])).float().tolist() == [448.0, -448.0]


def test_int4_pack_unpack():
    values = torch.arange(-8, 8, dtype=torch.int8)
    packed = quant.pack_int4(values)
    assert packed.dtype == torch.uint8 and packed.shape == (8,)
    assert quant.pack_int4(torch.tensor([1, -1], dtype=torch.int8)).item() == 0xF1
    assert torch.equal(quant.unpack_int4(packed), values)
    x = torch.randn(2, 3, 17, 64)
    q, _ = quant.quantize_int(x, 16, 4)
    assert torch.equal(quant.unpack_int4(quant.pack_int4(q)), q)
    odd = torch.randint(-7, 8, (3, 5), dtype=torch.int8)
    assert torch.equal(quant.unpack_int4(quant.pack_int4(odd), size=5), odd)


# ------------------------------------------------------------------------------------------
# SAS exp
# ------------------------------------------------------------------------------------------


def test_sas_poly_constraints_and_fit():
    c0, c1, c2, c3 = SAS_POLY
    assert c0 == 1.0 and abs(c0 + c1 + c2 + c3 - 2.0) < 1e-12
    refit = fit_sas_poly()
    assert max(abs(a - b) for a, b in zip(refit, SAS_POLY)) < 1e-9
    f = torch.linspace(0, 1, 100_001, dtype=torch.float64)
    rel = (sas_poly(f) / torch.exp2(f) - 1).abs().max().item()
    assert 5e-5 < rel <= SAS_MAX_REL_ERROR


@pytest.mark.parametrize("threshold", [-6.0, -2.5, -30.0])
def test_sas_exp(threshold):
    x = torch.cat([torch.linspace(threshold, 0, 50_001), torch.tensor([0.0, -math.log(2) * 3])])
    got = sas_exp(x, threshold)
    rel = (got.double() / torch.exp(x.double()) - 1).abs().max().item()
    # float32 rounding of y = x·log2(e) adds ~|x|·2^-24·log2(e)·ln(2) relative error
    assert rel < SAS_MAX_REL_ERROR + 1e-6 + abs(threshold) * 1e-7
    assert got[-2].item() == 1.0 and got[-1].item() == 0.125
    below = torch.tensor([threshold - 1e-3, threshold * 2, -1e4, -math.inf])
    assert torch.equal(sas_exp(below, threshold), torch.zeros(4))
    # continuous where the integer part steps (p(1) = 2)
    y = torch.tensor([-3.0 - 1e-6, -3.0], dtype=torch.float64) / math.log2(math.e)
    step = sas_exp(y, threshold)
    assert abs(step[0] / step[1] - 1) < 1e-5


# ------------------------------------------------------------------------------------------
# smoothing exactness (fp64)
# ------------------------------------------------------------------------------------------


def test_k_smoothing_keeps_softmax():
    q, k, _ = qkv(lq=50, lkv=70, d=64, dtype=torch.float64)
    k = _with_k_outliers(k)
    k_s, mean = smooth.smooth_k(k)
    assert mean.shape == (1, 2, 1, 64)
    torch.testing.assert_close(k_s.mean(-2), torch.zeros(1, 2, 64, dtype=torch.float64))
    a = torch.softmax(q @ k.transpose(-1, -2), -1)
    b = torch.softmax(q @ k_s.transpose(-1, -2), -1)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


def test_q_smoothing_plus_delta_s_is_exact():
    lq = 2 * SMOOTH_Q_BLOCK + 45  # a partial last block
    q, k, _ = qkv(hq=4, hkv=2, lq=lq, lkv=70, d=32, dtype=torch.float64)
    q = q + 3.0  # a channel offset worth removing
    q_s, q_mean = smooth.smooth_q(q)
    assert q_mean.shape == (1, 4, 3, 32)
    torch.testing.assert_close(q_mean[:, :, 2], q[:, :, 2 * SMOOTH_Q_BLOCK :].mean(-2))
    ds = smooth.expand_blocks(smooth.delta_s(q_mean, k), SMOOTH_Q_BLOCK, lq)
    k_rep = k.repeat_interleave(2, 1)
    torch.testing.assert_close(q_s @ k_rep.transpose(-1, -2) + ds, q @ k_rep.transpose(-1, -2))


def test_v_smoothing_is_exact():
    q, k, v = qkv(lq=20, lkv=30, d=16, dtype=torch.float64)
    v = v + 5.0
    p = torch.softmax(q @ k.transpose(-1, -2), -1)
    v_s, mean = smooth.smooth_v(v)
    torch.testing.assert_close(p @ v_s + mean, p @ v)


def test_sage2_every_smoothing_combination_is_accurate():
    q, k, v = qkv(lq=130, d=64)
    ref = exact_attention(q, k, v)
    for opts in ({}, {"smooth_q": False}, {"smooth_k": False, "smooth_q": False}):
        assert rel_l1(reference_attention(q, k, v, preset="sage2_8b", options=opts), ref) < 0.06
