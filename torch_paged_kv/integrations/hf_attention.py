"""The `paged_kv` attention and mask functions for transformers' `AttentionInterface`.

The mask function keeps only the padding of this step's new tokens, which is all the attention
needs: with a `PagedCache`, padding is never stored, so the pages hold exactly the keys each query
may see (up to causality, which `flash_attention` applies). It is `[batch, 1, new, 1]` bool (a 4-D
mask over the query rows, broadcast over heads and keys), so model code that slices the query
dimension of a 4-D mask (Gemma4's K/V-sharing layers trimmed to `logits_to_keep`) slices it too.
For a model with sparse-attention layers it is transformers' full causal mask (`sdpa_mask`) over the
cache's columns, padded queries' rows all False: their indexer picks keys with it (`hf_indexed`).
A mask function that adds to causality (with a window or chunks) what the kernels do not apply: an
overlay (`or_mask_function`, `block_sequence_ids`: Gemma3's bidirectional image blocks, a prefix
LM's bidirectional prefix, ...) gets transformers' full mask too, its columns moved to page positions
(`overlay_mask`), and the attention then reads the layer's K/V back from the pages and runs SDPA under
that mask (`_overlaid_attention`): exact, at the cost of the default attention's gather, for the
steps that carry an overlay (a VLM's prefill with images; its decode steps are causal).
The attention reads the real query rows as those that see any column, in every form. A layer with no
cache (a forward with no past, a vision tower) attends over its inputs in `hf_uncached`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import causal_mask_function, sdpa_mask

from . import hf_indexed, hf_mla, hf_uncached
from .hf_layer import PendingKV, token_rows
from .hf_support import (
    attention_chunk_size,
    check_attention_call,
    check_mask_config,
    check_unapplied_kwargs,
    indexed_layers,
)


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
    for sparse-attention models and overlays `[batch, 1, new, kv_length]`, see the module docstring).

    Contiguous: a compiled decode step guards on the mask's strides, and a slice of the growing 2D mask
    would change them every step (transformers < 5.18 passes the slice on as is).
    """
    config = kwargs.get("config")
    if config is not None:
        check_mask_config(config)
    if mask_function is not None and "causal_mask_function" not in mask_parts(mask_function):
        # a mask with no causal part: a vision tower's, an encoder's, a cross-attention's (no cache, over
        # the call's own keys): transformers' own, for `hf_uncached`
        return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, **kwargs)
    real = None if attention_mask is None else attention_mask[:, -q_length:].bool().contiguous()[:, None, :, None]
    indexed = bool(indexed_layers(config))
    if not indexed and not overlaid(mask_function):
        return real
    kwargs["allow_is_causal_skip"] = False  # (the indexer needs the causal mask at every step; an overlay
    kwargs["allow_is_bidirectional_skip"] = False  # is applied from the mask itself)
    mask_function = mask_function or causal_mask_function
    full = sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, **kwargs)
    assert full is not None  # (no skip allowed)
    full = full if real is None else full & real
    return full if indexed else overlay_mask(full, attention_mask)


_PLAIN_MASK_PARTS = (
    "causal_mask_function",
    "sliding_window_overlay.<locals>.inner_mask",
    "chunked_overlay.<locals>.inner_mask",
)


def overlaid(mask_function: Callable | None) -> bool:
    """Whether `mask_function` is more than the kernels apply (causality, with the window or chunks the
    attention call passes): anything but `causal_mask_function`, alone or and-ed with transformers'
    sliding-window or chunk overlays (an `or_masks`, a blockwise or prefix overlay, a model's own
    function)."""
    if mask_function is None:
        return False
    name = getattr(mask_function, "__qualname__", "")
    if name == "causal_mask_function":
        return False
    if name != "and_masks.<locals>.and_mask":
        return True
    names = mask_parts(mask_function)
    return "causal_mask_function" not in names or any(n not in _PLAIN_MASK_PARTS for n in names)


def mask_parts(mask_function: Callable) -> list[str]:
    """The qualified names of the functions transformers' `and_masks` / `or_masks` combined into
    `mask_function` (itself where it combines none)."""
    name = getattr(mask_function, "__qualname__", "")
    if name not in ("and_masks.<locals>.and_mask", "or_masks.<locals>.or_mask"):
        return [name]
    parts = [cell.cell_contents for cell in mask_function.__closure__ or ()]
    return [n for p in parts for f in (p if isinstance(p, tuple) else (p,)) for n in mask_parts(f)]


def overlay_mask(full: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """`full` (`[batch, 1, new, columns]` bool over transformers' columns, padding included) over page
    positions instead: a row's real columns (`attention_mask`, 2-D, columns so far) in order, as the
    pages hold its tokens; the rest False."""
    if attention_mask is None:
        return full
    columns = full.shape[-1]
    real = attention_mask.bool()[:, :columns]
    real = torch.nn.functional.pad(real, (0, columns - real.shape[-1]))  # unwritten columns: not real
    order = torch.sort(real.to(torch.int8), dim=-1, descending=True, stable=True).indices  # real columns first
    return full.gather(-1, order[:, None, None, :].expand_as(full))


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
    step (a K/V-sharing layer fed `logits_to_keep` positions): they attend as those positions. With no
    cache at all: `hf_uncached.attention` over the inputs.
    """
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    pending = kwargs.pop(hf_mla.PENDING_KWARG, None) or key  # an MLA layer's latents come as a keyword
    indices = kwargs.pop("indices", None)  # a sparse-attention layer's top-k columns [batch, new, k]
    sinks = kwargs.pop("s_aux", None)  # per-head sink logits (GPT-OSS, HY-V4)
    check_unapplied_kwargs(module, kwargs)
    causal = _is_causal(module, kwargs.pop("is_causal", None), attention_mask, query.shape[2])
    if not causal and not isinstance(pending, (PendingKV, hf_mla.PendingLatent)):
        # no cache, not causal (a vision tower, an adapter's pooling): sdpa under the model's own mask
        assert isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor)
        return sdpa_attention_forward(module, query, key, value, attention_mask, 0.0, scale, is_causal=False)
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        raise ValueError(
            f"attention_mask: a {attention_mask.dtype} 4-D mask; paged_kv takes the 2-D padding mask (or a 4-D "
            "bool mask of the keys each query sees)"
        )
    mask = None if attention_mask is None else attention_mask[:, 0].any(-1)  # [batch, new]: real query rows
    overlay = _overlay(module, attention_mask)
    if not isinstance(pending, (PendingKV, hf_mla.PendingLatent)):
        assert isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor)  # update returned no PendingKV
        return hf_uncached.attention(
            query, key, value, mask, scale,
            sliding_window=sliding_window, chunk=attention_chunk_size(module), softcap=softcap,
            sinks=None if sinks is None else sinks.detach(), indices=indices,
            overlay=None if overlay is None else hf_uncached.columns_of_positions(overlay, mask),
        ), None  # fmt: skip
    if indices is not None and not isinstance(pending, hf_mla.PendingLatent):
        raise ValueError(
            "config.layer_types: a sparse-attention layer over per-head K/V (not an MLA latent); paged_kv applies "
            "top-k keys to MLA layers only"
        )
    check_attention_call(module, {**kwargs, "is_causal": causal})
    batch, num_heads, new, _ = query.shape
    layer, cache = pending.layer, pending.layer.cache
    step_columns = (pending.latent if isinstance(pending, hf_mla.PendingLatent) else pending.key).shape[2]
    sinks = None if sinks is None else sinks.detach().float()
    if overlay is not None:
        _check_overlaid_call(module, pending, sinks, softcap, bool(cache.shared_layers))
        if overlay.shape[-1] > cache.max_cache_len:
            raise ValueError(
                f"attention_mask: {overlay.shape[-1]} key columns, more than the cache's max_cache_len="
                f"{cache.max_cache_len}"
            )
        overlay = torch.nn.functional.pad(overlay, (0, cache.max_cache_len - overlay.shape[-1]))  # unwritten
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
        if overlay is None:
            # a window the call does not pass is its layer group's: the model's mask applied it (Kyutai's, made
            # by generate from config.sliding_window), and the group gave back the pages outside it
            window = sliding_window or cache.layer_window(layer.pool_layer) or -1
            out = plan.flash_attention(
                q, layer.pool_layer, scale, True, window, softcap or 0.0, sinks, attention_chunk_size(module)
            )
        else:
            out = _overlaid_attention(cache.gather(plan, layer.pool_layer, query.dtype), query, overlay, mask, scale)
            out = out if real is None else out[real]
    cache.layer_done(layer_idx, batch)
    if real is not None:
        out = q.new_zeros(batch * new, num_heads, out.shape[-1]).index_copy_(0, real, out)
    return out.view(batch, new, num_heads, out.shape[-1]), None


def _is_causal(module: torch.nn.Module, call: bool | None, attention_mask: torch.Tensor | None, new: int) -> bool:
    """Whether the call attends causally: as transformers' sdpa, the call's `is_causal`, else the module's.
    A causal module may pass False where its mask carries causality (Moonshine, for SDPA's sake, whenever
    it has a mask or one query): `paged_kv_mask`'s causal mask (`[batch, 1, new, 1]`) leaves causality to
    the attention, and one query sees the same keys either way, so the call stays causal there."""
    module_causal = getattr(module, "is_causal", True)
    if call is None:
        return module_causal
    if call or not module_causal:
        return bool(call)
    return new == 1 or (attention_mask is not None and attention_mask.shape[-1] == 1)


def _overlay(module: torch.nn.Module, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The step's mask over page positions when `paged_kv_mask` made one for an overlay (see the module
    docstring), else None (the mask is `[batch, 1, new, 1]`, or a sparse-attention model's columns)."""
    if attention_mask is None or attention_mask.shape[-1] == 1 or indexed_layers(getattr(module, "config", None)):
        return None
    return attention_mask


def _check_overlaid_call(
    module: torch.nn.Module, pending: Any, sinks: torch.Tensor | None, softcap: float | None, sharing: bool
) -> None:
    """Refuse, before anything is stored, an overlay mask on a layer whose attention SDPA does not apply
    (`sharing`: a model with K/V-sharing layers, fed only the last positions at its prefill: refused at
    its first layer, before anything is stored)."""
    what = (
        "an MLA layer" if isinstance(pending, hf_mla.PendingLatent)
        else "attention sinks" if sinks is not None
        else "softcapped scores" if softcap
        else "chunked attention" if attention_chunk_size(module) > 0
        else "K/V-sharing layers" if sharing
        else None
    )  # fmt: skip
    if what is not None:
        raise ValueError(
            f"attn_implementation: paged_kv applies a mask overlay (bidirectional image or prefix blocks) "
            f"only to plain K/V layers, not to {what} (layer {getattr(module, 'layer_idx', '?')}); use "
            "attn_implementation='sdpa' or 'eager' with PagedCache for this model"
        )


def _overlaid_attention(
    kv: tuple[torch.Tensor, torch.Tensor],
    query: torch.Tensor,
    allowed: torch.Tensor,
    real_rows: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """SDPA of `query` (`[batch, heads, new, head_dim]`) over the layer's K/V read back from the pages
    (`kv`: `[batch, positions, kv_heads, head_dim]` each) under `allowed` (`[batch, 1, new, positions]`
    bool, page positions); padded query rows (`real_rows` False) give zeros. Returns `[batch * new,
    heads, head_dim]`."""
    keys, values = (t.transpose(1, 2) for t in kv)
    out = hf_uncached.sdpa(query, keys, values, allowed, real_rows, scale)
    return out.reshape(-1, *out.shape[2:])


def _new_tokens(attention_mask: torch.Tensor | None, batch: int, new: int, device: torch.device) -> torch.Tensor:
    """Each row's real new tokens, `[batch]` int32: the mask's count, or all `new` columns."""
    if attention_mask is not None:
        return attention_mask.sum(1, dtype=torch.int32)
    return torch.full((batch,), new, dtype=torch.int32, device=device)
