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
