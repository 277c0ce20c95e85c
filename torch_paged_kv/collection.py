"""Cache collections: they own the memory (the pool and the step tensors).

A collection owns one `blocks` pool for all layers plus the per-step tensors `cache_lengths`,
`lookup_table` and `input_row_offsets`, preallocated for `max_batch_size` rows so that a step
only ever updates them in place (CUDA graphs keep their addresses). A step with `batch` active
sequences uses the first `batch` rows: `collection.step_tensors(batch)`. The per-layer views they
hand out (MAX's `KVCacheT` surface) live in `kv_cache_views.py`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import huge_pages, layout
from .kv_cache_views import ContinuousBatchingKVCache, PagedKVCache
from .params import KVCacheParams


class StepTensors(NamedTuple):
    """The metadata of one step: the first `batch` rows of a collection's preallocated tensors."""

    cache_lengths: torch.Tensor
    lookup_table: torch.Tensor
    input_row_offsets: torch.Tensor


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return value


def _allocate_scales(params: KVCacheParams, physical_pages: int, device: torch.device) -> torch.Tensor | None:
    """The scales of an FP8 cache: `[pages, planes, layers, page_size, kv_heads, head_dim / granularity]`
    per granule (zeros: an unwritten slot reads as zeros), or the `[planes]` static per-tensor pair."""
    p = params
    if not p.quantized:
        return None
    if p.static_scales is not None:
        return torch.tensor(p.static_scales, dtype=torch.float32, device=device)
    shape = (physical_pages, p.num_planes, p.num_layers, p.page_size, p.num_kv_heads, p.scales_per_head)
    return torch.zeros(shape, dtype=p.scale_dtype, device=device)


class _Collection:
    """Storage shared by the paged and continuous-batching collections."""

    params: KVCacheParams
    blocks: torch.Tensor
    cache_lengths: torch.Tensor
    lookup_table: torch.Tensor
    input_row_offsets: torch.Tensor
    scales: torch.Tensor | None
    max_batch_size: int
    max_seq_len: int

    def _allocate(
        self,
        params: KVCacheParams,
        physical_pages: int,
        table_shape: tuple[int, ...],
        device: torch.device | str | None,
    ) -> None:
        if not isinstance(params, KVCacheParams):
            raise ValueError(f"params: expected KVCacheParams, got {type(params).__name__}")
        self.params = params
        device = torch.device(device if device is not None else "cpu")
        p = params
        self.blocks = huge_pages.zeros(
            physical_pages,
            p.num_planes,
            p.num_layers,
            p.page_size,
            p.num_kv_heads,
            p.head_dim,
            dtype=p.dtype,
            device=device,
        )
        self.scales = _allocate_scales(p, physical_pages, device)
        self.cache_lengths = torch.zeros(self.max_batch_size, dtype=torch.int32, device=device)
        self.lookup_table = torch.full(table_shape, layout.NULL_PAGE, dtype=torch.int32, device=device)
        self.input_row_offsets = torch.zeros(self.max_batch_size + 1, dtype=torch.int32, device=device)

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    @property
    def num_physical_pages(self) -> int:
        """Pages in `blocks`, the null page included."""
        return self.blocks.shape[0]

    def memory_footprint(self) -> int:
        """Bytes held by the pool (`blocks` and, for an FP8 cache, `scales`) and the step tensors."""
        tensors = (self.blocks, self.scales, self.cache_lengths, self.lookup_table, self.input_row_offsets)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def page_tensors(self) -> list[torch.Tensor]:
        """The tensors indexed by physical page: `blocks`, and the per-granule `scales` of an FP8 cache
        (what moves with a page when it is copied, offloaded, saved or sent)."""
        if self.scales is None or not self.params.has_scales_tensor:  # none, or a static scale per plane
            return [self.blocks]
        return [self.blocks, self.scales]

    def step_tensors(self, batch: int) -> StepTensors:
        """Views of the first `batch` rows of the step tensors (no copy)."""
        if not 0 < batch <= self.max_batch_size:
            raise ValueError(f"batch: expected 1..{self.max_batch_size}, got {batch}")
        return StepTensors(self.cache_lengths[:batch], self.lookup_table[:batch], self.input_row_offsets[: batch + 1])

    def get_key_cache(self, layer_idx: int) -> PagedKVCache:
        """Per-layer view of the keys (the latent plane of an MLA cache)."""
        return self._view(layer_idx, 0)

    def get_value_cache(self, layer_idx: int) -> PagedKVCache:
        """Per-layer view of the values; an MLA cache has none."""
        if self.params.is_mla:
            raise ValueError(
                "get_value_cache: an MLA cache has no value plane: its one latent row per token serves as "
                "both keys (latent + rope) and values (the latent, read by mla_attention); use get_key_cache"
            )
        return self._view(layer_idx, 1)

    def get_latent_cache(self, layer_idx: int) -> PagedKVCache:
        """Per-layer view of an MLA cache's latent rows (the same as `get_key_cache`)."""
        if not self.params.is_mla:
            raise ValueError("get_latent_cache: only an MLA cache (is_mla=True) has latent rows")
        return self._view(layer_idx, 0)

    def _view(self, layer_idx: int, plane: int) -> PagedKVCache:
        view_type = ContinuousBatchingKVCache if self.lookup_table.dim() == 1 else PagedKVCache
        return view_type(
            self.blocks,
            self.cache_lengths,
            self.lookup_table,
            layer_idx,
            plane,
            self.input_row_offsets,
            self.scales,
            rope_dim=self.params.rope_dim or 0,
        )


class PagedKVCacheCollection(_Collection):
    """A paged KV cache: `num_pages` usable pages of `params.page_size` tokens, plus the null page.

    `blocks` is `[num_pages + 1, 2|1, num_layers, page_size, num_kv_heads, head_dim]`; page
    `NULL_PAGE` (0) is reserved and pads every `lookup_table` row, whose width is a multiple of 8
    with 8 slack entries beyond the `max_seq_len` a sequence may reach.
    """

    def __init__(
        self,
        params: KVCacheParams,
        num_pages: int,
        max_batch_size: int,
        max_seq_len: int,
        device: torch.device | str | None = None,
    ) -> None:
        self.num_pages = _positive_int("num_pages", num_pages)
        self.max_batch_size = _positive_int("max_batch_size", max_batch_size)
        self.max_seq_len = _positive_int("max_seq_len", max_seq_len)
        width = layout.table_width(self.max_seq_len, params.page_size)
        self._allocate(params, num_pages + 1, (self.max_batch_size, width), device)

    @property
    def max_pages_per_sequence(self) -> int:
        """Pages a sequence of `max_seq_len` tokens needs."""
        return -(-self.max_seq_len // self.params.page_size)

    def __repr__(self) -> str:
        return (
            f"PagedKVCacheCollection({self.params}, num_pages={self.num_pages}, "
            f"max_batch_size={self.max_batch_size}, max_seq_len={self.max_seq_len}, "
            f"device={self.device})"
        )


class ContinuousBatchingKVCacheCollection(_Collection):
    """One slot (a page of `max_seq_len` tokens) per sequence; `lookup_table` is 1-D `[batch]`.

    `params.page_size` must equal `max_seq_len`. Slot `NULL_PAGE` (0) is reserved; row b of the
    table starts out pointing at slot b + 1.
    """

    def __init__(
        self, params: KVCacheParams, max_batch_size: int, max_seq_len: int, device: torch.device | str | None = None
    ) -> None:
        self.max_batch_size = _positive_int("max_batch_size", max_batch_size)
        self.max_seq_len = _positive_int("max_seq_len", max_seq_len)
        if params.page_size != max_seq_len:
            raise ValueError(
                f"params.page_size: a continuous-batching slot holds max_seq_len tokens, "
                f"so page_size must equal max_seq_len={max_seq_len}, got {params.page_size}"
            )
        self.num_pages = self.max_batch_size
        self._allocate(params, self.max_batch_size + 1, (self.max_batch_size,), device)
        self.lookup_table.copy_(torch.arange(1, self.max_batch_size + 1, dtype=torch.int32))

    def __repr__(self) -> str:
        return (
            f"ContinuousBatchingKVCacheCollection({self.params}, max_batch_size={self.max_batch_size}, "
            f"max_seq_len={self.max_seq_len}, device={self.device})"
        )
