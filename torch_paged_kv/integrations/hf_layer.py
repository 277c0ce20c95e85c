"""`PagedLayer`: one cached model layer of a `PagedCache` (transformers' per-layer cache surface).

Under `attn_implementation="paged_kv"` its `update` stores nothing and hands the attention function
a `PendingKV`; under any other attention it stores the step's K/V and returns them gathered. An MLA
layer goes through `hf_mla`. The step protocol itself (`layer_plan`, `layer_done`) is the cache's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from transformers.cache_utils import CacheLayerMixin

from . import hf_mla

if TYPE_CHECKING:
    from .hf_cache import PagedCache


class PendingKV(NamedTuple):
    """What `update` returns as keys (and values) under `attn_implementation="paged_kv"`: to be handed
    to the attention function as is. Model code that uses it as a tensor (reshapes or combines the
    cached keys itself) gets a `ValueError` naming `config.model_type`, before anything is stored."""

    layer: PagedLayer
    key: torch.Tensor  # [batch, kv_heads, new, head_dim], rotary already applied
    value: torch.Tensor

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise _used_as_tensor(self.layer, f".{name}")

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        pending = _find_pending([*args, *(kwargs or {}).values()])
        assert pending is not None  # torch calls this only with a PendingKV among the arguments
        raise _used_as_tensor(pending.layer, getattr(func, "__name__", str(func)))


def _find_pending(values: Any) -> PendingKV | None:
    """The first `PendingKV` in `values`, looking into lists, tuples and dicts (torch.cat's list)."""
    if isinstance(values, PendingKV):
        return values
    items = values.values() if isinstance(values, dict) else values if isinstance(values, (list, tuple)) else ()
    return next((p for p in map(_find_pending, items) if p is not None), None)


def _used_as_tensor(layer: PagedLayer, use: str) -> ValueError:
    model_type = getattr(layer.cache.config, "model_type", None)
    return ValueError(
        f"config.model_type: {model_type!r} layer {layer.layer_idx} uses the K/V the cache returns itself ({use}) "
        "instead of handing them to the attention function, which attn_implementation='paged_kv' needs (the "
        "keys are stored by the attention); use PagedCache with the model's default attention"
    )


class PagedLayer(CacheLayerMixin):
    """One cached model layer's view of the cache (HF's per-layer cache surface).

    `layer_idx` is the model's layer index, `pool_layer` its index among the cached layers (what the
    step's `GroupStepPlan` maps to a group and its pool layer). Row operations (reset, crop, reorder,
    select) touch every layer at once, so `PagedCache` does them.
    """

    is_compileable = True
    is_croppable = True
    is_sliding = False

    def __init__(self, cache: PagedCache, layer_idx: int, pool_layer: int) -> None:
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.pool_layer = pool_layer
        self.is_initialized = cache.pool is not None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate the pools (for every layer) if they do not exist yet."""
        self.cache.ensure_pool(key_states)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[Any, Any]:
        """Paged attention: defer to the attention function. Otherwise store and gather K/V."""
        cache = self.cache
        if self.pool_layer == 0:  # the step's first cached layer
            cache.ensure_pool(key_states)
            cache.read_attention_mode()
        if cache.is_mla:
            return hf_mla.update(self, key_states, value_states, kwargs)
        if cache.attends_from_pages:
            pending = PendingKV(self, key_states, value_states)
            return pending, pending
        batch, _, new, _ = key_states.shape
        counts = lambda: torch.full((batch,), new, dtype=torch.int32, device=cache.device)
        plan = cache.layer_plan(self.layer_idx, batch, new, counts)
        plan.store_kv(token_rows(key_states), token_rows(value_states), self.pool_layer)
        keys, values = cache.gather(plan, self.pool_layer, key_states.dtype)
        cache.layer_done(self.layer_idx, batch)
        return keys.transpose(1, 2).contiguous(), values.transpose(1, 2).contiguous()

    @property
    def keys(self) -> torch.Tensor | None:
        """A copy of the K this layer holds, read from the pages (`PagedCache.held_kv`), for code that
        reads a cache layer's tensors between steps (Whisper's `generate` returning its cache per row).
        Writing into it does not change the cache."""
        held = self.cache.held_kv(self.pool_layer)
        return None if held is None else held[0]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        _refuse_assignment(value, "keys")

    @property
    def values(self) -> torch.Tensor | None:
        """A copy of the V this layer holds (see `keys`)."""
        held = self.cache.held_kv(self.pool_layer)
        return None if held is None else held[1]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        _refuse_assignment(value, "values")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """K/V always span `max_cache_len` columns (what `update` returns)."""
        return self.cache.max_cache_len, 0

    def get_seq_length(self) -> Any:
        """Columns seen so far (padding included): a 0-dim tensor like `StaticLayer`'s, or the int 0
        before the pool exists (also like `StaticLayer`; transformers annotates an int)."""
        pool = self.cache.pool
        return 0 if pool is None else pool.columns

    def get_max_length(self) -> int:
        return self.cache.max_cache_len

    get_max_cache_shape = get_max_length  # the abstract name before transformers 5.13


def _refuse_assignment(value: torch.Tensor | None, name: str) -> None:
    """`CacheLayerMixin` sets `keys` and `values` to None; a tensor set there would never reach the pages."""
    if value is not None:
        raise ValueError(f"{name}: a PagedCache layer's K/V live in its pages; store them through update()")


def token_rows(states: torch.Tensor) -> torch.Tensor:
    """`[batch, heads, new, head_dim]` -> `[batch*new, heads, head_dim]` (batch-major rows)."""
    return states.transpose(1, 2).reshape(-1, states.shape[1], states.shape[3])
