"""Find hand-written attention: ``Q·Kᵀ → scale → mask → softmax → dropout → ·V`` chains.

Anchored on every softmax, a match walks

- back from the softmax input to the ``Q·Kᵀ`` product (``torch.matmul``, ``@``, ``bmm``,
  ``Tensor.matmul``) through float casts, scale factors (``mul``/``div`` by a constant or a
  run-time scalar, see :mod:`.scaling`), additive masks (``+ mask``) and ``-inf``-like masks
  (``masked_fill(m, -inf)``, ``where(m, scores, finfo.min)``), in any order. A finite fill
  (≤ −1e4) becomes a keep term like ``-inf``: the one difference is a row whose every key is
  filled, which the op gives 0 and the original the mean of V;
- forward from the softmax output through float casts and eval-mode dropout to the ``P·V``
  product, whose output the op replaces.

On the Q·Kᵀ operands, constant scales on Q or K are folded into the softmax scale and the
transpose/permute/``.mT`` of K is looked through; a key that was never transposed back (a
pre-transposed ``[.., D, L]`` key) is transposed by the rewrite. A softmax whose output
reaches a matmul and whose input comes from one (within a few ops) is a *candidate*: when
the strict walk fails, the site is reported with the reason — an unsupported op in between,
dropout in training, an intermediate (scores, probabilities) used elsewhere, …
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx

from . import gqa, masks
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
    is_last_two_swap,
    is_minus_inf_like,
    is_one,
    requires_grad,
    same_shape,
    same_size,
    shape_of,
    tensor_value,
)
from .scaling import Factor, as_factor, constant_scale, runtime_factors
from .site import AttentionSite, module_of, source_of

PATTERN = "matmul_softmax"
_IDENTITY = Op((), ("contiguous", "clone"))
_LOOSE_STEPS = 8
"""How far (in ops) a softmax may be from a matmul and still count as a candidate."""


@dataclass
class _Scores:
    """The walk from a softmax back to ``Q·Kᵀ``: steps in graph order (qk outward)."""

    qk: fx.Node | None = None
    nodes: list[fx.Node] = field(default_factory=list)
    steps: list[Factor | KeepTerm | fx.Node] = field(default_factory=list)
    refusal: str | None = None
    stop: fx.Node | None = None


def _operands(matmul: fx.Node) -> tuple:
    """The two operands of a ``matmul``/``bmm``/``@`` node, positional or keyword."""
    second = "mat2" if "mat2" in matmul.kwargs else "other"
    return arg(matmul, 0, "input"), arg(matmul, 1, second)


def _loose_matmul(node) -> fx.Node | None:
    """A matmul within :data:`_LOOSE_STEPS` ops before ``node``, following first tensor
    arguments (how far back a softmax input may come from ``Q·Kᵀ`` to be a candidate)."""
    for _ in range(_LOOSE_STEPS):
        if not isinstance(node, fx.Node):
            return None
        if MATMUL(node):
            return node
        node = next((a for a in node.all_input_nodes if tensor_value(a) is not None), None)
    return None


def _score_operand(node: fx.Node, candidates: list) -> fx.Node | None:
    """Which of ``candidates`` (operands of ``node``) carries the scores: it has ``node``'s
    shape and, when several do, leads back to a matmul."""
    out = shape_of(node)
    full = [c for c in candidates if isinstance(c, fx.Node) and same_shape(shape_of(c), out)]
    if len(full) > 1:
        full = [c for c in full if _loose_matmul(c) is not None] or full
    return full[0] if full else None


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
    if CAST(node) or _IDENTITY(node):
        return (node.args[0], None) if _is_float_copy(node) else unsupported
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
            return f"`where` {describe(node)} is not a mask (the other branch must be -inf-like)"
        return scores, KeepTerm(cond, negate=scores is other, fill=constant(fill))
    return unsupported


def _walk_scores(softmax: fx.Node) -> _Scores:
    """Walk from the softmax input back to ``Q·Kᵀ`` (see :func:`_step_back`)."""
    walk, node = _Scores(), arg(softmax, 0, "input")
    while not MATMUL(node):
        step = _step_back(node) if isinstance(node, fx.Node) else f"softmax of {node!r}"
        if isinstance(step, str):
            walk.refusal, walk.stop = step, node
            return walk
        walk.nodes.append(node)
        node, effect = step
        if effect is not None:
            walk.steps.append(effect)
    walk.qk = node
    walk.steps.reverse()
    return walk


def _prob_refusal(node: fx.Node) -> str | None:
    """Why an op between softmax and ``P·V`` cannot be served, or None."""
    if CAST(node) or _IDENTITY(node):
        return None if _is_float_copy(node) else f"unsupported cast {describe(node)} of the probabilities"
    if DROPOUT(node):
        p = arg(node, 1, "p", 0.5)
        training = arg(node, 2, "train" if node.target is torch.dropout else "training", True)
        if training is False or p == 0:
            return None
        return f"dropout p={p} in training mode (only eval-mode or p=0 dropout is served)"
    return f"unsupported op {describe(node)} between softmax and the P·V matmul"


def _walk_probs(softmax: fx.Node) -> tuple[fx.Node | None, list[fx.Node], str | None]:
    """(the ``P·V`` matmul, the ops between softmax and it, why they cannot be served).

    Searches every path of at most :data:`_LOOSE_STEPS` ops that pass the probabilities
    on as first argument, so a second user of the probabilities (returned weights, a
    ``detach``) does not hide the matmul; the reuse itself is refused later.
    """

    def search(node: fx.Node, path: list[fx.Node]):
        pv = next((u for u in node.users if MATMUL(u) and _operands(u)[0] is node), None)
        if pv is not None:
            return pv, path
        if len(path) < _LOOSE_STEPS:
            for user in node.users:
                if user.op in ("call_function", "call_method") and user.args and user.args[0] is node:
                    found = search(user, [*path, user])
                    if found is not None:
                        return found
        return None

    found = search(softmax, [])
    if found is None:
        return None, [], None
    pv, path = found
    return pv, path, next(filter(None, map(_prob_refusal, path)), None)


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
            outside = [f"`{u.name}`" for u in node.users if u not in inside]
            if outside:
                return (
                    f"intermediate `{node.name}` ({what}) is also used by {', '.join(outside)} "
                    "(e.g. the model returns its attention weights)"
                )
    return None


def _shape_refusal(q: fx.Node, k: fx.Node, v: fx.Node, k_transposed: bool) -> str | None:
    """Why these operands do not fit the op's layouts, or None."""
    qs, ks, vs = shape_of(q), shape_of(k), shape_of(v)
    if qs is None or ks is None or vs is None:
        return "query/key/value have no recorded example values"
    if k_transposed:
        ks = (*ks[:-2], ks[-1], ks[-2])
    if not (len(qs) == len(ks) == len(vs) and len(qs) in (3, 4)):
        return f"rank-{len(qs)} attention (only [B, H, L, D] and [B·H, L, D] are served)"
    if not (same_size(qs[0], ks[0]) and same_size(qs[0], vs[0])):
        return "query and key/value batch sizes differ (batch broadcast is not served)"
    if not same_size(ks[-3], vs[-3]):
        return "key and value head counts differ"
    return None


def _grad_refusal(nodes: list) -> str | None:
    grads = [f"`{n.name}`" for n in nodes if isinstance(n, fx.Node) and requires_grad(n)]
    if grads:
        return f"{', '.join(grads)} requires grad (training through qattn is not served)"
    return None


def _mask_and_scale(steps: list) -> tuple[MaskSpec, list[Factor], str | None]:
    """The mask terms and scale factors of a walk's steps (graph order): every additive
    term is multiplied by the factors applied after it. The third value refuses a scale
    applied after a keep term (``where``/``masked_fill``) that could undo its masking: not a
    positive constant, or one that lifts a finite fill above ``MASK_FILL_MAX`` (the op masks
    those keys fully whatever follows)."""
    spec, factors, refusal = MaskSpec(), [], None
    fills: list[float] = []  # each keep term's fill, times the factors after it
    for step in steps:
        if isinstance(step, Factor):
            factors.append(step)
            spec.additive = [AdditiveTerm(t.node, (*t.factors, step)) for t in spec.additive]
            if fills and (step.number is None or step.number <= 0):
                shown = step.number if step.number is not None else "a run-time value"
                refusal = refusal or f"scores scaled by {shown} after a masking `where`/`masked_fill`"
            elif fills:
                fills = [fill * step.number for fill in fills]
        elif isinstance(step, KeepTerm):
            spec.keep.append(step)
            fills.append(step.fill)
        else:
            spec.additive.append(AdditiveTerm(step))
    weakest = max(fills, default=float("-inf"))
    if refusal is None and weakest > MASK_FILL_MAX:
        refusal = (f"scores scaled after a masking `where`/`masked_fill`: its fill becomes "
                   f"{weakest:g}, which no longer masks (only values <= {MASK_FILL_MAX:g} do)")
    return spec, factors, refusal


def chain_site(softmax: fx.Node) -> AttentionSite | None:
    """The :class:`AttentionSite` of the chain around ``softmax``; ``None`` when ``softmax``
    is not a candidate (no matmul before and after it)."""
    if not SOFTMAX(softmax):
        return None
    pv, prob_nodes, refusal = _walk_probs(softmax)
    if pv is None:
        return None
    walk = _walk_scores(softmax)
    qk = walk.qk or _loose_matmul(walk.stop)
    if qk is None:
        return None
    refusal = walk.refusal or refusal
    rank, dim = len(shape_of(softmax) or ()), arg(softmax, 1, "dim")
    if refusal is None and not (isinstance(dim, int) and rank and dim % rank == rank - 1):
        refusal = f"softmax over dim {dim} (only the key axis, dim -1, is served)"

    q, kt = _operands(qk)
    q, q_factors, q_stripped = _strip_constant_scale(q)
    kt, k_factors, k_stripped = _strip_constant_scale(kt)
    k, k_transposed = kt, True
    if is_last_two_swap(kt):
        k, more_factors, more_stripped = _strip_constant_scale(kt.args[0])
        k_transposed, k_factors, k_stripped = False, k_factors + more_factors, [*k_stripped, kt, *more_stripped]
    v = _operands(pv)[1]
    chain = [*q_stripped, *k_stripped, qk, *walk.nodes, softmax, *prob_nodes, pv]
    mask, factors, scale_refusal = _mask_and_scale(walk.steps)
    factors = [*q_factors, *k_factors, *factors]
    runtime = runtime_factors(factors)

    refusal = (
        refusal
        or scale_refusal
        or _reuse_refusal([qk, *walk.nodes], [softmax, *prob_nodes], pv)
        or _shape_refusal(q, k, v, k_transposed)
        or _grad_refusal([q, k, v, *mask.nodes(), *(f.value for f in runtime)])
    )
    gqa_source = None
    if refusal is None and not k_transposed and (found := gqa.unrepeat_kv(k, v)):
        (k, v), gqa_source = (found[0].source, found[1].source), found[0].how
        chain += found[0].nodes + found[1].nodes
    elif refusal is None and len(shape_of(q)) == 4 and is_one(shape_of(k)[1]) and not is_one(shape_of(q)[1]):
        gqa_source = "broadcast"
    lengths_match = refusal is None and same_size(shape_of(q)[-2], shape_of(v)[-2])
    fqn, cls = module_of(pv)
    return AttentionSite(
        pattern=PATTERN,
        anchor=pv,
        q=q,
        k=k,
        v=v,
        mask=mask,
        scale=constant_scale(factors),
        scale_factors=runtime,
        k_transposed=k_transposed,
        gqa_source=gqa_source,
        mask_kind=masks.mask_kind(mask, False),
        causal_fast_path=lengths_match and masks.causal_fast_path(mask),
        fqn=fqn,
        module_class=cls,
        source=source_of(pv),
        refusal=refusal,
        chain=chain,
    )
