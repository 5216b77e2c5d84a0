"""FlashQ KV cache on the GPU: the decode kernel against the reference, CUDA graphs,
generate() eager and compiled. Run on the H100 with ``pytest -m gpu tests/test_kvcache_gpu.py``.
"""

import pytest
import torch

import qattn_compile
from qattn_compile import _compat
from qattn_compile.dynamo_backend import qattn_backend
from qattn_compile.kvcache import FlashQCache, FlashQLayer, flashq
from qattn_compile.policy import KVCacheLayer

pytestmark = pytest.mark.gpu


def _layer(b, h, d, length, steps, int2_heads, capacity, dtype=torch.bfloat16):
    layer = FlashQLayer(capacity, int2_heads)
    k = torch.randn(b, h, length, d, device="cuda", dtype=dtype)
    k[..., 1] = k[..., 1] * 6 + 3  # an outlier channel
    layer.append(k, torch.randn_like(k))
    for _ in range(steps):
        layer.append(torch.randn(b, h, 1, d, device="cuda", dtype=dtype), torch.randn(b, h, 1, d, device="cuda", dtype=dtype))
    return layer


@pytest.mark.parametrize(
    "b, h, group, d, length, steps, int2_heads, lq, mask, dtype",
    [
        (2, 8, 4, 128, 1000, 70, 4, 1, None, torch.bfloat16),
        (1, 4, 2, 64, 300, 5, 0, 3, "bool", torch.float16),
        (1, 2, 1, 80, 129, 0, 2, 1, "additive", torch.bfloat16),
        (4, 8, 4, 128, 4133, 1, 0, 1, None, torch.bfloat16),
        (1, 8, 4, 128, 20000, 3, 8, 2, "bool", torch.bfloat16),
    ],
)
def test_decode_kernel_matches_reference(b, h, group, d, length, steps, int2_heads, lq, mask, dtype):
    from qattn_compile.kvcache.kernel import flashq_decode_triton

    capacity = length + steps + 64
    layer = _layer(b, h, d, length, steps, int2_heads, capacity, dtype)
    q = torch.randn(b, h * group, lq, d, device="cuda", dtype=dtype)
    attn_mask = None
    if mask == "bool":
        attn_mask = torch.rand(b, 1, lq, capacity, device="cuda") > 0.2
    elif mask == "additive":
        attn_mask = torch.randn(b, h * group, lq, capacity, device="cuda", dtype=dtype)
    ref = flashq.reference_decode(q, layer.tensors(), attn_mask)
    out = flashq_decode_triton(q, layer.tensors(), attn_mask)
    assert out.dtype == dtype and out.shape == q.shape
    err = ((out.float() - ref).abs().sum() / ref.abs().sum()).item()
    assert err < 5e-3, err


_VARIANTS = [
    {"blocks_per_iter": 1}, {"blocks_per_iter": 2}, {"blocks_per_iter": 4}, {"codes": "biased"},
    {"num_stages": 2}, {"num_stages": 3}, {"num_warps": 2}, {"num_warps": 4},
    {"blocks_per_iter": 4, "num_warps": 8}, {"blocks_per_iter": 2, "num_warps": 2}, {"splits": 1}, {"splits": 127}, {"splits": 128},
    {"prefetch": "none"}, {"prefetch": "l2"}, {"prefetch": "keys"}, {"prefetch": "l2", "blocks_per_iter": 2},
]


@pytest.mark.parametrize("config", _VARIANTS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("int2_heads", [0, 4, 8])
def test_decode_kernel_variants_match_reference(config, int2_heads):
    """Every variant of the benchmark's sweep at a realistic size: B=2, GQA 32/8, D=128, 16K
    prompt tokens + 70 decode steps (a ragged buffer), INT4 / 2-4 mix / INT2."""
    from qattn_compile.kvcache.kernel import DecodeConfig, flashq_decode_triton

    layer = _layer(2, 8, 128, 16384, 70, int2_heads, 16384 + 70 + 64)
    q = torch.randn(2, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    ref = flashq.reference_decode(q, layer.tensors())
    out = flashq_decode_triton(q, layer.tensors(), None, None, DecodeConfig(**config))
    err = ((out.float() - ref).abs().sum() / ref.abs().sum()).item()
    rounding = ((ref.bfloat16().float() - ref).abs().sum() / ref.abs().sum()).item()  # ~1.4e-3
    assert err < rounding + 1e-3, (err, rounding)


def test_decode_op_replays_in_a_cuda_graph_as_the_cache_grows():
    layer = _layer(2, 8, 128, 500, 0, 4, 700)
    q = torch.randn(2, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    args = (q, *layer.tensors(), None, None)
    torch.ops.qattn.flashq_decode(*args)  # compile the kernels before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.qattn.flashq_decode(*args)
    for _ in range(70):  # crosses a buffer flush: the graph reads the new length on the device
        k1 = torch.randn(2, 8, 1, 128, device="cuda", dtype=torch.bfloat16)
        layer.append(k1, torch.randn_like(k1))
    graph.replay()
    torch.testing.assert_close(out, torch.ops.qattn.flashq_decode(*args))
    ref = flashq.reference_decode(q, layer.tensors())
    assert ((out.float() - ref).abs().sum() / ref.abs().sum()).item() < 5e-3


def _tiny_llama(attn):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                      attn_implementation=attn)
    return LlamaForCausalLM(cfg).eval().to("cuda", torch.float32)


def _generate(model, ids, cache, tokens=16):
    return model.generate(ids, past_key_values=cache, max_new_tokens=tokens, min_new_tokens=tokens,
                          do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0,
                          disable_compile=True)[:, ids.shape[1]:]


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_generate_kernel_path_matches_dense_path_eager_and_compiled(compiler):
    model = _tiny_llama("sdpa")
    ids = torch.randint(0, 256, (2, 200), device="cuda")
    settings = KVCacheLayer(int2_heads=1)
    dense = _generate(model, ids, FlashQCache(model.config, 260, settings))
    model.set_attn_implementation("qattn_kv")
    kernel = _generate(model, ids, FlashQCache(model.config, 260, settings))
    assert (kernel == dense).float().mean() > 0.9  # fp16 dots in the kernel vs fp32 SDPA
    _compat.reset_dynamo()
    # `default: none` leaves the prefill's SDPA as it is, so only the compiler differs
    # the backend function, not the name "qattn": with PYTHONPATH=. no entry point registers it
    model.compile(backend=qattn_backend, options={"compiler": compiler, "policy": {"qattn": 1, "default": "none"}})
    try:
        compiled = _generate(model, ids, FlashQCache(model.config, 260, settings))
        graphs = [r.fqn for r in qattn_compile.last_backend().site_reports]
    finally:
        _compat.reset_dynamo()
    if compiler == "eager":
        assert torch.equal(compiled, kernel)
    else:  # Inductor fuses the rest of the model differently
        assert (compiled == kernel).float().mean() > 0.9
    assert graphs == ["model.layers.0.self_attn", "model.layers.1.self_attn"]  # prefill sites seen


def test_generate_with_transformers_compile_config_and_cuda_graphs():
    """transformers' own route: prefill eager, decode steps compiled (backend qattn, Inductor,
    CUDA graphs) over the static-address FlashQ cache."""
    from transformers import CompileConfig

    model = _tiny_llama("qattn_kv")
    ids = torch.randint(0, 256, (2, 200), device="cuda")
    settings = KVCacheLayer(int2_heads=1)
    eager = _generate(model, ids, FlashQCache(model.config, 260, settings))
    _compat.reset_dynamo()
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    try:
        compiled = model.generate(
            ids, past_key_values=FlashQCache(model.config, 260, settings), max_new_tokens=16, min_new_tokens=16,
            do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0,
            compile_config=CompileConfig(backend=qattn_backend, mode="reduce-overhead"),
        )[:, ids.shape[1]:]
        # transformers falls back to eager decoding with only a warning: the steps must
        # have been compiled, by the qattn backend in CUDA-graph mode
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs_before
        assert qattn_compile.last_backend().options.mode == "reduce-overhead"
    finally:
        _compat.reset_dynamo()
    assert (compiled == eager).float().mean() > 0.9
