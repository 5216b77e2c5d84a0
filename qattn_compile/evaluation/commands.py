"""The ``qattn eval``, ``qattn calibrate`` and ``qattn tune`` subcommands.

Wire them into the ``qattn`` parser with :func:`add_subcommands` (each sets ``func``)::

    qattn eval MODEL_SPEC [--policy p.yaml] [--presets all|a,b] [--calibration scales.pt]
               [--inputs FILE|random] [--json out.json] [--png out.png]
    qattn calibrate MODEL_SPEC [--inputs FILE|random] -o scales.pt
    qattn tune MODEL_SPEC --budget 0.999 -o policy.yaml [--ranking ranking.json|measure]
               [--calibration scales.pt]

What the numbers mean: :mod:`qattn_compile.evaluation.site_eval` (site error vs exact fp64
attention on the same inputs; end-to-end vs the uncompiled fp32 model) and
:mod:`qattn_compile.evaluation.tuning` (the budget, the speed ranking).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from ..errors import QattnError
from ..policy import DEFAULT_POLICY_PATH, load_policy
from ..presets import PRESET_NAMES, QUANTIZED_PRESETS
from ..progress import step
from ..scales import resolve_calibration_path, save_scales, static_options
from ..specs import SPEC_HELP
from . import png
from .calibrate import calibrate_capture, format_scales
from .inputs import load_inputs
from .site_eval import Evaluator, RunResult, format_e2e, format_matrix, format_run
from .tuning import (
    DEFAULT_RANKING,
    DEFAULT_RANKING_SOURCE,
    load_ranking,
    measure_ranking,
    meets,
    tune,
)

ALL_PRESETS = ("flash", *QUANTIZED_PRESETS)
STATIC_LABEL = "fmha_int8:static"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
PLOT_METRICS = ("rel_l1", "1-cos", "rmse")
PLOT_FLOOR = 1e-6
"""Errors below this (e.g. ``flash`` in fp32, ~1e-7) are drawn on the plot's bottom line."""


# --------------------------------------------------------------------------- shared


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (checked before any model is loaded)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _ranking_spec(text: str) -> str:
    """argparse type of ``--ranking``: a file, ``measure`` or ``measure:SEQ`` (SEQ >= 1)."""
    kind, colon, seq = text.partition(":")
    if kind == "measure" and colon:
        _positive_int(seq)
    return text


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL_SPEC", help=SPEC_HELP)
    p.add_argument("--inputs", metavar="FILE|random",
                   help="text file, one sentence per line (tokenized with the model's tokenizer); "
                        "'random' for random tokens. Default: the bundled sentences for MiniLM, "
                        "else the model's own example inputs (random tokens for the tiny models)")
    p.add_argument("--batch-size", type=_positive_int, default=32,
                   help="sentences per batch (default 32)")
    p.add_argument("--max-samples", type=_positive_int, default=256,
                   help="sentences used at most (default 256)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    p.add_argument("--dtype", choices=tuple(DTYPES),
                   help="dtype of the quantized runs (default: float16 on cuda, float32 on cpu); "
                        "the reference is always the uncompiled float32 model")
    p.add_argument("--json", metavar="PATH", help="write the full report as JSON")


def _evaluator(args, *, fp_capture: bool) -> Evaluator:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise QattnError("--device cuda: this machine has no CUDA device (use --device cpu)")
    with step(f"loading {args.model} and its inputs"):
        inputs = load_inputs(args.model, args.inputs, batch_size=args.batch_size,
                             max_samples=args.max_samples)
    print(f"model: {args.model} ({inputs.kind})")
    print(f"inputs: {inputs.description}")
    for note in inputs.notes:
        print(f"note: {note}")
    what = "reference (uncompiled fp32)" + (" and full-precision site capture" if fp_capture else "")
    with step(f"running the {what}"):
        ev = Evaluator(inputs, device=args.device, dtype=DTYPES.get(args.dtype or ""),
                       fp_capture=fp_capture)
    print(f"compared end to end: the model's {ev.output}")
    path = "Triton kernels" if ev.device.type == "cuda" else "CPU reference path"
    print(f"device: {ev.device.type} ({path}), quantized runs in {str(ev.dtype).replace('torch.', '')}")
    if ev.dtype != torch.float32:
        with step(f"running with every site left alone in {ev.dtype} (the dtype's own error)"):
            floor = ev.dtype_floor()
        print(f"dtype floor: every site left alone, {format_e2e(floor.e2e)}")
    return ev


def _header(ev: Evaluator, args) -> dict:
    return {"model": args.model, "kind": ev.kind, "output": ev.output, "inputs": ev.inputs.description,
            "input_source": ev.inputs.source, "device": str(ev.device),
            "dtype": str(ev.dtype).replace("torch.", "")}


def _write_json(path: str | None, payload: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2, default=str))
        print(f"wrote {path}")


def _plot_value(site, metric: str):
    if site.status != "rewritten" or math.isnan(site.cos):
        return None
    return 1.0 - site.cos if metric == "1-cos" else getattr(site, metric)


SITE_LABEL_CHARS = 40
"""A site's label on the plot is at most this long (longer ones keep their end)."""


def site_labels(keys: list[str], max_chars: int = SITE_LABEL_CHARS) -> list[str]:
    """Short x-axis labels of site keys (module FQNs): the last ``d`` dotted parts of every
    key, ``d`` (at least 3) the fewest that still tell the keys apart
    (``model.layers.11.self_attn`` -> ``layers.11.self_attn``; an encoder-decoder's keep
    ``encoder.`` / ``decoder.``); a label longer than ``max_chars`` keeps its last
    ``max_chars - 2`` characters after ``..``."""
    parts = [key.split(".") for key in keys]
    deepest = max((len(p) for p in parts), default=0)
    depth = next((d for d in range(3, deepest) if len({".".join(p[-d:]) for p in parts}) == len(set(keys))),
                 deepest)
    labels = [".".join(p[-depth:]) for p in parts]
    return [label if len(label) <= max_chars else ".." + label[2 - max_chars:] for label in labels]


def write_plot(path: str, runs: list[RunResult], title: str, metric: str = "rel_l1") -> None:
    """PNG: the error of every run at every site (x = the sites in execution order, labelled
    by :func:`site_labels`)."""
    keys = [s.key for s in runs[0].sites] if runs else []
    series = {}
    for run in runs:
        by_key = {s.key: s for s in run.sites}
        series[run.label] = [_plot_value(by_key[k], metric) if k in by_key else None for k in keys]
    chart = png.line_chart(
        series, site_labels(keys), title=title,
        y_label=f"{metric} vs exact (log)", x_label="attention site (execution order)",
        floor=PLOT_FLOOR,
    )
    png.write_png(path, chart)
    print(f"wrote {path}")


def format_static_vs_dynamic(dynamic: RunResult, static: RunResult, calibration: str) -> str:
    """Side-by-side site and end-to-end error of fmha_int8 with dynamic and calibrated α."""
    width = max([len(s.key) for s in dynamic.sites] + [len("end to end")])
    head = (f"{'site':<{width}}  {'dynamic cos':>12} {'static cos':>12}  "
            f"{'dynamic rel-L1':>14} {'static rel-L1':>14}")
    lines = [f"fmha_int8: calibrated static α ({calibration}) vs dynamic α (amax per call, batch "
             "and head)", head, "-" * len(head)]
    by_key = {s.key: s for s in static.sites}

    def cells(site, spec_cos="12.6f", spec_l1="14.5f"):
        if site is None or site.status != "rewritten":
            word = site.status if site is not None else "-"
            return f"{word:>12}", f"{word:>14}"
        return format(site.cos, spec_cos), format(site.rel_l1, spec_l1)

    for d in dynamic.sites:
        (dc, dl), (sc, sl) = cells(d), cells(by_key.get(d.key))
        lines.append(f"{d.key:<{width}}  {dc} {sc}  {dl} {sl}")
    lines.append(f"{'end to end':<{width}}  {dynamic.e2e['cos']:12.6f} {static.e2e['cos']:12.6f}  "
                 f"{dynamic.e2e['rel_l1']:14.5f} {static.e2e['rel_l1']:14.5f}")
    fell_back = [s for s in static.sites if s.status == "fallback"]
    if fell_back:
        lines.append(f"note: static mode fell back at {', '.join(s.key for s in fell_back)}: "
                     f"{fell_back[0].reason}")
    return "\n".join(lines)


def _parse_presets(text: str) -> list[str]:
    if text == "all":
        return list(ALL_PRESETS)
    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in PRESET_NAMES or p == "none"]
    if bad:
        raise QattnError(f"--presets: unknown preset(s) {bad}; choose from all or "
                         f"{', '.join(ALL_PRESETS)}")
    return names


def _static_policy_calibrations(policy) -> list[str]:
    """The calibration files a policy's static fmha_int8 options name, resolved as the
    rewrite resolves them (a relative path: next to the policy file first)."""
    opts = [policy.default_options] + [r.options for r in policy.rules]
    return sorted({str(resolve_calibration_path(o.calibration, policy.source)) for o in opts
                   if getattr(o, "scales", None) == "static" and o.calibration})


# --------------------------------------------------------------------------- eval


def cmd_eval(args) -> int:
    presets = _parse_presets(args.presets) if args.presets else []
    policy_src = args.policy or (None if presets else str(DEFAULT_POLICY_PATH))
    policy = load_policy(policy_src) if policy_src else None
    ev = _evaluator(args, fp_capture=False)
    report = _header(ev, args)
    runs: list[RunResult] = []
    if policy is not None:
        with step(f"running with policy {policy_src}"):
            run = ev.run_policy(policy, f"policy {Path(policy_src).stem}")
        print(f"\npolicy {policy_src}: each site's output vs exact fp64 attention on the same inputs\n")
        print(format_run(run))
        report["policy"] = run.to_dict()
        runs.append(run)
    by_label: dict[str, RunResult] = {}
    for preset in presets:
        with step(f"running every site on {preset}"):
            by_label[preset] = ev.run_preset(preset)
    calibrations = ([args.calibration] if args.calibration else
                    (_static_policy_calibrations(policy) if policy is not None else []))
    if calibrations:
        with step(f"running every site on fmha_int8 with static α from {calibrations[0]}"):
            by_label[STATIC_LABEL] = ev.run_preset("fmha_int8", static_options(calibrations[0]),
                                                   label=STATIC_LABEL)
        if "fmha_int8" not in by_label:
            with step("running every site on fmha_int8 with dynamic α"):
                by_label["fmha_int8"] = ev.run_preset("fmha_int8")
    preset_runs = [r for label, r in by_label.items() if label in presets or label == STATIC_LABEL]
    for run in preset_runs:
        print(f"\n== every site on {run.label}: site output vs exact fp64 attention on the same inputs\n")
        print(format_run(run, show_preset=False))
    if len(preset_runs) > 1:
        print("\nsite cosine per preset (rows: sites in execution order)\n")
        print(format_matrix(preset_runs, "cos"))
        print("\nsite relative L1 per preset\n")
        print(format_matrix(preset_runs, "rel_l1"))
    if preset_runs:
        report["presets"] = {r.label: r.to_dict() for r in preset_runs}
    if STATIC_LABEL in by_label:
        print()
        print(format_static_vs_dynamic(by_label["fmha_int8"], by_label[STATIC_LABEL], calibrations[0]))
        report["static_vs_dynamic"] = {
            "calibration": calibrations[0], "dynamic": by_label["fmha_int8"].to_dict(),
            "static": by_label[STATIC_LABEL].to_dict(),
        }
    _write_json(args.json, report)
    if args.png:
        plotted = runs + preset_runs
        write_plot(args.png, plotted, f"{args.model}: attention error per site", args.plot_metric)
    return 0


# --------------------------------------------------------------------------- calibrate


def cmd_calibrate(args) -> int:
    ev = _evaluator(args, fp_capture=True)
    payload = calibrate_capture(ev.fp, model=args.model, inputs=ev.inputs.description,
                                samples=ev.inputs.num_samples())
    out = save_scales(payload, args.output)
    print(f"\nstatic α (amax over {payload['samples']} samples) and TurboAttention kv-head "
          f"priorities (gap × std of channel gaps, K × V) per site:\n")
    print(format_scales(payload))
    print(f"\nwrote {out} ({len(payload['sites'])} sites)")
    report = {**_header(ev, args), "scales": str(out), "sites": payload["sites"]}
    if not args.no_compare:
        with step("running every site on fmha_int8 with dynamic α"):
            dynamic = ev.run_preset("fmha_int8")
        with step("running every site on fmha_int8 with the calibrated static α"):
            static = ev.run_preset("fmha_int8", static_options(out), label=STATIC_LABEL)
        print()
        print(format_static_vs_dynamic(dynamic, static, str(out)))
        report["static_vs_dynamic"] = {"dynamic": dynamic.to_dict(), "static": static.to_dict()}
    print("\nuse it in a policy:\n"
          "  rules:\n"
          "    - match: \"*\"\n"
          "      preset: fmha_int8\n"
          f"      options: {{scales: static, calibration: {json.dumps(str(out))}}}")
    _write_json(args.json, report)
    return 0


# --------------------------------------------------------------------------- tune


def cmd_tune(args) -> int:
    ev = _evaluator(args, fp_capture=True)
    if args.ranking and args.ranking.split(":")[0] == "measure":
        _, _, seq = args.ranking.partition(":")
        seq_len = int(seq) if seq else None
        where = f"at {seq_len} tokens" if seq_len else "on the captured inputs"
        with step(f"measuring the speed of every preset on the model's sites {where}"):
            measured = measure_ranking(ev, seq_len=seq_len)
        ranking, source = measured["ranking"], f"measured on {measured['device']} {where}"
        ranking_path = Path(args.output).with_suffix(".ranking.json")
        ranking_path.parent.mkdir(parents=True, exist_ok=True)
        ranking_path.write_text(json.dumps(measured, indent=2))
        print(f"wrote {ranking_path}: {measured['times_ms']}")
    elif args.ranking:
        ranking, source = load_ranking(args.ranking)
    else:
        ranking, source = list(DEFAULT_RANKING), DEFAULT_RANKING_SOURCE
        if ev.device.type != "cuda":
            source += f", not here: this run is on the {ev.device.type}, where `--ranking measure` has no kernels to time"
    print(f"budget: cos >= {args.budget} per rewritten site and end to end")
    print(f"speed ranking ({source}): {' > '.join(ranking)}")
    with step("tuning"):
        result = tune(ev, args.budget, ranking=ranking, ranking_source=source,
                      calibration=args.calibration, max_rounds=args.max_rounds, log=print)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(result.policy_text)
    print(f"\nwrote {args.output}\n")
    width = max(len(c.fqn or "(top level)") for c in result.choices)
    print(f"{'site':<{width}}  {'preset':<10} {'site cos':>10}  rejected (faster first)")
    for c in result.choices:
        cos = f"{c.chosen.cos:10.6f}" if c.chosen else f"{'-':>10}"
        print(f"{c.fqn or '(top level)':<{width}}  {c.preset:<10} {cos}  {'; '.join(c.rejected) or '-'}")
    with step(f"re-evaluating {args.output}"):
        again = ev.run_policy(args.output, "tuned policy")
    print(f"\nre-evaluation of {args.output}:\n")
    print(format_run(again))
    worst = min((s.cos for s in again.sites if s.status == "rewritten"), default=1.0)
    ok = meets(again.e2e["cos"], args.budget) and meets(worst, args.budget)
    print(f"\nbudget {args.budget}: {'met' if ok else 'NOT met'} (end to end cos "
          f"{again.e2e['cos']:.6f}, worst rewritten site cos {worst:.6f})")
    _write_json(args.json, {**_header(ev, args), **result.to_dict(), "re_evaluation": again.to_dict(),
                            "met": ok})
    if args.png:
        write_plot(args.png, [again], f"{args.model}: tuned policy, error per site", "rel_l1")
    return 0 if ok else 1


# --------------------------------------------------------------------------- parser


def add_subcommands(subparsers) -> None:
    """Add ``eval``, ``calibrate`` and ``tune`` to the ``qattn`` subparsers."""
    ev = subparsers.add_parser(
        "eval", help="per-site and end-to-end accuracy of a policy (and of every preset)",
        description="Run the model in full precision and with the policy (compiler eager: CPU "
                    "reference path, or the Triton kernels on CUDA) and print, per attention site, "
                    "cos / rel-L1 / RMSE of its output against exact fp64 attention on the same "
                    "inputs, and the end-to-end metric (the output's cosine; logits cosine, KL, top-1).")
    _common(ev)
    ev.add_argument("--policy", help="policy YAML (default: the bundled policy, unless --presets)")
    ev.add_argument("--presets", metavar="all|P1,P2",
                    help="also run every site on each of these presets (one table each)")
    ev.add_argument("--calibration", metavar="scales.pt",
                    help="also compare fmha_int8 with these calibrated static α against dynamic α")
    ev.add_argument("--png", metavar="PATH", help="write a PNG plot of the error per site")
    ev.add_argument("--plot-metric", choices=PLOT_METRICS, default="rel_l1",
                    help="what the PNG plots (default rel_l1)")
    ev.set_defaults(func=cmd_eval)

    cal = subparsers.add_parser(
        "calibrate", help="record static α for fmha_int8 and TurboAttention head priorities",
        description="Capture every attention site in full precision on the inputs and write, per "
                    "site, α_q, α_k, α_v, α_o (amax per head) for fmha_int8 `scales: static` and "
                    "the TurboAttention kv-head priorities; then compare static and dynamic α.")
    _common(cal)
    cal.add_argument("-o", "--output", required=True, metavar="scales.pt", help="scales file to write")
    cal.add_argument("--no-compare", action="store_true", help="skip the static-vs-dynamic runs")
    cal.set_defaults(func=cmd_calibrate)

    tn = subparsers.add_parser(
        "tune", help="choose the fastest preset per site within an accuracy budget",
        description="Pick per site the fastest preset (speed ranking) whose site cosine and the "
                    "end-to-end cosine stay >= --budget; write a commented policy YAML and "
                    "re-evaluate it.")
    _common(tn)
    tn.add_argument("--budget", type=float, required=True,
                    help="minimum cosine similarity, per site and end to end (e.g. 0.999)")
    tn.add_argument("-o", "--output", required=True, metavar="policy.yaml", help="policy to write")
    tn.add_argument("--ranking", metavar="FILE|measure[:SEQ]", type=_ranking_spec,
                    help="speed ranking: JSON file (list fastest first, or preset -> ms), or "
                         "'measure' to time every preset on this CUDA device on the captured "
                         "inputs, 'measure:SEQ' on random inputs of SEQ tokens with each site's "
                         "heads and head dim. Default: " + " > ".join(DEFAULT_RANKING))
    tn.add_argument("--calibration", metavar="scales.pt",
                    help="consider fmha_int8 with these static α (instead of dynamic)")
    tn.add_argument("--max-rounds", type=_positive_int, help="verification rounds at most")
    tn.add_argument("--png", metavar="PATH", help="PNG plot of the tuned policy's error per site")
    tn.set_defaults(func=cmd_tune)
