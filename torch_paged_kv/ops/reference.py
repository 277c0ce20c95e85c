"""Reference backend: every op in pure, vectorised torch (any device), fp32 accumulation.

The oracle the other backends are tested against, and the CPU default. Inputs are validated
before these run. Prefill, chunked prefill, decode and ragged mixes all take the same path:
gather each sequence's K/V (padded), pad the queries, one masked softmax per query chunk.
"""

from __future__ import annotations

import torch

SCORE_BUDGET_BYTES = 256 * 2**20  # fp32 score memory per query chunk


def _row_coordinates(input_row_offsets: torch.Tensor, total_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence index, index among that sequence's new tokens) of every new row, int64."""
    offsets = input_row_offsets.long()
    rows = torch.arange(total_rows, device=offsets.device)
    seq = torch.searchsorted(offsets[1:], rows, right=True)
    return seq, rows - offsets[seq]


def _pages_of(lookup_table: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor, page_size: int) -> torch.Tensor:
    if lookup_table.dim() == 1:
        return lookup_table.long()[seq]
    return lookup_table.long()[seq, pos // page_size]


def store_kv(key: torch.Tensor, value: torch.Tensor, blocks: torch.Tensor, cache_lengths: torch.Tensor,
             lookup_table: torch.Tensor, input_row_offsets: torch.Tensor, layer_idx: int) -> None:
    seq, tok = _row_coordinates(input_row_offsets, key.shape[0])
    pos = cache_lengths.long()[seq] + tok
    page_size = blocks.shape[3]
    index = (_pages_of(lookup_table, seq, pos, page_size), pos % page_size)
    blocks[:, 0, layer_idx].index_put_(index, key)
    blocks[:, 1, layer_idx].index_put_(index, value)


def gather_padded(blocks: torch.Tensor, plane: int, layer_idx: int, lookup_table: torch.Tensor,
                  max_len: int) -> torch.Tensor:
    """`[batch, max_len, heads, head_dim]`: the first `max_len` cached tokens of every row.

    Tokens past a sequence's length hold whatever its pages hold; positions the table cannot
    address are zero.
    """
    page_size = blocks.shape[3]
    table = lookup_table.long()[:, None] if lookup_table.dim() == 1 else lookup_table.long()
    num_cols = min(-(-max_len // page_size), table.shape[1])
    tokens = blocks[:, plane, layer_idx][table[:, :num_cols]].flatten(1, 2)
    if tokens.shape[1] >= max_len:
        return tokens[:, :max_len]
    pad = tokens.new_zeros(tokens.shape[0], max_len - tokens.shape[1], *tokens.shape[2:])
    return torch.cat([tokens, pad], dim=1)


def gather_kv(blocks: torch.Tensor, cache_lengths: torch.Tensor, lookup_table: torch.Tensor,
              input_row_offsets: torch.Tensor, layer_idx: int, max_kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = input_row_offsets.long()
    kv_len = cache_lengths.long() + offsets[1:] - offsets[:-1]
    valid = torch.arange(max_kv_len, device=blocks.device)[None] < kv_len[:, None]
    mask = valid[:, :, None, None]
    key = gather_padded(blocks, 0, layer_idx, lookup_table, max_kv_len) * mask
    value = gather_padded(blocks, 1, layer_idx, lookup_table, max_kv_len) * mask
    return key, value


def flash_attention(q: torch.Tensor, blocks: torch.Tensor, cache_lengths: torch.Tensor,
                    lookup_table: torch.Tensor, input_row_offsets: torch.Tensor, layer_idx: int,
                    softmax_scale: float, causal: bool = True, sliding_window: int = -1,
                    softcap: float = 0.0) -> torch.Tensor:
    total, num_q_heads, head_dim = q.shape
    batch, num_kv_heads = cache_lengths.shape[0], blocks.shape[4]
    group = num_q_heads // num_kv_heads
    if total == 0:
        return q.new_empty(q.shape)
    offsets = input_row_offsets.long()
    new = offsets[1:] - offsets[:-1]
    lengths = cache_lengths.long()
    kv_len = lengths + new
    max_new, max_kv = (int(x) for x in torch.stack([new.max(), kv_len.max()]).tolist())

    # K^T and V per KV head, fp32: [batch, kv_heads, head_dim, max_kv] and [batch, kv_heads, max_kv, head_dim]
    key_t = torch.empty(batch, num_kv_heads, head_dim, max_kv, device=q.device)
    key_t.copy_(gather_padded(blocks, 0, layer_idx, lookup_table, max_kv).permute(0, 2, 3, 1))
    value = torch.empty(batch, num_kv_heads, max_kv, head_dim, device=q.device)
    value.copy_(gather_padded(blocks, 1, layer_idx, lookup_table, max_kv).permute(0, 2, 1, 3))

    seq, tok = _row_coordinates(input_row_offsets, total)
    q_padded = q.new_zeros(batch, max_new, num_q_heads, head_dim, dtype=torch.float32)
    q_padded[seq, tok] = q.float()
    q_padded = q_padded.view(batch, max_new, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    out = torch.empty(batch, num_kv_heads, group, max_new, head_dim, device=q.device)

    key_pos = torch.arange(max_kv, device=q.device)
    chunk = max(1, SCORE_BUDGET_BYTES // (4 * batch * num_q_heads * max_kv))
    for start in range(0, max_new, chunk):
        stop = min(start + chunk, max_new)
        q_pos = lengths[:, None] + torch.arange(start, stop, device=q.device)[None]  # [batch, n]
        allowed = key_pos[None, None] < kv_len[:, None, None]
        if causal:
            allowed = allowed & (key_pos[None, None] <= q_pos[..., None])
        if sliding_window > 0:
            allowed = allowed & (q_pos[..., None] - key_pos[None, None] < sliding_window)
        q_chunk = q_padded[:, :, :, start:stop].reshape(batch, num_kv_heads, group * (stop - start), head_dim)
        scores = torch.matmul(q_chunk, key_t).view(batch, num_kv_heads, group, stop - start, max_kv)
        scores.mul_(softmax_scale)
        if softcap > 0:
            scores = torch.tanh(scores / softcap).mul_(softcap)
        scores.masked_fill_(~allowed[:, None, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # padded query rows see no key
        out[:, :, :, start:stop] = torch.matmul(
            probs.view(batch, num_kv_heads, group * (stop - start), max_kv), value
        ).view(batch, num_kv_heads, group, stop - start, head_dim)

    out = out.permute(0, 3, 1, 2, 4).reshape(batch, max_new, num_q_heads, head_dim)
    return out[seq, tok].to(q.dtype)


def copy_pages(blocks: torch.Tensor, src_pages: torch.Tensor, dst_pages: torch.Tensor) -> None:
    blocks.index_copy_(0, dst_pages.long(), blocks.index_select(0, src_pages.long()))
