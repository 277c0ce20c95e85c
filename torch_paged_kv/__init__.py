"""torch_paged_kv: a paged KV cache for torch.compile'd LLM code (ops, collections, kernels)."""

from __future__ import annotations

__version__ = "0.1.0"  # first: checkpoint.py records it

from .collection import (
    ContinuousBatchingKVCache,
    ContinuousBatchingKVCacheCollection,
    PagedKVCache,
    PagedKVCacheCollection,
    StepTensors,
)
from .compile import mark_step_dynamic
from .checkpoint import CheckpointError, load_cache, save_cache
from .layout import NULL_PAGE
from .manager import KVCacheManager, OutOfPagesError
from .ops import (
    BackendUnavailableError,
    backend_info,
    copy_pages,
    flash_attention,
    gather_kv,
    store_kv,
)
from .params import KVCacheParams


__all__ = [
    "KVCacheParams", "PagedKVCacheCollection", "ContinuousBatchingKVCacheCollection", "PagedKVCache",
    "ContinuousBatchingKVCache", "StepTensors", "NULL_PAGE", "store_kv", "flash_attention", "gather_kv",
    "copy_pages", "backend_info", "BackendUnavailableError", "KVCacheManager", "OutOfPagesError",
    "save_cache", "load_cache", "CheckpointError", "mark_step_dynamic", "__version__",
]
