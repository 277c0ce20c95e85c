"""`store_latent`: one program per new row writes its latent and rope key into the token's MLA row.

An FP8 pool gets MAX's rope-aware row: the latent quantized with the rule of `ops/quant.py` (per
granule: scale = amax / dtype max, code = round(x / scale) clamped; or one static scale), its codes
as bytes, then the rope as bf16; the scales go to `scales`. The kernel sees the pool through two
views of one layer (latent columns and rope columns, `mla_views`), so FP8 and 16/32-bit rows take
the same addressing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..records import StoreLatentArgs
from .common import Launch, new_row_page, search_steps
from .fp8 import FORMATS, float_to_fp8_bits, quantize_granules


def mla_views(blocks: torch.Tensor, rank: int, scales: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """(latent, rope, scales) views of the pool, each `[pages, layers, page_size, columns]`: the latent
    columns (uint8 codes in an FP8 pool), the rope columns (bf16 after the FP8 bytes in an FP8 pool),
    and the per-granule scales (or the static `[1]` scale; the latent view itself when unquantized).
    Kernels add `layer_idx` times the layer stride themselves: a layer-sliced view would move the
    pointers' 16-byte alignment with the layer (a recompile per layer on some page sizes)."""
    rows = blocks[:, 0, :, :, 0]  # [pages, layers, page_size, row]
    if scales is None:
        return rows[..., :rank], rows[..., rank:], rows
    raw = rows.view(torch.uint8)
    pool_scales = scales[:, 0, :, :, 0] if scales.dim() == 6 else scales
    return raw[..., :rank], raw[..., rank:].view(torch.bfloat16), pool_scales


def view_strides(view: torch.Tensor, per_granule: bool = True) -> tuple[int, int, int]:
    """(page, layer, token) strides of a `mla_views` view, in its elements (zeros for a static scale)."""
    if not per_granule:
        return 0, 0, 0
    page, layer, token = view.stride()[:3]
    return page, layer, token


def quant_mode(blocks: torch.Tensor, scales: torch.Tensor | None) -> dict:
    """The FP8 constexprs of a launch: `FP8` (the rows are FP8 codes), the format (`MANT`, `BIAS`,
    `FP8_MAX`: `fp8.FORMATS`) and `SCALES` (0 none, 1 per granule, 2 one static scale)."""
    if scales is None:
        return dict(FP8=False, MANT=0, BIAS=0, FP8_MAX=0.0, SCALES=0)
    mant, bias, top = FORMATS[blocks.dtype]
    return dict(FP8=True, MANT=mant, BIAS=bias, FP8_MAX=top, SCALES=1 if scales.dim() == 6 else 2)


def granules(scales: torch.Tensor | None) -> int:
    """The `GROUPS` constexpr: scale granules per row (1 for one scale per token, a static scale or none)."""
    return scales.shape[5] if scales is not None and scales.dim() == 6 else 1


# per-call sizes: no specialisation on ==1 or %16, so a new batch compiles nothing
@triton.jit(do_not_specialize=["batch", "layer_idx"])
def _store_latent_kernel(
    latent,
    k_rope,
    latent_cache,
    rope_cache,
    scales,
    cache_lengths,
    lookup_table,
    input_row_offsets,
    batch,
    num_pages,
    table_width,
    table_stride,
    page_size,
    layer_idx,
    latent_stride_row,
    rope_stride_row,
    cache_stride_page,
    cache_stride_layer,
    cache_stride_token,
    rope_cache_stride_page,
    rope_cache_stride_layer,
    rope_cache_stride_token,
    scales_stride_page,
    scales_stride_layer,
    scales_stride_token,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_P: tl.constexpr,
    GROUPS: tl.constexpr,
    FP8: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    FP8_MAX: tl.constexpr,
    SCALES: tl.constexpr,
    STEPS: tl.constexpr,
):
    row = tl.program_id(0)
    # What data checks rule out (`.unchecked` calls skip them) writes nothing: a position before the
    # sequence or past its table, a page id outside `blocks`, the null page 0.
    pos, page, in_range = new_row_page(
        row, cache_lengths, lookup_table, input_row_offsets, batch, num_pages, table_width, table_stride, page_size,
        STEPS,
    )  # fmt: skip
    offset = (pos % page_size).to(tl.int64)  # times the token stride: a slot can span 2**31 elements
    dim = tl.arange(0, RANK)
    latent_ok = dim < tl.where(in_range, RANK, 0)  # (scalar & block masks break the interpreter)
    x = tl.load(latent + row.to(tl.int64) * latent_stride_row + dim)
    slot = (
        page.to(tl.int64) * cache_stride_page
        + layer_idx.to(tl.int64) * cache_stride_layer
        + offset * cache_stride_token
    )
    if not FP8:
        tl.store(latent_cache + slot + dim, x, mask=latent_ok)
    else:
        x = x.to(tl.float32)
        if SCALES == 1:  # one scale per granule of RANK // GROUPS elements
            GRAN: tl.constexpr = RANK // GROUPS
            bits, scale = quantize_granules(x, RANK, GRAN, MANT, BIAS, FP8_MAX)
            g = tl.arange(0, GROUPS)
            scale_slot = page.to(tl.int64) * scales_stride_page + layer_idx.to(tl.int64) * scales_stride_layer
            scale_slot += offset * scales_stride_token
            tl.store(scales + scale_slot + g, scale, mask=g < tl.where(in_range, GROUPS, 0))
        else:  # one static scale
            bits = float_to_fp8_bits(tl.math.div_rn(x, tl.load(scales)), MANT, BIAS, FP8_MAX)
        tl.store(latent_cache + slot + dim, bits.to(tl.uint8), mask=latent_ok)
    if ROPE > 0:
        r = tl.arange(0, ROPE_P)
        rope_ok = r < tl.where(in_range, ROPE, 0)
        kr = tl.load(k_rope + row.to(tl.int64) * rope_stride_row + r, mask=r < ROPE)
        rope_slot = page.to(tl.int64) * rope_cache_stride_page + layer_idx.to(tl.int64) * rope_cache_stride_layer
        rope_slot += offset * rope_cache_stride_token
        tl.store(rope_cache + rope_slot + r, kr.to(rope_cache.dtype.element_ty), mask=rope_ok)


def plan_store_latent(a: StoreLatentArgs) -> list[Launch]:
    latent, k_rope, blocks, scales, lookup_table = a.latent, a.k_rope, a.blocks, a.scales, a.lookup_table
    total, rank = latent.shape
    rope = k_rope.shape[1]
    batch = a.cache_lengths.shape[0]
    if total == 0 or batch == 0:
        return []
    latent = latent if latent.stride(1) == 1 else latent.contiguous()
    k_rope = k_rope if k_rope.stride(1) == 1 or rope == 0 else k_rope.contiguous()
    latent_cache, rope_cache, pool_scales = mla_views(blocks, rank, scales)
    quant = quant_mode(blocks, scales)
    scales_kind = quant["SCALES"]
    width, table_stride = (lookup_table.shape[1], lookup_table.stride(0)) if lookup_table.dim() == 2 else (1, 1)
    return [
        Launch(
            _store_latent_kernel,
            (total,),
            (
                latent,
                k_rope,
                latent_cache,
                rope_cache,
                pool_scales,
                a.cache_lengths,
                lookup_table,
                a.input_row_offsets,
                batch,
                blocks.shape[0],
                width,
                table_stride,
                blocks.shape[3],
                a.layer_idx,
                latent.stride(0),
                k_rope.stride(0),
                *view_strides(latent_cache),
                *view_strides(rope_cache),
                *view_strides(pool_scales, scales_kind == 1),
            ),
            dict(
                RANK=rank,
                ROPE=rope,
                ROPE_P=triton.next_power_of_2(max(rope, 1)),
                GROUPS=granules(scales),
                **quant,
                STEPS=search_steps(batch),
            ),
        )
    ]


def store_latent(a: StoreLatentArgs) -> None:
    for launch in plan_store_latent(a):
        launch()
