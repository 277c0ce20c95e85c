"""`flash_attention`: one kernel for ragged prefill, chunked prefill and decode, with split-KV.

Grid `(query tiles, kv heads, splits)`. A query tile packs `BLOCK_Q` tokens of one sequence times
the `GROUP` query heads that share a KV head, so every K/V tile is loaded once per group. Sequence
b's tiles start at `input_row_offsets[b] // BLOCK_Q + b`, which bounds the tile count by
`total // BLOCK_Q + batch` (shapes only); tiles past a sequence's new tokens exit at once.
Keys are gathered per token (`lookup_table[b, j // page_size]`), so any page size works; each
program walks `BLOCK_N`-key tiles from the first tile inside the sliding window (tiles before
it are never visited) up to the causal limit. Decode deals those tiles round-robin to `splits`
programs (flash-decoding: tile t goes to split t % splits, so the work is balanced whatever the
actual lengths are below the shape-derived bound) whose partial results `flash_merge` combines by
log-sum-exp. An FP8 cache's K/V tiles are read as bytes and dequantized in fp32 (`fp8.py`: exact),
then fed to `tl.dot` in the query's dtype, like 16-bit pages.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import splits as split_rule
from ..records import FlashAttentionArgs
from .common import (
    Launch,
    blocks_strides,
    grid_fits,
    is_interpreted,
    key_pages,
    online_softmax,
    popcount32,
    popcount64,
    query_tile,
    search_steps,
    store_rows,
    tile_rows,
)
from .flash_merge import plan_merge
from .fp8 import covered, fp8_bits_to_operand, hardware_fp8, quantization

PROGRAMS_PER_SM = 4
"""Attention programs one SM runs at once (the split rule's occupancy target; ops/splits.py)."""

MASK_FIRST_TILE = False
"""Also mask the first key tile's keys below the window's (or chunk's) first visible key, so that
pages a caller's own table still names there are not read at all (docs/triton.md). Off: it costs
sm_90 registers (decode window 168 -> 187); `bench_decode_gpu.py --kernels window,window-masked`
times it on a GPU."""


# per-call sizes: no specialisation on ==1 or %16, so a new batch, total or layer compiles nothing
@triton.jit(do_not_specialize=["batch", "total", "layer_idx"])
def _attention_kernel(
    q,
    out,
    part_out,
    part_lse,
    blocks,
    cache_lengths,
    lookup_table,
    input_row_offsets,
    batch,
    total,
    num_q_heads,
    num_pages,
    table_width,
    table_stride,
    page_size,
    layer_idx,
    q_stride_row,
    q_stride_head,
    out_stride_row,
    out_stride_head,
    stride_page,
    stride_plane,
    stride_layer,
    stride_token,
    scales,
    scale_stride_page,
    scale_stride_plane,
    scale_stride_layer,
    scale_stride_token,
    num_splits,
    softmax_scale,
    softcap,
    sliding_window,
    sinks,
    chunk,
    tree,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINK: tl.constexpr,
    CHUNK: tl.constexpr,
    TREE: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    STEPS: tl.constexpr,
    WIDE_PAGE: tl.constexpr,
    QUANT: tl.constexpr,
    GRAN: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    FMAX: tl.constexpr,
    HW_FP8: tl.constexpr,
    MASK_FIRST: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq, row0, new, q_start = query_tile(input_row_offsets, batch, tile, BLOCK_Q, STEPS)
    if q_start >= new:
        return
    cache_len = tl.load(cache_lengths + seq)
    kv_len = cache_len + new
    first_head = kv_head * GROUP
    tok, head, q_rows, row_ok = tile_rows(q_start, row0, new, total, first_head, first_head + GROUP, GROUP_P, BLOCK_M)
    pos = cache_len + tok
    q_pos = pos  # a row's position, where its window and chunk are measured from
    dim = tl.arange(0, HEAD_DIM)
    if TREE:  # each query row's bits over its sequence's new tokens
        tree_bits = tl.load(tree + q_rows, mask=row_ok, other=0)
        if WINDOW or CHUNK:  # a node's position: cached + depth - 1
            q_pos = (cache_len + popcount64(tree_bits) - 1).to(pos.dtype)
    qt = tl.load(
        q + (q_rows * q_stride_row + head * q_stride_head)[:, None] + dim[None, :], mask=row_ok[:, None], other=0.0
    )
    if UPCAST:
        qt = qt.to(tl.float32)

    # Keys this tile can see: [k_lo, k_hi), walked from the tile holding k_lo.
    if CAUSAL:
        k_hi = cache_len + tl.minimum(q_start + BLOCK_Q, new)
    else:
        k_hi = kv_len
    # A tree's rows start from the shallowest position a node can have, cache_len (depth 1; a min over
    # the rows took 255 registers on sm_80): the step's first token's start, so no page before what
    # that token needs (which a sliding group's manager may have released) is read. Every new key is
    # in the range (its position may pass its index where a mask names later tokens), masked below.
    if TREE:
        first = cache_len
    else:
        first = cache_len + q_start
    if WINDOW:
        k_lo = tl.maximum(first - sliding_window + 1, 0)
    else:
        k_lo = 0
    if CHUNK:  # keys in the chunks of the tile's queries only
        k_lo = tl.maximum(k_lo, first // chunk * chunk)
        if not CAUSAL and not TREE:  # (a tree's new keys may sit past their position's chunk)
            k_hi = tl.minimum(k_hi, ((cache_len + tl.minimum(q_start + BLOCK_Q, new) - 1) // chunk + 1) * chunk)
    # Split s takes key tiles s, s + num_splits, ...: balanced whatever the actual length.
    start = (k_lo // BLOCK_N) * BLOCK_N + split * BLOCK_N
    stop = tl.minimum(k_hi, table_width * page_size)  # keys the table addresses (bounds an unchecked call's loop)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table_row = lookup_table + seq.to(tl.int64) * table_stride
    plane0 = blocks + layer_idx.to(tl.int64) * stride_layer + kv_head * HEAD_DIM  # int64: see store_kv
    GROUPS: tl.constexpr = HEAD_DIM // GRAN  # scales per token and head (per-granule FP8)
    scale0 = scales + layer_idx.to(tl.int64) * scale_stride_layer + kv_head * GROUPS
    score_scale = softmax_scale
    if QUANT == 2:  # a static pair: K's folds into the score scale, V's scales the output
        score_scale = softmax_scale * tl.load(scales)
        out_scale = tl.load(scales + 1)
    for j0 in range(start, stop, num_splits * BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        page, in_page, key_ok = key_pages(table_row, j, stop, page_size, table_width, num_pages, WIDE_PAGE)
        if MASK_FIRST and (WINDOW or CHUNK):
            key_ok = key_ok & (j >= k_lo)
        kv_off = (page.to(tl.int64) * stride_page + in_page * stride_token)[:, None] + dim[None, :]
        k = tl.load(plane0 + kv_off, mask=key_ok[:, None], other=0)
        v = tl.load(plane0 + stride_plane + kv_off, mask=key_ok[:, None], other=0)
        if QUANT != 0:  # FP8 bytes -> their exact values; the scales are applied where cheapest
            OPERAND: tl.constexpr = tl.float32 if UPCAST or (QUANT == 1 and GROUPS > 1) else qt.dtype
            k = fp8_bits_to_operand(k, OPERAND, MANT, BIAS, HW_FP8)
            v = fp8_bits_to_operand(v, OPERAND, MANT, BIAS, HW_FP8)
            if QUANT == 1:
                scale_row = scale0 + page.to(tl.int64) * scale_stride_page + in_page * scale_stride_token
                if GROUPS == 1:  # one scale per key: applied to its score and its probability below
                    k_scale = tl.load(scale_row, mask=key_ok, other=0.0)
                    v_scale = tl.load(scale_row + scale_stride_plane, mask=key_ok, other=0.0)
                else:  # a scale per granule of GRAN dims: applied to the tile
                    granule = tl.arange(0, GROUPS)
                    k_scale = tl.load(scale_row[:, None] + granule[None, :], mask=key_ok[:, None], other=0.0)
                    v_scale = tl.load(
                        scale_row[:, None] + scale_stride_plane + granule[None, :], mask=key_ok[:, None], other=0.0
                    )
                    k = tl.reshape(tl.reshape(k, [BLOCK_N, GROUPS, GRAN]) * k_scale[:, :, None], [BLOCK_N, HEAD_DIM])
                    v = tl.reshape(tl.reshape(v, [BLOCK_N, GROUPS, GRAN]) * v_scale[:, :, None], [BLOCK_N, HEAD_DIM])
                    k = k.to(qt.dtype)  # tensor cores in the query's dtype, as for 16-bit pages
                    v = v.to(qt.dtype)
        elif UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(qt, tl.trans(k), input_precision=PRECISION) * score_scale
        if QUANT == 1 and GROUPS == 1:
            s = s * k_scale[None, :]
        if SOFTCAP:
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))  # softcap * tanh(s / softcap)
        allowed = row_ok[:, None] & key_ok[None, :]
        if CAUSAL:  # by place in the step
            allowed = allowed & (j[None, :] <= pos[:, None])
        k_pos = j
        if TREE:  # new token t (key cache_len + t) only where the query's bit t (< 64) is set
            t = j - cache_len
            bit = (tree_bits[:, None] >> tl.minimum(tl.maximum(t, 0), 63).to(tl.int64)[None, :]) & 1
            allowed = allowed & ((t < 0)[None, :] | ((t < 64)[None, :] & (bit != 0)))
            if WINDOW or CHUNK:  # a new key's position: cache_len + its depth - 1
                mine = (t >= 0) & (t < new) & (row0 + t >= 0) & (row0 + t < total)  # (an unchecked call's rows)
                halves = tree.to(tl.pointer_type(tl.int32)) + 2 * (row0 + t).to(tl.int64)  # (little-endian)
                depth = popcount32(tl.load(halves, mask=mine, other=0)) + popcount32(
                    tl.load(halves + 1, mask=mine, other=0)
                )
                k_pos = tl.where(mine, cache_len + depth - 1, j)
        if WINDOW:
            allowed = allowed & (q_pos[:, None] - k_pos[None, :] < sliding_window)
        if CHUNK:
            allowed = allowed & (k_pos[None, :] // chunk == q_pos[:, None] // chunk)
        s = tl.where(allowed, s * 1.4426950408889634, float("-inf"))  # base-2 softmax: times log2(e)
        p, alpha, m_i, l_i = online_softmax(s, m_i, l_i)
        if QUANT == 1 and GROUPS == 1:
            p = p * v_scale[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)

    if SINK and not SPLIT:  # the head's sink logit joins the denominator (the merge adds it to splits)
        sink = tl.load(sinks + head, mask=row_ok, other=0.0) * 1.4426950408889634
        o = acc / (l_i + tl.exp2(sink - m_i))[:, None]  # a row that saw no key: m_i = -inf, o = 0
    else:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if QUANT == 2:
        o = o * out_scale
    store_rows(
        o, m_i, l_i, out, out_stride_row, out_stride_head, part_out, part_lse, split, total, num_q_heads,
        row0, tok, q_rows, head, row_ok, HEAD_DIM, SPLIT,
    )  # fmt: skip


def _blocks_for(
    head_dim: int, group: int, decode: bool, interpret: bool, fp32: bool, fp8: bool = False
) -> tuple[int, int, int]:
    """(BLOCK_Q, BLOCK_N, num_warps): decode packs >= 16 rows; prefill ~64 rows x 64 keys.
    fp32 `tl.dot` runs on FMAs with every operand in registers: 16-32 rows x 16-32 keys over
    8 warps, the largest tiles that compile without spills on sm_80 and sm_90 (see `aot`); over
    FP8 pages (decoded in registers too) 16 x 16 (32-key tiles spilled 240-420 bytes)."""
    group_p = triton.next_power_of_2(group)
    if interpret:
        return max(1, 16 // group_p), 16, 4
    if fp32:
        if fp8:
            rows, block_n = 16, 16
        else:
            rows, block_n = (16, 32 if head_dim <= 128 else 16) if decode else (32, 16)
        return max(1, rows // group_p), block_n, 8
    block_n = 64 if head_dim <= 128 else 32
    rows = 16 if decode else 64
    return max(1, rows // group_p), block_n, 4 if decode or head_dim <= 64 else 8


def num_splits(programs: int, key_bound: int, block_n: int, device: torch.device) -> int:
    """Decode splits for `programs` (sequences x kv heads or head blocks): ops/splits.py's rule."""
    return split_rule.num_splits(programs, key_bound, block_n, device, PROGRAMS_PER_SM)


def wide_page(blocks: torch.Tensor) -> bool:
    """Whether offsets inside one page, `(page_size - 1) * stride_token`, pass int32. Only then does
    the attention kernel widen each key's in-page offset to int64 (an i32 product is cheaper in its
    inner loop, and the wider one moved ptxas's spill choices in a few fp32 variants)."""
    return (blocks.shape[3] - 1) * blocks.stride(3) >= 2**31


def supports(a: FlashAttentionArgs) -> bool:
    """Power-of-two head_dim from 16 to 256 (tl.arange and tl.dot need it), FP8 granules the kernel
    tiles, and grids CUDA can launch: the largest any tile choice plans (BLOCK_Q >= 1, MAX_SPLITS
    splits, then the merge). Not fp32 queries over FP8 pages at head_dim 256: the smallest tile
    (16 x 16, on FMAs, the pages decoded in registers) still spills ~300 bytes a thread; the
    reference backend runs them (FP8 caches serve 16-bit models)."""
    q, blocks = a.q, a.blocks
    head_dim = blocks.shape[5]
    if not (16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0) or not covered(blocks, a.scales):
        return False
    if q.dtype == torch.float32 and a.scales is not None and head_dim > 128:
        return False
    total, batch = q.shape[0], a.cache_lengths.shape[0]
    return (
        total == 0
        or batch == 0
        or (grid_fits((total + batch, blocks.shape[4], split_rule.MAX_SPLITS)) and grid_fits((total, q.shape[1])))
    )


def plan_flash_attention(a: FlashAttentionArgs) -> tuple[torch.Tensor, list[Launch]]:
    """The output, allocated, and the launches that fill it (attention, then the split merge)."""
    q, blocks, cache_lengths, lookup_table, sinks = a.q, a.blocks, a.cache_lengths, a.lookup_table, a.sinks
    sliding_window, chunk_size = a.sliding_window, a.attention_chunk_size
    total, num_q_heads, head_dim = q.shape
    batch, num_kv_heads, page_size = cache_lengths.shape[0], blocks.shape[4], blocks.shape[3]
    out = torch.empty((total, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if total == 0 or batch == 0:
        return out, []
    q = q if q.stride(2) == 1 else q.contiguous()
    group = num_q_heads // num_kv_heads
    interpret = is_interpreted(q)
    fp32 = q.dtype == torch.float32
    block_q, block_n, num_warps = _blocks_for(head_dim, group, total <= batch, interpret, fp32, a.scales is not None)
    width, table_stride = (lookup_table.shape[1], lookup_table.stride(0)) if lookup_table.dim() == 2 else (1, 1)
    max_context = width * page_size  # upper bound of every kv_len: no lengths are read on the host
    window, chunk = sliding_window > 0, chunk_size > 0
    key_bound = max_context  # keys one query tile may see, at most
    if a.causal and window:
        key_bound = min(key_bound, sliding_window + block_q + block_n)
    if chunk:
        key_bound = min(key_bound, chunk_size + block_q + block_n)

    splits = num_splits(batch * num_kv_heads, key_bound, block_n, q.device) if total <= batch else 1
    if splits == 1:
        part_out = part_lse = out  # unused
    else:
        part_out = torch.empty((splits, total, num_q_heads, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((splits, total, num_q_heads), dtype=torch.float32, device=q.device)

    grid = (total // block_q + batch, num_kv_heads, splits)
    quant = quantization(blocks, a.scales)
    launches = [
        Launch(
            _attention_kernel,
            grid,
            (
                q,
                out,
                part_out,
                part_lse,
                quant.pool,
                cache_lengths,
                lookup_table,
                a.input_row_offsets,
                batch,
                total,
                num_q_heads,
                blocks.shape[0],
                width,
                table_stride,
                page_size,
                a.layer_idx,
                q.stride(0),
                q.stride(1),
                out.stride(0),
                out.stride(1),
                *blocks_strides(blocks),
                quant.scales,
                *quant.scale_strides,
                splits,
                float(a.softmax_scale),
                float(a.softcap),
                int(sliding_window),
                q if sinks is None else sinks,  # (not read without sinks)
                max(int(chunk_size), 1),
                q if a.tree_mask is None else a.tree_mask,  # (not read without a tree)
            ),
            dict(
                GROUP=group,
                GROUP_P=triton.next_power_of_2(group),
                BLOCK_Q=block_q,
                BLOCK_N=block_n,
                HEAD_DIM=head_dim,
                CAUSAL=bool(a.causal),
                WINDOW=window,
                SOFTCAP=a.softcap > 0,
                SINK=sinks is not None,
                TREE=a.tree_mask is not None,
                CHUNK=chunk,
                SPLIT=splits > 1,
                UPCAST=interpret,
                PRECISION="ieee" if interpret or q.dtype == torch.float32 else "tf32",
                STEPS=search_steps(batch),
                WIDE_PAGE=wide_page(blocks),
                **quant.constexprs,
                HW_FP8=hardware_fp8(q.device),
                MASK_FIRST=MASK_FIRST_TILE,
                num_warps=num_warps,
            ),
        )
    ]
    if splits > 1:
        launches.append(plan_merge(part_out, part_lse, out, sinks))
    return out, launches


def flash_attention(a: FlashAttentionArgs) -> torch.Tensor:
    out, launches = plan_flash_attention(a)
    for launch in launches:
        launch()
    return out
