"""Paged decode attention vs SDPA on the same K/V already contiguous (the no-paging bound).

    python benchmarks/bench_decode.py [--device cuda] [--batch 8] [--context 2048]

Rows: each backend that can run on the device, and SDPA; `vs_sdpa` is time / SDPA time.
Bytes counted: K and V of every cached token read once, q read and out written once.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

import torch_paged_kv as pk
from harness import report, time_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-sizes", default="16")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.init()
    gen = torch.Generator().manual_seed(0)
    rows = []
    backends = ["reference"] + (["triton"] if device.type == "cuda" else [])
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for page_size in map(int, args.page_sizes.split(",")):
            rows += _compare(args, device, dtype, page_size, backends, gen)
    print(report("bench_decode", rows))


def _compare(args, device, dtype, page_size, backends, gen) -> list[dict]:
    batch, context, head_dim = args.batch, args.context, args.head_dim
    pages_per_seq = -(-context // page_size)
    params = pk.KVCacheParams(dtype, 1, args.kv_heads, head_dim, page_size)
    collection = pk.PagedKVCacheCollection(params, batch * pages_per_seq, batch, context, device)
    collection.blocks.copy_(torch.randn(collection.blocks.shape, generator=gen).to(dtype))
    pages = torch.randperm(batch * pages_per_seq, generator=gen) + 1
    collection.lookup_table[:, :pages_per_seq] = pages.view(batch, pages_per_seq).int().to(device)
    step = collection.step_tensors(batch)
    step.cache_lengths.fill_(context - 1)
    step.input_row_offsets.copy_(torch.arange(batch + 1, dtype=torch.int32))
    q = torch.randn(batch, args.q_heads, head_dim, generator=gen).to(dtype).to(device)
    key, value = pk.gather_kv(collection.blocks, *step, 0, context)
    key, value = key.transpose(1, 2).contiguous(), value.transpose(1, 2).contiguous()
    scale = head_dim ** -0.5

    def sdpa():
        return F.scaled_dot_product_attention(q[:, :, None], key, value, scale=scale, enable_gqa=True)

    nbytes = 2 * key.numel() * key.element_size() + 2 * q.numel() * q.element_size()
    sdpa_ms = time_ms(sdpa)
    rows = [dict(kernel="sdpa (contiguous)", dtype=str(dtype)[6:], page_size="-", batch=batch, context=context,
                 ms=sdpa_ms, GBps=nbytes / sdpa_ms / 1e6, vs_sdpa=1.0)]
    for backend in backends:
        os.environ["TORCH_PAGED_KV_BACKEND"] = backend
        try:
            def paged():
                return pk.flash_attention(q, collection.blocks, *step, 0, scale)
            out = paged()
            torch.testing.assert_close(out, sdpa()[:, :, 0], atol=2e-2, rtol=2e-2)  # same K/V, same answer
            ms = time_ms(paged)
        finally:
            del os.environ["TORCH_PAGED_KV_BACKEND"]
        rows.append(dict(kernel=f"paged {backend}", dtype=str(dtype)[6:], page_size=page_size, batch=batch,
                         context=context, ms=ms, GBps=nbytes / ms / 1e6, vs_sdpa=ms / sdpa_ms))
    return rows


if __name__ == "__main__":
    main()
