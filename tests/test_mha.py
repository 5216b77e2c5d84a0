"""``nn.MultiheadAttention`` (and the PyTorch transformer layers built on it) through qattn.

Dynamo keeps ``F.multi_head_attention_forward`` as one node: every configuration must give
exactly one site, served with the exact ``flash`` preset (output equal to eager's) or
reported with its reason and left as it was.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import qattn_compile
from qattn_compile import _compat
from qattn_compile.report import FALLBACK, REWRITTEN

E, HEADS, L, S, B = 16, 2, 5, 7, 2
FLASH = {"qattn": 1, "default": "flash"}
EXACT = dict(rtol=1e-4, atol=1e-5)


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class Caller(nn.Module):
    """Calls its ``mha`` with fixed keyword arguments; returns what ``keep`` selects."""

    def __init__(self, mha: nn.Module, keep: str = "output", **kwargs):
        super().__init__()
        self.mha, self.keep, self.kwargs = mha, keep, kwargs

    def forward(self, query, memory):
        out, weights = self.mha(query, memory, memory, **self.kwargs)
        return out if self.keep == "output" else (out, weights)


def compiled_run(module: nn.Module, *inputs, grad: bool = False):
    """(eager output, compiled output, site reports) of ``module`` with the flash preset."""
    be = qattn_compile.backend(FLASH, compiler="eager")
    compiled = torch.compile(module, backend=be, fullgraph=True)
    with torch.set_grad_enabled(grad):
        expected = module(*inputs)
        got = compiled(*inputs)
    return expected, got, be.site_reports


def _inputs(batch_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (lambda n: (B, n, E)) if batch_first else (lambda n: (n, B, E))
    return torch.randn(shape(L)), torch.randn(shape(S))


def _masks(key_padding: str | None, attn: str | None) -> dict:
    masks = {}
    if key_padding:
        pad = torch.zeros(B, S, dtype=torch.bool)
        pad[0, -2:] = True
        masks["key_padding_mask"] = pad if key_padding == "bool" else torch.zeros(B, S).masked_fill(pad, -1e9)
    if attn == "bool":
        masks["attn_mask"] = torch.rand(L, S) > 0.7
        masks["attn_mask"][:, 0] = False  # no fully masked row
    elif attn == "float":
        masks["attn_mask"] = torch.randn(L, S)
    elif attn == "per-head":
        masks["attn_mask"] = torch.randn(B * HEADS, L, S)
    return masks


SERVED = [
    (need_weights, batch_first, key_padding, attn)
    for need_weights, batch_first, (key_padding, attn) in itertools.product(
        (False, True), (False, True),
        [(None, None), ("bool", None), (None, "bool"), ("bool", "bool"), ("float", "float"), (None, "per-head")],
    )
]


@pytest.mark.parametrize("need_weights, batch_first, key_padding, attn", SERVED)
def test_multihead_attention_is_served(need_weights, batch_first, key_padding, attn):
    """need_weights=True is served too when the caller drops the weights."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, HEADS, batch_first=batch_first).eval()
    module = Caller(mha, need_weights=need_weights, **_masks(key_padding, attn))
    expected, got, reports = compiled_run(module, *_inputs(batch_first))
    (report,) = reports
    assert (report.fqn, report.module_class, report.status) == ("mha", "MultiheadAttention", REWRITTEN), report
    assert report.shapes["q"] == [B, HEADS, L, E // HEADS] and report.shapes["k"] == [B, HEADS, S, E // HEADS]
    assert ("padding" in report.mask_kind) == (key_padding is not None)
    torch.testing.assert_close(got, expected, **EXACT)


@pytest.mark.parametrize("attn", [None, "bool", "per-head"])
def test_unbatched_multihead_attention_is_served(attn):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, HEADS, batch_first=True).eval()
    masks = _masks("float" if attn == "per-head" else "bool", attn)  # one mask dtype: no warning
    masks = {name: mask[0] if name == "key_padding_mask" else mask for name, mask in masks.items()}
    if attn == "per-head":
        masks["attn_mask"] = masks["attn_mask"][:HEADS]  # [1·H, L, S]
    module = Caller(mha, need_weights=False, **masks)
    expected, got, reports = compiled_run(module, torch.randn(L, E), torch.randn(S, E))
    assert [(r.status, r.shapes["q"]) for r in reports] == [(REWRITTEN, [1, HEADS, L, E // HEADS])]
    torch.testing.assert_close(got, expected, **EXACT)


def test_causal_multihead_attention_is_served_as_is_causal():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, HEADS).eval()
    causal = nn.Transformer.generate_square_subsequent_mask(L)
    module = Caller(mha, need_weights=False, attn_mask=causal, is_causal=True)
    x = torch.randn(L, B, E)
    expected, got, reports = compiled_run(Self(module), x)
    assert [(r.status, r.mask_kind) for r in reports] == [(REWRITTEN, "causal")]
    torch.testing.assert_close(got, expected, **EXACT)


class Self(nn.Module):
    """Self-attention: the caller's memory is its query."""

    def __init__(self, caller: Caller):
        super().__init__()
        self.caller = caller

    def forward(self, x):
        return self.caller(x, x)


@pytest.mark.parametrize("average", [True, False])
@pytest.mark.parametrize("batch_first", [False, True])
def test_returned_attention_weights_are_refused(average, batch_first):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, HEADS, batch_first=batch_first).eval()
    module = Caller(mha, keep="both", average_attn_weights=average, **_masks("bool", None))
    expected, got, reports = compiled_run(module, *_inputs(batch_first))
    (report,) = reports
    assert (report.fqn, report.pattern, report.status) == ("mha", "mha", FALLBACK)
    assert "uses the attention weights (need_weights=True" in report.reason
    assert "need_weights=False" in report.reason
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("build, reason", [
    (lambda: nn.MultiheadAttention(E, HEADS, add_bias_kv=True).eval(), "add_bias_kv=True"),
    (lambda: nn.MultiheadAttention(E, HEADS, add_zero_attn=True).eval(), "add_zero_attn=True"),
    (lambda: nn.MultiheadAttention(E, HEADS, dropout=0.1).train(), "dropout p=0.1 in training mode"),
])
def test_unservable_multihead_attention_is_reported(build, reason):
    torch.manual_seed(0)
    module = Caller(build(), need_weights=False)
    _, got, reports = compiled_run(module, *_inputs(False))
    (report,) = reports
    assert report.status == FALLBACK and reason in report.reason, report.reason
    assert report.fqn == "mha"


def test_multihead_attention_with_gradients_is_refused():
    torch.manual_seed(0)
    module = Caller(nn.MultiheadAttention(E, HEADS), need_weights=False)
    _, got, reports = compiled_run(module, *_inputs(False), grad=True)
    assert [r.status for r in reports] == [FALLBACK]
    assert "grad with grad mode on" in reports[0].reason and got.requires_grad


def _encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(E, HEADS, 32, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()


def test_transformer_encoder_fast_path_is_reported_per_layer():
    """Eval mode without gradients takes the fused layer op: one fallback site per layer,
    named after the layer's ``self_attn``, with the way out; with the fast path off, the
    same layers are served."""
    torch.manual_seed(0)
    model = _encoder()
    x = torch.randn(B, L, E)
    expected, got, reports = compiled_run(model, x)
    assert [(r.fqn, r.module_class, r.status) for r in reports] == [
        (f"layers.{i}.self_attn", "MultiheadAttention", FALLBACK) for i in range(2)]
    assert all("set_fastpath_enabled(False)" in r.reason for r in reports)
    _compat.reset_dynamo()
    enabled = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        expected, got, reports = compiled_run(model, x)
    finally:
        torch.backends.mha.set_fastpath_enabled(enabled)
    assert [(r.fqn, r.status) for r in reports] == [(f"layers.{i}.self_attn", REWRITTEN) for i in range(2)]
    torch.testing.assert_close(got, expected, **EXACT)


def test_transformer_decoder_layer_is_served():
    torch.manual_seed(0)
    layer = nn.TransformerDecoderLayer(E, HEADS, 32, batch_first=True).eval()
    tgt, memory = torch.randn(B, L, E), torch.randn(B, S, E)
    causal = nn.Transformer.generate_square_subsequent_mask(L)

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, tgt, memory):
            return self.layer(tgt, memory, tgt_mask=causal, tgt_is_causal=True)

    expected, got, reports = compiled_run(Decoder(), tgt, memory)
    assert [(r.fqn, r.status, r.mask_kind) for r in reports] == [
        ("layer.self_attn", REWRITTEN, "causal"), ("layer.multihead_attn", REWRITTEN, "none")]
    torch.testing.assert_close(got, expected, **EXACT)


def test_dynamic_shapes_serve_every_length():
    """Under ``dynamic=True`` the module's float attributes (``dropout``) are symbolic; in
    eval mode they are unused and the site is served for every length."""
    torch.manual_seed(0)
    module = Caller(nn.MultiheadAttention(E, HEADS, batch_first=True).eval())
    be = qattn_compile.backend(FLASH, compiler="eager")
    compiled = torch.compile(module, backend=be, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for length in (5, 11):
            query, memory = torch.randn(B, length, E), torch.randn(B, length + 2, E)
            torch.testing.assert_close(compiled(query, memory), module(query, memory), **EXACT)
    assert [r.status for r in be.site_reports] == [REWRITTEN]


class ClipAttentionPool(nn.Module):
    """CLIP's ``AttentionPool2d``: ``F.multi_head_attention_forward`` called directly with
    separate q/k/v projection weights, the mean token as the query."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.c_proj = (nn.Linear(E, E) for _ in range(4))

    def forward(self, x):  # [L, B, E]
        x = torch.cat([x.mean(dim=0, keepdim=True), x], dim=0)
        out, _ = torch.nn.functional.multi_head_attention_forward(
            query=x[:1], key=x, value=x, embed_dim_to_check=E, num_heads=HEADS,
            q_proj_weight=self.q_proj.weight, k_proj_weight=self.k_proj.weight,
            v_proj_weight=self.v_proj.weight, in_proj_weight=None,
            in_proj_bias=torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]),
            bias_k=None, bias_v=None, add_zero_attn=False, dropout_p=0.0,
            out_proj_weight=self.c_proj.weight, out_proj_bias=self.c_proj.bias,
            use_separate_proj_weight=True, training=self.training, need_weights=False)
        return out.squeeze(0)


def test_separate_projection_weights_are_served():
    """``F.multi_head_attention_forward`` called directly (CLIP's pooling head) and an
    ``nn.MultiheadAttention`` whose keys and values have their own widths."""
    torch.manual_seed(0)
    model = nn.Sequential(ClipAttentionPool()).eval()
    expected, got, reports = compiled_run(model, torch.randn(S, B, E))
    assert [(r.fqn, r.module_class, r.status) for r in reports] == [("0", "ClipAttentionPool", REWRITTEN)]
    torch.testing.assert_close(got, expected, **EXACT)
    _compat.reset_dynamo()
    mha = nn.MultiheadAttention(E, HEADS, kdim=12, vdim=12).eval()
    expected, got, reports = compiled_run(Caller(mha, need_weights=False),
                                          torch.randn(L, B, E), torch.randn(S, B, 12))
    assert [r.status for r in reports] == [REWRITTEN]
    torch.testing.assert_close(got, expected, **EXACT)
