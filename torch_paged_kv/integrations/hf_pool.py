"""`CachePool`: what a `PagedCache` holds once its pools exist, made in one piece.

The layer groups (one `PagedKVCacheCollection` each, sharing one set of lengths and offsets: row b
of the batch is row b of every group's table), their on-device page stacks (`hf_pages.DevicePages`),
the column counter and the model's dtype. It runs the tensor side of a step (the pages new tokens
need, the lengths advanced, the pages that left a sliding window given back) and the row operations
between steps (reset, crop, beam reordering); `PagedCache` decides when, from the model's layers and
its own limits.
"""

from __future__ import annotations

import torch

from ..collection import StepTensors
from ..layer_groups import LayerGroups
from ..step import GroupStepPlan, StepPlan
from .hf_pages import DevicePages


class CachePool:
    """The pools of `groups` (made by `PagedCache` for the model whose keys are `dtype`)."""

    def __init__(self, groups: LayerGroups, dtype: torch.dtype) -> None:
        first = groups.collections[0]
        for c in groups.collections[1:]:  # one set of lengths and offsets for every group
            c.cache_lengths, c.input_row_offsets = first.cache_lengths, first.input_row_offsets
        self.groups = groups
        self.dtype = dtype  # the model's (an FP8 pool does not say it)
        self.device = first.device
        self.lengths = first.cache_lengths  # [max_batch_size] int32: every group's
        self.pages = [DevicePages(c) for c in groups.collections]
        self.sliding = [p for p in self.pages if p.window is not None]
        self.columns = torch.zeros((), dtype=torch.int64, device=self.device)  # padding included
        self.plan: GroupStepPlan | None = None  # this step's, made at its first cached layer
        self.step_columns = 0  # this step's columns: the column count adds them at its end
        self.static_addresses_marked = False

    def mark_static_addresses(self) -> None:
        """Tell dynamo that the pools' tensors keep their addresses (CUDA graphs then use them in place).
        Dynamo forbids this while compiling (a pool allocated by a compiled first step): the next eager
        step does it."""
        if self.static_addresses_marked or torch.compiler.is_compiling():
            return
        tensors: list[torch.Tensor | None] = [self.columns]
        for c, pages in zip(self.groups.collections, self.pages, strict=True):
            tensors += [c.blocks, c.scales, c.cache_lengths, c.input_row_offsets, c.lookup_table, *pages.tensors()]
        for t in tensors:
            if t is not None:
                torch._dynamo.mark_static_address(t)
        self.static_addresses_marked = True

    def kv_bytes_in_use(self) -> int:
        """Bytes of K/V (and FP8 scales) in the pages the rows hold now, every group (a host sync)."""
        return sum(p.in_use() * p.params.page_bytes for p in self.pages)

    # -- a step (tensors, in place) -----------------------------------------------------------
    def begin_step(self, new_tokens: torch.Tensor, columns: int) -> GroupStepPlan:
        """Record each row's new token count (`[batch]` int32) in the offsets, give the rows the pages
        their new tokens need, note the step's `columns`; the step's plan (also kept as `plan`)."""
        batch = new_tokens.shape[0]
        offsets = self.groups.collections[0].input_row_offsets
        offsets[0] = 0
        offsets[1 : batch + 1] = torch.cumsum(new_tokens, 0)
        for pages in self.pages:
            pages.grow(self.lengths[:batch], new_tokens, columns)
        self.step_columns = columns
        self.plan = GroupStepPlan.of(self.groups, self.groups.step_tensors(batch))
        return self.plan

    def step_plan(self) -> GroupStepPlan:
        """The plan `begin_step` made for this step."""
        if self.plan is None:
            raise RuntimeError("PagedCache: a layer asked for the step's plan before the step began")
        return self.plan

    def end_step(self, batch: int, keep_past: bool) -> None:
        """Add the step's new tokens to the lengths and its columns to the column count; the
        sliding-window groups give back the pages no later query reads (unless `keep_past`)."""
        lengths, _, offsets = self.groups.collections[0].step_tensors(batch)
        grown = lengths + (offsets[1:] - offsets[:-1])
        if not keep_past:
            for pages in self.sliding:
                pages.leave_window(lengths, grown, self.step_columns)
        lengths.copy_(grown)
        self.columns.add_(self.step_columns)

    def trailing_plan(self, batch: int, query_counts: torch.Tensor, pool_layer: int) -> GroupStepPlan:
        """A plan for queries that are only the last `query_counts[b]` (`[batch]` int32) of this step's new
        tokens of each row, whose K/V are stored already. Its call at `pool_layer` checks the step it
        describes in full."""
        steps = self.groups.step_tensors(batch)
        lengths, _, offsets = steps[0]
        new_tokens = offsets[1:] - offsets[:-1]
        query_offsets = torch.zeros(batch + 1, dtype=torch.int32, device=self.device)
        query_offsets[1:] = torch.cumsum(query_counts, 0)
        group, local = self.groups.layer_map[pool_layer]
        plans = tuple(
            StepPlan(c.blocks, StepTensors(lengths + new_tokens - query_counts, step.lookup_table, query_offsets),
                     c.scales, first_layer=local if g == group else 0)
            for g, (c, step) in enumerate(zip(self.groups.collections, steps, strict=True))
        )  # fmt: skip
        return GroupStepPlan(plans, self.groups.layer_map)

    def held_plan(self, batch: int, pool_layer: int) -> GroupStepPlan:
        """A plan of no new tokens over the first `batch` rows, to read what they hold between steps; its
        call at `pool_layer` checks it."""
        steps = self.groups.step_tensors(batch)
        no_tokens = torch.zeros(batch + 1, dtype=torch.int32, device=self.device)
        group, local = self.groups.layer_map[pool_layer]
        plans = tuple(
            StepPlan(c.blocks, StepTensors(step.cache_lengths, step.lookup_table, no_tokens), c.scales,
                     first_layer=local if g == group else 0)
            for g, (c, step) in enumerate(zip(self.groups.collections, steps, strict=True))
        )  # fmt: skip
        return GroupStepPlan(plans, self.groups.layer_map)

    def gather(
        self, plan: GroupStepPlan, pool_layer: int, columns: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of cached layer `pool_layer` gathered to `columns` columns (zeros past each row's length).
        In a sliding-window group the columns below the window read as zeros (the null page, unchecked:
        the model's own sliding mask hides them, as it does for transformers' own caches)."""
        step_plan, local = plan.at(pool_layer)
        if self.pages[self.groups.layer_map[pool_layer][0]].window is None:
            return step_plan.gather_kv(local, columns, dtype)
        return torch.ops.paged_kv.gather_kv.unchecked(
            step_plan.blocks, *step_plan.step, local, columns, step_plan.scales, dtype
        )

    # -- between steps (host-driven) ----------------------------------------------------------
    def reset(self) -> None:
        """Every row empty, every page free."""
        self.lengths.zero_()
        self.groups.collections[0].input_row_offsets.zero_()
        self.columns.zero_()
        for pages in self.pages:
            pages.reset()

    def crop(self, tokens_to_remove: int) -> None:
        """Rows and the column count lose their last `-tokens_to_remove` tokens; pages past the new
        lengths and below a sliding window's start go back. `ValueError` naming `tokens_to_remove`
        (nothing changed) when a row would need a page a window gave back already."""
        kept = (self.lengths + tokens_to_remove).clamp_(min=0)
        host = kept.cpu().numpy().astype("int64")
        for pages in self.pages:
            pages.keep(host, check_only=True)
        for pages in self.pages:
            pages.keep(host)
        self.lengths.copy_(kept)
        self.columns.copy_((self.columns + tokens_to_remove).clamp_(min=0))

    def select_rows(self, rows: torch.Tensor) -> None:
        """Row i := old row `rows[i]`: the first new row taking an old row takes its pages, the others
        copies of them (`copy_pages`); pages no new row takes go back first."""
        rows = rows.to(device=self.device, dtype=torch.int64)
        new_lengths = self.lengths[rows]
        order = rows.tolist()
        for pages in self.pages:
            pages.select_rows(order)
        self.lengths.zero_()
        self.lengths[: rows.numel()] = new_lengths
