"""The FlashQ KV cache as a ``transformers`` cache: :class:`FlashQCache` and its layers.

Usage::

    cache = FlashQCache.from_policy(model, "policy.yaml", max_cache_len=4096)
    model.generate(input_ids, past_key_values=cache, max_new_tokens=256)

Storage is preallocated for ``max_cache_len`` tokens and every tensor keeps its address
(as transformers' ``StaticLayer``), the stored length is a device tensor, and a decode step
has no data-dependent Python branch, so one compiled graph serves every decode step
(``torch.compile`` with ``backend="qattn"``, CUDA graphs included).

What ``update`` returns, i.e. which attention runs:

- ``attn_implementation="qattn_kv"`` (:mod:`.attention`): a :class:`FlashQView`. Prefill
  attention runs on the fresh K/V (SDPA, which ``backend="qattn"`` rewrites per the policy);
  decode steps run ``torch.ops.qattn.flashq_decode``, which reads the packed cache directly
  (Triton kernel on CUDA, :func:`.flashq.reference_decode` elsewhere). No float copy of the
  cache is made.
- any other implementation (``sdpa``, ``eager``, ...): dense K/V ``[B, H, max_cache_len, D]``
  in the model dtype, as ``StaticLayer`` does: the fresh K/V at prefill (zero-padded), the
  dequantized cache afterwards. Correct everywhere, but it materializes a float copy of the
  cache at every step.

A cache holds one sequence per batch row. ``generate`` takes what a cache passed to it holds
as the start of the prompt (prefix reuse), so a cache reused for a new prompt must be emptied
first: ``cache.reset()`` (storage kept; the next update is a prefill again).

Decode-step cost besides attention: the new token is quantized into the INT8 buffer and the
whole buffer (``n_b`` tokens) is compressed into the block slot it will occupy. The slot is
only read once the buffer is full, so this is the "compress when full" rule without a
branch; older blocks are never rewritten.
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin, StaticLayer, StaticSlidingWindowLayer

from .. import _compat
from ..blocks import KV_CACHE_BLOCK
from ..errors import PolicyError
from ..policy import KVCacheLayer, KVCachePolicy, load_policy, match_pattern
from . import flashq
from .priority import assign_int2_heads

log = logging.getLogger("qattn_compile.kvcache")

KV_ATTENTION = "qattn_kv"
"""The ``attn_implementation`` name whose attention reads the packed cache (:mod:`.attention`)."""
MAX_STEP_TOKENS = 16
"""Updates of at most this many tokens go token by token through the decode buffer (one
compiled graph per token count); longer ones after the prefill are eager-only."""


class FlashQView(NamedTuple):
    """What :meth:`FlashQCache.update` returns as both "keys" and "values" under ``qattn_kv``.

    ``layer``: the cache layer (already updated). ``key_states``/``value_states``: the fresh
    ``[B, H, T, D]`` K/V of this update. ``prefill``: True if this update filled an empty layer
    (attention then runs on the fresh K/V alone).
    """

    layer: "FlashQLayer"
    key_states: Tensor
    value_states: Tensor
    prefill: bool


def _mark_static(tensors) -> None:
    if not torch.compiler.is_compiling():
        for t in tensors:
            _compat.mark_static_address(t)


class FlashQLayer(CacheLayerMixin):
    """One attention layer's FlashQ cache (layout: :class:`.flashq.FlashQTensors`).

    Args:
        max_cache_len: tokens the layer can hold (prompt + generated).
        int2_heads: kv heads stored in INT2 (the lowest priority ones, chosen at prefill).
        buffer_tokens: ``n_b``, the INT8 decode buffer; a multiple of ``KV_CACHE_BLOCK``.
    """

    is_compileable = True
    is_sliding = False
    is_croppable = False

    def __init__(self, max_cache_len: int, int2_heads: int = 0, buffer_tokens: int = KV_CACHE_BLOCK):
        super().__init__()
        if buffer_tokens <= 0 or buffer_tokens % KV_CACHE_BLOCK:
            raise ValueError(f"buffer_tokens must be a positive multiple of {KV_CACHE_BLOCK}, got {buffer_tokens}")
        if int2_heads < 0:
            raise ValueError(f"int2_heads must be >= 0, got {int2_heads}")
        self.max_cache_len = max_cache_len
        self.int2_heads = int2_heads
        self.buffer_tokens = buffer_tokens
        self.prefilled = False
        self.length = torch.zeros((), dtype=torch.int64)

    # ------------------------------------------------------------------ allocation

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        """Allocate the storage from the first K/V's batch, heads, head dim, dtype, device."""
        b, h, _, d = key_states.shape
        if value_states.shape[-1] != d:
            raise ValueError(f"FlashQ needs equal K and V head dims, got {d} and {value_states.shape[-1]}")
        if d % 4:
            raise ValueError(f"FlashQ packs INT2 codes four per byte: head dim {d} is not a multiple of 4")
        if self.int2_heads > h:
            raise ValueError(f"int2_heads={self.int2_heads} but the layer has {h} kv heads")
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads, self.head_dim = b, h, d
        n_b = self.buffer_tokens
        capacity = (math.ceil(self.max_cache_len / n_b) + 1) * n_b  # + one spare buffer chunk
        n_blocks = capacity // KV_CACHE_BLOCK
        n2 = self.int2_heads
        n4 = h - n2
        dev = self.device
        self.codes4 = torch.zeros(2, b, n4, capacity, d // 2, dtype=torch.uint8, device=dev)
        self.codes2 = torch.zeros(2, b, n2, capacity, d // 4, dtype=torch.uint8, device=dev)
        self.step = torch.ones(2, b, h, n_blocks, d, dtype=torch.uint8, device=dev)
        self.lo = torch.zeros(2, b, h, n_blocks, d, dtype=torch.int8, device=dev)
        self.scale8 = torch.zeros(2, b, h, n_blocks, dtype=torch.float32, device=dev)
        self.buf = torch.zeros(2, b, h, n_b, d, dtype=torch.int8, device=dev)
        self.buf_scale = torch.ones(2, b, h, dtype=torch.float32, device=dev)
        self.heads4 = torch.arange(n2, h, dtype=torch.int32, device=dev)
        self.heads2 = torch.arange(n2, dtype=torch.int32, device=dev)
        self.length = self.length.to(dev)
        _mark_static(self.tensors())
        self.is_initialized = True

    def tensors(self) -> flashq.FlashQTensors:
        """The storage in the decode op's argument order."""
        return flashq.FlashQTensors(
            self.codes4, self.codes2, self.step, self.lo, self.scale8,
            self.buf, self.buf_scale, self.heads4, self.heads2, self.length,
        )

    # ------------------------------------------------------------------ writing

    def append(self, key_states: Tensor, value_states: Tensor) -> bool:
        """Store ``[B, H, T, D]`` K/V; returns True if this was the prefill (first update).

        More tokens than ``max_cache_len`` holds raise in eager calls (a device sync per
        call); under ``torch.compile`` the length lives on the device and is not checked, so
        size the cache for the prompt plus the tokens to generate."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        tokens = key_states.shape[-2]
        if not self.prefilled:
            self._prefill(torch.stack((key_states, value_states)))
            self.prefilled = True
            return True
        if not torch.compiler.is_compiling() and int(self.length) + tokens > self.max_cache_len:
            stored = int(self.length)
            raise ValueError(
                f"FlashQ cache: {stored} stored + {tokens} new tokens exceed "
                f"max_cache_len={self.max_cache_len}. {_reuse_hint(stored)}; to continue this "
                f"sequence, make the cache with max_cache_len >= {stored + tokens}"
            )
        if tokens <= MAX_STEP_TOKENS:
            for i in range(tokens):
                self._append_token(torch.stack((key_states[:, :, i : i + 1], value_states[:, :, i : i + 1])))
        else:
            self._append_bulk(torch.stack((key_states, value_states)))
        return False

    def _prefill(self, kv: Tensor) -> None:
        """Fill the empty layer with ``kv`` ``[2, B, H, L, D]``: whole ``n_b`` chunks as
        blocks (stage 1 per block, as the turbo prefill quantizes K/V), the rest to the buffer."""
        tokens = kv.shape[-2]
        if tokens > self.max_cache_len:
            raise ValueError(f"prompt of {tokens} tokens exceeds max_cache_len={self.max_cache_len}")
        heads4, heads2 = assign_int2_heads(kv[0], kv[1], self.int2_heads)
        self.heads4.copy_(heads4)
        self.heads2.copy_(heads2)
        self.buf_scale.copy_(flashq.universal_scale(kv))
        whole = (tokens // self.buffer_tokens) * self.buffer_tokens
        if whole:
            self._store_int8_tokens(kv[..., :whole, :], first_block=0)
        if tokens > whole:
            self.buf[..., : tokens - whole, :] = flashq.quantize_with_scale(kv[..., whole:, :], self.buf_scale)
        self.length.fill_(tokens)

    def _append_token(self, kv: Tensor) -> None:
        """One token ``[2, B, H, 1, D]``: into the buffer, then the buffer into its block slot."""
        n_b = self.buffer_tokens
        pos = self.length
        self.buf.index_copy_(3, (pos % n_b).view(1), flashq.quantize_with_scale(kv, self.buf_scale))
        per_chunk = n_b // KV_CACHE_BLOCK
        s8 = self.buf_scale.unsqueeze(-1).expand(*self.buf_scale.shape, per_chunk)
        self._store_blocks(self.buf.unflatten(3, (per_chunk, KV_CACHE_BLOCK)), s8, (pos // n_b) * per_chunk)
        self.length.add_(1)

    def _append_bulk(self, kv: Tensor) -> None:
        """Many tokens after the prefill (chunked prefill, a new turn); eager only.

        Tokens completing the current buffer go through it; whole ``n_b`` chunks after that are
        stored like the prefill's; the rest go through the buffer again.
        """
        if torch.compiler.is_compiling():
            raise NotImplementedError(
                f"FlashQ cache: an update of {kv.shape[-2]} tokens after the prefill under "
                f"torch.compile (at most {MAX_STEP_TOKENS}); run chunked prefill eagerly"
            )
        tokens, start = kv.shape[-2], int(self.length)  # the capacity was checked by append
        head = min(tokens, -start % self.buffer_tokens)
        whole = (tokens - head) // self.buffer_tokens * self.buffer_tokens
        for i in range(head):
            self._append_token(kv[..., i : i + 1, :])
        if whole:
            self._store_int8_tokens(kv[..., head : head + whole, :], first_block=(start + head) // KV_CACHE_BLOCK)
            self.length.add_(whole)
        for i in range(head + whole, tokens):
            self._append_token(kv[..., i : i + 1, :])

    def _store_int8_tokens(self, kv: Tensor, first_block: int) -> None:
        """Stage 1 per block then stage 2 for ``kv`` ``[2, B, H, T, D]`` (``T`` whole blocks)."""
        q8, s8 = flashq.int8_blocks(kv.flatten(0, 1))
        self._store_blocks(q8.unflatten(0, (2, -1)), s8.unflatten(0, (2, -1)), first_block)

    def _store_blocks(self, q8: Tensor, s8: Tensor, first_block: int | Tensor) -> None:
        """Compress INT8 blocks ``q8`` ``[2, B, H, nb, 64, D]`` (stage-1 scales ``s8``
        ``[2, B, H, nb]``) into block slots ``first_block .. first_block + nb - 1``."""
        nb = q8.shape[3]
        dev = q8.device
        blocks = first_block + torch.arange(nb, device=dev)
        tokens = first_block * KV_CACHE_BLOCK + torch.arange(nb * KV_CACHE_BLOCK, device=dev)
        step = torch.empty(*q8.shape[:4], q8.shape[-1], dtype=torch.uint8, device=dev)
        lo = torch.empty_like(step, dtype=torch.int8)
        for store, heads, bits in ((self.codes4, self.heads4, 4), (self.codes2, self.heads2, 2)):
            if heads.numel() == 0:
                continue
            idx = heads.long()
            codes, head_step, head_lo = flashq.progressive_quantize(q8.index_select(2, idx), bits)
            store.index_copy_(3, tokens, flashq.pack_codes(codes, bits).flatten(3, 4))
            step.index_copy_(2, idx, head_step)
            lo.index_copy_(2, idx, head_lo)
        self.step.index_copy_(3, blocks, step)
        self.lo.index_copy_(3, blocks, lo)
        self.scale8.index_copy_(3, blocks, s8.float())

    # ------------------------------------------------------------------ reading

    def dequantized(self) -> tuple[Tensor, Tensor]:
        """Dense K, V ``[B, H, max_cache_len, D]`` in the model dtype (tokens past ``length``
        hold stale values: the attention mask hides them, as for ``StaticLayer``)."""
        t = self.tensors()
        kv = flashq.dequantize_blocks(t, self.step.shape[3])
        buffered = self.buf.float() * self.buf_scale[..., None, None]
        chunk = (self.length // self.buffer_tokens).view(1)
        kv.unflatten(3, (-1, self.buffer_tokens)).index_copy_(3, chunk, buffered.unsqueeze(3))
        kv = kv[..., : self.max_cache_len, :].to(self.dtype)
        return kv[0], kv[1]

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Store the K/V and return dense ``[B, H, max_cache_len, D]`` K/V (see the module doc)."""
        if self.append(key_states, value_states):
            pad = (0, 0, 0, self.max_cache_len - key_states.shape[-2])
            return F.pad(key_states, pad), F.pad(value_states, pad)
        return self.dequantized()

    # ------------------------------------------------------------------ cache API

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """Masks span the whole static capacity (as ``StaticLayer``). A forward of no token
        on a filled layer (``generate`` given a cache that holds the whole prompt) raises."""
        if query_length == 0 and self.prefilled:
            stored = int(self.length)
            raise ValueError(f"FlashQ cache: a forward of 0 new tokens after {stored} stored. "
                             f"{_reuse_hint(stored)}")
        return self.max_cache_len, 0

    def get_seq_length(self) -> Tensor | int:
        """Stored tokens (a device tensor once initialized, so compiled graphs don't guard on it)."""
        return self.length if self.is_initialized else 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        """Forget the stored tokens (storage kept; the next update is a prefill again)."""
        if self.is_initialized:
            self.length.zero_()
        self.prefilled = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the batch (beam search), in place so that addresses stay static."""
        if not self.is_initialized:
            return
        idx = beam_idx.to(self.device)
        for t in (self.codes4, self.codes2, self.step, self.lo, self.scale8, self.buf, self.buf_scale):
            t.copy_(t.index_select(1, idx))

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("FlashQ cache blocks are compressed in place: crop is not supported")

    def storage_bytes(self) -> int:
        """Bytes of every allocated tensor of the layer (0 before the first update)."""
        if not self.is_initialized:
            return 0
        return sum(t.numel() * t.element_size() for t in self.tensors())


class FlashQCache(Cache):
    """A ``transformers`` cache whose full-attention layers store FlashQ K/V.

    Args:
        config: the model config (its text config is used; the cache reads
            ``num_hidden_layers``, ``layer_types``, ``sliding_window`` and, at every update,
            ``_attn_implementation``).
        max_cache_len: tokens each layer can hold (prompt + generated).
        settings: one :class:`~qattn_compile.policy.KVCacheLayer` for every layer, or a list
            with one per layer (default: INT4 on every head, ``n_b = KV_CACHE_BLOCK``).
            Layers with ``format: none``, and sliding-window layers, get transformers'
            static layers (model dtype). An ``int2_heads`` above the model's kv heads per
            layer is capped there (every head in INT2), with a warning.
    """

    def __init__(self, config, max_cache_len: int, settings: KVCacheLayer | list[KVCacheLayer] | None = None):
        config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        n_layers = config.num_hidden_layers
        if settings is None:
            settings = KVCacheLayer()
        if isinstance(settings, KVCacheLayer):
            settings = [settings] * n_layers
        if len(settings) != n_layers:
            raise ValueError(f"{len(settings)} layer settings for a model with {n_layers} layers")
        settings = _clamp_int2_heads(settings, _kv_heads(config),
                                    [("FlashQCache settings", f"layer {i}") for i in range(n_layers)])
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * n_layers
        layers: list[CacheLayerMixin] = []
        for setting, kind in zip(settings, layer_types):
            if kind in ("sliding_attention", "chunked_attention"):
                window = getattr(config, "sliding_window", None) or getattr(config, "attention_chunk_size")
                layers.append(StaticSlidingWindowLayer(max_cache_len=max_cache_len, sliding_window=window))
            elif kind != "full_attention":
                raise ValueError(f"FlashQCache: layer type {kind!r} is not supported")
            elif setting.format == "flashq":
                layers.append(FlashQLayer(max_cache_len, setting.int2_heads, setting.buffer_tokens))
            else:
                layers.append(StaticLayer(max_cache_len=max_cache_len))
        super().__init__(layers=layers)
        self.config = config

    @classmethod
    def from_policy(cls, model, policy, max_cache_len: int) -> "FlashQCache":
        """A cache for ``model`` with the per-layer settings of ``policy``'s ``kv_cache:`` block.

        Layers are named by their attention module's FQN (modules with an int ``layer_idx``
        whose class name contains "Attention"), the names the policy's ``match`` patterns see.
        An ``int2_heads`` above the model's kv heads is capped, with a warning naming the
        policy entry that set it and the layers.
        """
        policy = load_policy(policy)
        if policy.kv_cache is None:
            raise PolicyError(f"policy {policy.source} has no `kv_cache:` block")
        model = getattr(model, "_orig_mod", model)
        config = model.config.get_text_config(decoder=True)
        kv = policy.kv_cache
        settings = [kv.defaults()] * config.num_hidden_layers
        labels = [(f"policy {policy.source}: kv_cache", f"layer {i}")
                  for i in range(config.num_hidden_layers)]
        for fqn, module in model.named_modules():
            index = getattr(module, "layer_idx", None)
            if isinstance(index, int) and "attention" in type(module).__name__.lower():
                settings[index] = kv.for_layer(fqn)
                labels[index] = (f"policy {policy.source}: {_int2_origin(kv, fqn)}", f"{fqn} (layer {index})")
                log.info("kv cache %s (layer %d): %s", fqn, index, settings[index])
        return cls(model.config, max_cache_len, _clamp_int2_heads(settings, _kv_heads(config), labels))

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        """Store the K/V of layer ``layer_idx``; returns a :class:`FlashQView` pair under
        ``qattn_kv`` for FlashQ layers, dense K/V otherwise (see the module doc)."""
        layer = self.layers[layer_idx]
        if isinstance(layer, FlashQLayer) and self.config._attn_implementation == KV_ATTENTION:
            prefill = layer.append(key_states, value_states)
            view = FlashQView(layer, key_states, value_states, prefill)
            return view, view
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def _reuse_hint(stored: int) -> str:
    """What to do with a cache reused for a new prompt (its ``stored`` tokens kept)."""
    return (f"A cache keeps its tokens across generate() calls, and generate() takes them as "
            f"the first {stored} tokens of the next prompt: call cache.reset() before a new "
            "prompt (or make a new cache)")


def _kv_heads(config) -> int:
    """KV heads per layer of a (text) config."""
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def _int2_origin(kv: KVCachePolicy, fqn: str) -> str:
    """Which entry of a ``kv_cache:`` block sets the ``int2_heads`` of layer ``fqn`` (as
    :meth:`KVCachePolicy.for_layer` picks it: the last matching rule, else the block's)."""
    for index in reversed(range(len(kv.rules))):
        rule = kv.rules[index]
        if match_pattern(rule.match, fqn):
            if rule.int2_heads is not None:
                return f"kv_cache.rules[{index}] (match '{rule.match}')"
            break
    return "kv_cache"


def _clamp_int2_heads(settings: list[KVCacheLayer], kv_heads: int,
                     labels: list[tuple[str, str]]) -> list[KVCacheLayer]:
    """``settings`` with ``int2_heads`` capped at the layer's ``kv_heads``: a count larger
    than the model has stores every head in INT2. One warning per entry that set such a
    count (``labels[i]``: that entry and layer i's name)."""
    clamped: dict[str, list[str]] = {}
    out = []
    for setting, (origin, name) in zip(settings, labels):
        if setting.format == "flashq" and setting.int2_heads > kv_heads:
            clamped.setdefault(f"{origin}: int2_heads={setting.int2_heads}", []).append(name)
            setting = setting.model_copy(update={"int2_heads": kv_heads})
        out.append(setting)
    for origin, names in clamped.items():
        more = f" and {len(names) - 1} more" if len(names) > 1 else ""
        log.warning("%s exceeds the %d kv heads of %s%s: all %d heads of %s stored in INT2",
                    origin, kv_heads, names[0], more, kv_heads,
                    "these layers" if more else "the layer")
    return out
