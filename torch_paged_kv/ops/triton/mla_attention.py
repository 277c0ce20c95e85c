"""`mla_attention`: absorbed MLA (one latent row per token, shared by every head) for ragged prefill,
chunked prefill and decode, with split-KV for decode.

Grid `(query tiles x head blocks, 1, splits)`. A query tile packs `BLOCK_Q` tokens of one sequence
times `BLOCK_H` heads (`BLOCK_M = BLOCK_Q * BLOCK_H >= 16` rows, the `tl.dot` minimum), so each key
tile (`BLOCK_N` rows: `kv_lora_rank` latent + `rope_dim` rope elements) is loaded once per program
and serves all its rows: scores `q_nope . latent + q_rope . rope`, then `p . latent` into a
`[BLOCK_M, kv_lora_rank]` fp32 accumulator (the latent is both key and value). Heads beyond
`BLOCK_H` are other programs over the same rows, numbered next to each other on grid x: CUDA starts
blocks in grid order, x fastest (observed, not promised), so they run at the same time and all but
the first find each key tile in L2 (on an H100 no faster than head blocks on grid y at 128 heads:
that decode is bound by instruction issue). Tiles and the causal key range are those of
`flash_attention.py`; decode deals key tiles round-robin to `splits` programs, merged by
`mla_merge`. Attention sinks (`SINK`) join each row's denominator at the end, or in the merge. FP8
rows (uint8 codes, decoded exactly by `fp8.py`) are cast to the query dtype: with one scale per
token the scale multiplies the scores and the probabilities instead of every element (exact: every
FP8 value is a bf16/fp16 value); with finer granules each element is scaled. That key
tile (`attend_key_tile`) also serves sparse attention (`mla_sparse.py`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..records import MLAAttentionArgs
from .common import (
    Launch,
    is_interpreted,
    key_pages,
    online_softmax,
    query_tile,
    search_steps,
    sm_version,
    store_rows,
    tile_rows,
)
from .flash_attention import num_splits
from .fp8 import fp8_bits_to_operand, hardware_fp8
from .mla_merge import plan_mla_merge
from .mla_store import granules, mla_views, quant_mode, view_strides


@triton.jit
def attend_key_tile(
    qn, qr, m_i, l_i, acc, row_ok, page, offset, key_ok, j, pos, latent_cache, rope_cache, scales,
    cache_stride_page, cache_stride_token, rope_cache_stride_page, rope_cache_stride_token,
    scales_stride_page, scales_stride_token, softmax_scale,
    BLOCK_N: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr, ROPE_P: tl.constexpr, GROUPS: tl.constexpr,
    FP8: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, HW_FP8: tl.constexpr, SCALES: tl.constexpr,
    CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One tile of `BLOCK_N` keys for the query rows `qn` `[rows, RANK]`, `qr` `[rows, ROPE_P]`: load the
    rows at (`page`, `offset`) of the layer's views where `key_ok` (the latent, FP8 codes decoded and
    scaled, and the rope), score them for the rows where `row_ok` (and, if `CAUSAL`, key position `j`
    <= the row's position `pos`), and fold them into the online softmax state. Returns (m_i, l_i, acc)."""
    dim = tl.arange(0, RANK)
    rd = tl.arange(0, ROPE_P)
    slot = page.to(tl.int64) * cache_stride_page + offset * cache_stride_token
    latent = tl.load(latent_cache + slot[:, None] + dim[None, :], mask=key_ok[:, None], other=0)
    rope_slot = page.to(tl.int64) * rope_cache_stride_page + offset * rope_cache_stride_token
    rope = tl.load(rope_cache + rope_slot[:, None] + rd[None, :], mask=key_ok[:, None] & (rd[None, :] < ROPE))
    if FP8:
        if SCALES == 2:  # one static scale: applied to the scores and the probabilities below
            token_scale = tl.load(scales + tl.zeros([BLOCK_N], tl.int32))
        elif GROUPS == 1:  # one scale per token: likewise (loaded here, so page and offset die early)
            scale_slot = page.to(tl.int64) * scales_stride_page + offset * scales_stride_token
            token_scale = tl.load(scales + scale_slot, mask=key_ok, other=0.0)
        if SCALES == 1 and GROUPS > 1:  # one scale per granule: scale each element
            latent = fp8_bits_to_operand(latent, tl.float32, MANT, BIAS, HW_FP8)
            scale_slot = page.to(tl.int64) * scales_stride_page + offset * scales_stride_token
            granule = tl.load(
                scales + scale_slot[:, None] + tl.arange(0, GROUPS)[None, :], mask=key_ok[:, None], other=0.0
            )
            latent = tl.reshape(latent, (BLOCK_N, GROUPS, RANK // GROUPS)) * granule[:, :, None]
            latent = tl.reshape(latent, (BLOCK_N, RANK)).to(qn.dtype)
        else:  # exact in the query's dtype: the scale is applied to scores and probabilities
            latent = fp8_bits_to_operand(latent, qn.dtype, MANT, BIAS, HW_FP8)
        rope = rope.to(qn.dtype)
    elif UPCAST:
        latent = latent.to(tl.float32)
        rope = rope.to(tl.float32)
    s = tl.dot(qn, tl.trans(latent), input_precision=PRECISION)
    if FP8 and (SCALES == 2 or GROUPS == 1):
        s = s * token_scale[None, :]
    if ROPE > 0:
        s += tl.dot(qr, tl.trans(rope), input_precision=PRECISION)
    allowed = row_ok[:, None] & key_ok[None, :]
    if CAUSAL:
        allowed = allowed & (j[None, :] <= pos[:, None])
    s = tl.where(allowed, s * (softmax_scale * 1.4426950408889634), float("-inf"))  # base-2 softmax
    p, alpha, m_i, l_i = online_softmax(s, m_i, l_i)
    if FP8 and (SCALES == 2 or GROUPS == 1):
        p = p * token_scale[None, :]  # the value rows' scale, folded into the probabilities
    acc = acc * alpha[:, None] + tl.dot(p.to(latent.dtype), latent, input_precision=PRECISION)
    return m_i, l_i, acc


@triton.jit
def normalize(acc, m_i, l_i, sinks, head, row_ok, SINK: tl.constexpr):
    """The output rows `acc / l_i` (0 for a row that saw no key); with `SINK`, head `head`'s sink logit
    `sinks[head]` joins each row's denominator (`l_i + 2^(sink - m_i)` in the base-2 softmax; a row that
    saw no key has `m_i = -inf`: 0). Split programs leave the sink to the merge."""
    if SINK:
        sink = tl.load(sinks + head, mask=row_ok, other=0.0) * 1.4426950408889634
        o = acc / (l_i + tl.exp2(sink - m_i))[:, None]
    else:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    return o


# per-call sizes: no specialisation on ==1 or %16, so a new batch or total compiles nothing
@triton.jit(do_not_specialize=["batch", "total", "layer_idx"])
def _mla_attention_kernel(
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
    batch,
    total,
    num_heads,
    num_pages,
    table_width,
    table_stride,
    page_size,
    layer_idx,
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
    BLOCK_Q: tl.constexpr,
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
    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_H
    head_blocks = tl.cdiv(num_heads, BLOCK_H)
    tile = tl.program_id(0) // head_blocks  # head blocks fastest: a tile's run side by side
    head_block = tl.program_id(0) % head_blocks
    split = tl.program_id(2)
    seq, row0, new, q_start = query_tile(input_row_offsets, batch, tile, BLOCK_Q, STEPS)
    if q_start >= new:
        return
    cache_len = tl.load(cache_lengths + seq)
    kv_len = cache_len + new
    first_head = head_block * BLOCK_H
    tok, head, q_rows, row_ok = tile_rows(q_start, row0, new, total, first_head, num_heads, BLOCK_H, BLOCK_M)
    pos = cache_len + tok
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

    k_hi = cache_len + tl.minimum(q_start + BLOCK_Q, new) if CAUSAL else kv_len
    k_hi = tl.minimum(k_hi, table_width * page_size)  # lengths past the table (unchecked): keys it holds
    start = split * BLOCK_N  # split s takes key tiles s, s + num_splits, ...
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, RANK], tl.float32)
    table_row = lookup_table + seq.to(tl.int64) * table_stride
    latent_cache += layer_idx.to(tl.int64) * cache_stride_layer
    rope_cache += layer_idx.to(tl.int64) * rope_cache_stride_layer
    scales += layer_idx.to(tl.int64) * scales_stride_layer
    for j0 in range(start, k_hi, num_splits * BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        page, offset, key_ok = key_pages(table_row, j, k_hi, page_size, table_width, num_pages, WIDE_PAGE)
        m_i, l_i, acc = attend_key_tile(
            qn, qr, m_i, l_i, acc, row_ok, page, offset, key_ok, j, pos, latent_cache, rope_cache, scales,
            cache_stride_page, cache_stride_token, rope_cache_stride_page, rope_cache_stride_token,
            scales_stride_page, scales_stride_token, softmax_scale,
            BLOCK_N, RANK, ROPE, ROPE_P, GROUPS, FP8, MANT, BIAS, HW_FP8, SCALES, CAUSAL, UPCAST, PRECISION,
        )  # fmt: skip
    o = normalize(acc, m_i, l_i, sinks, head, row_ok, SINK and not SPLIT)
    store_rows(
        o, m_i, l_i, out, out_stride_row, out_stride_head, part_out, part_lse, split, total, num_heads,
        row0, tok, q_rows, head, row_ok, RANK, SPLIT,
    )  # fmt: skip


WGMMA_TILES = tuple(int(n) for n in triton.__version__.split(".")[:2]) < (3, 9)
"""Whether decode at 64 or more heads on sm_90 takes 64-head wgmma tiles (`_blocks_for`). `aot` compiles
them without spills under triton 3.6 and 3.8 (8-16 bytes under 3.7 over FP8 rows) but with 232-520
bytes of spills under 3.9; they were timed on an H100 under 3.6 only."""


def wide_page(*views: torch.Tensor | None) -> bool:
    """Whether an offset inside one page, `(page_size - 1) * token stride`, passes int32 in any of the
    `mla_views` views. Only then does the kernel widen each key's in-page offset to int64 (an i32
    product is cheaper in its inner loop, and the wider one moved ptxas's spill choices in the FP8
    variants, which sit at 255 registers)."""
    return any(view is not None and (view.shape[2] - 1) * view.stride(2) >= 2**31 for view in views)


def _blocks_for(
    rank: int,
    heads: int,
    decode: bool,
    interpret: bool,
    fp32: bool,
    fp8: bool,
    hw_fp8: bool = False,
    wgmma: bool = False,
    granules: bool = False,
) -> tuple[int, int, int, int]:
    """(BLOCK_H, BLOCK_Q, BLOCK_N, num_warps). The `[BLOCK_M, kv_lora_rank]` fp32 accumulator and the
    query (held by every warp as the first `tl.dot` operand) dominate the registers: 16 rows at
    rank >= 256 (as vLLM's and SGLang's Triton MLA decode), up to 64 at small ranks. fp32 (FMAs, no
    tensor cores) and FP8 rows decoded by integer arithmetic (sm_80) take 16-key tiles over 8 warps:
    the largest that compile without spills (see `aot`). FP8 rows converted in hardware (`hw_fp8`,
    sm_89+) take 32-key tiles over 8 warps (sm_90: 209 registers, no spill; 4 warps spill 192 bytes).
    Decode with 64 heads or more on sm_90 (`wgmma`: see `WGMMA_TILES`) takes 64 heads x 32 keys over
    8 warps, on wgmma, over 16-bit rows or FP8 rows with one scale per token or tensor: on an H100
    at 128 heads 1.4-1.5x faster than 16-head tiles in bf16 and 3x over FP8 rows (docs/mla.md)."""
    heads_p = triton.next_power_of_2(heads)
    if interpret:
        rows, block_n, warps = 16, 16, 4
    elif wgmma and decode and rank >= 256 and heads >= 64 and not fp32 and not granules and (hw_fp8 or not fp8):
        rows, block_n, warps = 64, 32, 8
    elif rank >= 256:
        narrow = fp32 or (fp8 and not hw_fp8)
        rows, block_n, warps = 16, (16 if narrow else 32), (4 if decode and not (fp32 or fp8) else 8)
    else:
        rows, block_n, warps = (16 if decode else 64 if rank <= 64 else 32), (16 if fp32 or fp8 else 64), 4
    block_h = min(heads_p, rows)
    return block_h, max(1, rows // block_h), block_n, warps


def mla_queries(a: MLAAttentionArgs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, allocated; q_nope and q_rope with unit stride in their last dim) of an MLA attention call."""
    q_nope, q_rope = a.q_nope, a.q_rope
    out = torch.empty(q_nope.shape, dtype=q_nope.dtype, device=q_nope.device)
    q_nope = q_nope if q_nope.stride(2) == 1 else q_nope.contiguous()
    q_rope = q_rope if q_rope.stride(2) == 1 or q_rope.shape[2] == 0 else q_rope.contiguous()
    return out, q_nope, q_rope


def mla_tiles(a: MLAAttentionArgs, decode: bool) -> tuple[int, int, int, int]:
    """(BLOCK_H, BLOCK_Q, BLOCK_N, num_warps) of an MLA attention call (`_blocks_for`, on its device)."""
    q_nope, scales = a.q_nope, a.scales
    device, fp8 = q_nope.device, scales is not None
    return _blocks_for(
        q_nope.shape[2],
        q_nope.shape[1],
        decode,
        is_interpreted(q_nope),
        q_nope.dtype == torch.float32,
        fp8,
        fp8 and hardware_fp8(device),
        WGMMA_TILES and sm_version(device) == 90,
        granules(scales) > 1,
    )


def table_geometry(a: MLAAttentionArgs) -> tuple[int, int]:
    """(columns, row stride) of the call's lookup table (a 1-D table: one slot per row)."""
    table = a.lookup_table
    return (table.shape[1], table.stride(0)) if table.dim() == 2 else (1, 1)


def mla_launches(
    kernel: triton.JITFunction,
    a: MLAAttentionArgs,
    queries: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    grid: tuple[int, int, int],
    step_args: tuple,
    size_args: tuple,
    tiles: dict[str, int],
    num_warps: int,
) -> list[Launch]:
    """The launches of an MLA attention kernel (this file's, or `mla_sparse.py`'s), then the split merge
    where `grid[2]` splits: the arguments and constexprs both kernels take, `step_args` after
    `input_row_offsets`, `size_args` after `layer_idx`, `tiles` (its `BLOCK_*`) among the constexprs."""
    out, q_nope, q_rope = queries
    blocks, scales, splits = a.blocks, a.scales, grid[2]
    total, heads, rank = q_nope.shape
    rope = q_rope.shape[2]
    if splits == 1:
        part_out = part_lse = out  # unused
    else:
        part_out = torch.empty((splits, total, heads, rank), dtype=torch.float32, device=q_nope.device)
        part_lse = torch.empty((splits, total, heads), dtype=torch.float32, device=q_nope.device)
    latent_cache, rope_cache, pool_scales = mla_views(blocks, rank, scales)
    quant = quant_mode(blocks, scales)
    scales_kind = quant["SCALES"]
    interpret = is_interpreted(q_nope)
    width, table_stride = table_geometry(a)
    batch = a.cache_lengths.shape[0]
    launches = [
        Launch(
            kernel,
            grid,
            (
                q_nope,
                q_rope,
                out,
                part_out,
                part_lse,
                latent_cache,
                rope_cache,
                pool_scales,
                a.cache_lengths,
                a.lookup_table,
                a.input_row_offsets,
                *step_args,
                batch,
                total,
                heads,
                blocks.shape[0],
                width,
                table_stride,
                blocks.shape[3],
                a.layer_idx,
                *size_args,
                q_nope.stride(0),
                q_nope.stride(1),
                q_rope.stride(0),
                q_rope.stride(1),
                out.stride(0),
                out.stride(1),
                *view_strides(latent_cache),
                *view_strides(rope_cache),
                *view_strides(pool_scales, scales_kind == 1),
                splits,
                float(a.softmax_scale),
                q_nope if a.sinks is None else a.sinks,  # (not read without sinks)
            ),
            dict(
                **tiles,
                RANK=rank,
                ROPE=rope,
                ROPE_P=max(16, triton.next_power_of_2(max(rope, 1))),
                GROUPS=granules(scales),
                **quant,
                HW_FP8=scales is not None and hardware_fp8(q_nope.device),
                CAUSAL=bool(a.causal),
                SINK=a.sinks is not None,
                SPLIT=splits > 1,
                WIDE_PAGE=wide_page(latent_cache, rope_cache, pool_scales if scales_kind == 1 else None),
                UPCAST=interpret,
                PRECISION="ieee" if interpret or q_nope.dtype == torch.float32 else "tf32",
                STEPS=search_steps(batch),
                num_warps=num_warps,
            ),
        )
    ]
    if splits > 1:
        launches.append(plan_mla_merge(part_out, part_lse, out, a.sinks))
    return launches


def plan_mla_attention(a: MLAAttentionArgs) -> tuple[torch.Tensor, list[Launch]]:
    """The output, allocated, and the launches that fill it (attention, then the split merge)."""
    queries = out, q_nope, _ = mla_queries(a)
    total, heads, _ = q_nope.shape
    batch, page_size = a.cache_lengths.shape[0], a.blocks.shape[3]
    if total == 0 or batch == 0:
        return out, []
    decode = total <= batch
    block_h, block_q, block_n, num_warps = mla_tiles(a, decode)
    head_blocks = triton.cdiv(heads, block_h)
    width = table_geometry(a)[0]
    splits = num_splits(batch * head_blocks, width * page_size, block_n, q_nope.device) if decode else 1
    grid = ((total // block_q + batch) * head_blocks, 1, splits)
    tiles = dict(BLOCK_H=block_h, BLOCK_Q=block_q, BLOCK_N=block_n)
    return out, mla_launches(_mla_attention_kernel, a, queries, grid, (), (), tiles, num_warps)


def mla_attention(a: MLAAttentionArgs) -> torch.Tensor:
    out, launches = plan_mla_attention(a)
    for launch in launches:
        launch()
    return out
