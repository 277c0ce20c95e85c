#!/usr/bin/env bash
# One GPU session's checks and benchmarks, in stages that cannot take each other down: each runs in
# its own process under a time limit (a hung kernel or a poisoned CUDA context ends that stage
# only), its output goes to LOGS/<stage>.log, and a summary table comes last.
#
#   bash benchmarks/gpu_session.sh [STAGE ...]     # default: every stage, in this order
#
# Stages: env paths triton cute examples bench-triton bench-cute bench-mla bench-fp8 bench-hf. LOGS is $OUT when set
# (the device tool brings it back), else gpu_logs/. Per-stage limit: STAGE_TIMEOUT seconds (180;
# 300 for the compile-heavy triton and cute stages).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
logs=${OUT:-gpu_logs}
mkdir -p "$logs"
limit=${STAGE_TIMEOUT:-180}
need_cute="python -c 'import cutlass.cute' || { echo 'no CuTe DSL: run . /tmp/kit/env.sh first'; exit 3; }"
hf_large="--layers 16 --hidden 1024 --batch 8 --prompt 256 --new-tokens 64 --repeats 3"

declare -A commands=(
  [env]="nvidia-smi -L; python -c 'import sys, torch, triton, transformers; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__, transformers.__version__, torch.cuda.get_device_name())'; python -c 'import cutlass; print(\"cutlass DSL\", cutlass.__version__)' || echo 'no CuTe DSL (source /tmp/kit/env.sh)'"
  [paths]="python -m pytest -q -rs tests/gpu/test_cuda_paths.py tests/gpu/test_distributed_gpu.py"
  [triton]="python -m pytest -q -rs --durations=5 tests/gpu/test_triton_gpu.py tests/gpu/test_mla_gpu.py"
  [cute]="$need_cute && python -m pytest -q -rs --durations=5 tests/gpu/test_cute_gpu.py"
  [examples]="python examples/hf_generate.py && python examples/compiled_decode.py && python examples/checkpoint_resume.py && python examples/quickstart.py && python examples/mla_decode.py"
  [bench-triton]="python benchmarks/bench_decode_gpu.py && python benchmarks/bench_decode.py --device cuda --dtypes bfloat16 --batch 64 --context 4096 --page-sizes 1,16,128"
  [bench-cute]="$need_cute && python benchmarks/bench_cute_decode.py"
  [bench-mla]="python benchmarks/bench_mla_gpu.py && python benchmarks/bench_mla.py --device cuda --batch 64 --context 4096"
  [bench-fp8]="python benchmarks/bench_fp8.py --device cuda --batch 64 --context 4096"
  [bench-hf]="python benchmarks/bench_hf.py --dtype bfloat16 $hf_large && python benchmarks/bench_hf.py --dtype bfloat16 $hf_large --compile"
)
order=(env paths triton cute examples bench-triton bench-cute bench-mla bench-fp8 bench-hf)
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=("${order[@]}")

summary=()
for stage in "${stages[@]}"; do
  [ -n "${commands[$stage]+x}" ] || { echo "unknown stage $stage; known: ${order[*]}"; exit 2; }
  start=$(date +%s)
  case $stage in triton|cute) stage_limit=${STAGE_TIMEOUT:-300} ;; *) stage_limit=$limit ;; esac
  timeout -s KILL "$stage_limit" bash -c "${commands[$stage]}" > "$logs/$stage.log" 2>&1
  rc=$?
  [ $rc -eq 137 ] && rc="137 (killed at ${stage_limit}s: hung?)"
  last=$(grep -v '^\s*$' "$logs/$stage.log" | tail -n 1 | cut -c1-100)
  summary+=("| $stage | $rc | $(( $(date +%s) - start )) | $last |")
  echo "== $stage: rc $rc"; tail -n 25 "$logs/$stage.log"
done
echo
echo "| stage | rc | s | last line |"
echo "|---|---|---|---|"
printf '%s\n' "${summary[@]}"
