"""Decode attention bandwidth of the Triton backend vs SDPA (contiguous K/V) and FlexAttention's
paged attention, plus store_kv of one decode step (64 tokens) under a CUDA graph, and sliding-window
decode (window context / 4 + 8) with and without the first key tile masked (`MASK_FIRST_TILE`).

bf16, 32 query / 8 KV heads, head_dim 128, batch 64 x 4096 context, page sizes 1, 16, 128, pages
shuffled. Every attention row is checked against SDPA on the same K/V before it is timed, and the
store_kv row against the key/value it writes (a window row against SDPA over the window's keys,
its bytes those keys'). GB/s: `harness.decode_bytes`; "of_copy" divides by a
measured device-to-device copy (read + write).

    PYTHONPATH=. python3 benchmarks/bench_decode_gpu.py [--page-sizes 1,16,128]
        [--kernels triton,splits,sdpa,flex,store,window,window-masked]
    PYTHONPATH=. python3 benchmarks/bench_decode_gpu.py --dry-run     # tiny, on CPU (Triton interpreted)

The copy bandwidth and every row are printed as they are measured (`COPY`, `ROW` lines), then a
markdown table; writes benchmarks/results/bench_decode_gpu.{md,json}; exits 0 without CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable
from unittest import mock

import torch
from harness import (
    DecodeBench,
    DecodeInputs,
    WrongOutputError,
    decode_bytes,
    forced_backend,
    gpu_main,
    matches,
    sdpa_decode,
)

import torch_paged_kv as pk

SHAPE = dict(batch=64, context=4096, q_heads=32, kv_heads=8, head_dim=128)
DRY_SHAPE = dict(batch=2, context=48, q_heads=4, kv_heads=2, head_dim=32)
PAGE_SIZES = (1, 16, 128)
DTYPE = torch.bfloat16
KERNELS = {
    "triton": "triton paged",
    "splits": "triton paged, forced splits",
    "sdpa": "SDPA contiguous",
    "flex": "flex paged",
    "store": "store_kv, one token per sequence, CUDA graph",
    "window": "triton paged, window",
    "window-masked": "triton paged, first tile masked, window",
}
ORDER = tuple(KERNELS.values())
# "splits": Triton with the split count forced, against the plan's (ops/splits.py assumes 4 programs
# per SM; the bf16 d128 decode variant compiles to 160 registers, 3 per SM on sm_90, so the plan's
# 2 splits fill 2.6 waves at the benchmark's shape where 3 would fill 3.9)
FORCED_SPLITS = (1, 2, 3, 4, 6, 8)
STORE_TARGET_US = 10.0  # store_kv of 64 tokens under a CUDA graph


def bandwidth_target(page_size: int) -> tuple[str, Callable[[dict], bool]]:
    """Triton decode: >= 0.7 of copy bandwidth (0.5 at page 1)."""
    fraction = 0.5 if page_size == 1 else 0.7
    return f">= {fraction} of copy", lambda row: row["of_copy"] >= fraction


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


def forced_splits(splits: int) -> contextlib.AbstractContextManager:
    """Within it, Triton's decode plan takes `splits` splits (one patch per row: none in the timed calls)."""
    from torch_paged_kv.ops.triton import flash_attention as triton_flash  # (imports triton: after --dry-run's env)

    return mock.patch.object(triton_flash, "num_splits", lambda *_: splits)


def first_tile_masked(masked: bool) -> contextlib.AbstractContextManager:
    """Within it, Triton's attention masks its first key tile below the window (`MASK_FIRST_TILE`) or not."""
    from torch_paged_kv.ops.triton import flash_attention as triton_flash

    return mock.patch.object(triton_flash, "MASK_FIRST_TILE", masked)


def window_rows(
    bench: DecodeBench, x: DecodeInputs, key: torch.Tensor, value: torch.Tensor, kernels: list[str]
) -> list[dict]:
    """Sliding-window decode over a quarter of the context and 8 keys (so the first key tile is
    partly below the window), each of `kernels` ("window", "window-masked") twice, alternating,
    checked against SDPA over those keys."""
    window = x.context // 4 + 8
    expected = sdpa_decode(x.q, key[:, :, -window:], value[:, :, -window:], x.scale)
    shape = {k: v for k, v in bench.shape.items() if k != "context"}
    moved = decode_bytes(**shape, context=window)
    rows = []
    for _ in range(2):
        for name in kernels:
            with first_tile_masked(name == "window-masked"):
                run = lambda: x.paged_attention("triton", sliding_window=window)
                rows.append(
                    bench.row(
                        f"{KERNELS[name]} {window}",
                        x.collection.params.page_size,
                        run,
                        matches(expected, name),
                        moved=moved,
                    )
                )
    return rows


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


def measure(
    shape: dict[str, int], device: torch.device, page_sizes: list[int], kernels: list[str]
) -> tuple[list[dict], dict]:
    """The rows of `kernels` (keys of KERNELS) at each page size, and the setup they were measured in."""
    bench = DecodeBench(**shape, dtype=DTYPE, device=device, streaming=True, repeats=20 if device.type == "cuda" else 2)
    rows = []
    for page in page_sizes:
        x = bench.inputs(page, seed=page)
        key, value, expected = x.sdpa_reference()
        if "triton" in kernels:
            run = lambda: x.paged_attention("triton")
            rows.append(
                bench.row(KERNELS["triton"], page, run, matches(expected, "triton"), target=bandwidth_target(page))
            )
        for splits in FORCED_SPLITS if "splits" in kernels else ():
            with forced_splits(splits):
                run = lambda: x.paged_attention("triton")
                rows.append(bench.row(f"{KERNELS['splits']} {splits}", page, run, matches(expected, "splits")))
        if windowed := [name for name in ("window", "window-masked") if name in kernels]:
            rows += window_rows(bench, x, key, value, windowed)
        if "sdpa" in kernels and page == page_sizes[0]:
            rows.append(bench.sdpa_row(x, key, value, expected))
        if "flex" in kernels:
            rows.append(bench.row(KERNELS["flex"], page, lambda: flex_paged(x, key, value), matches(expected, "flex")))
        if "store" in kernels:
            new_key, new_value = torch.randn(
                2, shape["batch"], shape["kv_heads"], shape["head_dim"], device=device, dtype=DTYPE
            )
            rows.append(
                bench.row(
                    KERNELS["store"],
                    page,
                    lambda: store_kv_graph(x, new_key, new_value),
                    stored(x, new_key, new_value),
                    bandwidth=False,
                    target=(f"<= {STORE_TARGET_US:g} us", lambda row: row["us"] <= STORE_TARGET_US),
                )
            )
    rows.sort(key=lambda r: ORDER.index(r["kernel"].rstrip("0123456789 ")))
    return rows, bench.setup()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--page-sizes", default=",".join(map(str, PAGE_SIZES)))
    parser.add_argument("--kernels", default=",".join(KERNELS), help=f"a subset of {','.join(KERNELS)}")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (Triton in its interpreter)")
    args = parser.parse_args()
    kernels = args.kernels.split(",")
    if unknown := set(kernels) - set(KERNELS):
        parser.error(f"unknown kernels {sorted(unknown)}; known: {', '.join(KERNELS)}")
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
    device = torch.device("cpu" if args.dry_run else "cuda")
    shape = DRY_SHAPE if args.dry_run else SHAPE
    page_sizes = [int(p) for p in args.page_sizes.split(",")]
    return gpu_main("bench_decode_gpu", lambda: measure(shape, device, page_sizes, kernels), device)


if __name__ == "__main__":
    sys.exit(main())
