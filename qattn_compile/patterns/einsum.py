"""Read a two-operand ``torch.einsum`` as a batched matrix product.

Attention is often written with einsum: ``einsum("bhqd,bhkd->bhqk", q, k)`` for the scores
and ``einsum("bhqk,bhkd->bhqd", p, v)`` for the output, or in other layouts
(``"bqhd,bkhd->bhqk"``, ``"...qd,...kd->...qk"``). Such an einsum is one matrix product
between permuted operands::

    einsum(eq, a, b) == matmul(a.permute(a_dims), b.permute(b_dims)).permute(out_dims)

where ``a.permute(a_dims)`` is ``[*batch, M, C]``, ``b.permute(b_dims)`` is
``[*batch, C, N]`` and the product ``[*batch, M, N]`` (batch axes in the output's order).
It is one when every index is used once per term, exactly one index (``C``) is summed over,
``a`` and ``b`` each have exactly one index of their own (``M``, ``N``), every other index is
shared by both operands and the output (a batch axis, of equal size on both sides) and no
index is summed away within one operand.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from .nodes import same_size, shape_of

_ELLIPSIS_LETTERS = "0123456789"
"""Stand-ins for the axes of ``...`` (einsum's own indices are letters, so these never clash)."""


@dataclass(frozen=True)
class Contraction:
    """``matmul(a.permute(a_dims), b.permute(b_dims)).permute(out_dims)``; a dims of ``None``
    is no permutation. ``node`` is the product (a matmul or einsum node)."""

    node: fx.Node
    a: fx.Node
    b: fx.Node
    a_dims: tuple[int, ...] | None = None
    b_dims: tuple[int, ...] | None = None
    out_dims: tuple[int, ...] | None = None


def is_einsum(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is torch.einsum


def _equation_and_operands(node: fx.Node) -> tuple[str, list]:
    equation, *operands = node.args
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    return equation, operands


def _expand(term: str, rank: int, ellipsis_rank: int) -> str | None:
    """``term`` with ``...`` replaced by ``ellipsis_rank`` stand-in letters; None if it does
    not fit ``rank``."""
    if "..." not in term:
        return term if len(term) == rank else None
    if ellipsis_rank < 0 or len(term) - 3 + ellipsis_rank != rank:
        return None
    return term.replace("...", _ELLIPSIS_LETTERS[:ellipsis_rank])


def _terms(equation: str, shapes: list[tuple]) -> tuple[str, str, str] | str:
    """(a's, b's, the output's indices), ``...`` expanded; or why they cannot be read."""
    lhs, arrow, out = equation.replace(" ", "").partition("->")
    inputs = lhs.split(",")
    if len(inputs) != 2:
        return f"{len(inputs)} terms for 2 operands"
    ranks = [len(shape) - (len(t) - 3) if "..." in t else None for t, shape in zip(inputs, shapes)]
    ellipsis = {r for r in ranks if r is not None}
    if len(ellipsis) > 1:
        return "`...` stands for a different number of axes in each operand (broadcasting)"
    ellipsis_rank = ellipsis.pop() if ellipsis else 0
    a, b = (_expand(t, len(s), ellipsis_rank) for t, s in zip(inputs, shapes))
    if a is None or b is None:
        return "a term does not match its operand's rank"
    if not arrow:  # implicit output: the `...` axes, then every index used once, sorted
        once = sorted(c for c in {*a, *b} if (a + b).count(c) == 1 and c not in _ELLIPSIS_LETTERS)
        out = _ELLIPSIS_LETTERS[:ellipsis_rank] + "".join(once)
    elif "..." in out:
        out = out.replace("...", _ELLIPSIS_LETTERS[:ellipsis_rank])
    return a, b, out


def _identity_or(dims: tuple[int, ...]) -> tuple[int, ...] | None:
    return None if dims == tuple(range(len(dims))) else dims


def contraction(node, swap: bool = False) -> Contraction | str | None:
    """``node`` as a :class:`Contraction` when it is an einsum of one matrix product, why not
    (a string) when it is another einsum, ``None`` when it is no einsum.

    ``swap`` reads the operands in the other order (``b`` becomes ``a``): the same einsum
    as ``Vᵀ·Pᵀ`` or as ``P·V``.
    """
    if not is_einsum(node):
        return None
    equation, operands = _equation_and_operands(node)
    why = f"einsum {equation!r} is not one batched matrix product"
    if not isinstance(equation, str) or len(operands) != 2 or not all(isinstance(o, fx.Node) for o in operands):
        return f"{why}: only two-operand einsums are read"
    shapes = [shape_of(o) for o in operands]
    if any(s is None for s in shapes):
        return f"{why}: its operands have no recorded example values"
    terms = _terms(equation, shapes)
    if isinstance(terms, str):
        return f"{why}: {terms}"
    if swap:
        operands, shapes, terms = operands[::-1], shapes[::-1], (terms[1], terms[0], terms[2])
    a, b, out = terms
    if any(len(set(t)) != len(t) for t in terms):
        return f"{why}: an index repeats within a term (a diagonal)"
    summed = [c for c in a if c in b and c not in out]
    own_a, own_b = [c for c in a if c not in b], [c for c in b if c not in a]
    batch = [c for c in out if c in a and c in b]
    if len(summed) != 1 or len(own_a) != 1 or len(own_b) != 1 or len(batch) + 2 != len(out):
        return f"{why}: it needs exactly one summed index and one own index per operand"
    if any(not same_size(shapes[0][a.index(c)], shapes[1][b.index(c)]) for c in batch):
        return f"{why}: a batch axis has different sizes in the two operands (broadcasting)"
    (m,), (n,), (c,) = own_a, own_b, summed
    product = [*batch, m, n]
    return Contraction(
        node=node,
        a=operands[0],
        b=operands[1],
        a_dims=_identity_or(tuple(a.index(i) for i in (*batch, m, c))),
        b_dims=_identity_or(tuple(b.index(i) for i in (*batch, c, n))),
        out_dims=_identity_or(tuple(product.index(i) for i in out)),
    )
