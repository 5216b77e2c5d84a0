"""The ``qattn`` dynamo backend.

``torch.compile(model, backend="qattn", options={...})`` calls :func:`qattn_backend` with
each captured FX graph. The graph is rewritten before AOTAutograd (where SDPA is still one
node and every node carries ``nn_module_stack``) and then handed to Inductor, or run as is
with ``compiler: eager``.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import logging
import os
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from . import _compat
from .debug.trace import emit_site_report
from .errors import OptionsError
from .patterns import ModuleNames
from .policy import DEFAULT_POLICY_PATH, Policy, load_policy
from .report import SiteReport, write_report
from .rewrite import rewrite_attention

log = logging.getLogger("qattn_compile.dynamo_backend")

REFERENCE_NOTICE = (
    "qattn: rewritten attention sites run on the CPU reference path (no CUDA device for the "
    "Triton kernels): it is there to check numerics, and it is slower than the original "
    "attention. To keep the original attention, compile without backend=\"qattn\" or with a "
    "policy of `default: none`")
"""Said once per backend, when the first graph with a site on the reference path compiles."""

COMPILERS = ("inductor", "eager")
OPTION_DOCS = {
    "policy": "policy file path, YAML text, dict or Policy (default: the bundled sage2_8b policy)",
    "strict": "true: a rule that matches no site is an error (overrides the policy's `strict`)",
    "report": "path of a JSON file to write the per-site report to",
    "compiler": "inductor (default) or eager (run the rewritten graph without Inductor)",
    "autotune": "true: time the kernel's tile candidates for every rewritten site while compiling "
    "(cached on disk; mode=\"max-autotune\" implies it); false: never; unset: as each policy "
    "rule's options say",
    "mode": "a torch.compile mode for Inductor (reduce-overhead, max-autotune, ...), for when "
    "torch.compile refuses mode= next to options=",
    "model": "the whole model (an nn.Module), when its blocks are compiled on their own "
    "(compile_repeated_blocks, torch.compile per block): sites get their names in it",
}


@dataclass
class BackendOptions:
    """Validated backend options (see :data:`OPTION_DOCS`)."""

    policy: Policy
    report: Path | None = None
    compiler: str = "inductor"
    mode: str | None = None
    autotune: bool | None = None
    """Overrides every rewritten site's ``autotune`` option when not None."""
    model: weakref.ref | None = None
    """The ``model`` option, held weakly (a cached backend must not keep a model alive)."""

    @classmethod
    def parse(cls, options: dict | None) -> "BackendOptions":
        options = dict(options or {})
        unknown = sorted(set(options) - set(OPTION_DOCS))
        if unknown:
            allowed = "; ".join(f"{k}: {v}" for k, v in OPTION_DOCS.items())
            raise OptionsError(f"unknown qattn backend option(s) {unknown}. Allowed: {allowed}")
        compiler = options.get("compiler", "inductor")
        if compiler not in COMPILERS:
            raise OptionsError(f"option `compiler` is {compiler!r}; allowed: {', '.join(COMPILERS)}")
        strict = options.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise OptionsError(f"option `strict` must be true or false, got {strict!r}")
        policy = options.get("policy")
        policy = load_policy(DEFAULT_POLICY_PATH if policy is None else policy)
        if strict is not None:
            policy = policy.with_strict(strict)
        report = options.get("report")
        if report is not None and not isinstance(report, (str, os.PathLike)):
            raise OptionsError(f"option `report` must be a file path, got {report!r}")
        autotune = options.get("autotune")
        if autotune is not None and not isinstance(autotune, bool):
            raise OptionsError(f"option `autotune` must be true or false, got {autotune!r}")
        mode = _parse_mode(options.get("mode"), compiler)
        if autotune is None and (mode or "").startswith("max-autotune"):
            autotune = True
        model = options.get("model")
        if model is not None and not isinstance(model, nn.Module):
            raise OptionsError(f"option `model` must be the model (an nn.Module), got {type(model).__name__}")
        return cls(policy=policy, report=Path(report) if report else None, compiler=compiler,
                   mode=mode, autotune=autotune, model=None if model is None else weakref.ref(model))


def _parse_mode(mode: Any, compiler: str) -> str | None:
    """The ``mode`` option, checked against Inductor's modes."""
    if mode is None:
        return None
    modes = _compat.inductor_modes()
    if not isinstance(mode, str) or mode not in modes:
        raise OptionsError(f"option `mode` is {mode!r}; allowed: {', '.join(modes)}")
    if compiler == "eager" and mode != "default":
        log.warning("qattn: mode %r is ignored with compiler: eager (no Inductor)", mode)
    return mode


class QattnBackend:
    """A dynamo backend callable that keeps the site reports of every graph it compiled.

    Rules that matched no site are warned about (an error with ``strict: true``) after each
    graph while the model has no graph break, i.e. while the graphs seen hold the whole
    model. Once dynamo splits the model at a graph break (or compiles a block of the
    ``model`` option on its own), a later graph may still hold a rule's sites: the check is
    then left to the caller, once the model has run (:meth:`unmatched_rules`, the ``report``
    file, ``qattn explain --strict``), and one warning says so.

    Sites are named as ``named_modules()`` of the ``model`` option names their modules, or
    without it, of the compiled module (``torch.compile(model)``, ``model.compile()``), so
    that a block's frame that dynamo compiles on its own after a graph break still gets the
    block's full name (:class:`~qattn_compile.patterns.ModuleNames`). A module outside that
    tree is named in its own frame's module. A site whose compiled code serves several blocks
    is decided once for all of them, and a :class:`~qattn_compile.errors.PolicyError` says so
    when the policy would decide them differently.
    """

    def __init__(self, policy: Any = None, **options):
        if policy is not None:
            options["policy"] = policy
        self.options = BackendOptions.parse(options)
        self.site_reports: list[SiteReport] = []
        self._graphs = 0
        self._partial = False  # a graph seen held a part of the model only
        self._warned: set[str] = set()  # the unmatched-rule lines already logged
        self.announce_reference = True
        """Say :data:`REFERENCE_NOTICE` (once); tools that run the reference on purpose to
        measure its numerics (``qattn eval``) turn it off."""

    @property
    def policy(self) -> Policy:
        return self.options.policy

    def matched_rules(self) -> set[int]:
        return {i for r in self.site_reports for i in r.matched_rules}

    def unmatched_rules(self) -> list[str]:
        return self.policy.unmatched_rules(self.matched_rules(), self._sites())

    def _sites(self) -> dict[str, str | None]:
        """Each site's FQN and module class (for the closest names an unmatched rule's line
        gives)."""
        return {r.fqn: r.module_class for r in self.site_reports}

    def __call__(self, gm, example_inputs):
        _last[:] = [self]
        names = self._names()
        reports = rewrite_attention(gm, self.policy, graph_index=self._graphs,
                                    autotune=self.options.autotune, names=names)
        self._graphs += 1
        self.site_reports.extend(reports)
        if self.announce_reference and any(r.execution == "reference" for r in reports):
            self.announce_reference = False
            log.warning(REFERENCE_NOTICE)
        emit_site_report(reports, self.unmatched_rules(), self._graphs - 1)
        if self.options.report:
            write_report(self.options.report, self.site_reports, self.unmatched_rules())
        self._check_unmatched(gm, names)
        if self.options.compiler == "eager":
            return gm.forward
        return _compat.compile_with_inductor(
            gm, example_inputs, _compat.inductor_mode_options(self.options.mode),
            cache_key_tag=f"qattn-{package_digest()}",
        )

    def _names(self) -> ModuleNames:
        """How this graph's sites are named (class docstring)."""
        model = self.options.model() if self.options.model is not None else None
        names = ModuleNames.of_traced_frame(model)
        if model is not None and names.scope is None:
            log.warning("qattn: the traced frame is not reachable in this torch: sites are named "
                        "in the `model` option's tree, but which blocks share a compiled graph "
                        "is not known (the policy must decide a block class's blocks alike)")
        return names

    def _check_unmatched(self, gm, names: ModuleNames) -> None:
        """The per-graph unmatched-rule check (class docstring). A graph of one block of
        ``model`` (regional compilation) holds a part of the model, as after a graph break;
        that is said at INFO level unless ``strict`` goes unenforced (the usual way to
        compile regionally, not a surprise)."""
        reason = getattr(gm, "compile_subgraph_reason", None)
        frame, model = names.frame_module(gm), names.model
        level = logging.WARNING
        if getattr(reason, "graph_break", False):
            why = f"the model has a graph break (graph {self._graphs - 1}: {getattr(reason, 'reason', '?')})"
        elif frame is not None and model is not None and frame is not model:
            why = f"graph {self._graphs - 1} holds a part of the model only (a block that runs as a frame of its own)"
            level = logging.WARNING if self.policy.strict else logging.INFO
        else:
            why = None
        if not self._partial and why:
            self._partial = True
            log.log(
                level, "qattn: %s; rules are no longer checked per graph for matching no site%s. "
                "Check once the model has run: qattn_compile.last_backend().unmatched_rules(), "
                "the report file, or `qattn explain --strict`", why,
                " (strict: true is not enforced)" if self.policy.strict else "")
        if not self._partial:  # each rule warned about once, not once per graph
            self._warned.update(self.policy.check_unmatched(self.matched_rules(), self._warned,
                                                            self._sites()))


@functools.lru_cache(maxsize=1)
def package_digest() -> str:
    """The first 16 hex digits of the SHA-256 of every Python source of this package.

    Part of the cache key of every graph the backend hands Inductor. torch's AOTAutograd
    cache keys a graph by its nodes; a rewritten site is one node naming our op, and the
    code behind that op (the lowering, the launchers, the Triton kernels it traces into
    the graph) is not in the key. Without this digest, a graph compiled by one version of
    qattn would be served from the on-disk cache to another (measured on the H100: a
    kernel change invisible to an A/B run until each arm had its own cache directory).
    """
    digest = hashlib.sha256()
    root = Path(__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@dataclass
class _CachedBackend:
    options: dict | None
    """The dict ``torch.compile`` passed, kept alive so its id is not reused; None for a dict
    holding a model (kept alive, it would keep the model alive: its snapshot's weak
    reference tells a later dict at that id apart once the model is gone)."""
    snapshot: dict | None
    """A copy of its contents when the backend was built (modules as weak references)."""
    backend: QattnBackend


_backends: OrderedDict[tuple[int, str | None], _CachedBackend] = OrderedDict()
"""Backends by ``(id(options), mode)``, most recently used last."""
_MAX_BACKENDS = 64
"""Backends kept for reuse; older ones are dropped (a model compiled that long ago gets a new
backend, and a new report, if dynamo compiles another of its graphs)."""
_last: list[QattnBackend] = []


def _comparable(options: dict | None) -> dict | None:
    """``options`` with modules replaced by weak references to them (equal while alive)."""
    if options is None:
        return None
    return {k: weakref.ref(v) if isinstance(v, nn.Module) else v for k, v in options.items()}


def _snapshot(options: dict | None) -> dict | None:
    """A copy of :func:`_comparable` ``options`` to compare later calls with (a shallow one
    when a value cannot be deep-copied)."""
    options = _comparable(options)
    if options is None:
        return None
    try:
        return copy.deepcopy(options)
    except Exception:  # noqa: BLE001 - any value a user may put in options
        return dict(options)


def qattn_backend(gm, example_inputs, options: dict | None = None, mode: str | None = None):
    """Entry point registered as dynamo backend ``qattn``.

    ``torch.compile`` passes the same ``options`` dict object for every graph of one compiled
    model, so the backend instance (and its report) is shared across graph breaks. A dict
    whose contents changed since (one dict reused for another compile) gets a new backend.
    Compiles without options (``torch.compile`` passes None, also whenever ``mode`` is given)
    share one backend per mode: their site reports accumulate in :func:`last_backend`.
    """
    key = (id(options), mode)
    cached = _backends.get(key)
    if cached is None or cached.snapshot != _comparable(options):
        settings = dict(options or {})
        if mode is not None:  # torch.compile(mode=...) without options
            settings["mode"] = mode
        holds_model = any(isinstance(v, nn.Module) for v in settings.values())
        cached = _CachedBackend(None if holds_model else options, _snapshot(options), QattnBackend(**settings))
        _backends[key] = cached
        while len(_backends) > _MAX_BACKENDS:
            _backends.popitem(last=False)
    _backends.move_to_end(key)
    return cached.backend(gm, example_inputs)


def backend(policy: Any = None, **options) -> QattnBackend:
    """A backend callable for ``torch.compile(model, backend=qattn_compile.backend(...))``."""
    return QattnBackend(policy, **options)


def last_backend() -> QattnBackend | None:
    """The backend instance that compiled most recently (its ``site_reports``, ``policy``)."""
    return _last[0] if _last else None
