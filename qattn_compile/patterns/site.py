"""What a site finder knows about one attention site in an FX graph, and how it names it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import fx, nn

from .. import _compat
from .masks import MaskSpec
from .nodes import shape_of
from .scaling import Factor

__all__ = ["AttentionSite", "ModuleNames", "clean_fqn", "module_of", "source_of"]


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
    serves: tuple[str, ...] = ()
    """The FQNs of the other modules whose calls run this same compiled code (a block
    compiled on its own is traced once and reused by dynamo for every block of its class):
    the policy must decide them as it decides ``fqn``."""
    softcap: float = 0.0
    """Logit soft-capping's cap (``cap·tanh(S/cap)`` on the scaled scores; 0 = none)."""
    child: tuple[str, str] | None = None
    """``(attribute, class name)`` of the submodule the attention belongs to when the node
    runs in its parent's code (a fused fast-path op of ``nn.TransformerEncoderLayer`` holds
    its ``self_attn``): the site is named for that child."""
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


_ROOT = re.compile(r"^([LG])\['([^']+)'\](?:\[(\d+)\])?\.?")
"""The root of a dynamo module path: a local or global of the traced frame, or one item of a
tuple there (``L['args'][0]``: transformers 5.24 wraps the models' ``forward`` in a
keyword-deprecation wrapper taking ``*args``). Anything after it names the module."""
_GETATTR = re.compile(r"getattr\(([^()]*), '([^']+)'\)")
_SEGMENT = re.compile(r"\.?(\w+)|\[(\d+)\]|\[(['\"])(.*?)\3\]")
_CONTAINERS = frozenset({"__dict__", "_modules"})
"""Path segments that step into a module's child dict rather than name a child: dynamo
records ``L['self'].__dict__['_modules']['blocks']`` for a class that overrides
``__getattr__`` (diffusers' ``ModelMixin``, ``SentenceTransformer``)."""


def clean_fqn(dynamo_path: str) -> str:
    """Module FQN from a dynamo module path, when the module tree is not reachable.

    ``L['self'].model.layers.0.self_attn``, ``L['self'].model.layers[0].self_attn``,
    ``L['self']._modules['model']...``, ``getattr(L['self'].layers, '0')``,
    ``L['self'].__dict__['_modules']['model'].layers.0`` and
    ``L['args'][0].model.layers.0.self_attn`` all give ``model.layers.0.self_attn``-style names.
    """
    path = _unwrap_getattr(dynamo_path)
    path = path[root.end():] if (root := _ROOT.match(path)) else path
    names, pos = [], 0
    while pos < len(path) and (segment := _SEGMENT.match(path, pos)):
        name = next(g for g in (segment.group(1), segment.group(2), segment.group(4)) if g is not None)
        if name not in _CONTAINERS:
            names.append(name)
        pos = segment.end()
    return ".".join(names) + path[pos:]


def _unwrap_getattr(path: str) -> str:
    """``getattr(X, 'name')`` written as ``X.name``, innermost first."""
    while _GETATTR.search(path):
        path = _GETATTR.sub(r"\1.\2", path)
    return path


def _innermost(node: fx.Node) -> tuple[str, str, type | str] | None:
    """(key, dynamo path, class) of the innermost ``nn_module_stack`` entry of ``node``."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return None
    key, (path, cls) = list(stack.items())[-1]
    return key, path, cls


def _class_name(cls: type | str) -> str:
    name = cls if isinstance(cls, str) else getattr(cls, "__name__", str(cls))
    return name.rsplit(".", 1)[-1]


def module_of(node: fx.Node) -> tuple[str, str | None]:
    """(FQN, class name) of the innermost module that produced ``node``, from dynamo's
    recorded path alone (:class:`ModuleNames` resolves it against the module tree)."""
    entry = _innermost(node)
    if entry is None:
        return "", None
    _, path, cls = entry
    return clean_fqn(path), _class_name(cls)


class ModuleNames:
    """Names the module of each graph node as ``named_modules()`` names it.

    When dynamo inlines modules (torch's default), it keys each ``nn_module_stack`` entry by
    ``id(module)`` (``"<id>@<n>"`` for the module's later calls), and writes the module's
    path from a local or global of the traced frame (``L['self'].layers[0].attn``). The
    module is looked up by identity in, first, ``model`` (the backend's ``model`` option:
    the whole model, when blocks are compiled on their own; else the compiled module), then
    the frame's module the path starts from (``L['self']``). Only when neither holds it (a
    module dynamo keeps specialised, a tracer whose frame is not reachable) does the name
    come from the path (:func:`clean_fqn`).

    ``scope`` is the traced frame's ``(f_locals, f_globals)``. When that frame's module sits
    inside ``model`` (a block compiled on its own, or a block's frame that a graph break
    made its own), dynamo reuses the graph for every other module of ``model`` of its class
    that passes the graph's guards: their names are the site's :attr:`AttentionSite.serves`.
    """

    def __init__(self, model: nn.Module | None = None, scope: tuple[dict, dict] | None = None):
        self.model, self.scope = model, scope
        self._trees: dict[int, tuple[nn.Module, dict[int, tuple[str, nn.Module]]]] = {}
        self._peers: dict[int, list[str]] = {}

    @classmethod
    def of_traced_frame(cls, model: nn.Module | None = None) -> ModuleNames:
        """Names for the graph dynamo is compiling now (the caller is a backend), in
        ``model``, by default the compiled module (``torch.compile(model)``)."""
        model = _compat.compiled_module() if model is None else model
        return cls(model, _compat.traced_frame_scope())

    def frame_module(self, gm: fx.GraphModule) -> nn.Module | None:
        """The traced frame's module that the module paths of ``gm`` start from (the
        compiled module, or one block of it when compiled on its own), or None."""
        entry = next(filter(None, map(_innermost, gm.graph.nodes)), None)
        return None if entry is None else self._frame_module(_unwrap_getattr(entry[1]))

    def name(self, node: fx.Node) -> tuple[str, str | None, tuple[str, ...]]:
        """(FQN, class name, :attr:`~AttentionSite.serves`) of the innermost module that
        produced ``node``."""
        entry = _innermost(node)
        if entry is None:
            return "", None, ()
        key, path, cls = entry
        path = _unwrap_getattr(path)
        root = self._frame_module(path)
        local = self._find(root, key, cls)
        if self.model is not None and (fqn := self._find(self.model, key, cls)) is not None:
            return fqn, _class_name(cls), self._serves(root, local)
        return (clean_fqn(path) if local is None else local), _class_name(cls), ()

    def _tree(self, root: nn.Module) -> dict[int, tuple[str, nn.Module]]:
        """``named_modules()`` of ``root`` by module id (built once per root)."""
        entry = self._trees.get(id(root))
        if entry is None or entry[0] is not root:
            entry = (root, {id(m): (name, m) for name, m in root.named_modules()})
            self._trees[id(root)] = entry
        return entry[1]

    def _find(self, root: nn.Module | None, key: str, cls) -> str | None:
        """The name in ``root`` of the module a stack entry's ``key`` identifies, or None
        (not there, or the key is not an id: a module dynamo kept specialised)."""
        module_id = key.split("@", 1)[0]
        if root is None or not module_id.isdigit():
            return None
        found = self._tree(root).get(int(module_id))
        if found is None or (isinstance(cls, type) and type(found[1]) is not cls):
            return None
        return found[0]

    def _frame_module(self, path: str) -> nn.Module | None:
        """The module of the traced frame that ``path`` starts from (``L['self']``)."""
        root = _ROOT.match(path)
        if self.scope is None or root is None:
            return None
        where, name, index = root.groups()
        value = self.scope[0 if where == "L" else 1].get(name)
        if index is not None:
            value = value[int(index)] if isinstance(value, (tuple, list)) and int(index) < len(value) else None
        return value if isinstance(value, nn.Module) else None

    def _serves(self, root: nn.Module | None, local: str | None) -> tuple[str, ...]:
        """The names in ``model`` of the module at ``local`` in every other module that may
        run ``root``'s compiled code (``root``: the traced frame's module, when inside
        ``model``): those of its class whose parameters and buffers have the same shapes and
        dtypes (dynamo's guards on them; a block that fails them gets its own graph)."""
        if root is None or local is None or root is self.model:
            return ()
        if id(root) not in self._peers:
            tree, signature = self._tree(self.model), _signature(root)
            self._peers[id(root)] = [] if id(root) not in tree else [
                name for name, m in tree.values()
                if type(m) is type(root) and m is not root and _signature(m) == signature]
        return tuple(f"{name}.{local}" if local else name for name in self._peers[id(root)])


def _signature(module: nn.Module) -> tuple:
    """What dynamo's guards on a module's tensors check: their names, shapes and dtypes."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return tuple((name, tuple(t.shape), t.dtype) for name, t in tensors)


def source_of(node: fx.Node) -> str | None:
    """``file:line`` of the user code that produced ``node`` (from dynamo's stack trace)."""
    trace = node.meta.get("stack_trace") or ""
    found = re.findall(r'File "([^"]+)", line (\d+)', trace)
    if not found:
        return None
    path, line = found[-1]
    return f"{path}:{line}"
