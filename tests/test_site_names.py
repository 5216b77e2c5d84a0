"""Site names are the compiled module's ``named_modules()`` names, whatever path dynamo records:
classes overriding ``__getattr__`` (diffusers' ``ModelMixin``), graph breaks inside blocks,
regional compilation (with the ``model`` option); one compiled block serving blocks the
policy decides differently is refused; a symbolic ``dropout_p`` of 0 is served."""

import gc
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qattn_compile
from qattn_compile import _compat, ops
from qattn_compile.debug.table import site_row
from qattn_compile.dynamo_backend import _backends, qattn_backend
from qattn_compile.errors import OptionsError, PolicyError
from qattn_compile.patterns import regions
from qattn_compile.patterns.site import clean_fqn
from qattn_compile.report import LEFT_ALONE, REWRITTEN


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _policy(*rules, default="none"):
    return {"qattn": 1, "default": default, "rules": [{"match": m, "preset": p} for m, p in rules]}


class Attn(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)


class Block(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.attn1 = Attn(dim)

    def forward(self, x):
        return x + self.attn1(x)


class BreakingBlock(Block):
    def forward(self, x):
        torch._dynamo.graph_break()
        return x + self.attn1(x)


class DropoutAttn(Attn):
    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.5).transpose(1, 2).reshape(b, n, d)


class BreakingDropoutBlock(BreakingBlock):
    def __init__(self, dim=16):
        super().__init__(dim)
        self.attn1 = DropoutAttn(dim)


class RegionBlock(Block):
    forward = torch.compiler.nested_compile_region(Block.forward)


class Model(nn.Module):
    """Blocks in a ModuleList, as ``named_modules()`` names them: ``blocks.0.attn1``..."""

    def __init__(self, block=Block, layers=3):
        super().__init__()
        self.blocks = nn.ModuleList([block() for _ in range(layers)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class GetattrModel(Model):
    """Overrides ``__getattr__`` as diffusers' ``ModelMixin`` does: dynamo then records the
    blocks' path as ``L['self'].__dict__['_modules']['blocks'].0``."""

    def __getattr__(self, name):
        return super().__getattr__(name)


def _run(model, compile_model, x):
    with torch.no_grad():
        return compile_model(model)(x)


def _sites(be):
    return {r.fqn: r for r in be.site_reports}


@pytest.mark.parametrize(
    "dynamo_path, fqn",
    [
        ("L['self'].__dict__['_modules']['blocks'].0.attn1", "blocks.0.attn1"),
        ("L['self'].__dict__['_modules']['blocks']._modules['0']._modules['attn1']", "blocks.0.attn1"),
        ("getattr(L['self'].__dict__['_modules']['blocks'], '0').attn1", "blocks.0.attn1"),
        ("L['self'].blocks[0].attn1", "blocks.0.attn1"),
        ("G['model'].blocks[1]", "blocks.1"),
        ("L['self']", ""),
    ],
)
def test_paths_are_cleaned_when_the_tree_is_unreachable(dynamo_path, fqn):
    assert clean_fqn(dynamo_path) == fqn


@pytest.mark.parametrize("model_class", [Model, GetattrModel])
def test_a_rule_copied_from_named_modules_is_applied(model_class):
    model = model_class().eval()
    names = [n for n, m in model.named_modules() if isinstance(m, Attn)]
    x = torch.randn(2, 5, 16)
    be = qattn_compile.backend(policy=_policy(("blocks.1.attn1", "flash")), compiler="eager", strict=True)
    out = _run(model, lambda m: torch.compile(m, backend=be), x)
    sites = _sites(be)
    assert sorted(sites) == names
    assert [sites[n].status for n in names] == [LEFT_ALONE, REWRITTEN, LEFT_ALONE]
    assert sites["blocks.1.attn1"].module_class == "Attn" and sites["blocks.1.attn1"].serves == ()
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


def test_a_graph_break_inside_blocks_keeps_full_names_and_serves_all_blocks():
    """After a graph break inside a block, dynamo compiles the block's frame once for all
    blocks: its site is named as the compiled model names it and serves the other blocks."""
    model = GetattrModel(BreakingBlock).eval()
    be = qattn_compile.backend(policy=_policy(("*attn1", "flash")), compiler="eager")
    _run(model, lambda m: torch.compile(m, backend=be), torch.randn(2, 5, 16))
    (site,) = be.site_reports
    assert (site.fqn, site.serves, site.status) == ("blocks.0.attn1", ("blocks.1.attn1", "blocks.2.attn1"), REWRITTEN)
    assert site_row(site)[0] == "blocks.0.attn1 (+2 sharing its graph)"


@pytest.mark.parametrize("rule, says", [
    ({"match": "blocks.2.attn1", "preset": "none"}, "gets 'none' by rules[1]"),
    ({"match": "blocks.2.attn1", "preset": "int_flash", "options": {"v_granularity": "tensor"}},
     "gets 'int_flash' by rules[1] (match 'blocks.2.attn1') (other options)"),
])
def test_blocks_sharing_a_graph_but_decided_differently_are_refused(rule, says):
    """One block's decision is never applied to another: the compile fails naming both."""
    policy = _policy(("*attn1", "int_flash"))
    policy["rules"].append(rule)
    be = qattn_compile.backend(policy=policy, compiler="eager")
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as err:
        _run(GetattrModel(BreakingBlock).eval(), lambda m: torch.compile(m, backend=be), torch.randn(2, 5, 16))
    assert isinstance(err.value.inner_exception, PolicyError)
    message = str(err.value.inner_exception)
    assert "attention site blocks.0.attn1 (Attn) and blocks.2.attn1 run one compiled graph" in message
    assert says in message


def test_a_site_that_falls_back_may_serve_blocks_decided_differently():
    """A shared site the finder refuses keeps the original attention in every block: there
    is no decision to split, and the rules of every block it serves count as matched."""
    policy = _policy(("*attn1", "int_flash"), ("blocks.2.attn1", "none"))
    be = qattn_compile.backend(policy=policy, compiler="eager", strict=True)
    _run(GetattrModel(BreakingDropoutBlock).eval(), lambda m: torch.compile(m, backend=be), torch.randn(2, 5, 16))
    (site,) = be.site_reports
    assert (site.fqn, site.status, site.matched_rules) == ("blocks.0.attn1", "fallback", (0, 1))
    assert "dropout_p=0.5" in site.reason


def test_a_nested_compile_region_is_rewritten_for_all_its_blocks_or_refused():
    """``nested_compile_region`` traces a block once into a subgraph that every block calls:
    its site is found in the subgraph, named for the block traced, serves the others."""
    model = GetattrModel(RegionBlock).eval()
    x = torch.randn(2, 5, 16)
    be = qattn_compile.backend(policy=_policy(("blocks.*.attn1", "flash")), compiler="eager", strict=True)
    graphs = []

    def spy(gm, example_inputs):
        graphs.append(gm)
        return be(gm, example_inputs)

    out = _run(model, lambda m: torch.compile(m, backend=spy), x)
    (site,) = be.site_reports
    assert (site.fqn, site.serves, site.status) == ("blocks.0.attn1", ("blocks.1.attn1", "blocks.2.attn1"), REWRITTEN)
    (gm,) = graphs
    in_subgraphs = [n for sub in gm.children() for n in sub.graph.nodes if n.target in ops.graph_ops()]
    assert len(in_subgraphs) == 1
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)

    _compat.reset_dynamo()
    split = qattn_compile.backend(policy=_policy(("*attn1", "flash"), ("blocks.1.attn1", "none")), compiler="eager")
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="blocks.1.attn1"):
        _run(model, lambda m: torch.compile(m, backend=split), x)


@pytest.mark.parametrize(
    "fqn, callers, serves",
    [
        ("blocks.0.attn1", ["blocks.0", "blocks.1", "blocks.2"], ("blocks.1.attn1", "blocks.2.attn1")),
        ("blocks.0", ["blocks.0", "blocks.1"], ("blocks.1",)),
        ("attn", ["", "encoder"], ("encoder.attn",)),
        ("head.attn", ["blocks.0", "blocks.1"], None),  # not inside a caller: unknown
    ],
)
def test_a_region_site_is_named_for_each_call(fqn, callers, serves):
    assert regions.served(fqn, callers) == serves


def test_blocks_compiled_one_by_one_get_full_names_with_the_model_option(caplog):
    model = Model(layers=2).eval()
    x = torch.randn(2, 5, 16)
    # the second rule picks blocks.1 only, which runs block 0's graph: it counts as matched
    policy = _policy(("blocks.*.attn1", "flash"), ("blocks.1.attn1", "flash"))
    be = qattn_compile.backend(policy=policy, compiler="eager", strict=True, model=model)
    for block in model.blocks:
        block.compile(backend=be)
    with torch.no_grad():
        out = model(x)
        model(x)
    (site,) = be.site_reports  # one graph, reused for the second block
    assert (site.fqn, site.serves, site.status) == ("blocks.0.attn1", ("blocks.1.attn1",), REWRITTEN)
    assert site.matched_rules == (0, 1) and be.unmatched_rules() == []
    # one block's graph is not the model: a rule for another block is not an error yet
    warning = next(r for r in caplog.records if "holds a part of the model only" in r.message)
    assert warning.levelname == "WARNING" and "strict: true is not enforced" in warning.message
    with torch.no_grad():
        reference = x
        for block in model.blocks:
            reference = block._call_impl(reference)  # the block uncompiled
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


def test_without_the_model_option_a_block_compiled_alone_is_named_in_itself():
    model = Model(layers=2).eval()
    be = qattn_compile.backend(policy=_policy(("attn1", "flash")), compiler="eager")
    for block in model.blocks:
        block.compile(backend=be)
    with torch.no_grad():
        model(torch.randn(2, 5, 16))
    assert [(r.fqn, r.serves, r.status) for r in be.site_reports] == [("attn1", (), REWRITTEN)]


def test_the_model_option_must_be_a_module_and_is_not_kept_alive():
    with pytest.raises(OptionsError, match="option `model` must be the model"):
        qattn_compile.backend(model="transformer")
    model = Model(layers=1).eval()
    options = {"compiler": "eager", "model": model}
    q = torch.randn(1, 2, 4, 8)
    gm = torch.fx.symbolic_trace(lambda q: F.scaled_dot_product_attention(q, q, q))
    qattn_backend(gm, [q], options)
    entry = _backends[(id(options), None)]
    assert entry.options is None and entry.backend.options.model() is model
    assert qattn_backend(gm, [q], options) and _backends[(id(options), None)] is entry  # same dict: reused
    probe = entry.backend.options.model
    del model, options["model"]
    gc.collect()
    assert probe() is None


def _attend(q, k, v, dropout_p=0.0):
    """A float default, as diffusers' ``dispatch_attention_fn(..., dropout_p=0.0)``: under
    ``dynamic=True`` dynamo passes it to the graph as a tensor and reads it with ``.item()``."""
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)


def test_dynamic_shapes_serve_a_symbolic_zero_dropout(monkeypatch):
    be = qattn_compile.backend(policy=_policy(("*", "flash"), default="flash"), compiler="eager")
    fn = torch.compile(lambda q, k, v: _attend(q, k, v), backend=be, dynamic=True)
    q, k, v = (torch.randn(1, 2, 7, 16) for _ in range(3))
    with torch.no_grad():
        torch.testing.assert_close(fn(q, k, v), F.scaled_dot_product_attention(q, k, v), atol=1e-5, rtol=1e-5)
    (site,) = be.site_reports
    assert site.status == REWRITTEN, site.reason
    # dynamo guards the value: a non-zero default recompiles, and that site falls back
    monkeypatch.setattr(_attend, "__defaults__", (0.5,))
    with torch.no_grad():
        fn(q, k, v)
    assert [r.status for r in be.site_reports] == [REWRITTEN, "fallback"]
    assert "dropout" in be.site_reports[-1].reason


def test_tune_writes_named_modules_names(tmp_path, monkeypatch):
    """``tune`` writes each site's name into its rules: a model overriding ``__getattr__``
    gets rules that match its ``named_modules()`` names. The capture under it records a
    nested compile region's site for every block calling it."""
    from qattn_compile.evaluation import Evaluator, load_inputs, tune
    from qattn_compile.policy import load_policy

    (tmp_path / "getattr_model.py").write_text(textwrap.dedent("""
        import torch
        from test_site_names import GetattrModel

        from test_site_names import RegionBlock

        def build():
            torch.manual_seed(0)
            return GetattrModel(layers=2).eval(), (torch.randn(1, 9, 16),)

        def regions():
            torch.manual_seed(0)
            return GetattrModel(RegionBlock, layers=2).eval(), (torch.randn(1, 9, 16),)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    result = tune(Evaluator(load_inputs("getattr_model:build"), device="cpu", fp_capture=True), 0.99)
    assert sorted(c.fqn for c in result.choices) == ["blocks.0.attn1", "blocks.1.attn1"]
    policy = load_policy(result.policy_text)
    for choice in result.choices:
        assert policy.decide(choice.fqn, "Attn").preset == choice.preset
    # a nested compile region's one site is recorded once per block calling it
    ev = Evaluator(load_inputs("getattr_model:regions"), device="cpu", fp_capture=True)
    assert [(s.key, s.status, len(s.calls)) for s in ev.fp.sites] == [("blocks.0.attn1", REWRITTEN, 2)]


# ----------------------------------------------------------------------------- diffusers

def _flux(layers=2):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=layers, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=16, axes_dims_rope=(2, 2, 4),
    ).eval()
    inputs = dict(hidden_states=torch.randn(1, 16, 4), encoder_hidden_states=torch.randn(1, 8, 16),
                  pooled_projections=torch.randn(1, 16), timestep=torch.tensor([1.0]),
                  img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(8, 3))
    return model, inputs


def _attention_names(model):
    return [n for n, m in model.named_modules() if type(m).__name__ == "FluxAttention"]


@pytest.mark.parametrize("dynamic", [False, True])
def test_flux_sites_have_their_named_modules_names(dynamic):
    """0 of 4 sites were rewritten on a Flux transformer: its sites were named
    ``__dict__['_modules']['transformer_blocks'].0.attn``; and under ``dynamic=True`` every
    site fell back on the symbolic default ``dropout_p=0.0``."""
    model, inputs = _flux(layers=1)
    names = _attention_names(model)
    be = qattn_compile.backend(policy=_policy((names[0], "flash")), compiler="eager", strict=True)
    with torch.no_grad():
        out = torch.compile(model, backend=be, dynamic=dynamic)(**inputs).sample
        reference = model(**inputs).sample
    sites = _sites(be)
    assert sorted(sites) == sorted(names)
    assert sites[names[0]].status == REWRITTEN, sites[names[0]].reason
    assert sites[names[1]].status == LEFT_ALONE
    torch.testing.assert_close(out, reference, atol=1e-4, rtol=1e-4)


def test_flux_compile_repeated_blocks_with_the_model_option():
    model, inputs = _flux(layers=2)
    policy = _policy(("*attn", "flash"), ("single_transformer_blocks.*", "none"))
    options = {"policy": policy, "compiler": "eager", "model": model, "strict": True}
    model.compile_repeated_blocks(backend="qattn", options=options)
    with torch.no_grad():
        model(**inputs)
    be = qattn_compile.last_backend()
    assert [(r.fqn, r.serves, r.status) for r in be.site_reports] == [
        ("transformer_blocks.0.attn", ("transformer_blocks.1.attn",), REWRITTEN),
        ("single_transformer_blocks.0.attn", (), LEFT_ALONE),
    ]

    _compat.reset_dynamo()
    split = _policy(("*attn", "flash"), ("transformer_blocks.1.attn", "none"))
    model, inputs = _flux(layers=2)
    model.compile_repeated_blocks(backend="qattn", options={"policy": split, "compiler": "eager", "model": model})
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="transformer_blocks.1.attn"):
        with torch.no_grad():
            model(**inputs)
