"""`CheckpointInfo`: what a checkpoint's headers, lengths and tables say."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..params import KVCacheParams, TPShard
from .file_format import CONTINUOUS


@dataclass(frozen=True)
class GroupInfo:
    """One layer group of a checkpoint: its params, the model layers it holds, how many pages it
    stores and its lookup table (stored page ids `1..num_pages`; the null page where a row holds
    none: past its length, or below a sliding window)."""

    params: KVCacheParams
    layers: tuple[int, ...]
    num_pages: int
    lookup_table: torch.Tensor


@dataclass
class CheckpointInfo:
    """What a checkpoint's headers, lengths and tables say (page data not read). `params`,
    `num_pages` and `lookup_table` are layer group 0's; `groups` lists every group (one for a file
    of one collection)."""

    path: Path
    params: KVCacheParams
    kind: str
    max_seq_len: int
    num_pages: int
    page_tokens: int
    cache_lengths: list[int]
    lookup_table: torch.Tensor
    files: list[Path]
    checksums: dict[str, str]  # tensor name -> stored checksum, every file
    tensor_files: dict[str, Path]  # tensor name -> file holding it
    tensor_offsets: dict[str, tuple[int, int]]  # tensor name -> byte range in its file
    metadata: dict[str, str]  # the main file's raw header metadata
    tp_shard: TPShard | None = None  # the KV heads of the model the file holds (None: all)
    groups: list[GroupInfo] = field(default_factory=list)
    extra_tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]] = field(default_factory=dict)  # name -> (dtype,
    # shape) of each extra tensor of the main file (`read_extra_tensors` reads them)

    def __post_init__(self) -> None:
        if not self.groups:
            layers = tuple(range(self.params.num_layers))
            self.groups = [GroupInfo(self.params, layers, self.num_pages, self.lookup_table)]

    @property
    def user_metadata(self) -> dict[str, str]:
        return json.loads(self.metadata.get("user_metadata", "{}"))

    def pages_per_row(self) -> list[int]:
        """Table entries each saved row spans (the pages it uses, in a group without a window)."""
        if self.kind == CONTINUOUS:
            return [1 if n > 0 else 0 for n in self.cache_lengths]
        return [-(-n // self.params.page_size) for n in self.cache_lengths]

    def first_held_per_row(self, group: int = 0) -> list[int]:
        """The first table entry each saved row holds a page in, in layer group `group`
        (`KVCacheParams.first_held_page`: 0 without a sliding window)."""
        params = self.groups[group].params
        return [0 if self.kind == CONTINUOUS else params.first_held_page(n) for n in self.cache_lengths]

    def stored_rows(self, group: int = 0) -> list[list[int]]:
        """Each row's table entries in layer group `group` as stored pages `0..num_pages-1` (the id in
        the table less one), -1 where the row holds none (below a sliding window)."""
        table = self.groups[group].lookup_table.reshape(len(self.cache_lengths), -1)
        firsts = self.first_held_per_row(group)
        return [
            [-1] * first + [j - 1 for j in table[b, first:n].tolist()]
            for b, (n, first) in enumerate(zip(self.pages_per_row(), firsts, strict=True))
        ]
