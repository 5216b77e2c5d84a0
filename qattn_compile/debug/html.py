"""Render a :class:`~qattn_compile.debug.capture.Capture` as one self-contained HTML page.

The page has no scripts and no external assets: a table of the sites (each linked to its
place in the graph), the rules that matched nothing, and per graph a side-by-side view of the
code before and after the rewrite with changed lines highlighted and long unchanged stretches
folded into ``<details>``. Every site has an anchor ``site-<graph>-<n>`` that shows its module
FQN, the rule and preset, and the source line (file, line and code) that produced it.
"""

from __future__ import annotations

import difflib
import linecache
from dataclasses import dataclass, field
from pathlib import Path

import jinja2

from ..report import CAUSAL_MASK_NOTE, count_by_status
from .capture import Capture, CapturedGraph, CapturedSite, node_line
from .table import format_shapes, mask_cell, outcome

CONTEXT = 4
"""Unchanged lines shown around a change or a site before the rest is folded."""
MIN_FOLD = 3
"""Shorter unchanged stretches are shown rather than folded."""


@dataclass
class SiteView:
    """What the page shows about one site."""

    anchor: str
    site: CapturedSite
    source_url: str | None = None
    source_code: str = ""

    @property
    def report(self):
        return self.site.report

    @property
    def shapes(self) -> str:
        return format_shapes(self.report.shapes).replace(" / ", "\n")

    @property
    def source_label(self) -> str:
        """``file.py:line`` (the full path is the link's title)."""
        return Path(self.report.source or "").name

    @property
    def mask(self) -> str:
        return mask_cell(self.report)

    @property
    def outcome(self) -> str:
        return outcome(self.report)


@dataclass
class Row:
    """One line pair of the side-by-side view; ``sites`` are anchored just above it."""

    kind: str  # equal | replace | delete | insert
    left_no: int | None
    left: str
    right_no: int | None
    right: str
    sites: list[SiteView] = field(default_factory=list)
    marked: bool = False  # the line of a site's node

    @property
    def changed(self) -> bool:
        return self.kind != "equal"


def site_view(graph: CapturedGraph, n: int, site: CapturedSite) -> SiteView:
    """The anchor id, source link and source code line of one site."""
    view = SiteView(f"site-{graph.index}-{n}", site)
    path, _, line = (site.report.source or "").rpartition(":")
    if path and line.isdigit():
        view.source_url = Path(path).resolve().as_uri() + f"#L{line}"
        view.source_code = linecache.getline(path, int(line)).strip()
    return view


def diff_rows(before: list[str], after: list[str]) -> list[Row]:
    """Side-by-side rows of the two codes. A replaced block is paired line by line from its
    end (a rewritten chain of nodes ends in the node its replacement stands for)."""
    rows = []
    matcher = difflib.SequenceMatcher(None, before, after, autojunk=False)
    for kind, i1, i2, j1, j2 in matcher.get_opcodes():
        height = max(i2 - i1, j2 - j1)
        for k in range(height):
            i, j = i2 - height + k, j2 - height + k
            left = (i + 1, before[i]) if i >= i1 else (None, "")
            right = (j + 1, after[j]) if j >= j1 else (None, "")
            rows.append(Row(kind, left[0], left[1], right[0], right[1]))
    return rows


def _line_no(lines: list[str], name: str | None) -> int | None:
    """1-based line number of node ``name`` in ``lines`` (the diff rows' numbering)."""
    i = node_line(lines, name)
    return None if i is None else i + 1


def _attach_sites(rows: list[Row], graph: CapturedGraph, before: list[str], after: list[str]) -> None:
    """Mark the lines of each site's node (before and after the rewrite) and anchor the site
    above the first of them (above the first row when neither can be found)."""
    left_rows = {r.left_no: k for k, r in enumerate(rows) if r.left_no}
    right_rows = {r.right_no: k for k, r in enumerate(rows) if r.right_no}
    for n, site in enumerate(graph.sites):
        found = [
            left_rows.get(_line_no(before, site.node_before)),
            right_rows.get(_line_no(after, site.node_after)),
        ]
        found = [k for k in found if k is not None]
        for k in found:
            rows[k].marked = True
        rows[min(found, default=0)].sites.append(site_view(graph, n, site))


def _flush(blocks: list, stretch: list[Row]) -> None:
    """Append an unchanged stretch: as one fold, or row by row when it is short."""
    blocks.extend(stretch if len(stretch) < MIN_FOLD else [stretch])


def fold(rows: list[Row]) -> list[list[Row] | Row]:
    """Rows near a change or a site stay; other unchanged stretches become one list (a fold)."""
    keep = [False] * len(rows)
    for k, row in enumerate(rows):
        if row.changed or row.sites or row.marked:
            for m in range(max(0, k - CONTEXT), min(len(rows), k + CONTEXT + 1)):
                keep[m] = True
    blocks: list[list[Row] | Row] = []
    stretch: list[Row] = []
    for row, kept in zip(rows, keep):
        if kept:
            _flush(blocks, stretch)
            stretch = []
            blocks.append(row)
        else:
            stretch.append(row)
    _flush(blocks, stretch)
    return blocks


@dataclass
class GraphView:
    """One graph's section of the page."""

    index: int
    blocks: list
    sites: list[SiteView]
    changed: int


def graph_view(graph: CapturedGraph) -> GraphView:
    """Rows, folds and site anchors of one graph."""
    before, after = graph.code_before.splitlines(), graph.code_after.splitlines()
    rows = diff_rows(before, after)
    _attach_sites(rows, graph, before, after)
    sites = [view for row in rows for view in row.sites]
    return GraphView(graph.index, fold(rows), sites, sum(r.changed for r in rows))


def render_html(capture: Capture, title: str) -> str:
    """The whole page as one HTML string."""
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    template = env.from_string(TEMPLATE)
    graphs = [graph_view(g) for g in capture.graphs]
    return template.render(
        title=title,
        policy=capture.policy.source,
        counts=count_by_status(capture.reports),
        graphs=graphs,
        sites=[s for g in graphs for s in g.sites],
        unmatched=capture.unmatched_rules(),
        causal_note=CAUSAL_MASK_NOTE,
    )


TEMPLATE = r"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{{ title }}</title>
<style>
  body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #1f2328; }
  h1 { font-size: 1.5em; margin: 0 0 .2em; }
  h2 { font-size: 1.2em; margin: 1.5em 0 .4em; }
  .meta { color: #59636e; margin-bottom: 1em; }
  table { border-collapse: collapse; }
  .sites td, .sites th { border: 1px solid #d1d9e0; padding: 3px 6px; text-align: left; vertical-align: top; }
  .sites th { background: #f6f8fa; }
  .sites { width: 100%; }
  .sites td.wrap { overflow-wrap: break-word; }
  .sites td.code-wrap { overflow-wrap: anywhere; min-width: 8em; }
  .sites td.nowrap { white-space: nowrap; }
  .sites td.shapes { white-space: pre; }
  .status-rewritten { color: #1a7f37; font-weight: 600; }
  .status-left_alone { color: #59636e; font-weight: 600; }
  .status-fallback { color: #bc4c00; font-weight: 600; }
  .warn { background: #fff8c5; border: 1px solid #d4a72c; padding: .5em 1em; margin: 1em 0; }
  .ok { color: #1a7f37; }
  code, .code { font: 12px/1.45 ui-monospace, "DejaVu Sans Mono", monospace; }
  .diff { table-layout: fixed; width: 100%; border: 1px solid #d1d9e0; }
  .diff col.no { width: 3.5em; }
  .diff td { padding: 0 6px; vertical-align: top; }
  .diff td.no { color: #8c959f; text-align: right; user-select: none; background: #f6f8fa; }
  .diff td.code { white-space: pre-wrap; overflow-wrap: anywhere; }
  .diff td.comment { color: #6e7781; }
  .diff td.del { background: #ffebe9; }
  .diff td.ins { background: #dafbe1; }
  .diff tr.marked td.code { font-weight: 700; }
  .diff tr.site td { background: #ddf4ff; border-top: 2px solid #0969da; padding: 3px 8px; }
  .diff tr.site:target td { background: #fff8c5; }
  .diff tr.fold td { background: #f6f8fa; color: #59636e; padding: 2px 8px; }
  .diff tr.fold table { width: 100%; table-layout: fixed; }
  .legend span { padding: 0 .5em; margin-right: .5em; }
</style>
</head>
<body>
<h1>{{ title }}</h1>
<div class="meta">policy: <code>{{ policy }}</code> &middot;
  {{ sites|length }} attention site(s) in {{ graphs|length }} graph(s):
  {{ counts.rewritten }} rewritten, {{ counts.left_alone }} left alone, {{ counts.fallback }} fell back</div>

{% if unmatched %}<div class="warn"><strong>Rules that matched nothing</strong><ul>
{% for line in unmatched %}<li>{{ line }}</li>{% endfor %}</ul></div>
{% else %}<p class="ok">Every rule of the policy matched at least one site.</p>{% endif %}

<table class="sites">
<tr><th>site (module FQN)</th><th>class</th><th>pattern</th><th>shapes q / k / v</th><th>mask</th><th>GQA</th>
<th>rule</th><th>preset</th><th>status</th><th>kernel variant / why left alone</th><th>source</th></tr>
{% for s in sites %}<tr>
<td class="wrap"><a href="#{{ s.anchor }}"><code>{{ s.report.fqn or "(top level)" }}</code></a></td>
<td class="nowrap">{{ s.report.module_class or "-" }}</td><td class="nowrap">{{ s.report.pattern }}</td>
<td class="shapes"><code>{{ s.shapes }}</code></td><td class="nowrap"{% if s.report.causal_from_mask %} title="{{ causal_note }}"{% endif %}>{{ s.mask }}</td>
<td class="nowrap">{{ s.report.gqa_group if s.report.gqa_group is not none else "-" }}</td>
<td class="code-wrap"><code>{{ s.report.rule }}</code></td><td class="nowrap">{{ s.report.preset }}</td>
<td class="nowrap status-{{ s.report.status }}">{{ s.report.status }}</td><td>{{ s.outcome }}</td>
<td class="code-wrap">{% if s.source_url %}<a href="{{ s.source_url }}" title="{{ s.report.source }}"><code>{{ s.source_label }}</code></a>{% else %}-{% endif %}</td>
</tr>{% else %}<tr><td colspan="11">No attention site was found.</td></tr>{% endfor %}
</table>

{% macro line_row(r) -%}
<tr class="{{ 'marked' if r.marked }}"><td class="no">{{ r.left_no or "" }}</td>
<td class="code{{ ' del' if r.changed and r.left_no }}{{ ' comment' if r.left.lstrip().startswith('#') }}">{{ r.left }}</td>
<td class="no">{{ r.right_no or "" }}</td>
<td class="code{{ ' ins' if r.changed and r.right_no }}{{ ' comment' if r.right.lstrip().startswith('#') }}">{{ r.right }}</td></tr>
{%- endmacro %}

{% for g in graphs %}
<h2 id="graph-{{ g.index }}">Graph {{ g.index }}: {{ g.changed }} changed line(s), {{ g.sites|length }} site(s)</h2>
<div class="legend"><span class="code" style="background:#ffebe9">before (dynamo graph)</span>
<span class="code" style="background:#dafbe1">after the qattn rewrite</span></div>
<table class="diff">
<colgroup><col class="no"><col><col class="no"><col></colgroup>
{% for b in g.blocks %}
{% if b is sequence %}
<tr class="fold"><td colspan="4"><details><summary>{{ b|length }} unchanged lines
({{ b[0].left_no }}&ndash;{{ b[-1].left_no }})</summary>
<table class="diff"><colgroup><col class="no"><col><col class="no"><col></colgroup>
{% for r in b %}{{ line_row(r) }}{% endfor %}</table></details></td></tr>
{% else %}
{% for s in b.sites %}
<tr class="site" id="{{ s.anchor }}"><td colspan="4">
<strong>{{ s.report.fqn or "(top level)" }}</strong> ({{ s.report.module_class or "?" }}, {{ s.report.pattern }})
&middot; <span class="status-{{ s.report.status }}">{{ s.report.status }}</span>
&middot; {{ s.report.rule }} &rarr; {{ s.report.preset }} &middot; {{ s.outcome }}
{% if s.report.causal_from_mask %}&middot; {{ causal_note }}{% endif %}<br>
source: {% if s.source_url %}<a href="{{ s.source_url }}" title="{{ s.report.source }}"><code>{{ s.source_label }}</code></a>
<code>{{ s.source_code }}</code>{% else %}unknown{% endif %}
</td></tr>
{% endfor %}
{{ line_row(b) }}
{% endif %}
{% endfor %}
</table>
{% endfor %}
</body>
</html>
"""
