"""Decode attention bandwidth of the Triton backend vs SDPA (contiguous K/V) and FlexAttention's
paged attention, plus store_kv of one decode step under a CUDA graph.

bf16, 32 query / 8 KV heads, head_dim 128, batch 64 x 4096 context, page sizes 1, 16, 128, pages
shuffled. Every attention row is checked against SDPA on the same K/V before it is timed, and the
store_kv row against the key/value it writes. GB/s: `harness.decode_bytes`; "of_copy" divides by a
measured device-to-device copy (read + write).

    PYTHONPATH=. python benchmarks/bench_decode_gpu.py

Prints a markdown table, writes benchmarks/results/bench_decode_gpu.{md,json}; exits 0 without CUDA.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from harness import DecodeBench, DecodeInputs, WrongOutputError, forced_backend, gpu_main, matches

import torch_paged_kv as pk

BATCH, CONTEXT, Q_HEADS, KV_HEADS, HEAD_DIM = 64, 4096, 32, 8, 128
PAGE_SIZES = (1, 16, 128)
DTYPE = torch.bfloat16
DEVICE = torch.device("cuda")
KERNELS = ("triton paged", "SDPA contiguous", "flex paged", "store_kv, 64 tokens, CUDA graph")


def flex_paged(x: DecodeInputs, key: torch.Tensor, value: torch.Tensor) -> Callable[[], torch.Tensor]:
    """FlexAttention over torch's experimental PagedAttention cache holding the same K/V (pages shuffled)."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention, noop_mask

    batch, kv_heads, context, head_dim = key.shape
    page_size, device = x.collection.params.page_size, key.device
    num_pages = batch * x.pages_per_seq
    paged = PagedAttention(num_pages, page_size, batch, device=device)
    paged.empty_pages = torch.randperm(num_pages, generator=torch.Generator().manual_seed(0)).tolist()
    for b in range(batch):
        paged.reserve(torch.tensor(b, device=device), torch.tensor(context, device=device))
    k_cache = key.new_zeros(1, kv_heads, num_pages * page_size, head_dim)
    v_cache = torch.zeros_like(k_cache)
    positions = torch.arange(context, device=device).expand(batch, -1)
    paged.assign(torch.arange(batch, device=device), positions, key, value, k_cache, v_cache)
    logical = create_block_mask(noop_mask, batch, 1, 1, context, device=device, BLOCK_SIZE=page_size)
    block_mask = paged.convert_logical_block_mask(logical, kv_len=torch.full((batch,), context, device=device))
    compiled = torch.compile(flex_attention)
    q = x.q[:, :, None]  # [batch, q_heads, 1, head_dim]
    return lambda: compiled(q, k_cache, v_cache, block_mask=block_mask, scale=x.scale, enable_gqa=True)[:, :, 0]


def graphed(fn: Callable[[], None]) -> Callable[[], None]:
    """`fn` captured in a CUDA graph; returns the replay."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def store_kv_graph(x: DecodeInputs, key: torch.Tensor, value: torch.Tensor) -> Callable[[], None]:
    """Replay of a CUDA graph of store_kv of one new token per sequence (`key`/`value [batch, kv_heads, d]`)."""
    args = (key, value, x.collection.blocks, *x.step, 0)

    def store() -> None:
        with forced_backend("triton"):
            pk.store_kv(*args)

    store()  # compile outside the capture
    replay = graphed(store)
    x.collection.blocks.zero_()  # so the checked first replay must write the rows itself
    return replay


def stored(x: DecodeInputs, key: torch.Tensor, value: torch.Tensor) -> Callable[[object], None]:
    """A `DecodeBench.row` check: the last cached token of every sequence is `key`/`value`."""

    def check(_: object) -> None:
        k, v = x.contiguous_kv()
        if not (torch.equal(k[:, :, -1], key) and torch.equal(v[:, :, -1], value)):
            raise WrongOutputError("store_kv: the replayed graph did not write this step's K/V")

    return check


def measure() -> tuple[list[dict], dict]:
    """All rows, and the setup they were measured in."""
    bench = DecodeBench(BATCH, CONTEXT, Q_HEADS, KV_HEADS, HEAD_DIM, DTYPE, DEVICE)
    rows = []
    for page in PAGE_SIZES:
        x = bench.inputs(page, seed=page)
        key, value, expected = x.sdpa_reference()
        rows.append(bench.row("triton paged", page, lambda: x.paged_attention("triton"), matches(expected, "triton")))
        if page == PAGE_SIZES[0]:
            rows.append(bench.sdpa_row(x, key, value, expected))
        rows.append(bench.row("flex paged", page, lambda: flex_paged(x, key, value), matches(expected, "flex")))
        new_key, new_value = torch.randn(2, BATCH, KV_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
        rows.append(
            bench.row(
                KERNELS[-1],
                page,
                lambda: store_kv_graph(x, new_key, new_value),
                stored(x, new_key, new_value),
                bandwidth=False,
            )
        )
    rows.sort(key=lambda r: KERNELS.index(r["kernel"]))
    return rows, bench.setup()


if __name__ == "__main__":
    sys.exit(gpu_main("bench_decode_gpu", measure))
