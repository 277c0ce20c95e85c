"""The `cpu` backend's op entry points: one ctypes call into the compiled kernels each.

Arguments arrive validated (`ops/validate.py`), in schema order. Tensors are passed as data
pointers with their strides in elements; index tensors are int32 with unit stride in their last
dimension (validated), `blocks` is contiguous. The threads used are torch's (`torch.get_num_threads()`).
"""

from __future__ import annotations

import torch

from . import build

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

# Attention work split (read per call, so tests can force each path):
MIN_SPLIT_KEYS = 256
"""Fewest key positions in one split of a sequence's key range (split-KV when items are too few)."""
WANT_ITEMS = 0
"""Split key ranges until a call has this many work items; 0: four per thread."""
MIN_WORK_PER_THREAD = 1 << 17
"""Fewest multiply-adds (of Q K^T) per thread before a call uses another thread."""

_lib = None


def loaded() -> bool:
    return _lib is not None


def load():
    """The kernel library, built and loaded on first use (raises `build.BuildError`)."""
    global _lib
    if _lib is None:
        _lib = build.library()
    return _lib


def _kernels():
    return _lib if _lib is not None else load()


def _table(lookup_table: torch.Tensor) -> tuple[int, int, int]:
    """(pointer, row stride, usable columns) of a 2-D table, or of a 1-D one (one slot per row)."""
    if lookup_table.dim() == 2:
        return lookup_table.data_ptr(), lookup_table.stride(0), lookup_table.shape[1]
    return lookup_table.data_ptr(), lookup_table.stride(0), 1


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    blocks: torch.Tensor,
    cache_lengths: torch.Tensor,
    lookup_table: torch.Tensor,
    input_row_offsets: torch.Tensor,
    layer_idx: int,
) -> None:
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    pages, _, layers, page_size, heads, head_dim = blocks.shape
    table, table_stride, width = _table(lookup_table)
    _kernels().pkv_store_kv(
        blocks.element_size(), key.data_ptr(), key.stride(0), key.stride(1), value.data_ptr(), value.stride(0),
        value.stride(1), blocks.data_ptr(), pages, layers, page_size, heads, head_dim, cache_lengths.data_ptr(),
        table, table_stride, width, input_row_offsets.data_ptr(), cache_lengths.shape[0], layer_idx,
        torch.get_num_threads(),
    )  # fmt: skip


def flash_attention(
    q: torch.Tensor,
    blocks: torch.Tensor,
    cache_lengths: torch.Tensor,
    lookup_table: torch.Tensor,
    input_row_offsets: torch.Tensor,
    layer_idx: int,
    softmax_scale: float,
    causal: bool = True,
    sliding_window: int = -1,
    softcap: float = 0.0,
) -> torch.Tensor:
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty_like(q)  # contiguous, as q is
    pages, _, layers, page_size, heads, head_dim = blocks.shape
    table, table_stride, width = _table(lookup_table)
    _kernels().pkv_flash_attention(
        DTYPE_CODES[q.dtype], q.data_ptr(), q.stride(0), q.stride(1), blocks.data_ptr(), pages, layers, page_size,
        heads, head_dim, cache_lengths.data_ptr(), table, table_stride, width, input_row_offsets.data_ptr(),
        cache_lengths.shape[0], layer_idx, q.shape[1], softmax_scale, causal, sliding_window, softcap,
        out.data_ptr(), out.stride(0), out.stride(1), MIN_SPLIT_KEYS, WANT_ITEMS, MIN_WORK_PER_THREAD,
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def gather_kv(
    blocks: torch.Tensor,
    cache_lengths: torch.Tensor,
    lookup_table: torch.Tensor,
    input_row_offsets: torch.Tensor,
    layer_idx: int,
    max_kv_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    pages, _, layers, page_size, heads, head_dim = blocks.shape
    batch = cache_lengths.shape[0]
    key = blocks.new_empty(batch, max_kv_len, heads, head_dim)
    value = blocks.new_empty(batch, max_kv_len, heads, head_dim)
    table, table_stride, width = _table(lookup_table)
    _kernels().pkv_gather_kv(
        blocks.element_size(), blocks.data_ptr(), pages, layers, page_size, heads, head_dim, cache_lengths.data_ptr(),
        table, table_stride, width, input_row_offsets.data_ptr(), batch, layer_idx, max_kv_len, key.data_ptr(),
        value.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return key, value


def copy_pages(blocks: torch.Tensor, src_pages: torch.Tensor, dst_pages: torch.Tensor) -> None:
    if src_pages.shape[0] == 0:
        return
    page_bytes = blocks.stride(0) * blocks.element_size()
    _kernels().pkv_copy_pages(
        blocks.data_ptr(), page_bytes, blocks.shape[0], src_pages.data_ptr(), dst_pages.data_ptr(),
        src_pages.shape[0], torch.get_num_threads(),
    )  # fmt: skip
