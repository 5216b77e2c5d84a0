"""The one place for token-group sizes shared by quantizers, references and kernels.

A quantization *granularity* names how many consecutive tokens share one scale:

- ``token``: every token has its own scale (group of 1).
- ``warp``: groups of :data:`QUANT_WARP_Q` query tokens (the rows one warp owns in a
  Hopper ``m64`` warpgroup MMA), SageAttention2's per-warp scheme. Keys use
  :data:`QUANT_BLOCK_KV` in this mode.
- ``block``: groups of :data:`QUANT_BLOCK_Q` query tokens / :data:`QUANT_BLOCK_KV` key or
  value tokens (SageAttention's per-block scheme; TurboAttention's B_r / B_c blocks).
- ``q_token``: every query token has its own scale, keys and values per
  :data:`QUANT_BLOCK_KV` tokens (``fp8``). A query's scale multiplies its score row, which
  the kernel does once per tile; a per-key scale would cost a multiply per score.
- ``tensor``: one scale per (batch, head).

``fp8`` reads its groups from :func:`fp8_group_sizes`: its ``block`` is Q per token with K
and V per :data:`FP8_KV_BLOCK` tokens. ``int_flash`` reads its Q/K groups from
:func:`int_flash_group_sizes`: Q per token, K per token or per :data:`FP8_BLOCK` tokens;
:func:`int_flash_v_group`: V per :data:`FP8_BLOCK` tokens or per tensor.

Kernels load scales by token index (``token // group``), so most tile sizes work with any
group; the few constraints between the attention tiles and these groups (per-block V
scales, the Q-smoothing block, :data:`V_KEY_BLOCK`) are listed and checked in
:mod:`qattn_compile.kernels.heuristics`.
"""

QUANT_WARP_Q = 16
QUANT_BLOCK_Q = 128
QUANT_BLOCK_KV = 64
FP8_BLOCK = 128
"""Tokens per K and V scale of ``fp8``'s ``block`` granularity: the key tile of its
long-sequence kernels, which a per-block V scale must span (with K and V per 64 tokens the
tile was capped at 64 keys, and slower: docs/performance.md)."""
FP8_KV_BLOCK = 256
"""Tokens per K and V scale of ``fp8``'s ``block`` granularity: the key tile of the Hopper
tier-2 kernel (:mod:`qattn_compile.kernels.tiers`), which takes one K and one V scale per
tile; tier 1's key tiles divide it."""
SMOOTH_Q_BLOCK = QUANT_BLOCK_Q  # tokens that share one q̄ in SageAttention2's Q smoothing
P_KEY_TILE = 64
"""Keys per tile over which the reference takes integer P's max under ``p_scale: tile``
when the caller does not pass the kernel's key tile (``key_tile``). A kernel's tile is its
``block_n`` from :mod:`qattn_compile.kernels.heuristics` (a multiple of 32, which depends on
the preset, head dim and arch); tests pass it so that reference and kernel quantize P over
the same keys."""
KV_CACHE_BLOCK = QUANT_BLOCK_KV  # tokens per FlashQ KV-cache block (turbo's B_c: the prefill's INT8 groups)
V_KEY_BLOCK = 32
"""Tokens per block within which the attention kernel's 8-bit V (transposed ``[B, H, D,
L_pad]``) stores its tokens permuted, so that the attention kernel's 8-bit P·V dot takes P
straight from the registers the score MMA left it in (no shuffles between lanes):
:func:`qattn_compile.kernels.primitives.v_column_of_token` gives the order, and ``L_pad``
is a whole number of these blocks (padding tokens are stored as zeros)."""


def group_sizes(granularity: str, q_len: int, kv_len: int) -> tuple[int, int]:
    """Tokens per scale for (Q, K/V) under ``granularity``; ``tensor`` spans the whole length."""
    if granularity == "token":
        return 1, 1
    if granularity == "q_token":
        return 1, QUANT_BLOCK_KV
    if granularity == "warp":
        return QUANT_WARP_Q, QUANT_BLOCK_KV
    if granularity == "block":
        return QUANT_BLOCK_Q, QUANT_BLOCK_KV
    if granularity == "tensor":
        return max(q_len, 1), max(kv_len, 1)
    raise ValueError(f"unknown granularity {granularity!r}; expected token, q_token, warp, "
                     "block or tensor")


def fp8_group_sizes(granularity: str, q_len: int, kv_len: int) -> tuple[int, int]:
    """Tokens per scale for (Q, K/V) of ``fp8``: :func:`group_sizes`, except that ``block``
    is Q per token with K and V per :data:`FP8_KV_BLOCK` tokens. Q per token costs nothing in
    the kernel (a query's scale multiplies its score row, once per tile), is the finest Q
    scale, and lets Inductor write Q's quantization into its RoPE kernel (one reduction per
    token); per block it took a pass of its own (docs/performance.md)."""
    if granularity == "block":
        return 1, FP8_KV_BLOCK
    return group_sizes(granularity, q_len, kv_len)


def int_flash_group_sizes(k_granularity: str, q_len: int, kv_len: int) -> tuple[int, int]:
    """Tokens per scale for (Q, K) of ``int_flash``: Q per token; K per :data:`FP8_BLOCK`
    tokens (``block``, the default: one K scale per 128-key tile, which the kernel folds into
    the rows' scale instead of multiplying each score by its key's: fewer registers, faster;
    docs/performance.md) or per token (``token``, the paper's)."""
    if k_granularity == "block":
        return 1, FP8_BLOCK
    return group_sizes(k_granularity, q_len, kv_len)


def int_flash_v_group(v_granularity: str, kv_len: int) -> int:
    """Tokens per INT8 V scale of ``int_flash``: :data:`FP8_BLOCK` (``block``, the default:
    one scale per 128-key tile, computed inside V's one quantizer pass) or all ``kv_len``
    tokens (``tensor``, the paper's: a statistics pass first). Per tensor, a row whose keys
    hold V values far smaller than the tensor's largest gets a few INT8 levels: with V token
    magnitudes spread 0.1–10 along the sequence, causal rows early in it lose most of their
    accuracy per tensor; per block costs no time (docs/performance.md)."""
    return int_flash_group_sizes(v_granularity, 1, kv_len)[1]
