"""The `cpu` backend's narrower instruction-set paths, built and tested on a machine that has wider
ones: the library is compiled `-march=native`, so without this a CPU with AVX-512 BF16 would only
ever test the bf16 dot-product path, one with AVX512-VBMI never the FP8 conversions without byte
tables, and one with AVX-512 never the AVX2 path. Each case builds the
library with `TORCH_PAGED_KV_CPU_FLAGS` in a fresh cache, checks that the build took the narrower
path, and runs test_cpu.py (fp64 and reference comparisons) on it in a subprocess."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

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


@pytest.mark.parametrize("flags, host_needs, expected", CASES, ids=[case[0] for case in CASES])
def test_a_narrower_instruction_set_build_passes_the_cpu_tests(tmp_path, cpu_flags, flags, host_needs, expected):
    if build.find_compiler() is None:
        pytest.skip("no C++ compiler: the cpu backend cannot be built here")
    if not host_needs <= cpu_flags:
        pytest.skip(f"this CPU lacks {sorted(host_needs - cpu_flags)}: the default build is no wider here")
    env = {**os.environ, build.EXTRA_FLAGS_ENV: flags, "TORCH_PAGED_KV_CACHE_DIR": str(tmp_path)}
    probe = (
        "from torch_paged_kv.ops.cpu import kernels; lib = kernels.load(); "
        "print(lib.pkv_vector_width(), lib.pkv_bf16_dot(), lib.pkv_fp8_byte_tables())"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=False)
    assert result.returncode == 0, result.stderr
    assert tuple(map(int, result.stdout.split())) == expected
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(HERE / "test_cpu.py")],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        cwd=HERE.parent,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout
