"""The `paged_kv` ops (see DESIGN.md for the contract) and their Python entry points.

Importing this package registers the ops and every backend that can load here.
"""

from __future__ import annotations

import torch

from . import (
    backends,  # noqa: F401  (registers the backends)
    library,  # noqa: F401  (registers torch.ops.paged_kv.*)
)
from .dispatch import BackendUnavailableError, backend_info

store_kv = torch.ops.paged_kv.store_kv.default
"""`store_kv(key, value, blocks, cache_lengths, lookup_table, input_row_offsets, layer_idx)`:
write this step's new K/V rows at positions `cache_lengths[b] + t` (mutates `blocks`)."""

flash_attention = torch.ops.paged_kv.flash_attention.default
"""`flash_attention(q, blocks, cache_lengths, lookup_table, input_row_offsets, layer_idx,
softmax_scale, causal=True, sliding_window=-1, softcap=0.0) -> out`: attention of the new
queries over `cache_lengths[b] + new_b` cached keys (call after `store_kv` of the same step)."""

gather_kv = torch.ops.paged_kv.gather_kv.default
"""`gather_kv(blocks, cache_lengths, lookup_table, input_row_offsets, layer_idx, max_kv_len)
-> (key, value)`: contiguous `[batch, max_kv_len, kv_heads, head_dim]`, zero past each length."""

copy_pages = torch.ops.paged_kv.copy_pages.default
"""`copy_pages(blocks, src_pages, dst_pages)`: `blocks[dst[i]] = blocks[src[i]]`, all sources read first."""

store_kv_unchecked = torch.ops.paged_kv.store_kv.unchecked
"""`store_kv` without the value checks (shape checks still run): for a caller whose step tensors a
checked call of the same step has covered, such as the layers after layer 0."""

flash_attention_unchecked = torch.ops.paged_kv.flash_attention.unchecked
"""`flash_attention` without the value checks (shape checks still run); see `store_kv_unchecked`."""

gather_kv_unchecked = torch.ops.paged_kv.gather_kv.unchecked
"""`gather_kv` without the value checks (shape checks still run); see `store_kv_unchecked`."""

copy_pages_unchecked = torch.ops.paged_kv.copy_pages.unchecked
"""`copy_pages` without the value checks (shape checks still run): page ids out of range or
duplicate destinations are not caught."""

__all__ = [
    "BackendUnavailableError",
    "backend_info",
    "copy_pages",
    "copy_pages_unchecked",
    "flash_attention",
    "flash_attention_unchecked",
    "gather_kv",
    "gather_kv_unchecked",
    "store_kv",
    "store_kv_unchecked",
]
