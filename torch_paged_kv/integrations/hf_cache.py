"""`PagedCache`: a `transformers.Cache` whose layers live in paged layer groups (`LayerGroups`).

The layers that keep K/V are grouped by what they hold (`hf_support.cache_groups`: heads, head_dim,
sliding window; an MLA latent), one `PagedKVCacheCollection` per group: Gemma3's sliding-window and
full layers, Gemma4's full layers of another head_dim, each in a pool of its own. Row b of the batch
is row b of every group's lookup table. Pages are handed out as rows grow, on the device
(`hf_pages.DevicePages`: no host sync, so a compiled decode step allocates in-graph), and in a
sliding-window group given back once they left the window of every later query, so such a group
holds O(window) tokens per row. Beam search reorders rows by moving their pages and copying the
duplicates' (`copy_pages`). Only the model layers that keep K/V get pool layers: shared-KV layers
(transformers' `kv_sharing_modes` "reuse") and layers without attention hold no cache, as in
transformers' own caches.

Two ways to attend, picked by `config._attn_implementation`:

- `"paged_kv"`: `update` (`hf_layer.PagedLayer`) writes nothing; it hands the attention function a
  `PendingKV` (the layer and this step's new K/V). The attention function, which also gets the padding
  mask, stores only the real tokens of each row (ragged `input_row_offsets`) and calls `flash_attention`
  on the pages. Left padding never reaches the cache, and token i of a row sits at position i (its
  rotary position).
- anything else (`sdpa`, `eager`, ...): `update` stores every column (padding included, like
  `StaticCache`) and returns K/V gathered to `[batch, heads, max_cache_len, head_dim]`; the model's
  own mask hides padding and the unused tail.

MLA models (DeepSeek-V2/V3) get an MLA pool of latent + rope rows (`hf_mla`). Layers that keep
conv and recurrent states per row (linear attention, Mamba, short convolutions) hold them in
`hf_state.StateLayer`, transformers' own layer for them, beside the pages. What the cache refuses to
serve, and why, is decided in `hf_support`.

Both paths go through `layer_plan` / `layer_done`, the one owner of the step protocol: the first
cached layer begins the step (writes this step's offsets, takes the pages the new tokens need), the
returned `GroupStepPlan` checks each group's step tensors at that group's first layer only, and the
last layer that reads the pages advances the lengths and gives back the pages that left a window
(under `paged_kv` a shared-KV layer reads the pages of the layer it shares, so it may come after the
last cached layer). Nothing per token lives in Python ints, so a compiled decode step does not recompile.
What exists once the pools do (groups, their pages, the column count) is one `hf_pool.CachePool`.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, EncoderDecoderCache, LinearAttentionLayer

from ..collection import PagedKVCacheCollection
from ..layer_groups import LayerGroups
from ..params import KVCacheParams
from ..step import GroupStepPlan
from .hf_checkpoint import load_paged_cache, save_paged_cache
from .hf_indexed import PagedIndexedLayer
from .hf_layer import PagedLayer
from .hf_pool import CachePool
from .hf_state import PagedStateLayer, StateLayer
from .hf_support import (
    INDEXED_SPECULATIVE_SINCE,
    CacheShape,
    attention_layers,
    cache_groups,
    check_config,
    check_cross_attention,
    decoder_config,
    indexed_layers,
    serves_indexed_speculative,
    state_layers,
)

if TYPE_CHECKING:  # transformers >= 5.23 (models with such layers need it)
    from transformers.cache_utils import DummyLayer, LinearAttentionCacheLayerMixin

    CacheLayer = CacheLayerMixin | LinearAttentionCacheLayerMixin | DummyLayer

ATTN_IMPLEMENTATION = "paged_kv"
_NOT_CHECKED = object()


def cache_kwarg(model: torch.nn.Module) -> str:
    """The keyword under which `model.generate(...)` and `model(...)` take a cache: `"cache"` where the
    model's forward has that parameter (transformers >= 5.24, which deprecates the old name), else
    `"past_key_values"`. For code that runs on both: `model.generate(ids, **{cache_kwarg(model): cache})`.
    A `torch.compile`d model is looked through to the module it wraps."""
    forward = getattr(model, "_orig_mod", model).forward
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def _no_cache_layer() -> DummyLayer | LinearAttentionLayer:
    """transformers' placeholder for a layer without a cache (shared-KV and attention-free layers): its
    `DummyLayer` (>= 5.23), before that the empty `LinearAttentionLayer` its own caches hold for
    attention-free layers (Nemotron-H's "mlp" and "moe" layers)."""
    try:
        from transformers.cache_utils import DummyLayer
    except ImportError:
        return LinearAttentionLayer()
    return DummyLayer()


class PagedCache(Cache):
    """A `transformers.Cache` over paged KV pools; pass it as `generate(..., cache=cache)` (transformers
    >= 5.24; `past_key_values=cache` before: `cache_kwarg(model)` says which).

    Args:
        config: the model's config (`model.config`); its `_attn_implementation` picks the path.
        max_batch_size: most rows at once (`batch * num_beams` for beam search).
        max_cache_len: most tokens (columns, padding included) a row may reach.
        page_size: tokens per page.
        device, dtype: the model's, that is of the keys the cache is given. Given both, the pools are
            allocated now; otherwise at the first step, on the device and in the dtype of the model's
            keys for the one not given. A model whose keys then differ from a given one raises
            `ValueError` naming the argument.
        kv_dtype: what the pools store (default: `dtype`). `torch.float8_e4m3fn` or
            `torch.float8_e5m2` halve the memory of a 16-bit cache: K/V are quantized on write and
            dequantized on read (see docs/fp8.md for what it costs in accuracy).
        quantization_granularity: for an FP8 `kv_dtype`, elements of head_dim sharing one scale
            (default head_dim: one scale per token and head).
        static_scales: for an FP8 `kv_dtype`, one fixed (k_scale, v_scale) pair instead of scales per
            token (vLLM's per-tensor FP8; needs calibrated scales).
        max_step_tokens: most new tokens a row takes in one step (a prefill chunk: `generate(...,
            prefill_chunk_size=...)`). It sizes the pools of sliding-window groups: a row holds its
            window plus one step's tokens there. None (the default): `max_cache_len`, a whole prompt
            in one step, so those pools are as large as the others. A longer step raises `ValueError`.
        encoder_decoder: True for the decoder's self-attention cache of an encoder-decoder model (T5,
            BART, Whisper, ...), wrapped in transformers' `EncoderDecoderCache` beside a cache for the
            cross-attention (`PagedCache.for_encoder_decoder` builds both). Such a config is refused
            without it: a bare cache would be handed the cross-attention's K/V too.

    Each group's pool has room for every row at its longest (`max_batch_size` rows of `max_cache_len`
    tokens; a sliding-window group: of its window and `max_step_tokens`); pages are taken as rows grow
    and given back by `reset`, `crop` and the sliding windows, so `kv_bytes_in_use()` follows the rows.
    """

    # Plain attributes set in `__init__`: they shadow `Cache`'s read-only properties (transformers < 5.20).
    max_cache_len: int = 0
    max_batch_size: int = 0

    def __init__(
        self,
        config: PreTrainedConfig,
        max_batch_size: int,
        max_cache_len: int,
        page_size: int = 16,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        kv_dtype: torch.dtype | None = None,
        quantization_granularity: int | None = None,
        static_scales: tuple[float, float] | None = None,
        max_step_tokens: int | None = None,
        encoder_decoder: bool = False,
    ) -> None:
        self.config = decoder_config(config)
        self._attention_config = config if encoder_decoder else self.config  # (the decoder view may be a copy)
        check_cross_attention(config, encoder_decoder)
        cfg = self.config
        self.cached_layers, self.attention_layers = attention_layers(cfg)
        self.shared_layers = frozenset(self.attention_layers) - frozenset(self.cached_layers)  # reuse others' K/V
        self._checked_attention: object = _NOT_CHECKED  # the attention implementation check_config passed for
        # (None too: a config no model holds yet has none)
        self._check_config()
        if max_step_tokens is not None and (not isinstance(max_step_tokens, int) or max_step_tokens <= 0):
            raise ValueError(f"max_step_tokens: expected a positive int or None, got {max_step_tokens!r}")
        self.max_step_tokens = max_step_tokens
        self.group_shapes: list[CacheShape] = []
        self.group_layers: list[list[int]] = []
        for shape, members in cache_groups(cfg, self.cached_layers, max_cache_len):
            self.group_shapes.append(shape)
            self.group_layers.append(members)
        self.is_mla = self.group_shapes[0].is_mla
        self.num_kv_heads, self.head_dim = self.group_shapes[0].num_kv_heads, self.group_shapes[0].head_dim  # the
        # config's; a one-group cache takes the keys' at the first step (a model may differ: Falcon's multi_query)
        self.page_size = page_size
        self.max_cache_len = max_cache_len
        self.max_batch_size = max_batch_size
        self.requested_device = None if device is None else torch.device(device)
        self.requested_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.kv_dtype = getattr(torch, kv_dtype) if isinstance(kv_dtype, str) else kv_dtype
        self.quantization_granularity, self.static_scales = quantization_granularity, static_scales
        if self.kv_dtype is not None:  # a bad combination fails now, naming the argument, not at the first step
            for shape in self.group_shapes:
                self._params(self.kv_dtype, shape, 1)
        self.pool: CachePool | None = None  # made at the first step, or now given device and dtype
        self.record_past = False
        self._attends_from_pages = False
        self.read_attention_mode()
        self.rows = 0  # rows in use: set by each eager step, changed by reorder/select/repeat
        if self.requested_device is not None and self.requested_dtype is not None:
            self._allocate(self.requested_device, self.requested_dtype)
        pool_layer = {layer: j for j, layer in enumerate(self.cached_layers)}
        self.state_layers = state_layers(cfg)
        self.indexed_layers = indexed_layers(cfg)
        self._paged_layers = [
            PagedStateLayer(self, i, pool_layer[i], cfg)
            if i in self.state_layers
            else PagedIndexedLayer(self, i, pool_layer[i])
            if i in self.indexed_layers
            else PagedLayer(self, i, pool_layer[i])
            for i in self.cached_layers
        ]
        by_index = dict(zip(self.cached_layers, self._paged_layers, strict=True))
        layers: list[CacheLayer] = [
            by_index[i] if i in by_index else StateLayer(cfg) if i in self.state_layers else _no_cache_layer()
            for i in range(cfg.num_hidden_layers)
        ]
        super().__init__(layers=layers)

    # -- the pool's state (None before it exists) -----------------------------------------------
    @property
    def groups(self) -> LayerGroups | None:
        """The layer groups (a `LayerGroups`: one collection per group), once allocated."""
        return None if self.pool is None else self.pool.groups

    @property
    def device(self) -> torch.device | None:
        """The pools' device, once allocated."""
        return None if self.pool is None else self.pool.device

    @property
    def dtype(self) -> torch.dtype | None:
        """The model's dtype (its keys'), known once the pools exist (an FP8 pool does not say it)."""
        return None if self.pool is None else self.pool.dtype

    @property
    def static_addresses_marked(self) -> bool:
        """Whether dynamo was told that the pools keep their addresses."""
        return self.pool is not None and self.pool.static_addresses_marked

    def _live(self) -> CachePool:
        """The pool, during a step (the step's first cached layer made it)."""
        if self.pool is None:
            raise RuntimeError("PagedCache: a step reached a layer before the first cached layer allocated the pool")
        return self.pool

    @property
    def collection(self) -> PagedKVCacheCollection | None:
        """The pool of a cache of one layer group (None before it is allocated; ValueError for a cache
        of several: see `groups`)."""
        if self.pool is None:
            return None
        groups = self.pool.groups
        if len(groups) != 1:
            raise ValueError(f"collection: this cache has {len(groups)} layer groups; use groups.collections")
        return groups.collections[0]

    def _params(self, dtype: torch.dtype, shape: CacheShape, num_layers: int) -> KVCacheParams:
        """A group's params: K/V heads, or for an MLA model one latent + rope row per token."""
        quantization = dict(quantization_granularity=self.quantization_granularity, static_scales=self.static_scales)
        if shape.kv_lora_rank is not None and shape.rope_dim is not None:  # MLA
            return KVCacheParams.mla(
                dtype, num_layers, self.page_size, shape.kv_lora_rank, shape.rope_dim, **quantization
            )
        return KVCacheParams(
            dtype, num_layers, shape.num_kv_heads, shape.head_dim, self.page_size,
            quantization_granularity=self.quantization_granularity, static_scales=self.static_scales,
            sliding_window=shape.sliding_window,
        )  # fmt: skip

    def pages_per_row(self, params: KVCacheParams) -> int:
        """The most pages one row holds in a group of `params`: every page of `max_cache_len` tokens, or
        in a sliding-window group those of its window and one step (`max_step_tokens`)."""
        full = -(-self.max_cache_len // self.page_size)
        if params.sliding_window is None:
            return full
        step = self.max_cache_len if self.max_step_tokens is None else self.max_step_tokens
        return min(full, -(-(step + params.sliding_window - 1) // self.page_size) + 1)

    def _allocate(self, device: torch.device, dtype: torch.dtype) -> None:
        """The pools, one per layer group, sharing the lengths and offsets (each group has its own table)."""
        shapes = list(self.group_shapes)
        if len(shapes) == 1 and not self.is_mla:
            shapes[0] = dataclasses.replace(shapes[0], num_kv_heads=self.num_kv_heads, head_dim=self.head_dim)
        params = [
            self._params(self.kv_dtype or dtype, s, len(ls)) for s, ls in zip(shapes, self.group_layers, strict=True)
        ]
        counts = [self.max_batch_size * self.pages_per_row(p) for p in params]
        groups = LayerGroups.allocate(
            params, self.group_layers, counts, self.max_batch_size, self.max_cache_len, device
        )
        self.pool = CachePool(groups, dtype)
        self.pool.mark_static_addresses()

    def ensure_pool(self, key_states: torch.Tensor) -> None:
        """Check that the model's keys (of the first cached layer) fit the pools (their dtype and device,
        given or already allocated), then allocate the pools on first use (see the class docstring)."""
        pool = self.pool
        if pool is None:
            dtype, device = self.requested_dtype or key_states.dtype, self.requested_device or key_states.device
        else:
            dtype, device = pool.dtype, pool.device
        if key_states.dtype != dtype:
            raise ValueError(
                f"dtype: the pool holds {dtype} but the model's keys are {key_states.dtype}; "
                f"pass dtype={key_states.dtype} (or leave it None to follow the model)"
            )
        here = key_states.device
        if here.type != device.type or (device.index is not None and here.index != device.index):
            raise ValueError(
                f"device: the pool is on {device} but the model's keys are on {here}; "
                f"pass device={str(here)!r} (or leave it None to follow the model)"
            )
        heads, head_dim = key_states.shape[1], key_states.shape[3]
        adopt = len(self.group_shapes) == 1 and not self.is_mla  # the keys say what the model caches
        if pool is None:
            if adopt:  # (Falcon: 1 head for 71 queried)
                self.num_kv_heads, self.head_dim = heads, head_dim
            self._allocate(here, dtype)
            pool = self._live()
            for layer in self._paged_layers:
                layer.is_initialized = True
        else:
            pool.mark_static_addresses()
        params = pool.groups.collections[pool.groups.layer_map[0][0]].params
        if not self.is_mla and (heads, head_dim) != (params.num_kv_heads, params.head_dim):
            raise ValueError(
                f"config: the model's keys have {heads} heads of {head_dim}, but the pool, allocated from the "
                f"config, holds {params.num_kv_heads} of {params.head_dim}; leave device or dtype None so that the "
                "pool follows the keys at the first step"
            )

    def read_attention_mode(self) -> None:
        """Read `attends_from_pages` from the config: once per step, at the first cached layer, as a
        transformers config attribute costs microseconds (several `__getattribute__` layers) and every
        layer asks twice. A new attention implementation is checked (`check_config`) before anything
        of the step is stored."""
        self._check_config()
        self._attends_from_pages = self.attn_implementation == ATTN_IMPLEMENTATION

    def _check_config(self) -> None:
        """`hf_support.check_config` for the config's attention implementation, once per implementation."""
        attn = self.attn_implementation
        if attn != self._checked_attention:
            check_config(self.config, paged=attn == ATTN_IMPLEMENTATION)
            self._checked_attention = attn

    @property
    def attn_implementation(self) -> str | None:
        """The model's attention implementation (`config._attn_implementation`), as it is now."""
        return self._attention_config._attn_implementation

    @property
    def attends_from_pages(self) -> bool:
        """True when the model runs the `paged_kv` attention function (as of this step's first layer)."""
        return self._attends_from_pages

    def kv_bytes_in_use(self) -> int:
        """Bytes of K/V (and FP8 scales) in the pages the rows hold now, every group (a host sync)."""
        return 0 if self.pool is None else self.pool.kv_bytes_in_use()

    def state_bytes_in_use(self) -> int:
        """Bytes of the conv and recurrent states the state layers hold now (transformers makes them at
        the first step, for that batch; `reset` keeps them for the next one)."""
        return sum(
            state.nbytes
            for layer in self._state_layer_objects()
            for i in range(layer.number_of_states)
            for state in layer.saved_states(i)
            if state is not None
        )

    def indexer_bytes(self) -> int:
        """Bytes of the sparse-attention layers' indexer-key buffers (`max_batch_size` x `max_cache_len` x
        `index_head_dim` each, allocated whole at the first step that writes keys; 0 before)."""
        buffers = (layer.indexer_keys for layer in self._indexed_layer_objects())
        return sum(keys.nbytes for keys in buffers if keys is not None)

    def activate_past_recording(self) -> None:
        """Keep the pages sliding windows would give back until the next `crop` (transformers calls this
        before assisted generation, whose `crop` may go back past a window's start), and the state
        layers' conv states of the tokens since (transformers' `LinearAttentionLayer`).

        A cache with state layers raises `ValueError` instead: recurrent states cannot go back, and
        over conv states alone (LFM2) a crop gives other tokens than `DynamicCache`'s there (so does
        transformers' `StaticCache`), so speculative decoding is refused before its first token. So
        does a cache with indexed layers before transformers `INDEXED_SPECULATIVE_SINCE` (no oracle)."""
        if self.indexed_layers and not serves_indexed_speculative():
            raise ValueError(
                f"cache: layers {self.indexed_layers} attend to the top-k keys of an indexer (sparse attention), "
                f"whose speculative decoding PagedCache serves from transformers {INDEXED_SPECULATIVE_SINCE} (checked "
                "against its StaticCache, which refuses it before); use that version or DynamicCache"
            )
        if self.state_layers:
            raise ValueError(
                f"cache: layers {self.state_layers} keep conv or recurrent states, which PagedCache cannot take back "
                "to an earlier token exactly; speculative decoding (assistant_model=, prompt_lookup_num_tokens=) "
                "needs that: use transformers' DynamicCache for it"
            )
        self.record_past = True

    # -- the step protocol (tensors, in place) ------------------------------------------------
    def layer_plan(
        self, layer_idx: int, batch: int, columns: int, new_tokens: Callable[[], torch.Tensor]
    ) -> GroupStepPlan:
        """The step's `GroupStepPlan` at model layer `layer_idx` over the first `batch` rows. The first
        cached layer begins the step: it records each row's new token count (`new_tokens()`, `[batch]`
        int32) in `input_row_offsets`, gives the rows the pages their new tokens need, and records the
        step's `columns` (padding included), which `layer_done` adds to the column count. The plan
        checks each group's step tensors at that group's first layer only."""
        pool = self._live()
        if layer_idx == self.cached_layers[0]:
            counts = new_tokens()
            if not torch.compiler.is_compiling():
                self._check_room(pool, counts)
                self.rows = counts.shape[0]
            return pool.begin_step(counts, columns)
        return pool.step_plan()  # the same for every layer of the step (views of the step's rows)

    def trailing_plan(self, batch: int, query_counts: torch.Tensor, pool_layer: int) -> GroupStepPlan:
        """A plan for queries that are only the last `query_counts[b]` (`[batch]` int32) of this step's new
        tokens of each row, whose K/V are stored already: transformers trims the hidden states of K/V-sharing
        layers to `logits_to_keep` positions during a prefill. Its call at `pool_layer` checks the step it
        describes in full."""
        return self._live().trailing_plan(batch, query_counts, pool_layer)

    def gather(self, plan: GroupStepPlan, pool_layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of cached layer `pool_layer` gathered to `max_cache_len` columns (zeros past each row's
        length). In a sliding-window group the columns below the window read as zeros (the null page,
        unchecked: the model's own sliding mask hides them, as it does for transformers' own caches)."""
        return self._live().gather(plan, pool_layer, self.max_cache_len, dtype)

    def held_kv(self, pool_layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K/V that cached layer `pool_layer` holds for the rows in use, between steps: copies gathered to
        `[rows, kv_heads, max_cache_len, head_dim]` (a `StaticCache` layer's shape; zeros past each row's
        length), or None before the first step and for MLA caches."""
        pool = self.pool
        if pool is None or self.rows == 0 or self.is_mla:
            return None
        keys, values = pool.gather(pool.held_plan(self.rows, pool_layer), pool_layer, self.max_cache_len, pool.dtype)
        return keys.transpose(1, 2).contiguous(), values.transpose(1, 2).contiguous()

    def layer_window(self, pool_layer: int) -> int | None:
        """The sliding window of cached layer `pool_layer`'s group (it gives back the pages outside it), or None."""
        groups = self._live().groups
        return groups.collections[groups.layer_map[pool_layer][0]].params.sliding_window

    def layer_done(self, layer_idx: int, batch: int) -> None:
        """After model layer `layer_idx` is done with the step: the last layer that reads the pages
        (under `paged_kv` the last attention layer, shared-KV readers included; otherwise the last
        cached layer, as readers use the K/V `update` returned) adds the new tokens to the lengths and
        the step's columns to the column count, and the sliding-window groups give back the pages no
        later query reads. Until then every layer reports the count before the step, as a
        `DynamicCache` layer does before its update (Llama4's no-rope layers scale their queries by it)."""
        last = self.attention_layers[-1] if self.attends_from_pages else self.cached_layers[-1]
        if layer_idx == last:
            self._live().end_step(batch, keep_past=self.record_past)

    def _check_room(self, pool: CachePool, new_tokens: torch.Tensor) -> None:
        batch = new_tokens.shape[0]
        if batch > self.max_batch_size:
            raise ValueError(
                f"batch: {batch} rows, more than max_batch_size={self.max_batch_size} "
                "(rows are batch x num_beams under beam search)"
            )
        lengths = pool.lengths
        most, longest = (int(n) for n in torch.stack([new_tokens.max(), (lengths[:batch] + new_tokens).max()]))
        if longest > self.max_cache_len:
            raise ValueError(f"max_cache_len: a row would hold {longest} tokens, more than {self.max_cache_len}")
        if self.max_step_tokens is not None and most > self.max_step_tokens:
            raise ValueError(
                f"max_step_tokens: a row takes {most} new tokens in one step, more than {self.max_step_tokens} "
                "(prefill in chunks: generate(..., prefill_chunk_size=...))"
            )

    # -- Cache API ---------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every row and give back every page (pages are not cleared: nothing reads past a row's length)."""
        self.rows = 0
        if self.pool is not None:
            self.pool.reset()
        for layer in self._state_layer_objects():
            StateLayer.reset(layer)
        for indexed in self._indexed_layer_objects():
            indexed.set_columns(0)

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` tokens of every row (HF's convention: a negative count); a
        positive count is the number of columns to keep, as transformers before 5.24 passes it
        (`crop(max_length)` in its assisted decoding; no change when there are no more). The pages past
        the new lengths, and those below a sliding window's start, go back. A row that would need
        tokens a sliding window gave back already raises `ValueError` (nothing changed) unless
        `activate_past_recording()` kept them. A cache with state layers cannot go back: a crop that
        drops tokens raises `ValueError` (nothing changed; see `activate_past_recording`)."""
        if self.pool is None:
            return
        if tokens_to_remove > 0:
            tokens_to_remove = min(0, tokens_to_remove - int(self.pool.columns))
        if tokens_to_remove and self.state_layers:
            raise ValueError(
                f"tokens_to_remove: layers {self.state_layers} keep conv or recurrent states, which PagedCache "
                "cannot take back to an earlier token"
            )
        self.pool.crop(tokens_to_remove)
        for indexed in self._indexed_layer_objects():
            indexed.set_columns(self.pool.columns)

    @property
    def is_croppable(self) -> bool:
        """Whether `crop` can go back without a trace (transformers asks): not with state layers."""
        return not self.state_layers

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i becomes a copy of row `beam_idx[i]`."""
        self._select_rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows `indices`, in that order."""
        self._select_rows(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each row `repeats` times in place (row i becomes row i // repeats)."""
        self._select_rows(torch.arange(self.rows * repeats, device=self.device) // repeats)

    def _select_rows(self, rows: torch.Tensor) -> None:
        """Row i := old row `rows[i]`: the first new row taking an old row takes its pages, the others
        copies of them (`copy_pages`); pages no new row takes go back first."""
        batch = rows.numel()
        if batch > self.max_batch_size:
            raise ValueError(
                f"rows: {batch} rows, more than max_batch_size={self.max_batch_size} "
                "(rows are batch x num_beams under beam search)"
            )
        if self.pool is not None:  # else nothing stored yet
            self.pool.select_rows(rows)
        for layer in self._state_layer_objects():
            StateLayer.reorder_cache(layer, cast(torch.LongTensor, rows.long()))
        for indexed in self._indexed_layer_objects():
            indexed.select_rows(rows)
        self.rows = batch

    def state_layer(self, layer_idx: int) -> StateLayer:
        """The cache layer of model layer `layer_idx`, one of `state_layers` (its conv and recurrent states)."""
        layer = self.layers[layer_idx]
        assert isinstance(layer, StateLayer)  # the constructor makes every one of `state_layers` a StateLayer
        return layer

    def _state_layer_objects(self) -> list[StateLayer]:
        return [self.state_layer(i) for i in self.state_layers]

    def indexed_layer(self, layer_idx: int) -> PagedIndexedLayer:
        """The cache layer of model layer `layer_idx`, one of `indexed_layers` (its indexer keys)."""
        layer = self.layers[layer_idx]
        assert isinstance(layer, PagedIndexedLayer)  # the constructor makes every one of `indexed_layers` one
        return layer

    def _indexed_layer_objects(self) -> list[PagedIndexedLayer]:
        return [self.indexed_layer(i) for i in self.indexed_layers]

    def indexer_keys(self, columns: int) -> dict[int, torch.Tensor]:
        """Model layer -> the rows in use's indexer keys of the first `columns` columns, for the indexed
        layers a step wrote (a model's "shared" indexed layers reuse another layer's top-k and write none)."""
        keys = {i: self.indexed_layer(i).saved_keys(self.rows, columns) for i in self.indexed_layers}
        return {i: k for i, k in keys.items() if k is not None}

    @classmethod
    def for_encoder_decoder(
        cls, config: PreTrainedConfig, max_batch_size: int, max_cache_len: int, **options: Any
    ) -> EncoderDecoderCache:
        """The cache of an encoder-decoder model (T5, BART, Whisper, ...): transformers' `EncoderDecoderCache`
        of a `PagedCache` for the decoder's self-attention (`max_cache_len`: decoder tokens; `options` as
        the constructor's) and a `DynamicCache` for the cross-attention (the encoder's K/V, computed once
        per generation). Pass it as `generate(..., cache=...)`; `.self_attention_cache` is the paged part
        (`save` it; `PagedCache.load(path, config, encoder_decoder=True)` resumes it)."""
        paged = cls(config, max_batch_size, max_cache_len, encoder_decoder=True, **options)
        return EncoderDecoderCache(paged, DynamicCache(config=paged.config))

    # -- checkpoints (hf_checkpoint.py) ------------------------------------------------------
    def save(self, path: str | os.PathLike[str], **options: Any) -> None:
        """Save the rows in use to a KV checkpoint at `path` (between `generate` calls, not inside
        a step); `PagedCache.load` resumes from it in any process. `options`: `metadata` (str -> str),
        `shard_bytes`, `progress`, as for `torch_paged_kv.save_cache`."""
        save_paged_cache(self, path, **options)

    @classmethod
    def load(cls, path: str | os.PathLike[str], config: PreTrainedConfig, **options: Any) -> PagedCache:
        """A new cache for the model of `config` holding what `save` wrote at `path`, on `device`
        (default CPU). Constructor arguments default to the saved cache's; pass a larger
        `max_cache_len` to generate further. Then `generate(all tokens so far, ..., cache=cache)`
        goes on as if never interrupted. See docs/transformers.md."""
        return load_paged_cache(cls, path, config, **options)

    def __repr__(self) -> str:
        if self.pool is None:
            return (
                f"PagedCache(not allocated yet: {self.max_batch_size} rows x {self.max_cache_len} tokens, "
                f"page_size={self.page_size}, {len(self.group_shapes)} layer group(s))"
            )
        groups = self.pool.groups
        if len(groups) == 1:
            return f"PagedCache({groups.collections[0]!r})"
        return f"PagedCache({groups!r})"
