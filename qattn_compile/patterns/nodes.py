"""Small predicates over dynamo FX nodes, shared by the site finders.

Dynamo graphs hold torch-level calls: ``call_function`` nodes whose target is a torch or
``operator`` function, and ``call_method`` nodes whose target is a Tensor method name (some
releases record a Python operator as its dunder method, e.g. ``__eq__`` in torch 2.11). The
helpers here recognise an operation in either spelling, read its arguments by position or
keyword, and compare (possibly symbolic) shapes without adding guards.
"""

from __future__ import annotations

import operator
import os
import re
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx
from .._compat import statically_known_true


class Op:
    """One tensor operation in its function and method spellings.

    ``functions`` are ``call_function`` targets, ``methods`` are ``call_method`` names.
    """

    def __init__(self, functions: Sequence[Any] = (), methods: Sequence[str] = ()):
        self.functions = tuple(functions)
        self.methods = frozenset(methods)

    def __call__(self, node: Any) -> bool:
        if not isinstance(node, fx.Node):
            return False
        if node.op == "call_function":
            return any(node.target is f for f in self.functions)
        return node.op == "call_method" and node.target in self.methods


MATMUL = Op((torch.matmul, operator.matmul, torch.bmm), ("matmul", "bmm", "__matmul__"))
SOFTMAX = Op((F.softmax, torch.softmax, torch.Tensor.softmax), ("softmax",))
DROPOUT = Op((F.dropout, torch.dropout))
MUL = Op((operator.mul, operator.imul, torch.mul), ("mul", "__mul__", "__rmul__"))
DIV = Op(
    (operator.truediv, operator.itruediv, torch.div, torch.true_divide), ("div", "true_divide", "__truediv__")
)
ADD = Op((operator.add, operator.iadd, torch.add), ("add", "__add__", "__radd__"))
MASKED_FILL = Op((torch.masked_fill,), ("masked_fill",))
WHERE = Op((torch.where,), ("where",))
TRANSPOSE = Op((torch.transpose, torch.swapaxes, torch.swapdims), ("transpose", "swapaxes", "swapdims"))
PERMUTE = Op((torch.permute,), ("permute",))
CAST = Op((), ("to", "type", "type_as", "float", "half", "bfloat16", "double"))
AND = Op(
    (operator.and_, operator.iand, torch.logical_and, torch.bitwise_and), ("logical_and", "bitwise_and", "__and__")
)
EXPAND = Op((), ("expand", "expand_as"))
RESHAPE = Op((torch.reshape,), ("reshape", "view"))
UNSQUEEZE = Op((torch.unsqueeze,), ("unsqueeze",))
REPEAT_INTERLEAVE = Op((torch.repeat_interleave,), ("repeat_interleave",))
GETITEM = Op((operator.getitem,))
CONSTANT_TENSOR = Op((torch.full, torch.tensor, torch.scalar_tensor, torch.as_tensor))
_ZEROS, _ONES = Op((torch.zeros,)), Op((torch.ones,))


def example_value(node: Any):
    """The fake tensor (or symbolic scalar) dynamo recorded for ``node``; ``None`` if none."""
    if not isinstance(node, fx.Node):
        return None
    return node.meta.get("example_value", node.meta.get("val"))


def tensor_value(node: Any) -> torch.Tensor | None:
    """``example_value(node)`` when it is a tensor, else ``None``."""
    val = example_value(node)
    return val if isinstance(val, torch.Tensor) else None


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Argument ``name`` of ``node``, given at position ``index`` (``self`` counts for
    methods: a method's first non-self argument is at position 1) or as a keyword."""
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[index] if len(node.args) > index else default


def constant(value: Any) -> float | None:
    """The number ``value`` stands for at compile time, or ``None`` when it is not constant.

    Python numbers are constants; so are ``torch.full(size, c)`` / ``torch.tensor(c)`` nodes
    with a numeric ``c``, ``torch.zeros`` and ``torch.ones`` (how models spell a scale, a mask
    fill value, or the 0 of ``where(mask, 0, finfo.min)``).
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if _ZEROS(value):
        return 0.0
    if _ONES(value):
        return 1.0
    if CONSTANT_TENSOR(value):
        fill = arg(value, 1, "fill_value") if value.target is torch.full else arg(value, 0, "data")
        number, tensor = constant(fill), tensor_value(value)
        if number is None or tensor is None:
            return number
        # the value the tensor holds: a bool or uint8 tensor of 5 or -1 holds 1 or 255
        return float(torch.tensor(number).to(tensor.dtype).item())
    return None


MASK_FILL_MAX = -1e4
"""Largest fill value a ``masked_fill``/``where`` mask may use and still count as a mask."""


def is_minus_inf_like(value: float | None) -> bool:
    """Whether filling a score with ``value`` removes its key from the softmax: ``-inf`` or a
    finite value at most :data:`MASK_FILL_MAX` (``exp`` of it underflows to 0 in fp32 and
    fp64 against any realistic row maximum)."""
    return value is not None and value <= MASK_FILL_MAX


def shape_of(node: Any) -> tuple | None:
    """The (possibly symbolic) shape of ``node``'s example tensor, or ``None``."""
    val = tensor_value(node)
    return tuple(val.shape) if val is not None else None


def same_size(a: Any, b: Any) -> bool:
    """Whether two sizes (ints or SymInts) are provably equal, without adding a guard."""
    return statically_known_true(a == b)


def same_shape(a: Sequence | None, b: Sequence | None) -> bool:
    """Whether two shapes are provably equal, without adding a guard."""
    return a is not None and b is not None and len(a) == len(b) and all(map(same_size, a, b))


def is_one(size: Any) -> bool:
    """Whether a size is provably 1."""
    return same_size(size, 1)


def broadcasts_into(small: Sequence, big: Sequence) -> bool:
    """Whether a tensor of shape ``small`` broadcasts against ``big`` without growing it."""
    if len(small) > len(big):
        return False
    return all(is_one(s) or same_size(s, b) for s, b in zip(reversed(small), reversed(big), strict=False))


def is_last_two_swap(node: fx.Node) -> bool:
    """Whether ``node`` swaps the last two dims of its input (transpose, permute, ``.mT``)."""
    val = tensor_value(node)
    if val is None:
        return False
    rank = val.dim()
    last = {rank - 2, rank - 1}
    if TRANSPOSE(node):
        dims = (arg(node, 1, "dim0"), arg(node, 2, "dim1"))
        return all(isinstance(d, int) for d in dims) and {d % rank for d in dims} == last
    if PERMUTE(node):
        dims = node.args[1:] if len(node.args) > 2 else arg(node, 1, "dims")
        if not isinstance(dims, (list, tuple)) or not all(isinstance(d, int) for d in dims):
            return False
        dims = [d % rank for d in dims]
        return dims == [*range(rank - 2), rank - 1, rank - 2]
    if node.op == "call_function" and node.target is getattr:
        return node.args[1] == "mT" or (node.args[1] == "T" and rank == 2)
    return False


def requires_grad(node: Any) -> bool:
    """Whether ``node``'s example tensor requires grad."""
    val = tensor_value(node)
    return bool(val is not None and val.requires_grad)


def grad_refusal(output: fx.Node, inputs: dict[str, Any]) -> str | None:
    """Why an attention whose result is ``output`` cannot be served for gradients, or None.

    Only a result that requires grad is refused: the graph was traced with grad mode on and
    some input (named by the keys of ``inputs``; a value is a node or a list of nodes)
    requires grad. Under ``torch.no_grad()`` or ``torch.inference_mode()`` a parameter used
    directly as K/V still requires grad itself, but no gradient will flow through the
    attention, so it is served."""
    if not requires_grad(output):
        return None
    names = [name for name, nodes in inputs.items()
             if any(map(requires_grad, nodes if isinstance(nodes, (list, tuple)) else [nodes]))]
    names = names or ["an input"]
    verb = "requires" if len(names) == 1 else "require"
    return (f"{', '.join(names)} {verb} grad with grad mode on (training through qattn is "
            "not served; run inference under torch.no_grad() or torch.inference_mode())")


def line_of(node: fx.Node) -> str | None:
    """``file.py:line`` of the user code that produced ``node`` (the innermost frame of
    dynamo's stack trace; the file's base name), or ``None``."""
    found = re.findall(r'File "([^"]+)", line (\d+)', node.meta.get("stack_trace") or "")
    if not found:
        return None
    path, line = found[-1]
    return f"{os.path.basename(path)}:{line}"


def describe(node: fx.Node) -> str:
    """What ``node`` is, in the user's terms for messages: the op as the model's code calls
    it and where (``masked_fill`` at ``model.py:120``). Never the FX node's name, which
    the user never wrote."""
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    line = line_of(node)
    return f"`{target}` ({line})" if line else f"`{target}`"


_AUGMENTED = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift",
              "matmul")
_IN_PLACE_FUNCTIONS = frozenset({operator.setitem, *(getattr(operator, f"i{op}") for op in _AUGMENTED)})
_IN_PLACE_METHODS = frozenset({"__setitem__", *(f"__i{op}__" for op in _AUGMENTED)})


def mutates(node: fx.Node) -> bool:
    """Whether ``node`` changes a tensor in place: ``x[i] = v``, ``x &= m`` (``operator.iand``
    or ``x.__iand__(m)``), ``x.masked_fill_(...)`` or ``torch.Tensor.add_(x, ...)``, a
    ``torch`` function ending in ``_``, or any call given an ``out=`` tensor. A dynamo graph
    is not functionalized, so such a node may be unused while later nodes read what it changed."""
    if node.op not in ("call_function", "call_method"):
        return False
    if node.kwargs.get("out") is not None:
        return True
    if node.op == "call_method":
        return node.target in _IN_PLACE_METHODS or _in_place_name(node.target)
    if node.target in _IN_PLACE_FUNCTIONS:
        return True
    name = getattr(node.target, "__name__", "")
    return _in_place_name(name) and getattr(operator, name, None) is not node.target  # not operator.and_


def _in_place_name(name: str) -> bool:
    """``add_``, ``masked_fill_``: torch's names of in-place variants (not dunders)."""
    return name.endswith("_") and not name.endswith("__")
