"""Public entry: paged decode attention with the CuTe kernels (compile cache -> kernels).

`flash_attention` takes the `paged_kv::flash_attention` record (validated), picks the arch's
kernel variant and a split count from shapes only (no host sync, CUDA-graph safe), runs the decode
kernel into fp32 partials and merges them with the combine kernel.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .. import splits as split_rule
from ..records import FlashAttentionArgs
from . import grids, variants
from .arch import device_arch, device_index, unverified_reason
from .operand import KVCacheMHAOperand

PROGRAMS_PER_SM = 2
"""Decode CTAs one SM runs at once (the split rule's occupancy target; ops/splits.py)."""
_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def supports(a: FlashAttentionArgs) -> bool:
    """Decode-shaped calls (one query row per sequence) the kernels cover; decided from shapes only."""
    return unsupported_option(a) is None and covers(
        device_arch(device_index(a.q.device)), a.q, a.blocks, a.cache_lengths.shape[0]
    )


def unsupported_option(a: FlashAttentionArgs) -> str | None:
    """The call's option that the kernels lack (Triton runs such calls), or None: what a forced
    `TORCH_PAGED_KV_BACKEND=cute` names when it refuses."""
    missing = (
        (a.softcap > 0, "softcap"),
        (a.sinks is not None, "attention sinks"),
        (a.attention_chunk_size > 0, "chunked attention (attention_chunk_size)"),
        (a.tree_mask is not None, "tree masks (tree_mask)"),
        (a.scales is not None, "FP8 caches (scales)"),
    )
    for lacking, what in missing:
        if lacking:
            return f"the CuTe decode kernels have no {what}; Triton runs such calls"
    if a.q.device.type != "cuda":
        return f"the CuTe kernels need CUDA tensors, got {a.q.device.type}"
    return None


def covers(arch: str | None, q: torch.Tensor, blocks: torch.Tensor, batch: int) -> bool:
    """The part of `supports` that depends on the arch, dtypes and shapes (any device, meta included)."""
    if arch is None or unverified_reason(arch) is not None:  # sm_100a: not until a Blackwell run
        return False
    if q.dtype not in _DTYPES or blocks.dtype != q.dtype:
        return False
    if blocks.dim() != 6 or blocks.shape[1] != 2 or not blocks.is_contiguous():
        return False
    page_size, kv_heads, head_dim = blocks.shape[3], blocks.shape[4], blocks.shape[5]
    rows, q_heads = q.shape[0], q.shape[1]
    group = q_heads // kv_heads
    return (
        0 < rows == batch
        and grids.grid_fits(grids.decode_grid(rows, kv_heads, split_rule.MAX_SPLITS))  # CUDA's launch limits
        and grids.grid_fits(grids.combine_grid(rows, q_heads))
        and head_dim in variants.HEAD_DIMS
        and group in variants.GROUPS
        and group * head_dim <= variants.MAX_GROUP_DIM  # compiled and checked
        and variants.page_supported(arch, page_size, variants.tile_config(head_dim)[0])
        and blocks.numel() // (kv_heads * head_dim) < 2**31 - page_size  # TMA coordinates are int32
    )


def flash_attention(a: FlashAttentionArgs) -> torch.Tensor:
    """`paged_kv::flash_attention` for calls `supports` accepts."""
    q, causal, sliding_window = a.q, a.causal, a.sliding_window
    operand = KVCacheMHAOperand.from_blocks(a.blocks, a.cache_lengths, a.lookup_table, a.layer_idx)
    index = device_index(q.device)
    arch = device_arch(index)
    assert arch is not None  # (supports: an sm_90a / sm_100a device)
    dtype = _DTYPES[q.dtype]
    rows, q_heads, head_dim = q.shape
    key = variants.decode_key(arch, dtype, head_dim, operand.page_size, q_heads // operand.num_kv_heads)
    max_keys = operand.lookup_table.shape[1] * operand.page_size
    if causal and sliding_window > 0:  # a query sees at most the window, plus a tile of alignment
        max_keys = min(max_keys, sliding_window + key.tile_n)
    splits = split_rule.num_splits(rows * operand.num_kv_heads, max_keys, key.tile_n, q.device, PROGRAMS_PER_SM)
    return launch(
        variants.get(key),
        variants.get(variants.combine_key(arch, dtype, head_dim)),
        q,
        operand,
        a.input_row_offsets,
        a.softmax_scale,
        causal,
        sliding_window,
        splits,
    )


def launch(
    decode: Any,
    combine: Any,
    q: torch.Tensor,
    operand: KVCacheMHAOperand,
    input_row_offsets: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    sliding_window: int,
    splits: int,
) -> torch.Tensor:
    """Run the compiled decode kernel into fp32 partials, then the combine kernel; returns the output."""
    q = q.contiguous()  # the combine kernel writes a compact `out`
    rows, q_heads, head_dim = q.shape
    partial = torch.empty(splits, rows, q_heads, head_dim, device=q.device, dtype=torch.float32)
    lse = torch.empty(splits, rows, q_heads, device=q.device, dtype=torch.float32)
    out = torch.empty_like(q)
    decode(
        q,
        operand.rows,
        operand.lookup_table,
        operand.cache_lengths,
        input_row_offsets,
        partial,
        lse,
        operand.page_stride,
        operand.k_plane_offset,
        operand.v_plane_offset,
        softmax_scale * math.log2(math.e),
        sliding_window,
        int(causal),
        splits,
    )
    combine(partial, lse, out, splits)
    return out
