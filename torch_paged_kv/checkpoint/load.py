"""Reading page data: `verify`, `load_pages` (into a live pool) and `load_cache` (into a new cache)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from .. import layout
from ..collection import ContinuousBatchingKVCacheCollection, PagedKVCacheCollection
from ..layer_groups import LayerGroups
from ..params import KVCacheParams
from ..safetensors_stream import SafetensorsFormatError
from .file_format import CONTINUOUS, PAGED, CheckpointError, Collection, paged_tensors, progress_bar
from .info import CheckpointInfo
from .read import read_extra_tensors, read_info, verify_checksum


def _stream_pages(
    info: CheckpointInfo,
    pools: list[torch.Tensor] | None,
    pages: torch.Tensor | None,
    progress: bool | None,
    group: int = 0,
) -> None:
    """Read every page tensor of layer group `group` in chunks and verify its checksum; stored page j
    (from 0) goes to page `pages[j]` of each pool (`blocks`, then an FP8 cache's `scales`) when `pools`
    is given."""
    g = info.groups[group]
    paged = paged_tensors(g.params, group)
    targets: list[torch.Tensor | None] = [None] * len(paged) if pools is None else list(pools)
    streams = [t.stream(g.params, info.page_tokens, pool) for t, pool in zip(paged, targets, strict=True)]
    total = g.num_pages * sum(io.page_bytes for io in streams)
    bar = progress_bar(progress, total, f"load {info.path.name}")
    try:
        for t, io in zip(paged, streams, strict=True):
            first = 0
            for name in sorted(n for n in info.tensor_files if n.rsplit(".", 1)[0] == t.name):
                path = info.tensor_files[name]
                start, end = info.tensor_offsets[name]
                count = (end - start) // io.page_bytes if io.page_bytes else 0
                ids = None if pages is None else pages[first : first + count]
                with open(path, "rb") as f:
                    try:
                        crc = io.read(f, start, ids, count, bar)
                    except SafetensorsFormatError as exc:  # cut short since its header was read
                        raise CheckpointError(f"{path}: {exc}") from None
                verify_checksum(name, crc, info.checksums, path)
                first += count
    finally:
        bar.close()


def verify(path: str | os.PathLike[str], *, progress: bool | None = None) -> CheckpointInfo:
    """Check every header and every tensor checksum; returns the info or raises CheckpointError."""
    info = read_info(path)
    read_extra_tensors(info)
    for group in range(len(info.groups)):
        _stream_pages(info, None, None, progress, group)
    return info


def load_pages(
    path: str | os.PathLike[str],
    blocks: torch.Tensor,
    pages: list[int] | torch.Tensor,
    *,
    scales: torch.Tensor | None = None,
    progress: bool | None = None,
    group: int = 0,
    info: CheckpointInfo | None = None,
) -> CheckpointInfo:
    """Stream the stored pages of a checkpoint (of its layer group `group`) into an existing pool:
    stored page j + 1 (the id in the file's lookup table) goes to `blocks[pages[j]]` (and
    `scales[pages[j]]` for a per-granule FP8 cache), through bounded host memory.

    For restoring into a live cache: `blocks` (and `scales`) must match the group's params (else
    `CheckpointError`); `pages` must be distinct, in range, and the group's `num_pages` long.
    A continuous-batching file writes only its first `page_tokens` tokens of each slot. A checksum
    error can come after some pages were written: only pages in `pages` are ever touched. `info`:
    `read_info(path)` if the caller has it already (the headers are read once).
    """
    info = read_info(path) if info is None else info
    if not isinstance(group, int) or not 0 <= group < len(info.groups):
        raise ValueError(f"group: expected a layer group of the file, 0..{len(info.groups) - 1}, got {group!r}")
    g = info.groups[group]
    p = g.params
    pools: list[torch.Tensor] = []
    for t, pool in zip(paged_tensors(p, group), (blocks, scales), strict=False):  # `scales`: only a scales tensor's
        expected = (p.num_planes, p.num_layers, p.page_size, *t.token_shape)
        if (
            pool is None
            or tuple(pool.shape[1:]) != expected
            or pool.dtype != t.dtype
            or pool.shape[0] != blocks.shape[0]
        ):
            found = "none" if pool is None else f"{pool.dtype}{list(pool.shape)}"
            raise CheckpointError(f"{path}: params {p} do not fit the target {t.name} ({found})")
        pools.append(pool)
    ids = torch.as_tensor(pages, dtype=torch.int64).cpu().reshape(-1)
    if (
        ids.numel() != g.num_pages
        or ids.unique().numel() != ids.numel()
        or bool(((ids <= layout.NULL_PAGE) | (ids >= blocks.shape[0])).any())
    ):
        raise ValueError(
            f"pages: expected {g.num_pages} distinct ids in 1..{blocks.shape[0] - 1} "
            f"(never the null page {layout.NULL_PAGE}), got {ids.tolist()}"
        )
    _stream_pages(info, pools, ids, progress, group)
    return info


def _device_memory(device: torch.device) -> int | None:
    """Total memory of `device` (the host's RAM for the CPU), or None where unknown."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None
    return None


def check_allocation(info: CheckpointInfo, params: KVCacheParams, device: torch.device | str | None) -> None:
    """Refuse, before allocating, a collection of `params` for `info`'s rows (what `load_cache` builds;
    with the file's other layer groups) larger than the memory of `device`: a small file may declare
    any params and `max_seq_len`."""
    if info.kind == PAGED:
        sizes = [(max(1, g.num_pages) + 1, g.params) for g in info.groups[1:]]
        sizes.insert(0, (max(1, info.num_pages) + 1, params))
        field = "params"
    else:
        sizes, field = [(len(info.cache_lengths) + 1, params)], "max_seq_len"
    nbytes = sum(pages * p.page_bytes for pages, p in sizes)
    device = torch.device(device if device is not None else "cpu")
    memory = _device_memory(device)
    if memory is not None and nbytes > memory:
        raise CheckpointError(
            f"{info.path}: metadata field {field!r}: the {info.kind} collection it describes needs {nbytes} "
            f"bytes, more than the {memory} bytes of memory of {device}"
        )


def load_cache(
    path: str | os.PathLike[str],
    *,
    device: torch.device | str | None = None,
    progress: bool | None = None,
    expected_params: KVCacheParams | list[KVCacheParams] | None = None,
) -> Collection | LayerGroups:
    """Load a checkpoint into a new collection of the saved kind on `device` (default CPU); a file
    of several layer groups into a new `LayerGroups` (one collection per group).

    Row i is the i-th saved row; pages are `1..num_pages` of each group (at least one page is
    allocated); `input_row_offsets` are zeros. `expected_params` (a list, one per group, for a file of
    several) makes a mismatch a `CheckpointError`, before anything is allocated: without it the file's
    params (and, for continuous batching, its `max_seq_len`) size the collection, refused only when it
    exceeds the device's memory. A tensor-parallel rank's file loads as a cache of the heads it holds
    (`read_info(path).tp_shard` says which; `distributed.reshard` loads shards at any size).
    """
    info = read_info(path)
    saved = [g.params for g in info.groups]
    if expected_params is not None:
        expected = [expected_params] if isinstance(expected_params, KVCacheParams) else list(expected_params)
        if expected != saved:
            mine = saved[0] if len(saved) == 1 else saved
            raise CheckpointError(f"{path}: params {mine} do not fit the target {expected_params}")
    check_allocation(info, info.params, device)
    batch = len(info.cache_lengths)
    if info.kind == CONTINUOUS:
        collection = ContinuousBatchingKVCacheCollection(info.params, batch, info.max_seq_len, device)
        _fill(info, [collection], progress)
        return collection
    paged = [
        PagedKVCacheCollection(g.params, max(1, g.num_pages), batch, info.max_seq_len, device) for g in info.groups
    ]
    _fill(info, paged, progress)
    return paged[0] if len(paged) == 1 else LayerGroups(paged, [g.layers for g in info.groups])


def _fill(info: CheckpointInfo, collections: Sequence[Collection], progress: bool | None) -> None:
    """Stream every layer group's pages into pages `1..num_pages` of its new collection; set the rows."""
    lengths = torch.tensor(info.cache_lengths, dtype=torch.int32)
    for group, (c, g) in enumerate(zip(collections, info.groups, strict=True)):
        _stream_pages(info, c.page_tensors(), torch.arange(1, g.num_pages + 1), progress, group)
        c.cache_lengths.copy_(lengths)
        c.lookup_table.copy_(g.lookup_table)
