#!/usr/bin/env bash
# GPU call 2 of 3, issued right after call 1 (device tool: carry .kit/b, timeout_s 330; see
# docs/benchmarks.md, "GPU"): installs the CuTe kit (part a must still be on the machine), probes
# one CuTe decode for a hang, runs the bf16 CuTe tests, measures CuTe decode GB/s at page 64 and
# profiles one CuTe decode kernel with Nsight Compute.
# `--dry-run`: the same on CPU, no GPU.
cd "$(dirname "$0")/../.." && exec python3 -u benchmarks/gpu/session.py call2 "$@"
