"""Head-wise mixed precision: which kv heads of a layer get INT2 blocks (TurboAttention).

A head's *priority* measures how badly coarse quantization would hurt it: with
``gap_c = max_t x[t, c] - min_t x[t, c]`` the range of channel ``c`` over the tokens and
``gap = max x - min x`` the head's whole range,

    priority = gap × std_c(gap_c)

A head with a wide range whose channels also differ a lot in range (outlier channels)
loses most from a few levels per channel. Per layer, the ``count`` heads with the lowest
priority get INT2, the others INT4.

Choices where the paper leaves room: the statistics come from the prefill (the first
tokens the cache sees), the batch rows' priorities are averaged (a head has one precision
for the whole batch, as the storage layout needs), and a head's priority is the product of
its K and V priorities (one precision per head serves both tensors; the product ranks heads
the same whatever the relative scale of K and V).
"""

from __future__ import annotations

import torch
from torch import Tensor


def head_priority(x: Tensor) -> Tensor:
    """Priority of every head of ``x`` ``[B, H, L, D]``: float32 ``[H]`` (batch mean)."""
    x = x.float()
    channel_gap = x.amax(dim=-2) - x.amin(dim=-2)  # [B, H, D]
    gap = x.amax(dim=(-2, -1)) - x.amin(dim=(-2, -1))  # [B, H]
    spread = channel_gap.std(dim=-1, unbiased=False)  # [B, H]
    return (gap * spread).mean(dim=0)


def assign_int2_heads(k: Tensor, v: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """Split the kv heads of ``k``/``v`` ``[B, H, L, D]`` into INT4 and INT2 heads.

    The ``count`` heads with the lowest ``head_priority(k) * head_priority(v)`` get INT2
    (ties: lower head index first). Returns ``(heads4, heads2)``: int32 ``[H - count]`` and
    ``[count]``, each in increasing head order.
    """
    n_heads = k.shape[1]
    if not 0 <= count <= n_heads:
        raise ValueError(f"int2_heads={count} but the layer has {n_heads} kv heads")
    priority = head_priority(k) * head_priority(v)
    order = torch.sort(priority, stable=True).indices
    heads2 = order[:count].sort().values
    heads4 = order[count:].sort().values
    return heads4.to(torch.int32), heads2.to(torch.int32)
