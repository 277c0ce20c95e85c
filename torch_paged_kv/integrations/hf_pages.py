"""`DevicePages`: one layer group's pages for `PagedCache`, handed out on the device as rows grow.

A `PagedCache` has no host-side manager: its step runs inside the model's forward, possibly a
compiled one, where a host allocation would break the graph or sync every step. Each group's free
pages are a stack in a device tensor (`free[:count]`, `count` a 0-dim tensor), and a step's
allocation and release are a handful of tensor operations of fixed shapes (rows x the columns a step
can touch): at the step's start, every table entry a row's new tokens reach that holds no page
takes one from the top of the stack; at its end, in a sliding-window group, the entries that left
the window of every later query give theirs back and read as the null page. Out of pages (which the
pool sizes of `PagedCache` rule out), an entry stays the null page and the step's checked
`store_kv` raises. Between steps (`reset`, `crop`, beam reordering, loading a checkpoint) the host
edits the same state directly.
"""

from __future__ import annotations

import numpy as np
import torch

from ..collection import PagedKVCacheCollection
from ..layout import NULL_PAGE


class DevicePages:
    """The pages of `collection` (its lookup table rows are the cache's rows)."""

    def __init__(self, collection: PagedKVCacheCollection) -> None:
        self.collection = collection
        self.params = collection.params
        self.page_size = collection.params.page_size
        self.window = collection.params.sliding_window
        n = collection.num_pages
        device = collection.device
        self.free = torch.zeros(n + 1, dtype=torch.int32, device=device)  # [:count] free; [n] a dump slot
        self.count = torch.zeros((), dtype=torch.int64, device=device)
        t = collection.lookup_table
        self._views: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # (table, free, count) on the CPU
        if device.type == "cpu":
            self._views = (t.numpy(), self.free.numpy(), self.count.numpy())
        self.reset()

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The allocator's own tensors (they keep their addresses: CUDA graphs use them in place)."""
        return self.free, self.count

    def reset(self) -> None:
        """Every page free, every table entry the null page."""
        n = self.collection.num_pages
        self.free[:n] = torch.arange(n, 0, -1, dtype=torch.int32, device=self.free.device)  # pops 1, 2, ...
        self.count.fill_(n)
        self.collection.lookup_table.fill_(NULL_PAGE)

    def in_use(self) -> int:
        """Pages some row holds (a host sync)."""
        return self.collection.num_pages - int(self.count)

    def first_held(self, lengths: torch.Tensor) -> torch.Tensor:
        """`KVCacheParams.first_held_page` of each length (int tensors; no window: zeros)."""
        if self.window is None:
            return torch.zeros_like(lengths)
        return (lengths - (self.window - 1)).clamp(min=0) // self.page_size

    # -- a step (tensor operations: in a compiled graph too) -------------------------------------
    def _on_host(self) -> bool:
        """Whether this call may work on the numpy views of the CPU tensors where there are some (eager:
        an order of magnitude cheaper than torch on tensors this small); same result as the tensor path
        (tested)."""
        return not torch.compiler.is_compiling()

    def grow(self, lengths: torch.Tensor, new_tokens: torch.Tensor, columns: int) -> None:
        """Give every row `b` (of `lengths.shape[0]`) a page for each table entry its `new_tokens[b]`
        tokens after `lengths[b]` reach that holds none; `columns` bounds the new tokens of a row."""
        views = self._views
        if views is not None and self._on_host():
            self._grow_host(views, lengths.numpy(), new_tokens.numpy())
            return
        table, ps = self.collection.lookup_table, self.page_size
        first = (lengths + ps - 1) // ps
        stop = (lengths + new_tokens + ps - 1) // ps
        cols, current = self._entries(first, columns)
        need = (cols < stop[:, None]) & (current == NULL_PAGE)
        flat = need.reshape(-1)
        index = self.count - flat.sum() + flat.cumsum(0) - 1  # the top of the stack, in order
        taken = self.free[index.clamp(min=0)].view_as(need)
        pages = torch.where(need & (index >= 0).view_as(need), taken, current)
        table[: lengths.shape[0]].scatter_(1, cols.clamp(max=table.shape[1] - 1), pages)
        self.count.sub_(flat.sum()).clamp_(min=0)

    def leave_window(self, old_lengths: torch.Tensor, new_lengths: torch.Tensor, columns: int) -> None:
        """Rows grown from `old_lengths` to `new_lengths` (by at most `columns` tokens) give back the
        pages that left the window of every later query; their entries become the null page."""
        window, views = self.window, self._views
        if window is None:  # a full group: no page ever leaves
            return
        if views is not None and self._on_host():
            self._leave_window_host(views, window, old_lengths.numpy(), new_lengths.numpy())
            return
        table = self.collection.lookup_table
        start, stop = self.first_held(old_lengths), self.first_held(new_lengths)
        cols, current = self._entries(start, columns)
        drop = (cols < stop[:, None]) & (current != NULL_PAGE)
        flat = drop.reshape(-1)
        slot = torch.where(flat, self.count + flat.cumsum(0) - 1, self.collection.num_pages)  # else the dump slot
        self.free.scatter_(0, slot, current.reshape(-1))
        table[: old_lengths.shape[0]].scatter_(1, cols.clamp(max=table.shape[1] - 1), current.masked_fill(drop, 0))
        self.count.add_(flat.sum())

    def _entries(self, first: torch.Tensor, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The table entries a step of at most `columns` new tokens can touch from entry `first[b]` of
        each row on (`[rows, ceil(columns / page_size) + 1]`), and what they hold now."""
        table = self.collection.lookup_table
        span = -(-columns // self.page_size) + 1
        cols = first[:, None] + torch.arange(span, dtype=first.dtype, device=first.device)
        current = table[: first.shape[0]].gather(1, cols.clamp(max=table.shape[1] - 1).long())
        return cols.long(), current

    def _grow_host(self, views: tuple[np.ndarray, ...], lengths: np.ndarray, new_tokens: np.ndarray) -> None:
        table, free, count = views
        ps = self.page_size
        first, stop = (lengths + ps - 1) // ps, (lengths + new_tokens + ps - 1) // ps
        need = [(b, col) for b in np.flatnonzero(stop > first).tolist() for col in range(first[b], stop[b])]
        need = [(b, col) for b, col in need if table[b, col] == NULL_PAGE]
        top = int(count)
        for rank, (b, col) in enumerate(need):  # (the tensor path's order: the stack's top last)
            if top - len(need) + rank >= 0:
                table[b, col] = free[top - len(need) + rank]
        count[...] = max(0, top - len(need))

    def _leave_window_host(
        self, views: tuple[np.ndarray, ...], window: int, old_lengths: np.ndarray, new_lengths: np.ndarray
    ) -> None:
        table, free, count = views
        window, ps = window - 1, self.page_size
        start, stop = np.maximum(old_lengths - window, 0) // ps, np.maximum(new_lengths - window, 0) // ps
        for b in np.flatnonzero(stop > start).tolist():
            for col in range(start[b], stop[b]):
                if table[b, col] != NULL_PAGE:
                    free[count] = table[b, col]
                    count += 1
                    table[b, col] = NULL_PAGE

    # -- between steps (on the host) -------------------------------------------------------------
    def host_state(self) -> tuple[np.ndarray, list[int]]:
        """A host copy of the table rows and the free pages (top of the stack last)."""
        table = self.collection.lookup_table.cpu().numpy().copy()
        return table, self.free[: int(self.count)].tolist()

    def set_host_state(self, table: np.ndarray, free: list[int]) -> None:
        """Make `table` and `free` (as `host_state` gives them) the device state."""
        self.collection.lookup_table.copy_(torch.from_numpy(table))
        self.free[: len(free)] = torch.tensor(free, dtype=torch.int32)
        self.count.fill_(len(free))

    def keep(self, lengths: np.ndarray, check_only: bool = False) -> None:
        """Rows of `lengths[b]` tokens (the table's first `len(lengths)` rows; the rest hold none) keep the
        pages their next query reads, no others. `ValueError` naming `tokens_to_remove` when a row would
        need a page a sliding window gave back already (nothing changed)."""
        table, free = self.host_state()
        first = self.first_held(torch.from_numpy(lengths)).numpy() if len(lengths) else lengths
        stop = -(-lengths // self.page_size)
        for b in range(len(lengths)):
            if (table[b, first[b] : stop[b]] == NULL_PAGE).any():
                raise ValueError(
                    f"tokens_to_remove: row {b} would need tokens its sliding window of {self.window} dropped "
                    "already; call activate_past_recording() before the steps that may be cropped"
                )
        if check_only:
            return
        cols = np.arange(table.shape[1])[None]
        rows = np.arange(table.shape[0])[:, None] < len(lengths)
        first_all = np.zeros(table.shape[0], dtype=np.int64)
        stop_all = np.zeros(table.shape[0], dtype=np.int64)
        first_all[: len(lengths)], stop_all[: len(lengths)] = first, stop
        gone = ((cols < first_all[:, None]) | (cols >= stop_all[:, None]) | ~rows) & (table != NULL_PAGE)
        free += table[gone].tolist()
        table[gone] = NULL_PAGE
        self.set_host_state(table, free)

    def select_rows(self, rows: list[int]) -> None:
        """Row i becomes a copy of old row `rows[i]`: the first row to take an old row takes its pages,
        any other gets fresh ones and a copy (`copy_pages`); pages no new row takes go back first."""
        table, free = self.host_state()
        owner: dict[int, int] = {}
        for i, r in enumerate(rows):
            owner.setdefault(r, i)
        new = np.full_like(table, NULL_PAGE)
        for r in range(table.shape[0]):
            if r not in owner:
                held = table[r][table[r] != NULL_PAGE]
                free += held.tolist()
        src, dst = [], []
        for i, r in enumerate(rows):
            if owner[r] == i:
                new[i] = table[r]
                continue
            cols = np.flatnonzero(table[r] != NULL_PAGE)
            if len(cols) > len(free):
                raise ValueError(f"rows: the pool of layer group {self.params} has too few pages for the copies")
            pages = [free.pop() for _ in cols]
            new[i, cols] = pages
            src += table[r, cols].tolist()
            dst += pages
        if src:
            from ..ops import copy_pages

            c = self.collection
            src_pages, dst_pages = (torch.tensor(p, dtype=torch.int32, device=c.device) for p in (src, dst))
            copy_pages(c.blocks, src_pages, dst_pages, c.scales)
        self.set_host_state(new, free)

    def assign(self, pages_per_row: list[int], first: list[int]) -> list[list[int]]:
        """Fresh pages for empty rows `0..`: row b gets entries `first[b]..pages_per_row[b]-1`; returns them."""
        table, free = self.host_state()
        out = []
        for b, (n, f) in enumerate(zip(pages_per_row, first, strict=True)):
            if n - f > len(free):
                raise ValueError(f"max_batch_size: the pool has too few pages for row {b}")
            pages = [free.pop() for _ in range(f, n)]
            table[b, f:n] = pages
            out.append(pages)
        self.set_host_state(table, free)
        return out
