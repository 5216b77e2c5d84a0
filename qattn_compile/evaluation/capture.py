"""Capture every attention site's op inputs and output while a model runs under a policy.

How (no change to the rewrite is needed): :class:`CaptureBackend` is a dynamo backend that
hands each captured FX graph to the ordinary qattn backend
(:class:`~qattn_compile.dynamo_backend.QattnBackend`, ``compiler: eager``) and then, after the
rewrite, inserts after every ``torch.ops.qattn.attention`` node one call
``_record(token, slot, q, k, v, attn_mask, out)`` on that node's own arguments and result.
So what is recorded is exactly what the op receives (q with run-time scale factors folded
in, un-repeated K/V for GQA, the combined mask, rank-3 sites unsqueezed) and what it
returned (reference on CPU, Triton kernels on CUDA). Sites the policy leaves alone, or that
fall back, have no op: they are listed (from the rewrite's reports) without a recording.

Full-precision capture (``policy=None``): every site is rewritten
with ``flash`` only to obtain the op's inputs, and the op node's target is swapped for
:func:`full_precision_attention` (exact attention in float64, cast to the input dtype), so
the model runs in full precision and every site's inputs are recorded. A site ``flash``
cannot serve there (refused by the finder or the device) is not recorded.

Op nodes are matched to the rewrite's reports by order (the rewrite inserts each op before
its site's output node, in site order) and checked by FQN. Site keys are the module FQN
(``"(top level)"`` when empty); a module whose attention runs twice in one graph gets
``fqn#1``, ``fqn#2``... for the later calls. Calls of a site across batches and recompiles
are gathered under its key.

``fmha_int8`` with ``scales: static``: the policy names a calibration file; per-site α are
filled into the site's options by :func:`qattn_compile.scales.options_for_site`.
So that this works whether or not the rewrite already does that, the backend fills them into
each such op node's options argument after the rewrite (a no-op when they are already there).

The graph runs with ``compiler: eager`` (a Python recorder cannot go through Inductor). The
recorded tensors are detached clones, kept on their device (``offload=True``: moved to CPU).
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from .. import _compat, ops
from ..dynamo_backend import QattnBackend
from ..errors import QattnError
from ..patterns import regions
from ..policy import Policy, load_policy
from ..presets import options_from_json
from ..reference import exact_attention
from ..report import REWRITTEN, SiteReport
from ..scales import options_for_site, site_keys



_FP_POLICY = {"qattn": 1, "default": "flash"}

_tokens = itertools.count(1)
_active: dict[int, tuple[weakref.ref, list[str]]] = {}


def _record(token: int, slot: int, q, k, v, attn_mask, out):
    """Graph-side hook (inserted by :class:`CaptureBackend`): store one site call."""
    entry = _active.get(token)
    if entry is not None:
        backend = entry[0]()
        if backend is not None:
            backend._store(entry[1][slot], q, k, v, attn_mask, out)
    return None


def full_precision_attention(q, k, v, attn_mask, is_causal, scale, preset=None, options=None,
                             softcap=0.0, alibi_slopes=None):
    """Stand-in for ``torch.ops.qattn.attention`` in a full-precision capture: exact
    attention in float64, returned in q's dtype (fully masked rows are 0, as the op's)."""
    return exact_attention(q, k, v, attn_mask, is_causal, scale, softcap=softcap,
                           alibi_slopes=alibi_slopes).to(q.dtype)


@dataclass
class SiteCall:
    """One execution of a site: its inputs and the output the run produced there."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    attn_mask: torch.Tensor | None
    out: torch.Tensor


@dataclass
class SiteRecord:
    """Everything captured about one attention site (all its calls, in run order)."""

    key: str
    fqn: str
    module_class: str | None
    pattern: str
    is_causal: bool
    scale: float | None
    mask_kind: str
    order: int
    softcap: float = 0.0  # the op's logit soft cap (0 = none)
    report: SiteReport | None = None
    calls: list[SiteCall] = field(default_factory=list)

    @property
    def preset(self) -> str:
        return self.report.preset if self.report else "none"

    @property
    def status(self) -> str:
        return self.report.status if self.report else "left_alone"

    def shapes(self) -> dict[str, list[int]]:
        if not self.calls:
            return {}
        c = self.calls[0]
        return {n: list(getattr(c, n).shape) for n in ("q", "k", "v")}


@dataclass
class CaptureResult:
    """The compared model outputs (one per batch) and the sites in first-seen order."""

    outputs: list[torch.Tensor]
    sites: list[SiteRecord]
    policy: Policy
    reports: list[SiteReport]

    def site(self, key: str) -> SiteRecord:
        for s in self.sites:
            if s.key == key:
                return s
        raise KeyError(key)


class CaptureBackend:
    """A dynamo backend that applies ``policy`` (eager) and records every rewritten site.

    ``policy=None``: full-precision capture (module docstring). After the model ran,
    :attr:`sites` holds a :class:`SiteRecord` per site and :attr:`site_reports` the
    rewrite's reports.
    """

    def __init__(self, policy: Any = None, *, offload: bool = False, record: bool = True):
        self.full_precision = policy is None
        self.policy = load_policy(_FP_POLICY if policy is None else policy)
        self.offload = offload
        self.record = record
        self.records: dict[str, SiteRecord] = {}
        self.site_reports: list[SiteReport] = []
        self._graphs = 0

    @property
    def sites(self) -> list[SiteRecord]:
        return sorted(self.records.values(), key=lambda r: r.order)

    def _store(self, key, q, k, v, attn_mask, out) -> None:
        if not self.record:
            return

        def keep(t):
            if not isinstance(t, torch.Tensor):
                return t
            t = t.detach()
            return t.to("cpu", copy=True) if self.offload else t.clone()

        self.records[key].calls.append(SiteCall(keep(q), keep(k), keep(v), keep(attn_mask), keep(out)))

    def _record_for(self, key: str, report: SiteReport, node: fx.Node | None) -> SiteRecord:
        if key not in self.records:
            args = node.args if node is not None else (None,) * 6
            self.records[key] = SiteRecord(
                key=key, fqn=report.fqn, module_class=report.module_class, pattern=report.pattern,
                is_causal=bool(args[4]), scale=args[5],
                softcap=float(args[8]) if len(args) > 8 and args[8] else 0.0,
                mask_kind=report.mask_kind, order=len(self.records),
            )
        record = self.records[key]
        if record.report is None or (node is not None and record.report.status != REWRITTEN):
            record.report = report
        return record

    def __call__(self, gm: fx.GraphModule, example_inputs):
        inner = QattnBackend(self.policy, compiler="eager")
        inner.announce_reference = False  # the tools print where the sites run
        inner._graphs = self._graphs
        inner(gm, example_inputs)  # rewrites gm in place (eager: returns gm.forward)
        reports = inner.site_reports
        op_nodes = [n for n in regions.walk(gm) if n.op == "call_function" and n.target in ops.graph_ops()]
        rewritten = [r for r in reports if r.status == REWRITTEN]
        if [n.meta.get("qattn", {}).get("fqn") for n in op_nodes] != [r.fqn for r in rewritten]:
            raise RuntimeError(
                "qattn capture: the qattn ops in the graph "
                f"{[n.meta.get('qattn', {}).get('fqn') for n in op_nodes]} do not match the "
                f"rewritten sites {[r.fqn for r in rewritten]}"
            )
        token = next(_tokens)
        keys, nodes = [], iter(op_nodes)
        for report, key in zip(reports, site_keys([r.fqn for r in reports])):
            node = next(nodes) if report.status == REWRITTEN else None
            self._record_for(key, report, node)
            if node is None:
                continue
            slot = len(keys)
            keys.append(key)
            if self.full_precision:
                node.target = full_precision_attention
            else:
                _fill_static_scales(node, key, self.policy.source)
            with node.graph.inserting_after(node):  # gm's graph or a nested region's
                node.graph.call_function(_record, (token, slot, *node.args[:4], node))
        for graph in dict.fromkeys([gm.graph, *(n.graph for n in op_nodes)]):
            graph.owning_module.recompile()
        _active[token] = (weakref.ref(self), keys)
        self.site_reports.extend(reports)
        self._graphs += 1
        return gm.forward


def _fill_static_scales(node: fx.Node, key: str, policy_source: str) -> None:
    """Put the calibrated α of the site ``key`` (:func:`qattn_compile.scales.site_keys`) into
    a static fmha_int8 op node's options JSON."""
    preset, text = node.args[6], node.args[7]
    options = options_from_json(preset, text)
    filled = options_for_site(preset, options, key, policy_source)
    if filled is not options:
        node.args = (*node.args[:7], filled.to_json(), *node.args[8:])


def _qattn_cause(exc: BaseException) -> QattnError | None:
    """The QattnError (policy, calibration file...) a dynamo backend failure wraps, if any."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, QattnError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or getattr(exc, "inner_exception", None) or exc.__context__
    return None


def capture_run(inputs, policy: Any = None, *, offload: bool = False, record: bool = True) -> CaptureResult:
    """Run ``inputs``' model on every batch, compiled with :class:`CaptureBackend` (eager).

    ``inputs``: an :class:`~qattn_compile.evaluation.inputs.EvalInputs`. ``policy``: any
    policy source (None = leave every site alone: a full-precision capture). Dynamo is reset
    before and after (the model is compiled afresh).
    """
    _compat.reset_dynamo()
    backend = CaptureBackend(policy, offload=offload, record=record)
    try:
        compiled = torch.compile(inputs.bundle.model, backend=backend, dynamic=False)
        outputs = inputs.run(compiled)
    except Exception as exc:
        cause = _qattn_cause(exc)
        if cause is None or cause is exc:
            raise
        raise cause from None
    finally:
        _compat.reset_dynamo()
    return CaptureResult(outputs, backend.sites, backend.policy, backend.site_reports)
