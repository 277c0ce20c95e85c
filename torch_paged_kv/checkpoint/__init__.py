"""KV-state checkpoints in safetensors: `save_cache`, `load_cache`, `load_pages`, `read_info`, `verify`,
`read_extra_tensors`.

Only the pages the saved rows use are stored, compacted and renumbered `1..n` in first-use order
(shared pages once, and still shared after load), per layer group for a cache of several
(`LayerGroups`). Files are written through bounded host memory (`page_stream.PageStream`),
atomically (temporary files, fsync, rename), and split into shards of `shard_bytes` of page data.
A save may carry named extra tensors (`extra.*`: what a cache keeps beside its pages) in the main
file, checksummed like the lengths and tables. See docs/checkpoints.md for the format.

The modules: `file_format` (names, versions, errors, page tensors), `plan` (what a save stores),
`write` (`save_cache`), `fields` and `checks` (parsing and cross-checking headers), `info`
(`CheckpointInfo`), `read` (`read_info`, `read_extra_tensors`), `load` (`verify`, `load_pages`, `load_cache`).
"""

from .file_format import (
    CONTINUOUS,
    DEFAULT_SHARD_BYTES,
    EXTRA_PREFIX,
    EXTRA_TENSORS_VERSION,
    FORMAT,
    FORMAT_VERSION,
    PAGED,
    READABLE_VERSIONS,
    VERIFIED_METADATA_VERSION,
    CheckpointError,
    Collection,
    UnverifiedMetadataWarning,
    group_prefix,
)
from .info import CheckpointInfo, GroupInfo
from .load import check_allocation, load_cache, load_pages, verify
from .plan import mark_driven
from .read import read_extra_tensors, read_info
from .write import Cache, save_cache

__all__ = [
    "CONTINUOUS",
    "DEFAULT_SHARD_BYTES",
    "EXTRA_PREFIX",
    "EXTRA_TENSORS_VERSION",
    "FORMAT",
    "FORMAT_VERSION",
    "PAGED",
    "READABLE_VERSIONS",
    "VERIFIED_METADATA_VERSION",
    "Cache",
    "CheckpointError",
    "CheckpointInfo",
    "Collection",
    "GroupInfo",
    "UnverifiedMetadataWarning",
    "check_allocation",
    "group_prefix",
    "load_cache",
    "load_pages",
    "mark_driven",
    "read_extra_tensors",
    "read_info",
    "save_cache",
    "verify",
]
