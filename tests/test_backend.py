"""The dynamo backend: registration, options, SDPA rewrite, report, fallback."""

import json
import logging
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qattn_compile
from qattn_compile import _compat
from qattn_compile.metrics import compare
from qattn_compile.models import tiny_bert, tiny_llama
from qattn_compile.presets import QUANTIZED_PRESETS
from qattn_compile.report import FALLBACK, LEFT_ALONE, REWRITTEN

# Expected end-to-end closeness on the tiny random models (cosine vs the uncompiled model).
COS_FLOOR = {"flash": 0.9999, "sage2_4b": 0.98}
DEFAULT_COS_FLOOR = 0.995


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    _compat.reset_dynamo()
    yield
    _compat.reset_dynamo()


def _compile_run(bundle, **backend_options):
    be = qattn_compile.backend(**backend_options)
    out = bundle.run(torch.compile(bundle.model, backend=be))
    return be, out


def test_backend_registered_via_entry_point_without_import():
    code = (
        "import sys, torch\n"
        "assert 'qattn' in torch._dynamo.list_backends(exclude_tags=())\n"
        "assert 'qattn_compile.dynamo_backend' not in sys.modules\n"
        "f = torch.compile(lambda q: torch.nn.functional.scaled_dot_product_attention(q, q, q),"
        " backend='qattn', options={'compiler': 'eager'})\n"
        "q = torch.randn(1, 2, 8, 16)\n"
        "out = f(q)\n"
        "import qattn_compile\n"
        "sites = qattn_compile.last_backend().site_reports\n"
        "assert [s.status for s in sites] == ['rewritten'], sites\n"
        "ref = torch.nn.functional.scaled_dot_product_attention(q, q, q)\n"
        "assert torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0) > 0.999\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"polcy": "x.yaml"}, r"unknown qattn backend option\(s\) \['polcy'\].*policy"),
        ({"compiler": "tvm"}, "allowed: inductor, eager"),
        ({"strict": "yes"}, "`strict` must be true or false"),
        ({"report": 5}, "`report` must be a file path"),
        ({"mode": "max-autotun"}, "option `mode` is 'max-autotun'; allowed: default, .*reduce"),
        ({"mode": 5}, "option `mode` is 5; allowed"),
    ],
)
def test_bad_options_are_clear_errors(options, message):
    with pytest.raises(qattn_compile.OptionsError, match=message):
        qattn_compile.backend(**options)


def test_options_dict_through_torch_compile_is_validated():
    f = torch.compile(lambda x: x + 1, backend="qattn", options={"bogus": 1})
    with pytest.raises(Exception, match="unknown qattn backend option"):
        f(torch.randn(3))


@pytest.mark.parametrize("preset", ["flash", *QUANTIZED_PRESETS])
def test_tiny_llama_every_site_rewritten(preset):
    bundle = tiny_llama()
    reference = bundle.run()
    be, out = _compile_run(bundle, policy={"qattn": 1, "default": preset}, compiler="eager")
    assert [r.fqn for r in be.site_reports] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert all(r.status == REWRITTEN and r.preset == preset for r in be.site_reports)
    assert all(r.module_class == "LlamaAttention" and r.source for r in be.site_reports)
    assert compare(out, reference)["cos"] > COS_FLOOR.get(preset, DEFAULT_COS_FLOOR)


@pytest.mark.parametrize("preset", ["flash", "int_flash", "sage2_8b", "sage2_4b"])
def test_tiny_bert_with_padding_mask(preset):
    bundle = tiny_bert()
    reference = bundle.run()
    be, out = _compile_run(bundle, policy={"qattn": 1, "default": preset}, compiler="eager")
    assert len(be.site_reports) == 2
    assert all(r.status == REWRITTEN for r in be.site_reports)
    assert all(r.mask_kind not in ("none", "causal") for r in be.site_reports)  # the padding mask is seen
    assert compare(out, reference)["cos"] > COS_FLOOR.get(preset, DEFAULT_COS_FLOOR)


def test_rules_choose_per_layer_and_report_is_written(tmp_path):
    policy = tmp_path / "p.yaml"
    policy.write_text(
        "qattn: 1\ndefault: int_flash\nrules:\n"
        "  - match: '*layers.1.self_attn'\n    preset: none\n"
        "  - match: '*nonexistent*'\n    preset: fp8\n"
    )
    report = tmp_path / "sites.json"
    be, _ = _compile_run(tiny_llama(), policy=str(policy), compiler="eager", report=str(report))
    statuses = {r.fqn: (r.status, r.preset) for r in be.site_reports}
    assert statuses == {
        "model.layers.0.self_attn": (REWRITTEN, "int_flash"),
        "model.layers.1.self_attn": (LEFT_ALONE, "none"),
    }
    data = json.loads(report.read_text())
    assert data["counts"] == {"rewritten": 1, "left_alone": 1, "fallback": 0}
    assert any("*nonexistent*" in line for line in data["unmatched_rules"])


class DropoutAttention(nn.Module):
    def forward(self, q):
        return F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)


class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = DropoutAttention()

    def forward(self, q):
        return self.attn(q)


def test_unsupported_site_falls_back_with_reason():
    be = qattn_compile.backend({"qattn": 1, "default": "int_flash"}, compiler="eager")
    q = torch.randn(1, 2, 8, 16)
    torch.compile(Wrapper(), backend=be)(q)
    (site,) = be.site_reports
    assert site.fqn == "attn" and site.status == FALLBACK and "dropout_p=0.1" in site.reason


def test_unsupported_site_with_on_unsupported_error_raises():
    policy = {"qattn": 1, "default": "int_flash", "on_unsupported": "error"}
    be = qattn_compile.backend(policy, compiler="eager")
    with pytest.raises(Exception, match=r"attention site attn .*dropout_p=0.1.*on_unsupported: error") as info:
        torch.compile(Wrapper(), backend=be)(torch.randn(1, 2, 8, 16))
    # dynamo wraps every backend error; the README tells users where qattn's is
    assert isinstance(info.value.inner_exception, qattn_compile.UnsupportedSiteError)


def test_strict_option_makes_unmatched_rule_an_error():
    policy = {"qattn": 1, "default": "int_flash", "rules": [{"match": "*self_atn", "preset": "fp8"}]}
    be = qattn_compile.backend(policy, compiler="eager", strict=True)
    bundle = tiny_llama()
    with pytest.raises(Exception, match=r"\*self_atn"):
        bundle.run(torch.compile(bundle.model, backend=be))


class Attention(nn.Module):
    def forward(self, q):
        return F.scaled_dot_product_attention(q, q, q)


class TwoAttentions(nn.Module):
    def __init__(self):
        super().__init__()
        self.a1, self.a2 = Attention(), Attention()

    def forward(self, q):
        return self.a2(self.a1(q))


def test_strict_counts_rules_that_match_but_do_not_decide():
    """``strict`` catches rules that match nothing (typos), not rules that match sites where
    a later rule or an ignore pattern decides."""
    policy = {"qattn": 1, "default": "none", "strict": True, "ignore": ["a2"],
              "rules": [{"match": "a*", "preset": "flash"},  # overridden on a1, ignored on a2
                        {"module_class": "Attention", "preset": "int_flash"},
                        {"match": "a2", "preset": "fp8"}]}  # matches only an ignored site
    be = qattn_compile.backend(policy, compiler="eager")
    _compat.reset_dynamo()
    torch.compile(TwoAttentions(), backend=be)(torch.randn(1, 2, 8, 16))
    assert [(r.fqn, r.preset, r.matched_rules) for r in be.site_reports] == [
        ("a1", "int_flash", (0, 1)), ("a2", "none", (0, 1, 2))]
    assert be.unmatched_rules() == []


class TwoGraphs(nn.Module):
    """Two attention sites that dynamo puts in two graphs (a graph break between them)."""

    def __init__(self):
        super().__init__()
        self.a1, self.a2 = Attention(), Attention()

    def forward(self, q):
        q = self.a1(q)
        torch._dynamo.graph_break()
        return self.a2(q)


def test_strict_waits_for_the_later_graphs_of_a_graph_break(caplog):
    """With a graph break, a rule whose sites are in the second graph is not reported as
    unmatched after the first; the check is left to unmatched_rules() once the model ran."""
    policy = {"qattn": 1, "default": "none", "strict": True,
              "rules": [{"match": "a2", "preset": "flash"}, {"match": "a3", "preset": "flash"}]}
    be = qattn_compile.backend(policy, compiler="eager")
    torch.compile(TwoGraphs(), backend=be)(torch.randn(1, 2, 8, 16))
    assert [(r.fqn, r.status) for r in be.site_reports] == [("a1", LEFT_ALONE), ("a2", REWRITTEN)]
    assert [line.split(" (")[0] for line in be.unmatched_rules()] == ["rules[1]"]
    assert "graph break" in caplog.text and "strict: true is not enforced" in caplog.text


def test_an_unmatched_rule_is_warned_about_once_not_once_per_graph(caplog):
    """A recompile (here a new shape with dynamic=False; generate()'s prefill and decode
    graphs alike) checks the rules again: a rule that still matches nothing is not logged
    a second time."""
    class Sdpa(nn.Module):
        def forward(self, q):
            return F.scaled_dot_product_attention(q, q, q)

    policy = {"qattn": 1, "default": "flash", "rules": [{"match": "no_such_site", "preset": "flash"}]}
    be = qattn_compile.backend(policy, compiler="eager")
    compiled = torch.compile(Sdpa(), backend=be, dynamic=False)
    with caplog.at_level(logging.WARNING, logger="qattn_compile"):
        compiled(torch.randn(1, 2, 8, 16))
        compiled(torch.randn(1, 2, 9, 16))
    assert len(be.site_reports) == 2 and {r.graph_index for r in be.site_reports} == {0, 1}
    assert caplog.text.count("rules[0] (`no_such_site`) matched no site") == 1, caplog.text


def test_the_cpu_reference_path_is_announced_once_per_backend(caplog):
    """512 sentences took 17.7 s uncompiled and 99.6 s through qattn on a CPU, with no word
    said: the reference path is said to be slow once per backend (not once per graph), and
    only when a rewritten site runs on it."""
    x = torch.randn(1, 2, 8, 16)
    with caplog.at_level(logging.WARNING, logger="qattn_compile"):
        be = qattn_compile.backend({"qattn": 1, "default": "flash"}, compiler="eager")
        torch.compile(TwoGraphs(), backend=be)(x)
    assert [r.execution for r in be.site_reports] == ["reference", "reference"]
    assert caplog.text.count("CPU reference path") == 1, caplog.text
    assert "slower than the original attention" in caplog.text and "default: none" in caplog.text
    caplog.clear()
    _compat.reset_dynamo()
    with caplog.at_level(logging.WARNING, logger="qattn_compile"):
        torch.compile(TwoGraphs(), backend=qattn_compile.backend({"qattn": 1, "default": "none"},
                                                                  compiler="eager"))(x)
    assert "CPU reference path" not in caplog.text


def test_an_options_dict_changed_between_compiles_gets_a_new_backend():
    """One dict reused (and changed) for a second torch.compile: the second compile follows
    the new contents, not the backend built from the first."""
    q = torch.randn(1, 2, 8, 16)
    options = {"compiler": "eager", "policy": {"qattn": 1, "default": "flash"}}
    torch.compile(Attention(), backend="qattn", options=options)(q)
    first = qattn_compile.last_backend()
    options["policy"] = {"qattn": 1, "default": "none"}
    _compat.reset_dynamo()
    torch.compile(Attention(), backend="qattn", options=options)(q)
    second = qattn_compile.last_backend()
    assert second is not first
    assert [(r.status, r.preset) for r in first.site_reports] == [(REWRITTEN, "flash")]
    assert [(r.status, r.preset) for r in second.site_reports] == [(LEFT_ALONE, "none")]


def test_mode_among_the_options():
    """torch.compile refuses mode= next to options=: the mode can be an option instead."""
    q = torch.randn(1, 2, 8, 16)
    options = {"compiler": "eager", "mode": "max-autotune-no-cudagraphs"}
    torch.compile(Attention(), backend="qattn", options=options)(q)
    be = qattn_compile.last_backend()
    assert be.options.mode == "max-autotune-no-cudagraphs" and be.options.autotune is True
    assert qattn_compile.backend(mode="reduce-overhead").options.mode == "reduce-overhead"


def test_compiles_without_options_share_a_backend_per_mode():
    q = torch.randn(1, 2, 8, 16)
    torch.compile(Attention(), backend="qattn")(q)
    plain = qattn_compile.last_backend()
    torch.compile(Attention(), backend="qattn", mode="max-autotune-no-cudagraphs")(q)
    tuned = qattn_compile.last_backend()
    assert tuned is not plain and tuned.options.mode == "max-autotune-no-cudagraphs"
    assert tuned.options.autotune is True and plain.options.autotune is None
    # a second plain compile reuses the first plain backend: its reports gather both sites
    _compat.reset_dynamo()  # else dynamo reuses the first compile's frame and compiles nothing
    torch.compile(Attention(), backend="qattn")(q)
    assert qattn_compile.last_backend() is plain and len(plain.site_reports) == 2


def test_a_cached_graph_is_not_served_to_another_qattn_version(tmp_path, monkeypatch):
    """torch's on-disk compile caches key a graph by its nodes: a rewritten site is one node
    naming our op, whatever code serves it. The backend adds the package's source digest to
    the key, so a compile by other qattn sources misses the cache (and the same sources hit
    it, which shows the cache is on in this test)."""
    from torch._dynamo.utils import counters

    from qattn_compile import dynamo_backend

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    q = torch.randn(1, 2, 8, 16)
    policy = {"qattn": 1, "default": "sage2_8b"}

    def cache_hits_and_misses():
        _compat.reset_dynamo()
        counters.clear()
        be = qattn_compile.backend(policy)
        torch.compile(Attention(), backend=be)(q)
        assert [r.status for r in be.site_reports] == [REWRITTEN]
        return counters["aot_autograd"]["autograd_cache_hit"], \
            counters["aot_autograd"]["autograd_cache_miss"]

    assert cache_hits_and_misses() == (0, 1)
    assert cache_hits_and_misses() == (1, 0)
    monkeypatch.setattr(dynamo_backend, "package_digest", lambda: "another-version")
    assert cache_hits_and_misses() == (0, 1)


@pytest.mark.parametrize("policy", ["", {}])
def test_an_empty_policy_is_an_error_not_the_default(policy):
    with pytest.raises(qattn_compile.PolicyError):
        qattn_compile.backend(policy=policy)


@pytest.mark.slow
@pytest.mark.parametrize("make_bundle", [tiny_llama, tiny_bert], ids=["llama", "bert"])
def test_inductor_compiles_rewritten_graph(make_bundle):
    bundle = make_bundle()
    reference = bundle.run()
    be, out = _compile_run(bundle, policy={"qattn": 1, "default": "sage2_8b"})
    assert all(r.status == REWRITTEN for r in be.site_reports) and len(be.site_reports) == 2
    assert compare(out, reference)["cos"] > DEFAULT_COS_FLOOR


def test_graph_op_choice_on_cpu():
    """CPU sites get the custom op (the reference); the CUDA side is
    ``test_lowering_gpu.py::test_cuda_sites_get_the_triton_op``."""
    from qattn_compile import ops

    assert ops.graph_op("reference") is torch.ops.qattn.attention.default
    assert ops.execution_path("cpu") == ("reference", None)


@pytest.mark.parametrize("heads_inside", [False, True])
def test_custom_op_output_is_contiguous_whatever_q_layout(heads_inside):
    """The custom op (CPU sites) returns a contiguous output, as its fake says: Inductor may
    hand it a q stored otherwise than the fake q was (an output following q's layout failed
    Inductor's stride check in the compiled tiny Llama)."""
    from qattn_compile.kernels.layout import heads_inside_tokens

    torch.manual_seed(0)
    q = torch.randn(2, 37, 4, 32)
    q = q.transpose(1, 2) if heads_inside else q.permute(0, 2, 1, 3).contiguous()
    k, v = torch.randn(2, 2, 37, 32), torch.randn(2, 2, 37, 32)
    args = (q, k, v, None, True, None, "flash", "{}")
    out = torch.ops.qattn.attention(*args)
    assert heads_inside_tokens(q) == heads_inside and out.is_contiguous()
    torch.library.opcheck(torch.ops.qattn.attention.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_tiny_llama_causal_mask_is_served_as_is_causal():
    """transformers' materialized causal+padding mask: the report says its causal part became
    ``is_causal`` (the explain table too), and the output is still exact."""
    from qattn_compile.debug.table import site_row

    bundle = tiny_llama()
    reference = bundle.run()
    be, out = _compile_run(bundle, policy={"qattn": 1, "default": "flash"}, compiler="eager")
    assert [(r.mask_kind, r.causal_fast_path, r.causal_from_mask) for r in be.site_reports] == [
        ("causal+padding", True, True)
    ] * 2
    assert all("causal+padding (→ is_causal)" in site_row(r) for r in be.site_reports)
    assert compare(out, reference)["cos"] > COS_FLOOR["flash"]


def test_progress_step_reports_a_failure_as_such():
    """A CLI step that raises says "failed after", not "done in", before the error."""
    import io

    from qattn_compile.progress import step

    out = io.StringIO()
    with step("loading", stream=out):
        pass
    with pytest.raises(ValueError), step("parsing", stream=out):
        raise ValueError("bad")
    lines = out.getvalue().splitlines()
    assert lines[0] == "loading ..." and lines[1].startswith("   done in ")
    assert lines[2] == "parsing ..." and lines[3].startswith("   failed after ")
