"""On the GPU: compiled sites become Triton code that Inductor inlines (no opaque op call)."""

import json
import re

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


def test_cuda_sites_get_the_triton_op():
    """CUDA sites get the inlinable ``attention_triton`` (any mask: the bool-mask case is
    ``test_bool_mask_sites_are_inlined_by_inductor``); the CPU side is in test_backend.py."""
    from qattn_compile import ops

    assert ops.graph_op("triton") is torch.ops.qattn.attention_triton.default
    assert ops.graph_op("gluon") is torch.ops.qattn.attention.default
    assert ops.execution_path("cuda") == ("triton", None)


@pytest.mark.parametrize("preset", ["int_flash", "sage2_8b"])
def test_attention_kernels_are_inlined_by_inductor(preset):
    _compat.reset_dynamo()
    q, k, v = _inputs()
    be = qattn_compile.backend({"qattn": 1, "default": preset})
    compiled = torch.compile(CausalAttention(), backend=be, fullgraph=True)
    out, codes = _compat.run_and_get_code(compiled, q, k, v)
    code = "\n".join(codes)
    assert [r.status for r in be.site_reports] == ["rewritten"]
    assert "def attention_kernel(" in code
    assert "def _quantize_kernel(" in code  # the transposed 8-bit V
    assert "torch.ops.qattn" not in code, "the op must be inlined, not called"
    ref = exact_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert compare(out, ref)["cos"] > 0.998


class EinsumAttention(nn.Module):
    """Attention written with einsum on ``[B, L, H, D]`` tensors (the projections' layout)."""

    def forward(self, q, k, v):
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
        return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


def test_einsum_attention_in_another_layout_is_inlined():
    _compat.reset_dynamo()
    q, k, v = (t.transpose(1, 2) for t in _inputs())
    k, v = (t.repeat_interleave(2, dim=2) for t in (k, v))
    be = qattn_compile.backend({"qattn": 1, "default": "int_flash"})
    compiled = torch.compile(EinsumAttention(), backend=be, fullgraph=True)
    out, codes = _compat.run_and_get_code(compiled, q, k, v)
    code = "\n".join(codes)
    assert [r.status for r in be.site_reports] == ["rewritten"], be.site_reports
    assert "def attention_kernel(" in code and "torch.ops.qattn" not in code
    ref = exact_attention(*(t.transpose(1, 2).float() for t in (q, k, v))).transpose(1, 2)
    assert out.shape == q.shape and compare(out, ref)["cos"] > 0.998


def test_inlined_int8_values_keep_the_tma_layout():
    """A length that needs no padding (1024 tokens): the torch-form INT8 V reaches the
    inlined attention kernel as the quantizer kernel lays it out (tokens contiguous), so
    the kernel takes the TMA path its config asks for. Before, the transposed view's
    strides came through and int_flash silently ran its pointer-load path (no slower at
    this size on the H100: 107 µs either way in the 1B-shaped block)."""
    _compat.reset_dynamo()
    q = torch.randn(2, 8, 1024, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 4, 1024, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    be = qattn_compile.backend({"qattn": 1, "default": "int_flash"})
    compiled = torch.compile(CausalAttention(), backend=be, fullgraph=True)
    out, codes = _compat.run_and_get_code(compiled, q, k, v)
    code = "\n".join(codes)
    assert "def attention_kernel(" in code
    # the table's int_flash config at D=64 on sm_90 asks for TMA (128 × 64 tiles)
    assert "'USE_TMA': True" in code, "the inlined kernel got K/V that TMA cannot address"
    ref = exact_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert compare(out, ref)["cos"] > 0.998


class FullAttention(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


def test_compiled_call_takes_the_uncapped_tile():
    """At 4K keys, D=128, no mask, an eager fmha_int8 call runs the table's register-capped
    tile (two stages, ``maxnreg=168``); compiled, Inductor's code could not pass the cap, so
    the same call runs the uncapped three-stage tile, with no cap in the code, and agrees
    with the eager output."""
    from qattn_compile.kernels import prepare_attention

    _compat.reset_dynamo()
    q, k, v = (torch.randn(1, 4, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    assert prepare_attention(q, k, v, preset="fmha_int8").cfg.maxnreg == 168
    be = qattn_compile.backend({"qattn": 1, "default": "fmha_int8"})
    compiled = torch.compile(FullAttention(), backend=be, fullgraph=True)
    out, codes = _compat.run_and_get_code(compiled, q, k, v)
    code = "\n".join(codes)
    assert "def attention_kernel(" in code and "maxnreg" not in code
    assert re.search(r"'num_stages': 3", code), "the compiled call lost the uncapped tile"
    eager = qattn_compile.attention(q, k, v, preset="fmha_int8")
    assert compare(out, eager)["cos"] > 0.9999


class RotaryAttention(nn.Module):
    """RoPE on Q and K (transformers' ``rotate_half`` form), then causal GQA SDPA."""

    def forward(self, q, k, v, cos, sin):
        def rotate_half(x):
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat((-x2, x1), dim=-1)

        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


@pytest.mark.parametrize("preset,options", [
    ("int_flash", {}), ("int_flash", {"k_granularity": "token"}),
    ("int_flash", {"v_granularity": "tensor"}), ("sage2_8b", {}), ("turbo", {}),
    ("fp8", {}), ("fp8", {"granularity": "q_token"}),
])
def test_quantizers_fuse_with_rope(preset, options):
    """Under torch.compile the Q/K quantizers (smoothing means, INT8 quantization, FP8 per
    token) are Inductor ops: RoPE's rotation and the quantizer's rounding land in the same
    generated kernel (not for sage2_8b, see below)."""
    _compat.reset_dynamo()
    q, k, v = _inputs()
    angles = torch.rand(777, 128, device="cuda") * 6.28
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    be = qattn_compile.backend({"qattn": 1, "default": preset, "default_options": options})
    compiled = torch.compile(RotaryAttention(), backend=be, fullgraph=True)
    out, codes = _compat.run_and_get_code(compiled, q, k, v, cos, sin)
    code = "\n".join(codes)
    names = re.findall(r"def (triton_\w+)\(", code)
    user = re.findall(r"def (_\w+_kernel|attention_kernel)\(", code)
    print(f"{preset}: Inductor kernels {names}; inlined qattn kernels {user}")
    # RoPE (rotate_half's cat) and the quantizer's rounding in one kernel. Not for sage2_8b:
    # its ΔS GEMM reads the rotated K, and its Q is one quantizer pass of ours (block means
    # and group scales together) over the rotated Q.
    # fp8 (block and q_token): Q's amax and rounding per token with RoPE; K per block of
    # keys and V are one launch of ours (in-tile amax) over the rotated K and V.
    sage, fp8 = preset == "sage2_8b", preset == "fp8"
    rounding = "amax" if fp8 else "round"
    fused = [n for n in names if rounding in n and "cat" in n]
    assert sage or fused, names
    # The transposed 8-bit V's quantizer (after its statistics kernel where one scale spans
    # more tokens than a tile: int_flash's V per tensor, sage2_8b's per channel; int_flash's
    # default V per 128 tokens needs none); sage2_8b also its smoothed Q (one pass) and ΔS.
    assert user.count("_quantize_kernel") == (2 if sage else 0 if fp8 else 1), user
    assert user.count("_quantize_kv_kernel") == fp8, user
    v_stats = sage or options.get("v_granularity") == "tensor"
    assert ("_token_stats_kernel" in user) == v_stats, user
    assert user.count("_stats_finish_kernel") == user.count("_token_stats_kernel"), user
    assert ("_delta_s_kernel" in user) == sage, user
    rotated = [t.float() * cos + torch.cat((-t.float()[..., 64:], t.float()[..., :64]), -1) * sin
               for t in (q, k)]
    ref = exact_attention(rotated[0], rotated[1], v.float(), is_causal=True)
    assert compare(out, ref)["cos"] > 0.998


class ProjectedAttention(nn.Module):
    """Q from a projection viewed per head (``[B, L, H, D]`` memory, as transformers passes
    it), causal GQA SDPA, the output transposed back and projected."""

    def __init__(self, heads=8, dim=64):
        super().__init__()
        self.heads, self.dim = heads, dim
        self.q_proj = nn.Linear(heads * dim, heads * dim, bias=False)
        self.o_proj = nn.Linear(heads * dim, heads * dim, bias=False)

    def forward(self, x, k, v):
        bsz, length, _ = x.shape
        q = self.q_proj(x).view(bsz, length, self.heads, self.dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, length, -1))


@pytest.mark.parametrize("preset,options", [
    ("int_flash", {}), ("sage2_8b", {}), ("fp8", {}), ("fp8", {"granularity": "tensor"}),
    ("fp8", {"granularity": "q_token"}),
])
def test_attention_output_feeds_the_projection_without_a_copy(preset, options):
    """The generated code launches nothing between the attention kernel and the output
    projection's GEMM (the output is stored ``[B, L, H, D]``, so the transpose is a view),
    fills no one-element stand-ins for absent kernel operands, does not copy the 8-bit Q
    (one tensor passed as several kernel arguments is copied per argument), and copies no
    statistics out of a shared buffer. fp8's per-token Q scales are laid out as Q's rows
    (``[B, L, H]`` memory) and reach the kernel without a copy."""
    _compat.reset_dynamo()
    model = ProjectedAttention().to("cuda", torch.bfloat16)
    x = torch.randn(2, 300, 512, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 4, 300, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    be = qattn_compile.backend({"qattn": 1, "default": preset, "default_options": options})
    with torch.no_grad():
        out, codes = _compat.run_and_get_code(torch.compile(model, backend=be, fullgraph=True), x, k, v)
        want = model(x, k, v)
    code = "\n".join(codes)
    after = code[re.search(r"attention_kernel_\d+\.run\(", code).end():]
    next_launch = after.find(".run(")
    assert next_launch == -1 or after.index("extern_kernels.mm(") < next_launch, \
        "a kernel runs between the attention kernel and o_proj"
    assert not re.search(r"\.run\(buf\d+, 1, stream=", code), "a one-element fill kernel"
    eight_bit_q = re.findall(r"empty_strided_cuda\(\(2, 8, 300, 64\), [^)]*\), torch\.(?:int8|float8)", code)
    assert len(eight_bit_q) == 1, f"the 8-bit Q is copied: {eight_bit_q}"
    assert not re.findall(r"def triton_\w*fused_select_\d+\(", code)
    q_scales = re.findall(r"empty_strided_cuda\(\(2, 8, 300\), \(\d+, \d+, \d+\), torch\.float32", code)
    if preset == "fp8" and options.get("granularity") != "tensor":  # Q per token
        assert q_scales == ["empty_strided_cuda((2, 8, 300), (2400, 1, 8), torch.float32"], q_scales
    assert compare(out, want)["cos"] > 0.995


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


def test_autotune_while_compiling_then_a_second_compile_reads_the_cache(tmp_path, monkeypatch):
    """``autotune: true`` times the tile candidates while Inductor traces the op (fake
    tensors outside, real random inputs inside the tuner) and bakes the winner into the
    inlined kernel; a second compile with Inductor's caches off reads the tuner's file and
    times nothing."""
    from qattn_compile.kernels import autotune

    monkeypatch.setenv(autotune.CACHE_DIR_ENV, str(tmp_path))
    autotune.clear_memory()
    autotune.stats.clear()
    q, k, v = _inputs()
    ref = exact_attention(q.float(), k.float(), v.float(), is_causal=True)
    for attempt in range(2):
        _compat.reset_dynamo()
        autotune.clear_memory()  # as in a new process: only the file remains
        be = qattn_compile.backend({"qattn": 1, "default": "sage2_8b"}, autotune=True)
        compiled = torch.compile(CausalAttention(), backend=be, fullgraph=True)
        with torch._inductor.config.patch(force_disable_caches=True):
            out, codes = _compat.run_and_get_code(compiled, q, k, v)
        code = "\n".join(codes)
        assert "def attention_kernel(" in code and "torch.ops.qattn" not in code
        assert compare(out, ref)["cos"] > 0.998
        # tracing visits the op body more than once: the first visit tunes, later ones hit
        assert autotune.stats["tuned"] == 1, (attempt, dict(autotune.stats))
        hits = autotune.stats["hits"]
        if attempt == 1:
            assert hits > first_hits, dict(autotune.stats)
        first_hits = hits
    entries = json.loads(autotune.cache_path().read_text())["entries"]
    assert len(entries) == 1
    (entry,) = entries.values()
    assert len(entry["timings_ms"]) >= 3 and min(entry["timings_ms"].values()) > 0


@pytest.mark.parametrize("autotune", [False, True])
def test_static_fmha_int8_is_served_by_the_kernels(tmp_path, monkeypatch, autotune):
    """``scales: static`` sites: the rewrite fills in each site's calibrated α before the
    kernels' support check (which refuses static options without them), so the compiled
    model runs the Triton kernels instead of falling back; with ``autotune`` the tuner times
    its candidates on real stand-in α, not the traced (fake) ones."""
    from qattn_compile.evaluation import Evaluator, calibrate_capture, load_inputs
    from qattn_compile.scales import save_scales
    from qattn_compile.kernels import autotune as tuner

    monkeypatch.setenv(tuner.CACHE_DIR_ENV, str(tmp_path))
    tuner.clear_memory()

    ev = Evaluator(load_inputs("tiny-bert"), device="cuda", fp_capture=True)
    path = save_scales(calibrate_capture(ev.fp, model="tiny-bert", inputs="test", samples=2),
                       tmp_path / "scales.pt")
    policy = {"qattn": 1, "default": "none",
              "rules": [{"match": "*attention.self", "preset": "fmha_int8",
                         "options": {"scales": "static", "calibration": str(path)}}]}
    _compat.reset_dynamo()
    be = qattn_compile.backend(policy=policy, autotune=autotune)
    bundle = ev.inputs.bundle
    got = bundle.run(torch.compile(bundle.model, backend=be))
    assert [(r.status, r.execution) for r in be.site_reports] == [("rewritten", "triton")] * 2
    assert tuner.cache_path().exists() == autotune
    assert compare(got, ev.reference[0])["cos"] > 0.9999
