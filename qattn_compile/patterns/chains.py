"""Find hand-written attention: ``Q·Kᵀ → scale → mask → softmax → dropout → ·V`` chains.

Anchored on every softmax, a match walks

- back from the softmax input to the ``Q·Kᵀ`` product (``torch.matmul``, ``@``, ``bmm``,
  ``Tensor.matmul``, a ``torch.einsum`` that is one batched matrix product in any layout,
  see :mod:`.einsum`, or ``baddbmm``, whose added input is an additive term: BLOOM's ALiBi
  bias) through float casts, views that only regroup the batch dims (OPT's and BLOOM's
  ``[B·H, L, L]`` ↔ ``[B, H, L, L]``, Swin's ``[B·nW, H, N, N]`` ↔ ``[B, nW, H, N, N]``: a mask
  applied in another grouping is moved into the product's, see :func:`.masks.regroup`;
  Q and K viewed from tensors grouped as the P·V product are read before the view), scale
  factors (``mul``/``div`` by a constant or a run-time scalar, see :mod:`.scaling`),
  additive masks (``+ mask``), ``-inf``-like masks (``masked_fill(m, -inf)``,
  ``where(m, scores, finfo.min)``) and floors that still mask (OPT's ``torch.max(scores,
  finfo.min)``), in any order. A finite fill (≤ −1e4) becomes a keep term like ``-inf``: the
  one difference is a row whose every key is filled, which the op gives 0 and the original
  the mean of V;
- forward from the softmax output through float casts, batch-regrouping views and
  eval-mode dropout to the ``P·V`` product, whose output the op replaces.

Logit soft-capping (``cap·tanh(scores/cap)`` before the masks: Gemma 2, Grok) is served: the
site carries the cap and the kernels apply it. Reasons name ops by what the model's code
calls and its source line, never by FX node names.

On the Q·Kᵀ operands, constant scales on Q or K are folded into the softmax scale and the
transpose/permute/``.mT`` of K is looked through; a key that was never transposed back (a
pre-transposed ``[.., D, L]`` key) is transposed by the rewrite, and so are an einsum's
operands held in other layouts (the site's ``*_dims``). A softmax whose output
reaches a matmul and whose input comes from one (within a few ops) is a *candidate*: when
the strict walk fails, the site is reported with the reason — an unsupported op in between,
dropout in training, an intermediate (scores, probabilities) used elsewhere, …
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import fx

from . import einsum, gqa, masks
from .einsum import Contraction
from .masks import AdditiveTerm, KeepTerm, MaskSpec
from .nodes import (
    ADD,
    CAST,
    DIV,
    DROPOUT,
    MASK_FILL_MAX,
    MASKED_FILL,
    MATMUL,
    MUL,
    SOFTMAX,
    WHERE,
    Op,
    arg,
    constant,
    describe,
    grad_refusal,
    is_last_two_swap,
    is_minus_inf_like,
    is_one,
    same_shape,
    same_size,
    shape_of,
    tensor_value,
)
from .scaling import Factor, as_factor, constant_scale, runtime_factors
from .site import AttentionSite, module_of, source_of

PATTERN = "matmul_softmax"
_IDENTITY = Op((), ("contiguous", "clone"))
TANH = Op((torch.tanh, torch.nn.functional.tanh), ("tanh",))
BADDBMM = Op((torch.baddbmm,), ("baddbmm",))
_MAXIMUM = Op((torch.max, torch.maximum), ("max", "maximum"))
_CLAMP_MIN = Op((torch.clamp, torch.clamp_min), ("clamp", "clamp_min"))
_REGROUP = Op((torch.reshape, torch.flatten, torch.unflatten), ("reshape", "view", "flatten", "unflatten"))
_LOOSE_STEPS = 8
"""How far (in ops) a softmax may be from a matmul and still count as a candidate."""


class _SoftCap:
    """The ``tanh`` of logit soft-capping ``cap·tanh(scores/cap)`` (Gemma 2, Grok): the
    constant factors after it are the cap, those before it the softmax scale over the cap."""


SOFT_CAP = _SoftCap()


@dataclass
class _Scores:
    """The walk from a softmax back to ``Q·Kᵀ``: steps in graph order (qk outward)."""

    qk: fx.Node | None = None
    nodes: list[fx.Node] = field(default_factory=list)
    steps: list[tuple[Factor | KeepTerm | AdditiveTerm | fx.Node, tuple]] = field(default_factory=list)
    """Each step's effect with the batch dims of the scores it applies to."""
    refusal: str | None = None
    stop: fx.Node | None = None


def _product(node, swap: bool = False) -> Contraction | str | None:
    """``node`` as a matrix product: a ``matmul``/``bmm``/``@`` node (operands positional or
    keyword) or an einsum of one batched product, read with its operands swapped when
    ``swap`` (einsums only); a string says why an einsum is not one; ``None``: neither."""
    if MATMUL(node):
        second = "mat2" if "mat2" in node.kwargs else "other"
        return Contraction(node, arg(node, 0, "input"), arg(node, 1, second))
    if BADDBMM(node):  # input + b1·b2 (scaled by beta, alpha): the bias is a scores step
        return Contraction(node, arg(node, 1, "batch1"), arg(node, 2, "batch2"))
    return einsum.contraction(node, swap)


def _baddbmm_steps(node: fx.Node) -> list | str:
    """The scores steps of ``baddbmm(bias, q, kᵀ, beta=β, alpha=α)`` = ``α·(q·kᵀ) + β·bias``
    in graph order: the factor α, then the bias as an additive term times β (how BLOOM adds
    its ALiBi bias, and MHA its mask when it returns weights)."""
    alpha, beta = constant(node.kwargs.get("alpha", 1)), constant(node.kwargs.get("beta", 1))
    if alpha is None or beta is None:
        return f"`alpha`/`beta` of {describe(node)} are not constants"
    bias, steps = arg(node, 0, "input"), []
    if alpha != 1:
        steps.append(Factor(alpha))
    if beta != 0:
        val = tensor_value(bias)
        if val is None or not val.is_floating_point():
            return f"the bias of {describe(node)} is not a float tensor"
        steps.append(AdditiveTerm(bias, (Factor(beta),) if beta != 1 else (), kind="additive"))
    return steps


def _scores_product(node: fx.Node) -> Contraction | str:
    """The ``Q·Kᵀ`` product at ``node``: an einsum is read with the operand whose own index
    is the output's last (the keys) second, so that its product needs no output permutation."""
    found = _product(node)
    if isinstance(found, Contraction) and found.out_dims is not None:  # an einsum (a matmul has none)
        swapped = _product(node, swap=True)
        found = swapped if isinstance(swapped, Contraction) and swapped.out_dims is None else found
    if isinstance(found, Contraction) and found.out_dims is not None:
        return f"einsum scores {node.args[0]!r} whose last two axes are not (queries, keys)"
    return found


def _pv_product(node: fx.Node, probs: fx.Node) -> Contraction | None:
    """``node`` as the ``P·V`` product of ``probs`` (its first operand), or ``None``."""
    for swap in (False, True) if einsum.is_einsum(node) else (False,):
        found = None if BADDBMM(node) else _product(node, swap)
        if isinstance(found, Contraction) and found.a is probs:
            return found
    return None


def _loose_matmul(node) -> fx.Node | None:
    """A matrix product (:func:`_product`) within :data:`_LOOSE_STEPS` ops before ``node``,
    following first tensor arguments (the way scores usually flow)."""
    for _ in range(_LOOSE_STEPS):
        if not isinstance(node, fx.Node):
            return None
        if _product(node) is not None:
            return node
        node = next((a for a in node.all_input_nodes if tensor_value(a) is not None), None)
    return None


def _nearby_product(node) -> fx.Node | None:
    """A matrix product (an unreadable einsum included) within :data:`_LOOSE_STEPS` ops
    before ``node`` along any tensor input: how far back a softmax input may come from
    ``Q·Kᵀ`` for the softmax to be a candidate, reported when the strict walk fails."""
    frontier, seen = [node], set()
    for _ in range(_LOOSE_STEPS):
        found = next((n for n in frontier if _product(n) is not None), None)
        if found is not None:
            return found
        seen.update(frontier)
        frontier = [a for n in frontier if isinstance(n, fx.Node) for a in n.all_input_nodes
                    if a not in seen and tensor_value(a) is not None]
    return None


def _score_operand(node: fx.Node, candidates: list) -> fx.Node | None:
    """Which of ``candidates`` (operands of ``node``) carries the scores: it has ``node``'s
    shape and, when several do, leads back to a matmul."""
    out = shape_of(node)
    full = [c for c in candidates if isinstance(c, fx.Node) and same_shape(shape_of(c), out)]
    if len(full) > 1:
        full = [c for c in full if _loose_matmul(c) is not None] or full
    return full[0] if full else None


def _shown(shape) -> str:
    return str(list(shape)) if shape is not None else "?"


def _is_float_copy(node: fx.Node) -> bool:
    """Whether a cast/copy ``node`` keeps its input's shape and gives a float tensor."""
    val = tensor_value(node)
    return val is not None and val.is_floating_point() and same_shape(shape_of(node.args[0]), val.shape)


def _is_bool(node) -> bool:
    val = tensor_value(node)
    return val is not None and val.dtype == torch.bool


def _step_back(node: fx.Node) -> tuple[fx.Node, Factor | KeepTerm | fx.Node | None] | str:
    """One op on the scores: (its scores operand, what it does), or why it is unsupported.

    What it does: ``None`` (a cast), a :class:`Factor`, a :class:`KeepTerm`, or the node of
    an additive mask.
    """
    unsupported = f"unsupported op {describe(node)} between Q·Kᵀ and softmax"
    if TANH(node):
        return node.args[0], SOFT_CAP
    if CAST(node) or _IDENTITY(node):
        return (node.args[0], None) if _is_float_copy(node) else unsupported
    if _regroups(node):
        return node.args[0], None
    if _MAXIMUM(node) or _CLAMP_MIN(node):
        return _floor(node) or unsupported
    if MUL(node) or DIV(node):
        if DIV(node) and arg(node, 2, "rounding_mode") is not None:
            return unsupported
        a, b = node.args[:2]
        scores = _score_operand(node, [a] if DIV(node) else [a, b])
        if scores is None:
            return unsupported
        factor = as_factor(b if scores is a else a, DIV(node), shape_of(node))
        return (scores, factor) if isinstance(factor, Factor) else factor
    if ADD(node) and len(node.args) == 2 and not node.kwargs:
        scores = _score_operand(node, list(node.args))
        other = node.args[1] if scores is node.args[0] else node.args[0]
        if (scores is not None and not same_shape(shape_of(other), shape_of(node))
                and _loose_matmul(scores) is None and _loose_matmul(other) is not None):
            return (f"{describe(node)} broadcasts the scores {_shown(shape_of(other))} up to the "
                    f"mask's {_shown(shape_of(node))} (only masks that broadcast to the scores are served)")
        val = tensor_value(other)
        if scores is None or val is None or not val.is_floating_point():
            return unsupported
        return scores, other
    if MASKED_FILL(node):
        mask, value = arg(node, 1, "mask"), constant(arg(node, 2, "value"))
        if not _is_bool(mask):
            return unsupported
        if not is_minus_inf_like(value):
            return f"masked_fill value {arg(node, 2, 'value')!r} does not mask (only -inf or <= -1e4 do)"
        return node.args[0], KeepTerm(mask, negate=True, fill=value)
    if WHERE(node) and len(node.args) == 3:
        cond, then, other = node.args
        if node.op == "call_method":  # scores.where(cond, fill)
            cond, then = then, cond
        scores = _score_operand(node, [then, other])
        fill = other if scores is then else then
        if scores is None or not _is_bool(cond) or not is_minus_inf_like(constant(fill)):
            return f"{describe(node)} is not a mask (the other branch of `where` must be -inf-like)"
        return scores, KeepTerm(cond, negate=scores is other, fill=constant(fill))
    return unsupported


def _floor(node: fx.Node) -> tuple[fx.Node, None] | None:
    """``(scores, None)`` when ``node`` only raises the scores to a floor that still masks
    (``torch.max(scores, finfo.min)``, as OPT writes after adding its mask; ``clamp(min=…)``):
    the floor is at most :data:`MASK_FILL_MAX`, so it changes masked scores only (like a
    finite fill, see the module docstring)."""
    if _MAXIMUM(node) and len(node.args) == 2 and not node.kwargs:
        scores = _score_operand(node, list(node.args))
        floor = node.args[1] if scores is node.args[0] else node.args[0]
    elif _CLAMP_MIN(node) and arg(node, 2, "max") is None:
        scores, floor = node.args[0], arg(node, 1, "min")
    else:
        return None
    if scores is None or not is_minus_inf_like(constant(floor)):
        return None
    return scores, None


def _regroups(node: fx.Node) -> bool:
    """Whether ``node`` only regroups the batch dims of the scores or probabilities (a
    ``view``/``reshape``/``flatten``/``unflatten`` keeping the last two dims and the dtype:
    OPT's and BLOOM's ``[B·H, L, L]`` ↔ ``[B, H, L, L]``, Swin's windows)."""
    val, source = tensor_value(node), tensor_value(node.args[0]) if node.args else None
    return (_REGROUP(node) and val is not None and source is not None and val.dtype == source.dtype
            and val.dim() >= 2 and source.dim() >= 2 and same_shape(val.shape[-2:], source.shape[-2:]))


def _unviewed(node: fx.Node, layout: tuple) -> fx.Node | None:
    """The tensor ``node`` is a batch-regrouping view of (:func:`_regroups`), when its batch
    dims are ``layout``; else ``None``."""
    if isinstance(node, fx.Node) and _regroups(node) and same_shape(_batch_dims(node.args[0]), layout):
        return node.args[0]
    return None


def _batch_dims(node: fx.Node) -> tuple:
    return tuple((shape_of(node) or ())[:-2])


def _walk_scores(softmax: fx.Node) -> _Scores:
    """Walk from the softmax input back to ``Q·Kᵀ`` (see :func:`_step_back`)."""
    walk, node = _Scores(), arg(softmax, 0, "input")
    while _product(node) is None:
        step = _step_back(node) if isinstance(node, fx.Node) else f"softmax of {node!r}"
        if isinstance(step, str):
            walk.refusal, walk.stop = step, node
            return walk
        walk.nodes.append(node)
        layout = _batch_dims(node)
        node, effect = step
        if effect is not None:
            walk.steps.append((effect, layout))
    walk.qk = node
    walk.steps.reverse()
    return walk


def _prob_refusal(node: fx.Node) -> str | None:
    """Why an op between softmax and ``P·V`` cannot be served, or None."""
    if CAST(node) or _IDENTITY(node):
        return None if _is_float_copy(node) else f"unsupported cast {describe(node)} of the probabilities"
    if _regroups(node):
        return None
    if DROPOUT(node):
        p = arg(node, 1, "p", 0.5)
        training = arg(node, 2, "train" if node.target is torch.dropout else "training", True)
        if training is False or p == 0:
            return None
        return f"dropout p={p} in training mode (only eval-mode or p=0 dropout is served)"
    return f"unsupported op {describe(node)} between softmax and the P·V matmul"


def _transposed_pv(node: fx.Node) -> Contraction | None:
    """``Vᵀ·Pᵀ``: a matmul taking ``node``, a last-two swap of the probabilities, as its
    right operand (the key axis is still the one contracted)."""
    if not is_last_two_swap(node):
        return None
    for user in node.users:
        if MATMUL(user) and len(user.args) == 2 and user.args[1] is node and user.args[0] is not node:
            return Contraction(user, node, user.args[0])
    return None


def _walk_probs(softmax: fx.Node) -> tuple[Contraction | None, list[fx.Node], str | None, bool]:
    """(the ``P·V`` product, the ops between softmax and it, why they cannot be served,
    whether the product is ``Vᵀ·Pᵀ``, found only when no ``P·V`` is).

    Searches every path of at most :data:`_LOOSE_STEPS` ops that pass the probabilities
    on as first argument, so a second user of the probabilities (returned weights, a
    ``detach``) does not hide the matmul; the reuse itself is refused later.
    """

    def search(node: fx.Node, path: list[fx.Node], find):
        pv = find(node)
        if pv is not None:
            return pv, path
        if len(path) < _LOOSE_STEPS:
            for user in node.users:
                if user.op in ("call_function", "call_method") and user.args and user.args[0] is node:
                    found = search(user, [*path, user], find)
                    if found is not None:
                        return found
        return None

    found = search(softmax, [], lambda node: next(filter(None, (_pv_product(u, node) for u in node.users)), None))
    if found is not None:
        pv, path = found
        return pv, path, next(filter(None, map(_prob_refusal, path)), None), False
    found = search(softmax, [], _transposed_pv)
    if found is None:
        return None, [], None, False
    pv, path = found
    return pv, path, (f"the probabilities enter {describe(pv.node)} transposed, as its right operand "
                           "(Vᵀ·Pᵀ instead of P·V): not served"), True


def _strip_constant_scale(node) -> tuple[fx.Node, list[Factor], list[fx.Node]]:
    """``node`` without constant ``mul``/``div`` factors: (base, factors, stripped nodes)."""
    factors, stripped = [], []
    while (MUL(node) or DIV(node)) and len(node.args) == 2 and not node.kwargs:
        a, b = node.args
        if constant(b) is not None and isinstance(a, fx.Node):
            base, value = a, b
        elif MUL(node) and constant(a) is not None and isinstance(b, fx.Node):
            base, value = b, a
        else:
            break
        factor = as_factor(value, DIV(node), ())
        if not isinstance(factor, Factor):
            break
        factors.append(factor)
        stripped.append(node)
        node = base
    return node, factors, stripped


def _reuse_refusal(scores: list[fx.Node], probs: list[fx.Node], last: fx.Node) -> str | None:
    """Why the chain (``scores`` ops, then ``probs`` ops, then ``last``) cannot be removed:
    an intermediate is used outside it."""
    inside = {*scores, *probs, last}
    for what, nodes in (("scores", scores), ("probabilities", probs)):
        for node in nodes:
            outside = [describe(u) for u in node.users if u not in inside]
            if outside:
                return (
                    f"the {what} from {describe(node)} are also used by {', '.join(outside)} outside "
                    "the attention (e.g. the model returns its attention weights)"
                )
    return None


def _shape_refusal(shapes: dict[str, tuple | None]) -> str | None:
    """Why q, k, v of these shapes (as the op would receive them) do not fit its layouts."""
    qs, ks, vs = shapes["q"], shapes["k"], shapes["v"]
    if qs is None or ks is None or vs is None:
        return "query/key/value have no recorded example values"
    if not (len(qs) == len(ks) == len(vs) and len(qs) in (3, 4)):
        return f"rank-{len(qs)} attention (only [B, H, L, D] and [B·H, L, D] are served)"
    if not (same_size(qs[0], ks[0]) and same_size(qs[0], vs[0])):
        return "query and key/value batch sizes differ (batch broadcast is not served)"
    if not same_size(ks[-3], vs[-3]):
        return "key and value head counts differ"
    return None


def _mask_and_scale(steps: list, site_layout: tuple) -> tuple[MaskSpec, list[Factor], float, str | None]:
    """The mask terms and scale factors of a walk's steps (graph order, each with the batch
    dims of the scores it applies to): every additive term is multiplied by the factors
    applied after it, and a term applied while a view regrouped the batch dims is moved to
    ``site_layout`` (:func:`~.masks.regroup`). The third value refuses a term that cannot be
    moved, a per-row run-time scale applied in another layout, and a scale applied after a
    keep term (``where``/``masked_fill``) that could undo its masking: not a positive
    constant, or one that lifts a finite fill above ``MASK_FILL_MAX`` (the op masks those
    keys fully whatever follows). The soft cap (0.0 without ``tanh``) is the product of the
    factors after the ``tanh``, which must be positive constants with no mask before the
    ``tanh`` (it would not mask through it): ``cap·tanh(τ·Q·Kᵀ/cap)`` with τ the product of
    every factor."""
    spec, factors, refusal = MaskSpec(), [], None
    fills: list[float] = []  # each keep term's fill, times the factors after it
    softcap = 0.0
    for step, layout in steps:
        if step is SOFT_CAP:
            if softcap or spec.keep or spec.additive:
                refusal = refusal or ("soft-capping `tanh` after another one or after a mask (only "
                                      "cap·tanh(scores/cap) before any mask is served)")
            softcap = 1.0
            continue
        if softcap and isinstance(step, Factor):
            if step.number is None or step.number <= 0:
                refusal = refusal or "a soft cap that is not a positive constant"
            else:
                softcap *= step.number
        moved = None
        if not same_shape(layout, site_layout):
            node = step.node if isinstance(step, (KeepTerm, AdditiveTerm)) else step
            if isinstance(step, Factor):
                value = tensor_value(step.value)
                if value is not None and value.dim() > 0:
                    refusal = refusal or "a per-row scale applied while a view regrouped the scores' batch dims"
            else:
                moved = masks.regroup(node, layout, site_layout)
                if isinstance(moved, str):
                    refusal, moved = refusal or moved, None
        if isinstance(step, Factor):
            factors.append(step)
            spec.additive = [replace(t, factors=(*t.factors, step)) for t in spec.additive]
            if fills and (step.number is None or step.number <= 0):
                shown = step.number if step.number is not None else "a run-time value"
                refusal = refusal or f"scores scaled by {shown} after a masking `where`/`masked_fill`"
            elif fills:
                fills = [fill * step.number for fill in fills]
        elif isinstance(step, KeepTerm):
            spec.keep.append(replace(step, regroup=moved))
            fills.append(step.fill)
        elif isinstance(step, AdditiveTerm):
            spec.additive.append(replace(step, regroup=moved))
        else:
            spec.additive.append(AdditiveTerm(step, regroup=moved))
    weakest = max(fills, default=float("-inf"))
    if refusal is None and weakest > MASK_FILL_MAX:
        refusal = (f"scores scaled after a masking `where`/`masked_fill`: its fill becomes "
                   f"{weakest:g}, which no longer masks (only values <= {MASK_FILL_MAX:g} do)")
    return spec, factors, softcap, refusal


def _swap_last_two(dims: tuple[int, ...] | None, rank: int) -> tuple[int, ...] | None:
    """``dims`` followed by a swap of the last two axes (``None``: no permutation)."""
    if rank < 2:
        return dims
    dims = list(dims or range(rank))
    dims[-2:] = dims[-1], dims[-2]
    return None if dims == list(range(rank)) else tuple(dims)


def _key(kt: fx.Node, kt_dims: tuple[int, ...] | None) -> tuple[fx.Node, tuple | None, list[Factor], list[fx.Node]]:
    """K from the product's second operand (Kᵀ after ``kt_dims``): (node, the permutation
    that gives ``[.., Lk, D]``, constant factors, stripped nodes). A transpose/permute/``.mT``
    that swaps back to K is looked through."""
    kt, factors, stripped = _strip_constant_scale(kt)
    if kt_dims is None and is_last_two_swap(kt):
        k, more_factors, more_stripped = _strip_constant_scale(kt.args[0])
        return k, None, factors + more_factors, [*stripped, kt, *more_stripped]
    return kt, _swap_last_two(kt_dims, len(shape_of(kt) or ())), factors, stripped


def chain_site(softmax: fx.Node) -> AttentionSite | None:
    """The :class:`AttentionSite` of the chain around ``softmax``; ``None`` when ``softmax``
    is not a candidate (no matmul before and after it)."""
    if not SOFTMAX(softmax):
        return None
    pv, prob_nodes, refusal, transposed = _walk_probs(softmax)
    if pv is None:
        return None
    walk = _walk_scores(softmax)
    qk_node = walk.qk or (None if transposed else _nearby_product(walk.stop))
    if qk_node is None:
        return None
    qk = _scores_product(qk_node)
    if isinstance(qk, str):  # an einsum that is no Q·Kᵀ product: report it on its operands
        refusal = refusal or qk
        operands = [a for a in qk_node.all_input_nodes if tensor_value(a) is not None] or [qk_node]
        qk = Contraction(qk_node, operands[0], operands[-1])
    refusal = walk.refusal or refusal
    rank, dim = len(shape_of(softmax) or ()), arg(softmax, 1, "dim")
    if refusal is None and not (isinstance(dim, int) and rank and dim % rank == rank - 1):
        refusal = f"softmax over dim {dim} (only the key axis, dim -1, is served)"
    if refusal is None and pv.a_dims is not None:
        refusal = f"the P·V einsum {pv.node.args[0]!r} permutes the probabilities"
    site_layout = _batch_dims(qk.node)
    if BADDBMM(qk.node):
        bias_steps = _baddbmm_steps(qk.node)
        if isinstance(bias_steps, str):
            refusal, bias_steps = refusal or bias_steps, []
        walk.steps[:0] = [(step, site_layout) for step in bias_steps]

    q, q_factors, q_stripped = _strip_constant_scale(qk.a)
    k, k_dims, k_factors, k_stripped = _key(qk.b, qk.b_dims)
    v, v_dims = pv.b, pv.b_dims
    pv_layout = _batch_dims(pv.node)
    if any(map(_regroups, [*walk.nodes, *prob_nodes])) and not same_shape(site_layout, pv_layout):
        q_source, k_source = _unviewed(q, pv_layout), _unviewed(k, pv_layout)
        if refusal is None and (q_source is None or k_source is None or k_dims is not None):
            refusal = (f"Q·Kᵀ ({describe(qk.node)}) and P·V ({describe(pv.node)}) group their batch dims "
                       f"differently: {_shown(site_layout)} and {_shown(pv_layout)} (served only when Q "
                       "and K are views of tensors grouped as P·V's)")
        elif refusal is None:  # bmm on [B, H, L, D] tensors viewed as [B·H, L, D]
            q_stripped, k_stripped = [*q_stripped, q], [*k_stripped, k]
            q, k, site_layout = q_source, k_source, pv_layout
    chain = [*q_stripped, *k_stripped, qk.node, *walk.nodes, softmax, *prob_nodes, pv.node]
    mask, factors, softcap, scale_refusal = _mask_and_scale(walk.steps, site_layout)
    factors = [*q_factors, *k_factors, *factors]
    runtime = runtime_factors(factors)
    fqn, cls = module_of(pv.node)
    site = AttentionSite(
        pattern=PATTERN,
        anchor=pv.node,
        q=q,
        k=k,
        v=v,
        mask=mask,
        scale=constant_scale(factors),
        scale_factors=runtime,
        softcap=softcap,
        q_dims=qk.a_dims,
        k_dims=k_dims,
        v_dims=v_dims,
        out_dims=pv.out_dims,
        mask_kind=masks.mask_kind(mask, False),
        fqn=fqn,
        module_class=cls,
        source=source_of(pv.node),
        chain=chain,
    )
    shapes = site.op_shapes()
    inputs = {"Q": q, "K": k, "V": v, "the mask": mask.nodes(), "the scale": [f.value for f in runtime]}
    site.refusal = (
        refusal
        or scale_refusal
        or _reuse_refusal([qk.node, *walk.nodes], [softmax, *prob_nodes], pv.node)
        or _shape_refusal(shapes)
        or grad_refusal(pv.node, inputs)
    )
    if site.refusal is None and k_dims is None and v_dims is None and (found := gqa.unrepeat_kv(k, v)):
        (site.k, site.v), site.gqa_source = (found[0].source, found[1].source), found[0].how
        site.chain += found[0].nodes + found[1].nodes
    elif site.refusal is None and len(shapes["q"]) == 4 and is_one(shapes["k"][1]) and not is_one(shapes["q"][1]):
        site.gqa_source = "broadcast"
    lengths_match = site.refusal is None and same_size(shapes["q"][-2], shapes["v"][-2])
    site.causal_fast_path = lengths_match and masks.causal_fast_path(mask)
    return site
