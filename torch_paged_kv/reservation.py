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

from .page_pool import PagePool, token_array


@dataclasses.dataclass(frozen=True)
class Incoming:
    """The sequences of a reservation, checked and normalised: `seq_ids[i]` holds `lengths[i]` tokens
    in the incoming pages `rows[i]` (`ceil(length / page_size)` indices into `0..n-1`, each used;
    rows may share full pages), its token ids known from position 0 `tokens[i]` (or None), for
    prefix caching, and the prefix keys `keys[i]` of its leading full pages, computed with the
    manager's salt; `page_keys` is the key of each keyed incoming page."""

    seq_ids: list
    lengths: list[int]
    rows: list[list[int]]
    tokens: list[np.ndarray | None]
    keys: list[list[bytes]]
    page_keys: dict[int, bytes]

    @classmethod
    def check(
        cls,
        seq_ids: list,
        cache_lengths: Sequence[int],
        page_rows: Sequence[Sequence[int]],
        token_ids: Sequence[Sequence[int] | None] | None,
        prefix_keys: Sequence[Sequence[bytes]] | None,
        page_size: int,
        max_seq_len: int,
        prefix_caching: bool,
    ) -> Incoming:
        """The arguments of `KVCacheManager.reserve` (ids checked there), ValueError naming the bad one."""
        batch = len(seq_ids)
        for name, value in (("cache_lengths", cache_lengths), ("page_rows", page_rows)):
            if len(value) != batch:
                raise ValueError(f"{name}: expected {batch} entries (one per sequence), got {len(value)}")
        lengths = [int(n) for n in cache_lengths]
        if any(not 0 <= n <= max_seq_len for n in lengths):
            raise ValueError(f"cache_lengths: expected 0..{max_seq_len}, got {lengths}")
        rows = [list(map(int, row)) for row in page_rows]
        used = sorted({i for row in rows for i in row})
        if used != list(range(len(used))) or any(
            len(row) != -(-n // page_size) for row, n in zip(rows, lengths, strict=True)
        ):
            raise ValueError("page_rows: expected ceil(length / page_size) incoming pages per row, using all of 0..n-1")
        uses = Counter(i for row in rows for i in row)
        if any(uses[row[-1]] > 1 for row, n in zip(rows, lengths, strict=True) if n % page_size):
            raise ValueError("page_rows: only full pages may be shared (a partially filled page is in two places)")
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
        page_keys: dict[int, bytes] = {}
        for row, row_keys in zip(rows, keys, strict=True):
            for i, key in zip(row, row_keys, strict=False):
                if page_keys.setdefault(i, key) != key:
                    raise ValueError(f"prefix_keys: incoming page {i} has two different keys")
        return cls(seq_ids, lengths, rows, tokens, keys, page_keys)


Register = Callable[[Incoming, list[list[int]]], None]
"""What commit hands to the manager: the sequences and the physical pages of each row."""


class Reservation:
    """Pages picked for the sequences of `KVCacheManager.reserve`, not yet taken.

    Write incoming page `incoming[j]` into physical page `pages[j]` (free pages first, then cached
    pages to evict, least recently used first); the incoming pages not listed are shared from this
    manager's prefix cache. Then `commit()`, or `abort(pages_written)`. As a context manager, a
    reservation still open at the end of the block is aborted (as if every page had been written).
    """

    def __init__(self, pool: PagePool, request: Incoming, register: Register) -> None:
        hits = {i: page for i, key in request.page_keys.items() if (page := pool.lookup(key)) is not None}
        num_incoming = 1 + max((i for row in request.rows for i in row), default=-1)
        incoming = [i for i in range(num_incoming) if i not in hits]
        revived = sum(1 for page in hits.values() if pool.refcounts[page] == 0)
        pool.require(len(incoming) + revived)  # a revived cached page leaves the evictable ones
        self.incoming: list[int] = incoming
        self.pages: list[int] = pool.peek(len(incoming), keep=set(hits.values()))
        self.request = request
        self._pool, self._hits, self._register = pool, hits, register
        self._open = True

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
        pool, pages = self._pool, self.pages
        pool.take(pages)
        physical = {**self._hits, **dict(zip(self.incoming, pages, strict=True))}
        taken = set(pages)
        rows = []
        for row, row_keys in zip(self.request.rows, self.request.keys, strict=True):
            row_pages = [physical[i] for i in row]
            for page in row_pages:
                if page in taken:
                    taken.discard(page)  # the first owner holds the refcount `take` gave it
                else:
                    pool.ref(page)
            for page, key in zip(row_pages, row_keys, strict=False):
                pool.register(page, key)
            rows.append(row_pages)
        self._register(self.request, rows)

    def abort(self, pages_written: int | None = None) -> None:
        """Give up: nothing was taken, but the cached pages this reservation was going to evict and
        may have overwritten leave the prefix cache (they are free pages now). `pages_written`: how
        many of `pages`, in order, may have been written (None: all of them)."""
        self._close("abort")
        pool = self._pool
        evicting = self.pages[min(len(self.pages), len(pool.free)) :]
        if pages_written is not None:
            evicting = evicting[: max(0, pages_written - len(pool.free))]
        pool.forget(evicting)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._open:
            self.abort()
