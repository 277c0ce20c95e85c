"""The checkpoint file format: its names, versions and errors, and the page tensors a file stores.

A checkpoint is a main safetensors file (metadata, `cache_lengths`, one lookup table per layer group,
the caller's extra tensors) and the shard files its header lists; every page tensor is stored as
pieces `<name>.<k>` of whole pages. See docs/checkpoints.md.
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass

import torch
from tqdm import tqdm

from ..collection import ContinuousBatchingKVCacheCollection, PagedKVCacheCollection
from ..page_stream import PageStream
from ..params import KVCacheParams

FORMAT = "torch_paged_kv.kv_cache"
FORMAT_VERSION = 5
READABLE_VERSIONS = (1, 2, 3, 4, 5)
"""Version 2 added FP8 caches (quantization fields in `params`, `scales.*` page tensors); version 3 a
checksum of every file's header (`header_checksum`); version 4 layer groups (`groups` metadata,
`groups.<g>.*` tensors) and sliding-window params (`sliding_window`: table entries below a row's
window are the null page); version 5 extra tensors (`extra_tensors` metadata, `extra.*` tensors).
A save writes version 5 only for a file with extra tensors, else version 4 (what readers of version 4
read). Files of versions 1 and 2 read as they always did, with an `UnverifiedMetadataWarning`; a file
of one group without a window reads as version 3 did."""
EXTRA_TENSORS_VERSION = 5
"""The first format version whose files may hold extra tensors."""
EXTRA_PREFIX = "extra."
"""What the name of every extra tensor starts with (no tensor of the format's own does)."""
_EXTRA_NAME = re.compile(re.escape(EXTRA_PREFIX) + r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}")
VERIFIED_METADATA_VERSION = 3
"""The first format version whose headers are checksummed."""
DEFAULT_SHARD_BYTES = 4 << 30
PROGRESS_MIN_BYTES = 512 << 20
PAGED, CONTINUOUS = "paged", "continuous_batching"


Collection = PagedKVCacheCollection | ContinuousBatchingKVCacheCollection


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read; the message says what is wrong."""


class UnverifiedMetadataWarning(UserWarning):
    """A checkpoint of a format version before 3: nothing checksums its metadata (params, token ids,
    shard list), so damage there goes unnoticed. Saving it again writes a verified file."""


@dataclass(frozen=True)
class PagedTensor:
    """A pool tensor indexed by page, as files store it: `<name>.<k>` pieces of whole pages."""

    name: str  # "blocks", or "scales" for a per-granule FP8 cache
    dtype: torch.dtype
    token_shape: tuple[int, ...]  # per token, layer and plane: (kv_heads, head_dim) or (kv_heads, groups)

    def piece(self, k: int) -> str:
        return f"{self.name}.{k:05d}"

    def stream(self, params: KVCacheParams, page_tokens: int, pool: torch.Tensor | None) -> PageStream:
        token_bytes = math.prod(self.token_shape) * torch.empty((), dtype=self.dtype).element_size()
        return PageStream(params.num_planes, params.num_layers, token_bytes, page_tokens, pool)


def extra_name_error(name: object) -> str | None:
    """Why `name` cannot name an extra tensor, or None: `extra.` then 1 to 200 letters, digits, `_`,
    `.` or `-` (not starting with `.` or `-`)."""
    if isinstance(name, str) and _EXTRA_NAME.fullmatch(name):
        return None
    return (
        f"expected names {EXTRA_PREFIX!r} + 1..200 of [A-Za-z0-9_.-] (starting with a letter, digit or _), "
        f"got {name!r:.80}"
    )


def group_prefix(group: int) -> str:
    """What the names of layer group `group`'s tensors start with: nothing for group 0 (the names of a
    file of one group), `groups.<g>.` for the others."""
    return "" if group == 0 else f"groups.{group}."


def paged_tensors(params: KVCacheParams, group: int = 0) -> list[PagedTensor]:
    """`blocks`, then the per-granule `scales` of an FP8 cache (static scales live in `params`), of
    layer group `group`."""
    prefix = group_prefix(group)
    tensors = [PagedTensor(prefix + "blocks", params.dtype, (params.num_kv_heads, params.head_dim))]
    scale_dtype = params.scale_dtype  # set exactly when the cache has a scales tensor (`has_scales_tensor`)
    if scale_dtype is not None:
        tensors.append(PagedTensor(prefix + "scales", scale_dtype, (params.num_kv_heads, params.scales_per_head)))
    return tensors


def progress_bar(progress: bool | None, total: int, desc: str) -> tqdm:
    """A bar of `total` bytes: shown when `progress` says so, by default for large transfers on a terminal."""
    show = progress if progress is not None else total >= PROGRESS_MIN_BYTES and sys.stderr.isatty()
    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not show)
