"""`PageTable`: the host state of a manager's sequences, one slot (row) each, over its layer groups.

Per slot, in int64 numpy arrays: the cached length, the length before the last committed step (what
`KVCacheManager.accept` reorders; -1: none) and the token ids known from position 0 (for
prefix-cache keys; -1: unknown), shared by every group; and per group (`groups[g]`, a
`group_table.GroupTable`) the slot's pages in that group's pool and the upload of a step's rows into
that group's step tensors. A decode step costs a few vectorised numpy operations per group.
The table knows page ids, never refcounts or keys (`page_pool.PagePool` does).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .collection import PagedKVCacheCollection
from .group_table import GroupTable
from .page_pool import TOKEN_DTYPE


class PageTable:
    """Slots of sequences over the collections of a cache's layer groups: lengths, token ids, and
    each group's pages.

    Slots are handed out lowest first and grow (doubling) past `max_batch_size`; a step's rows are
    the slots of its sequences, in order. Sliding-window groups keep what a rewind of up to
    `max_rewind` tokens needs (`GroupTable.first_kept`). `rows` and `num_pages` are the first
    group's (the only one of a single-group cache).
    """

    def __init__(
        self, collections: PagedKVCacheCollection | Sequence[PagedKVCacheCollection], max_rewind: int = 0
    ) -> None:
        if isinstance(collections, PagedKVCacheCollection):
            collections = [collections]
        self.groups = [GroupTable(c, max_rewind) for c in collections]
        first = collections[0]
        self.page_size = first.params.page_size
        self.max_pages = first.max_pages_per_sequence
        self.lengths = np.zeros(0, dtype=np.int64)
        self.known = np.zeros(0, dtype=np.int64)  # token ids known from position 0; -1: unknown
        self.tokens = np.zeros((0, 0), dtype=TOKEN_DTYPE)  # [slot, :known]: the ids (columns double)
        self.step_start = np.zeros(0, dtype=np.int64)  # length before the last committed step; -1: none
        self._free: list[int] = []
        self._grow(first.max_batch_size)

    @property
    def rows(self) -> np.ndarray:
        return self.groups[0].rows

    @property
    def num_pages(self) -> np.ndarray:
        return self.groups[0].num_pages

    # -- slots -----------------------------------------------------------------------------------
    def add(self, pages: Sequence[list[int]], length: int, tokens: np.ndarray | None) -> int:
        """A new slot holding `pages[g]` in group g, `length` cached tokens and the known `tokens`
        (None: unknown)."""
        if not self._free:
            self._grow(len(self.lengths))
        slot = self._free.pop()
        self.lengths[slot] = length
        self.step_start[slot] = -1
        if tokens is None:
            self.known[slot] = -1
        else:
            self.reserve_tokens(len(tokens))
            self.tokens[slot, : len(tokens)] = tokens
            self.known[slot] = len(tokens)
        for group, group_pages in zip(self.groups, pages, strict=True):
            group.set_pages(slot, group_pages)
        return slot

    def remove(self, slot: int) -> list[list[int]]:
        """Free `slot`; returns the pages it held in each group (the caller gives them back to the pools)."""
        held = []
        for group in self.groups:
            held.append(group.held(slot))
            group.set_pages(slot, [])
        self._free.append(slot)  # its lengths are overwritten when the slot is reused
        return held

    def _grow(self, extra: int) -> None:
        start = len(self.lengths)
        zeros = np.zeros(extra, dtype=np.int64)
        self.lengths = np.concatenate([self.lengths, zeros])
        self.known = np.concatenate([self.known, zeros])
        self.step_start = np.concatenate([self.step_start, zeros - 1])
        self.tokens = np.concatenate([self.tokens, np.zeros((extra, self.tokens.shape[1]), dtype=TOKEN_DTYPE)])
        for group in self.groups:
            group.grow(extra)
        self._free.extend(range(start + extra - 1, start - 1, -1))

    def pages_for(self, length: int | np.ndarray) -> int | np.ndarray:
        """Table entries (pages) that `length` tokens span."""
        return -(-length // self.page_size)

    # -- token ids -------------------------------------------------------------------------------
    def reserve_tokens(self, length: int) -> None:
        """Room for `length` token ids per slot: whole pages, doubling until they fit."""
        capacity = self.tokens.shape[1]
        if length > capacity:
            doubled = min(2 * capacity // self.page_size, self.max_pages)
            pages = max(self.pages_for(length), doubled)
            grown = np.zeros((len(self.tokens), pages * self.page_size), dtype=TOKEN_DTYPE)
            grown[:, :capacity] = self.tokens
            self.tokens = grown

    def token_ids(self, slot: int) -> list[int] | None:
        """Known token ids of `slot` from position 0 (may run past its length: a prompt), or None."""
        known = int(self.known[slot])
        return self.tokens[slot, :known].tolist() if known >= 0 else None

    def append_tokens(
        self, slots: np.ndarray, old_lengths: np.ndarray, new_lengths: np.ndarray, num_new: np.ndarray, ids: np.ndarray
    ) -> np.ndarray:
        """Record a committed step's token ids `ids` (row b's `num_new[b]`, concatenated); returns the
        rows' new known counts. A row whose ids are known up to its old length gets the new ids
        written there (over the rest of a remembered prompt: they are what ran); any other row
        stops knowing its ids (-1). `reserve_tokens(max(new_lengths))` must have run."""
        known = self.known[slots]
        ok = known >= old_lengths
        rows, cols = slots, old_lengths
        if len(ids) != len(rows):  # some row has several new tokens: one (row, col) per id
            starts = np.cumsum(num_new) - num_new
            cols = np.repeat(old_lengths - starts, num_new) + np.arange(len(ids))
            rows = np.repeat(rows, num_new)
        if ok.all():
            known = new_lengths
        else:
            select = np.repeat(ok, num_new)
            rows, cols, ids = rows[select], cols[select], ids[select]
            known = np.where(ok, new_lengths, -1)
        self.tokens[rows, cols] = ids
        self.known[slots] = known
        return known

    def page_tokens(self, slots: Sequence[int], page_index: Sequence[int]) -> bytes:
        """Token ids of page `page_index[i]` of `slots[i]`, as `TOKEN_DTYPE` bytes, one page after another."""
        return self.tokens.reshape(len(self.tokens), -1, self.page_size)[slots, page_index].tobytes()
