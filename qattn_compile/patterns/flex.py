"""FlexAttention calls (``torch.nn.attention.flex_attention``) in a dynamo graph.

Dynamo records ``flex_attention`` as one higher-order op whose ``score_mod`` and block mask
are subgraphs run inside its own kernel. qattn's kernels take a plain mask, not a score
function, so every such call is reported as a site with that reason (never silently left
out of the report).
"""

from __future__ import annotations

import torch
from torch import fx

from .site import AttentionSite, module_of, source_of

PATTERN = "flex_attention"
REASON = ("FlexAttention (torch.nn.attention.flex_attention) applies its score_mod/mask_mod "
          "inside its own kernel: not served (use attn_implementation sdpa or eager for qattn)")
_FLEX = getattr(torch.ops.higher_order, "flex_attention", None)


def flex_site(node: fx.Node) -> AttentionSite | None:
    """The refused :class:`AttentionSite` of a ``flex_attention`` call; ``None`` for other nodes."""
    if _FLEX is None or node.op != "call_function" or node.target is not _FLEX:
        return None
    q, k, v = node.args[:3]
    fqn, cls = module_of(node)
    return AttentionSite(pattern=PATTERN, anchor=node, q=q, k=k, v=v, fqn=fqn, module_class=cls,
                         source=source_of(node), refusal=REASON, chain=[node])
