"""Reference backend of the MLA ops (`store_latent`, `mla_attention`): pure, vectorised torch, fp32 math.

An MLA row holds `kv_lora_rank` latent elements then `rope_dim` rope elements (in an FP8 pool: FP8
latent bytes then the rope as bf16). Absorbed attention is multi-query attention with one KV head:
the key is the whole row `[latent; rope]`, the query `[q_nope; q_rope]`, the value the latent. So
each step gathers every sequence's rows once (fp32, dequantized), folds the heads into the query
rows (all heads read the same row: no per-head copy of K), and runs torch's SDPA with the value set
to the whole row, keeping the first `kv_lora_rank` output columns (SDPA's fast CPU path needs equal
key and value widths; the rope columns cost 1/8 more of the value product at DeepSeek's shapes).
Sparse attention (`key_positions`) reads only the listed rows, through the table, one row per entry.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..layout import NULL_PAGE
from . import quant
from .reference import (
    CHUNK_BUDGET_BYTES,
    _allowed,
    _decode_allowed,
    _row_coordinates,
    _scratch,
    gather_tokens,
    put_rows,
    row_slots,
    step_lengths,
    zero_outside,
)

ROPE_DTYPE = torch.bfloat16  # the rope part of an FP8 row (params.ROPE_DTYPE; ops never import params)


def store_latent(
    latent: torch.Tensor,
    k_rope: torch.Tensor,
    blocks: torch.Tensor,
    cache_lengths: torch.Tensor,
    lookup_table: torch.Tensor,
    input_row_offsets: torch.Tensor,
    layer_idx: int,
    scales: torch.Tensor | None = None,
) -> None:
    index, stored = row_slots(
        latent.shape[0], cache_lengths, lookup_table, input_row_offsets, blocks.shape[3], blocks.shape[0]
    )
    rows = blocks[:, 0, layer_idx, :, 0]  # [pages, page_size, row]
    if scales is None:
        put_rows(rows, index, stored, torch.cat((latent, k_rope), dim=1))
        return
    if scales.dim() == 1:  # one static scale
        q = quant.quantize_static(latent, blocks.dtype, scales[0])
    else:
        q, row_scales = quant.quantize(latent, blocks.dtype, latent.shape[1] // scales.shape[5])
        put_rows(scales[:, 0, layer_idx, :, 0], index, stored, row_scales)
    packed = torch.cat((q.view(torch.uint8), k_rope.to(ROPE_DTYPE).view(torch.uint8)), dim=1)  # the rope-aware row
    put_rows(rows.view(torch.uint8), index, stored, packed)


_fp8_tables: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _fp8_to_fp32(codes: torch.Tensor, dtype: torch.dtype, out: torch.Tensor) -> None:
    """`out[...] = codes.view(dtype).float()` through a 256-entry table: torch's FP8 conversion runs
    element by element on CPU (about 4x slower here than an int32 index_select from the table)."""
    key = (dtype, codes.device)
    if key not in _fp8_tables:
        _fp8_tables[key] = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float().to(codes.device)
    index = _scratch("fp8_index", tuple(codes.shape), torch.int32, codes.device).copy_(codes)
    flat = _scratch("fp8_values", tuple(codes.shape), torch.float32, codes.device)
    torch.index_select(_fp8_tables[key], 0, index.view(-1), out=flat.view(-1))
    out.copy_(flat)


def _gather_rows_fp32(
    blocks: torch.Tensor,
    layer_idx: int,
    lookup_table: torch.Tensor,
    max_len: int,
    kv_len: torch.Tensor,
    rank: int,
    rope_dim: int,
    scales: torch.Tensor | None,
) -> torch.Tensor:
    """`[batch, max_len, kv_lora_rank + rope_dim]` fp32 logical rows (latent dequantized, then rope),
    in reused scratch (valid until the next call); zeros past each sequence's `kv_len`."""
    tokens = gather_tokens(quant.indexable(blocks), 0, layer_idx, lookup_table, max_len, kv_len, "mla_rows")
    tokens = tokens[:, :max_len, 0]  # [batch, max_len, row]
    out = _scratch("mla_fp32", (tokens.shape[0], tokens.shape[1], rank + rope_dim), torch.float32, blocks.device)
    if scales is None:
        return zero_outside(out.copy_(tokens), kv_len)
    _fp8_to_fp32(tokens[..., :rank], blocks.dtype, out[..., :rank])
    out[..., rank:].copy_(tokens[..., rank:].view(ROPE_DTYPE))
    latent = out[..., :rank]
    if scales.dim() == 1:
        latent.mul_(scales[0])
    else:
        token_scales = gather_tokens(scales, 0, layer_idx, lookup_table, max_len, kv_len)[:, :max_len, 0]
        groups = token_scales.shape[-1]
        latent.view(*latent.shape[:-1], groups, rank // groups).mul_(token_scales[..., None])
    return zero_outside(out, kv_len)


def mla_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    blocks: torch.Tensor,
    cache_lengths: torch.Tensor,
    lookup_table: torch.Tensor,
    input_row_offsets: torch.Tensor,
    layer_idx: int,
    softmax_scale: float,
    causal: bool = True,
    scales: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    total, heads, rank = q_nope.shape
    rope_dim = q_rope.shape[2]
    batch = cache_lengths.shape[0]
    if total == 0:
        return q_nope.new_empty(q_nope.shape)
    kv_len, min_kv, max_kv, max_new = step_lengths(
        cache_lengths, lookup_table, input_row_offsets, blocks, "q_nope", total
    )
    q = torch.cat((q_nope.float(), q_rope.float()), dim=2)  # [total, heads, rank + rope]
    if key_positions is not None:
        seq, tok = _row_coordinates(input_row_offsets, total)
        new = input_row_offsets.diff().long()[seq]
        limit = cache_lengths.long()[seq] + (tok if causal else new - 1)  # the last key each query may see
        listed = Listed(blocks, layer_idx, lookup_table, seq, rank, scales)
        return _attend_listed(q, listed, key_positions, limit, softmax_scale, sinks).to(q_nope.dtype)
    rows = _gather_rows_fp32(blocks, layer_idx, lookup_table, max_kv, kv_len, rank, rope_dim, scales)[:, None]
    key_pos = torch.arange(max_kv, device=q_nope.device)
    if total == batch and max_new == 1:  # decode: each sequence's one query (at its last position) sees all its keys
        allowed = None if min_kv == max_kv else _decode_allowed(kv_len, key_pos, -1)
        out = _attend(q.view(batch, 1, heads, -1), rows, allowed, softmax_scale, sinks)
        return q_nope.new_empty(q_nope.shape).copy_(out[..., :rank].view(q_nope.shape))  # contiguous, like the fake

    seq, tok = _row_coordinates(input_row_offsets, total)
    q_padded = q.new_zeros(batch, max_new, heads, rank + rope_dim)
    q_padded[seq, tok] = q
    out = q.new_empty(batch, max_new, heads, rank)
    sees_all = min_kv == max_kv and not causal
    chunk = max(1, CHUNK_BUDGET_BYTES // (batch * max_kv * heads))  # bytes of the per-(token, head) mask
    for start in range(0, max_new, chunk):
        stop = min(start + chunk, max_new)
        n = stop - start
        allowed = None
        if not sees_all:  # [batch, 1, n, max_kv] -> one row per (token, head), the order of the folded queries
            allowed = _allowed(cache_lengths, kv_len, key_pos, start, stop, causal, -1)
            allowed = allowed[:, :, :, None].expand(batch, 1, n, heads, max_kv).reshape(batch, 1, n * heads, max_kv)
        q_chunk = q_padded[:, start:stop].reshape(batch, 1, n * heads, -1)
        out[:, start:stop] = _attend(q_chunk, rows, allowed, softmax_scale, sinks)[..., :rank].view(
            batch, n, heads, rank
        )
    return out[seq, tok].to(q_nope.dtype)


class Listed(NamedTuple):
    """Where a sparse step's rows are: the pool, its layer and table, each query's sequence."""

    blocks: torch.Tensor
    layer_idx: int
    lookup_table: torch.Tensor
    seq: torch.Tensor  # [total] int64
    rank: int
    scales: torch.Tensor | None

    def rows_fp32(self, queries: slice, positions: torch.Tensor) -> torch.Tensor:
        """`[n, k, rank + rope_dim]` fp32: the rows at `positions` `[n, k]` (>= 0) of the sequences of
        `queries`, latent dequantized; the null page's rows where a position passes the table row or
        names a page outside the pool (entries the caller masks)."""
        blocks, rank = self.blocks, self.rank
        page_size = blocks.shape[3]
        table = self.lookup_table.long() if self.lookup_table.dim() == 2 else self.lookup_table.long()[:, None]
        pages = table[self.seq[queries, None], (positions // page_size).clamp(max=table.shape[1] - 1)]
        pages = pages.where((pages >= 0) & (pages < blocks.shape[0]), NULL_PAGE)
        slots = (pages * page_size + positions % page_size).view(-1)
        source = quant.indexable(blocks)[:, 0, self.layer_idx, :, 0].flatten(0, 1)  # [pages * page_size, row]
        raw = source.index_select(0, slots).view(*positions.shape, -1)
        if self.scales is None:
            return raw.float()
        rope = raw[..., rank:].view(ROPE_DTYPE)
        out = torch.empty(*positions.shape, rank + rope.shape[-1], dtype=torch.float32, device=blocks.device)
        _fp8_to_fp32(raw[..., :rank].contiguous(), blocks.dtype, out[..., :rank])
        out[..., rank:].copy_(rope)
        latent = out[..., :rank]
        if self.scales.dim() == 1:
            latent.mul_(self.scales[0])
        else:
            row_scales = self.scales[:, 0, self.layer_idx, :, 0].flatten(0, 1).index_select(0, slots)
            groups = row_scales.shape[-1]
            latent.view(*positions.shape, groups, rank // groups).mul_(row_scales.view(*positions.shape, groups, 1))
        return out


def _attend_listed(
    q: torch.Tensor,
    listed: Listed,
    key_positions: torch.Tensor,
    limit: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """fp32 attention of each query row of `q` `[total, heads, width]` over the rows `key_positions` lists
    (keys, and their first `rank` elements values) -> `[total, heads, rank]`, each head's sink logit in
    its denominator; entries outside 0 .. `limit` (per query: the last key it may see) count as none; a
    row with no key gets zeros. Reads only the listed rows, chunked over queries (`[n, k, width]` each)."""
    total, _, width = q.shape
    positions = key_positions.long()
    valid = (positions >= 0) & (positions <= limit[:, None])  # [total, k]
    positions = positions.where(valid, 0)
    out = q.new_zeros(*q.shape[:2], listed.rank)
    chunk = max(1, CHUNK_BUDGET_BYTES // (positions.shape[1] * width * 4))
    for start in range(0, total, chunk):
        part = slice(start, min(total, start + chunk))
        keys = listed.rows_fp32(part, positions[part])  # [n, k, width]
        scores = torch.einsum("nhw,nkw->nhk", q[part], keys) * scale
        scores = scores.masked_fill(~valid[part, None, :], float("-inf"))
        weights = _softmax(scores, sinks).nan_to_num_(0.0)  # (a row with no key nor sink: all -inf -> NaN -> 0)
        out[part] = torch.einsum("nhk,nkr->nhr", weights, keys[..., : listed.rank])
    return out


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim of `scores` `[..., heads, keys]`, with head h's sink logit `sinks[h]` as
    one more entry of each row, dropped after."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.float()[:, None].expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]


def _attend(
    q: torch.Tensor, rows: torch.Tensor, allowed: torch.Tensor | None, scale: float, sinks: torch.Tensor | None
) -> torch.Tensor:
    """fp32 attention of `q` `[batch, 1, m, width]` (its m rows: query tokens x heads, head fastest) over
    `rows` `[batch, 1, s, width]` as keys and values, with each head's sink logit in its denominator;
    rows of `q` that may see no key (padding) are garbage."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, rows, rows, attn_mask=allowed, scale=scale)
    batch, m = q.shape[0], q.shape[2]
    heads = sinks.shape[0]
    scores = torch.matmul(q, rows.transpose(-1, -2)).mul_(scale)  # [batch, 1, m, s]
    if allowed is not None:
        scores.masked_fill_(~allowed, float("-inf"))
    probs = _softmax(scores.view(batch, m // heads, heads, -1), sinks).view(batch, 1, m, -1)
    return torch.matmul(probs, rows)
