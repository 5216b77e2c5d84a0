"""A policy applied to any model without ``torch.compile``, inside a ``with`` block.

::

    with qattn_compile.policy_scope(pipe.transformer, "policy.yaml") as scope:
        image = pipe(prompt).images[0]
    print(scope.site_reports)

Inside the block, every ``F.scaled_dot_product_attention`` call made while a module of
``model`` runs is decided by the policy, by that module's ``model.named_modules()`` name
and class name (the innermost module running, as the compile backend names a site): a
chosen preset runs qattn's kernels (:func:`qattn_compile.attention`; the reference on CPU),
``none`` and calls qattn cannot serve run the original SDPA (the reason logged and reported;
``on_unsupported: error`` raises). SDPA calls made outside ``model`` (a pipeline's text
encoder or VAE when ``model`` is its denoiser) are not touched.

How: forward pre-hooks and forward hooks (``always_call``) on the modules of ``model`` keep
a per-thread stack of the modules running, and a ``TorchFunctionMode`` sees the SDPA calls.
Leaf modules of ``torch.nn`` (``Linear``, ``LayerNorm``, ...) never call SDPA and get no hook.
Leaving the block (also by an exception) removes the hooks and the mode; nothing outside
the block changes (no global patch, no other thread affected). Only SDPA calls are seen:
attention written as ``softmax(q @ k.T) @ v`` is found by the compile backend alone.

A model compiled with ``torch.compile`` runs its SDPA calls inside the scope as compiled
(a warning says so once): ``backend="qattn"`` decides them by its own policy.

Nesting: a scope may be entered again after it was left (reports accumulate), not while it
is active. Scopes on different models (or on one model and its submodule) nest; a call is
decided by the innermost scope whose model is running, and no other scope decides it again.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .. import _compat
from ..policy import DEFAULT_POLICY_PATH, Policy, load_policy
from .sites import EagerSites, SdpaCall, SitesView, claimed, is_claimed, warn_compiled

ENTRY = "policy_scope"
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _hooked(module: torch.nn.Module) -> bool:
    """Whether ``module`` may call SDPA: anything but a leaf module of ``torch.nn``."""
    return next(module.children(), None) is not None or not type(module).__module__.startswith("torch.nn.")


class _Frame:
    """A module running inside the scope: its name, class and SDPA calls so far."""

    __slots__ = ("module", "fqn", "module_class", "calls")

    def __init__(self, module: torch.nn.Module, fqn: str):
        self.module, self.fqn, self.module_class, self.calls = module, fqn, type(module).__name__, 0


class _SdpaMode(TorchFunctionMode):
    """Hands the SDPA calls of the scope's model to the scope; every other call runs as is."""

    def __init__(self, scope: policy_scope):
        super().__init__()
        self.scope = scope

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and not is_claimed():
            if torch.compiler.is_compiling():
                _compat.while_tracing(warn_compiled)
            else:
                out = self.scope._attention(args, kwargs)
                if out is not None:
                    return out
        return func(*args, **kwargs)


class policy_scope(SitesView):  # noqa: N801 - used like a function: `with policy_scope(model, policy):`
    """Apply ``policy`` to the SDPA calls of ``model`` while the ``with`` block runs.

    Args:
        model: the module whose attention the policy decides (its ``named_modules()`` names
            are the site names; a ``torch.compile`` wrapper is unwrapped).
        policy: a policy file path, YAML text, dict or :class:`~qattn_compile.Policy`
            (default: the bundled policy, ``sage2_8b`` on every site, as the backend's).

    The scope object keeps ``site_reports`` (one :class:`~qattn_compile.report.SiteReport`
    per site and outcome) and ``unmatched_rules()``. On leaving the block without an
    exception, rules that matched no site are warned about (a ``PolicyError`` with
    ``strict: true``), as the backend does after a graph.
    """

    def __init__(self, model: torch.nn.Module,
                 policy: Policy | str | os.PathLike | Mapping[str, Any] | None = None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"policy_scope needs a torch.nn.Module, got {type(model).__name__}")
        self.model = getattr(model, "_orig_mod", model)
        self.sites = EagerSites(load_policy(DEFAULT_POLICY_PATH if policy is None else policy), ENTRY)
        self._local = threading.local()
        self._handles: list = []
        self._mode: _SdpaMode | None = None
        self._warned: set[str] = set()

    # ----------------------------------------------------------------- entering, leaving

    def __enter__(self) -> policy_scope:
        if self._mode is not None:
            raise RuntimeError("this policy_scope is already active; leave it before entering it "
                               "again (or make another scope for a nested block)")
        try:
            for fqn, module in self.model.named_modules():
                if _hooked(module):
                    self._handles.append(module.register_forward_pre_hook(self._pre_hook(fqn)))
                    self._handles.append(module.register_forward_hook(self._post_hook(), always_call=True))
            self._mode = _SdpaMode(self)
            self._mode.__enter__()
        except BaseException:
            self._remove_hooks()
            self._mode = None
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        mode, self._mode = self._mode, None
        try:
            mode.__exit__(exc_type, exc, tb)
        finally:
            self._remove_hooks()
            self._local.__dict__.clear()
        if exc_type is None:
            self._warned.update(self.policy.check_unmatched(self.sites.matched_rules(), self._warned))

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ----------------------------------------------------------------- the module stack

    def _stack(self) -> list[_Frame]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _pre_hook(self, fqn: str):
        def push(module, args):
            if not torch.compiler.is_compiling():  # compiled: the backend names the sites
                self._stack().append(_Frame(module, fqn))
        return push

    def _post_hook(self):
        def pop(module, args, output):
            if torch.compiler.is_compiling():
                return
            stack = self._stack()
            while stack:  # down to this module's frame (a frame left by a failed call included)
                if stack.pop().module is module:
                    break
        return pop

    # ----------------------------------------------------------------- SDPA calls

    def _attention(self, args: tuple, kwargs: dict):
        """The output of an SDPA call: qattn's, or the original's (which no enclosing scope
        decides again) where the policy leaves the site alone or qattn cannot serve it.
        None for a call the model did not make (the caller runs it as is)."""
        stack = self._stack()
        if not stack:
            return None  # not made by the model: left to an enclosing scope or SDPA
        frame = stack[-1]
        call = SdpaCall(**dict(zip(_SDPA_ARGS, args)), **kwargs)
        key = frame.fqn if frame.calls == 0 else f"{frame.fqn or '(top level)'}#{frame.calls}"
        frame.calls += 1
        out = self.sites.serve(frame.fqn, frame.module_class, call, key)
        if out is None:
            with claimed():  # the original attention, not decided again by an outer scope
                return F.scaled_dot_product_attention(*args, **kwargs)
        return out
