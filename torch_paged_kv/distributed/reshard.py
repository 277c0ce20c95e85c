"""KV-state checkpoints across tensor-parallel sizes: each rank saves its heads, any size loads them.

Rank r of a tensor-parallel group saves its own file (`save_sequences(manager, shard_path(path,
manager.tp_shard), ids)`): an ordinary checkpoint whose `params` metadata carries the manager's `TPShard` (`tp_size`,
`tp_rank`, `kv_head_start`, `total_kv_heads`). Every rank's file holds the same lengths, tables and token ids
(the ranks' page decisions are identical) and its own heads of each page. Loading at another size
reads, for the heads the target holds, the files that hold them, and copies those head columns of
every stored page into the target's pages (each file is read whole: its checksums cover whole
tensors). Files that are not shards of one KV state, or do not cover the target's heads, are
refused with a `CheckpointError` saying why, before any page is allocated.
"""

from __future__ import annotations

import dataclasses
import math
import os
import zlib
from collections.abc import Sequence
from pathlib import Path

import torch

from ..checkpoint import CONTINUOUS, PAGED, CheckpointError, CheckpointInfo, check_allocation, read_info
from ..collection import ContinuousBatchingKVCacheCollection, PagedKVCacheCollection
from ..manager import KVCacheManager
from ..ops.quant import indexable
from ..page_stream import CHUNK_BYTES
from ..params import KVCacheParams, TPShard
from ..safetensors_stream import SafetensorsFormatError, format_crc, read_into
from ..sequence_checkpoint import saved_token_ids
from .tensor_parallel import shard_params, tp_shard, unshard_params

PathLike = str | os.PathLike[str]


def shard_path(path: PathLike, tp_shard: TPShard | None) -> Path:
    """Where rank `tp_shard.tp_rank` saves its shard of a checkpoint named `path`:
    `kv.safetensors` -> `kv.tp1-of-4.safetensors` (no shard, every head: `path` itself)."""
    path = Path(path)
    if tp_shard is None:
        return path
    return path.with_name(f"{path.stem}.tp{tp_shard.tp_rank}-of-{tp_shard.tp_size}{path.suffix or '.safetensors'}")


def _base(params: KVCacheParams) -> KVCacheParams:
    """`params` without its head count (what every shard of one cache shares)."""
    return dataclasses.replace(params, num_kv_heads=1)


def _heads(params: KVCacheParams, tp_shard: TPShard | None) -> tuple[range, int]:
    """The global KV heads a cache of `params` holding `tp_shard` has, and how many the model has."""
    if tp_shard is None:
        return range(params.num_kv_heads), params.num_kv_heads
    return tp_shard.kv_head_range(params.num_kv_heads), tp_shard.total_kv_heads


@dataclasses.dataclass
class _Source:
    info: CheckpointInfo
    file_heads: slice  # columns of the file's pages to read
    target_heads: slice  # where they go in the target's pages


def plan_shards(
    paths: Sequence[PathLike], target: KVCacheParams, target_shard: TPShard | None = None
) -> tuple[CheckpointInfo, list[_Source]]:
    """Check that `paths` are shards of one KV state covering the heads of a cache of `target`
    holding `target_shard`; returns the first file's info (lengths, tables, metadata) and, per file
    to read, which head columns go where."""
    paths = [Path(p) for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths)]
    if not paths:
        raise CheckpointError("paths: no checkpoint files given")
    infos = [read_info(p) for p in paths]
    first = infos[0]
    target_heads, total = _heads(target, target_shard)
    for info in infos:
        p = info.params
        if _base(p) != _base(target) or _heads(p, info.tp_shard)[1] != total:
            raise CheckpointError(
                f"{info.path}: a cache of {p} ({_describe(*_heads(p, info.tp_shard))}) does not fit the target "
                f"{target} ({_describe(target_heads, total)}) (only the KV heads a file holds may differ)"
            )
        if info.kind != first.kind:
            raise CheckpointError(f"{info.path}: a {info.kind} cache, {first.path} is {first.kind}")
        same = (
            info.max_seq_len == first.max_seq_len
            and info.num_pages == first.num_pages
            and info.page_tokens == first.page_tokens
            and info.cache_lengths == first.cache_lengths
            and torch.equal(info.lookup_table, first.lookup_table)
            and info.user_metadata == first.user_metadata
        )
        if not same:
            raise CheckpointError(
                f"{info.path} and {first.path} are not shards of one KV state "
                "(their lengths, lookup tables or token ids differ)"
            )
    sources: list[_Source] = []
    needed = set(target_heads)
    for info in infos:
        heads = _heads(info.params, info.tp_shard)[0]
        take = [h for h in heads if h in needed]
        if not take:
            continue
        # a contiguous run of this file's heads the target still needs
        lo, hi = take[0], take[-1] + 1
        if hi - lo != len(take):
            raise CheckpointError(f"{info.path}: heads {take} of it are needed, not a contiguous range")
        needed -= set(range(lo, hi))
        sources.append(
            _Source(
                info,
                slice(lo - heads.start, hi - heads.start),
                slice(lo - target_heads.start, hi - target_heads.start),
            )
        )
    if needed:
        held = ", ".join(f"{i.path.name}: {_describe(*_heads(i.params, i.tp_shard))}" for i in infos)
        raise CheckpointError(
            f"KV heads {sorted(needed)} of the target ({_describe(target_heads, total)}) are in none of the files "
            f"({held})"
        )
    return first, sources


def _describe(heads: range, total: int) -> str:
    return f"heads {heads.start}..{heads.stop - 1} of {total}"


def _paged_tensors(params: KVCacheParams) -> list[tuple[str, torch.dtype, int]]:
    """(name, dtype, last dim) of the tensors a file stores per page: `blocks`, and the per-granule
    `scales` of an FP8 cache; both `[pages, planes, layers, page_tokens, kv_heads, last dim]`."""
    tensors = [("blocks", params.dtype, params.head_dim)]
    if params.has_scales_tensor:
        assert params.scale_dtype is not None  # (KVCacheParams sets it for a scales tensor)
        tensors.append(("scales", params.scale_dtype, params.scales_per_head))
    return tensors


def _stream_heads(source: _Source, pools: list[torch.Tensor], pages: torch.Tensor) -> None:
    """Copy the head columns `source.file_heads` of every stored page of one file into
    `pool[pages[j], ..., source.target_heads, :]` of each pool (`blocks`, then `scales`; stored page
    j + 1 -> `pages[j]`), reading whole pages in chunks and checking every tensor's CRC-32 (a
    mismatch raises after some pages were written: only pages in `pages` are touched)."""
    info = source.info
    p = info.params
    for (name, dtype, last), pool in zip(_paged_tensors(p), pools, strict=True):
        unit = (p.num_planes, p.num_layers, info.page_tokens, p.num_kv_heads, last)
        itemsize = torch.empty((), dtype=dtype).element_size()
        page_bytes = math.prod(unit) * itemsize
        per_chunk = max(1, CHUNK_BYTES // max(page_bytes, 1))
        host = torch.empty(min(info.num_pages, per_chunk) * math.prod(unit), dtype=dtype)  # one chunk, reused
        target = indexable(pool)  # FP8 as bytes: torch has no FP8 index_put
        first = 0
        for piece in sorted(n for n in info.tensor_files if n.startswith(name + ".")):
            start, end = info.tensor_offsets[piece]
            count = (end - start) // page_bytes
            crc = 0
            with open(info.tensor_files[piece], "rb") as f:
                for a in range(0, count, per_chunk):
                    n = min(per_chunk, count - a)
                    chunk = host[: n * math.prod(unit)].view(n, *unit)
                    try:
                        read_into(f, start + a * page_bytes, chunk)
                    except SafetensorsFormatError as exc:  # cut short since its header was read
                        raise CheckpointError(f"{info.tensor_files[piece]}: {exc}") from None
                    crc = zlib.crc32(chunk.view(torch.uint8).numpy().data.cast("B"), crc)
                    index = pages[first + a : first + a + n].to(pool.device)
                    columns = indexable(chunk)[:, :, :, :, source.file_heads].to(pool.device)
                    target[index, :, :, : info.page_tokens, source.target_heads] = columns
            if format_crc(crc) != info.checksums[piece]:
                raise CheckpointError(
                    f"{info.tensor_files[piece]}: checksum mismatch in tensor {piece!r} "
                    f"(stored {info.checksums[piece]}, computed {format_crc(crc)})"
                )
            first += count


def _fill(sources: list[_Source], pools: list[torch.Tensor], pages: torch.Tensor) -> None:
    for source in sources:
        _stream_heads(source, pools, pages)


def load_sharded(manager: KVCacheManager, paths: Sequence[PathLike], seq_ids: Sequence | None = None) -> list:
    """Add the sequences of a checkpoint saved as shards (any tensor-parallel size) to `manager`,
    reading the KV heads its cache holds (`manager.tp_shard`); returns their ids (`seq_ids`, else `("loaded", n)`).

    All or nothing, through `KVCacheManager.reserve`: mismatched or incomplete files raise
    `CheckpointError` before anything is allocated, too few pages `OutOfPagesError`, a checksum
    error while streaming `CheckpointError` with the manager as before."""
    c = manager.collection
    info, sources = plan_shards(paths, c.params, manager.tp_shard)
    if info.kind != PAGED:
        raise CheckpointError(f"{info.path}: a {info.kind} cache does not load into a paged manager")
    if max(info.cache_lengths) > c.max_seq_len:
        raise CheckpointError(f"{info.path}: a sequence of {max(info.cache_lengths)} tokens exceeds {c.max_seq_len}")
    batch = len(info.cache_lengths)
    ids = manager.fresh_ids(batch) if seq_ids is None else list(seq_ids)
    if len(ids) != batch:
        raise ValueError(f"seq_ids: the checkpoint holds {batch} sequences, got {len(ids)} ids")
    manager.check_new_ids(ids)
    tokens = saved_token_ids(info.path, info, c.max_seq_len)
    rows = [[j - 1 for j in info.lookup_table[b, :per_row].tolist()] for b, per_row in enumerate(info.pages_per_row())]
    try:
        reservation = manager.reserve(ids, info.cache_lengths, rows, token_ids=tokens)
    except CheckpointError:
        raise
    except ValueError as exc:  # the ids were checked above: what reserve refuses is the files'
        raise CheckpointError(f"{info.path}: {exc}") from None
    with reservation:
        order = torch.empty(info.num_pages, dtype=torch.long)  # stored page j + 1 -> order[j]
        order[torch.tensor(reservation.incoming, dtype=torch.long)] = torch.tensor(reservation.pages, dtype=torch.long)
        _fill(sources, c.page_tensors(), order)
        reservation.commit()
    return ids


def load_cache_sharded(
    paths: Sequence[PathLike],
    *,
    tp_size: int = 1,
    tp_rank: int = 0,
    device: torch.device | str | None = None,
) -> PagedKVCacheCollection | ContinuousBatchingKVCacheCollection:
    """`checkpoint.load_cache` for shards: a new collection holding rank `tp_rank`'s heads of a
    group of `tp_size` (default: every head; `tensor_parallel.tp_shard` says which they are), read
    from the shard files `paths`."""
    first = read_info(Path(paths[0]) if not isinstance(paths, (str, os.PathLike)) else Path(paths))
    full = unshard_params(first.params, first.tp_shard)
    target = shard_params(full, tp_size, tp_rank)
    info, sources = plan_shards(paths, target, tp_shard(full, tp_size, tp_rank))
    check_allocation(info, target, device)
    batch = len(info.cache_lengths)
    collection: PagedKVCacheCollection | ContinuousBatchingKVCacheCollection
    if info.kind == CONTINUOUS:
        collection = ContinuousBatchingKVCacheCollection(target, batch, info.max_seq_len, device)
    else:
        collection = PagedKVCacheCollection(target, max(1, info.num_pages), batch, info.max_seq_len, device)
    _fill(sources, collection.page_tensors(), torch.arange(1, info.num_pages + 1))
    collection.cache_lengths.copy_(torch.tensor(info.cache_lengths, dtype=torch.int32))
    collection.lookup_table.copy_(info.lookup_table)
    return collection
