"""Checkpoint throughput: save / load / verify GB/s of a few-hundred-MB paged cache.

    PYTHONPATH=. python benchmarks/bench_checkpoint.py [--size-mb 384] [--device cpu|cuda] [--repeats 3]

GB/s counts the page bytes stored (every stored page once). Anchors in the same run: writing the
same bytes to a file with fsync (the disk), and safetensors' own `save_file`/`load_file` of one
tensor holding those pages (which needs them all in host memory). Writes
benchmarks/results/checkpoint_<device>.{md,json} (git-ignored). Medians of `--repeats` runs after one warm-up.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from harness import report, time_ms
from safetensors.torch import load_file, save_file

from torch_paged_kv import KVCacheParams, PagedKVCacheCollection
from torch_paged_kv.checkpoint import load_cache, save_cache, verify


def make_cache(size_mb: int, device: str) -> PagedKVCacheCollection:
    """A bf16 Llama-8B-shaped cache (32 layers, 8 KV heads, head_dim 128, page 16: 2 MiB/page),
    every page in use by 8 sequences, pages shuffled, random data."""
    params = KVCacheParams(torch.bfloat16, num_layers=32, num_kv_heads=8, head_dim=128, page_size=16)
    pages = max(8, size_mb * (1 << 20) // (params.bytes_per_token * params.page_size))
    per_row = pages // 8
    c = PagedKVCacheCollection(
        params, num_pages=pages, max_batch_size=8, max_seq_len=per_row * params.page_size, device=device
    )
    c.blocks.copy_(torch.randn(c.blocks.shape, dtype=torch.bfloat16, device=device))
    order = (torch.randperm(pages)[: 8 * per_row] + 1).to(torch.int32).view(8, per_row)
    c.lookup_table[:, :per_row] = order.to(device)
    c.cache_lengths.fill_(per_row * params.page_size)
    return c


def raw_write(path: Path, data: memoryview) -> None:
    """Write a new file (a fresh file costs block allocation, as an atomic save does) and fsync."""
    path.unlink(missing_ok=True)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def st_save(stored: torch.Tensor, directory: Path) -> None:
    (directory / "st.safetensors").unlink(missing_ok=True)
    save_file({"blocks": stored}, directory / "st.safetensors")


def owned(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU `load_file` maps the file lazily: copy, so every byte is read as `load_cache` does."""
    return {k: v.clone() if v.device.type == "cpu" else v for k, v in tensors.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=384)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write the files (default: a temp dir)")
    args = parser.parse_args()

    cache = make_cache(args.size_mb, args.device)
    ids = cache.lookup_table[:, : cache.max_pages_per_sequence].reshape(-1).long()
    stored = cache.blocks[ids.cpu()] if args.device == "cpu" else cache.blocks[ids].cpu()
    nbytes = stored.numel() * stored.element_size()
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "kv.safetensors"
        flat = memoryview(stored.view(-1).view(torch.uint8).numpy())
        cases: list[tuple[str, Callable[[], object]]] = [
            ("save_cache", lambda: save_cache(cache, path, progress=False)),
            ("load_cache", lambda: load_cache(path, device=args.device, progress=False)),
            ("verify", lambda: verify(path, progress=False)),
            ("anchor: raw write + fsync", lambda: raw_write(Path(tmp) / "raw.bin", flat)),
            ("anchor: safetensors save_file (host tensor, no fsync)", lambda: st_save(stored, Path(tmp))),
            (
                "anchor: safetensors load_file (+ clone on CPU)",
                lambda: owned(load_file(Path(tmp) / "st.safetensors", device=args.device)),
            ),
        ]
        for name, fn in cases:
            ms = time_ms(fn, warmup=1, repeats=args.repeats)
            rows.append({"op": name, "ms": ms, "GB/s": nbytes / ms / 1e6})
            print(f"{name:45s} {ms:9.1f} ms {nbytes / ms / 1e6:7.2f} GB/s", flush=True)

    setup = {
        "device": args.device,
        "cpus": os.cpu_count(),
        "bytes": nbytes,
        "pages": ids.numel(),
        "layout": "bf16 pages of 2 MiB, shuffled",
        "repeats": args.repeats,
        "params": cache.params.to_dict(),
    }
    print(report(f"checkpoint_{args.device.split(':')[0]}", rows, setup))


if __name__ == "__main__":
    main()
