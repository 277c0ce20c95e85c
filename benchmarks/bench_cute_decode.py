"""Decode attention bandwidth of the CuTe kernels beside Triton, SDPA on contiguous K/V and
FlashAttention-4's paged decode (`flash_attn.cute`, when importable).

bf16, 32 query / 8 KV heads, head_dim 128, batch 64 x 8192 context, page sizes 16, 64, 128.
GB/s counts K and V of every context token once, plus q and the output; "of copy" divides by a
measured device-to-device copy (read + write). Needs the CuTe DSL kit (`. /tmp/kit/env.sh`).
Run: `python benchmarks/bench_cute_decode.py`; prints markdown, writes benchmarks/results/.
Exits cleanly (status 0) without CUDA.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

import torch

BATCH, CONTEXT, Q_HEADS, KV_HEADS, HEAD_DIM = 64, 8192, 32, 8, 128
PAGE_SIZES = (16, 64, 128)
DTYPE = torch.bfloat16
SCALE = HEAD_DIM ** -0.5


def bench_us(fn) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median") * 1e3


def copy_bandwidth() -> float:
    """GB/s of a 1 GiB device-to-device copy, counting read + write."""
    src = torch.randn(2**28, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / bench_us(lambda: dst.copy_(src)) / 1e3


def moved_bytes() -> int:
    itemsize = torch.empty((), dtype=DTYPE).element_size()
    return 2 * BATCH * CONTEXT * KV_HEADS * HEAD_DIM * itemsize + 2 * BATCH * Q_HEADS * HEAD_DIM * itemsize


def paged_inputs(page_size: int) -> tuple:
    """(q, blocks, cache_lengths, lookup_table, input_row_offsets) with shuffled pages, one layer."""
    pages_per_seq = CONTEXT // page_size
    num_pages = 1 + BATCH * pages_per_seq
    blocks = torch.randn(num_pages, 2, 1, page_size, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    table = torch.zeros(BATCH, pages_per_seq + 8, dtype=torch.int32, device="cuda")
    table[:, :pages_per_seq] = (torch.randperm(num_pages - 1, device="cuda") + 1).view(BATCH, -1).int()
    q = torch.randn(BATCH, Q_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    cache_lengths = torch.full((BATCH,), CONTEXT - 1, dtype=torch.int32, device="cuda")
    offsets = torch.arange(BATCH + 1, dtype=torch.int32, device="cuda")
    return q, blocks, cache_lengths, table, offsets


def cute_paged(page_size: int) -> tuple[float, float]:
    """(µs, first-call seconds including compile) of the CuTe decode kernel."""
    from torch_paged_kv.cute.attention import flash_attention, supports
    args = (*paged_inputs(page_size), 0, SCALE)
    if not supports(*args):
        raise RuntimeError("cute does not cover this call")
    start = time.perf_counter()
    flash_attention(*args)
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    return bench_us(lambda: flash_attention(*args)), first


def triton_paged(page_size: int) -> float:
    from torch_paged_kv.ops.triton.flash_attention import flash_attention
    args = (*paged_inputs(page_size), 0, SCALE)
    return bench_us(lambda: flash_attention(*args))


def sdpa_contiguous() -> float:
    import torch.nn.functional as F
    q = torch.randn(BATCH, Q_HEADS, 1, HEAD_DIM, device="cuda", dtype=DTYPE)
    k, v = (torch.randn(BATCH, KV_HEADS, CONTEXT, HEAD_DIM, device="cuda", dtype=DTYPE) for _ in range(2))
    return bench_us(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))


def fa4_paged(page_size: int) -> float:
    """FlashAttention-4 (CuTe DSL) paged decode: K/V as `[pages, page_size, kv_heads, head_dim]`."""
    from flash_attn.cute.interface import flash_attn_varlen_func
    pages_per_seq = CONTEXT // page_size
    num_pages = BATCH * pages_per_seq
    k, v = (torch.randn(num_pages, page_size, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE) for _ in range(2))
    table = torch.randperm(num_pages, device="cuda").view(BATCH, -1).int().contiguous()
    q = torch.randn(BATCH, 1, Q_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    seqused_k = torch.full((BATCH,), CONTEXT, dtype=torch.int32, device="cuda")
    return bench_us(lambda: flash_attn_varlen_func(q, k, v, seqused_k=seqused_k, page_table=table,
                                                   softmax_scale=SCALE, causal=True, num_splits=0))


def attempt(fn, *args):
    try:
        return fn(*args)
    except Exception as exc:  # an anchor that cannot run here is reported, not fatal
        first_line = str(exc).splitlines()[0][:120] if str(exc) else ""
        return f"unavailable: {type(exc).__name__}: {first_line}"


def main() -> int:
    if not torch.cuda.is_available():
        print("bench_cute_decode: no CUDA GPU visible; nothing to measure.")
        return 0
    copy_gbs = copy_bandwidth()
    moved = moved_bytes()
    rows = []
    for page in PAGE_SIZES:
        result = attempt(cute_paged, page)
        us, first = result if isinstance(result, tuple) else (result, None)
        rows.append({"kernel": "cute paged", "page_size": page, "us": us, "first_call_s": first})
    rows += [{"kernel": "triton paged", "page_size": p, "us": attempt(triton_paged, p)} for p in PAGE_SIZES]
    rows.append({"kernel": "SDPA contiguous", "page_size": None, "us": attempt(sdpa_contiguous)})
    rows += [{"kernel": "FA4 paged", "page_size": p, "us": attempt(fa4_paged, p)} for p in PAGE_SIZES]
    for row in rows:
        if isinstance(row["us"], float):
            row["GB/s"] = moved / row["us"] / 1e3
            row["of_copy"] = row["GB/s"] / copy_gbs

    print(f"device: {torch.cuda.get_device_name()}, copy bandwidth {copy_gbs:.0f} GB/s (read+write)")
    print(f"decode bf16, batch {BATCH} x context {CONTEXT}, {Q_HEADS}/{KV_HEADS} heads, head_dim {HEAD_DIM}\n")
    print("| kernel | page size | µs | GB/s | of copy |\n|---|---|---|---|---|")
    for r in rows:
        if "GB/s" in r:
            print(f"| {r['kernel']} | {r['page_size'] or '-'} | {r['us']:.1f} | {r['GB/s']:.0f} | {r['of_copy']:.2f} |")
        else:
            print(f"| {r['kernel']} | {r['page_size'] or '-'} | {r['us']} | | |")
    firsts = [f"page {r['page_size']}: {r['first_call_s']:.1f} s" for r in rows if r.get("first_call_s")]
    if firsts:
        print("\ncute first call (compile + run): " + ", ".join(firsts))

    out_dir = pathlib.Path(__file__).parent / "results"
    out_dir.mkdir(exist_ok=True)
    path = out_dir / f"cute_decode_{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                "copy_GB/s": copy_gbs, "bytes_moved": moved, "rows": rows}, indent=2))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
