"""Replace the attention sites of a dynamo FX graph with ``torch.ops.qattn.attention``.

For each site the policy chooses a preset for, the rewrite inserts before the site's output
node (with the output's module provenance, and fake example values so later passes see
correct shapes):

1. run-time scale factors multiplied into q (the op's ``scale`` takes the constant part);
2. Kᵀ transposed back when the chain held the key only transposed;
3. the mask: each term first moved into the site's batch layout when it was applied while
   a ``view`` regrouped the scores' batch dims (OPT/BLOOM's ``[B·H, L, L]`` ↔ ``[B, H, L, L]``,
   Swin's windows); keep terms ANDed (``masked_fill`` masks negated: True = attend), additive
   terms summed (each times the scale factors applied after it), and both together as
   ``where(keep, additive, -inf)``. A causal comparison proven from ``arange`` indices
   (:func:`~qattn_compile.patterns.masks.split_causal`) is left out of the keep terms and
   passed as ``is_causal=True`` instead, so a materialized causal mask costs nothing;
4. a leading batch dim of 1 around rank-3 (``[B·H, L, D]``) sites;
5. the op, then a cast when the site's output dtype differs from q's;

then points every user of the site's output at the new value and erases the matched nodes
that no longer have users (softmax chain, transposes, ``repeat_kv``), and the mask-building
nodes left without users (a causal mask replaced by ``is_causal``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator

import torch
from torch import fx

from . import _compat, ops
from .errors import PolicyError, UnsupportedSiteError
from .patterns import AttentionSite, ModuleNames, expand_mha, find_attention_sites
from .patterns.emit import Emitter
from .patterns.masks import MaskSpec, Regroup, split_causal
from .patterns.nodes import mutates, shape_of, tensor_value
from .policy import Decision, Policy
from .presets import KernelOptions
from .report import FALLBACK, LEFT_ALONE, REWRITTEN, SiteReport
from .scales import options_for_site, site_keys

log = logging.getLogger("qattn_compile.rewrite")


def _site_dtype_device(site: AttentionSite):
    val = tensor_value(site.q)
    return (val.dtype, val.device) if val is not None else (None, None)


def _op_shapes(site: AttentionSite) -> list[tuple]:
    """Shapes of q, k, v as the op receives them."""
    q, k, v = site.op_shapes().values()
    if len(q) == 3:
        q, k, v = ((1, *s) for s in (q, k, v))
    return [q, k, v]


def _unsupported(site: AttentionSite, preset: str, options) -> str | None:
    if site.refusal:
        return site.refusal
    dtype, device = _site_dtype_device(site)
    return ops.unsupported_reason(*_op_shapes(site), dtype, device, preset, options)


def _tier_inputs(site: AttentionSite, decision: Decision) -> dict:
    """What :func:`qattn_compile.ops.execution_path` weighs for a site: its preset and
    options, the op's shapes (size hints of symbolic sizes), dtype, whether a tensor mask
    remains once causality is taken out, the softmax scale and causality."""
    spec, causal_from_mask = split_causal(site.mask)
    dtype, _ = _site_dtype_device(site)
    shapes = [tuple(_compat.size_hint(d) or 0 for d in shape) for shape in _op_shapes(site)]
    return {"preset": decision.preset, "options": decision.options,
            "shapes": shapes, "dtype": dtype, "masked": bool(spec.keep or spec.additive),
            "scale": site.scale, "causal": bool(site.is_causal or causal_from_mask),
            "softcap": site.softcap}


def _scaled(emit: Emitter, node: fx.Node, factors) -> fx.Node:
    """``node`` multiplied (or divided) by each factor in turn."""
    for factor in factors:
        node = emit(operator.truediv if factor.divide else operator.mul, node, factor.value)
    return node


def _build_mask(emit: Emitter, spec: MaskSpec) -> fx.Node | None:
    """The op's one mask from the mask terms ``spec`` (see the module docstring)."""
    keep = None
    for term in spec.keep:
        node = _regrouped(emit, term.node, term.regroup)
        node = emit(torch.logical_not, node) if term.negate else node
        keep = node if keep is None else emit(torch.logical_and, keep, node)
    additive = None
    for term in spec.additive:
        node = _scaled(emit, _regrouped(emit, term.node, term.regroup), term.factors)
        additive = node if additive is None else emit(operator.add, additive, node)
    if keep is None or additive is None:
        return keep if additive is None else additive
    return emit(torch.where, keep, additive, -math.inf)


def _regrouped(emit: Emitter, node: fx.Node, regroup: Regroup | None) -> fx.Node:
    """A mask term moved into the site's batch layout (see :class:`Regroup`)."""
    for name, args in regroup.ops if regroup else ():
        node = emit(name, node, *args, method=True)
    return node


def _permuted(emit: Emitter, node: fx.Node, dims: tuple[int, ...] | None) -> fx.Node:
    """``node.permute(dims)``, or ``node`` when ``dims`` is None."""
    return node if dims is None else emit("permute", node, *dims, method=True)


def _build_query(emit: Emitter, site: AttentionSite) -> fx.Node:
    """q in the op's layout with the run-time scale factors (which are in the scores'
    layout) multiplied in, in q's dtype."""
    return _cast_like(emit, _scaled(emit, _permuted(emit, site.q, site.q_dims), site.scale_factors), site.q)


def _cast_like(emit: Emitter, node: fx.Node, like: fx.Node) -> fx.Node:
    """``node`` cast to the dtype of ``like`` when their example dtypes differ."""
    have, want = tensor_value(node), tensor_value(like)
    if have is None or want is None or have.dtype == want.dtype:
        return node
    return emit("to", node, want.dtype, method=True)


def _is_pure(node: fx.Node) -> bool:
    """Whether erasing ``node`` once unused changes nothing else: a call that neither mutates
    its inputs nor has side effects."""
    return node.op in ("call_function", "call_method") and not node.is_impure() and not mutates(node)


def _erase_dead(graph: fx.Graph, nodes: list[fx.Node], matched: list[fx.Node]) -> None:
    """Erase the nodes of ``nodes`` left without users, then their inputs left without users,
    transitively (the replaced attention chain, a mask the op no longer reads down to its
    ``arange``). A node of ``matched`` (the replaced chain: its in-place ops only fed the
    chain) goes once unused; any other node only when pure (:func:`_is_pure`)."""
    chain = set(matched)
    pending, erased = list(dict.fromkeys(nodes)), set()
    while pending:
        node = pending.pop()
        if node in erased or node.users or not (node in chain or _is_pure(node)):
            continue
        pending += node.all_input_nodes
        graph.erase_node(node)
        erased.add(node)


def _replace(gm: fx.GraphModule, site: AttentionSite, decision: Decision, report: SiteReport) -> None:
    """Replace ``site`` by the op with the preset and options of ``decision``."""
    preset = decision.preset
    graph = site.anchor.graph  # gm's, or a nested compile region's subgraph's
    emit = Emitter(graph, site.anchor)
    q, k, v = _build_query(emit, site), _permuted(emit, site.k, site.k_dims), _permuted(emit, site.v, site.v_dims)
    spec, causal_from_mask = split_causal(site.mask)
    mask = _build_mask(emit, spec)
    rank3 = len(shape_of(site.q)) == 3
    if rank3:
        q, k, v = (emit("unsqueeze", t, 0, method=True) for t in (q, k, v))
    _, device = _site_dtype_device(site)
    is_causal = site.is_causal or causal_from_mask
    out = emit(ops.graph_op(report.execution), q, k, v, mask, is_causal, site.scale, preset,
               decision.options.to_json(), site.softcap)
    report.causal_from_mask = causal_from_mask
    out.meta["qattn"] = {
        "fqn": site.fqn,
        "rule": report.rule,
        "pattern": site.pattern,
        "preset": preset,
        "mask_kind": site.mask_kind,
        "causal_fast_path": site.causal_fast_path,
        "causal_from_mask": causal_from_mask,
    }
    if rank3:
        out = emit("squeeze", out, 0, method=True)
    out = _permuted(emit, out, site.out_dims)
    site.anchor.replace_all_uses_with(_cast_like(emit, out, site.anchor))
    _erase_dead(graph, [*site.chain, *site.mask.nodes()], matched=site.chain)


def rewrite_attention(
    gm: fx.GraphModule, policy: Policy, graph_index: int = 0, autotune: bool | None = None,
    names: ModuleNames | None = None,
) -> list[SiteReport]:
    """Rewrite every site ``policy`` chooses a preset for; report every site found.

    ``autotune`` (not None) overrides the ``autotune`` option of every rewritten site
    (the backend option of that name). ``names`` names the sites (default: the traced
    frame's module tree, :class:`~qattn_compile.patterns.ModuleNames`).

    Every site is decided first (in graph order); the chosen ones are then replaced from the
    last to the first, so that a site reading an earlier site's output (the next layer's
    attention) still holds valid nodes when it is replaced.

    Raises :class:`UnsupportedSiteError` for a site that cannot be served when the policy
    says ``on_unsupported: error``, and :class:`PolicyError` for a site whose compiled code
    also serves modules the policy decides differently (both before the graph is modified).
    """
    reports, chosen = [], []
    expand_mha(gm)
    sites = find_attention_sites(gm, names)
    for site, key in zip(sites, site_keys([s.fqn for s in sites])):
        decision = _shared_decision(site, key, policy.decide(site.fqn, site.module_class), policy)
        if autotune is not None and isinstance(decision.options, KernelOptions):
            options = decision.options.model_copy(update={"autotune": autotune})
            decision = dataclasses.replace(decision, options=options)
        # The site's own options (static fmha_int8's calibrated α, keyed as the capture
        # keys them) before the support check, which needs them; a site the finder refused
        # falls back whatever its options, and calibration never recorded it.
        if site.refusal is None:
            options = options_for_site(decision.preset, decision.options, key, policy.source)
            decision = dataclasses.replace(decision, options=options)
        report = _decide(site, decision, policy, graph_index)
        reports.append(report)
        if report.status == REWRITTEN:
            chosen.append((site, decision, report))
    for site, decision, report in reversed(chosen):
        _replace(gm, site, decision, report)
    for graph in dict.fromkeys([gm.graph, *(site.anchor.graph for site, _, _ in chosen)]):
        graph.lint()
        graph.owning_module.recompile()
    return reports


def _shared_decision(site: AttentionSite, key: str, decision: Decision, policy: Policy) -> Decision:
    """``decision``, once every module the site's compiled code also serves
    (:attr:`AttentionSite.serves`) is decided alike (calibrated per-site options included);
    its ``matched_rules`` then count the rules matching those modules too. Raises
    :class:`PolicyError` naming the first module decided otherwise: one compiled region
    cannot apply two decisions."""
    if not site.serves:
        return decision
    theirs = {other: policy.decide(other, site.module_class) for other in site.serves}
    if site.refusal is None:  # a refused site keeps its attention in every block: nothing to split
        call = key[key.index("#"):] if "#" in key else ""  # a module's later calls: fqn#1, ...

        def applied(d: Decision, site_key: str) -> tuple:
            return d.preset, options_for_site(d.preset, d.options, site_key, policy.source)

        ours = applied(decision, key)
        for other, their in theirs.items():
            if applied(their, other + call) != ours:
                raise PolicyError(
                    f"attention site {site.fqn} ({site.module_class}) and {other} run one compiled "
                    "graph (dynamo compiles a block once for all blocks of its class when the block "
                    "is a region of its own: compiled on its own, a nested compile region, or a "
                    f"frame of its own after a graph break inside it), but policy {policy.source} "
                    f"decides them differently: {site.fqn} gets {decision.preset!r} by "
                    f"{decision.rule_text}, {other} gets {their.preset!r} by {their.rule_text}"
                    f"{' (other options)' if their.preset == decision.preset else ''}. Write rules "
                    "that decide these blocks alike, or compile the whole model with its blocks in "
                    "no region of their own."
                )
    matched = {i for d in (decision, *theirs.values()) for i in d.matched_rules}
    return dataclasses.replace(decision, matched_rules=tuple(sorted(matched)))


def _decide(site: AttentionSite, decision: Decision, policy: Policy, graph_index: int) -> SiteReport:
    """The report of ``site`` given the policy's ``decision``: rewritten, left alone, or
    fallback (and why)."""
    dtype, device = _site_dtype_device(site)
    report = SiteReport(
        fqn=site.fqn,
        module_class=site.module_class,
        serves=site.serves,
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
        matched_rules=decision.matched_rules,
        status=LEFT_ALONE,
        reason=decision.reason,
        graph_index=graph_index,
        causal_fast_path=site.causal_fast_path,
        gqa_source=site.gqa_source,
    )
    if decision.preset == "none":
        log.info("qattn: %s left alone: %s", site.fqn, decision.reason)
        return report
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
        return report
    report.status = REWRITTEN
    report.execution, report.execution_reason = ops.execution_path(device, _tier_inputs(site, decision))
    log.info("qattn: %s -> %s (%s)", site.fqn, decision.preset, decision.rule_text)
    if report.execution != "triton" and getattr(decision.options, "autotune", False):
        log.info("qattn: %s: autotune has no effect here (the %s path runs; tiles are timed "
                 "only for the Triton kernels on CUDA)", site.fqn, report.execution)
    return report
