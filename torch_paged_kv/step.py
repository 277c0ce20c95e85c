"""`StepPlan`: one model step's paged-cache calls, planned once and run per layer.

A step's tensors (`cache_lengths`, `lookup_table`, `input_row_offsets`) do not change between the
first and the last layer of a model, so their value checks need to run only once: at the first
cached layer the plan calls the checked ops, at every later layer the `.unchecked` overloads (shape
checks still run). This is the one place that rule lives; model code, the transformers integration
and the examples all go through a plan (as FlashInfer's wrappers plan once and run per layer).
The choice is made from `layer_idx`, a Python constant per layer, so it holds in a compiled graph.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from .collection import ContinuousBatchingKVCacheCollection, PagedKVCacheCollection, StepTensors
from .ops import library  # noqa: F401  (registers torch.ops.paged_kv)

_OPS = torch.ops.paged_kv


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """The paged-cache ops of one step over `blocks` (and an FP8 cache's `scales`), per layer;
    `first_layer` checks the step."""

    blocks: Tensor
    step: StepTensors
    scales: Tensor | None = None
    first_layer: int = 0

    @classmethod
    def of(
        cls, collection: PagedKVCacheCollection | ContinuousBatchingKVCacheCollection, step: StepTensors
    ) -> StepPlan:
        """The plan over a collection's pool (its `blocks` and `scales`)."""
        return cls(collection.blocks, step, collection.scales)

    def _checked(self, layer_idx: int) -> str:
        return "default" if layer_idx == self.first_layer else "unchecked"

    def store_kv(self, key: Tensor, value: Tensor, layer_idx: int) -> None:
        """`api.store_kv` of this step's new K/V rows `[total_new, num_kv_heads, head_dim]` into layer `layer_idx`."""
        op = getattr(_OPS.store_kv, self._checked(layer_idx))
        op(key, value, self.blocks, *self.step, layer_idx, self.scales)

    def flash_attention(
        self,
        q: Tensor,
        layer_idx: int,
        softmax_scale: float,
        causal: bool = True,
        sliding_window: int = -1,
        softcap: float = 0.0,
    ) -> Tensor:
        """`api.flash_attention` of this step's queries `[total_new, num_q_heads, head_dim]` at layer `layer_idx`."""
        op = getattr(_OPS.flash_attention, self._checked(layer_idx))
        return op(q, self.blocks, *self.step, layer_idx, softmax_scale, causal, sliding_window, softcap, self.scales)

    def store_latent(self, latent: Tensor, k_rope: Tensor, layer_idx: int) -> None:
        """`api.store_latent` of this step's latents `[total_new, kv_lora_rank]` and rotated rope keys
        `[total_new, rope_dim]` into layer `layer_idx` of an MLA cache."""
        op = getattr(_OPS.store_latent, self._checked(layer_idx))
        op(latent, k_rope, self.blocks, *self.step, layer_idx, self.scales)

    def mla_attention(
        self, q_nope: Tensor, q_rope: Tensor, layer_idx: int, softmax_scale: float, causal: bool = True
    ) -> Tensor:
        """`api.mla_attention` (absorbed MLA) of this step's queries at layer `layer_idx` -> `[total_new,
        num_heads, kv_lora_rank]`; `q_nope` already multiplied by W_UK."""
        op = getattr(_OPS.mla_attention, self._checked(layer_idx))
        return op(q_nope, q_rope, self.blocks, *self.step, layer_idx, softmax_scale, causal, self.scales)

    def gather_kv(self, layer_idx: int, max_kv_len: int, out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """`api.gather_kv` of layer `layer_idx`: `[batch, max_kv_len, num_kv_heads, head_dim]` K and V."""
        op = getattr(_OPS.gather_kv, self._checked(layer_idx))
        return op(self.blocks, *self.step, layer_idx, max_kv_len, self.scales, out_dtype)
