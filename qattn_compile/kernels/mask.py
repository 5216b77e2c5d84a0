"""Per-tile summary of an attention mask, so the attention kernel reads the mask cheaply.

A mask is ``None``, bool (True = attend) or additive float, broadcastable to ``[B, Hq, Lq,
Lkv]``. For every (batch, head, query tile, key tile) the summary holds one code:

- :data:`TILE_SKIP` (0): every element is masked out (bool False / float ``-inf``); the
  kernel skips the tile.
- :data:`TILE_FULL` (1): every element is a no-op (bool True / float ``0``); the kernel
  computes the tile without loading the mask.
- :data:`TILE_MIXED` (2): anything else; the kernel loads the mask tile.

The summary is computed on the mask's own (un-broadcast) shape with torch reductions and
then expanded (stride 0) like the mask itself, so a ``[B, 1, 1, Lkv]`` padding mask costs one
row of codes per key tile. Nothing of size ``[B, Hq, Lq, Lkv]`` is ever materialized.

The kernel does not branch on the codes (a branch around the loads would stop Triton from
pipelining them): every query tile gets the compacted list of its key tiles that are not
skipped (:attr:`MaskPlan.tiles`, :attr:`MaskPlan.counts`) and loops over that list only,
reading the mask with a load predicated on the tile being mixed. With ``is_causal`` the
tiles entirely above the diagonal are skipped as well.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

TILE_SKIP = 0
TILE_FULL = 1
TILE_MIXED = 2


@dataclass(frozen=True)
class MaskPlan:
    """A mask ready for the kernel.

    ``values``: the mask expanded (a view, stride 0 on broadcast dims) to ``[B, Hq, Lq,
    Lkv]``, in its own dtype: a bool mask reaches the kernel as is (Triton loads a bool
    pointer as bytes and gives ``int1``), so there is no copy and no dtype view (which
    Inductor cannot lower for bool). ``summary``: int8 codes expanded to ``[B, Hq,
    n_m_tiles, n_n_tiles]``. ``tiles``: int32 ``[B, Hq, n_m_tiles, n_n_tiles]`` (expanded
    likewise), per query tile the key-tile indices that are not skipped, ascending, first;
    ``counts``: int32 ``[B, Hq, n_m_tiles]`` how many. ``is_bool``: bool (keep/drop) or
    additive float mask.
    """

    values: Tensor
    summary: Tensor
    tiles: Tensor
    counts: Tensor
    is_bool: bool


def _as_4d(mask: Tensor) -> Tensor:
    """View ``mask`` with leading size-1 dims added up to 4 dims (``[Bm, Hm, Lqm, Lkvm]``)."""
    if mask.dim() > 4:
        raise ValueError(f"attn_mask must have at most 4 dims, got shape {tuple(mask.shape)}")
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))


def _reduce_blocks(flags: Tensor, dim: int, block: int, reduce: Callable[..., Tensor]) -> Tensor:
    """``reduce`` (``torch.any``/``torch.all``) of bool ``flags`` over consecutive blocks of
    ``block`` along ``dim`` (2 or 3 of a 4-D tensor); a last partial block is reduced over
    what it has (``any``/``all`` of the elements present, the same as padding it with
    ``False``/``True``). Returns ``flags`` with ``dim`` of size ``ceil(size / block)``.

    Nothing is padded: the whole blocks are a view of ``flags`` (a slice split in two dims)
    and the partial block a slice.
    """
    size = flags.shape[dim]
    whole = size // block * block
    parts = []
    if whole:
        head = flags.narrow(dim, 0, whole)
        blocks = head.reshape(*head.shape[:dim], whole // block, block, *head.shape[dim + 1:])
        parts.append(reduce(blocks, dim=dim + 1))
    if whole < size:
        parts.append(reduce(flags.narrow(dim, whole, size - whole), dim=dim, keepdim=True))
    return torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0]


def _tile_reduce(flags: Tensor, block_m: int, block_n: int, reduce: Callable[..., Tensor]) -> Tensor:
    """``reduce`` (``torch.any``/``torch.all``) of bool ``flags`` ``[Bm, Hm, Lm, Ln]`` over
    tiles of ``block_m × block_n`` (``block_m`` is 1 when ``Lm == 1``, a broadcast query
    axis); partial tiles reduce over their in-range elements. Returns bool ``[Bm, Hm,
    ceil(Lm / block_m), ceil(Ln / block_n)]``. The key axis is reduced first, so the
    second reduction reads a tensor ``block_n`` times smaller."""
    rows = _reduce_blocks(flags, 3, block_n, reduce)
    return _reduce_blocks(rows, 2, block_m, reduce) if flags.shape[2] > 1 else rows


def tile_summary(mask: Tensor, block_m: int, block_n: int) -> Tensor:
    """Codes (``TILE_*``) of ``mask`` ``[Bm, Hm, Lqm, Lkvm]`` per ``block_m × block_n`` tile.

    Returns int8 ``[Bm, Hm, n_m, n_n]`` (``n_m = 1`` when the query axis is broadcast).
    Out-of-range elements of partial tiles count as neither visible nor mixed.
    """
    if mask.dtype == torch.bool:
        visible, noop = mask, mask
    else:
        visible, noop = mask != float("-inf"), mask == 0
    any_visible = _tile_reduce(visible, block_m, block_n, torch.any)
    all_noop = _tile_reduce(noop, block_m, block_n, torch.all)
    codes = torch.where(all_noop, TILE_FULL, TILE_MIXED)
    return torch.where(any_visible, codes, TILE_SKIP).to(torch.int8)


def _causal_tiles(n_m: int, n_n: int, block_m: int, block_n: int, device) -> Tensor:
    """bool ``[n_m, n_n]``: key tile ``n`` has a key visible (``j <= i``) to query tile ``m``."""
    first_key = torch.arange(n_n, device=device) * block_n
    last_query = torch.arange(n_m, device=device) * block_m + block_m - 1
    return first_key[None, :] <= last_query[:, None]


def plan_mask(
    attn_mask: Tensor | None,
    shape: tuple[int, int, int, int],
    block_m: int,
    block_n: int,
    is_causal: bool = False,
) -> MaskPlan | None:
    """Prepare ``attn_mask`` for a ``[B, Hq, Lq, Lkv]`` (``shape``) score matrix tiled
    ``block_m × block_n``; ``None`` when there is no mask. ``is_causal`` also skips the key
    tiles above the diagonal (the kernel masks the diagonal tiles itself)."""
    if attn_mask is None:
        return None
    bsz, heads, lq, lkv = shape
    mask4 = _as_4d(attn_mask)
    try:
        values = mask4.expand(bsz, heads, lq, lkv)
    except RuntimeError as exc:
        raise ValueError(
            f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to {tuple(shape)}"
        ) from exc
    n_m, n_n = -(-lq // block_m), -(-lkv // block_n)
    # A mask broadcast along the keys ([..., 1]) summarises to one code per query tile,
    # which every key tile shares: expanded before the live lists are built from it.
    codes = tile_summary(mask4, block_m, block_n)
    codes = codes.expand(*codes.shape[:3], n_n)
    if is_causal:
        visible = _causal_tiles(n_m, n_n, block_m, block_n, codes.device)
        codes = torch.where(visible, codes.expand(*codes.shape[:2], n_m, n_n), TILE_SKIP)
    live = codes != TILE_SKIP
    tiles = torch.argsort(live.logical_not().to(torch.int8), dim=-1, stable=True)
    counts = live.sum(dim=-1, dtype=torch.int32)
    return MaskPlan(
        values=values,
        summary=codes.expand(bsz, heads, n_m, n_n),
        tiles=tiles.to(torch.int32).expand(bsz, heads, n_m, n_n),
        counts=counts.expand(bsz, heads, n_m),
        is_bool=attn_mask.dtype == torch.bool,
    )
