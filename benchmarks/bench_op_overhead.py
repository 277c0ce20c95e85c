"""Per-call cost of the ops at a tiny decode step, and of each part of a call (CPU, one thread).

    PYTHONPATH=. python benchmarks/bench_op_overhead.py [--repeats 5] [--calls 2000]

The shape is the tiny model's (bench_hf.py defaults): batch 4, 8 q / 2 kv heads, head_dim 32,
about 30 cached tokens, page 16, fp32. Rows: each op through `torch.ops.paged_kv` (checked and
`.unchecked`) on the `cpu` and the `reference` backends, and checked without the dispatcher (the
op's implementation called directly, as `StepPlan`'s first eager layer does); then the parts of a
call: the shape checks, the value checks, `dispatch.select`, and the backend's kernel called
directly. `us` is the best of `--repeats` loops of `--calls` calls; `aten ops` counts the torch
operators one call runs (a `TorchDispatchMode` around the op's Python implementation).
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from harness import forced_backend, report
from torch.utils._python_dispatch import TorchDispatchMode

import torch_paged_kv  # noqa: F401  (registers the ops)
from torch_paged_kv.ops import dispatch, library, reference, shape_checks, validate
from torch_paged_kv.ops.cpu import kernels
from torch_paged_kv.ops.records import RECORDS
from torch_paged_kv.testing import make_paged_batch


class CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def aten_ops(fn: Callable[[], Any]) -> int:
    with CountOps() as mode:
        fn()
    return mode.count


def best_us(fn: Callable[[], Any], calls: int, repeats: int) -> float:
    for _ in range(min(calls, 200)):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("TORCH_PAGED_KV_VALIDATE", "full")
    b = make_paged_batch(
        [30, 28, 31, 25], [1, 1, 1, 1], page_size=16, num_kv_heads=2, head_dim=32, group=4, num_layers=4, layer_idx=1
    )
    attn = (b.q, b.blocks, *b.step, b.layer_idx, 32**-0.5, True, -1, 0.0)
    store = (b.new_keys, b.new_values, b.blocks, *b.step, b.layer_idx)
    ops = torch.ops.paged_kv
    rows = []

    def row(what: str, backend: str, fn: Callable[[], Any], count: Callable[[], Any] | None = None) -> None:
        with forced_backend(backend):
            us = best_us(fn, args.calls, args.repeats)
            n = aten_ops(count) if count is not None else None
        rows.append({"what": what, "backend": backend, "us": us, "aten ops": n})

    def without_dispatcher(op: str, op_args: tuple, value_checks: bool = True) -> Callable[[], Any]:
        """The op's implementation called directly (what `StepPlan`'s first eager layer does)."""

        def call() -> Any:
            record = RECORDS[op](*op_args)
            return library.checked_kernel(op, record, value_checks)(record)

        return call

    for backend in ("cpu", "reference"):
        for op, op_args in (("store_kv", store), ("flash_attention", attn)):
            overloads = getattr(ops, op)
            row(op, backend, functools.partial(overloads.default, *op_args), without_dispatcher(op, op_args))
            row(
                f"{op}.unchecked",
                backend,
                functools.partial(overloads.unchecked, *op_args),
                without_dispatcher(op, op_args, value_checks=False),
            )
            row(f"{op}, no dispatcher", backend, without_dispatcher(op, op_args))
    records = {"store_kv": RECORDS["store_kv"](*store), "flash_attention": RECORDS["flash_attention"](*attn)}
    row("  shape checks, store_kv", "-", lambda: shape_checks.check_store_kv_meta(records["store_kv"]))
    attention = records["flash_attention"]
    row("  shape checks, flash_attention", "-", lambda: shape_checks.check_flash_attention_meta(attention))
    row("  value checks, store_kv", "-", lambda: validate.check_store_kv_data(store[0], b.blocks, *b.step))
    row("  value checks, flash_attention", "-", lambda: validate.check_read_data(b.blocks, *b.step, b.q.shape[0]))
    attn_record = records["flash_attention"]
    row("  dispatch.select", "cpu", lambda: dispatch.select("flash_attention", b.blocks.device, attn_record))
    for op in ("store_kv", "flash_attention"):
        call = functools.partial(getattr(kernels, op), records[op])  # the cpu kernels take the op's record
        row(f"  kernel: {op}", "cpu", call, call)
    for op, op_args in (("store_kv", store), ("flash_attention", attn)):
        call = functools.partial(getattr(reference, op), *op_args)
        row(f"  kernel: {op}", "reference", call, call)
    setup = {"shape": "batch 4, 8 q / 2 kv heads, head_dim 32, ~30 cached tokens, page 16, fp32", "threads": 1}
    print(report("bench_op_overhead", rows, setup))


if __name__ == "__main__":
    main()
