#!/usr/bin/env bash
# GPU call 2 of 3, issued right after call 1 (device tool: carry .kit/b, timeout_s 330; see
# docs/benchmarks.md, "GPU"): installs the CuTe kit (part a must still be on the machine), probes
# one CuTe decode for a hang, runs the bf16 and float16 CuTe tests and measures CuTe decode GB/s at
# pages 16, 64 and 128 (benchmarks/gpu/profile_cute_decode.py, the Nsight Compute profile, runs alone).
# `--dry-run`: the same on CPU, no GPU.
cd "$(dirname "$0")/../.." && exec python3 -u benchmarks/gpu/session.py call2 "$@"
