"""Paged decode attention vs SDPA on the same K/V already contiguous (the no-paging bound).

    PYTHONPATH=. python benchmarks/bench_decode.py [--device cuda] [--batch 8] [--context 2048]

Rows: SDPA, then each backend that can run on the device (cpu and reference; reference and Triton on
CUDA), each checked against SDPA before it is timed; `vs_sdpa` is time / SDPA time. Bytes:
`harness.decode_bytes`. The fuller CPU comparison (FlexAttention, vLLM, prefill) is bench_cpu.py.
"""

from __future__ import annotations

import argparse

import torch
from harness import check_close, decode_bytes, median_us, paged_decode_inputs, report, sdpa_decode


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
    backends = ["reference", "triton"] if device.type == "cuda" else ["cpu", "reference"]
    rows = []
    for dtype_name in args.dtypes.split(","):
        for page_size in map(int, args.page_sizes.split(",")):
            rows += compare(args, device, getattr(torch, dtype_name), page_size, backends)
    print(report("bench_decode", rows))


def compare(
    args: argparse.Namespace, device: torch.device, dtype: torch.dtype, page_size: int, backends: list[str]
) -> list[dict]:
    """SDPA on contiguous K/V, then each paged backend on the same K/V."""
    x = paged_decode_inputs(
        args.batch, args.context, args.q_heads, args.kv_heads, args.head_dim, page_size, dtype, device
    )
    key, value, expected = x.sdpa_reference()
    nbytes = decode_bytes(args.batch, args.context, args.q_heads, args.kv_heads, args.head_dim, dtype)
    dtype_name = str(dtype).removeprefix("torch.")

    def row(kernel: str, page: int | str, ms: float) -> dict:
        return dict(
            kernel=kernel,
            dtype=dtype_name,
            page_size=page,
            batch=args.batch,
            context=args.context,
            ms=ms,
            GBps=nbytes / ms / 1e6,
            vs_sdpa=ms / sdpa_ms,
        )

    sdpa_ms = median_us(lambda: sdpa_decode(x.q, key, value, x.scale), device) / 1e3
    rows = [row("sdpa (contiguous)", "-", sdpa_ms)]
    for backend in backends:
        paged = x.paged_attention(backend)
        check_close(paged(), expected, f"paged {backend}")
        rows.append(row(f"paged {backend}", page_size, median_us(paged, device) / 1e3))
    return rows


if __name__ == "__main__":
    main()
