"""The `cpu` backend's narrower instruction-set paths, built and tested on a machine that has wider
ones: the library is compiled `-march=native`, so without this a CPU with AVX-512 BF16 would only
ever test the bf16 dot-product path, one with AVX512-VBMI never the FP8 conversions without byte
tables, and one with AVX-512 never the AVX2 path. Each case builds the
library with `TORCH_PAGED_KV_CPU_FLAGS` in a fresh cache, checks that the build took the narrower
path, and runs test_cpu.py and test_cpu_mla.py (fp64 and reference comparisons) on it in a subprocess; the cases start
with the session, beside the slow set's other subprocesses (conftest.py's `background_runs`)."""

from __future__ import annotations

import functools
import os
import pathlib
import subprocess
import sys
from collections.abc import Callable

import pytest

from torch_paged_kv.native import build

HERE = pathlib.Path(__file__).resolve().parent
pytestmark = pytest.mark.slow  # a library build and a test_cpu.py run per case


# flags appended, the /proc/cpuinfo flags the host needs for the case to be narrower than the
# default build, and what the library must then report: (floats per vector, bf16 dot products, FP8
# byte tables)
CASES = [
    ("-mno-avx512vbmi", {"avx512vbmi", "avx512_bf16"}, (16, 1, 0)),
    ("-mno-avx512bf16", {"avx512_bf16", "avx512vbmi"}, (16, 0, 1)),
    ("-mno-avx512f", {"avx512f"}, (8, 0, 0)),
]


# test_cpu.py's tests of the build itself, which no instruction set changes (the default run has them):
# syntax-only compiles for fixed -march targets, and a second process finding the cached library.
BUILD_ONLY = [
    "--deselect",
    "tests/test_cpu.py::test_kernels_compile_for_other_x86_targets",
    "--deselect",
    "tests/test_cpu.py::test_a_second_process_loads_the_cached_library_without_compiling",
]


TESTS = [str(HERE / "test_cpu.py"), str(HERE / "test_cpu_mla.py")]  # what each narrower build runs
PROBE = (
    "from torch_paged_kv.ops.cpu import kernels; lib = kernels.load(); "
    "print(lib.pkv_vector_width(), lib.pkv_bf16_dot(), lib.pkv_fp8_byte_tables())"
)
Run = subprocess.CompletedProcess[str]


def _build_and_test(flags: str, cache: pathlib.Path) -> tuple[Run, Run | None]:
    """The library built with `flags` in `cache` (what it reports), then `TESTS` on it (None if the
    build failed)."""
    env = {**os.environ, build.EXTRA_FLAGS_ENV: flags, "TORCH_PAGED_KV_CACHE_DIR": str(cache)}
    probe = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, check=False)
    if probe.returncode != 0:
        return probe, None
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *TESTS, *BUILD_ONLY],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        cwd=HERE.parent,
    )
    return probe, tests


def _runnable(host_needs: set[str], cpu_flags: set[str]) -> str | None:
    """Why a case cannot run here, or None."""
    if build.find_compiler() is None:
        return "no C++ compiler: the cpu backend cannot be built here"
    if not host_needs <= cpu_flags:
        return f"this CPU lacks {sorted(host_needs - cpu_flags)}: the default build is no wider here"
    return None


def background_jobs(items, request) -> list[tuple[str, float, Callable[[], tuple[Run, Run | None]]]]:
    """The selected cases this machine can run, for conftest's `background_runs` (about 100 s each,
    a compile and a test run, on a loaded 2-core machine)."""
    wanted = {item.callspec.params["flags"] for item in items}
    cpu_flags, tmp = request.getfixturevalue("cpu_flags"), request.getfixturevalue("tmp_path_factory")
    return [
        (f"isa {flags}", 100, functools.partial(_build_and_test, flags, tmp.mktemp("isa")))
        for flags, host_needs, _ in CASES
        if flags in wanted and _runnable(host_needs, cpu_flags) is None
    ]


@pytest.mark.parametrize("flags, host_needs, expected", CASES, ids=[case[0] for case in CASES])
def test_a_narrower_instruction_set_build_passes_the_cpu_tests(background_runs, cpu_flags, flags, host_needs, expected):
    reason = _runnable(host_needs, cpu_flags)
    if reason is not None:
        pytest.skip(reason)
    probe, tests = background_runs[f"isa {flags}"].result()
    assert probe.returncode == 0, probe.stderr
    assert tuple(map(int, probe.stdout.split())) == expected
    assert tests is not None
    assert tests.returncode == 0, tests.stdout[-4000:] + tests.stderr[-2000:]
    assert " passed" in tests.stdout
