"""`Reservation`: sequences whose pages come from elsewhere (another process, a file), added in two phases.

`KVCacheManager.reserve(...)` checks the sequences and picks the pages their contents go to, taking
nothing; the caller writes the pages; `commit()` takes them and registers the sequences, `abort()`
gives up. Until one of them the manager refuses every change (`RuntimeError`), so the picked pages
stay what they were.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .layout import NULL_PAGE
from .page_pool import PagePool, token_array
from .params import KVCacheParams


@dataclasses.dataclass(frozen=True)
class Incoming:
    """The sequences of a reservation, checked and normalised: `seq_ids[i]` holds `lengths[i]` tokens,
    in layer group g in the incoming pages `rows[g][i]` (`ceil(length / page_size)` entries: indices
    into that group's incoming pages `0..n-1`, each used; rows may share full pages; -1 where a
    sliding-window group holds no page: the entries below `KVCacheParams.first_held_page`, whatever
    was given there), its token ids known from position 0 `tokens[i]` (or None), for prefix caching,
    and the prefix keys `keys[i]` of its leading full pages, computed with the manager's salt;
    `page_keys[g]` is the key of each keyed incoming page of group g that a row holds."""

    seq_ids: list
    lengths: list[int]
    rows: list[list[list[int]]]
    tokens: list[np.ndarray | None]
    keys: list[list[bytes]]
    page_keys: list[dict[int, bytes]]

    @classmethod
    def check(
        cls,
        seq_ids: list,
        cache_lengths: Sequence[int],
        page_rows: Sequence[Sequence[Sequence[int]]],
        token_ids: Sequence[Sequence[int] | None] | None,
        prefix_keys: Sequence[Sequence[bytes]] | None,
        params: Sequence[KVCacheParams],
        max_seq_len: int,
        prefix_caching: bool,
    ) -> Incoming:
        """The arguments of `KVCacheManager.reserve` (ids checked there; `page_rows[g]`: group g's rows,
        `params[g]` its params), ValueError naming the bad one."""
        batch = len(seq_ids)
        if len(cache_lengths) != batch:
            raise ValueError(f"cache_lengths: expected {batch} entries (one per sequence), got {len(cache_lengths)}")
        lengths = [int(n) for n in cache_lengths]
        if any(not 0 <= n <= max_seq_len for n in lengths):
            raise ValueError(f"cache_lengths: expected 0..{max_seq_len}, got {lengths}")
        rows = [_group_rows(group_rows, lengths, p) for group_rows, p in zip(page_rows, params, strict=True)]
        page_size = params[0].page_size
        tokens: list[np.ndarray | None] = [None] * batch
        if token_ids is not None:
            if len(token_ids) != batch:
                raise ValueError(f"token_ids: expected {batch} entries (one per sequence), got {len(token_ids)}")
            tokens = [None if t is None else token_array("token_ids", t) for t in token_ids]
            if any(t is not None and len(t) > max_seq_len for t in tokens):
                raise ValueError(f"token_ids: more than max_seq_len={max_seq_len} ids")
        keys: list[list[bytes]] = [[] for _ in seq_ids]
        if prefix_keys is not None:
            if len(prefix_keys) != batch:
                raise ValueError(f"prefix_keys: expected {batch} entries (one per sequence), got {len(prefix_keys)}")
            keys = [list(k) for k in prefix_keys]
            for row_keys, n in zip(keys, lengths, strict=True):
                well_formed = all(isinstance(k, bytes) and len(k) == 32 for k in row_keys)
                if len(row_keys) > n // page_size or not well_formed:
                    raise ValueError("prefix_keys: expected 32-byte keys of at most the full pages of each row")
        if not prefix_caching:
            tokens, keys = [None] * batch, [[] for _ in seq_ids]
        page_keys: list[dict[int, bytes]] = []
        for group_rows in rows:
            group_keys: dict[int, bytes] = {}
            for row, row_keys in zip(group_rows, keys, strict=True):
                for i, key in zip(row, row_keys, strict=False):
                    if i >= 0 and group_keys.setdefault(i, key) != key:
                        raise ValueError(f"prefix_keys: incoming page {i} has two different keys")
            page_keys.append(group_keys)
        return cls(seq_ids, lengths, rows, tokens, keys, page_keys)


def _group_rows(page_rows: Sequence[Sequence[int]], lengths: list[int], params: KVCacheParams) -> list[list[int]]:
    """One group's `page_rows`, checked (ValueError naming it), with -1 below each row's first held page."""
    if len(page_rows) != len(lengths):
        raise ValueError(f"page_rows: expected {len(lengths)} entries (one per sequence), got {len(page_rows)}")
    page_size = params.page_size
    rows = [list(map(int, row)) for row in page_rows]
    used = sorted({i for row in rows for i in row if i >= 0})
    firsts = [params.first_held_page(n) for n in lengths]
    if used != list(range(len(used))) or any(
        len(row) != -(-n // page_size) or min(row[first:], default=0) < 0
        for row, n, first in zip(rows, lengths, firsts, strict=True)
    ):
        raise ValueError(
            "page_rows: expected ceil(length / page_size) incoming pages per row, using all of 0..n-1 "
            "(-1 only where a sliding-window group holds no page)"
        )
    rows = [[-1] * first + row[first:] for row, first in zip(rows, firsts, strict=True)]
    uses = Counter(i for row in rows for i in row if i >= 0)
    if any(uses[row[-1]] > 1 for row, n in zip(rows, lengths, strict=True) if n % page_size):
        raise ValueError("page_rows: only full pages may be shared (a partially filled page is in two places)")
    return rows


Register = Callable[[Incoming, list[list[list[int]]]], None]
"""What commit hands to the manager: the sequences and, per group, the physical pages of each row."""


class GroupPick:
    """The pages a reservation picked in one group's pool: write incoming page `incoming[j]` into
    physical page `pages[j]`; the incoming pages not listed are shared from the prefix cache or held
    by no row (below a sliding window)."""

    def __init__(self, pool: PagePool, rows: list[list[int]], page_keys: dict[int, bytes]) -> None:
        hits = {i: page for i, key in page_keys.items() if (page := pool.lookup(key)) is not None}
        held = sorted({i for row in rows for i in row if i >= 0})
        incoming = [i for i in held if i not in hits]
        revived = sum(1 for page in hits.values() if pool.refcounts[page] == 0)
        pool.require(len(incoming) + revived)  # a revived cached page leaves the evictable ones
        self.incoming: list[int] = incoming
        self.pages: list[int] = pool.peek(len(incoming), keep=set(hits.values()))
        self.pool, self.hits = pool, hits

    def commit(self, rows: list[list[int]], keys: list[list[bytes]]) -> list[list[int]]:
        """Take the pages, share the cached ones, key the full pages; the physical pages of each row."""
        pool, pages = self.pool, self.pages
        pool.take(pages)
        physical = {**self.hits, **dict(zip(self.incoming, pages, strict=True)), -1: NULL_PAGE}
        taken = set(pages)
        out = []
        for row, row_keys in zip(rows, keys, strict=True):
            row_pages = [physical[i] for i in row]
            for page in row_pages:
                if page == NULL_PAGE:
                    continue
                if page in taken:
                    taken.discard(page)  # the first owner holds the refcount `take` gave it
                else:
                    pool.ref(page)
            for page, key in zip(row_pages, row_keys, strict=False):
                if page != NULL_PAGE:
                    pool.register(page, key)
            out.append(row_pages)
        return out

    def abort(self, pages_written: int | None) -> None:
        pool = self.pool
        evicting = self.pages[min(len(self.pages), len(pool.free)) :]
        if pages_written is not None:
            evicting = evicting[: max(0, pages_written - len(pool.free))]
        pool.forget(evicting)


class Reservation:
    """Pages picked for the sequences of `KVCacheManager.reserve`, not yet taken.

    Write incoming page `incoming[j]` into physical page `pages[j]` (free pages first, then cached
    pages to evict, least recently used first); the incoming pages not listed are shared from this
    manager's prefix cache. A manager of several layer groups picks pages in each: `groups[g]` has
    group g's `incoming` and `pages` (`incoming` and `pages` are those of a single group). Then
    `commit()`, or `abort(pages_written)`. As a context manager, a reservation still open at the end
    of the block is aborted (as if every page had been written).
    """

    def __init__(self, pools: Sequence[PagePool], request: Incoming, register: Register) -> None:
        self.groups = [
            GroupPick(pool, rows, keys) for pool, rows, keys in zip(pools, request.rows, request.page_keys, strict=True)
        ]
        self.request = request
        self._register = register
        self._open = True

    def _single(self) -> GroupPick:
        if len(self.groups) != 1:
            raise ValueError(
                f"Reservation: the cache has {len(self.groups)} layer groups; use groups[g].incoming / .pages"
            )
        return self.groups[0]

    @property
    def incoming(self) -> list[int]:
        """The incoming pages to write (a cache of one layer group)."""
        return self._single().incoming

    @property
    def pages(self) -> list[int]:
        """Where each of `incoming` goes (a cache of one layer group)."""
        return self._single().pages

    @property
    def open(self) -> bool:
        """Whether neither `commit` nor `abort` has run (the manager refuses changes meanwhile)."""
        return self._open

    def _close(self, what: str) -> None:
        if not self._open:
            raise RuntimeError(f"Reservation.{what}: the reservation was already committed or aborted")
        self._open = False

    def commit(self) -> None:
        """The pages are written: take them, share the cached ones, register the sequences and key
        their full pages."""
        self._close("commit")
        keys = self.request.keys
        rows = [pick.commit(group_rows, keys) for pick, group_rows in zip(self.groups, self.request.rows, strict=True)]
        self._register(self.request, rows)

    def abort(self, pages_written: int | Sequence[int] | None = None) -> None:
        """Give up: nothing was taken, but the cached pages this reservation was going to evict and
        may have overwritten leave the prefix cache (they are free pages now). `pages_written`: how
        many of `pages`, in order, may have been written (None: all of them); per group for a cache
        of several."""
        self._close("abort")
        written = [pages_written] * len(self.groups) if not isinstance(pages_written, Sequence) else list(pages_written)
        for pick, count in zip(self.groups, written, strict=True):
            pick.abort(count)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._open:
            self.abort()
