"""Random paged K/V batches written without the ops (FP8 ones too), and the fp64 attention oracle."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from ..layout import NULL_PAGE, table_width
from ..ops import quant

ATTENTION_TOLERANCE = {
    torch.bfloat16: {"atol": 2e-3, "rtol": 1.6e-2},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
}
"""`torch.testing.assert_close` tolerances for an attention output (in its dtype) against an exact
answer. rtol covers the output's own rounding; atol stays small because decode outputs over
thousands of random keys are small (|out| ~ 0.02 at 4k-32k keys): an atol of 1e-2 or 2e-2 passed
kernels that dropped a whole page of keys."""


UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def assert_attention_within_rounding(out: torch.Tensor, exact: torch.Tensor, spread: torch.Tensor) -> None:
    """Every element of `out` within what rounding can move a tensor-core kernel's answer from `exact`
    (fp64): `ATTENTION_TOLERANCE[out.dtype]`'s rtol (the output's own rounding) and a small atol,
    plus u * `spread`, where u is `out.dtype`'s unit roundoff and `spread` is the same attention over
    |V| (`attention_fp64_and_spread`): the softmax weights rounded to the value dtype before they
    multiply V move the answer by at most u * sum(p |v|). That term is large only for rows that see
    few keys, where the old fixed atol (2e-3 in bf16) was exceeded on an H100; over thousands of keys
    it stays near u * E|v|."""
    rtol = ATTENTION_TOLERANCE[out.dtype]["rtol"]
    atol = min(ATTENTION_TOLERANCE[out.dtype]["atol"], 1e-4)
    exact, spread = exact.to(out.device), spread.to(out.device)
    error = (out.double() - exact).abs()
    allowed = atol + rtol * exact.abs() + UNIT_ROUNDOFF[out.dtype] * spread
    worst = (error - allowed).flatten().argmax()
    if error.flatten()[worst] > allowed.flatten()[worst]:
        at = tuple(int(i) for i in torch.unravel_index(worst, error.shape))
        raise AssertionError(
            f"{int((error > allowed).sum())} of {error.numel()} elements outside rounding; worst at {at}: "
            f"got {float(out[at]):.6g}, exact {float(exact[at]):.6g}, error {float(error[at]):.3g} "
            f"> allowed {float(allowed[at]):.3g} (spread {float(spread[at]):.3g})"
        )


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
        # positions: key j < cached at j; new token t at cached + t, or in a tree step at its depth
        # (cached + the bits of its own mask - 1), as a query and as a key
        place = torch.arange(k.shape[0])
        position = place.clone()
        if tree_mask is not None:
            rows = tree_mask[row : row + new].tolist()
            depth = torch.tensor([bin(bits % 2**64).count("1") for bits in rows])
            position[cached:] = cached + depth - 1
            sees = torch.tensor([[t < 64 and bool((bits >> t) & 1) for t in range(new)] for bits in rows])
        p, j = position[cached:, None], position[None, :]
        allowed = torch.ones(new, k.shape[0], dtype=torch.bool)
        if causal:  # by place in the step
            allowed &= place[None, :] <= place[cached:, None]
        if sliding_window > 0:
            allowed &= p - j < sliding_window
        if attention_chunk_size > 0:
            allowed &= p // attention_chunk_size == j // attention_chunk_size
        if tree_mask is not None:  # new token t of this sequence only where the query's bit t is set
            allowed[:, cached:] &= sees
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


def attention_fp64_and_spread(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    cache_lengths: Sequence[int],
    softmax_scale: float,
    **options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`attention_fp64`, the same attention over |V|): the exact answer and the `spread` that
    `assert_attention_within_rounding` scales the unit roundoff by."""
    exact = attention_fp64(q, keys, values, cache_lengths, softmax_scale, **options)
    spread = attention_fp64(q, keys, [v.abs() for v in values], cache_lengths, softmax_scale, **options)
    return exact, spread
