"""`gather_kv`: one program per (token tile, sequence, chunk of heads x head_dim) copies K and V
into padded contiguous tensors, writing zeros past each sequence's kv_len.

Token tiles, the one dimension that grows with context, go on grid x (up to 2**31 - 1; grid y and z
stop at 65535); sequences on y, a program taking every `num_programs(1)`-th one past 65535. An FP8
cache is read as bytes and dequantized (`fp8.py`); the outputs take their own dtype (`out_dtype`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..records import GatherKVArgs
from .common import MAX_GRID, Launch, blocks_strides, grid_fits, page_at
from .fp8 import covered, fp8_bits_to_float, quantization


# per-call sizes: no specialisation on ==1 or %16, so a new batch, total or layer compiles nothing
@triton.jit(do_not_specialize=["batch", "layer_idx", "max_kv_len"])
def _gather_kv_kernel(
    blocks,
    key_out,
    value_out,
    cache_lengths,
    lookup_table,
    input_row_offsets,
    batch,
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
    scales,
    scale_stride_page,
    scale_stride_plane,
    scale_stride_layer,
    scale_stride_token,
    ROW: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    QUANT: tl.constexpr,
    GRAN: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    FMAX: tl.constexpr,
):
    for seq in range(tl.program_id(1), batch, tl.num_programs(1)):
        kv_len = tl.load(cache_lengths + seq) + tl.load(input_row_offsets + seq + 1) - tl.load(input_row_offsets + seq)
        tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        idx = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
        table_row = lookup_table + tl.cast(seq, tl.int64) * table_stride
        page, live = page_at(table_row, tok, kv_len, page_size, table_width, num_pages, False)
        # int64 before any multiply: the layer and token offsets of a large page outgrow int32.
        src = (
            page.to(tl.int64) * stride_page
            + layer_idx.to(tl.int64) * stride_layer
            + (tok % page_size).to(tl.int64) * stride_token
        )
        src = src[:, None] + idx[None, :]
        load_mask = live[:, None] & (idx < ROW)[None, :]
        k = tl.load(blocks + src, mask=load_mask, other=0)
        v = tl.load(blocks + src + stride_plane, mask=load_mask, other=0)
        if QUANT == 1:  # per granule: row element idx has scale idx // GRAN of its token's scale row
            scale_src = (
                page.to(tl.int64) * scale_stride_page
                + layer_idx.to(tl.int64) * scale_stride_layer
                + (tok % page_size).to(tl.int64) * scale_stride_token
            )[:, None] + (idx // GRAN)[None, :]
            k_scale = tl.load(scales + scale_src, mask=load_mask, other=0.0)
            v_scale = tl.load(scales + scale_stride_plane + scale_src, mask=load_mask, other=0.0)
            k = fp8_bits_to_float(k, MANT, BIAS) * k_scale
            v = fp8_bits_to_float(v, MANT, BIAS) * v_scale
        elif QUANT == 2:
            k = fp8_bits_to_float(k, MANT, BIAS) * tl.load(scales)
            v = fp8_bits_to_float(v, MANT, BIAS) * tl.load(scales + 1)
        dst = (tl.cast(seq, tl.int64) * max_kv_len + tok)[:, None] * ROW + idx[None, :]
        store_mask = (tok < max_kv_len)[:, None] & (idx < ROW)[None, :]
        tl.store(key_out + dst, k.to(key_out.dtype.element_ty), mask=store_mask)
        tl.store(value_out + dst, v.to(value_out.dtype.element_ty), mask=store_mask)


def _grid(batch: int, max_kv_len: int, row: int) -> tuple[tuple[int, int, int], int, int]:
    """(grid, BLOCK_T, BLOCK_R): token tiles on x, sequences on y (capped), row chunks on z."""
    block_r = min(triton.next_power_of_2(row), 1024)
    block_t = max(1, min(64, 4096 // block_r, triton.next_power_of_2(max_kv_len)))
    return (triton.cdiv(max_kv_len, block_t), min(batch, MAX_GRID[1]), triton.cdiv(row, block_r)), block_t, block_r


def supports(a: GatherKVArgs) -> bool:
    """Calls whose grid CUDA can launch, whose token indices stay int32 and whose FP8 granules the
    kernel handles (shapes only)."""
    batch, row = a.cache_lengths.shape[0], a.blocks.shape[4] * a.blocks.shape[5]
    if not covered(a.blocks, a.scales):
        return False
    if batch == 0 or a.max_kv_len == 0 or row == 0:
        return True
    grid, block_t, _ = _grid(batch, a.max_kv_len, row)
    return grid_fits(grid) and grid[0] * block_t <= 2**31


def plan_gather_kv(a: GatherKVArgs) -> tuple[torch.Tensor, torch.Tensor, list[Launch]]:
    """The (key, value) outputs, allocated, and the launch that fills them."""
    blocks, lookup_table, max_kv_len, scales = a.blocks, a.lookup_table, a.max_kv_len, a.scales
    batch, num_kv_heads, head_dim = a.cache_lengths.shape[0], blocks.shape[4], blocks.shape[5]
    shape = (batch, max_kv_len, num_kv_heads, head_dim)
    dtype = a.out_dtype or (torch.float32 if scales is not None else blocks.dtype)
    key = torch.empty(shape, dtype=dtype, device=blocks.device)
    value = torch.empty(shape, dtype=dtype, device=blocks.device)
    if key.numel() == 0:
        return key, value, []
    grid, block_t, block_r = _grid(batch, max_kv_len, num_kv_heads * head_dim)
    quant = quantization(blocks, scales)
    width, table_stride = (lookup_table.shape[1], lookup_table.stride(0)) if lookup_table.dim() == 2 else (1, 1)
    return (
        key,
        value,
        [
            Launch(
                _gather_kv_kernel,
                grid,
                (
                    quant.pool,
                    key,
                    value,
                    a.cache_lengths,
                    lookup_table,
                    a.input_row_offsets,
                    batch,
                    blocks.shape[0],
                    width,
                    table_stride,
                    blocks.shape[3],
                    a.layer_idx,
                    max_kv_len,
                    *blocks_strides(blocks),
                    quant.scales,
                    *quant.scale_strides,
                ),
                dict(ROW=num_kv_heads * head_dim, BLOCK_T=block_t, BLOCK_R=block_r, **quant.constexprs),
            )
        ],
    )


def gather_kv(a: GatherKVArgs) -> tuple[torch.Tensor, torch.Tensor]:
    key, value, launches = plan_gather_kv(a)
    for launch in launches:
        launch()
    return key, value
