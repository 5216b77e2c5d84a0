"""KV-cache memory accounting: bytes per token of a FlashQ cache against a bf16 cache.

Per layer and token (one sequence), K and V together, ``H`` kv heads of dim ``D``, ``n2`` of
them INT2, blocks of ``KV_CACHE_BLOCK = 64`` tokens:

- codes: ``(H - n2)·D/2 + n2·D/4`` bytes, for K and for V;
- block metadata, amortized over the block: per head ``D`` steps (uint8) + ``D`` zero points
  (int8) + one float32 stage-1 scale, i.e. ``(2D + 4) / 64`` bytes per head;
- bf16: ``2·H·D`` bytes for K and for V.

The INT8 decode buffer (``n_b`` tokens, ``D`` bytes per head, plus a float32 universal scale)
is a fixed cost per layer, reported separately (``fixed_bytes``). With ``D = 128`` an INT4
head costs 68.06 bytes per token per tensor against 256 in bf16 (3.76×) and an INT2 head
36.06 (7.10×); half INT2 heads give 4.92×.
"""

from __future__ import annotations

from ..blocks import KV_CACHE_BLOCK


def flashq_bytes_per_token(num_kv_heads: int, head_dim: int, int2_heads: int) -> float:
    """K+V bytes per token of one FlashQ layer (compressed blocks, metadata amortized)."""
    n4 = num_kv_heads - int2_heads
    codes = n4 * head_dim / 2 + int2_heads * head_dim / 4
    metadata = num_kv_heads * (2 * head_dim + 4) / KV_CACHE_BLOCK
    return 2 * (codes + metadata)


def dense_bytes_per_token(num_kv_heads: int, head_dim: int, bytes_per_value: int = 2) -> float:
    """K+V bytes per token of one layer stored densely (bf16: 2 bytes per value)."""
    return 2 * num_kv_heads * head_dim * bytes_per_value


def kv_bytes_report(cache) -> dict:
    """Bytes per token of ``cache`` (a :class:`.cache.FlashQCache`) vs a bf16 cache.

    Reads the kv heads and head dim from the cache's config. Returns ``{"layers": [{"layer",
    "format", "int2_heads", "bytes_per_token", "bf16_bytes_per_token"}], "bytes_per_token",
    "bf16_bytes_per_token", "ratio" (bf16 / FlashQ), "fixed_bytes" (decode buffers, per
    sequence)}``.
    """
    from .cache import FlashQLayer

    config = cache.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dense = dense_bytes_per_token(heads, head_dim)
    layers, fixed = [], 0
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, FlashQLayer):
            row = {"format": "flashq", "int2_heads": layer.int2_heads,
                   "bytes_per_token": flashq_bytes_per_token(heads, head_dim, layer.int2_heads)}
            fixed += 2 * heads * (layer.buffer_tokens * head_dim + 4)
        else:
            row = {"format": "none", "int2_heads": 0, "bytes_per_token": dense}
        layers.append({"layer": index, **row, "bf16_bytes_per_token": dense})
    total = sum(row["bytes_per_token"] for row in layers)
    total_dense = dense * len(layers)
    return {"layers": layers, "bytes_per_token": total, "bf16_bytes_per_token": total_dense,
            "ratio": total_dense / total, "fixed_bytes": fixed}
