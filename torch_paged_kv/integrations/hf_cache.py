"""`PagedCache`: a `transformers.Cache` whose layers live in one `PagedKVCacheCollection`.

Row b of the batch owns the fixed pages `1 + b*P .. (b+1)*P` (P pages per row), so the lookup table
never changes and beam search reorders rows by copying pages (`copy_pages`, all layers at once).
Only the model layers that keep K/V get pool layers: shared-KV layers (transformers'
`kv_sharing_modes` "reuse") and layers without attention hold no cache, as in transformers' own caches.

Two ways to attend, picked by `config._attn_implementation`:

- `"paged_kv"`: `update` writes nothing; it hands the attention function a `PendingKV` (the layer
  and this step's new K/V). The attention function, which also gets the padding mask, stores only
  the real tokens of each row (ragged `input_row_offsets`) and calls `flash_attention` on the pages.
  Left padding never reaches the cache, and token i of a row sits at position i (its rotary position).
- anything else (`sdpa`, `eager`, ...): `update` stores every column (padding included, like
  `StaticCache`) and returns K/V gathered to `[batch, heads, max_cache_len, head_dim]`; the model's
  own mask hides padding and the unused tail.

MLA models (DeepSeek-V2/V3) get an MLA pool of latent + rope rows (`hf_mla`). What the cache
refuses to serve, and why, is decided in `hf_support`.

Both paths go through `layer_plan` / `layer_done`, the one owner of the step protocol: the first
cached layer begins the step (writes this step's offsets), the returned `StepPlan` checks the step
tensors at that layer only, and the last layer that reads the pages advances the lengths (under
`paged_kv` a shared-KV layer reads the pages of the layer it shares, so it may come after the last
cached layer). Nothing per token lives in Python ints, so a compiled decode step does not recompile.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin

from ..collection import PagedKVCacheCollection, StepTensors
from ..ops import copy_pages
from ..params import KVCacheParams
from ..step import StepPlan
from . import hf_mla
from .hf_checkpoint import load_paged_cache, save_paged_cache
from .hf_support import NO_CACHE_LAYER_TYPES, cache_shape, check_config

ATTN_IMPLEMENTATION = "paged_kv"


def attention_layers(config: PreTrainedConfig) -> tuple[list[int], list[int]]:
    """(layers that keep their own K/V, layers with attention), as model layer indices, by
    transformers' rule: a layer that reuses another's K/V (`kv_sharing_modes[i] == "reuse"`) attends
    but keeps nothing; a layer without attention (type "moe", "mlp") does neither."""
    num_layers = config.num_hidden_layers
    if getattr(config, "num_kv_shared_layers", 0) and not hasattr(config, "kv_sharing_modes"):
        raise ValueError(
            f"config: its last {config.num_kv_shared_layers} layers reuse other layers' K/V the way transformers "
            "before 5.23 does it (through a `shared_layers` dict on the cache), which PagedCache does not "
            "follow; use transformers >= 5.23 (`kv_sharing_modes`) for this model"
        )
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * num_layers)
    modes = getattr(config, "kv_sharing_modes", None) or [None] * num_layers
    attending = [i for i, kind in enumerate(types) if kind not in NO_CACHE_LAYER_TYPES]
    return [i for i in attending if modes[i] != "reuse"], attending


class PendingKV(NamedTuple):
    """What `update` returns as keys (and values) under `attn_implementation="paged_kv"`."""

    layer: PagedLayer
    key: torch.Tensor  # [batch, kv_heads, new, head_dim], rotary already applied
    value: torch.Tensor


class PagedLayer(CacheLayerMixin):
    """One cached model layer's view of the shared collection (HF's per-layer cache surface).

    `layer_idx` is the model's layer index, `pool_layer` its layer in the pool. Row operations
    (reset, crop, reorder, select) touch every layer at once, so `PagedCache` does them.
    """

    is_compileable = True
    is_croppable = True
    is_sliding = False

    def __init__(self, cache: PagedCache, layer_idx: int, pool_layer: int) -> None:
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.pool_layer = pool_layer
        self.is_initialized = cache.collection is not None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate the shared pool (for every layer) if it does not exist yet."""
        self.cache.ensure_pool(key_states)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[Any, Any]:
        """Paged attention: defer to the attention function. Otherwise store and gather K/V."""
        cache = self.cache
        if self.pool_layer == 0:  # the step's first cached layer
            cache.ensure_pool(key_states)
            cache.read_attention_mode()
        if cache.shape.is_mla:
            return hf_mla.update(self, key_states, value_states, kwargs)
        if cache.attends_from_pages:
            pending = PendingKV(self, key_states, value_states)
            return pending, pending
        batch, _, new, _ = key_states.shape
        counts = lambda: torch.full((batch,), new, dtype=torch.int32, device=cache.device)
        plan = cache.layer_plan(self.layer_idx, batch, new, counts)
        plan.store_kv(token_rows(key_states), token_rows(value_states), self.pool_layer)
        keys, values = plan.gather_kv(self.pool_layer, cache.max_cache_len, key_states.dtype)
        cache.layer_done(self.layer_idx, batch)
        return keys.transpose(1, 2), values.transpose(1, 2)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """K/V always span `max_cache_len` columns (what `update` returns)."""
        return self.cache.max_cache_len, 0

    def get_seq_length(self) -> torch.Tensor | int:
        """Columns seen so far (padding included): a 0-dim tensor like `StaticLayer`'s, or the int 0
        before the pool exists (also like `StaticLayer`)."""
        return 0 if self.cache.columns is None else self.cache.columns

    def get_max_length(self) -> int:
        return self.cache.max_cache_len

    get_max_cache_shape = get_max_length  # the abstract name before transformers 5.13


def token_rows(states: torch.Tensor) -> torch.Tensor:
    """`[batch, heads, new, head_dim]` -> `[batch*new, heads, head_dim]` (batch-major rows)."""
    return states.transpose(1, 2).reshape(-1, states.shape[1], states.shape[3])


def cache_kwarg(model: torch.nn.Module) -> str:
    """The keyword under which `model.generate(...)` and `model(...)` take a cache: `"cache"` where the
    model's forward has that parameter (transformers >= 5.24, which deprecates the old name), else
    `"past_key_values"`. For code that runs on both: `model.generate(ids, **{cache_kwarg(model): cache})`.
    A `torch.compile`d model is looked through to the module it wraps."""
    forward = getattr(model, "_orig_mod", model).forward
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def _no_cache_layer() -> CacheLayerMixin:
    """transformers' placeholder for a layer without a cache (shared-KV and attention-free layers)."""
    from transformers.cache_utils import DummyLayer  # transformers >= 5.23; older models have no such layers

    return DummyLayer()


class PagedCache(Cache):
    """A `transformers.Cache` over a paged KV pool; pass it as `generate(..., cache=cache)` (transformers
    >= 5.24; `past_key_values=cache` before: `cache_kwarg(model)` says which).

    Args:
        config: the model's config (`model.config`); its `_attn_implementation` picks the path.
        max_batch_size: most rows at once (`batch * num_beams` for beam search).
        max_cache_len: most tokens (columns, padding included) a row may reach.
        page_size: tokens per page.
        device, dtype: the model's, that is of the keys the cache is given. Given both, the pool is
            allocated now; otherwise at the first step, on the device and in the dtype of the model's
            keys for the one not given. A model whose keys then differ from a given one raises
            `ValueError` naming the argument.
        kv_dtype: what the pool stores (default: `dtype`). `torch.float8_e4m3fn` or
            `torch.float8_e5m2` halve the memory of a 16-bit cache: K/V are quantized on write and
            dequantized on read (see docs/fp8.md for what it costs in accuracy).
        quantization_granularity: for an FP8 `kv_dtype`, elements of head_dim sharing one scale
            (default head_dim: one scale per token and head).
        static_scales: for an FP8 `kv_dtype`, one fixed (k_scale, v_scale) pair instead of scales per
            token (vLLM's per-tensor FP8; needs calibrated scales).
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
    ) -> None:
        self.config = config.get_text_config(decoder=True)
        cfg = self.config
        self.cached_layers, self.attention_layers = attention_layers(cfg)
        self._checked_attention: str | None = None  # the attention implementation check_config passed for
        self._check_config()
        self.shape = cache_shape(cfg, self.cached_layers)
        self.num_kv_heads, self.head_dim = self.shape.num_kv_heads, self.shape.head_dim  # the config's; the
        # keys' at the first step where the pool is allocated then (a model may differ: Falcon's multi_query)
        self.page_size = page_size
        self.max_cache_len = max_cache_len
        self.max_batch_size = max_batch_size
        self.requested_device = None if device is None else torch.device(device)
        self.requested_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.kv_dtype = getattr(torch, kv_dtype) if isinstance(kv_dtype, str) else kv_dtype
        self.quantization = dict(quantization_granularity=quantization_granularity, static_scales=static_scales)
        if self.kv_dtype is not None:  # a bad combination fails now, naming the argument, not at the first step
            self._params(self.kv_dtype, 1)
        self.dtype: torch.dtype | None = None  # the model's (the keys'): known once the pool exists
        self.collection: PagedKVCacheCollection | None = None
        self.columns: torch.Tensor | None = None
        self.device: torch.device | None = None
        self.static_addresses_marked = False
        self._plan: StepPlan | None = None  # this step's, made at its first cached layer
        self._step_columns = 0  # this step's columns (padding included): the column count adds them at its end
        self._attends_from_pages = False
        self.read_attention_mode()
        self.rows = 0  # rows in use: set by each eager step, changed by reorder/select/repeat
        if self.requested_device is not None and self.requested_dtype is not None:
            self._allocate(self.requested_device, self.requested_dtype)
        pool_layer = {layer: j for j, layer in enumerate(self.cached_layers)}
        layers = [
            PagedLayer(self, i, pool_layer[i]) if i in pool_layer else _no_cache_layer()
            for i in range(cfg.num_hidden_layers)
        ]
        super().__init__(layers=layers)

    def _params(self, dtype: torch.dtype, num_layers: int) -> KVCacheParams:
        """The pool's params: K/V heads, or for an MLA model one latent + rope row per token."""
        shape = self.shape
        if shape.is_mla:
            return KVCacheParams.mla(
                dtype, num_layers, self.page_size, shape.kv_lora_rank, shape.rope_dim, **self.quantization
            )
        return KVCacheParams(dtype, num_layers, self.num_kv_heads, self.head_dim, self.page_size, **self.quantization)

    def _allocate(self, device: torch.device, dtype: torch.dtype) -> None:
        """The pool: row b owns pages `1 + b*P .. (b+1)*P`, written into the lookup table once."""
        self.dtype = dtype
        params = self._params(self.kv_dtype or dtype, len(self.cached_layers))
        pages_per_row = -(-self.max_cache_len // self.page_size)
        self.collection = PagedKVCacheCollection(
            params, self.max_batch_size * pages_per_row, self.max_batch_size, self.max_cache_len, device
        )
        self.device = self.collection.device
        own = torch.arange(1, self.max_batch_size * pages_per_row + 1, dtype=torch.int32, device=self.device)
        self.collection.lookup_table[:, :pages_per_row] = own.view(self.max_batch_size, pages_per_row)
        self.columns = torch.zeros((), dtype=torch.int64, device=self.device)
        self._mark_static_addresses()

    def _mark_static_addresses(self) -> None:
        """Tell dynamo that the pool's tensors keep their addresses (CUDA graphs then use them in place).
        Dynamo forbids this while compiling (a pool allocated by a compiled first step): the next eager
        step does it."""
        if self.static_addresses_marked or torch.compiler.is_compiling():
            return
        c = self.collection
        for t in (c.blocks, c.scales, c.cache_lengths, c.input_row_offsets, c.lookup_table, self.columns):
            if t is not None:
                torch._dynamo.mark_static_address(t)
        self.static_addresses_marked = True

    def ensure_pool(self, key_states: torch.Tensor) -> None:
        """Check that the model's keys fit the pool (its dtype and device, given or already allocated),
        then allocate the pool on first use (see the class docstring)."""
        if self.collection is None:
            dtype, device = self.requested_dtype or key_states.dtype, self.requested_device or key_states.device
        else:
            dtype, device = self.dtype, self.collection.blocks.device
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
        if self.collection is None:
            if not self.shape.is_mla:  # the keys say what the model caches (Falcon: 1 head for 71 queried)
                self.num_kv_heads, self.head_dim = heads, head_dim
            self._allocate(here, dtype)
            for layer in self.layers:
                layer.is_initialized = True
        else:
            if not self.shape.is_mla and (heads, head_dim) != (self.num_kv_heads, self.head_dim):
                raise ValueError(
                    f"config: the model's keys have {heads} heads of {head_dim}, but the pool, allocated from the "
                    f"config, holds {self.num_kv_heads} of {self.head_dim}; leave device or dtype None so that the "
                    "pool follows the keys at the first step"
                )
            self._mark_static_addresses()

    def read_attention_mode(self) -> None:
        """Read `attends_from_pages` from the config: once per step, at the first cached layer, as a
        transformers config attribute costs microseconds (several `__getattribute__` layers) and every
        layer asks twice. A new attention implementation is checked (`check_config`) before anything
        of the step is stored."""
        self._check_config()
        self._attends_from_pages = self.config._attn_implementation == ATTN_IMPLEMENTATION

    def _check_config(self) -> None:
        """`hf_support.check_config` for the config's attention implementation, once per implementation."""
        attn = self.config._attn_implementation
        if attn != self._checked_attention:
            check_config(self.config, paged=attn == ATTN_IMPLEMENTATION)
            self._checked_attention = attn

    @property
    def attends_from_pages(self) -> bool:
        """True when the model runs the `paged_kv` attention function (as of this step's first layer)."""
        return self._attends_from_pages

    # -- the step protocol (tensors, in place) ------------------------------------------------
    def layer_plan(self, layer_idx: int, batch: int, columns: int, new_tokens: Callable[[], torch.Tensor]) -> StepPlan:
        """The step's `StepPlan` at model layer `layer_idx` over the first `batch` rows. The first
        cached layer begins the step: it records each row's new token count (`new_tokens()`, `[batch]`
        int32) in `input_row_offsets` and the step's `columns` (padding included), which `layer_done`
        adds to the column count. The plan checks the step tensors at that layer only."""
        if layer_idx == self.cached_layers[0]:
            self._begin_step(new_tokens(), columns)
            self._plan = StepPlan.of(self.collection, self.collection.step_tensors(batch))
        return self._plan  # the same for every layer of the step (views of the step's rows)

    def trailing_plan(self, batch: int, query_counts: torch.Tensor, pool_layer: int) -> StepPlan:
        """A plan for queries that are only the last `query_counts[b]` (`[batch]` int32) of this step's new
        tokens of each row, whose K/V are stored already: transformers trims the hidden states of K/V-sharing
        layers to `logits_to_keep` positions during a prefill. Its first call (at `pool_layer`) checks the
        step it describes in full."""
        lengths, table, offsets = self.collection.step_tensors(batch)
        new_tokens = offsets[1:] - offsets[:-1]
        query_offsets = torch.zeros(batch + 1, dtype=torch.int32, device=self.device)
        query_offsets[1:] = torch.cumsum(query_counts, 0)
        step = StepTensors(lengths + new_tokens - query_counts, table, query_offsets)
        return StepPlan(self.collection.blocks, step, self.collection.scales, first_layer=pool_layer)

    def layer_done(self, layer_idx: int, batch: int) -> None:
        """After model layer `layer_idx` is done with the step: the last layer that reads the pages
        (under `paged_kv` the last attention layer, shared-KV readers included; otherwise the last
        cached layer, as readers use the K/V `update` returned) adds the new tokens to the lengths and
        the step's columns to the column count. Until then every layer reports the count before the
        step, as a `DynamicCache` layer does before its update (Llama4's no-rope layers scale their
        queries by it)."""
        last = self.attention_layers[-1] if self.attends_from_pages else self.cached_layers[-1]
        if layer_idx == last:
            _, _, offsets = self.collection.step_tensors(batch)
            self.collection.cache_lengths[:batch] += offsets[1:] - offsets[:-1]
            self.columns.add_(self._step_columns)

    def _begin_step(self, new_tokens: torch.Tensor, columns: int) -> None:
        batch = new_tokens.shape[0]
        if not torch.compiler.is_compiling():
            self._check_room(batch, new_tokens)
            self.rows = batch
        offsets = self.collection.input_row_offsets
        offsets[0] = 0
        offsets[1 : batch + 1] = torch.cumsum(new_tokens, 0)
        self._step_columns = columns

    def _check_room(self, batch: int, new_tokens: torch.Tensor) -> None:
        if batch > self.max_batch_size:
            raise ValueError(
                f"batch: {batch} rows, more than max_batch_size={self.max_batch_size} "
                "(rows are batch x num_beams under beam search)"
            )
        longest = int((self.collection.cache_lengths[:batch] + new_tokens).max())
        if longest > self.max_cache_len:
            raise ValueError(f"max_cache_len: a row would hold {longest} tokens, more than {self.max_cache_len}")

    # -- Cache API ---------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every row (pages are not cleared: nothing reads past a row's length)."""
        self.rows = 0
        if self.collection is None:
            return
        self.collection.cache_lengths.zero_()
        self.collection.input_row_offsets.zero_()
        self.columns.zero_()

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` tokens of every row (HF's convention: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"tokens_to_remove: pass a negative count of tokens to drop, got {tokens_to_remove}")
        if self.collection is None:
            return
        lengths = self.collection.cache_lengths
        lengths.copy_((lengths + tokens_to_remove).clamp_(min=0))
        self.columns.copy_((self.columns + tokens_to_remove).clamp_(min=0))

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
        """Row i := old row `rows[i]`: copy the used pages of moved rows onto row i's own pages."""
        batch = rows.numel()
        if batch > self.max_batch_size:
            raise ValueError(
                f"rows: {batch} rows, more than max_batch_size={self.max_batch_size} "
                "(rows are batch x num_beams under beam search)"
            )
        if self.collection is None:  # nothing stored yet
            self.rows = batch
            return
        rows = rows.to(device=self.device, dtype=torch.int64)
        lengths = self.collection.cache_lengths
        new_lengths = lengths[rows]
        used = -(-int(new_lengths.max()) // self.collection.params.page_size) if batch else 0
        table = self.collection.lookup_table
        src, dst = table[rows, :used].flatten(), table[:batch, :used].flatten()
        moved = src != dst
        if bool(moved.any()):
            copy_pages(self.collection.blocks, src[moved].contiguous(), dst[moved].contiguous())
        lengths.zero_()
        lengths[:batch] = new_lengths
        self.rows = batch

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
        if self.collection is None:
            return (
                f"PagedCache(not allocated yet: {self.max_batch_size} rows x {self.max_cache_len} tokens, "
                f"page_size={self.page_size})"
            )
        return f"PagedCache({self.collection!r})"
