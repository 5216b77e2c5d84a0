"""Find ``F.scaled_dot_product_attention`` calls in a dynamo graph."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx

from .site import AttentionSite, example_value, module_of, source_of

SDPA_TARGETS = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)
SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def _bound_args(node: fx.Node) -> dict:
    """SDPA's arguments by parameter name, positional or keyword, defaults filled in."""
    bound = dict(_DEFAULTS)
    bound.update(zip(SDPA_PARAMS, node.args))
    bound.update(node.kwargs)
    return bound


def _mask_kind(mask, is_causal: bool) -> str:
    if mask is None:
        return "causal" if is_causal else "none"
    val = example_value(mask)
    kind = "bool" if getattr(val, "dtype", None) == torch.bool else "additive"
    return f"causal+{kind}" if is_causal else kind


def _refusal(args: dict) -> str | None:
    """Why an SDPA call cannot be rewritten, or None."""
    for name in ("dropout_p", "is_causal", "scale", "enable_gqa"):
        if isinstance(args[name], fx.Node):
            return f"`{name}` is computed at run time; only constants can be served"
    if args["dropout_p"]:
        return f"dropout_p={args['dropout_p']} (dropout in training is not served)"
    q, k, v = (example_value(args[n]) for n in ("query", "key", "value"))
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "query/key/value have no recorded example values"
    if any(t.requires_grad for t in (q, k, v)):
        return "inputs require grad (training through qattn is not supported)"
    if not (q.dim() == k.dim() == v.dim() == 4):
        return f"rank {q.dim()} inputs (only [B, H, L, D] is served)"
    if q.shape[1] != k.shape[1] and not args["enable_gqa"]:
        return "query and key/value head counts differ without enable_gqa"
    mask = example_value(args["attn_mask"]) if args["attn_mask"] is not None else None
    if mask is not None and mask.dim() > 4:
        return f"attn_mask of rank {mask.dim()}"
    return None


def find_sdpa_sites(gm: fx.GraphModule) -> list[AttentionSite]:
    """One :class:`AttentionSite` per SDPA call in ``gm``, in graph order."""
    sites = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in SDPA_TARGETS:
            continue
        args = _bound_args(node)
        fqn, cls = module_of(node)
        causal = args["is_causal"]
        sites.append(
            AttentionSite(
                pattern="sdpa",
                anchor=node,
                q=args["query"],
                k=args["key"],
                v=args["value"],
                attn_mask=args["attn_mask"],
                is_causal=bool(causal) if not isinstance(causal, fx.Node) else False,
                scale=args["scale"] if not isinstance(args["scale"], fx.Node) else None,
                dropout_p=args["dropout_p"] if not isinstance(args["dropout_p"], fx.Node) else 0.0,
                mask_kind=_mask_kind(args["attn_mask"], bool(causal) is True),
                fqn=fqn,
                module_class=cls,
                source=source_of(node),
                refusal=_refusal(args),
            )
        )
    return sites
