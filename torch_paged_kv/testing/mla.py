"""MLA: random latent batches written without the ops, and fp64 oracles (absorbed and not)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from ..layout import NULL_PAGE, table_width
from ..ops import quant
from ..params import KVCacheParams
from .paged import attention_fp64


@dataclasses.dataclass
class MLABatch:
    """One step of a ragged batch over an MLA latent pool, with the same rows kept contiguous."""

    blocks: torch.Tensor
    scales: torch.Tensor | None
    cache_lengths: torch.Tensor
    lookup_table: torch.Tensor
    input_row_offsets: torch.Tensor
    layer_idx: int
    latents: list[torch.Tensor]  # per sequence [cache_len + new, kv_lora_rank]: the values the cache holds
    ropes: list[torch.Tensor]  # per sequence [cache_len + new, rope_dim]
    new_latent: torch.Tensor  # this step's rows, as given to store_latent [total_new, kv_lora_rank]
    new_rope: torch.Tensor  # [total_new, rope_dim]
    q_nope: torch.Tensor  # [total_new, heads, kv_lora_rank]
    q_rope: torch.Tensor  # [total_new, heads, rope_dim]

    @property
    def step(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(cache_lengths, lookup_table, input_row_offsets)`, the op arguments after `blocks`."""
        return self.cache_lengths, self.lookup_table, self.input_row_offsets


def mla_row_contents(
    latent: torch.Tensor, rope: torch.Tensor, params: KVCacheParams
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """What an MLA cache of `params` holds for the rows `latent` `[n, kv_lora_rank]`, `rope` `[n, rope_dim]`:
    (stored latent elements, FP8 codes for an FP8 cache; their per-granule scales or None; the latent
    it reads back, fp32 for an FP8 cache; the rope as stored, bf16 in an FP8 cache)."""
    if not params.quantized:
        return latent.to(params.dtype), None, latent.to(params.dtype).float(), rope.to(params.dtype)
    rope = rope.to(params.rope_dtype)
    if params.static_scales is not None:
        q = quant.quantize_static(latent, params.dtype, params.static_scales[0])
        return q, None, q.float() * params.static_scales[0], rope
    granularity = params.quantization_granularity
    assert granularity is not None  # (per-granule scales: KVCacheParams sets it)
    q, scales = quant.quantize(latent, params.dtype, granularity)
    return q, scales, quant.dequantize(q, scales), rope


def make_mla_batch(
    cache_lengths: Sequence[int],
    new_lengths: Sequence[int],
    *,
    page_size: int,
    kv_lora_rank: int = 32,
    rope_dim: int = 16,
    num_heads: int = 4,
    num_layers: int = 2,
    layer_idx: int = 1,
    dtype: torch.dtype = torch.float32,
    q_dtype: torch.dtype | None = None,
    continuous: bool = False,
    spare_pages: int = 3,
    seed: int = 0,
    device: str | torch.device = "cpu",
    **quantization,
) -> MLABatch:
    """A random MLA batch: shuffled physical pages, cached prefixes written (by indexing, through the FP8
    rule of `ops/quant.py` for an FP8 `dtype`), new rows not yet stored; every unused slot holds random
    bytes. `latents` / `ropes` are what the cache holds (for an FP8 cache: the dequantized latent, the
    bf16 rope), which is what `mla_attention` must attend over once `store_latent` wrote the new rows.
    `q_dtype` (default `dtype`, bf16 for an FP8 cache) is the dtype of the queries and new rows."""
    gen = torch.Generator().manual_seed(seed)
    params = KVCacheParams.mla(dtype, num_layers, page_size, kv_lora_rank, rope_dim, **quantization)
    q_dtype = q_dtype or (torch.bfloat16 if params.quantized else dtype)
    batch = len(cache_lengths)
    kv_lens = [c + n for c, n in zip(cache_lengths, new_lengths, strict=True)]
    pages_per_seq = [1] * batch if continuous else [math.ceil(n / page_size) for n in kv_lens]
    if continuous and max(kv_lens, default=0) > page_size:
        raise ValueError("page_size: a continuous-batching slot must hold the longest sequence")
    num_pages = 1 + sum(pages_per_seq) + spare_pages
    shape = (num_pages, 1, num_layers, page_size, 1, params.head_dim)
    if params.quantized:  # random bytes below any NaN/inf pattern of either FP8 dtype or of the bf16 rope
        blocks = torch.randint(0, 100, shape, generator=gen, dtype=torch.uint8).view(dtype)
    else:
        blocks = torch.randn(shape, generator=gen).to(dtype)
    scales = None
    if params.has_scales_tensor:
        scales = torch.rand((*shape[:5], params.scales_per_head), generator=gen)
    elif params.quantized:
        scales = torch.tensor(params.static_scales, dtype=torch.float32)

    physical = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()  # never the null page
    if continuous:
        table = torch.tensor(physical[:batch], dtype=torch.int32)
    else:
        table = torch.full((batch, table_width(max(kv_lens, default=1) or 1, page_size)), NULL_PAGE, dtype=torch.int32)
        taken = 0
        for b, n in enumerate(pages_per_seq):
            table[b, :n] = torch.tensor(physical[taken : taken + n], dtype=torch.int32)
            taken += n

    latents, ropes, new_latent, new_rope = [], [], [], []
    for b in range(batch):
        latent = torch.randn(kv_lens[b], kv_lora_rank, generator=gen).to(q_dtype)
        rope = torch.randn(kv_lens[b], rope_dim, generator=gen).to(q_dtype)
        stored, row_scales, held, held_rope = mla_row_contents(latent, rope, params)
        cached = cache_lengths[b]
        pos = torch.arange(cached)
        pages = table[b].long().expand(cached) if continuous else table[b, pos // page_size].long()
        if params.quantized:
            rows = torch.cat((stored[:cached].view(torch.uint8), held_rope[:cached].view(torch.uint8)), dim=1)
            blocks.view(torch.uint8)[pages, 0, layer_idx, pos % page_size, 0] = rows
            if scales is not None and row_scales is not None:
                scales[pages, 0, layer_idx, pos % page_size, 0] = row_scales[:cached]
        else:
            blocks[pages, 0, layer_idx, pos % page_size, 0] = torch.cat((stored[:cached], held_rope[:cached]), dim=1)
        latents.append(held)
        ropes.append(held_rope)
        new_latent.append(latent[cached:])
        new_rope.append(rope[cached:])

    offsets = torch.zeros(batch + 1, dtype=torch.int32)
    offsets[1:] = torch.tensor(list(new_lengths), dtype=torch.int32).cumsum(0)
    total = int(offsets[-1])
    q_nope = torch.randn(total, num_heads, kv_lora_rank, generator=gen).to(q_dtype)
    q_rope = torch.randn(total, num_heads, rope_dim, generator=gen).to(q_dtype)
    device = torch.device(device)
    return MLABatch(
        blocks.to(device),
        None if scales is None else scales.to(device),
        torch.tensor(list(cache_lengths), dtype=torch.int32, device=device),
        table.to(device),
        offsets.to(device),
        layer_idx,
        [t.to(device) for t in latents],
        [t.to(device) for t in ropes],
        torch.cat(new_latent).to(device),
        torch.cat(new_rope).to(device),
        q_nope.to(device),
        q_rope.to(device),
    )


def mla_attention_fp64(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latents: list[torch.Tensor],
    ropes: list[torch.Tensor],
    cache_lengths: Sequence[int],
    softmax_scale: float,
    causal: bool = True,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed MLA in float64, from the op contract: multi-query attention whose one key per token is
    `[latent; rope]`, whose query is `[q_nope; q_rope]`, and whose value is the latent (`sinks`: each
    head's sink logit in its denominator)."""
    attention = mla_as_attention(q_nope, q_rope, latents, ropes)
    return attention_fp64(*attention, cache_lengths, softmax_scale, causal, sinks=sinks)


def sparse_mla_attention_fp64(
    b: MLABatch,
    key_positions: torch.Tensor,
    softmax_scale: float,
    causal: bool = True,
    sinks: torch.Tensor | None = None,
    spread: bool = False,
) -> torch.Tensor:
    """Sparse absorbed MLA (`mla_attention` with `key_positions`) in float64 on the CPU, query by query
    from the op contract: softmax over the listed keys `[latent; rope]` that it may see (each entry
    counts once as listed; other entries none; head h's sink logit `sinks[h]` a term of the
    denominator only), of `[latent; rope] . [q_nope; q_rope]` times the scale, times the latents; zeros
    for a query with no key. `spread`: the same weights times |latent| (`assert_attention_within_rounding`'s
    spread)."""
    q = torch.cat((b.q_nope.double(), b.q_rope.double()), dim=2).cpu()
    offsets, lengths = b.input_row_offsets.tolist(), b.cache_lengths.tolist()
    rank = b.q_nope.shape[2]
    out = torch.zeros(b.q_nope.shape, dtype=torch.float64)
    for s in range(len(lengths)):
        keys = torch.cat((b.latents[s].double(), b.ropes[s].double()), dim=1).cpu()
        values = keys[:, :rank].abs() if spread else keys[:, :rank]
        for i, t in enumerate(range(offsets[s], offsets[s + 1])):
            last = lengths[s] + i if causal else keys.shape[0] - 1
            listed = [p for p in key_positions[t].tolist() if 0 <= p <= last]
            if listed:
                logits = (q[t] @ keys[listed].T * softmax_scale).exp()  # [heads, keys]
                denominator = logits.sum(-1, keepdim=True)
                if sinks is not None:
                    denominator = denominator + sinks.double().cpu().exp()[:, None]
                out[t] = (logits / denominator) @ values[listed]
    return out


def random_key_positions(b: MLABatch, k: int, seed: int, causal: bool = True, none_share: float = 0.25) -> torch.Tensor:
    """`key_positions` for batch `b`: int32 `[total_new, k]` (on the CPU), each row up to `k` distinct
    positions its query may see in random order, about `none_share` of the entries -1."""
    gen = torch.Generator().manual_seed(seed)
    offsets, lengths = b.input_row_offsets.tolist(), b.cache_lengths.tolist()
    rows = []
    for s in range(len(lengths)):
        new = offsets[s + 1] - offsets[s]
        for i in range(new):
            visible = lengths[s] + (i + 1 if causal else new)
            chosen = torch.randperm(visible, generator=gen)[:k]
            row = torch.full((k,), -1, dtype=torch.int32)
            row[: chosen.numel()] = chosen.int()
            dropped = torch.rand(k, generator=gen) < none_share
            rows.append(
                torch.where(dropped, torch.tensor(-1, dtype=torch.int32), row)[torch.randperm(k, generator=gen)]
            )
    return torch.stack(rows)


def mla_as_attention(
    q_nope: torch.Tensor, q_rope: torch.Tensor, latents: list[torch.Tensor], ropes: list[torch.Tensor]
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Absorbed MLA as one-kv-head attention: (query `[q_nope; q_rope]`, keys `[latent; rope]`, values
    the latents), the first arguments of `attention_fp64` or `attention_fp64_and_spread`."""
    keys = [
        torch.cat((latent.double(), rope.double()), dim=1)[:, None] for latent, rope in zip(latents, ropes, strict=True)
    ]
    return torch.cat((q_nope, q_rope), dim=2), keys, [latent[:, None] for latent in latents]


def absorb_query(q_nope_full: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """The absorbed no-rope query: `q_nope_full` `[tokens, heads, qk_nope_dim]` times W_UK `[heads,
    qk_nope_dim, kv_lora_rank]` per head -> `[tokens, heads, kv_lora_rank]`."""
    return torch.einsum("thd,hdr->thr", q_nope_full, w_uk)


def mla_nonabsorbed_fp64(
    q_nope_full: torch.Tensor,
    q_rope: torch.Tensor,
    latents: list[torch.Tensor],
    ropes: list[torch.Tensor],
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    cache_lengths: Sequence[int],
    softmax_scale: float,
    causal: bool = True,
) -> torch.Tensor:
    """MLA as the model defines it, in float64: decompress every cached latent into per-head keys
    `[W_UK latent; k_rope]` (`w_uk` `[heads, qk_nope_dim, kv_lora_rank]`; the rope key shared by the
    heads) and values `W_UV latent` (`w_uv` `[heads, v_head_dim, kv_lora_rank]`), then multi-head
    attention of `[q_nope_full; q_rope]` -> `[total_new, heads, v_head_dim]`."""
    heads = w_uk.shape[0]
    q = torch.cat((q_nope_full.double(), q_rope.double()), dim=2)
    keys, values = [], []
    for latent, rope in zip(latents, ropes, strict=True):
        k_nope = torch.einsum("kr,hdr->khd", latent.double(), w_uk.double())
        keys.append(torch.cat((k_nope, rope.double()[:, None].expand(-1, heads, -1)), dim=2))
        values.append(torch.einsum("kr,hvr->khv", latent.double(), w_uv.double()))
    return attention_fp64(q, keys, values, cache_lengths, softmax_scale, causal)
