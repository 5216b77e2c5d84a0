"""Attention site finders: each returns :class:`AttentionSite` records for a dynamo FX graph.

- :mod:`.sdpa`: ``F.scaled_dot_product_attention`` calls;
- :mod:`.chains`: hand-written ``matmul → scale → mask → softmax → matmul`` chains;
- :mod:`.gqa`: K/V repeated per head traced back to the un-repeated tensors;
- :mod:`.masks`: mask terms and their kind (causal, padding, sliding window, …);
- :mod:`.scaling`: softmax scale factors (constant or run-time);
- :mod:`.site`: the :class:`AttentionSite` record and site naming (module FQN, class, line).
"""

from torch import fx

from .chains import chain_site
from .sdpa import sdpa_site
from .site import AttentionSite, ModuleNames


def find_attention_sites(gm: fx.GraphModule, names: ModuleNames | None = None) -> list[AttentionSite]:
    """Every attention site (and refused candidate) of a dynamo FX graph, in graph order.

    Each site is named by ``names`` (default: the module tree of the frame dynamo is
    compiling now, see :class:`ModuleNames`). Pure: the graph is not modified.
    """
    names = ModuleNames.of_traced_frame() if names is None else names
    sites = []
    for node in gm.graph.nodes:
        site = sdpa_site(node) or chain_site(node)
        if site is not None:
            site.fqn, site.module_class, site.serves = names.name(site.anchor)
            sites.append(site)
    return sites


__all__ = ["AttentionSite", "ModuleNames", "find_attention_sites"]
