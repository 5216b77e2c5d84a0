"""The debugging tools: graph diff (text, HTML), explain, provenance, torch logging."""

import argparse
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModel

from qattn_compile import _compat
from qattn_compile.debug import ARTIFACT_NAME, capture_graphs, explain, graph_diff, kernel_variant
from qattn_compile._compat import structured_trace_logger
from qattn_compile.cli import main
from qattn_compile.debug.commands import STRICT_EXIT, add_subcommands
from qattn_compile.debug.explain import Explanation
from qattn_compile.debug.table import format_shapes
from qattn_compile.models import tiny_llama
from qattn_compile.policy import load_policy
from qattn_compile.report import FALLBACK, LEFT_ALONE, REWRITTEN, SiteReport
from qattn_compile.rewrite import rewrite_attention
from qattn_compile.specs import ModelSpecError, load_spec, random_inputs, tiny_config
from qattn_compile.zoo import ZOO
from qattn_compile.zoo import attention_modules as zoo_attention_modules

QATTN_OP = "torch.ops.qattn.attention.default("
SDPA_CALL = "scaled_dot_product_attention("
# rules[2] has a typo in its match string; rules[0] and rules[1] match tiny-llama's two layers.
TYPO_POLICY = textwrap.dedent(
    r"""
    qattn: 1
    default: none
    rules:
      - match: "*self_attn"
        preset: int_flash
      - match: 're:model\.layers\.1\.self_attn'
        preset: none
      - match: "*self_atn"
        preset: fp8
    """
)
TYPO_LINE = ("rules[2] (`*self_atn`) matched no site; closest sites: "
             "`model.layers.0.self_attn`, `model.layers.1.self_attn`")
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
)


class _SelfAttention(nn.Module):
    """[B, H, L, D] SDPA: a site qattn can serve."""

    def forward(self, x):
        return F.scaled_dot_product_attention(x, x, x, is_causal=True)


class _DropoutAttention(nn.Module):
    """SDPA with dropout: a site the policy chooses but qattn cannot serve (it falls back)."""

    def forward(self, x):
        return F.scaled_dot_product_attention(x, x, x, dropout_p=0.5)


class TwoSites(nn.Module):
    """One served site (``attn``) and one that falls back (``dropout_attn``)."""

    def __init__(self):
        super().__init__()
        self.attn = _SelfAttention()
        self.dropout_attn = _DropoutAttention()

    def forward(self, x):
        return self.dropout_attn(self.attn(x))


def two_sites():
    """MODEL_SPEC ``test_debug:two_sites``."""
    return TwoSites(), (torch.randn(2, 4, 8, 16),)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    yield
    _compat.reset_dynamo()


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


@pytest.fixture(scope="module")
def typo_diff(llama):
    return graph_diff(llama.model, llama.kwargs, TYPO_POLICY, title="tiny-llama")


@pytest.fixture
def typo_policy_file(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text(TYPO_POLICY)
    return str(path)


def run_cli(argv: list[str]) -> int:
    """Run a ``qattn`` subcommand the way ``qattn_compile.cli`` dispatches it."""
    parser = argparse.ArgumentParser(prog="qattn")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def code_lines(code: str) -> list[str]:
    """The statements of readable graph code (comments dropped: they quote the source)."""
    return [line for line in code.splitlines() if not line.lstrip().startswith("#")]


# ----------------------------------------------------------------------------- graph diff


def test_diff_replaces_sdpa_with_the_qattn_op(llama):
    diff = graph_diff(llama.model, llama.kwargs)  # the bundled policy: every site rewritten
    assert [r.status for r in diff.reports] == [REWRITTEN, REWRITTEN]
    (graph,) = diff.capture.graphs
    before, after = code_lines(graph.code_before), code_lines(graph.code_after)
    assert sum(SDPA_CALL in line for line in before) == 2
    assert not any(SDPA_CALL in line for line in after)
    assert sum(QATTN_OP in line for line in after) == 2
    removed = [line for line in diff.text.splitlines() if line.startswith("-") and SDPA_CALL in line]
    added = [line for line in diff.text.splitlines() if line.startswith("+") and QATTN_OP in line]
    assert len(removed) == len(added) == 2
    assert diff.text.startswith("--- graph 0 (dynamo, before qattn)\n+++ graph 0 (after qattn rewrite)")
    assert str(diff) == diff.text


def test_diff_keeps_left_alone_sites_and_shows_provenance(typo_diff):
    (graph,) = typo_diff.capture.graphs
    assert [r.status for r in typo_diff.reports] == [REWRITTEN, LEFT_ALONE]
    after = code_lines(graph.code_after)
    assert sum(SDPA_CALL in line for line in after) == 1
    assert sum(QATTN_OP in line and "'int_flash'" in line for line in after) == 1
    (added,) = [line for line in typo_diff.text.splitlines() if line.startswith("+") and QATTN_OP in line]
    rule = typo_diff.reports[0].rule
    assert added.endswith(f"  # qattn: site model.layers.0.self_attn | {rule} | pattern sdpa | preset int_flash")


def test_diff_hunks_name_their_site(llama):
    """Each hunk header names its site: the one whose node it changes, else the next one
    down (a hunk removing the causal mask the ops no longer read)."""
    diff = graph_diff(llama.model, llama.kwargs)
    headers = [line for line in diff.text.splitlines() if line.startswith("@@")]
    at_site = [h.split(" @@ ", 1)[1] for h in headers if " @@ site " in h]
    assert at_site == [f"site model.layers.{i}.self_attn (sdpa -> sage2_8b)" for i in (0, 1)]
    others = [h.split(" @@ ", 1)[1] for h in headers if " @@ site " not in h]
    assert others and set(others) <= {"before site model.layers.0.self_attn", "before site model.layers.1.self_attn"}
    # the site's hunk holds its op's line
    hunks = diff.text.split("\n@@")
    for i in (0, 1):
        (hunk,) = [h for h in hunks if f" @@ site model.layers.{i}.self_attn" in h.splitlines()[0]]
        assert f"# qattn: site model.layers.{i}.self_attn |" in hunk


def test_tiny_config_shrinks_every_sub_config():
    """A vision-language model type is tiny in its text and vision towers too (they kept
    their full sizes: `explain llava` ran out of memory), per-layer lists cut to the layers."""
    llava = tiny_config("llava")
    for sub in (llava.text_config, llava.vision_config):
        assert (sub.hidden_size, sub.num_hidden_layers, sub.num_attention_heads) == (64, 2, 4)
    gemma3 = tiny_config("gemma3").text_config
    assert gemma3.num_hidden_layers == len(gemma3.layer_types) == 2 and gemma3.head_dim == 16


def test_diff_of_hand_written_attention_anchors_each_site():
    config = tiny_config("llama")
    model = AutoModel.from_config(config, attn_implementation="eager").eval()
    diff = graph_diff(model, random_inputs(model, config), title="eager llama")
    assert [(r.pattern, r.status) for r in diff.reports] == [("matmul_softmax", REWRITTEN)] * 2
    lines = diff.text.splitlines()
    assert any(line.startswith("-") and "torch.nn.functional.softmax(" in line for line in lines)
    assert sum(line.startswith("+") and QATTN_OP in line for line in lines) == 2
    page = diff.html()
    for n, report in enumerate(diff.reports):
        row = re.search(rf'<tr class="site" id="site-0-{n}">(.*?)</tr>', page, re.S).group(1)
        assert f"<strong>{report.fqn}</strong>" in row and "modeling_llama.py:" in row


def test_every_node_qattn_creates_carries_provenance(llama):
    created = []

    def backend(gm, example_inputs):
        rewrite_attention(gm, load_policy(TYPO_POLICY))
        created.extend(n for n in gm.graph.nodes if n.op == "call_function" and "qattn" in str(n.target))
        return gm.forward

    _compat.reset_dynamo()
    llama.run(torch.compile(llama.model, backend=backend))
    assert len(created) == 1
    provenance = created[0].meta["qattn"]
    assert (provenance["fqn"], provenance["pattern"], provenance["preset"]) == (
        "model.layers.0.self_attn", "sdpa", "int_flash")
    assert "*self_attn" in provenance["rule"]


def test_html_is_self_contained_with_an_anchor_per_site(typo_diff):
    page = typo_diff.html()
    assert page.startswith("<!DOCTYPE html>")
    assert not re.search(r"<script|<link|\ssrc=|https?://", page)
    for n, report in enumerate(typo_diff.reports):
        row = re.search(rf'<tr class="site" id="site-0-{n}">(.*?)</tr>', page, re.S)
        assert row, f"no anchor for site {n}"
        path, _, line = report.source.rpartition(":")
        assert f"<strong>{report.fqn}</strong>" in row.group(1)
        assert f"{os.path.basename(path)}:{line}" in row.group(1)
        assert f'href="file://{path}#L{line}"' in row.group(1)
        assert f'href="#site-0-{n}"' in page  # the sites table links to the anchor
    assert TYPO_LINE in page
    assert page.count('class="code ins"') >= 2 and page.count('class="code del"') >= 2


# ----------------------------------------------------------------------------- explain


def test_explain_table_has_one_row_per_site(typo_diff):
    explanation = Explanation(typo_diff.capture)  # explain() is this capture, not rendered
    lines = explanation.format().splitlines()
    header, rule = lines[0], lines[1]
    assert header.split()[:3] == ["site", "(module", "FQN)"]
    assert set(rule) == {"-", " "}
    rows = [next(line for line in lines if line.startswith(r.fqn + " ")) for r in explanation.reports]
    for row, report in zip(rows, explanation.reports):
        cells = row.split("  ")
        for cell in ("LlamaAttention", "sdpa", report.mask_kind, str(report.gqa_group), report.rule, report.preset):
            assert cell in cells or f" {cell} " in row
        assert format_shapes(report.shapes) in row
    assert "*self_attn" in rows[0]
    assert rows[0].endswith(
        "int_flash  reference (CPU) int_flash q=int8/token k=int8/128tok p=int8/tile v=int8/128tok smooth=k")
    assert re.search(r"\snone\s+left alone: ", rows[1])
    assert "1 of 2 attention site(s) rewritten, 1 left alone, 0 fell back" in explanation.format()
    assert explanation.unmatched_rules() == [TYPO_LINE]
    assert explanation.problems() == [TYPO_LINE]


def test_cli_explain_typo_policy_strict_exit(typo_policy_file, capsys):
    assert run_cli(["explain", "tiny-llama", "--policy", typo_policy_file]) == 0
    out = capsys.readouterr().out
    assert "rules that matched nothing:\n  " + TYPO_LINE in out
    assert run_cli(["explain", "tiny-llama", "--policy", typo_policy_file, "--strict"]) == STRICT_EXIT
    assert TYPO_LINE in capsys.readouterr().out


def test_cli_explain_strict_fails_on_a_fallback_site(tmp_path, capsys):
    policy = tmp_path / "all.yaml"
    policy.write_text("qattn: 1\nrules:\n  - match: '*attn'\n    preset: turbo\n")
    spec = f"{__name__}:two_sites"
    assert run_cli(["explain", spec, "--policy", str(policy)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^attn\s+_SelfAttention\s+sdpa\s.*causal.*reference \(CPU\) turbo", out, re.M)
    assert re.search(r"^dropout_attn\s+_DropoutAttention\s+sdpa\s.*fallback: dropout_p=0.5", out, re.M)
    assert "every rule matched at least one site" in out
    assert run_cli(["explain", spec, "--policy", str(policy), "--strict"]) == STRICT_EXIT
    assert "1 problem(s)" in capsys.readouterr().err


def test_cli_verbose_flag_before_or_after_the_subcommand():
    from qattn_compile.cli import build_parser

    parse = build_parser().parse_args
    for command in (["explain", "tiny-llama"], ["tune", "tiny-llama", "--budget", "0.99", "-o", "t.yaml"], ["demo"]):
        assert parse(["-v", *command]).verbose and parse([*command, "-v"]).verbose
        assert parse([*command, "--verbose"]).verbose and not parse(command).verbose


def test_cli_diff_writes_text_and_html(tmp_path, typo_policy_file, capsys):
    out_html = tmp_path / "diff.html"
    assert run_cli(["diff", "tiny-llama", "--policy", typo_policy_file, "--html", str(out_html)]) == 0
    captured = capsys.readouterr()
    assert "+        attention_default" in captured.out and QATTN_OP in captured.out
    assert "warning: " + TYPO_LINE in captured.err
    assert 'id="site-0-1"' in out_html.read_text()


def test_kernel_variant():
    report = SiteReport(
        fqn="l.0.attn", module_class="A", pattern="sdpa", source=None, shapes={}, dtype="float16",
        mask_kind="none", gqa_group=1, preset="int_flash",
        options={"v_granularity": "tensor", "p_scale": "row", "k_granularity": "token", "smooth_k": False},
        rule="default", rule_index=None, status=REWRITTEN, reason="", execution="triton",
    )
    assert kernel_variant(report) == "triton int_flash qk=int8/token p=int8/row v=int8/tensor smooth=off"
    report.options = {"v_granularity": "tensor", "smooth_k": True, "p_scale": "tile"}
    assert kernel_variant(report) == (  # K's granularity left out: the default, 128 tokens
        "triton int_flash q=int8/token k=int8/128tok p=int8/tile v=int8/tensor smooth=k")
    report.preset, report.options = "sage2_4b", {"qk_granularity": "block", "smooth_k": True, "smooth_q": False}
    assert kernel_variant(report) == (
        "triton sage2_4b q=int4/128tok k=int4/64tok p=fp8 v=fp8/channel smooth=k")
    report.options = {**report.options, "pv": "fp16", "qk_granularity": "token"}
    assert kernel_variant(report) == "triton sage2_4b qk=int4/token p=fp16 v=fp16 smooth=k"
    report.preset, report.options = "fp8", {}  # the default `block`: Q per token, K/V per 128
    assert kernel_variant(report) == "triton fp8 q=fp8/token kv=fp8/256tok p=fp8"
    report.options = {"granularity": "tensor"}
    assert kernel_variant(report) == "triton fp8 qkv=fp8/tensor p=fp8"
    report.preset, report.options = "turbo", {}  # options a report leaves out are the defaults
    assert kernel_variant(report) == "triton turbo q=int8/128tok kv=int8/64tok p=int8/tile exp=sas (threshold -6.0)"
    report.status = FALLBACK
    assert kernel_variant(report) == "-"


# ----------------------------------------------------------------------------- MODEL_SPEC


def test_spec_model_type_builds_a_tiny_random_model():
    assert "gemma" not in ZOO
    bundle = load_spec("gemma")  # a model type outside the zoo
    config = bundle.model.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads) == (64, 2, 2)
    assert bundle.kwargs["input_ids"].shape == (2, 16)
    assert bundle.kwargs["attention_mask"][0, -1] == 0
    # a decoder-only LM type is built as its causal LM, as the zoo's llama is: the site names a
    # policy written from `explain`/`tune` on it matches are those of GemmaForCausalLM
    assert (type(bundle.model).__name__, bundle.kind) == ("GemmaForCausalLM", "decoder")
    assert [r.fqn for r in explain(bundle.model, bundle.kwargs).reports] == [
        f"model.layers.{i}.self_attn" for i in range(2)]
    assert type(load_spec("t5").model).__name__ == "T5Model"  # encoder-decoders: the bare model


def test_spec_config_is_built_as_its_architectures_class(tmp_path):
    """A checkpoint's config.json names the class it was saved from; the spec builds that one,
    so that `qattn tune <config.json>` writes rules for the model the user loads
    (GPT2LMHeadModel's `transformer.h.0.attn`, not GPT2Model's `h.0.attn`)."""
    config = load_spec("gpt2").model.config
    config.architectures = ["GPT2LMHeadModel"]
    config.save_pretrained(tmp_path / "lm")
    config.architectures = ["GPT2Model"]
    config.save_pretrained(tmp_path / "bare")
    lm, bare = load_spec(str(tmp_path / "lm" / "config.json")), load_spec(str(tmp_path / "bare"))
    assert (type(lm.model).__name__, lm.kind) == ("GPT2LMHeadModel", "decoder")
    assert (type(bare.model).__name__, bare.kind) == ("GPT2Model", "encoder")
    assert explain(lm.model, lm.kwargs).reports[0].fqn == "transformer.h.0.attn"
    assert explain(bare.model, bare.kwargs).reports[0].fqn == "h.0.attn"
    # a name that is no PyTorch model of this config, or a head random inputs may not fit
    # (sequence classification wants a pad token), falls back to the model type's class
    for name in ("TFGPT2LMHeadModel", "LlamaForCausalLM", "GPT2Config", "GPT2ForSequenceClassification",
                 "NoSuchModel"):
        config.architectures = [name]
        config.save_pretrained(tmp_path / name)
        assert type(load_spec(str(tmp_path / name)).model).__name__ == "GPT2LMHeadModel", name


def test_spec_config_path_may_start_with_a_tilde(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    load_spec("bert").model.config.save_pretrained(tmp_path / "cfg")
    assert type(load_spec("~/cfg/config.json").model).__name__ == "BertModel"


def test_spec_path_that_does_not_exist_is_named_as_such(tmp_path):
    for spec in (str(tmp_path / "nowhere" / "config.json"), "./nowhere/config.json", "missing.json"):
        with pytest.raises(ModelSpecError, match=f"MODEL_SPEC '{re.escape(spec)}': no such file or directory"):
            load_spec(spec)


def test_spec_callable_in_the_working_directory(tmp_path, monkeypatch):
    """The `qattn` console script does not put the working directory on sys.path (`python -m`
    does); a `module:callable` there is found all the same."""
    (tmp_path / "my_models_in_cwd.py").write_text(
        "import torch\n"
        "def make():\n    return torch.nn.Linear(2, 2), (torch.randn(1, 2),)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "my_models_in_cwd", raising=False)
    bundle = load_spec("my_models_in_cwd:make")
    assert isinstance(bundle.model, torch.nn.Linear) and bundle.args[0].shape == (1, 2)
    assert sys.path[-1] == str(tmp_path)  # last: a file there shadows no installed module
    sys.path.remove(str(tmp_path))
    with pytest.raises(ModelSpecError, match="No module named 'not_in_cwd_either'"):
        load_spec("not_in_cwd_either:make")
    assert str(tmp_path) not in sys.path  # not left behind by a failed lookup


def test_spec_config_path_and_explain_a_bert(tmp_path):
    load_spec("bert").model.config.save_pretrained(tmp_path)
    for spec in (str(tmp_path), str(tmp_path / "config.json")):
        assert load_spec(spec).model.config.model_type == "bert"
    bundle = load_spec(str(tmp_path))
    reports = explain(bundle.model, bundle.kwargs).reports
    assert [r.fqn for r in reports] == [f"encoder.layer.{i}.attention.self" for i in range(2)]
    assert all(r.status == REWRITTEN for r in reports)


def test_spec_errors_name_the_accepted_forms():
    with pytest.raises(ModelSpecError, match="Hugging Face model type"):
        load_spec("no-such-model")
    with pytest.raises(ModelSpecError, match="module:callable"):
        load_spec("no_such_module_xyz:fn")
    for bad in (":fn", ".relative_xyz:fn"):  # no module name, a relative import
        with pytest.raises(ModelSpecError, match=f"MODEL_SPEC '{bad}': cannot load module:callable"):
            load_spec(bad)
    with pytest.raises(ModelSpecError, match="sep is a str, not a callable"):
        load_spec("os:sep")
    with pytest.raises(ModelSpecError, match="zoo model 'llama' takes .*eager.*'flash'"):
        load_spec("llama:flash")


def test_spec_callable_must_return_model_and_inputs(tmp_path, monkeypatch, capsys):
    (tmp_path / "user_models_xyz.py").write_text(
        "import torch\n"
        "def just_model():\n    return torch.nn.Linear(2, 2)\n"
        "def broken():\n    raise RuntimeError('bug in the user callable')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModelSpecError, match=r"just_model\(\) must return \(model, example_inputs\)"):
        load_spec("user_models_xyz:just_model")
    with pytest.raises(RuntimeError, match="bug in the user callable"):  # the user's own error
        load_spec("user_models_xyz:broken")
    # every command goes through the same loader and reports without a traceback
    assert main(["demo", "--model", "no-such-model", "--compiler", "eager"]) == 2
    assert "qattn: error: unknown MODEL_SPEC 'no-such-model'" in capsys.readouterr().err


# ----------------------------------------------------------------------------- torch logging


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_site_report_is_a_trace_structured_artifact(llama):
    handler = _Records()
    trace_log = structured_trace_logger()
    trace_log.addHandler(handler)
    try:
        capture_graphs(llama.model, llama.kwargs, TYPO_POLICY)
    finally:
        trace_log.removeHandler(handler)
    ours = [r for r in handler.records if r.metadata.get("artifact", {}).get("name") == ARTIFACT_NAME]
    assert len(ours) == 1
    assert ours[0].metadata["artifact"]["encoding"] == "json"
    assert "frame_id" in ours[0].metadata  # tlparse files it under the compiled frame
    payload = json.loads(ours[0].payload)
    assert [s["fqn"] for s in payload["sites"]] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert payload["sites"][0]["kernel_variant"].startswith("reference (CPU) int_flash")
    assert payload["unmatched_rules"] == [TYPO_LINE]


def test_torch_logs_plus_qattn_shows_the_report(tmp_path):
    """``TORCH_LOGS=+qattn``, with ``register_torch_logs`` as a ``torch.backends`` entry point
    (declared here by a throw-away dist-info, as the package's pyproject would)."""
    dist = tmp_path / "qattn_logs_probe-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: qattn-logs-probe\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text("[torch.backends]\nqattn = qattn_compile._logging:register_torch_logs\n")
    code = (
        "import torch\n"
        "from qattn_compile.debug import capture_graphs\n"
        "capture_graphs(lambda q: torch.nn.functional.scaled_dot_product_attention(q, q, q),"
        " (torch.randn(1, 2, 8, 16),))\n"
    )
    env = dict(os.environ, TORCH_LOGS="+qattn", PYTHONPATH=os.pathsep.join([str(tmp_path), os.getcwd()]))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "qattn site report, graph 0:" in result.stderr
    assert "reference (CPU) sage2_8b" in result.stderr


# ----------------------------------------------------------------------------- real browser


@pytest.mark.skipif(
    shutil.which("chromium") is None,
    reason="chromium is not on PATH: `apt-get install -y chromium chromium-driver` "
    "to check the HTML graph diff in a real browser",
)
def test_html_renders_in_headless_chromium(typo_diff, tmp_path):
    page = typo_diff.write_html(tmp_path / "diff.html")
    shot = tmp_path / "diff.png"
    base = ["chromium", *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1400,900"]
    subprocess.run([*base, f"--screenshot={shot}", page.as_uri()], check=True, capture_output=True, timeout=120)
    data = shot.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 20_000  # a blank page is a few kB
    dom = subprocess.run([*base, "--dump-dom", page.as_uri()], check=True, capture_output=True,
                         text=True, timeout=120).stdout
    assert 'id="site-0-0"' in dom and 'id="site-0-1"' in dom and TYPO_LINE in dom


@pytest.mark.parametrize("name", sorted(ZOO))
def test_cli_explain_lists_every_zoo_site(name, capsys):
    """`qattn explain NAME` on every zoo architecture: one rewritten row per attention module."""
    entry = ZOO[name]
    expected = zoo_attention_modules(entry.build("sdpa"), entry)
    assert run_cli(["explain", name, "--strict"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.split(" ", 1)[0] in expected]
    assert sorted(line.split(" ", 1)[0] for line in rows) == sorted(expected)
    assert all("reference (CPU) sage2_8b" in row for row in rows)
    assert f"{len(expected)} of {len(expected)} attention site(s) rewritten" in out


def test_cli_model_that_fails_on_its_inputs_is_a_clear_error(capsys):
    assert main(["explain", "clip"]) == 2
    err = capsys.readouterr().err
    assert "MODEL_SPEC 'clip' (CLIPModel) failed on its example inputs" in err
    assert "Traceback" not in err


def test_capture_pairs_sites_that_feed_each_other():
    """Two rewritten sites where the second reads the first's op output directly: each keeps
    its node after the rewrite (the diff page marks both)."""
    chained = nn.Sequential(_SelfAttention(), _SelfAttention())
    capture = capture_graphs(chained, (torch.randn(1, 2, 8, 16),), {"qattn": 1, "default": "flash"})
    (graph,) = capture.graphs
    assert [(s.report.fqn, s.report.status) for s in graph.sites] == [("0", REWRITTEN), ("1", REWRITTEN)]
    assert all(s.node_after is not None for s in graph.sites), graph.sites
    assert graph.sites[0].node_after != graph.sites[1].node_after

