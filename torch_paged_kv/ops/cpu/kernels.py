"""The `cpu` backend's op entry points: one ctypes call into the compiled kernels each.

Each takes its op's argument record (`ops/records.py`), validated (`ops/shape_checks.py`,
`ops/validate.py`). Tensors are passed as data pointers with their strides in elements; index
tensors are int32 with unit stride in their last dimension (validated), `blocks` is contiguous.
The threads used are torch's (`torch.get_num_threads()`).

Each call packs its arguments into one `bytes` laid out as the entry's argument struct (`args.py`,
checked against the library's `args.h` when it loads) and passes that: ctypes converts one argument
instead of forty-odd, which saves several microseconds per call (a decode step makes two calls per
layer). The values go in field order; `tests/test_cpu.py` checks each entry's values by field name.
"""

from __future__ import annotations

import ctypes

import torch

from ...native import build
from ..records import (
    CopyPagesArgs,
    FlashAttentionArgs,
    GatherKVArgs,
    MLAAttentionArgs,
    StoreKVArgs,
    StoreLatentArgs,
)
from .args import PACKERS, SIGNATURES, check_layout

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
FP8_CODES = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}

# Attention work split (read per call, so tests can force each path):
MIN_SPLIT_KEYS = 256
"""Fewest key positions in one split of a sequence's key range (split-KV when items are too few)."""
WANT_ITEMS = 0
"""Split key ranges until a call has this many work items; 0: eight per thread."""
MIN_WORK_PER_THREAD = 1 << 17
"""Fewest multiply-adds (of Q K^T) per thread before a call uses another thread."""

_lib: ctypes.CDLL | None = None


def loaded() -> bool:
    return _lib is not None


def load() -> ctypes.CDLL:
    """The kernel library, built and loaded on first use (raises `build.BuildError`), its argument
    structs checked against `args.py`'s (raises `args.ArgsLayoutError` where they differ)."""
    global _lib
    if _lib is None:
        lib = build.declare(build.library(), SIGNATURES)
        check_layout(lib.pkv_args_layout().decode())
        _lib = lib
    return _lib


def step_ok(
    blocks: torch.Tensor,
    cache_lengths: torch.Tensor,
    lookup_table: torch.Tensor,
    input_row_offsets: torch.Tensor,
    total_rows: int | None,
    reads_all: int,
    max_kv_len: int | None = None,
) -> bool:
    """Whether the step passes every value check that `validate.check_store_kv_data` (`reads_all`
    0) or `check_read_data` (1; W + 1 within a sliding window of W) makes, in one pass over the index
    tensors (CPU tensors). False means: let those checks find what is wrong; so does a call before
    the library is loaded (this check never loads it)."""
    if _lib is None:
        return False
    table_shape = lookup_table.shape
    two_d = len(table_shape) == 2
    return bool(
        _lib.pkv_step_ok(
            _STEP_OK.pack(
                cache_lengths.data_ptr(), lookup_table.data_ptr(), lookup_table.stride(0),
                table_shape[1] if two_d else 1, input_row_offsets.data_ptr(), cache_lengths.shape[0], two_d,
                -1 if total_rows is None else total_rows, blocks.shape[3], blocks.shape[0], reads_all,
                -1 if max_kv_len is None else max_kv_len,
            )
        )
    )  # fmt: skip


def _pool_and_step(
    a: StoreKVArgs | FlashAttentionArgs | GatherKVArgs | StoreLatentArgs | MLAAttentionArgs,
) -> tuple[int, ...]:
    """args.h's pool fields, then its step fields, from an op's record: blocks, its shape but the
    planes, the layer, the FP8 format code (0: not FP8), the scales and their groups per token and kv
    head (0: a static pair); cache_lengths, the table (row stride, usable columns), offsets, batch."""
    blocks, scales, lookup_table, cache_lengths = a.blocks, a.scales, a.lookup_table, a.cache_lengths
    pages, _, layers, page_size, heads, head_dim = blocks.shape
    if scales is None:
        fp8, scales_ptr, groups = 0, 0, 0
    else:
        fp8, scales_ptr, groups = (
            FP8_CODES[blocks.dtype],
            scales.data_ptr(),
            scales.shape[5] if scales.dim() == 6 else 0,
        )
    table_shape = lookup_table.shape
    return (
        blocks.data_ptr(), pages, layers, page_size, heads, head_dim, a.layer_idx, fp8, scales_ptr, groups,
        cache_lengths.data_ptr(), lookup_table.data_ptr(), lookup_table.stride(0),
        table_shape[1] if len(table_shape) == 2 else 1, a.input_row_offsets.data_ptr(), cache_lengths.shape[0],
    )  # fmt: skip


def store_kv(a: StoreKVArgs) -> None:
    """An FP8 pool (with `scales`) quantizes the rows by the reference's rule, bit for bit."""
    # (a decode step calls this once per layer: each tensor attribute is read once)
    key, value = a.key, a.value
    ks, vs = key.stride(), value.stride()
    if ks[2] != 1:
        key = key.contiguous()
        ks = key.stride()
    if vs[2] != 1:
        value = value.contiguous()
        vs = value.stride()
    total = key.shape[0]
    bad = (_lib or load()).pkv_store_kv(
        _STORE_KV.pack(
            DTYPE_CODES[key.dtype], key.data_ptr(), ks[0], ks[1], value.data_ptr(), vs[0], vs[1], total,
            *_pool_and_step(a), torch.get_num_threads(),
        )
    )  # fmt: skip
    _raise_out_of_bounds(bad, "key", total)


def flash_attention(a: FlashAttentionArgs) -> torch.Tensor:
    """Over an FP8 pool the fp32 output comes back in q's dtype; bf16 queries stay bf16 where the
    kernels' FP8_*_DOT kinds take them (attention.h's dispatch decides: a call it declines is made
    again with fp32 queries), other queries go in as fp32."""
    lib = _lib or load()
    q = a.q
    result_dtype = q.dtype
    if a.scales is not None and q.dtype != torch.bfloat16:
        q = q.float()
    status, out = _flash_attention_call(lib, q, a)
    if status == _DECLINED and q.dtype != torch.float32:
        status, out = _flash_attention_call(lib, q.float(), a)
    if status == _DECLINED:
        raise RuntimeError(f"the cpu kernels declined {q.dtype} queries over a {a.blocks.dtype} cache")
    _raise_out_of_bounds(status, "q", q.shape[0])
    return out if out.dtype == result_dtype else out.to(result_dtype)


def _flash_attention_call(lib: ctypes.CDLL, q: torch.Tensor, a: FlashAttentionArgs) -> tuple[int, torch.Tensor]:
    """One `pkv_flash_attention` call on `q` (`a.q`, or it converted) and the rest of `a`: (the
    entry's status: 0, `_DECLINED`, or an out-of-bounds code; the output)."""
    qs = q.stride()
    if qs[2] != 1:
        q = q.contiguous()
        qs = q.stride()
    # contiguous, as the fake says (empty_like is the cheaper call, where q is contiguous itself)
    out = torch.empty_like(q) if q.is_contiguous() else q.new_empty(q.shape)
    os_ = out.stride()
    sinks, tree = a.sinks, a.tree_mask
    status = lib.pkv_flash_attention(
        _FLASH_ATTENTION.pack(
            DTYPE_CODES[q.dtype], q.data_ptr(), qs[0], qs[1], q.shape[0], q.shape[1], out.data_ptr(), os_[0], os_[1],
            *_pool_and_step(a), a.softmax_scale, a.softcap, a.causal, a.sliding_window, a.attention_chunk_size,
            0 if sinks is None else sinks.data_ptr(), 0 if tree is None else tree.data_ptr(), MIN_SPLIT_KEYS,
            WANT_ITEMS, MIN_WORK_PER_THREAD,
            torch.get_num_threads(),
        )
    )  # fmt: skip
    return status, out


_DECLINED = 3
"""`pkv_flash_attention`'s status where the kernels do not take these queries (kernels.cpp)."""


def _raise_out_of_bounds(status: int, rows_name: str, rows: int) -> None:
    """The `ValueError` for an entry's out-of-bounds status (kernels.cpp's `step_bounds`: nothing was
    read or written). Checked calls never get here (their value checks say more); `.unchecked` ones
    whose step does not match their tensors do."""
    if status == 1:
        raise ValueError(
            f"input_row_offsets: must start at 0, never decrease and end at the {rows} rows of {rows_name} "
            "(an unchecked call whose step tensors do not match its rows; nothing was written)"
        )
    if status == 2:
        raise ValueError(
            "cache_lengths: a length is negative or passes what its lookup_table row addresses "
            "(an unchecked call; nothing was written)"
        )


def gather_kv(a: GatherKVArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 pool (with `scales`) is dequantized into fp32 rows, the reference's values bit for bit.
    Only gathers in that dtype come here (`out_dtype` None or it: `cpu.__init__`'s supports)."""
    blocks, scales = a.blocks, a.scales
    shape = (a.cache_lengths.shape[0], a.max_kv_len, *blocks.shape[4:])
    dtype = blocks.dtype if scales is None else torch.float32
    key, value = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
    (_lib or load()).pkv_gather_kv(
        _GATHER_KV.pack(
            blocks.element_size(), *_pool_and_step(a), a.max_kv_len, key.data_ptr(), value.data_ptr(),
            torch.get_num_threads(),
        )
    )  # fmt: skip
    return key, value


def copy_pages(a: CopyPagesArgs) -> None:
    """Whole pages, every source read before any write; an FP8 pool's scales rows move with them
    (a static pair has none)."""
    src_pages, dst_pages, scales = a.src_pages, a.dst_pages, a.scales
    if src_pages.shape[0] == 0:
        return
    pools = (a.blocks,) if scales is None or scales.dim() != 6 else (a.blocks, scales)
    for pool in pools:
        (_lib or load()).pkv_copy_pages(
            _COPY_PAGES.pack(
                pool.data_ptr(), pool.stride(0) * pool.element_size(), pool.shape[0], src_pages.data_ptr(),
                dst_pages.data_ptr(), src_pages.shape[0], torch.get_num_threads(),
            )
        )  # fmt: skip


def store_latent(a: StoreLatentArgs) -> None:
    """MLA rows `[latent; rope]` into their slots; an FP8 pool (with `scales`) quantizes the latent by
    the reference's rule, bit for bit, and keeps the rope as bf16 (converted here, as the reference does)."""
    latent, rope = a.latent, a.k_rope
    if a.scales is not None and rope.dtype != torch.bfloat16:
        rope = rope.to(torch.bfloat16)
    if latent.stride(1) != 1:
        latent = latent.contiguous()
    if rope.stride(1) != 1:
        rope = rope.contiguous()
    total = latent.shape[0]
    bad = (_lib or load()).pkv_store_latent(
        _STORE_LATENT.pack(
            DTYPE_CODES[latent.dtype], latent.data_ptr(), latent.stride(0), rope.data_ptr(), rope.stride(0), total,
            latent.shape[1], rope.shape[1], *_pool_and_step(a), torch.get_num_threads(),
        )
    )  # fmt: skip
    _raise_out_of_bounds(bad, "latent", total)


def mla_attention(a: MLAAttentionArgs) -> torch.Tensor:
    """Absorbed MLA attention (dense or sparse, sinks) in fp32, out in q_nope's dtype, contiguous."""
    q_nope, q_rope, positions, sinks = a.q_nope, a.q_rope, a.key_positions, a.sinks
    out = q_nope.new_empty(q_nope.shape)
    total = q_nope.shape[0]
    if total == 0:
        return out
    if q_nope.stride(2) != 1:
        q_nope = q_nope.contiguous()
    if q_rope.stride(2) != 1:
        q_rope = q_rope.contiguous()
    ns, rs = q_nope.stride(), q_rope.stride()
    status = (_lib or load()).pkv_mla_attention(
        _MLA_ATTENTION.pack(
            DTYPE_CODES[q_nope.dtype], q_nope.data_ptr(), ns[0], ns[1], q_rope.data_ptr(), rs[0], rs[1], total,
            q_nope.shape[1], q_nope.shape[2], q_rope.shape[2], out.data_ptr(), *_pool_and_step(a), a.softmax_scale,
            a.causal, 0 if positions is None else positions.data_ptr(), 0 if positions is None else positions.shape[1],
            0 if sinks is None else sinks.data_ptr(), MIN_SPLIT_KEYS, WANT_ITEMS, MIN_WORK_PER_THREAD,
            torch.get_num_threads(),
        )
    )  # fmt: skip
    _raise_out_of_bounds(status, "q_nope", total)
    return out


_STORE_KV, _FLASH_ATTENTION, _GATHER_KV, _COPY_PAGES, _STEP_OK, _STORE_LATENT, _MLA_ATTENTION = (
    PACKERS[name]
    for name in ("store_kv", "flash_attention", "gather_kv", "copy_pages", "step_ok", "store_latent", "mla_attention")
)
