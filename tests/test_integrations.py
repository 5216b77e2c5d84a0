"""The ways in without torch.compile: ``attn_implementation="qattn"`` (transformers) and
``policy_scope`` (any model). Same policy, same site names as the compile backend."""

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qattn_compile
from qattn_compile import functional
from qattn_compile.errors import PolicyError, PolicyNotAppliedError, UnsupportedSiteError
from qattn_compile.metrics import compare


def apply_policy(model, policy=None, **options):
    """``qattn_compile.apply_policy``, imported on first use: transformers imports triton,
    which the kernel tests' modules switch to the interpreter before its first import."""
    return qattn_compile.apply_policy(model, policy, **options)


LAYER0_EXACT = {"qattn": 1, "default": "int_flash",
                "rules": [{"match": "model.layers.0.self_attn", "preset": "none"}]}


@pytest.fixture
def served(monkeypatch):
    """The (preset, query shape) of every call qattn serves, in order."""
    calls = []
    real = functional.attention

    def spy(q, k, v, *args, preset, **options):
        calls.append((preset, tuple(q.shape)))
        return real(q, k, v, *args, preset=preset, **options)

    monkeypatch.setattr(functional, "attention", spy)
    return calls


def _llama(cls_name="LlamaForCausalLM", layers=2, **extra):
    import transformers

    config_cls = getattr(transformers, cls_name.replace("ForCausalLM", "Config"))
    torch.manual_seed(0)
    cfg = config_cls(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                     attn_implementation="sdpa", **extra)
    return getattr(transformers, cls_name)(cfg).eval()


def _batch(b=2, length=13, pad=4):
    """Token ids and a left-padding mask (row 1 has ``pad`` padding tokens)."""
    ids = torch.randint(1, 128, (b, length))
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    return ids, mask


def _logits(model, ids, mask):
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits


# ------------------------------------------------------------------------------------------
# transformers: attn_implementation="qattn"
# ------------------------------------------------------------------------------------------


def test_apply_policy_decides_per_layer_by_module_names(served):
    model = _llama(layers=4)
    ids, mask = _batch()
    policy = {"qattn": 1, "ignore": ["*layers.3.*"], "rules": [
        {"module_class": "LlamaAttention", "preset": "int_flash"},
        {"match": "model.layers.0.self_attn", "preset": "none"},
        {"match": "re:model\\.layers\\.[23]\\..*", "preset": "sage2_8b"}]}
    applied = apply_policy(model, policy)
    assert model.config._attn_implementation == "qattn"
    _logits(model, ids, mask)
    assert served == [("int_flash", (2, 4, 13, 16)), ("sage2_8b", (2, 4, 13, 16))]
    names = dict(model.named_modules())
    reports = {r.fqn: r for r in applied.site_reports}
    assert set(reports) == {f"model.layers.{i}.self_attn" for i in range(4)} <= set(names)
    assert [reports[f"model.layers.{i}.self_attn"].preset for i in range(4)] == ["none", "int_flash", "sage2_8b", "none"]
    assert [r.status for r in applied.site_reports] == ["left_alone", "rewritten", "rewritten", "left_alone"]
    assert reports["model.layers.3.self_attn"].rule == "ignore '*layers.3.*'"
    assert "/models/llama/modeling_llama.py:" in reports["model.layers.1.self_attn"].source
    assert reports["model.layers.1.self_attn"].gqa_group == 2
    assert applied.unmatched_rules() == []
    applied.remove()
    assert model.config._attn_implementation == "sdpa"


def test_an_exact_policy_gives_sdpa_bit_for_bit_and_a_quantized_one_the_preset_error(served):
    model = _llama()
    ids, mask = _batch()
    reference = _logits(model, ids, mask)
    applied = apply_policy(model, {"qattn": 1, "default": "none"})
    assert torch.equal(_logits(model, ids, mask), reference) and served == []
    applied.remove()
    with qattn_compile.policy_scope(model, {"qattn": 1, "default": "int_flash"}):
        scoped = _logits(model, ids, mask)  # the same reference kernels through the other entry
    apply_policy(model, {"qattn": 1, "default": "int_flash"})
    quantized = _logits(model, ids, mask)
    assert torch.equal(quantized, scoped) and len(served) == 4
    valid = mask.bool()
    error = compare(quantized[valid], reference[valid])
    assert 0 < error["rel_l1"] < 0.02 and error["cos"] > 0.999


def test_generate_with_padding_and_gqa_serves_prefill_and_decode(served):
    model = _llama()
    ids, mask = _batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        reference = model.generate(ids, **kwargs)
        apply_policy(model, LAYER0_EXACT)
        out = model.generate(ids, **kwargs)
    assert out.shape == reference.shape == (2, 17)
    assert torch.equal(out[:, :13], ids)
    # layer 1 only: the prefill, then one query per decode step, K/V never repeated
    assert served == [("int_flash", (2, 4, 13, 16))] + [("int_flash", (2, 4, 1, 16))] * 3


def test_flash_preset_follows_the_sliding_window_and_padding_masks():
    """``flash`` is exact up to rounding: any mask transformers builds (left padding, a
    sliding window of 5 over 13 tokens) that qattn dropped or misread would show."""
    model = _llama("MistralForCausalLM", sliding_window=5)
    ids, mask = _batch()
    reference = _logits(model, ids, mask)
    apply_policy(model, {"qattn": 1, "default": "flash"})
    out = _logits(model, ids, mask)
    valid = mask.bool()
    torch.testing.assert_close(out[valid], reference[valid], atol=2e-5, rtol=1e-4)
    model.set_attn_implementation("sdpa")
    model.config.sliding_window = None  # without the window the logits differ: the test can fail
    assert not torch.allclose(_logits(model, ids, mask)[valid], reference[valid], atol=1e-3)


def test_policy_scope_serves_the_prefill_of_a_flashq_cache_generate(served):
    """Eager generate with the FlashQ cache: the prefill's SDPA gets the policy's preset,
    decode steps read the packed cache (the flashq_decode op, no SDPA)."""
    from qattn_compile.kvcache import FlashQCache

    model = _llama()
    model.set_attn_implementation("qattn_kv")
    ids = torch.randint(1, 128, (2, 13))
    policy = {"qattn": 1, "default": "turbo", "kv_cache": {"int2_heads": 1}}
    cache = FlashQCache.from_policy(model, policy, max_cache_len=20)
    with torch.no_grad(), qattn_compile.policy_scope(model, policy) as scope:
        out = model.generate(ids, past_key_values=cache, max_new_tokens=4, min_new_tokens=4,
                             do_sample=False, pad_token_id=0)
    assert out.shape == (2, 17) and int(cache.get_seq_length()) == 16
    assert served == [("turbo", (2, 4, 13, 16))] * 2
    assert [(r.fqn, r.status) for r in scope.site_reports] == [
        ("model.layers.0.self_attn", "rewritten"), ("model.layers.1.self_attn", "rewritten")]


def test_t5_position_bias_and_cross_attention_are_served():
    """T5 adds its relative position bias to unscaled scores (``scaling=1``) and attends from
    5 decoder tokens to 9 padded encoder tokens: ``flash`` matches sdpa only if qattn folds
    the bias into the mask and keeps the scale."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(vocab_size=64, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
                   relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0,
                   attn_implementation="sdpa")
    model = T5ForConditionalGeneration(cfg).eval()
    ids = torch.randint(1, 64, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # right padding
    decoder_ids = torch.randint(1, 64, (2, 5))
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
        applied = apply_policy(model, {"qattn": 1, "default": "flash"})
        out = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
        generated = model.generate(ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3)
    torch.testing.assert_close(out, reference, atol=2e-5, rtol=1e-4)
    assert generated.shape == (2, 4)
    sites = {r.fqn: (r.status, r.shapes["k"][2]) for r in applied.site_reports}
    assert sites["decoder.block.1.layer.1.EncDecAttention"] == ("rewritten", 9)
    assert len(sites) == 6 and {status for status, _ in sites.values()} == {"rewritten"}


def test_training_calls_fall_back_with_a_reason(caplog, served):
    model = _llama()
    ids, mask = _batch()
    applied = apply_policy(model, {"qattn": 1, "default": "int_flash"})
    with caplog.at_level(logging.WARNING, logger="qattn_compile.integrations"):
        out = model(ids, attention_mask=mask).logits  # grad mode on, weights require grad
    assert served == [] and out.requires_grad
    assert {r.status for r in applied.site_reports} == {"fallback"}
    assert "query, key, value require grad with grad mode on" in applied.site_reports[0].reason
    assert "model.layers.0.self_attn falls back to the original attention" in caplog.text
    apply_policy(model, {"qattn": 1, "default": "int_flash", "on_unsupported": "error"})
    with pytest.raises(UnsupportedSiteError, match=r"model.layers.0.self_attn \(LlamaAttention, "
                                                   r"attn_implementation=\"qattn\"\) chose preset 'int_flash'"):
        model(ids, attention_mask=mask)


def test_compiling_a_qattn_model_hands_its_sdpa_to_the_backend(caplog, monkeypatch):
    from qattn_compile import _compat
    from qattn_compile.integrations import sites

    model = _llama()
    ids, mask = _batch()
    applied = apply_policy(model, LAYER0_EXACT)
    eager = _logits(model, ids, mask)
    backend = qattn_compile.backend(LAYER0_EXACT, compiler="eager")
    monkeypatch.setattr(sites, "_WARNED_COMPILED", [])
    _compat.reset_dynamo()
    try:
        with caplog.at_level(logging.WARNING, logger="qattn_compile.integrations"):
            compiled = _logits(torch.compile(model, backend=backend, fullgraph=True), ids, mask)
    finally:
        _compat.reset_dynamo()
    site = lambda r: (r.fqn, r.module_class, r.preset, r.status)  # noqa: E731
    assert [site(r) for r in backend.site_reports] == [site(r) for r in applied.site_reports]
    torch.testing.assert_close(compiled, eager)
    assert caplog.text.count("leave the attention to the compile backend") == 1


def test_a_model_loaded_with_qattn_needs_the_policy_applied():
    model = _llama()
    model.set_attn_implementation("qattn")
    ids, mask = _batch()
    with pytest.raises(PolicyNotAppliedError, match=r"LlamaAttention runs with attn_implementation=\"qattn\" "
                                                     r"but no qattn policy names it: call .*apply_policy"):
        _logits(model, ids, mask)
    apply_policy(model, LAYER0_EXACT, set_attn_implementation=False)
    assert _logits(model, ids, mask).isfinite().all()


def test_apply_policy_refuses_a_model_without_sdpa_and_a_bad_policy():
    model = _llama()
    with pytest.raises(PolicyError, match="unknown preset 'int9'"):
        apply_policy(model, {"qattn": 1, "default": "int9"})
    assert model.config._attn_implementation == "sdpa"
    type(model)._supports_sdpa, supports = False, type(model)._supports_sdpa
    try:
        with pytest.raises(ValueError, match="does not support attn_implementation=\"sdpa\""):
            apply_policy(model)
    finally:
        type(model)._supports_sdpa = supports


# ------------------------------------------------------------------------------------------
# policy_scope: any model
# ------------------------------------------------------------------------------------------


class Attention(nn.Module):
    """Self-attention through SDPA; ``preset`` set: through qattn directly (the expectation)."""

    def __init__(self, dim=32, heads=2):
        super().__init__()
        self.qkv, self.out, self.heads, self.preset = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), heads, None

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if self.preset:
            o = qattn_compile.attention(q, k, v, preset=self.preset)
        else:
            o = F.scaled_dot_product_attention(q, k, v)
        return self.out(o.transpose(1, 2).reshape(b, n, -1))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(32), Attention()

    def forward(self, x):
        return x + self.attn(self.norm(x))


class Denoiser(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.fail = False

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        if self.fail:
            raise RuntimeError("boom")
        return x


class Pipeline:
    """A diffusers-like pipeline: a text encoder and a denoiser, both with attention."""

    def __init__(self):
        self.text_encoder, self.denoiser = Attention(), Denoiser()

    def __call__(self, x):
        return self.denoiser(self.text_encoder(x))


BLOCK0 = {"qattn": 1, "rules": [{"match": "blocks.0.attn", "preset": "int_flash"}]}


def _hooks(module):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in module.modules())


@torch.no_grad()
def test_policy_scope_serves_matched_modules_only_and_leaves_the_text_encoder_exact(served):
    pipe, x = Pipeline(), torch.randn(2, 11, 32)
    reference = pipe(x)
    pipe.denoiser.blocks[0].attn.preset = "int_flash"
    expected = pipe(x)
    pipe.denoiser.blocks[0].attn.preset = None
    served.clear()
    with qattn_compile.policy_scope(pipe.denoiser, BLOCK0) as scope:
        out = pipe(x)
    assert served == [("int_flash", (2, 2, 11, 16))]  # blocks.0.attn; not blocks.1, not the encoder
    assert torch.equal(out, expected) and not torch.equal(out, reference)
    assert [(r.fqn, r.module_class, r.status) for r in scope.site_reports] == [
        ("blocks.0.attn", "Attention", "rewritten"), ("blocks.1.attn", "Attention", "left_alone")]
    assert scope.site_reports[0].source.startswith(f"{__file__}:")  # Attention.forward's SDPA call
    assert torch.equal(pipe(x), reference) and _hooks(pipe.denoiser) == 0  # nothing left behind


@torch.no_grad()
def test_policy_scope_names_and_decisions_equal_the_compile_backends(caplog, monkeypatch):
    """Compiled inside a scope, the model's SDPA calls go to the backend (fullgraph: the
    scope's hooks and mode add no graph break), which decides them alike."""
    from qattn_compile import _compat
    from qattn_compile.integrations import sites

    model, x = Denoiser(), torch.randn(2, 11, 32)
    policy = {"qattn": 1, "default": "sage2_8b", "rules": [{"match": "blocks.1.*", "preset": "none"}]}
    with qattn_compile.policy_scope(model, policy) as scope:
        eager = model(x)
    backend = qattn_compile.backend(policy, compiler="eager")
    monkeypatch.setattr(sites, "_WARNED_COMPILED", [])
    _compat.reset_dynamo()
    try:
        with qattn_compile.policy_scope(model, policy) as around, caplog.at_level(logging.WARNING):
            compiled = torch.compile(model, backend=backend, fullgraph=True)(x)
    finally:
        _compat.reset_dynamo()
    site = lambda r: (r.fqn, r.module_class, r.preset, r.status)  # noqa: E731
    assert [site(r) for r in scope.site_reports] == [site(r) for r in backend.site_reports]
    assert [r.status for r in scope.site_reports] == ["rewritten", "left_alone"]
    assert around.site_reports == [] and caplog.text.count("leave the attention to the compile backend") == 1
    torch.testing.assert_close(eager, compiled)


def test_policy_scope_is_undone_on_an_exception_and_reusable():
    model, x = Denoiser(), torch.randn(2, 11, 32)
    scope = qattn_compile.policy_scope(model, BLOCK0)
    model.fail = True
    with pytest.raises(RuntimeError, match="boom"), torch.no_grad(), scope:
        model(x)
    assert _hooks(model) == 0
    model.fail = False
    with torch.no_grad():
        reference = model(x)
        with scope:
            with pytest.raises(RuntimeError, match="already active"):
                scope.__enter__()
            quantized = model(x)
    assert not torch.equal(quantized, reference) and torch.equal(model(x), reference)
    assert [r.fqn for r in scope.site_reports] == ["blocks.0.attn", "blocks.1.attn"]


@torch.no_grad()
def test_nested_scopes_the_innermost_decides_once(served):
    model, x = Denoiser(), torch.randn(2, 11, 32)
    outer_policy = {"qattn": 1, "default": "sage2_8b"}
    inner_policy = {"qattn": 1, "default": "none"}  # the inner scope keeps blocks.1 exact
    with qattn_compile.policy_scope(model, outer_policy) as outer:
        with qattn_compile.policy_scope(model.blocks[1], inner_policy) as inner:
            model(x)
    assert served == [("sage2_8b", (2, 2, 11, 16))]
    assert [(r.fqn, r.status) for r in outer.site_reports] == [("blocks.0.attn", "rewritten")]
    assert [(r.fqn, r.status) for r in inner.site_reports] == [("attn", "left_alone")]


def test_policy_scope_falls_back_for_training_and_checks_strict_on_exit(caplog):
    model, x = Denoiser(), torch.randn(2, 11, 32)
    with qattn_compile.policy_scope(model, BLOCK0) as scope:
        out = model(x)  # grad mode on: not served
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    assert scope.site_reports[0].status == "fallback" and "value require grad" in scope.site_reports[0].reason
    strict = {**BLOCK0, "strict": True, "rules": BLOCK0["rules"] + [{"match": "*cross_attn", "preset": "fp8"}]}
    with pytest.raises(PolicyError, match=r"rules\[1\] \(`\*cross_attn`\) matched no site"):
        with torch.no_grad(), qattn_compile.policy_scope(model, strict):
            model(x)
    assert _hooks(model) == 0


@torch.no_grad()
def test_policy_scope_on_a_diffusers_unet_keeps_cross_attention_exact(served):
    diffusers = pytest.importorskip("diffusers")
    unet = diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8).eval()
    x, t, text = torch.randn(1, 4, 8, 8), torch.tensor([10]), torch.randn(1, 7, 32)
    reference = unet(x, t, text).sample
    policy = {"qattn": 1, "default": "int_flash", "rules": [{"match": "*.attn2", "preset": "none"}]}
    with qattn_compile.policy_scope(unet, policy) as scope:
        out = unet(x, t, text).sample
    names = dict(unet.named_modules())
    sites = {r.fqn: r.status for r in scope.site_reports}
    assert set(sites) <= set(names) and len(sites) == 8
    assert all(status == ("left_alone" if fqn.endswith("attn2") else "rewritten") for fqn, status in sites.items())
    assert len(served) == 4 and {preset for preset, _ in served} == {"int_flash"}
    error = compare(out, reference)
    assert 0 < error["rel_l1"] < 0.01


# ------------------------------------------------------------------------------------------
# sentence-transformers: the recipes that reach encode()
# ------------------------------------------------------------------------------------------

SENTENCES = ["the cat sat on the mat", "a quick brown fox ran far away", "dog"]


@pytest.fixture(scope="module")
def sentence_runs(tmp_path_factory):
    """A tiny random SentenceTransformer (BERT, 2 layers, 2 heads) run with one policy through
    ``policy_scope``, ``apply_policy``, ``torch.compile(st)`` and ``st.compile``."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import BertConfig, BertModel, BertTokenizerFast

    from qattn_compile import _compat

    path = tmp_path_factory.mktemp("st")
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *sorted(set(" ".join(SENTENCES).split()))]
    (path / "vocab.txt").write_text("\n".join(words) + "\n")
    BertTokenizerFast(vocab_file=str(path / "vocab.txt")).save_pretrained(path)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(words), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, attn_implementation="sdpa")).save_pretrained(path)
    encoder = Transformer(str(path))
    st = SentenceTransformer(modules=[encoder, Pooling(encoder.get_embedding_dimension())]).eval()

    def encode():
        return st.encode(SENTENCES, convert_to_tensor=True)

    policy = {"qattn": 1, "default": "int_flash"}
    runs = {"reference": encode()}
    with qattn_compile.policy_scope(st, policy) as scope:
        runs["scope"] = encode()
    applied = apply_policy(st, policy)
    runs["applied"] = encode()
    applied.remove()
    wrapper = qattn_compile.backend(policy, compiler="eager")
    torch.compile(st, backend=wrapper).encode(SENTENCES)  # encode() bypasses the wrapper
    backend = qattn_compile.backend(policy, compiler="eager")
    _compat.reset_dynamo()
    try:
        st.compile(backend=backend)
        runs["compiled"] = encode()
    finally:
        _compat.reset_dynamo()
    return st, runs, {"scope": scope, "applied": applied, "wrapper": wrapper, "compiled": backend}


def test_sentence_transformers_st_compile_and_the_eager_entries_apply_the_policy(sentence_runs):
    st, runs, reports = sentence_runs
    names = [f"0.model.encoder.layer.{i}.attention.self" for i in range(2)]
    assert set(names) <= set(dict(st.named_modules()))
    for entry in ("scope", "applied"):
        assert [(r.fqn, r.module_class, r.status) for r in reports[entry].site_reports] == [
            (name, "BertSelfAttention", "rewritten") for name in names]
    assert reports["wrapper"].site_reports == []  # torch.compile(st): encode() never calls it
    assert [(r.module_class, r.status) for r in reports["compiled"].site_reports] == [
        ("BertSelfAttention", "rewritten")] * 2
    torch.testing.assert_close(runs["applied"], runs["scope"], rtol=0, atol=0)
    torch.testing.assert_close(runs["compiled"], runs["scope"])
    error = compare(runs["compiled"], runs["reference"])
    assert 0 < error["rel_l1"] < 0.02


def test_sentence_transformers_site_names_are_the_backends(sentence_runs):
    _, _, reports = sentence_runs
    assert [r.fqn for r in reports["compiled"].site_reports] == [r.fqn for r in reports["scope"].site_reports]


@torch.no_grad()
def test_a_modules_second_sdpa_call_has_its_own_calibration_key(monkeypatch):
    """As the rewrite keys the sites of one graph (calibrate.site_keys): `fqn`, then `fqn#1`
    for the module's next call in the same forward, and again `fqn` in the next forward."""
    from qattn_compile.integrations import sites

    keys = []
    real = sites.options_for_site

    def spy(preset, options, key, source=None):
        keys.append(key)
        return real(preset, options, key, source)

    monkeypatch.setattr(sites, "options_for_site", spy)

    class Twice(nn.Module):
        def forward(self, q):
            return F.scaled_dot_product_attention(F.scaled_dot_product_attention(q, q, q), q, q)

    model = nn.Sequential(Twice())
    q = torch.randn(1, 2, 5, 16)
    with qattn_compile.policy_scope(model, {"qattn": 1, "default": "int_flash"}) as scope:
        model(q)
        model(q)
    assert keys == ["0", "0#1"]  # decided once per key
    assert [(r.fqn, r.status) for r in scope.site_reports] == [("0", "rewritten")]
