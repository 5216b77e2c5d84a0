"""Debugging tools: did qattn match my layer, what did it become, and if not, why not?

- :func:`graph_diff`: the dynamo graphs before and after the rewrite, as a unified text diff
  (``.text``) and a self-contained HTML page (``.html()``, ``.write_html(path)``);
- :func:`explain`: the per-site decisions as a table, and the rules that matched nothing;
- :func:`emit_site_report`: the per-site report as a ``trace_structured`` artifact
  (``tlparse``) and a DEBUG log (``TORCH_LOGS=+qattn``), for backends;
- ``qattn diff`` / ``qattn explain``: :func:`qattn_compile.debug.commands.add_subcommands`.
"""

from .capture import Capture, capture_graphs
from .diff import GraphDiff, graph_diff
from .explain import Explanation, explain
from .table import format_site_table, kernel_variant
from .trace import ARTIFACT_NAME, emit_site_report

__all__ = [
    "ARTIFACT_NAME",
    "Capture",
    "Explanation",
    "GraphDiff",
    "capture_graphs",
    "emit_site_report",
    "explain",
    "format_site_table",
    "graph_diff",
    "kernel_variant",
]
