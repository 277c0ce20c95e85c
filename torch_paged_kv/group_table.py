"""`GroupTable`: one layer group's pages of a manager's sequences, and the upload of a step's rows.

Per slot (a `PageTable` row), in numpy: the group's pages in table order (`rows`, a row of the host
lookup table) and how many table entries the slot uses (`num_pages`: page i holds tokens
`i*page_size ..`). In a sliding-window group (`params.sliding_window`) the entries below the first
held one are the null page: those pages left the window of every query at any length a rewind of up
to `max_rewind` tokens may go back to (`first_kept`), and went back to the pool. `upload` writes a
step's rows into the group's collection's step tensors in place, re-sending table rows only when
they changed (vLLM's `BlockTable`).
"""

from __future__ import annotations

import numpy as np
import torch

from .collection import PagedKVCacheCollection, StepTensors
from .layout import NULL_PAGE
from .ops import copy_pages


class GroupTable:
    """The pages of every slot in one group's `PagedKVCacheCollection`."""

    def __init__(self, collection: PagedKVCacheCollection, max_rewind: int = 0) -> None:
        self.collection = collection
        self.max_rewind = max_rewind
        self.params = collection.params
        self.page_size = collection.params.page_size
        self.window = collection.params.sliding_window
        self.num_pages = np.zeros(0, dtype=np.int64)
        self.rows = np.zeros((0, collection.lookup_table.shape[1]), dtype=np.int32)
        self._step_views: dict[int, StepTensors] = {}
        c = collection
        on_cpu = c.device.type == "cpu"
        self._host_views = (
            (c.cache_lengths.numpy(), c.lookup_table.numpy(), c.input_row_offsets.numpy()) if on_cpu else None
        )

    def grow(self, extra: int) -> None:
        """`extra` more slots, holding nothing."""
        self.num_pages = np.concatenate([self.num_pages, np.zeros(extra, dtype=np.int64)])
        self.rows = np.concatenate([self.rows, np.full((extra, self.rows.shape[1]), NULL_PAGE, dtype=np.int32)])

    # -- pages -----------------------------------------------------------------------------------
    def first_held(self, lengths: np.ndarray) -> np.ndarray:
        """The first table entry a slot of each length holds (`KVCacheParams.first_held_page`): 0 without
        a window."""
        if self.window is None:
            return np.zeros_like(lengths)
        return np.maximum(lengths - (self.window - 1), 0) // self.page_size

    def first_kept(self, lengths: np.ndarray) -> np.ndarray:
        """The first table entry a slot that reached each length keeps: what every length a rewind of
        up to `max_rewind` tokens goes back to needs (`first_held` of `lengths - max_rewind`)."""
        return self.first_held(np.maximum(lengths - self.max_rewind, 0))

    def first_entry(self, slot: int) -> int:
        """The first table entry `slot` holds (the ones before are the null page); `num_pages[slot]`
        when it holds none."""
        held = np.flatnonzero(self.rows[slot, : self.num_pages[slot]] != NULL_PAGE)
        return int(held[0]) if held.size else int(self.num_pages[slot])

    def pages(self, slot: int) -> list[int]:
        """The table entries of `slot`, in order (the null page where a page left the window)."""
        return self.rows[slot, : self.num_pages[slot]].tolist()

    def held(self, slot: int) -> list[int]:
        """The pages `slot` holds, in table order (no null pages)."""
        row = self.rows[slot, : self.num_pages[slot]]
        return row[row != NULL_PAGE].tolist()

    def set_pages(self, slot: int, pages: list[int]) -> None:
        """Make `pages` the table entries of `slot` (the null page where it holds none)."""
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

    def leave_window(self, slots: np.ndarray, old_lengths: np.ndarray, new_lengths: np.ndarray) -> tuple[list, list]:
        """The slots that grew from `old_lengths` to `new_lengths` drop the pages below `first_kept` of
        their new length (those a rewind of up to `max_rewind` tokens needs stay): their entries become
        the null page. Returns (the indices into `slots` whose rows changed, the dropped pages, in
        table order: the caller gives them back to the pool)."""
        if self.window is None:
            return [], []
        start, stop = self.first_kept(old_lengths), self.first_kept(new_lengths)
        moved = np.flatnonzero(stop > start)
        if not moved.size:
            return [], []
        rows = slots[moved]
        if (stop[moved] - start[moved] == 1).all():  # (decode: at most one page per row)
            cols = start[moved]
            dropped = self.rows[rows, cols]
            self.rows[rows, cols] = NULL_PAGE
            dropped = dropped[dropped != NULL_PAGE].tolist()
        else:
            dropped = []
            for slot, a, b in zip(rows.tolist(), start[moved].tolist(), stop[moved].tolist(), strict=True):
                entries = self.rows[slot, a:b]
                dropped += entries[entries != NULL_PAGE].tolist()
                self.rows[slot, a:b] = NULL_PAGE
        return moved.tolist(), dropped

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy whole pages `src[i]` to `dst[i]` in the collection (every layer, K and V, FP8 scales)."""
        c = self.collection
        src_pages, dst_pages = (torch.tensor(p, dtype=torch.int32, device=c.device) for p in (src, dst))
        copy_pages(c.blocks, src_pages, dst_pages, c.scales)

    # -- upload ----------------------------------------------------------------------------------
    def step_tensors(self, batch: int) -> StepTensors:
        """The collection's step tensors for `batch` rows (views, made once per batch size)."""
        views = self._step_views.get(batch)
        if views is None:
            views = self._step_views[batch] = self.collection.step_tensors(batch)
        return views

    def upload(
        self,
        slots: np.ndarray,
        lengths: np.ndarray,
        num_new: np.ndarray,
        changed_rows: np.ndarray | None,
        same_offsets: bool,
    ) -> None:
        """Write a step into the collection's step tensors: row b is `slots[b]`, holding `lengths[b]`
        tokens, with `num_new[b]` new ones. Lengths always; table rows `changed_rows` (None: all of
        them); offsets unless `same_offsets` (the rows hold the same counts as the last upload)."""
        c, batch = self.collection, len(slots)
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
