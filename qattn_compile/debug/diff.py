"""``graph_diff``: the dynamo graphs of a model before and after the qattn rewrite, as a
unified text diff of readable graph code and as a self-contained HTML page."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..report import SiteReport
from .capture import Capture, CapturedGraph, capture_graphs


def graph_unified_diff(graph: CapturedGraph, context: int = 3) -> str:
    """The unified diff of one graph's readable code (empty when the rewrite changed nothing)."""
    lines = difflib.unified_diff(
        graph.code_before.splitlines(),
        graph.code_after.splitlines(),
        fromfile=f"graph {graph.index} (dynamo, before qattn)",
        tofile=f"graph {graph.index} (after qattn rewrite)",
        n=context,
        lineterm="",
    )
    return "\n".join(lines)


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
