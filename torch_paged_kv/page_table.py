"""`PageTable`: the host state of a manager's sequences, one slot (row) each, and its upload.

Per slot, in int64 numpy arrays: the cached length, the pages in order (a row of the host lookup
table), and the token ids known from position 0 (for prefix-cache keys; -1: unknown). A decode step
costs a few vectorised numpy operations. `upload` writes a step's rows into a collection's step
tensors in place, re-sending table rows only when they changed (vLLM's `BlockTable`).
The table knows page ids, never refcounts or keys (`page_pool.PagePool` does).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .collection import PagedKVCacheCollection, StepTensors
from .layout import NULL_PAGE
from .page_pool import TOKEN_DTYPE


class PageTable:
    """Slots of sequences over a `PagedKVCacheCollection`: lengths, pages, token ids.

    Slots are handed out lowest first and grow (doubling) past `collection.max_batch_size`; a
    step's rows are the slots of its sequences, in order.
    """

    def __init__(self, collection: PagedKVCacheCollection) -> None:
        self.collection = collection
        self.page_size = collection.params.page_size
        self.max_pages = collection.max_pages_per_sequence
        self.lengths = np.zeros(0, dtype=np.int64)
        self.num_pages = np.zeros(0, dtype=np.int64)
        self.known = np.zeros(0, dtype=np.int64)  # token ids known from position 0; -1: unknown
        self.tokens = np.zeros((0, 0), dtype=TOKEN_DTYPE)  # [slot, :known]: the ids (columns double)
        self.rows = np.zeros((0, collection.lookup_table.shape[1]), dtype=np.int32)
        self._free: list[int] = []
        self._grow(collection.max_batch_size)
        self._step_views: dict[int, StepTensors] = {}
        on_cpu = collection.device.type == "cpu"
        c = collection
        self._host_views = (
            (c.cache_lengths.numpy(), c.lookup_table.numpy(), c.input_row_offsets.numpy()) if on_cpu else None
        )

    # -- slots -----------------------------------------------------------------------------------
    def add(self, pages: list[int], length: int, tokens: np.ndarray | None) -> int:
        """A new slot holding `pages`, `length` cached tokens and the known `tokens` (None: unknown)."""
        if not self._free:
            self._grow(len(self.lengths))
        slot = self._free.pop()
        self.lengths[slot] = length
        if tokens is None:
            self.known[slot] = -1
        else:
            self.reserve_tokens(len(tokens))
            self.tokens[slot, : len(tokens)] = tokens
            self.known[slot] = len(tokens)
        self.set_pages(slot, pages)
        return slot

    def remove(self, slot: int) -> list[int]:
        """Free `slot`; returns its pages (the caller gives them back to the pool)."""
        pages = self.pages(slot)
        self.set_pages(slot, [])
        self._free.append(slot)  # its lengths are overwritten when the slot is reused
        return pages

    def _grow(self, extra: int) -> None:
        start = len(self.lengths)
        zeros = np.zeros(extra, dtype=np.int64)
        self.lengths = np.concatenate([self.lengths, zeros])
        self.num_pages = np.concatenate([self.num_pages, zeros])
        self.known = np.concatenate([self.known, zeros])
        self.tokens = np.concatenate([self.tokens, np.zeros((extra, self.tokens.shape[1]), dtype=TOKEN_DTYPE)])
        self.rows = np.concatenate([self.rows, np.full((extra, self.rows.shape[1]), NULL_PAGE, dtype=np.int32)])
        self._free.extend(range(start + extra - 1, start - 1, -1))

    # -- pages -----------------------------------------------------------------------------------
    def pages_for(self, length: int | np.ndarray) -> int | np.ndarray:
        """Pages that `length` tokens occupy."""
        return -(-length // self.page_size)

    def pages(self, slot: int) -> list[int]:
        """Physical pages of `slot`, in order."""
        return self.rows[slot, : self.num_pages[slot]].tolist()

    def set_pages(self, slot: int, pages: list[int]) -> None:
        """Make `pages` the pages of `slot` (the rest of its row: the null page)."""
        self.rows[slot, : len(pages)] = pages
        self.rows[slot, len(pages) : self.num_pages[slot]] = NULL_PAGE
        self.num_pages[slot] = len(pages)

    def extend(self, slots: np.ndarray, counts: np.ndarray, pages: list[int]) -> None:
        """Append `counts[i]` of `pages` (in order) to each slot (vectorised when each gets one)."""
        if len(pages) == len(slots):
            self.rows[slots, self.num_pages[slots]] = pages
            self.num_pages[slots] += 1
            return
        i = 0
        for slot, count in zip(slots.tolist(), counts.tolist(), strict=True):
            start = int(self.num_pages[slot])
            self.rows[slot, start : start + count] = pages[i : i + count]
            self.num_pages[slot] = start + count
            i += count

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

    # -- upload ----------------------------------------------------------------------------------
    def step_tensors(self, batch: int) -> StepTensors:
        """The collection's step tensors for `batch` rows (views, made once per batch size)."""
        views = self._step_views.get(batch)
        if views is None:
            views = self._step_views[batch] = self.collection.step_tensors(batch)
        return views

    def upload(
        self, slots: np.ndarray, num_new: np.ndarray, changed_rows: np.ndarray | None, same_offsets: bool
    ) -> None:
        """Write a step into the collection's step tensors: row b is `slots[b]` with `num_new[b]` new
        tokens. Lengths always; table rows `changed_rows` (None: all of them); offsets unless
        `same_offsets` (the rows hold the same counts as the last upload)."""
        c, batch = self.collection, len(slots)
        lengths = self.lengths[slots]
        if self._host_views is not None:
            lengths_np, table_np, offsets_np = self._host_views
            lengths_np[:batch] = lengths
            rows = slice(0, batch) if changed_rows is None else changed_rows
            if changed_rows is None or changed_rows.size:
                table_np[rows] = self.rows[slots[rows]]
            if not same_offsets:
                np.cumsum(num_new, out=offsets_np[1 : batch + 1])
            return
        c.cache_lengths[:batch].copy_(torch.from_numpy(lengths))
        if changed_rows is None:
            c.lookup_table[:batch].copy_(torch.from_numpy(self.rows[slots]))
        elif changed_rows.size:
            index = torch.from_numpy(changed_rows).to(c.device)
            c.lookup_table[index] = torch.from_numpy(self.rows[slots[changed_rows]]).to(c.device)
        if not same_offsets:
            c.input_row_offsets[1 : batch + 1].copy_(torch.from_numpy(np.cumsum(num_new)))
