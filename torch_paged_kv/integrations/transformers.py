"""transformers integration: `PagedCache` and the `attn_implementation="paged_kv"` functions.

Importing this module registers `"paged_kv"` with both `AttentionInterface` and
`AttentionMaskInterface` (transformers drops the mask of an attention name it has no mask
function for). See docs/transformers.md.

    import torch_paged_kv.integrations.transformers as paged
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="paged_kv")
    cache = paged.PagedCache(model.config, max_batch_size=8, max_cache_len=1024)  # model's device, dtype
    model.generate(**inputs, cache=cache)  # past_key_values=cache before transformers 5.24
"""

from __future__ import annotations

from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from .hf_attention import paged_kv_attention, paged_kv_mask
from .hf_cache import ATTN_IMPLEMENTATION, PagedCache, cache_kwarg
from .hf_layer import PagedLayer, PendingKV

AttentionInterface.register(ATTN_IMPLEMENTATION, paged_kv_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, paged_kv_mask)

__all__ = [
    "ATTN_IMPLEMENTATION",
    "PagedCache",
    "PagedLayer",
    "PendingKV",
    "cache_kwarg",
    "paged_kv_attention",
    "paged_kv_mask",
]
