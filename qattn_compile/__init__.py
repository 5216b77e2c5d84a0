"""qattn: a torch.compile backend that makes attention run as quantized flash attention.

``torch.compile(model, backend="qattn", options={"policy": "policy.yaml"})``

The public names below load on first use (PEP 562), so that importing the package — which
torch does at start-up for the ``TORCH_LOGS`` hook, see :mod:`qattn_compile._logging` — is cheap.
"""

from importlib import import_module

_PUBLIC = {
    "attention": "functional",
    "policy_scope": "integrations.eager",
    "apply_policy": "integrations.transformers",
    "backend": "dynamo_backend",
    "last_backend": "dynamo_backend",
    "Policy": "policy",
    "load_policy": "policy",
    "PRESET_NAMES": "presets",
    "QattnError": "errors",
    "PolicyError": "errors",
    "OptionsError": "errors",
    "UnsupportedSiteError": "errors",
    "PolicyNotAppliedError": "errors",
    "ModelSpecError": "errors",
    "AttentionInputError": "errors",
}

__all__ = sorted(_PUBLIC)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(import_module(f".{_PUBLIC[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'qattn_compile' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
