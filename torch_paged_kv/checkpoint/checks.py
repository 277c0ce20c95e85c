"""Cross-checks of what a checkpoint's headers declare: format and version, sizes, layer groups,
tensor shapes, and the lookup tables against the pages stored."""

from __future__ import annotations

from pathlib import Path

import torch

from .. import layout
from ..params import KVCacheParams, TPShard
from ..safetensors_stream import DTYPE_NAMES, HEADER_CHECKSUM_KEY
from .file_format import (
    CONTINUOUS,
    EXTRA_PREFIX,
    FORMAT,
    PAGED,
    READABLE_VERSIONS,
    VERIFIED_METADATA_VERSION,
    CheckpointError,
    group_prefix,
    paged_tensors,
)
from .info import CheckpointInfo


def check_format(path: Path, metadata: dict[str, str]) -> int:
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


def check_groups(
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


def check_sizes(path: Path, params: KVCacheParams, kind: str, max_seq_len: int, page_tokens: int) -> None:
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


def check_tables(info: CheckpointInfo, group: int = 0) -> None:
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


def check_extras(path: Path, extras: dict[str, tuple[torch.dtype, tuple[int, ...]]], tensors: dict[str, dict]) -> None:
    """Every extra tensor the metadata lists is in the main file (`tensors`), of the dtype and shape
    listed; the main file holds no other extra tensor."""
    for name, (dtype, shape) in extras.items():
        if name not in tensors:
            raise CheckpointError(f"{path}: extra tensor {name!r} listed in metadata field 'extra_tensors' is missing")
        found = tensors[name]
        if found["dtype"] != DTYPE_NAMES[dtype] or tuple(found["shape"]) != shape:
            raise CheckpointError(
                f"{path}: extra tensor {name!r} is {found['dtype']}{found['shape']}, metadata field 'extra_tensors' "
                f"says {DTYPE_NAMES[dtype]}{list(shape)}"
            )
    unlisted = sorted(n for n in tensors if n.startswith(EXTRA_PREFIX) and n not in extras)
    if unlisted:
        raise CheckpointError(f"{path}: extra tensors {unlisted} are not listed in metadata field 'extra_tensors'")


def check_shapes(
    path: Path,
    groups: list[tuple[KVCacheParams, tuple[int, ...], int]],
    kind: str,
    max_seq_len: int,
    page_tokens: int,
    tensors: dict[str, dict],
    extras: frozenset[str] = frozenset(),
) -> None:
    """Every tensor is one of the layer groups' (`(params, layers, stored pages)` each), of the shape and
    dtype their params and sizes say, or a listed extra tensor (`extras`, checked by `check_extras`);
    the page tensors' pieces hold each group's pages."""

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
    expected = {t.name: (t, p, n) for g, (p, _, n) in enumerate(groups) for t in paged_tensors(p, g)}
    stray = sorted(n for n in tensors if n.rsplit(".", 1)[0] not in expected and n not in small and n not in extras)
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
