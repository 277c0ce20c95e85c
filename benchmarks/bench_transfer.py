"""Page transfer between two processes over gloo (loopback), and the per-step cost of TP bookkeeping.

    python benchmarks/bench_transfer.py [--size-mb 256] [--chunk-mb 16,64] [--repeats 5]
                                        [--tp-batch 64] [--tp-steps 300]

Transfer: rank 0 holds sequences whose pages are scattered over its pool (a Llama-8B-shaped bf16
cache: 32 layers x 8 KV heads x 128, page 16 = 2 MiB per page); `send_sequences` ships them to rank
1's pool (scattered free pages too), with lengths, token ids, keys and checksums (`--checksum`).
2 MiB pages go direct (each page its own message, no packing); the "packed" rows make the receiver
choose the packed path (pages gathered into chunk messages), for comparison. The
anchor is a raw `torch.distributed.send` of one contiguous tensor of the same bytes between the same
processes (and in messages of the chunk size). All are timed on the receiver, from a barrier to
the last byte placed (the transfer also waits for the receiver's confirmation), interleaved
repeat by repeat so that a shared machine's load hits every case alike; "of raw send" is the median
over repeats of (raw one-message time / this time). The first transfer's pages are compared with the
sender's (regenerated from the seed) before anything is timed.

TP bookkeeping: two ranks decode `--tp-batch` sequences one token per step with
`TensorParallelKVCacheManager` (a digest all-reduce per step over gloo) and with a plain
`KVCacheManager`, `--tp-model-ms` of sleep standing in for the model between prepare_step and
commit_step; the difference is the per-step cost of keeping the ranks in lockstep.
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from harness import report

import torch_paged_kv as pk
from torch_paged_kv.distributed import receive_sequences, send_sequences
from torch_paged_kv.distributed import transfer as transfer_module
from torch_paged_kv.distributed.tensor_parallel import TensorParallelKVCacheManager, shard_params, tp_shard

DIRECT_MIN = transfer_module.DIRECT_MIN_MESSAGE_BYTES
PARAMS = pk.KVCacheParams(torch.bfloat16, num_layers=32, num_kv_heads=8, head_dim=128, page_size=16)


def scattered_manager(num_pages: int, seed: int) -> pk.KVCacheManager:
    """A manager whose free list is shuffled, so the pages a transfer uses are scattered. Each rank
    has its own salt: the receiver keys the pages itself and never finds them in its cache (a
    repeated transfer would otherwise send nothing)."""
    c = pk.PagedKVCacheCollection(PARAMS, num_pages, num_pages, PARAMS.page_size * num_pages)
    m = pk.KVCacheManager(c, hash_salt=bytes([seed]))
    ids = list(range(num_pages))
    for i in ids:
        m.claim(i)
    m.prepare_step(ids, [1] * num_pages)
    m.commit_step()
    random.Random(seed).shuffle(ids)
    for i in ids:
        m.release(i)
    return m


def sender_pages(num_pages: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    pages = torch.empty((num_pages, *PARAMS_SHAPE), dtype=torch.int16)
    return pages.random_(generator=gen).view(torch.bfloat16)


PARAMS_SHAPE = (2, PARAMS.num_layers, PARAMS.page_size, PARAMS.num_kv_heads, PARAMS.head_dim)


def transfer_worker(rank: int, args: argparse.Namespace, init_file: str, results) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=300)
    )
    page_bytes = PARAMS.page_size * PARAMS.bytes_per_token
    num_pages = max(8, (args.size_mb << 20) // page_bytes)  # at least a page per sequence
    manager = scattered_manager(num_pages + 8, seed=rank)
    lengths = [num_pages * PARAMS.page_size // 8] * 7
    lengths.append(num_pages * PARAMS.page_size - sum(lengths))  # 8 sequences, every page full
    ids = [f"seq{i}" for i in range(8)]
    rows: list[dict] = []
    if rank == 0:
        for k, (i, n) in enumerate(zip(ids, lengths, strict=True)):
            manager.claim(i, [k * 100_000 + t for t in range(n)])
        manager.prepare_step(ids, lengths)
        manager.commit_step()
        used = torch.tensor([p for i in ids for p in manager.pages(i)], dtype=torch.long)
        manager.collection.blocks[used] = sender_pages(num_pages, seed=7)
    expected = sender_pages(num_pages, seed=7) if rank == 1 else None
    raw = torch.empty(num_pages * page_bytes, dtype=torch.uint8)

    def transfer(chunk_mb: int, check: bool, direct: bool = True) -> None:
        if rank == 0:
            send_sequences(manager, ids, 1, chunk_bytes=chunk_mb << 20, checksum=args.checksum)
            return
        transfer_module.DIRECT_MIN_MESSAGE_BYTES = DIRECT_MIN if direct else 1 << 62  # the receiver chooses
        stats = receive_sequences(manager, 0)
        if check:
            got = torch.stack([manager.collection.blocks[p] for i in ids for p in manager.pages(i)])
            assert torch.equal(got.view(torch.int16), expected.view(torch.int16)), "WRONG: pages differ"
            assert stats.pages_sent == num_pages
        for i in ids:
            manager.release(i)

    def raw_send(chunk_mb: int | None) -> None:
        step = raw.numel() if chunk_mb is None else chunk_mb << 20
        for a in range(0, raw.numel(), step):
            (dist.send if rank == 0 else dist.recv)(raw[a : a + step], 1 - rank)

    cases = {"raw send, one message": lambda check: raw_send(None)}
    for mb in args.chunk_mb:
        cases[f"raw send, {mb} MiB messages"] = lambda check, mb=mb: raw_send(mb)
    for mb in args.chunk_mb:
        cases[f"send_sequences, {mb} MiB chunks"] = lambda check, mb=mb: transfer(mb, check)
        cases[f"send_sequences, {mb} MiB chunks, packed"] = lambda check, mb=mb: transfer(mb, check, direct=False)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for rep in range(args.repeats + 1):  # interleaved, so that the machine's load hits every case alike
        for name, run in cases.items():
            dist.barrier()
            start = time.perf_counter()
            run(rep == 0)  # the first run is checked, and not timed
            times[name].append(time.perf_counter() - start)
    if rank == 1:
        anchor = times["raw send, one message"][1:]
        for name, ts in times.items():
            ts = ts[1:]
            ratios = [a / t for a, t in zip(anchor, ts, strict=True)]
            rows.append(
                {
                    "what": name,
                    "MiB": num_pages * page_bytes / 2**20,
                    "seconds": statistics.median(ts),
                    "GB/s": num_pages * page_bytes / statistics.median(ts) / 1e9,
                    "of raw send": statistics.median(ratios),
                }
            )
        results.put(rows)
    tp_rows = tp_bookkeeping(rank, args)
    if rank == 0:
        results.put(tp_rows)
    dist.barrier()
    dist.destroy_process_group()


def tp_bookkeeping(rank: int, args: argparse.Namespace) -> list[dict]:
    """Median microseconds per decode step (prepare_step, `--tp-model-ms` of simulated model time,
    commit_step) of a plain manager and of TP managers checked every step, and the overhead over
    the plain one; then the digest and a blocking `verify` alone."""
    full = pk.KVCacheParams(torch.float16, num_layers=1, num_kv_heads=2, head_dim=8, page_size=16)
    params, shard = shard_params(full, 2, rank), tp_shard(full, 2, rank)
    model_s = args.tp_model_ms / 1e3
    rows = []
    for name, make in [
        ("KVCacheManager (no TP)", lambda c: pk.KVCacheManager(c)),
        (
            "TensorParallelKVCacheManager (check overlapped with the model)",
            lambda c: TensorParallelKVCacheManager(c, tp_shard=shard),
        ),
        (
            "TensorParallelKVCacheManager, overlap=False",
            lambda c: TensorParallelKVCacheManager(c, tp_shard=shard, overlap=False),
        ),
    ]:
        per_step = []
        for _ in range(args.repeats):
            batch, max_len = args.tp_batch, 64 + 16 + args.tp_steps
            c = pk.PagedKVCacheCollection(params, batch * (max_len // 16 + 1), batch, max_len)
            m = make(c)
            ids = list(range(batch))
            for i in ids:
                m.claim(i, [i] * (64 + i % 16))
            m.prepare_step(ids, [64 + i % 16 for i in ids])
            m.commit_step()
            ones, tokens = [1] * batch, [[7]] * batch
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.tp_steps):
                m.prepare_step(ids, ones, tokens)
                if model_s:
                    time.sleep(model_s)
                m.commit_step()
            per_step.append((time.perf_counter() - start) / args.tp_steps * 1e6)
        rows.append({"what": name, "batch": args.tp_batch, "us_per_step": statistics.median(per_step)})
    for row in rows:
        row["overhead_us"] = row["us_per_step"] - rows[0]["us_per_step"]
    m = TensorParallelKVCacheManager(pk.PagedKVCacheCollection(params, 64, 8, 64), tp_shard=shard)
    m.claim(0)
    m.prepare_step([0], [1])
    for label, fn in [("digest alone", m.digest), ("verify (digest + blocking all-reduce)", m.verify)]:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.tp_steps):
            fn()
        rows.append({"what": label, "batch": 1, "us_per_step": (time.perf_counter() - start) / args.tp_steps * 1e6})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--chunk-mb", type=lambda s: [int(x) for x in s.split(",")], default=[16, 64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tp-batch", type=int, default=64)
    parser.add_argument("--tp-steps", type=int, default=300)
    parser.add_argument("--tp-model-ms", type=float, default=2.0, help="simulated model time per step")
    parser.add_argument("--checksum", choices=["sum64", "crc32"], default="sum64")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            transfer_worker, args=(args, os.path.join(tmp, "rendezvous"), results), nprocs=2, start_method="spawn"
        )
    transfer_rows, tp_rows = results.get(), results.get()
    setup = {"params": str(PARAMS), "page MiB": PARAMS.page_size * PARAMS.bytes_per_token / 2**20, "backend": "gloo"}
    print(report("bench_transfer", transfer_rows, setup))
    print()
    tp_setup = {"ranks": 2, "backend": "gloo", "steps": args.tp_steps, "model ms": args.tp_model_ms}
    print(report("bench_tp_bookkeeping", tp_rows, tp_setup))


if __name__ == "__main__":
    main()
