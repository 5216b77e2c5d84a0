"""What a site finder knows about one attention site in an FX graph."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import fx


@dataclass
class AttentionSite:
    """One attention computation found in a dynamo graph.

    ``q``/``k``/``v`` are the nodes that feed the rewritten op: q ``[B, Hq, Lq, D]``,
    k/v ``[B, Hkv, Lkv, D|Dv]`` (un-repeated when GQA was recovered). ``anchor`` is the node
    whose value is the attention output; the rewrite replaces its uses. ``refusal`` is set
    when the finder recognised attention but it cannot be rewritten (and says why).
    """

    pattern: str
    anchor: fx.Node
    q: fx.Node
    k: fx.Node
    v: fx.Node
    attn_mask: fx.Node | None = None
    is_causal: bool = False
    scale: float | None = None
    dropout_p: float = 0.0
    mask_kind: str = "none"
    fqn: str = ""
    module_class: str | None = None
    source: str | None = None
    refusal: str | None = None
    chain: list[fx.Node] = field(default_factory=list)

    @property
    def gqa_group(self) -> int | None:
        hq, hkv = _dim(self.q, -3), _dim(self.k, -3)
        if isinstance(hq, int) and isinstance(hkv, int) and hkv and hq % hkv == 0:
            return hq // hkv
        return None

    def shapes(self) -> dict[str, list]:
        return {name: _shape(node) for name, node in (("q", self.q), ("k", self.k), ("v", self.v))}

    def example(self, name: str):
        return example_value(getattr(self, name))


def example_value(node: fx.Node):
    """The fake tensor dynamo recorded for ``node`` (``None`` if there is none)."""
    if not isinstance(node, fx.Node):
        return None
    return node.meta.get("example_value", node.meta.get("val"))


def _shape(node: fx.Node) -> list:
    val = example_value(node)
    if not isinstance(val, torch.Tensor):
        return []
    return [int(s) if isinstance(s, int) else str(s) for s in val.shape]


def _dim(node: fx.Node, i: int):
    shape = _shape(node)
    return shape[i] if len(shape) >= abs(i) else None


_DYNAMO_ROOT = re.compile(r"^L\['self'\]\.?")
_MODULES_ITEM = re.compile(r"\._modules\['([^']+)'\]")


def clean_fqn(dynamo_path: str) -> str:
    """``L['self'].model.layers.0.self_attn`` -> ``model.layers.0.self_attn``."""
    path = _MODULES_ITEM.sub(r".\1", dynamo_path)
    path = _DYNAMO_ROOT.sub("", path)
    return path.replace("L['self']", "").lstrip(".")


def module_of(node: fx.Node) -> tuple[str, str | None]:
    """(FQN, class name) of the innermost module that produced ``node``."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "", None
    path, cls = list(stack.values())[-1]
    name = cls if isinstance(cls, str) else getattr(cls, "__name__", str(cls))
    return clean_fqn(path), name.rsplit(".", 1)[-1]


def source_of(node: fx.Node) -> str | None:
    """``file:line`` of the user code that produced ``node`` (from dynamo's stack trace)."""
    trace = node.meta.get("stack_trace") or ""
    found = re.findall(r'File "([^"]+)", line (\d+)', trace)
    if not found:
        return None
    path, line = found[-1]
    return f"{path}:{line}"
