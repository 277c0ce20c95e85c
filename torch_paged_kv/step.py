"""`StepPlan`: one model step's paged-cache calls, planned once and run per layer.

A step's tensors (`cache_lengths`, `lookup_table`, `input_row_offsets`) do not change between the
first and the last layer of a model, so their value checks need to run only once: at the first
cached layer the plan calls the checked ops, at every later layer the `.unchecked` overloads (shape
checks still run). This is the one place that rule lives; model code, the transformers integration
and the examples all go through a plan (as FlashInfer's wrappers plan once and run per layer).
The choice is made from `layer_idx`, a Python constant per layer, so it holds in a compiled graph.
A cache of several layer groups (layer_groups.py) plans a step with `GroupStepPlan`: one `StepPlan`
per group over that group's pool and step tensors, each checking at the group's first layer.

Eager calls skip the dispatcher: the first layer runs the op's own full checks and kernel choice
(`library.checked_kernel`, what the registered op would do) and keeps the kernel; the later layers
call that kernel directly, after the shape checks of what changes per layer (the new rows, the
layer index); the pool and the step tensors are the same objects, checked in full at the first
layer. That saves the dispatcher round trip into Python per call and, at the later layers, the
kernel choice and the step's shape checks (tens of microseconds per layer on a CPU, where a small
model's decode step is a few milliseconds). It applies only where the op call would run that same
kernel with nothing watching: eager, plain tensors, no torch function or dispatch mode, no
profiler; anything else (a compiled graph, FakeTensor, a `TorchDispatchMode`) gets the ops.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .collection import ContinuousBatchingKVCacheCollection, PagedKVCacheCollection, StepTensors
from .layer_groups import LayerGroups
from .ops import library, shape_checks
from .ops.quant import FP8_DTYPES
from .ops.records import FlashAttentionArgs, GatherKVArgs, StoreKVArgs

_OPS = torch.ops.paged_kv


def _eager_plain(*tensors: Tensor) -> bool:
    """Whether an op call on `tensors` would reach the selected kernel as it is: not compiling, no
    torch function or dispatch mode or profiler that should see the op, plain tensors."""
    # Private torch APIs, the cheapest way to ask (checked with torch 2.13; tests/test_step_plan.py
    # fails if one disappears or stops answering as used here): torch._C._is_torch_function_mode_enabled()
    # and torch._C._len_torch_dispatch_stack() (an active TorchFunctionMode / TorchDispatchMode), and
    # torch.autograd.profiler._is_profiler_enabled (a bool the profilers set while they record).
    if torch.compiler.is_compiling():
        return False
    if torch._C._is_torch_function_mode_enabled() or torch._C._len_torch_dispatch_stack():
        return False
    if torch.autograd.profiler._is_profiler_enabled:
        return False
    for t in tensors:  # noqa: SIM110 (`all` over a generator costs twice all the rest of this function)
        if type(t) is not Tensor:
            return False
    return True


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """The paged-cache ops of one step over `blocks` (and an FP8 cache's `scales`), per layer;
    `first_layer` checks the step."""

    blocks: Tensor
    step: StepTensors
    scales: Tensor | None = None
    first_layer: int = 0
    # (op name, options deciding its kernel) -> the kernel an eager call of it ran: later layers call it
    kernels: dict[tuple, Callable[..., Any]] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    # "rows": the new rows the first layer's checked call took (= input_row_offsets[-1]); every later
    # layer must take as many (a shape check: its kernel trusts the step tensors' values)
    step_rows: dict[str, int | torch.SymInt] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.blocks.dtype in FP8_DTYPES and self.scales is None:
            raise ValueError(
                f"scales: an FP8 cache ({self.blocks.dtype}) needs its scales tensor; "
                "StepPlan.of(collection, step) passes the collection's"
            )

    @classmethod
    def of(
        cls, collection: PagedKVCacheCollection | ContinuousBatchingKVCacheCollection, step: StepTensors
    ) -> StepPlan:
        """The plan over a collection's pool (its `blocks` and `scales`)."""
        return cls(collection.blocks, step, collection.scales)

    def _checked(self, layer_idx: int) -> str:
        return "default" if layer_idx == self.first_layer else "unchecked"

    def _rows(self, name: str, t: Tensor, layer_idx: int) -> None:
        """Record the step's new rows at the first layer; at a later layer, require the same count."""
        if layer_idx == self.first_layer:
            self.step_rows["rows"] = t.shape[0]
        elif "rows" in self.step_rows:
            shape_checks.check_step_rows(name, t, self.step_rows["rows"], layer_idx, self.first_layer)

    def _direct(self, variant: tuple, layer_idx: int, *tensors: Tensor) -> Callable[..., Any] | None:
        """The kernel to call directly at this later layer, or None (call the op). `variant` is the op's
        name and what else decides its kernel choice per layer (`flash_attention`'s options)."""
        kernel = self.kernels.get(variant)
        if kernel is None or layer_idx == self.first_layer or not _eager_plain(*tensors):
            return None
        if not 0 <= layer_idx < self.blocks.shape[2]:
            return None  # the op raises the error
        return kernel

    def _call(self, variant: tuple, layer_idx: int, a: tuple, *tensors: Tensor) -> Any:
        """A call, on the op's record `a`, with no kept kernel to run directly. Eager and plain: the
        op's own checks and kernel choice without the dispatcher's round trip (which costs more than
        the checks), keeping the kernel for the later layers of this variant: at the first layer the
        full checks, at a later one (a variant the first layer did not run, such as a sliding-window
        layer after a full one) the shape checks. Otherwise the op: checked at the first layer,
        `.unchecked` after (a compiled graph, a mode watching the ops)."""
        op = variant[0]
        if _eager_plain(*tensors):
            kernel = library.checked_kernel(op, a, value_checks=layer_idx == self.first_layer)
            self.kernels[variant] = kernel
            return kernel(a)
        return getattr(getattr(_OPS, op), self._checked(layer_idx))(*a)

    def store_kv(self, key: Tensor, value: Tensor, layer_idx: int) -> None:
        """`api.store_kv` of this step's new K/V rows `[total_new, num_kv_heads, head_dim]` into layer `layer_idx`."""
        self._rows("key", key, layer_idx)
        kernel = self._direct(("store_kv",), layer_idx, key, value)
        a = StoreKVArgs(key, value, self.blocks, *self.step, layer_idx, self.scales)
        if kernel is not None:
            shape_checks.check_store_kv_rows(a)
            kernel(a)
            return
        self._call(("store_kv",), layer_idx, a, key, value)

    def flash_attention(
        self,
        q: Tensor,
        layer_idx: int,
        softmax_scale: float,
        causal: bool = True,
        sliding_window: int = -1,
        softcap: float = 0.0,
        sinks: Tensor | None = None,
        attention_chunk_size: int = -1,
        tree_mask: Tensor | None = None,
    ) -> Tensor:
        """`api.flash_attention` of this step's queries `[total_new, num_q_heads, head_dim]` at layer `layer_idx`."""
        self._rows("q", q, layer_idx)
        variant = (
            "flash_attention", causal, sliding_window > 0, softcap > 0, sinks is None, attention_chunk_size > 0,
            tree_mask is None,
        )  # fmt: skip
        tensors = (
            (q,) if sinks is None and tree_mask is None else tuple(t for t in (q, sinks, tree_mask) if t is not None)
        )
        kernel = self._direct(variant, layer_idx, *tensors)
        a = FlashAttentionArgs(
            q, self.blocks, *self.step, layer_idx, softmax_scale, causal, sliding_window, softcap, self.scales, sinks,
            attention_chunk_size, tree_mask,
        )  # fmt: skip
        if kernel is not None:
            shape_checks.check_flash_attention_rows(a)
            return kernel(a)
        return self._call(variant, layer_idx, a, *tensors)

    def store_latent(self, latent: Tensor, k_rope: Tensor, layer_idx: int) -> None:
        """`api.store_latent` of this step's latents `[total_new, kv_lora_rank]` and rotated rope keys
        `[total_new, rope_dim]` into layer `layer_idx` of an MLA cache."""
        self._rows("latent", latent, layer_idx)
        op = getattr(_OPS.store_latent, self._checked(layer_idx))
        op(latent, k_rope, self.blocks, *self.step, layer_idx, self.scales)

    def mla_attention(
        self,
        q_nope: Tensor,
        q_rope: Tensor,
        layer_idx: int,
        softmax_scale: float,
        causal: bool = True,
        key_positions: Tensor | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor:
        """`api.mla_attention` (absorbed MLA) of this step's queries at layer `layer_idx` -> `[total_new,
        num_heads, kv_lora_rank]`; `q_nope` already multiplied by W_UK; `key_positions` for sparse
        attention (each layer's own: value-checked at every layer), `sinks` per head."""
        self._rows("q_nope", q_nope, layer_idx)
        op = getattr(_OPS.mla_attention, "default" if key_positions is not None else self._checked(layer_idx))
        extra = (self.scales, key_positions, sinks)
        return op(q_nope, q_rope, self.blocks, *self.step, layer_idx, softmax_scale, causal, *extra)

    def gather_kv(self, layer_idx: int, max_kv_len: int, out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """`api.gather_kv` of layer `layer_idx`: `[batch, max_kv_len, num_kv_heads, head_dim]` K and V."""
        kernel = self._direct(("gather_kv",), layer_idx) if out_dtype is None else None
        a = GatherKVArgs(self.blocks, *self.step, layer_idx, max_kv_len, self.scales, out_dtype)
        if kernel is not None and max_kv_len >= 0:
            return kernel(a)
        if out_dtype is not None:  # kernels are kept for the plan's own dtype only
            return getattr(_OPS.gather_kv, self._checked(layer_idx))(*a)
        return self._call(("gather_kv",), layer_idx, a)


@dataclasses.dataclass(frozen=True)
class GroupStepPlan:
    """The paged-cache ops of one step over a cache of layer groups: model layer `layer_idx` runs in
    `plans[g]` at pool layer j, where `(g, j) = layer_map[layer_idx]` (`LayerGroups.layer_map`). Each
    group's plan checks the step at its first layer (pool layer 0, the group's first model layer), so a
    step is checked once per group; every other call costs a `StepPlan` call and a tuple lookup."""

    plans: tuple[StepPlan, ...]
    layer_map: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, groups: LayerGroups, steps: Sequence[StepTensors]) -> GroupStepPlan:
        """The plan over each group's pool, with `steps[g]` (what `KVCacheManager.prepare_step` returns)."""
        if len(steps) != len(groups):
            raise ValueError(f"steps: expected {len(groups)} step tensors (one per layer group), got {len(steps)}")
        plans = tuple(StepPlan.of(c, step) for c, step in zip(groups.collections, steps, strict=True))
        return cls(plans, groups.layer_map)

    def at(self, layer_idx: int) -> tuple[StepPlan, int]:
        """The plan of model layer `layer_idx`'s group and its pool layer there (ValueError naming
        `layer_idx` outside the model's layers)."""
        if type(layer_idx) is not int or not 0 <= layer_idx < len(self.layer_map):
            raise ValueError(f"layer_idx: expected a model layer 0..{len(self.layer_map) - 1}, got {layer_idx!r}")
        g, j = self.layer_map[layer_idx]
        return self.plans[g], j

    def store_kv(self, key: Tensor, value: Tensor, layer_idx: int) -> None:
        """`StepPlan.store_kv` at model layer `layer_idx`."""
        plan, j = self.at(layer_idx)
        plan.store_kv(key, value, j)

    def flash_attention(self, q: Tensor, layer_idx: int, softmax_scale: float, *args: Any, **kwargs: Any) -> Tensor:
        """`StepPlan.flash_attention` at model layer `layer_idx` (the same further arguments)."""
        plan, j = self.at(layer_idx)
        return plan.flash_attention(q, j, softmax_scale, *args, **kwargs)

    def store_latent(self, latent: Tensor, k_rope: Tensor, layer_idx: int) -> None:
        """`StepPlan.store_latent` at model layer `layer_idx`."""
        plan, j = self.at(layer_idx)
        plan.store_latent(latent, k_rope, j)

    def mla_attention(
        self, q_nope: Tensor, q_rope: Tensor, layer_idx: int, softmax_scale: float, *args: Any, **kwargs: Any
    ) -> Tensor:
        """`StepPlan.mla_attention` at model layer `layer_idx` (the same further arguments)."""
        plan, j = self.at(layer_idx)
        return plan.mla_attention(q_nope, q_rope, j, softmax_scale, *args, **kwargs)

    def gather_kv(self, layer_idx: int, max_kv_len: int, out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """`StepPlan.gather_kv` at model layer `layer_idx`."""
        plan, j = self.at(layer_idx)
        return plan.gather_kv(j, max_kv_len, out_dtype)
