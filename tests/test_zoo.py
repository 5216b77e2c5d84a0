"""Tiny random Hugging Face models of every zoo architecture through ``backend="qattn"``.

With an all-``int_flash`` policy every attention module must become exactly one rewritten
site (counted per pattern), nothing is left unmatched, and outputs match eager; the exact
``flash`` preset must match to float rounding. Most tests run the rewritten graph without
Inductor (``compiler: eager``); one model per family goes through Inductor (``slow``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import qattn_compile
from qattn_compile import _compat
from qattn_compile.report import FALLBACK, LEFT_ALONE, REWRITTEN, count_by_pattern
from qattn_compile.zoo import (
    ATTN_IMPLEMENTATIONS,
    TORCH_ZOO,
    ZOO,
    attention_like_modules,
    attention_modules,
    main_output,
)

INT_FLASH = {"qattn": 1, "default": "int_flash"}
FLASH = {"qattn": 1, "default": "flash"}
PATTERN = {"eager": "matmul_softmax", "sdpa": "sdpa"}
COS_FLOOR = 0.999  # int_flash on these tiny random models reaches >= 0.9999
FLASH_REL_ERR = 1e-5
CASES = [(name, impl) for name in ZOO for impl in ATTN_IMPLEMENTATIONS]

# What the mask analysis proves on transformers' masks (right-padded token inputs).
MASK_KINDS = {
    "llama": {"causal+padding"},
    "mistral": {"causal+sliding_window+padding"},
    "qwen2": {"causal+padding"},
    "gpt2": {"causal+padding"},
    "bert": {"padding"},
    "roberta": {"padding"},
    "vit": {"none"},
    "t5": {"padding+additive", "causal+additive", "padding"},
    "clip_text": {"causal+padding"},
    "clip_vision": {"none"},
    "whisper": {"none", "causal"},  # its decoder gets no attention_mask: one sequence
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    _compat.reset_dynamo()
    yield
    _compat.reset_dynamo()


def compile_zoo(name: str, impl: str, policy: dict, **compile_kwargs):
    """(bundle, eager output, compiled output, site reports) of one zoo model."""
    bundle = ZOO[name].build(impl)
    options = {"policy": policy, "compiler": compile_kwargs.pop("compiler", "eager")}
    compiled = torch.compile(bundle.model, backend="qattn", options=options, fullgraph=True, **compile_kwargs)
    with torch.no_grad():
        expected = main_output(bundle.model(**bundle.kwargs))
        got = main_output(compiled(**bundle.kwargs))
    return bundle, expected, got, qattn_compile.last_backend().site_reports


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def rel_err(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize("name, impl", CASES)
def test_every_attention_module_is_one_rewritten_site(name, impl):
    bundle, expected, got, reports = compile_zoo(name, impl, INT_FLASH)
    modules = attention_modules(bundle, ZOO[name])
    assert sorted(r.fqn for r in reports) == sorted(modules)
    assert all(r.status == REWRITTEN and r.preset == "int_flash" for r in reports), reports
    assert count_by_pattern(reports) == {PATTERN[impl]: {REWRITTEN: len(modules), LEFT_ALONE: 0, FALLBACK: 0}}
    assert all(r.module_class in ZOO[name].attention_classes and r.source for r in reports)
    assert {r.mask_kind for r in reports} == MASK_KINDS[name]
    assert all(r.causal_fast_path == ("causal" in r.mask_kind) for r in reports)
    assert not unreported(bundle.model, reports)
    assert cosine(got, expected) >= COS_FLOOR


def unreported(model: torch.nn.Module, reports) -> list[str]:
    """The attention-like modules of ``model`` (class name containing "Attention", every
    ``nn.MultiheadAttention``) that neither are nor hold a reported site."""
    return [name for name in attention_like_modules(model)
            if not any(not name or r.fqn == name or r.fqn.startswith(f"{name}.") for r in reports)]


TORCH_STATUS = {"transformer_encoder": FALLBACK, "transformer_decoder": REWRITTEN, "attention_pool": REWRITTEN}


@pytest.mark.parametrize("name", TORCH_ZOO)
def test_every_torch_attention_module_is_reported(name):
    """PyTorch's own attention: every ``nn.MultiheadAttention`` is a site, served or with
    its reason (the encoder's fused fast path, which runs a whole layer as one op)."""
    bundle = TORCH_ZOO[name].build()
    be = qattn_compile.backend(INT_FLASH, compiler="eager")
    compiled = torch.compile(bundle.model, backend=be, fullgraph=True)
    with torch.no_grad():
        expected, got = bundle.model(**bundle.kwargs), compiled(**bundle.kwargs)
    reports = be.site_reports
    modules = dict(bundle.model.named_modules())
    assert reports and not unreported(bundle.model, reports)
    assert all(type(modules[r.fqn]).__name__ == r.module_class == "MultiheadAttention" for r in reports)
    assert {r.status for r in reports} == {TORCH_STATUS[name]}, [r.reason for r in reports]
    assert all(r.status == REWRITTEN or "set_fastpath_enabled(False)" in r.reason for r in reports)
    assert cosine(got, expected) >= COS_FLOOR


@pytest.mark.parametrize("name, impl", CASES)
def test_flash_preset_is_exact(name, impl):
    bundle, expected, got, reports = compile_zoo(name, impl, FLASH)
    assert sorted(r.fqn for r in reports if r.status == REWRITTEN) == sorted(
        attention_modules(bundle, ZOO[name]))  # the exactness below is the kernel's, not eager's
    assert rel_err(got, expected) < FLASH_REL_ERR


@pytest.mark.parametrize("impl", ATTN_IMPLEMENTATIONS)
def test_gqa_is_served_unrepeated(impl):
    *_, reports = compile_zoo("llama", impl, INT_FLASH)
    assert all(r.gqa_group == 2 and r.gqa_source == "repeat_kv" for r in reports)
    assert all(r.shapes["k"][1] == 2 and r.shapes["q"][1] == 4 for r in reports)


def test_policy_exclusions_are_left_untouched():
    policy = {
        "qattn": 1,
        "default": "int_flash",
        "ignore": ["re:decoder\\.block\\.\\d+\\.layer\\.1\\.EncDecAttention"],
        "rules": [{"match": "encoder.block.1.*", "preset": "none"}],
    }
    _, expected, got, reports = compile_zoo("t5", "eager", policy)
    left = {r.fqn for r in reports if r.status == LEFT_ALONE}
    assert left == {
        "encoder.block.1.layer.0.SelfAttention",
        "decoder.block.0.layer.1.EncDecAttention",
        "decoder.block.1.layer.1.EncDecAttention",
    }
    assert sum(r.status == REWRITTEN for r in reports) == 3
    assert cosine(got, expected) >= COS_FLOOR


def test_model_returning_attention_weights_is_refused():
    """(transformers' output capturing breaks the graph itself: no ``fullgraph`` here.)"""
    bundle = ZOO["llama"].build("eager")
    be = qattn_compile.backend(INT_FLASH, compiler="eager")
    with torch.no_grad():
        out = torch.compile(bundle.model, backend=be)(**bundle.kwargs, output_attentions=True)
    assert out.attentions is not None and len(be.site_reports) == 2
    assert all(r.status == FALLBACK and "also used by" in r.reason for r in be.site_reports)


@pytest.mark.parametrize("impl, reason", [("eager", "dropout p=0.1 in training mode"), ("sdpa", "dropout_p=0.1")])
def test_training_mode_dropout_is_refused(impl, reason):
    bundle = ZOO["bert"].build(impl)
    bundle.model.train()
    be = qattn_compile.backend(INT_FLASH, compiler="eager")
    with torch.no_grad():
        torch.compile(bundle.model, backend=be, fullgraph=True)(**bundle.kwargs)
    assert [r.status for r in be.site_reports] == [FALLBACK, FALLBACK]
    assert all(reason in r.reason for r in be.site_reports)


def test_gradients_through_attention_are_refused():
    bundle = ZOO["vit"].build("sdpa")
    be = qattn_compile.backend(INT_FLASH, compiler="eager")
    torch.compile(bundle.model, backend=be, fullgraph=True)(**bundle.kwargs)
    assert [r.status for r in be.site_reports] == [FALLBACK, FALLBACK]
    assert all("grad with grad mode on" in r.reason for r in be.site_reports)


class _CountingBackend:
    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


@pytest.mark.parametrize("name, impl", [("llama", "eager"), ("bert", "sdpa")])
def test_dynamic_shapes_need_no_extra_recompiles(name, impl):
    """``dynamic=True`` compiles once for every length; automatic dynamic compiles exactly
    as often as a backend that changes nothing."""
    lengths = (10, 17, 23)
    bundles = [ZOO[name].build(impl, seq_len=n) for n in lengths]
    model = bundles[0].model
    for dynamic in (True, None):
        _compat.reset_dynamo()
        baseline = _CountingBackend()
        with torch.no_grad():
            plain = torch.compile(model, backend=baseline, dynamic=dynamic, fullgraph=True)
            for bundle in bundles:
                plain(**bundle.kwargs)
        _compat.reset_dynamo()
        be = qattn_compile.backend(FLASH, compiler="eager")
        compiled = torch.compile(model, backend=be, dynamic=dynamic, fullgraph=True)
        with torch.no_grad():
            for bundle in bundles:
                expected = main_output(model(**bundle.kwargs))
                assert rel_err(main_output(compiled(**bundle.kwargs)), expected) < FLASH_REL_ERR
        graphs = {r.graph_index for r in be.site_reports}
        assert len(graphs) == baseline.graphs == (1 if dynamic else 2)
        assert all(r.status == REWRITTEN for r in be.site_reports)


# One model per family through Inductor (tens of seconds each on a 2-core CPU).
INDUCTOR_CASES = {
    "decoder": ("llama", "eager"),
    "encoder": ("bert", "eager"),
    "vision": ("vit", "sdpa"),
    "seq2seq": ("whisper", "eager"),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", INDUCTOR_CASES)
def test_inductor_compiles_rewritten_zoo_model(family):
    name, impl = INDUCTOR_CASES[family]
    assert ZOO[name].family == family
    bundle, expected, got, reports = compile_zoo(name, impl, INT_FLASH, compiler="inductor")
    assert len(reports) == len(attention_modules(bundle, ZOO[name]))
    assert all(r.status == REWRITTEN for r in reports)
    assert cosine(got, expected) >= COS_FLOOR


@pytest.mark.gpu
@pytest.mark.parametrize("name, impl", [("llama", "eager"), ("llama", "sdpa"), ("t5", "eager"), ("vit", "sdpa")])
def test_zoo_on_cuda_runs_the_triton_kernels(name, impl):
    bundle = ZOO[name].build(impl)
    model = bundle.model.to("cuda", torch.bfloat16)
    kwargs = {k: v.to("cuda") if isinstance(v, torch.Tensor) else v for k, v in bundle.kwargs.items()}
    kwargs = {k: v.to(torch.bfloat16) if k == "pixel_values" else v for k, v in kwargs.items()}
    be = qattn_compile.backend(INT_FLASH)
    compiled = torch.compile(model, backend=be, fullgraph=True)
    with torch.no_grad():
        expected = main_output(model(**kwargs))
        got = main_output(compiled(**kwargs))
    assert len(be.site_reports) == len(attention_modules(bundle, ZOO[name]))
    assert all(r.status == REWRITTEN and r.execution == "triton" for r in be.site_reports), be.site_reports
    assert cosine(got, expected) >= 0.99
