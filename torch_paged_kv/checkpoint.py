"""KV-state checkpoints in safetensors: `save_cache`, `load_cache`, `load_pages`, `read_info`, `verify`.

Only the pages the saved rows use are stored, compacted and renumbered `1..n` in first-use order
(shared pages once, and still shared after load), per layer group for a cache of several
(`LayerGroups`). Files are written through bounded host memory (`page_stream.PageStream`),
atomically (temporary files, fsync, rename), and split into shards of `shard_bytes` of page data.
See docs/checkpoints.md for the format.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import uuid
import warnings
import weakref
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from . import layout
from ._version import __version__
from .collection import ContinuousBatchingKVCacheCollection, PagedKVCacheCollection
from .layer_groups import LayerGroups
from .page_stream import PageStream
from .params import KVCacheParams, TPShard, params_from_dict, params_to_dict
from .safetensors_stream import (
    CHECKSUM_KEY,
    DTYPE_NAMES,
    HEADER_CHECKSUM_KEY,
    SafetensorsFormatError,
    SafetensorsWriter,
    TensorSpec,
    format_crc,
    read_header,
    read_into,
)

FORMAT = "torch_paged_kv.kv_cache"
FORMAT_VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)
"""Version 2 added FP8 caches (quantization fields in `params`, `scales.*` page tensors); version 3 a
checksum of every file's header (`header_checksum`); version 4 layer groups (`groups` metadata,
`groups.<g>.*` tensors) and sliding-window params (`sliding_window`: table entries below a row's
window are the null page). Files of versions 1 and 2 read as they always did, with an
`UnverifiedMetadataWarning`; a file of one group without a window reads as version 3 did."""
VERIFIED_METADATA_VERSION = 3
"""The first format version whose headers are checksummed."""
DEFAULT_SHARD_BYTES = 4 << 30
PROGRESS_MIN_BYTES = 512 << 20
PAGED, CONTINUOUS = "paged", "continuous_batching"

Collection = PagedKVCacheCollection | ContinuousBatchingKVCacheCollection
Cache = Collection | LayerGroups


_DRIVERS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def mark_driven(collection: Collection, how_to_save: str) -> None:
    """Record that something else (a `KVCacheManager`) owns `collection`'s state: its step tensors
    then hold the rows of the last prepared step, not sequences, and `save_cache` refuses to save
    them (explicit `rows=` still save); `how_to_save` is what its error message points to."""
    _DRIVERS[collection] = how_to_save


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read; the message says what is wrong."""


class UnverifiedMetadataWarning(UserWarning):
    """A checkpoint of a format version before 3: nothing checksums its metadata (params, token ids,
    shard list), so damage there goes unnoticed. Saving it again writes a verified file."""


@dataclass
class _Plan:
    """What a save stores: compacted tables and the source pages in stored order."""

    kind: str
    rows: list[int]
    cache_lengths: torch.Tensor  # int32 [B], CPU
    lookup_table: torch.Tensor  # int32 [B, W] or [B], CPU, renumbered
    source_pages: torch.Tensor  # int64 [n], physical ids in the source, stored order
    page_tokens: int  # tokens stored per page (CB slots: the longest saved length)


def _first_use_order(used: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique values of `used` in first-appearance order, and each entry's rank among them."""
    uniq, inverse = torch.unique(used, return_inverse=True)
    first = torch.full((uniq.numel(),), used.numel(), dtype=torch.int64)
    first.scatter_reduce_(0, inverse, torch.arange(used.numel()), "amin")
    order = torch.argsort(first)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel())
    return uniq[order], rank[inverse]


def _selected_rows(
    collections: list[Collection],
    batch_indices: list[int] | None,
    rows: tuple[torch.Tensor, Any] | None,
) -> tuple[list[int], torch.Tensor, list[torch.Tensor]]:
    """(source row numbers, cache_lengths, each group's lookup_table) of what a save stores, on the CPU."""
    driven = [c for c in collections if c in _DRIVERS]
    if rows is None and driven:
        raise CheckpointError(
            f"collection: its rows are the step tensors of the manager that drives it (the last prepared "
            f"step, lengths from before that step), not the sequences' state: save with {_DRIVERS[driven[0]]}"
        )
    if rows is not None:
        if batch_indices is not None:
            raise CheckpointError("rows: pass either batch_indices or rows, not both")
        lengths, tables = rows
        tables = [tables] if len(collections) == 1 else list(tables)
        if len(tables) != len(collections):
            raise CheckpointError(f"rows: expected {len(collections)} lookup tables (one per layer group)")
        lengths, tables = torch.as_tensor(lengths).cpu(), [torch.as_tensor(t).cpu() for t in tables]
        for c, table in zip(collections, tables, strict=True):
            width = c.lookup_table.shape[1:]
            shape_ok = lengths.dim() == 1 and tuple(table.shape) == (lengths.shape[0], *width)
            if lengths.dtype != torch.int32 or table.dtype != torch.int32 or not shape_ok:
                want = f"[B, {width[0]}]" if width else "[B]"
                raise CheckpointError(
                    f"rows: expected int32 cache_lengths [B] and lookup_table {want}, "
                    f"got {lengths.dtype}{list(lengths.shape)} and {table.dtype}{list(table.shape)}"
                )
        if not lengths.numel():
            raise CheckpointError("rows: nothing to save (empty)")
        return list(range(lengths.shape[0])), lengths, tables
    first = collections[0]
    selected = list(range(first.max_batch_size)) if batch_indices is None else [int(b) for b in batch_indices]
    if not selected:
        raise CheckpointError("batch_indices: nothing to save (empty)")
    if len(set(selected)) != len(selected) or not all(0 <= b < first.max_batch_size for b in selected):
        raise CheckpointError(f"batch_indices: expected distinct rows in 0..{first.max_batch_size - 1}, got {selected}")
    index = torch.tensor(selected)
    return selected, first.cache_lengths.cpu()[index], [c.lookup_table.cpu()[index] for c in collections]


def _plan(collection: Collection, rows: list[int], lengths: torch.Tensor, table: torch.Tensor) -> _Plan:
    if bool((lengths < 0).any()) or bool((lengths > collection.max_seq_len).any()):
        raise CheckpointError(f"cache_lengths: expected 0..{collection.max_seq_len}, got {lengths.tolist()}")
    page_size = collection.params.page_size
    continuous = isinstance(collection, ContinuousBatchingKVCacheCollection)
    if continuous:
        mask = lengths > 0  # slots in use
        new_table = torch.zeros_like(table)
    else:
        positions = torch.arange(table.shape[1])
        first = torch.tensor([collection.params.first_held_page(n) for n in lengths.tolist()], dtype=torch.int64)
        mask = (positions[None, :] < ((lengths + page_size - 1) // page_size)[:, None]) & (
            positions[None, :] >= first[:, None]
        )  # a sliding-window group holds no page below its window: those entries stay the null page
        new_table = torch.full_like(table, layout.NULL_PAGE)
    used = table[mask].to(torch.int64)
    if bool(((used <= layout.NULL_PAGE) | (used >= collection.num_physical_pages)).any()):
        raise CheckpointError(f"lookup_table: rows {rows} use page ids outside 1..{collection.num_physical_pages - 1}")
    source_pages, rank = _first_use_order(used)
    new_table[mask] = (rank + 1).to(torch.int32)
    if not continuous:
        return _Plan(PAGED, rows, lengths, new_table, source_pages, page_size)
    free = ~mask  # CB rows without tokens still need a slot of their own
    new_table[free] = torch.arange(
        source_pages.numel() + 1, source_pages.numel() + 1 + int(free.sum()), dtype=torch.int32
    )
    page_tokens = int(lengths.max()) if source_pages.numel() else 0
    return _Plan(CONTINUOUS, rows, lengths, new_table, source_pages, page_tokens)


@dataclass(frozen=True)
class _PagedTensor:
    """A pool tensor indexed by page, as files store it: `<name>.<k>` pieces of whole pages."""

    name: str  # "blocks", or "scales" for a per-granule FP8 cache
    dtype: torch.dtype
    token_shape: tuple[int, ...]  # per token, layer and plane: (kv_heads, head_dim) or (kv_heads, groups)

    def piece(self, k: int) -> str:
        return f"{self.name}.{k:05d}"

    def stream(self, params: KVCacheParams, page_tokens: int, pool: torch.Tensor | None) -> PageStream:
        token_bytes = math.prod(self.token_shape) * torch.empty((), dtype=self.dtype).element_size()
        return PageStream(params.num_planes, params.num_layers, token_bytes, page_tokens, pool)


def group_prefix(group: int) -> str:
    """What the names of layer group `group`'s tensors start with: nothing for group 0 (the names of a
    file of one group), `groups.<g>.` for the others."""
    return "" if group == 0 else f"groups.{group}."


def _paged_tensors(params: KVCacheParams, group: int = 0) -> list[_PagedTensor]:
    """`blocks`, then the per-granule `scales` of an FP8 cache (static scales live in `params`), of
    layer group `group`."""
    prefix = group_prefix(group)
    tensors = [_PagedTensor(prefix + "blocks", params.dtype, (params.num_kv_heads, params.head_dim))]
    if params.has_scales_tensor:
        tensors.append(
            _PagedTensor(prefix + "scales", params.scale_dtype, (params.num_kv_heads, params.scales_per_head))
        )
    return tensors


def _show_progress(progress: bool | None, total: int) -> bool:
    return progress if progress is not None else total >= PROGRESS_MIN_BYTES and sys.stderr.isatty()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _shard_name(path: Path, save_id: str, k: int, n: int) -> str:
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
    names = {_shard_name(path, save_id, k, n) for k in range(1, n + 1)}
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
    A failed save leaves any checkpoint at `path` intact.
    """
    if isinstance(cache, LayerGroups):
        collections, layers = list(cache.collections), cache.layers
    elif isinstance(cache, (PagedKVCacheCollection, ContinuousBatchingKVCacheCollection)):
        collections, layers = [cache], None
    else:
        raise CheckpointError(f"collection: expected a KV cache collection or LayerGroups, got {type(cache).__name__}")
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise CheckpointError("metadata: expected a dict of str to str")
    if shard_bytes <= 0:
        raise CheckpointError(f"shard_bytes: expected a positive int, got {shard_bytes}")
    if tp_shard is not None and len(collections) > 1:
        raise CheckpointError("tp_shard: a cache of several layer groups holds every head (one group only)")
    try:
        params_json = json.dumps(params_to_dict(collections[0].params, tp_shard))
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    selected, lengths, tables = _selected_rows(collections, batch_indices, rows)
    plans = [_plan(c, selected, lengths, table) for c, table in zip(collections, tables, strict=True)]
    first = collections[0]
    paged = [_paged_tensors(c.params, g) for g, c in enumerate(collections)]
    streams = [
        [t.stream(c.params, plan.page_tokens, pool) for t, pool in zip(group, c.page_tensors(), strict=True)]
        for c, plan, group in zip(collections, plans, paged, strict=True)
    ]
    page_bytes = [sum(io.page_bytes for io in group) for group in streams]
    chunks: list[tuple[int, int, int, int]] = []  # (group, first page, end page, piece number in the group)
    for g, (plan, nbytes) in enumerate(zip(plans, page_bytes, strict=True)):
        n = plan.source_pages.numel()
        per_file = max(1, shard_bytes // nbytes) if nbytes else max(n, 1)
        chunks += [(g, a, min(n, a + per_file), k) for k, a in enumerate(range(0, n, per_file))]
    per_file_chunks: list[list[tuple[int, int, int, int]]] = [[]]  # chunks packed into files in order
    for chunk in chunks:
        size = (chunk[2] - chunk[1]) * page_bytes[chunk[0]]
        used = sum((b - a) * page_bytes[g] for g, a, b, _ in per_file_chunks[-1])
        if per_file_chunks[-1] and used + size > shard_bytes:
            per_file_chunks.append([])
        per_file_chunks[-1].append(chunk)
    files = len(per_file_chunks)
    total = sum(plan.source_pages.numel() * nbytes for plan, nbytes in zip(plans, page_bytes, strict=True))

    path = Path(path)
    save_id = uuid.uuid4().hex[:8]
    names = [path.name] + [_shard_name(path, save_id, k, files - 1) for k in range(1, files)]
    common = {"format": FORMAT, "format_version": str(FORMAT_VERSION), "save_id": save_id}
    bar = tqdm(
        total=total, unit="B", unit_scale=True, desc=f"save {path.name}", disable=not _show_progress(progress, total)
    )
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
            for _, t in small:
                writer.write(t)
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
        small = [("cache_lengths", plans[0].cache_lengths), ("lookup_table", plans[0].lookup_table)]
        small += [(f"{group_prefix(g)}lookup_table", plan.lookup_table) for g, plan in enumerate(plans) if g]
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


@dataclass(frozen=True)
class GroupInfo:
    """One layer group of a checkpoint: its params, the model layers it holds, how many pages it
    stores and its lookup table (stored page ids `1..num_pages`; the null page where a row holds
    none: past its length, or below a sliding window)."""

    params: KVCacheParams
    layers: tuple[int, ...]
    num_pages: int
    lookup_table: torch.Tensor


@dataclass
class CheckpointInfo:
    """What a checkpoint's headers, lengths and tables say (page data not read). `params`,
    `num_pages` and `lookup_table` are layer group 0's; `groups` lists every group (one for a file
    of one collection)."""

    path: Path
    params: KVCacheParams
    kind: str
    max_seq_len: int
    num_pages: int
    page_tokens: int
    cache_lengths: list[int]
    lookup_table: torch.Tensor
    files: list[Path]
    checksums: dict[str, str]  # tensor name -> stored checksum, every file
    tensor_files: dict[str, Path]  # tensor name -> file holding it
    tensor_offsets: dict[str, tuple[int, int]]  # tensor name -> byte range in its file
    metadata: dict[str, str]  # the main file's raw header metadata
    tp_shard: TPShard | None = None  # the KV heads of the model the file holds (None: all)
    groups: list[GroupInfo] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.groups:
            layers = tuple(range(self.params.num_layers))
            self.groups = [GroupInfo(self.params, layers, self.num_pages, self.lookup_table)]

    @property
    def user_metadata(self) -> dict[str, str]:
        return json.loads(self.metadata.get("user_metadata", "{}"))

    def pages_per_row(self) -> list[int]:
        """Table entries each saved row spans (the pages it uses, in a group without a window)."""
        if self.kind == CONTINUOUS:
            return [1 if n > 0 else 0 for n in self.cache_lengths]
        return [-(-n // self.params.page_size) for n in self.cache_lengths]

    def first_held_per_row(self, group: int = 0) -> list[int]:
        """The first table entry each saved row holds a page in, in layer group `group`
        (`KVCacheParams.first_held_page`: 0 without a sliding window)."""
        params = self.groups[group].params
        return [0 if self.kind == CONTINUOUS else params.first_held_page(n) for n in self.cache_lengths]

    def stored_rows(self, group: int = 0) -> list[list[int]]:
        """Each row's table entries in layer group `group` as stored pages `0..num_pages-1` (the id in
        the table less one), -1 where the row holds none (below a sliding window)."""
        table = self.groups[group].lookup_table.reshape(len(self.cache_lengths), -1)
        firsts = self.first_held_per_row(group)
        return [
            [-1] * first + [j - 1 for j in table[b, first:n].tolist()]
            for b, (n, first) in enumerate(zip(self.pages_per_row(), firsts, strict=True))
        ]


def _header(path: Path, what: str) -> tuple[dict[str, str], dict[str, dict]]:
    if not path.is_file():
        raise CheckpointError(f"{path}: missing {what}")
    try:
        return read_header(path)
    except SafetensorsFormatError as exc:
        raise CheckpointError(f"{path}: {exc}") from None


def _check_format(path: Path, metadata: dict[str, str]) -> int:
    """The file's format version, after checking it is ours, readable, and (version 3 on) checksummed."""
    if metadata.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a torch_paged_kv checkpoint (format {metadata.get('format')!r})")
    version = metadata.get("format_version")
    if version not in [str(v) for v in READABLE_VERSIONS]:
        raise CheckpointError(
            f"{path}: unknown format version {version!r} "
            f"(this library reads versions {', '.join(map(str, READABLE_VERSIONS))})"
        )
    if int(version) >= VERIFIED_METADATA_VERSION and HEADER_CHECKSUM_KEY not in metadata:
        raise CheckpointError(f"{path}: metadata field {HEADER_CHECKSUM_KEY!r} is missing (format version {version})")
    return int(version)


_CRC = re.compile(r"crc32:[0-9a-f]{8}")


def _count(text: str) -> int:
    if not re.fullmatch(r"[0-9]{1,18}", text):  # below 2**63: compared with int64 tensors
        raise ValueError(f"expected a non-negative integer below 10**18, got {text[:40]!r}")
    return int(text)


def _json(text: str, kind: type) -> Any:
    value = json.loads(text)
    if not isinstance(value, kind):
        raise ValueError(f"expected a JSON {kind.__name__}, got {type(value).__name__}")
    return value


def _params(text: str) -> tuple[KVCacheParams, TPShard | None]:
    return params_from_dict(_json(text, dict))


def _checksums(value: Any) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(v, str) and _CRC.fullmatch(v) for v in value.values()):
        raise ValueError('expected an object of "crc32:xxxxxxxx" strings')
    return value


def _strings(text: str) -> dict[str, str]:
    value = _json(text, dict)
    if not all(isinstance(v, str) for v in value.values()):
        raise ValueError("expected an object of strings")
    return value


def _row_numbers(text: str) -> list[int]:
    value = _json(text, list)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise ValueError("expected a list of row numbers")
    return value


def _shard_list(text: str) -> list[tuple[str, dict[str, str]]]:
    """(file name, checksums) of each listed shard: plain names of files beside the main file."""
    shards = []
    for entry in _json(text, list):
        name = entry.get("file") if isinstance(entry, dict) else None
        if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name or "\\" in name:
            raise ValueError(
                f"expected entries {{'file': a file name beside the main file, 'checksums': ...}}, got {entry!r:.80}"
            )
        shards.append((name, _checksums(entry.get("checksums"))))
    return shards


def _group_list(text: str) -> list[tuple[KVCacheParams, tuple[int, ...], int]]:
    """(params, model layers, stored pages) of each layer group."""
    groups = []
    for entry in _json(text, list):
        if not isinstance(entry, dict) or set(entry) != {"params", "layers", "num_pages"}:
            raise ValueError(f"expected entries {{'params': ..., 'layers': [...], 'num_pages': n}}, got {entry!r:.80}")
        layers = entry["layers"]
        if not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
            raise ValueError(f"'layers': expected a list of layer numbers, got {layers!r:.80}")
        params = KVCacheParams.from_dict(_json(json.dumps(entry["params"]), dict))
        groups.append((params, tuple(layers), _count(str(entry["num_pages"]))))
    return groups


def _check_groups(
    path: Path,
    version: int,
    groups: list[tuple[KVCacheParams, tuple[int, ...], int]],
    params: KVCacheParams,
    num_pages: int,
    kind: str,
    tp_shard: TPShard | None,
) -> None:
    """The layer groups of a version 4 file agree with each other and with the fields of group 0."""

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: metadata field 'groups': {what}")

    if version < 4 or kind != PAGED or tp_shard is not None:
        raise bad("layer groups are a paged cache's of every KV head, from format version 4 on")
    if len(groups) < 2 or groups[0][0] != params or groups[0][2] != num_pages:
        raise bad("expected two or more groups, the first one the file's 'params' and 'num_pages'")
    layers = sorted(i for _, group, _ in groups for i in group)
    if layers != list(range(len(layers))) or any(len(group) != p.num_layers for p, group, _ in groups):
        raise bad("the groups must hold model layers 0..n-1, each once, as many as their params' num_layers")
    if any(p.page_size != params.page_size for p, _, _ in groups):
        raise bad(f"every group has page_size={params.page_size}")


def _field(path: Path, metadata: dict[str, str], key: str, parse: Any) -> Any:
    """`parse(metadata[key])`, any failure a CheckpointError naming the file and the field."""
    if key not in metadata:
        raise CheckpointError(f"{path}: metadata field {key!r} is missing")
    try:
        return parse(metadata[key])
    except (ValueError, TypeError, AttributeError, OverflowError, RecursionError) as exc:
        raise CheckpointError(f"{path}: metadata field {key!r}: {exc}") from None


def read_info(path: str | os.PathLike[str]) -> CheckpointInfo:
    """Read and cross-check every header of the checkpoint at `path` (not the tensor data).

    A file of format version 1 or 2 (no header checksum) also gives an `UnverifiedMetadataWarning`."""
    path = Path(path)
    metadata, tensors = _header(path, "checkpoint file")
    version = _check_format(path, metadata)
    params, tp_shard = _field(path, metadata, "params", _params)
    kind = _field(path, metadata, "collection", lambda text: text)
    if kind not in (PAGED, CONTINUOUS):
        raise CheckpointError(f"{path}: metadata field 'collection': unknown collection kind {kind!r:.80}")
    max_seq_len = _field(path, metadata, "max_seq_len", _count)
    num_pages = _field(path, metadata, "num_pages", _count)
    page_tokens = _field(path, metadata, "page_tokens", _count)
    shards = _field(path, metadata, "shards", _shard_list)
    checksums: dict[str, str] = dict(_field(path, metadata, CHECKSUM_KEY, lambda text: _checksums(json.loads(text))))
    _field(path, metadata, "user_metadata", _strings)
    if "source_batch_indices" in metadata:
        _field(path, metadata, "source_batch_indices", _row_numbers)
    _check_sizes(path, params, kind, max_seq_len, page_tokens)
    groups = [(params, tuple(range(params.num_layers)), num_pages)]
    if "groups" in metadata:
        groups = _field(path, metadata, "groups", _group_list)
        _check_groups(path, version, groups, params, num_pages, kind, tp_shard)
    files = [path]
    tensor_files = {name: path for name in tensors}
    all_tensors = dict(tensors)
    for name, shard_sums in shards:
        shard = path.parent / name
        shard_metadata, shard_tensors = _header(shard, f"shard {name} listed in {path.name}")
        _check_format(shard, shard_metadata)
        try:
            same = json.loads(shard_metadata.get(CHECKSUM_KEY, "{}")) == shard_sums
        except (ValueError, RecursionError):
            same = False
        if shard_metadata.get("save_id") != metadata.get("save_id") or not same:
            raise CheckpointError(f"{shard}: shard does not belong to {path.name} (save id or checksums differ)")
        twice = sorted(set(shard_tensors) & set(all_tensors))
        if twice:
            raise CheckpointError(f"{shard}: tensors {twice} are in another file of {path.name} too")
        files.append(shard)
        checksums.update(shard_sums)
        tensor_files.update({name: shard for name in shard_tensors})
        all_tensors.update(shard_tensors)
    if set(checksums) != set(all_tensors):
        raise CheckpointError(f"{path}: checksums do not cover the tensors {sorted(all_tensors)}")
    tables = [f"{group_prefix(g)}lookup_table" for g in range(len(groups))]
    _check_shapes(path, groups, kind, max_seq_len, page_tokens, all_tensors)
    if not {"cache_lengths", *tables} <= set(tensors):
        raise CheckpointError(f"{path}: the main file must hold 'cache_lengths' and {', '.join(map(repr, tables))}")
    offsets = {name: (t["data_offsets"][0], t["data_offsets"][1]) for name, t in all_tensors.items()}
    with open(path, "rb") as f:
        lengths = _read_small(f, "cache_lengths", tensors, checksums, path)
        group_tables = [_read_small(f, name, tensors, checksums, path) for name in tables]
    table = group_tables[0]
    info = CheckpointInfo(
        path,
        params,
        kind,
        max_seq_len,
        num_pages,
        page_tokens,
        lengths.tolist(),
        table,
        files,
        checksums,
        tensor_files,
        offsets,
        metadata,
        tp_shard,
        [GroupInfo(p, layers, n, t) for (p, layers, n), t in zip(groups, group_tables, strict=True)],
    )
    for g in range(len(groups)):
        _check_tables(info, g)
    if version < VERIFIED_METADATA_VERSION:
        warnings.warn(
            f"{path}: a format version {version} file has unverified metadata (no header checksum: damage to "
            "its params, lengths' meaning, token ids or shard list goes unnoticed); save it again to verify it",
            UnverifiedMetadataWarning,
            stacklevel=2,
        )
    return info


def _check_sizes(path: Path, params: KVCacheParams, kind: str, max_seq_len: int, page_tokens: int) -> None:
    """The sizes the metadata declares agree with each other (what the tensors hold is checked next)."""
    if max_seq_len < 1:
        raise CheckpointError(f"{path}: metadata field 'max_seq_len': expected a positive int, got {max_seq_len}")
    if kind == PAGED and page_tokens != params.page_size:
        raise CheckpointError(
            f"{path}: metadata field 'page_tokens': a paged file stores whole pages of "
            f"page_size={params.page_size} tokens, got {page_tokens}"
        )
    if kind == CONTINUOUS and (params.page_size != max_seq_len or page_tokens > max_seq_len):
        raise CheckpointError(
            f"{path}: metadata fields 'max_seq_len' / 'page_tokens': a continuous-batching slot holds "
            f"page_size={params.page_size} tokens, max_seq_len is {max_seq_len}, page_tokens {page_tokens}"
        )


def _check_tables(info: CheckpointInfo, group: int = 0) -> None:
    """Lengths fit `max_seq_len`; layer group `group`'s table entries fit the collection `load_cache`
    builds (pages 0..num_pages; continuous-batching slots 1..batch, one per row), and every page holding
    a row's tokens (from the first one a sliding window keeps) is a stored one (1..num_pages); a
    continuous-batching file stores every row's tokens."""
    lengths = torch.tensor(info.cache_lengths, dtype=torch.int64)
    if bool(((lengths < 0) | (lengths > info.max_seq_len)).any()):
        raise CheckpointError(f"{info.path}: cache_lengths {info.cache_lengths} outside 0..{info.max_seq_len}")
    g = info.groups[group]
    name = f"{group_prefix(group)}lookup_table"
    table = g.lookup_table.reshape(len(info.cache_lengths), -1)
    bound = g.num_pages if info.kind == PAGED else len(info.cache_lengths)
    if bool(((table < 0) | (table > bound)).any()):
        raise CheckpointError(f"{info.path}: {name} has page ids outside 0..{bound}")
    columns = torch.arange(table.shape[1])[None]
    first = torch.tensor(info.first_held_per_row(group))[:, None]
    used = (columns < torch.tensor(info.pages_per_row())[:, None]) & (columns >= first)
    if bool((used & ((table == layout.NULL_PAGE) | (table > g.num_pages))).any()):
        raise CheckpointError(
            f"{info.path}: {name} puts a row's tokens in a page it does not store "
            f"(the null page {layout.NULL_PAGE}, or past {g.num_pages})"
        )
    if info.kind == CONTINUOUS:
        if bool((table == layout.NULL_PAGE).any()) or table.unique().numel() != table.numel():
            raise CheckpointError(f"{info.path}: lookup_table must give each row a slot of its own (1..{bound})")
        if max(info.cache_lengths) > info.page_tokens:
            raise CheckpointError(
                f"{info.path}: cache_lengths up to {max(info.cache_lengths)} but page_tokens is {info.page_tokens}"
            )


def _check_shapes(
    path: Path,
    groups: list[tuple[KVCacheParams, tuple[int, ...], int]],
    kind: str,
    max_seq_len: int,
    page_tokens: int,
    tensors: dict[str, dict],
) -> None:
    """Every tensor is one of the layer groups' (`(params, layers, stored pages)` each), of the shape and
    dtype their params and sizes say; the page tensors' pieces hold each group's pages."""

    def fail(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: {what}")

    small = ["cache_lengths"] + [f"{group_prefix(g)}lookup_table" for g in range(len(groups))]
    for name in small:
        if name not in tensors or tensors[name]["dtype"] != "I32":
            raise fail(f"missing int32 tensor {name!r}")
    batch = tensors["cache_lengths"]["shape"]
    width = [] if kind == CONTINUOUS else [layout.table_width(max_seq_len, groups[0][0].page_size)]
    for name in small[1:]:
        if len(batch) != 1 or batch[0] < 1 or tensors[name]["shape"] != batch + width:
            raise fail(f"cache_lengths {batch} / {name} {tensors[name]['shape']} shapes disagree")
    expected = {t.name: (t, p, n) for g, (p, _, n) in enumerate(groups) for t in _paged_tensors(p, g)}
    stray = sorted(n for n in tensors if n.rsplit(".", 1)[0] not in expected and n not in small)
    if stray:
        dtypes = "/".join(sorted({str(p.dtype) for p, _, _ in groups}))
        raise fail(f"tensors {stray} are not part of a {dtypes} cache")
    for t, params, num_pages in expected.values():
        pieces = sorted(name for name in tensors if name.rsplit(".", 1)[0] == t.name)
        unit = [params.num_planes, params.num_layers, page_tokens, *t.token_shape]
        dtype_name = DTYPE_NAMES[t.dtype]
        total = 0
        for name in pieces:
            info = tensors[name]
            if info["shape"][1:] != unit or info["dtype"] != dtype_name:
                raise fail(f"tensor {name} is {info['dtype']}{info['shape']}, params say {dtype_name}[n, {unit}]")
            total += info["shape"][0]
        if total != num_pages or pieces != [t.piece(k) for k in range(len(pieces))] or (total and not page_tokens):
            raise fail(f"page tensors {pieces} hold {total} pages, the header says {num_pages}")


def _read_small(f: Any, name: str, tensors: dict[str, dict], checksums: dict[str, str], path: Path) -> torch.Tensor:
    """An int32 tensor of the main file (its size checked by `read_header`), its checksum verified."""
    tensor = torch.empty(tensors[name]["shape"], dtype=torch.int32)
    try:
        read_into(f, tensors[name]["data_offsets"][0], tensor)
    except SafetensorsFormatError as exc:  # cut short since its header was read
        raise CheckpointError(f"{path}: {exc}") from None
    _verify(name, zlib.crc32(tensor.view(torch.uint8).numpy().reshape(-1).data), checksums, path)
    return tensor


def _verify(name: str, crc: int, checksums: dict[str, str], path: Path) -> None:
    if format_crc(crc) != checksums[name]:
        raise CheckpointError(
            f"{path}: checksum mismatch in tensor {name!r} (stored {checksums[name]}, computed {format_crc(crc)})"
        )


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
    paged = _paged_tensors(g.params, group)
    streams = [t.stream(g.params, info.page_tokens, None if pools is None else pool)
               for t, pool in zip(paged, pools or [None] * len(paged), strict=True)]  # fmt: skip
    total = g.num_pages * sum(io.page_bytes for io in streams)
    bar = tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc=f"load {info.path.name}",
        disable=not _show_progress(progress, total),
    )
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
                _verify(name, crc, info.checksums, path)
                first += count
    finally:
        bar.close()


def verify(path: str | os.PathLike[str], *, progress: bool | None = None) -> CheckpointInfo:
    """Check every header and every tensor checksum; returns the info or raises CheckpointError."""
    info = read_info(path)
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
    pools = [blocks] + ([scales] if p.has_scales_tensor else [])
    for t, pool in zip(_paged_tensors(p, group), pools, strict=True):
        expected = (p.num_planes, p.num_layers, p.page_size, *t.token_shape)
        if (
            pool is None
            or tuple(pool.shape[1:]) != expected
            or pool.dtype != t.dtype
            or pool.shape[0] != blocks.shape[0]
        ):
            found = "none" if pool is None else f"{pool.dtype}{list(pool.shape)}"
            raise CheckpointError(f"{path}: params {p} do not fit the target {t.name} ({found})")
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
        collection: Collection = ContinuousBatchingKVCacheCollection(info.params, batch, info.max_seq_len, device)
        collections = [collection]
    else:
        collections = [
            PagedKVCacheCollection(g.params, max(1, g.num_pages), batch, info.max_seq_len, device) for g in info.groups
        ]
    lengths = torch.tensor(info.cache_lengths, dtype=torch.int32)
    for group, (c, g) in enumerate(zip(collections, info.groups, strict=True)):
        _stream_pages(info, c.page_tensors(), torch.arange(1, g.num_pages + 1), progress, group)
        c.cache_lengths.copy_(lengths)
        c.lookup_table.copy_(g.lookup_table)
    if len(collections) == 1:
        return collections[0]
    return LayerGroups(collections, [g.layers for g in info.groups])
