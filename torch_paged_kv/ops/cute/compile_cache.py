"""One process-wide, thread-safe cache of compiled CuTe kernels, keyed by every specialisation.

`cute.compile` neither caches nor is thread-safe, so every compile goes through `CompileCache.get`
under one lock (double-checked, so concurrent callers of one key compile it once). Kernels are
compiled from fake tensors with symbolic sizes (`make_fake_compact_tensor` + `sym_int32`), so one
compile serves every batch size, context length, head count and pool size. With TVM-FFI
(`--enable-tvm-ffi`, on by default) the result is callable with torch tensors on the current
stream, and is written to disk with `export_to_c` and reloaded with `cutlass.runtime.load_module`
(about a millisecond instead of a compile) when `TORCH_PAGED_KV_CUTE_CACHE_DIR` names a
directory. `stats()` records how long each key took the first time and where it came from.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

CACHE_DIR_ENV = "TORCH_PAGED_KV_CUTE_CACHE_DIR"
_SOURCES = (
    "operand.py",
    "decode_sm90.py",
    "decode_sm100.py",
    "combine.py",
    "grids.py",
    "compile_cache.py",
    "variants.py",
)


@dataclasses.dataclass(frozen=True)
class KernelKey:
    """Everything a compiled kernel is specialised on."""

    kernel: str  # "decode" or "combine"
    arch: str  # "sm_90a" or "sm_100a"
    dtype: str  # "bfloat16" or "float16"
    head_dim: int
    page_size: int = 0
    group: int = 0
    tile_n: int = 0
    stages: int = 0
    consumer_warps: int = 0

    def slug(self) -> str:
        """A file-name-safe name, unique per key, for PTX dumps and exported objects."""
        return "_".join(f"{v}" for v in dataclasses.astuple(self)).replace(".", "")


@dataclasses.dataclass
class CacheEntry:
    fn: Any
    seconds: float
    source: str  # "compiled" or "disk"


def _source_digest() -> str:
    """Hash of the installed DSL version and of this package's kernel sources: the disk-cache salt."""
    import cutlass

    digest = hashlib.sha256(str(getattr(cutlass, "__version__", "")).encode())
    here = Path(__file__).parent
    for name in _SOURCES:
        path = here / name
        if path.exists():
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


class CompileCache:
    """`get(key, build)` returns the compiled kernel for `key`, compiling it once per process."""

    def __init__(self, cache_dir: str | os.PathLike | None = None) -> None:
        self._entries: dict[KernelKey, CacheEntry] = {}
        self._lock = threading.Lock()
        self._compile_lock = threading.Lock()
        self._cache_dir = cache_dir
        self._digest: str | None = None

    def cache_dir(self) -> Path | None:
        directory = self._cache_dir if self._cache_dir is not None else os.environ.get(CACHE_DIR_ENV)
        return Path(directory) if directory else None

    def get(self, key: KernelKey, build: Callable[[], Any]) -> Any:
        """The compiled kernel of `key`; `build()` runs `cute.compile` and is called at most once."""
        entry = self._entries.get(key)
        if entry is not None:
            return entry.fn
        with self._compile_lock:  # cute.compile is not thread-safe: one compile at a time
            entry = self._entries.get(key)
            if entry is None:
                entry = self._load_or_build(key, build)
                with self._lock:
                    self._entries[key] = entry
        return entry.fn

    def _object_path(self, key: KernelKey) -> Path | None:
        directory = self.cache_dir()
        if directory is None:
            return None
        if self._digest is None:
            self._digest = _source_digest()
        return directory / f"{key.slug()}_{self._digest}.o"

    def _load_or_build(self, key: KernelKey, build: Callable[[], Any]) -> CacheEntry:
        from cutlass.runtime import load_module

        start = time.perf_counter()
        path = self._object_path(key)
        symbol = "paged_kv_" + hashlib.sha1(key.slug().encode()).hexdigest()[:12]
        if path is not None and path.exists():
            fn = getattr(load_module(str(path), enable_tvm_ffi=True), symbol)
            return CacheEntry(fn, time.perf_counter() - start, "disk")
        fn = build()
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.tmp.o")
            fn.export_to_c(str(partial), function_name=symbol)
            partial.replace(path)
        return CacheEntry(fn, time.perf_counter() - start, "compiled")

    def stats(self) -> dict[KernelKey, tuple[float, str]]:
        """Seconds each key took to compile (or load) the first time, and whether it was compiled or loaded."""
        with self._lock:
            return {key: (entry.seconds, entry.source) for key, entry in self._entries.items()}

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


CACHE = CompileCache()
