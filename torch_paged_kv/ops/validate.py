"""Value checks every op runs before it writes (`check_*_data`), after the shape checks of
`shape_checks.py`. A rejected call raises `ValueError` naming the argument.

The value checks read the index tensors (page ids, lengths, offsets). On CUDA that is a host sync,
so they are skipped while a CUDA graph is being captured and can be switched off with
`TORCH_PAGED_KV_VALIDATE=shapes` (default `full`), or per call through the ops' `.unchecked`
overloads; kernels still clamp out-of-range pages so that an unchecked bad call cannot write
outside `blocks`.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import Tensor

from ..layout import NULL_PAGE
from . import dispatch
from .shape_checks import TREE_TOKENS, fail


def data_checks_enabled(device: torch.device) -> bool:
    """Whether the value checks run for tensors on `device` right now."""
    if os.environ.get("TORCH_PAGED_KV_VALIDATE", "full") == "shapes":
        return False
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


# The checks run in numpy on host arrays: a view of CPU tensors (no copy; an order of magnitude
# cheaper per operation than torch on tiny index tensors), one small device-to-host copy of each
# index tensor on other devices (the sync the module docstring mentions).


def _host(t: Tensor) -> np.ndarray:
    return (t if t.device.type == "cpu" else t.cpu()).numpy().astype(np.int64, copy=False)


def _check_lengths(
    blocks: Tensor,
    cache_lengths: Tensor,
    lookup_table: Tensor,
    input_row_offsets: Tensor,
    total_rows: int | None,
    rows_name: str,
) -> tuple[np.ndarray, np.ndarray]:
    """Checks offsets and lengths; returns (cache_lengths, kv_len) as int64 host arrays."""
    offsets, lengths = _host(input_row_offsets), _host(cache_lengths)
    new = np.diff(offsets)
    kv_len = lengths + new
    capacity = blocks.shape[3] * (lookup_table.shape[1] if lookup_table.dim() == 2 else 1)
    if offsets[0] != 0:
        fail("input_row_offsets", f"must start at 0, got {offsets[0]}")
    if (new < 0).any():
        fail("input_row_offsets", f"must be non-decreasing; entry {np.flatnonzero(new < 0)[0] + 1} goes down")
    if (lengths < 0).any():
        b = np.flatnonzero(lengths < 0)[0]
        fail("cache_lengths", f"sequence {b} has negative length {lengths[b]}")
    if (kv_len > capacity).any():
        b = np.flatnonzero(kv_len > capacity)[0]
        fail(
            "cache_lengths",
            f"sequence {b} would reach {kv_len[b]} tokens, past the {capacity} its lookup_table row can address",
        )
    if total_rows is not None and offsets[-1] != total_rows:
        fail("input_row_offsets", f"last entry {offsets[-1]} must equal the {total_rows} rows of {rows_name}")
    return lengths, kv_len


def _check_pages(blocks: Tensor, lookup_table: Tensor, first_tok: np.ndarray, end_tok: np.ndarray) -> None:
    """Every page holding tokens [first_tok[b], end_tok[b]) of each sequence is a real page of
    `blocks`: inside it and not the null page (which pads tables and holds no sequence's tokens)."""
    live = end_tok > first_tok
    if not live.any():
        return
    page_size = blocks.shape[3]
    if lookup_table.dim() == 2:
        num_cols = int(-(-end_tok.max() // page_size))
        table = _host(lookup_table[:, :num_cols])
        cols = np.arange(num_cols)
        used = (cols >= (first_tok // page_size)[:, None]) & (cols * page_size < end_tok[:, None]) & live[:, None]
    else:
        table = _host(lookup_table)[:, None]
        used = live[:, None]
    bad = used & ((table <= NULL_PAGE) | (table >= blocks.shape[0]))
    if bad.any():
        b, col = np.argwhere(bad)[0]
        page = table[b, col]
        if page == NULL_PAGE:
            fail(
                "lookup_table",
                f"sequence {b} has no page for its tokens at entry {col} (it holds the "
                f"null page {NULL_PAGE}): allocate pages before storing or reading them",
            )
        fail("lookup_table", f"sequence {b} uses page id {page} (entry {col}), outside blocks' {blocks.shape[0]} pages")


def _fast_yes(
    blocks: Tensor,
    cache_lengths: Tensor,
    lookup_table: Tensor,
    input_row_offsets: Tensor,
    total_rows: int | None,
    reads_all: int,
    max_kv_len: int | None = None,
) -> bool:
    """The fast value check a backend registered for `blocks`' device type (`dispatch.ValueCheck`; the
    CPU kernels' one pass takes about 1 us where numpy takes tens): a yes settles it; on a no, or where
    none is registered, the checks below run and say what is wrong. `reads_all`: 0 (False) for a store
    (the new tokens' pages), 1 (True) for a read of every cached token, `W + 1` for a read within a
    sliding window of W (native/cache_ops.h's step_ok)."""
    check = dispatch.value_check(blocks.device.type)
    return check is not None and check(
        blocks, cache_lengths, lookup_table, input_row_offsets, total_rows, reads_all, max_kv_len
    )


def check_store_kv_data(
    key: Tensor, blocks: Tensor, cache_lengths: Tensor, lookup_table: Tensor, input_row_offsets: Tensor
) -> None:
    if _fast_yes(blocks, cache_lengths, lookup_table, input_row_offsets, key.shape[0], False):
        return
    lengths, kv_len = _check_lengths(blocks, cache_lengths, lookup_table, input_row_offsets, key.shape[0], "key")
    _check_pages(blocks, lookup_table, lengths, kv_len)


def check_read_data(
    blocks: Tensor,
    cache_lengths: Tensor,
    lookup_table: Tensor,
    input_row_offsets: Tensor,
    total_rows: int | None,
    max_kv_len: int | None = None,
    sliding_window: int = -1,
) -> None:
    """Checks for the ops that read the cached tokens (flash_attention, gather_kv, mla_attention): every
    one below each sequence's kv_len, or with `sliding_window` W > 0 those its queries may see, from
    position `cache_length - W + 1` (the first query's oldest key) on. Pages before that may be the null
    page: a sliding-window layer group's manager gives them back once no later query can see them."""
    reads = sliding_window + 1 if sliding_window > 0 else 1
    if _fast_yes(blocks, cache_lengths, lookup_table, input_row_offsets, total_rows, reads, max_kv_len):
        return
    lengths, kv_len = _check_lengths(blocks, cache_lengths, lookup_table, input_row_offsets, total_rows, "q")
    if max_kv_len is not None and kv_len.size and kv_len.max() > max_kv_len:
        b = kv_len.argmax()
        fail("max_kv_len", f"sequence {b} holds {kv_len[b]} tokens, more than max_kv_len={max_kv_len}")
    first = np.maximum(lengths - (sliding_window - 1), 0) if sliding_window > 0 else np.zeros_like(kv_len)
    _check_pages(blocks, lookup_table, first, kv_len)


def check_tree_data(input_row_offsets: Tensor, tree_mask: Tensor) -> None:
    """A step with a `tree_mask`: no sequence has more new tokens than its bits can name, and every
    row's mask holds its own bit (a draft sees itself; its depth, which places its window, counts it)."""
    offsets = _host(input_row_offsets).astype(np.int64)
    new = np.diff(offsets)
    if new.size and new.max() > TREE_TOKENS:
        b = int(new.argmax())
        fail("tree_mask", f"sequence {b} has {new[b]} new tokens; a tree step names at most {TREE_TOKENS} per sequence")
    bits = _host(tree_mask).astype(np.int64).view(np.uint64)
    own = np.arange(bits.size, dtype=np.int64) - np.repeat(offsets[:-1], new)
    missing = np.flatnonzero((bits >> own.astype(np.uint64)) & np.uint64(1) == 0)
    if missing.size:
        r = int(missing[0])
        fail("tree_mask", f"row {r} lacks its own bit {own[r]} (each row's mask holds itself and its ancestors)")


def check_key_positions_data(
    cache_lengths: Tensor, input_row_offsets: Tensor, key_positions: Tensor, causal: bool
) -> None:
    """A sparse `mla_attention` step: every entry of `key_positions` is -1 or a key its query may see
    (`0 <= pos <= p` at query position p; `< kv_len` when not causal)."""
    offsets = _host(input_row_offsets)
    new = np.diff(offsets)
    own = np.arange(offsets[-1], dtype=np.int64) - np.repeat(offsets[:-1], new)  # index among its sequence's new
    lengths = np.repeat(_host(cache_lengths), new)
    limit = lengths + own if causal else lengths + np.repeat(new, new) - 1  # the last key each query may see
    positions = _host(key_positions)
    bad = (positions < -1) | (positions > limit[:, None])
    if bad.any():
        r, i = (int(x) for x in np.argwhere(bad)[0])
        fail(
            "key_positions",
            f"row {r} lists position {positions[r, i]} (column {i}); its query may see positions 0..{limit[r]} "
            "(-1 for no key)",
        )


def check_copy_pages_data(blocks: Tensor, src_pages: Tensor, dst_pages: Tensor) -> None:
    num_pages = blocks.shape[0]
    dst = _host(dst_pages)
    for name, pages in (("src_pages", _host(src_pages)), ("dst_pages", dst)):
        bad = (pages < 0) | (pages >= num_pages)
        if bad.any():
            fail(name, f"page id {pages[np.flatnonzero(bad)[0]]} is outside blocks' {num_pages} pages")
    if (dst == NULL_PAGE).any():
        fail("dst_pages", f"lists the null page {NULL_PAGE}, which pads every table and must stay as it is")
    if np.unique(dst).size != dst.size:
        fail("dst_pages", "lists a page more than once; the result would be ambiguous")
