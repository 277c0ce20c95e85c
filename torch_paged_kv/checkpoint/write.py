"""`save_cache`: rows of a cache written through bounded host memory, atomically (temporary files,
fsync, rename), in shards of `shard_bytes` of page data."""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .._version import __version__
from ..collection import ContinuousBatchingKVCacheCollection, PagedKVCacheCollection
from ..layer_groups import LayerGroups
from ..params import TPShard, params_to_dict
from ..safetensors_stream import DTYPE_NAMES, SafetensorsWriter, TensorSpec, read_header
from .file_format import (
    DEFAULT_SHARD_BYTES,
    EXTRA_TENSORS_VERSION,
    FORMAT,
    CheckpointError,
    Collection,
    extra_name_error,
    group_prefix,
    paged_tensors,
    progress_bar,
)
from .plan import plan_save, selected_rows

Cache = Collection | LayerGroups


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def shard_name(path: Path, save_id: str, k: int, n: int) -> str:
    return f"{path.stem}-{save_id}-{k:05d}-of-{n:05d}{path.suffix or '.safetensors'}"


def _old_shards(path: Path) -> list[Path]:
    """Shard files of the checkpoint now at `path` that a save over it deletes once committed: those
    its header lists that are named exactly as a save to `path` names its shards (same directory,
    same save id), are plain files (not links), and whose own header names that save id. Anything
    else a (damaged or crafted) header lists is left alone."""
    try:
        metadata, _ = read_header(path)
        save_id = metadata.get("save_id", "")
        entries = json.loads(metadata.get("shards", "[]")) if metadata.get("format") == FORMAT else []
    except (OSError, ValueError, RecursionError):
        return []
    if not re.fullmatch(r"[0-9a-f]{8}", save_id) or not isinstance(entries, list):
        return []
    n = len(entries)
    names = {shard_name(path, save_id, k, n) for k in range(1, n + 1)}
    old = []
    for entry in entries:
        name = entry.get("file") if isinstance(entry, dict) else None
        shard = path.parent / name if name in names else None
        if shard is None or shard.is_symlink() or not shard.is_file():
            continue
        try:
            shard_metadata, _ = read_header(shard)
        except (OSError, ValueError):
            continue
        if shard_metadata.get("format") == FORMAT and shard_metadata.get("save_id") == save_id:
            old.append(shard)
    return old


Chunk = tuple[int, int, int, int]
"""Pages of one layer group stored as one piece: (group, first page, end page, piece number in the group)."""


def _pack_files(num_pages: list[int], page_bytes: list[int], shard_bytes: int) -> list[list[Chunk]]:
    """The pieces each file holds, in order: each group's stored pages (`num_pages[g]` of
    `page_bytes[g]` bytes) cut into pieces of at most `shard_bytes`, packed into files of at most
    `shard_bytes` (a piece of one page larger than that gets a file of its own)."""
    chunks: list[Chunk] = []
    for g, (n, nbytes) in enumerate(zip(num_pages, page_bytes, strict=True)):
        per_file = max(1, shard_bytes // nbytes) if nbytes else max(n, 1)
        chunks += [(g, a, min(n, a + per_file), k) for k, a in enumerate(range(0, n, per_file))]
    files: list[list[Chunk]] = [[]]
    for chunk in chunks:
        size = (chunk[2] - chunk[1]) * page_bytes[chunk[0]]
        used = sum((b - a) * page_bytes[g] for g, a, b, _ in files[-1])
        if files[-1] and used + size > shard_bytes:
            files.append([])
        files[-1].append(chunk)
    return files


def _host_extras(extra_tensors: dict[str, torch.Tensor] | None) -> list[tuple[str, torch.Tensor]]:
    """`extra_tensors` checked (names, tensors of a stored dtype), as contiguous CPU copies, by name."""
    if extra_tensors is None:
        return []
    if not isinstance(extra_tensors, dict):
        raise CheckpointError(f"extra_tensors: expected a dict of names to tensors, got {type(extra_tensors).__name__}")
    extras = []
    for name, tensor in sorted(extra_tensors.items()):
        why = extra_name_error(name)
        if why is not None:
            raise CheckpointError(f"extra_tensors: {why}")
        if not isinstance(tensor, torch.Tensor) or tensor.dtype not in DTYPE_NAMES:
            found = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise CheckpointError(
                f"extra_tensors: {name!r}: expected a tensor of {', '.join(map(str, DTYPE_NAMES))}, got {found}"
            )
        extras.append((name, tensor.detach().to("cpu", copy=True).contiguous()))
    return extras


def save_cache(
    cache: Cache,
    path: str | os.PathLike[str],
    *,
    batch_indices: list[int] | None = None,
    rows: tuple[torch.Tensor, Any] | None = None,
    metadata: dict[str, str] | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: bool | None = None,
    tp_shard: TPShard | None = None,
    extra_tensors: dict[str, torch.Tensor] | None = None,
) -> None:
    """Save rows `batch_indices` (default: every row, in order) of `cache` (a collection, or the
    collections of a `LayerGroups`) to `path`.

    The loaded cache's row i is saved row `batch_indices[i]`. Instead of the collection's own rows,
    `rows=(cache_lengths, lookup_table)` saves rows given explicitly (int32, the shapes of the
    collection's step tensors; for a `LayerGroups`, one lookup table per group), whose tables name
    pages of the pools (what `save_sequences` passes: its sequences are not rows of the
    collection). `metadata` (str -> str) is stored as user metadata. Page data beyond `shard_bytes`
    per file goes to shard files next to `path`, listed in `path`'s header. `tp_shard` records which
    KV heads of the model the collection holds (a tensor-parallel rank's; None: all; one group only).
    `extra_tensors` (names `extra.*` -> tensors) are stored in the main file beside the lengths and
    tables, checksummed, listed in the header (format version 5; `read_extra_tensors` reads them).
    A failed save leaves any checkpoint at `path` intact.
    """
    collections: list[Collection]
    layers: Sequence[Sequence[int]] | None
    if isinstance(cache, LayerGroups):
        collections, layers = list(cache.collections), cache.layers
    elif isinstance(cache, (PagedKVCacheCollection, ContinuousBatchingKVCacheCollection)):
        collections, layers = [cache], None
    else:
        raise CheckpointError(f"collection: expected a KV cache collection or LayerGroups, got {type(cache).__name__}")
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise CheckpointError("metadata: expected a dict of str to str")
    extras = _host_extras(extra_tensors)
    if shard_bytes <= 0:
        raise CheckpointError(f"shard_bytes: expected a positive int, got {shard_bytes}")
    if tp_shard is not None and len(collections) > 1:
        raise CheckpointError("tp_shard: a cache of several layer groups holds every head (one group only)")
    try:
        params_json = json.dumps(params_to_dict(collections[0].params, tp_shard))
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    selected, lengths, tables = selected_rows(collections, batch_indices, rows)
    plans = [plan_save(c, selected, lengths, table) for c, table in zip(collections, tables, strict=True)]
    first = collections[0]
    paged = [paged_tensors(c.params, g) for g, c in enumerate(collections)]
    streams = [
        [t.stream(c.params, plan.page_tokens, pool) for t, pool in zip(group, c.page_tensors(), strict=True)]
        for c, plan, group in zip(collections, plans, paged, strict=True)
    ]
    page_bytes = [sum(io.page_bytes for io in group) for group in streams]
    per_file_chunks = _pack_files([plan.source_pages.numel() for plan in plans], page_bytes, shard_bytes)
    files = len(per_file_chunks)
    total = sum(plan.source_pages.numel() * nbytes for plan, nbytes in zip(plans, page_bytes, strict=True))

    path = Path(path)
    save_id = uuid.uuid4().hex[:8]
    names = [path.name] + [shard_name(path, save_id, k, files - 1) for k in range(1, files)]
    version = EXTRA_TENSORS_VERSION if extras else EXTRA_TENSORS_VERSION - 1  # the lowest that describes it
    common = {"format": FORMAT, "format_version": str(version), "save_id": save_id}
    bar = progress_bar(progress, total, f"save {path.name}")
    index_device = [plan.source_pages.to(c.device) for plan, c in zip(plans, collections, strict=True)]
    written: list[Path] = []
    shard_entries: list[dict[str, Any]] = []

    def write_file(k: int, small: list[tuple[str, torch.Tensor]], file_metadata: dict[str, str]) -> dict[str, str]:
        specs = [TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in small]
        for g, a, b, piece in per_file_chunks[k]:
            p = collections[g].params
            for t in paged[g]:
                unit = (p.num_planes, p.num_layers, plans[g].page_tokens, *t.token_shape)
                specs.append(TensorSpec(t.piece(piece), t.dtype, (b - a, *unit)))
        temp = path.parent / f".{names[k]}.{save_id}.tmp"
        written.append(temp)
        with open(temp, "wb") as f:
            writer = SafetensorsWriter(f, specs, file_metadata)
            for _, tensor in small:
                writer.write(tensor)
            for g, a, b, _ in per_file_chunks[k]:
                for io in streams[g]:
                    io.write(writer, index_device[g][a:b], bar)
            checksums = writer.finish()
        final = path.parent / names[k]
        os.replace(temp, final)
        written[-1] = final
        return checksums

    old = _old_shards(path)
    try:
        for k in range(1, files):
            sums = write_file(k, [], {**common, "shard": f"{k}/{files - 1}"})
            shard_entries.append({"file": names[k], "checksums": sums})
        _fsync_dir(path.parent)
        main_metadata = {
            **common,
            "collection": plans[0].kind,
            "params": params_json,
            "max_seq_len": str(first.max_seq_len),
            "num_pages": str(plans[0].source_pages.numel()),
            "page_tokens": str(plans[0].page_tokens),
            "source_batch_indices": json.dumps(plans[0].rows),
            "shards": json.dumps(shard_entries),
            "user_metadata": json.dumps(metadata or {}),
            "torch_version": torch.__version__,
            "torch_paged_kv_version": __version__,
        }
        if layers is not None and len(collections) > 1:
            main_metadata["groups"] = json.dumps(
                [
                    {"params": c.params.to_dict(), "layers": list(group), "num_pages": plan.source_pages.numel()}
                    for c, group, plan in zip(collections, layers, plans, strict=True)
                ]
            )
        if extras:
            main_metadata["extra_tensors"] = json.dumps(
                {name: {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape)} for name, t in extras}
            )
        small = [("cache_lengths", plans[0].cache_lengths), ("lookup_table", plans[0].lookup_table)]
        small += [(f"{group_prefix(g)}lookup_table", plan.lookup_table) for g, plan in enumerate(plans) if g]
        small += extras
        write_file(0, small, main_metadata)
        written.clear()  # committed: the new checkpoint is at `path` now
        _fsync_dir(path.parent)
    except BaseException:
        for p in written:
            p.unlink(missing_ok=True)
        raise
    finally:
        bar.close()
    for p in old:
        if p.name not in names:
            p.unlink(missing_ok=True)
