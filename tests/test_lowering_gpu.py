"""On the GPU: compiled sites become Triton code that Inductor inlines (no opaque op call)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qattn_compile
from qattn_compile import _compat
from qattn_compile.metrics import compare
from qattn_compile.reference import exact_attention

pytestmark = pytest.mark.gpu


class CausalAttention(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _inputs():
    shape_q, shape_kv = (2, 8, 777, 128), (2, 4, 777, 128)
    q = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("preset", ["int_flash", "sage2_8b"])
def test_attention_kernels_are_inlined_by_inductor(preset):
    _compat.reset_dynamo()
    q, k, v = _inputs()
    be = qattn_compile.backend({"qattn": 1, "default": preset})
    compiled = torch.compile(CausalAttention(), backend=be, fullgraph=True)
    out, codes = _compat.run_and_get_code(compiled, q, k, v)
    code = "\n".join(codes)
    assert [r.status for r in be.site_reports] == ["rewritten"]
    assert "def attention_kernel(" in code and "def _quantize_kernel(" in code
    assert "torch.ops.qattn" not in code, "the op must be inlined, not called"
    ref = exact_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert compare(out, ref)["cos"] > 0.998


def test_reduce_overhead_cuda_graphs_run_the_inlined_kernels():
    _compat.reset_dynamo()
    q, k, v = _inputs()
    be = qattn_compile.backend({"qattn": 1, "default": "int_flash"}, mode="reduce-overhead")
    compiled = torch.compile(CausalAttention(), backend=be, fullgraph=True)
    first = compiled(q, k, v).clone()
    for _ in range(3):  # warm-up, record, replay
        again = compiled(q, k, v)
    assert torch.equal(first, again)
    ref = exact_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert compare(again, ref)["cos"] > 0.998


class MaskedAttention(nn.Module):
    """SDPA with a bool ``keep`` mask; with ``causal_from_arange`` ANDed with ``kv <= q``
    built from ``arange`` (what transformers materializes), which the rewrite turns into
    ``is_causal`` and the remaining ``keep``."""

    def __init__(self, causal_from_arange: bool):
        super().__init__()
        self.causal_from_arange = causal_from_arange

    def mask(self, q, keep):
        if not self.causal_from_arange:
            return keep
        idx = torch.arange(q.shape[-2], device=q.device)
        return (idx[None, None, None, :] <= idx[None, None, :, None]) & keep

    def forward(self, q, k, v, keep):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask(q, keep), enable_gqa=True)


def _keep(kind: str, length: int) -> torch.Tensor:
    """A bool mask with no fully masked row: right padding ``[2, 1, 1, L]`` or random ``[2, 1, L, L]``."""
    if kind == "random [B,1,L,L]":
        keep = torch.rand(2, 1, length, length, device="cuda") > 0.3
        return keep | torch.eye(length, dtype=torch.bool, device="cuda")
    keep = torch.ones(2, 1, 1, length, dtype=torch.bool, device="cuda")
    keep[0, ..., length - 177:] = False
    return keep


@pytest.mark.parametrize(
    "kind, causal_from_arange",
    [("padding [B,1,1,L]", False), ("random [B,1,L,L]", False), ("padding [B,1,1,L]", True)],
    ids=["padding", "random", "arange causal + padding"],
)
def test_bool_mask_sites_are_inlined_by_inductor(kind, causal_from_arange):
    _compat.reset_dynamo()
    q, k, v = _inputs()
    keep = _keep(kind, q.shape[-2])
    module = MaskedAttention(causal_from_arange)
    be = qattn_compile.backend({"qattn": 1, "default": "int_flash"})
    compiled = torch.compile(module, backend=be, fullgraph=True)
    out, codes = _compat.run_and_get_code(compiled, q, k, v, keep)
    code = "\n".join(codes)
    assert [(r.status, r.causal_from_mask) for r in be.site_reports] == [("rewritten", causal_from_arange)]
    assert "def attention_kernel(" in code
    assert "torch.ops.qattn" not in code, "the op must be inlined, not called"
    ref = exact_attention(q.float(), k.float(), v.float(), attn_mask=module.mask(q, keep))
    assert compare(out, ref)["cos"] > 0.998
