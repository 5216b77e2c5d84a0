"""Sentences for validation errors: what was given and what is allowed.

The policy (:mod:`qattn_compile.policy`) and the preset options (:mod:`qattn_compile.presets`)
turn each pydantic error into one of these sentences, so that a wrong key or value reads the
same wherever it was written.
"""

from __future__ import annotations

import difflib
import reprlib
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel


SHOWN_CHARS = 60
"""The most characters of a value a message shows."""
SHOWN_PROBLEMS = 5
"""The most problems one error message lists (:func:`join_problems`); the rest are counted."""


class _BoundedRepr(reprlib.Repr):
    """``repr`` that looks at a bounded part of a value: a few levels, items and characters,
    so a huge or deeply nested value (a YAML alias bomb, a policy nested 1000 levels deep)
    costs no more to show than a small one."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxlist, self.maxtuple, self.maxdict = 4, 8, 8, 6
        self.maxset = self.maxfrozenset = self.maxdeque = self.maxarray = 8
        self.maxstring = self.maxother = SHOWN_CHARS

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 4 * SHOWN_CHARS:  # str() of a huge int is slow, or refused
            return f"<an integer of {x.bit_length()} bits>"
        return super().repr_int(x, level)


_REPR = _BoundedRepr()


def short_repr(value: Any, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` cut to ``limit`` characters, in time bounded whatever ``value`` is."""
    text = _REPR.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def join_problems(sentences: Sequence[str], total: int | None = None, sep: str = "; ") -> str:
    """The first :data:`SHOWN_PROBLEMS` of ``sentences`` joined with ``sep``, and how many
    more there are of ``total`` (default ``len(sentences)``): an error with thousands of
    problems stays a paragraph."""
    total = len(sentences) if total is None else total
    text = sep.join(sentences[:SHOWN_PROBLEMS])
    if total > SHOWN_PROBLEMS:
        text += f"{sep}and {total - SHOWN_PROBLEMS} more problem(s) ({total} in all)"
    return text


def describe_value(value: Any) -> str:
    """``a string 'x'``, ``a list [...]``: how messages show a wrong value."""
    if value is None:
        return "nothing (null)"
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string",
             list: "a list", tuple: "a list", dict: "a mapping"}
    return f"{names.get(type(value), type(value).__name__)} {short_repr(value)}"


def problem_sentence(
    error: dict, model: type[BaseModel], field: str, missing_hints: Mapping[str, str] | None = None
) -> str:
    """The sentence for one pydantic error (an item of ``ValidationError.errors()``) of
    ``model``'s key ``field``, saying what is allowed; ``missing_hints`` adds a hint to the
    sentence of a missing key, by key name."""
    kind, value = error["type"], error.get("input")
    if kind == "extra_forbidden":
        allowed = list(model.model_fields)
        if not allowed:
            return f"unknown key `{field}`; no keys are allowed here"
        close = difflib.get_close_matches(str(field), allowed, n=1)
        hint = f" (did you mean `{close[0]}`?)" if close else ""
        return f"unknown key `{field}`{hint}; allowed keys: {', '.join(allowed)}"
    if kind == "missing":
        return f"missing required key `{field}`{(missing_hints or {}).get(field, '')}"
    if kind in ("value_error", "assertion_error"):
        return str(error["ctx"]["error"])
    if kind == "literal_error":
        return f"got {describe_value(value)}; allowed: {error['ctx']['expected']}"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        allowed = ", ".join(model.model_fields)
        return f"must be a mapping, got {describe_value(value)}; allowed keys: {allowed}"
    if kind in ("tuple_type", "list_type"):
        return f"must be a list, got {describe_value(value)}"
    if kind in ("string_type", "str_type"):
        return f"must be a string, got {describe_value(value)}"
    if kind == "float_type":
        return f"must be a number, got {describe_value(value)}"
    if kind in ("int_type", "int_from_float"):
        return f"must be an integer, got {describe_value(value)}"
    if kind == "bool_type":
        return f"must be true or false, got {describe_value(value)}"
    return f"{error['msg']}, got {describe_value(value)}"
