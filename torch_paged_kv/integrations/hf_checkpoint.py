"""`PagedCache.save` / `PagedCache.load`: a transformers cache in a KV checkpoint, to resume `generate`.

The file is an ordinary checkpoint (docs/checkpoints.md; `python -m torch_paged_kv inspect` reads
it): the rows in use, only the pages they fill, checksums. What the pool does not say goes under
the user-metadata key `METADATA_KEY`: the column counter (`get_seq_length`, which `generate` turns
into the next positions), the model's dtype (an FP8 pool does not tell it), and whether the pages
hold real tokens only (filled under `attn_implementation="paged_kv"`) or every column, padding
included (any other attention).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedConfig

from ..checkpoint import DEFAULT_SHARD_BYTES, PAGED, CheckpointError, load_pages, read_info, save_cache
from ..params import SUPPORTED_DTYPES

if TYPE_CHECKING:
    from .hf_cache import PagedCache

METADATA_KEY = "torch_paged_kv.transformers"


def save_paged_cache(
    cache: PagedCache,
    path: str | os.PathLike[str],
    *,
    metadata: dict[str, str] | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: bool | None = None,
) -> None:
    """Write the rows `cache` holds (row i of the file is row i of the batch) to `path`."""
    pool = cache.pool
    if pool is None or cache.rows == 0:
        raise ValueError("cache: nothing to save (no step has run since it was created or reset)")
    if cache.state_layers:
        raise ValueError(
            f"cache: layers {cache.state_layers} keep conv or recurrent states beside the pages, which a KV "
            "checkpoint does not hold; nothing was written"
        )
    if metadata is not None and METADATA_KEY in metadata:
        raise ValueError(f"metadata: the key {METADATA_KEY!r} is the cache's own")
    state = {
        "columns": int(pool.columns),
        "dtype": str(pool.dtype).removeprefix("torch."),
        "real_tokens_only": cache.attends_from_pages,
    }
    save_cache(
        pool.groups,
        path,
        batch_indices=list(range(cache.rows)),
        metadata={**(metadata or {}), METADATA_KEY: json.dumps(state)},
        shard_bytes=shard_bytes,
        progress=progress,
    )


def load_paged_cache(
    cache_type: type[PagedCache],
    path: str | os.PathLike[str],
    config: PreTrainedConfig,
    *,
    device: torch.device | str = "cpu",
    progress: bool | None = None,
    **options: Any,
) -> PagedCache:
    """A new `cache_type(config, device=device, **options)` holding the rows saved at `path`.

    Every other constructor argument defaults to the saved cache's (`max_batch_size` to the rows
    saved); a larger `max_cache_len` or `max_batch_size` leaves room to go on. Raises
    `CheckpointError` for a file that is not a saved `PagedCache` or whose pool (layers, heads,
    page size, dtypes) differs from the one `config` and `options` make, and `ValueError` naming
    the argument when the rows do not fit (`max_batch_size`, `max_cache_len`) or `config` attends
    differently from the run that filled the cache with padding (`config`).
    """
    info = read_info(path)
    state = _saved_state(info.path, info.user_metadata, info.kind)
    p = info.params
    rows, lengths = len(info.cache_lengths), torch.tensor(info.cache_lengths, dtype=torch.int32)
    defaults = dict(
        max_batch_size=rows,
        max_cache_len=info.max_seq_len,
        page_size=p.page_size,
        dtype=SUPPORTED_DTYPES[state["dtype"]],
        kv_dtype=p.dtype,
        quantization_granularity=p.quantization_granularity,
        static_scales=p.static_scales,
    )
    if device is None or options.get("dtype", defaults["dtype"]) is None:
        raise ValueError("device, dtype: loading allocates the pool now, which needs both (None given)")
    cache = cache_type(config, device=device, **{**defaults, **options})
    pool = cache.pool
    assert pool is not None  # device and dtype given: allocated by the constructor
    groups = pool.groups
    saved, ours = [(g.params, g.layers) for g in info.groups], list(zip(groups.params, groups.layers, strict=True))
    if saved != ours:
        if len(saved) == len(ours) == 1:
            raise CheckpointError(
                f"{info.path}: the file holds a cache of {p}, but this config and these options make {ours[0][0]}"
            )
        raise CheckpointError(
            f"{info.path}: the file holds a cache of layer groups {saved}, but this config and these options "
            f"make {ours}"
        )
    if rows > cache.max_batch_size:
        raise ValueError(f"max_batch_size: the file holds {rows} rows, more than {cache.max_batch_size}")
    longest = max(state["columns"], *info.cache_lengths)
    if longest > cache.max_cache_len:
        raise ValueError(f"max_cache_len: the file holds rows of {longest} columns, more than {cache.max_cache_len}")
    # Pages of real tokens only read as columns when no row was padded; pages with padding in them
    # never read as real tokens only (the padding cannot be told apart).
    padded = bool((lengths != state["columns"]).any())
    if state["real_tokens_only"] != cache.attends_from_pages and (padded or cache.attends_from_pages):
        filled_under = "paged_kv" if state["real_tokens_only"] else "an attention other than paged_kv"
        raise ValueError(
            f"config: the cache was filled under {filled_under}, which stores "
            f"{'real tokens only' if state['real_tokens_only'] else 'padding too'}; "
            f"this config uses attn_implementation={cache.config._attn_implementation!r}"
        )
    per_row = info.pages_per_row()
    for g, group in enumerate(info.groups):
        firsts = info.first_held_per_row(g)
        if sum(per_row) - sum(firsts) != group.num_pages:
            raise CheckpointError(f"{info.path}: rows share pages, which a PagedCache never does")
    for g, (group, group_pages) in enumerate(zip(info.groups, pool.pages, strict=True)):
        firsts = info.first_held_per_row(g)
        pages = torch.empty(group.num_pages, dtype=torch.int64)  # stored page j + 1 -> its row's own page
        own = group_pages.assign(per_row, firsts)
        for b, (n, first) in enumerate(zip(per_row, firsts, strict=True)):
            pages[group.lookup_table[b, first:n].long() - 1] = torch.tensor(own[b], dtype=torch.int64)
        c = group_pages.collection
        load_pages(info.path, c.blocks, pages, scales=c.scales, progress=progress, group=g, info=info)
    pool.lengths[:rows] = lengths.to(pool.device)
    pool.columns.fill_(state["columns"])
    cache.rows = rows
    return cache


def _saved_state(path: os.PathLike[str], user_metadata: dict[str, str], kind: str) -> dict[str, Any]:
    """The cache's own metadata, checked; `CheckpointError` for a file `save_paged_cache` did not write."""
    try:
        state = json.loads(user_metadata[METADATA_KEY])
        ok = (
            kind == PAGED
            and isinstance(state["columns"], int)
            and state["columns"] >= 0
            and state["dtype"] in SUPPORTED_DTYPES
            and isinstance(state["real_tokens_only"], bool)
        )
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise CheckpointError(f"{path}: not a saved PagedCache (PagedCache.save writes one; see {METADATA_KEY!r})")
    return state
