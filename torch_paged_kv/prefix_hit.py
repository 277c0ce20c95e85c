"""The prefix-cache hit of a prompt over a cache's layer groups (`KVCacheManager.claim`).

A page's key names the tokens up to its end, so page i has the same key in every group; each
group's pool caches its own pages under those keys. A hit of h whole pages is usable only when every
group still holds what the continuation needs (docs/manager.md, vLLM's hybrid allocator rule): a
full group pages 0..h-1, a sliding-window group the pages from `first_held_page(h * page_size - R)`
on, with R the manager's `max_rewind` (the pages a rewind of up to R tokens needs, as a commit keeps).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .layout import NULL_PAGE
from .page_pool import PagePool, page_key
from .params import KVCacheParams


def match_prefix(
    pools: Sequence[PagePool],
    params: Sequence[KVCacheParams],
    root: bytes,
    prompt: np.ndarray,
    max_pages: int,
    max_rewind: int = 0,
) -> tuple[list[list[int]], list[bytes]]:
    """Each group's pages of the longest cached prefix of `prompt` (whole pages, at most `max_pages`)
    that every group can continue from, and its keys chained from `root`: a group without a window
    needs every page of the prefix cached; a sliding-window group only the pages from the first one
    it keeps at that length (what a rewind of up to `max_rewind` tokens needs too); the rest are the
    null page. Nothing is referenced."""
    page_size = params[0].page_size
    keys: list[bytes] = []
    parent = root

    def key(i: int) -> bytes:  # keys are computed as far as they are asked for
        nonlocal parent
        while len(keys) <= i:
            j = len(keys)
            parent = page_key(parent, prompt[j * page_size : (j + 1) * page_size])
            keys.append(parent)
        return keys[i]

    hit = max_pages
    for pool, p in zip(pools, params, strict=True):
        if p.sliding_window is None:  # a full group: the prefix cached from page 0 on
            n = 0
            while n < hit and pool.lookup(key(n)) is not None:
                n += 1
            hit = n
    changed = True
    while changed:  # a sliding group may shorten the hit, which moves the pages others need
        changed = False
        for pool, p in zip(pools, params, strict=True):
            if p.sliding_window is not None:
                n = _sliding_hit(pool, p, hit, key, max_rewind)
                changed |= n < hit
                hit = n
    pages = []
    for pool, p in zip(pools, params, strict=True):
        first = _first_kept(p, hit, max_rewind)
        pages.append([NULL_PAGE] * first + [pool.page_of[key(i)] for i in range(first, hit)])
    return pages, keys[:hit]


def _first_kept(params: KVCacheParams, hit: int, max_rewind: int) -> int:
    """The first page a group of `params` keeps for a hit of `hit` pages (0 without a window)."""
    return params.first_held_page(max(hit * params.page_size - max_rewind, 0))


def _sliding_hit(pool: PagePool, params: KVCacheParams, hit: int, key: Callable[[int], bytes], max_rewind: int) -> int:
    """The longest hit of at most `hit` pages whose pages from `_first_kept` on are all cached in
    `pool` (a sliding-window group's test, scanned from the end as vLLM's)."""
    while hit > 0:
        first = _first_kept(params, hit, max_rewind)
        miss = next((i for i in range(hit - 1, first - 1, -1) if pool.lookup(key(i)) is None), None)
        if miss is None:
            return hit
        hit = miss  # a hit ending at or before the missing page
    return 0
