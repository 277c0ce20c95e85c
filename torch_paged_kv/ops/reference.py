"""Reference backend: every op in pure, vectorised torch (any device), fp32 accumulation.

The oracle the other backends are tested against, and what runs where the `cpu` kernels do not.
Inputs are validated before these run; the `.unchecked` overloads skip the value checks, so the
functions here still keep every read and write inside the tensors whatever the index tensors
hold: a new row without a real page of its own is not stored, the null page is never changed, a
gather reads only the pages holding each sequence's first `kv_len` tokens and zeroes the rest (a
reused page's stale NaN never meets a sequence that does not own it), and attention raises
`ValueError` on offsets or lengths that do not fit its tensors (it reads them on the host anyway).

Prefill, chunked prefill, decode and ragged mixes all take one path: gather
each sequence's pages (padded to the longest) in fp32, pad the queries, and attend per chunk of
query positions under the contract's mask, with torch's SDPA in fp32 (an explicit masked softmax
when `softcap` is set, which SDPA lacks). No loop runs per token.

Speed on CPU: gathers land in reused per-thread scratch buffers (a fresh large CPU allocation
page-faults on every call and costs more than the gather itself), and SDPA reads K/V through
strided views instead of head-major copies.
"""

from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F

from ..layout import NULL_PAGE
from . import quant

CHUNK_BUDGET_BYTES = 256 * 2**20  # mask (or, with softcap, fp32 scores) of one chunk of query positions

_scratch_buffers = threading.local()


def _scratch(slot: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A per-thread buffer reused across calls; its contents are garbage and it must not escape."""
    buffers = _scratch_buffers.__dict__.setdefault("buffers", {})
    key = (slot, dtype, device)
    numel = math.prod(shape)
    buf = buffers.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype, device=device)
        buffers[key] = buf
    return buf[:numel].view(shape)


def _row_coordinates(input_row_offsets: torch.Tensor, total_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence index, index among that sequence's new tokens) of every new row, int64."""
    offsets = input_row_offsets.long()
    rows = torch.arange(total_rows, device=offsets.device)
    seq = torch.searchsorted(offsets[1:], rows, right=True)
    return seq, rows - offsets[seq]


def row_slots(
    rows: int,
    cache_lengths: torch.Tensor,
    lookup_table: torch.Tensor,
    input_row_offsets: torch.Tensor,
    page_size: int,
    num_pages: int,
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """((page, offset in the page), stored) of each of `rows` new rows: `stored` is False for a row
    outside the offsets or without a real page (a position before 0 or past its table row, the null
    page, an id outside the pool: only an unchecked call has such rows), whose slot is the null page's
    first. No host sync."""
    batch = cache_lengths.shape[0]
    offsets = input_row_offsets.long()
    seq, tok = _row_coordinates(input_row_offsets, rows)
    in_step = (seq < batch) & (torch.arange(rows, device=offsets.device) >= offsets[0])
    seq = seq.clamp(max=max(batch - 1, 0))
    pos = cache_lengths.long()[seq] + tok
    table = lookup_table.long()
    width = table.shape[1] if table.dim() == 2 else 1
    col = pos // page_size
    pages = table[seq] if table.dim() == 1 else table[seq, col.clamp(0, width - 1)]
    stored = in_step & (pos >= 0) & (col < width) & (pages > NULL_PAGE) & (pages < num_pages)
    return (pages.where(stored, NULL_PAGE), (pos % page_size).where(stored, 0)), stored


def put_rows(target: torch.Tensor, slots: tuple[torch.Tensor, torch.Tensor], stored: torch.Tensor, rows: torch.Tensor):
    """`target[slots] = rows` (`target` `[pages, page_size, ...]`) for the `stored` rows; the others
    write the null page's first slot with its own value (unchanged, and no host sync to drop them)."""
    keep = stored.view(-1, *([1] * (rows.dim() - 1)))
    target.index_put_(slots, rows.to(target.dtype).where(keep, target[NULL_PAGE, 0]))


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    blocks: torch.Tensor,
    cache_lengths: torch.Tensor,
    lookup_table: torch.Tensor,
    input_row_offsets: torch.Tensor,
    layer_idx: int,
    scales: torch.Tensor | None = None,
) -> None:
    index, stored = row_slots(
        key.shape[0], cache_lengths, lookup_table, input_row_offsets, blocks.shape[3], blocks.shape[0]
    )
    codes = quant.indexable(blocks)  # FP8 codes as bytes (torch's where has no FP8)
    for plane, rows in enumerate((key, value)):
        if scales is None:
            put_rows(codes[:, plane, layer_idx], index, stored, rows)
        elif scales.dim() == 1:  # a static per-tensor scale per plane
            q = quant.quantize_static(rows, blocks.dtype, scales[plane])
            put_rows(codes[:, plane, layer_idx], index, stored, quant.indexable(q))
        else:
            q, row_scales = quant.quantize(rows, blocks.dtype, blocks.shape[5] // scales.shape[5])
            put_rows(codes[:, plane, layer_idx], index, stored, quant.indexable(q))
            put_rows(scales[:, plane, layer_idx], index, stored, row_scales)


def readable_pages(
    lookup_table: torch.Tensor,
    kv_len: torch.Tensor,
    num_cols: int,
    page_size: int,
    num_pages: int,
    first: torch.Tensor | None = None,
):
    """The first `num_cols` columns of the table (long; a 1-D table's slots as one column), the null
    page wherever a column holds none of its row's first `kv_len` tokens (nor, with `first`, any from
    the row's `first` on) or an id outside the pool."""
    table = lookup_table.long()[:, :num_cols] if lookup_table.dim() == 2 else lookup_table.long()[:, None]
    col = torch.arange(table.shape[1], device=table.device) * page_size
    used = col < kv_len[:, None]
    if first is not None:
        used &= col + page_size > first[:, None]
    return table.where(used & (table >= 0) & (table < num_pages), NULL_PAGE)


def zero_outside(tokens: torch.Tensor, kv_len: torch.Tensor, first: torch.Tensor | None = None) -> torch.Tensor:
    """`tokens` `[batch, T, ...]` with every position at or past its row's `kv_len` (or, with `first`,
    before its `first`) zeroed, in place."""
    pos = torch.arange(tokens.shape[1], device=tokens.device)
    outside = pos >= kv_len[:, None]
    if first is not None:
        outside |= pos < first[:, None]
    return tokens.masked_fill_(outside.view(*outside.shape, *([1] * (tokens.dim() - 2))), 0)


def gather_tokens(
    blocks: torch.Tensor,
    plane: int,
    layer_idx: int,
    lookup_table: torch.Tensor,
    max_len: int,
    kv_len: torch.Tensor,
    scratch_slot: str | None = None,
    first: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[batch, T, heads, head_dim]` with T >= min(max_len, what the table addresses): each row's
    first cached tokens, whole pages at a time, reading only the pages that hold some of its first
    `kv_len` tokens (and, with `first`, some from its `first` on: the null page stands for the rest;
    contents outside those tokens are arbitrary).

    `blocks` may be any tensor laid out like a pool (`[pages, planes, layers, page_size, ...]`, such
    as per-granule scales). With `scratch_slot` the result is a view into that reused scratch buffer.
    """
    page_size = blocks.shape[3]
    plane_view = blocks[:, plane, layer_idx]  # [num_pages, page_size, heads, head_dim]
    if lookup_table.dim() == 1:  # one slot per row: take only the first max_len tokens of it
        tokens = min(max_len, page_size)
        pages = readable_pages(lookup_table, kv_len, 1, page_size, blocks.shape[0], first).view(-1)
        source = plane_view[:, :tokens].flatten(1)
    else:
        num_cols = min(-(-max_len // page_size), lookup_table.shape[1])
        tokens = num_cols * page_size
        pages = readable_pages(lookup_table, kv_len, num_cols, page_size, blocks.shape[0], first).reshape(-1)
        source = plane_view.flatten(1)
    shape = (lookup_table.shape[0], tokens, *blocks.shape[4:])
    if scratch_slot is None:
        return source.index_select(0, pages).view(shape)
    out = _scratch(scratch_slot, shape, blocks.dtype, blocks.device)
    torch.index_select(source, 0, pages, out=out.view(-1, source.shape[1]))
    return out


def _gather_fp32(
    blocks: torch.Tensor,
    plane: int,
    layer_idx: int,
    lookup_table: torch.Tensor,
    max_len: int,
    kv_len: torch.Tensor,
    scales: torch.Tensor | None,
    first: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[batch, max_len, heads, head_dim]` fp32 (dequantized for an FP8 cache): `gather_tokens` in
    scratch (valid until the next call), zeros past each row's `kv_len` and before its `first`."""
    slot = f"gather{plane}"
    tokens = gather_tokens(blocks, plane, layer_idx, lookup_table, max_len, kv_len, slot, first)[:, :max_len]
    if tokens.dtype == torch.float32:
        return zero_outside(tokens, kv_len, first)
    out = _scratch(f"fp32_{plane}", tuple(tokens.shape), torch.float32, tokens.device).copy_(tokens)
    if scales is not None and scales.dim() == 1:
        out.mul_(scales[plane])
    elif scales is not None:
        token_scales = gather_tokens(scales, plane, layer_idx, lookup_table, max_len, kv_len, None, first)[:, :max_len]
        groups = token_scales.shape[-1]
        out.view(*out.shape[:-1], groups, -1).mul_(token_scales[..., None])
    return zero_outside(out, kv_len, first)


def gather_kv(
    blocks: torch.Tensor,
    cache_lengths: torch.Tensor,
    lookup_table: torch.Tensor,
    input_row_offsets: torch.Tensor,
    layer_idx: int,
    max_kv_len: int,
    scales: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    kv_len = cache_lengths + input_row_offsets.diff()
    batch, heads, head_dim = cache_lengths.shape[0], blocks.shape[4], blocks.shape[5]
    valid = (torch.arange(max_kv_len, device=blocks.device)[None] < kv_len[:, None])[:, :, None, None]
    dtype = out_dtype or (torch.float32 if scales is not None else blocks.dtype)
    outputs = []
    for plane in (0, 1):
        out = blocks.new_zeros(batch, max_kv_len, heads, head_dim, dtype=dtype)
        if scales is None:
            tokens = gather_tokens(blocks, plane, layer_idx, lookup_table, max_kv_len, kv_len)[:, :max_kv_len]
        else:
            tokens = _gather_fp32(blocks, plane, layer_idx, lookup_table, max_kv_len, kv_len, scales)
        n = tokens.shape[1]
        out[:, :n] = tokens.masked_fill(~valid[:, :n], 0)
        outputs.append(out)
    return outputs[0], outputs[1]


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
    scales: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    attention_chunk_size: int = -1,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    total, num_q_heads, head_dim = q.shape
    batch = cache_lengths.shape[0]
    if total == 0:
        return q.new_empty(q.shape)
    kv_len, min_kv, max_kv, max_new = step_lengths(cache_lengths, lookup_table, input_row_offsets, blocks, "q", total)
    chunk = attention_chunk_size
    first = _first_visible(cache_lengths, sliding_window, chunk)
    # [batch, kv_heads, max_kv, head_dim] fp32 views of scratch buffers
    key, value = (
        _gather_fp32(blocks, plane, layer_idx, lookup_table, max_kv, kv_len, scales, first).transpose(1, 2)
        for plane in (0, 1)
    )
    key_pos = torch.arange(max_kv, device=q.device)
    # no mask where every query sees every key below its sequence's length
    unbounded = (sliding_window <= 0 or sliding_window >= max_kv) and (chunk <= 0 or chunk >= max_kv)
    if total == batch and max_new == 1 and tree_mask is None:  # decode: one new token per row, no padding
        # its one query sits at the last position, so causality hides nothing
        allowed = None if min_kv == max_kv and unbounded else _decode_allowed(kv_len, key_pos, sliding_window, chunk)
        q_rows = q.float().reshape(batch, num_q_heads, 1, head_dim)
        out = _attend(q_rows, key, value, allowed, softmax_scale, softcap, sinks)
        return out.reshape(q.shape).to(q.dtype)

    seq, tok = _row_coordinates(input_row_offsets, total)
    q_padded = q.new_zeros(batch, max_new, num_q_heads, head_dim, dtype=torch.float32)
    q_padded[seq, tok] = q.float()
    tree = None
    if tree_mask is not None:  # each query's bits over its sequence's new tokens, padded like q
        tree = tree_mask.new_zeros(batch, max_new)
        tree[seq, tok] = tree_mask
    out = torch.empty_like(q_padded)
    # No mask when it would allow every key: equal lengths, each query seeing its whole sequence.
    sees_all = min_kv == max_kv and not causal and unbounded and tree is None
    explicit = softcap > 0 or sinks is not None  # (fp32 scores in memory, not SDPA's)
    per_query = batch * max_kv * (4 * num_q_heads if explicit else 1)  # mask bytes, or fp32 scores
    rows = max(1, CHUNK_BUDGET_BYTES // per_query)
    for start in range(0, max_new, rows):
        stop = min(start + rows, max_new)
        allowed = None
        if tree is not None:  # positions are depths: windows and chunks from them
            allowed = _allowed(cache_lengths, kv_len, key_pos, start, stop, causal, -1)
            allowed = allowed & _tree_allowed(tree, start, stop, cache_lengths, key_pos, sliding_window, chunk)
        elif not sees_all:
            allowed = _allowed(cache_lengths, kv_len, key_pos, start, stop, causal, sliding_window, chunk)
        q_chunk = q_padded[:, start:stop].transpose(1, 2)  # [batch, q_heads, n, head_dim]
        out[:, start:stop] = _attend(q_chunk, key, value, allowed, softmax_scale, softcap, sinks).transpose(1, 2)
    return out[seq, tok].to(q.dtype)


def _first_visible(cache_lengths: torch.Tensor, sliding_window: int, chunk: int) -> torch.Tensor | None:
    """Each row's first key that any query of the step may see (its first new token's window or chunk
    start: later tokens, and tree nodes at depths, sit at higher positions), or None: every key."""
    if sliding_window <= 0 and chunk <= 0:
        return None
    position = cache_lengths.long()
    first = (position - sliding_window + 1).clamp_(min=0) if sliding_window > 0 else torch.zeros_like(position)
    return first.maximum(position // chunk * chunk) if chunk > 0 else first


def _tree_allowed(
    tree: torch.Tensor,
    start: int,
    stop: int,
    lengths: torch.Tensor,
    key_pos: torch.Tensor,
    window: int,
    chunk: int,
) -> torch.Tensor:
    """`[batch, 1, n, max_kv]`: what the tree rules let the queries at new-token indices start..stop-1
    see (`tree` `[batch, max_new]` int64, each row's bits, 0 past a sequence's new tokens). Every new
    token's position, as a query and as a key, is `lengths + depth - 1`, its depth being its bit count;
    a cached key's is its index. A query sees new token t (key index `lengths + t`) only where its bit
    t (< 64) is set; windows and chunks are measured between positions."""
    depth = ((tree[:, :, None] >> torch.arange(64, device=tree.device)) & 1).sum(-1)  # [batch, max_new]
    t = key_pos[None, :] - lengths[:, None].long()  # [batch, max_kv]: the key's index among the new tokens
    new = (t >= 0) & (t < tree.shape[1])
    key_depth = torch.gather(depth, 1, t.clamp(0, tree.shape[1] - 1))
    k_pos = torch.where(new, lengths[:, None] + key_depth - 1, key_pos[None, :])[:, None, :]
    q_pos = (lengths[:, None] + depth[:, start:stop] - 1)[:, :, None]  # [batch, n, 1]
    bits = torch.bitwise_right_shift(tree[:, start:stop, None], t.clamp(0, 63)[:, None, :]) & 1
    allowed = (t < 0)[:, None, :] | ((new & (t < 64))[:, None, :] & (bits == 1))
    if window > 0:
        allowed = allowed & (q_pos - k_pos < window)
    if chunk > 0:
        allowed = allowed & (q_pos // chunk == k_pos // chunk)
    return allowed[:, None]


def step_lengths(
    cache_lengths: torch.Tensor,
    lookup_table: torch.Tensor,
    input_row_offsets: torch.Tensor,
    blocks: torch.Tensor,
    rows_name: str,
    rows: int,
) -> tuple[torch.Tensor, int, int, int]:
    """(kv_len, min kv_len, max kv_len, most new tokens) of an attention step, read in one host
    sync, which also checks what keeps the step inside its tensors (an unchecked call's values):
    offsets from 0 to `rows`, never decreasing; lengths >= 0 and within their table rows."""
    new = input_row_offsets.diff()
    kv_len = cache_lengths + new
    first_last = input_row_offsets[[0, -1]]
    stats = torch.stack((*torch.aminmax(kv_len), new.max(), new.min(), cache_lengths.min(), *first_last)).tolist()
    min_kv, max_kv, max_new, min_new, min_cached, first, last = stats
    if first != 0 or last != rows or min_new < 0:
        raise ValueError(
            f"input_row_offsets: must start at 0, never decrease and end at the {rows} rows of {rows_name} "
            "(an unchecked call whose step tensors do not match its rows)"
        )
    capacity = blocks.shape[3] * (lookup_table.shape[1] if lookup_table.dim() == 2 else 1)
    if min_cached < 0 or max_kv > capacity:
        raise ValueError(
            "cache_lengths: a length is negative or passes what its lookup_table row addresses (an unchecked call)"
        )
    return kv_len, min_kv, max_kv, max_new


def _decode_allowed(kv_len: torch.Tensor, key_pos: torch.Tensor, sliding_window: int, chunk: int = -1) -> torch.Tensor:
    """`[batch, 1, 1, max_kv]`: the keys each sequence's one new query (the last token) may see."""
    last = kv_len[:, None]
    allowed = key_pos < last
    if sliding_window > 0:
        allowed &= key_pos >= last - sliding_window
    if chunk > 0:
        allowed &= key_pos // chunk == (last - 1) // chunk
    return allowed[:, None, None]


def _allowed(
    lengths: torch.Tensor,
    kv_len: torch.Tensor,
    key_pos: torch.Tensor,
    start: int,
    stop: int,
    causal: bool,
    sliding_window: int,
    chunk: int = -1,
) -> torch.Tensor:
    """`[batch, 1, n, max_kv]`: which keys the queries at new-token indices start..stop-1 may see."""
    q_pos = lengths[:, None, None] + torch.arange(start, stop, device=key_pos.device)[None, :, None]
    allowed = key_pos < kv_len[:, None, None]  # [batch, n, max_kv] once broadcast
    if causal:
        allowed = allowed & (key_pos <= q_pos)
    if sliding_window > 0:
        allowed = allowed & (q_pos - key_pos < sliding_window)
    if chunk > 0:
        allowed = allowed & (key_pos // chunk == q_pos // chunk)
    return allowed.expand(lengths.shape[0], stop - start, key_pos.shape[0])[:, None]


def _attend(
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor | None,
    scale: float,
    softcap: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 attention of `q` `[batch, q_heads, n, d]` over `key`/`value` `[batch, kv_heads, s, d]`
    where `allowed` `[batch, 1, n, s]` (None: everywhere), each query head's sink logit (`sinks`
    `[q_heads]`) in its softmax denominator; rows that may see no key (padding) are garbage."""
    group = q.shape[1] // key.shape[1]
    if softcap <= 0 and sinks is None:
        return F.scaled_dot_product_attention(q, key, value, attn_mask=allowed, scale=scale, enable_gqa=group > 1)
    batch, kv_heads, n = key.shape[0], key.shape[1], q.shape[2]
    scores = torch.matmul(q.reshape(batch, kv_heads, group * n, -1), key.transpose(-1, -2)).mul_(scale)
    if softcap > 0:
        scores = torch.tanh(scores.div_(softcap)).mul_(softcap)
    scores = scores.view(batch, kv_heads, group, n, -1)
    if allowed is not None:
        scores.masked_fill_(~allowed[:, :, None], float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # the sink as one more logit per row, dropped after the softmax
        sink = sinks.float().view(1, kv_heads, group, 1, 1).expand(batch, kv_heads, group, n, 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    probs = probs.reshape(batch, kv_heads, group * n, -1)
    return torch.matmul(probs, value).view(q.shape)


def copy_pages(
    blocks: torch.Tensor, src_pages: torch.Tensor, dst_pages: torch.Tensor, scales: torch.Tensor | None = None
) -> None:
    num_pages = blocks.shape[0]
    src, dst = src_pages.long(), dst_pages.long()
    # an unchecked call's ids outside the pool, or a null page destination, copy nothing: such pairs
    # copy the null page onto itself (unchanged; dropping them would need a host sync)
    copied = (src >= 0) & (src < num_pages) & (dst > NULL_PAGE) & (dst < num_pages)
    src, dst = src.where(copied, NULL_PAGE), dst.where(copied, NULL_PAGE)
    for pool in (blocks, scales) if scales is not None and scales.dim() == 6 else (blocks,):
        data = quant.indexable(pool)
        data.index_copy_(0, dst, data.index_select(0, src))
