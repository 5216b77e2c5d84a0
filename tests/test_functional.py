"""The eager functional API: SDPA semantics, shapes, errors."""

import pytest
import torch
import torch.nn.functional as F

import qattn_compile
from qattn_compile.metrics import compare
from qattn_compile.presets import QUANTIZED_PRESETS
from qattn_compile.reference import exact_attention


def _qkv(b=2, hq=4, hkv=2, lq=19, lkv=23, d=32, dtype=torch.float32):
    q = torch.randn(b, hq, lq, d, dtype=dtype)
    k = torch.randn(b, hkv, lkv, d, dtype=dtype)
    v = torch.randn(b, hkv, lkv, d, dtype=dtype)
    return q, k, v


def test_none_preset_is_sdpa():
    q, k, v = _qkv(hkv=4)
    out = qattn_compile.attention(q, k, v, is_causal=True, preset="none")
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_flash_matches_sdpa_with_mask_and_extra_batch_dims():
    q, k, v = (t.reshape(2, 1, *t.shape[1:]) for t in _qkv(hkv=4))  # [2, 1, H, L, D]
    mask = torch.rand(19, 23) > 0.3
    out = qattn_compile.attention(q, k, v, attn_mask=mask, preset="flash")
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert out.shape == ref.shape == (2, 1, 4, 19, 32)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("preset", QUANTIZED_PRESETS)
def test_quantized_presets_close_to_exact_with_gqa(preset):
    q, k, v = _qkv()
    out = qattn_compile.attention(q, k, v, is_causal=True, enable_gqa=True, preset=preset)
    m = compare(out, exact_attention(q, k, v, is_causal=True))
    floor = 0.97 if preset == "sage2_4b" else 0.99
    assert m["cos"] > floor, (preset, m)
    assert 0 < m["rel_l1"] < 0.2, (preset, m)


def test_options_are_validated():
    q, k, v = _qkv(hkv=4)
    with pytest.raises(qattn_compile.PolicyError, match="v_granularity"):
        qattn_compile.attention(q, k, v, preset="int_flash", v_granularity="row")
    with pytest.raises(qattn_compile.PolicyError, match="unknown preset 'int4'.*sage2_8b"):
        qattn_compile.attention(q, k, v, preset="int4")


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda q, k, v: (q, k.half(), v), "same dtype"),
        (lambda q, k, v: (q, k[..., :16], v), "same head dim"),
        (lambda q, k, v: (q, k, v[:, :, :5]), "key and value to have the same heads and length"),
        (lambda q, k, v: (q[0, 0], k, v), "at least 3 dims"),
        (lambda q, k, v: (q.int(), k.int(), v.int()), "floating point"),
    ],
)
def test_bad_inputs_raise_sdpa_style_errors(change, message):
    q, k, v = change(*_qkv(hkv=4))
    with pytest.raises(ValueError, match=message):
        qattn_compile.attention(q, k, v, preset="int_flash")


def test_gqa_needs_enable_gqa_and_divisible_heads():
    q, k, v = _qkv(hq=4, hkv=2)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        qattn_compile.attention(q, k, v, preset="int_flash")
    q, k, v = _qkv(hq=5, hkv=2)
    with pytest.raises(ValueError, match="must divide"):
        qattn_compile.attention(q, k, v, enable_gqa=True, preset="int_flash")
    q, k, v = _qkv(hq=4, hkv=0)
    with pytest.raises(ValueError, match="must divide"):
        qattn_compile.attention(q, k, v, enable_gqa=True, preset="int_flash")


def test_bad_mask_and_dropout():
    q, k, v = _qkv(hkv=4)
    with pytest.raises(ValueError, match="not broadcastable"):
        qattn_compile.attention(q, k, v, attn_mask=torch.ones(7, 23, dtype=torch.bool), preset="flash")
    with pytest.raises(ValueError, match=r"attn_mask of shape \(1, 2, 4, 19, 23\) has more dims"):
        qattn_compile.attention(q, k, v, attn_mask=torch.ones(1, 2, 4, 19, 23, dtype=torch.bool),
                                preset="flash")
    with pytest.raises(ValueError, match="attn_mask dtype"):
        qattn_compile.attention(q, k, v, attn_mask=torch.ones(19, 23, dtype=torch.int32), preset="flash")
    with pytest.raises(ValueError, match="dropout_p must be 0"):
        qattn_compile.attention(q, k, v, dropout_p=0.1, preset="flash")


def test_fully_masked_rows_are_zero_not_nan():
    q, k, v = _qkv(hkv=4)
    mask = torch.rand(2, 1, 19, 23) > 0.5
    mask[:, :, 3] = False
    out = qattn_compile.attention(q, k, v, attn_mask=mask, preset="int_flash")
    assert not out.isnan().any()
    assert out[:, :, 3].abs().max() == 0
    assert out[:, :, 4].abs().max() > 0
