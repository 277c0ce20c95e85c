"""Host bookkeeping of KVCacheManager alone: prepare_step + commit_step of a decode loop, no model.

    python benchmarks/bench_manager.py [--batch 256] [--steps 400] [--repeats 7] [--device cpu]

Each repeat builds a fresh manager, prefills `batch` sequences of staggered lengths (untimed),
then times `steps` decode steps (one new token per sequence). Rows: the same rows every step
(the serving steady state) without and with token ids (ids let generated pages enter the prefix
cache), with prefix caching off, and with the rows in a new order every step (full table rewrite).
Reported: median wall microseconds per step over the repeats, steps/s, and median process CPU
microseconds per step (steadier than wall time on a shared machine).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from harness import report

import torch_paged_kv as pk
from torch_paged_kv.manager import KVCacheManager

CASES = {
    "same rows, no token ids": dict(tokens=False, caching=True, shuffle=False),
    "same rows, token ids": dict(tokens=True, caching=True, shuffle=False),
    "same rows, prefix caching off": dict(tokens=False, caching=False, shuffle=False),
    "rows reordered every step": dict(tokens=False, caching=True, shuffle=True),
}


def time_decode(
    batch: int, steps: int, page_size: int, device: str, tokens: bool, caching: bool, shuffle: bool
) -> tuple[float, float]:
    """Wall and process-CPU microseconds per decode step (prepare_step + commit_step), one fresh manager."""
    params = pk.KVCacheParams(torch.float16, num_layers=1, num_kv_heads=1, head_dim=8, page_size=page_size)
    max_len = 64 + page_size + steps
    collection = pk.PagedKVCacheCollection(params, batch * (max_len // page_size + 1), batch, max_len, device)
    manager = KVCacheManager(collection, enable_prefix_caching=caching)
    ids = list(range(batch))
    prompts = [[i] * (64 + i % page_size) for i in ids]  # staggered: ~batch/page_size rows grow per step
    for i, prompt in zip(ids, prompts, strict=True):
        manager.claim(i, prompt)
    manager.prepare_step(ids, [len(p) for p in prompts])
    manager.commit_step()
    orders = [ids[k:] + ids[:k] for k in range(1, steps + 1)] if shuffle else [ids] * steps
    ones = [1] * batch
    token_ids = [[7]] * batch if tokens else None
    start, cpu_start = time.perf_counter(), time.process_time()
    for order in orders:
        manager.prepare_step(order, ones, token_ids)
        manager.commit_step()
    return (time.perf_counter() - start) / steps * 1e6, (time.process_time() - cpu_start) / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    rows = []
    for name, case in CASES.items():
        runs = [time_decode(args.batch, args.steps, args.page_size, args.device, **case) for _ in range(args.repeats)]
        wall, cpu = (statistics.median(r[k] for r in runs) for k in (0, 1))
        rows.append(
            {
                "case": name,
                "batch": args.batch,
                "page_size": args.page_size,
                "device": args.device,
                "us_per_step": wall,
                "steps_per_s": 1e6 / wall,
                "cpu_us_per_step": cpu,
            }
        )
    print(report("bench_manager", rows))


if __name__ == "__main__":
    main()
