"""How much of a core's memory streaming survives its arithmetic: the ceiling on overlap that a cold
paged decode meets (CPU).

    PYTHONPATH=. python benchmarks/bench_overlap.py [--gib 1] [--chunk-kib 32] [--ratios 0.5,0.75,1,1.25]

`page_stream.cpp`'s `overlap` walks 32 KiB chunks scattered over a 1 GiB buffer on huge pages (a bf16
decode's K or V plane of one page: 16 tokens x 8 kv heads x 128 x 2 bytes) on torch's threads, three
ways: synthetic compute alone (vector FMAs on registers, an amount per chunk calibrated to take
`ratio` times the stream's time), the chunks' word sums alone, and both, overlapped as the `cpu`
kernels overlap them (the next chunk prefetched into L2 in 16 slices between parts of this chunk's
compute, then this chunk summed from L2). `both / max` is the combined time over the larger of the
two alone: 1.0 would be a perfect overlap. A kernel whose arithmetic with every page in cache
takes `ratio` of its page stream's time should not expect to beat this row's `both / max`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_cpu import page_stream_library
from harness import report

from torch_paged_kv import huge_pages

MODES = {"compute": 0, "stream": 1, "both": 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--chunk-kib", type=int, default=32)
    parser.add_argument("--ratios", default="0.5,0.75,1,1.25", help="compute time / stream time, comma separated")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    chunk = args.chunk_kib << 10
    chunks = int(args.gib * 2**30) // chunk
    data = huge_pages.zeros(chunks * chunk, dtype=torch.uint8, device=torch.device("cpu")).fill_(1)
    offsets = (torch.randperm(chunks, generator=torch.Generator().manual_seed(0)) * chunk).to(torch.int64)
    fn = page_stream_library().overlap
    threads = torch.get_num_threads()

    def ms(mode: str, fmas: int) -> float:
        def call() -> float:
            return fn(data.data_ptr(), offsets.data_ptr(), chunks, chunk, fmas, MODES[mode], threads)

        call()
        samples = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            call()
            samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples)

    stream_ms = ms("stream", 0)
    probe = 1 << 14
    per_fma_ms = ms("compute", probe) / probe
    rows = []
    for ratio in map(float, args.ratios.split(",")):
        fmas = max(16, round(ratio * stream_ms / per_fma_ms / 16) * 16)
        compute_ms, stream_ms_now, both_ms = ms("compute", fmas), ms("stream", 0), ms("both", fmas)
        rows.append(
            {
                "compute / stream": compute_ms / stream_ms_now,
                "compute ms": compute_ms,
                "stream ms": stream_ms_now,
                "stream GB/s": chunks * chunk / stream_ms_now / 1e6,
                "both ms": both_ms,
                "both / max": both_ms / max(compute_ms, stream_ms_now),
            }
        )
        print(rows[-1], flush=True)
    setup = {"buffer GiB": args.gib, "chunk KiB": args.chunk_kib, "threads": threads, "repeats": args.repeats}
    print(report("bench_overlap", rows, setup))


if __name__ == "__main__":
    main()
