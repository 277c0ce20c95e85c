"""Row arithmetic of the paged layout, shared by collections, kernels and tests.

`blocks` is `[num_pages, num_planes, num_layers, page_size, num_kv_heads, head_dim]`. Seen as a
2-D matrix of rows of width `num_kv_heads * head_dim` (the "row view" TMA descriptors use), the
row holding token offset `o` of page `p` for (layer, plane) is

    p * page_stride_rows + plane_row_offset + o
    page_stride_rows  = num_planes * num_layers * page_size
    plane_row_offset  = (plane * num_layers + layer) * page_size

Every function uses only `+ * // %`, so it works on Python ints, torch tensors and symbolic ints.
"""

from __future__ import annotations

from typing import TypeVar

import torch

IntLike = TypeVar("IntLike", int, torch.Tensor)

NULL_PAGE = 0
"""Physical page every collection reserves and pads lookup tables with. Never owned by a sequence."""

TABLE_ALIGN = 8
"""Lookup-table widths are multiples of this, with at least this many slack entries."""


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that is >= `value`."""
    return -(-value // multiple) * multiple


def table_width(max_seq_len: int, page_size: int) -> int:
    """Lookup-table width: pages for `max_seq_len` tokens, rounded to 8, plus 8 slack entries."""
    return round_up(-(-max_seq_len // page_size), TABLE_ALIGN) + TABLE_ALIGN


def page_stride_rows(num_planes: int, num_layers: int, page_size: int) -> int:
    """Rows between the same (layer, plane, offset) of consecutive pages in the row view."""
    return num_planes * num_layers * page_size


def plane_row_offset(layer_idx: int, plane: int, num_layers: int, page_size: int) -> int:
    """Row of token 0 of page 0 for (layer, plane) in the row view."""
    return (plane * num_layers + layer_idx) * page_size


def tma_row(encoded: IntLike, page_size: int, page_stride: int, plane_offset: int) -> IntLike:
    """Row-view row of an encoded token index `encoded = page * page_size + offset`."""
    return (encoded // page_size) * page_stride + plane_offset + encoded % page_size
