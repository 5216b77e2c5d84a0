"""``TORCH_LOGS`` integration: ``TORCH_LOGS=+qattn`` shows every ``qattn_compile`` logger at DEBUG.

torch parses ``TORCH_LOGS`` once, while ``import torch`` runs, and rejects names it does not
know. torch calls the entry points of group ``torch.backends`` just before it parses
``TORCH_LOGS``, so :func:`register_torch_logs` is registered there (pyproject.toml). It does
nothing unless ``TORCH_LOGS`` mentions ``qattn`` and never raises, so it cannot slow down or
break ``import torch``; ``qattn_compile/__init__.py`` is lazy, so loading this module is cheap.
``TORCH_LOGS=+qattn_compile`` works without any registration.
"""

from __future__ import annotations

import logging
import os

TORCH_LOGS_NAME = "qattn"
"""The name to give ``TORCH_LOGS`` (``+qattn`` = DEBUG, ``qattn`` = INFO)."""
LOGGER_NAME = "qattn_compile"
"""The parent of every logger of the package."""


def register_torch_logs() -> None:
    """Register ``qattn`` as the ``TORCH_LOGS`` name of the ``qattn_compile`` loggers."""
    if TORCH_LOGS_NAME not in os.environ.get("TORCH_LOGS", ""):
        return
    try:
        from ._compat import register_log

        register_log(TORCH_LOGS_NAME, LOGGER_NAME)
    except Exception:  # never break `import torch` for a logging nicety
        logging.getLogger(LOGGER_NAME).debug("could not register TORCH_LOGS name", exc_info=True)
