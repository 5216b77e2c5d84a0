"""qattn: a torch.compile backend that makes attention run as quantized flash attention.

``torch.compile(model, backend="qattn", options={"policy": "policy.yaml"})``
"""

from . import ops  # noqa: F401  (registers torch.ops.qattn.*)
from .backend import backend, last_backend
from .errors import OptionsError, PolicyError, QattnError, UnsupportedSiteError
from .functional import attention
from .policy import Policy, load_policy
from .presets import PRESET_NAMES

__all__ = [
    "PRESET_NAMES",
    "OptionsError",
    "Policy",
    "PolicyError",
    "QattnError",
    "UnsupportedSiteError",
    "attention",
    "backend",
    "last_backend",
    "load_policy",
]
__version__ = "0.1.0"
