"""Compile `kernels.cpp` (with the headers it includes) and `wire_copy.cpp` once per machine into one
shared library, cache it on disk, load it with ctypes. `library()` returns the library as loaded:
each caller declares the functions it calls (`declare`): the `cpu` backend its op entries
(`ops/cpu/args.py`), the distributed wire its copy and checksum (`distributed/wire.py`).

The library has no torch headers (it compiles in seconds and does not depend on torch's C++ ABI):
the system C++ compiler (`$CXX`, else `c++`, `g++` or `clang++` on `PATH`) builds it with `-O3
-march=native` and OpenMP when the compiler supports it; `-fopenmp` links `libgomp.so.1`, which is
the OpenMP runtime torch itself loaded, so the kernels share torch's threads. The file is keyed by
the sources and headers, the compiler (path, size, mtime), the flags and the CPU (`-march=native`
code must not run on another CPU), and lands in `$TORCH_PAGED_KV_CACHE_DIR` (default
`$XDG_CACHE_HOME/torch_paged_kv` or `~/.cache/torch_paged_kv`), written to a temporary name and
renamed, so concurrent first calls in several processes at worst compile twice; a process that
compiles says so on stderr (one line: the first call stalls 10-20 s). A warm cache loads in
milliseconds, silently. Where a variant fails to compile, the next one (no `-march=native`, no OpenMP) is
tried, with a `RuntimeWarning` saying why; the failure is kept beside the library's place
(`compile-error.txt`) so later processes do not compile it again (delete it to retry).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from typing import Any

SOURCE = pathlib.Path(__file__).with_name("kernels.cpp")
SOURCES = (SOURCE, SOURCE.with_name("wire_copy.cpp"))
"""Compiled together, in one compiler call; the cache key hashes the bytes of each."""
LIBRARY_NAME = "paged_kv_cpu"
BASE_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=fast", "-fno-math-errno"]
# Tried in order: the first set the compiler accepts is used (no OpenMP: one thread).
VARIANT_FLAGS: tuple[list[str], ...] = (["-march=native", "-fopenmp"], ["-fopenmp"], ["-march=native"], [])
EXTRA_FLAGS_ENV = "TORCH_PAGED_KV_CPU_FLAGS"
"""Compiler flags appended to each variant (split on spaces), e.g. `-mno-avx512f` to build and test
the AVX2 path on an AVX-512 machine; part of the cache key like every flag."""


class BuildError(RuntimeError):
    """The kernels could not be compiled or loaded here (the reason is in the message)."""


def cache_dir() -> pathlib.Path:
    root = os.environ.get("TORCH_PAGED_KV_CACHE_DIR")
    if root:
        return pathlib.Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (pathlib.Path(xdg) if xdg else pathlib.Path.home() / ".cache") / "torch_paged_kv"


def headers() -> tuple[pathlib.Path, ...]:
    """The parts of `kernels.cpp` (the headers beside it, which it includes): hashed into the cache
    key with the sources."""
    return tuple(sorted(SOURCES[0].parent.glob("*.h")))


def find_compiler() -> str | None:
    """The C++ compiler to use: `$CXX`, else the first of c++, g++, clang++ on PATH."""
    candidates = [os.environ["CXX"]] if os.environ.get("CXX") else ["c++", "g++", "clang++"]
    for name in candidates:
        path = shutil.which(name)
        if path:
            return path
    return None


def _cpu_identity() -> str:
    """What `-march=native` depends on: the CPU's model and feature flags where the OS says them."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()


def _key(compiler: str, flags: list[str], sources: list[bytes]) -> str:
    real = os.path.realpath(compiler)
    st = os.stat(real)
    parts = [*sources, real.encode(), f"{st.st_size}:{st.st_mtime_ns}".encode(), " ".join(flags).encode()]
    parts += [_cpu_identity().encode(), platform.machine().encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:24]


def _compile(compiler: str, flags: list[str], sources: tuple[pathlib.Path, ...], target: pathlib.Path) -> str | None:
    """Compile into `target` (atomically); None on success, else the compiler's complaint."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run(
            [compiler, *BASE_FLAGS, *flags, *map(str, sources), "-o", tmp], capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            return (result.stderr or result.stdout).strip()[:20000]
        os.replace(tmp, target)
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | BuildError] = {}


def library() -> ctypes.CDLL:
    """The loaded kernel library (built on the first call in a machine's life); raises `BuildError`.
    Thread-safe; the outcome, success or failure, is kept for the life of the process."""
    outcome = _loaded.get("lib")
    if outcome is None:
        with _lock:
            outcome = _loaded.get("lib")
            if outcome is None:
                try:
                    outcome = _build_and_load()
                except BuildError as exc:
                    outcome = exc
                _loaded["lib"] = outcome
    if isinstance(outcome, BuildError):
        raise outcome
    return outcome


def _build_and_load() -> ctypes.CDLL:
    compiler = find_compiler()
    if compiler is None:
        raise BuildError("no C++ compiler found (set CXX, or install g++ or clang++)")
    sources = [path.read_bytes() for path in (*SOURCES, *headers())]
    extra = os.environ.get(EXTRA_FLAGS_ENV, "").split()
    errors, said = [], False
    for flags in (variant + extra for variant in VARIANT_FLAGS):
        path = cache_dir() / "cpu" / _key(compiler, flags, sources) / f"lib{LIBRARY_NAME}.so"
        failed = path.with_name(FAILED_NAME)  # this variant's compile failed before: not tried again
        if not path.exists():
            if not failed.exists() and not said:  # the first call stalls: say why, once
                print(COMPILING.format(cache_dir() / "cpu"), file=sys.stderr, flush=True)
                said = True
            error = failed.read_text() if failed.exists() else _compile(compiler, flags, SOURCES, path)
            if error is not None:
                if not failed.exists():  # (a fresh failure)
                    _write_atomically(failed, error)
                errors.append(f"{' '.join(flags) or '(no extra flags)'}: {_first_error(error)} (in full: {failed})")
                continue
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as exc:
            errors.append(f"{path}: {exc}")
            continue
        if errors:  # a fallback: slower kernels (no -march=native, or no OpenMP), said once per process
            warnings.warn(
                f"torch_paged_kv: the CPU kernels were built with {' '.join(flags) or 'no extra flags'} and "
                f"may run slower: {'; '.join(errors)}. Delete that file to compile it again.",
                RuntimeWarning,
                stacklevel=2,
            )
        return lib
    raise BuildError(f"could not build the CPU kernels with {compiler}: " + "; ".join(errors))


FAILED_NAME = "compile-error.txt"
COMPILING = "torch_paged_kv: compiling the CPU kernels once (about 15 s); cached in {}"
"""Printed to stderr when a process compiles the library (not when it loads it from the cache)."""


def _first_error(output: str) -> str:
    """The compiler's first error line (else its last line)."""
    lines = output.splitlines()
    return next((line for line in lines if "error" in line), lines[-1] if lines else "")


def _write_atomically(target: pathlib.Path, text: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, target)


Signatures = dict[str, tuple[list[Any], Any]]
"""Function name -> (ctypes argument types, result type), as a caller declares its functions."""


def declare(lib: ctypes.CDLL, signatures: Signatures) -> ctypes.CDLL:
    """Set the argument and result types of `lib`'s functions named in `signatures`; returns `lib`."""
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = restype
    return lib
