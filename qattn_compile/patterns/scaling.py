"""Softmax scale factors: constants folded into the op's ``scale``, run-time values into q.

A factor multiplies (or divides) the attention scores. Constant factors (Python numbers,
``torch.full([], c)``) multiply into one float. Run-time factors — ``.item()`` of a module
attribute (how dynamo traces float attributes under ``dynamic=True``), a SymFloat such as
``sqrt(q.size(-1))``, a 0-d tensor, or a tensor constant along the key axis (a per-head
temperature ``[H, 1, 1]``) — are exact when multiplied into q instead:
``(q·f)·kᵀ = f·(q·kᵀ)`` whenever ``f`` does not vary along the key axis.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import fx

from .nodes import broadcasts_into, constant, describe, example_value, is_one


@dataclass(frozen=True)
class Factor:
    """Scores are multiplied by ``value`` (divided by it with ``divide``).

    ``value`` is a float, or a node producing a SymInt/SymFloat or a tensor whose last dim
    is 1 and that broadcasts into the scores (so it also broadcasts into q).
    """

    value: float | fx.Node
    divide: bool = False

    @property
    def number(self) -> float | None:
        """The multiplier when ``value`` is a constant, else ``None``."""
        if isinstance(self.value, fx.Node):
            return None
        return 1.0 / self.value if self.divide else self.value


def as_factor(value, divide: bool, scores_shape: Sequence) -> Factor | str:
    """``value`` (the other operand of a ``mul``/``div`` on the scores) as a :class:`Factor`,
    or the reason it is not a scale."""
    number = constant(value)
    if number is not None:
        if divide and number == 0:
            return "scores are divided by 0"
        return Factor(number, divide)
    val = example_value(value)
    if isinstance(val, (torch.SymInt, torch.SymFloat, int, float)) and not isinstance(val, bool):
        return Factor(value, divide)
    if isinstance(val, torch.Tensor):
        shape = tuple(val.shape)
        if val.dim() == 0 or (is_one(shape[-1]) and broadcasts_into(shape, scores_shape)):
            return Factor(value, divide)
        return f"scores are scaled by a tensor of shape {list(shape)} that varies along the key axis"
    shown = describe(value) if isinstance(value, fx.Node) else repr(value)
    return f"scores are scaled by {shown}, which is neither a number nor a tensor"


def constant_scale(factors: Iterable[Factor]) -> float:
    """The product of the constant factors (1.0 when there are none)."""
    return float(math.prod(f.number for f in factors if f.number is not None))


def runtime_factors(factors: Iterable[Factor]) -> tuple[Factor, ...]:
    """The factors only known at run time, in order."""
    return tuple(f for f in factors if f.number is None)
