"""Host copies of pages: what `KVCacheManager.offload` keeps and `restore` puts back into the pools.

A host copy is one tensor per page tensor of the collection (`blocks`, and `scales` for a
per-granule FP8 cache), `[pages, ...]` in the sequence's page order, pinned when the pool is on a
GPU. Restoring shares again every full page whose prefix key is still cached, so a page that other
sequences hold (a system prompt) stays one copy.
"""

from __future__ import annotations

import torch

from .collection import PagedKVCacheCollection
from .layout import NULL_PAGE
from .ops.quant import indexable
from .page_pool import PagePool
from .page_table import PageTable

HostCopy = list[torch.Tensor]
"""One host tensor per page tensor of the collection, `[pages, ...]`."""


def read_pages(collection: PagedKVCacheCollection, pages: list[int]) -> HostCopy:
    """Host copies of `pages` of every page tensor (pinned for a GPU pool; blocking copies)."""
    out = []
    for t in collection.page_tensors():
        data = indexable(t)
        host = torch.empty((len(pages), *data.shape[1:]), dtype=data.dtype, pin_memory=data.is_cuda)
        out.append(host.copy_(data.index_select(0, torch.tensor(pages, dtype=torch.long, device=data.device))))
    return out


def write_pages(collection: PagedKVCacheCollection, pages: list[int], contents: HostCopy) -> None:
    """Write host copies made by `read_pages` into `pages`."""
    for t, host in zip(collection.page_tensors(), contents, strict=True):
        data = indexable(t)
        data.index_copy_(0, torch.tensor(pages, dtype=torch.long, device=data.device), host.to(data.device))


def restore_need(pool: PagePool, copies: list[tuple[HostCopy, list[bytes]]]) -> int:
    """Free or evictable pages `restore_pages(pool, ..., copies)` needs: a fresh page per page not
    cached any more, and one per cached page that nobody holds (it leaves the evictable ones)."""
    cached = [[pool.lookup(key) for key in keys] for _, keys in copies]
    missing = sum(
        host[0].shape[0] - len(hits) + hits.count(None) for (host, _), hits in zip(copies, cached, strict=True)
    )
    revived = {page for hits in cached for page in hits if page is not None and pool.refcounts[page] == 0}
    return missing + len(revived)


def restore_pages(
    pool: PagePool, collection: PagedKVCacheCollection, copies: list[tuple[HostCopy, list[bytes]]]
) -> list[list[int]]:
    """Pages holding each `(host copy, prefix keys of its leading full pages)` again, all or nothing
    (`OutOfPagesError` before anything changed): a full page whose key is still cached is shared
    (one more reference), the others are written into fresh pages and keyed again."""
    pool.require(restore_need(pool, copies))
    cached = [[pool.lookup(key) for key in keys] for _, keys in copies]
    for hits in cached:
        for page in hits:
            if page is not None:
                pool.ref(page)
    restored = []
    for (host, keys), hits in zip(copies, cached, strict=True):
        hits += [None] * (host[0].shape[0] - len(hits))
        todo = [i for i, page in enumerate(hits) if page is None]
        fresh = pool.allocate(len(todo))
        write_pages(collection, fresh, [t[todo] for t in host])
        written = iter(fresh)
        pages = [next(written) if page is None else page for page in hits]
        for page, key in zip(pages[: len(keys)], keys, strict=True):  # keyed: the leading full pages
            pool.register(page, key)
        restored.append(pages)
    return restored


def offload_slot(pools: list[PagePool], table: PageTable, slot: int) -> list[HostCopy]:
    """Host copies of what `slot` holds in each group (from the first page it holds, in a sliding window
    group those a rewind needs too, to its last used one); its pages go back to the pools and its
    table rows empty."""
    used = table.pages_for(int(table.lengths[slot]))
    copies = []
    for pool, group in zip(pools, table.groups, strict=True):
        first = group.first_entry(slot)
        copies.append(read_pages(group.collection, group.pages(slot)[first:used]))
        pool.unref(reversed(group.held(slot)))
        group.set_pages(slot, [])
    return copies


def restore_slots(
    pools: list[PagePool], table: PageTable, slots: list[int], host: list[list[HostCopy]], keys: list[list[bytes]]
) -> None:
    """Put `slots[i]` back from its host copies `host[i]` (one per group, `offload_slot`'s: its pages up to
    the last used one; `keys[i]`: the prefix keys of its leading full pages), all or nothing over every
    group (`OutOfPagesError` before any change)."""
    used = [table.pages_for(int(table.lengths[slot])) for slot in slots]
    firsts = [[n - held[g][0].shape[0] for n, held in zip(used, host, strict=True)] for g in range(len(table.groups))]
    copies = [
        [(held[g], k[first:]) for held, k, first in zip(host, keys, firsts[g], strict=True)]
        for g in range(len(table.groups))
    ]
    for pool, group_copies in zip(pools, copies, strict=True):
        pool.require(restore_need(pool, group_copies))
    restored = [
        restore_pages(pool, group.collection, group_copies)
        for pool, group, group_copies in zip(pools, table.groups, copies, strict=True)
    ]
    for i, slot in enumerate(slots):
        for g, group in enumerate(table.groups):
            group.set_pages(slot, [NULL_PAGE] * firsts[g][i] + restored[g][i])
