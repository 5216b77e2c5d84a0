"""The per-site table of ``qattn explain`` and the kernel variant each rewritten site runs."""

from __future__ import annotations

from ..blocks import fp8_group_sizes, group_sizes, int_flash_group_sizes, int_flash_v_group
from ..presets import resolve_options
from ..report import REWRITTEN, SiteReport, format_grid

COLUMNS = ("site (module FQN)", "class", "pattern", "shapes q / k / v", "mask", "GQA", "rule", "preset",
           "kernel variant / why left alone")
EXECUTION_LABELS = {"gluon": "gluon (tier 2)", "triton": "triton", "reference": "reference (CPU)"}
"""How the table names :func:`qattn_compile.ops.execution_path` values."""


def _per(granularity: str, tokens: int) -> str:
    """One scale group as the table prints it: ``token``, ``tensor`` or ``<n>tok``."""
    if granularity == "tensor":
        return "tensor"
    return "token" if tokens == 1 else f"{tokens}tok"


def _q_k_formats(fmt: str, granularity: str, groups: tuple[int, int], k_name: str = "k") -> str:
    """Q's and K's (``k_name``: K's and V's) number format and scale groups (``groups``:
    tokens per scale for Q, K), e.g. ``qk=int8/token`` or ``q=int8/token k=int8/128tok``."""
    q, k = (_per(granularity, tokens) for tokens in groups)
    return f"q{k_name}={fmt}/{q}" if q == k else f"q={fmt}/{q} {k_name}={fmt}/{k}"


def _sage_formats(options: dict, bits: str) -> str:
    smooth = ",".join(t for t in ("q", "k", "v") if options[f"smooth_{t}"]) or "off"
    pv = "p=fp8 v=fp8/channel" if options["pv"] == "fp8" else "p=fp16 v=fp16"
    granularity = options["qk_granularity"]
    qk = _q_k_formats(bits, granularity, group_sizes(granularity, 1, 1))
    return f"{qk} {pv} smooth={smooth}"


def _int_flash_formats(options: dict) -> str:
    k_group, v_group = options["k_granularity"], options["v_granularity"]
    qk = _q_k_formats("int8", k_group, int_flash_group_sizes(k_group, 1, 1))
    v = _per(v_group, int_flash_v_group(v_group, 1))
    smooth = "k" if options["smooth_k"] else "off"
    return f"{qk} p=int8/{options['p_scale']} v=int8/{v} smooth={smooth}"


def _fmha_formats(options: dict) -> str:
    out = " o=int8" if options["quantize_output"] else ""
    return f"qkv=int8/tensor ({options['scales']}) p=uint8/{options['p_scale']}{out}"


def _turbo_formats(options: dict) -> str:
    exp = options["exp"]
    threshold = f" (threshold {options['sas_threshold']})" if exp == "sas" else ""
    qkv = _q_k_formats("int8", "block", group_sizes("block", 1, 1), k_name="kv")
    return f"{qkv} p=int8/{options['p_scale']} exp={exp}{threshold}"


def _fp8_formats(options: dict) -> str:
    granularity = options["granularity"]
    return f"{_q_k_formats('fp8', granularity, fp8_group_sizes(granularity, 1, 1), k_name='kv')} p=fp8"


QUANT_FORMATS = {
    "flash": lambda o: "exact (input dtype, fp32 accumulation)",
    "int_flash": _int_flash_formats,
    "fmha_int8": _fmha_formats,
    "sage2_8b": lambda o: _sage_formats(o, "int8"),
    "sage2_4b": lambda o: _sage_formats(o, "int4"),
    "turbo": _turbo_formats,
    "fp8": _fp8_formats,
}
"""Per preset: its options as the number formats of Q/K, P and V, with the tokens each scale
covers (the groups of :mod:`qattn_compile.blocks`)."""


def kernel_variant(report: SiteReport) -> str:
    """What serves a rewritten site, e.g. ``triton int_flash q=int8/token k=int8/128tok
    p=int8/tile v=int8/128tok smooth=k``
    (`` tiles=autotuned`` appended when the site's Triton kernel's tiles are timed, option
    ``autotune``; the reference path has no tiles).

    ``-`` for a site that was not rewritten.
    """
    if report.status != REWRITTEN:
        return "-"
    where = EXECUTION_LABELS.get(report.execution, report.execution or "?")
    options = {**resolve_options(report.preset).model_dump(), **report.options}  # defaults filled
    formats = QUANT_FORMATS.get(report.preset, lambda o: "")(options)
    tiles = " tiles=autotuned" if report.options.get("autotune") and report.execution == "triton" else ""
    tier = f" (tier 1: {report.execution_reason})" if report.execution_reason else ""
    return f"{where} {report.preset} {formats}{tiles}{tier}".rstrip()


def format_shapes(shapes: dict) -> str:
    """``{"q": [2, 4, 24, 16], ...}`` -> ``2x4x24x16 / 2x2x24x16 / 2x2x24x16``."""
    return " / ".join("x".join(str(d) for d in shapes.get(n) or ["?"]) for n in ("q", "k", "v"))


def mask_cell(report: SiteReport) -> str:
    """The mask column: the mask's kind, and ``(→ is_causal)`` when the rewrite proved its
    causal part and served it as ``is_causal`` (:data:`~qattn_compile.report.CAUSAL_MASK_NOTE`)."""
    return f"{report.mask_kind} (→ is_causal)" if report.causal_from_mask else report.mask_kind


def outcome(report: SiteReport) -> str:
    """The last column: the kernel variant, or the status and the reason."""
    if report.status == REWRITTEN:
        return kernel_variant(report)
    return f"{report.status.replace('_', ' ')}: {report.reason}"


def site_row(report: SiteReport) -> tuple[str, ...]:
    """One table row, in the order of :data:`COLUMNS`."""
    shared = f" (+{len(report.serves)} sharing its graph)" if report.serves else ""
    return (
        (report.fqn or "(top level)") + shared,
        report.module_class or "-",
        report.pattern,
        format_shapes(report.shapes),
        mask_cell(report),
        str(report.gqa_group) if report.gqa_group is not None else "-",
        report.rule,
        report.preset,
        outcome(report),
    )


def format_site_table(reports: list[SiteReport]) -> str:
    """A fixed-width table with one row per site (the last column is not padded)."""
    return format_grid([COLUMNS] + [site_row(r) for r in reports])
