"""Checkpoint throughput: save / load / verify GB/s of a few-hundred-MB paged cache.

    PYTHONPATH=. python benchmarks/bench_checkpoint.py [--size-mb 384] [--device cpu|cuda] [--repeats 3]

GB/s counts the page bytes stored (every stored page once). Anchors in the same run: writing the
same bytes to a file with fsync (the disk), and safetensors' own `save_file`/`load_file` of one
tensor holding those pages (which needs them all in host memory). Writes markdown and JSON to
benchmarks/results/ (git-ignored). Medians of `--repeats` runs after one warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from torch_paged_kv import KVCacheParams, PagedKVCacheCollection
from torch_paged_kv.checkpoint import load_cache, save_cache, verify

RESULTS = Path(__file__).resolve().parent / "results"


def make_cache(size_mb: int, device: str) -> PagedKVCacheCollection:
    """A bf16 Llama-8B-shaped cache (32 layers, 8 KV heads, head_dim 128, page 16: 2 MiB/page),
    every page in use by 8 sequences, pages shuffled, random data."""
    params = KVCacheParams(torch.bfloat16, num_layers=32, num_kv_heads=8, head_dim=128, page_size=16)
    pages = max(8, size_mb * (1 << 20) // (params.bytes_per_token * params.page_size))
    per_row = pages // 8
    c = PagedKVCacheCollection(params, num_pages=pages, max_batch_size=8,
                               max_seq_len=per_row * params.page_size, device=device)
    c.blocks.copy_(torch.randn(c.blocks.shape, dtype=torch.bfloat16, device=device))
    order = (torch.randperm(pages) + 1).to(torch.int32).reshape(8, -1)[:, :per_row]
    c.lookup_table[:, :per_row] = order.to(device)
    c.cache_lengths.fill_(per_row * params.page_size)
    return c


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], repeats: int, device: str) -> float:
    """Median seconds of `repeats` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


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
            ("anchor: safetensors load_file (+ clone on CPU)", lambda: owned(load_file(Path(tmp) / "st.safetensors",
                                                                                   device=args.device))),
        ]
        for name, fn in cases:
            seconds = timed(fn, args.repeats, args.device)
            rows.append({"op": name, "seconds": seconds, "GB/s": nbytes / seconds / 1e9})
            print(f"{name:45s} {seconds * 1e3:9.1f} ms {nbytes / seconds / 1e9:7.2f} GB/s", flush=True)

    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    result = {"device": args.device, "device_name": device_name, "cpus": os.cpu_count(), "bytes": nbytes,
              "torch": torch.__version__, "params": cache.params.to_dict(), "pages": ids.numel(), "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"checkpoint_{args.device.split(':')[0]}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2))
    lines = [f"# Checkpoint throughput ({args.device}: {device_name}, {os.cpu_count()} CPUs, torch {torch.__version__})",
             "", f"{nbytes / 2**20:.0f} MiB of bf16 pages ({ids.numel()} pages of 2 MiB, shuffled), median of "
             f"{args.repeats}.", "", "| op | ms | GB/s |", "|---|---:|---:|"]
    lines += [f"| {r['op']} | {r['seconds'] * 1e3:.1f} | {r['GB/s']:.2f} |" for r in rows]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {stem}.md and .json")


if __name__ == "__main__":
    main()
