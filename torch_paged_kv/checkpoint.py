"""KV-state checkpoints in safetensors: `save_cache`, `load_cache`, `load_pages`, `read_info`, `verify`.

Only the pages the saved rows use are stored, compacted and renumbered `1..n` in first-use order
(shared pages once, and still shared after load). Files are written through bounded host memory
(`page_stream.PageStream`), atomically (temporary files, fsync, rename), and split into shards of
`shard_bytes` of page data. See docs/checkpoints.md for the format.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from . import layout
from ._version import __version__
from .collection import ContinuousBatchingKVCacheCollection, PagedKVCacheCollection
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
FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
"""Version 2 added FP8 caches (quantization fields in `params`, `scales.*` page tensors); version 3 a
checksum of every file's header (`header_checksum`). Files of versions 1 and 2 read as they always
did, with an `UnverifiedMetadataWarning`."""
VERIFIED_METADATA_VERSION = 3
"""The first format version whose headers are checksummed."""
DEFAULT_SHARD_BYTES = 4 << 30
PROGRESS_MIN_BYTES = 512 << 20
PAGED, CONTINUOUS = "paged", "continuous_batching"

Collection = PagedKVCacheCollection | ContinuousBatchingKVCacheCollection


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
    collection: Collection, batch_indices: list[int] | None, rows: tuple[torch.Tensor, torch.Tensor] | None
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """(source row numbers, cache_lengths, lookup_table) of what a save stores, on the CPU."""
    if rows is None and collection in _DRIVERS:
        raise CheckpointError(
            f"collection: its rows are the step tensors of the manager that drives it (the last prepared "
            f"step, lengths from before that step), not the sequences' state: save with {_DRIVERS[collection]}"
        )
    if rows is not None:
        if batch_indices is not None:
            raise CheckpointError("rows: pass either batch_indices or rows, not both")
        lengths, table = (torch.as_tensor(t).cpu() for t in rows)
        width = collection.lookup_table.shape[1:]
        shape_ok = lengths.dim() == 1 and tuple(table.shape) == (lengths.shape[0], *width)
        if lengths.dtype != torch.int32 or table.dtype != torch.int32 or not shape_ok:
            raise CheckpointError(
                f"rows: expected int32 cache_lengths [B] and lookup_table [B{', ' + str(width[0]) if width else ''}], "
                f"got {lengths.dtype}{list(lengths.shape)} and {table.dtype}{list(table.shape)}"
            )
        if not lengths.numel():
            raise CheckpointError("rows: nothing to save (empty)")
        return list(range(lengths.shape[0])), lengths, table
    selected = list(range(collection.max_batch_size)) if batch_indices is None else [int(b) for b in batch_indices]
    if not selected:
        raise CheckpointError("batch_indices: nothing to save (empty)")
    if len(set(selected)) != len(selected) or not all(0 <= b < collection.max_batch_size for b in selected):
        raise CheckpointError(
            f"batch_indices: expected distinct rows in 0..{collection.max_batch_size - 1}, got {selected}"
        )
    index = torch.tensor(selected)
    return selected, collection.cache_lengths.cpu()[index], collection.lookup_table.cpu()[index]


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
        mask = positions[None, :] < ((lengths + page_size - 1) // page_size)[:, None]
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


def _paged_tensors(params: KVCacheParams) -> list[_PagedTensor]:
    """`blocks`, then the per-granule `scales` of an FP8 cache (static scales live in `params`)."""
    tensors = [_PagedTensor("blocks", params.dtype, (params.num_kv_heads, params.head_dim))]
    if params.has_scales_tensor:
        tensors.append(_PagedTensor("scales", params.scale_dtype, (params.num_kv_heads, params.scales_per_head)))
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
    collection: Collection,
    path: str | os.PathLike[str],
    *,
    batch_indices: list[int] | None = None,
    rows: tuple[torch.Tensor, torch.Tensor] | None = None,
    metadata: dict[str, str] | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: bool | None = None,
    tp_shard: TPShard | None = None,
) -> None:
    """Save rows `batch_indices` (default: every row, in order) of `collection` to `path`.

    The loaded collection's row i is saved row `batch_indices[i]`. Instead of the collection's own
    rows, `rows=(cache_lengths, lookup_table)` saves rows given explicitly (int32, the shapes of the
    collection's step tensors), whose tables name pages of `collection.blocks` (what
    `save_sequences` passes: a manager's sequences are not rows of the collection). `metadata` (str -> str) is
    stored as user metadata. Page data beyond `shard_bytes` per file goes to shard files next to
    `path`, listed in `path`'s header. `tp_shard` records which KV heads of the model the collection
    holds (a tensor-parallel rank's; None: all). A failed save leaves any checkpoint at `path` intact.
    """
    if not isinstance(collection, (PagedKVCacheCollection, ContinuousBatchingKVCacheCollection)):
        raise CheckpointError(f"collection: expected a KV cache collection, got {type(collection).__name__}")
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise CheckpointError("metadata: expected a dict of str to str")
    if shard_bytes <= 0:
        raise CheckpointError(f"shard_bytes: expected a positive int, got {shard_bytes}")
    try:
        params_json = json.dumps(params_to_dict(collection.params, tp_shard))
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    plan = _plan(collection, *_selected_rows(collection, batch_indices, rows))
    params = collection.params
    paged = _paged_tensors(params)
    pools = collection.page_tensors()
    streams = [t.stream(params, plan.page_tokens, pool) for t, pool in zip(paged, pools, strict=True)]
    page_bytes = sum(io.page_bytes for io in streams)
    n = plan.source_pages.numel()
    per_file = max(1, shard_bytes // page_bytes) if page_bytes else max(n, 1)
    ranges = [(a, min(n, a + per_file)) for a in range(0, n, per_file)] or [(0, 0)]

    path = Path(path)
    save_id = uuid.uuid4().hex[:8]
    names = [path.name] + [_shard_name(path, save_id, k, len(ranges) - 1) for k in range(1, len(ranges))]
    common = {"format": FORMAT, "format_version": str(FORMAT_VERSION), "save_id": save_id}
    bar = tqdm(
        total=n * page_bytes,
        unit="B",
        unit_scale=True,
        desc=f"save {path.name}",
        disable=not _show_progress(progress, n * page_bytes),
    )
    index_device = plan.source_pages.to(collection.device)
    written: list[Path] = []
    shard_entries: list[dict[str, Any]] = []

    def write_file(k: int, small: list[tuple[str, torch.Tensor]], file_metadata: dict[str, str]) -> dict[str, str]:
        a, b = ranges[k]
        specs = [TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in small]
        if b > a:
            for t in paged:
                unit = (params.num_planes, params.num_layers, plan.page_tokens, *t.token_shape)
                specs.append(TensorSpec(t.piece(k), t.dtype, (b - a, *unit)))
        temp = path.parent / f".{names[k]}.{save_id}.tmp"
        written.append(temp)
        with open(temp, "wb") as f:
            writer = SafetensorsWriter(f, specs, file_metadata)
            for _, t in small:
                writer.write(t)
            for io in streams:
                io.write(writer, index_device[a:b], bar)
            checksums = writer.finish()
        final = path.parent / names[k]
        os.replace(temp, final)
        written[-1] = final
        return checksums

    old = _old_shards(path)
    try:
        for k in range(1, len(ranges)):
            sums = write_file(k, [], {**common, "shard": f"{k}/{len(ranges) - 1}"})
            shard_entries.append({"file": names[k], "checksums": sums})
        _fsync_dir(path.parent)
        main_metadata = {
            **common,
            "collection": plan.kind,
            "params": params_json,
            "max_seq_len": str(collection.max_seq_len),
            "num_pages": str(n),
            "page_tokens": str(plan.page_tokens),
            "source_batch_indices": json.dumps(plan.rows),
            "shards": json.dumps(shard_entries),
            "user_metadata": json.dumps(metadata or {}),
            "torch_version": torch.__version__,
            "torch_paged_kv_version": __version__,
        }
        write_file(0, [("cache_lengths", plan.cache_lengths), ("lookup_table", plan.lookup_table)], main_metadata)
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


@dataclass
class CheckpointInfo:
    """What a checkpoint's headers, lengths and tables say (page data not read)."""

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

    @property
    def user_metadata(self) -> dict[str, str]:
        return json.loads(self.metadata.get("user_metadata", "{}"))

    def pages_per_row(self) -> list[int]:
        """Pages each saved row uses."""
        if self.kind == CONTINUOUS:
            return [1 if n > 0 else 0 for n in self.cache_lengths]
        return [-(-n // self.params.page_size) for n in self.cache_lengths]


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
    _check_shapes(path, params, kind, max_seq_len, num_pages, page_tokens, all_tensors)
    if not {"cache_lengths", "lookup_table"} <= set(tensors):
        raise CheckpointError(f"{path}: the main file must hold 'cache_lengths' and 'lookup_table'")
    offsets = {name: (t["data_offsets"][0], t["data_offsets"][1]) for name, t in all_tensors.items()}
    with open(path, "rb") as f:
        lengths = _read_small(f, "cache_lengths", tensors, checksums, path)
        table = _read_small(f, "lookup_table", tensors, checksums, path)
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
    )
    _check_tables(info)
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


def _check_tables(info: CheckpointInfo) -> None:
    """Lengths fit `max_seq_len`; table entries fit the collection `load_cache` builds (pages
    0..num_pages; continuous-batching slots 1..batch, one per row), and every page holding a row's
    tokens is a stored one (1..num_pages); a continuous-batching file stores every row's tokens."""
    lengths = torch.tensor(info.cache_lengths, dtype=torch.int64)
    if bool(((lengths < 0) | (lengths > info.max_seq_len)).any()):
        raise CheckpointError(f"{info.path}: cache_lengths {info.cache_lengths} outside 0..{info.max_seq_len}")
    table = info.lookup_table.reshape(len(info.cache_lengths), -1)
    bound = info.num_pages if info.kind == PAGED else len(info.cache_lengths)
    if bool(((table < 0) | (table > bound)).any()):
        raise CheckpointError(f"{info.path}: lookup_table has page ids outside 0..{bound}")
    used = torch.arange(table.shape[1])[None] < torch.tensor(info.pages_per_row())[:, None]
    if bool((used & ((table == layout.NULL_PAGE) | (table > info.num_pages))).any()):
        raise CheckpointError(
            f"{info.path}: lookup_table puts a row's tokens in a page it does not store "
            f"(the null page {layout.NULL_PAGE}, or past {info.num_pages})"
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
    params: KVCacheParams,
    kind: str,
    max_seq_len: int,
    num_pages: int,
    page_tokens: int,
    tensors: dict[str, dict],
) -> None:
    def fail(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: {what}")

    for name in ("cache_lengths", "lookup_table"):
        if name not in tensors or tensors[name]["dtype"] != "I32":
            raise fail(f"missing int32 tensor {name!r}")
    batch = tensors["cache_lengths"]["shape"]
    width = [] if kind == CONTINUOUS else [layout.table_width(max_seq_len, params.page_size)]
    if len(batch) != 1 or batch[0] < 1 or tensors["lookup_table"]["shape"] != batch + width:
        raise fail(f"cache_lengths {batch} / lookup_table {tensors['lookup_table']['shape']} shapes disagree")
    expected = {t.name: t for t in _paged_tensors(params)}
    stray = sorted(n for n in tensors if n.split(".")[0] not in expected and n not in ("cache_lengths", "lookup_table"))
    if stray:
        raise fail(f"tensors {stray} are not part of a {params.dtype} cache")
    for t in expected.values():
        pieces = sorted(name for name in tensors if name.startswith(t.name + "."))
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
    info: CheckpointInfo, pools: list[torch.Tensor] | None, pages: torch.Tensor | None, progress: bool | None
) -> None:
    """Read every page tensor in chunks and verify its checksum; stored page j (from 0) goes to page
    `pages[j]` of each pool (`blocks`, then an FP8 cache's `scales`) when `pools` is given."""
    paged = _paged_tensors(info.params)
    streams = [t.stream(info.params, info.page_tokens, None if pools is None else pool)
               for t, pool in zip(paged, pools or [None] * len(paged), strict=True)]  # fmt: skip
    total = info.num_pages * sum(io.page_bytes for io in streams)
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
            for name in sorted(n for n in info.tensor_files if n.startswith(t.name + ".")):
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
    _stream_pages(info, None, None, progress)
    return info


def load_pages(
    path: str | os.PathLike[str],
    blocks: torch.Tensor,
    pages: list[int] | torch.Tensor,
    *,
    scales: torch.Tensor | None = None,
    progress: bool | None = None,
) -> CheckpointInfo:
    """Stream the stored pages of a checkpoint into an existing pool: stored page j + 1 (the id
    in the file's lookup table) goes to `blocks[pages[j]]` (and `scales[pages[j]]` for a per-granule
    FP8 cache), through bounded host memory.

    For restoring into a live cache: `blocks` (and `scales`) must match the file's params (else
    `CheckpointError`); `pages` must be distinct, in range, and `read_info(path).num_pages` long.
    A continuous-batching file writes only its first `page_tokens` tokens of each slot. A checksum
    error can come after some pages were written: only pages in `pages` are ever touched.
    """
    info = read_info(path)
    p = info.params
    pools = [blocks] + ([scales] if p.has_scales_tensor else [])
    for t, pool in zip(_paged_tensors(p), pools, strict=True):
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
        ids.numel() != info.num_pages
        or ids.unique().numel() != ids.numel()
        or bool(((ids <= layout.NULL_PAGE) | (ids >= blocks.shape[0])).any())
    ):
        raise ValueError(
            f"pages: expected {info.num_pages} distinct ids in 1..{blocks.shape[0] - 1} "
            f"(never the null page {layout.NULL_PAGE}), got {ids.tolist()}"
        )
    _stream_pages(info, pools, ids, progress)
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
    """Refuse, before allocating, a collection of `params` for `info`'s rows (what `load_cache` builds)
    larger than the memory of `device`: a small file may declare any params and `max_seq_len`."""
    if info.kind == PAGED:
        pages, field = max(1, info.num_pages) + 1, "params"
    else:
        pages, field = len(info.cache_lengths) + 1, "max_seq_len"
    nbytes = pages * params.page_size * (params.bytes_per_token + params.scale_bytes_per_token)
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
    expected_params: KVCacheParams | None = None,
) -> Collection:
    """Load a checkpoint into a new collection of the saved kind on `device` (default CPU).

    Row i is the i-th saved row; pages are `1..num_pages` (at least one page is allocated);
    `input_row_offsets` are zeros. `expected_params` makes a mismatch a `CheckpointError`, before
    anything is allocated: without it the file's params (and, for continuous batching, its
    `max_seq_len`) size the collection, refused only when it exceeds the device's memory. A
    tensor-parallel rank's file loads as a cache of the heads it holds (`read_info(path).tp_shard`
    says which; `distributed.reshard` loads shards at any size).
    """
    info = read_info(path)
    if expected_params is not None and info.params != expected_params:
        raise CheckpointError(f"{path}: params {info.params} do not fit the target {expected_params}")
    check_allocation(info, info.params, device)
    batch = len(info.cache_lengths)
    if info.kind == CONTINUOUS:
        collection: Collection = ContinuousBatchingKVCacheCollection(info.params, batch, info.max_seq_len, device)
    else:
        collection = PagedKVCacheCollection(info.params, max(1, info.num_pages), batch, info.max_seq_len, device)
    _stream_pages(info, collection.page_tensors(), torch.arange(1, info.num_pages + 1), progress)
    collection.cache_lengths.copy_(torch.tensor(info.cache_lengths, dtype=torch.int32))
    collection.lookup_table.copy_(info.lookup_table)
    return collection
