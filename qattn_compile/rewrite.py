"""Replace the attention sites of a dynamo FX graph with ``torch.ops.qattn.attention``."""

from __future__ import annotations

import logging

import torch
from torch import fx

from . import ops
from .errors import UnsupportedSiteError
from .patterns import AttentionSite, find_attention_sites
from .policy import Policy
from .report import FALLBACK, LEFT_ALONE, REWRITTEN, SiteReport

log = logging.getLogger("qattn_compile.rewrite")


def _site_dtype_device(site: AttentionSite):
    val = site.example("q")
    return (val.dtype, val.device) if isinstance(val, torch.Tensor) else (None, None)


def _unsupported(site: AttentionSite, preset: str, options) -> str | None:
    if site.refusal:
        return site.refusal
    dtype, device = _site_dtype_device(site)
    shapes = [site.example(n).shape for n in ("q", "k", "v")]
    return ops.unsupported_reason(*shapes, dtype, device, preset, options)


def _replace(gm: fx.GraphModule, site: AttentionSite, preset: str, options, report: SiteReport):
    graph = gm.graph
    with graph.inserting_before(site.anchor):
        new = graph.call_function(
            torch.ops.qattn.attention.default,
            (site.q, site.k, site.v, site.attn_mask, site.is_causal, site.scale, preset, options.to_json()),
        )
    new.meta.update(site.anchor.meta)
    new.meta["qattn"] = {"fqn": site.fqn, "rule": report.rule, "pattern": site.pattern, "preset": preset}
    site.anchor.replace_all_uses_with(new)
    graph.erase_node(site.anchor)
    for node in reversed(site.chain):
        if not node.users:
            graph.erase_node(node)


def rewrite_attention(gm: fx.GraphModule, policy: Policy, graph_index: int = 0) -> list[SiteReport]:
    """Rewrite every site ``policy`` chooses a preset for; report every site found.

    Raises :class:`UnsupportedSiteError` for a site that cannot be served when the policy
    says ``on_unsupported: error``.
    """
    reports = []
    for site in find_attention_sites(gm):
        decision = policy.decide(site.fqn, site.module_class)
        dtype, device = _site_dtype_device(site)
        report = SiteReport(
            fqn=site.fqn,
            module_class=site.module_class,
            pattern=site.pattern,
            source=site.source,
            shapes=site.shapes(),
            dtype=str(dtype).replace("torch.", "") if dtype else None,
            mask_kind=site.mask_kind,
            gqa_group=site.gqa_group,
            preset=decision.preset,
            options=decision.options.model_dump(),
            rule=decision.rule_text,
            rule_index=decision.rule_index,
            status=LEFT_ALONE,
            reason=decision.reason,
            graph_index=graph_index,
        )
        reports.append(report)
        if decision.preset == "none":
            log.info("qattn: %s left alone: %s", site.fqn, decision.reason)
            continue
        why_not = _unsupported(site, decision.preset, decision.options)
        if why_not:
            report.status, report.reason = FALLBACK, why_not
            if policy.on_unsupported == "error":
                raise UnsupportedSiteError(
                    f"attention site {site.fqn or '(top level)'} ({site.module_class}, "
                    f"{site.source}) chose preset {decision.preset!r} by {decision.rule_text} "
                    f"but cannot be served: {why_not}. Policy {policy.source} says "
                    "on_unsupported: error; use `fallback` to keep the original attention there."
                )
            log.warning("qattn: %s falls back to the original attention: %s", site.fqn, why_not)
            continue
        _replace(gm, site, decision.preset, decision.options, report)
        report.status = REWRITTEN
        report.execution = ops.execution_path(device)
        log.info("qattn: %s -> %s (%s)", site.fqn, decision.preset, decision.rule_text)
    gm.graph.lint()
    gm.recompile()
    return reports
