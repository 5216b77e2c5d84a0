"""CPU tests of the Triton kernels under the Triton interpreter (``TRITON_INTERPRET=1``).

The interpreter is switched on here, before anything imports triton, whenever no CUDA GPU is
present (on a GPU machine this module is skipped: ``tests/test_kernels_gpu.py`` covers it).
Shapes are tiny (the interpreter runs numpy per tile op). Under the interpreter:

- int8 dots are exact: the integer score path is compared bit for bit with the reference;
- bf16 dots and fp32→bf16 conversion are wrong, so inputs here are fp16/fp32 (bf16 is
  tested on the GPU);
- in-kernel fp32→fp8 conversion mis-rounds, which the kernels avoid by rounding on the e4m3
  grid first (``EXACT_FP8``), so FP8 paths are checked with the same criterion here and with
  the hardware conversion on the GPU.

Accuracy criterion (DESIGN §7): ``err(kernel, exact) <= 1.05·err(reference, exact) + EPS``
with rel-L1 against fp64 exact attention.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from qattn_compile.blocks import (  # noqa: E402
    QUANT_BLOCK_KV, SMOOTH_Q_BLOCK, group_sizes, int_flash_group_sizes)
from qattn_compile.kernels import kernel_attention, prepare_attention, supports  # noqa: E402
from qattn_compile.kernels import attention as attn  # noqa: E402
from qattn_compile.kernels import primitives as prim  # noqa: E402
from qattn_compile.kernels import quantize as kq  # noqa: E402
from qattn_compile.kernels import launch  # noqa: E402
from qattn_compile.kernels.heuristics import (  # noqa: E402
    GRID_GROUP_KV_BYTES,
    AttentionConfig,
    grid_head_group,
)
from qattn_compile.lowering import quantize as lowered  # noqa: E402
from qattn_compile.kernels.mask import (  # noqa: E402
    TILE_FULL,
    TILE_MIXED,
    TILE_SKIP,
    plan_mask,
    tile_summary,
)
from qattn_compile.reference import (  # noqa: E402
    SAS_POLY,
    exact_attention,
    quantized_scores,
    reference_attention,
    sas_exp,
)
from qattn_compile.reference import quant as rq  # noqa: E402
from qattn_compile.reference import smooth as rsmooth  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="interpreter tests (CPU); on a GPU machine run tests/test_kernels_gpu.py",
)

ALL_PRESETS = ("flash", "int_flash", "fmha_int8", "sage2_8b", "sage2_4b", "turbo", "fp8")
EPS = 1e-3
LOG2E = math.log2(math.e)


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------


def rel_l1(out, ref):
    """Σ|o − r| / Σ|r| in float64."""
    out, ref = out.double(), ref.double()
    return ((out - ref).abs().sum() / ref.abs().sum()).item()


def make_qkv(b=1, hq=2, hkv=None, lq=45, lkv=None, d=64, dv=None, dtype=torch.float16,
             k_outliers=False):
    """Fresh N(0, 1) q, k, v; ``k_outliers`` adds a large per-channel offset/scale to K."""
    hkv, lkv, dv = hkv or hq, lkv or lq, dv or d
    q = torch.randn(b, hq, lq, d)
    k = torch.randn(b, hkv, lkv, d)
    v = torch.randn(b, hkv, lkv, dv)
    if k_outliers:
        k[..., ::7] = k[..., ::7] * 4 + 8  # channel outliers, as real K has
    return q.to(dtype), k.to(dtype), v.to(dtype)


def check_against_reference(q, k, v, preset, options=None, eps=EPS, **kwargs):
    """Kernel vs reference vs exact; returns (kernel error, reference error). The reference
    takes integer P's range over the kernel's key tile (``p_scale: tile``)."""
    out = kernel_attention(q, k, v, preset=preset, options=options, **kwargs)
    key_tile = prepare_attention(q, k, v, preset=preset, options=options, **kwargs).cfg.block_n
    ref = reference_attention(q, k, v, preset=preset, options=options, key_tile=key_tile,
                              **kwargs)
    exact = exact_attention(q, k, v, **kwargs)
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert not out.isnan().any()
    err_k, err_r = rel_l1(out, exact), rel_l1(ref, exact)
    assert err_k <= 1.05 * err_r + eps, f"{preset}: kernel {err_k:.5f} vs reference {err_r:.5f}"
    return out, err_k, err_r


def random_bool_mask(shape, p_keep=0.7):
    """Random keep-mask with the diagonal kept."""
    mask = torch.rand(shape) < p_keep
    n = min(shape[-2], shape[-1])
    mask[..., torch.arange(n), torch.arange(n)] = True
    return mask


# ------------------------------------------------------------------------------------------
# quantizers: bit-exact against qattn_compile.reference.quant
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("granularity", ["token", "warp", "block", "tensor"])
@pytest.mark.parametrize("num_bits", [8, 4])
def test_quantize_int_bit_exact(granularity, num_bits):
    x = (torch.randn(1, 2, 77, 80) * 3).to(torch.float16)
    x[..., 5] *= 30
    for side, group in zip(("q", "kv"), group_sizes(granularity, 77, 77)):
        ref_q, ref_scale = rq.quantize_int(x, group, num_bits)
        got = kq.quantize_int(x, group, num_bits, scale_mul=0.125 * LOG2E)
        values = rq.unpack_int4(got.data, 80) if num_bits == 4 else got.data
        assert torch.equal(values, ref_q), (side, group)
        assert torch.equal(got.scale, ref_scale * (0.125 * LOG2E))
        if num_bits == 4:
            assert torch.equal(got.data, rq.pack_int4(ref_q))


def test_quantize_int_transposed_and_static():
    x = torch.randn(2, 1, 50, 32)
    got = kq.quantize_int(x, QUANT_BLOCK_KV, 8, transpose=True)
    ref_q, ref_scale = rq.quantize_int(x, QUANT_BLOCK_KV, 8)
    assert got.data.shape == (2, 1, 32, 64)  # [B, H, D, L_pad]
    assert torch.equal(kq.v_in_token_order(got.data, 50), ref_q)
    stored = kq.v_column_of_token_torch(torch.arange(50))
    padding = torch.ones(64, dtype=torch.bool)
    padding[stored] = False
    assert padding.sum() == 14 and not got.data[..., padding].any()  # zeros, not garbage
    assert torch.equal(got.scale, ref_scale)
    with_sums = kq.quantize_int(x, 50, 8, transpose=True, colsum_chunk=32)  # fmha_int8's V
    values = kq.v_in_token_order(with_sums.data, 50).to(torch.int32)
    padded = torch.nn.functional.pad(values, (0, 0, 0, 14))  # 64 tokens = 2 chunks of 32
    assert torch.equal(with_sums.colsum, padded.reshape(2, 1, 2, 32, 32).sum(dim=3))
    static = kq.quantize_int(x, 50, 8, amax=1.5)  # values beyond α saturate
    ref_q, ref_scale = rq.quantize_int(x, 50, 8, amax=1.5)
    assert torch.equal(static.data, ref_q) and torch.equal(static.scale, ref_scale)


@pytest.mark.parametrize("dim", [160, 256])
def test_transposed_v_padding_is_zero_for_wide_heads(dim, monkeypatch):
    """Wide heads get 16-token quantizer tiles under the interpreter: the padding tokens of
    the 8-bit V past the last tile of real tokens are written (as zeros) too (output buffers
    are poisoned first, so a column nothing wrote shows)."""
    alloc = kq._alloc_8bit
    monkeypatch.setattr(kq, "_alloc_8bit", lambda *args: alloc(*args).view(torch.int8).fill_(99)
                        .view(args[1]))
    x = torch.randn(1, 2, 33, dim, dtype=torch.float16)
    padding = torch.ones(64, dtype=torch.bool)  # L_pad = 64 for 33 tokens
    padding[kq.v_column_of_token_torch(torch.arange(33))] = False
    outputs = {
        "int8": kq.quantize_int(x, QUANT_BLOCK_KV, 8, transpose=True).data,
        "fp8 per channel": kq.quantize_fp8_per_channel(x).data,
        "fp8 K+V": kq.quantize_fp8_kv(x, x, 16)[1].data,
    }
    for name, data in outputs.items():
        assert data.shape[-1] == 64, name
        assert not data.view(torch.int8)[..., padding].any(), name


@pytest.mark.parametrize("group", [1, 16, 64, 128, 77])
def test_quantize_fp8_bit_exact(group):
    x = (torch.randn(1, 2, 77, 64) * 5).to(torch.float16)
    got = kq.quantize_fp8(x, group, transpose=group == 64)
    ref_q, ref_scale = rq.quantize_fp8(x, group)
    data = kq.v_in_token_order(got.data, 77) if group == 64 else got.data
    assert torch.equal(data.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(got.scale, ref_scale)


@pytest.mark.parametrize("group,v_dim", [(64, 40), (32, 40), (64, 48), (600, 40)])
def test_quantize_fp8_kv_matches_the_reference(group, v_dim):
    """K and V in one launch (groups that fit a tile, one shape for both) or two (a V of
    another head dim, a group larger than a tile): each bit-exact against the reference,
    V stored transposed; odd length, K channel outliers."""
    _, k, v = make_qkv(hq=2, lq=77, d=40, dv=v_dim, dtype=torch.float16, k_outliers=True)
    got_k, got_v = kq.quantize_fp8_kv(k, v, group)
    for got, x in ((got_k, k), (got_v, v)):
        ref_q, ref_scale = rq.quantize_fp8(x, group)
        data = kq.v_in_token_order(got.data, 77) if got.transposed else got.data
        assert torch.equal(data.view(torch.uint8), ref_q.view(torch.uint8))
        assert torch.equal(got.scale, ref_scale)
    assert got_v.transposed and not got_k.transposed


@pytest.mark.parametrize("smooth", [False, True])
def test_quantize_fp8_per_channel(smooth):
    v = torch.randn(1, 2, 45, 80) + torch.linspace(-3, 3, 80)
    got = kq.quantize_fp8_per_channel(v, smooth=smooth)
    src = v - got.mean if smooth else v
    if smooth:
        # float32 sums in another order: a few ulps of the channel offsets (|mean| up to 3)
        torch.testing.assert_close(got.mean, v.mean(dim=-2, keepdim=True), rtol=1e-6, atol=1e-5)
    ref_q, ref_scale = rq.quantize_fp8_per_channel(src)
    assert torch.equal(kq.v_in_token_order(got.data, 45).view(torch.uint8),
                       ref_q.view(torch.uint8))
    assert torch.equal(got.scale, ref_scale)


@pytest.mark.parametrize("stats_chunk", [256, 16])
def test_statistics_combine_many_chunks(stats_chunk, monkeypatch):
    """Scales of groups longer than one statistics chunk: partial sums/extrema per chunk (the
    last one partial), combined by the finishing kernel (with 16-token chunks, 38 per group:
    more than one block of chunks). Per-tensor INT8 and FP8 scales and the per-channel FP8 V
    (smoothed) match the reference bit for bit; the means match up to the order of sums."""
    monkeypatch.setattr(kq, "_STATS_CHUNKS", (stats_chunk,))
    # D=128: the finishing kernel combines 32 chunks per step, so 38 chunks take two
    x = make_qkv(hq=2, lq=600, d=128, dtype=torch.float32, k_outliers=True)[1]
    got = kq.quantize_int(x, 600, 8, scale_mul=0.5)
    ref_q, ref_scale = rq.quantize_int(x, 600, 8)
    assert torch.equal(got.data, ref_q) and torch.equal(got.scale, ref_scale * 0.5)
    got = kq.quantize_fp8(x, 600)
    ref_q, ref_scale = rq.quantize_fp8(x, 600)
    assert torch.equal(got.data.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(got.scale, ref_scale)
    got = kq.quantize_fp8_per_channel(x, smooth=True)
    torch.testing.assert_close(got.mean, x.mean(dim=-2, keepdim=True), rtol=1e-6, atol=1e-5)
    ref_q, ref_scale = rq.quantize_fp8_per_channel(x - got.mean)
    assert torch.equal(kq.v_in_token_order(got.data, 600).view(torch.uint8),
                       ref_q.view(torch.uint8))
    assert torch.equal(got.scale, ref_scale)


def test_statistics_chunks_keep_enough_programs():
    """The statistics kernel's chunk: the longest that still gives 512 programs (the shapes
    measured on the H100), never below 256 tokens, never beyond the token group."""
    assert kq._stats_chunk(4 * 32, 16384, 16384) == 1024  # 2048 programs
    assert kq._stats_chunk(4 * 32, 4096, 4096) == 1024  # 512
    assert kq._stats_chunk(1 * 8, 32768, 32768) == 512  # 1024 would give 256
    assert kq._stats_chunk(4 * 32, 1024, 1024) == 256  # short: the shortest chunk
    assert kq._stats_chunk(2, 600, 600) == 256
    assert kq._stats_chunk(4 * 32, 16384, 64) == 64  # a group shorter than any chunk


def test_smoothing_means_and_delta_s():
    q, k, _ = make_qkv(hq=4, hkv=2, lq=150, lkv=70, d=80, dtype=torch.float32, k_outliers=True)
    k_mean = kq.smooth_mean(k)
    q_mean = kq.smooth_mean(q, SMOOTH_Q_BLOCK)
    k_s, ref_k_mean = rsmooth.smooth_k(k)
    _, ref_q_mean = rsmooth.smooth_q(q)
    torch.testing.assert_close(k_mean, ref_k_mean, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(q_mean, ref_q_mean, rtol=1e-6, atol=1e-6)
    ds = kq.delta_s(q_mean, k, k_mean, 2.0)
    torch.testing.assert_close(ds, 2.0 * rsmooth.delta_s(ref_q_mean, k_s), rtol=1e-5, atol=1e-4)
    # Quantizing the smoothed tensor in the kernel = quantizing (x − mean) in the reference.
    got = kq.quantize_int(k, QUANT_BLOCK_KV, 8, mean=k_mean)
    ref_q, ref_scale = rq.quantize_int(k - k_mean, QUANT_BLOCK_KV, 8)
    assert torch.equal(got.data, ref_q) and torch.equal(got.scale, ref_scale)


@pytest.mark.parametrize("mean_group", [24, 64, 300])
def test_quantizer_subtracts_a_given_mean_per_token_group(mean_group):
    """A given mean with one row per ``mean_group`` tokens: gathered per token when a tile's
    tokens span several rows (24), one row loaded per tile when they cannot (64: a multiple
    of the tile; 300: longer than the tensor). The kernel quantizes exactly ``x − mean`` as
    the reference does, INT8 in 16-token groups and INT4 per token."""
    x = make_qkv(hq=2, lq=150, d=40, dtype=torch.float32, k_outliers=True)[1]
    n_rows = -(-150 // mean_group)
    mean = torch.randn(1, 2, n_rows, 40) * 3
    per_token = mean.repeat_interleave(mean_group, dim=2)[:, :, :150]
    for group, bits in ((16, 8), (1, 4)):
        got = kq.quantize_int(x, group, bits, mean=mean, mean_group=mean_group)
        ref_q, ref_scale = rq.quantize_int(x - per_token, group, bits)
        values = rq.unpack_int4(got.data, 40) if bits == 4 else got.data
        assert torch.equal(values, ref_q) and torch.equal(got.scale, ref_scale), (group, bits)


@pytest.mark.parametrize("group, num_bits, d", [(16, 8, 80), (1, 8, 32), (16, 4, 40), (128, 8, 48)])
def test_smoothed_quantizer_computes_the_block_means_itself(group, num_bits, d):
    """SageAttention2's Q: block means and quantization in one pass. Odd length (a partial
    last block), channel outliers; the means match the reference's up to the order of the
    sums, and the values and scales are the two-pass quantizer's given those means."""
    q = make_qkv(hq=3, lq=300, d=d, dtype=torch.float32, k_outliers=True)[1] * 3 + 1.5
    got = kq.quantize_int_smoothed(q, group, num_bits, mean_group=SMOOTH_Q_BLOCK, scale_mul=0.7)
    _, ref_mean = rsmooth.smooth_q(q)
    assert got.mean.shape == ref_mean.shape == (1, 3, 3, d)
    torch.testing.assert_close(got.mean, ref_mean, rtol=1e-6, atol=1e-5)
    want = kq.quantize_int(q, group, num_bits, scale_mul=0.7, mean=got.mean,
                           mean_group=SMOOTH_Q_BLOCK)
    assert torch.equal(got.data, want.data) and torch.equal(got.scale, want.scale)
    ref_q, ref_scale = rq.quantize_int(q - rsmooth.expand_blocks(got.mean, SMOOTH_Q_BLOCK, 300),
                                       group, num_bits)
    assert torch.equal(got.scale, ref_scale * 0.7)
    values = rq.unpack_int4(got.data, d) if num_bits == 4 else got.data
    assert torch.equal(values, ref_q)


def test_smoothed_quantizer_refuses_groups_beyond_one_tile():
    q = torch.randn(1, 1, 64, 32)
    with pytest.raises(ValueError, match="group=45, mean_group=128"):
        kq.quantize_int_smoothed(q, 45, mean_group=SMOOTH_Q_BLOCK)


def test_delta_s_many_query_blocks_gqa():
    """ΔS tiles over more q̄ rows than one program holds (n_blocks > 64), GQA, odd lengths."""
    q_mean = torch.randn(1, 4, 70, 48)
    k = torch.randn(1, 2, 45, 48) * 3 + 1
    k_mean = kq.smooth_mean(k)
    got = kq.delta_s(q_mean, k, k_mean, 1.5)
    want = 1.5 * rsmooth.delta_s(q_mean, k - k_mean)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(kq.delta_s(q_mean, k, None, 1.0), rsmooth.delta_s(q_mean, k),
                               rtol=1e-5, atol=1e-4)


def test_causal_delta_s_writes_every_entry_a_causal_kernel_reads():
    """``causal=True``: ΔS rows of query block ``blk`` equal the full ΔS for every key below
    ``(blk + 2)·SMOOTH_Q_BLOCK`` (what a causal kernel's key tiles can reach); the skipped
    tiles lie beyond that. 80 blocks: two programs of q̄ rows, the first of which skips its
    keys past 65 blocks."""
    q_mean = torch.randn(1, 2, 80, 32)
    k = torch.randn(1, 1, 80 * SMOOTH_Q_BLOCK + 50, 32)
    full = kq.delta_s(q_mean, k, None, 1.0)
    causal = kq.delta_s(q_mean, k, None, 1.0, causal=True)
    keys = torch.arange(k.shape[2])
    for blk in (0, 1, 40, 63, 64, 79):
        reach = keys < (blk + 2) * SMOOTH_Q_BLOCK
        assert torch.equal(causal[:, :, blk, reach], full[:, :, blk, reach]), blk


# ------------------------------------------------------------------------------------------
# the quantizers' torch form (what Inductor fuses under torch.compile)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("group", [1, 16, 32, 45])
def test_lowered_int8_quantizer_matches_the_kernel(group):
    x = make_qkv(hq=3, lq=45, d=40, k_outliers=True)[1].float()
    cases = [{}, {"scale_mul": 0.3}, {"amax": 2.5}]
    if group <= 32:  # the kernels smooth only groups that fit one tile
        cases.append({"mean": kq.smooth_mean(x)})
    for kwargs in cases:
        got_data, got_scale = lowered.quantize_int8(x, group, **kwargs)
        want = kq.quantize_int(x, group, 8, **kwargs)
        assert torch.equal(got_data, want.data) and torch.equal(got_scale, want.scale), kwargs


@pytest.mark.parametrize("group", [1, 16, 45])
def test_lowered_fp8_quantizer_matches_the_kernel(group):
    x = make_qkv(hq=3, lq=45, d=40, k_outliers=True)[1]
    per_head_view = x.transpose(1, 2).contiguous().transpose(1, 2)  # [B, L, H, D] memory
    for scale_mul, src in ((1.0, x), (0.3, x), (0.3, per_head_view)):
        got_data, got_scale = lowered.quantize_fp8(src, group, scale_mul=scale_mul)
        want = kq.quantize_fp8(x, group, scale_mul=scale_mul)
        assert got_data.dtype == want.data.dtype == torch.float8_e4m3fn
        assert torch.equal(got_data.float(), want.data.float()), (group, scale_mul)
        assert torch.equal(got_scale, want.scale), (group, scale_mul)
        if group == 1 and src is per_head_view:  # per-token scales in the rows' memory order
            assert got_scale.stride() == (45 * 3, 1, 3), got_scale.stride()


def test_lowered_means_match_the_kernels():
    q, k, _ = make_qkv(hq=4, hkv=2, lq=300, lkv=70, d=48, dtype=torch.float32, k_outliers=True)
    for x, group in ((k, None), (q, SMOOTH_Q_BLOCK)):
        torch.testing.assert_close(lowered.smooth_mean(x, group), kq.smooth_mean(x, group),
                                   rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("preset,options", [
    ("int_flash", {}), ("fmha_int8", {}), ("sage2_8b", {}), ("turbo", {}), ("fp8", {}),
    ("fp8", {"granularity": "q_token"}),
])
def test_attention_on_lowered_quantizers(preset, options, monkeypatch):
    """The attention kernel on operands from the torch-form quantizers (as under
    torch.compile): the same output as with the quantizer kernels, up to the order of the
    smoothing sums."""
    q, k, v = make_qkv(hq=4, hkv=2, lq=70, lkv=90, d=64)
    quantizer_kernels = kernel_attention(q, k, v, is_causal=True, preset=preset, options=options)
    monkeypatch.setattr(lowered, "decomposed", lambda x: True)
    out, _, _ = check_against_reference(q, k, v, preset, options, is_causal=True)
    assert (out.float() - quantizer_kernels.float()).abs().max() <= 2e-3


# ------------------------------------------------------------------------------------------
# the 8-bit V's token order: what the quantizer stores and what the kernel relabels agree
# ------------------------------------------------------------------------------------------


@triton.jit
def _v_order_probe(p_ptr, relabelled_ptr, columns_ptr, M: tl.constexpr, N: tl.constexpr):
    """``in_v_key_order`` of an ``[M, N]`` tile, and ``v_column_of_token`` of ``0 … N−1``."""
    rows, cols = tl.arange(0, M), tl.arange(0, N)
    p = tl.load(p_ptr + rows[:, None] * N + cols[None, :])
    tl.store(relabelled_ptr + rows[:, None] * N + cols[None, :], prim.in_v_key_order(p))
    tl.store(columns_ptr + cols, prim.v_column_of_token(cols))


def test_v_token_order_kernel_and_torch_forms_agree():
    """The quantizer stores token ``t`` at column ``v_column_of_token(t)``; the kernel's
    relabelled P must hold at column ``c`` the score of the token stored there, and the torch
    form (``v_in_token_order``) must use the same map."""
    m, n = 2, 128
    p = torch.arange(m * n, dtype=torch.int32).reshape(m, n)
    relabelled = torch.empty_like(p)
    columns = torch.empty(n, dtype=torch.int32)
    _v_order_probe[(1,)](p, relabelled, columns, M=m, N=n)
    tokens = torch.arange(n)
    assert torch.equal(columns.long(), kq.v_column_of_token_torch(tokens))
    assert sorted(columns.tolist()) == tokens.tolist()  # a permutation within 32-token blocks
    assert torch.equal((columns // 32).long(), tokens // 32)
    token_at = torch.argsort(columns.long())  # the token stored at each column
    assert torch.equal(relabelled, p[:, token_at])
    assert not torch.equal(token_at, tokens)  # the order is not the identity


# ------------------------------------------------------------------------------------------
# the integer score path, bit for bit
# ------------------------------------------------------------------------------------------


@triton.jit
def _scores_probe(q_ptr, k_ptr, out_ptr, Lq, Lkv, sql, skl, QK_FMT: tl.constexpr,
                  HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    """Raw ``Q̂·K̂ᵀ`` of one tile through the kernel's own load and score helpers."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    q, q2 = attn.load_qk_tile(q_ptr, offs_m, sql, 1, Lq, QK_FMT, HEAD_D, BLOCK_D, True)
    k, k2 = attn.load_qk_tile(k_ptr, offs_n, skl, 1, Lkv, QK_FMT, HEAD_D, BLOCK_D, True)
    ones_m = tl.full((BLOCK_M,), 1.0, tl.float32)
    ones_n = tl.full((BLOCK_N,), 1.0, tl.float32)
    s, _ = attn.qk_scores(q, q2, k, k2, ones_m, ones_n, 1.0, QK_FMT, "ieee", BLOCK_N)
    tl.store(out_ptr + offs_m[:, None] * BLOCK_N + offs_n[None, :], s)


@pytest.mark.parametrize(
    "preset,options",
    [
        ("int_flash", {"smooth_k": False, "k_granularity": "block"}),
        ("int_flash", {"smooth_k": False, "k_granularity": "token"}),
        ("fmha_int8", None),
        ("turbo", None),
        ("sage2_8b", {"smooth_q": False, "smooth_k": False}),
        ("sage2_4b", {"smooth_q": False, "smooth_k": False, "qk_granularity": "token"}),
    ],
)
def test_integer_scores_bit_exact(preset, options):
    lq, lkv, d = 29, 45, 80
    q, k, _ = make_qkv(b=1, hq=1, lq=lq, lkv=lkv, d=d, k_outliers=True)
    ref = quantized_scores(q, k, preset, options).dot[0, 0]
    num_bits = 4 if preset == "sage2_4b" else 8
    if preset == "int_flash":
        gq, gk = int_flash_group_sizes(options["k_granularity"], lq, lkv)
    else:
        granularity = {"fmha_int8": "tensor", "turbo": "block"}.get(
            preset, (options or {}).get("qk_granularity", "warp"))
        gq, gk = group_sizes(granularity, lq, lkv)
    qq = kq.quantize_int(q, gq, num_bits)
    kk = kq.quantize_int(k, gk, num_bits)
    qd, kd = qq.data.view(torch.int8), kk.data.view(torch.int8)
    out = torch.empty(32, 64, dtype=torch.float32)
    fmt = attn.QK_INT4 if num_bits == 4 else attn.QK_INT8
    _scores_probe[(1,)](qd, kd, out, lq, lkv, qd.stride(2), kd.stride(2), QK_FMT=int(fmt),
                        HEAD_D=d, BLOCK_M=32, BLOCK_N=64, BLOCK_D=128)
    assert torch.equal(out[:lq, :lkv].double(), ref)


@triton.jit
def _sas_probe(y_ptr, out_ptr, thr_log2, c0, c1, c2, c3, N: tl.constexpr):
    """Elementwise :func:`attention.sas_exp2` of ``N`` log2-domain values."""
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, attn.sas_exp2(tl.load(y_ptr + offs), thr_log2, c0, c1, c2, c3))


def test_sas_exp_matches_reference():
    x = torch.cat([-torch.rand(1000) * 9, torch.tensor([0.0, -6.0, -5.999, -6.001, -1e-7])])
    x = torch.cat([x, torch.full((1024 - x.numel(),), -float("inf"))])
    y = x * LOG2E
    out = torch.empty_like(y)
    _sas_probe[(1,)](y, out, -6.0 * LOG2E, *SAS_POLY, N=1024)
    ref = sas_exp(x, -6.0)
    torch.testing.assert_close(out, ref, rtol=2e-6, atol=0)
    assert torch.equal(out == 0, ref == 0)


# ------------------------------------------------------------------------------------------
# mask summary
# ------------------------------------------------------------------------------------------


def test_tile_summary_codes():
    mask = torch.ones(1, 1, 40, 70, dtype=torch.bool)
    mask[..., :32, 32:64] = False  # tile (0, 1) all masked
    mask[..., 35, 5] = False  # tile (1, 0) mixed
    codes = tile_summary(mask, 32, 32)
    assert codes.shape == (1, 1, 2, 3)
    assert codes[0, 0].tolist() == [
        [TILE_FULL, TILE_SKIP, TILE_FULL],
        [TILE_MIXED, TILE_FULL, TILE_FULL],
    ]
    additive = torch.zeros(1, 70)
    additive[0, 40:] = -float("inf")
    additive[0, 3] = -1.0
    codes = tile_summary(additive[None, None], 32, 32)  # broadcast query axis: one row of codes
    assert codes[0, 0].tolist() == [[TILE_MIXED, TILE_MIXED, TILE_SKIP]]
    # The kernel's per-query-tile lists of live key tiles; causal also skips above-diagonal.
    plan = plan_mask(mask, (2, 4, 40, 70), 32, 32, is_causal=True)
    assert plan.counts.shape == (2, 4, 2) and plan.counts.stride()[:2] == (0, 0)
    assert plan.counts[0, 0].tolist() == [1, 2]  # tile (0, 1) masked; (1, 2) above diagonal
    assert plan.tiles[0, 0, 0, :1].tolist() == [0] and plan.tiles[0, 0, 1, :2].tolist() == [0, 1]
    # A mask broadcast along the keys: its one code per query tile holds for every key tile.
    rows = torch.ones(40, 1, dtype=torch.bool)
    rows[35:] = False  # query tile 1 mixed (rows 32-34 visible), query tile 0 full
    plan = plan_mask(rows, (1, 2, 40, 70), 32, 32)
    assert plan.counts[0, 0].tolist() == [3, 3]
    assert plan.tiles[0, 0].tolist() == [[0, 1, 2], [0, 1, 2]]
    assert plan.summary[0, 0].tolist() == [[TILE_FULL] * 3, [TILE_MIXED] * 3]


# ------------------------------------------------------------------------------------------
# attention: every preset against the reference and exact attention
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ALL_PRESETS)
def test_presets_plain_and_outliers(preset):
    q, k, v = make_qkv(lq=77, d=64)
    check_against_reference(q, k, v, preset)
    q, k, v = make_qkv(lq=40, lkv=70, d=32, k_outliers=True)
    check_against_reference(q, k, v, preset)


@pytest.mark.parametrize("preset", ALL_PRESETS)
def test_presets_causal_rectangular_d80(preset):
    q, k, v = make_qkv(lq=45, lkv=70, d=80)
    check_against_reference(q, k, v, preset, is_causal=True)
    q, k, v = make_qkv(lq=70, lkv=33, d=80)  # more queries than keys
    check_against_reference(q, k, v, preset, is_causal=True)


@pytest.mark.parametrize("preset", ALL_PRESETS)
def test_presets_bool_mask_gqa_fully_masked_rows(preset):
    q, k, v = make_qkv(b=2, hq=4, hkv=2, lq=40, lkv=70, d=32)
    mask = random_bool_mask((2, 1, 40, 70))
    mask[0, 0, 3] = False  # fully masked rows
    mask[1, 0, 30:] = False
    mask[1, 0, :, 32:64] = False  # a skipped tile column
    out, _, _ = check_against_reference(q, k, v, preset, attn_mask=mask)
    assert torch.equal(out[0, :, 3], torch.zeros_like(out[0, :, 3]))
    assert torch.equal(out[1, :, 30:], torch.zeros_like(out[1, :, 30:]))


@pytest.mark.parametrize("preset", ALL_PRESETS)
def test_presets_additive_mask_and_causal(preset):
    q, k, v = make_qkv(lq=50, lkv=50, d=64)
    bias = torch.randn(1, 2, 50, 50)
    bias[random_bool_mask((1, 2, 50, 50), p_keep=0.8).logical_not()] = -float("inf")
    bias[0, 1, 7] = -float("inf")
    out, _, _ = check_against_reference(q, k, v, preset, attn_mask=bias, is_causal=True)
    assert torch.equal(out[0, 1, 7], torch.zeros_like(out[0, 1, 7]))
    padding = torch.zeros(1, 1, 1, 50)
    padding[..., 41:] = -float("inf")  # [B, 1, 1, Lkv] padding mask, broadcast everywhere
    check_against_reference(q, k, v, preset, attn_mask=padding)
    q, k, v = make_qkv(lq=40, lkv=100, d=32)
    per_query = torch.zeros(40, 1)  # [Lq, 1]: broadcast along the keys (every key tile)
    per_query[5] = -float("inf")
    per_query[20:] = -2.0
    out, _, _ = check_against_reference(q, k, v, preset, attn_mask=per_query)
    assert torch.equal(out[0, :, 5], torch.zeros_like(out[0, :, 5]))


def sink_qkv(lq=64, lkv=256, d=32):
    """Scores (scale 1) of 0 at key 0 (a sink) and 6.1-6.6 below it elsewhere: just below
    turbo's default SAS threshold (-6) relative to the row max, which the first tile holds."""
    q = torch.zeros(1, 1, lq, d)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, lkv, d)
    k[..., 0] = torch.empty(lkv).uniform_(-6.6, -6.1)
    k[..., 0, 0] = 0.0
    return q.half(), k.half(), torch.randn(1, 1, lkv, d).half()


@pytest.mark.parametrize("options", [None, {"p_scale": "row"}])
def test_turbo_skips_the_tiles_below_the_running_max_as_the_reference_does(options):
    """turbo's SAS drops key tiles whose scores all lie below the running max + threshold
    (here every tile after the sink's, ~40 % of the attention mass): the reference models
    the skip, so kernel and reference agree."""
    q, k, v = sink_qkv()
    out, err_k, err_r = check_against_reference(q, k, v, "turbo", options, scale=1.0)
    assert err_k > 0.3 and err_r > 0.3  # the skipped mass, not quantization error
    key_tile = prepare_attention(q, k, v, scale=1.0, preset="turbo", options=options).cfg.block_n
    ref = reference_attention(q, k, v, scale=1.0, preset="turbo", options=options, key_tile=key_tile)
    assert rel_l1(out, ref) < 1e-3


@pytest.mark.parametrize("preset", ["flash", "int_flash"])
def test_finite_additive_fill_keeps_keys_visible(preset):
    """Only -inf masks: finfo(float32).min on every key of a row leaves the row averaging V,
    as SDPA does (times log2 e it would overflow to -inf in the kernel)."""
    q, k, v = make_qkv(lq=40, lkv=70, d=32)
    bias = torch.zeros(1, 1, 40, 70)
    bias[..., 3, :] = torch.finfo(torch.float32).min
    bias[..., 10:, 50:] = torch.finfo(torch.float32).min
    out, _, _ = check_against_reference(q, k, v, preset, attn_mask=bias)
    torch.testing.assert_close(out[0, :, 3].float(), v[0].float().mean(-2), atol=3e-2, rtol=0)


@pytest.mark.parametrize(
    "preset,options",
    [
        ("int_flash", {"v_granularity": "tensor"}),
        ("int_flash", {"smooth_k": False}),
        ("int_flash", {"p_scale": "row", "v_granularity": "tensor"}),
        ("int_flash", {"k_granularity": "token"}),
        ("fmha_int8", {"quantize_output": True}),
        ("fmha_int8", {"p_scale": "row"}),
        ("sage2_8b", {"qk_granularity": "token", "smooth_v": True}),
        ("sage2_8b", {"qk_granularity": "block", "smooth_q": False}),
        ("sage2_8b", {"pv": "fp16"}),
        ("sage2_4b", {"smooth_k": False, "smooth_v": True}),
        ("sage2_4b", {"pv": "fp16", "qk_granularity": "token"}),
        ("turbo", {"exp": "hardware"}),
        ("turbo", {"p_scale": "row"}),
        ("turbo", {"sas_threshold": -3.0}),
        ("fp8", {"granularity": "tensor"}),
        ("fp8", {"granularity": "q_token"}),
    ],
)
def test_preset_options(preset, options):
    """Each option reaches the kernel: its output is as accurate as the option's reference
    and nearer that reference than the kernel with the default options is."""
    q, k, v = make_qkv(lq=70, lkv=140, d=64, k_outliers=True)
    v = v + 2.0  # a V channel offset (what smooth_v removes)
    out, _, _ = check_against_reference(q, k, v, preset, options)
    key_tile = prepare_attention(q, k, v, preset=preset, options=options).cfg.block_n
    ref = reference_attention(q, k, v, preset=preset, options=options, key_tile=key_tile)
    default = kernel_attention(q, k, v, preset=preset)
    assert rel_l1(out, ref) < 0.75 * rel_l1(default, ref), (rel_l1(out, ref), rel_l1(default, ref))


@pytest.mark.parametrize(
    "preset,options",
    [("sage2_8b", None), ("sage2_4b", None), ("sage2_8b", {"qk_granularity": "block",
     "smooth_q": False}), ("fp8", None), ("int_flash", None), ("flash", None),
     ("fmha_int8", None)],
)
@pytest.mark.parametrize("causal", [False, True])
def test_128_key_tiles_over_smaller_token_groups(preset, options, causal):
    """128-key tiles: sage2's K scales come per QUANT_BLOCK_KV = 64 keys, two per tile,
    applied per half of the tile's scores (the last tile's second group lies past Lkv =
    150); fp8's one scale per 128-token block (one per tile), int_flash's per-key and flash's
    scalar scale leave the row scale to the exponent; fmha_int8's UINT8-P correction adds four 32-token V̂ sums per tile (the
    last tile's from padding). K's second group is 10× larger, so a scale applied to the
    wrong keys shows as a large error (causal: 150 queries, so that rows see past key 128)."""
    assert QUANT_BLOCK_KV == 64
    q, k, v = make_qkv(lq=150 if causal else 40, lkv=150, d=32, k_outliers=True)
    k[:, :, 64:128] *= 10.0
    out = prepare_attention(q, k, v, None, causal, None, preset, options,
                            config=AttentionConfig(32, 128, 4, 1)).run()
    ref = reference_attention(q, k, v, preset=preset, options=options, key_tile=128,
                              is_causal=causal)
    exact = exact_attention(q, k, v, is_causal=causal)
    err_k, err_r = rel_l1(out, exact), rel_l1(ref, exact)
    assert err_k <= 1.05 * err_r + EPS, f"{preset}: kernel {err_k:.5f} vs reference {err_r:.5f}"


@pytest.mark.parametrize("preset,options", [("fp8", {"granularity": "block"}), ("turbo", None)])
@pytest.mark.parametrize("causal", [False, True])
def test_per_tile_v_scales_across_magnitudes(preset, options, causal):
    """V scaled per key tile (``VS_TILE``): the accumulator is kept in the last tile's V
    units and rescaled per row when the next tile's scale differs. V's groups span twelve
    orders of magnitude, one of them all zero (a scale at the quantizer's floor), so a unit
    carried over wrongly shows as a large error or a non-finite output."""
    q, k, v = make_qkv(lq=140 if causal else 24, lkv=3 * 128 + 10, d=32)
    prepared = prepare_attention(q, k, v, None, causal, None, preset, options)
    assert launch._v_scale_args(prepared.ops, None)[1] == attn.VS_TILE
    group = prepared.ops.v_group
    v[:, :, :group] *= 1e3
    v[:, :, group:2 * group] = 0.0
    v[:, :, 2 * group:3 * group] *= 1e-3
    out, _, _ = check_against_reference(q, k, v, preset, options, is_causal=causal)
    assert out.isfinite().all()


@pytest.mark.parametrize("granularity,per_query", [("block", True), ("q_token", True),
                                                   ("tensor", False)])
def test_fp8_query_outlier_leaves_other_queries(granularity, per_query):
    """``fp8`` ``block`` and ``q_token`` scale Q per token: a query 1000× larger than the
    rest changes no other query's output, in the kernel or the reference; per tensor it
    coarsens every query of its head."""
    q, k, v = make_qkv(lq=70, lkv=90, d=32)
    options = {"granularity": granularity}
    loud = q.clone()
    loud[:, :, 5] *= 1000.0
    others = torch.arange(70) != 5
    for run in (kernel_attention, reference_attention):
        quiet_out, loud_out = (run(x, k, v, preset="fp8", options=options) for x in (q, loud))
        same = torch.equal(quiet_out[:, :, others], loud_out[:, :, others])
        assert same == per_query, f"{run.__name__}: other queries unchanged: {same}"
    check_against_reference(loud, k, v, "fp8", options)


@pytest.mark.parametrize("preset", ["int_flash", "fmha_int8", "turbo"])
def test_tile_p_scale_across_far_apart_tile_maxima(preset):
    """``p_scale: tile`` keeps the accumulator in units of the last tile's weight
    ``2^(m_t − m)``. Additive biases put whole key tiles 100 (natural log units) below the
    row's best tile, before or after it, and a third tile 30 or 60 below: a tile far below is
    quantized against the row's max − P_TILE_FLOOR (without that floor its units would
    overflow float32), the next one moves the accumulator back."""
    q, k, v = make_qkv(lq=40, lkv=100, d=32)
    block_n = prepare_attention(q, k, v, preset=preset).cfg.block_n
    q, k, v = make_qkv(lq=40, lkv=3 * block_n + 5, d=32)
    bias = torch.zeros(1, 1, 40, 3 * block_n + 5)
    for rows, tile_bias in ((slice(0, 20), (0.0, -100.0, -30.0)),
                            (slice(20, 40), (-100.0, 0.0, -60.0))):
        for tile, value in enumerate(tile_bias):
            bias[..., rows, tile * block_n:(tile + 1) * block_n] = value
    out, _, _ = check_against_reference(q, k, v, preset, attn_mask=bias.half())
    assert out.isfinite().all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_sage2_fp16_pv_masks_gqa(dtype):
    """``pv: fp16`` (P_NATIVE / V_NATIVE after INT8 Q·Kᵀ): GQA, a bool mask with fully masked
    rows, causal, ragged lengths; fp32 inputs keep an fp32 P·V."""
    q, k, v = make_qkv(b=2, hq=4, hkv=2, lq=45, lkv=70, d=64, dtype=dtype, k_outliers=True)
    mask = random_bool_mask((2, 1, 45, 70))
    mask[1, 0, 5] = False
    out, _, _ = check_against_reference(q, k, v, "sage2_8b", {"pv": "fp16"}, attn_mask=mask,
                                        is_causal=True)
    assert torch.equal(out[1, :, 5], torch.zeros_like(out[1, :, 5]))
    if dtype == torch.float32:  # unrounded P and V: the reference's output to float precision
        ref = reference_attention(q, k, v, mask, True, preset="sage2_8b", options={"pv": "fp16"})
        assert rel_l1(out, ref) < 1e-5


def test_int_flash_smooth_k_kernel_removes_outlier_damage():
    """The kernel's ``smooth_k`` (the ``smooth_mean`` kernel, subtracted in the quantizer)
    undoes a per-channel K offset as the reference does."""
    q, k, v = make_qkv(lq=64, lkv=96, d=64)
    k_out = k.clone()
    k_out[..., ::8] += 12.0
    _, smoothed, _ = check_against_reference(q, k_out, v, "int_flash")
    _, raw, _ = check_against_reference(q, k_out, v, "int_flash", {"smooth_k": False})
    clean = rel_l1(kernel_attention(q, k, v, preset="int_flash"), exact_attention(q, k, v))
    assert smoothed < 1.3 * clean and raw > 1.5 * smoothed, (clean, smoothed, raw)


@pytest.mark.parametrize("preset", ["int_flash", "fmha_int8", "turbo"])
def test_tile_p_scale_kernel_beats_row_scale(preset):
    """``p_scale: tile`` (default) quantizes P per key tile against the tile's max; over rows
    of many tiles the kernel is then more accurate than with the paper's running max, and
    each matches its reference."""
    q, k, v = make_qkv(lq=32, lkv=256, d=32)
    _, tile, _ = check_against_reference(q, k, v, preset)
    _, row, _ = check_against_reference(q, k, v, preset, {"p_scale": "row"})
    assert tile < {"int_flash": 0.85, "fmha_int8": 0.97, "turbo": 0.92}[preset] * row, (tile, row)


def test_fmha_static_scales():
    q, k, v = make_qkv(lq=40, d=32)
    static = {"q": 3.0, "k": 3.5, "v": 2.5, "o": 1.0}
    options = {"scales": "static", "calibration": "unused.json", "quantize_output": True}
    out = kernel_attention(q, k, v, preset="fmha_int8", options=options, static_scales=static)
    ref = reference_attention(q, k, v, preset="fmha_int8", options=options, static_scales=static,
                              key_tile=32)
    exact = exact_attention(q, k, v)
    assert rel_l1(out, exact) <= 1.05 * rel_l1(ref, exact) + EPS
    assert rel_l1(out, ref) < 1e-5  # the same static α quantize both
    # Per-head α carried in the options (how the graph op receives calibrated scales).
    per_head = {"q": (3.0, 2.0), "k": (3.5, 3.0), "v": (2.5, 2.0), "o": (1.0, 0.8)}
    options = {"scales": "static", "static_scales": per_head, "quantize_output": True}
    assert supports(q.shape, k.shape, v.shape, q.dtype, q.device, "fmha_int8", options) is None
    out = kernel_attention(q, k, v, preset="fmha_int8", options=options)
    ref = reference_attention(q, k, v, preset="fmha_int8", options=options, key_tile=32)
    assert rel_l1(out, exact) <= 1.05 * rel_l1(ref, exact) + EPS
    assert rel_l1(out, ref) < 1e-5


@pytest.mark.parametrize("preset", ["flash", "int_flash", "sage2_8b"])
def test_every_grid_grouping_computes_the_same_causal_attention(preset, monkeypatch):
    """The causal grid interleaves the query tiles of groups of heads (:func:`grid_head_group`).
    Every grouping, forced here on a small call (odd lengths, GQA, a bool mask with a fully
    masked row on top of the causal one), gives the reference's accuracy and the same bits:
    one head at a time, a group of 3 of the 8 (batch, head) rows (the last group partial:
    its spare programs must exit, not write), and all 8. The launcher hands the rule
    ``B·Hq`` and one (batch, kv head)'s K + V bytes in the kernel formats (fp16 for flash,
    8-bit K and V for the others)."""
    q, k, v = make_qkv(b=2, hq=4, hkv=2, lq=70, lkv=70, d=32)
    mask = random_bool_mask((2, 1, 70, 70))
    mask[1, 0, 5] = False
    seen, outs = set(), {}
    for group in (1, 3, 8):
        def rule(is_causal, hq_per_kv, n_heads, kv_bytes_per_head, forced=group):
            seen.add((is_causal, hq_per_kv, n_heads, kv_bytes_per_head))
            return forced
        monkeypatch.setattr(launch, "grid_head_group", rule)
        for kwargs in ({"is_causal": True}, {"is_causal": True, "attn_mask": mask}):
            out, _, _ = check_against_reference(q, k, v, preset, **kwargs)
            outs.setdefault(len(kwargs), []).append(out)
    for first, *rest in outs.values():
        assert all(torch.equal(first, other) for other in rest)
    bytes_per_value = 2 if preset == "flash" else 1
    assert seen == {(True, 2, 8, 70 * 2 * 32 * bytes_per_value)}  # Lkv·(D + Dv)·bytes


def test_grid_groups_hold_the_kv_heads_that_fit_the_l2_share():
    budget = GRID_GROUP_KV_BYTES
    assert grid_head_group(False, 4, 128, 1) == 1  # non-causal: one head at a time
    assert grid_head_group(True, 4, 128, budget // 128) == 128  # everything fits: all heads
    assert grid_head_group(True, 4, 128, budget // 4) == 16  # 4 kv heads × 4 query heads
    assert grid_head_group(True, 4, 128, budget + 1) == 4  # one kv head's query heads at least
    assert grid_head_group(True, 4, None, 1) == 4  # no size hint


@pytest.mark.parametrize("preset", ["flash", "sage2_8b"])
def test_output_stored_like_a_projection_output(preset):
    """Q as transformers passes it (``[B, L, H, D]`` viewed per head): the kernel writes its
    output in that order (heads inside tokens), with the values of a contiguous call."""
    q, k, v = make_qkv(hq=4, hkv=2, lq=45, d=32)
    q_bl = q.transpose(1, 2).contiguous().transpose(1, 2)
    out = kernel_attention(q_bl, k, v, is_causal=True, preset=preset)
    assert out.transpose(1, 2).is_contiguous() and not out.is_contiguous()
    assert torch.equal(out, kernel_attention(q.contiguous(), k, v, is_causal=True, preset=preset))
    # what the opaque custom op asks for (its output must be contiguous): written so, no copy
    flat = kernel_attention(q_bl, k, v, is_causal=True, preset=preset, output_like_q=False)
    assert flat.is_contiguous() and torch.equal(flat, out)


@pytest.mark.parametrize("preset", ["flash", "fp8", "int_flash"])
@pytest.mark.parametrize("scale", [-0.2, 0.0])
def test_zero_and_negative_softmax_scales(preset, scale):
    """SDPA accepts any ``scale``. A negative one turns the row max into the min of the raw
    scores, so the kernel scales the scores before the max instead of in the exponent
    (``POSITIVE_SCALE``); zero gives uniform weights over the visible keys. A bool mask with
    a fully masked row: still 0, no NaN (0·−inf would be one)."""
    q, k, v = make_qkv(lq=40, lkv=70, d=32)
    mask = random_bool_mask((1, 1, 40, 70))
    mask[..., 5, :] = False
    out = kernel_attention(q, k, v, attn_mask=mask, scale=scale, preset=preset)
    ref = reference_attention(q, k, v, attn_mask=mask, scale=scale, preset=preset,
                              key_tile=32)
    exact = exact_attention(q, k, v, attn_mask=mask, scale=scale)
    assert not out.isnan().any()
    assert torch.equal(out[..., 5, :], torch.zeros_like(out[..., 5, :]))
    err_k, err_r = rel_l1(out, exact), rel_l1(ref, exact)
    assert err_k <= 1.05 * err_r + EPS, f"{preset}: kernel {err_k:.5f} vs reference {err_r:.5f}"


def test_flash_fp32_matches_exact_and_strided_inputs():
    q, k, v = make_qkv(b=2, hq=4, hkv=1, lq=33, lkv=65, d=96, dtype=torch.float32)
    out = kernel_attention(q, k, v, is_causal=True, scale=0.3)
    exact = exact_attention(q, k, v, is_causal=True, scale=0.3)
    torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5)
    # [B, L, H, D] storage viewed as [B, H, L, D] (what HF projections give).
    qs = q.transpose(1, 2).contiguous().transpose(1, 2)
    ks = k.transpose(1, 2).contiguous().transpose(1, 2)
    for preset in ("flash", "sage2_8b"):
        torch.testing.assert_close(
            kernel_attention(qs, ks, v, preset=preset), kernel_attention(q, k, v, preset=preset)
        )


# Offsets past 2**31 elements, without the memory: a lazily committed storage (untouched
# pages cost nothing) holding a few [32, 32] heads HEAD_STRIDE elements apart, so that the
# last head starts past 2**31 while every stride still fits 32 bits (Triton then passes it
# as int32). The view starts 2**31 elements in, so that the address a 32-bit offset would
# wrap to lies inside the storage, where zeros are planted: wrapped reads see them.
HEAD_STRIDE = 3 * 2**29
WRAP = 2**32


def _far_apart_heads(heads=3, tokens=32, dim=32):
    """``[1, heads, tokens, dim]`` float16 N(0, 1) heads ``HEAD_STRIDE`` apart (the last one
    past 2**31 elements), the wrapped addresses of those past 2**31 zeroed; None when the
    machine will not reserve the address space (~11 GB)."""
    start, n = 2**31, tokens * dim
    try:
        storage = torch.empty(start + (heads - 1) * HEAD_STRIDE + n, dtype=torch.float16)
    except RuntimeError:
        return None
    x = storage.as_strided((1, heads, tokens, dim), (heads * HEAD_STRIDE, HEAD_STRIDE, dim, 1),
                           storage_offset=start)
    for h in range(heads):
        x[0, h].copy_(torch.randn(tokens, dim))
        if h * HEAD_STRIDE >= WRAP - start:  # its 32-bit offset wraps
            wrapped = start + h * HEAD_STRIDE - WRAP
            storage[wrapped:wrapped + n].zero_()
    return x


def test_offsets_past_2_to_the_31_elements_do_not_wrap():
    """Quantizers and the attention kernel address heads past 2**31 elements of an operand
    (the first element of head 2 here) in 64 bits (in 32 they read the zeros planted where
    the offset wraps: scales ~1e-15 and all-zero codes)."""
    x = _far_apart_heads()
    if x is None:
        pytest.skip("cannot reserve ~11 GB of address space")
    dense = x.contiguous()
    for group in (1, 32 * 32 + 1):  # per token; per tensor (the statistics passes)
        got, want = kq.quantize_int(x, group, 8), kq.quantize_int(dense, group, 8)
        assert torch.equal(got.data, want.data) and torch.equal(got.scale, want.scale), group
    got, want = kq.quantize_fp8(x, 16), kq.quantize_fp8(dense, 16)
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
    k, v = torch.randn(2, 1, 3, 32, 32, dtype=torch.float16)
    torch.testing.assert_close(kernel_attention(x, k, v, preset="flash"),
                               kernel_attention(dense, k, v, preset="flash"))


def test_mask_rows_past_2_to_the_31_elements_do_not_wrap():
    """A bool mask whose query rows are ``2**25 + 64`` elements apart (a ``[L, L]`` mask at
    ~33K tokens has rows that far apart, at ~46K its last rows lie past 2**31): rows from 64
    on start past 2**31 elements. The kernel adds the query tile's first row in 64 bits (the
    32-bit offsets wrapped to the all-False rows planted there: those rows came out 0)."""
    rows, keys, row_stride, start = 80, 40, 2**25 + 64, 2**32
    try:
        storage = torch.empty(start + rows * row_stride, dtype=torch.bool)
    except RuntimeError:
        pytest.skip("cannot reserve ~7 GB of address space")
    mask = storage.as_strided((1, 1, rows, keys), (0, 0, row_stride, 1), storage_offset=start)
    mask.copy_(random_bool_mask((1, 1, rows, keys)))
    for row in range(rows):
        if row * row_stride >= 2**31:  # where its 32-bit offset wraps to: all False
            storage[start + row * row_stride - WRAP:][:keys] = False
    q, k, v = make_qkv(hq=2, lq=rows, lkv=keys, d=32)
    torch.testing.assert_close(kernel_attention(q, k, v, attn_mask=mask, preset="flash"),
                               kernel_attention(q, k, v, attn_mask=mask.contiguous(),
                                                preset="flash"))


def test_delta_s_rows_past_2_to_the_31_elements_do_not_wrap():
    """ΔS ``[B, Hq, n_blocks, Lkv]`` passes 2**31 elements from ~93K tokens at B=1 and 32
    query heads. Here the last of 65 heads' rows starts past 2**31 floats (the kernel computes
    one key tile per head into a lazily committed storage): it must land there, not at the
    32-bit wrapped address."""
    heads, n_blocks, dim, block_t = 65, 2, 32, 32
    lkv = 2**24 + 64
    last = (heads - 1) * n_blocks * lkv  # the last head's row 0, key 0: past 2**31
    start = 2**31  # keeps a wrapped address inside the storage
    try:
        storage = torch.empty(start + heads * n_blocks * lkv, dtype=torch.float32)
    except RuntimeError:
        pytest.skip("cannot reserve ~17 GB of address space")
    out = storage[start:]
    for row in range(heads * n_blocks):  # the entries the kernel writes, and the wrapped one
        out[row * lkv:row * lkv + block_t].zero_()
    storage[start + last - WRAP:start + last - WRAP + block_t].zero_()
    q_mean = torch.randn(1, heads, n_blocks, dim)
    k = torch.randn(1, 1, block_t, dim)
    kq._delta_s_kernel[(1, 1, heads)](
        q_mean, k, q_mean, out, lkv, dim, n_blocks, heads, heads, 1.0, *k.stride(),
        SUB_K_MEAN=False, PRECISION="ieee", SPLIT_Q=False, CAUSAL=False,
        Q_BLOCK=SMOOTH_Q_BLOCK, TILES=1, BLOCK_T=block_t, BLOCK_B=16, BLOCK_D=dim)
    torch.testing.assert_close(out[last:last + block_t], q_mean[0, -1, 0] @ k[0, 0].T)


@pytest.mark.parametrize("preset", ["sage2_8b", "fp8", "int_flash"])
def test_float16_output_saturates_where_v_nears_the_float16_max(preset):
    """FP8 P's l is summed before rounding, so O may pass max|V| (by ~0.8 % here): with V at
    65000 the float16 output was inf in 32 of 2048 entries. It saturates at 65504, in the
    kernel and the reference alike; the exact output is 64992."""
    q, k, _ = make_qkv(hq=1, lq=64, d=32)
    v = torch.full((1, 1, 64, 32), 65000.0, dtype=torch.float16)
    out = kernel_attention(q, k, v, preset=preset)
    ref = reference_attention(q, k, v, preset=preset)
    for got in (out, ref):
        assert got.isfinite().all() and got.float().min() > 64000


@pytest.mark.parametrize("preset, where", [
    ("flash", "k"), ("int_flash", "q"), ("int_flash", "k"), ("int_flash", "v"),
    ("fmha_int8", "q"), ("fmha_int8", "k"), ("sage2_8b", "k"), ("turbo", "k"), ("fp8", "q"),
])
def test_a_nan_input_reaches_the_output_of_its_head(preset, where):
    """A NaN in Q, K or V makes NaN the output rows of its (batch, head) that SDPA's would
    make NaN, or more of them where a quantization scale spans several tokens, and no other
    head's; kernel and reference agree row for row (the quantizers skipped NaN in their
    amax, and integer P rounded a NaN to a finite code: outputs were finite)."""
    q, k, v = make_qkv(hq=2, lq=40, d=32)
    {"q": q, "k": k, "v": v}[where][0, 0, 7, 5] = float("nan")
    out = kernel_attention(q, k, v, preset=preset, is_causal=True)
    ref = reference_attention(q, k, v, preset=preset, is_causal=True)
    sdpa = torch.nn.functional.scaled_dot_product_attention(*(t.float() for t in (q, k, v)),
                                                            is_causal=True)
    nan_rows = out.isnan().any(-1)
    assert torch.equal(nan_rows, ref.isnan().any(-1))
    assert nan_rows[0, 0].sum() >= sdpa.isnan().any(-1)[0, 0].sum() > 0
    assert not out[0, 1].isnan().any()


def test_dv_differs_from_d_and_empty_keys():
    q, k, v = make_qkv(lq=20, lkv=40, d=64, dv=32)
    for preset in ("flash", "int_flash", "sage2_8b"):
        check_against_reference(q, k, v, preset)
    empty = kernel_attention(q, k[:, :, :0], v[:, :, :0], preset="turbo")
    assert empty.shape == (1, 2, 20, 32) and not empty.any()


def test_supports_reasons():
    shape = (1, 2, 16, 64)
    cpu = torch.device("cpu")
    assert supports(shape, shape, shape, torch.float16, cpu, "sage2_8b", None) is None
    big = (1, 2, 16, 512)
    assert "head dim 512 of q (1, 2, 16, 512) / v (1, 2, 16, 512) > 256" in supports(
        big, big, big, torch.float16, cpu, "flash", None)
    assert "q (1, 2, 16, 64), k (2, 16, 64), v (1, 2, 16, 64): the kernels take 4-D" in supports(
        shape, shape[1:], shape, torch.float16, cpu, "flash", None)
    assert "float64" in supports(shape, shape, shape, torch.float64, cpu, "flash", None)
    assert "multiple" in supports((1, 3, 16, 64), shape, shape, torch.float16, cpu, "flash", None)
    assert "no kernel" in supports(shape, shape, shape, torch.float16, cpu, "none", None)
    static = {"scales": "static", "calibration": "x.json"}
    assert "static" in supports(shape, shape, shape, torch.float16, cpu, "fmha_int8", static)
    assert "head dim 0" in supports((1, 2, 16, 0), (1, 2, 16, 0), shape, torch.float16, cpu,
                                    "flash", None)
    many_heads, kv = (1024, 128, 16, 64), (1024, 1, 16, 64)
    assert "65535 batch" in supports(many_heads, kv, kv, torch.float16, cpu, "flash", None)
    long_q = (1, 2, 65535 * 32 + 1, 64)
    assert "query tiles" in supports(long_q, shape, shape, torch.float16, cpu, "flash", None)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda q, k, v, m: (q, k.float(), v, m), "k is torch.float32"),
        (lambda q, k, v, m: (q, k, v.to("meta"), m), "v is on meta, q on cpu"),
        (lambda q, k, v, m: (q, k, v, m.to(torch.int32)), "attn_mask of dtype torch.int32"),
        (lambda q, k, v, m: (q, k, v, m.to(torch.uint8)), "attn_mask of dtype torch.uint8"),
        (lambda q, k, v, m: (q[0], k, v, m), "4-D"),
        # empty lengths are checked like any other call, not answered with zeros
        (lambda q, k, v, m: (q[:, :, :0], k[:, :2], v[:, :2], None), "multiple of key/value heads"),
        (lambda q, k, v, m: (q[:, :, :0], k[..., :16], v, None), "key head dim 16"),
    ],
)
def test_kernel_attention_bad_inputs_name_the_culprit(change, message):
    q, k, v = make_qkv(hq=3, hkv=3, lq=8, lkv=8, d=32)
    mask = torch.ones(8, 8, dtype=torch.bool)
    q, k, v, mask = change(q, k, v, mask)
    with pytest.raises(ValueError, match=message):
        kernel_attention(q, k, v, attn_mask=mask, preset="flash")


# ----------------------------------------------------------------------------- soft-capping, ALiBi


def _explicit_scores(q, k, scale, softcap, slopes):
    """float64 scores of one batch element written out term by term (an oracle for the
    oracle): ``cap·tanh(τ·q·k/cap) − slope_h·|i + Lkv − Lq − j|``, GQA by head index."""
    hq, lq, _ = q.shape
    hkv, lkv, _ = k.shape
    s = torch.empty(hq, lq, lkv, dtype=torch.float64)
    for h in range(hq):
        raw = scale * (q[h].double() @ k[h // (hq // hkv)].double().T)
        if softcap:
            raw = softcap * torch.tanh(raw / softcap)
        for i in range(lq):
            for j in range(lkv):
                s[h, i, j] = raw[i, j] - float(slopes[h]) * abs(i + lkv - lq - j)
    return s


def test_exact_attention_soft_capping_and_alibi_follow_their_formulas():
    q, k, v = torch.randn(1, 4, 5, 8) * 3, torch.randn(1, 2, 7, 8) * 3, torch.randn(1, 2, 7, 8)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    s = _explicit_scores(q[0], k[0], 8 ** -0.5, 2.0, slopes)
    expected = torch.softmax(s, -1) @ v[0].double().repeat_interleave(2, 0)
    out = exact_attention(q, k, v, softcap=2.0, alibi_slopes=slopes)
    assert torch.allclose(out[0], expected, atol=1e-12)
    assert not torch.allclose(out, exact_attention(q, k, v), atol=1e-2)  # the terms matter


@pytest.mark.parametrize("preset", ["flash", "int_flash", "fp8", "sage2_8b"])
@pytest.mark.parametrize("lq,causal", [(37, False), (37, True), (1, False)],
                         ids=["prefill", "causal", "decode"])
def test_kernels_soft_cap_and_alibi(preset, lq, causal):
    """The kernel (interpreter) against the preset's reference and fp64 exact attention, both
    with the same soft cap and ALiBi slopes ([B, Hq]: one per batch element and head); the
    scores are large enough that the cap bites."""
    b, hq, hkv, lkv, d = 2, 4, 2, 45, 32
    q, k, v = torch.randn(b, hq, lq, d) * 4, torch.randn(b, hkv, lkv, d), torch.randn(b, hkv, lkv, d)
    k[..., 3] += 5.0
    slopes = torch.rand(b, hq) * 0.3
    terms = dict(softcap=3.0, alibi_slopes=slopes)
    exact = exact_attention(q, k, v, is_causal=causal, **terms)
    ref = reference_attention(q, k, v, is_causal=causal, preset=preset, **terms)
    out = kernel_attention(q, k, v, is_causal=causal, preset=preset, **terms)
    err, err_ref = rel_l1(out, exact), rel_l1(ref, exact)
    assert err <= 1.05 * err_ref + EPS, (err, err_ref)
    assert rel_l1(exact_attention(q, k, v, is_causal=causal), exact) > 0.05  # the terms matter
