"""Emit the per-site report to torch's logs: a ``trace_structured`` artifact (``TORCH_TRACE``,
``tlparse``) and a DEBUG message on ``qattn_compile.debug`` (``TORCH_LOGS=+qattn``)."""

from __future__ import annotations

import json
import logging

from ..report import SiteReport, count_by_status
from .. import _compat
from .table import format_site_table, kernel_variant

log = logging.getLogger("qattn_compile.debug")

ARTIFACT_NAME = "qattn_site_report"
"""The artifact's name in the structured trace (what ``tlparse`` lists)."""


def report_payload(reports: list[SiteReport], unmatched_rules: list[str], graph_index: int) -> dict:
    """The JSON the artifact carries: every site (with its kernel variant), counts, unmatched rules."""
    sites = [dict(r.to_dict(), kernel_variant=kernel_variant(r)) for r in reports]
    return {
        "graph_index": graph_index,
        "sites": sites,
        "counts": count_by_status(reports),
        "unmatched_rules": unmatched_rules,
    }


def emit_site_report(reports: list[SiteReport], unmatched_rules: list[str], graph_index: int) -> None:
    """Emit the sites of one dynamo graph; call it from a backend, inside the compile.

    Both outputs are lazy: nothing is formatted unless a trace handler or DEBUG log is on.
    """
    _compat.trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": ARTIFACT_NAME, "encoding": "json"},
        payload_fn=lambda: json.dumps(report_payload(reports, unmatched_rules, graph_index), indent=1),
    )
    if log.isEnabledFor(logging.DEBUG):
        unmatched = "".join(f"\n{line}" for line in unmatched_rules)
        log.debug("qattn site report, graph %d:\n%s%s", graph_index, format_site_table(reports), unmatched)
