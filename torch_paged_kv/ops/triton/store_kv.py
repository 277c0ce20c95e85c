"""`store_kv`: one program per (new row, chunk of heads x head_dim) writes K and V into its page slot.

An FP8 cache gets the values quantized on the way (`ops/quant.py`'s rule): per granule, each
granule's amax over the chunk's elements gives its scale, stored beside the page; per tensor, the
plane's static scale. The pool is then addressed as raw bytes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..records import StoreKVArgs
from .common import Launch, blocks_strides, grid_fits, new_row_page, search_steps
from .fp8 import covered, float_to_fp8_bits, quantization, quantize_granules


# per-call sizes: no specialisation on ==1 or %16, so a new batch, total or layer compiles nothing
@triton.jit(do_not_specialize=["batch", "layer_idx"])
def _store_kv_kernel(
    key,
    value,
    blocks,
    cache_lengths,
    lookup_table,
    input_row_offsets,
    batch,
    num_pages,
    table_width,
    table_stride,
    page_size,
    layer_idx,
    key_stride_row,
    key_stride_head,
    value_stride_row,
    value_stride_head,
    stride_page,
    stride_plane,
    stride_layer,
    stride_token,
    scales,
    scale_stride_page,
    scale_stride_plane,
    scale_stride_layer,
    scale_stride_token,
    HEAD_DIM: tl.constexpr,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
    STEPS: tl.constexpr,
    QUANT: tl.constexpr,
    GRAN: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    FMAX: tl.constexpr,
):
    row = tl.program_id(0)
    # A page id outside `blocks` or the null page 0 (possible only if data checks were off) writes nothing.
    pos, page, in_range = new_row_page(
        row, cache_lengths, lookup_table, input_row_offsets, batch, num_pages, table_width, table_stride, page_size,
        STEPS,
    )  # fmt: skip

    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < tl.where(in_range, ROW, 0)  # (scalar & block masks break the interpreter)
    head = idx // HEAD_DIM
    dim = idx % HEAD_DIM
    k = tl.load(key + row.to(tl.int64) * key_stride_row + head * key_stride_head + dim, mask=mask)
    v = tl.load(value + row.to(tl.int64) * value_stride_row + head * value_stride_head + dim, mask=mask)
    # int64 before any multiply: a continuous-batching page (slot) spans gigabytes, so the layer and
    # token offsets outgrow int32 (Triton passes small ints as i32 and would multiply in i32).
    slot = (
        page.to(tl.int64) * stride_page
        + layer_idx.to(tl.int64) * stride_layer
        + (pos % page_size).to(tl.int64) * stride_token
        + idx
    )
    if QUANT == 0:
        tl.store(blocks + slot, k, mask=mask)
        tl.store(blocks + slot + stride_plane, v, mask=mask)
    else:
        scale_slot = (
            page.to(tl.int64) * scale_stride_page
            + layer_idx.to(tl.int64) * scale_stride_layer
            + (pos % page_size).to(tl.int64) * scale_stride_token
        )
        in_range_row = tl.where(in_range, ROW, 0)
        for plane in tl.static_range(2):
            x = (k if plane == 0 else v).to(tl.float32)
            bits = _quantize(x, scales, scale_slot + plane * scale_stride_plane, plane, in_range_row,
                             BLOCK, QUANT, GRAN, MANT, BIAS, FMAX)  # fmt: skip
            tl.store(blocks + slot + plane * stride_plane, bits.to(tl.uint8), mask=mask)


@triton.jit
def _quantize(x, scales, scale_slot, plane, live, BLOCK: tl.constexpr, QUANT: tl.constexpr, GRAN: tl.constexpr,
              MANT: tl.constexpr, BIAS: tl.constexpr, FMAX: tl.constexpr):  # fmt: skip
    """FP8 bytes of this program's chunk `x` (fp32 `[BLOCK]`, elements `pid * BLOCK ..` of a token's row);
    per granule (QUANT 1) the chunk's granule scales are stored at `scale_slot` first (the first
    `live` elements are real)."""
    if QUANT == 2:
        return float_to_fp8_bits(tl.math.div_rn(x, tl.load(scales + plane)), MANT, BIAS, FMAX)
    bits, scale = quantize_granules(x, BLOCK, GRAN, MANT, BIAS, FMAX)
    NG: tl.constexpr = BLOCK // GRAN
    group = tl.program_id(1) * NG + tl.arange(0, NG)
    tl.store(scales + scale_slot + group, scale, mask=group * GRAN < live)
    return bits


def _grid(total: int, row: int, granularity: int = 1) -> tuple[tuple[int, int], int]:
    """(grid, BLOCK): one program per (new row, chunk of heads x head_dim); a chunk holds whole
    granules (`granularity`, a power of two dividing head_dim)."""
    block = max(min(triton.next_power_of_2(row), 4096), granularity)
    return (total, triton.cdiv(row, block)), block


def supports(a: StoreKVArgs) -> bool:
    """Calls whose grid CUDA can launch and whose quantization the kernel handles (shapes only)."""
    key = a.key
    launchable = key.shape[0] == 0 or grid_fits(_grid(key.shape[0], key.shape[1] * key.shape[2])[0])
    return launchable and covered(a.blocks, a.scales)


def plan_store_kv(a: StoreKVArgs) -> list[Launch]:
    key, value, blocks, lookup_table = a.key, a.value, a.blocks, a.lookup_table
    total, num_kv_heads, head_dim = key.shape
    batch = a.cache_lengths.shape[0]
    if total == 0 or batch == 0:
        return []
    key = key if key.stride(2) == 1 else key.contiguous()
    value = value if value.stride(2) == 1 else value.contiguous()
    row = num_kv_heads * head_dim
    quant = quantization(blocks, a.scales)
    grid, block = _grid(total, row, int(quant.constexprs["GRAN"]))
    width, table_stride = (lookup_table.shape[1], lookup_table.stride(0)) if lookup_table.dim() == 2 else (1, 1)
    return [
        Launch(
            _store_kv_kernel,
            grid,
            (
                key,
                value,
                quant.pool,
                a.cache_lengths,
                lookup_table,
                a.input_row_offsets,
                batch,
                blocks.shape[0],
                width,
                table_stride,
                blocks.shape[3],
                a.layer_idx,
                key.stride(0),
                key.stride(1),
                value.stride(0),
                value.stride(1),
                *blocks_strides(blocks),
                quant.scales,
                *quant.scale_strides,
            ),
            dict(HEAD_DIM=head_dim, ROW=row, BLOCK=block, STEPS=search_steps(batch), **quant.constexprs),
        )
    ]


def store_kv(a: StoreKVArgs) -> None:
    for launch in plan_store_kv(a):
        launch()
