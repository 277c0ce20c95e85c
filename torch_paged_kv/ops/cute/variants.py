"""Which kernel variants exist, their tile configs, and how each is compiled from fake tensors
(the kernel modules, imported when a variant is compiled; they import only `grids` from here).

Nothing here needs a GPU: compiling for `arch` passes `--gpu-arch`, so PTX for sm_90a and sm_100a
can be produced on any machine with nvidia-cutlass-dsl installed.
"""

from __future__ import annotations

import itertools
from typing import Any

from . import compile_cache
from .compile_cache import CompileCache, KernelKey

ARCHES = ("sm_90a", "sm_100a")
DTYPES = ("bfloat16", "float16")
HEAD_DIMS = (64, 128, 256)
GROUPS = (1, 2, 4, 8, 16)
PAGE_SIZES = {"sm_90a": (8, 16, 32, 64, 128, 256), "sm_100a": (1, 2, 4, 8, 16, 32, 64, 128, 256)}
MIN_TMA_PAGE = 8  # sm90: smaller pages would cost one TMA box per few rows; they go to Triton
MAX_GROUP_DIM = 2048  # group * head_dim: per-lane registers for q and the accumulator
CONSUMER_WARPS = 4


def tile_config(head_dim: int) -> tuple[int, int]:
    """(tile_n, stages): keys per pipeline stage and ring depth; about 96 KB of K/V in flight."""
    if head_dim <= 64:
        return 64, 4
    if head_dim <= 128:
        return 64, 3
    return 32, 3


def page_supported(arch: str, page_size: int, tile_n: int) -> bool:
    """sm90 needs page boxes that tile the key tile; gather4 (sm100) takes any page size."""
    if arch == "sm_100a":
        return True
    return page_size >= MIN_TMA_PAGE and (page_size % tile_n == 0 or tile_n % page_size == 0)


def decode_key(arch: str, dtype: str, head_dim: int, page_size: int, group: int) -> KernelKey:
    tile_n, stages = tile_config(head_dim)
    return KernelKey("decode", arch, dtype, head_dim, page_size, group, tile_n, stages, CONSUMER_WARPS)


def combine_key(arch: str, dtype: str, head_dim: int) -> KernelKey:
    return KernelKey("combine", arch, dtype, head_dim)


def all_keys(arch: str) -> list[KernelKey]:
    """Every variant the CLI compiles for `arch`."""
    keys = [combine_key(arch, dtype, d) for dtype, d in itertools.product(DTYPES, HEAD_DIMS)]
    for dtype, d, page, group in itertools.product(DTYPES, HEAD_DIMS, PAGE_SIZES[arch], GROUPS):
        if group * d <= MAX_GROUP_DIM and page_supported(arch, page, tile_config(d)[0]):
            keys.append(decode_key(arch, dtype, d, page, group))
    return keys


def _cutlass_dtype(name: str) -> Any:
    import cutlass

    return {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[name]


def _options(key: KernelKey, ptx_dir: str | None) -> str:
    options = f"--gpu-arch {key.arch} --enable-tvm-ffi"  # TVM-FFI launch: torch tensors, the current stream
    if ptx_dir is not None:
        options += f" --keep-ptx --dump-dir {ptx_dir}"
    return options


def build(key: KernelKey, ptx_dir: str | None = None) -> Any:
    """`cute.compile` the kernel of `key` from fake tensors with symbolic sizes."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_tensor

    dtype = _cutlass_dtype(key.dtype)
    stream = cutlass.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    rows, heads, splits = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    out_partial = make_fake_compact_tensor(
        Float32, (splits, rows, heads, key.head_dim), stride_order=(3, 2, 1, 0), assumed_align=16
    )
    lse = make_fake_compact_tensor(Float32, (splits, rows, heads), stride_order=(2, 1, 0), assumed_align=4)
    if key.kernel == "combine":
        from .combine import SplitCombine

        out = make_fake_compact_tensor(dtype, (rows, heads, key.head_dim), stride_order=(2, 1, 0), assumed_align=16)
        return cute.compile(
            SplitCombine(dtype, key.head_dim), out_partial, lse, out, Int32(1), stream, options=_options(key, ptx_dir)
        )

    from .decode_sm90 import PagedDecodeSm90
    from .decode_sm100 import PagedDecodeSm100

    kernel_class = PagedDecodeSm100 if key.arch == "sm_100a" else PagedDecodeSm90
    kernel = kernel_class(dtype, key.head_dim, key.page_size, key.group, key.tile_n, key.stages, key.consumer_warps)
    batch, pool_rows = cute.sym_int32(), cute.sym_int32()
    q = make_fake_compact_tensor(dtype, (rows, heads, key.head_dim), stride_order=(2, 1, 0), assumed_align=16)
    row_view = make_fake_compact_tensor(
        dtype, (pool_rows, cute.sym_int32(divisibility=64)), stride_order=(1, 0), assumed_align=16
    )
    table = make_fake_tensor(Int32, (batch, cute.sym_int32()), stride=(cute.sym_int32(), 1), assumed_align=4)
    cache_lengths = make_fake_compact_tensor(Int32, (batch,), assumed_align=4)
    offsets = make_fake_compact_tensor(Int32, (cute.sym_int32(),), assumed_align=4)
    scalars = (Int32(1), Int32(0), Int32(0), Float32(1.0), Int32(0), Int32(1), Int32(1))
    return cute.compile(
        kernel,
        q,
        row_view,
        table,
        cache_lengths,
        offsets,
        out_partial,
        lse,
        *scalars,
        stream,
        options=_options(key, ptx_dir),
    )


def get(key: KernelKey, cache: CompileCache | None = None) -> Any:
    """The compiled kernel of `key` from `cache` (default: the process-wide `CACHE`)."""
    return (cache if cache is not None else compile_cache.CACHE).get(key, lambda: build(key))
