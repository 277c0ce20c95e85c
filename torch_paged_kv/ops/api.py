"""The public ops: one typed function per `paged_kv` op, the single source of its signature.

`library.py` derives each op's schema from these signatures (names, types, defaults), so the Python
entry points and the registered ops cannot drift apart. Each function calls the checked overload
(`torch.ops.paged_kv.<op>.default`); `step.StepPlan` is the one caller of the `.unchecked` overloads.

Shapes, for a pool of `num_pages` physical pages (the null page 0 included), a step of `batch`
sequences and `total_new` new tokens:

- `blocks`: `[num_pages, 2, num_layers, page_size, num_kv_heads, head_dim]` (K then V).
- `cache_lengths`: int32 `[batch]`, tokens cached before this step.
- `lookup_table`: int32 `[batch, width]` (pages of each sequence, in order), or `[batch]` (one
  continuous-batching slot per sequence).
- `input_row_offsets`: int32 `[batch + 1]`, prefix sums of each sequence's new tokens.
- `scales` (FP8 caches only, else None): fp32 `[num_pages, 2, num_layers, page_size, num_kv_heads,
  head_dim / granularity]` (one scale per granule, beside `blocks`), or `[2]` (a static per-tensor
  scale per plane). See `quant.py` for the rule.

The MLA ops (`store_latent`, `mla_attention`) take an MLA latent pool instead: `blocks` `[num_pages, 1,
num_layers, page_size, 1, row]`, one row per token: `kv_lora_rank` latent elements then `rope_dim`
rope-key elements (`row = kv_lora_rank + rope_dim`), or for an FP8 pool the FP8 latent bytes then
the rope as bf16 (`row = kv_lora_rank + 2 * rope_dim` bytes: MAX's rope-aware row), with `scales`
`[num_pages, 1, num_layers, page_size, 1, kv_lora_rank / granularity]` (per token by default) or `[1]`.
`kv_lora_rank` and `rope_dim` are read from the shapes of the latent and rope arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


def store_kv(
    key: Tensor,
    value: Tensor,
    blocks: Tensor,
    cache_lengths: Tensor,
    lookup_table: Tensor,
    input_row_offsets: Tensor,
    layer_idx: int,
    scales: Tensor | None = None,
) -> None:
    """Write this step's new K/V rows into their pages (mutates `blocks`, and `scales`).

    `key`, `value`: `[total_new, num_kv_heads, head_dim]`, in `blocks`' dtype (an FP8 cache takes
    fp32/fp16/bf16 rows and quantizes them on write). New token t of sequence b goes to position
    `cache_lengths[b] + t`: page `lookup_table[b, pos // page_size]`, row `pos % page_size`.
    `cache_lengths` is not advanced (the caller does that after the step).
    """
    torch.ops.paged_kv.store_kv.default(
        key, value, blocks, cache_lengths, lookup_table, input_row_offsets, layer_idx, scales
    )


def flash_attention(
    q: Tensor,
    blocks: Tensor,
    cache_lengths: Tensor,
    lookup_table: Tensor,
    input_row_offsets: Tensor,
    layer_idx: int,
    softmax_scale: float,
    causal: bool = True,
    sliding_window: int = -1,
    softcap: float = 0.0,
    scales: Tensor | None = None,
    sinks: Tensor | None = None,
    attention_chunk_size: int = -1,
    tree_mask: Tensor | None = None,
) -> Tensor:
    """Attention of the new queries over each sequence's `cache_lengths[b] + new_b` keys -> `[total_new,
    num_q_heads, head_dim]`.

    `q`: `[total_new, num_q_heads, head_dim]`, `num_q_heads` a multiple of `num_kv_heads` (GQA/MQA).
    Call after `store_kv` of the same step. The query at position p sees key j iff (`not causal` or
    `j <= p`) and (`sliding_window <= 0` or `p - j < sliding_window`) and (`attention_chunk_size <= 0`
    or `p // attention_chunk_size == j // attention_chunk_size`: chunked local attention, Llama 4's).
    `softcap > 0` applies `softcap * tanh(score / softcap)` after scaling. `sinks` (fp32
    `[num_q_heads]`, GPT-OSS's attention sinks) adds one logit per query head to each row's softmax
    denominator and nothing to its output: `out = sum_j exp(s_j) v_j / (exp(sink) + sum_j exp(s_j))`.
    `tree_mask` (int64 `[total_new]`, speculative decoding's tree verification) restricts which of its
    sequence's new tokens each query sees: bit t of query row r's entry set iff it may see the
    sequence's new token t (t < 64; a tree step has at most 64 new tokens per sequence; list a draft
    token after its ancestors). Every new token of a tree step has the position of its depth,
    `cache_length + popcount(tree_mask[row]) - 1`, as a query and as a key, and windows and chunks
    are measured between positions (a chain is plain causal attention); cached keys keep theirs.
    Accumulates in fp32 (an FP8 cache is dequantized on read; `q` is then fp32, fp16 or bf16).
    """
    return torch.ops.paged_kv.flash_attention.default(
        q,
        blocks,
        cache_lengths,
        lookup_table,
        input_row_offsets,
        layer_idx,
        softmax_scale,
        causal,
        sliding_window,
        softcap,
        scales,
        sinks,
        attention_chunk_size,
        tree_mask,
    )


def gather_kv(
    blocks: Tensor,
    cache_lengths: Tensor,
    lookup_table: Tensor,
    input_row_offsets: Tensor,
    layer_idx: int,
    max_kv_len: int,
    scales: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """Each sequence's `cache_lengths[b] + new_b` keys and values as contiguous `[batch, max_kv_len,
    num_kv_heads, head_dim]` tensors, zeros past each sequence's length, in `out_dtype` (default:
    `blocks`' dtype; float32 for an FP8 cache, which is dequantized)."""
    return torch.ops.paged_kv.gather_kv.default(
        blocks, cache_lengths, lookup_table, input_row_offsets, layer_idx, max_kv_len, scales, out_dtype
    )


def copy_pages(blocks: Tensor, src_pages: Tensor, dst_pages: Tensor, scales: Tensor | None = None) -> None:
    """`blocks[dst_pages[i]] = blocks[src_pages[i]]` for every i, whole pages (all layers, K and V),
    every source read before any destination is written (mutates `blocks`; per-granule `scales`
    move with their pages).

    `src_pages`, `dst_pages`: int32 `[n]`; destinations distinct and never the null page 0.
    """
    torch.ops.paged_kv.copy_pages.default(blocks, src_pages, dst_pages, scales)


def store_latent(
    latent: Tensor,
    k_rope: Tensor,
    blocks: Tensor,
    cache_lengths: Tensor,
    lookup_table: Tensor,
    input_row_offsets: Tensor,
    layer_idx: int,
    scales: Tensor | None = None,
) -> None:
    """Write this step's compressed latents and rotated rope keys into their MLA rows (mutates `blocks`,
    and `scales`).

    `latent`: `[total_new, kv_lora_rank]`, `k_rope`: `[total_new, rope_dim]` (after rotary embedding),
    in `blocks`' dtype (an FP8 pool takes fp32/fp16/bf16 rows: the latent is quantized, the rope
    stored as bf16). Slots as for `store_kv`; `cache_lengths` is not advanced.
    """
    torch.ops.paged_kv.store_latent.default(
        latent, k_rope, blocks, cache_lengths, lookup_table, input_row_offsets, layer_idx, scales
    )


def mla_attention(
    q_nope: Tensor,
    q_rope: Tensor,
    blocks: Tensor,
    cache_lengths: Tensor,
    lookup_table: Tensor,
    input_row_offsets: Tensor,
    layer_idx: int,
    softmax_scale: float,
    causal: bool = True,
    scales: Tensor | None = None,
    key_positions: Tensor | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Absorbed multi-head latent attention (DeepSeek-V2 MLA) over each sequence's `cache_lengths[b] +
    new_b` latent rows -> `[total_new, num_heads, kv_lora_rank]` (the latent-space output: multiply
    by W_UV per head for the value heads).

    `q_nope`: `[total_new, num_heads, kv_lora_rank]`, the no-rope query already multiplied by W_UK;
    `q_rope`: `[total_new, num_heads, rope_dim]`, the rotated rope query. All heads share each
    token's one row: score_j = (q_nope . latent_j + q_rope . k_rope_j) * softmax_scale, output =
    softmax(score) . latent. Call after `store_latent` of the same step; `causal` as for
    `flash_attention`. Accumulates in fp32 (an FP8 pool is dequantized on read; `q` is then fp32,
    fp16 or bf16, and the output takes its dtype).

    `key_positions` (sparse attention, DeepSeek-V3.2's DSA): int32 `[total_new, k]`, the positions in
    its sequence of the keys each query attends to instead of all of them, -1 for none; each entry
    counts once as listed. Every other entry must be a key the query may see (`0 <= pos <= p` for the
    query at position p, or `< kv_len` when not `causal`): the checked op raises `ValueError` naming
    `key_positions` otherwise, and kernels skip such entries (an unchecked call never reads outside
    the sequence's pages). A query with no key gets zeros.

    `sinks` (fp32 `[num_heads]`, HY-V4's MLA): adds `exp(sinks[h])` to the softmax denominator of
    every query row of head h and nothing to its output, as for `flash_attention`.
    """
    return torch.ops.paged_kv.mla_attention.default(
        q_nope,
        q_rope,
        blocks,
        cache_lengths,
        lookup_table,
        input_row_offsets,
        layer_idx,
        softmax_scale,
        causal,
        scales,
        key_positions,
        sinks,
    )


OPS: dict[str, Callable[..., Any]] = {
    "store_kv": store_kv,
    "flash_attention": flash_attention,
    "gather_kv": gather_kv,
    "copy_pages": copy_pages,
    "store_latent": store_latent,
    "mla_attention": mla_attention,
}
"""op name -> its typed public function (what `library.py` registers)."""

MUTATED: dict[str, tuple[str, ...]] = {
    "store_kv": ("blocks", "scales"),
    "flash_attention": (),
    "gather_kv": (),
    "copy_pages": ("blocks", "scales"),
    "store_latent": ("blocks", "scales"),
    "mla_attention": (),
}
"""op name -> the arguments it writes (declared `Tensor(a!)` in its schema)."""
