"""What the eager entry points share: a policy's decision per attention site, and one SDPA
call served by qattn's kernels or left to the original attention with a reported reason.

A site is named as the compile backend names it: the ``named_modules()`` FQN of the module
whose forward made the call (the model the user passed is the root) and that module's class
name. :class:`EagerSites` asks :meth:`Policy.decide <qattn_compile.policy.Policy.decide>`
once per site, fills a static ``fmha_int8`` site's calibrated scales as the rewrite does
(:func:`~qattn_compile.evaluation.calibrate.options_for_site`, keyed ``fqn``, ``fqn#1``... for
a module's later calls in one forward), and keeps one
:class:`~qattn_compile.report.SiteReport` per site and outcome.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import sys
import threading
from typing import Any

import torch
from torch import Tensor

from .. import functional, ops
from ..errors import UnsupportedSiteError
from ..policy import Decision, Policy
from ..report import FALLBACK, LEFT_ALONE, REWRITTEN, SiteReport
from ..scales import options_for_site

log = logging.getLogger("qattn_compile.integrations")

_OWN_CODE = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                  for m in (sys.modules["qattn_compile"], torch))
"""Where the frames between a model's attention call and :meth:`EagerSites.serve` live."""

_claimed = threading.local()


@contextlib.contextmanager
def claimed():
    """Mark the attention running inside as decided: an SDPA call made within (the original
    attention of a site left alone or falling back, or one inside qattn's own code) is not
    decided again by an enclosing :func:`~qattn_compile.integrations.eager.policy_scope`."""
    depth = getattr(_claimed, "depth", 0)
    _claimed.depth = depth + 1
    try:
        yield
    finally:
        _claimed.depth = depth


def is_claimed() -> bool:
    """Whether this thread runs inside :func:`claimed`."""
    return getattr(_claimed, "depth", 0) > 0


@dataclasses.dataclass(frozen=True)
class SdpaCall:
    """The arguments of one ``F.scaled_dot_product_attention`` call (its layouts: query
    ``[..., Hq, Lq, D]``, key ``[..., Hkv, Lkv, D]``, value ``[..., Hkv, Lkv, Dv]``)."""

    query: Tensor
    key: Tensor
    value: Tensor
    attn_mask: Tensor | None = None
    dropout_p: float = 0.0
    is_causal: bool = False
    scale: float | None = None
    enable_gqa: bool = False

    def refusal(self) -> str | None:
        """Why qattn does not serve this call (the original attention runs), or None.

        Inputs SDPA itself rejects are refused too: the original call then raises SDPA's
        own error."""
        q, k, v, mask = self.query, self.key, self.value, self.attn_mask
        if not all(isinstance(t, Tensor) for t in (q, k, v)) or (
                mask is not None and not isinstance(mask, Tensor)):
            return "query/key/value/attn_mask are not all tensors"
        if self.dropout_p:
            return f"dropout_p={self.dropout_p} (dropout in training is not served)"
        if not (q.dim() == k.dim() == v.dim() and q.dim() >= 3):
            return f"ranks {q.dim()}, {k.dim()}, {v.dim()} (query/key/value [..., H, L, D] of one rank are served)"
        if q.shape[-3] != k.shape[-3] and not self.enable_gqa:
            return "query and key/value head counts differ without enable_gqa"
        if mask is not None and (mask.dim() > q.dim() or not (
                mask.dtype == torch.bool or mask.dtype.is_floating_point)):
            return f"attn_mask of shape {tuple(mask.shape)} and dtype {mask.dtype}"
        if torch.is_grad_enabled():
            names = [n for n, t in (("query", q), ("key", k), ("value", v), ("attn_mask", mask))
                     if t is not None and t.requires_grad]
            if names:
                verb = "requires" if len(names) == 1 else "require"
                return (f"{', '.join(names)} {verb} grad with grad mode on (training through "
                        "qattn is not served; run inference under torch.no_grad() or "
                        "torch.inference_mode())")
        return None

    def op_shapes(self) -> tuple[tuple[int, ...], ...]:
        """q, k, v shapes as the op takes them: leading dims folded into one batch dim."""
        return tuple((math.prod(t.shape[:-3]), *t.shape[-3:])
                     for t in (self.query, self.key, self.value))

    def mask_kind(self) -> str:
        """The report's name for the mask (``causal``, ``padding``, ``bool``, ``additive``,
        joined with ``+``; ``none``)."""
        kinds = ["causal"] if self.is_causal else []
        mask = self.attn_mask
        if mask is not None:
            if mask.dtype != torch.bool:
                kinds.append("additive")
            elif mask.dim() >= 2 and mask.shape[-2] == 1:
                kinds.append("padding")
            else:
                kinds.append("bool")
        return "+".join(kinds) or "none"


_WARNED_COMPILED: list[bool] = []


def warn_compiled(_context) -> None:
    """Run (through :func:`qattn_compile._compat.while_tracing`) when dynamo traces an
    attention call an eager entry point would have served: says once per process that the
    compile backend decides it."""
    if not _WARNED_COMPILED:
        _WARNED_COMPILED.append(True)
        log.warning(
            "qattn: under torch.compile, policy_scope and attn_implementation=\"qattn\" leave "
            "the attention to the compile backend (transformers' sdpa for the latter, "
            "generate's compiled decode steps included): backend=\"qattn\" decides it by its "
            "own policy, any other backend leaves it exact")


class SitesView:
    """What an entry point shows of its :class:`EagerSites` (``self.sites``): the policy, the
    site reports and the rules that matched nothing."""

    sites: EagerSites

    @property
    def policy(self) -> Policy:
        return self.sites.policy

    @property
    def site_reports(self) -> list[SiteReport]:
        return self.sites.site_reports

    def unmatched_rules(self) -> list[str]:
        return self.sites.unmatched_rules()


class EagerSites:
    """A policy applied to attention calls made outside ``torch.compile``.

    ``entry`` names the entry point in log lines and errors (``policy_scope``,
    ``attn_implementation="qattn"``). Thread-safe: decisions and reports are shared, a lock
    guards their first computation.
    """

    def __init__(self, policy: Policy, entry: str):
        self.policy = policy
        self.entry = entry
        self._decisions: dict[tuple[str, str | None, str], tuple[Decision, dict[str, Any]]] = {}
        self._reports: dict[tuple[str, str, str], SiteReport] = {}
        self._lock = threading.Lock()

    # ----------------------------------------------------------------- reports

    @property
    def site_reports(self) -> list[SiteReport]:
        """One report per site and outcome, in the order they first happened (a site served
        at prefill and refused in a training step has two)."""
        return list(self._reports.values())

    def matched_rules(self) -> set[int]:
        return {i for r in self._reports.values() for i in r.matched_rules}

    def unmatched_rules(self) -> list[str]:
        """Rules that matched no site the model has run so far."""
        return self.policy.unmatched_rules(self.matched_rules())

    # ----------------------------------------------------------------- serving

    def decide(self, fqn: str, module_class: str | None, key: str | None = None) -> Decision:
        """The policy's decision for the site ``fqn`` (class ``module_class``), its options
        filled for the site key ``key`` (default ``fqn``); computed once per site."""
        return self._decision(fqn, module_class, key or fqn)[0]

    def _decision(self, fqn: str, module_class: str | None, key: str) -> tuple[Decision, dict]:
        cache_key = (fqn, module_class, key)
        found = self._decisions.get(cache_key)
        if found is None:
            with self._lock:
                decision = self.policy.decide(fqn, module_class)
                options = options_for_site(decision.preset, decision.options, key, self.policy.source)
                decision = dataclasses.replace(decision, options=options)
                found = decision, options.model_dump()
                self._decisions[cache_key] = found
        return found

    def serve(self, fqn: str, module_class: str | None, call: SdpaCall, key: str | None = None) -> Tensor | None:
        """qattn's attention for ``call`` at the site ``fqn``, or None when the original
        attention must run: the policy leaves the site alone, or qattn cannot serve the call
        (logged once per site and reason, and reported). Returns SDPA's layout
        ``[..., Hq, Lq, Dv]`` in the query's dtype.

        Raises :class:`~qattn_compile.errors.UnsupportedSiteError` for a call qattn cannot
        serve when the policy says ``on_unsupported: error``.
        """
        decision, options = self._decision(fqn, module_class, key or fqn)
        if decision.preset == "none":
            self._report(fqn, module_class, call, decision, LEFT_ALONE, decision.reason)
            return None
        why_not = call.refusal() or ops.unsupported_reason(
            *call.op_shapes(), call.query.dtype, call.query.device, decision.preset, decision.options)
        if why_not:
            self._fall_back(fqn, module_class, call, decision, why_not)
            return None
        self._report(fqn, module_class, call, decision, REWRITTEN, decision.reason)
        with claimed():
            return functional.attention(
                call.query, call.key, call.value, call.attn_mask, 0.0, call.is_causal, call.scale,
                call.enable_gqa, preset=decision.preset, **options)

    def _fall_back(self, fqn, module_class, call: SdpaCall, decision: Decision, why_not: str) -> None:
        if self.policy.on_unsupported == "error":
            raise UnsupportedSiteError(
                f"attention site {fqn or '(top level)'} ({module_class}, {self.entry}) chose "
                f"preset {decision.preset!r} by {decision.rule_text} but cannot be served: "
                f"{why_not}. Policy {self.policy.source} says on_unsupported: error; use "
                "`fallback` to keep the original attention there.")
        self._report(fqn, module_class, call, decision, FALLBACK, why_not)

    def _report(self, fqn, module_class, call: SdpaCall, decision: Decision, status: str, reason: str) -> None:
        """Record (and log) the outcome of a call at ``fqn`` the first time it happens."""
        if (fqn, status, reason) in self._reports:
            return
        with self._lock:
            if (fqn, status, reason) in self._reports:
                return
            shapes = {n: list(t.shape) for n, t in (("q", call.query), ("k", call.key), ("v", call.value))
                      if isinstance(t, Tensor)}
            hq, hkv = (shapes[n][-3] if len(shapes.get(n, ())) >= 3 else None for n in ("q", "k"))
            served = status == REWRITTEN
            self._reports[(fqn, status, reason)] = SiteReport(
                fqn=fqn, module_class=module_class, pattern="sdpa", source=_caller_source(),
                shapes=shapes,
                dtype=str(call.query.dtype).replace("torch.", "") if isinstance(call.query, Tensor) else None,
                mask_kind=call.mask_kind(),
                gqa_group=hq // hkv if hq and hkv and hq % hkv == 0 else None,
                preset=decision.preset, options=decision.options.model_dump(),
                rule=decision.rule_text, rule_index=decision.rule_index, status=status, reason=reason,
                execution=ops.execution_path(call.query.device) if served else None,
                causal_fast_path=bool(call.is_causal),
                gqa_source="enable_gqa" if call.enable_gqa and hq != hkv else None,
                matched_rules=decision.matched_rules,
            )
        if status == FALLBACK:
            log.warning("qattn (%s): %s falls back to the original attention: %s", self.entry, fqn, reason)
        elif served:
            log.info("qattn (%s): %s -> %s (%s)", self.entry, fqn, decision.preset, decision.rule_text)
        else:
            log.info("qattn (%s): %s left alone: %s", self.entry, fqn, reason)


def _caller_source() -> str | None:
    """``file:line`` of the innermost frame outside qattn and torch: the model code that
    called the attention (the ``source`` of a site's report, as dynamo's stack trace gives
    it to the compile backend)."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_OWN_CODE):
            return f"{path}:{frame.f_lineno}"
        frame = frame.f_back
    return None
