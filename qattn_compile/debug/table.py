"""The per-site table of ``qattn explain`` and the kernel variant each rewritten site runs."""

from __future__ import annotations

from ..presets import IntFlashOptions
from ..report import REWRITTEN, SiteReport, format_grid

COLUMNS = ("site (module FQN)", "class", "pattern", "shapes q / k / v", "mask", "GQA", "rule", "preset",
           "kernel variant / why left alone")
EXECUTION_LABELS = {"triton": "triton", "reference": "reference (CPU)"}
"""How the table names :func:`qattn_compile.ops.execution_path` values."""


def _sage_formats(options: dict, bits: str) -> str:
    smooth = ",".join(t for t in ("q", "k", "v") if options.get(f"smooth_{t}")) or "off"
    pv = "p=fp8 v=fp8/channel" if options.get("pv", "fp8") == "fp8" else "p=fp16 v=fp16"
    return f"qk={bits}/{options.get('qk_granularity')} {pv} smooth={smooth}"


def _int_flash_formats(options: dict) -> str:
    k_group = options.get("k_granularity", IntFlashOptions.model_fields["k_granularity"].default)
    qk = "qk=int8/token" if k_group == "token" else f"q=int8/token k=int8/{k_group}"
    smooth = "k" if options.get("smooth_k") else "off"
    return (f"{qk} p=int8/{options.get('p_scale')} v=int8/{options.get('v_granularity')}"
            f" smooth={smooth}")


def _fmha_formats(options: dict) -> str:
    out = " o=int8" if options.get("quantize_output") else ""
    return f"qkv=int8/tensor ({options.get('scales')}) p=uint8/{options.get('p_scale')}{out}"


def _turbo_formats(options: dict) -> str:
    exp = options.get("exp")
    threshold = f" (threshold {options.get('sas_threshold')})" if exp == "sas" else ""
    return f"qkv=int8/block p=int8/{options.get('p_scale')} exp={exp}{threshold}"


QUANT_FORMATS = {
    "flash": lambda o: "exact (input dtype, fp32 accumulation)",
    "int_flash": _int_flash_formats,
    "fmha_int8": _fmha_formats,
    "sage2_8b": lambda o: _sage_formats(o, "int8"),
    "sage2_4b": lambda o: _sage_formats(o, "int4"),
    "turbo": _turbo_formats,
    "fp8": lambda o: f"qkv=fp8/{o.get('granularity')} p=fp8",
}
"""Per preset: its options as the number formats of Q/K, P and V."""


def kernel_variant(report: SiteReport) -> str:
    """What serves a rewritten site, e.g. ``triton int_flash q=int8/token k=int8/block
    p=int8/tile v=int8/tensor smooth=k``
    (`` tiles=autotuned`` appended when the site's tiles are timed, option ``autotune``).

    ``-`` for a site that was not rewritten.
    """
    if report.status != REWRITTEN:
        return "-"
    where = EXECUTION_LABELS.get(report.execution, report.execution or "?")
    formats = QUANT_FORMATS.get(report.preset, lambda o: "")(report.options)
    tiles = " tiles=autotuned" if report.options.get("autotune") else ""
    return f"{where} {report.preset} {formats}{tiles}".rstrip()


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
    return (
        report.fqn or "(top level)",
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
