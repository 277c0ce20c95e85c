"""`LayerGroups`: a KV cache as layer groups, each a `PagedKVCacheCollection` of its own geometry.

A model whose layers do not all cache the same thing (sliding-window and full layers, per-layer head
dims: Gemma2/3/4, Mistral, GPT-OSS, Cohere2) keeps each kind of layer in a group of its own: its own
`KVCacheParams` (heads, head_dim, dtype, FP8 scales, MLA latent, `sliding_window`) and its own page
pool, sized for what it holds. The groups share one request lifecycle: a `KVCacheManager` over them
gives each sequence pages in every group (all or nothing), and one step's `GroupStepPlan`
(step.py) routes each model layer to its group. Every group has its own step tensors (the tables
differ); they share `page_size`, `max_batch_size`, `max_seq_len` and the device, so that token i of
a sequence is page `i // page_size` in every group and prefix-cache keys are the same in all of them.

A single collection is a cache of one group (`LayerGroups.of(collection)`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .collection import PagedKVCacheCollection, StepTensors
from .params import KVCacheParams


def _shared(collection: PagedKVCacheCollection, name: str) -> object:
    """What every group of a `LayerGroups` must agree on: `name` of `collection` (or of its params)."""
    return collection.params.page_size if name == "page_size" else getattr(collection, name)


class LayerGroups:
    """Collections `collections[g]` holding the model layers `layers[g]` (in order: pool layer j of
    group g is model layer `layers[g][j]`); together they hold model layers `0..num_layers-1`, each once.

    `layer_map[i]` is `(group, pool layer)` of model layer i. Build one from collections you made, or
    allocate them with `LayerGroups.allocate`.
    """

    def __init__(self, collections: Sequence[PagedKVCacheCollection], layers: Sequence[Sequence[int]]) -> None:
        collections, layers = tuple(collections), tuple(tuple(group) for group in layers)
        if not collections or not all(isinstance(c, PagedKVCacheCollection) for c in collections):
            raise ValueError("collections: expected one or more PagedKVCacheCollections")
        if len(layers) != len(collections):
            raise ValueError(f"layers: expected {len(collections)} lists (one per collection), got {len(layers)}")
        first = collections[0]
        for g, (c, group) in enumerate(zip(collections, layers, strict=True)):
            if len(group) != c.params.num_layers:
                raise ValueError(
                    f"layers: group {g} lists {len(group)} model layers, its collection holds {c.params.num_layers}"
                )
            for name in ("page_size", "max_batch_size", "max_seq_len", "device"):
                mine, theirs = (_shared(x, name) for x in (c, first))
                if mine != theirs:
                    raise ValueError(f"collections: group {g} has {name} {mine}, group 0 {theirs}; groups share it")
        flat = sorted(i for group in layers for i in group)
        if flat != list(range(len(flat))) or any(not isinstance(i, int) for i in flat):
            raise ValueError(f"layers: expected model layers 0..{len(flat) - 1}, each in one group, got {list(layers)}")
        self.collections = collections
        self.layers = layers
        layer_map: list[tuple[int, int]] = [(0, 0)] * len(flat)
        for g, group in enumerate(layers):
            for j, i in enumerate(group):
                layer_map[i] = (g, j)
        self.layer_map: tuple[tuple[int, int], ...] = tuple(layer_map)

    @classmethod
    def of(cls, collection: PagedKVCacheCollection) -> LayerGroups:
        """One group: `collection`, holding model layers `0..num_layers-1`."""
        return cls([collection], [range(collection.params.num_layers)])

    @classmethod
    def allocate(
        cls,
        params: Sequence[KVCacheParams],
        layers: Sequence[Sequence[int]],
        num_pages: Sequence[int],
        max_batch_size: int,
        max_seq_len: int,
        device: torch.device | str | None = None,
    ) -> LayerGroups:
        """Group g: a collection of `params[g]` with `num_pages[g]` pages, holding model layers `layers[g]`."""
        if not len(params) == len(layers) == len(num_pages):
            raise ValueError(
                f"num_pages: expected one entry per group like params ({len(params)}) and layers ({len(layers)}), "
                f"got {len(num_pages)}"
            )
        collections = [
            PagedKVCacheCollection(p, n, max_batch_size, max_seq_len, device)
            for p, n in zip(params, num_pages, strict=True)
        ]
        return cls(collections, layers)

    def __len__(self) -> int:
        return len(self.collections)

    @property
    def params(self) -> tuple[KVCacheParams, ...]:
        return tuple(c.params for c in self.collections)

    @property
    def num_layers(self) -> int:
        """Model layers the groups hold together."""
        return len(self.layer_map)

    @property
    def page_size(self) -> int:
        return self.collections[0].params.page_size

    @property
    def max_batch_size(self) -> int:
        return self.collections[0].max_batch_size

    @property
    def max_seq_len(self) -> int:
        return self.collections[0].max_seq_len

    @property
    def device(self) -> torch.device:
        return self.collections[0].device

    def step_tensors(self, batch: int) -> tuple[StepTensors, ...]:
        """Each group's `step_tensors(batch)` (views, no copy)."""
        return tuple(c.step_tensors(batch) for c in self.collections)

    def memory_footprint(self) -> int:
        """Bytes every group's pool and step tensors hold."""
        return sum(c.memory_footprint() for c in self.collections)

    def __repr__(self) -> str:
        groups = ", ".join(f"layers {list(ls)}: {c!r}" for ls, c in zip(self.layers, self.collections, strict=True))
        return f"LayerGroups({groups})"
