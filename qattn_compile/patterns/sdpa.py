"""Find ``F.scaled_dot_product_attention`` calls in a dynamo graph.

Every spelling dynamo records is read the same way: positional or keyword arguments,
``attn_mask`` None / bool / additive float of any broadcastable shape, ``is_causal``,
``scale`` (None, a float, or a run-time value such as ``.item()`` of a module attribute
under ``dynamic=True``), ``enable_gqa`` and ``dropout_p`` (only 0 is served, also a symbolic
0: under ``dynamic=True`` a float default such as diffusers' ``dropout_p=0.0`` reaches SDPA
as ``.item()`` of a graph input, which dynamo guards to be 0). K/V repeated
by ``repeat_kv``/``repeat_interleave`` are traced back to the un-repeated tensors.
"""

from __future__ import annotations

import torch
from torch import fx

from .. import _compat
from . import gqa, masks
from .masks import AdditiveTerm, KeepTerm, MaskSpec
from .nodes import example_value, grad_refusal, same_size, shape_of, tensor_value
from .scaling import Factor, as_factor
from .site import AttentionSite, module_of, source_of

SDPA_TARGETS = _compat.sdpa_graph_targets()
SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
_CONSTANT_ONLY = ("dropout_p", "is_causal", "enable_gqa")


def _bound_args(node: fx.Node) -> dict:
    """SDPA's arguments by parameter name, positional or keyword, defaults filled in; a
    symbolic ``dropout_p`` known (and guarded by dynamo) to be 0 as ``0.0``."""
    bound = dict(_DEFAULTS)
    bound.update(zip(SDPA_PARAMS, node.args, strict=False))
    bound.update(node.kwargs)
    dropout = example_value(bound["dropout_p"])
    if isinstance(dropout, (torch.SymFloat, torch.SymInt)) and _compat.statically_known_true(dropout == 0):
        bound["dropout_p"] = 0.0
    return bound


def _refusal(node: fx.Node, args: dict, scale: Factor | str | None) -> str | None:
    """Why the SDPA call ``node`` (bound arguments ``args``) cannot be rewritten, or None."""
    for name in _CONSTANT_ONLY:
        if isinstance(args[name], fx.Node):
            return f"`{name}` is computed at run time; only constants can be served"
    if args["dropout_p"]:
        return f"dropout_p={args['dropout_p']} (dropout in training is not served)"
    if isinstance(scale, str):
        return scale
    q, k, v = (tensor_value(args[n]) for n in ("query", "key", "value"))
    if not all(t is not None for t in (q, k, v)):
        return "query/key/value have no recorded example values"
    if not (q.dim() == k.dim() == v.dim() and q.dim() in (3, 4)):
        return f"rank-{q.dim()} inputs (only [B, H, L, D] or [B, L, D] are served)"
    if not same_size(q.shape[-3], k.shape[-3]) and not args["enable_gqa"]:
        return "query and key/value head counts differ without enable_gqa"
    mask = tensor_value(args["attn_mask"])
    if mask is not None and mask.dim() > q.dim():
        return f"attn_mask of rank {mask.dim()} for rank-{q.dim()} inputs"
    inputs = {n: args[n] for n in ("query", "key", "value", "attn_mask")}
    if isinstance(scale, Factor):
        inputs["scale"] = scale.value
    return grad_refusal(node, inputs)


def _scale(args: dict, query: fx.Node) -> tuple[float | None, Factor | str | None]:
    """(constant scale, run-time factor or reason) of an SDPA call's ``scale`` argument."""
    scale = args["scale"]
    if scale is None:
        return None, None
    factor = as_factor(scale, False, shape_of(query) or ())
    if isinstance(factor, Factor) and factor.number is not None:
        return factor.number, None
    return 1.0, factor


def _mask(attn_mask) -> MaskSpec:
    val = tensor_value(attn_mask)
    if val is None:
        return MaskSpec()
    if val.dtype == torch.bool:
        return MaskSpec(keep=[KeepTerm(attn_mask)])
    return MaskSpec(additive=[AdditiveTerm(attn_mask)])


def sdpa_site(node: fx.Node) -> AttentionSite | None:
    """The :class:`AttentionSite` of an SDPA call ``node``, or ``None`` for other nodes."""
    if node.op != "call_function" or node.target not in SDPA_TARGETS:
        return None
    args = _bound_args(node)
    q, k, v = args["query"], args["key"], args["value"]
    scale, factor = _scale(args, q)
    refusal = _refusal(node, args, factor)
    is_causal = args["is_causal"] is True
    mask = _mask(args["attn_mask"])
    chain, gqa_source, lengths_match = [node], None, False
    if refusal is None:
        lengths_match = same_size(shape_of(q)[-2], shape_of(k)[-2])
        if args["enable_gqa"] is True and not same_size(shape_of(q)[-3], shape_of(k)[-3]):
            gqa_source = "enable_gqa"
        elif found := gqa.unrepeat_kv(k, v):
            (k, v), gqa_source = (found[0].source, found[1].source), found[0].how
            chain += found[0].nodes + found[1].nodes
    fqn, cls = module_of(node)
    return AttentionSite(
        pattern="sdpa",
        anchor=node,
        q=q,
        k=k,
        v=v,
        mask=mask,
        is_causal=is_causal,
        scale=scale,
        scale_factors=(factor,) if isinstance(factor, Factor) else (),
        gqa_source=gqa_source,
        mask_kind=masks.mask_kind(mask, is_causal),
        causal_fast_path=is_causal or (lengths_match and masks.causal_fast_path(mask)),
        fqn=fqn,
        module_class=cls,
        source=source_of(node),
        refusal=refusal,
        chain=chain,
    )
