"""Attention masks: the terms a site applies to its scores, and what they are.

A site's mask is a :class:`MaskSpec`: boolean *keep* terms (ANDed; True = attend) and
*additive* terms (summed into the scores, each multiplied by the scale factors applied
after it; a term applied while a view regrouped the scores' batch dims carries the
:class:`Regroup` that moves it into the site's grouping). The rewrite combines them into the
op's one mask; this module only describes.

:func:`mask_kind` names a mask from the subgraph that built it, recognising how
transformers builds masks under torch.compile (``masking_utils.sdpa_mask``: index tensors
``q_idx [.., Lq, 1]`` and ``kv_idx [.., 1, Lkv]`` compared and ANDed, then ``expand``-ed,
and for eager attention turned additive by ``torch.where(mask, 0, finfo.min)``):

- ``causal``: ``kv_idx <= q_idx`` *proven* top-left causal (:func:`proven_causal`: both
  indices are ``torch.arange`` with equal start offsets, and Lq = Lkv); an unproven one
  (positions from a user tensor, unequal offsets) is a plain ``bool`` mask;
- ``sliding_window``: ``kv_idx > q_idx - w``;
- ``padding``: a mask constant along the query axis (``[B, 1, 1, Lkv]``-shaped);
- ``packed``: ``seq_id[q_idx] == seq_id[kv_idx]`` (transformers' packed-sequence mask),
  unless ``seq_id`` is proven to be one sequence (:func:`single_sequence`: positions
  from ``torch.arange``), when the term is always true and dropped;
- ``bool`` / ``additive``: anything else (a T5 position bias is ``additive``).

Kinds found together are joined with ``+`` (``causal+padding``); no mask gives ``none``.
The causal fast path (:func:`causal_fast_path`) holds for ``is_causal=True`` and when a
proven causal comparison is ANDed at the top of the mask (for an additive mask: inside its
``where(m, x, finfo.min)``): every key after its query is then masked (by ``finfo.min`` in
an additive mask) whatever else the mask says, so a kernel may skip the tiles above the
diagonal.

Names are a report. The one rewrite input is :func:`split_causal`: a bool keep term whose
AND tree holds a proven causal comparison loses it (the rewrite passes ``is_causal=True``
instead) and keeps its other leaves, so transformers' materialized ``[B, 1, L, L]`` causal
mask becomes ``is_causal`` plus, at most, its ``[B, 1, 1, L]`` padding term. Additive masks
are never split: their masked entries are ``finfo.min``, not ``-inf``, which differs from
``is_causal`` on fully masked rows.
"""

from __future__ import annotations

import math
import operator
import weakref
from dataclasses import dataclass, field, replace

import torch
from torch import fx

from .._compat import statically_known_true
from .nodes import (
    ADD,
    AND,
    CAST,
    EXPAND,
    GETITEM,
    RESHAPE,
    UNSQUEEZE,
    WHERE,
    Op,
    constant,
    is_minus_inf_like,
    is_one,
    mutates,
    same_shape,
    same_size,
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
_ARANGE = Op((torch.arange,))
_REPEAT = Op((), ("repeat",))
_NE = Op((operator.ne, torch.ne), ("ne", "__ne__"))
_DIFF = Op((torch.diff,), ("diff",))
_CUMSUM = Op((torch.cumsum,), ("cumsum",))
_INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class Regroup:
    """A mask term applied to the scores while their batch dims were grouped differently
    (``scores.view(B, H, Lq, Lk)`` of ``[B·H, Lq, Lk]`` scores, Swin's ``view(-1, nW, H, N,
    N)``): applying the tensor methods ``ops`` in turn (``(name, args)``: ``unsqueeze``,
    ``expand``, ``flatten``, ``unflatten``) gives the same term in the site's grouping. Only
    the batch groups the term varies along are materialized, and sizes are spelled so that
    symbolic (dynamic) ones are never needed where the term already has them."""

    ops: tuple[tuple[str, tuple], ...]


def _hint(size):
    """The example value of a (possibly symbolic) size."""
    return size if isinstance(size, int) else getattr(getattr(size, "node", None), "hint", None)


def _batch_groups(a: tuple, b: tuple) -> list[tuple[range, range]] | None:
    """The dims of batch layouts ``a`` and ``b`` — one viewed as the other, so their
    row-major groups are the same for every shape the graph accepts — in matching groups:
    each group of ``a`` holds exactly the elements of its group of ``b`` (matched on the
    example sizes; dynamo specializes sizes 0 and 1, so no symbolic size hides a 1);
    ``None`` if they do not match."""
    groups, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        pairs = sorted(((ia, jb) for ia in range(i + 1, len(a) + 1) for jb in range(j + 1, len(b) + 1)), key=sum)
        match = next(((ia, jb) for ia, jb in pairs
                      if _hint(math.prod(a[i:ia])) == _hint(math.prod(b[j:jb])) is not None), None)
        if match is None:
            return None
        groups.append((range(i, match[0]), range(j, match[1])))
        i, j = match
    if not all(is_one(s) for s in (*a[i:], *b[j:])):
        return None
    if groups:  # trailing size-1 dims join the last group
        last_a, last_b = groups[-1]
        groups[-1] = (range(last_a.start, len(a)), range(last_b.start, len(b)))
    return groups


def _static(size):
    """``size`` as an int when it provably is one (a symbolic ``s//(s//4)`` that the shape
    guards pin to 4), else ``size`` itself."""
    if isinstance(size, int):
        return size
    hint = _hint(size)
    return hint if isinstance(hint, int) and same_size(size, hint) else size


def _unflatten_sizes(sizes: tuple) -> tuple | None:
    """``sizes`` for ``unflatten``: one symbolic size may be left to ``-1``."""
    symbolic = [i for i, s in enumerate(sizes) if not isinstance(s, int)]
    if len(symbolic) > 1:
        return None
    return tuple(-1 if i in symbolic else s for i, s in enumerate(sizes))


def regroup(term: fx.Node, layout: tuple, site_layout: tuple) -> Regroup | str | None:
    """How to move mask term ``term``, applied to scores of batch dims ``layout``, to
    scores of batch dims ``site_layout`` (see :class:`Regroup`); ``None`` when it broadcasts
    the same way in both; a string says why it cannot be moved."""
    shape = shape_of(term)
    if shape is None:
        return "a mask term has no recorded example value"
    lead = (1,) * (len(layout) - len(shape[:-2])) + tuple(shape[:-2])
    if len(lead) > len(layout):
        return f"a mask term of shape {list(shape)} has more batch dims than the scores it is added to"
    if all(is_one(s) for s in lead) and len(shape) <= len(site_layout) + 2:
        return None
    layout, site_layout = tuple(map(_static, layout)), tuple(map(_static, site_layout))
    groups = _batch_groups(layout, site_layout)
    if groups is None:
        return (f"a view regroups the scores' batch dims {list(layout)} in a way that does not "
                f"map onto {list(site_layout)}")
    ops = [("unsqueeze", (0,))] * (len(layout) + 2 - len(shape))
    expand, unflatten = [-1] * (len(layout) + 2), []
    for dims, site_dims in groups:
        if all(is_one(lead[d]) for d in dims):
            sizes = (1,) * len(site_dims)
        else:
            for d in dims:  # a term's dim is 1 (broadcast) or, as the add required, the scores'
                if is_one(lead[d]) and not is_one(layout[d]):
                    if not isinstance(layout[d], int):
                        return ("a mask constant along a batch dim that a view regroups, under dynamic "
                                "shapes (the dim's size is symbolic)")
                    expand[d] = layout[d]
            sizes = _unflatten_sizes(tuple(site_layout[e] for e in site_dims))
            if sizes is None:
                return "a view regroups the scores' batch dims into several symbolic sizes"
        unflatten.append((dims, sizes))
    if any(size != -1 for size in expand):
        ops.append(("expand", tuple(expand)))
    for dims, sizes in reversed(unflatten):  # last group first: earlier dims keep their index
        if len(dims) > 1:
            ops.append(("flatten", (dims.start, dims.stop - 1)))
        if len(sizes) > 1:
            ops.append(("unflatten", (dims.start, sizes)))
    return Regroup(tuple(ops)) if ops else None


@dataclass(frozen=True)
class KeepTerm:
    """A boolean mask term. ``negate=False``: True marks keys to attend (``where(m, s, -inf)``,
    SDPA bool masks); ``negate=True``: True marks masked keys (``masked_fill(m, -inf)``)."""

    node: fx.Node
    negate: bool = False
    fill: float = float("-inf")
    """What the masked scores are set to in the graph (``-inf``, or a finite value ≤ -1e4)."""
    regroup: Regroup | None = None
    """How to bring the term from the batch layout it was applied in to the site's."""


@dataclass(frozen=True)
class AdditiveTerm:
    """A float mask term added to the scores, then multiplied by ``factors``."""

    node: fx.Node
    factors: tuple[Factor, ...] = ()
    regroup: Regroup | None = None
    """How to bring the term from the batch layout it was applied in to the site's."""
    kind: str | None = None
    """The term's kind when known from how it was applied (a ``baddbmm`` bias: ``additive``)."""


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


@dataclass(frozen=True)
class _Arange:
    """An index tensor proven to hold ``offset + i`` at position ``i`` of dim ``dim``
    (negative: counted from the last dim) and to be constant along every other dim."""

    offset: int
    dim: int


def _int_constant(value) -> int | None:
    """``value`` as an int when it is a compile-time integer (a Python int, or a 0-d
    ``torch.tensor``/``torch.full`` node of one), else ``None``."""
    if isinstance(value, fx.Node) and (shape_of(value) != ()
                                       or getattr(tensor_value(value), "dtype", None) not in _INDEX_DTYPES):
        return None
    number = constant(value)
    return int(number) if number is not None and number == int(number) else None


def _vector_dim(node) -> int | None:
    """The one dim of ``node``'s tensor that is not provably 1, counted from the last dim
    (``-2`` for ``[1, 1, L, 1]``); ``None`` when there is not exactly one."""
    shape = shape_of(node)
    wide = [i - len(shape) for i, size in enumerate(shape or ()) if not is_one(size)]
    return wide[0] if len(wide) == 1 else None


def _new_axes_only(index) -> bool:
    """Whether a ``getitem`` index only adds dims and keeps everything (``None``, ``:``, ``...``)."""
    items = index if isinstance(index, tuple) else (index,)
    full = slice(None, None, None)
    return all(item is None or item is Ellipsis or item == full for item in items)


def _arange_call(node: fx.Node) -> _Arange | None:
    """``torch.arange(end)`` / ``torch.arange(start, end[, 1])`` with a constant start, its
    arguments positional or named (``arange(2, end=n)``: one positional argument is the
    start when ``end`` is named)."""
    named = dict(node.kwargs)
    names = ("start", "end", "step") if len(node.args) >= 2 or "end" in named else ("end",)
    named.update(zip(names, node.args))
    if named.get("step", 1) != 1:
        return None
    offset = _int_constant(named.get("start", 0))
    return None if offset is None else _Arange(offset, -1)


def _shifted(node: fx.Node) -> _Arange | None:
    """``index + c``, ``c + index`` or ``index - c`` with ``c`` a compile-time integer that
    does not broadcast the index to a bigger shape."""
    if len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    if ADD(node) and _int_constant(a) is not None:
        a, b = b, a
    shift, index = _int_constant(b), _arange_of(a)
    if shift is None or index is None or not same_shape(shape_of(node), shape_of(a)):
        return None
    return _Arange(index.offset + (shift if ADD(node) else -shift), index.dim)


def _repeated(node: fx.Node) -> _Arange | None:
    """``index.repeat(*sizes)`` that does not repeat along the index's dim (it tiles the
    other, constant, dims)."""
    sizes = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else node.args[1:]
    index = _arange_of(node.args[0])
    if index is None or len(sizes) < -index.dim or sizes[index.dim] != 1:
        return None
    return index


def _gathered(node: fx.Node) -> _Arange | None:
    """``table[(i_0, ..., i_r-1)]`` (one integer index tensor per dim of ``table``) with
    ``table`` an arange along one dim and that dim's index an arange from an offset ``o >= 0``
    that stays in range: ``table[..., o + j, ...] = table_offset + o + j``. transformers
    builds causal masks from positions this way (``position_ids[batch_idx, kv_idx]``)."""
    table, indices = node.args
    shape = shape_of(table)
    if shape is None or not isinstance(indices, tuple) or len(indices) != len(shape):
        return None
    if not all(_is_index(i) for i in indices):
        return None
    outer = _arange_of(table)
    if outer is None:
        return None
    along = indices[len(shape) + outer.dim]
    inner = _arange_of(along)
    if inner is None or inner.offset < 0:
        return None
    if not statically_known_true(inner.offset + shape_of(along)[inner.dim] <= shape[outer.dim]):
        return None
    return _Arange(outer.offset + inner.offset, inner.dim)


def _arange_of(node) -> _Arange | None:
    """What ``torch.arange`` ``node``'s int32/int64 tensor provably is (see :class:`_Arange`),
    traced back through ``+``/``-`` of a constant, casts, copies, ``expand``, ``repeat`` of
    the other dims, gathers ``table[batch_idx, idx]`` (:func:`_gathered`), and — while the
    tensor has one wide dim — ``getitem`` with ``None``/``:``/``...``, ``unsqueeze`` and
    ``view``/``reshape`` (not a ``view`` to another dtype); ``None`` when it cannot be
    proven, or when its values could leave the dtype's range (an int32 that wraps around)."""
    index = _arange_shape_of(node)
    if index is None:
        return None
    info, size = torch.iinfo(tensor_value(node).dtype), shape_of(node)[index.dim]
    length = size if isinstance(size, int) else MAX_SYMBOLIC_LENGTH
    return index if info.min <= index.offset and index.offset + length - 1 <= info.max else None


MAX_SYMBOLIC_LENGTH = 1 << 30
"""The longest a symbolic (dynamic) index length is assumed to be when proving that an
index stays within its dtype's range (attention over 2^30 tokens does not fit in memory)."""


def _arange_shape_of(node) -> _Arange | None:
    """:func:`_arange_of` without the final range check (each recursion checks its own)."""
    val = tensor_value(node)
    if val is None or val.dtype not in _INDEX_DTYPES:
        return None
    source = tensor_value(node.args[0]) if node.args else None
    if RESHAPE(node) and getattr(source, "dtype", None) != val.dtype:
        return None  # x.view(dtype): a reinterpretation of the bits, not a reshape
    if _ARANGE(node):
        return _arange_call(node)
    if ADD(node) or _SUB(node):
        return _shifted(node)
    if EXPAND(node) or _PASS(node) or CAST(node):
        return _arange_of(node.args[0])
    if _REPEAT(node):
        return _repeated(node)
    if GETITEM(node) and not _new_axes_only(node.args[1]):
        return _gathered(node)
    if GETITEM(node) or UNSQUEEZE(node) or RESHAPE(node):
        inner, dim = _arange_of(node.args[0]), _vector_dim(node)
        if inner is None or dim is None or _vector_dim(node.args[0]) != inner.dim:
            return None
        return _Arange(inner.offset, dim)
    return None


_mutated_cache: "weakref.WeakKeyDictionary[fx.Graph, tuple[int, frozenset]]" = weakref.WeakKeyDictionary()


def _mutated_nodes(graph: fx.Graph) -> frozenset:
    """Nodes whose tensor a later (or earlier) in-place op may change, with every node they
    may be a view of: the mutated tensor and its chain of first arguments (a view's base;
    conservatively any op's). A dynamo graph is not functionalized when qattn rewrites it,
    so a node's recorded value is not its value at every use."""
    count = len(graph.nodes)
    hit = _mutated_cache.get(graph)
    if hit is not None and hit[0] == count:
        return hit[1]
    found = set()
    for node in graph.nodes:
        if not mutates(node):
            continue
        target = node.kwargs.get("out", node.args[0] if node.args else None)
        while isinstance(target, fx.Node) and target not in found:
            found.add(target)
            target = target.args[0] if target.op in ("call_function", "call_method") and target.args else None
    result = frozenset(found)
    _mutated_cache[graph] = (count, result)
    return result


def _reads_mutated(node) -> bool:
    """Whether ``node`` or anything it is computed from is changed in place somewhere in
    the graph (:func:`_mutated_nodes`): a proof from its recorded values would not hold."""
    if not isinstance(node, fx.Node):
        return False
    mutated = _mutated_nodes(node.graph)
    if not mutated:
        return False
    seen, stack = set(), [node]
    while stack:
        current = stack.pop()
        if current in mutated:
            return True
        for parent in current.all_input_nodes:
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return False


def proven_causal(node) -> bool:
    """Whether ``node`` is a top-left causal comparison, ``kv_idx <= q_idx`` (or
    ``q_idx >= kv_idx``), proven from where the indices come from: both are ``torch.arange``
    (see :func:`_arange_of`) with equal start offsets, ``q_idx`` running along the query
    axis (dim -2) and ``kv_idx`` along the key axis (dim -1), over equal lengths (Lq = Lkv).
    Then key ``j`` is visible to query ``i`` iff ``j <= i``: exactly ``is_causal``."""
    if not (isinstance(node, fx.Node) and len(node.args) == 2 and not node.kwargs):
        return False
    if _reads_mutated(node):
        return False
    if _LE(node):
        kv, q = node.args
    elif _GE(node):
        q, kv = node.args
    else:
        return False
    q_index, kv_index = _arange_of(q), _arange_of(kv)
    return (
        q_index is not None
        and kv_index is not None
        and (q_index.dim, kv_index.dim) == (-2, -1)
        and q_index.offset == kv_index.offset
        and same_size(shape_of(q)[-2], shape_of(kv)[-1])
    )


def _compare_kind(node: fx.Node) -> str | None:
    """The kind of an index comparison ``node``, or ``None``."""
    if not (len(node.args) == 2 and all(_is_index(a) for a in node.args)):
        return None
    if proven_causal(node):
        return "causal"
    a, b = node.args
    axes = (_axis(a), _axis(b))
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
        if _always_true(leaf):
            continue  # `q_idx >= 0`, a packed-sequence term over one sequence, ones
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
    """Whether a proven causal comparison is ANDed at the top of the bool mask ``node``."""
    return any(proven_causal(leaf) for leaf in _bool_leaves(node))


def mask_kind(spec: MaskSpec, is_causal: bool) -> str:
    """The name of a site's mask (see the module docstring)."""
    kinds = {"causal"} if is_causal else set()
    for term in spec.keep:
        if term.negate:
            kinds.add("padding" if _axis(term.node) == "kv" else "bool")
        else:
            kinds |= _bool_kinds(term.node)
    for term in spec.additive:
        kinds |= {term.kind} if term.kind else _additive_kinds(term.node)
    return "+".join(k for k in KIND_ORDER if k in kinds) or "none"


def causal_fast_path(spec: MaskSpec) -> bool:
    """Whether the mask provably masks every key after its query: a proven causal comparison
    (:func:`proven_causal`) ANDed into a keep term or into the bool mask of an additive
    ``where(m, x, fill)``, whose fill is the whole additive mask or is beyond any bias added
    to it (``-inf``, or float32/bfloat16's ``finfo.min`` as transformers fills: at most
    :data:`HUGE_FILL`); a fill such as -1e4 plus another additive part (``+2e4`` where the
    fill is) may no longer mask."""
    keep = any(_has_causal(t.node) for t in spec.keep if not t.negate)
    parts = [part for t in spec.additive for part in _additive_parts(t.node)]
    additive = any(
        _has_causal(part.args[0])
        and (len(parts) == 1 and not spec.additive[0].factors
             or constant(part.args[2]) <= HUGE_FILL)
        for part in parts
        if _where_mask(part) is not None
    )
    return keep or additive


HUGE_FILL = -1e30
"""A mask fill no realistic additive bias undoes (float32's and bfloat16's ``finfo.min`` are
-3.4e38)."""


def _is_bool_node(node) -> bool:
    val = tensor_value(node)
    return val is not None and val.dtype == torch.bool


def _unwrap_bool(node):
    """``node`` without the broadcasts, copies and bool-to-bool casts around it: the value
    that, broadcast (right-aligned), gives ``node``'s value."""
    while (EXPAND(node) or _PASS(node) or CAST(node)) and _is_bool_node(node) and _is_bool_node(node.args[0]):
        node = node.args[0]
    return node


def _keep_leaves(node) -> list:
    """The operands of the AND tree of the bool mask ``node``, each a value that broadcasts
    (right-aligned) to ``node``'s shape; only bool ANDs, broadcasts and copies are looked
    through (no reshape, which could move dims)."""
    node = _unwrap_bool(node)
    if AND(node) and _is_bool_node(node):
        return [leaf for a in node.args for leaf in _keep_leaves(a)]
    return [node]


def _first_minus_one(node, positions) -> bool:
    """Whether ``node`` is ``positions[:, ..., :1] - 1`` (each row's first entry, minus 1)."""
    if not (_SUB(node) and len(node.args) == 2 and not node.kwargs  # no `alpha`
            and _int_constant(node.args[1]) == 1):
        return False
    first = node.args[0]
    if not (GETITEM(first) and first.args[0] is positions):
        return False
    items = first.args[1] if isinstance(first.args[1], tuple) else (first.args[1],)
    shape = shape_of(positions)
    full = slice(None, None, None)
    return (
        shape is not None
        and len(items) == len(shape)
        and all(item == full for item in items[:-1])
        and items[-1] in (slice(None, 1, None), slice(0, 1, None))
    )


def _unit_steps(node) -> bool:
    """Whether ``node`` is ``torch.diff(p, prepend=p[..., :1] - 1, dim=-1)`` of ``p`` a
    ``torch.arange`` along its last dim (:func:`_arange_of`): every entry is then 1."""
    if not (_DIFF(node) and len(node.args) == 1):
        return False
    kwargs = dict(node.kwargs)
    positions, prepend = node.args[0], kwargs.pop("prepend", None)
    if kwargs.pop("dim", -1) != -1 or kwargs.pop("n", 1) != 1 or kwargs:
        return False
    index = _arange_of(positions)
    return index is not None and index.dim == -1 and _first_minus_one(prepend, positions)


def single_sequence(leaf) -> bool:
    """Whether ``leaf`` is transformers' packed-sequence term ``seq[b, q_idx] ==
    seq[b, kv_idx]`` with ``seq = cumsum(diff(positions, prepend=positions[:, :1] - 1) != 1)``
    over positions proven to be ``torch.arange`` (:func:`_unit_steps`): every step is 1, so
    ``seq`` is 0 everywhere, every gather of it equal, and the term True everywhere (one
    sequence per batch row: what transformers builds under torch.compile, where it cannot
    test for packing at run time)."""
    if not (_EQ(leaf) and len(leaf.args) == 2 and not leaf.kwargs):
        return False
    a, b = leaf.args
    if not (GETITEM(a) and GETITEM(b) and a.args[0] is b.args[0]):
        return False
    seq = a.args[0]
    if not (_CUMSUM(seq) and seq.args and _cumsum_dim(seq) in (-1, len(shape_of(seq) or ()) - 1)):
        return False
    steps = seq.args[0]
    return (
        _NE(steps) and len(steps.args) == 2 and _int_constant(steps.args[1]) == 1
        and _unit_steps(steps.args[0])
    )


def _cumsum_dim(node: fx.Node):
    """The ``dim`` of a ``cumsum`` node (``torch.cumsum(x, dim)`` or ``x.cumsum(dim)``),
    ``None`` when other arguments (``dtype``) are given too or it is missing."""
    if set(node.kwargs) - {"dim"} or len(node.args) > 2:
        return None
    return node.args[1] if len(node.args) == 2 else node.kwargs.get("dim")


def _always_true(leaf) -> bool:
    """Whether a keep leaf is True everywhere: ``True``, a ``ones`` tensor, ``idx >= 0``
    with ``idx`` a ``torch.arange`` from a non-negative offset, or a packed-sequence term
    over one sequence (:func:`single_sequence`)."""
    if leaf is True:
        return True
    if _reads_mutated(leaf):
        return False
    if _ONES(leaf) or single_sequence(leaf):
        return True
    if not (_GE(leaf) and len(leaf.args) == 2 and _int_constant(leaf.args[1]) == 0):
        return False
    index = _arange_of(leaf.args[0])
    return index is not None and index.offset >= 0


def _without_causal(node) -> list[fx.Node] | None:
    """The leaves of the keep mask ``node`` (True = attend) left once its proven causal
    comparisons and always-true leaves are dropped; ``None`` when no leaf is a proven causal
    comparison or a leaf left is not a bool tensor node (the mask is then kept whole)."""
    leaves = _keep_leaves(node)
    if not any(proven_causal(leaf) for leaf in leaves):
        return None
    rest = [leaf for leaf in leaves if not (proven_causal(leaf) or _always_true(leaf))]
    if not all(_is_bool_node(leaf) for leaf in rest):
        return None
    return list(dict.fromkeys(rest))


def split_causal(spec: MaskSpec) -> tuple[MaskSpec, bool]:
    """``(spec, proven)``: ``proven`` when a keep term (True = attend, not negated) ANDs a
    proven causal comparison (:func:`proven_causal`); such terms are then replaced by their
    other leaves (each an existing graph node broadcasting to ``[B, H, Lq, Lkv]``, one keep
    term each; always-true leaves such as ``q_idx >= 0`` or ``new_ones`` dropped), so that
    the causal part can be served as ``is_causal=True``. Additive terms are kept as they are
    (see the module docstring). ``(spec, False)`` unchanged when nothing is proven."""
    keep, proven = [], False
    for term in spec.keep:
        rest = None if term.negate or term.regroup else _without_causal(term.node)
        if rest is None:
            keep.append(term)
        else:
            keep += [KeepTerm(leaf) for leaf in rest]
            proven = True
    return (replace(spec, keep=keep), True) if proven else (spec, False)
