"""Hand-written attention that regroups its batch dims between the two products, adds a
bias through ``torch.baddbmm``, or soft-caps its logits: every one is one site, served with
the exact ``flash`` preset (output equal to eager's) or reported with its reason; a softmax
that is no attention is no site.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from qattn_compile.policy import load_policy
from qattn_compile.report import FALLBACK, REWRITTEN
from qattn_compile.rewrite import rewrite_attention

B, H, L, D = 2, 4, 9, 8
EXACT = dict(rtol=1e-4, atol=1e-5)


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class Recorder:
    """A dynamo backend rewriting with the flash preset; keeps reports and node names."""

    def __init__(self):
        self.policy = load_policy({"qattn": 1, "default": "flash"})
        self.reports, self.names, self.graphs = [], set(), []

    def __call__(self, gm: fx.GraphModule, example_inputs):
        self.names |= {n.name for n in gm.graph.nodes if n.name != getattr(n.target, "__name__", n.target)}
        self.reports += rewrite_attention(gm, self.policy)
        self.graphs.append(gm)
        return gm.forward


def run(module: nn.Module, *inputs):
    rec = Recorder()
    with torch.no_grad():
        expected = module(*inputs)
        got = torch.compile(module, backend=rec, fullgraph=True)(*inputs)
    return expected, got, rec


def _causal(batch: int = B) -> torch.Tensor:
    """``[B, 1, L, L]`` True above the diagonal (masked), one padded key in sample 0."""
    masked = torch.triu(torch.ones(L, L, dtype=torch.bool), 1).expand(batch, 1, L, L).clone()
    masked[0, ..., 1] = True
    masked[0, :, 1, 0] = False
    return masked


class OptStyle(nn.Module):
    """OPT (transformers 4.3x): ``bmm`` on ``[B·H, L, D]``, the mask added in ``[B, H, L, L]``
    (the scores viewed there and back), ``torch.max`` against ``finfo.min`` left out."""

    def forward(self, q, k, v, additive):
        batch, length = q.shape[0] // H, q.shape[1]
        scores = torch.bmm(q * D**-0.5, k.transpose(1, 2))
        scores = scores.view(batch, H, length, length) + additive
        scores = scores.view(batch * H, length, length)
        return torch.bmm(F.softmax(scores, dim=-1), v)


class OptClamped(nn.Module):
    """OPT (transformers 4.2x): the masked scores floored at ``finfo.min`` with ``torch.max``."""

    def forward(self, q, k, v, additive):
        scores = torch.bmm(q, k.transpose(1, 2)) * D**-0.5
        scores = scores.view(B, H, L, L) + additive
        scores = torch.max(scores, torch.tensor(torch.finfo(scores.dtype).min))
        return torch.bmm(F.softmax(scores.view(B * H, L, L), dim=-1), v)


class ViewedForBmm(nn.Module):
    """``[B, H, L, D]`` Q and K viewed as ``[B·H, L, D]`` for ``bmm``, the scores viewed back,
    the second product in ``[B, H, ...]``."""

    def forward(self, q, k, v, masked):
        scores = torch.bmm(q.reshape(B * H, L, D), k.reshape(B * H, L, D).transpose(1, 2)) / D**0.5
        scores = scores.view(B, H, L, L).masked_fill(masked, float("-inf"))
        return torch.matmul(scores.softmax(-1), v)


class BloomStyle(nn.Module):
    """BLOOM: ALiBi through ``baddbmm`` on ``[B·H, ...]``, a causal mask in ``[B, H, L, L]``,
    softmax there, the probabilities viewed back for ``bmm``."""

    def forward(self, q, k, v, masked):
        slopes = torch.tensor([2.0 ** (-8 * (i + 1) / H) for i in range(H)]).repeat(B)
        alibi = slopes[:, None, None] * torch.arange(L)[None, None, :]  # [B·H, 1, L]
        scores = alibi.baddbmm(batch1=q, batch2=k.transpose(1, 2), beta=1.0, alpha=1 / math.sqrt(D))
        scores = scores.view(B, H, L, L)
        scores = torch.masked_fill(scores, masked, torch.finfo(scores.dtype).min)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.bmm(probs.view(B * H, L, L), v)


class SwinStyle(nn.Module):
    """timm's Swin window attention with a shifted-window mask added through a 5-D view."""

    def __init__(self, windows: int = 2):
        super().__init__()
        self.windows = windows
        self.bias = nn.Parameter(torch.randn(H, L, L))

    def forward(self, q, k, v, window_mask):
        attn = (q * D**-0.5) @ k.transpose(-2, -1)
        attn = attn + self.bias.unsqueeze(0)
        attn = attn.view(-1, self.windows, H, L, L) + window_mask.unsqueeze(1).unsqueeze(0)
        attn = attn.view(-1, H, L, L)
        return attn.softmax(dim=-1) @ v


def _rank3(*tensors):
    return [t.reshape(B * H, L, D) for t in tensors]


def _qkv(batch: int = B):
    return [torch.randn(batch, H, L, D) for _ in range(3)]


def _window_mask(windows: int) -> torch.Tensor:
    mask = torch.zeros(windows, L, L)
    mask[1, : L // 2, L // 2:] = -100.0
    mask[1, L // 2:, : L // 2] = -100.0
    return mask


CASES = {
    "opt": lambda: (OptStyle(), *_rank3(*_qkv()), torch.zeros(B, 1, L, L).masked_fill(_causal(), -1e9)),
    "bloom": lambda: (BloomStyle(), *_rank3(*_qkv()), _causal()),
    "swin": lambda: (SwinStyle(), *_qkv(2 * B), _window_mask(2)),
    "opt-clamped": lambda: (OptClamped(), *_rank3(*_qkv()), torch.zeros(B, 1, L, L).masked_fill(_causal(), -1e9)),
    "viewed-for-bmm": lambda: (ViewedForBmm(), *_qkv(), _causal()),
}


@pytest.mark.parametrize("name", CASES)
def test_batch_dims_regrouped_between_products_are_served(name):
    module, *inputs = CASES[name]()
    expected, got, rec = run(module, *inputs)
    (report,) = rec.reports
    assert report.status == REWRITTEN, report.reason
    torch.testing.assert_close(got, expected, **EXACT)


def test_baddbmm_bias_is_an_additive_term():
    class Alibi(nn.Module):
        def forward(self, q, k, v, bias):
            return torch.baddbmm(bias, q, k.mT, beta=0.5, alpha=0.25).softmax(-1) @ v

    q, k, v = _rank3(*_qkv())
    expected, got, rec = run(Alibi(), q, k, v, torch.randn(B * H, 1, L))
    (report,) = rec.reports
    assert (report.status, report.mask_kind) == (REWRITTEN, "additive"), report.reason
    torch.testing.assert_close(got, expected, **EXACT)


class SoftCapped(nn.Module):
    """Gemma 2's eager attention: scores / cap, tanh, * cap."""

    def forward(self, q, k, v):
        scores = q @ k.transpose(2, 3) * D**-0.5
        scores = torch.tanh(scores / 50.0) * 50.0
        return F.softmax(scores, dim=-1) @ v


class SoftCapAfterMask(nn.Module):
    """A mask before the tanh: tanh(-inf) = -1 would not mask, so the chain is refused."""

    def forward(self, q, k, v):
        scores = (q @ k.transpose(2, 3)).masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
        return F.softmax(torch.tanh(scores / 50.0) * 50.0, dim=-1) @ v


def test_logit_soft_capping_is_served_with_its_cap():
    """Gemma 2's cap·tanh(τ·Q·Kᵀ/cap) reaches the op as its soft cap (50) and scale (τ): the
    output matches the model's (flash is exact), and the scores are large enough to be
    capped (without the cap the output would differ)."""
    q, k, v = (t * 8 for t in _qkv())
    expected, got, rec = run(SoftCapped(), q, k, v)
    (report,) = rec.reports
    assert report.status == REWRITTEN, report.reason
    (op,) = [n for gm in rec.graphs for n in gm.graph.nodes if n.target is torch.ops.qattn.attention.default]
    assert op.args[8] == pytest.approx(50.0) and op.args[5] == pytest.approx(D**-0.5)
    torch.testing.assert_close(got, expected, **EXACT)
    uncapped = F.softmax(q @ k.transpose(2, 3) * D**-0.5, dim=-1) @ v
    assert not torch.allclose(uncapped, expected, **EXACT)


class Mixed(nn.Module):
    """A view that changes the last two dims: no batch regrouping."""

    def forward(self, q, k, v):
        scores = (q @ k.mT).view(B, H, L * L // 3, 3).view(B, H, L, L)
        return scores.softmax(-1) @ v


class ReturnsWeights(nn.Module):
    """OPT-style attention that also returns its probabilities, viewed per head."""

    def forward(self, q, k, v):
        probs = torch.bmm(q, k.transpose(1, 2)).softmax(-1)
        return torch.bmm(probs, v), probs.view(B, H, L, L)


def test_products_grouped_differently_are_reported():
    """Q·Kᵀ on ``[B·H, L, D]`` inputs and P·V in ``[B, H, ...]``: the op would need the
    output regrouped; reported with both groupings."""

    class Mixed3And4(nn.Module):
        def forward(self, q, k, v):
            scores = torch.bmm(q, k.transpose(1, 2)).view(B, H, L, L)
            return torch.matmul(scores.softmax(-1), v.view(B, H, L, D))

    expected, got, rec = run(Mixed3And4(), *_rank3(*_qkv()))
    (report,) = rec.reports
    assert report.status == FALLBACK
    assert "group their batch dims differently: [8] and [2, 4]" in report.reason, report.reason
    torch.testing.assert_close(got, expected)


def test_view_that_mixes_query_rows_into_batch_is_reported_not_served():
    expected, got, rec = run(Mixed(), *_qkv())
    (report,) = rec.reports
    assert report.status == FALLBACK and "unsupported op `view` (test_reach.py:" in report.reason
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("module, inputs, reason", [
    (SoftCapAfterMask(), _qkv, "soft-capping `tanh` after another one or after a mask"),
    (Mixed(), _qkv, "unsupported op `view`"),
    (ReturnsWeights(), lambda: _rank3(*_qkv()), "the probabilities from `softmax` (test_reach.py:"),
], ids=["soft-capped", "view", "returns-weights"])
def test_reasons_name_no_graph_node(module, inputs, reason):
    """Refusal texts quote ops and source lines, never an FX node name."""
    _, _, rec = run(module, *inputs())
    (report,) = rec.reports
    assert report.status == FALLBACK and reason in report.reason, report.reason
    assert not [n for n in rec.names if f"`{n}`" in report.reason], report.reason


@pytest.mark.parametrize("name, status", [("opt", REWRITTEN), ("swin", FALLBACK)])
def test_regrouped_mask_under_dynamic_shapes(name, status):
    """Under dynamic shapes a mask is moved between batch groupings as long as no symbolic
    size must be spelled out: OPT's ``[B, 1, L, L]`` mask (symbolic B, L) is served; Swin's
    ``[nW, N, N]`` window mask would need B copies (B symbolic) and falls back, saying why."""
    module, *inputs = CASES[name]()
    rec = Recorder()
    with torch.no_grad():
        got = torch.compile(module, backend=rec, fullgraph=True, dynamic=True)(*inputs)
    (report,) = rec.reports
    assert report.status == status, report.reason
    if status == FALLBACK:
        assert "under dynamic shapes (the dim's size is symbolic)" in report.reason
    torch.testing.assert_close(got, module(*inputs), **EXACT)


class Classifier(nn.Module):
    """Softmaxes that are no attention: class probabilities of a linear head, used by a
    matmul afterwards (a soft lookup in an embedding table), and a mixture of experts."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(D, 5)
        self.table = nn.Parameter(torch.randn(5, D))

    def forward(self, x):
        probs = self.head(x).softmax(-1)  # [B, L, 5]: over classes, from one activation
        soft_lookup = probs @ self.table
        gates = torch.softmax(x.sum(-1), dim=-1)
        return soft_lookup, gates


def test_softmax_that_is_not_attention_is_no_site():
    _, _, rec = run(Classifier().eval(), torch.randn(B, L, D))
    assert rec.reports == []


class Flex(nn.Module):
    """FlexAttention with a relative-position score_mod."""

    def forward(self, q, k, v):
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q, k, v, score_mod=lambda score, b, h, q_idx, kv_idx: score + (q_idx - kv_idx))


def test_flex_attention_is_reported():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = Flex()

        def forward(self, q, k, v):
            return self.attn(q, k, v)

    expected, got, rec = run(Block(), *_qkv())
    assert [(r.fqn, r.module_class, r.pattern, r.status) for r in rec.reports] == [
        ("attn", "Flex", "flex_attention", FALLBACK)]
    assert "score_mod/mask_mod" in rec.reports[0].reason
    torch.testing.assert_close(got, expected)


def test_transposed_output_product_is_reported():
    """``(Vᵀ·Pᵀ)ᵀ`` is attention too: reported (not silently left out), not served."""

    class Transposed(nn.Module):
        def forward(self, q, k, v):
            probs = (q @ k.mT * D**-0.5).softmax(-1)
            return (v.mT @ probs.mT).mT

    expected, got, rec = run(Transposed(), *_qkv())
    (report,) = rec.reports
    assert report.status == FALLBACK
    assert "the probabilities enter `matmul` (test_reach.py:" in report.reason, report.reason
    assert "Vᵀ·Pᵀ instead of P·V" in report.reason
    torch.testing.assert_close(got, expected)



@pytest.mark.parametrize("term_shape, layout, site_layout", [
    ((2, 1, 5, 6), (2, 4), (8,)),  # OPT: [B, 1, Lq, Lk] added in [B, H, ...], site [B·H, ...]
    ((8, 1, 6), (8,), (2, 4)),  # BLOOM's ALiBi in [B·H, ...], site [B, H, ...]
    ((1, 3, 1, 5, 6), (2, 3, 4), (6, 4)),  # Swin: [1, nW, 1, N, N] in [B, nW, H, ...]
    ((3, 1, 1, 6), (2, 3, 4), (6, 4)),  # rank below the layout's
    ((1, 1, 1, 5, 6), (2, 3, 4), (6, 4)),  # constant along every batch dim, one rank too many
    ((2, 3, 4, 5, 6), (2, 3, 4), (24,)),
    ((6,), (2, 3), (3, 2)),  # a key-axis vector broadcasts in any grouping
    ((2, 1, 5, 6), (2, 3), (3, 2)),  # (2, 3) <-> (3, 2) is one group: materialized
])
def test_regroup_moves_a_term_between_batch_groupings(term_shape, layout, site_layout):
    from qattn_compile.patterns.masks import regroup

    term = torch.randn(term_shape)
    node = fx.Graph().placeholder("term")
    node.meta["example_value"] = term
    moved = regroup(node, layout, site_layout)
    got = term
    for name, args in moved.ops if moved else ():
        got = getattr(got, name)(*args)
    last = (5, 6)
    expected = term.expand(*layout, *last).reshape(*site_layout, *last)
    assert got.dim() <= len(site_layout) + 2
    torch.testing.assert_close(got.expand(*site_layout, *last), expected)
