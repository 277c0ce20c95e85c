"""Every benchmark script still runs (tiny sizes; the figures themselves are not checked here).

The CPU benchmarks check their own outputs against a reference where they time one, and print a
table; the GPU-only ones must say that no GPU is visible and exit 0. Each runs from its own copy
of benchmarks/, so that the results/ of real runs are left alone; the module starts them all at once,
as many at a time as there are cores.
"""

import concurrent.futures
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"

CPU_RUNS = {
    "bench_decode.py": [
        "--device",
        "cpu",
        "--batch",
        "2",
        "--context",
        "64",
        "--q-heads",
        "4",
        "--kv-heads",
        "2",
        "--head-dim",
        "32",
        "--page-sizes",
        "1,16",
    ],
    "bench_manager.py": ["--batch", "8", "--steps", "20", "--repeats", "1"],
    "bench_cpu.py": ["--shapes", "2x48", "--prefill", "40", "--dtypes", "float32", "--repeats", "1", "--no-flex"],
    "bench_op_overhead.py": ["--calls", "20", "--repeats", "1"],
    "bench_fp8.py": [
        "--batch",
        "2",
        "--context",
        "64",
        "--head-dim",
        "64",
        "--heads",
        "4,2",
        "--accuracy-tokens",
        "64",
    ],
    "bench_checkpoint.py": ["--device", "cpu", "--size-mb", "4", "--repeats", "1"],
    "bench_mla.py": [
        "--batch",
        "1",
        "--context",
        "64",
        "--heads",
        "2",
        "--accuracy-tokens",
        "64",
        "--accuracy-heads",
        "2",
        "--sparse",
        "256,32",
    ],
    "bench_transfer.py": ["--size-mb", "8", "--chunk-mb", "4", "--repeats", "1", "--tp-steps", "5", "--tp-batch", "4"],
    "bench_hf.py": [
        "--layers",
        "1",
        "--hidden",
        "64",
        "--batch",
        "2",
        "--prompt",
        "8",
        "--new-tokens",
        "4",
        "--repeats",
        "1",
    ],
    "bench_hybrid_memory.py": [
        "--contexts",
        "2048",
        "--chunk",
        "512",
        "--batch",
        "2",
        "--prompt",
        "40",
        "--window",
        "16",
        "--steps",
        "3",
    ],
}
GPU_ONLY = ["bench_decode_gpu.py", "bench_cute_decode.py", "bench_mla_gpu.py", "bench_mla_tiles_gpu.py"]


Run = subprocess.CompletedProcess[str]


def _run(folder: pathlib.Path, script: str, *args: str) -> Run:
    return subprocess.run(
        [sys.executable, str(folder / script), *args], capture_output=True, text=True, timeout=600, cwd=folder
    )


@pytest.fixture(scope="module")
def started(request, tmp_path_factory):
    """script -> (its copy of benchmarks/, the running script), for the selected tests' scripts: all at
    once, as many at a time as there are cores (each mostly one thread: imports, tiny sizes)."""
    wanted = {item.callspec.params["script"] for item in request.session.items if item.module is request.module}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=cores)
    runs = {}
    gpu_only = [] if torch.cuda.is_available() else GPU_ONLY  # (with a GPU they would measure for real)
    for script in [*sorted(CPU_RUNS), *gpu_only]:
        if script in wanted:
            copy = tmp_path_factory.mktemp("bench") / "benchmarks"
            shutil.copytree(BENCHMARKS, copy, ignore=shutil.ignore_patterns("results", "__pycache__"))
            runs[script] = copy, pool.submit(_run, copy, script, *CPU_RUNS.get(script, []))
    yield runs
    pool.shutdown(cancel_futures=True)


def _output(started, script: str) -> tuple[pathlib.Path, str]:
    folder, run = started[script]
    done = run.result()
    assert done.returncode == 0, done.stderr[-3000:]
    return folder, done.stdout


@pytest.mark.parametrize("script", sorted(CPU_RUNS))
def test_cpu_benchmark_prints_its_table(started, script):
    folder, out = _output(started, script)
    assert "|---|" in out and "WRONG" not in out, out[-3000:]
    assert any((folder / "results").glob("*.md"))  # its own results, in the copy


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: these would measure for real")
@pytest.mark.parametrize("script", GPU_ONLY)
def test_gpu_benchmark_says_it_needs_a_gpu(started, script):
    assert "no CUDA GPU visible" in _output(started, script)[1]
