"""The `paged_kv` attention of a causal layer with no cache: a forward with no past (`use_cache=False`,
a scoring pass). The keys are the call's own inputs, padding included, so the rules are transformers'
own, over those columns: causality, the call's sliding window, the layer's chunks (counted from a
row's first real column, as transformers' chunked mask does), padding, a sparse layer's top-k columns,
or a mask overlay in place of all of these; softcapped scores and sink logits as transformers' eager
attention applies them. A query row that sees no key (padding) gives zeros. (A non-causal layer with
no cache, a vision tower's, takes transformers' own SDPA: `hf_attention`.)"""

from __future__ import annotations

import torch


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    real: torch.Tensor | None,
    scale: float,
    *,
    sliding_window: int | None = None,
    chunk: int = -1,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    indices: torch.Tensor | None = None,
    overlay: torch.Tensor | None = None,
) -> torch.Tensor:
    """`query` `[batch, heads, new, head_dim]` over `key`/`value` `[batch, kv_heads, new, head_dim]`;
    `real` `[batch, new]` bool (None: no padding); `indices` `[batch, new, k]`; `overlay` `[batch, 1,
    new, new]` bool (transformers' whole mask). Returns `[batch, new, heads, head_dim]`."""
    new = query.shape[2]
    if key.shape[2] != new:
        raise ValueError(
            "attn_implementation='paged_kv' needs a PagedCache as the model's cache "
            "(cache=PagedCache(...), or past_key_values= before transformers 5.24) to attend over past keys"
        )
    allowed = overlay if overlay is not None else _allowed(new, real, sliding_window, chunk, query.device)
    if indices is not None:
        listed = torch.zeros(*indices.shape[:2], new, dtype=torch.bool, device=query.device)
        allowed = allowed & listed.scatter_(-1, indices.long(), True)[:, None]
    return sdpa(query, key, value, allowed, real, scale, softcap, sinks)


def _allowed(new: int, real: torch.Tensor | None, window: int | None, chunk: int, device: torch.device) -> torch.Tensor:
    """Which column each query row sees, `[batch or 1, 1, new, new]` bool."""
    q = torch.arange(new, device=device)[:, None]
    k = torch.arange(new, device=device)[None, :]
    allowed = k <= q
    if window:
        allowed = allowed & (k > q - window)
    allowed = allowed[None, None]
    if chunk > 0:
        first = torch.zeros(1, dtype=torch.long, device=device) if real is None else (real.cumsum(-1) == 0).sum(-1)
        blocks = (torch.arange(new, device=device)[None] - first[:, None]).div(chunk, rounding_mode="floor")
        allowed = allowed & (blocks[:, None, :, None] == blocks[:, None, None, :])
    if real is not None:
        allowed = allowed & real[:, None, None, :]
    return allowed


def sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor,
    real: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of `query` over `key`/`value` (`[batch, kv_heads, keys, head_dim]`) under `allowed`
    (bool, broadcast to `[batch, heads, new, keys]`), `[batch, new, heads, head_dim]`; rows that see
    no key, or are not `real`, give zeros. Softcapped scores or sinks take the eager form (fp32 softmax,
    as transformers' eager attention), else torch's SDPA."""
    seen = allowed.any(-1, keepdim=True)
    allowed = allowed | ~seen  # (a row of no key would give NaN)
    if softcap or sinks is not None:
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        scores = torch.matmul(query, key.transpose(-1, -2)) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.float().masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            scores = torch.cat((scores, sinks.float()[None, :, None, None].expand(*scores.shape[:-1], 1)), -1)
        weights = scores.softmax(-1)[..., : key.shape[2]].to(value.dtype)
        out = torch.matmul(weights, value)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=allowed, scale=scale, enable_gqa=query.shape[1] != key.shape[1]
        )
    keep = seen if real is None else seen & real[:, None, :, None]
    return (out * keep).transpose(1, 2).contiguous()


def columns_of_positions(positions: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
    """The overlay mask `paged_kv_mask` made over page positions (`[batch, 1, new, new]`) over a step's
    own columns again, for a step with no past (a row's real columns are its real query rows)."""
    if real is None:
        return positions
    position = (real.cumsum(-1) - 1).clamp_(min=0)  # [batch, new]: each real column's page position
    columns = positions.gather(-1, position[:, None, None, :].expand_as(positions))
    return columns & real[:, None, None, :]
