"""Nested compile regions: the subgraphs of ``torch.compiler.nested_compile_region``.

Dynamo traces a function or module ``forward`` decorated with ``nested_compile_region``
once, into a subgraph ``GraphModule`` of the graph, and calls it with each call's operands:
``invoke_subgraph(subgraph, identifier, *operands)``, one call per block. The attention
inside is found in the subgraph and named as the block dynamo traced it for names it (the
first call); it serves the blocks of the other calls too (:attr:`AttentionSite.serves`).
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import fx

from .. import _compat

INVOKE_SUBGRAPH = _compat.invoke_subgraph_target()


def region_calls(gm: fx.GraphModule) -> dict[fx.GraphModule, list[fx.Node]]:
    """Each nested compile region's subgraph of ``gm`` with its calls, in graph order."""
    calls: dict[fx.GraphModule, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if INVOKE_SUBGRAPH is None or node.op != "call_function" or node.target is not INVOKE_SUBGRAPH:
            continue
        getter = node.args[0]
        if isinstance(getter, fx.Node) and getter.op == "get_attr":
            calls.setdefault(getattr(gm, getter.target), []).append(node)
    return calls


def walk(gm: fx.GraphModule) -> Iterator[fx.Node]:
    """The nodes of ``gm`` in order, with each region's subgraph's nodes (recursively) just
    before the region's first call: the order of :func:`~qattn_compile.patterns.find_attention_sites`."""
    first_calls = {nodes[0]: subgraph for subgraph, nodes in region_calls(gm).items()}
    for node in gm.graph.nodes:
        if node in first_calls:
            yield from walk(first_calls[node])
        yield node


def served(fqn: str, callers: list[str]) -> tuple[str, ...] | None:
    """The names a site named ``fqn`` in a region's subgraph takes in the other calls of the
    region, whose callers (the decorated blocks) are named ``callers``; None when the site
    is not inside one of them (then which module each call runs it for is not known)."""
    traced = next((c for c in callers if not c or fqn == c or fqn.startswith(f"{c}.")), None)
    if traced is None:
        return None
    rest = fqn[len(traced):].lstrip(".")
    return tuple(".".join(filter(None, (c, rest))) for c in dict.fromkeys(callers) if c != traced)
