"""``attn_implementation="qattn"`` for Hugging Face transformers models, without compiling.

::

    from qattn_compile.integrations.transformers import apply_policy

    model = AutoModelForCausalLM.from_pretrained(...).eval()
    qattn = apply_policy(model, "policy.yaml")   # names the sites, sets attn_implementation
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=32)
    print(qattn.site_reports)

transformers hands an attention function the attention module, not its name. The policy
decides by name, so :func:`apply_policy` records the ``model.named_modules()`` name of every
module of ``model`` (the names the compile backend gives the same model's sites) and then
calls ``model.set_attn_implementation("qattn")``. Loading with
``from_pretrained(..., attn_implementation="qattn")`` (after importing this module, which
registers the name) works too, but the model's first forward raises
:class:`~qattn_compile.errors.PolicyNotAppliedError` until :func:`apply_policy` has run.

Each call is served as transformers' ``sdpa`` implementation would run it
(``transformers.integrations.sdpa_attention.sdpa_attention_forward``): the same causal rule
(``is_causal`` only for several queries and no mask), the mask transformers builds for
``sdpa`` (bool, carrying padding and sliding windows; ``None`` when causality alone
suffices), a T5-style ``position_bias`` folded into an additive mask. K/V arrive with their
own (fewer) heads and are never repeated (GQA). Sites the policy leaves alone, and calls
qattn cannot serve (training: dropout or gradients), run ``sdpa_attention_forward`` itself;
the reason is logged and reported.

Under ``torch.compile`` (``torch.compile(model)``, or ``generate``'s compiled decode steps
with a static cache on a GPU) the function runs transformers' ``sdpa`` attention, and a
warning says so once: ``backend="qattn"`` then applies its policy (its rewrite finds that
SDPA call, under the same site name), any other backend leaves the attention exact.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .. import _compat
from ..errors import PolicyNotAppliedError
from ..policy import DEFAULT_POLICY_PATH, Policy, load_policy
from .sites import EagerSites, SdpaCall, SitesView, claimed, warn_compiled

ATTN_IMPLEMENTATION = "qattn"
"""The name to give ``attn_implementation`` / ``set_attn_implementation``."""
ENTRY = f'attn_implementation="{ATTN_IMPLEMENTATION}"'

_BINDINGS: weakref.WeakKeyDictionary[torch.nn.Module, tuple[str, EagerSites]] = weakref.WeakKeyDictionary()
"""Every module of a model given to :func:`apply_policy`: its FQN there and the policy."""


class AppliedPolicy(SitesView):
    """What :func:`apply_policy` returns: the policy's reports for one model.

    ``site_reports``: one :class:`~qattn_compile.report.SiteReport` per attention site and
    outcome, as sites run; ``unmatched_rules()``: rules that matched no site run so far;
    ``remove()``: forget the names and restore the previous attention implementations.
    """

    def __init__(self, root: torch.nn.Module, sites: EagerSites, previous: list[tuple[Any, str]]):
        self.model, self.sites, self._previous = root, sites, previous

    def remove(self) -> None:
        for module in self.model.modules():
            if _BINDINGS.get(module, (None, None))[1] is self.sites:
                del _BINDINGS[module]
        for model, previous in self._previous:
            if model.config._attn_implementation == ATTN_IMPLEMENTATION:
                model.set_attn_implementation(previous)


def _transformers_models(root: torch.nn.Module) -> list:
    """``root`` if it is a transformers model, else the outermost ones inside it."""
    from transformers import PreTrainedModel

    found, pending = [], [root]
    while pending:
        module = pending.pop(0)
        if isinstance(module, PreTrainedModel):
            found.append(module)
        else:
            pending.extend(module.children())
    return found


def apply_policy(model: torch.nn.Module,
                 policy: Policy | str | os.PathLike | Mapping[str, Any] | None = None, *,
                 set_attn_implementation: bool = True) -> AppliedPolicy:
    """Apply ``policy`` to ``model``'s attention through ``attn_implementation="qattn"``.

    Args:
        model: a transformers ``PreTrainedModel`` whose attention goes through
            ``AttentionInterface``, or any module holding such models (a
            ``SentenceTransformer``); a ``torch.compile`` wrapper is unwrapped. Its
            ``named_modules()`` names are the site names, as when ``model`` is compiled.
        policy: a policy file path, YAML text, dict or :class:`~qattn_compile.Policy`
            (default: the bundled policy, ``sage2_8b`` on every site, as the backend's).
        set_attn_implementation: call ``set_attn_implementation("qattn")`` on the
            transformers models (False when they were loaded with
            ``attn_implementation="qattn"``, or for a per-sub-model dict set by the caller).

    Applying again (the same or another policy) replaces the names and policy.
    Raises ``ValueError`` when ``model`` holds no transformers model, or one that does not
    run transformers' ``sdpa`` attention.
    """
    register()
    root = getattr(model, "_orig_mod", model)
    models = _transformers_models(root)
    if not models:
        raise ValueError(f"{type(root).__name__} is not and holds no transformers model; for any "
                         "model use qattn_compile.policy_scope(model, policy)")
    for found in models:
        if not getattr(found, "_supports_sdpa", False):
            raise ValueError(
                f"{type(found).__name__} does not support attn_implementation=\"sdpa\", which "
                "attn_implementation=\"qattn\" serves; use torch.compile(model, backend=\"qattn\") "
                "or qattn_compile.policy_scope(model, policy)")
    sites = EagerSites(load_policy(DEFAULT_POLICY_PATH if policy is None else policy), ENTRY)
    for fqn, module in root.named_modules():
        _BINDINGS[module] = (fqn, sites)
    previous = [(found, found.config._attn_implementation) for found in models
                if set_attn_implementation and found.config._attn_implementation != ATTN_IMPLEMENTATION]
    for found, _ in previous:
        found.set_attn_implementation(ATTN_IMPLEMENTATION)
    return AppliedPolicy(root, sites, previous)


def qattn_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """The ``qattn`` attention implementation (transformers' attention-interface signature).

    query ``[B, Hq, Lq, D]``, key/value ``[B, Hkv, Lkv, D]`` (``Hq % Hkv == 0``),
    attention_mask ``None``, bool (True = attend) or additive, broadcastable to
    ``[B, Hq, Lq, Lkv]``. Returns ``([B, Lq, Hq, Dv], None)`` as ``sdpa_attention_forward``.
    """
    from transformers.integrations.sdpa_attention import create_position_bias_mask, sdpa_attention_forward

    if torch.compiler.is_compiling():  # traced (generate's auto-compile, torch.compile(model))
        _compat.while_tracing(warn_compiled)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    binding = _BINDINGS.get(module)
    if binding is None:
        raise PolicyNotAppliedError(
            f"{type(module).__name__} runs with attn_implementation=\"qattn\" but no qattn policy "
            "names it: call qattn_compile.integrations.transformers.apply_policy(model, policy) "
            "on the model after loading it (the policy decides by the names of "
            "model.named_modules())")
    fqn, sites = binding

    def original() -> tuple[Tensor, None]:
        with claimed():
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, is_causal=is_causal, **kwargs)

    if kwargs.get("softcap") is not None:
        return original()  # raises sdpa's error for the option it does not support either
    q_len = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(q_len > 1 and attention_mask is None and causal)
    k, v, mask = key, value, attention_mask
    position_bias = kwargs.get("position_bias")
    if causal and k.shape[2] > q_len:  # a static cache's prefill: later slots are never seen
        k, v = k[:, :, :q_len], v[:, :, :q_len]
        if position_bias is not None:
            position_bias = position_bias[..., :q_len]
    if position_bias is not None:
        mask = create_position_bias_mask(position_bias, mask, causal, query, k)
        causal = False
    call = SdpaCall(query, k, v, mask, dropout, causal, scaling, enable_gqa=query.shape[1] != k.shape[1])
    out = sites.serve(fqn, type(module).__name__, call)
    if out is None:
        return original()
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register ``qattn`` with transformers' attention and mask interfaces (idempotent);
    importing this module does it. The masks are ``sdpa``'s."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, qattn_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


register()
