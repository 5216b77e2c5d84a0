"""The static scales file of ``fmha_int8`` (written by ``qattn calibrate``) and how a site's
options are filled from it.

The rewrite calls :func:`options_for_site` for every site right after the policy decides it:
a policy names only the file (``preset: fmha_int8``, ``options: {scales: static,
calibration: scales.pt}``), and the site's α, found under its key (:func:`site_keys`), go
into the options the graph op carries. What the α are and how they are recorded:
:mod:`qattn_compile.evaluation.calibrate`.

File format (``torch.save`` of plain Python data — lists of floats, no tensors, so that it
can be read inside a dynamo backend where tensor creation is faked; read it with
:func:`load_scales` or ``torch.load(path, weights_only=True)``)::

    {"format": "qattn-scales", "version": 1, "model": MODEL_SPEC, "inputs": "...",
     "samples": N, "method": "amax",
     "sites": {KEY: {"fqn": ..., "module_class": ..., "heads": Hq, "kv_heads": Hkv,
                     "head_dim": D, "calls": n,
                     "q": [Hq floats], "k": [Hkv], "v": [Hkv], "o": [Hq],
                     "priority": {"k": [Hkv], "v": [Hkv], "kv": [Hkv],
                                  "k_gap": [Hkv], "k_std": [Hkv], "v_gap": [Hkv], "v_std": [Hkv],
                                  "order": [Hkv ints, highest kv priority first]}}}}
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .errors import PolicyError
from .presets import FmhaInt8Options, PresetOptions, StaticScales

FORMAT = "qattn-scales"
VERSION = 1


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
