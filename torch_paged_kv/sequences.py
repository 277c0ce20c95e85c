"""The manager's sequences by id: each one's page-table slot, prefix keys and host copy, and id checks.

`Sequences` is the registry `KVCacheManager` keeps (claim order); `cache_full_pages` keys the full
pages of sequences into the prefix cache, chaining each page's key over the one before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterator, Sequence

from .layout import NULL_PAGE
from .offload import HostCopy
from .page_pool import PagePool, page_key_of_bytes
from .page_table import PageTable


@dataclasses.dataclass(eq=False)
class SequenceState:
    seq_id: Hashable
    slot: int
    keys: list[bytes]  # prefix-cache keys of the leading full pages
    host_pages: list[HostCopy] | None = None  # while offloaded: one per layer group


def check_unique(ids: list, name: str) -> None:
    """ValueError naming `name` unless `ids` are hashable and distinct."""
    try:
        unique = len(set(ids)) == len(ids)
    except TypeError:
        raise ValueError(f"{name}: sequence ids must be hashable") from None
    if not unique:
        raise ValueError(f"{name}: lists a sequence more than once")


class Sequences:
    """Sequences by id, in the order they were added."""

    def __init__(self) -> None:
        self._by_id: dict[Hashable, SequenceState] = {}
        self._next_loaded = 0  # ("loaded", n) ids from here on were never added

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._by_id)

    def get(self, seq_id: Hashable, name: str) -> SequenceState:
        """The sequence `seq_id` (ValueError naming `name` if there is none)."""
        try:
            return self._by_id[seq_id]
        except (KeyError, TypeError):
            raise ValueError(f"{name}: unknown sequence {seq_id!r}") from None

    def on_device(self, seq_id: Hashable, name: str, prepared: Sequence[SequenceState] = ()) -> SequenceState:
        """The sequence `seq_id`, which must not be offloaded nor in `prepared` (the prepared step)."""
        seq = self.get(seq_id, name)
        if seq.host_pages is not None:
            raise ValueError(f"{name}: sequence {seq_id!r} is offloaded; restore it first")
        if seq in prepared:
            raise ValueError(f"{name}: sequence {seq_id!r} is in the prepared step; commit_step first")
        return seq

    def resolve(self, ids: list, prepared: Sequence[SequenceState], max_batch: int | None) -> list[SequenceState]:
        """The distinct sequences `ids` (`seq_ids`), on device: the rows of a step (1..`max_batch` of
        them; a step may re-prepare the rows of an abandoned one), else none in `prepared`."""
        if max_batch is not None and not 0 < len(ids) <= max_batch:
            raise ValueError(f"seq_ids: expected 1..{max_batch} sequences (max_batch_size), got {len(ids)}")
        check_unique(ids, "seq_ids")
        if max_batch is None:
            return [self.on_device(i, "seq_ids", prepared) for i in ids]
        try:
            seqs = [self._by_id[i] for i in ids]
        except (KeyError, TypeError):
            seqs = [self.get(i, "seq_ids") for i in ids]  # raises for the first unknown id
        for seq in seqs:
            if seq.host_pages is not None:
                self.on_device(seq.seq_id, "seq_ids")  # raises: offloaded
        return seqs

    def check_new(self, seq_id: Hashable, name: str) -> None:
        """ValueError naming `name` unless `seq_id` is hashable and not in use."""
        try:
            taken = seq_id in self._by_id
        except TypeError:
            raise ValueError(f"{name}: sequence ids must be hashable, got {type(seq_id).__name__}") from None
        if taken:
            raise ValueError(f"{name}: sequence {seq_id!r} already exists")

    def check_new_ids(self, ids: list, name: str) -> None:
        check_unique(ids, name)
        for i in ids:
            self.check_new(i, name)

    def fresh_ids(self, count: int) -> list:
        """`count` ids `("loaded", n)` not in use, counting on from the last ones added."""
        ids: list = []
        n = self._next_loaded
        while len(ids) < count:
            if ("loaded", n) not in self._by_id:
                ids.append(("loaded", n))
            n += 1
        return ids

    def add(self, seq_id: Hashable, slot: int, keys: list[bytes]) -> SequenceState:
        seq = self._by_id[seq_id] = SequenceState(seq_id, slot, keys)
        if isinstance(seq_id, tuple) and len(seq_id) == 2 and seq_id[0] == "loaded" and type(seq_id[1]) is int:
            self._next_loaded = max(self._next_loaded, seq_id[1] + 1)
        return seq

    def remove(self, seq_id: Hashable) -> SequenceState:
        return self._by_id.pop(seq_id)


def cache_full_pages(
    pools: Sequence[PagePool], table: PageTable, root: bytes, seqs: list[SequenceState], num_full: Sequence[int]
) -> None:
    """Key the pages of `seqs[i]` below page `num_full[i]` not yet keyed (their token ids are known)
    and cache them in every layer group that holds them (a key names the tokens, the same in every group)."""
    todo = [(seq, i) for seq, n in zip(seqs, num_full, strict=True) for i in range(len(seq.keys), n)]
    if not todo:
        return
    slots, index = [seq.slot for seq, _ in todo], [i for _, i in todo]
    data = table.page_tokens(slots, index)  # one page of token ids after another
    width = len(data) // len(todo)
    for (seq, _), start in zip(todo, range(0, len(data), width), strict=True):
        keys = seq.keys  # a sequence's pages come in order: each chains over the one before
        keys.append(page_key_of_bytes(keys[-1] if keys else root, data[start : start + width]))
    keyed = [seq.keys[i] for seq, i in todo]
    for pool, group in zip(pools, table.groups, strict=True):
        for page, key in zip(group.rows[slots, index].tolist(), keyed, strict=True):
            if page != NULL_PAGE:  # (a sliding-window group may hold no page there)
                pool.register(page, key)
