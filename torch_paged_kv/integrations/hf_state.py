"""`StateLayer`: the cache layer of a model layer that keeps fixed-size states per row (the conv and
recurrent states of linear-attention, Mamba and short-convolution layers), not K/V per token.

It is transformers' own `LinearAttentionLayer`, the one its `DynamicCache` and `StaticCache` hold for
such a layer, so those states evolve exactly as under transformers' caches; `PagedCache` keeps it
beside its pages and applies its row operations (reset, beam reorder, select) to both (not `crop`:
`PagedCache.activate_past_recording` says why). One difference: a `PagedCache` is reused across
`generate` calls, so a prefill after `reset` may bring another batch size; the states are then made
again for it (transformers' layer would fail copying into the old ones). A batch of the same size
keeps their addresses (CUDA graphs). `saved_states` and `restore` are what `PagedCache.save` / `load`
store and set of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import LinearAttentionLayer

from .hf_layer import PagedLayer

if TYPE_CHECKING:
    from .hf_cache import PagedCache


class StateLayer(LinearAttentionLayer):
    """transformers' `LinearAttentionLayer`, whose states follow a new batch size after `reset`;
    `config.number_of_conv_states` states (default 1), as transformers' caches read it."""

    def __init__(self, config: Any) -> None:
        LinearAttentionLayer.__init__(self, number_of_states=getattr(config, "number_of_conv_states", None) or 1)

    def update_conv_state(
        self, conv_states: torch.Tensor, state_idx: int = 0, conv_kernel_size: int | None = None, **kwargs: Any
    ) -> torch.Tensor:
        if self.is_conv_states_initialized[state_idx] and _other_batch(self.conv_states[state_idx], conv_states):
            self.is_conv_states_initialized[state_idx] = False
        if conv_kernel_size is not None:  # passed on only when given, as transformers' callers do
            kwargs["conv_kernel_size"] = conv_kernel_size
        return super().update_conv_state(conv_states, state_idx, **kwargs)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs: Any) -> torch.Tensor:
        if self.is_recurrent_states_initialized[state_idx] and _other_batch(
            self.recurrent_states[state_idx], recurrent_states
        ):
            self.is_recurrent_states_initialized[state_idx] = False
        return super().update_recurrent_state(recurrent_states, state_idx, **kwargs)

    def saved_states(self, state_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(conv, recurrent) states of `state_idx`, None where not initialized."""
        conv = self.conv_states[state_idx] if self.is_conv_states_initialized[state_idx] else None
        recurrent = self.recurrent_states[state_idx] if self.is_recurrent_states_initialized[state_idx] else None
        return conv, recurrent

    def restore(
        self,
        state_idx: int,
        conv: torch.Tensor | None,
        recurrent: torch.Tensor | None,
        conv_kernel_size: int | None,
        has_previous_state: bool,
    ) -> None:
        """Set the states of `state_idx` to copies of `conv` and `recurrent` (None: left uninitialized), as
        transformers' own initialization makes them (static addresses), then the flags."""
        if conv is not None:
            self.lazy_initialization(conv_states=conv, state_idx=state_idx, conv_kernel_size=conv_kernel_size)
            _copy_into(self.conv_states[state_idx], conv)
        if recurrent is not None:
            self.lazy_initialization(recurrent_states=recurrent, state_idx=state_idx)
            _copy_into(self.recurrent_states[state_idx], recurrent)
        self.has_previous_state[state_idx] = has_previous_state


def _copy_into(made: torch.Tensor | None, states: torch.Tensor) -> None:
    assert made is not None  # made by `lazy_initialization`
    made.copy_(states)


def _other_batch(held: torch.Tensor | None, new: torch.Tensor) -> bool:
    """Whether `new` states come for another number of rows than the `held` ones (dim 0: the rows)."""
    return held is None or held.shape[0] != new.shape[0]


class PagedStateLayer(PagedLayer, StateLayer):
    """A layer that keeps both (transformers' "hybrid" layer types: attention beside a Mamba mixer in
    one layer, Falcon-H1, Zamba): its K/V in the pages as a `PagedLayer`, its states as a `StateLayer`."""

    def __init__(self, cache: PagedCache, layer_idx: int, pool_layer: int, config: Any) -> None:
        StateLayer.__init__(self, config)
        PagedLayer.__init__(self, cache, layer_idx, pool_layer)

    def lazy_initialization(self, *args: Any, **kwargs: Any) -> None:
        """The pools for `(key_states, value_states)`; the states for transformers' keyword call."""
        if args:
            PagedLayer.lazy_initialization(self, *args)
        else:
            StateLayer.lazy_initialization(self, **kwargs)
