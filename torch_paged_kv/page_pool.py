"""`PagePool`: the physical pages of one KV pool: refcounts, free pages, and the prefix cache.

A full page is keyed by `sha256(parent_key + token ids as little-endian int64)`, chained from
`root_key(salt)`, so a key names the whole token prefix up to the end of that page. A cached page
nobody references stays cached ("evictable") until an allocation needs it; evictable pages leave
in the order they became unreferenced (least recently used first). This is vLLM's block pool:
it knows page ids and keys, never which sequence holds a page (`page_table.PageTable` does).
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence

import numpy as np

from .layout import NULL_PAGE


class OutOfPagesError(RuntimeError):
    """Not enough free or evictable pages (in layer group `group` of a cache of several); the manager
    was left unchanged."""

    def __init__(self, needed: int, free: int, evictable: int, group: int | None = None) -> None:
        where = "" if group is None else f" in layer group {group}"
        super().__init__(f"out of KV pages{where}: {needed} needed, {free} free, {evictable} evictable")
        self.needed, self.free, self.evictable, self.group = needed, free, evictable, group


def root_key(salt: bytes | None) -> bytes:
    """Parent key of a sequence's first page; different salts give disjoint caches."""
    return hashlib.sha256(b"torch_paged_kv/prefix/" + (salt or b"")).digest()


TOKEN_DTYPE = np.dtype("<i8")
"""How token ids enter keys: little-endian int64."""


def token_array(name: str, tokens: Iterable[int]) -> np.ndarray:
    """`tokens` as an int64 array; anything but ints (floats, strings) raises ValueError naming `name`."""
    try:
        return np.frombuffer(array("q", tokens), dtype=np.int64)
    except (TypeError, OverflowError) as exc:
        raise ValueError(f"{name}: expected a sequence of int token ids ({exc})") from None


def page_key(parent: bytes, tokens: Sequence[int] | np.ndarray) -> bytes:
    """Key of a full page holding `tokens` (ints), chained over its parent page's key."""
    return page_key_of_bytes(parent, np.asarray(tokens, dtype=TOKEN_DTYPE).tobytes())


def page_key_of_bytes(parent: bytes, token_bytes: bytes) -> bytes:
    """`page_key` of a page whose token ids are given as `TOKEN_DTYPE` bytes."""
    return hashlib.sha256(parent + token_bytes).digest()


class PagePool:
    """Pages `1..num_pages`: each is free, referenced (refcount > 0), or cached and evictable.
    `group`: the layer group whose pool it is, named by `OutOfPagesError` (None: a cache of one group)."""

    def __init__(self, num_pages: int, group: int | None = None) -> None:
        self.group = group
        self.refcounts = [0] * (num_pages + 1)
        self.free = list(range(num_pages, NULL_PAGE, -1))  # pop() hands out low ids first
        self.evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.page_of: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}

    def available(self) -> int:
        """Pages an allocation may take now: free plus evictable."""
        return len(self.free) + len(self.evictable)

    def require(self, needed: int) -> None:
        """`OutOfPagesError` unless an allocation of `needed` pages can succeed now."""
        if needed > len(self.free) + len(self.evictable):
            raise OutOfPagesError(needed, len(self.free), len(self.evictable), self.group)

    def in_use(self) -> int:
        """Pages some sequence holds (refcount > 0)."""
        return len(self.refcounts) - 1 - len(self.free) - len(self.evictable)

    def free_pages(self) -> list[int]:
        """The free pages, in the order allocations take them."""
        return self.free[::-1]

    def counts(self) -> tuple[int, int, int]:
        """(free, evictable, cached) page counts: cached includes the referenced cached pages."""
        return len(self.free), len(self.evictable), len(self.key_of)

    def allocate(self, count: int) -> list[int]:
        """`count` pages with refcount 1, free ones first, then evicting LRU cached pages.

        The caller checks `available()` first.
        """
        take = min(count, len(self.free))
        pages = self.free[len(self.free) - take :]
        del self.free[len(self.free) - take :]
        pages.reverse()
        for _ in range(count - take):
            page, _ = self.evictable.popitem(last=False)
            del self.page_of[self.key_of.pop(page)]
            pages.append(page)
        refcounts = self.refcounts
        for page in pages:
            refcounts[page] = 1
        return pages

    def peek(self, count: int, keep: Collection[int] = ()) -> list[int]:
        """The pages `allocate(count)` would hand out, without taking them: free pages first, then
        evictable cached pages least recently used first, skipping those in `keep`. The caller checks
        there are enough (`available()`, less the evictable pages in `keep`)."""
        take = min(count, len(self.free))
        pages = self.free[len(self.free) - take :][::-1]
        if count > take:
            pages += itertools.islice((p for p in self.evictable if p not in keep), count - take)
        return pages

    def take(self, pages: Sequence[int]) -> None:
        """Allocate exactly `pages`, as `peek` returned them with the pool unchanged since: refcount 1;
        the cached ones among them leave the prefix cache."""
        take = min(len(pages), len(self.free))
        if self.free[len(self.free) - take :][::-1] != list(pages[:take]):
            raise RuntimeError("PagePool.take: the pool changed since peek")
        del self.free[len(self.free) - take :]
        for page in pages[take:]:
            del self.evictable[page]
            del self.page_of[self.key_of.pop(page)]
        for page in pages:
            self.refcounts[page] = 1

    def forget(self, pages: Iterable[int]) -> None:
        """Drop the cache entries of unreferenced cached `pages` whose contents are no longer what their
        keys say (they become free pages); other pages are left alone."""
        for page in pages:
            if self.refcounts[page] == 0 and page in self.key_of:
                del self.evictable[page]
                del self.page_of[self.key_of.pop(page)]
                self.free.append(page)

    def unpublish(self, page: int) -> None:
        """Take a referenced `page` out of the prefix cache (its contents are about to change); a page
        not cached is left alone."""
        key = self.key_of.pop(page, None)
        if key is not None:
            del self.page_of[key]

    def ref(self, page: int) -> None:
        """One more owner of `page` (a cached page stops being evictable)."""
        if self.refcounts[page] == 0:
            del self.evictable[page]
        self.refcounts[page] += 1

    def unref(self, pages: Iterable[int]) -> None:
        """Drop one owner of each page, in order; unreferenced pages become evictable or free."""
        refcounts = self.refcounts
        for page in pages:
            refcounts[page] -= 1
            if refcounts[page] == 0:
                if page in self.key_of:
                    self.evictable[page] = None
                else:
                    self.free.append(page)

    def lookup(self, key: bytes) -> int | None:
        """The cached page with this key, if any."""
        return self.page_of.get(key)

    def register(self, page: int, key: bytes) -> None:
        """Cache a full, referenced `page` under `key` unless either is already cached."""
        if key not in self.page_of and page not in self.key_of:
            self.page_of[key] = page
            self.key_of[page] = key

    def match_prefix(
        self, root: bytes, tokens: np.ndarray, page_size: int, max_pages: int
    ) -> tuple[list[int], list[bytes]]:
        """The cached pages holding the longest prefix of `tokens` in whole pages (at most `max_pages`),
        and their keys, chained from `root`. Nothing is referenced: the caller `ref`s what it keeps."""
        pages: list[int] = []
        keys: list[bytes] = []
        parent = root
        for i in range(max_pages):
            key = page_key(parent, tokens[i * page_size : (i + 1) * page_size])
            page = self.page_of.get(key)
            if page is None:
                break
            pages.append(page)
            keys.append(key)
            parent = key
        return pages, keys

    def cache_full_page(self, parent: bytes, page: int, token_bytes: bytes) -> bytes:
        """Key the full `page` by its tokens (`TOKEN_DTYPE` bytes) chained over `parent`, cache it
        (`register`), and return the key (vLLM's `cache_full_blocks`, one page)."""
        key = page_key_of_bytes(parent, token_bytes)
        self.register(page, key)
        return key
