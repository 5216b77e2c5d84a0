"""Per-site and end-to-end accuracy of a policy (the engine of ``qattn eval``).

Definitions (every number the tools print):

- **Site error** of a run: at each attention site, the output the run produced there (the
  policy's op, or the original attention if the site was left alone or fell back) against
  :func:`~qattn_compile.reference.exact_attention` in float64 *on the same inputs* (the
  inputs that site received in that run, so upstream error is not counted twice). Metrics
  are SageAttention's (:func:`qattn_compile.metrics.compare`: cosine, relative L1, RMSE),
  over every call of the site, query rows with no visible key left out.
- **Isolated site error** of a preset (:func:`isolated_site_metrics`, used by ``tune``): the
  same comparison with the preset's op applied to the inputs captured in a full-precision
  run (nothing rewritten), cast to the run dtype.
- **End to end**: the model output under the policy against the *uncompiled* model in
  float32 on the same inputs (which output: :func:`qattn_compile.zoo.compared_output`; its
  name is ``e2e["output"]``). Encoders and other models (a pooled, normalized embedding, a
  diffusion transformer's sample, ...): ``cos`` is the mean per-sample cosine, ``cos_min``
  the worst sample's. Decoders (logits): ``cos`` is
  the cosine of all logits, ``kl`` the mean KL(p_ref ‖ p_run) per position with softmax in
  float32, ``top1`` the fraction of positions whose argmax agrees (positions with
  ``attention_mask == 0`` left out).

Runs use ``compiler: eager``: on CPU every rewritten site executes the plain-PyTorch
reference, on CUDA the Triton kernels (model in ``dtype``, default float16 there).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from .. import ops
from ..metrics import compare
from ..presets import PRESET_NAMES, PresetOptions, resolve_options
from ..reference import exact_attention, mask_bias
from ..scales import options_for_site
from .capture import CaptureResult, SiteRecord, capture_run
from .inputs import EvalInputs


# --------------------------------------------------------------------------- metrics


def _visible_rows(call, is_causal: bool) -> torch.Tensor | None:
    """Bool ``[B, H|1, Lq, 1]`` of query rows with at least one visible key (None = all)."""
    b, hq, lq, _ = call.q.shape
    lkv = call.k.shape[2]
    bias = mask_bias(call.attn_mask, is_causal, (b, hq, lq, lkv), torch.float32, call.q.device)
    if bias is None:
        return None
    return (bias > -math.inf).any(dim=-1, keepdim=True)


def _pairs(record: SiteRecord, outs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Flattened (outputs, fp64 exact outputs) over every call of ``record``."""
    got, want = [], []
    for call, out in zip(record.calls, outs):
        exact = exact_attention(call.q, call.k, call.v, call.attn_mask, record.is_causal,
                                record.scale, softcap=record.softcap)
        rows = _visible_rows(call, record.is_causal)
        out = out.double()
        if rows is not None:
            rows = rows.expand(*exact.shape[:-1], 1)
            out, exact = out[rows.squeeze(-1)], exact[rows.squeeze(-1)]
        got.append(out.flatten())
        want.append(exact.flatten())
    return torch.cat(got), torch.cat(want)


def site_metrics(record: SiteRecord) -> dict[str, float]:
    """cos / rel_l1 / rmse of the outputs a run recorded at ``record`` vs exact attention."""
    if not record.calls:
        return {"cos": float("nan"), "rel_l1": float("nan"), "rmse": float("nan")}
    got, want = _pairs(record, [c.out for c in record.calls])
    return compare(got, want)


def _cast_inputs(call, dtype):
    q, k, v, mask = call.q, call.k, call.v, call.attn_mask
    if dtype is not None:
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        if mask is not None and mask.is_floating_point():
            mask = mask.to(dtype)
    return q, k, v, mask


def isolated_site_metrics(
    record: SiteRecord,
    preset: str,
    options: PresetOptions | dict | None = None,
    *,
    dtype: torch.dtype | None = None,
    policy_source: str | None = None,
) -> dict[str, Any]:
    """Error of ``preset`` at a site on inputs captured in a full-precision run.

    Runs ``torch.ops.qattn.attention`` (reference on CPU, kernels on CUDA) on every recorded
    call, inputs cast to ``dtype``. Returns ``{"cos", "rel_l1", "rmse"}``, or
    ``{"unsupported": reason}`` when the op cannot serve the site (it would fall back; also
    when the full-precision capture could not rewrite the site and so has no inputs).
    """
    opts = resolve_options(preset, options)
    if preset == "none":
        return site_metrics(record)
    if not record.calls:  # the capture could not rewrite it: no inputs to run a preset on
        why = record.report.reason if record.report is not None else "never executed"
        return {"unsupported": f"not recorded in the full-precision capture ({why})"}
    opts = options_for_site(preset, opts, record.key, policy_source)
    outs = []
    with torch.no_grad():
        for call in record.calls:
            q, k, v, mask = _cast_inputs(call, dtype)
            reason = ops.unsupported_reason(q.shape, k.shape, v.shape, q.dtype, q.device, preset, opts)
            if reason:
                return {"unsupported": reason}
            outs.append(torch.ops.qattn.attention(
                q, k, v, mask, record.is_causal, record.scale, preset, opts.to_json(),
                record.softcap
            ))
    got, want = _pairs(record, outs)
    return compare(got, want)


def end_to_end(kind: str, outputs, references, masks=None, output: str = "output") -> dict[str, Any]:
    """End-to-end metrics of a run's outputs vs the reference outputs (module docstring);
    ``output`` names what a non-decoder's outputs are (a decoder's are ``"logits"``)."""
    masks = masks or [None] * len(outputs)
    if kind == "decoder":
        got, want = [], []
        for o, r, m in zip(outputs, references, masks):
            if m is not None and tuple(m.shape) == tuple(o.shape[:-1]):
                keep = m.bool()
                o, r = o[keep], r[keep]
            got.append(o.reshape(-1, o.shape[-1]))
            want.append(r.reshape(-1, r.shape[-1]))
        o, r = torch.cat(got).float(), torch.cat(want).float()
        m = compare(o, r)
        log_r, log_o = F.log_softmax(r, dim=-1).double(), F.log_softmax(o, dim=-1).double()
        kl = (log_r.exp() * (log_r - log_o)).sum(-1).mean().item()
        top1 = (o.argmax(-1) == r.argmax(-1)).double().mean().item()
        return {"output": "logits", "cos": m["cos"], "rel_l1": m["rel_l1"], "rmse": m["rmse"],
                "kl": kl, "top1": top1, "positions": int(o.shape[0])}
    o = torch.cat([x.reshape(x.shape[0], -1) for x in outputs]).double()
    r = torch.cat([x.reshape(x.shape[0], -1) for x in references]).double()
    per = F.cosine_similarity(o, r, dim=-1)
    m = compare(o, r)
    return {"output": output, "cos": per.mean().item(), "cos_min": per.min().item(),
            "rel_l1": m["rel_l1"], "rmse": m["rmse"], "samples": int(o.shape[0])}


# --------------------------------------------------------------------------- results


@dataclass
class SiteResult:
    """One site of one run: what was applied and its error (see the module docstring)."""

    index: int
    key: str
    fqn: str
    module_class: str | None
    preset: str
    status: str
    reason: str
    rule: str
    options: dict
    calls: int
    shapes: dict
    mask_kind: str
    cos: float
    rel_l1: float
    rmse: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class RunResult:
    """A policy run: its sites and the end-to-end metrics."""

    label: str
    policy: str
    sites: list[SiteResult]
    e2e: dict
    notes: list[str] = field(default_factory=list)

    def worst_site(self) -> SiteResult | None:
        rated = [s for s in self.sites if not math.isnan(s.cos)]
        return min(rated, key=lambda s: s.cos) if rated else None

    def to_dict(self) -> dict:
        return {"label": self.label, "policy": self.policy, "end_to_end": self.e2e,
                "sites": [s.to_dict() for s in self.sites], "notes": self.notes}


def _clean_options(options: dict) -> dict:
    """Options for display / JSON: the (large) filled-in static scales are summarised."""
    out = dict(options)
    if out.get("static_scales") is not None:
        out["static_scales"] = "(per-site α from the calibration file)"
    return out


def run_result(label: str, cap: CaptureResult, e2e: dict, policy_text: str) -> RunResult:
    sites = []
    for i, rec in enumerate(cap.sites):
        m = site_metrics(rec)
        rep = rec.report
        sites.append(SiteResult(
            index=i, key=rec.key, fqn=rec.fqn, module_class=rec.module_class,
            preset=rec.preset, status=rec.status, reason=rep.reason if rep else "",
            rule=rep.rule if rep else "", options=_clean_options(rep.options if rep else {}),
            calls=len(rec.calls), shapes=rec.shapes(), mask_kind=rec.mask_kind,
            cos=m["cos"], rel_l1=m["rel_l1"], rmse=m["rmse"],
        ))
    return RunResult(label, policy_text, sites, e2e)


# --------------------------------------------------------------------------- evaluator


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class Evaluator:
    """Runs one model on one set of inputs: reference, full-precision capture, policy runs.

    ``device`` defaults to CUDA when available; ``dtype`` (of the policy runs) to float16 on
    CUDA and float32 on CPU. The reference (uncompiled, float32) and the full-precision
    capture are made first, in float32, before the model is cast to ``dtype``.
    """

    def __init__(self, inputs: EvalInputs, *, device=None, dtype=None, fp_capture: bool = False,
                 offload: bool = False):
        self.inputs = inputs
        self.device = torch.device(device) if device is not None else default_device()
        if dtype is None:
            dtype = torch.float16 if self.device.type == "cuda" else torch.float32
        self.dtype = dtype
        self.offload = offload
        inputs.to(self.device)
        inputs.bundle.model.float()
        self.reference = inputs.run()
        self.output = inputs.bundle.output  # what is compared: "logits", "embedding", "sample"...
        self.fp: CaptureResult | None = capture_run(inputs, None, offload=offload) if fp_capture else None
        if dtype != torch.float32:
            inputs.to(self.device, dtype)

    @property
    def kind(self) -> str:
        return self.inputs.kind

    def dtype_floor(self) -> RunResult | None:
        """Every site left alone, model in the run dtype (None in float32): the end-to-end
        error the dtype alone costs, below which no policy can go. Computed once."""
        if self.dtype == torch.float32:
            return None
        if getattr(self, "_floor", None) is None:
            self._floor = self.run_policy({"qattn": 1, "default": "none"}, f"none ({self.dtype})")
        return self._floor

    def run_policy(self, policy: Any, label: str = "policy") -> RunResult:
        """Run the model under ``policy`` (eager), with site and end-to-end metrics."""
        cap = capture_run(self.inputs, policy, offload=self.offload)
        e2e = end_to_end(self.kind, cap.outputs, self.reference, self.inputs.attention_masks(),
                         self.output)
        return run_result(label, cap, e2e, cap.policy.source)

    def run_preset(self, preset: str, options: dict | None = None, label: str | None = None) -> RunResult:
        """Every site on one preset (``default: preset``)."""
        if preset not in PRESET_NAMES:
            raise ValueError(f"unknown preset {preset!r}")
        policy = {"qattn": 1, "default": preset, "default_options": dict(options or {})}
        result = self.run_policy(policy, label or preset)
        result.policy = f"default: {preset}" + (f" {options}" if options else "")
        return result


# --------------------------------------------------------------------------- text output


def _fmt(x: float, spec: str) -> str:
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def format_e2e(e2e: dict) -> str:
    if e2e.get("output") == "logits":
        return (f"logits vs uncompiled fp32: cos {e2e['cos']:.6f}  KL {e2e['kl']:.3e}  "
                f"top-1 agreement {e2e['top1'] * 100:.2f} %  ({e2e['positions']} positions)")
    return (f"{e2e['output']} vs uncompiled fp32: cos {e2e['cos']:.6f} (mean over {e2e['samples']} "
            f"samples; worst {e2e['cos_min']:.6f})  rel-L1 {e2e['rel_l1']:.5f}")


def format_run(run: RunResult, *, show_preset: bool = True) -> str:
    """The per-site table of a run plus its end-to-end line."""
    width = max([len(s.key) for s in run.sites] + [len("site (module FQN)")])
    head = f"{'#':>2}  {'site (module FQN)':<{width}}  "
    if show_preset:
        head += f"{'preset':<10} {'status':<10} "
    head += f"{'cos':>10} {'rel-L1':>9} {'RMSE':>10}"
    lines = [head, "-" * len(head)]
    for s in run.sites:
        row = f"{s.index:>2}  {s.key:<{width}}  "
        if show_preset:
            row += f"{s.preset:<10} {s.status:<10} "
        if s.status == "rewritten":
            row += f"{_fmt(s.cos, '10.6f')} {_fmt(s.rel_l1, '9.5f')} {_fmt(s.rmse, '10.3e')}"
        else:
            row += f"{'-':>10} {'-':>9} {'-':>10}  (original attention)"
        lines.append(row.rstrip())
        if s.status == "fallback":
            lines.append(f"{'':>4}fallback: {s.reason}")
    lines.append(f"end to end: {format_e2e(run.e2e)}")
    return "\n".join(lines)


def format_matrix(runs: list[RunResult], metric: str = "cos") -> str:
    """Sites × runs table of one metric (a compact overview of several presets)."""
    if not runs:
        return ""
    keys = [s.key for s in runs[0].sites]
    width = max([len(k) for k in keys] + [len("end to end")])
    cols = [max(len(r.label), 10) for r in runs]
    spec = {"cos": ".6f", "rel_l1": ".5f", "rmse": ".3e"}[metric]
    lines = [f"{'site':<{width}}  " + " ".join(f"{r.label:>{w}}" for r, w in zip(runs, cols))]
    for key in keys:
        cells = []
        for r, w in zip(runs, cols):
            site = next((s for s in r.sites if s.key == key), None)
            shown = site is not None and site.status == "rewritten"
            cells.append(f"{_fmt(getattr(site, metric), spec) if shown else '-':>{w}}")
        lines.append(f"{key:<{width}}  " + " ".join(cells))
    e2e_key = "cos" if metric == "cos" else metric
    lines.append(f"{'end to end':<{width}}  " + " ".join(
        f"{_fmt(r.e2e.get(e2e_key), spec):>{w}}" for r, w in zip(runs, cols)))
    return "\n".join(lines)
