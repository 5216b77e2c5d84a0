"""Attention site finders: each returns :class:`AttentionSite` records for a dynamo FX graph.

- :mod:`.sdpa`: ``F.scaled_dot_product_attention`` calls;
- :mod:`.chains`: hand-written ``matmul → scale → mask → softmax → matmul`` chains;
- :mod:`.mha`: ``nn.MultiheadAttention`` calls (expanded into an SDPA call when served) and
  PyTorch's fused transformer fast paths;
- :mod:`.flex`: FlexAttention calls (reported, not served);
- :mod:`.gqa`: K/V repeated per head traced back to the un-repeated tensors;
- :mod:`.masks`: mask terms and their kind (causal, padding, sliding window, …);
- :mod:`.scaling`: softmax scale factors (constant or run-time);
- :mod:`.site`: the :class:`AttentionSite` record and site naming (module FQN, class, line).
"""

from torch import fx

from .chains import chain_site
from .flex import flex_site
from .mha import expand_mha, mha_site
from .sdpa import sdpa_site
from .site import AttentionSite


def find_attention_sites(gm: fx.GraphModule) -> list[AttentionSite]:
    """Every attention site (and refused candidate) of a dynamo FX graph, in graph order.

    Pure: the graph is not modified (the rewrite first runs :func:`expand_mha`, so that a
    served ``nn.MultiheadAttention`` is found as its SDPA call).
    """
    sites = []
    for node in gm.graph.nodes:
        site = sdpa_site(node) or chain_site(node) or mha_site(node) or flex_site(node)
        if site is not None:
            sites.append(site)
    return sites


__all__ = ["AttentionSite", "expand_mha", "find_attention_sites"]
