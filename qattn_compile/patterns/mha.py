"""``nn.MultiheadAttention`` and PyTorch's fused transformer ops in a dynamo graph.

Dynamo keeps ``F.multi_head_attention_forward`` (what ``nn.MultiheadAttention``, and with it
``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer`` and many vision pooling
heads, call) as one opaque node returning ``(output, weights)``. :func:`expand_mha` replaces
each one that can be served by the ops the function runs when it does not compute weights —
in-projection, heads split, ``F.scaled_dot_product_attention`` with the merged
``attn_mask``/``key_padding_mask``, heads merged, out-projection — so that the SDPA finder
serves it like any other SDPA call (same output, named by the module's FQN). The others get
a site with the reason (:func:`mha_site`): the attention weights are used
(``need_weights=True``, the module's default, and the caller reads them: a flash kernel never
forms them), dropout in training, ``add_bias_kv``, ``add_zero_attn``, …

The fused fast paths (``torch._native_multi_head_attention``, and
``torch._transformer_encoder_layer_fwd``, which ``nn.TransformerEncoderLayer`` takes in
eval mode under ``no_grad``) compute a whole attention, or layer, in one op: reported with
their reason and how to avoid them.
"""

from __future__ import annotations

import inspect
import math
import operator

import torch
import torch.nn.functional as F
from torch import fx

from .emit import Emitter
from .nodes import GETITEM, grad_refusal, tensor_value
from .site import AttentionSite, module_of, source_of

PATTERN = "mha"
_MHA = F.multi_head_attention_forward
_SIGNATURE = inspect.signature(_MHA)
_CONSTANT_ARGS = ("embed_dim_to_check", "num_heads", "add_zero_attn", "dropout_p", "training",
                  "need_weights", "use_separate_proj_weight", "average_attn_weights", "is_causal")
_NOT_SERVED = {
    "bias_k": "`add_bias_kv=True` appends a learned key/value to every sequence",
    "static_k": "`static_k`/`static_v` replace the projected keys/values",
    "static_v": "`static_k`/`static_v` replace the projected keys/values",
}
_FASTPATH_HINT = ("disable it with torch.backends.mha.set_fastpath_enabled(False) to have "
                  "the attention served")
_FUSED = {
    torch._native_multi_head_attention: (
        "", "nn.MultiheadAttention's fused fast path (torch._native_multi_head_attention) runs the "
        f"whole attention as one op, which qattn cannot open; {_FASTPATH_HINT}"),
    torch._transformer_encoder_layer_fwd: (
        "self_attn", "nn.TransformerEncoderLayer's fused fast path (torch._transformer_encoder_layer_fwd, "
        "taken in eval mode without gradients) runs the whole layer as one op, which qattn cannot "
        f"open; {_FASTPATH_HINT}"),
}


def _is_mha(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is _MHA


def _bound(node: fx.Node) -> dict | None:
    """``F.multi_head_attention_forward``'s arguments by name, defaults filled in; ``None``
    when they do not fit this torch's signature."""
    try:
        bound = _SIGNATURE.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return dict(bound.arguments)


def _output(node: fx.Node, index: int) -> list[fx.Node]:
    """The ``getitem`` nodes reading item ``index`` of the MHA call's ``(output, weights)``."""
    return [u for u in node.users if GETITEM(u) and u.args[1] == index]


def _refusal(node: fx.Node, args: dict | None) -> str | None:
    """Why the MHA call ``node`` (arguments ``args``) cannot be expanded and served, or None."""
    if args is None:
        return "F.multi_head_attention_forward is called with arguments this torch does not know"
    for name in _CONSTANT_ARGS:
        if name == "dropout_p" and args["training"] is False:
            continue  # unused in eval mode (a float attribute is symbolic under dynamic=True)
        if isinstance(args[name], fx.Node):
            return f"nn.MultiheadAttention's `{name}` is computed at run time; only constants are served"
    if any(u.users for u in _output(node, 1)):
        return ("the caller uses the attention weights (need_weights=True, nn.MultiheadAttention's "
                "default), which a flash kernel never forms; pass need_weights=False to have it served")
    if len(node.users) != len(_output(node, 0)) + len(_output(node, 1)):
        return "the result of nn.MultiheadAttention is used other than as (output, weights)"
    for name, why in _NOT_SERVED.items():
        if args[name] is not None:
            return f"{why} (not served)"
    if args["add_zero_attn"]:
        return "`add_zero_attn=True` appends a zero key/value to every sequence (not served)"
    if args["training"] and args["dropout_p"]:  # both constants here
        return f"dropout p={args['dropout_p']} in training mode (only eval-mode or p=0 dropout is served)"
    query, key, value = (tensor_value(args[n]) for n in ("query", "key", "value"))
    if query is None or key is None or value is None:
        return "query/key/value have no recorded example values"
    if query.dim() not in (2, 3):
        return f"rank-{query.dim()} query (nn.MultiheadAttention takes [L, E] or [L, B, E])"
    for name in ("attn_mask", "key_padding_mask"):
        mask = tensor_value(args[name])
        if args[name] is not None and (mask is None or not (mask.dtype == torch.bool or mask.is_floating_point())):
            return f"`{name}` is neither a bool nor a float tensor"
    if args["is_causal"] and args["attn_mask"] is None:
        return "is_causal=True without attn_mask (nn.MultiheadAttention itself refuses it)"
    weights = ("in_proj_weight", "in_proj_bias", "q_proj_weight", "k_proj_weight", "v_proj_weight",
               "out_proj_weight", "out_proj_bias")
    outputs = _output(node, 0)
    inputs = {name: args[name] for name in ("query", "key", "value", *weights) if isinstance(args[name], fx.Node)}
    return grad_refusal(outputs[0], inputs) if outputs else None


def _projections(emit: Emitter, args: dict) -> list[fx.Node]:
    """q, k, v projected, ``[L, B, E]``."""
    bias = args["in_proj_bias"]
    biases = [None] * 3
    if bias is not None:
        chunks = emit("chunk", bias, 3, method=True)
        biases = [emit(operator.getitem, chunks, i) for i in range(3)]
    if args["use_separate_proj_weight"]:
        weights = [args[f"{name}_proj_weight"] for name in "qkv"]
    else:
        chunks = emit("chunk", args["in_proj_weight"], 3, method=True)
        weights = [emit(operator.getitem, chunks, i) for i in range(3)]
    inputs = (args["query"], args["key"], args["value"])
    return [emit(F.linear, x, w, b) for x, w, b in zip(inputs, weights, biases)]


def _batched(emit: Emitter, args: dict) -> dict:
    """``args`` with unbatched inputs given a batch of one, as the function does: query,
    key, value ``[L, E]`` → ``[L, 1, E]``, key_padding_mask ``[S]`` → ``[1, S]``."""
    if tensor_value(args["query"]).dim() == 3:
        return args
    batched = {**args, **{n: emit("unsqueeze", args[n], 1, method=True) for n in ("query", "key", "value")}}
    if args["key_padding_mask"] is not None:
        batched["key_padding_mask"] = emit("unsqueeze", args["key_padding_mask"], 0, method=True)
    return batched


def _additive(emit: Emitter, mask: fx.Node, dtype: torch.dtype) -> fx.Node:
    """A float mask as it is, a bool one (True = masked) as 0 / ``-inf`` in ``dtype``."""
    if tensor_value(mask).dtype != torch.bool:
        return mask
    return emit("to", emit(torch.where, mask, -math.inf, 0.0), dtype, method=True)


def _mask(emit: Emitter, args: dict, heads: int, dtype: torch.dtype) -> tuple[fx.Node | None, bool]:
    """(the SDPA mask broadcasting to ``[B, H, Lq, Lk]``, is_causal), as the function merges
    ``attn_mask`` and ``key_padding_mask`` (True = masked; float masks are added)."""
    attn_mask, padding = args["attn_mask"], args["key_padding_mask"]
    if args["is_causal"] and padding is None and not args["need_weights"]:
        return None, True  # the function drops attn_mask and passes is_causal
    terms = []
    if attn_mask is not None:
        term = _additive(emit, attn_mask, dtype)
        if tensor_value(term).dim() == 3:  # [B·H, Lq, Lk]
            term = emit("unflatten", term, 0, (-1, heads), method=True)
        terms.append(term)
    if padding is not None:  # [B, Lk] -> [B, 1, 1, Lk]
        term = _additive(emit, padding, dtype)
        terms.append(emit("unsqueeze", emit("unsqueeze", term, 1, method=True), 1, method=True))
    mask = None
    for term in terms:
        mask = term if mask is None else emit(operator.add, mask, term)
    return mask, False


def _expand(graph: fx.Graph, node: fx.Node, args: dict) -> None:
    """Replace the MHA call ``node`` by its ops (module docstring)."""
    emit = Emitter(graph, node)
    heads, unbatched = args["num_heads"], tensor_value(args["query"]).dim() == 2
    dtype = tensor_value(args["query"]).dtype
    args = _batched(emit, args)
    q, k, v = (emit("permute", emit("unflatten", x, -1, (heads, -1), method=True), 1, 2, 0, 3, method=True)
               for x in _projections(emit, args))  # [L, B, E] -> [B, H, L, E/H]
    mask, is_causal = _mask(emit, args, heads, dtype)
    attn = emit(F.scaled_dot_product_attention, q, k, v, attn_mask=mask, is_causal=is_causal)
    merged = emit("flatten", emit("permute", attn, 2, 0, 1, 3, method=True), -2, method=True)  # [Lq, B, E]
    result = emit(F.linear, merged, args["out_proj_weight"], args["out_proj_bias"])
    if unbatched:
        result = emit("squeeze", result, 1, method=True)
    for output in _output(node, 0):
        output.replace_all_uses_with(result)
    for user in list(node.users):
        graph.erase_node(user)
    graph.erase_node(node)


def expand_mha(gm: fx.GraphModule) -> int:
    """Expand every ``F.multi_head_attention_forward`` call that can be served (module
    docstring); returns how many were expanded. The others are left for :func:`mha_site`."""
    expanded = 0
    for node in list(gm.graph.nodes):
        if _is_mha(node) and _refusal(node, _bound(node)) is None and _output(node, 0):
            _expand(gm.graph, node, _bound(node))
            expanded += 1
    return expanded


def mha_site(node: fx.Node) -> AttentionSite | None:
    """The refused :class:`AttentionSite` of an MHA call left in the graph or of a fused
    fast-path op; ``None`` for other nodes."""
    if node.op != "call_function":
        return None
    fqn, cls = module_of(node)
    owner = None
    if node.target in _FUSED:
        child, refusal = _FUSED[node.target]
        if child:
            owner = (child, "MultiheadAttention")
        q = k = v = node.args[0]
    elif _is_mha(node):
        args = _bound(node)
        q, k, v = (node.args[0],) * 3 if args is None else (args["query"], args["key"], args["value"])
        refusal = _refusal(node, args) or "nn.MultiheadAttention is one opaque op until the rewrite expands it"
    else:
        return None
    return AttentionSite(pattern=PATTERN, anchor=node, q=q, k=k, v=v, fqn=fqn, module_class=cls,
                         child=owner, source=source_of(node), refusal=refusal, chain=[node])
