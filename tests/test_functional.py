"""The eager functional API: SDPA semantics, shapes, errors."""

import functools
import inspect
import re

import pytest
import torch
import torch.nn.functional as F

import qattn_compile
from qattn_compile.errors import AttentionInputError
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
        (lambda q, k, v: (q, k, v[:, :, :5]), "key and value to have the same leading dims, heads "
                                              "and length"),
        (lambda q, k, v: (q[0, 0, 0], k, v), "at least 2 dimensional"),
        (lambda q, k, v: (q.int(), k.int(), v.int()), "floating point"),
    ],
)
def test_bad_inputs_raise_sdpa_style_errors(change, message):
    q, k, v = change(*_qkv(hkv=4))
    with pytest.raises(ValueError, match=message):
        qattn_compile.attention(q, k, v, preset="int_flash")


@pytest.mark.parametrize("q_shape, kv_shape, enable_gqa", [
    ((19, 32), (23, 32), False),  # 2-D: one head, no batch
    ((19, 32), (2, 3, 23, 32), False),
    ((2, 1, 3, 19, 32), (4, 3, 23, 32), False),  # leading dims broadcast
    ((2, 4, 19, 32), (1, 4, 23, 32), False),
    ((2, 4, 19, 32), (2, 1, 23, 32), False),  # one key/value head, broadcast over the query's
    ((2, 1, 19, 32), (2, 4, 23, 32), False),  # one query head, broadcast over the key's
    ((2, 4, 19, 32), (1, 2, 23, 32), True),
], ids=str)
@pytest.mark.parametrize("preset", ["none", "flash", "int_flash"])
def test_shapes_sdpa_broadcasts_are_broadcast(q_shape, kv_shape, enable_gqa, preset):
    q, k, v = torch.randn(q_shape), torch.randn(kv_shape), torch.randn(kv_shape)
    mask = torch.rand(19, 23) > 0.3
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)
    out = qattn_compile.attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa, preset=preset)
    assert out.shape == ref.shape
    error = compare(out, ref)["rel_l1"]
    assert error < (1e-5 if preset != "int_flash" else 0.05), error


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
    # broadcastable both ways, but larger than the scores [2, 4, 19, 23]
    with pytest.raises(ValueError, match=r"attn_mask of shape \(3, 1, 19, 23\) is not broad"):
        qattn_compile.attention(q, k, v, attn_mask=torch.ones(3, 1, 19, 23, dtype=torch.bool),
                                preset="flash")


def test_float_mask_of_another_float_dtype_is_added_as_sdpa_adds_it():
    q, k, v = (t.half() for t in _qkv(hkv=4))
    mask = torch.randn(2, 1, 19, 23, dtype=torch.float64)
    out = qattn_compile.attention(q, k, v, attn_mask=mask, preset="flash")
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    assert out.dtype == torch.float16
    assert compare(out, ref)["rel_l1"] < 2e-3


def test_inputs_that_require_grad_are_refused_by_name():
    q, k, v = _qkv(hkv=4)
    k.requires_grad_(True)
    with pytest.raises(ValueError, match="inference-only: key requires grad"):
        qattn_compile.attention(q, k, v, preset="int_flash")
    with torch.no_grad():
        assert qattn_compile.attention(q, k, v, preset="int_flash").shape == (2, 4, 19, 32)
    out = qattn_compile.attention(q, k, v, preset="none")  # SDPA itself, with its backward
    out.sum().backward()
    assert k.grad is not None
    torch.manual_seed(0)
    dropped = qattn_compile.attention(q, k, v, dropout_p=0.5, preset="none")  # and its dropout
    torch.manual_seed(0)
    assert torch.equal(dropped, F.scaled_dot_product_attention(q, k, v, dropout_p=0.5))


def test_fully_masked_rows_are_zero_not_nan():
    q, k, v = _qkv(hkv=4)
    mask = torch.rand(2, 1, 19, 23) > 0.5
    mask[:, :, 3] = False
    out = qattn_compile.attention(q, k, v, attn_mask=mask, preset="int_flash")
    assert not out.isnan().any()
    assert out[:, :, 3].abs().max() == 0
    assert out[:, :, 4].abs().max() > 0


@pytest.mark.parametrize("lead", [(), (2, 3)], ids=["3d", "5d"])
def test_leading_dims_pass_the_kernels_support_check(lead, monkeypatch):
    """The kernels take 4-D ``[B, H, L, D]``; the functional API folds SDPA's leading dims
    into B before asking them (on CPU: pretend the Triton path serves, as on CUDA)."""
    from qattn_compile import ops

    monkeypatch.setattr(ops, "execution_path", lambda device, site=None: ("triton", None))
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the kernels' check accepts CPU tensors then
    q, k, v = (t.reshape(*lead, *t.shape[1:]) if lead else t[0] for t in _qkv(b=6 if lead else 1))
    out = qattn_compile.attention(q, k, v, is_causal=True, enable_gqa=True, preset="int_flash")
    flat = qattn_compile.attention(*(t.reshape(-1, *t.shape[-3:]) for t in (q, k, v)),
                                   is_causal=True, enable_gqa=True, preset="int_flash")
    assert out.shape == (*lead, 4, 19, 32)
    assert torch.equal(out, flat.reshape(out.shape))
    # what the kernels still refuse is named with the 4-D shapes they were asked about
    with pytest.raises(ValueError, match=r"head dim 300 of q \(\d+, 4, 19, 300\)"):
        qattn_compile.attention(*(torch.randn(*t.shape[:-1], 300) for t in (q, k, v)),
                                enable_gqa=True, preset="int_flash")


@pytest.mark.parametrize("preset", ["int_flash", "sage2_8b", "fp8"])
def test_empty_inputs_give_what_sdpa_gives(preset):
    """Zero batch, heads, query or key length: SDPA's output (empty, or zeros when no key
    exists), not an error from deep inside a quantizer."""
    cases = [dict(b=0), dict(hq=0, hkv=0), dict(lq=0), dict(lkv=0), dict(d=0)]
    for dims in cases:
        q, k, v = _qkv(**{"hkv": 4, **dims})
        out = qattn_compile.attention(q, k, v, preset=preset)
        ref = F.scaled_dot_product_attention(q, k, v)
        assert out.shape == ref.shape, (dims, out.shape, ref.shape)
        assert torch.equal(out, ref), dims
        if dims == dict(lkv=0):
            assert out.numel() > 0  # rows with no key at all: zeros, as fully masked rows
    q, k, v = _qkv(hkv=4)
    with pytest.raises(ValueError, match=r"head dim 0 \(q \(2, 4, 19, 0\)"):
        qattn_compile.attention(q[..., :0], k[..., :0], v, preset=preset)


@pytest.mark.parametrize("preset, options, message", [
    ("bogus", "{}", "unknown preset 'bogus'"),
    ("none", "{}", "serves the presets other than 'none'"),
    ("int_flash", "{not json", "options of preset 'int_flash' are not JSON"),
    ("int_flash", "[]", "must be a JSON object"),
    ("int_flash", '{"p_scale": "x"}', "field `p_scale`"),
])
def test_the_op_called_directly_names_a_bad_preset_or_options(preset, options, message):
    """The graph op, called by hand, and its fake (what tracing runs) give the library's
    named errors instead of a KeyError or pydantic's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(qattn_compile.PolicyError, match=message):
        torch.ops.qattn.attention(q, q, q, None, False, None, preset, options)
    with FakeTensorMode():
        fake = torch.randn(1, 2, 8, 16)
        with pytest.raises(qattn_compile.PolicyError, match=message):
            torch.ops.qattn.attention(fake, fake, fake, None, False, None, preset, options)


@pytest.mark.parametrize("static_scales, message", [
    ({"q": (1.0, 2.0), "k": 1.0, "v": 1.0},
     r"static_scales\['q'\] holds 2 values .* this call has 4"),
    ({"q": 1.0, "k": (1.0, 1.0, 1.0, 1.0), "v": 1.0},
     r"static_scales\['k'\] holds 4 .*key/value heads; this call has 2"),
])
def test_static_scales_per_head_must_match_the_heads(static_scales, message):
    q, k, v = _qkv()  # 4 query heads, 2 kv heads
    with pytest.raises(ValueError, match=message):
        qattn_compile.attention(q, k, v, enable_gqa=True, preset="fmha_int8", scales="static",
                                static_scales=static_scales)
    ok = {"q": (1.0, 2.0, 3.0, 4.0), "k": (3.0, 3.0), "v": 4.0}
    out = qattn_compile.attention(q, k, v, enable_gqa=True, preset="fmha_int8", scales="static",
                                  static_scales=ok)
    assert out.shape == (2, 4, 19, 32) and not out.isnan().any()


def test_static_scales_are_not_negative_and_calibration_files_need_the_backend():
    q, k, v = _qkv(hkv=4)
    for k_amax, shown in ((-3.0, "a number -3.0"), ([1.0, float("nan")], "a list [1.0, nan]")):
        with pytest.raises(qattn_compile.PolicyError) as error:
            qattn_compile.attention(q, k, v, preset="fmha_int8", scales="static",
                                    static_scales={"q": 1.0, "k": k_amax, "v": 1.0})
        # one sentence for the field, not one per member of its type's union
        assert ("field `static_scales.k`: must be an amax (a finite number, at least 0) or a "
                f"list of them (one per head), got {shown}") in str(error.value)
        assert str(error.value).count("static_scales.k") == 1
    with pytest.raises(ValueError, match="read per site by the torch.compile backend"):
        qattn_compile.attention(q, k, v, preset="fmha_int8", scales="static",
                                calibration="scales.pt")


# ----------------------------------------------------------------------------- SDPA's arguments

def test_sdpa_arguments_by_name_as_diffusers_passes_them():
    """``functools.partial(qattn_compile.attention, preset=...)`` replaces SDPA in code that
    names every argument; the positional order is SDPA's."""
    params = list(inspect.signature(qattn_compile.attention).parameters.values())
    assert [p.name for p in params[:8]] == ["query", "key", "value", "attn_mask", "dropout_p",
                                            "is_causal", "scale", "enable_gqa"]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params[:8])
    assert params[8].name == "preset" and params[8].kind is inspect.Parameter.KEYWORD_ONLY
    sdpa = functools.partial(qattn_compile.attention, preset="flash")
    q, k, v = _qkv()
    mask = torch.rand(19, 23) > 0.3
    named = dict(query=q, key=k, value=v, attn_mask=mask, dropout_p=0.0, is_causal=False,
                 scale=0.3, enable_gqa=True)
    out = sdpa(**named)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(**named), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(sdpa(*named.values()), out)


@pytest.mark.parametrize("typo, meant", [("is_casual", "is_causal"), ("atn_mask", "attn_mask"),
                                         ("enable_gq", "enable_gqa")])
def test_a_misspelled_sdpa_argument_is_a_type_error_not_an_unknown_option(typo, meant):
    q, k, v = _qkv(hkv=4)
    with pytest.raises(TypeError, match="unexpected keyword"):
        F.scaled_dot_product_attention(q, k, v, **{typo: True})
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{typo}' "
                                        f"\\(did you mean '{meant}'\\?\\)"):
        qattn_compile.attention(q, k, v, **{typo: True}, preset="int_flash")
    with pytest.raises(qattn_compile.PolicyError, match="unknown key `smooth`"):
        qattn_compile.attention(q, k, v, smooth=True, preset="int_flash")  # an option's typo
    with pytest.raises(qattn_compile.PolicyError, match="unknown key `scales`"):
        qattn_compile.attention(q, k, v, scales="static", preset="int_flash")  # fmha_int8's


def _np_bool():
    return pytest.importorskip("numpy").bool_(True)


def _np_mask():
    return pytest.importorskip("numpy").ones((19, 23), dtype=bool)


@pytest.mark.parametrize("name, bad", [
    ("is_causal", lambda: "False"),  # was read as causal: a non-empty string is truthy
    ("is_causal", lambda: 1),
    ("is_causal", lambda: None),
    ("is_causal", _np_bool),
    ("is_causal", lambda: torch.tensor(True)),
    ("enable_gqa", lambda: "False"),
    ("attn_mask", lambda: [[True] * 23] * 19),
    ("attn_mask", _np_mask),
    ("dropout_p", lambda: "0.0"),
    ("dropout_p", lambda: None),
    ("scale", lambda: "0.5"),
    ("scale", lambda: torch.tensor([0.5, 0.5])),
    ("query", lambda: [[1.0]]),
], ids=lambda x: x if isinstance(x, str) else "")
@pytest.mark.parametrize("preset", ["none", "int_flash"])
def test_an_argument_of_a_wrong_type_is_sdpas_type_error(name, bad, preset):
    q, k, v = _qkv(hkv=4)
    arguments = dict(query=q, key=k, value=v) | {name: bad()}
    with pytest.raises(TypeError, match=f"argument '{name}'"):
        F.scaled_dot_product_attention(**arguments)
    with pytest.raises(TypeError, match=f"argument '{name}' must be "):
        qattn_compile.attention(**arguments, preset=preset)


@pytest.mark.parametrize("arguments", [
    dict(scale=torch.tensor(0.5)), dict(scale=1), dict(dropout_p=0), dict(dropout_p=False),
], ids=["0-d tensor scale", "int scale", "int dropout_p", "bool dropout_p"])
def test_what_sdpas_parser_takes_for_a_float_is_taken(arguments):
    q, k, v = _qkv(hkv=4)
    out = qattn_compile.attention(q, k, v, **arguments, preset="flash")
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, **arguments),
                               atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("mask", [torch.ones(23, dtype=torch.bool), torch.zeros(23),
                                  torch.tensor(True)], ids=["1-d bool", "1-d float", "0-d"])
@pytest.mark.parametrize("preset", ["none", "flash", "int_flash"])
def test_a_mask_of_fewer_than_2_dims_is_sdpas_index_error(mask, preset):
    q, k, v = _qkv(hkv=4)
    with pytest.raises(IndexError):
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with pytest.raises(IndexError, match=rf"attn_mask must have at least 2 dims .*shape "
                                         rf"{re.escape(str(tuple(mask.shape)))}"):
        qattn_compile.attention(q, k, v, attn_mask=mask, preset=preset)


@pytest.mark.parametrize("preset", ["none", "flash", "int_flash", "sage2_8b"])
def test_a_mask_with_is_causal_applies_both_as_sdpa_on_cpu_does(preset):
    """SDPA's CPU path takes ``attn_mask`` with ``is_causal=True`` and applies both (its
    fused CUDA backends refuse the pair); so does every preset."""
    q, k, v = _qkv(hkv=4)
    mask = torch.rand(2, 1, 19, 23) > 0.3
    combined = mask & torch.ones(19, 23, dtype=torch.bool).tril()
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
    torch.testing.assert_close(sdpa, F.scaled_dot_product_attention(q, k, v, attn_mask=combined),
                               equal_nan=True)
    both = qattn_compile.attention(q, k, v, attn_mask=mask, is_causal=True, preset=preset)
    torch.testing.assert_close(both, qattn_compile.attention(q, k, v, attn_mask=combined,
                                                             preset=preset))
    assert not torch.allclose(both, qattn_compile.attention(q, k, v, attn_mask=mask,
                                                            preset=preset), atol=1e-2)


@pytest.mark.parametrize("change", [
    lambda q, k, v: dict(query=q, key=k.double(), value=v),
    lambda q, k, v: dict(query=q, key=k[..., :16], value=v),
    lambda q, k, v: dict(query=q.int(), key=k.int(), value=v.int()),
    lambda q, k, v: dict(query=q, key=k[:, :2], value=v[:, :2]),  # heads differ, no enable_gqa
    lambda q, k, v: dict(query=q, key=k, value=v, attn_mask=torch.ones(19, 23, dtype=torch.int32)),
    lambda q, k, v: dict(query=q, key=k, value=v, attn_mask=torch.ones(7, 23, dtype=torch.bool)),
], ids=["dtypes", "head dims", "integer", "heads", "mask dtype", "mask shape"])
def test_tensors_sdpa_refuses_with_a_runtime_error_raise_one(change):
    """SDPA's RuntimeError; still a ValueError, as qattn's other refusals of bad input."""
    arguments = change(*_qkv(hkv=4))
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(**arguments)
    with pytest.raises(AttentionInputError) as info:
        qattn_compile.attention(**arguments, preset="int_flash")
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, ValueError)


def test_flash_keeps_a_nan_in_a_masked_key_out_where_sdpa_does_not():
    """The difference the README's NaN paragraph states: a NaN in a key that the mask hides
    gives SDPA (and the quantized presets, through a quantization scale) NaN rows in its
    head; ``flash`` replaces the masked score, as its kernel does, so its rows stay finite."""
    q, k, v = _qkv(hkv=4)
    k[0, 1, 22, 5] = float("nan")
    mask = torch.ones(19, 23, dtype=torch.bool)
    mask[:, 22] = False
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    flash = qattn_compile.attention(q, k, v, attn_mask=mask, preset="flash")
    quantized = qattn_compile.attention(q, k, v, attn_mask=mask, preset="int_flash")
    assert sdpa[0, 1].isnan().all() and quantized[0, 1].isnan().any()
    assert flash.isfinite().all()
    unmasked = exact_attention(q[:1, 1:2], k[:1, 1:2, :22], v[:1, 1:2, :22])
    torch.testing.assert_close(flash[0, 1], unmasked[0, 0].float(), atol=1e-5, rtol=1e-4)


def test_a_head_dim_the_gpu_refuses_is_refused_on_cpu_too():
    """One support authority (qattn_compile.support): the CPU reference path refuses what the
    GPU kernels refuse, naming the shape, instead of computing it here and failing there."""
    q = torch.randn(1, 2, 8, 512)
    with pytest.raises(ValueError, match=r"head dim 512 of q \(1, 2, 8, 512\)"):
        qattn_compile.attention(q, q, q, preset="int_flash")


def test_soft_cap_and_alibi_through_the_eager_api():
    """``softcap`` and ``alibi_slopes`` reach the preset (here the CPU reference) with SDPA's
    leading dims: slopes per head, or per leading index and head."""
    from qattn_compile.reference import exact_attention

    q, k, v = torch.randn(3, 4, 9, 16) * 3, torch.randn(3, 4, 11, 16), torch.randn(3, 4, 11, 16)
    per_head = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    per_batch = torch.rand(3, 4)
    for slopes in (per_head, per_batch):
        out = qattn_compile.attention(q, k, v, preset="flash", softcap=2.0, alibi_slopes=slopes)
        exact = exact_attention(q, k, v, softcap=2.0, alibi_slopes=slopes)
        assert torch.allclose(out.double(), exact, atol=1e-5)
        assert not torch.allclose(out.double(), exact_attention(q, k, v), atol=1e-2)


def test_soft_cap_and_alibi_arguments_are_checked():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(TypeError, match="softcap must be a number"):
        qattn_compile.attention(q, q, q, preset="flash", softcap="2")
    with pytest.raises(ValueError, match="softcap must be >= 0"):
        qattn_compile.attention(q, q, q, preset="flash", softcap=-1.0)
    with pytest.raises(TypeError, match="alibi_slopes must be a floating-point Tensor"):
        qattn_compile.attention(q, q, q, preset="flash", alibi_slopes=[0.5, 0.25])
    with pytest.raises(RuntimeError, match=r"alibi_slopes of shape \(3,\)"):
        qattn_compile.attention(q, q, q, preset="flash", alibi_slopes=torch.ones(3))
    with pytest.raises(ValueError, match="preset 'none'"):
        qattn_compile.attention(q, q, q, preset="none", softcap=2.0)
