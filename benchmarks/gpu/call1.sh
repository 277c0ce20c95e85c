#!/usr/bin/env bash
# GPU call 1 of 3 (device tool: carry .kit/a, timeout_s 360; see docs/benchmarks.md, "GPU"): stages
# CuTe kit part a, reports the environment, probes each Triton kernel family, measures the copy
# bandwidth and Triton decode at page 16 against SDPA, FP8 against bf16 decode, checks PagedCache greedy tokens against
# DynamicCache, then runs the Triton GPU test files. `--dry-run`: the same on CPU, no GPU.
cd "$(dirname "$0")/../.." && exec python3 -u benchmarks/gpu/session.py call1 "$@"
