"""The per-site report: what qattn decided for every attention site, and why."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

REWRITTEN = "rewritten"
CAUSAL_MASK_NOTE = "causal mask proven from arange indices → is_causal"
"""What reports say of a site whose causal mask the rewrite replaced by ``is_causal``."""
LEFT_ALONE = "left_alone"  # the policy chose `none` or an ignore pattern matched
FALLBACK = "fallback"  # the policy chose a preset but the site cannot be served


@dataclass
class SiteReport:
    """One attention site's decision; serialisable to JSON."""

    fqn: str
    module_class: str | None
    pattern: str
    source: str | None
    shapes: dict
    dtype: str | None
    mask_kind: str
    gqa_group: int | None
    preset: str
    options: dict
    rule: str
    rule_index: int | None
    status: str
    reason: str
    execution: str | None = None  # "gluon", "triton" or "reference" for rewritten sites
    execution_reason: str | None = None  # why a CUDA site is not on tier 2 ("gluon")
    graph_index: int = 0
    causal_fast_path: bool = False  # the mask provably hides every key after its query
    gqa_source: str | None = None  # how K/V head sharing was found: repeat_kv, enable_gqa, ...
    causal_from_mask: bool = False  # the mask's causal part was proven and served as is_causal
    matched_rules: tuple[int, ...] = ()  # every rule matching the site (Decision.matched_rules)
    serves: tuple[str, ...] = ()  # other modules running this site's compiled code (AttentionSite.serves)

    def to_dict(self) -> dict:
        return asdict(self)


def write_report(path: str | Path, reports: list[SiteReport], unmatched_rules: list[str]) -> None:
    """Write the sites and the rules that matched nothing as JSON to ``path``."""
    payload = {
        "sites": [r.to_dict() for r in reports],
        "counts": count_by_status(reports),
        "pattern_counts": count_by_pattern(reports),
        "unmatched_rules": unmatched_rules,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2))


def count_by_status(reports: list[SiteReport]) -> dict[str, int]:
    counts = {REWRITTEN: 0, LEFT_ALONE: 0, FALLBACK: 0}
    for r in reports:
        counts[r.status] += 1
    return counts


def count_by_pattern(reports: list[SiteReport]) -> dict[str, dict[str, int]]:
    """Per pattern (``sdpa``, ``matmul_softmax``): how many sites got each status."""
    counts: dict[str, dict[str, int]] = {}
    for r in reports:
        counts.setdefault(r.pattern, {REWRITTEN: 0, LEFT_ALONE: 0, FALLBACK: 0})[r.status] += 1
    return counts


def format_grid(rows: list[tuple[str, ...]]) -> str:
    """Fixed-width text table: ``rows[0]`` is the header, underlined; the last column is not padded."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join([cell.ljust(w) for cell, w in zip(row, widths)] + [row[-1]]).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths) + "  " + "-" * len(rows[0][-1]))
    return "\n".join(lines)


def format_table(reports: list[SiteReport]) -> str:
    """The short per-site table: FQN, class, preset, status, and the deciding rule or reason."""
    rows = [("site (module FQN)", "class", "preset", "status", "rule / reason")]
    for r in reports:
        why = f"by {r.rule}" if r.status == REWRITTEN else r.reason
        rows.append((r.fqn or "(top level)", r.module_class or "-", r.preset, r.status, why))
    return format_grid(rows)
