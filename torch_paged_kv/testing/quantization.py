"""FP8 accuracy: K/V with outlier channels, and the error of attention over an FP8 cache against bf16."""

from __future__ import annotations

import torch

from ..collection import PagedKVCacheCollection
from ..params import KVCacheParams
from ..step import StepPlan


def outlier_kv(
    tokens: int, kv_heads: int, head_dim: int, outliers: bool, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K and V `[tokens, kv_heads, head_dim]`; with `outliers`, a few channels 100x larger (as
    real K caches have: the case where one scale per tensor wastes FP8's range)."""
    gen = torch.Generator().manual_seed(seed)
    k, v = torch.randn(2, tokens, kv_heads, head_dim, generator=gen)
    if outliers:
        k[..., [3, head_dim // 2 + 13]] *= 100
        v[..., [5]] *= 100
    return k, v


def quantized_attention_error(
    k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, dtype: torch.dtype, granularity: int | None
) -> tuple[float, float]:
    """(max abs, relative RMS) error of one decode query row `q` `[q_heads, head_dim]` over K/V
    `[tokens, kv_heads, head_dim]` stored in an FP8 `dtype` cache (scales per `granularity` elements,
    or None: one static scale per tensor, the amax / dtype max), against the same stored in bf16."""
    tokens, kv_heads, head_dim = k.shape
    outputs = []
    for cache_dtype in (torch.bfloat16, dtype):
        quant: dict = {}
        if cache_dtype != torch.bfloat16:
            top = torch.finfo(dtype).max
            static = (k.abs().max().item() / top, v.abs().max().item() / top)
            quant = dict(quantization_granularity=granularity) if granularity else dict(static_scales=static)
        params = KVCacheParams(cache_dtype, 1, kv_heads, head_dim, page_size=16, **quant)
        pages = -(-tokens // 16)
        collection = PagedKVCacheCollection(params, num_pages=pages, max_batch_size=1, max_seq_len=pages * 16)
        collection.lookup_table[0, :pages] = torch.arange(1, pages + 1, dtype=torch.int32)
        plan = StepPlan.of(collection, collection.step_tensors(1))
        collection.input_row_offsets[1] = tokens
        plan.store_kv(k.bfloat16(), v.bfloat16(), 0)
        collection.cache_lengths[0], collection.input_row_offsets[1] = tokens - 1, 1
        outputs.append(plan.flash_attention(q[None].bfloat16(), 0, head_dim**-0.5).double())
    diff = outputs[1] - outputs[0]
    return diff.abs().max().item(), (diff.norm() / outputs[0].norm()).item()
