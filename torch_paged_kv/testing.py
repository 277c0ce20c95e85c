"""Test helpers: random paged batches written without the ops, and an fp64 attention oracle.

Used by the project's tests on every backend; handy for users testing their own kernels. The
cached prefix is written into `blocks` by direct indexing (not through `store_kv`), and every
unused slot of the pool, null page included, holds random values (or a chosen `fill`), so a
kernel that reads past a sequence or ignores the table shows up.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from .collection import PagedKVCacheCollection
from .layout import NULL_PAGE, table_width
from .ops import quant
from .params import KVCacheParams
from .step import StepPlan

ATTENTION_TOLERANCE = {
    torch.bfloat16: {"atol": 2e-3, "rtol": 1.6e-2},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
}
"""`torch.testing.assert_close` tolerances for an attention output (in its dtype) against an exact
answer. rtol covers the output's own rounding; atol stays small because decode outputs over
thousands of random keys are small (|out| ~ 0.02 at 4k-32k keys): an atol of 1e-2 or 2e-2 passed
kernels that dropped a whole page of keys."""


@dataclasses.dataclass
class PagedBatch:
    """One step of a ragged batch over a paged pool, with the same data kept contiguous."""

    blocks: torch.Tensor
    cache_lengths: torch.Tensor
    lookup_table: torch.Tensor
    input_row_offsets: torch.Tensor
    layer_idx: int
    keys: list[torch.Tensor]  # per sequence [cache_len + new, kv_heads, head_dim]: cached then new
    values: list[torch.Tensor]
    q: torch.Tensor  # [total_new, q_heads, head_dim]
    scales: torch.Tensor | None = None  # an FP8 pool's (make_fp8_batch)

    @property
    def new_keys(self) -> torch.Tensor:
        """This step's keys `[total_new, kv_heads, head_dim]`, in row order."""
        return self._new(self.keys)

    @property
    def new_values(self) -> torch.Tensor:
        return self._new(self.values)

    def _new(self, full: list[torch.Tensor]) -> torch.Tensor:
        lengths = self.cache_lengths.tolist()
        parts = [seq[length:] for seq, length in zip(full, lengths, strict=True)]
        return torch.cat(parts) if parts else full[0][:0]

    @property
    def step(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(cache_lengths, lookup_table, input_row_offsets)`, the op arguments after `blocks`."""
        return self.cache_lengths, self.lookup_table, self.input_row_offsets


def make_paged_batch(
    cache_lengths: Sequence[int],
    new_lengths: Sequence[int],
    *,
    page_size: int,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    group: int = 1,
    num_layers: int = 2,
    layer_idx: int = 1,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    continuous: bool = False,
    spare_pages: int = 3,
    seed: int = 0,
    fill: float | None = None,
) -> PagedBatch:
    """A random batch: shuffled physical pages, cached prefixes written, new K/V not yet stored.

    `continuous=True` builds the continuous-batching layout (1-D table, one slot per row, slot
    length `page_size`, which must hold every sequence). `fill` puts that value, instead of random
    ones, in every pool slot the batch does not write: a large finite value (300, say) makes a
    kernel that reads a key it must not see give a visibly wrong answer.
    """
    gen = torch.Generator().manual_seed(seed)
    batch = len(cache_lengths)
    kv_lens = [c + n for c, n in zip(cache_lengths, new_lengths, strict=True)]
    planes = 2
    if continuous:
        if max(kv_lens, default=0) > page_size:
            raise ValueError("page_size: a continuous-batching slot must hold the longest sequence")
        pages_per_seq = [1] * batch
    else:
        pages_per_seq = [math.ceil(n / page_size) for n in kv_lens]
    num_pages = 1 + sum(pages_per_seq) + spare_pages
    pool_shape = (num_pages, planes, num_layers, page_size, num_kv_heads, head_dim)
    blocks = torch.randn(pool_shape, generator=gen) if fill is None else torch.full(pool_shape, fill)
    blocks = blocks.to(dtype)

    physical = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()  # never the null page
    if continuous:
        table = torch.tensor(physical[:batch], dtype=torch.int32)
    else:
        width = table_width(max(kv_lens, default=1) or 1, page_size)
        table = torch.full((batch, width), NULL_PAGE, dtype=torch.int32)
        taken = 0
        for b, n in enumerate(pages_per_seq):
            table[b, :n] = torch.tensor(physical[taken : taken + n], dtype=torch.int32)
            taken += n

    keys, values = [], []
    for b in range(batch):
        k = torch.randn(kv_lens[b], num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(kv_lens[b], num_kv_heads, head_dim, generator=gen).to(dtype)
        pos = torch.arange(cache_lengths[b])
        pages = table[b].long().expand(len(pos)) if continuous else table[b, pos // page_size].long()
        blocks[pages, 0, layer_idx, pos % page_size] = k[: cache_lengths[b]]
        blocks[pages, 1, layer_idx, pos % page_size] = v[: cache_lengths[b]]
        keys.append(k)
        values.append(v)

    offsets = torch.zeros(batch + 1, dtype=torch.int32)
    offsets[1:] = torch.tensor(list(new_lengths), dtype=torch.int32).cumsum(0)
    q = torch.randn(int(offsets[-1]), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    device = torch.device(device)
    return PagedBatch(
        blocks.to(device),
        torch.tensor(list(cache_lengths), dtype=torch.int32, device=device),
        table.to(device),
        offsets.to(device),
        layer_idx,
        [k.to(device) for k in keys],
        [v.to(device) for v in values],
        q.to(device),
    )


def make_fp8_batch(
    cache_lengths: Sequence[int],
    new_lengths: Sequence[int],
    *,
    dtype: torch.dtype = torch.float8_e4m3fn,
    granularity: int | None = 16,
    page_size: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    group: int = 2,
    continuous: bool = False,
    seed: int = 0,
) -> tuple[PagedBatch, torch.Tensor, torch.Tensor]:
    """A random batch over an FP8 pool: `(batch, new_keys, new_values)`.

    The cached prefixes are written quantized by the rule of `ops/quant.py` (per `granularity`
    elements, or None: a static pair of scales), every unused slot holds random FP8 bytes and random
    scales. `new_keys`/`new_values` are this step's bf16 rows for `store_kv`; `batch.keys`/`values`
    are what the cache holds once they are stored (every token quantized, then dequantized to
    fp32), ready for `attention_fp64`; `batch.q` is bf16 and `batch.scales` the pool's scales.
    """
    b = make_paged_batch(cache_lengths, new_lengths, page_size=page_size, num_kv_heads=num_kv_heads,
                         head_dim=head_dim, group=group, continuous=continuous, seed=seed)  # fmt: skip
    gen = torch.Generator().manual_seed(seed + 1)
    shape = b.blocks.shape
    if granularity:
        scales = torch.rand(*shape[:5], head_dim // granularity, generator=gen)
    else:
        scales = torch.tensor([0.02, 0.03])
    blocks = torch.randn(shape, generator=gen).to(dtype)
    page_size = shape[3]
    stored: list[list[torch.Tensor]] = [[], []]
    new_rows: list[list[torch.Tensor]] = [[], []]
    for plane, full in enumerate((b.keys, b.values)):
        for i, n in enumerate(cache_lengths):
            rows = full[i].bfloat16()  # the model's K/V, as the model would store them
            if granularity:
                q, row_scales = quant.quantize(rows, dtype, granularity)
                stored[plane].append(quant.dequantize(q, row_scales))
            else:
                q, row_scales = quant.quantize_static(rows, dtype, scales[plane]), None
                stored[plane].append(q.float() * scales[plane])
            pos = torch.arange(n)
            pages = b.lookup_table[i].long().expand(n) if continuous else b.lookup_table[i, pos // page_size].long()
            blocks[pages, plane, b.layer_idx, pos % page_size] = q[:n]
            if row_scales is not None:
                scales[pages, plane, b.layer_idx, pos % page_size] = row_scales[:n]
            new_rows[plane].append(rows[n:])
    b.blocks, b.scales, b.q = blocks, scales, b.q.bfloat16()
    b.keys, b.values = stored
    return b, torch.cat(new_rows[0]), torch.cat(new_rows[1])


def attention_fp64(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    cache_lengths: Sequence[int],
    softmax_scale: float,
    causal: bool = True,
    sliding_window: int = -1,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    attention_chunk_size: int = -1,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention in float64 on contiguous per-sequence K/V, written from the op contract alone."""
    outputs, row = [], 0
    for k, v, cached in zip(keys, values, cache_lengths, strict=True):
        new = k.shape[0] - cached
        if new == 0:
            continue
        group = q.shape[1] // k.shape[1]
        qs = q[row : row + new].double()  # [new, Hq, D]
        kk = k.double().repeat_interleave(group, dim=1)  # [kv, Hq, D]
        vv = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs, kk) * softmax_scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        p = cached + torch.arange(new)[:, None]
        j = torch.arange(k.shape[0])[None, :]
        allowed = torch.ones(new, k.shape[0], dtype=torch.bool)
        if causal:
            allowed &= j <= p
        if sliding_window > 0:
            allowed &= p - j < sliding_window
        if attention_chunk_size > 0:
            allowed &= p // attention_chunk_size == j // attention_chunk_size
        if tree_mask is not None:  # new token t of this sequence only where the query's bit t is set
            for i, bits in enumerate(tree_mask[row : row + new].tolist()):
                for t in range(new):
                    allowed[i, cached + t] &= t < 64 and bool((bits >> t) & 1)
        scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
        top = scores.amax(-1, keepdim=True)
        sink = None if sinks is None else sinks.double().to(scores.device)[:, None, None]
        if sink is not None:  # a sink joins the softmax's denominator as one more logit
            top = torch.maximum(top, sink)
        weights = (scores - top).exp()
        denominator = weights.sum(-1, keepdim=True)
        if sink is not None:
            denominator = denominator + (sink - top).exp()
        outputs.append(torch.einsum("hqk,khd->qhd", weights / denominator, vv))
        row += new
    return torch.cat(outputs) if outputs else q.new_zeros(q.shape, dtype=torch.float64)


# -- MLA ---------------------------------------------------------------------------------------------


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
    from .ops import quant

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
) -> torch.Tensor:
    """Absorbed MLA in float64, from the op contract: multi-query attention whose one key per token is
    `[latent; rope]`, whose query is `[q_nope; q_rope]`, and whose value is the latent."""
    q = torch.cat((q_nope, q_rope), dim=2)
    keys = [
        torch.cat((latent.double(), rope.double()), dim=1)[:, None] for latent, rope in zip(latents, ropes, strict=True)
    ]
    values = [latent[:, None] for latent in latents]
    return attention_fp64(q, keys, values, cache_lengths, softmax_scale, causal)


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
