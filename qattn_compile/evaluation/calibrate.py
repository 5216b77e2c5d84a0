"""Static scales for ``fmha_int8`` and TurboAttention head priorities (``qattn calibrate``).

A full-precision run (nothing rewritten) is captured on the calibration inputs and, per
attention site, records:

- ``q``, ``k``, ``v``: α = max |x| over every calibration call, token and channel, one per
  head (``q``: query heads, ``k``/``v``: kv heads) — the static counterpart of the dynamic
  α = amax per (batch, head). ``fmha_int8`` then quantizes with α/127 and saturates beyond.
- ``o``: α_o = max |O| per query head of the site's full-precision output (for
  ``quantize_output``).
- ``priority``: TurboAttention's head-wise priority for KV-cache compression, per kv head,
  for K and V: over the valid (not padding-masked) tokens of every call, the per-channel gap
  ``g_c = max_t x[t, c] − min_t x[t, c]``; the head's ``gap`` = max − min over all its tokens
  and channels; ``priority = gap × std_c(g_c)`` (population std). ``kv`` = priority_k ×
  priority_v (as the KV cache ranks heads, :mod:`qattn_compile.kvcache.priority`); ``order``
  lists kv heads from the highest combined priority (keep at higher precision) to the lowest
  (compress first).

The payload is written as the scales file of :mod:`qattn_compile.scales` (its format), which
a policy names with ``preset: fmha_int8`` and ``options: {scales: static, calibration:
scales.pt}``; the rewrite fills each site's α into its options from there.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import torch

from ..errors import QattnError
from ..report import FALLBACK
from ..scales import FORMAT, VERSION

if TYPE_CHECKING:  # annotations only: the capture imports the backend
    from .capture import CaptureResult, SiteRecord

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- recording


def _valid_keys(mask: torch.Tensor | None, batch: int, lkv: int, device) -> torch.Tensor:
    """Bool ``[B, Lkv]``: keys some query may attend to (padding keys are False)."""
    if mask is None:
        return torch.ones(batch, lkv, dtype=torch.bool, device=device)
    m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    visible = m if m.dtype == torch.bool else m > -math.inf
    visible = visible.any(dim=1).any(dim=1)  # [B|1, Lkv]
    return visible.expand(batch, lkv)


def _channel_range(x: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (head, channel) max and min over valid tokens of ``x`` ``[B, H, L, D]``."""
    keep = valid[:, None, :, None]
    xf = x.float()
    hi = torch.where(keep, xf, -math.inf).amax(dim=(0, 2))
    lo = torch.where(keep, xf, math.inf).amin(dim=(0, 2))
    return hi, lo


def head_priority(hi: torch.Tensor, lo: torch.Tensor) -> dict[str, torch.Tensor]:
    """TurboAttention priority per head from per-channel max/min ``[H, D]``.

    ``gap`` = max over channels of ``hi`` − min over channels of ``lo`` (the head's range),
    ``std`` = population std of the channel gaps ``hi − lo``; ``priority = gap × std``.
    """
    gaps = hi - lo
    gap = hi.amax(dim=-1) - lo.amin(dim=-1)
    std = gaps.std(dim=-1, unbiased=False)
    return {"gap": gap, "std": std, "priority": gap * std}


def site_scales(record: SiteRecord) -> dict[str, Any]:
    """The calibration entry of one site (module docstring) from its recorded calls."""
    if not record.calls:
        raise QattnError(f"site {record.key} was never executed during calibration")
    amax = {n: None for n in "qkvo"}
    ranges: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for call in record.calls:
        for name, t in (("q", call.q), ("k", call.k), ("v", call.v), ("o", call.out)):
            a = t.float().nan_to_num().abs().amax(dim=(0, 2, 3))
            amax[name] = a if amax[name] is None else torch.maximum(amax[name], a)
        valid = _valid_keys(call.attn_mask, call.k.shape[0], call.k.shape[2], call.k.device)
        for name, t in (("k", call.k), ("v", call.v)):
            hi, lo = _channel_range(t, valid)
            if name in ranges:
                hi, lo = torch.maximum(ranges[name][0], hi), torch.minimum(ranges[name][1], lo)
            ranges[name] = (hi, lo)
    pk, pv = head_priority(*ranges["k"]), head_priority(*ranges["v"])
    combined = pk["priority"] * pv["priority"]  # the cache's ranking (kvcache.priority)
    first = record.calls[0]
    cpu = lambda t: [float(x) for x in t.detach().to("cpu", torch.float64).tolist()]  # noqa: E731
    return {
        "fqn": record.fqn, "module_class": record.module_class,
        "heads": int(first.q.shape[1]), "kv_heads": int(first.k.shape[1]),
        "head_dim": int(first.q.shape[-1]), "calls": len(record.calls),
        **{n: cpu(amax[n]) for n in "qkvo"},
        "priority": {
            "k": cpu(pk["priority"]), "v": cpu(pv["priority"]), "kv": cpu(combined),
            "k_gap": cpu(pk["gap"]), "k_std": cpu(pk["std"]),
            "v_gap": cpu(pv["gap"]), "v_std": cpu(pv["std"]),
            "order": [int(i) for i in torch.argsort(combined.cpu(), descending=True).tolist()],
        },
    }


def calibrate_capture(cap: CaptureResult, *, model: str = "", inputs: str = "", samples: int = 0) -> dict:
    """The scales payload (module docstring) of a full-precision capture. A site the capture
    could not rewrite (it fell back: no op, no inputs recorded) gets no entry, with a
    warning: a policy cannot rewrite it either."""
    sites = {}
    for rec in cap.sites:
        if rec.calls or rec.report is None or rec.report.status != FALLBACK:
            sites[rec.key] = site_scales(rec)
        else:
            logger.warning("calibration: site %s falls back (%s): no scales recorded",
                           rec.key, rec.report.reason)
    return {
        "format": FORMAT, "version": VERSION, "model": model, "inputs": inputs,
        "samples": samples, "method": "amax", "sites": sites,
    }


# --------------------------------------------------------------------------- text


def format_scales(payload: dict) -> str:
    """One line per site: α ranges over heads and the head priority order."""
    rows = []
    width = max([len(k) for k in payload["sites"]] + [4])
    head = (f"{'site':<{width}}  {'heads':>5}  {'α_q (min..max)':>16}  {'α_k':>16}  "
            f"{'α_v':>16}  {'α_o':>16}  kv heads by priority (high -> low)")
    rows.append(head)
    rows.append("-" * len(head))

    def rng(t):
        return f"{min(t):7.3f}..{max(t):<7.3f}"

    for key, e in payload["sites"].items():
        order = list(e["priority"]["order"])
        shown = " ".join(str(i) for i in order[:8]) + (" ..." if len(order) > 8 else "")
        rows.append(f"{key:<{width}}  {e['heads']:>2}/{e['kv_heads']:<2}  {rng(e['q']):>16}  "
                    f"{rng(e['k']):>16}  {rng(e['v']):>16}  {rng(e['o']):>16}  {shown}")
    return "\n".join(rows)
