"""Decode attention over a FlashQ cache: the ``qattn::flashq_decode`` op and the
``qattn_kv`` attention implementation that routes a model's attention to it.

``torch.ops.qattn.flashq_decode(q, codes4, codes2, step, lo, scale8, buf, buf_scale, heads4,
heads2, length, attn_mask, scale)``

- q ``[B, Hq, Lq, D]`` (the newest ``Lq`` tokens' queries, ``Lq`` small); the cache tensors
  as :class:`.flashq.FlashQTensors` lays them out (kv heads ``H`` divide ``Hq``: GQA);
- attn_mask: None, bool (True = attend) or additive, broadcastable to
  ``[B, Hq, Lq, >= length]``; causality among the newest ``Lq`` tokens is implied;
- scale: softmax scale (``D ** -0.5`` when None). Returns ``[B, Hq, Lq, D]`` in q's dtype.

On CUDA it runs the split-K Triton kernel (:mod:`.kernel`), which reads
the packed INT4/INT2 blocks and the INT8 buffer and dequantizes in registers; elsewhere
:func:`.flashq.reference_decode`. It is a ``custom_op`` with a fake implementation, so dynamo
traces it without a graph break and Inductor calls it as an opaque kernel.

``qattn_kv`` (registered with transformers' ``AttentionInterface`` and
``AttentionMaskInterface`` by :func:`register`) receives a :class:`.cache.FlashQView` from
:class:`.cache.FlashQCache` in place of K/V and:

- prefill (the update that filled an empty layer): SDPA on the fresh K/V through
  transformers' ``sdpa_attention_forward`` (so ``backend="qattn"`` finds and rewrites it
  per the policy, e.g. into the ``turbo`` kernel);
- ``Lq <= MAX_DECODE_QUERIES``: ``flashq_decode`` on the packed cache;
- longer updates of a filled layer (chunked prefill): SDPA on the dequantized cache.

Any other K/V (another cache, no cache) goes to ``sdpa_attention_forward`` unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .cache import KV_ATTENTION, MAX_STEP_TOKENS, FlashQView
from .flashq import FlashQTensors, reference_decode

MAX_DECODE_QUERIES = MAX_STEP_TOKENS
"""Longest query (tokens per update) served by the decode op; longer ones use SDPA. The
cache's update appends as many in a compiled step (:data:`.cache.MAX_STEP_TOKENS`)."""


@torch.library.custom_op("qattn::flashq_decode", mutates_args=())
def flashq_decode(
    q: Tensor,
    codes4: Tensor,
    codes2: Tensor,
    step: Tensor,
    lo: Tensor,
    scale8: Tensor,
    buf: Tensor,
    buf_scale: Tensor,
    heads4: Tensor,
    heads2: Tensor,
    length: Tensor,
    attn_mask: Tensor | None,
    scale: float | None,
) -> Tensor:
    """Decode attention over a FlashQ cache (see the module docstring for shapes)."""
    tensors = FlashQTensors(codes4, codes2, step, lo, scale8, buf, buf_scale, heads4, heads2, length)
    if q.device.type == "cuda":
        from .kernel import flashq_decode_triton  # Triton: loaded only where it runs

        return flashq_decode_triton(q, tensors, attn_mask, scale)
    return reference_decode(q, tensors, attn_mask, scale).to(q.dtype).contiguous()


@flashq_decode.register_fake
def _flashq_decode_fake(q, codes4, codes2, step, lo, scale8, buf, buf_scale, heads4, heads2, length, attn_mask, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def flashq_attention(
    module: torch.nn.Module,
    query: Tensor,
    key,
    value,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """The ``qattn_kv`` attention implementation (transformers' attention-interface signature).

    query ``[B, Hq, Lq, D]``; key/value a :class:`FlashQView` (or plain tensors); returns
    ``([B, Lq, Hq, D], None)`` like transformers' SDPA integration.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not isinstance(key, FlashQView):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    view = key
    if view.prefill:
        k, v = view.key_states, view.value_states
        mask = None if attention_mask is None else attention_mask[..., : k.shape[-2]]
        return sdpa_attention_forward(module, query, k, v, mask, dropout=dropout, scaling=scaling, **kwargs)
    if dropout:
        raise ValueError(f"qattn_kv decode attention is inference-only: dropout must be 0, got {dropout}")
    if query.shape[2] > MAX_DECODE_QUERIES:
        k, v = view.layer.dequantized()
        return sdpa_attention_forward(module, query, k, v, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    out = torch.ops.qattn.flashq_decode(query, *view.layer.tensors(), attention_mask, scaling)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register ``qattn_kv`` with transformers' attention and mask interfaces (idempotent).

    Afterwards load the model with ``attn_implementation="qattn_kv"`` or call
    ``model.set_attn_implementation("qattn_kv")``.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(KV_ATTENTION, flashq_attention)
    AttentionMaskInterface.register(KV_ATTENTION, sdpa_mask)
