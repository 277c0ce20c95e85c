"""What a save stores: the rows selected, and per layer group the pages they use, compacted and
renumbered `1..n` in first-use order (shared pages once)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from .. import layout
from ..collection import ContinuousBatchingKVCacheCollection
from .file_format import CONTINUOUS, PAGED, CheckpointError, Collection

_DRIVERS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def mark_driven(collection: Collection, how_to_save: str) -> None:
    """Record that something else (a `KVCacheManager`) owns `collection`'s state: its step tensors
    then hold the rows of the last prepared step, not sequences, and `save_cache` refuses to save
    them (explicit `rows=` still save); `how_to_save` is what its error message points to."""
    _DRIVERS[collection] = how_to_save


@dataclass
class SavePlan:
    """What a save stores: compacted tables and the source pages in stored order."""

    kind: str
    rows: list[int]
    cache_lengths: torch.Tensor  # int32 [B], CPU
    lookup_table: torch.Tensor  # int32 [B, W] or [B], CPU, renumbered
    source_pages: torch.Tensor  # int64 [n], physical ids in the source, stored order
    page_tokens: int  # tokens stored per page (CB slots: the longest saved length)


def _first_use_order(used: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique values of `used` in first-appearance order, and each entry's rank among them."""
    uniq, inverse = torch.unique(used, return_inverse=True)
    first = torch.full((uniq.numel(),), used.numel(), dtype=torch.int64)
    first.scatter_reduce_(0, inverse, torch.arange(used.numel()), "amin")
    order = torch.argsort(first)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel())
    return uniq[order], rank[inverse]


def selected_rows(
    collections: list[Collection],
    batch_indices: list[int] | None,
    rows: tuple[torch.Tensor, Any] | None,
) -> tuple[list[int], torch.Tensor, list[torch.Tensor]]:
    """(source row numbers, cache_lengths, each group's lookup_table) of what a save stores, on the CPU."""
    driven = [c for c in collections if c in _DRIVERS]
    if rows is None and driven:
        raise CheckpointError(
            f"collection: its rows are the step tensors of the manager that drives it (the last prepared "
            f"step, lengths from before that step), not the sequences' state: save with {_DRIVERS[driven[0]]}"
        )
    if rows is not None:
        if batch_indices is not None:
            raise CheckpointError("rows: pass either batch_indices or rows, not both")
        lengths, tables = rows
        tables = [tables] if len(collections) == 1 else list(tables)
        if len(tables) != len(collections):
            raise CheckpointError(f"rows: expected {len(collections)} lookup tables (one per layer group)")
        lengths, tables = torch.as_tensor(lengths).cpu(), [torch.as_tensor(t).cpu() for t in tables]
        for c, table in zip(collections, tables, strict=True):
            width = c.lookup_table.shape[1:]
            shape_ok = lengths.dim() == 1 and tuple(table.shape) == (lengths.shape[0], *width)
            if lengths.dtype != torch.int32 or table.dtype != torch.int32 or not shape_ok:
                want = f"[B, {width[0]}]" if width else "[B]"
                raise CheckpointError(
                    f"rows: expected int32 cache_lengths [B] and lookup_table {want}, "
                    f"got {lengths.dtype}{list(lengths.shape)} and {table.dtype}{list(table.shape)}"
                )
        if not lengths.numel():
            raise CheckpointError("rows: nothing to save (empty)")
        return list(range(lengths.shape[0])), lengths, tables
    first = collections[0]
    selected = list(range(first.max_batch_size)) if batch_indices is None else [int(b) for b in batch_indices]
    if not selected:
        raise CheckpointError("batch_indices: nothing to save (empty)")
    if len(set(selected)) != len(selected) or not all(0 <= b < first.max_batch_size for b in selected):
        raise CheckpointError(f"batch_indices: expected distinct rows in 0..{first.max_batch_size - 1}, got {selected}")
    index = torch.tensor(selected)
    return selected, first.cache_lengths.cpu()[index], [c.lookup_table.cpu()[index] for c in collections]


def plan_save(collection: Collection, rows: list[int], lengths: torch.Tensor, table: torch.Tensor) -> SavePlan:
    if bool((lengths < 0).any()) or bool((lengths > collection.max_seq_len).any()):
        raise CheckpointError(f"cache_lengths: expected 0..{collection.max_seq_len}, got {lengths.tolist()}")
    page_size = collection.params.page_size
    continuous = isinstance(collection, ContinuousBatchingKVCacheCollection)
    if continuous:
        mask = lengths > 0  # slots in use
        new_table = torch.zeros_like(table)
    else:
        positions = torch.arange(table.shape[1])
        first = torch.tensor([collection.params.first_held_page(n) for n in lengths.tolist()], dtype=torch.int64)
        mask = (positions[None, :] < ((lengths + page_size - 1) // page_size)[:, None]) & (
            positions[None, :] >= first[:, None]
        )  # a sliding-window group holds no page below its window: those entries stay the null page
        new_table = torch.full_like(table, layout.NULL_PAGE)
    used = table[mask].to(torch.int64)
    if bool(((used <= layout.NULL_PAGE) | (used >= collection.num_physical_pages)).any()):
        raise CheckpointError(f"lookup_table: rows {rows} use page ids outside 1..{collection.num_physical_pages - 1}")
    source_pages, rank = _first_use_order(used)
    new_table[mask] = (rank + 1).to(torch.int32)
    if not continuous:
        return SavePlan(PAGED, rows, lengths, new_table, source_pages, page_size)
    free = ~mask  # CB rows without tokens still need a slot of their own
    new_table[free] = torch.arange(
        source_pages.numel() + 1, source_pages.numel() + 1 + int(free.sum()), dtype=torch.int32
    )
    page_tokens = int(lengths.max()) if source_pages.numel() else 0
    return SavePlan(CONTINUOUS, rows, lengths, new_table, source_pages, page_tokens)
