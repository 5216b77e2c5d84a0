"""Attention site finders: each returns :class:`AttentionSite` records for a dynamo FX graph.

- :mod:`.sdpa`: ``F.scaled_dot_product_attention`` calls;
- :mod:`.chains`: hand-written ``matmul → scale → mask → softmax → matmul`` chains;
- :mod:`.mha`: ``nn.MultiheadAttention`` calls (expanded into an SDPA call when served) and
  PyTorch's fused transformer fast paths;
- :mod:`.flex`: FlexAttention calls (reported, not served);
- :mod:`.gqa`: K/V repeated per head traced back to the un-repeated tensors;
- :mod:`.masks`: mask terms and their kind (causal, padding, sliding window, …);
- :mod:`.scaling`: softmax scale factors (constant or run-time);
- :mod:`.site`: the :class:`AttentionSite` record and site naming (module FQN, class, line);
- :mod:`.regions`: sites inside ``nested_compile_region`` subgraphs, and the blocks they serve.
"""

from torch import fx

from . import regions
from .chains import chain_site
from .flex import flex_site
from .mha import expand_mha, mha_site
from .sdpa import sdpa_site
from .site import AttentionSite, ModuleNames


def find_attention_sites(gm: fx.GraphModule, names: ModuleNames | None = None) -> list[AttentionSite]:
    """Every attention site (and refused candidate) of a dynamo FX graph, in graph order,
    the sites of each nested compile region's subgraph (:mod:`.regions`) at its first call.

    Each site is named by ``names`` (default: the module tree of the frame dynamo is
    compiling now, see :class:`ModuleNames`). Pure: the graph is not modified (the
    rewrite first runs :func:`expand_mha`, so that a served ``nn.MultiheadAttention``
    is found as its SDPA call).
    """
    names = ModuleNames.of_traced_frame() if names is None else names
    calls = regions.region_calls(gm)
    first_calls = {nodes[0]: subgraph for subgraph, nodes in calls.items()}
    sites = []
    for node in gm.graph.nodes:
        if node in first_calls:
            subgraph = first_calls[node]
            callers = [names.name(call)[0] for call in calls[subgraph]]
            sites += [_in_region(site, callers) for site in find_attention_sites(subgraph, names)]
        site = sdpa_site(node) or chain_site(node) or mha_site(node) or flex_site(node)
        if site is not None:
            site.fqn, site.module_class, site.serves = names.name(site.anchor)
            if site.child is not None:
                attribute, site.module_class = site.child
                site.fqn = f"{site.fqn}.{attribute}" if site.fqn else attribute
                site.serves = tuple(f"{name}.{attribute}" for name in site.serves)
            sites.append(site)
    return sites


def _in_region(site: AttentionSite, callers: list[str]) -> AttentionSite:
    """``site`` of a region's subgraph (its ``serves``: those of a region inside it), also
    serving the blocks of the region's other calls (``callers``: the calls' module names);
    refused when those are not known."""
    mapped = [regions.served(name, callers) for name in (site.fqn, *site.serves)]
    if any(m is None for m in mapped):
        site.refusal = site.refusal or (
            f"inside a nested compile region called by {', '.join(dict.fromkeys(callers))}: "
            "which module each call runs it for is not known"
        )
    else:
        site.serves = tuple(dict.fromkeys([*site.serves, *(n for m in mapped for n in m)]))
    return site


__all__ = ["AttentionSite", "ModuleNames", "expand_mha", "find_attention_sites"]
