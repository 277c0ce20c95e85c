"""MLA models (DeepSeek-V2/V3) in `PagedCache`: one latent + rope row per token, absorbed attention.

transformers' MLA attention (`DeepseekV3Attention` and its kind) hands `Cache.update` the compressed
latent `c` `[batch, 1, new, kv_lora_rank]` (after `kv_a_layernorm`) and the rotated rope key
`[batch, 1, new, qk_rope_head_dim]`, and decompresses what `update` returns with `expand_kv`
(`kv_b_proj`: per head, keys `[W_UK c; k_rope]` and values `W_UV c`). The pool is an MLA pool
(`KVCacheParams.mla`): one row of `kv_lora_rank + rope_dim` per token and layer.

- Under the model's own attention, `update` stores the new rows (`store_latent`) and returns every
  row of the sequence (`max_cache_len` columns, zeros past each row's length, as `gather_kv` does),
  which the model decompresses and attends over with its own mask.
- Under `paged_kv`, `update` stores nothing and returns its inputs (so `expand_kv` decompresses only
  the new tokens, which nothing reads); it puts a `PendingLatent` into the layer's keyword arguments,
  which transformers passes on to the attention function (`Cache.update(..., kwargs=kwargs)`, then
  `attention_interface(..., **kwargs)`). The attention function stores the real tokens' rows and runs
  absorbed MLA over the pages: `W_UK` into the query, `mla_attention` (`[tokens, heads,
  kv_lora_rank]`), `W_UV` onto the output. `W_UK` and `W_UV` are views of the layer's `kv_b_proj`
  weight (no copy); cached latents are never decompressed.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..ops.quant import FP8_DTYPES
from ..step import GroupStepPlan
from .hf_support import MLA_LATENT_UPDATE

PENDING_KWARG = "paged_kv_latent"
"""The keyword under which the attention function receives this step's `PendingLatent`."""


class PendingLatent(NamedTuple):
    """What `update` leaves for the `paged_kv` attention function of an MLA layer."""

    layer: Any  # the PagedLayer
    latent: torch.Tensor  # [batch, 1, new, kv_lora_rank]
    rope: torch.Tensor  # [batch, 1, new, rope_dim], rotated


def rows(states: torch.Tensor) -> torch.Tensor:
    """`[batch, 1, new, width]` -> `[batch*new, width]` (batch-major token rows)."""
    return states.reshape(-1, states.shape[-1])


def check_inputs(latent: torch.Tensor, rope: torch.Tensor, kv_lora_rank: int, rope_dim: int) -> None:
    """`update`'s inputs must be the latent and the rope key, one head each (a transformers whose MLA
    attention hands `update` decompressed per-head K/V is refused before anything is stored)."""
    for name, t, width in (("key_states", latent, kv_lora_rank), ("value_states", rope, rope_dim)):
        if t.dim() != 4 or t.shape[1] != 1 or t.shape[3] != width:
            raise ValueError(
                f"{name}: an MLA PagedCache expects the compressed latent and rope key [batch, 1, new, "
                f"{kv_lora_rank} | {rope_dim}] from the model's attention, got {tuple(t.shape)} (a transformers "
                f"version that decompresses K/V before Cache.update: use transformers >= {MLA_LATENT_UPDATE} or a "
                "DynamicCache)"
            )


def update(layer: Any, latent: torch.Tensor, rope: torch.Tensor, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """`PagedLayer.update` of an MLA layer (see the module docstring)."""
    cache = layer.cache
    params = cache.collection.params
    check_inputs(latent, rope, params.kv_lora_rank, params.rope_dim)
    if cache.attends_from_pages:
        call_kwargs = kwargs.get("kwargs")
        if not isinstance(call_kwargs, dict):
            raise ValueError(
                "attn_implementation: 'paged_kv' on an MLA model needs the attention's keyword arguments in "
                "Cache.update (transformers >= 5.24 passes kwargs=...); use the model's default attention"
            )
        call_kwargs[PENDING_KWARG] = PendingLatent(layer, latent, rope)
        return latent, rope
    if params.dtype in FP8_DTYPES:
        raise ValueError(
            f"kv_dtype: an FP8 MLA PagedCache ({params.dtype}) is read only by attn_implementation='paged_kv' "
            "(absorbed attention over the pages); the model's default attention needs a 16/32-bit kv_dtype"
        )
    batch, _, new, _ = latent.shape
    counts = lambda: torch.full((batch,), new, dtype=torch.int32, device=cache.device)
    plan = cache.layer_plan(layer.layer_idx, batch, new, counts)
    plan.store_latent(rows(latent), rows(rope), layer.pool_layer)
    gathered = gather_rows(plan, layer.pool_layer, cache.max_cache_len)
    cache.layer_done(layer.layer_idx, batch)
    gathered = gathered.unsqueeze(1).to(latent.dtype)
    return gathered[..., : params.kv_lora_rank], gathered[..., params.kv_lora_rank :]


def gather_rows(plan: GroupStepPlan, pool_layer: int, max_len: int) -> torch.Tensor:
    """Every stored row of each sequence of the step (this step's included), `[batch, max_len, width]`,
    zeros past each sequence's length (what `gather_kv` does for K/V)."""
    group_plan, local = plan.at(pool_layer)
    lengths, table, offsets = group_plan.step
    page_size = group_plan.blocks.shape[3]
    pages = -(-max_len // page_size)
    layer_rows = group_plan.blocks[:, 0, local, :, 0]  # [pages, page_size, width]
    out = layer_rows[table[:, :pages].long()].flatten(1, 2)[:, :max_len]
    seen = lengths + offsets[1:] - offsets[:-1]
    kept = torch.arange(max_len, device=out.device)[None, :] < seen[:, None]
    return torch.where(kept[..., None], out, torch.zeros((), dtype=out.dtype, device=out.device))


def attend(
    plan: GroupStepPlan,
    module: Any,
    q: torch.Tensor,
    pending: PendingLatent,
    real: torch.Tensor | None,
    scale: float,
    key_positions: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Store this step's latent rows (only `real` token rows where given) and run absorbed MLA for the
    queries `q` `[tokens, heads, qk_nope_head_dim + qk_rope_head_dim]` -> `[tokens, heads, v_head_dim]`
    of `module`, transformers' MLA attention (its `kv_b_proj`, `qk_nope_head_dim`, `v_head_dim`); with
    `key_positions` `[tokens, k]`, over the keys each query's row lists (sparse attention); `sinks` fp32
    `[heads]` (HY-V4's)."""
    latent, rope = rows(pending.latent), rows(pending.rope)
    if real is not None:
        latent, rope = latent[real], rope[real]
    pool_layer = pending.layer.pool_layer
    plan.store_latent(latent, rope, pool_layer)
    nope, v_dim = module.qk_nope_head_dim, module.v_head_dim
    w_uk, w_uv = module.kv_b_proj.weight.view(q.shape[1], nope + v_dim, -1).split([nope, v_dim], dim=1)
    q_latent = torch.einsum("thd,hdr->thr", q[..., :nope], w_uk)
    q_rope = q[..., nope:].contiguous()
    out = plan.mla_attention(q_latent.contiguous(), q_rope, pool_layer, scale, True, key_positions, sinks)
    return torch.einsum("thr,hvr->thv", out.to(w_uv.dtype), w_uv)
