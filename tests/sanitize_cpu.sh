#!/usr/bin/env bash
# The cpu backend's C++ (native/kernels.cpp and its headers, native/wire_copy.cpp) under
# AddressSanitizer and UndefinedBehaviorSanitizer. Opt-in: not part of CI's default run.
#
#   tests/sanitize_cpu.sh [FUZZ_SCALE]     (default 20; from any directory; GCC or Clang on Linux)
#
# The kernel library is built with TORCH_PAGED_KV_CPU_FLAGS="-fsanitize=address,undefined ..." in
# its own cache ($TORCH_PAGED_KV_CACHE_DIR, default /tmp/torch_paged_kv_sanitize: the first build
# takes minutes, a rebuild follows every edit of the sources), the compiler's ASan and UBSan runtimes
# are preloaded into python, leak reports are off (python and torch keep their allocations), and any
# report aborts the process: the run fails at the first finding, its report printed at the end.
#
# First a canary: a kernel entry called (past Python's checks) on a pool one page short must be
# reported as a heap-buffer-overflow, which proves that the setup sees a read just past a torch
# tensor's storage (torch's CPU allocator allocates exactly, through the intercepted posix_memalign).
# A read inside a tensor's storage but outside its view (a slice) is not seen: test_unchecked_bounds
# and test_fuzz_ops put the pool between sentinel bytes (which catch writes there), so
# test_fuzz_cpu_unchecked.py gives every tensor an allocation of its own.
# Then, with TORCH_PAGED_KV_BACKEND=cpu (no Triton interpreter cases, which run no native code, and no
# opcheck cases, whose gathers to another dtype the forced cpu backend refuses):
#   test_unchecked_bounds, test_cpu, test_cpu_args, test_cpu_threads, test_tree_attention,
#   test_sinks_chunks, test_sliding_pages, test_splits, test_fp8, test_fp8_nan, test_step_plan, test_cpu_mla,
#   fuzz/test_fuzz_ops (cpu) and fuzz/test_fuzz_cpu_unchecked at FUZZ_SCALE times their CI size;
# and with the default backends (the cpu one where it covers the op): test_manager, test_checkpoint,
# test_hostile_files, test_rewind, test_wire, test_hostile_transfer, fuzz/test_fuzz_files and
# fuzz/test_fuzz_transfer (FUZZ_SCALE / 4).
set -euo pipefail

scale="${1:-20}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
cxx="${CXX:-c++}"
asan="$("$cxx" -print-file-name=libasan.so)"
ubsan="$("$cxx" -print-file-name=libubsan.so)"
[[ -f "$asan" && -f "$ubsan" ]] || { echo "sanitize_cpu.sh: $cxx has no libasan.so / libubsan.so" >&2; exit 2; }

export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_PAGED_KV_CPU_FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g"
export TORCH_PAGED_KV_CACHE_DIR="${TORCH_PAGED_KV_CACHE_DIR:-/tmp/torch_paged_kv_sanitize}"
# Reports go to files (pytest's capture would drop them with the aborted process), shown at the end.
reports="$(mktemp -d "${TMPDIR:-/tmp}/sanitize_cpu.XXXXXX")"
show_reports() {
  local status=$? report
  for report in "$reports"/*; do [[ -f "$report" ]] && { echo "== $report"; cat "$report"; } >&2; done
  [[ $status -eq 0 ]] && rm -rf "$reports"
  return $status
}
trap show_reports EXIT
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:log_path=$reports/asan"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$reports/ubsan"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/torch_paged_kv_sanitize/inductor}"
sanitized=(env LD_PRELOAD="$asan:$ubsan")

echo "== build (minutes the first time) and canary"
canary='
import torch
from torch_paged_kv.ops.cpu import kernels
from torch_paged_kv.ops.cpu.args import PACKERS
lib = kernels.load()
pool = torch.randn(4, 2, 1, 4, 1, 8)  # 4 pages; the call claims 5 and copies from page 4
src, dst = torch.tensor([4], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
print("loaded", flush=True)
lib.pkv_copy_pages(PACKERS["copy_pages"].pack(pool.data_ptr(), pool.stride(0) * 4, 5, src.data_ptr(), dst.data_ptr(), 1, 1))
'
"${sanitized[@]}" python -c "import torch_paged_kv.ops.cpu.kernels as k; k.load()"
if out="$(ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 "${sanitized[@]}" python -c "$canary" 2>&1)"; then
  echo "canary: the out-of-bounds copy was NOT reported: the sanitizer is not working" >&2
  exit 1
fi
grep -q "loaded" <<<"$out" && grep -q "AddressSanitizer: heap-buffer-overflow" <<<"$out" || {
  echo "canary: no heap-buffer-overflow report:" >&2
  echo "$out" | tail -20 >&2
  exit 1
}
echo "canary: reported, as it must be"

pytest=("${sanitized[@]}" python -m pytest -q -p no:cacheprovider)
echo "== cpu backend forced"
TORCH_PAGED_KV_BACKEND=cpu "${pytest[@]}" -k "not triton and not opcheck" \
  tests/test_unchecked_bounds.py tests/test_cpu.py tests/test_cpu_args.py tests/test_cpu_threads.py \
  tests/test_tree_attention.py tests/test_sinks_chunks.py tests/test_sliding_pages.py tests/test_splits.py \
  tests/test_fp8.py tests/test_fp8_nan.py tests/test_step_plan.py tests/test_cpu_mla.py \
  --deselect tests/test_cpu.py::test_kernels_compile_for_other_x86_targets
TORCH_PAGED_KV_BACKEND=cpu TORCH_PAGED_KV_FUZZ_SCALE="$scale" "${pytest[@]}" \
  "tests/fuzz/test_fuzz_ops.py::test_random_op_calls_stay_in_bounds_and_agree_with_the_reference[cpu]" \
  tests/fuzz/test_fuzz_cpu_unchecked.py
echo "== default backends: manager, checkpoints, transfer wire"
"${pytest[@]}" tests/test_manager.py tests/test_checkpoint.py tests/test_hostile_files.py tests/test_rewind.py \
  tests/test_wire.py tests/test_hostile_transfer.py
TORCH_PAGED_KV_FUZZ_SCALE="$(( (scale + 3) / 4 ))" "${pytest[@]}" tests/fuzz/test_fuzz_files.py \
  tests/fuzz/test_fuzz_transfer.py
echo "== sanitize_cpu.sh: no finding"
