"""Attention masks: the terms a site applies to its scores, and what they are.

A site's mask is a :class:`MaskSpec`: boolean *keep* terms (ANDed; True = attend) and
*additive* terms (summed into the scores, each multiplied by the scale factors applied
after it). The rewrite combines them into the op's one mask; this module only describes.

:func:`mask_kind` names a mask from the subgraph that built it, recognising how
transformers builds masks under torch.compile (``masking_utils.sdpa_mask``: index tensors
``q_idx [.., Lq, 1]`` and ``kv_idx [.., 1, Lkv]`` compared and ANDed, then ``expand``-ed,
and for eager attention turned additive by ``torch.where(mask, 0, finfo.min)``):

- ``causal``: ``kv_idx <= q_idx``; ``sliding_window``: ``kv_idx > q_idx - w``;
- ``padding``: a mask constant along the query axis (``[B, 1, 1, Lkv]``-shaped);
- ``packed``: ``seq_id[q_idx] == seq_id[kv_idx]`` (transformers' packed-sequence mask);
- ``bool`` / ``additive``: anything else (a T5 position bias is ``additive``).

Kinds found together are joined with ``+`` (``causal+padding``); no mask gives ``none``.
The causal fast path (:func:`causal_fast_path`) holds for ``is_causal=True`` and when a
causal comparison is ANDed at the top of the mask (for an additive mask: inside its
``where(m, x, finfo.min)``): every key after its query is then masked (by ``finfo.min`` in
an additive mask) whatever else the mask says, so a kernel may skip the tiles above the
diagonal. The finders only claim it when Lq = Lkv, where positions compare as indices do.
Names are a report, not a rewrite input: the rewrite keeps the mask's exact values.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from .nodes import (
    ADD,
    AND,
    CAST,
    EXPAND,
    RESHAPE,
    WHERE,
    Op,
    constant,
    is_minus_inf_like,
    is_one,
    same_shape,
    shape_of,
    tensor_value,
)
from .scaling import Factor

KIND_ORDER = ("causal", "sliding_window", "padding", "packed", "bool", "additive")

_PASS = Op((), ("contiguous", "clone"))
_LE, _GE = Op((operator.le, torch.le), ("le", "__le__")), Op((operator.ge, torch.ge), ("ge", "__ge__"))
_GT, _LT = Op((operator.gt, torch.gt), ("gt", "__gt__")), Op((operator.lt, torch.lt), ("lt", "__lt__"))
_EQ = Op((operator.eq, torch.eq), ("eq", "__eq__"))
_SUB = Op((operator.sub, torch.sub), ("sub", "__sub__"))
_ONES = Op((torch.ones, torch.ones_like), ("new_ones",))


@dataclass(frozen=True)
class KeepTerm:
    """A boolean mask term. ``negate=False``: True marks keys to attend (``where(m, s, -inf)``,
    SDPA bool masks); ``negate=True``: True marks masked keys (``masked_fill(m, -inf)``)."""

    node: fx.Node
    negate: bool = False


@dataclass(frozen=True)
class AdditiveTerm:
    """A float mask term added to the scores, then multiplied by ``factors``."""

    node: fx.Node
    factors: tuple[Factor, ...] = ()


@dataclass
class MaskSpec:
    """Every mask term of a site; empty when the scores are not masked."""

    keep: list[KeepTerm] = field(default_factory=list)
    additive: list[AdditiveTerm] = field(default_factory=list)

    def nodes(self) -> list[fx.Node]:
        """The graph nodes the mask reads."""
        return [t.node for t in self.keep] + [t.node for t in self.additive]


def _axis(node) -> str | None:
    """``"q"`` for a tensor constant along the key axis (``[.., Lq, 1]``), ``"kv"`` for one
    constant along the query axis (``[.., 1, Lkv]``), else ``None``."""
    shape = shape_of(node)
    if shape is None or len(shape) < 2:
        return None
    q_one, kv_one = is_one(shape[-2]), is_one(shape[-1])
    if kv_one and not q_one:
        return "q"
    if q_one and not kv_one:
        return "kv"
    return None


def _is_index(node) -> bool:
    val = tensor_value(node)
    return val is not None and not val.is_floating_point() and val.dtype != torch.bool


def _compare_kind(node: fx.Node) -> str | None:
    """The kind of an index comparison ``node``, or ``None``."""
    if not (len(node.args) == 2 and all(_is_index(a) for a in node.args)):
        return None
    a, b = node.args
    axes = (_axis(a), _axis(b))
    if (_LE(node) and axes == ("kv", "q")) or (_GE(node) and axes == ("q", "kv")):
        return "causal"
    if _EQ(node) and set(axes) == {"q", "kv"}:
        return "packed"
    window = _GT(node) and _axis(a) == "kv" and _SUB(b) and _axis(b.args[0]) == "q"
    window = window or (_LT(node) and _SUB(a) and _axis(a.args[0]) == "q" and _axis(b) == "kv")
    return "sliding_window" if window else None


def _is_passthrough(node) -> bool:
    """Whether ``node`` only broadcasts, copies, casts or adds leading dims to its input."""
    if EXPAND(node) or _PASS(node) or CAST(node):
        return True
    if RESHAPE(node):
        before, after = shape_of(node.args[0]), shape_of(node)
        return before is not None and after is not None and same_shape(before[-2:], after[-2:])
    return False


def _unwrap(node):
    """``node`` without the no-ops around it (see :func:`_is_passthrough`)."""
    while isinstance(node, fx.Node) and _is_passthrough(node):
        node = node.args[0]
    return node


def _bool_leaves(node) -> list:
    """The operands of the AND tree at the top of a boolean mask."""
    node = _unwrap(node)
    if AND(node):
        return [leaf for a in node.args for leaf in _bool_leaves(a)]
    return [node]


def _additive_parts(node) -> list:
    """The summands of an additive mask."""
    node = _unwrap(node)
    if ADD(node):
        return [part for a in node.args for part in _additive_parts(a)]
    return [node]


def _where_mask(node) -> tuple[fx.Node, object] | None:
    """``(m, x)`` when ``node`` is ``where(m, x, -inf-like)``: ``x`` where ``m``, else masked
    (``x`` = 0 for a bool mask made additive, a bias for T5's masked position bias)."""
    if WHERE(node) and len(node.args) == 3 and is_minus_inf_like(constant(node.args[2])):
        return node.args[0], node.args[1]
    return None


def _bool_kinds(node) -> set[str]:
    """Kinds of a boolean mask where True = attend."""
    kinds = set()
    for leaf in _bool_leaves(node):
        if leaf is True or _ONES(leaf):
            continue
        if _GE(leaf) and _is_index(leaf.args[0]) and leaf.args[1] == 0:
            continue  # `q_idx >= 0`: transformers' always-true query term
        kind = _compare_kind(leaf) if isinstance(leaf, fx.Node) else None
        kinds.add(kind or ("padding" if _axis(leaf) == "kv" else "bool"))
    return kinds


def _additive_kinds(node) -> set[str]:
    """Kinds of an additive mask (0 = attend, very negative = masked)."""
    kinds = set()
    for part in _additive_parts(node):
        masked = _where_mask(part)
        if masked is None:
            if constant(part) != 0:
                kinds.add("padding" if _axis(part) == "kv" else "additive")
            continue
        cond, value = masked
        kinds |= _bool_kinds(cond)
        if constant(value) != 0:
            kinds |= _additive_kinds(value)
    return kinds


def _has_causal(node) -> bool:
    """Whether a causal comparison is ANDed at the top of the bool mask ``node``."""
    return any(isinstance(leaf, fx.Node) and _compare_kind(leaf) == "causal" for leaf in _bool_leaves(node))


def mask_kind(spec: MaskSpec, is_causal: bool) -> str:
    """The name of a site's mask (see the module docstring)."""
    kinds = {"causal"} if is_causal else set()
    for term in spec.keep:
        if term.negate:
            kinds.add("padding" if _axis(term.node) == "kv" else "bool")
        else:
            kinds |= _bool_kinds(term.node)
    for term in spec.additive:
        kinds |= _additive_kinds(term.node)
    return "+".join(k for k in KIND_ORDER if k in kinds) or "none"


def causal_fast_path(spec: MaskSpec, is_causal: bool) -> bool:
    """Whether every key after its query is provably masked: ``is_causal``, or a causal
    comparison ANDed into a keep term or into the bool mask of an additive term."""
    keep = any(_has_causal(t.node) for t in spec.keep if not t.negate)
    additive = any(
        _has_causal(masked[0])
        for t in spec.additive
        for masked in map(_where_mask, _additive_parts(t.node))
        if masked is not None
    )
    return is_causal or keep or additive
