"""What a site finder knows about one attention site in an FX graph, and how it names it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import fx

from .masks import MaskSpec
from .nodes import shape_of
from .scaling import Factor

__all__ = ["AttentionSite", "clean_fqn", "module_of", "source_of"]


@dataclass
class AttentionSite:
    """One attention computation found in a dynamo graph.

    The rewrite feeds ``torch.ops.qattn.attention`` with:

    - ``q`` ``[B, Hq, Lq, D]``; ``k``/``v`` ``[B, Hkv, Lkv, D|Dv]``, un-repeated when GQA was
      recovered (``gqa_source`` says from what). A node held in another layout comes with
      the permutation that the rewrite applies to it first (``q_dims``, ``k_dims``,
      ``v_dims``; ``None``: none): a pre-transposed key ``[..., D, Lkv]`` that was never
      transposed back, an einsum's operands (``"bqhd,bkhd->bhqk"``). ``out_dims`` permutes
      the op's output ``[B, Hq, Lq, Dv]`` into the anchor's layout. Rank-3 sites
      (``[B·H, L, D]``, e.g. ``bmm`` chains) get a leading batch dim of 1 around the op.
    - ``mask``: the mask terms, combined by the rewrite into one bool or additive mask.
    - ``scale``: the constant part of the softmax scale (``None`` = ``1/sqrt(D)``) and
      ``scale_factors``: run-time factors (``.item()`` of a module attribute, a SymFloat,
      a 0-d or per-row tensor) that the rewrite multiplies into ``q``.

    ``anchor`` is the node whose value is the attention output; the rewrite replaces its
    uses. ``chain`` lists the nodes the match consumed: they are erased once unused.
    ``refusal`` is set when the finder recognised attention that cannot be rewritten (and
    says why).
    """

    pattern: str
    anchor: fx.Node
    q: fx.Node
    k: fx.Node
    v: fx.Node
    mask: MaskSpec = field(default_factory=MaskSpec)
    is_causal: bool = False
    scale: float | None = None
    scale_factors: tuple[Factor, ...] = ()
    q_dims: tuple[int, ...] | None = None
    k_dims: tuple[int, ...] | None = None
    v_dims: tuple[int, ...] | None = None
    out_dims: tuple[int, ...] | None = None
    gqa_source: str | None = None
    mask_kind: str = "none"
    causal_fast_path: bool = False
    fqn: str = ""
    module_class: str | None = None
    source: str | None = None
    refusal: str | None = None
    chain: list[fx.Node] = field(default_factory=list)

    @property
    def gqa_group(self) -> int | None:
        """Query heads per key/value head, when both head counts are static."""
        shapes = self.shapes()
        hq, hkv = (shapes[name][-3] if len(shapes[name]) >= 3 else None for name in ("q", "k"))
        if isinstance(hq, int) and isinstance(hkv, int) and hkv and hq % hkv == 0:
            return hq // hkv
        return None

    def op_shapes(self) -> dict[str, tuple | None]:
        """Shapes of q, k, v as the op receives them (after ``*_dims``; sizes may be symbolic,
        ``None`` without a recorded example value)."""
        return {name: _permuted(shape_of(getattr(self, name)), getattr(self, f"{name}_dims"))
                for name in ("q", "k", "v")}

    def shapes(self) -> dict[str, list]:
        """:meth:`op_shapes` as ints, or strings for symbolic sizes."""
        return {name: [int(s) if isinstance(s, int) else str(s) for s in shape or ()]
                for name, shape in self.op_shapes().items()}


def _permuted(shape: tuple | None, dims: tuple[int, ...] | None) -> tuple | None:
    """``shape`` after ``permute(dims)`` (``None`` dims: unchanged)."""
    if shape is None or dims is None:
        return shape
    return tuple(shape[d] for d in dims)


_DYNAMO_ROOT = re.compile(r"^[LG]\['args'\]\[\d+\]\.?|^[LG]\['[^']+'\]\.?")
"""The root of a dynamo module path: a local or global, or one item of the ``args`` tuple of
a forward reached through a ``*args`` wrapper (``L['args'][0]``: transformers 5.24 wraps the
models' ``forward`` in a keyword-deprecation wrapper). Anything after it names the module."""
_MODULES_ITEM = re.compile(r"\.?_modules\['([^']+)'\]")
_INDEX = re.compile(r"\[(\d+)\]")
_GETATTR = re.compile(r"getattr\(([^()]*), '([^']+)'\)")


def clean_fqn(dynamo_path: str) -> str:
    """Module FQN from a dynamo module path.

    ``L['self'].model.layers.0.self_attn``, ``L['self'].model.layers[0].self_attn``,
    ``L['self']._modules['model']...``, ``getattr(L['self'].layers, '0')`` and
    ``L['args'][0].model.layers.0.self_attn`` all give ``model.layers.0.self_attn``-style names.
    """
    path = dynamo_path
    while _GETATTR.search(path):
        path = _GETATTR.sub(r"\1.\2", path)
    path = _DYNAMO_ROOT.sub("", path)
    path = _MODULES_ITEM.sub(r".\1", path)
    return _INDEX.sub(r".\1", path).lstrip(".")


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
