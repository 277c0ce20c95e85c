"""`mla_attention` with `key_positions`: sparse absorbed MLA (DeepSeek-V3.2's DSA), each query over the
keys its row lists, for decode and prefill alike.

Grid `(rows x head blocks, 1, splits)`. A program takes one query token and `BLOCK_H` of its heads
(`>= 16` rows for `tl.dot`; heads past `num_heads` are masked rows): each token has its own key list,
so tokens share no key tile. It walks its row of `key_positions` `BLOCK_N` entries at a time: an
entry is read only if it is a key the query may see (`0 <= pos <=` the query's position, or `<
kv_len` when not causal) inside the lookup table, on a page of the pool; any other entry counts as
-1 (an `.unchecked` call's wild entries read nothing). The table is read only for those entries.
Each tile of rows then goes through `mla_attention.attend_key_tile` (the dense kernel's load, FP8
decode, scores, online softmax and `p . latent`), so the two kernels read rows alike. A query with
no key ends with an empty softmax: zeros. Attention sinks join the denominator as in the dense kernel
(`mla_attention.normalize`, or the merge). Few queries (decode) deal the entries' tiles
round-robin to `splits` programs, merged by `mla_merge`; the split count comes from shapes alone
(`ops/splits.py`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..records import MLAAttentionArgs
from .common import Launch, owning_sequence, store_rows, tile_rows
from .flash_attention import num_splits
from .mla_attention import attend_key_tile, mla_launches, mla_queries, mla_tiles, normalize


# per-call sizes: no specialisation on ==1 or %16, so a new batch, total or k compiles nothing
@triton.jit(do_not_specialize=["batch", "total", "layer_idx", "num_keys"])
def _mla_sparse_attention_kernel(
    q_nope,
    q_rope,
    out,
    part_out,
    part_lse,
    latent_cache,
    rope_cache,
    scales,
    cache_lengths,
    lookup_table,
    input_row_offsets,
    key_positions,
    batch,
    total,
    num_heads,
    num_pages,
    table_width,
    table_stride,
    page_size,
    layer_idx,
    num_keys,
    q_nope_stride_row,
    q_nope_stride_head,
    q_rope_stride_row,
    q_rope_stride_head,
    out_stride_row,
    out_stride_head,
    cache_stride_page,
    cache_stride_layer,
    cache_stride_token,
    rope_cache_stride_page,
    rope_cache_stride_layer,
    rope_cache_stride_token,
    scales_stride_page,
    scales_stride_layer,
    scales_stride_token,
    num_splits,
    softmax_scale,
    sinks,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_P: tl.constexpr,
    GROUPS: tl.constexpr,
    FP8: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    FP8_MAX: tl.constexpr,
    HW_FP8: tl.constexpr,
    SCALES: tl.constexpr,
    CAUSAL: tl.constexpr,
    SINK: tl.constexpr,
    SPLIT: tl.constexpr,
    WIDE_PAGE: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    STEPS: tl.constexpr,
):
    head_blocks = tl.cdiv(num_heads, BLOCK_H)
    row = tl.program_id(0) // head_blocks  # head blocks fastest: a token's run side by side
    head_block = tl.program_id(0) % head_blocks
    split = tl.program_id(2)
    seq = owning_sequence(input_row_offsets, batch, row, 1, 0, STEPS)
    row0 = tl.load(input_row_offsets + seq)
    new = tl.load(input_row_offsets + seq + 1) - row0
    q_index = row - row0  # the token's index among its sequence's new tokens
    if (q_index < 0) | (q_index >= new):  # (only an `.unchecked` call's offsets leave a row outside)
        return
    tok, head, q_rows, row_ok = tile_rows(q_index, row0, new, total, head_block * BLOCK_H, num_heads, BLOCK_H, BLOCK_H)
    cache_len = tl.load(cache_lengths + seq).to(tl.int64)
    limit = cache_len + q_index if CAUSAL else cache_len + new - 1  # the last key it may see (int64: no wrap)
    dim = tl.arange(0, RANK)
    rd = tl.arange(0, ROPE_P)
    qn = tl.load(
        q_nope + (q_rows * q_nope_stride_row + head * q_nope_stride_head)[:, None] + dim[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    qr = tl.load(
        q_rope + (q_rows * q_rope_stride_row + head * q_rope_stride_head)[:, None] + rd[None, :],
        mask=row_ok[:, None] & (rd[None, :] < ROPE),
        other=0.0,
    )
    if UPCAST:
        qn = qn.to(tl.float32)
        qr = qr.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, RANK], tl.float32)
    listed_row = key_positions + row.to(tl.int64) * num_keys
    table_row = lookup_table + seq.to(tl.int64) * table_stride
    latent_cache += layer_idx.to(tl.int64) * cache_stride_layer
    rope_cache += layer_idx.to(tl.int64) * rope_cache_stride_layer
    scales += layer_idx.to(tl.int64) * scales_stride_layer
    for n0 in range(split * BLOCK_N, num_keys, num_splits * BLOCK_N):  # split s takes tiles s, s + splits, ...
        n = n0 + tl.arange(0, BLOCK_N)
        j = tl.load(listed_row + n, mask=n < num_keys, other=-1)
        col = j // page_size
        seen = (j >= 0) & (j <= limit) & (col < table_width)  # a key it may see, in the table
        page = tl.load(table_row + col, mask=seen, other=0)
        key_ok = seen & (page >= 0) & (page < num_pages)  # (common.real_page)
        offset = j % page_size
        if WIDE_PAGE:
            offset = offset.to(tl.int64)
        m_i, l_i, acc = attend_key_tile(  # (key_ok holds the causal bound: no per-row mask)
            qn, qr, m_i, l_i, acc, row_ok, page, offset, key_ok, j, tok, latent_cache, rope_cache, scales,
            cache_stride_page, cache_stride_token, rope_cache_stride_page, rope_cache_stride_token,
            scales_stride_page, scales_stride_token, softmax_scale,
            BLOCK_N, RANK, ROPE, ROPE_P, GROUPS, FP8, MANT, BIAS, HW_FP8, SCALES, False, UPCAST, PRECISION,
        )  # fmt: skip

    o = normalize(acc, m_i, l_i, sinks, head, row_ok, SINK and not SPLIT)
    store_rows(
        o, m_i, l_i, out, out_stride_row, out_stride_head, part_out, part_lse, split, total, num_heads,
        row0, tok, q_rows, head, row_ok, RANK, SPLIT,
    )  # fmt: skip


def plan_mla_sparse(a: MLAAttentionArgs) -> tuple[torch.Tensor, list[Launch]]:
    """The output, allocated, and the launches that fill it (attention, then the split merge) of a call
    with `key_positions`. Tiles are the dense kernel's decode tiles (`mla_tiles`), its query tokens'
    rows given to heads: `BLOCK_H` = the tile's rows (16, or 64 for wgmma)."""
    key_positions = a.key_positions
    assert key_positions is not None  # (routed here only with it)
    queries = out, q_nope, _ = mla_queries(a)
    total, heads, _ = q_nope.shape
    batch, num_keys = a.cache_lengths.shape[0], key_positions.shape[1]
    if total == 0 or batch == 0:
        return out, []
    block_h, block_q, block_n, num_warps = mla_tiles(a, True)
    block_h *= block_q  # one token per program: its rows all go to heads (masked past num_heads)
    head_blocks = triton.cdiv(heads, block_h)
    splits = num_splits(total * head_blocks, num_keys, block_n, q_nope.device)
    grid = (total * head_blocks, 1, splits)
    tiles = dict(BLOCK_H=block_h, BLOCK_N=block_n)
    kernel = _mla_sparse_attention_kernel
    return out, mla_launches(kernel, a, queries, grid, (key_positions,), (num_keys,), tiles, num_warps)


def mla_sparse(a: MLAAttentionArgs) -> torch.Tensor:
    out, launches = plan_mla_sparse(a)
    for launch in launches:
        launch()
    return out
