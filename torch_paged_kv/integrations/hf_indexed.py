"""`PagedIndexedLayer`: the cache layer of a sparse-attention layer (transformers' "indexed_attention":
DeepSeek-V3.2, GLM-5 and the other DSA models), whose indexer keeps one key row per token
(`[index_head_dim]`, one head) beside the layer's K/V, to pick each query's top-k keys.

Its K/V (or MLA latent) are in the pages, as for any `PagedLayer`. The indexer keys are in one buffer
of `max_batch_size` rows x `max_cache_len` columns, each token at the column its K/V take, and
`update_indexer` returns the batch's rows of it whole: transformers' `StaticIndexedLayer`'s layout,
whose unfilled columns the model's own mask hides. `saved_keys` and `restore` are what
`PagedCache.save` / `load` store and set of it.

Under `paged_kv` (`hf_support.SPARSE_MLA_MODEL_TYPES`) the mask function gives such models the full
causal mask over those columns (the indexer needs it), and the model hands the attention function
each query's top-k columns (`indices=`); `key_positions` turns them into positions in the pages,
which hold only the real tokens, for `mla_attention`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .hf_layer import PagedLayer

if TYPE_CHECKING:
    from .hf_cache import PagedCache


class PagedIndexedLayer(PagedLayer):
    """A `PagedLayer` with the indexer keys of its rows (see the module docstring)."""

    def __init__(self, cache: PagedCache, layer_idx: int, pool_layer: int) -> None:
        super().__init__(cache, layer_idx, pool_layer)
        self.indexer_keys: torch.Tensor | None = None  # [max_batch_size, max_cache_len, index_head_dim]
        self.indexer_columns: torch.Tensor | None = None  # 0-dim int64: the columns written (= the K/V's)
        self.indexer_position_ids = None  # transformers' attribute (no model it serves sets it)

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        """Write this step's indexer keys `[batch, new, index_head_dim]` at the step's columns; return the
        batch's rows of every column `[batch, max_cache_len, index_head_dim]`."""
        batch, new, width = indexer_key_states.shape
        if self.indexer_keys is None or self.indexer_keys.shape[2] != width:
            self._allocate(indexer_key_states)
        keys, columns = self.indexer_keys, self.indexer_columns
        assert keys is not None and columns is not None  # made by `_allocate`
        positions = torch.arange(new, device=keys.device) + columns
        keys[:batch].index_copy_(1, positions, indexer_key_states.to(keys.dtype))
        columns.add_(new)
        return keys[:batch]

    def _allocate(self, like: torch.Tensor) -> None:
        cache = self.cache
        shape = (cache.max_batch_size, cache.max_cache_len, like.shape[2])
        self.indexer_keys = torch.zeros(shape, dtype=like.dtype, device=like.device)
        self.indexer_columns = torch.zeros((), dtype=torch.int64, device=like.device)
        if not torch.compiler.is_compiling():
            torch._dynamo.mark_static_address(self.indexer_keys)
            torch._dynamo.mark_static_address(self.indexer_columns)

    def saved_keys(self, rows: int, columns: int) -> torch.Tensor | None:
        """The first `rows` rows' keys of the first `columns` columns (None: no step wrote any)."""
        return None if self.indexer_keys is None else self.indexer_keys[:rows, :columns].contiguous()

    def restore(self, keys: torch.Tensor) -> None:
        """Hold `keys` `[rows, columns, index_head_dim]` (a checkpoint's) as rows 0.. up to column `columns`."""
        rows, columns, _ = keys.shape
        self._allocate(keys)
        assert self.indexer_keys is not None and self.indexer_columns is not None  # made by `_allocate`
        self.indexer_keys[:rows, :columns] = keys
        self.indexer_columns.fill_(columns)

    def set_columns(self, columns: torch.Tensor | int) -> None:
        """After `reset` (0) or `crop` (the cache's column count): later keys go there."""
        if self.indexer_columns is not None:
            self.indexer_columns.fill_(columns)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Row i := old row `rows[i]` (beam reorder, batch select, repeat)."""
        if self.indexer_keys is not None:
            self.indexer_keys[: rows.numel()] = self.indexer_keys[rows.to(self.indexer_keys.device)]


def key_positions(indices: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The page positions of the keys the indexer picked, `[batch * new, k]` int32, -1 where a pick is a
    column the query may not see (top-k over fewer visible columns than k picks masked ones too).

    `indices` `[batch, new, k]`: columns of the indexer's layout (every token of each row, padding
    included); `attention_mask` `[batch, 1, new, columns]` bool: which columns each query sees (causal,
    padding, padded queries' rows all False). The pages hold a row's real tokens in column order, so a
    column's position is the count of real columns before it; the columns some query of the step sees
    are the real ones up to the step's last real token, which is all any pick may be. `O(batch x
    columns)` beside the picks: no `[new, columns]` intermediate besides the mask itself."""
    visible = attention_mask[:, 0]
    picks = indices.long()
    real = visible.any(1)  # [batch, columns]
    before = real.cumsum(-1, dtype=torch.int32) - 1
    positions = before.gather(-1, picks.flatten(1)).view(picks.shape)
    return torch.where(visible.gather(-1, picks), positions, -1).flatten(0, 1)
