"""FlashQ KV cache (TurboAttention) for ``model.generate``.

- :mod:`.flashq`: the quantization math (reference, plain PyTorch) and the storage layout;
- :mod:`.priority`: head-wise mixed precision (which heads get INT2);
- :mod:`.cache`: :class:`FlashQCache`, a ``transformers`` cache (static shapes, compile-friendly);
- :mod:`.attention`: the ``qattn::flashq_decode`` op and the ``qattn_kv`` attention
  implementation that reads the packed cache;
- :mod:`.kernel`: the split-K Triton decode kernel the op runs on CUDA;
- :mod:`.memory`: KV bytes per token against a bf16 cache.

Importing this package registers ``qattn_kv`` with transformers (:func:`register`).
"""

from .attention import MAX_DECODE_QUERIES, flashq_attention, flashq_decode, register
from .cache import KV_ATTENTION, FlashQCache, FlashQLayer, FlashQView
from .memory import kv_bytes_report

register()

__all__ = [
    "KV_ATTENTION",
    "MAX_DECODE_QUERIES",
    "FlashQCache",
    "FlashQLayer",
    "FlashQView",
    "flashq_attention",
    "flashq_decode",
    "kv_bytes_report",
    "register",
]
