"""Compile every Triton kernel variant the wrappers launch, ahead of time, for a GPU this machine
need not have: `python -m torch_paged_kv.ops.triton.aot --arch 90 80 [--quick] [--keep DIR]`.

Variants are planned by the wrappers' own `plan_*` functions on meta tensors, and the arguments go
through the binder a real launch uses, so constexprs, `num_warps` and Triton's launch
specialisation (ints equal to 1 become constants, ints and pointers divisible by 16 are marked so)
are those of a launch on that shape. Registers and spills come from the `ptxas -v` log.
Triton must be in compiled mode: run this in a process without `TRITON_INTERPRET=1`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from ..records import CopyPagesArgs, FlashAttentionArgs, GatherKVArgs, MLAAttentionArgs, StoreKVArgs, StoreLatentArgs
from .common import META_ARCH, Launch
from .copy_pages import plan_copy_pages
from .flash_attention import plan_flash_attention
from .gather_kv import plan_gather_kv
from .mla_attention import plan_mla_attention
from .mla_sparse import plan_mla_sparse
from .mla_store import plan_store_latent
from .store_kv import plan_store_kv

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HEAD_DIMS = (64, 128, 256)
GROUPS = (1, 4, 8, 16)
MODES = ("decode-split", "decode", "prefill")
WIDE_SLOT = 2**23  # "decode-slot": continuous-batching slots whose in-page offsets pass int32 (WIDE_PAGE)
OPTIONS = (
    "causal",
    "non-causal",
    "window",
    "softcap",
    "window+softcap",
    "sinks",
    "chunk",
    "sinks+chunk",
    "tree",
    "tree+window",
    "tree+chunk",
)
KV_HEADS = 8
LAYER = 3  # a plain i32 (layer 0 and 1 specialise: 16-divisible, constant)


OFFSET_ARG = re.compile(r"(^|_)stride_(page|plane|layer|token)$|^layer_idx$|^page_numel$")
"""Kernel arguments that scale a layer, page or token-in-page offset into a pool (`blocks`, `scales`,
MLA's latent, rope and scale views: `stride_page`, `cache_stride_token`, `scale_stride_layer`, ...):
every multiply they feed must be int64 (a continuous-batching pool's page spans more than 2**31
elements). The one exception: attention launches planned with `WIDE_PAGE=False`, whose plan checked
that in-page offsets, `(page_size - 1) * stride_token`, fit in int32 (`offset_args`); a scale's
in-page offset is smaller than its page's."""


def offset_args(launch: Launch) -> tuple[str, ...]:
    """The arguments of `launch`'s kernel whose products must be int64 (`OFFSET_ARG`)."""
    names = [name for name in launch.kernel.arg_names if OFFSET_ARG.search(name)]
    if launch.kwargs.get("WIDE_PAGE") is False:
        names = [name for name in names if not name.endswith("stride_token")]
    return tuple(names)


_SSA = re.compile(r"%([\w.$-]+)")


def narrow_offset_products(ttir: str, args: tuple[str, ...] | None = None) -> list[str]:
    """The i32 `arith.muli` lines of `ttir` fed, through any chain of ops, by one of `args` (default:
    every argument of its `tt.func` that `OFFSET_ARG` names). Triton passes an int below 2**31 as
    i32 and multiplies before any widening, so `layer_idx * stride_layer` wraps;
    `layer_idx.to(tl.int64) * stride_layer` does not."""
    if args is None:
        func = next((line for line in ttir.splitlines() if "tt.func" in line), "")
        args = tuple(name for name in re.findall(r"%([\w.$-]+):", func) if OFFSET_ARG.search(name))
    tainted = set(args)
    found = []
    for line in ttir.splitlines():
        code = line.split(" loc(")[0]
        if "=" not in code or code.lstrip().startswith(("tt.func", "#")):
            continue
        results, _, op = code.partition(" = ")
        used = {name.split("#")[0] for name in _SSA.findall(op)}
        if "iter_args(" in op:  # loop-carried values start from their initial values
            for carried, initial in re.findall(r"%([\w.$-]+) = %([\w.$-]+)", op):
                if initial in tainted:
                    tainted.add(carried)
        if used & tainted:
            tainted.update(name.split(":")[0] for name in _SSA.findall(results))
            if re.search(r"arith\.muli\b.*:\s*(tensor<[^>]*xi32>|i32)\s*$", op):
                found.append(line.strip())
    return found


class Compiled(NamedTuple):
    regs: int
    spills: int  # bytes of spill stores
    seconds: float
    tensor_cores: str  # "wgmma", "mma", or "" when tl.dot lowers to FMAs
    asm: dict[str, str | bytes]


def _paged(
    dtype: torch.dtype, head_dim: int, batch: int, new: int, context: int, page_size: int = 16
) -> tuple[torch.Tensor, ...]:
    """Meta tensors of a step: blocks, cache_lengths, lookup_table, input_row_offsets, new K/V rows."""
    width = triton.cdiv(context, page_size) + 8
    blocks = torch.empty(batch * width + 1, 2, 4, page_size, KV_HEADS, head_dim, dtype=dtype, device="meta")
    index = [torch.empty(shape, dtype=torch.int32, device="meta") for shape in ((batch,), (batch, width), (batch + 1,))]
    rows = torch.empty(batch * new, KV_HEADS, head_dim, dtype=dtype, device="meta")
    return blocks, *index, rows


def _attention(dtype: str, head_dim: int, group: int, mode: str, option: str) -> list[Launch]:
    # decode-split: batch 1 over 32k keys; decode: batch 64, a 256-key table (one split); prefill: 4 x 256 new;
    # decode-slot: batch 2 in slots of 8M tokens (page = slot).
    batch, new, context = {
        "decode-split": (1, 1, 32768),
        "decode": (64, 1, 128),
        "prefill": (4, 256, 1024),
        "decode-slot": (2, 1, WIDE_SLOT),
    }[mode]
    page_size = WIDE_SLOT if mode == "decode-slot" else 16
    blocks, cache_lengths, table, offsets, _ = _paged(DTYPES[dtype], head_dim, batch, new, context, page_size)
    q = torch.empty(batch * new, KV_HEADS * group, head_dim, dtype=DTYPES[dtype], device="meta")
    args = FlashAttentionArgs(
        q,
        blocks,
        cache_lengths,
        table,
        offsets,
        LAYER,
        head_dim**-0.5,
        causal=option != "non-causal",
        sliding_window=512 if "window" in option else -1,
        softcap=30.0 if "softcap" in option else 0.0,
        sinks=torch.empty(q.shape[1], device="meta") if "sinks" in option else None,
        attention_chunk_size=8192 if "chunk" in option else -1,
        tree_mask=torch.empty(q.shape[0], dtype=torch.int64, device="meta") if "tree" in option else None,
    )
    return plan_flash_attention(args)[1]


def _attention_cases(quick: bool) -> Iterator[tuple[str, int, int, str, str]]:
    if quick:  # the corners: each dtype, head_dim, group, mode and option at least once
        yield from [
            ("bf16", 128, 4, "decode-split", "causal"),
            ("bf16", 128, 1, "prefill", "causal"),
            ("bf16", 64, 16, "decode", "window+softcap"),
            ("fp16", 256, 8, "prefill", "non-causal"),
            ("fp16", 64, 1, "decode-split", "softcap"),
            ("fp32", 256, 16, "prefill", "window"),
            ("fp32", 128, 4, "decode-split", "causal"),
            ("bf16", 64, 4, "decode-slot", "causal"),
            ("bf16", 128, 8, "decode-split", "sinks"),
            ("bf16", 128, 4, "prefill", "sinks+chunk"),
            ("bf16", 128, 4, "prefill", "tree"),
            ("fp16", 128, 4, "prefill", "tree+window"),
            ("bf16", 128, 4, "prefill", "tree+chunk"),
        ]
        return
    for dtype, head_dim, group, mode in itertools.product(DTYPES, HEAD_DIMS, GROUPS, MODES):
        yield dtype, head_dim, group, mode, "causal"
    for dtype, mode, option in itertools.product(DTYPES, MODES, OPTIONS[1:]):
        yield dtype, 128, 4, mode, option
    for dtype in DTYPES:
        yield dtype, 64, 4, "decode-slot", "causal"


MLA_CACHES = {  # name: (pool dtype, scales shape per token or None, or "static")
    "unquantized": (None, None),
    "fp8": (torch.float8_e4m3fn, 1),  # one scale per token (MAX's rope-aware row)
    "fp8-g128": (torch.float8_e4m3fn, 4),
    "e5m2-static": (torch.float8_e5m2, "static"),
}
MLA_RANK, MLA_ROPE = 512, 64  # DeepSeek-V2/V3
MLA_TOPK = 2048  # DeepSeek-V3.2's index_topk: the keys each query of sparse MLA attends to


MLAStep = tuple[
    torch.Tensor, "torch.Tensor | None", torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]


def _mla_paged(dtype: torch.dtype, cache: str, batch: int, new: int, context: int, page_size: int = 64) -> MLAStep:
    """Meta tensors of an MLA step: blocks, scales (or None), the step tensors, new rows."""
    pool_dtype, granules = MLA_CACHES[cache]
    pool_dtype = pool_dtype or dtype
    row = MLA_RANK + MLA_ROPE * (2 if pool_dtype.itemsize == 1 else 1)
    width = triton.cdiv(context, page_size) + 8
    blocks = torch.empty(batch * width + 1, 1, 4, page_size, 1, row, dtype=pool_dtype, device="meta")
    scales = None
    if granules == "static":
        scales = torch.empty(1, device="meta")
    elif isinstance(granules, int):
        scales = torch.empty(*blocks.shape[:5], granules, device="meta")
    lengths, table, offsets = (
        torch.empty(shape, dtype=torch.int32, device="meta") for shape in ((batch,), (batch, width), (batch + 1,))
    )
    latent, rope = (torch.empty(batch * new, n, dtype=dtype, device="meta") for n in (MLA_RANK, MLA_ROPE))
    return blocks, scales, lengths, table, offsets, latent, rope


def _mla_cases(quick: bool) -> Iterator[tuple[str, str, int, str]]:
    """(dtype, cache, heads, mode) of the MLA attention variants ("decode-slot": pages of 2**23 tokens)."""
    if quick:
        yield from [  # each dtype, cache kind and mode, 16 and 128 heads, the merge
            ("bf16", "fp8", 16, "decode-split"),
            ("bf16", "unquantized", 128, "prefill"),
            ("fp16", "fp8-g128", 16, "prefill"),
            ("bf16", "e5m2-static", 16, "decode"),
            ("fp32", "unquantized", 16, "decode"),
            ("bf16", "fp8-g128", 16, "decode-slot"),  # (per-token rows spilled 84 B there with the integer decode)
            ("bf16", "unquantized", 128, "decode-split"),  # 64-head wgmma tiles on sm_90
            ("bf16", "fp8", 128, "decode"),
        ]
        return
    for dtype, heads, mode in itertools.product(DTYPES, (16, 128), MODES):
        yield dtype, "unquantized", heads, mode
    for dtype, cache, mode in itertools.product(("bf16", "fp16"), list(MLA_CACHES)[1:], MODES):
        yield dtype, cache, 16, mode  # (fp32 queries over FP8 rows run on the reference backend)
    for cache in MLA_CACHES:
        yield "bf16", cache, 16, "decode-slot"
    for dtype, cache in itertools.product(("bf16", "fp16"), list(MLA_CACHES)[1:]):
        yield dtype, cache, 128, "decode-split"  # (64-head wgmma tiles on sm_90 for per-token and static scales)


def _mla_sparse_cases(quick: bool) -> Iterator[tuple[str, str, int, str]]:
    """(dtype, cache, heads, mode) of the sparse MLA attention variants (`key_positions`, k 2048): one
    query token per program, so decode and prefill differ in their splits (decode-split: batch 1, split
    over its 2048 entries, then the merge; decode: batch 64, one split; prefill: 4 x 256 tokens)."""
    if quick:
        yield from [
            ("bf16", "unquantized", 16, "decode-split"),
            ("bf16", "unquantized", 128, "prefill"),
            ("bf16", "fp8", 128, "decode"),
            ("bf16", "fp8-g128", 16, "decode-slot"),
        ]
        return
    for heads, mode in itertools.product((16, 128), MODES):
        yield "bf16", "unquantized", heads, mode
    for cache, heads in itertools.product(list(MLA_CACHES)[1:], (16, 128)):
        yield "bf16", cache, heads, "decode-split"
    yield "fp16", "unquantized", 128, "decode-split"
    for cache in MLA_CACHES:
        yield "bf16", cache, 16, "decode-slot"


MLA_SHAPES = {  # mode: (batch, new tokens each, context)
    "decode-split": (1, 1, 32768),
    "decode": (64, 1, 128),
    "prefill": (4, 256, 1024),
    "decode-slot": (2, 1, WIDE_SLOT),  # slots whose in-page offsets pass int32 (WIDE_PAGE)
}


def _mla_args(dtype: str, cache: str, heads: int, mode: str, sparse: bool, sinks: bool = False) -> MLAAttentionArgs:
    """Meta tensors of an `mla_attention` call (`sparse`: with `key_positions`, k = `MLA_TOPK`)."""
    batch, new, context = MLA_SHAPES[mode]
    page_size = WIDE_SLOT if mode == "decode-slot" else 64
    blocks, scales, lengths, table, offsets, _, _ = _mla_paged(DTYPES[dtype], cache, batch, new, context, page_size)
    q_nope = torch.empty(batch * new, heads, MLA_RANK, dtype=DTYPES[dtype], device="meta")
    q_rope = torch.empty(batch * new, heads, MLA_ROPE, dtype=DTYPES[dtype], device="meta")
    positions = torch.empty(batch * new, MLA_TOPK, dtype=torch.int32, device="meta") if sparse else None
    sink_logits = torch.empty(heads, device="meta") if sinks else None
    return MLAAttentionArgs(
        q_nope, q_rope, blocks, lengths, table, offsets, LAYER, 192**-0.5, True, scales, positions, sink_logits
    )


def _mla_variants(quick: bool) -> Iterator[tuple[str, Launch]]:
    for sparse, cases in ((False, _mla_cases(quick)), (True, _mla_sparse_cases(quick))):
        plan = plan_mla_sparse if sparse else plan_mla_attention
        for dtype, cache, heads, mode in cases:
            for launch in plan(_mla_args(dtype, cache, heads, mode, sparse))[1]:
                yield f"{launch.kernel.__name__.strip('_')} {dtype} {cache} h{heads} {mode}", launch
        for mode in ("decode-split", "prefill"):  # sinks (HY-V4): in the merge, or in the kernel's epilogue
            for launch in plan(_mla_args("bf16", "unquantized", 16, mode, sparse, sinks=True))[1]:
                yield f"{launch.kernel.__name__.strip('_')} bf16 unquantized h16 {mode} sinks", launch
    for dtype, cache in itertools.product(("bf16",) if quick else DTYPES, MLA_CACHES):
        if quick and cache == "fp8-g128":
            continue
        blocks, scales, lengths, table, offsets, latent, rope = _mla_paged(DTYPES[dtype], cache, 64, 1, 1024)
        for launch in plan_store_latent(StoreLatentArgs(latent, rope, blocks, lengths, table, offsets, LAYER, scales)):
            yield f"store_latent {dtype} {cache}", launch


def variants(quick: bool = False, arch: int = 90) -> list[tuple[str, Launch]]:
    """(name, launch) for every distinct kernel variant planned for sm_`arch` (FP8 reads decode in
    hardware from sm_89: `fp8.hardware_fp8`); `quick` keeps a representative subset."""
    token = META_ARCH.set(arch)
    try:
        return _variants(quick)
    finally:
        META_ARCH.reset(token)


def _variants(quick: bool) -> list[tuple[str, Launch]]:
    found: list[tuple[str, Launch]] = []
    for dtype, head_dim, group, mode, option in _attention_cases(quick):
        for launch in _attention(dtype, head_dim, group, mode, option):
            found.append((f"{launch.kernel.__name__.strip('_')} {dtype} d{head_dim} g{group} {mode} {option}", launch))
    for dtype, head_dim in itertools.product(DTYPES, (128,) if quick else HEAD_DIMS):
        for mode, (batch, new) in {"decode": (64, 1), "prefill": (4, 256)}.items():
            blocks, cache_lengths, table, offsets, rows = _paged(DTYPES[dtype], head_dim, batch, new, 1024)
            for launch in plan_store_kv(StoreKVArgs(rows, rows, blocks, cache_lengths, table, offsets, LAYER)):
                found.append((f"store_kv {dtype} d{head_dim} {mode}", launch))
        blocks, cache_lengths, table, offsets, _ = _paged(DTYPES[dtype], head_dim, 4, 1, 1024)
        for launch in plan_gather_kv(GatherKVArgs(blocks, cache_lengths, table, offsets, LAYER, 1024))[2]:
            found.append((f"gather_kv {dtype} d{head_dim}", launch))
        pages = torch.empty(7, dtype=torch.int32, device="meta")
        for i, launch in enumerate(plan_copy_pages(CopyPagesArgs(blocks, pages, pages))):
            found.append((f"copy_pages {dtype} d{head_dim} pass{i + 1}", launch))
    found.extend(_fp8_variants(quick))
    found.extend(_mla_variants(quick))
    return found


FP8_CACHES = {  # name: (FP8 dtype, scales per token and head, or None for a static per-tensor pair)
    "e4m3-token": (torch.float8_e4m3fn, 1),
    "e4m3-g32": (torch.float8_e4m3fn, 4),
    "e5m2-static": (torch.float8_e5m2, None),
}


def _fp8_paged(cache: str, batch: int, new: int, context: int) -> tuple[torch.Tensor, ...]:
    """`_paged` over an FP8 pool of head_dim 128, bf16 new rows, and the cache's scales."""
    dtype, groups = FP8_CACHES[cache]
    blocks, cache_lengths, table, offsets, _ = _paged(dtype, 128, batch, new, context)
    rows = torch.empty(batch * new, KV_HEADS, 128, dtype=torch.bfloat16, device="meta")
    shape = (2,) if groups is None else (*blocks.shape[:5], groups)
    return blocks, cache_lengths, table, offsets, rows, torch.empty(shape, dtype=torch.float32, device="meta")


def _fp8_variants(quick: bool) -> list[tuple[str, Launch]]:
    """The K/V ops over FP8 caches: 16-bit rows, bf16, fp16 and fp32 queries, head_dim 128, GQA 4."""
    found = []
    caches = ("e4m3-token", "e5m2-static") if quick else tuple(FP8_CACHES)
    for cache in caches:
        for mode, (batch, new, context) in {"decode": (64, 1, 128), "prefill": (4, 256, 1024)}.items():
            blocks, lengths, table, offsets, rows, scales = _fp8_paged(cache, batch, new, context)
            for launch in plan_store_kv(StoreKVArgs(rows, rows, blocks, lengths, table, offsets, LAYER, scales)):
                found.append((f"store_kv {cache} {mode}", launch))
        blocks, lengths, table, offsets, _, scales = _fp8_paged(cache, 4, 1, 1024)
        for launch in plan_gather_kv(
            GatherKVArgs(blocks, lengths, table, offsets, LAYER, 1024, scales, torch.bfloat16)
        )[2]:
            found.append((f"gather_kv {cache} to bf16", launch))
        pages = torch.empty(7, dtype=torch.int32, device="meta")
        for i, launch in enumerate(plan_copy_pages(CopyPagesArgs(blocks, pages, pages, scales))):
            found.append((f"copy_pages {cache} pass{i + 1}", launch))
    modes = {"decode-split": (1, 1, 32768), "decode": (64, 1, 128), "prefill": (4, 256, 1024)}
    quick_cases: tuple[tuple[str, str, str], ...] = (
        ("e4m3-token", "bf16", "decode-split"),
        ("e5m2-static", "bf16", "prefill"),
    )
    quick_cases += (("e4m3-token", "fp32", "decode-split"), ("e4m3-g32", "fp32", "prefill"))
    for cache, q_dtype, mode in itertools.product(tuple(FP8_CACHES), ("bf16", "fp16", "fp32"), modes):
        if quick and (cache, q_dtype, mode) not in quick_cases:
            continue
        batch, new, context = modes[mode]
        blocks, lengths, table, offsets, _, scales = _fp8_paged(cache, batch, new, context)
        q = torch.empty(batch * new, KV_HEADS * 4, 128, dtype=DTYPES[q_dtype], device="meta")
        _, launches = plan_flash_attention(
            FlashAttentionArgs(q, blocks, lengths, table, offsets, LAYER, 128**-0.5, scales=scales)
        )
        for launch in launches:
            found.append((f"{launch.kernel.__name__.strip('_')} {q_dtype} over {cache} {mode}", launch))
    return found


def _source(launch: Launch, backend) -> tuple[ASTSource, dict]:
    """What `kernel[grid](*args, **kwargs)` would compile: Triton's own binder and packing."""
    kernel = launch.kernel
    kwargs = {**launch.kwargs, "debug": False, "instrumentation_mode": ""}
    if hasattr(triton.knobs.compilation, "fpsan_homomorphic_casts"):  # triton 3.9 has it; 3.6 rejects it
        kwargs["fpsan_homomorphic_casts"] = False
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return ASTSource(kernel, signature, constexprs, attrs), options.__dict__


def compile_key(launch: Launch, arch: int) -> str:
    """Equal for launches that compile to the same kernel."""
    source, options = _source(launch, make_backend(GPUTarget("cuda", arch, 32)))
    return f"{source.hash()}-{sorted(options.items())}"


def compile_launch(launch: Launch, arch: int) -> Compiled:
    """Compile `launch` for sm_`arch` (always compiling: the ptxas log is read fresh)."""
    target = GPUTarget("cuda", arch, 32)
    source, options = _source(launch, make_backend(target))
    triton.knobs.nvidia.dump_ptxas_log = True
    triton.knobs.compilation.always_compile = True
    log = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(log):
        kernel = triton.compile(source, target=target, options=options)
    seconds = time.perf_counter() - start
    text = log.getvalue()
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores", text)
    if regs is None or spills is None:
        raise RuntimeError(f"no register/spill report in the ptxas log: {text!r}")
    ptx = kernel.asm["ptx"]
    cores = "wgmma" if "wgmma.mma_async" in ptx else "mma" if re.search(r"\bmma\.sync", ptx) else ""
    return Compiled(int(regs[1]), int(spills[1]), seconds, cores, kernel.asm)


def _keep(directory: Path, arch: int, name: str, asm: dict[str, str | bytes]) -> None:
    stem = directory / f"sm{arch}" / re.sub(r"[^\w.+-]+", "_", name)
    stem.parent.mkdir(parents=True, exist_ok=True)
    for ext, text in asm.items():
        path = stem.with_name(f"{stem.name}.{ext}")
        path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90], help="SM versions, e.g. 90 80")
    parser.add_argument("--quick", action="store_true", help="a representative subset (what CI compiles)")
    parser.add_argument("--keep", type=Path, help="write each variant's ttir/ttgir/llir/ptx/cubin here")
    args = parser.parse_args(argv)
    if triton.knobs.runtime.interpret:
        parser.error("triton is in interpreter mode: unset TRITON_INTERPRET")
    compiled = failures = 0
    with tempfile.TemporaryDirectory() as cache:
        triton.knobs.cache.dir = cache  # leave the user's cache alone
        print(f"{'arch':<5} {'variant':<58} {'regs':>4} {'spills':>6} {'mma':>5} {'s':>6}")
        for arch in args.arch:
            seen: set[str] = set()
            for name, launch in variants(args.quick, arch):
                if (key := compile_key(launch, arch)) not in seen:
                    seen.add(key)
                    failures += not _report(arch, name, launch, args.keep)
                    compiled += 1
    print(f"{compiled - failures} of {compiled} distinct variants compiled ({', '.join(f'sm_{a}' for a in args.arch)})")
    return 1 if failures else 0


def _report(arch: int, name: str, launch: Launch, keep: Path | None) -> bool:
    """Compile and print one table row; False (with the traceback on stderr) if it failed."""
    try:
        c = compile_launch(launch, arch)
    except Exception as error:  # report every failing variant; main exits non-zero
        print(f"sm{arch:<3} {name:<58} FAILED: {str(error).strip().splitlines()[0][:200]}", flush=True)
        traceback.print_exc(file=sys.stderr)
        return False
    print(f"sm{arch:<3} {name:<58} {c.regs:>4} {c.spills:>6} {c.tensor_cores or '-':>5} {c.seconds:>6.2f}", flush=True)
    if keep:
        _keep(keep, arch, name, c.asm)
    ttir = c.asm["ttir"]
    if narrow := narrow_offset_products(ttir if isinstance(ttir, str) else ttir.decode(), offset_args(launch)):
        print(f"sm{arch:<3} {name:<58} FAILED: i32 multiply of a layer/page offset: {narrow[0][:120]}", flush=True)
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
