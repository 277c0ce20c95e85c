"""Scale-out on `torch.distributed`: tensor-parallel caches and page transfer between processes.

- `tensor_parallel`: KV heads sharded over the ranks of a group (`shard_params`, `tp_shard`, `head_shard`) and
  `TensorParallelKVCacheManager`, identical page decisions on every rank, checked each step.
- `transfer`: `send_sequences` / `receive_sequences`, the pages of whole sequences from one
  process's pool to another's (disaggregated prefill and decode), all or nothing.
- `wire`: the transfer's messages, byte for byte.
- `reshard`: KV-state checkpoints saved at one tensor-parallel size loaded at another.

See docs/distributed.md.
"""

from __future__ import annotations

from .reshard import load_cache_sharded, load_sharded, shard_path
from .tensor_parallel import (
    TensorParallelDivergenceError,
    TensorParallelKVCacheManager,
    head_shard,
    kv_head_range,
    shard_params,
    tp_shard,
    unshard_params,
)
from .transfer import (
    TransferError,
    TransferRejected,
    TransferStats,
    receive_sequences,
    send_sequences,
)

__all__ = [
    "TensorParallelDivergenceError",
    "TensorParallelKVCacheManager",
    "TransferError",
    "TransferRejected",
    "TransferStats",
    "head_shard",
    "kv_head_range",
    "load_cache_sharded",
    "load_sharded",
    "receive_sequences",
    "send_sequences",
    "shard_params",
    "shard_path",
    "tp_shard",
    "unshard_params",
]
