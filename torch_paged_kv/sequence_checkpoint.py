"""KV checkpoints of a manager's sequences: `save_sequences` and `load_sequences` (`torch_paged_kv.*`).

Above both the manager and checkpoint/: a save writes the sequences' lengths and table rows with
`checkpoint.save_cache(rows=...)` and their known token ids as user metadata (`METADATA_KEY`); a
load checks the file against the live cache, reserves pages (`KVCacheManager.reserve`), streams
the stored pages into them (`checkpoint.load_pages`) and commits, all or nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence

import torch

from . import checkpoint
from .layer_groups import LayerGroups
from .manager import KVCacheManager
from .page_pool import token_array
from .params import KVCacheParams, TPShard, describe_heads

METADATA_KEY = "torch_paged_kv.manager"
"""Checkpoint user-metadata key holding the saved sequences' token ids (JSON)."""


def save_sequences(manager: KVCacheManager, path: str | os.PathLike[str], seq_ids: Sequence) -> None:
    """Save sequences of `manager` (on device, not in a prepared step) with `checkpoint.save_cache`.

    Row i of the file is `seq_ids[i]`; pages they share are stored once. Token ids known for
    prefix caching go into the checkpoint's metadata, `manager.tp_shard` into its params. The live
    step tensors are untouched.
    """
    ids = list(seq_ids)
    groups = range(len(manager.collections))
    lengths, _ = manager.committed_rows(ids)
    if not ids:
        raise ValueError("seq_ids: nothing to save (empty)")
    tables = [torch.from_numpy(manager.committed_rows(ids, g)[1]) for g in groups]
    rows = (torch.from_numpy(lengths.astype("int32")), tables[0] if len(tables) == 1 else tables)
    meta = {"token_ids": [manager.token_ids(i) for i in ids]}
    metadata = {METADATA_KEY: json.dumps(meta)}
    cache = manager.collection if len(tables) == 1 else manager.groups
    checkpoint.save_cache(cache, path, rows=rows, metadata=metadata, tp_shard=manager.tp_shard)


def load_sequences(manager: KVCacheManager, path: str | os.PathLike[str], seq_ids: Sequence | None = None) -> list:
    """Add the sequences of a checkpoint to `manager`'s live cache, in free pages; returns their ids.

    Ids are `seq_ids` if given, else fresh `("loaded", n)` tuples (`manager.fresh_ids`). All or
    nothing: a checkpoint whose params, KV heads (`tp_shard`), kind, tables or token ids do not fit raises
    `checkpoint.CheckpointError`, too few pages `OutOfPagesError`, before any page is taken. Pages
    stream straight into the pool; a checksum error found on the way also raises `CheckpointError`
    with the manager as before, except that prefix-cache entries of the pages it was going to evict
    are dropped.
    """
    info = checkpoint.read_info(path)
    collections, groups = manager.collections, manager.groups
    c = collections[0]
    if len(collections) > 1 or len(info.groups) > 1:
        theirs = [(g.params, g.layers) for g in info.groups]
        if info.kind != checkpoint.PAGED or theirs != list(zip(groups.params, groups.layers, strict=True)):
            raise checkpoint.CheckpointError(f"{path}: {_misfit_groups(info, groups)}")
    elif info.kind != checkpoint.PAGED or (info.params, info.tp_shard) != (c.params, manager.tp_shard):
        raise checkpoint.CheckpointError(f"{path}: {_misfit(info, c.params, manager.tp_shard)}")
    if max(info.cache_lengths) > c.max_seq_len:
        raise checkpoint.CheckpointError(
            f"{path}: a sequence of {max(info.cache_lengths)} tokens exceeds max_seq_len={c.max_seq_len}"
        )
    batch = len(info.cache_lengths)
    ids = manager.fresh_ids(batch) if seq_ids is None else list(seq_ids)
    if len(ids) != batch:
        raise ValueError(f"seq_ids: the checkpoint holds {batch} sequences, got {len(ids)} ids")
    manager.check_new_ids(ids)
    tokens = saved_token_ids(path, info, c.max_seq_len)
    rows = [info.stored_rows(g) for g in range(len(info.groups))]  # -1 below a sliding window
    try:
        reservation = manager.reserve(ids, info.cache_lengths, rows[0] if len(rows) == 1 else rows, token_ids=tokens)
    except checkpoint.CheckpointError:
        raise
    except ValueError as exc:  # the ids were checked above: what reserve refuses is the file's
        raise checkpoint.CheckpointError(f"{path}: {exc}") from None
    with reservation:
        for g, (pick, group) in enumerate(zip(reservation.groups, collections, strict=True)):
            order = [0] * info.groups[g].num_pages  # stored page j + 1 -> order[j]
            for i, page in zip(pick.incoming, pick.pages, strict=True):
                order[i] = page
            checkpoint.load_pages(path, group.blocks, order, scales=group.scales, group=g, info=info)
        reservation.commit()
    return ids


def saved_token_ids(path: str | os.PathLike[str], info: checkpoint.CheckpointInfo, max_len: int) -> list:
    """The token ids `save` stored with each sequence of `info` (None where it had none), checked."""
    text = info.user_metadata.get(METADATA_KEY)
    batch = len(info.cache_lengths)
    if text is None:
        return [None] * batch

    def bad(what: str) -> checkpoint.CheckpointError:
        return checkpoint.CheckpointError(f"{path}: user metadata {METADATA_KEY!r}: {what}")

    try:
        payload = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise bad(f"not JSON ({exc})") from None
    if not isinstance(payload, dict):
        raise bad(f"expected a JSON object, got {type(payload).__name__}")
    rows = payload.get("token_ids", [None] * batch)
    if not isinstance(rows, list) or len(rows) != batch:
        got = f"{len(rows)} rows of token ids" if isinstance(rows, list) else type(rows).__name__
        raise bad(f"'token_ids': the file holds {batch} sequences, {got}")
    tokens = []
    for b, row in enumerate(rows):
        ok = row is None or (isinstance(row, list) and len(row) <= max_len and all(type(t) is int for t in row))
        try:
            tokens.append(None if row is None or not ok else token_array("token_ids", row))
        except ValueError:
            ok = False
        if not ok:
            raise bad(f"'token_ids' row {b}: expected null or at most {max_len} int64 ids")
    return tokens


def _misfit_groups(info: checkpoint.CheckpointInfo, groups: LayerGroups) -> str:
    """Why the checkpoint of `info` does not load into this cache of layer `groups` (or the reverse)."""

    def describe(pairs: list) -> str:
        return "; ".join(f"layers {list(layers)}: {params}" for params, layers in pairs)

    theirs = describe([(g.params, g.layers) for g in info.groups])
    ours = describe(list(zip(groups.params, groups.layers, strict=True)))
    return f"a {info.kind} cache of {len(info.groups)} layer group(s) ({theirs}) does not fit this cache ({ours})"


def _misfit(info: checkpoint.CheckpointInfo, ours: KVCacheParams, our_shard: TPShard | None) -> str:
    """Why the checkpoint of `info` does not load into this paged cache of `ours` holding `our_shard`."""
    theirs = info.params
    if theirs.is_mla != ours.is_mla:
        kinds = {True: "an MLA (latent)", False: "a K/V"}
        return f"{kinds[theirs.is_mla]} cache does not fit this {kinds[ours.is_mla].split(' ', 1)[1]} cache ({theirs})"
    try:
        other_heads = dataclasses.replace(theirs, num_kv_heads=ours.num_kv_heads) == ours
    except ValueError:
        other_heads = False
    other_heads &= (info.tp_shard, theirs.num_kv_heads) != (our_shard, ours.num_kv_heads)
    hint = " (a shard of other KV heads: see torch_paged_kv.distributed.reshard.load_sharded)" * other_heads
    file, live = f"{theirs}, {describe_heads(theirs, info.tp_shard)}", f"{ours}, {describe_heads(ours, our_shard)}"
    return f"a {info.kind} cache of {file} does not fit this paged cache of {live}{hint}"
