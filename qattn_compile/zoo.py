"""A zoo of tiny random-weight Hugging Face models, one per architecture family member.

Every entry builds a seeded model (2 layers, hidden 64, 4 heads of dim 16; GQA 4/2 where
the architecture has it) in eval mode with example inputs, for either attention
implementation transformers offers (``eager``: hand-written matmul/softmax chains;
``sdpa``: ``F.scaled_dot_product_attention``). Offline: nothing is downloaded.
``attention_classes`` names the module classes holding one attention computation each, so
a test can check that every attention module became exactly one site. :data:`TORCH_ZOO`
holds PyTorch's own attention modules (``nn.MultiheadAttention``, the transformer layers).

Every model the CLI and tests run (here, in :mod:`qattn_compile.models` and
:mod:`qattn_compile.specs`) comes as a :class:`ModelBundle`: the model, its example inputs
and how to read its comparable output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn


def move_tensor(value, device, dtype: torch.dtype | None = None):
    """``value`` on ``device`` with a floating-point tensor cast to ``dtype`` (when given);
    integer tensors (token ids, masks) keep their dtype, anything else is returned as is."""
    if not torch.is_tensor(value):
        return value
    if dtype is not None and value.is_floating_point():
        return value.to(device, dtype)
    return value.to(device)


def move_tensors(kwargs: dict, device, dtype: torch.dtype | None = None) -> dict:
    """:func:`move_tensor` applied to every value of ``kwargs`` (a new dict)."""
    return {k: move_tensor(v, device, dtype) for k, v in kwargs.items()}


@dataclass
class ModelBundle:
    """A model in eval mode, its example inputs and how to read its comparable output.

    ``output`` names what :meth:`run` last returned (``""`` before the first run): see
    :func:`compared_output`.
    """

    name: str
    model: nn.Module
    kwargs: dict = field(default_factory=dict)
    args: tuple = ()
    kind: str = "encoder"  # decoder: logits are compared; encoder: any other output
    output: str = ""

    def to(self, device, dtype: torch.dtype | None = None) -> "ModelBundle":
        """Move the model and the example inputs to ``device`` (in place; returns self); with
        ``dtype``, the model's and the inputs' floating-point tensors are cast to it (a
        Whisper's ``input_features`` must follow its weights)."""
        self.model.to(device) if dtype is None else self.model.to(device, dtype)
        self.args = tuple(move_tensor(a, device, dtype) for a in self.args)
        self.kwargs = move_tensors(self.kwargs, device, dtype)
        return self

    def run(self, model: nn.Module | None = None) -> torch.Tensor:
        """Forward ``model`` (default: the bundle's) on the inputs; return the compared output
        in float32 (:func:`compared_output`; its name is left in ``self.output``)."""
        with torch.no_grad():
            out = (self.model if model is None else model)(*self.args, **self.kwargs)
        self.output, tensor = compared_output(out, self.kind, self.kwargs.get("attention_mask"))
        return tensor


def compared_output(out, kind: str, attention_mask: torch.Tensor | None = None) -> tuple[str, torch.Tensor]:
    """The name and the float32 tensor of a model output that the tools compare:

    - ``kind == "decoder"``: ``"logits"``, ``out.logits``;
    - an output with ``last_hidden_state`` and an ``attention_mask`` input: ``"embedding"``,
      the hidden states mean-pooled over the unmasked tokens and L2-normalized ``[B, D]``;
      without a mask: ``"mean last hidden state"``, the mean over tokens ``[B, D]``;
    - a tensor: ``"output"``, itself;
    - another model output (a diffusers ``Transformer2DModelOutput``, a classifier's): its
      first field by name (``"sample"``, ``"logits"``); a tuple: ``"output[0]"``.
    """
    if kind == "decoder":
        return "logits", out.logits.float()
    if isinstance(out, torch.Tensor):
        return "output", out.float()
    if not hasattr(out, "last_hidden_state"):
        keys = list(out.keys()) if hasattr(out, "keys") else []
        return (str(keys[0]) if keys else "output[0]"), out[0].float()
    hidden = out.last_hidden_state.float()
    if attention_mask is None:
        return "mean last hidden state", hidden.mean(dim=1)
    mask = attention_mask.unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
    return "embedding", torch.nn.functional.normalize(pooled, dim=-1)


HIDDEN, HEADS, KV_HEADS, LAYERS, FFN, VOCAB = 64, 4, 2, 2, 128, 256
IMAGE, PATCH, MEL_BINS, AUDIO_FRAMES = 16, 4, 8, 16


@dataclass(frozen=True)
class ZooEntry:
    """How to build one architecture: ``build(attn_implementation, seq_len, batch)``."""

    name: str
    family: str  # decoder | encoder | vision | seq2seq
    attention_classes: tuple[str, ...]
    build: Callable[..., ModelBundle]


def _tokens(batch: int, seq_len: int, pad: int = 0) -> dict:
    """Random token ids and a right-padding mask (the first sample's last quarter padded)."""
    ids = torch.randint(3, VOCAB, (batch, seq_len))
    mask = torch.ones(batch, seq_len, dtype=torch.long)
    mask[0, seq_len - max(1, seq_len // 4) :] = 0
    ids[0][mask[0] == 0] = pad
    return {"input_ids": ids, "attention_mask": mask}


def _pixels(batch: int) -> dict:
    return {"pixel_values": torch.randn(batch, 3, IMAGE, IMAGE)}


def _causal_lm(name: str, config_cls: str, model_cls: str, **extra) -> Callable[..., ModelBundle]:
    def build(attn_implementation: str = "sdpa", seq_len: int = 24, batch: int = 2) -> ModelBundle:
        import transformers

        torch.manual_seed(0)
        cfg = getattr(transformers, config_cls)(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256,
            attn_implementation=attn_implementation, **extra,
        )
        model = getattr(transformers, model_cls)(cfg).eval()
        inputs = {**_tokens(batch, seq_len), "use_cache": False}
        return ModelBundle(f"{name}:{attn_implementation}", model, kwargs=inputs, kind="decoder")

    return build


def _gpt2(attn_implementation: str = "sdpa", seq_len: int = 24, batch: int = 2) -> ModelBundle:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=256,
        attn_implementation=attn_implementation,
    )
    model = GPT2LMHeadModel(cfg).eval()
    inputs = {**_tokens(batch, seq_len), "use_cache": False}
    return ModelBundle(f"gpt2:{attn_implementation}", model, kwargs=inputs, kind="decoder")


def _encoder(name: str, config_cls: str, model_cls: str, pad: int) -> Callable[..., ModelBundle]:
    def build(attn_implementation: str = "sdpa", seq_len: int = 24, batch: int = 2) -> ModelBundle:
        import transformers

        torch.manual_seed(0)
        cfg = getattr(transformers, config_cls)(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, max_position_embeddings=256, pad_token_id=pad,
            attn_implementation=attn_implementation,
        )
        model = getattr(transformers, model_cls)(cfg).eval()
        return ModelBundle(f"{name}:{attn_implementation}", model, kwargs=_tokens(batch, seq_len, pad))

    return build


def _vit(attn_implementation: str = "sdpa", seq_len: int = 0, batch: int = 2) -> ModelBundle:
    from transformers import ViTConfig, ViTModel

    torch.manual_seed(0)
    cfg = ViTConfig(
        image_size=IMAGE, patch_size=PATCH, hidden_size=HIDDEN, intermediate_size=FFN,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, attn_implementation=attn_implementation,
    )
    return ModelBundle(f"vit:{attn_implementation}", ViTModel(cfg).eval(), kwargs=_pixels(batch))


def _t5(attn_implementation: str = "sdpa", seq_len: int = 24, batch: int = 2) -> ModelBundle:
    from transformers import T5Config, T5Model

    torch.manual_seed(0)
    cfg = T5Config(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=FFN, num_layers=LAYERS,
        num_heads=HEADS, attn_implementation=attn_implementation,
    )
    inputs = _tokens(batch, seq_len)
    inputs["decoder_input_ids"] = torch.randint(3, VOCAB, (batch, max(2, seq_len // 2)))
    return ModelBundle(f"t5:{attn_implementation}", T5Model(cfg).eval(), kwargs={**inputs, "use_cache": False})


def _clip_text(attn_implementation: str = "sdpa", seq_len: int = 24, batch: int = 2) -> ModelBundle:
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(0)
    cfg = CLIPTextConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, max_position_embeddings=256, attn_implementation=attn_implementation,
    )
    return ModelBundle(f"clip_text:{attn_implementation}", CLIPTextModel(cfg).eval(), kwargs=_tokens(batch, seq_len))


def _clip_vision(attn_implementation: str = "sdpa", seq_len: int = 0, batch: int = 2) -> ModelBundle:
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    cfg = CLIPVisionConfig(
        image_size=IMAGE, patch_size=PATCH, hidden_size=HIDDEN, intermediate_size=FFN,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, attn_implementation=attn_implementation,
    )
    return ModelBundle(f"clip_vision:{attn_implementation}", CLIPVisionModel(cfg).eval(), kwargs=_pixels(batch))


def _whisper(attn_implementation: str = "sdpa", seq_len: int = 24, batch: int = 2) -> ModelBundle:
    from transformers import WhisperConfig, WhisperModel

    torch.manual_seed(0)
    cfg = WhisperConfig(
        vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=LAYERS, decoder_layers=LAYERS,
        encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FFN,
        decoder_ffn_dim=FFN, num_mel_bins=MEL_BINS, max_source_positions=AUDIO_FRAMES // 2,
        max_target_positions=64, pad_token_id=1, bos_token_id=2, eos_token_id=2,
        decoder_start_token_id=2, attn_implementation=attn_implementation,
    )
    inputs = {
        "input_features": torch.randn(batch, MEL_BINS, AUDIO_FRAMES),
        "decoder_input_ids": torch.randint(3, VOCAB, (batch, max(2, seq_len // 2))),
        "use_cache": False,
    }
    return ModelBundle(f"whisper:{attn_implementation}", WhisperModel(cfg).eval(), kwargs=inputs)


ZOO: dict[str, ZooEntry] = {
    entry.name: entry
    for entry in (
        ZooEntry("llama", "decoder", ("LlamaAttention",), _causal_lm("llama", "LlamaConfig", "LlamaForCausalLM")),
        ZooEntry(
            "mistral", "decoder", ("MistralAttention",),
            _causal_lm("mistral", "MistralConfig", "MistralForCausalLM", sliding_window=8),
        ),
        ZooEntry("qwen2", "decoder", ("Qwen2Attention",), _causal_lm("qwen2", "Qwen2Config", "Qwen2ForCausalLM")),
        ZooEntry("gpt2", "decoder", ("GPT2Attention",), _gpt2),
        ZooEntry("bert", "encoder", ("BertSelfAttention",), _encoder("bert", "BertConfig", "BertModel", pad=0)),
        ZooEntry(
            "roberta", "encoder", ("RobertaSelfAttention",), _encoder("roberta", "RobertaConfig", "RobertaModel", pad=1)
        ),
        ZooEntry("vit", "vision", ("ViTAttention", "ViTSelfAttention"), _vit),
        ZooEntry("t5", "seq2seq", ("T5Attention",), _t5),
        ZooEntry("clip_text", "encoder", ("CLIPAttention",), _clip_text),
        ZooEntry("clip_vision", "vision", ("CLIPAttention",), _clip_vision),
        ZooEntry("whisper", "seq2seq", ("WhisperAttention",), _whisper),
    )
}
"""Every zoo architecture by name."""

ATTN_IMPLEMENTATIONS = ("eager", "sdpa")


class AttentionPool(torch.nn.Module):
    """A vision-style pooling head: one learned query attends over the tokens through
    ``nn.MultiheadAttention`` called with its defaults (``need_weights=True``, the weights
    dropped), then a classifier."""

    def __init__(self, dim: int = HIDDEN, heads: int = HEADS, classes: int = 10):
        super().__init__()
        self.patch = torch.nn.Linear(3 * PATCH * PATCH, dim)
        self.query = torch.nn.Parameter(torch.randn(1, 1, dim))
        self.attn = torch.nn.MultiheadAttention(dim, heads, batch_first=True)
        self.head = torch.nn.Linear(dim, classes)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = torch.nn.functional.unfold(pixel_values, PATCH, stride=PATCH).transpose(1, 2)
        tokens = self.patch(patches)
        pooled, _ = self.attn(self.query.expand(tokens.shape[0], -1, -1), tokens, tokens)
        return self.head(pooled[:, 0])


def _transformer_encoder(attn_implementation: str = "torch", seq_len: int = 24, batch: int = 2) -> ModelBundle:
    """``nn.TransformerEncoder`` (batch first, a key padding mask): in eval mode without
    gradients PyTorch runs each layer as one fused op (its fast path)."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(HIDDEN, HEADS, FFN, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False).eval()
    padding = _tokens(batch, seq_len)["attention_mask"] == 0
    inputs = {"src": torch.randn(batch, seq_len, HIDDEN), "src_key_padding_mask": padding}
    return ModelBundle("transformer_encoder", model, kwargs=inputs)


def _transformer_decoder(attn_implementation: str = "torch", seq_len: int = 24, batch: int = 2) -> ModelBundle:
    """``nn.TransformerDecoder``: causal self-attention and cross-attention per layer."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerDecoderLayer(HIDDEN, HEADS, FFN, batch_first=True)
    model = torch.nn.TransformerDecoder(layer, LAYERS).eval()
    inputs = {
        "tgt": torch.randn(batch, seq_len, HIDDEN),
        "memory": torch.randn(batch, seq_len + 3, HIDDEN),
        "tgt_mask": torch.nn.Transformer.generate_square_subsequent_mask(seq_len),
        "tgt_is_causal": True,
    }
    return ModelBundle("transformer_decoder", model, kwargs=inputs)


def _attention_pool(attn_implementation: str = "torch", seq_len: int = 0, batch: int = 2) -> ModelBundle:
    torch.manual_seed(0)
    return ModelBundle("attention_pool", AttentionPool().eval(), kwargs=_pixels(batch))


TORCH_ZOO: dict[str, ZooEntry] = {
    entry.name: entry
    for entry in (
        ZooEntry("transformer_encoder", "encoder", ("MultiheadAttention",), _transformer_encoder),
        ZooEntry("transformer_decoder", "decoder", ("MultiheadAttention",), _transformer_decoder),
        ZooEntry("attention_pool", "vision", ("MultiheadAttention",), _attention_pool),
    )
}
"""PyTorch's own attention modules (``nn.MultiheadAttention`` and the layers built on it),
with no attention implementation to choose (``build`` ignores it)."""


def attention_like_modules(model: torch.nn.Module) -> list[str]:
    """FQNs of every module that looks like attention: its class name contains "Attention",
    or it is an ``nn.MultiheadAttention``. Every one must hold (or be) a reported site."""
    return [name for name, module in model.named_modules()
            if "Attention" in type(module).__name__ or isinstance(module, torch.nn.MultiheadAttention)]


def attention_modules(bundle: ModelBundle, entry: ZooEntry) -> list[str]:
    """FQNs of the modules of ``bundle.model`` that hold one attention computation each: the
    innermost modules of ``entry.attention_classes`` (releases move attention between an
    outer ``…Attention`` and an inner ``…SelfAttention`` module)."""
    names = [n for n, m in bundle.model.named_modules() if type(m).__name__ in entry.attention_classes]
    return [n for n in names if not any(other.startswith(f"{n}.") for other in names)]


def main_output(output) -> torch.Tensor:
    """The tensor a zoo model's output is compared on: logits, else the last hidden state."""
    for name in ("logits", "last_hidden_state"):
        value = getattr(output, name, None)
        if value is not None:
            return value.float()
    return output[0].float()
