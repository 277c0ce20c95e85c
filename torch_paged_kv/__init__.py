"""torch_paged_kv: a paged KV cache for torch.compile'd LLM code (ops, collections, kernels)."""

from __future__ import annotations

from ._version import __version__
from .checkpoint import CheckpointError, load_cache, save_cache
from .collection import ContinuousBatchingKVCacheCollection, PagedKVCacheCollection, StepTensors
from .compile import mark_step_dynamic
from .kv_cache_views import ContinuousBatchingKVCache, PagedKVCache
from .layer_groups import LayerGroups
from .layout import NULL_PAGE
from .manager import KVCacheManager, OutOfPagesError
from .ops import (
    BackendUnavailableError,
    backend_info,
    copy_pages,
    flash_attention,
    gather_kv,
    mla_attention,
    store_kv,
    store_latent,
)
from .params import KVCacheParams, TPShard
from .sequence_checkpoint import load_sequences, save_sequences
from .step import GroupStepPlan, StepPlan

__all__ = [
    "NULL_PAGE",
    "BackendUnavailableError",
    "CheckpointError",
    "ContinuousBatchingKVCache",
    "ContinuousBatchingKVCacheCollection",
    "GroupStepPlan",
    "KVCacheManager",
    "KVCacheParams",
    "LayerGroups",
    "OutOfPagesError",
    "PagedKVCache",
    "PagedKVCacheCollection",
    "StepPlan",
    "StepTensors",
    "TPShard",
    "__version__",
    "backend_info",
    "copy_pages",
    "flash_attention",
    "gather_kv",
    "load_cache",
    "load_sequences",
    "mark_step_dynamic",
    "mla_attention",
    "save_cache",
    "save_sequences",
    "store_kv",
    "store_latent",
]
