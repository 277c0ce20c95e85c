"""`read_info`: every header of a checkpoint read and cross-checked, its lengths and tables read."""

from __future__ import annotations

import io
import json
import os
import warnings
import zlib
from pathlib import Path

import torch

from ..safetensors_stream import (
    CHECKSUM_KEY,
    SafetensorsFormatError,
    format_crc,
    read_header,
    read_into,
)
from . import fields
from .checks import check_extras, check_format, check_groups, check_shapes, check_sizes, check_tables
from .fields import parse_field
from .file_format import (
    CONTINUOUS,
    EXTRA_TENSORS_VERSION,
    PAGED,
    VERIFIED_METADATA_VERSION,
    CheckpointError,
    UnverifiedMetadataWarning,
    group_prefix,
)
from .info import CheckpointInfo, GroupInfo


def _header(path: Path, what: str) -> tuple[dict[str, str], dict[str, dict]]:
    if not path.is_file():
        raise CheckpointError(f"{path}: missing {what}")
    try:
        return read_header(path)
    except SafetensorsFormatError as exc:
        raise CheckpointError(f"{path}: {exc}") from None


def _read_small(
    f: io.BufferedIOBase,
    name: str,
    tensors: dict[str, dict],
    checksums: dict[str, str],
    path: Path,
    dtype: torch.dtype = torch.int32,
) -> torch.Tensor:
    """A tensor of the main file (its size and dtype checked already), its checksum verified."""
    tensor = torch.empty(tensors[name]["shape"], dtype=dtype)
    try:
        read_into(f, tensors[name]["data_offsets"][0], tensor)
    except SafetensorsFormatError as exc:  # cut short since its header was read
        raise CheckpointError(f"{path}: {exc}") from None
    verify_checksum(name, zlib.crc32(tensor.reshape(-1).view(torch.uint8).numpy().data), checksums, path)
    return tensor


def verify_checksum(name: str, crc: int, checksums: dict[str, str], path: Path) -> None:
    if format_crc(crc) != checksums[name]:
        raise CheckpointError(
            f"{path}: checksum mismatch in tensor {name!r} (stored {checksums[name]}, computed {format_crc(crc)})"
        )


def read_info(path: str | os.PathLike[str]) -> CheckpointInfo:
    """Read and cross-check every header of the checkpoint at `path` (not the tensor data).

    A file of format version 1 or 2 (no header checksum) also gives an `UnverifiedMetadataWarning`."""
    path = Path(path)
    metadata, tensors = _header(path, "checkpoint file")
    version = check_format(path, metadata)
    params, tp_shard = parse_field(path, metadata, "params", fields.params_and_shard)
    kind = parse_field(path, metadata, "collection", lambda text: text)
    if kind not in (PAGED, CONTINUOUS):
        raise CheckpointError(f"{path}: metadata field 'collection': unknown collection kind {kind!r:.80}")
    max_seq_len = parse_field(path, metadata, "max_seq_len", fields.count)
    num_pages = parse_field(path, metadata, "num_pages", fields.count)
    page_tokens = parse_field(path, metadata, "page_tokens", fields.count)
    shards = parse_field(path, metadata, "shards", fields.shard_list)
    checksums: dict[str, str] = dict(
        parse_field(path, metadata, CHECKSUM_KEY, lambda text: fields.checksums(json.loads(text)))
    )
    parse_field(path, metadata, "user_metadata", fields.strings)
    if "source_batch_indices" in metadata:
        parse_field(path, metadata, "source_batch_indices", fields.row_numbers)
    extras: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    if "extra_tensors" in metadata:
        if version < EXTRA_TENSORS_VERSION:
            raise CheckpointError(
                f"{path}: metadata field 'extra_tensors' is a format version {EXTRA_TENSORS_VERSION} field, "
                f"but the file says {version}"
            )
        extras = parse_field(path, metadata, "extra_tensors", fields.extra_specs)
    check_extras(path, extras, tensors)
    check_sizes(path, params, kind, max_seq_len, page_tokens)
    groups = [(params, tuple(range(params.num_layers)), num_pages)]
    if "groups" in metadata:
        groups = parse_field(path, metadata, "groups", fields.group_list)
        check_groups(path, version, groups, params, num_pages, kind, tp_shard)
    if version < 4 and params.sliding_window is not None:
        raise CheckpointError(
            f"{path}: metadata field 'params': sliding_window (pages below a window not stored) is a "
            f"format version 4 field, but the file says version {version}"
        )
    files = [path]
    tensor_files = {name: path for name in tensors}
    all_tensors = dict(tensors)
    for name, shard_sums in shards:
        shard = path.parent / name
        shard_metadata, shard_tensors = _header(shard, f"shard {name} listed in {path.name}")
        check_format(shard, shard_metadata)
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
    check_shapes(path, groups, kind, max_seq_len, page_tokens, all_tensors, frozenset(extras))
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
        extras,
    )
    for g in range(len(groups)):
        check_tables(info, g)
    if version < VERIFIED_METADATA_VERSION:
        warnings.warn(
            f"{path}: a format version {version} file has unverified metadata (no header checksum: damage to "
            "its params, lengths' meaning, token ids or shard list goes unnoticed); save it again to verify it",
            UnverifiedMetadataWarning,
            stacklevel=2,
        )
    return info


def read_extra_tensors(info: CheckpointInfo) -> dict[str, torch.Tensor]:
    """The extra tensors of the checkpoint `info` describes (`read_info`), read from its main file on
    the CPU, every checksum verified (else `CheckpointError` naming the file and the tensor)."""
    tensors = {
        name: {"shape": list(shape), "data_offsets": list(info.tensor_offsets[name])}
        for name, (_, shape) in info.extra_tensors.items()
    }
    with open(info.path, "rb") as f:
        return {
            name: _read_small(f, name, tensors, info.checksums, info.path, dtype)
            for name, (dtype, _) in info.extra_tensors.items()
        }
