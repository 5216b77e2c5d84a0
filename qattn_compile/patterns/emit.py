"""Insert nodes into a dynamo FX graph the way dynamo would have recorded them.

Each node inserted before an ``anchor`` carries the anchor's module provenance
(``nn_module_stack``, ``stack_trace``: site naming and reports read them) and a fake example
value computed from its arguments' (the site finders and later passes read shapes and
dtypes from ``example_value``).
"""

from __future__ import annotations

import torch.utils._pytree as pytree
from torch import fx

from .nodes import example_value

PROVENANCE = ("nn_module_stack", "stack_trace")


class Emitter:
    """Inserts nodes before ``anchor``, with its provenance and fake example values."""

    def __init__(self, graph: fx.Graph, anchor: fx.Node):
        self.graph, self.anchor = graph, anchor

    def __call__(self, target, *args, method: bool = False, **kwargs) -> fx.Node:
        """A ``call_function`` node of ``target`` (a ``call_method`` node of the method
        named ``target`` with ``method``) on ``args`` and ``kwargs`` (nodes and constants)."""
        with self.graph.inserting_before(self.anchor):
            node = self.graph.create_node("call_method" if method else "call_function", target, args, kwargs)
        node.meta.update({key: self.anchor.meta[key] for key in PROVENANCE if key in self.anchor.meta})
        value = _example(target, args, kwargs, method)
        if value is not None:
            node.meta["example_value"] = value
        return node


def _example(target, args, kwargs, method: bool):
    """``target(*args, **kwargs)`` on the arguments' fake values, in their fake mode (None
    without one). Arguments are flat: nodes and constants."""
    values = [example_value(a) if isinstance(a, fx.Node) else a for a in args]
    named = {k: example_value(a) if isinstance(a, fx.Node) else a for k, a in kwargs.items()}
    leaves = pytree.tree_leaves((values, named))
    mode = next((v.fake_mode for v in leaves if hasattr(v, "fake_mode")), None)
    if mode is None:
        return None
    with mode:
        return getattr(values[0], target)(*values[1:], **named) if method else target(*values, **named)
