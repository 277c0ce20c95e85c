"""One typed argument record per op: its arguments in schema order, read by name.

`library.py` builds an op's record once per call, from the arguments the dispatcher passes (the
record fills the schema's defaults), and hands it to the validation, to each backend's `supports`
and to its kernel. An argument added to an op touches its record, `api.py` (the public signature,
which the record must match: `library.py` checks it at import), `shape_checks.py` and the kernels
that read it. Records are tuples: `op(*record)` calls the op with them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor


class StoreKVArgs(NamedTuple):
    key: Tensor
    value: Tensor
    blocks: Tensor
    cache_lengths: Tensor
    lookup_table: Tensor
    input_row_offsets: Tensor
    layer_idx: int
    scales: Tensor | None = None


class FlashAttentionArgs(NamedTuple):
    q: Tensor
    blocks: Tensor
    cache_lengths: Tensor
    lookup_table: Tensor
    input_row_offsets: Tensor
    layer_idx: int
    softmax_scale: float
    causal: bool = True
    sliding_window: int = -1
    softcap: float = 0.0
    scales: Tensor | None = None
    sinks: Tensor | None = None
    attention_chunk_size: int = -1
    tree_mask: Tensor | None = None


class GatherKVArgs(NamedTuple):
    blocks: Tensor
    cache_lengths: Tensor
    lookup_table: Tensor
    input_row_offsets: Tensor
    layer_idx: int
    max_kv_len: int
    scales: Tensor | None = None
    out_dtype: torch.dtype | None = None


class CopyPagesArgs(NamedTuple):
    blocks: Tensor
    src_pages: Tensor
    dst_pages: Tensor
    scales: Tensor | None = None


class StoreLatentArgs(NamedTuple):
    latent: Tensor
    k_rope: Tensor
    blocks: Tensor
    cache_lengths: Tensor
    lookup_table: Tensor
    input_row_offsets: Tensor
    layer_idx: int
    scales: Tensor | None = None


class MLAAttentionArgs(NamedTuple):
    q_nope: Tensor
    q_rope: Tensor
    blocks: Tensor
    cache_lengths: Tensor
    lookup_table: Tensor
    input_row_offsets: Tensor
    layer_idx: int
    softmax_scale: float
    causal: bool = True
    scales: Tensor | None = None
    key_positions: Tensor | None = None
    sinks: Tensor | None = None


RECORDS: dict[str, type[tuple]] = {
    "store_kv": StoreKVArgs,
    "flash_attention": FlashAttentionArgs,
    "gather_kv": GatherKVArgs,
    "copy_pages": CopyPagesArgs,
    "store_latent": StoreLatentArgs,
    "mla_attention": MLAAttentionArgs,
}
"""op name -> its argument record."""


def unpacked(fn: Callable[..., Any]) -> Callable[[tuple], Any]:
    """A kernel taking an op's record, from `fn`, which takes the op's arguments as `api.py` does (the
    reference, the tests' oracle, keeps the public signature)."""

    def run(a: tuple) -> Any:
        return fn(*a)

    run.__name__ = fn.__name__
    return run
