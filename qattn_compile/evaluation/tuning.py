"""Pick the fastest preset per attention site within an accuracy budget (``qattn tune``).

**Budget** = a minimum cosine similarity, applied twice: every rewritten site's output vs
exact fp64 attention on the same inputs (site error, :mod:`.site_eval`), and the end-to-end
output vs the uncompiled fp32 model (decoders: cosine of the logits; other models: mean
per-sample cosine of their compared output, e.g. a pooled embedding or a diffusion sample). ``--budget 0.999`` means both must be >= 0.999.

**Speed ranking** (fastest first): :data:`DEFAULT_RANKING`, or a JSON file measured on the
device (``--ranking``; :func:`load_ranking` reads it, :func:`measure_ranking` writes one on
CUDA). The default is this package's kernels as measured on the H100 (``benchmarks/
attention.py`` at 16K, quantizers included, and the 32K Llama prefill; the numbers:
docs/performance.md):

1. ``fp8`` (FP8 for both GEMMs).
2. ``int_flash``: the fastest 8-bit preset in the compiled prefill.
3. ``sage2_8b`` (ΔS adds a term per score).
4. ``fmha_int8`` (UINT8 P has no Triton dot: P−128 plus a 128·colsum(V) correction).
5. ``flash``, 16-bit and nearly exact: the presets below are slower and less accurate on
   the H100, so ``tune`` reaches them only with a measured ranking that puts them first.
6. ``sage2_4b``: the H100 has no INT4 tensor cores, so packed INT4 is unpacked into the
   INT8 dot (it wins on GPUs with INT4 MMA: measure a ranking there).
7. ``turbo``: the SAS polynomial exp costs several issue slots against one.

**Algorithm.**

1. Capture every site's inputs in a full-precision run; for every site and every ranked
   preset compute the isolated site error (:func:`~.site_eval.isolated_site_metrics`).
2. Start each site at the fastest preset whose isolated site cosine meets the budget (and
   that the op can serve there); if none does, the site is left alone (``none``).
3. Run the model with that policy (eager), measuring in-context site errors and the
   end-to-end metric. If a site misses the budget, demote it; if only the end-to-end metric
   misses, demote the quantized site with the largest isolated relative L1 error. Demoting
   moves a site to the next slower acceptable preset that is more accurate (lower isolated
   relative L1) than its current one, or leaves it alone when there is none. Repeat until the
   run meets the budget (every site left alone always does, so this ends).
4. Write a commented policy YAML: one exact-FQN rule per site with its numbers, the presets
   rejected before it and why, ``default: none`` for sites not seen.
"""

from __future__ import annotations

import datetime
import json
import math
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..errors import QattnError
from ..policy import load_policy
from ..presets import PRESET_NAMES, QUANTIZED_PRESETS
from ..scales import static_options
from .site_eval import Evaluator, RunResult, format_e2e, isolated_site_metrics

DEFAULT_RANKING: tuple[str, ...] = ("fp8", "int_flash", "sage2_8b", "fmha_int8", "flash", "sage2_4b", "turbo")
"""Presets fastest first (module docstring: measured on the H100)."""
DEFAULT_RANKING_SOURCE = "default: measured on the H100 (docs/performance.md)"
LEAVE_ALONE = "none"
COS_SLACK = 1e-12
"""Float64 rounding allowance when a cosine is compared with the budget (so that an output
identical to the reference meets ``--budget 1``)."""


def meets(cos: float, budget: float) -> bool:
    """Whether ``cos`` satisfies the budget (NaN never does)."""
    return cos >= budget - COS_SLACK


def load_ranking(path: str | Path) -> tuple[list[str], str]:
    """A speed ranking from JSON: ``["fp8", ...]`` (fastest first), ``{"ranking": [...]}``,
    or times ``{"times_ms": {"fp8": 1.2, ...}}`` / ``{"fp8": 1.2, ...}`` (sorted ascending).

    Returns (ranking, a description of where it came from).
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise QattnError(f"cannot read ranking file {path}: {exc}") from None
    device = data.get("device") if isinstance(data, dict) else None
    if isinstance(data, dict) and "ranking" in data:
        data = data["ranking"]
    elif isinstance(data, dict):
        found = data.get("times_ms", data)
        if not isinstance(found, dict):
            raise QattnError(f"ranking file {path}: `times_ms` must map presets to ms, got a "
                             f"{type(found).__name__}")
        times = {k: v for k, v in found.items() if k in PRESET_NAMES}
        if not times:
            keys = f"its keys are {', '.join(map(str, found))}" if found else "it is empty"
            raise QattnError(f"ranking file {path}: no preset times ({keys}); expected a list of "
                             "presets or preset -> ms")
        if bad := {k: v for k, v in times.items() if not isinstance(v, (int, float))}:
            raise QattnError(f"ranking file {path}: times must be numbers (ms), got {bad}")
        data = sorted(times, key=times.get)
    if not isinstance(data, list) or not data:
        raise QattnError(f"ranking file {path}: expected a non-empty list of presets")
    bad = [p for p in data if p not in PRESET_NAMES or p == LEAVE_ALONE]
    if bad:
        raise QattnError(f"ranking file {path}: unknown preset(s) {bad}; "
                         f"choose from {', '.join(p for p in PRESET_NAMES if p != 'none')}")
    return list(data), f"measured, from {path}" + (f" ({device})" if device else "")


def measure_ranking(
    evaluator: Evaluator, presets=None, *, seq_len: int | None = None, batch: int = 1,
    warmup: int = 10, rep: int = 50,
) -> dict:
    """Time ``torch.ops.qattn.attention`` per preset on the model's sites (CUDA only).

    Without ``seq_len``: the first recorded call of every site of the full-precision
    capture, cast to the run dtype (the model's real shapes; tiny inputs only measure launch
    overhead). With ``seq_len``: random inputs ``[batch, H, seq_len, D]`` with each site's
    head counts and head dims, no mask, the site's ``is_causal``. Returns ``{"device",
    "dtype", "shapes", "times_ms": {preset: summed median ms over sites}, "ranking": [...],
    "unsupported": {preset: reason}}`` (write it as JSON for ``--ranking``).
    """
    if evaluator.device.type != "cuda" or evaluator.fp is None:
        raise QattnError("measuring a speed ranking needs a CUDA device and a full-precision capture")
    import triton.testing

    from .. import ops
    from ..presets import resolve_options

    dtype = evaluator.dtype
    cases = []
    for rec in (r for r in evaluator.fp.sites if r.calls):  # fallback sites have no inputs
        c = rec.calls[0]
        if seq_len is None:
            mask = c.attn_mask
            if mask is not None and mask.is_floating_point():
                mask = mask.to(dtype)
            cases.append((rec, c.q.to(dtype), c.k.to(dtype), c.v.to(dtype), mask))
        else:
            gen = torch.Generator(device=c.q.device).manual_seed(0)
            (hq, d), (hkv, dv) = (c.q.shape[1], c.q.shape[3]), (c.k.shape[1], c.v.shape[3])
            rand = lambda h, e: torch.randn(batch, h, seq_len, e, generator=gen,  # noqa: E731
                                            device=c.q.device, dtype=dtype)
            cases.append((rec, rand(hq, d), rand(hkv, d), rand(hkv, dv), None))
    presets = list(presets or ("flash", *QUANTIZED_PRESETS))
    times, unsupported = {}, {}
    for preset in presets:
        opts = resolve_options(preset, {})
        text = opts.to_json()
        total = 0.0
        for rec, q, k, v, mask in cases:
            reason = ops.unsupported_reason(q.shape, k.shape, v.shape, q.dtype, q.device, preset, opts)
            if reason:
                unsupported[preset] = reason
                break
            fn = lambda: torch.ops.qattn.attention(q, k, v, mask, rec.is_causal, rec.scale, preset, text)  # noqa: E731,B023
            total += triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
        else:
            times[preset] = total
    return {"device": torch.cuda.get_device_name(evaluator.device), "dtype": str(dtype),
            "shapes": [{"site": rec.key, "q": list(q.shape), "k": list(k.shape)} for rec, q, k, _, _ in cases],
            "times_ms": times, "ranking": sorted(times, key=times.get), "unsupported": unsupported}


@dataclass
class Candidate:
    """One entry of a site's ladder: a preset, its options and its isolated error."""

    preset: str
    options: dict
    metrics: dict

    @property
    def cos(self) -> float:
        return self.metrics.get("cos", float("nan"))

    @property
    def supported(self) -> bool:
        return "unsupported" not in self.metrics


@dataclass
class SiteChoice:
    fqn: str
    module_class: str | None
    keys: list[str]
    ladder: list[Candidate]
    position: int = 0  # index into ladder; len(ladder) = leave alone
    rejections: list[tuple[int, str]] = field(default_factory=list)  # (rank of the preset, why)
    ranking: list[str] = field(default_factory=list)

    @property
    def rejected(self) -> list[str]:
        """Why each preset faster than the chosen one was not taken (ranking order)."""
        limit = self.ranking.index(self.preset) if self.preset in self.ranking else len(self.ranking)
        return [text for rank, text in sorted(self.rejections, key=lambda r: r[0]) if rank < limit]

    @property
    def chosen(self) -> Candidate | None:
        return self.ladder[self.position] if self.position < len(self.ladder) else None

    @property
    def preset(self) -> str:
        return self.chosen.preset if self.chosen else LEAVE_ALONE


@dataclass
class TuneResult:
    budget: float
    ranking: list[str]
    ranking_source: str
    choices: list[SiteChoice]
    rounds: list[dict]
    final: RunResult
    policy_text: str
    met: bool

    def to_dict(self) -> dict:
        return {
            "budget": self.budget, "ranking": self.ranking, "ranking_source": self.ranking_source,
            "met": self.met, "rounds": self.rounds,
            "choices": [{"fqn": c.fqn, "preset": c.preset, "rejected": c.rejected,
                         "isolated": {cand.preset: cand.metrics for cand in c.ladder}}
                        for c in self.choices],
            "final": self.final.to_dict(), "policy": self.policy_text,
        }


def _options_for(preset: str, calibration: str | None) -> dict:
    if preset == "fmha_int8" and calibration:
        return static_options(calibration)
    return {}


def _ladder(evaluator, records, ranking, calibration, budget):
    """The acceptable candidates of a site (ranking order) and (rank, why) for the others."""
    ladder, rejected = [], []
    for rank, preset in enumerate(ranking):
        options = _options_for(preset, calibration)
        per_key = [isolated_site_metrics(r, preset, options, dtype=evaluator.dtype) for r in records]
        bad = next((m for m in per_key if "unsupported" in m), None)
        if bad:
            rejected.append((rank, f"{preset} (cannot be served: {bad['unsupported']})"))
            continue
        worst = min(per_key, key=lambda m: m["cos"])
        cand = Candidate(preset, options, worst)
        if meets(worst["cos"], budget):
            ladder.append(cand)
        else:
            rejected.append((rank, f"{preset} (site cos {worst['cos']:.6f} < {budget})"))
    return ladder, rejected


def _demote(c: SiteChoice, why: str) -> None:
    """Move a site to the next slower acceptable preset that is more accurate (lower isolated
    relative L1) than its current one; none left: leave the site alone."""
    current = c.chosen
    c.rejections.append((c.ranking.index(current.preset), f"{current.preset} ({why})"))
    err = current.metrics.get("rel_l1", math.inf)
    nxt = c.position + 1
    while nxt < len(c.ladder) and not c.ladder[nxt].metrics.get("rel_l1", math.inf) < err:
        skipped = c.ladder[nxt]
        c.rejections.append((c.ranking.index(skipped.preset),
                             f"{skipped.preset} (skipped: site rel-L1 {skipped.metrics['rel_l1']:.5f}"
                             f" is not below {current.preset}'s {err:.5f})"))
        nxt += 1
    c.position = nxt


def policy_dict(choices: list[SiteChoice]) -> dict:
    rules = []
    for c in choices:
        rule = {"match": fqn_pattern(c.fqn), "preset": c.preset}
        if c.chosen and c.chosen.options:
            rule["options"] = c.chosen.options
        rules.append(rule)
    return {"qattn": 1, "default": LEAVE_ALONE, "rules": rules}


def fqn_pattern(fqn: str) -> str:
    """A policy pattern matching exactly ``fqn`` (a glob if it has no glob characters; the
    top-level module's empty FQN as the regex ``^$``)."""
    if fqn and not re.search(r"[*?\[\]]", fqn) and not fqn.startswith("re:"):
        return fqn
    return "re:" + (re.escape(fqn) if fqn else "^$")


def tune(
    evaluator: Evaluator,
    budget: float,
    *,
    ranking: list[str] | None = None,
    ranking_source: str = DEFAULT_RANKING_SOURCE,
    calibration: str | None = None,
    max_rounds: int | None = None,
    log: Callable[[str], None] = lambda s: None,
) -> TuneResult:
    """Choose per site the fastest preset meeting ``budget`` (module docstring)."""
    if not 0.0 < budget <= 1.0:
        raise QattnError(f"--budget is a minimum cosine similarity in (0, 1], got {budget}")
    if evaluator.fp is None:
        raise QattnError("tune needs an Evaluator made with fp_capture=True")
    if max_rounds is not None and max_rounds < 1:
        raise QattnError(f"--max-rounds must be at least 1, got {max_rounds}")
    ranking = list(ranking or DEFAULT_RANKING)
    floor = evaluator.dtype_floor()
    if floor is not None and not meets(floor.e2e["cos"], budget):
        log(f"  warning: with every site left alone the model in {evaluator.dtype} already scores "
            f"end-to-end cos {floor.e2e['cos']:.6f} < {budget}: the budget cannot be met")
    by_fqn: dict[str, list] = {}
    for rec in evaluator.fp.sites:
        by_fqn.setdefault(rec.fqn, []).append(rec)
    if not by_fqn:
        raise QattnError("no attention site was found in the model: nothing to tune")
    choices = []
    for fqn, records in by_fqn.items():
        ladder, rejected = _ladder(evaluator, records, ranking, calibration, budget)
        choices.append(SiteChoice(fqn, records[0].module_class, [r.key for r in records], ladder,
                                  0, rejected, ranking))
        log(f"  {fqn or '(top level)'}: start at {choices[-1].preset}")
    rounds: list[dict] = []
    limit = max_rounds if max_rounds is not None else sum(len(c.ladder) + 1 for c in choices) + 1
    run = None
    met = False
    for round_no in range(limit):
        run = evaluator.run_policy(policy_dict(choices), label=f"tune round {round_no}")
        run.policy = "<tuned policy>"
        failing = sorted({s.fqn for s in run.sites
                          if s.status == "rewritten" and not meets(s.cos, budget)})
        e2e_ok = meets(run.e2e["cos"], budget)
        rounds.append({"round": round_no, "presets": {c.fqn: c.preset for c in choices},
                       "end_to_end": run.e2e, "failing_sites": failing})
        log(f"  round {round_no}: end-to-end cos {run.e2e['cos']:.6f}"
            + (f", sites below budget: {', '.join(failing)}" if failing else ""))
        if e2e_ok and not failing:
            met = True
            break
        if failing:
            targets = [c for c in choices if c.fqn in failing]
            why = "in-context site cos below budget"
        else:
            quantized = [c for c in choices if c.chosen and c.preset != "flash"]
            pool = quantized or [c for c in choices if c.chosen]
            if not pool:
                break
            targets = [max(pool, key=lambda c: c.chosen.metrics.get("rel_l1", 0.0))]
            why = f"end-to-end cos {run.e2e['cos']:.6f} < {budget}"
        for c in targets:
            _demote(c, f"{why}, round {round_no}")
            log(f"    {c.fqn}: -> {c.preset}")
    text = policy_yaml(choices, evaluator, run, budget, ranking, ranking_source, met)
    load_policy(text)  # the written policy must read back
    return TuneResult(budget, ranking, ranking_source, choices, rounds, run, text, met)


def _yaml_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def policy_yaml(choices, evaluator, run: RunResult, budget, ranking, ranking_source, met) -> str:
    """The commented policy text (see the module docstring)."""
    ev_inputs = evaluator.inputs
    e2e_what = ("cosine of the logits" if evaluator.kind == "decoder"
                else f"mean per-sample cosine of the {evaluator.output}")
    worst = run.worst_site() if run else None
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    paragraphs = [
        f"qattn policy written by `qattn tune` ({when}) for {ev_inputs.spec or ev_inputs.bundle.name}.",
        f"Budget: minimum cosine {budget} for every rewritten site (its output vs exact fp64 "
        f"attention on the same inputs) and end to end ({e2e_what} vs the uncompiled fp32 model).",
        f"Inputs: {ev_inputs.description}. Device: {evaluator.device.type}, "
        f"{str(evaluator.dtype).replace('torch.', '')}.",
        f"Speed ranking, fastest first ({ranking_source}): {' > '.join(ranking)}. Each site gets "
        "the fastest preset that met the budget; the faster ones rejected are listed above its rule.",
    ]
    if run is not None:
        verdict = "meets the budget" if met else "DOES NOT meet the budget"
        text = f"Verified: {verdict}. End to end {format_e2e(run.e2e)}."
        if worst is not None:
            text += f" Worst site: {worst.key}, cos {worst.cos:.6f} ({worst.preset})."
        paragraphs.append(text)
    paragraphs.append(
        "Edit freely: rules match the module FQN and the LAST matching rule wins. Re-check with "
        f"`qattn eval {ev_inputs.spec or 'MODEL_SPEC'} --policy <this file>`."
    )
    lines = []
    for para in paragraphs:
        lines += ["# " + line for line in textwrap.wrap(" ".join(para.split()), 92)]
    lines += [
        "",
        "qattn: 1",
        "default: none              # sites not seen while tuning keep their original attention",
        "on_unsupported: fallback   # a site a kernel cannot serve keeps its original attention",
        "strict: false",
        "rules:",
    ]
    in_context = {s.fqn: s for s in (run.sites if run else [])}
    for c in choices:
        site = in_context.get(c.fqn)
        label = c.fqn or "(top level)"
        lines.append(f"  # {label} ({c.module_class or '?'})")
        if c.chosen is not None:
            m = c.chosen.metrics
            text = f"  #   {c.preset}: site cos {m['cos']:.6f}, rel-L1 {m['rel_l1']:.5f} (full-precision inputs)"
            if site is not None and not math.isnan(site.cos):
                text += f"; in context cos {site.cos:.6f}"
            lines.append(text)
        else:
            lines.append("  #   left alone: no preset met the budget here")
        for r in c.rejected:
            lines.append(f"  #   rejected: {r}")
        lines.append(f"  - match: {_yaml_str(fqn_pattern(c.fqn))}")
        lines.append(f"    preset: {c.preset}")
        if c.chosen is not None and c.chosen.options:
            opts = ", ".join(f"{k}: {_yaml_str(v) if isinstance(v, str) else json.dumps(v)}"
                             for k, v in c.chosen.options.items())
            lines.append(f"    options: {{{opts}}}")
    return "\n".join(lines) + "\n"
