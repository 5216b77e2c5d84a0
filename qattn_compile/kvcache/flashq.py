"""FlashQ KV-cache quantization (TurboAttention), in plain PyTorch: the reference.

The cache layer (:mod:`.cache`), the decode kernel (:mod:`.kernel`)
and the CPU decode path (:func:`reference_decode`) all implement the arithmetic stated here.

Stages, per (batch, kv head), for K and V alike (``x`` is ``[B, H, L, D]``):

1. **INT8, symmetric, per block** of :data:`~qattn_compile.blocks.KV_CACHE_BLOCK` tokens:
   ``s8 = amax(block) / 127``, ``q8 = clamp(round(x / s8), -127, 127)``. This is exactly
   :func:`qattn_compile.reference.quant.quantize_int` with the turbo preset's K/V group
   (``QUANT_BLOCK_KV``), i.e. the INT8 K/V the ``turbo`` prefill attention computes.
2. **Progressive INT4 / INT2, asymmetric, channel-wise per block** (on the INT8 integers, so
   dequantization stays integer arithmetic): per block and channel ``c``,
   ``lo_c = min_t q8``, ``hi_c = max_t q8``, integer step ``step_c = max(ceil((hi_c - lo_c) /
   (2^bits - 1)), 1)`` (so no code clips), ``code = round((q8 - lo_c) / step_c)`` in
   ``[0, 2^bits - 1]``. Dequantization: ``q8' = code·step_c + lo_c`` (an integer in
   ``[-127, 141]``), ``x' = s8·q8'``.
3. **Decode buffer**: tokens that arrive one at a time are quantized to INT8 with one
   *universal* scale per (batch, kv head) fixed at prefill (``amax(prefill) / 127``), values
   beyond it clamp to ±127. When ``n_b`` tokens are buffered they are compressed by stage 2
   as ``n_b / KV_CACHE_BLOCK`` blocks whose ``s8`` is the universal scale. Compressed blocks
   are never touched again.

Packing (:func:`pack_codes`), "split" layout: a token's ``D`` codes take ``M = D·bits/8``
bytes, and byte ``i`` holds channels ``i, i + M, i + 2M, ...`` from the lowest bits up (INT4:
channel ``i`` in bits 0-3, ``i + D/2`` in bits 4-7; INT2: channel ``i + j·D/4`` in bits
``2j, 2j+1``). Each bit field of the ``M`` bytes is then a contiguous run of channels, so the
kernel extracts whole channel ranges with one shift and mask, without reordering registers.

Rounding is half to even everywhere (:func:`torch.round`), divisions are float32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..blocks import KV_CACHE_BLOCK
from ..reference import quant

INT8_QMAX = 127
CODE_BITS = (4, 2)
"""Bit widths of the compressed blocks: INT4 (high-priority heads) and INT2 (the others)."""


def code_levels(bits: int) -> int:
    """Largest code of ``bits``-bit asymmetric quantization (15 for INT4, 3 for INT2)."""
    if bits not in CODE_BITS:
        raise ValueError(f"FlashQ blocks are INT4 or INT2, got bits={bits!r}")
    return (1 << bits) - 1


# ------------------------------------------------------------------------------ stage 1


def int8_blocks(x: Tensor, block: int = KV_CACHE_BLOCK) -> tuple[Tensor, Tensor]:
    """Stage 1 on ``x`` ``[B, H, L, D]`` (``L`` a multiple of ``block``).

    Returns ``(q8, s8)``: int8 ``[B, H, L // block, block, D]`` and float32
    ``[B, H, L // block]``.
    """
    b, h, length, d = x.shape
    if length % block:
        raise ValueError(f"int8_blocks needs whole blocks: {length} tokens, block {block}")
    q8, s8 = quant.quantize_int(x, block, 8)
    return q8.view(b, h, length // block, block, d), s8


def universal_scale(x: Tensor) -> Tensor:
    """The decode buffer's scale: ``amax / 127`` over tokens and channels of ``x`` ``[..., L, D]``.

    Returns float32 ``[...]``, clamped below like every qattn amax.
    """
    return x.float().abs().amax(dim=(-2, -1)).clamp_min(quant.AMAX_MIN) / INT8_QMAX


def quantize_with_scale(x: Tensor, scale: Tensor) -> Tensor:
    """INT8 with a given scale and clamping: ``clamp(round(x / scale), -127, 127)``.

    x: ``[..., T, D]``; scale: ``[...]`` (float32). Returns int8 ``[..., T, D]``.
    """
    return torch.round(x.float() / scale[..., None, None]).clamp_(-INT8_QMAX, INT8_QMAX).to(torch.int8)


# ------------------------------------------------------------------------------ stage 2


def progressive_quantize(q8: Tensor, bits: int) -> tuple[Tensor, Tensor, Tensor]:
    """Stage 2 on INT8 blocks ``q8`` ``[..., T, D]`` (one block = the ``T`` tokens).

    Returns ``(codes, step, lo)``: uint8 ``[..., T, D]`` in ``[0, 2^bits - 1]``, uint8
    ``[..., D]`` in ``[1, 254]`` and int8 ``[..., D]``.
    """
    levels = code_levels(bits)
    q = q8.to(torch.int16)
    lo = q.amin(dim=-2)
    span = q.amax(dim=-2) - lo
    step = torch.div(span + (levels - 1), levels, rounding_mode="floor").clamp_(min=1)
    codes = torch.round((q - lo.unsqueeze(-2)).float() / step.unsqueeze(-2).float())
    return codes.clamp_(0, levels).to(torch.uint8), step.to(torch.uint8), lo.to(torch.int8)


def progressive_dequantize(codes: Tensor, step: Tensor, lo: Tensor) -> Tensor:
    """``code·step + lo`` per channel: codes ``[..., T, D]``, step/lo ``[..., D]`` → int16."""
    return codes.to(torch.int16) * step.to(torch.int16).unsqueeze(-2) + lo.to(torch.int16).unsqueeze(-2)


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """Pack codes ``[..., D]`` (``D`` a multiple of ``8 // bits``) into uint8 ``[..., D·bits/8]``
    in the split layout (module docstring)."""
    per_byte = 8 // bits
    if codes.shape[-1] % per_byte:
        raise ValueError(f"INT{bits} packing needs a head dim divisible by {per_byte}, got {codes.shape[-1]}")
    fields = codes.to(torch.int32).unflatten(-1, (per_byte, -1))  # [..., field, byte]
    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * bits
    return (fields << shifts[:, None]).sum(dim=-2).to(torch.uint8)


def unpack_codes(packed: Tensor, bits: int) -> Tensor:
    """Inverse of :func:`pack_codes`: uint8 ``[..., M]`` → uint8 codes ``[..., M·8/bits]``."""
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, device=packed.device, dtype=torch.int32) * bits
    fields = (packed.to(torch.int32).unsqueeze(-2) >> shifts[:, None]) & code_levels(bits)
    return fields.flatten(-2).to(torch.uint8)


# ------------------------------------------------------------------------------ storage


class FlashQTensors(NamedTuple):
    """One layer's FlashQ storage, as the decode op and kernel read it.

    ``NB`` blocks of ``KV_CACHE_BLOCK`` tokens cover the capacity ``T = NB·KV_CACHE_BLOCK``;
    ``H`` = kv heads, ``n4 + n2 = H``; the leading axis of size 2 is (K, V).

    - ``codes4``: uint8 ``[2, B, n4, T, D/2]``, packed INT4 codes of the heads in ``heads4``.
    - ``codes2``: uint8 ``[2, B, n2, T, D/4]``, packed INT2 codes of the heads in ``heads2``.
    - ``step``: uint8 ``[2, B, H, NB, D]``; ``lo``: int8 ``[2, B, H, NB, D]`` (stage 2).
    - ``scale8``: float32 ``[2, B, H, NB]`` (stage-1 scale of each block).
    - ``buf``: int8 ``[2, B, H, n_b, D]`` (decode buffer); ``buf_scale``: float32
      ``[2, B, H]`` (universal scales).
    - ``heads4``, ``heads2``: int32 ``[n4]``, ``[n2]`` (kv head of each slot), each in
      increasing head order, so that a single-format cache's map is the identity (the decode
      kernel then does not read it).
    - ``length``: int64 ``[]``, tokens stored. Tokens ``[0, C)`` with
      ``C = (length // n_b)·n_b`` are in compressed blocks, ``[C, length)`` in ``buf``.
    """

    codes4: Tensor
    codes2: Tensor
    step: Tensor
    lo: Tensor
    scale8: Tensor
    buf: Tensor
    buf_scale: Tensor
    heads4: Tensor
    heads2: Tensor
    length: Tensor


def dequantize_blocks(t: FlashQTensors, n_blocks: int) -> Tensor:
    """Float32 K/V of the first ``n_blocks`` compressed blocks: ``[2, B, H, n_blocks·64, D]``."""
    _, b, h, _, d = t.step.shape
    tokens = n_blocks * KV_CACHE_BLOCK
    out = torch.empty(2, b, h, tokens, d, dtype=torch.float32, device=t.step.device)
    for codes, heads, bits in ((t.codes4, t.heads4, 4), (t.codes2, t.heads2, 2)):
        if heads.numel() == 0:
            continue
        idx = heads.long()
        unpacked = unpack_codes(codes[..., :tokens, :], bits)
        blocks = unpacked.unflatten(-2, (n_blocks, KV_CACHE_BLOCK))
        q8 = progressive_dequantize(
            blocks, t.step[:, :, idx, :n_blocks], t.lo[:, :, idx, :n_blocks]
        ).float()
        x = q8 * t.scale8[:, :, idx, :n_blocks, None, None]
        out.index_copy_(2, idx, x.flatten(-3, -2))
    return out


def dequantize(t: FlashQTensors) -> Tensor:
    """Float32 K/V of every stored token: ``[2, B, H, length, D]`` (reads ``length`` on the host)."""
    length = int(t.length)
    n_b = t.buf.shape[-2]
    compressed = (length // n_b) * n_b
    blocks = dequantize_blocks(t, compressed // KV_CACHE_BLOCK)
    buffered = t.buf[..., : length - compressed, :].float() * t.buf_scale[..., None, None]
    return torch.cat((blocks, buffered), dim=-2)


def check_decode_args(q: Tensor, t: FlashQTensors, attn_mask: Tensor | None) -> None:
    """Raise ``ValueError`` naming the tensor when ``q`` ``[B, Hq, Lq, D]`` or ``attn_mask``
    does not fit the cache ``t`` (:func:`reference_decode` states the contract)."""
    _, b, h, _, d = t.step.shape
    if q.dim() != 4:
        raise ValueError(f"decode q must be [B, Hq, Lq, D], got shape {tuple(q.shape)}")
    if q.shape[0] != b or q.shape[-1] != d:
        raise ValueError(f"decode q {tuple(q.shape)} does not fit the cache's batch {b} and head dim {d}")
    if q.shape[1] < h or q.shape[1] % h:
        raise ValueError(f"decode q has {q.shape[1]} heads, not a multiple of the cache's {h} kv heads")
    if attn_mask is None:
        return
    shape = tuple(attn_mask.shape)
    if not (attn_mask.dtype == torch.bool or attn_mask.is_floating_point()):
        raise ValueError(f"decode attn_mask must be bool or floating point, got {attn_mask.dtype}")
    if attn_mask.device != q.device:
        raise ValueError(f"decode attn_mask is on {attn_mask.device}, q on {q.device}")
    rows = q.shape[:3]
    if not 1 <= len(shape) <= 4 or any(m not in (1, n) for m, n in zip(shape[-2::-1], rows[::-1])):
        raise ValueError(f"decode attn_mask {shape} does not broadcast to [B, Hq, Lq, keys] = "
                         f"[{', '.join(map(str, rows))}, keys]")


def reference_decode(
    q: Tensor, t: FlashQTensors, attn_mask: Tensor | None = None, scale: float | None = None
) -> Tensor:
    """Decode attention of the newest ``Lq`` queries over a FlashQ cache, in float32.

    q: ``[B, Hq, Lq, D]`` (``Hq`` a multiple of the kv heads ``H``; query head ``i`` reads kv
    head ``i // (Hq // H)``); the queries are the last ``Lq`` stored tokens, so query ``i``
    sees keys ``j <= length - Lq + i``. attn_mask: None, bool (True = attend) or additive,
    broadcastable to ``[B, Hq, Lq, keys]`` with one column (every key) or at least
    ``length`` (only the first ``length`` are read; transformers passes ``max_cache_len``).
    A row with no visible key gives 0. Returns float32 ``[B, Hq, Lq, D]``.
    """
    check_decode_args(q, t, attn_mask)
    kv = dequantize(t)
    b, hq, lq, d = q.shape
    h, length = kv.shape[2], kv.shape[-2]
    if attn_mask is not None and 1 < attn_mask.shape[-1] < length:
        raise ValueError(f"decode attn_mask {tuple(attn_mask.shape)} has fewer columns than the "
                         f"{length} stored tokens")
    k = kv[0].repeat_interleave(hq // h, dim=1)
    v = kv[1].repeat_interleave(hq // h, dim=1)
    tau = d**-0.5 if scale is None else scale
    scores = (q.float() @ k.transpose(-1, -2)) * tau
    query_pos = torch.arange(length - lq, length, device=q.device)
    visible = torch.arange(length, device=q.device)[None, :] <= query_pos[:, None]
    if attn_mask is not None:
        mask = attn_mask[..., :length]
        if mask.dtype == torch.bool:
            visible = visible & mask
        else:
            scores = scores + mask.float()
    scores = scores.masked_fill(~visible, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    p = torch.exp(scores - row_max)
    denom = p.sum(dim=-1, keepdim=True)
    return torch.where(denom > 0, (p @ v) / denom.clamp_min(1e-30), torch.zeros_like(q, dtype=torch.float32))
