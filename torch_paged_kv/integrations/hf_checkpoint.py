"""`PagedCache.save` / `PagedCache.load`: a transformers cache in a KV checkpoint, to resume `generate`.

The file is an ordinary checkpoint (docs/checkpoints.md; `python -m torch_paged_kv inspect` reads
it): the rows in use, only the pages they fill, checksums. What the pool does not say goes under
the user-metadata key `METADATA_KEY`: the column counter (`get_seq_length`, which `generate` turns
into the next positions), the model's dtype (an FP8 pool does not tell it), whether the pages
hold real tokens only (filled under `attn_implementation="paged_kv"`) or every column, padding
included (any other attention), and for a hybrid model what restores its state layers' states:
those states themselves are extra tensors of the file (`extra.states.<layer>.<state>.conv` /
`.recurrent`, one row per saved row), checksummed like the rest; so are the indexer keys of a
sparse-attention model's indexed layers (`extra.indexer.<layer>`, `[rows, columns, index_head_dim]`).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedConfig

from ..checkpoint import (
    DEFAULT_SHARD_BYTES,
    PAGED,
    CheckpointError,
    CheckpointInfo,
    load_pages,
    read_extra_tensors,
    read_info,
    save_cache,
)
from ..params import SUPPORTED_DTYPES

if TYPE_CHECKING:
    from .hf_cache import PagedCache

METADATA_KEY = "torch_paged_kv.transformers"
STATE_KINDS = ("conv", "recurrent")


def state_tensor_name(layer: int, state: int, kind: str) -> str:
    """The extra tensor holding the `kind` ("conv" or "recurrent") states `state` of model layer `layer`."""
    return f"extra.states.{layer}.{state}.{kind}"


def indexer_tensor_name(layer: int) -> str:
    """The extra tensor holding the indexer keys of model layer `layer`."""
    return f"extra.indexer.{layer}"


def _states_to_save(cache: PagedCache) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """What restores the state layers (metadata) and their initialized states (extra tensors), checked:
    `ValueError` naming `cache` where a file of them could not resume exactly."""
    entries, tensors = [], {}
    layers = [(i, cache.state_layer(i)) for i in cache.state_layers]
    for i, layer in layers:
        for s in range(layer.number_of_states):
            states = dict(zip(STATE_KINDS, layer.saved_states(s), strict=True))
            for kind, tensor in states.items():
                if tensor is not None and tensor.shape[0] != cache.rows:
                    raise ValueError(
                        f"cache: layer {i} keeps {kind} states {s} of {tensor.shape[0]} rows, but {cache.rows} "
                        "rows are in use; nothing was written"
                    )
                if tensor is not None:
                    tensors[state_tensor_name(i, s, kind)] = tensor
            if any(t is not None for t in states.values()):
                kernel = layer.conv_kernel_size[s] if states["conv"] is not None else None
                entries.append(
                    {
                        "layer": i,
                        "state": s,
                        **{kind: t is not None for kind, t in states.items()},
                        "conv_kernel_size": kernel,
                        "has_previous_state": bool(layer.has_previous_state[s]),
                    }
                )
    meta = {"state_layers": [[i, layer.number_of_states] for i, layer in layers], "states": entries}
    return meta, tensors


def save_paged_cache(
    cache: PagedCache,
    path: str | os.PathLike[str],
    *,
    metadata: dict[str, str] | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: bool | None = None,
) -> None:
    """Write the rows `cache` holds (row i of the file is row i of the batch) to `path`, with its state
    layers' states (transformers' `LinearAttentionLayer`: every initialized conv and recurrent state,
    `conv_kernel_size` and `has_previous_state`)."""
    pool = cache.pool
    if pool is None or cache.rows == 0:
        raise ValueError("cache: nothing to save (no step has run since it was created or reset)")
    if metadata is not None and METADATA_KEY in metadata:
        raise ValueError(f"metadata: the key {METADATA_KEY!r} is the cache's own")
    state: dict[str, Any] = {
        "columns": int(pool.columns),
        "dtype": str(pool.dtype).removeprefix("torch."),
        "real_tokens_only": cache.attends_from_pages,
    }
    extra_tensors: dict[str, torch.Tensor] = {}
    if cache.state_layers:
        states, extra_tensors = _states_to_save(cache)
        state.update(states)
    if cache.indexed_layers:
        keys = cache.indexer_keys(state["columns"])
        state["indexer_layers"] = sorted(keys)
        extra_tensors.update({indexer_tensor_name(i): k for i, k in keys.items()})
    save_cache(
        pool.groups,
        path,
        batch_indices=list(range(cache.rows)),
        metadata={**(metadata or {}), METADATA_KEY: json.dumps(state)},
        shard_bytes=shard_bytes,
        progress=progress,
        extra_tensors=extra_tensors or None,
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
    differently from the run that filled the cache with padding (`config`). The state layers' states
    come back on `device`, in their saved dtype; a file whose state layers (model layers, states per
    layer) differ from `config`'s is a `CheckpointError`. The states' other dims are the model's: the
    file's are checked against each other (rows, kernel size), the model's own at its next step.
    """
    info = read_info(path)
    state = _saved_state(info.path, info.user_metadata, info.kind)
    states, state_names = _saved_states(info, state)
    indexer_layers = _saved_indexer_layers(info, state)
    listed = state_names | {indexer_tensor_name(i) for i in indexer_layers}
    if listed != set(info.extra_tensors):
        raise CheckpointError(
            f"{info.path}: user metadata {METADATA_KEY!r} lists the extra tensors {sorted(listed)}, the file holds "
            f"{sorted(info.extra_tensors)}"
        )
    saved_states = read_extra_tensors(info)  # checksums verified before anything is allocated
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
    ours_states = [[i, cache.state_layer(i).number_of_states] for i in cache.state_layers]
    if state.get("state_layers", []) != ours_states:
        raise CheckpointError(
            f"{info.path}: the file holds state layers (model layer, states) {state.get('state_layers', [])}, "
            f"but this config makes {ours_states}"
        )
    if not set(indexer_layers) <= set(cache.indexed_layers) or (cache.indexed_layers and not indexer_layers):
        raise CheckpointError(
            f"{info.path}: the file holds indexer keys of layers {indexer_layers}, but this config's indexed layers "
            f"are {cache.indexed_layers}"
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
            f"this config uses attn_implementation={cache.attn_implementation!r}"
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
    for entry in states:
        i, s = entry["layer"], entry["state"]
        conv, recurrent = (
            saved_states[state_tensor_name(i, s, kind)].to(pool.device) if entry[kind] else None for kind in STATE_KINDS
        )
        cache.state_layer(i).restore(s, conv, recurrent, entry["conv_kernel_size"], entry["has_previous_state"])
    for i in indexer_layers:
        cache.indexed_layer(i).restore(saved_states[indexer_tensor_name(i)].to(pool.device))
    cache.rows = rows
    return cache


def _saved_states(info: CheckpointInfo, state: dict[str, Any]) -> tuple[list[dict[str, Any]], set[str]]:
    """The state entries of the cache's own metadata, checked against each other and the file's extra
    tensors (conv states `[rows, ..., conv_kernel_size]`, recurrent states `[rows, ...]`), and the names
    of the extra tensors they list; `CheckpointError` naming the file otherwise."""

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{info.path}: user metadata {METADATA_KEY!r}: {what}")

    def is_int(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    layers, entries = state.get("state_layers", []), state.get("states", [])
    if not isinstance(layers, list) or not all(
        isinstance(p, list) and len(p) == 2 and is_int(p[0]) and is_int(p[1]) for p in layers
    ):
        raise bad(f"'state_layers': expected a list of [model layer, states], got {layers!r:.80}")
    per_layer = dict(map(tuple, layers))
    keys = {"layer", "state", *STATE_KINDS, "conv_kernel_size", "has_previous_state"}
    expected: dict[str, tuple[int, ...]] = {}
    seen: set[tuple[int, int]] = set()
    if not isinstance(entries, list):
        raise bad(f"'states': expected a list, got {entries!r:.80}")
    for entry in entries:
        if (
            not isinstance(entry, dict)
            or set(entry) != keys
            or not all(isinstance(entry[k], bool) for k in (*STATE_KINDS, "has_previous_state"))
            or not is_int(entry["layer"])
            or not is_int(entry["state"])
            or entry["state"] >= per_layer.get(entry["layer"], 0)
            or not (entry["conv"] or entry["recurrent"])
            or (entry["conv_kernel_size"] is not None and not is_int(entry["conv_kernel_size"]))
            or (entry["conv_kernel_size"] is None) == entry["conv"]
        ):
            raise bad(f"'states': expected entries {sorted(keys)} of the state layers' states, got {entry!r:.120}")
        if (entry["layer"], entry["state"]) in seen:
            raise bad(f"'states': layer {entry['layer']}'s states {entry['state']} twice")
        seen.add((entry["layer"], entry["state"]))
        for kind in STATE_KINDS:
            name = state_tensor_name(entry["layer"], entry["state"], kind)
            if entry[kind]:
                expected[name] = info.extra_tensors.get(name, (None, ()))[1]
    rows = len(info.cache_lengths)
    for entry in entries:
        for kind in STATE_KINDS:
            shape = expected.get(state_tensor_name(entry["layer"], entry["state"], kind))
            if shape is None:
                continue
            kernel_ok = kind != "conv" or (len(shape) >= 2 and shape[-1] == entry["conv_kernel_size"])
            if not shape or shape[0] != rows or not kernel_ok:
                raise bad(
                    f"{state_tensor_name(entry['layer'], entry['state'], kind)} is {list(shape)}: expected "
                    f"[{rows} rows, ...{', conv_kernel_size' if kind == 'conv' else ''}]"
                )
    return entries, set(expected)


def _saved_indexer_layers(info: CheckpointInfo, state: dict[str, Any]) -> list[int]:
    """The layers whose indexer keys the file holds (`indexer_layers` of the cache's own metadata), each
    an extra tensor `[rows, columns, index_head_dim]`; `CheckpointError` naming the file otherwise."""
    layers = state.get("indexer_layers", [])
    if (
        not isinstance(layers, list)
        or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers)
        or len(set(layers)) != len(layers)
    ):
        raise CheckpointError(
            f"{info.path}: user metadata {METADATA_KEY!r}: 'indexer_layers': expected distinct model layers, "
            f"got {layers!r:.80}"
        )
    rows = len(info.cache_lengths)
    for i in layers:
        shape = info.extra_tensors.get(indexer_tensor_name(i), (None, ()))[1]
        if len(shape) != 3 or shape[0] != rows or shape[1] != state["columns"] or shape[2] == 0:
            raise CheckpointError(
                f"{info.path}: {indexer_tensor_name(i)} is {list(shape)}: expected [{rows} rows, "
                f"{state['columns']} columns, index_head_dim]"
            )
    return layers


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
