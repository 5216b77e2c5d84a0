"""Site finders and rewrite on hand-written attention chains and SDPA calls.

Chains are generated from parameters (:class:`Chain`: one field per way models spell a
step) and run through the rewrite with the exact ``flash`` preset, so a wrong mask polarity,
scale or GQA mapping shows up as an output mismatch against the uncompiled module.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass, fields, replace

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from qattn_compile import _compat
from qattn_compile.models import tiny_llama
from qattn_compile.patterns import einsum, find_attention_sites
from qattn_compile.patterns.nodes import mutates, tensor_value
from qattn_compile.patterns.site import clean_fqn
from qattn_compile.policy import load_policy
from qattn_compile.report import FALLBACK, LEFT_ALONE, REWRITTEN, count_by_pattern
from qattn_compile.rewrite import rewrite_attention

B, H, L, D = 2, 4, 12, 16
FLASH = {"qattn": 1, "default": "flash"}
EXACT = dict(rtol=1e-4, atol=1e-5)


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class Recorder:
    """A dynamo backend that rewrites each graph with ``policy`` and keeps graphs and reports."""

    def __init__(self, policy=None):
        self.policy = load_policy(policy or FLASH)
        self.graphs, self.reports = [], []

    def __call__(self, gm, example_inputs):
        self.reports += rewrite_attention(gm, self.policy, graph_index=len(self.graphs))
        self.graphs.append(gm)
        return gm.forward

    def count(self, predicate) -> int:
        return sum(predicate(n) for gm in self.graphs for n in gm.graph.nodes)


def _is_qattn(node) -> bool:
    return node.target is torch.ops.qattn.attention.default


def _is_softmax(node) -> bool:
    return node.target in (F.softmax, torch.softmax, "softmax")


def run_compiled(module, *inputs, policy=None, dynamic=None, grad=False):
    """(eager output, compiled output, recorder) of ``module`` on ``inputs``."""
    rec = Recorder(policy)
    compiled = torch.compile(module, backend=rec, fullgraph=True, dynamic=dynamic)
    with torch.set_grad_enabled(grad):
        torch.manual_seed(0)
        expected = module(*inputs)
        torch.manual_seed(0)
        got = compiled(*inputs)
    return expected, got, rec


# ----------------------------------------------------------------------------------------
# hand-written chains, generated from parameters
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Chain:
    """One spelling of hand-written attention; the defaults are transformers' eager one."""

    qk: str = "torch.matmul"  # torch.matmul | @ | Tensor.matmul | bmm (rank-3 [B·H, L, D])
    key: str = "transpose(2, 3)"  # transpose(-1, -2) | torch.transpose | permute | mT | pre-transposed
    scale: str = "scores * c"  # none | scores / c | scores / full | q * c | q / c | q and k | per-head
    mask: str = "additive"  # none | masked_fill -inf | masked_fill min | where | Tensor.where | bool+additive | padding
    scale_after_mask: bool = False
    softmax: str = "F.softmax(dtype)"  # F.softmax | torch.softmax | Tensor.softmax | nn.Softmax | .float()
    dropout: str = "F.dropout(eval)"  # none | nn.Dropout(eval)
    pv: str = "torch.matmul"  # @ | bmm
    gqa: str = "none"  # repeat_kv | repeat_interleave | repeat (tiled: not GQA, served repeated)


VARIANTS = {
    "qk": ["@", "Tensor.matmul"],
    "key": ["transpose(-1, -2)", "torch.transpose", "permute", "mT", "pre-transposed"],
    "scale": ["none", "scores / c", "scores / full", "q * c", "q / c", "q and k", "per-head"],
    "mask": ["none", "masked_fill -inf", "masked_fill min", "where", "Tensor.where", "bool+additive", "padding"],
    "scale_after_mask": [True],
    "softmax": ["F.softmax", "torch.softmax", "Tensor.softmax", "nn.Softmax", ".float()"],
    "dropout": ["none", "nn.Dropout(eval)"],
    "pv": ["@"],
    "gqa": ["repeat_kv", "repeat_interleave", "repeat"],
}
COMBINATIONS = [
    Chain(qk="bmm", pv="bmm", key="permute", scale="q / c", mask="masked_fill -inf"),
    Chain(qk="bmm", pv="bmm", key="pre-transposed", scale="none", mask="bool+additive", softmax="Tensor.softmax"),
    Chain(qk="@", pv="@", key="mT", scale="scores / c", mask="where", softmax=".float()", gqa="repeat_kv"),
    Chain(gqa="repeat_interleave", mask="masked_fill min", scale="scores / full", scale_after_mask=True),
    Chain(gqa="repeat_interleave", mask="masked_fill min", scale="per-head"),
    Chain(scale="q and k", mask="padding", dropout="nn.Dropout(eval)", softmax="nn.Softmax", gqa="repeat_kv"),
]


def _chains() -> list[Chain]:
    base = Chain()
    singles = [replace(base, **{f.name: value}) for f in fields(Chain) for value in VARIANTS.get(f.name, [])]
    return [base, *singles, *COMBINATIONS]


def _chain_id(chain: Chain) -> str:
    base = Chain()
    diff = [
        f"{f.name}={getattr(chain, f.name)}" for f in fields(Chain) if getattr(chain, f.name) != getattr(base, f.name)
    ]
    return ",".join(diff) or "transformers-eager"


def repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    """transformers' repeat_kv."""
    b, h, length, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n, length, d).reshape(b, h * n, length, d)


class ChainAttention(nn.Module):
    """Attention spelled as ``chain`` says; q ``[B, H, L, D]``, k/v ``[B, Hkv, L, D]``."""

    def __init__(self, chain: Chain):
        super().__init__()
        self.chain = chain
        self.softmax = nn.Softmax(dim=-1)
        self.dropout = nn.Dropout(0.1)
        self.register_buffer("temperature", torch.linspace(0.1, 0.4, H).view(H, 1, 1))

    def _repeat(self, x: torch.Tensor) -> torch.Tensor:
        n = H // x.shape[1]
        how = self.chain.gqa
        if how == "repeat_kv":
            return repeat_kv(x, n)
        if how == "repeat_interleave":
            return x.repeat_interleave(n, dim=1)
        return x.repeat(1, n, 1, 1) if how == "repeat" else x

    def _mask(self, scores, keep, bias, rank3):
        """Apply the chain's mask to the scores ([B, H, L, L] masks flattened for bmm)."""
        if rank3:
            keep, bias = (t.expand(B, H, L, L).flatten(0, 1) for t in (keep, bias))
        kind, minimum = self.chain.mask, torch.finfo(scores.dtype).min
        if kind == "additive":
            return scores + bias
        if kind == "masked_fill -inf":
            return scores.masked_fill(~keep, float("-inf"))
        if kind == "masked_fill min":
            return scores.masked_fill(keep == 0, minimum)
        if kind == "where":
            return torch.where(keep, scores, torch.tensor(minimum))
        if kind == "Tensor.where":
            return scores.where(keep, minimum)
        if kind == "bool+additive":
            return (scores + bias).masked_fill(~keep, float("-inf"))
        if kind == "padding":
            return scores.masked_fill(~keep[:, :, :1, :], float("-inf"))
        return scores

    def _scale_scores(self, scores):
        how = self.chain.scale
        if how == "scores * c":
            return scores * D**-0.5
        if how == "scores / c":
            return scores / math.sqrt(D)
        if how == "scores / full":
            return scores / torch.full([], D**0.5, dtype=scores.dtype)
        if how == "per-head":
            return scores * self.temperature
        return scores

    def forward(self, q, k, v, keep, bias):
        c = self.chain
        k, v = self._repeat(k), self._repeat(v)
        if c.scale == "q * c":
            q = q * D**-0.5
        elif c.scale == "q / c":
            q = q / D**0.5
        elif c.scale == "q and k":
            q, k = q * D**-0.25, k * D**-0.25
        rank3 = c.qk == "bmm"
        if rank3:
            q, k, v = (t.flatten(0, 1) for t in (q, k, v))
        kt = {
            "transpose(2, 3)": lambda: k.transpose(-2, -1) if rank3 else k.transpose(2, 3),
            "transpose(-1, -2)": lambda: k.transpose(-1, -2),
            "torch.transpose": lambda: torch.transpose(k, -2, -1),
            "permute": lambda: k.permute(0, 2, 1) if rank3 else k.permute(0, 1, 3, 2),
            "mT": lambda: k.mT,
            "pre-transposed": lambda: (k.transpose(-1, -2) * 1).contiguous(),
        }[c.key]()
        qk = {"torch.matmul": torch.matmul, "@": operator.matmul, "Tensor.matmul": torch.Tensor.matmul}
        scores = {**qk, "bmm": torch.bmm}[c.qk](q, kt)
        if c.scale_after_mask:
            scores = self._scale_scores(self._mask(scores, keep, bias, rank3))
        else:
            scores = self._mask(self._scale_scores(scores), keep, bias, rank3)
        probs = {
            "F.softmax(dtype)": lambda s: F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype),
            "F.softmax": lambda s: F.softmax(s, -1),
            "torch.softmax": lambda s: torch.softmax(s, dim=-1),
            "Tensor.softmax": lambda s: s.softmax(-1),
            "nn.Softmax": self.softmax,
            ".float()": lambda s: F.softmax(s.float(), dim=-1).type_as(s),
        }[c.softmax](scores)
        if c.dropout == "F.dropout(eval)":
            probs = F.dropout(probs, p=0.1, training=False)
        elif c.dropout == "nn.Dropout(eval)":
            probs = self.dropout(probs)
        pv = {"torch.matmul": torch.matmul, "@": operator.matmul, "bmm": torch.bmm}
        out = pv[c.pv](probs, v)
        return out.view(B, H, L, D) if rank3 else out


def attention_inputs(hkv: int = H, dtype=torch.float32, length: int = L):
    """q, k, v, a keep mask (every query sees itself) and an additive bias with -inf holes."""
    q = torch.randn(B, H, length, D, dtype=dtype)
    k, v = (torch.randn(B, hkv, length, D, dtype=dtype) for _ in range(2))
    keep = torch.rand(B, 1, length, length) > 0.3
    keep |= torch.eye(length, dtype=torch.bool)
    bias = (0.5 * torch.randn(B, 1, length, length)).masked_fill(~keep, float("-inf")).to(dtype)
    return q, k, v, keep, bias


@pytest.mark.parametrize("chain", _chains(), ids=_chain_id)
def test_hand_written_chain_is_one_exact_site(chain):
    module = ChainAttention(chain).eval()
    hkv = H if chain.gqa == "none" else H // 2
    expected, got, rec = run_compiled(module, *attention_inputs(hkv))
    (report,) = rec.reports
    assert report.status == REWRITTEN, report.reason
    assert report.pattern == "matmul_softmax"
    assert report.gqa_group == (2 if chain.gqa in ("repeat_kv", "repeat_interleave") else 1)
    assert rec.count(_is_qattn) == 1 and rec.count(_is_softmax) == 0
    torch.testing.assert_close(got, expected, **EXACT)


@pytest.mark.parametrize(
    "mask, kind",
    [("none", "none"), ("additive", "additive"), ("masked_fill -inf", "bool"), ("padding", "padding")],
)
def test_chain_mask_kind(mask, kind):
    _, _, rec = run_compiled(ChainAttention(Chain(mask=mask)).eval(), *attention_inputs())
    assert rec.reports[0].mask_kind == kind


def test_chain_in_half_precision_keeps_output_dtype():
    module = ChainAttention(Chain(softmax=".float()")).eval()
    expected, got, rec = run_compiled(module, *attention_inputs(dtype=torch.bfloat16))
    assert rec.reports[0].status == REWRITTEN and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


# ----------------------------------------------------------------------------------------
# einsum chains
# ----------------------------------------------------------------------------------------

LQ, LK, DV = 12, 20, 8
"""Query and key lengths and V's head dim differ, so that a swapped operand cannot pass."""


class EinsumAttention(nn.Module):
    """Attention written with ``torch.einsum`` as ``spelling`` says; q ``[B, H, LQ, D]``,
    k ``[B, Hkv, LK, D]``, v ``[B, Hkv, LK, DV]``, bias ``[B, 1, LQ, LK]``."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling

    def forward(self, q, k, v, bias):
        s, e = self.spelling, torch.einsum
        if s == "bhqd":
            return e("bhqk,bhkd->bhqd", (e("bhqd,bhkd->bhqk", q, k) * D**-0.5 + bias).softmax(-1), v)
        if s == "ellipsis, spaces, list operands":
            scores = e("... q d, ... k d -> ... q k", [q * D**-0.5, k])
            return e("...qk,...kd->...qd", [F.softmax(scores, dim=-1), v])
        if s == "[B, L, H, D] layout":
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            scores = e("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
            return e("bhqk,bkhd->bqhd", torch.softmax(scores.masked_fill(bias < -1e9, float("-inf")), -1), v)
        if s == "operands swapped":
            scores = e("bhkd,bhqd->bhqk", k, q) * D**-0.5
            return e("bhkd,bhqk->bhqd", v, scores.softmax(-1))
        if s == "pre-transposed key":
            kt = k.transpose(-1, -2).contiguous()
            return e("bhqk,bhkd->bhqd", (e("bhqd,bhdk->bhqk", q, kt) + bias).softmax(-1), v)
        if s == "rank-3":
            q, k, v = (t.flatten(0, 1) for t in (q, k, v))
            return e("zqk,zkd->zqd", e("zqd,zkd->zqk", q, k).softmax(-1), v).view(B, H, LQ, DV)
        if s == "repeat_kv":
            return EinsumAttention("bhqd")(q, repeat_kv(k, 2), repeat_kv(v, 2), bias)
        raise AssertionError(s)


EINSUM_SPELLINGS = ["bhqd", "ellipsis, spaces, list operands", "[B, L, H, D] layout", "operands swapped",
                    "pre-transposed key", "rank-3", "repeat_kv"]


def einsum_inputs(hkv: int = H):
    q = torch.randn(B, H, LQ, D)
    k, v = torch.randn(B, hkv, LK, D), torch.randn(B, hkv, LK, DV)
    bias = (0.5 * torch.randn(B, 1, LQ, LK)).masked_fill(torch.rand(B, 1, LQ, LK) > 0.7, float("-inf"))
    bias[..., 0] = 0.0  # every query sees a key
    return q, k, v, bias


@pytest.mark.parametrize("spelling", EINSUM_SPELLINGS)
def test_einsum_chain_is_one_exact_site(spelling):
    gqa = spelling == "repeat_kv"
    expected, got, rec = run_compiled(EinsumAttention(spelling).eval(), *einsum_inputs(H // 2 if gqa else H))
    (report,) = rec.reports
    assert report.status == REWRITTEN, report.reason
    assert report.pattern == "matmul_softmax"
    hkv = H // 2 if gqa else H
    shapes = {"q": [B, H, LQ, D], "k": [B, hkv, LK, D], "v": [B, hkv, LK, DV]}
    if spelling == "rank-3":
        shapes = {name: [B * H, *shape[2:]] for name, shape in shapes.items()}
    assert report.shapes == shapes
    assert report.gqa_source == ("repeat_kv" if gqa else None)
    assert rec.count(_is_qattn) == 1 and rec.count(_is_softmax) == 0
    assert rec.count(lambda n: n.target is torch.einsum) == 0
    torch.testing.assert_close(got, expected, **EXACT)


def _einsum_node(equation: str, *shapes):
    graph = fx.Graph()
    operands = []
    for i, shape in enumerate(shapes):
        operands.append(graph.placeholder(f"x{i}"))
        operands[-1].meta["val"] = torch.empty(shape)
    return graph.call_function(torch.einsum, (equation, *operands))


@pytest.mark.parametrize("equation, a, b", [
    ("bhqd,bhkd->bhqk", (2, 3, 4, 5), (2, 3, 6, 5)),
    ("bqhd,bkhd->bhqk", (2, 4, 3, 5), (2, 6, 3, 5)),
    ("bhqk,bkhd->bqhd", (2, 3, 4, 6), (2, 6, 3, 5)),
    ("hbqd,bhkd->bhkq", (3, 2, 4, 5), (2, 3, 6, 5)),
    ("...qd,...kd->...qk", (2, 3, 4, 5), (2, 3, 6, 5)),
    ("qd,kd", (4, 5), (6, 5)),  # implicit output: "kq"
    ("bij , bjk -> bik", (2, 4, 5), (2, 5, 6)),
])
def test_einsum_contraction_equals_the_einsum(equation, a, b):
    node = _einsum_node(equation, a, b)
    found = einsum.contraction(node)
    x, y = torch.randn(a), torch.randn(b)

    def permute(t, dims):
        return t if dims is None else t.permute(dims)

    product = torch.matmul(permute(x, found.a_dims), permute(y, found.b_dims))
    torch.testing.assert_close(permute(product, found.out_dims), torch.einsum(equation, x, y))


@pytest.mark.parametrize("equation, shapes, reason", [
    ("bij,bjk->bk", [(2, 4, 5), (2, 5, 6)], "one summed index"),
    ("bii,bij->bij", [(2, 4, 4), (2, 4, 6)], "diagonal"),
    ("bhqd,bhkd->bhqkd", [(2, 3, 4, 5), (2, 3, 6, 5)], "one summed index"),
    ("...qd,...kd->...qk", [(2, 3, 4, 5), (3, 6, 5)], "broadcasting"),
    ("bhqd,bhkd->bhqk", [(2, 3, 4, 5), (1, 3, 6, 5)], "broadcasting"),
    ("bhqd,bhkd,bh->bhqk", [(2, 3, 4, 5), (2, 3, 6, 5), (2, 3)], "only two-operand"),
])
def test_einsum_that_is_no_matrix_product_says_why(equation, shapes, reason):
    found = einsum.contraction(_einsum_node(equation, *shapes))
    assert isinstance(found, str) and reason in found and repr(equation) in found, found


class EinsumRefusal(nn.Module):
    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        self.w = nn.Parameter(torch.eye(D), requires_grad=False)

    def forward(self, q, k, v, bias):
        e = torch.einsum
        if self.spelling == "bilinear":  # three operands: Q·W·Kᵀ
            return e("bhqk,bhkd->bhqd", e("bhqd,de,bhke->bhqk", q, self.w, k).softmax(-1), v)
        if self.spelling == "heads between":  # scores [B, LQ, H, LK]
            return e("bqhk,bhkd->bhqd", e("bhqd,bhkd->bqhk", q, k).softmax(-1), v)
        raise AssertionError(self.spelling)


@pytest.mark.parametrize("spelling, reason", [
    ("bilinear", r"einsum 'bhqd,de,bhke->bhqk' is not one batched matrix product: only two-operand"),
    ("heads between", r"einsum scores 'bhqd,bhkd->bqhk' whose last two axes are not \(queries, keys\)"),
])
def test_einsum_that_is_no_attention_product_is_reported(spelling, reason):
    expected, got, rec = run_compiled(EinsumRefusal(spelling).eval(), *einsum_inputs())
    (report,) = rec.reports
    assert report.status == FALLBACK and re.search(reason, report.reason), report.reason
    assert rec.count(_is_qattn) == 0
    torch.testing.assert_close(got, expected)


# ----------------------------------------------------------------------------------------
# SDPA call sites
# ----------------------------------------------------------------------------------------


class Sdpa(nn.Module):
    """``F.scaled_dot_product_attention`` called as ``spelling`` says."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        self.scaling = 0.3

    def forward(self, q, k, v, keep, bias):
        s = self.spelling
        if s == "positional":
            return F.scaled_dot_product_attention(q, k, v, bias, 0.0, False, scale=0.2)
        if s == "bool mask [B,1,L,L]":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        if s == "bool mask [L,L]":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[0, 0])
        if s == "padding [B,1,1,L]":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, :, :1])
        if s == "additive [B,H,L,L]":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.expand(B, H, L, L) + 0.0)
        if s == "is_causal":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling)
        if s == "enable_gqa":
            return F.scaled_dot_product_attention(q, k[:, ::2], v[:, ::2], attn_mask=keep, enable_gqa=True)
        if s == "repeat_kv":
            k, v = repeat_kv(k[:, ::2], 2), repeat_kv(v[:, ::2], 2)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=0.0)
        if s == "rank-3":
            q, k, v = (t.flatten(0, 1) for t in (q, k, v))
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.expand(B, H, L, L).flatten(0, 1))
        raise AssertionError(s)


SDPA_SPELLINGS = {
    "positional": ("additive", None),
    "bool mask [B,1,L,L]": ("bool", None),
    "bool mask [L,L]": ("bool", None),
    "padding [B,1,1,L]": ("padding", None),
    "additive [B,H,L,L]": ("additive", None),
    "is_causal": ("causal", None),
    "enable_gqa": ("bool", "enable_gqa"),
    "repeat_kv": ("bool", "repeat_kv"),
    "rank-3": ("additive", None),
}


@pytest.mark.parametrize("spelling", SDPA_SPELLINGS)
def test_sdpa_call_is_one_exact_site(spelling):
    expected, got, rec = run_compiled(Sdpa(spelling), *attention_inputs())
    (report,) = rec.reports
    assert report.status == REWRITTEN, report.reason
    assert (report.pattern, report.mask_kind, report.gqa_source) == ("sdpa", *SDPA_SPELLINGS[spelling])
    assert report.causal_fast_path == (spelling == "is_causal")
    assert rec.count(_is_qattn) == 1
    torch.testing.assert_close(got.view(expected.shape), expected, **EXACT)


def test_sdpa_gqa_is_fed_unrepeated():
    _, _, rec = run_compiled(Sdpa("repeat_kv"), *attention_inputs())
    (op,) = [n for n in rec.graphs[0].graph.nodes if _is_qattn(n)]
    shapes = [tuple(a.meta["example_value"].shape) for a in op.args[:3]]
    assert shapes == [(B, H, L, D), (B, H // 2, L, D), (B, H // 2, L, D)]
    assert not [n for n in rec.graphs[0].graph.nodes if n.target == "expand"]


# ----------------------------------------------------------------------------------------
# refusals: every reason a recognised site is left alone
# ----------------------------------------------------------------------------------------


class ReturnsWeights(nn.Module):
    def forward(self, q, k, v, keep, bias):
        weights = torch.softmax(q @ k.transpose(-1, -2) * 0.25 + bias, dim=-1)
        returned = weights.detach()
        return weights @ v, returned


class TrainingDropout(nn.Module):
    def forward(self, q, k, v, keep, bias):
        return F.dropout(torch.softmax(q @ k.mT, -1), p=0.1, training=True) @ v


class MaskedFillFinite(nn.Module):
    def forward(self, q, k, v, keep, bias):
        return torch.softmax((q @ k.mT).masked_fill(~keep, -5.0), -1) @ v


class SoftmaxOverQueries(nn.Module):
    def forward(self, q, k, v, keep, bias):
        return torch.softmax(q @ k.mT, dim=-2) @ v


class KeyAxisScale(nn.Module):
    def forward(self, q, k, v, keep, bias):
        return torch.softmax(q @ k.mT * torch.linspace(0.1, 1.0, L), -1) @ v


class Rank5(nn.Module):
    def forward(self, q, k, v, keep, bias):
        q5, k5, v5 = (t.view(B, 2, H // 2, L, D) for t in (q, k, v))
        return torch.softmax(q5 @ k5.mT, -1) @ v5


class BatchBroadcast(nn.Module):
    def forward(self, q, k, v, keep, bias):
        return torch.softmax(q @ k[:1].mT, -1) @ v[:1]


class Projected(nn.Module):
    """Attention on projected inputs: its graph needs gradients when grad mode is on."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, D)

    def forward(self, q, k, v, keep, bias):
        return F.scaled_dot_product_attention(self.proj(q), k, v)


class BroadcastScores(nn.Module):
    """One head's scores broadcast to every head by the mask (the mask added first)."""

    def forward(self, q, k, v, keep, bias):
        return torch.softmax(bias.expand(B, H, L, L) + q[:, :1] @ k[:, :1].mT, -1) @ v


REFUSALS = [
    (ReturnsWeights(), r"the probabilities from `softmax` \(test_patterns.py:\d+\) are also used by `detach` "
                       r"\(test_patterns.py:\d+\) outside the attention"),
    (TrainingDropout(), r"dropout p=0.1 in training mode"),
    (MaskedFillFinite(), r"masked_fill value -5.0 does not mask"),
    (SoftmaxOverQueries(), r"softmax over dim -2"),
    (KeyAxisScale(), r"varies along the key axis"),
    (Rank5(), r"rank-5 attention"),
    (BatchBroadcast(), r"batch sizes differ"),
    (BroadcastScores(), r"`add` \(test_patterns.py:\d+\) broadcasts the scores \[2, 1, 12, 12\] up to the mask's \[2, 4, 12, 12\]"),
]


@pytest.mark.parametrize("module, reason", REFUSALS, ids=[type(module).__name__ for module, _ in REFUSALS])
def test_refused_candidate_is_reported_with_reason_and_left_intact(module, reason):
    expected, got, rec = run_compiled(module, *attention_inputs())
    (report,) = rec.reports
    assert report.status == FALLBACK
    assert report.pattern == "matmul_softmax"
    assert report.source.startswith(__file__)
    assert re.search(reason, report.reason), report.reason
    assert rec.count(_is_qattn) == 0
    torch.testing.assert_close(got, expected)
    assert not node_names_in(report.reason, rec.graphs[0])


def node_names_in(text: str, gm: fx.GraphModule) -> list[str]:
    """The FX node names of ``gm`` that ``text`` quotes as identifiers (in backticks), other
    than names that are also an op's own name (a node named ``softmax`` calls softmax)."""
    targets = {n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "") for n in gm.graph.nodes}
    return [n.name for n in gm.graph.nodes if n.name not in targets and f"`{n.name}`" in text]


def test_graph_needing_gradients_is_left_alone():
    expected, got, rec = run_compiled(Projected(), *attention_inputs(), grad=True)
    (report,) = rec.reports
    assert report.status == FALLBACK and "requires grad" in report.reason
    assert rec.count(_is_qattn) == 0


class ParameterKV(nn.Module):
    """K and V are parameters used as they are (a learned memory): they require grad
    themselves, whatever the grad mode."""

    def __init__(self, chain: bool):
        super().__init__()
        self.chain = chain
        self.k, self.v = (nn.Parameter(torch.randn(B, H, L, D)) for _ in range(2))

    def forward(self, q, k, v, keep, bias):
        if self.chain:
            return torch.softmax(q @ self.k.mT * D**-0.5, dim=-1) @ self.v
        return F.scaled_dot_product_attention(q, self.k, self.v)


@pytest.mark.parametrize("chain", [False, True], ids=["sdpa", "matmul_softmax"])
def test_parameter_kv_is_served_under_no_grad_and_refused_with_grad_mode_on(chain):
    """What is refused is an attention whose result needs gradients, not an input that
    requires grad: under no_grad a parameter K/V is served (it used to fall back)."""
    expected, got, rec = run_compiled(ParameterKV(chain), *attention_inputs())
    (report,) = rec.reports
    assert report.status == REWRITTEN, report.reason
    assert rec.count(_is_qattn) == 1
    torch.testing.assert_close(got, expected, **EXACT)
    _compat.reset_dynamo()
    _, got, rec = run_compiled(ParameterKV(chain), *attention_inputs(), grad=True)
    (report,) = rec.reports
    assert report.status == FALLBACK and rec.count(_is_qattn) == 0
    assert re.search(r"requires? grad with grad mode on \(.*torch\.no_grad\(\)", report.reason), report.reason
    assert ("K, V require" if chain else "key, value require") in report.reason  # SDPA names its arguments
    assert got.requires_grad


def test_sdpa_dropout_in_training_is_refused():
    class DropoutSdpa(nn.Module):
        def forward(self, q, k, v, keep, bias):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=0.2)

    _, _, rec = run_compiled(DropoutSdpa(), *attention_inputs())
    assert rec.reports[0].status == FALLBACK and "dropout_p=0.2" in rec.reports[0].reason


def test_unsupported_head_dim_is_refused():
    """The kernels' limits reach the report on a CPU machine too (one support authority,
    qattn_compile.support): a head dim the GPU refuses falls back here as it would there."""
    q = torch.randn(1, 2, 8, 512)
    _, _, rec = run_compiled(Sdpa("bool mask [L,L]"), q, q, q, torch.ones(1, 1, 8, 8, dtype=torch.bool), None)
    assert rec.reports[0].status == FALLBACK and "head dim 512" in rec.reports[0].reason


def test_broadcast_batch_falls_back():
    """SDPA broadcasts a batch of 1 in k/v against q's; the op does not: the site keeps the
    original attention, with the reason, and the output is eager's."""
    q = torch.randn(2, 2, 8, 16)
    kv = torch.randn(1, 2, 8, 16)
    keep = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    expected, got, rec = run_compiled(Sdpa("bool mask [L,L]"), q, kv, kv, keep, None)
    assert rec.reports[0].status == FALLBACK and "broadcast batches" in rec.reports[0].reason
    torch.testing.assert_close(got, expected)


def test_on_unsupported_error_names_the_site():
    policy = {"qattn": 1, "default": "flash", "on_unsupported": "error"}
    with pytest.raises(Exception, match=r"cannot be served: the probabilities .* are also used"):
        run_compiled(ReturnsWeights(), *attention_inputs(), policy=policy)


def test_softmax_that_is_not_attention_is_not_a_candidate():
    class Router(nn.Module):
        def forward(self, x, w):
            return torch.softmax(F.linear(x, w), -1).topk(2, dim=-1).values

    _, _, rec = run_compiled(Router(), torch.randn(4, 8), torch.randn(3, 8))
    assert rec.reports == []


# ----------------------------------------------------------------------------------------
# naming, policy, counters, graph hygiene, dynamic shapes
# ----------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, attn: nn.Module, gqa: bool):
        super().__init__()
        self.attn, self.gqa = attn, gqa

    def forward(self, q, k, v, keep, bias):
        if self.gqa:
            k, v = k[:, ::2], v[:, ::2]
        return self.attn(q, k, v, keep, bias)


class Net(nn.Module):
    """Three attention layers: the transformers eager chain, SDPA, a repeat_kv GQA chain."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(
            [
                Block(ChainAttention(Chain()), gqa=False),
                Block(Sdpa("bool mask [B,1,L,L]"), gqa=False),
                Block(ChainAttention(Chain(gqa="repeat_kv")), gqa=True),
            ]
        )

    def forward(self, q, k, v, keep, bias):
        for layer in self.layers:
            q = layer(q, k, v, keep, bias)
        return q


def test_sites_are_named_by_module_fqn_class_and_source_line():
    _, _, rec = run_compiled(Net().eval(), *attention_inputs())
    names = [(r.fqn, r.module_class, r.pattern) for r in rec.reports]
    assert names == [
        ("layers.0.attn", "ChainAttention", "matmul_softmax"),
        ("layers.1.attn", "Sdpa", "sdpa"),
        ("layers.2.attn", "ChainAttention", "matmul_softmax"),
    ]
    assert all(r.source.startswith(__file__) for r in rec.reports)


@pytest.mark.parametrize(
    "dynamo_path",
    [
        "L['self'].model.layers.0.self_attn",
        "L['self'].model.layers[0].self_attn",
        "L['self']._modules['model']._modules['layers']._modules['0'].self_attn",
        "getattr(L['self'].model.layers, '0').self_attn",
        "L['model'].model.layers.0.self_attn",
        "L['args'][0].model.layers.0.self_attn",  # forward wrapped as f(*args) (transformers 5.24)
        "L['args'][0]._modules['model'].layers[0].self_attn",
    ],
)
def test_dynamo_module_paths_become_fqns(dynamo_path):
    assert clean_fqn(dynamo_path) == "model.layers.0.self_attn"


def test_policy_exclusions_stay_untouched_and_counters_add_up():
    policy = {
        "qattn": 1,
        "default": "int_flash",
        "rules": [{"match": "layers.0.*", "preset": "none"}, {"module_class": "Sdpa", "preset": "flash"}],
    }
    expected, got, rec = run_compiled(Net().eval(), *attention_inputs(), policy=policy)
    decisions = [(r.status, r.preset) for r in rec.reports]
    assert decisions == [(LEFT_ALONE, "none"), (REWRITTEN, "flash"), (REWRITTEN, "int_flash")]
    assert count_by_pattern(rec.reports) == {
        "matmul_softmax": {REWRITTEN: 1, LEFT_ALONE: 1, FALLBACK: 0},
        "sdpa": {REWRITTEN: 1, LEFT_ALONE: 0, FALLBACK: 0},
    }
    assert rec.count(_is_qattn) == 2 and rec.count(_is_softmax) == 1
    assert F.cosine_similarity(got.flatten(), expected.flatten(), dim=0) > 0.99


def test_rewritten_graph_keeps_example_values_and_finder_is_pure():
    module = ChainAttention(Chain(qk="bmm", pv="bmm", mask="bool+additive", key="pre-transposed"))
    rec = Recorder()

    def backend(gm, example_inputs):
        before = [n.name for n in gm.graph.nodes]
        find_attention_sites(gm)
        assert [n.name for n in gm.graph.nodes] == before
        return rec(gm, example_inputs)

    with torch.no_grad():
        torch.compile(module.eval(), backend=backend, fullgraph=True)(*attention_inputs())
    for node in rec.graphs[0].graph.nodes:
        if node.op in ("call_function", "call_method"):
            assert "example_value" in node.meta, node.format_node()


def test_dynamic_shapes_rewrite_once_and_serve_every_length():
    module = Net().eval()
    rec = Recorder()
    compiled = torch.compile(module, backend=rec, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for length in (7, 12, 19):
            inputs = attention_inputs(length=length)
            torch.testing.assert_close(compiled(*inputs), module(*inputs), **EXACT)
    assert len(rec.graphs) == 1
    assert [r.status for r in rec.reports] == [REWRITTEN] * 3


# ----------------------------------------------------------------------------------------
# causal masks proven from arange indices become is_causal
# ----------------------------------------------------------------------------------------


def _op_nodes(rec: Recorder) -> list:
    return [n for gm in rec.graphs for n in gm.graph.nodes if _is_qattn(n)]


def _op_mask_and_causal(op) -> tuple:
    """(mask node or None, is_causal) the rewrite passed the op."""
    return op.args[3], op.args[4]


def _run_bundle(bundle, rec: Recorder):
    """(eager output, compiled output) of a zoo bundle through ``rec``."""
    compiled = torch.compile(bundle.model, backend=rec, fullgraph=True)
    return bundle.run(), bundle.run(compiled)


@pytest.mark.parametrize("padded", [False, True], ids=["all-ones attention_mask", "padded"])
def test_transformers_causal_mask_becomes_is_causal(padded):
    """The tiny Llama's materialized ``[B, 1, L, L]`` mask: its causal part is served as
    ``is_causal`` and only the padding term ``[B, 1, 1, L]`` (data, even when all ones) is
    left; the ``[B, 1, L, L]`` mask is no longer built."""
    bundle = tiny_llama()
    if not padded:
        bundle.kwargs["attention_mask"] = torch.ones_like(bundle.kwargs["attention_mask"])
    rec = Recorder()
    expected, got = _run_bundle(bundle, rec)
    assert [(r.status, r.mask_kind, r.causal_from_mask) for r in rec.reports] == [
        (REWRITTEN, "causal+padding", True)
    ] * 2
    op_nodes = _op_nodes(rec)
    assert len(op_nodes) == 2 and all(op.meta["qattn"]["causal_from_mask"] for op in op_nodes)
    for mask, is_causal in map(_op_mask_and_causal, op_nodes):
        assert is_causal is True
        assert (mask.meta["example_value"].dtype, tuple(mask.meta["example_value"].shape)) == (torch.bool, (2, 1, 1, 24))
    assert rec.count(_is_square_bool_mask) == 0
    torch.testing.assert_close(got, expected, **EXACT)


def test_transformers_mask_without_attention_mask_is_erased():
    """No ``attention_mask`` (a prefill of one sequence): under torch.compile transformers
    ANDs its packed-sequence term ``seq[q] == seq[kv]`` into the mask, ``seq`` computed from
    ``arange`` position ids; it is proven always true, so the op gets ``is_causal`` and no
    mask at all."""
    bundle = tiny_llama()
    del bundle.kwargs["attention_mask"]
    rec = Recorder()
    expected, got = _run_bundle(bundle, rec)
    assert [(r.status, r.mask_kind, r.causal_from_mask) for r in rec.reports] == [
        (REWRITTEN, "causal", True)
    ] * 2
    assert [_op_mask_and_causal(op) for op in _op_nodes(rec)] == [(None, True)] * 2
    assert rec.count(_is_square_bool_mask) == 0
    torch.testing.assert_close(got, expected, **EXACT)


class PackedSequenceCausal(nn.Module):
    """SDPA with transformers' packed-sequence term ANDed to a causal one:
    ``seq = cumsum(diff(pos, prepend=pos[:, :1] - prepend_gap) != 1)``, ``seq[q] == seq[kv]``.
    ``positions``: ``arange`` (one sequence) or ``two`` (a run-time tensor holding two
    packed sequences, ``0..L/2-1`` twice)."""

    def __init__(self, positions: str = "arange", prepend_gap: int = 1):
        super().__init__()
        self.positions, self.prepend_gap = positions, prepend_gap

    def forward(self, q, k, v, keep, bias):
        idx, batch = torch.arange(L), torch.arange(1)
        pos = idx.unsqueeze(0)
        if self.positions == "two":
            pos = (bias[:1, 0, 0].argsort(-1) * 0 + idx) % (L // 2)  # data-dependent: unproven
        first = pos[:, :1] - self.prepend_gap
        seq = (torch.diff(pos, prepend=first, dim=-1) != 1).cumsum(-1)
        rows, cols = batch[:, None, None, None], idx[None, None, :, None]
        same = seq[rows, cols] == seq[rows, idx[None, None, None, :]]
        mask = same & (idx[None, None, None, :] <= idx[None, None, :, None])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.expand(B, 1, L, L))


def test_single_sequence_packed_term_is_dropped():
    expected, got, rec = run_compiled(PackedSequenceCausal(), *attention_inputs())
    (op,) = _op_nodes(rec)
    assert _op_mask_and_causal(op) == (None, True)
    assert rec.reports[0].mask_kind == "causal"
    torch.testing.assert_close(got, expected, **EXACT)


@pytest.mark.parametrize(
    "module", [PackedSequenceCausal("two"), PackedSequenceCausal(prepend_gap=2)],
    ids=["two packed sequences", "prepend gap 2"],
)
def test_unproven_packed_term_is_kept(module):
    """Positions from a tensor (two sequences), or a prepend the proof does not cover: the
    packed term stays a ``[.., L, L]`` mask next to ``is_causal``, and the output is exact."""
    expected, got, rec = run_compiled(module, *attention_inputs())
    (op,) = _op_nodes(rec)
    mask, is_causal = _op_mask_and_causal(op)
    assert is_causal is True and tuple(mask.meta["example_value"].shape)[-2:] == (L, L)
    assert rec.reports[0].mask_kind == "causal+packed"
    torch.testing.assert_close(got, expected, **EXACT)


def _is_square_bool_mask(node) -> bool:
    """Whether ``node`` computes a bool ``[..., 24, 24]`` tensor (the tiny Llama's full mask)."""
    val = tensor_value(node)
    return val is not None and val.dtype == torch.bool and tuple(val.shape[-2:]) == (24, 24)


class TransformersCausalMask(nn.Module):
    """SDPA with a causal mask built by transformers' own ``sdpa_mask`` (no padding)."""

    def __init__(self, q_offset: int = 0, kv_offset: int = 0):
        super().__init__()
        self.q_offset, self.kv_offset = q_offset, kv_offset

    def forward(self, q, k, v, keep, bias):
        from transformers.masking_utils import sdpa_mask

        mask = sdpa_mask(
            batch_size=q.shape[0], q_length=q.shape[-2], kv_length=k.shape[-2], q_offset=self.q_offset,
            kv_offset=self.kv_offset, allow_is_causal_skip=False,
        )
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class HandBuiltCausal(nn.Module):
    """SDPA with ``kv_pos <= q_pos`` AND a padding term, positions from ``positions``:
    ``arange`` (+ shifts), ``named`` (the shifts as ``arange``'s start, ``end`` named),
    ``gathered`` (transformers' ``position_ids[batch_idx, idx]`` with
    ``arange`` position ids) or ``user`` (a run-time tensor: nothing says it is 0, 1, 2, ...)."""

    def __init__(self, positions: str = "arange", q_shift: int = 0, kv_shift: int = 0):
        super().__init__()
        self.positions, self.q_shift, self.kv_shift = positions, q_shift, kv_shift

    def forward(self, q, k, v, keep, bias):
        q_pos, kv_pos = torch.arange(L) + self.q_shift, torch.arange(L) + self.kv_shift
        if self.positions == "named":
            q_pos = torch.arange(self.q_shift, end=L + self.q_shift)
            kv_pos = torch.arange(start=self.kv_shift, end=L + self.kv_shift)
        if self.positions == "user":
            q_pos = kv_pos = bias[0, 0, 0].argsort()
        if self.positions == "gathered":  # the shifts move the position ids, not the indices
            table, batch, idx = torch.arange(L).unsqueeze(0).repeat(B, 1), torch.arange(B), torch.arange(L)
            q_pos = (table + self.q_shift)[batch[:, None, None, None], idx[None, None, :, None]]
            kv_pos = (table + self.kv_shift)[batch[:, None, None, None], idx[None, None, None, :]]
        else:
            q_pos, kv_pos = q_pos[None, None, :, None], kv_pos[None, None, None, :]
        mask = (kv_pos <= q_pos) & keep[:, :, :1]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.expand(B, 1, L, L))


def test_causal_only_mask_becomes_is_causal_without_mask():
    expected, got, rec = run_compiled(TransformersCausalMask(), *attention_inputs())
    (op,) = _op_nodes(rec)
    assert _op_mask_and_causal(op) == (None, True)
    (report,) = rec.reports
    assert (report.mask_kind, report.causal_fast_path, report.causal_from_mask) == ("causal", True, True)
    assert rec.count(lambda n: n.target in (operator.le, operator.and_, "expand")) == 0  # the mask is erased
    torch.testing.assert_close(got, expected, **EXACT)


@pytest.mark.parametrize(
    "module",
    [HandBuiltCausal(q_shift=5, kv_shift=5), HandBuiltCausal("named", q_shift=5, kv_shift=5),
     HandBuiltCausal("gathered")],
    ids=["offsets 5, 5", "named arange arguments 5, 5", "gathered"],
)
def test_proven_causal_comparison_leaves_the_padding_term(module):
    expected, got, rec = run_compiled(module, *attention_inputs())
    mask, is_causal = _op_mask_and_causal(_op_nodes(rec)[0])
    assert is_causal is True and tuple(mask.meta["example_value"].shape) == (B, 1, 1, L)
    torch.testing.assert_close(got, expected, **EXACT)


@pytest.mark.parametrize(
    "module",
    [
        HandBuiltCausal("user"),
        HandBuiltCausal(q_shift=1),
        HandBuiltCausal("named", q_shift=2),
        HandBuiltCausal("gathered", kv_shift=1),
        TransformersCausalMask(q_offset=1),
    ],
    ids=["position tensor", "arange+1 vs arange", "arange(2, end=) vs arange(start=0, end=)",
         "gathered arange+1", "sdpa_mask q_offset=1"],
)
def test_unproven_causal_comparison_keeps_the_full_mask(module):
    expected, got, rec = run_compiled(module, *attention_inputs())
    (op,) = _op_nodes(rec)
    mask, is_causal = _op_mask_and_causal(op)
    assert is_causal is False and tuple(mask.meta["example_value"].shape)[-2:] == (L, L)
    (report,) = rec.reports
    assert not report.causal_fast_path and not report.causal_from_mask and "causal" not in report.mask_kind
    torch.testing.assert_close(got, expected, **EXACT)


class BuiltMask(nn.Module):
    """SDPA with the mask ``build(L)`` returns (an adversarial index computation)."""

    def __init__(self, build):
        super().__init__()
        self.build = build

    def forward(self, q, k, v, keep, bias):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.build(q.shape[-2]))


def _ones_changed_in_place(n):
    i, keep = torch.arange(n), torch.ones(n, n, dtype=torch.bool)
    keep[:, 0] = False  # no longer all ones
    return (i[None, :] <= i[:, None]) & keep


def _ones_and_in_place_by_dunder(n):
    i, keep = torch.arange(n), torch.ones(n, n, dtype=torch.bool)
    keep.__iand__(i[None, :] != n - 1)  # a call_method `__iand__` node: the last key hidden
    return (i[None, :] <= i[:, None]) & keep


def _ones_and_in_place_by_out(n):
    i, keep = torch.arange(n), torch.ones(n, n, dtype=torch.bool)
    torch.logical_and(keep, i[None, :] != n - 1, out=keep)
    return (i[None, :] <= i[:, None]) & keep


def _arange_changed_through_itself(n):
    idx = torch.arange(n)
    kv = idx[None, :]
    idx += 1  # kv is a view: its values move too
    return kv <= torch.arange(n)[:, None]


def _shift_changed_in_place(n):
    shift = torch.tensor(0)
    shift.add_(3)
    i = torch.arange(n)
    return i[None, :] <= (i + shift)[:, None]


def _packed_term_not_constant(n):
    idx, pos = torch.arange(n), torch.arange(n).unsqueeze(0)
    seq = (torch.diff(pos, prepend=pos[:, :1].sub(1, alpha=2), dim=-1) != 1).cumsum(0)
    rows = torch.arange(1)[:, None, None, None]
    same = seq[rows, idx[None, None, :, None]] == seq[rows, idx[None, None, None, :]]
    return same & (idx[None, None, None, :] <= idx[None, None, :, None])


@pytest.mark.parametrize("build", [
    _ones_changed_in_place,
    _ones_and_in_place_by_dunder,
    _ones_and_in_place_by_out,
    _arange_changed_through_itself,
    _shift_changed_in_place,
    lambda n: (torch.arange(n) + 5)[None, :] <= (torch.arange(n) + torch.full((), 5, dtype=torch.bool))[:, None],
    lambda n: (torch.arange(n) - 1)[None, :] <= (torch.arange(n) + torch.full((), -1, dtype=torch.uint8))[:, None],
    _packed_term_not_constant,
    lambda n: torch.arange(n // 2).view(torch.int32)[None, :] <= torch.arange(n // 2).view(torch.int32)[:, None],
    lambda n: ((torch.arange(n, dtype=torch.int32) + (2**31 - 4))[None, :]
               <= (torch.arange(n, dtype=torch.int32) + (2**31 - 4))[:, None]),
    lambda n: (torch.arange(2**31 - 5, 2**31 - 5 + n).to(torch.int32)[None, :]
               <= torch.arange(2**31 - 5, 2**31 - 5 + n).to(torch.int32)[:, None]),
], ids=["ones changed in place", "ones &= by __iand__", "ones changed by out=", "arange changed through a view", "0-d shift changed in place",
        "bool 0-d shift", "uint8 0-d shift", "packed term with alpha and cumsum over dim 0",
        "arange viewed as int32", "int32 arange that wraps", "int64 arange cast to int32 wraps"])
def test_masks_that_only_look_causal_are_kept(build):
    """Index computations whose recorded values are not what the mask uses (in-place
    changes, a 0-d constant's own dtype, integer wrap-around, a view to another dtype, a
    packed-sequence term that is not constant) must not be proven causal or always true
    (each of these was, before: the compiled output differed by 2.4-3.9)."""
    expected, got, rec = run_compiled(BuiltMask(build), *attention_inputs())
    (report,) = rec.reports
    if build in (_packed_term_not_constant, _ones_changed_in_place, _ones_and_in_place_by_dunder,
                 _ones_and_in_place_by_out):
        # their causal comparison is real; the term beside it is kept, not dropped as always true
        assert report.mask_kind in ("causal+packed", "causal+bool"), report.mask_kind
    else:
        assert not report.causal_from_mask and "causal" not in report.mask_kind, report.mask_kind
    torch.testing.assert_close(got, expected, **EXACT)


def _causal(n):
    i = torch.arange(n)
    return i[None, :] <= i[:, None]


@pytest.mark.parametrize("build, fast", [
    (lambda n: torch.where(_causal(n), 0.0, -1e4), True),
    (lambda n: torch.where(_causal(n), 0.0, float("-inf")) + (~_causal(n)).float() * 2e4, True),
    (lambda n: torch.where(_causal(n), 0.0, -1e4) + (~_causal(n)).float() * 2e4, False),
], ids=["finite fill alone", "-inf fill plus a bias", "finite fill undone by a bias"])
def test_causal_fast_path_claims_only_what_the_mask_guarantees(build, fast):
    """``causal_fast_path`` (every key after its query masked) holds for a causal ``where``
    with a -inf fill whatever is added, or a finite fill that is the whole mask; a finite
    fill plus another additive part may be undone (here +2e4 on a -1e4 fill)."""
    expected, got, rec = run_compiled(BuiltMask(build), *attention_inputs())
    (report,) = rec.reports
    assert report.causal_fast_path is fast
    torch.testing.assert_close(got, expected, **EXACT)


class ScaledAfterMasking(nn.Module):
    """``softmax(mask(q·kᵀ) · c)·v`` with the mask a ``where``/``masked_fill`` and a scale after it."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.temperature = nn.Parameter(torch.full((1, H, 1, 1), 0.5), requires_grad=False)

    def forward(self, q, k, v, keep, bias):
        s, keep = q @ k.transpose(-1, -2), keep[:, :, :1]
        if self.form == "zero":
            return torch.softmax(torch.where(keep, s, torch.finfo(s.dtype).min) * 0.0, -1) @ v
        if self.form == "negative":
            return torch.softmax(torch.where(keep, s, -1e9) * -1.0, -1) @ v
        if self.form == "small":
            return torch.softmax(s.masked_fill(~keep, -1e4) * 1e-3, -1) @ v
        if self.form == "run-time":  # per-head values: their sign is not known when compiling
            return torch.softmax(s.masked_fill(~keep, -1e9) * self.temperature, -1) @ v
        return torch.softmax(s.masked_fill(~keep, -1e9) / 8, -1) @ v  # -1.25e8 still masks


@pytest.mark.parametrize("form, status", [
    ("zero", FALLBACK), ("negative", FALLBACK), ("small", FALLBACK), ("run-time", FALLBACK),
    ("divided", REWRITTEN)])
def test_scale_after_masking_must_keep_the_mask(form, status):
    """A factor after a masking ``where``/``masked_fill`` that is zero, negative, or lifts its
    fill above -1e4 no longer masks those keys, which the op would mask fully: the site
    falls back (it was served, and differed by up to 2.75), as with a run-time factor whose
    sign is unknown. A constant factor that keeps the fill below -1e4 is served."""
    expected, got, rec = run_compiled(ScaledAfterMasking(form), *attention_inputs())
    (report,) = rec.reports
    assert report.status == status, report.reason
    if status == FALLBACK:
        assert "after a masking" in report.reason
    torch.testing.assert_close(got, expected, **EXACT)


def test_additive_causal_mask_is_not_split():
    """An eager (additive ``where(mask, 0, finfo.min)``) causal mask keeps its exact values."""
    from qattn_compile.zoo import ZOO

    rec = Recorder()
    expected, got = _run_bundle(ZOO["llama"].build("eager"), rec)
    assert all(r.causal_fast_path and not r.causal_from_mask for r in rec.reports)
    assert all(_op_mask_and_causal(op)[1] is False for op in _op_nodes(rec))
    torch.testing.assert_close(got, expected, **EXACT)


# ----------------------------------------------------------------------------------------
# erasing what the rewrite leaves unused
# ----------------------------------------------------------------------------------------


def test_erase_dead_keeps_in_place_ops_and_follows_inputs():
    """Unused pure nodes go, and with them inputs nothing else reads; an unused in-place op
    stays (a later node reads the tensor it changed) unless it belongs to the replaced
    chain."""
    from torch import fx

    from qattn_compile.rewrite import _erase_dead

    graph = fx.Graph()
    x, m = graph.placeholder("x"), graph.placeholder("m")
    ones = graph.call_function(torch.ones_like, (x,))
    fill = graph.call_method("masked_fill_", (ones, m, 0.0))  # unused result, mutates `ones`
    doubled = graph.call_function(operator.mul, (ones, 2))
    as_float = graph.call_method("float", (x,))
    dead = graph.call_function(torch.abs, (as_float,))  # only reader of `as_float`
    graph.output(doubled)
    _erase_dead(graph, [fill, dead], matched=[])
    left = {n.name for n in graph.nodes}
    assert fill.name in left and ones.name in left
    assert dead.name not in left and as_float.name not in left
    _erase_dead(graph, [fill], matched=[fill])
    assert fill.name not in {n.name for n in graph.nodes}


def test_erase_dead_keeps_an_unused_call_writing_to_out():
    """``torch.logical_and(a, b, out=keep)`` changes ``keep``: unused, it still stays."""
    from qattn_compile.rewrite import _erase_dead

    graph = fx.Graph()
    x, m = graph.placeholder("x"), graph.placeholder("m")
    keep = graph.call_function(torch.ones_like, (x,))
    write = graph.call_function(torch.logical_and, (keep, m), {"out": keep})
    graph.output(graph.call_function(operator.and_, (keep, m)))
    _erase_dead(graph, [write], matched=[])
    assert write.name in {n.name for n in graph.nodes}


def _node(graph: fx.Graph, op: str, target, *args, **kwargs) -> fx.Node:
    return graph.create_node(op, target, args, kwargs)


@pytest.mark.parametrize("op, target, out, changes", [
    ("call_method", "__iand__", False, True),
    ("call_method", "__ior__", False, True),
    ("call_method", "__iadd__", False, True),
    ("call_method", "__setitem__", False, True),
    ("call_method", "masked_fill_", False, True),
    ("call_function", operator.iand, False, True),
    ("call_function", operator.setitem, False, True),
    ("call_function", torch.Tensor.add_, False, True),
    ("call_function", torch.relu_, False, True),
    ("call_function", torch.logical_and, True, True),
    ("call_method", "__and__", False, False),
    ("call_method", "masked_fill", False, False),
    ("call_function", operator.and_, False, False),
    ("call_function", torch.logical_and, False, False),
    ("call_function", torch.add, False, False),
])
def test_mutates_names_in_place_ops_in_every_spelling(op, target, out, changes):
    """In-place dunders (``x &= m`` recorded as ``__iand__``), their ``operator`` functions,
    ``*_`` methods and functions, and ``out=`` calls change a tensor; ``operator.and_`` and the
    out-of-place ops do not."""
    graph = fx.Graph()
    x, m = graph.placeholder("x"), graph.placeholder("m")
    node = _node(graph, op, target, x, m, **({"out": x} if out else {}))
    assert mutates(node) is changes
