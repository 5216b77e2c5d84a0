"""Grouped-query attention: find the un-repeated K/V behind a repeated one.

Models repeat each of ``Hkv`` key/value heads ``n`` times before attention, so that query
head ``h`` reads kv head ``h // n`` — exactly the op's GQA mapping, which reads the
un-repeated tensors instead. Two spellings are recognised, from the example shapes (not
from argument values, which are symbolic under dynamic shapes):

- transformers' ``repeat_kv``: ``x[:, :, None, :, :]`` (or ``x.unsqueeze(2)``) ``[B, Hkv, 1,
  L, D]`` → ``expand`` ``[B, Hkv, n, L, D]`` → ``reshape``/``view`` ``[B, Hkv·n, L, D]``;
- ``x.repeat_interleave(n, dim=1)``.

``x.repeat(1, n, 1, 1)`` maps query head ``h`` to kv head ``h % Hkv`` and is left as is
(the op then sees the repeated K/V: exact, only slower).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import fx

from .nodes import EXPAND, GETITEM, REPEAT_INTERLEAVE, RESHAPE, UNSQUEEZE, arg, same_shape, shape_of


@dataclass
class Unrepeated:
    """A K or V node traced back to the tensor it repeats."""

    source: fx.Node
    group: int
    how: str
    nodes: list[fx.Node] = field(default_factory=list)


def _repeat_kv(node: fx.Node) -> Unrepeated | None:
    if not (RESHAPE(node) and EXPAND(node.args[0])):
        return None
    expand = node.args[0]
    unsqueezed = expand.args[0]
    if not (GETITEM(unsqueezed) or UNSQUEEZE(unsqueezed)):
        return None
    source = unsqueezed.args[0]
    shapes = [shape_of(n) for n in (source, unsqueezed, expand, node)]
    if any(s is None for s in shapes) or len(shapes[0]) != 4:
        return None
    (b, h, length, d), _, expanded, out = shapes
    group = expanded[2] if len(expanded) == 5 else None
    if not isinstance(group, int):
        return None
    if not (
        same_shape(shapes[1], (b, h, 1, length, d))
        and same_shape(expanded, (b, h, group, length, d))
        and same_shape(out, (b, h * group, length, d))
    ):
        return None
    return Unrepeated(source, group, "repeat_kv", [node, expand, unsqueezed])


def _repeat_interleave(node: fx.Node) -> Unrepeated | None:
    if not REPEAT_INTERLEAVE(node):
        return None
    source, repeats, dim = node.args[0], arg(node, 1, "repeats"), arg(node, 2, "dim")
    shape, out = shape_of(source), shape_of(node)
    if not (isinstance(repeats, int) and shape is not None and len(shape) == 4 and dim in (1, -3)):
        return None
    b, h, length, d = shape
    if not same_shape(out, (b, h * repeats, length, d)):
        return None
    return Unrepeated(source, repeats, "repeat_interleave", [node])


def unrepeat(node: fx.Node) -> Unrepeated | None:
    """The tensor ``node`` repeats per head (see the module docstring), or ``None``."""
    return _repeat_kv(node) or _repeat_interleave(node)


def unrepeat_kv(k: fx.Node, v: fx.Node) -> tuple[Unrepeated, Unrepeated] | None:
    """Un-repeated K and V when both repeat their heads by the same factor, else ``None``."""
    uk, uv = unrepeat(k), unrepeat(v)
    if uk is None or uv is None or uk.group != uv.group:
        return None
    return uk, uv
