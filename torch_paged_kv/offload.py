"""Host copies of pages: what `KVCacheManager.offload` keeps and `restore` puts back into a pool.

A host copy is one tensor per page tensor of the collection (`blocks`, and `scales` for a
per-granule FP8 cache), `[pages, ...]` in the sequence's page order, pinned when the pool is on a
GPU. Restoring shares again every full page whose prefix key is still cached, so a page that other
sequences hold (a system prompt) stays one copy.
"""

from __future__ import annotations

import torch

from .collection import PagedKVCacheCollection
from .ops.quant import indexable
from .page_pool import PagePool

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
