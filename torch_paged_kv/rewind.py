"""Speculative decoding on a manager's sequences: `KVCacheManager.rewind` and `KVCacheManager.accept`.

`rewind` drops a sequence's last tokens: pages past the new length go back to their pools (one
reference less: a page a fork or the prefix cache shares stays with them, cached pages stay
cached), the token ids and prefix keys past it are forgotten. `accept`, after a tree verify step,
moves the kept tokens' K/V (every group, layer, K and V, FP8 scales) to the front of the step and
rewinds the rest. A page about to be written again or keyed anew (the new partial last page, the
pages tokens move into or whose ids change) is made private first: copied to a fresh page
(`copy_pages`) when someone else holds it, taken out of the prefix cache when keyed, so nobody
else ever sees a page change (docs/manager.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .collection import PagedKVCacheCollection
from .layout import NULL_PAGE
from .ops.quant import indexable
from .page_pool import PagePool, token_array
from .page_table import PageTable
from .sequences import SequenceState, cache_full_pages


def rewind_tokens(pools: Sequence[PagePool], table: PageTable, seq: SequenceState, n: object) -> None:
    """Drop the last `n` tokens of `seq` (on device, not in a prepared step), all or nothing."""
    length = int(table.lengths[seq.slot])
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or not 0 <= n <= length:
        raise ValueError(
            f"n: expected an int in 0..{length} (sequence {seq.seq_id!r} holds {length} tokens), got {n!r}"
        )
    if n == 0:
        return
    new_length = length - int(n)
    _check_held(table, seq, new_length, "n")
    keep = table.pages_for(new_length)  # the pages past it go back first: a copy may take one of them
    freed = [sum(pool.refcounts[p] == 1 for p in g.rows[seq.slot, keep : g.num_pages[seq.slot]] if p != NULL_PAGE)
             for pool, g in zip(pools, table.groups, strict=True)]  # fmt: skip
    held = _plan_private(pools, table, seq.slot, _partial(table, new_length), freed)
    _truncate(pools, table, seq, new_length, forget=False)
    _make_private(pools, table, seq.slot, held)


def accept_path(
    pools: Sequence[PagePool],
    table: PageTable,
    root: bytes,
    seq: SequenceState,
    kept: Sequence[int],
    token_ids: Sequence[int] | None,
) -> None:
    """Keep the new tokens `kept` (indices, in path order) of `seq`'s last committed step, at the
    step's first positions; drop the others. All or nothing."""
    slot = seq.slot
    start, length = int(table.step_start[slot]), int(table.lengths[slot])
    if start < 0:
        raise ValueError(f"seq_id: sequence {seq.seq_id!r} has no committed step to accept tokens of")
    path = _check_kept(kept, length - start)
    ids = None if token_ids is None else token_array("token_ids", token_ids)
    if ids is not None and len(ids) != len(path):
        raise ValueError(f"token_ids: expected {len(path)} ids (one per kept token), got {len(ids)}")
    new_length = start + len(path)
    _check_held(table, seq, new_length, "kept")
    moved = np.flatnonzero(path != np.arange(len(path)))
    known = int(table.known[slot])
    record = ids is not None and known >= start  # the given ids replace the step's
    unchanged = 0 if record else int(moved[0]) if moved.size else len(path)  # positions start + unchanged.. change
    first = (start + unchanged) // table.page_size  # pages from here on are written or rekeyed
    held = _plan_private(pools, table, slot, list(range(first, table.pages_for(new_length))), [0] * len(pools))
    _make_private(pools, table, slot, held)
    if moved.size:
        for group in table.groups:
            _move(group.collection, group.rows[slot], start + path[moved], start + moved)
    if ids is not None and record:
        table.reserve_tokens(new_length)
        table.tokens[slot, start:new_length] = ids
        table.known[slot] = new_length
    elif known >= length:  # the step's ids are known: they move with their tokens
        table.tokens[slot, start:new_length] = table.tokens[slot, start + path]
    else:
        table.known[slot] = min(known, start)
    del seq.keys[first:]
    _truncate(pools, table, seq, new_length, forget=True)
    known = int(table.known[slot])
    if known >= 0:
        cache_full_pages(pools, table, root, [seq], [known // table.page_size])


def _check_kept(kept: Sequence[int], count: int) -> np.ndarray:
    """`kept` as int64 indices, distinct, each in 0..count-1 (ValueError naming `kept`)."""
    try:
        items = list(kept)
    except TypeError:
        raise ValueError(f"kept: expected a sequence of indices into the step's {count} new tokens") from None
    if any(not isinstance(i, (int, np.integer)) or isinstance(i, bool) for i in items):
        raise ValueError(f"kept: expected int indices, got {items!r}")
    if any(not 0 <= i < count for i in items):
        raise ValueError(f"kept: expected indices in 0..{count - 1} (the step's new tokens), got {items!r}")
    if len(set(items)) != len(items):
        raise ValueError(f"kept: lists a token more than once: {items!r}")
    return np.array(items, dtype=np.int64)


def _partial(table: PageTable, length: int) -> list[int]:
    """The table entry of a partial last page of a sequence of `length` tokens (none when it ends a page)."""
    return [length // table.page_size] if length % table.page_size else []


def _check_held(table: PageTable, seq: SequenceState, length: int, name: str) -> None:
    """ValueError naming `name` unless every group holds the pages a sequence of `length` tokens needs:
    a sliding-window group keeps only what a rewind of up to `max_rewind` tokens needs, and pages it
    dropped cannot come back."""
    for g, group in enumerate(table.groups):
        first = int(group.first_held(np.array([length]))[0])
        if (group.rows[seq.slot, first : table.pages_for(length)] == NULL_PAGE).any():
            raise ValueError(
                f"{name}: sequence {seq.seq_id!r} would go back to {length} tokens, but layer group {g} "
                f"(sliding_window={group.window}) already dropped pages that length needs (it keeps what a "
                f"rewind of up to max_rewind={group.max_rewind} tokens from its longest length needs: "
                "KVCacheManager(..., max_rewind=...))"
            )


def _plan_private(
    pools: Sequence[PagePool], table: PageTable, slot: int, entries: list[int], freed: list[int]
) -> list[list[int]]:
    """The pages of table entries `entries` of `slot` in each group (the null page left out), after
    checking that every group can copy the ones someone else holds (`OutOfPagesError` otherwise;
    `freed[g]`: pages of group g that become available before the copies are made)."""
    held = []
    for pool, group, extra in zip(pools, table.groups, freed, strict=True):
        pages = [p for p in group.rows[slot, entries].tolist() if p != NULL_PAGE]
        pool.require(sum(pool.refcounts[p] > 1 for p in pages) - extra)
        held.append(pages)
    return held


def _make_private(pools: Sequence[PagePool], table: PageTable, slot: int, held: list[list[int]]) -> None:
    """Make `slot`'s pages `held[g]` (`_plan_private`'s) safe to overwrite: a page someone else holds is
    replaced by a copy of it, a page only `slot` holds leaves the prefix cache."""
    for pool, group, pages in zip(pools, table.groups, held, strict=True):
        shared = [p for p in pages if pool.refcounts[p] > 1]
        for p in pages:
            if pool.refcounts[p] == 1:
                pool.unpublish(p)
        if shared:
            fresh = pool.allocate(len(shared))
            group.copy_pages(shared, fresh)
            row = group.rows[slot]
            for old, new in zip(shared, fresh, strict=True):
                row[row == old] = new
            pool.unref(shared)


def _move(collection: PagedKVCacheCollection, row: np.ndarray, src: np.ndarray, dst: np.ndarray) -> None:
    """Copy the K/V (every layer and plane, FP8 scales) of positions `src` to positions `dst` of the
    sequence whose table row is `row`, all sources read first; positions whose page the row no longer
    holds (left a sliding window) are skipped."""
    page_size = collection.params.page_size
    keep = row[dst // page_size] != NULL_PAGE
    src, dst = src[keep], dst[keep]
    if not dst.size:
        return
    index = [
        torch.from_numpy(a).to(collection.device)
        for a in (
            row[src // page_size].astype(np.int64),
            src % page_size,
            row[dst // page_size].astype(np.int64),
            dst % page_size,
        )
    ]
    for t in collection.page_tensors():
        data = indexable(t)
        data[index[2], :, :, index[3]] = data[index[0], :, :, index[1]]  # the gather is a copy: read first


def _truncate(pools: Sequence[PagePool], table: PageTable, seq: SequenceState, length: int, forget: bool) -> None:
    """Make `length` the length of `seq`: table entries past it go back to their pools (last first;
    `forget`: their prefix keys too, where nobody holds them any more), token ids and keys past it
    are forgotten, and it has no step to accept."""
    slot, keep = seq.slot, table.pages_for(length)
    for pool, group in zip(pools, table.groups, strict=True):
        entries = group.rows[slot, keep : group.num_pages[slot]]
        dropped = entries[entries != NULL_PAGE].tolist()[::-1]
        group.set_pages(slot, group.pages(slot)[:keep])
        pool.unref(dropped)
        if forget:
            pool.forget(dropped)
    table.lengths[slot] = length
    table.known[slot] = min(int(table.known[slot]), length)
    table.step_start[slot] = -1
    del seq.keys[length // table.page_size :]
