"""Exceptions qattn raises on purpose. Each message names the culprit and what is allowed."""


class QattnError(Exception):
    """Base class of every error qattn raises deliberately."""


class PolicyError(QattnError, ValueError):
    """A policy file or text is malformed: bad YAML, unknown key, bad value, unknown preset."""


class OptionsError(QattnError, ValueError):
    """Backend options (``torch.compile(..., options={...})``) are malformed."""


class UnsupportedSiteError(QattnError):
    """An attention site cannot be served and the policy says ``on_unsupported: error``."""


class ModelSpecError(QattnError, ValueError):
    """A MODEL_SPEC (the model argument of the ``qattn`` commands) that names nothing
    loadable, or a ``module:callable`` that does not return ``(model, example_inputs)``."""


class AttentionInputError(QattnError, RuntimeError, ValueError):
    """Tensors the eager ``qattn_compile.attention`` cannot take (shapes, dtypes, devices,
    mask): a RuntimeError, as ``F.scaled_dot_product_attention`` raises for them, and a
    ValueError, as qattn raises for other bad input."""


class PolicyNotAppliedError(QattnError, RuntimeError):
    """A model runs with ``attn_implementation="qattn"`` but no policy was applied to it
    (``qattn_compile.integrations.transformers.apply_policy``), so its sites have no names."""
