"""`gather_kv`: one program per (sequence, token tile, chunk of heads x head_dim) copies K and V
into padded contiguous tensors, writing zeros past each sequence's kv_len."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import Launch, blocks_strides


# per-call sizes: no specialisation on ==1 or %16, so a new batch, total or layer compiles nothing
@triton.jit(do_not_specialize=["layer_idx", "max_kv_len"])
def _gather_kv_kernel(
    blocks,
    key_out,
    value_out,
    cache_lengths,
    lookup_table,
    input_row_offsets,
    num_pages,
    table_width,
    table_stride,
    page_size,
    layer_idx,
    max_kv_len,
    stride_page,
    stride_plane,
    stride_layer,
    stride_token,
    ROW: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_len = tl.load(cache_lengths + seq) + tl.load(input_row_offsets + seq + 1) - tl.load(input_row_offsets + seq)
    tok = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    idx = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    col = tok // page_size
    live = (tok < kv_len) & (col < table_width)
    page = tl.load(lookup_table + seq.to(tl.int64) * table_stride + col, mask=live, other=0)
    live = live & (page >= 0) & (page < num_pages)
    src = page.to(tl.int64) * stride_page + layer_idx * stride_layer + (tok % page_size) * stride_token
    src = src[:, None] + idx[None, :]
    load_mask = live[:, None] & (idx < ROW)[None, :]
    k = tl.load(blocks + src, mask=load_mask, other=0.0)
    v = tl.load(blocks + src + stride_plane, mask=load_mask, other=0.0)
    dst = (seq.to(tl.int64) * max_kv_len + tok)[:, None] * ROW + idx[None, :]
    store_mask = (tok < max_kv_len)[:, None] & (idx < ROW)[None, :]
    tl.store(key_out + dst, k, mask=store_mask)
    tl.store(value_out + dst, v, mask=store_mask)


def plan_gather_kv(
    blocks: torch.Tensor,
    cache_lengths: torch.Tensor,
    lookup_table: torch.Tensor,
    input_row_offsets: torch.Tensor,
    layer_idx: int,
    max_kv_len: int,
) -> tuple[torch.Tensor, torch.Tensor, list[Launch]]:
    """The (key, value) outputs, allocated, and the launch that fills them."""
    batch, num_kv_heads, head_dim = cache_lengths.shape[0], blocks.shape[4], blocks.shape[5]
    shape = (batch, max_kv_len, num_kv_heads, head_dim)
    key = torch.empty(shape, dtype=blocks.dtype, device=blocks.device)
    value = torch.empty(shape, dtype=blocks.dtype, device=blocks.device)
    if key.numel() == 0:
        return key, value, []
    row = num_kv_heads * head_dim
    block_r = min(triton.next_power_of_2(row), 1024)
    block_t = max(1, min(64, 4096 // block_r, triton.next_power_of_2(max_kv_len)))
    width, table_stride = (lookup_table.shape[1], lookup_table.stride(0)) if lookup_table.dim() == 2 else (1, 1)
    grid = (batch, triton.cdiv(max_kv_len, block_t), triton.cdiv(row, block_r))
    return (
        key,
        value,
        [
            Launch(
                _gather_kv_kernel,
                grid,
                (
                    blocks,
                    key,
                    value,
                    cache_lengths,
                    lookup_table,
                    input_row_offsets,
                    blocks.shape[0],
                    width,
                    table_stride,
                    blocks.shape[3],
                    layer_idx,
                    max_kv_len,
                    *blocks_strides(blocks),
                ),
                dict(ROW=row, BLOCK_T=block_t, BLOCK_R=block_r),
            )
        ],
    )


def gather_kv(
    blocks: torch.Tensor,
    cache_lengths: torch.Tensor,
    lookup_table: torch.Tensor,
    input_row_offsets: torch.Tensor,
    layer_idx: int,
    max_kv_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    key, value, launches = plan_gather_kv(blocks, cache_lengths, lookup_table, input_row_offsets, layer_idx, max_kv_len)
    for launch in launches:
        launch()
    return key, value
