"""torch_paged_kv: a paged KV cache for torch.compile'd LLM code (ops, collections, kernels)."""

from __future__ import annotations

from .collection import (
    ContinuousBatchingKVCache,
    ContinuousBatchingKVCacheCollection,
    PagedKVCache,
    PagedKVCacheCollection,
    StepTensors,
)
from .layout import NULL_PAGE
from .ops import BackendUnavailableError, backend_info, copy_pages, flash_attention, gather_kv, store_kv
from .params import KVCacheParams

__version__ = "0.1.0"

__all__ = [
    "KVCacheParams", "PagedKVCacheCollection", "ContinuousBatchingKVCacheCollection", "PagedKVCache",
    "ContinuousBatchingKVCache", "StepTensors", "NULL_PAGE", "store_kv", "flash_attention", "gather_kv",
    "copy_pages", "backend_info", "BackendUnavailableError", "__version__",
]
