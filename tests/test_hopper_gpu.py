"""GPU tests of tier 2, the Hopper Gluon kernel (run on the H200: ``pytest -m gpu``).

Gluon has no interpreter, so tier 2 is tested here only: against the fp8 preset's
simulated-quantization reference and fp64 exact attention on the same inputs (DESIGN §7: the
kernel's error within a small factor of the reference's), against tier 1 on the same
prepared operands, its log-sum-exp against fp64, and its dispatch (eager and compiled).
"""

import math

import pytest
import torch

from qattn_compile.reference import exact_attention, reference_attention

pytestmark = pytest.mark.gpu

CASES = [  # (B, Hq, Hkv, Lq, Lkv, D, causal)
    (1, 2, 2, 1024, 1024, 128, False),
    (2, 4, 2, 777, 777, 128, True),
    (2, 4, 1, 100, 1999, 64, False),
    (1, 3, 3, 2177, 300, 64, True),
    (1, 2, 2, 129, 129, 64, True),
    (1, 8, 2, 4096, 4096, 128, True),
]


def _tier2_ready():
    from qattn_compile.kernels.tiers import tier2_refusal

    reason = tier2_refusal("fp8", None, (1, 1, 4096, 128), (1, 1, 4096, 128),
                           (1, 1, 4096, 128), torch.bfloat16, torch.device("cuda"),
                           masked=False, scale=None, causal=False)
    if reason is not None:
        pytest.skip(f"tier 2 unavailable here: {reason}")


def _inputs(bsz, hq, hkv, lq, lkv, d, dtype=torch.bfloat16):
    q = torch.randn(bsz, hq, lq, d, device="cuda", dtype=dtype)
    k = torch.randn(bsz, hkv, lkv, d, device="cuda", dtype=dtype)
    k[..., 5] += 6.0  # a K channel outlier
    v = torch.randn(bsz, hkv, lkv, d, device="cuda", dtype=dtype)
    return q, k, v


def _rel_l1(out, ref):
    return ((out.double() - ref.double()).abs().sum() / ref.double().abs().sum()).item()


PRESET_OPTIONS = [
    ("fp8", {"granularity": "block"}),
    ("fp8", {"granularity": "tensor"}),
    ("sage2_8b", {}),
    ("sage2_8b", {"smooth_v": True, "qk_granularity": "token"}),
    ("sage2_8b", {"smooth_q": False, "smooth_k": False, "qk_granularity": "block"}),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("preset,opts", PRESET_OPTIONS, ids=lambda x: str(x))
def test_tier2_matches_the_reference(case, preset, opts):
    _tier2_ready()
    from qattn_compile.kernels.launch import prepare_attention

    bsz, hq, hkv, lq, lkv, d, causal = case
    q, k, v = _inputs(bsz, hq, hkv, lq, lkv, d)
    exact = exact_attention(q.double(), k.double(), v.double(), is_causal=causal)
    ref = reference_attention(q, k, v, is_causal=causal, preset=preset, options=opts)
    call2 = prepare_attention(q, k, v, None, causal, None, preset, opts, tier="gluon")
    out2 = call2.run()
    out1 = prepare_attention(q, k, v, None, causal, None, preset, opts, tier="triton").run()
    assert call2.tier == "gluon" and out2.shape == (bsz, hq, lq, d) and out2.dtype == q.dtype
    assert not out2.isnan().any()
    err2, err_ref, err1 = _rel_l1(out2, exact), _rel_l1(ref, exact), _rel_l1(out1, exact)
    print(f"{case} {preset} {opts}: tier2 {err2:.4f} tier1 {err1:.4f} reference {err_ref:.4f}")
    assert 0 < err2 <= 1.05 * err_ref + 1e-3
    # the same operands and scheme; the tiers' key tiles differ (P is rounded against the
    # running max of 256 keys instead of 128), so they differ well within the scheme's error
    assert _rel_l1(out2, out1) < 0.25 * err_ref


@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: "x".join(map(str, c)))
def test_tier2_log_sum_exp(case):
    """The log-sum-exp of the scores the kernel computes (FP8 Q̂·K̂ᵀ times the scales), in
    float64 from the same prepared operands; rows of no visible key are not in these cases."""
    _tier2_ready()
    from qattn_compile.kernels.launch import prepare_attention

    bsz, hq, hkv, lq, lkv, d, causal = case
    q, k, v = _inputs(bsz, hq, hkv, lq, lkv, d)
    call = prepare_attention(q, k, v, None, causal, None, "fp8", None, tier="gluon")
    lse = torch.full((bsz, hq, lq), float("nan"), device="cuda")
    call.run(lse=lse)
    ops, g = call.ops, hq // hkv
    qs = ops.q_scale.double().repeat_interleave(ops.q_group, -1)[..., :lq]
    ks = ops.k_scale.double().repeat_interleave(ops.k_group, -1)[..., :lkv]
    raw = ops.q.double() @ ops.k.double().repeat_interleave(g, 1).transpose(-1, -2)
    s_log2 = raw * qs[..., :, None] * ks.repeat_interleave(g, 1)[..., None, :]
    if causal:
        s_log2 = s_log2.masked_fill(torch.ones(lq, lkv, dtype=torch.bool, device="cuda").triu(1),
                                    float("-inf"))
    expected = torch.logsumexp(s_log2 * math.log(2.0), -1)
    err = (lse.double() - expected).abs().max().item()
    print(f"{case}: max |lse - expected| {err:.2e}")
    assert err < 1e-3


def test_tier2_writes_float16_and_strided_outputs():
    _tier2_ready()
    from qattn_compile.kernels.launch import prepare_attention

    q, k, v = _inputs(2, 4, 4, 300, 300, 64, dtype=torch.float16)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # heads inside tokens, as transformers
    call = prepare_attention(q, k, v, None, True, None, "fp8", None, tier="gluon")
    out = call.run()
    assert out.stride(1) < out.stride(2)  # stored [B, L, H, D] like q
    ref = prepare_attention(q, k, v, None, True, None, "fp8", None, tier="triton").run()
    assert _rel_l1(out, ref) < 0.01


def test_tier2_refuses_what_it_cannot_serve():
    _tier2_ready()
    from qattn_compile.kernels.launch import prepare_attention

    q, k, v = _inputs(1, 2, 2, 256, 256, 96)
    with pytest.raises(ValueError, match="head dims 96"):
        prepare_attention(q, k, v, None, False, None, "fp8", None, tier="gluon")
    q, k, v = _inputs(1, 2, 2, 256, 256, 64)
    mask = torch.ones(256, 256, dtype=torch.bool, device="cuda")
    with pytest.raises(ValueError, match="tensor mask"):
        prepare_attention(q, k, v, mask, False, None, "fp8", None, tier="gluon")
    with pytest.raises(ValueError, match="no tier-2 kernel"):
        prepare_attention(q, k, v, None, False, None, "int_flash", None, tier="gluon")
    with pytest.raises(ValueError, match="pv: fp16"):
        prepare_attention(q, k, v, None, False, None, "sage2_8b", {"pv": "fp16"}, tier="gluon")
    call = prepare_attention(q, k, v, None, False, None, "sage2_8b", None, tier="gluon")
    with pytest.raises(ValueError, match="log-sum-exp"):
        call.run(lse=torch.empty(1, 2, 256, device="cuda"))


@pytest.mark.parametrize("index", range(2))
def test_the_tier_table_decides_eager_calls(index):
    """Each row of the tier table (imported in the test: collection must not load the
    kernels on CPU machines, where they run under the interpreter)."""
    _tier2_ready()
    from qattn_compile.kernels.launch import prepare_attention
    from qattn_compile.kernels.tiers import TIER2_TABLE

    assert len(TIER2_TABLE) == 2
    row = TIER2_TABLE[index]
    n, causal = row.min_length, row.causal
    long = _inputs(1, 2, 2, n, n, row.head_dim)
    short = _inputs(1, 2, 2, n // 2, n // 2, row.head_dim)
    assert prepare_attention(*long, None, causal, None, row.preset).tier == "gluon"
    assert prepare_attention(*short, None, causal, None, row.preset).tier == "triton"


def test_compiled_long_fp8_site_gets_the_opaque_op_and_runs_tier2():
    _tier2_ready()
    import torch.nn.functional as F

    import qattn_compile
    from qattn_compile import _compat

    class Attn(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v)

    q, k, v = _inputs(1, 4, 4, 4096, 4096, 128)
    _compat.reset_dynamo()
    be = qattn_compile.backend(policy={"qattn": 1, "default": "fp8"})
    with torch.no_grad():
        out = torch.compile(Attn(), backend=be, fullgraph=True)(q, k, v)
    assert [(r.status, r.execution) for r in be.site_reports] == [("rewritten", "gluon")]
    ref = reference_attention(q, k, v, preset="fp8")
    exact = exact_attention(q.double(), k.double(), v.double())
    assert _rel_l1(out, exact) <= 1.05 * _rel_l1(ref, exact) + 1e-3
