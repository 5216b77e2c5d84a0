"""FlashQ KV cache: quantization math, buffer, head priority, decode op and kernel, generate().

CPU only; the decode kernel runs under the Triton interpreter (switched on here, before
anything imports triton, when no GPU is present). ``tests/test_kvcache_gpu.py`` runs the
kernel on the H100.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

import qattn_compile  # noqa: E402
from qattn_compile import _compat  # noqa: E402
from qattn_compile.blocks import KV_CACHE_BLOCK  # noqa: E402
from qattn_compile.errors import PolicyError  # noqa: E402
from qattn_compile.kvcache import FlashQCache, FlashQLayer, flashq, kv_bytes_report  # noqa: E402
from qattn_compile.kvcache.memory import dense_bytes_per_token, flashq_bytes_per_token  # noqa: E402
from qattn_compile.kvcache.priority import assign_int2_heads, head_priority  # noqa: E402
from qattn_compile.policy import KVCacheLayer, Policy, load_policy  # noqa: E402
from qattn_compile.reference import quant  # noqa: E402

DATA = Path(__file__).parent / "data"


def _kv(b=2, h=4, length=150, d=32, outlier=True):
    """Random K/V ``[B, H, L, D]``; K gets an outlier channel (real K has them)."""
    k, v = torch.randn(b, h, length, d), torch.randn(b, h, length, d)
    if outlier:
        k[..., 3] = k[..., 3] * 8 + 5
    return k, v


def _filled_layer(b=2, h=4, length=150, d=32, int2_heads=1, steps=0, buffer_tokens=KV_CACHE_BLOCK, capacity=400):
    layer = FlashQLayer(capacity, int2_heads, buffer_tokens)
    k, v = _kv(b, h, length, d)
    layer.append(k, v)
    new_k, new_v = _kv(b, h, steps, d)
    for i in range(steps):
        layer.append(new_k[:, :, i : i + 1], new_v[:, :, i : i + 1])
    return layer, torch.cat((k, new_k), 2), torch.cat((v, new_v), 2)


# ------------------------------------------------------------------------------------------
# policy: the kv_cache block
# ------------------------------------------------------------------------------------------


def test_policy_kv_cache_block_per_layer_and_round_trip():
    policy = load_policy(
        "qattn: 1\ndefault: turbo\nkv_cache:\n  int2_heads: 2\n  rules:\n"
        "    - match: 're:model\\.layers\\.0\\.self_attn'\n      int2_heads: 0\n"
        "    - match: '*layers.3.self_attn'\n      format: none\n"
    )
    kv = policy.kv_cache
    assert kv.for_layer("model.layers.0.self_attn") == KVCacheLayer(int2_heads=0)
    assert kv.for_layer("model.layers.1.self_attn") == KVCacheLayer(int2_heads=2)
    assert kv.for_layer("model.layers.3.self_attn").format == "none"
    assert Policy.from_dict(policy.to_dict()).kv_cache == kv
    assert load_policy({"qattn": 1}).kv_cache is None and "kv_cache" not in load_policy({"qattn": 1}).to_dict()


@pytest.mark.parametrize(
    "block, message",
    [
        ({"int2_head": 1}, r"field `kv_cache`: unknown key `int2_head` \(did you mean `int2_heads`\?\)"),
        ({"rules": [{"match": "*x", "bits": 2}]}, r"rules\[0\] \(match '\*x'\): unknown key `bits`; allowed keys: match"),
        ({"rules": [{"int2_heads": 1}]}, r"rules\[0\]: missing required key `match`"),
        ({"buffer_tokens": 100}, r"`buffer_tokens`: buffer_tokens must be a multiple of 64"),
        ({"format": "int3"}, r"`format`: got a string 'int3'; allowed: 'flashq' or 'none'"),
        ({"int2_heads": -1}, r"`int2_heads`: .*greater than or equal to 0"),
        (7, r"field `kv_cache`: must be a mapping, got a number 7"),
    ],
)
def test_policy_kv_cache_errors_name_the_field(block, message):
    with pytest.raises(PolicyError, match=message):
        load_policy({"qattn": 1, "kv_cache": block})


# ------------------------------------------------------------------------------------------
# quantization math
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [4, 2])
def test_pack_unpack_round_trip(bits):
    codes = torch.randint(0, 1 << bits, (3, 5, 16), dtype=torch.uint8)
    packed = flashq.pack_codes(codes, bits)
    assert packed.shape == (3, 5, 16 * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(flashq.unpack_codes(packed, bits), codes)
    # split layout: byte i holds channels i, i + M, ... from the lowest bits up
    assert flashq.pack_codes(torch.tensor([1, 2, 3, 0], dtype=torch.uint8), 2).item() == 1 | 2 << 2 | 3 << 4
    assert flashq.pack_codes(torch.tensor([1, 2, 3, 4], dtype=torch.uint8), 4).tolist() == [1 | 3 << 4, 2 | 4 << 4]


@pytest.mark.parametrize("bits, rel_l1_max", [(4, 0.16), (2, 0.55)])
def test_progressive_round_trip_error_bounds(bits, rel_l1_max):
    k, _ = _kv(length=2 * KV_CACHE_BLOCK)
    q8, s8 = flashq.int8_blocks(k)
    assert torch.equal(q8.flatten(2, 3), quant.quantize_int(k, KV_CACHE_BLOCK, 8)[0])  # = turbo's INT8 K
    codes, step, lo = flashq.progressive_quantize(q8, bits)
    assert int(codes.max()) <= (1 << bits) - 1 and int(step.min()) >= 1
    back = flashq.progressive_dequantize(codes, step, lo)
    # exact bound of stage 2, in INT8 units: half a step per element, no clipping
    assert ((back - q8.to(torch.int16)).abs() <= (step.to(torch.int16).unsqueeze(-2) + 1) // 2).all()
    x = back.float() * s8[..., None, None]
    bound = s8[..., None, None] * (step.float().unsqueeze(-2) + 1) / 2  # stage 1 + stage 2
    assert ((x - k.unflatten(2, (2, KV_CACHE_BLOCK))).abs() <= bound + 1e-6).all()
    rel = (x.flatten(2, 3) - k).abs().sum() / k.abs().sum()
    assert rel < rel_l1_max


def test_int8_stage_is_exact_for_representable_values():
    spans = torch.tensor([0, 3, 15, 16, 40, 254])
    q8 = (torch.rand(1, 1, 64, 6) * (spans + 1)).floor() - 127
    q8[..., 0, :], q8[..., 1, :] = -127, spans - 127  # every channel spans exactly its span
    q8 = q8.to(torch.int8)
    for bits, levels in ((4, 15), (2, 3)):
        back = flashq.progressive_dequantize(*flashq.progressive_quantize(q8, bits))
        exact = (spans <= levels).expand_as(back)  # one INT8 value per code: lossless
        assert torch.equal(back[exact], q8.to(torch.int16)[exact])
        assert not torch.equal(back, q8.to(torch.int16))


# ------------------------------------------------------------------------------------------
# the decode buffer
# ------------------------------------------------------------------------------------------


def test_prefill_fills_whole_chunks_and_buffers_the_rest():
    layer, k, v = _filled_layer(length=150)
    t = layer.tensors()
    assert int(t.length) == 150
    torch.testing.assert_close(t.buf_scale[0], flashq.universal_scale(k))
    assert torch.equal(t.buf[0, :, :, :22], flashq.quantize_with_scale(k[:, :, 128:], t.buf_scale[0]))
    kv = flashq.dequantize(t)
    assert kv.shape == (2, 2, 4, 150, 32)
    err = (kv[0] - k).abs() / k.abs().amax()
    assert err[:, :, 128:].max() < 0.5 / 127 + 1e-6  # buffered tokens: INT8 with the universal scale
    # whole chunks: INT8 per block, then INT2 codes for the lowest-priority head, INT4 for the rest
    heads4, heads2 = assign_int2_heads(k, v, 1)
    assert torch.equal(t.heads4, heads4) and torch.equal(t.heads2, heads2)
    for side, x in enumerate((k, v)):
        q8, s8 = flashq.int8_blocks(x[:, :, :128])
        for heads, bits in ((heads2.long(), 2), (heads4.long(), 4)):
            back = flashq.progressive_dequantize(*flashq.progressive_quantize(q8[:, heads], bits))
            expected = (back.float() * s8[:, heads, :, None, None]).flatten(2, 3)
            torch.testing.assert_close(kv[side][:, heads, :128].float(), expected)


def test_buffer_clamps_to_the_universal_scale():
    layer, _, _ = _filled_layer(length=100, int2_heads=0)
    scale = layer.buf_scale.clone()
    big = torch.full((2, 4, 1, 32), 1e3)
    layer.append(big, -big)
    t = layer.tensors()
    assert (t.buf[0, :, :, 36] == 127).all() and (t.buf[1, :, :, 36] == -127).all()
    torch.testing.assert_close(flashq.dequantize(t)[0, :, :, 100], 127 * scale[0][..., None].expand(2, 4, 32))
    assert torch.equal(layer.buf_scale, scale)  # the universal scale never changes


@pytest.mark.parametrize("buffer_tokens", [64, 128])
def test_flush_when_full_compresses_the_buffer_and_never_old_blocks(buffer_tokens):
    n_b = buffer_tokens
    layer, _, _ = _filled_layer(length=n_b + 10, int2_heads=2, buffer_tokens=n_b)
    old_blocks = n_b // KV_CACHE_BLOCK
    before = [x.clone() for x in layer.tensors()]
    for i in range(n_b - 10):
        k1, v1 = _kv(length=1, outlier=False)
        layer.append(k1, v1)
        assert int(layer.length) == n_b + 11 + i
        t = layer.tensors()
        for name, old, new in zip(t._fields, before, t):  # compressed blocks stay byte-identical
            if name in ("codes4", "codes2"):
                assert torch.equal(old[..., :n_b, :], new[..., :n_b, :]), name
            elif name in ("step", "lo", "scale8"):
                assert torch.equal(old[..., :old_blocks, :] if old.dim() == 5 else old[..., :old_blocks],
                                   new[..., :old_blocks, :] if new.dim() == 5 else new[..., :old_blocks]), name
    t = layer.tensors()
    assert int(t.length) == 2 * n_b
    new_blocks = slice(old_blocks, 2 * old_blocks)
    assert torch.equal(t.scale8[..., new_blocks], t.buf_scale[..., None].expand(2, 2, 4, old_blocks))
    expected = t.buf.float() * t.buf_scale[..., None, None]  # the buffer, as stored in INT8
    got = flashq.dequantize(t)[..., n_b:, :]
    step = t.step[..., new_blocks, :].float().unsqueeze(-2)  # the stored steps (INT4 or INT2 heads)
    bound = (step + 1) / 2 * t.buf_scale[..., None, None, None]
    assert ((got - expected).unflatten(3, (old_blocks, KV_CACHE_BLOCK)).abs() <= bound + 1e-6).all()


def test_updates_beyond_max_cache_len_raise():
    """One token, a few, or a bulk update past the capacity: a named error, not tokens the
    dense view (cut at ``max_cache_len``) silently drops."""
    for steps, new in ((0, 1), (0, 3), (1, 150)):
        layer, _, _ = _filled_layer(length=150, steps=steps, capacity=150 + steps)  # full
        stored = int(layer.length)
        k, v = _kv(length=new)
        with pytest.raises(ValueError, match=rf"{stored} stored \+ {new} new tokens exceed "
                                             rf"max_cache_len={stored}"):
            layer.append(k, v)
        assert int(layer.length) == stored


def test_bulk_update_after_prefill():
    layer, k, v = _filled_layer(length=100, steps=3)
    k2, v2 = _kv(length=150)
    layer.append(k2, v2)
    kv = flashq.dequantize(layer.tensors())
    assert kv.shape[-2] == 253
    ref = torch.cat((k, k2), 2)
    assert ((kv[0] - ref).abs().sum() / ref.abs().sum()) < 0.25


# ------------------------------------------------------------------------------------------
# head priority
# ------------------------------------------------------------------------------------------


def test_head_priority_ranks_crafted_heads():
    base = torch.randn(1, 4, 128, 16)
    x = base.clone()
    x[:, 0] *= 0.1  # narrow, even channels: lowest priority
    x[:, 2, :, 5] *= 20  # an outlier channel: wide range AND uneven channel gaps: highest
    x[:, 3] *= 3  # wide but even channels
    priority = head_priority(x)
    assert priority.argsort().tolist() == [0, 1, 3, 2]
    heads4, heads2 = assign_int2_heads(x, base, 2)
    assert heads2.tolist() == [0, 1] and heads4.tolist() == [2, 3]
    assert heads2.dtype == torch.int32
    with pytest.raises(ValueError, match="int2_heads=5 but the layer has 4 kv heads"):
        assign_int2_heads(x, base, 5)


def test_int2_heads_are_the_low_priority_ones_in_the_cache():
    layer = FlashQLayer(200, int2_heads=1)
    k, v = _kv(b=1, h=3, length=64, outlier=False)
    k[:, 1] *= 0.01
    v[:, 1] *= 0.01
    layer.append(k, v)
    assert layer.heads2.tolist() == [1] and layer.heads4.tolist() == [0, 2]
    assert layer.codes2.shape == (2, 1, 1, layer.codes2.shape[3], 8)


# ------------------------------------------------------------------------------------------
# the cache object
# ------------------------------------------------------------------------------------------


def test_dense_view_matches_the_storage_and_cache_api():
    layer, _, _ = _filled_layer(length=130, steps=5)
    keys, values = layer.dequantized()
    kv = flashq.dequantize(layer.tensors())
    assert keys.shape == (2, 4, 400, 32)
    torch.testing.assert_close(keys[:, :, :135], kv[0])
    torch.testing.assert_close(values[:, :, :135], kv[1])
    assert layer.get_mask_sizes(1) == (400, 0) and int(layer.get_seq_length()) == 135
    beams = torch.tensor([1, 0])
    layer.reorder_cache(beams)
    torch.testing.assert_close(flashq.dequantize(layer.tensors()), kv[:, beams])
    layer.reset()
    assert int(layer.get_seq_length()) == 0 and not layer.prefilled
    with pytest.raises(NotImplementedError, match="crop"):
        layer.crop(-1)


def test_cache_from_policy_names_layers_by_fqn():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg)
    policy = {"qattn": 1, "kv_cache": {"int2_heads": 1, "rules": [
        {"match": "model.layers.0.self_attn", "int2_heads": 0},
        {"match": "*layers.2.self_attn", "format": "none"}]}}
    cache = FlashQCache.from_policy(model, policy, max_cache_len=64)
    kinds = [(type(layer).__name__, getattr(layer, "int2_heads", None)) for layer in cache.layers]
    assert kinds == [("FlashQLayer", 0), ("FlashQLayer", 1), ("StaticLayer", None)]
    with pytest.raises(PolicyError, match="no `kv_cache:` block"):
        FlashQCache.from_policy(model, {"qattn": 1}, 64)


def test_memory_accounting():
    assert flashq_bytes_per_token(1, 128, 0) / 2 == pytest.approx(68.0625)
    assert flashq_bytes_per_token(1, 128, 1) / 2 == pytest.approx(36.0625)
    assert dense_bytes_per_token(8, 128) / flashq_bytes_per_token(8, 128, 0) == pytest.approx(3.761, abs=1e-3)
    assert dense_bytes_per_token(8, 128) / flashq_bytes_per_token(8, 128, 4) == pytest.approx(4.917, abs=1e-3)

    from transformers import LlamaConfig

    cfg = LlamaConfig(num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096)
    cache = FlashQCache(cfg, 4096, [KVCacheLayer(int2_heads=4), KVCacheLayer(format="none")])
    report = kv_bytes_report(cache)
    assert report["bytes_per_token"] == flashq_bytes_per_token(8, 128, 4) + dense_bytes_per_token(8, 128)
    assert report["layers"][0]["format"] == "flashq" and report["fixed_bytes"] == 2 * 8 * (64 * 128 + 4)
    # the allocated storage matches the accounting (plus the spare chunk and the buffer)
    cache.layers[0].lazy_initialization(torch.zeros(1, 8, 0, 128), torch.zeros(1, 8, 0, 128))
    per_token = (cache.layers[0].storage_bytes() - report["fixed_bytes"]) / (4096 + 64)
    assert per_token == pytest.approx(flashq_bytes_per_token(8, 128, 4), rel=1e-3)


# ------------------------------------------------------------------------------------------
# decode attention: reference, op, kernel
# ------------------------------------------------------------------------------------------


def test_reference_decode_is_attention_over_the_dequantized_cache():
    layer, _, _ = _filled_layer(length=140, steps=2)
    q = torch.randn(2, 8, 2, 32)
    kv = flashq.dequantize(layer.tensors())
    k, v = (x.repeat_interleave(2, dim=1) for x in kv)
    causal = torch.ones(2, 142, dtype=torch.bool).tril(diagonal=140)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal)
    torch.testing.assert_close(flashq.reference_decode(q, layer.tensors()), expected, atol=1e-5, rtol=1e-4)
    out = torch.ops.qattn.flashq_decode(q.to(torch.bfloat16), *layer.tensors(), None, None)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape


def test_fully_masked_rows_give_zero():
    layer, _, _ = _filled_layer(length=70)
    q = torch.randn(2, 8, 1, 32)
    mask = torch.zeros(2, 1, 1, 400, dtype=torch.bool)
    mask[1, ..., :10] = True
    out = flashq.reference_decode(q, layer.tensors(), mask)
    assert (out[0] == 0).all() and (out[1] != 0).any()


_INTERP = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter (CPU) test")


def _kernel_error(layer, q, attn_mask=None, scale=0.2, **config):
    """rel-L1 of the Triton kernel (interpreter) against ``reference_decode``."""
    from qattn_compile.kvcache.kernel import DecodeConfig, flashq_decode_triton

    ref = flashq.reference_decode(q, layer.tensors(), attn_mask, scale)
    out = flashq_decode_triton(q, layer.tensors(), attn_mask, scale, DecodeConfig(**config))
    assert out.dtype == q.dtype and out.shape == q.shape
    return ((out.float() - ref).abs().sum() / ref.abs().sum()).item()


@_INTERP
@pytest.mark.parametrize(
    "b, h, group, d, length, steps, int2_heads, lq, mask, splits",
    [
        (2, 2, 2, 16, 150, 3, 1, 1, None, 2),  # GQA, INT4 + INT2 heads, buffer partly full
        (1, 2, 4, 48, 64, 2, 0, 2, "bool", 2),  # head dim padded to 64, two queries, padding mask
        (1, 2, 1, 32, 200, 0, 2, 1, "additive", 3),  # all INT2, additive mask; 3 of 4 merge slots
        (1, 2, 4, 20, 140, 1, 1, 1, None, 2),  # packed rows not whole int32 words: byte loads
        (1, 2, 2, 32, 130, 2, 1, 3, "bool", 2),  # 6 query rows per kv head, padded to 8
        (1, 2, 4, 128, 140, 1, 1, 1, None, 2),  # D=128: the word-to-lane layouts of the benchmarks
    ],
)
def test_decode_kernel_matches_reference_in_interpreter(b, h, group, d, length, steps, int2_heads, lq, mask, splits):
    layer, _, _ = _filled_layer(b, h, length, d, int2_heads, steps, capacity=320)
    q = torch.randn(b, h * group, lq, d, dtype=torch.float16)
    attn_mask = None
    if mask == "bool":
        attn_mask = torch.rand(b, 1, lq, 320) > 0.3
    elif mask == "additive":
        attn_mask = torch.randn(b, h * group, lq, 320)
    assert _kernel_error(layer, q, attn_mask, splits=splits) < 2e-3


def _bad_decode_calls(layer):
    """(q, mask, message) of decode calls that do not fit a [2 batch, 2 kv heads, D=32] cache."""
    q = torch.randn(2, 4, 1, 32)
    return [
        (torch.randn(2, 3, 1, 32), None, "3 heads, not a multiple of the cache's 2 kv heads"),
        (torch.randn(2, 1, 1, 32), None, "1 heads, not a multiple"),
        (torch.randn(2, 4, 1, 64), None, r"q \(2, 4, 1, 64\) does not fit the cache's batch 2 and head dim 32"),
        (torch.randn(1, 4, 1, 32), None, r"q \(1, 4, 1, 32\) does not fit"),
        (torch.randn(4, 1, 32), None, r"q must be \[B, Hq, Lq, D\], got shape \(4, 1, 32\)"),
        (q, torch.ones(2, 1, 1, 320, dtype=torch.int32), "must be bool or floating point"),
        (q, torch.ones(3, 1, 1, 320, dtype=torch.bool), r"\(3, 1, 1, 320\) does not broadcast to \[B, Hq, Lq, keys\]"),
        (q, torch.ones(2, 1, 2, 1, 320, dtype=torch.bool), "does not broadcast"),
    ]


def test_decode_arguments_that_do_not_fit_the_cache_are_named():
    layer, _, _ = _filled_layer(2, 2, 100, 32, 0, 1, capacity=320)
    for q, mask, message in _bad_decode_calls(layer):
        with pytest.raises(ValueError, match=message):
            torch.ops.qattn.flashq_decode(q, *layer.tensors(), mask, None)
    with pytest.raises(ValueError, match="fewer columns than the 101 stored tokens"):
        flashq.reference_decode(torch.randn(2, 4, 1, 32), layer.tensors(), torch.ones(2, 1, 1, 50, dtype=torch.bool))


@_INTERP
def test_decode_kernel_names_arguments_that_do_not_fit_the_cache():
    from qattn_compile.kvcache.kernel import flashq_decode_triton

    layer, _, _ = _filled_layer(2, 2, 100, 32, 0, 1, capacity=320)
    for q, mask, message in _bad_decode_calls(layer):
        with pytest.raises(ValueError, match=message):
            flashq_decode_triton(q.half(), layer.tensors(), mask)


@_INTERP
@pytest.mark.parametrize("mask", [torch.ones(1, 1, 1, 1, dtype=torch.bool), torch.full((1, 1, 1, 1), -1.0),
                                  torch.tensor([[True], [False]]).view(2, 1, 1, 1)])
def test_decode_kernel_one_column_mask_holds_for_every_key(mask):
    layer, _, _ = _filled_layer(2, 2, 100, 32, 0, 1, capacity=320)
    q = torch.randn(2, 4, 1, 32, dtype=torch.float16)
    assert _kernel_error(layer, q, mask, splits=2) < 2e-3


@_INTERP
def test_decode_kernel_finite_additive_fill_keeps_keys_visible():
    """finfo(float32).min on every key of a row: the row averages V (as the reference and
    SDPA do), it is not masked (times log2 e the fill would overflow to -inf)."""
    layer, _, _ = _filled_layer(2, 2, 100, 32, 0, 1, capacity=320)
    q = torch.randn(2, 4, 1, 32, dtype=torch.float16)
    mask = torch.zeros(2, 1, 1, 320)
    mask[1] = torch.finfo(torch.float32).min
    assert _kernel_error(layer, q, mask, splits=2) < 2e-3


@_INTERP
@pytest.mark.parametrize("blocks_per_iter", [1, 2, 4])
@pytest.mark.parametrize("codes", ["subnormal", "biased"])
def test_decode_kernel_variants_match_reference(blocks_per_iter, codes):
    """Every sweep variant, GQA 4, INT4 + INT2 heads: 7 compressed blocks (a ragged last tile
    for 2 and 4 blocks per iteration) and 45 tokens in the INT8 buffer."""
    layer, _, _ = _filled_layer(1, 3, 490, 32, 1, 3, capacity=640)
    q = torch.randn(1, 12, 1, 32, dtype=torch.float16)
    assert _kernel_error(layer, q, None, None, splits=3, blocks_per_iter=blocks_per_iter, codes=codes) < 2e-3


@_INTERP
@pytest.mark.parametrize("blocks_per_iter, splits", [(2, 3), (4, 3), (2, 4)])
@pytest.mark.parametrize("d", [32, 48])
def test_decode_kernel_metadata_prefetch_edges(blocks_per_iter, splits, d):
    """Block metadata loaded one tile ahead: 7 stored blocks, so a ragged last tile; 3 splits
    (a split's last prefetch reads past the last block); 4 splits of 2-block tiles (the last
    split's first tile, loaded before the stored length is known, is the ragged one); INT4 +
    INT2 heads, a head dim whose packed rows are not whole words (48)."""
    layer, _, _ = _filled_layer(1, 2, 490, d, 1, 3, capacity=640)
    q = torch.randn(1, 8, 1, d, dtype=torch.float16)
    assert _kernel_error(layer, q, None, None, splits=splits, blocks_per_iter=blocks_per_iter) < 2e-3


@_INTERP
@pytest.mark.parametrize("splits", [3, 40])
@pytest.mark.parametrize("int2_heads", [0, 1])
def test_decode_kernel_carried_key_words(splits, int2_heads):
    """``prefetch="keys"`` at D=128 (INT4 rows of 16 words) carries each next tile's key words
    in registers: splits of several tiles, the last of which requests none, and more splits
    than tiles (a split without a tile loads none); an INT4-only cache and a mix, whose INT2
    path loads its words where it uses them."""
    layer, _, _ = _filled_layer(1, 2, 490, 128, int2_heads, 3, capacity=640)
    q = torch.randn(1, 8, 1, 128, dtype=torch.float16)
    assert _kernel_error(layer, q, None, None, splits=splits, prefetch="keys") < 2e-3


@_INTERP
@pytest.mark.parametrize("splits", [1, 5, 40])
@pytest.mark.parametrize("int2_heads", [0, 2])
def test_decode_kernel_splits_and_single_format_caches(splits, int2_heads):
    """More splits than tiles (empty splits), one split; all-INT4 and all-INT2 caches compile
    one code path each."""
    layer, _, _ = _filled_layer(1, 2, 300, 32, int2_heads, 2, capacity=400)
    q = torch.randn(1, 8, 1, 32, dtype=torch.float16)
    assert _kernel_error(layer, q, splits=splits, blocks_per_iter=2) < 2e-3


@_INTERP
@pytest.mark.parametrize("length, buffer_tokens", [(40, 64), (300, 128), (256, 128)])
def test_decode_kernel_buffer_only_wide_and_empty_buffers(length, buffer_tokens):
    """No compressed block yet; a 128-token buffer (two block slots of a tile) partly filled;
    a buffer that was just compressed (empty)."""
    layer, _, _ = _filled_layer(1, 2, length, 32, 1, 0, buffer_tokens, capacity=400)
    q = torch.randn(1, 8, 2, 32, dtype=torch.float16)
    assert _kernel_error(layer, q, blocks_per_iter=2) < 2e-3


@_INTERP
@pytest.mark.parametrize("late", [True, False])
def test_decode_kernel_score_max_jumps_between_tiles(late):
    """One program walks 5 compressed blocks (``splits=1``). At scale 2 the row maxima (log2
    units) jump by tens between blocks, and one token aligned with a query gives its row the
    largest score, in the first or in the last block: the kernel must rescale its state
    mid-loop. With the accumulator's rescale removed, both cases fail."""
    torch.manual_seed(3)
    b, h, group, d, length = 1, 2, 2, 32, 5 * KV_CACHE_BLOCK + 10
    k, v = _kv(b, h, length, d)
    q = torch.randn(b, h * group, 1, d, dtype=torch.float16)
    token = 4 * KV_CACHE_BLOCK + 7 if late else 5
    k[:, :, token] = 6.0 * q[:, ::group, 0].float() / q[:, ::group, 0].float().norm(dim=-1, keepdim=True)
    layer = FlashQLayer(8 * KV_CACHE_BLOCK, int2_heads=1)
    layer.append(k, v)
    assert _kernel_error(layer, q, None, 2.0, splits=1) < 2e-3


def test_default_splits_and_config_validation():
    from qattn_compile.kvcache.kernel import (
        MAX_SPLITS, DecodeConfig, default_prefetch, default_splits, default_warps,
    )

    blocks_32k, blocks_128k = 32768 // KV_CACHE_BLOCK + 2, 131072 // KV_CACHE_BLOCK + 2
    # two waves of resident programs (8 warps per SM), one buffer program per (batch, kv head)
    assert default_splits(8, 8, blocks_32k, 1, 1) == 32  # the defaults for GQA 32/8: 64·33 = 2·8·132
    assert default_splits(8, 8, blocks_32k, 2, 2) == 15  # 4 two-warp programs per SM: 64·16 = 2·4·132 - 32
    assert default_splits(8, 8, blocks_32k, 2, 4) == 7  # 2 four-warp programs per SM
    assert default_splits(1, 8, blocks_128k, 1, 1) == MAX_SPLITS
    assert default_splits(1, 8, blocks_32k, 1, 1) == MAX_SPLITS == 128  # 512 tiles: 4 per split, none 5
    assert default_splits(1, 8, blocks_32k, 2, 2) == 64  # at least 4 tiles of 2 blocks per split
    assert default_splits(64, 8, blocks_32k, 2, 2) == 1  # more (batch, kv head)s than a wave: one split
    assert default_splits(1, 1, 3, 2, 2) == 1  # short caches: one split
    assert [default_warps(rows) for rows in (4, 16, 32, 64)] == [1, 1, 2, 4]
    # prefetch: L2 for long splits of one format, key words for short INT4 splits of 16-word rows
    assert default_prefetch(8, 0, 128, 16) == default_prefetch(0, 8, 128, 8) == "l2"
    assert default_prefetch(8, 0, 128, 4) == default_prefetch(8, 0, 100, 7) == "keys"
    assert default_prefetch(8, 0, 64, 4) == default_prefetch(0, 8, 128, 4) == "none"  # 8-word rows
    assert default_prefetch(4, 4, 128, 16) == default_prefetch(4, 4, 128, 4) == "none"  # the mix
    for bad in ({"blocks_per_iter": 8}, {"codes": "int8"}, {"splits": 0}, {"splits": MAX_SPLITS + 1},
                {"prefetch": "tma"}):
        with pytest.raises(ValueError):
            DecodeConfig(**bad)


def _decode_benchmark():
    """benchmarks/decode.py as a module."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "decode.py"
    spec = importlib.util.spec_from_file_location("decode_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_decode_benchmark_variants_resolve_their_split_counts():
    """benchmarks/decode.py: an integer split count is launched as given, ``half``/``double``
    relative to the default (an integer count was once dropped, timing the default twice)."""
    from qattn_compile.kvcache.kernel import resolve, DecodeConfig

    bench = _decode_benchmark()
    layer, _, _ = _filled_layer(1, 2, 1300, 32, 1, 0, capacity=1400)
    q = torch.randn(1, 8, 1, 32, dtype=torch.float16)
    t = layer.tensors()
    default = resolve(DecodeConfig(), q, t).splits
    assert default > 2
    assert bench._config({"splits": 3}, q, t).splits == 3
    assert bench._config({"splits": "half"}, q, t).splits == default // 2
    assert bench._config({}, q, t).splits == default


def test_decode_benchmark_summary_prints_the_in_step_timings():
    """benchmarks/decode.py's table from a report shaped as it writes one (a backend that
    failed, the in-step timings): the speed-up in a step is over the faster SDPA's step."""
    bench = _decode_benchmark()
    variant = {"config": {"splits": 128}, "graph_ms": 0.5, "GBps": 2.0, "speedup_vs_sdpa": 2.0,
               "kernel_vs_reference": {"rel_l1": 1e-3}, "vs_exact_unquantized": {"rel_l1": 0.1}}
    flashq_entry = {"bytes": 1e6, "variants": {"default": variant}, "best": "default",
                    "reference_vs_exact_unquantized": {"rel_l1": 0.1}, "default_eager_ms": 1.0,
                    "default_op_ms": 1.0, "default_bool_mask_graph_ms": 1.0, "default_step_ms": 0.3}
    shape = {"shape": {"batch": 1, "context": 32768, "heads": 32, "kv_heads": 8, "dim": 128},
             "sdpa_bf16": {"flash": {"graph_ms": 1.0, "GBps": 1.0, "step_ms": 0.9},
                           "cudnn": {"graph_ms": 0.8, "GBps": 1.0, "step_ms": 0.6}, "other": {"error": "refused"}},
             "sdpa_bytes": 1e6, "flashq": {"int4": flashq_entry}}
    report = {"device": "test", "versions": {}, "variants": {"default": {}}, "shapes": [shape],
              "check": {"bf16 rounding": {"int4": 1e-3}, "default": {"int4": 1e-3}}}
    text = bench.summary(report)
    assert "sdpa flash 0.9000, sdpa cudnn 0.6000; int4 0.3000 (2.00x)" in text


# ------------------------------------------------------------------------------------------
# generate(), eager and compiled
# ------------------------------------------------------------------------------------------


def _tiny_llama(attn="sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      attn_implementation=attn)
    return LlamaForCausalLM(cfg).eval()


def _generate(model, ids, cache=None, tokens=8):
    kwargs = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                  attention_mask=torch.ones_like(ids), pad_token_id=0, disable_compile=True)
    return model.generate(ids, past_key_values=cache, **kwargs)[:, ids.shape[1]:]


def test_generate_dense_and_kernel_paths_agree():
    """Through ``sdpa`` (dense dequantized K/V) and ``qattn_kv`` (the decode op on the packed
    cache) the model sees the same quantized values, so greedy tokens are identical."""
    model = _tiny_llama()
    ids = torch.randint(0, 256, (2, 100))
    settings = KVCacheLayer(int2_heads=1)
    dense = _generate(model, ids, FlashQCache(model.config, 160, settings), tokens=32)
    model.set_attn_implementation("qattn_kv")
    kernel = _generate(model, ids, FlashQCache(model.config, 160, settings), tokens=32)
    assert torch.equal(dense, kernel)


def test_int2_heads_beyond_a_layers_kv_heads_is_clamped_with_a_warning_naming_the_entry(caplog):
    """A count larger than the model's kv heads (a policy written for a larger model) stores
    every head in INT2; the warning names the policy entry and the layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg)
    policy = {"qattn": 1, "kv_cache": {"int2_heads": 4, "rules": [
        {"match": "*layers.1.*", "int2_heads": 3}, {"match": "*layers.2.*", "buffer_tokens": 128}]}}
    with caplog.at_level("WARNING", logger="qattn_compile.kvcache"):
        cache = FlashQCache.from_policy(model, policy, max_cache_len=64)
    assert [layer.int2_heads for layer in cache.layers] == [2, 2, 2]
    assert cache.layers[2].buffer_tokens == 128
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "policy <policy dict>: kv_cache: int2_heads=4 exceeds the 2 kv heads of "
        "model.layers.0.self_attn (layer 0) and 1 more: all 2 heads of these layers stored in INT2",
        "policy <policy dict>: kv_cache.rules[0] (match '*layers.1.*'): int2_heads=3 exceeds the 2 kv "
        "heads of model.layers.1.self_attn (layer 1): all 2 heads of the layer stored in INT2"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="qattn_compile.kvcache"):
        direct = FlashQCache(cfg, 64, KVCacheLayer(int2_heads=5))
    assert [layer.int2_heads for layer in direct.layers] == [2, 2, 2]
    assert "FlashQCache settings: int2_heads=5 exceeds the 2 kv heads of layer 0 and 2 more" in caplog.text


def test_the_example_policy_makes_a_cache_for_a_model_with_fewer_kv_heads():
    """examples/policy.yaml gives int2_heads: 4; the tiny Llama has 2 kv heads per layer."""
    model = _tiny_llama()
    cache = FlashQCache.from_policy(model, Path(__file__).parents[1] / "examples" / "policy.yaml", 40)
    ids = torch.randint(0, 256, (2, 20))
    assert _generate(model, ids, cache, tokens=4).shape == (2, 4)
    assert [layer.int2_heads for layer in cache.layers] == [0, 2]  # rule for layer 0, then clamped


def test_reusing_a_cache_for_a_new_prompt_says_to_reset_it():
    model = _tiny_llama()
    ids = torch.randint(0, 256, (1, 8))
    cache = FlashQCache(model.config, 16, KVCacheLayer(int2_heads=1))
    first = _generate(model, ids, cache, tokens=8)
    stored = int(cache.get_seq_length())
    longer = torch.randint(0, 256, (1, 20))  # generate takes the stored tokens as its first ones
    with pytest.raises(ValueError, match=rf"{stored} stored \+ {20 - stored} new tokens exceed max_cache_len=16\. "
                                         r".*call cache\.reset\(\) before a new prompt .*max_cache_len >= 20"):
        _generate(model, longer, cache, tokens=4)
    with pytest.raises(ValueError, match=r"A cache keeps its tokens across generate\(\) calls.*call cache\.reset\(\)"):
        _generate(model, ids, cache, tokens=8)  # the same prompt again: generate sees it as cached
    with pytest.raises(ValueError, match=rf"a forward of 0 new tokens after {int(cache.get_seq_length())} stored\. "):
        cache.layers[0].get_mask_sizes(0)  # what generate runs for a prompt the cache holds whole
    cache.reset()
    assert cache.get_seq_length() == 0
    assert torch.equal(_generate(model, ids, cache, tokens=8), first)


def _copy_llama():
    """The copy-task Llama of ``tests/data`` (see ``make_copy_llama.py`` there)."""
    import importlib.util

    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    spec = importlib.util.spec_from_file_location("make_copy_llama", DATA / "make_copy_llama.py")
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    model = LlamaForCausalLM(maker.copy_llama_config()).eval()
    state = {k: v.float() for k, v in load_file(str(DATA / "copy_llama.safetensors")).items()}
    model.load_state_dict(state)
    return model


def test_generate_int4_matches_the_unquantized_cache_for_32_tokens(record_property):
    """The copy-task Llama reads its cache to continue a periodic prompt. On every prompt it
    continues confidently (top-1 probability >= 0.9 at each of the 32 steps), the INT4 cache
    gives the same 32 greedy tokens as the unquantized cache. Prompts where the model itself
    hesitates are near-ties that any perturbation flips: they count in the reported overall
    agreement (and the 2/4 mix's), not in the assertion."""
    model = _copy_llama()
    model.set_attn_implementation("qattn_kv")
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (48, 40)).repeat(1, 3)[:, :100]
    kwargs = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, attention_mask=torch.ones_like(ids),
                  pad_token_id=0, disable_compile=True)
    out = model.generate(ids, output_scores=True, return_dict_in_generate=True, **kwargs)
    reference = out.sequences[:, 100:]
    confident = torch.stack(out.scores, 1).softmax(-1).amax(-1).amin(1) >= 0.9
    agreement = {}
    for label, int2_heads in (("int4", 0), ("mix_2_4", 1)):
        cache = FlashQCache(model.config, 160, KVCacheLayer(int2_heads=int2_heads))
        same = model.generate(ids, past_key_values=cache, **kwargs)[:, 100:] == reference
        agreement[label] = same
        record_property(f"{label}_token_agreement", same.float().mean().item())
        record_property(f"{label}_confident_prompts_matching", f"{int(same[confident].all(1).sum())}/{int(confident.sum())}")
    assert confident.sum() >= 12
    assert agreement["int4"][confident].all()


def test_compiled_generate_uses_the_decode_op_without_recompiling():
    _compat.reset_dynamo()
    model = _tiny_llama("qattn_kv")
    ids = torch.randint(0, 256, (2, 70))
    settings = KVCacheLayer(int2_heads=1)
    eager = _generate(model, ids, FlashQCache(model.config, 100, settings))
    graphs = []
    backend = qattn_compile.backend({"qattn": 1, "default": "turbo"}, compiler="eager")

    def recording(gm, example_inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return backend(gm, example_inputs)

    model.compile(backend=recording)
    try:
        compiled = _generate(model, ids, FlashQCache(model.config, 100, settings))
        again = _generate(model, ids, FlashQCache(model.config, 100, settings))
    finally:
        _compat.reset_dynamo()
    assert torch.equal(compiled, eager) and torch.equal(again, eager)
    assert len(graphs) == 2  # prefill and decode, no recompilation for a new cache
    assert any("qattn.flashq_decode" in targets for targets in graphs)
    assert [r.preset for r in backend.site_reports] == ["turbo", "turbo"]  # the prefill's SDPA
