"""SageAttention2's smoothing of Q, K and V, in plain PyTorch (K smoothing also serves
``int_flash`` with ``smooth_k``).

All functions work per (batch, head) on ``[B, H, L, D]`` tensors and compute in the dtype
they are given (the reference passes its compute dtype, float32 or float64).

Why each smoothing is exact (before quantization):

- K: ``K ← K − k̄`` with ``k̄`` the per-channel mean over tokens shifts every score of query
  row ``i`` by the same constant ``q_i·k̄``; softmax is invariant to that. The shift is exact
  for *any* subset of visible keys, so the mean is taken over **all** ``Lkv`` tokens,
  masked or not (simplest, identical in kernels, and it needs no mask).
- Q: ``Q ← Q − q̄_b`` per block ``b`` of :data:`~qattn_compile.blocks.SMOOTH_Q_BLOCK` query
  tokens (mean over the tokens the block really has: the last block may be partial); the
  removed part comes back as ``ΔS = q̄_b·Kᵀ`` (raw dot units, added before the softmax
  scale), so ``Q·Kᵀ = (Q − q̄)·Kᵀ + ΔS`` exactly.
- V: ``V ← V − v̄`` per channel over all tokens; since the normalized probabilities of a row
  sum to 1, ``O = P·(V − v̄) + v̄`` (the reference adds ``v̄`` back to every visible row).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..blocks import SMOOTH_Q_BLOCK
from .quant import num_groups


def smooth_k(k: Tensor) -> tuple[Tensor, Tensor]:
    """Subtract K's per-channel mean over all tokens.

    k: ``[B, H, Lkv, D]``. Returns ``(k - k̄, k̄)`` with ``k̄`` of shape ``[B, H, 1, D]``.
    """
    mean = k.mean(dim=-2, keepdim=True)
    return k - mean, mean


def smooth_v(v: Tensor) -> tuple[Tensor, Tensor]:
    """Subtract V's per-channel mean over all tokens (to be added back to O).

    v: ``[B, H, Lkv, Dv]``. Returns ``(v - v̄, v̄)`` with ``v̄`` of shape ``[B, H, 1, Dv]``.
    """
    return smooth_k(v)


def block_means(x: Tensor, block: int) -> Tensor:
    """Mean over each block of ``block`` consecutive tokens (the last may be partial).

    x: ``[B, H, L, D]``. Returns ``[B, H, ceil(L / block), D]``.
    """
    length = x.shape[-2]
    n_blocks = num_groups(length, block)
    padded = n_blocks * block
    x_padded = torch.nn.functional.pad(x, (0, 0, 0, padded - length)) if padded != length else x
    sums = x_padded.reshape(*x.shape[:-2], n_blocks, block, x.shape[-1]).sum(dim=-2)
    starts = torch.arange(n_blocks, device=x.device, dtype=sums.dtype) * block
    counts = (length - starts).clamp(max=block)  # tokens per block (tensor ops: traceable)
    return sums / counts.unsqueeze(-1)


def expand_blocks(x: Tensor, block: int, length: int) -> Tensor:
    """Per-block rows -> per-token rows: ``[B, H, n_blocks, N]`` -> ``[B, H, length, N]``
    where token ``t`` gets row ``t // block``."""
    return x.repeat_interleave(block, dim=-2)[..., :length, :]


def smooth_q(q: Tensor, block: int = SMOOTH_Q_BLOCK) -> tuple[Tensor, Tensor]:
    """Subtract Q's per-block channel mean.

    q: ``[B, H, Lq, D]``. Returns ``(q - q̄ per token, q̄)`` with ``q̄`` of shape
    ``[B, H, ceil(Lq / block), D]``.
    """
    mean = block_means(q, block)
    return q - expand_blocks(mean, block, q.shape[-2]), mean


def delta_s(q_mean: Tensor, k: Tensor) -> Tensor:
    """The Q-smoothing correction ``ΔS = q̄·Kᵀ`` per query block (raw dot units, no scale).

    q_mean: ``[B, Hq, n_blocks, D]`` (from :func:`smooth_q`); k: ``[B, Hkv, Lkv, D]`` (the K
    the scores use, i.e. already K-smoothed), ``Hq % Hkv == 0`` (GQA: query head ``h`` uses
    kv head ``h // (Hq // Hkv)``). Returns ``[B, Hq, n_blocks, Lkv]``; query token ``t`` of
    block ``t // block`` adds row ``t // block`` to its scores (:func:`expand_blocks`).
    """
    b, hq, n_blocks, d = q_mean.shape
    hkv = k.shape[1]
    grouped = q_mean.reshape(b, hkv, hq // hkv, n_blocks, d)
    out = grouped @ k.unsqueeze(2).transpose(-1, -2)
    return out.reshape(b, hq, n_blocks, k.shape[-2])
