"""``graph_diff``: the dynamo graphs of a model before and after the qattn rewrite, as a
unified text diff of readable graph code and as a self-contained HTML page."""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..report import REWRITTEN, SiteReport
from .capture import Capture, CapturedGraph, capture_graphs, node_line


HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def graph_unified_diff(graph: CapturedGraph, context: int = 3) -> str:
    """The unified diff of one graph's readable code (empty when the rewrite changed nothing).

    Every hunk header names the site it belongs to after the closing ``@@`` (where ``git
    diff`` puts a function name): ``site <fqn> (<pattern> -> <preset>)`` for each site whose
    node is in the hunk, else ``before site <fqn>`` (the next site down: a hunk that only
    removes what a site's replacement no longer needs, such as a mask it reads) or ``after
    site <fqn>``."""
    before, after = graph.code_before.splitlines(), graph.code_after.splitlines()
    lines = difflib.unified_diff(
        before, after,
        fromfile=f"graph {graph.index} (dynamo, before qattn)",
        tofile=f"graph {graph.index} (after qattn rewrite)",
        n=context,
        lineterm="",
    )
    located = [(node_line(before, s.node_before), node_line(after, s.node_after), s.report)
               for s in graph.sites]
    return "\n".join(_name_hunk(line, located) if line.startswith("@@") else line for line in lines)


def _name_hunk(header: str, located: list) -> str:
    """``header`` (``@@ -a,b +c,d @@``) with the site(s) of its line ranges appended; ``located``
    holds each site's 0-based line before and after the rewrite (None: not found) and report."""
    match = HUNK.match(header)
    if match is None or not located:
        return header
    a, b, c, d = (int(g) if g is not None else 1 for g in match.groups())
    old, new = range(a - 1, a - 1 + b), range(c - 1, c - 1 + d)
    inside = [r for i, j, r in located if (i is not None and i in old) or (j is not None and j in new)]
    if inside:
        names = ", ".join(f"site {_fqn(r)} ({_outcome(r)})" for r in inside)
    else:
        below = [r for i, j, r in located if (i is not None and i >= old.stop) or (j is not None and j >= new.stop)]
        names = f"before site {_fqn(below[0])}" if below else f"after site {_fqn(located[-1][2])}"
    return f"{match.group(0)} {names}"


def _fqn(report: SiteReport) -> str:
    return report.fqn or "(top level)"


def _outcome(report: SiteReport) -> str:
    """``sdpa -> sage2_8b`` for a rewritten site, else its status (``fallback``...)."""
    return f"{report.pattern} -> {report.preset}" if report.status == REWRITTEN else report.status


@dataclass
class GraphDiff:
    """The result of :func:`graph_diff`: ``text`` is the unified diff, :meth:`html` the page."""

    capture: Capture
    title: str = "qattn graph diff"

    @property
    def reports(self) -> list[SiteReport]:
        """The report of every attention site found."""
        return self.capture.reports

    @property
    def text(self) -> str:
        """The unified diff of every graph, one after the other."""
        diffs = [graph_unified_diff(g) for g in self.capture.graphs]
        return "\n".join(d + "\n" for d in diffs if d)

    def html(self) -> str:
        """A self-contained HTML page: sites, rules that matched nothing, side-by-side graphs."""
        from .html import render_html

        return render_html(self.capture, self.title)

    def write_html(self, path: str | Path) -> Path:
        """Write :meth:`html` to ``path`` (its directory created if missing); return the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.html(), encoding="utf-8")
        return path

    def __str__(self) -> str:
        return self.text


def graph_diff(model, example_inputs, policy: Any = None, title: str = "qattn graph diff") -> GraphDiff:
    """Trace ``model`` with dynamo on ``example_inputs``, rewrite it with ``policy``, and diff.

    ``example_inputs`` is a dict of keyword inputs, a tuple of positional inputs or a tensor;
    ``policy`` anything :func:`qattn_compile.load_policy` takes (default: the bundled policy).
    Needs no GPU and no Inductor.
    """
    return GraphDiff(capture_graphs(model, example_inputs, policy), title)
