"""``explain``: a dry run of the rewrite (CPU, no Inductor) that says, per attention site,
what qattn decided and why, and which policy rules matched nothing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..report import FALLBACK, REWRITTEN, SiteReport
from .capture import Capture, capture_graphs
from .table import format_site_table


@dataclass
class Explanation:
    """The result of :func:`explain`."""

    capture: Capture

    @property
    def reports(self) -> list[SiteReport]:
        """The report of every attention site found, in graph order."""
        return self.capture.reports

    @property
    def fallbacks(self) -> list[SiteReport]:
        """Sites the policy chose a preset for that could not be served."""
        return [r for r in self.reports if r.status == FALLBACK]

    def unmatched_rules(self) -> list[str]:
        """One line per policy rule that matched no site."""
        return self.capture.unmatched_rules()

    def summary(self) -> str:
        """One line: how many sites were rewritten, left alone and fell back."""
        reports = self.reports
        rewritten = sum(r.status == REWRITTEN for r in reports)
        left = len(reports) - rewritten - len(self.fallbacks)
        graphs = len(self.capture.graphs)
        return (
            f"{rewritten} of {len(reports)} attention site(s) rewritten, {left} left alone, "
            f"{len(self.fallbacks)} fell back ({graphs} graph(s); policy {self.capture.policy.source})"
        )

    def format(self) -> str:
        """The table, the summary and the rules that matched nothing."""
        unmatched = self.unmatched_rules()
        rules = "\n".join(["rules that matched nothing:"] + [f"  {line}" for line in unmatched])
        return "\n\n".join([
            format_site_table(self.reports),
            self.summary(),
            rules if unmatched else "every rule matched at least one site",
        ])

    def problems(self) -> list[str]:
        """What ``--strict`` fails on: rules that matched nothing and sites that fell back."""
        fell_back = [f"site {r.fqn or '(top level)'} fell back: {r.reason}" for r in self.fallbacks]
        return self.unmatched_rules() + fell_back


def explain(model, example_inputs, policy: Any = None) -> Explanation:
    """Dry-run the rewrite of ``model`` on ``example_inputs`` with ``policy`` and explain it.

    The same capture as :func:`~qattn_compile.debug.graph_diff` (dynamo, no Inductor), without
    rendering; on a CPU model every rewritten site runs the reference implementation.
    """
    return Explanation(capture_graphs(model, example_inputs, policy))
