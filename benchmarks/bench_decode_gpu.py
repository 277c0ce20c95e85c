"""Decode attention bandwidth of the Triton backend vs SDPA (contiguous K/V) and FlexAttention's
paged attention, plus store_kv of one decode step under a CUDA graph.

bf16, 32 query / 8 KV heads, head_dim 128, batch 64 x 4096 context, page sizes 1, 16, 128.
Run: `python benchmarks/bench_decode_gpu.py`; prints a markdown table, writes benchmarks/results/.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

import torch

BATCH, CONTEXT, Q_HEADS, KV_HEADS, HEAD_DIM = 64, 4096, 32, 8, 128
PAGE_SIZES = (1, 16, 128)
DTYPE = torch.bfloat16


def bench_us(fn) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median") * 1e3


def copy_bandwidth() -> float:
    """GB/s of a 1 GiB device-to-device copy, counting read + write."""
    src = torch.randn(2**28, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / bench_us(lambda: dst.copy_(src)) / 1e3


def decode_inputs(page_size: int) -> dict:
    pages_per_seq = CONTEXT // page_size
    num_pages = 1 + BATCH * pages_per_seq
    blocks = torch.randn(num_pages, 2, 1, page_size, KV_HEADS, HEAD_DIM, device="cuda").to(DTYPE)
    width = pages_per_seq + 8
    table = torch.zeros(BATCH, width, dtype=torch.int32, device="cuda")
    table[:, :pages_per_seq] = (torch.randperm(num_pages - 1, device="cuda") + 1).view(BATCH, -1).int()
    return dict(
        q=torch.randn(BATCH, Q_HEADS, HEAD_DIM, device="cuda").to(DTYPE), blocks=blocks,
        cache_lengths=torch.full((BATCH,), CONTEXT - 1, dtype=torch.int32, device="cuda"),
        lookup_table=table, input_row_offsets=torch.arange(BATCH + 1, dtype=torch.int32, device="cuda"),
    )


def attention_bytes() -> int:
    itemsize = torch.empty((), dtype=DTYPE).element_size()
    kv = 2 * BATCH * CONTEXT * KV_HEADS * HEAD_DIM * itemsize
    return kv + 2 * BATCH * Q_HEADS * HEAD_DIM * itemsize  # + q read + out write


def paged_triton(page_size: int) -> float:
    from torch_paged_kv import ops
    x = decode_inputs(page_size)
    args = (x["q"], x["blocks"], x["cache_lengths"], x["lookup_table"], x["input_row_offsets"], 0, HEAD_DIM ** -0.5)
    return bench_us(lambda: ops.flash_attention(*args))


def sdpa_contiguous() -> float:
    import torch.nn.functional as F
    q = torch.randn(BATCH, Q_HEADS, 1, HEAD_DIM, device="cuda").to(DTYPE)
    k, v = (torch.randn(BATCH, KV_HEADS, CONTEXT, HEAD_DIM, device="cuda").to(DTYPE) for _ in range(2))
    return bench_us(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))


def flex_paged(page_size: int) -> float:
    """FlexAttention over a paged cache (torch's experimental PagedAttention helper)."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    pages_per_seq = CONTEXT // page_size
    paged = PagedAttention(BATCH * pages_per_seq, page_size, BATCH, device="cuda")
    k_cache = torch.zeros(1, KV_HEADS, BATCH * pages_per_seq * page_size, HEAD_DIM, device="cuda", dtype=DTYPE)
    v_cache = torch.zeros_like(k_cache)
    batch_idx = torch.arange(BATCH, device="cuda")
    paged.reserve(batch_idx, torch.full((BATCH,), CONTEXT, device="cuda"))
    k, v = (torch.randn(BATCH, KV_HEADS, CONTEXT, HEAD_DIM, device="cuda").to(DTYPE) for _ in range(2))
    paged.assign(batch_idx, torch.arange(CONTEXT, device="cuda").expand(BATCH, -1), k, v, k_cache, v_cache)
    logical = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx >= 0, BATCH, 1, 1, CONTEXT, device="cuda",
                                BLOCK_SIZE=(1, page_size) if page_size >= 128 else 128)
    block_mask = paged.convert_logical_block_mask(logical)
    q = torch.randn(1, Q_HEADS, BATCH, HEAD_DIM, device="cuda").to(DTYPE)
    compiled = torch.compile(flex_attention)
    return bench_us(lambda: compiled(q, k_cache, v_cache, block_mask=block_mask, enable_gqa=True))


def store_kv_graph_us(page_size: int) -> float:
    from torch_paged_kv import ops
    x = decode_inputs(page_size)
    key, value = (torch.randn(BATCH, KV_HEADS, HEAD_DIM, device="cuda").to(DTYPE) for _ in range(2))
    args = (key, value, x["blocks"], x["cache_lengths"], x["lookup_table"], x["input_row_offsets"], 0)
    ops.store_kv(*args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.store_kv(*args)
    return bench_us(graph.replay)


def attempt(fn, *args) -> float | str:
    try:
        return fn(*args)
    except Exception as exc:  # an anchor that cannot run here is reported, not fatal
        return f"unavailable: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"


def main() -> int:
    if not torch.cuda.is_available():
        print("bench_decode_gpu: no CUDA GPU visible; nothing to measure.")
        return 0
    os.environ.setdefault("TORCH_PAGED_KV_BACKEND", "triton")
    copy_gbs = copy_bandwidth()
    moved = attention_bytes()
    rows = []
    for name, fn, arg in ([("triton paged", paged_triton, p) for p in PAGE_SIZES]
                          + [("SDPA contiguous", sdpa_contiguous, None)]
                          + [("flex paged", flex_paged, p) for p in PAGE_SIZES]):
        us = attempt(fn, *(() if arg is None else (arg,)))
        row = {"kernel": name, "page_size": arg, "us": us}
        if isinstance(us, float):
            row["GB/s"] = moved / us / 1e3
            row["of_copy"] = row["GB/s"] / copy_gbs
        rows.append(row)
    store = {p: attempt(store_kv_graph_us, p) for p in PAGE_SIZES}

    print(f"device: {torch.cuda.get_device_name()}, copy bandwidth {copy_gbs:.0f} GB/s (read+write)")
    print(f"decode bf16, batch {BATCH} x context {CONTEXT}, {Q_HEADS}/{KV_HEADS} heads, head_dim {HEAD_DIM}\n")
    print("| kernel | page size | µs | GB/s | of copy |\n|---|---|---|---|---|")
    for r in rows:
        if "GB/s" in r:
            print(f"| {r['kernel']} | {r['page_size'] or '-'} | {r['us']:.1f} | {r['GB/s']:.0f} | {r['of_copy']:.2f} |")
        else:
            print(f"| {r['kernel']} | {r['page_size'] or '-'} | {r['us']} | | |")
    print("\n| store_kv, 64 decode tokens, CUDA graph | " + " | ".join(
        f"page {p}: {v:.1f} µs" if isinstance(v, float) else f"page {p}: {v}" for p, v in store.items()) + " |")

    out_dir = pathlib.Path(__file__).parent / "results"
    out_dir.mkdir(exist_ok=True)
    path = out_dir / f"decode_{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_GB/s": copy_gbs,
                                "bytes_moved": moved, "attention": rows, "store_kv_graph_us": store}, indent=2))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
