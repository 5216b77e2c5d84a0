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

File format (``torch.save`` of plain Python data — lists of floats, no tensors, so that it
can be read inside a dynamo backend where tensor creation is faked; read it with
:func:`load_scales` or ``torch.load(path, weights_only=True)``)::

    {"format": "qattn-scales", "version": 1, "model": MODEL_SPEC, "inputs": "...",
     "samples": N, "method": "amax",
     "sites": {FQN: {"fqn": ..., "module_class": ..., "heads": Hq, "kv_heads": Hkv,
                     "head_dim": D, "calls": n,
                     "q": [Hq floats], "k": [Hkv], "v": [Hkv], "o": [Hq],
                     "priority": {"k": [Hkv], "v": [Hkv], "kv": [Hkv],
                                  "k_gap": [Hkv], "k_std": [Hkv], "v_gap": [Hkv], "v_std": [Hkv],
                                  "order": [Hkv ints, highest kv priority first]}}}}

A policy uses it with ``preset: fmha_int8`` and ``options: {scales: static, calibration:
scales.pt}``; :func:`options_for_site` fills the site's α into its options.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import PolicyError, QattnError
from ..presets import FmhaInt8Options, PresetOptions, StaticScales
from ..report import FALLBACK

if TYPE_CHECKING:  # no runtime import: the rewrite imports this module (options_for_site)
    from .capture import CaptureResult, SiteRecord

logger = logging.getLogger(__name__)

FORMAT = "qattn-scales"
VERSION = 1


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


# --------------------------------------------------------------------------- file


def save_scales(payload: dict, path: str | os.PathLike) -> Path:
    path = Path(path)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(payload, path)
    _cache.pop(str(path.resolve()), None)
    return path


_cache: dict[str, tuple[float, dict]] = {}


def load_scales(path: str | os.PathLike) -> dict:
    """Read and check a scales file (cached by path and modification time)."""
    p = Path(path).expanduser()
    try:
        stamp = p.stat().st_mtime
    except OSError:
        raise PolicyError(f"calibration file not found: {p} (write it with `qattn calibrate`)") from None
    key = str(p.resolve())
    hit = _cache.get(key)
    if hit and hit[0] == stamp:
        return hit[1]
    try:
        data = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 (pickle / zip errors of many kinds)
        raise PolicyError(f"calibration file {p} cannot be read: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise PolicyError(f"{p} is not a qattn scales file (write it with `qattn calibrate`)")
    if data.get("version") != VERSION:
        raise PolicyError(f"{p}: scales file version {data.get('version')!r}; this qattn reads {VERSION}")
    _cache[key] = (stamp, data)
    return data


def resolve_calibration_path(calibration: str, policy_source: str | None = None) -> Path:
    """``calibration`` as given, else relative to the policy file's directory."""
    path = Path(calibration).expanduser()
    if path.is_absolute() or path.exists() or not policy_source:
        return path
    base = Path(policy_source).expanduser()
    if base.is_file():
        candidate = base.parent / path
        if candidate.exists():
            return candidate
    return path


def site_keys(fqns: list[str]) -> list[str]:
    """The keys of one graph's attention sites (module FQNs in graph order) in a calibration
    file and a capture: the FQN (``"(top level)"`` when empty), then ``fqn#1``, ``fqn#2``...
    for the later calls of a module whose attention runs more than once in the graph."""
    keys, calls = [], {}
    for fqn in fqns:
        occurrence = calls.get(fqn, 0)
        calls[fqn] = occurrence + 1
        base = fqn or TOP_LEVEL
        keys.append(base if occurrence == 0 else f"{base}#{occurrence}")
    return keys


TOP_LEVEL = "(top level)"
"""The key of a site whose module is the model itself (empty FQN)."""


def options_for_site(
    preset: str, options: PresetOptions, key: str, policy_source: str | None = None
) -> PresetOptions:
    """The options a site's op gets: static ``fmha_int8`` options with the site's α filled in.

    Every other preset, dynamic mode, or options that already carry ``static_scales`` are
    returned unchanged (the same object). Raises :class:`PolicyError` when the calibration
    file is missing, unreadable, or has no entry for ``key`` (the site's key, :func:`site_keys`:
    a module's second attention call in one graph has its own α). The rewrite and the
    capture call this per site (``policy_source``: the policy file, for relative paths).
    """
    if preset != "fmha_int8" or not isinstance(options, FmhaInt8Options):
        return options
    if options.scales != "static" or options.static_scales is not None:
        return options
    path = resolve_calibration_path(options.calibration, policy_source)
    data = load_scales(path)
    key = key or TOP_LEVEL
    entry = data["sites"].get(key)
    if entry is None:
        known = ", ".join(list(data["sites"])[:6])
        raise PolicyError(
            f"calibration file {path} has no scales for attention site {key!r} "
            f"(it has {len(data['sites'])} sites: {known}{', ...' if len(data['sites']) > 6 else ''}); "
            f"run `qattn calibrate` on this model"
        )

    def values(t):  # plain floats: this may run inside dynamo, where tensors are fake
        return tuple(float(x) for x in t)

    scales = StaticScales(q=values(entry["q"]), k=values(entry["k"]), v=values(entry["v"]),
                          o=values(entry["o"]))
    return options.model_copy(update={"static_scales": scales})


def static_options(calibration: str | os.PathLike, quantize_output: bool = False) -> dict:
    """``fmha_int8`` options of static mode reading ``calibration``."""
    return {"scales": "static", "calibration": str(calibration), "quantize_output": quantize_output}


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
