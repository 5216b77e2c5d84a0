"""Capture what the qattn rewrite does to a model: every dynamo graph before and after
:func:`~qattn_compile.rewrite.rewrite_attention`, and the report of every attention site.

No Inductor: the capturing backend rewrites each graph and runs it as is (``gm.forward``),
so this works on CPU in about the time of one eager forward plus dynamo tracing.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from .. import _compat
from ..errors import QattnError
from ..patterns import find_attention_sites, regions
from ..policy import DEFAULT_POLICY_PATH, Policy, load_policy
from ..report import CAUSAL_MASK_NOTE, REWRITTEN, SiteReport
from ..rewrite import rewrite_attention
from .trace import emit_site_report

_DEALLOC = re.compile(r";  (?:\w+ = )+None$")


@dataclass
class CapturedSite:
    """One site's report and the names of its node in the graph before and after the rewrite."""

    report: SiteReport
    node_before: str | None
    node_after: str | None


@dataclass
class CapturedGraph:
    """One dynamo graph as readable code before and after the rewrite, with its sites."""

    index: int
    code_before: str
    code_after: str
    sites: list[CapturedSite] = field(default_factory=list)


@dataclass
class Capture:
    """Everything one traced forward produced: the policy, its graphs and their sites."""

    policy: Policy
    graphs: list[CapturedGraph] = field(default_factory=list)

    @property
    def reports(self) -> list[SiteReport]:
        """Every site of every graph, in order."""
        return [site.report for graph in self.graphs for site in graph.sites]

    def unmatched_rules(self) -> list[str]:
        """The policy's lines for the rules no site matched (e.g. ``rules[2] (`*x`) matched no
        site; closest sites: `layers.0.x```)."""
        matched = {i for r in self.reports for i in r.matched_rules}
        return self.policy.unmatched_rules(matched, {r.fqn: r.module_class for r in self.reports})


def node_line(lines: list[str], name: str | None) -> int | None:
    """Index of the line of readable code that assigns node ``name`` (``name: "f32[..]" = ...``)."""
    if name is None:
        return None
    pattern = re.compile(rf"^\s*{re.escape(name)}(:\s|\s*=)")
    return next((i for i, text in enumerate(lines) if pattern.match(text)), None)


def provenance_comment(node: fx.Node) -> str:
    """``# qattn: site <fqn> | rule ... | pattern ... | preset ...`` from ``node.meta["qattn"]``."""
    meta = node.meta["qattn"]
    return (
        f"# qattn: site {meta.get('fqn') or '(top level)'} | {meta.get('rule')} | "
        f"pattern {meta.get('pattern')} | preset {meta.get('preset')}"
    )


def readable_code(gm: fx.GraphModule) -> str:
    """The graph as Python with shapes and source comments, without the ``x = None`` clean-ups,
    and with a provenance comment ending the line of every node the rewrite created (and,
    above an op whose causal mask became ``is_causal``, a comment line saying so)."""
    code = gm.print_readable(print_output=False, include_stride=False, include_device=False, colored=False)
    lines = [_DEALLOC.sub("", line) for line in code.splitlines()]
    for node in _qattn_nodes(gm):
        i = node_line(lines, node.name)
        if i is None:
            continue
        lines[i] += "  " + provenance_comment(node)
        if node.meta["qattn"].get("causal_from_mask"):
            indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
            lines.insert(i, f"{indent}# qattn: {CAUSAL_MASK_NOTE}")
    return "\n".join(lines)


def _qattn_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The op nodes the rewrite inserted, one per rewritten site, in graph order: the only
    nodes that carry ``meta["qattn"]`` provenance (a site's own casts and reshapes do not,
    and a site may read the previous site's op directly)."""
    return [n for n in regions.walk(gm) if "qattn" in n.meta]


def _locate(reports: list[SiteReport], before: list, outputs: list[fx.Node]) -> list[CapturedSite]:
    """Pair each report with its node before the rewrite and the node computing it after."""
    if len(before) != len(reports):  # the finder and the rewrite disagree: names unknown
        before = [None] * len(reports)
    outputs = iter(outputs)
    sites = []
    for report, name in zip(reports, before):
        after = name
        if report.status == REWRITTEN:
            node = next(outputs, None)
            after = node.name if node is not None and node.meta["qattn"].get("fqn") == report.fqn else None
        sites.append(CapturedSite(report, name, after))
    return sites


class CapturingBackend:
    """A dynamo backend that rewrites every graph with ``policy`` and records it.

    A :class:`~qattn_compile.errors.QattnError` raised by the rewrite is kept in ``error``
    (dynamo would wrap it) and the graph runs unrewritten.
    """

    def __init__(self, policy: Policy):
        self.capture = Capture(policy)
        self.error: QattnError | None = None

    def __call__(self, gm: fx.GraphModule, example_inputs):
        index = len(self.capture.graphs)
        before = readable_code(gm)
        anchors = [site.anchor.name for site in find_attention_sites(gm)]
        try:
            reports = rewrite_attention(gm, self.capture.policy, graph_index=index)
        except QattnError as exc:
            self.error = self.error or exc
            return gm.forward
        sites = _locate(reports, anchors, _qattn_nodes(gm))
        self.capture.graphs.append(CapturedGraph(index, before, readable_code(gm), sites))
        emit_site_report(reports, self.capture.unmatched_rules(), index)
        return gm.forward


def run_model(model, example_inputs) -> Any:
    """Call ``model`` on ``example_inputs``: a dict of keyword inputs, a tuple/list of
    positional inputs, or a single tensor."""
    if isinstance(example_inputs, Mapping):
        return model(**example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return model(*example_inputs)
    return model(example_inputs)


def capture_graphs(model, example_inputs, policy: Any = None) -> Capture:
    """Trace ``model`` on ``example_inputs`` with dynamo, rewrite with ``policy``, record all.

    ``policy`` is anything :func:`~qattn_compile.policy.load_policy` takes (default: the
    bundled policy). Resets dynamo first (previously compiled frames are forgotten), so the
    model is traced afresh. Raises the rewrite's :class:`~qattn_compile.errors.QattnError`.
    """
    backend = CapturingBackend(load_policy(policy if policy is not None else DEFAULT_POLICY_PATH))
    _compat.reset_dynamo()
    with torch.no_grad():
        run_model(torch.compile(model, backend=backend), example_inputs)
    if backend.error is not None:
        raise backend.error
    return backend.capture
