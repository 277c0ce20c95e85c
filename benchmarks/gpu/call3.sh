#!/usr/bin/env bash
# GPU call 3 of 3, issued right after call 2 where the visit's time allows (device tool: no carry,
# timeout_s 360; see docs/benchmarks.md, "GPU"): the MLA, variant and CUDA-path test files, MLA
# decode tiles and FP8 read paths timed, compiled PagedCache generation against StaticCache, then
# sliding-window decode with and without the first key tile masked.
# `--dry-run`: the same on CPU, no GPU.
cd "$(dirname "$0")/../.." && exec python3 -u benchmarks/gpu/session.py call3 "$@"
