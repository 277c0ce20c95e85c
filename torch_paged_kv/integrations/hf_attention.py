"""The `paged_kv` attention and mask functions for transformers' `AttentionInterface`.

The mask function keeps only the padding of this step's new tokens, which is all the attention
needs: with a `PagedCache`, padding is never stored, so the pages hold exactly the keys each query
may see (up to causality, which `flash_attention` applies). It is `[batch, 1, new, 1]` bool (a 4-D
mask over the query rows, broadcast over heads and keys), so model code that slices the query
dimension of a 4-D mask (Gemma4's K/V-sharing layers trimmed to `logits_to_keep`) slices it too.
For a model with sparse-attention layers it is transformers' full causal mask (`sdpa_mask`) over the
cache's columns, padded queries' rows all False: their indexer picks keys with it (`hf_indexed`).
The attention reads the real query rows as those that see any column, in either form.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers.masking_utils import causal_mask_function, sdpa_mask

from . import hf_indexed, hf_mla
from .hf_layer import PendingKV, token_rows
from .hf_support import attention_chunk_size, check_attention_call, indexed_layers


def paged_kv_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: Any = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """`AttentionMaskInterface` entry: which of the `q_length` new tokens are real (`[batch, 1, new, 1]` bool;
    for sparse-attention models `[batch, 1, new, kv_length]`, see the module docstring).

    Contiguous: a compiled decode step guards on the mask's strides, and a slice of the growing 2D mask
    would change them every step (transformers < 5.18 passes the slice on as is).
    """
    real = None if attention_mask is None else attention_mask[:, -q_length:].bool().contiguous()[:, None, :, None]
    if not indexed_layers(kwargs.get("config")):
        return real
    kwargs["allow_is_causal_skip"] = False  # (the indexer needs the causal mask at every step)
    mask_function = mask_function or causal_mask_function
    full = sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, **kwargs)
    assert full is not None  # (no skip allowed)
    return full if real is None else full & real


def paged_kv_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: PendingKV | torch.Tensor,
    value: PendingKV | torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """`AttentionInterface` entry: store this step's real tokens in the pages, attend from the pages.

    `query` is `[batch, heads, new, head_dim]`; returns `[batch, new, heads, head_dim]` (MLA:
    `v_head_dim`). Padded query positions get zeros. Queries may be only the last positions of the
    step (a K/V-sharing layer fed `logits_to_keep` positions): they attend as those positions. Without
    a `PagedCache` (no cache at all), plain masked SDPA over the inputs.
    """
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    pending = kwargs.pop(hf_mla.PENDING_KWARG, None) or key  # an MLA layer's latents come as a keyword
    indices = kwargs.pop("indices", None)  # a sparse-attention layer's top-k columns [batch, new, k]
    mask = None if attention_mask is None else attention_mask[:, 0].any(-1)  # [batch, new]: real query rows
    if not isinstance(pending, (PendingKV, hf_mla.PendingLatent)):
        assert isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor)  # update returned no PendingKV
        return _uncached_attention(query, key, value, mask, scale, indices), None
    if indices is not None and not isinstance(pending, hf_mla.PendingLatent):
        raise ValueError(
            "config.layer_types: a sparse-attention layer over per-head K/V (not an MLA latent); paged_kv applies "
            "top-k keys to MLA layers only"
        )
    check_attention_call(module, kwargs)
    batch, num_heads, new, _ = query.shape
    layer, cache = pending.layer, pending.layer.cache
    step_columns = (pending.latent if isinstance(pending, hf_mla.PendingLatent) else pending.key).shape[2]
    q = token_rows(query)
    ragged = mask is not None and step_columns > 1  # a multi-token step with padding: real tokens only
    real = mask.reshape(-1).nonzero().squeeze(1) if mask is not None and ragged else None
    if real is not None:
        q = q[real]
    module_layer: Any = getattr(module, "layer_idx", None)  # a shared-KV layer attends with another's K/V; a
    layer_idx = module_layer if module_layer in cache.shared_layers else layer.layer_idx  # layer called again
    # (HRM's cycles) with the K/V of the cache slot it updated
    counts = lambda: _new_tokens(mask if ragged else None, batch, new, query.device)
    plan = cache.layer_plan(layer_idx, batch, new, counts)
    if new != step_columns:  # only the step's last `new` positions ask (K/V stored by the layer shared)
        plan = cache.trailing_plan(batch, counts(), layer.pool_layer)
    sinks = kwargs.get("s_aux")  # per-head sink logits (GPT-OSS, HY-V4)
    sinks = None if sinks is None else sinks.detach().float()
    if isinstance(pending, hf_mla.PendingLatent):
        positions = None
        if indices is not None:
            assert attention_mask is not None  # (paged_kv_mask gives sparse-attention models their full mask)
            positions = hf_indexed.key_positions(indices, attention_mask)
            positions = positions if real is None else positions[real]
        out = hf_mla.attend(plan, module, q, pending, real, scale, positions, sinks)
    else:
        if layer_idx == layer.layer_idx:  # the layer owning these K/V stores them; a sharing layer only reads
            k, v = token_rows(pending.key), token_rows(pending.value)
            plan.store_kv(k if real is None else k[real], v if real is None else v[real], layer.pool_layer)
        out = plan.flash_attention(
            q, layer.pool_layer, scale, True, sliding_window or -1, softcap or 0.0, sinks,
            attention_chunk_size(module),
        )  # fmt: skip
    cache.layer_done(layer_idx, batch)
    if real is not None:
        out = q.new_zeros(batch * new, num_heads, out.shape[-1]).index_copy_(0, real, out)
    return out.view(batch, new, num_heads, out.shape[-1]), None


def _new_tokens(attention_mask: torch.Tensor | None, batch: int, new: int, device: torch.device) -> torch.Tensor:
    """Each row's real new tokens, `[batch]` int32: the mask's count, or all `new` columns."""
    if attention_mask is not None:
        return attention_mask.sum(1, dtype=torch.int32)
    return torch.full((batch,), new, dtype=torch.int32, device=device)


def _uncached_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scale: float,
    indices: torch.Tensor | None,
) -> torch.Tensor:
    """Causal SDPA over the given keys, hiding padded keys (and with `indices`, `[batch, new, k]`, every
    key a query's row does not list); only for a forward with no past."""
    new, kv_len = query.shape[2], key.shape[2]
    if kv_len != new:
        raise ValueError(
            "attn_implementation='paged_kv' needs a PagedCache as the model's cache "
            "(cache=PagedCache(...), or past_key_values= before transformers 5.24) to attend over past keys"
        )
    allowed = torch.ones(new, new, dtype=torch.bool, device=query.device).tril()[None, None]
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, None, :]
    if indices is not None:
        listed = torch.zeros(*indices.shape[:2], kv_len, dtype=torch.bool, device=query.device)
        allowed = allowed & listed.scatter_(-1, indices.long(), True)[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=allowed, scale=scale, enable_gqa=query.shape[1] != key.shape[1]
    )
    return out.transpose(1, 2).contiguous()
