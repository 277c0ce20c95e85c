"""`ManagerState`: the state a `KVCacheManager` owns, its read-only queries, and the lookups its
operations share (manager.py holds the operations: the policy).

The state is a `PagePool` per layer group (page_pool.py), one `PageTable` (page_table.py,
group_table.py), the sequences by id (sequences.py), the prepared step and what the step tensors
hold (step_rows.py), and an open reservation (reservation.py).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from .checkpoint import mark_driven
from .collection import PagedKVCacheCollection
from .layer_groups import LayerGroups
from .page_pool import PagePool, root_key
from .page_table import PageTable
from .params import TPShard, normalized_shard
from .reservation import Reservation
from .sequences import Sequences, SequenceState
from .step_rows import PreparedStep, StepRows, UploadedRows


class ManagerState:
    """What a `KVCacheManager` owns and answers (`KVCacheManager`'s docstring describes the arguments)."""

    def __init__(
        self,
        collection: PagedKVCacheCollection | LayerGroups,
        enable_prefix_caching: bool = True,
        hash_salt: bytes | None = None,
        *,
        tp_shard: TPShard | None = None,
        max_rewind: int = 0,
    ) -> None:
        if isinstance(collection, PagedKVCacheCollection):
            groups = LayerGroups.of(collection)
        elif isinstance(collection, LayerGroups):
            groups = collection
        else:
            raise ValueError(
                f"collection: expected a PagedKVCacheCollection or LayerGroups, got {type(collection).__name__}"
            )
        if hash_salt is not None and not isinstance(hash_salt, bytes):
            raise ValueError(f"hash_salt: expected bytes or None, got {type(hash_salt).__name__}")
        if not isinstance(max_rewind, (int, np.integer)) or isinstance(max_rewind, bool) or max_rewind < 0:
            raise ValueError(f"max_rewind: expected an int >= 0 (tokens a rewind may drop), got {max_rewind!r}")
        if tp_shard is not None and len(groups) > 1:
            raise ValueError("tp_shard: a tensor-parallel cache has one layer group")
        self.groups = groups
        self.collections = groups.collections
        self.tp_shard = normalized_shard(self.collections[0].params, tp_shard)
        for c in self.collections:
            mark_driven(c, "torch_paged_kv.save_sequences(manager, path, seq_ids)")
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.page_size = groups.page_size
        self.max_seq_len = groups.max_seq_len
        self.prefix_cache_hits = 0
        self.prefix_cache_misses = 0
        named = len(groups) > 1  # out-of-pages errors name the group
        self.page_pools = [PagePool(c.num_pages, g if named else None) for g, c in enumerate(self.collections)]
        self.max_rewind = int(max_rewind)
        self.page_table = PageTable(self.collections, self.max_rewind)
        self._windowed = [g for g, c in enumerate(self.collections) if c.params.sliding_window is not None]
        self._left_window: list[np.ndarray | None] = [None] * len(groups)  # step rows whose entries went null
        self._root = root_key(hash_salt)
        self._seqs = Sequences()
        self._pending: PreparedStep | None = None
        self._uploaded: UploadedRows | None = None
        self._reservation: Reservation | None = None

    # -- queries -------------------------------------------------------------------------------
    @property
    def collection(self) -> PagedKVCacheCollection:
        """The collection of a cache of one layer group (ValueError for several: see `collections`)."""
        if len(self.collections) != 1:
            raise ValueError(f"collection: this cache has {len(self.collections)} layer groups; use collections[g]")
        return self.collections[0]

    @property
    def page_pool(self) -> PagePool:
        """The page pool of a cache of one layer group (ValueError for several: see `page_pools`)."""
        if len(self.page_pools) != 1:
            raise ValueError(f"page_pool: this cache has {len(self.page_pools)} layer groups; use page_pools[g]")
        return self.page_pools[0]

    @property
    def sequences(self) -> list:
        """Ids of the claimed sequences (offloaded ones included), in claim order."""
        return list(self._seqs)

    def cache_length(self, seq_id: Hashable) -> int:
        """Tokens cached for `seq_id` (committed steps only)."""
        return int(self.page_table.lengths[self._seqs.get(seq_id, "seq_id").slot])

    def pages(self, seq_id: Hashable, group: int = 0) -> list[int]:
        """Table entries of `seq_id` in layer group `group`, in order (page i holds tokens `i*page_size..`;
        the null page where a sliding-window group dropped it; empty while offloaded)."""
        return self.page_table.groups[self._group(group)].pages(self._seqs.get(seq_id, "seq_id").slot)

    def token_ids(self, seq_id: Hashable) -> list[int] | None:
        """Token ids of `seq_id` known from position 0 (a claimed prompt may run past its length), or None."""
        return self.page_table.token_ids(self._seqs.get(seq_id, "seq_id").slot)

    def prefix_keys(self, seq_id: Hashable) -> list[bytes]:
        """Prefix-cache keys of `seq_id`'s leading full pages (chained sha256, see page_pool.py)."""
        return list(self._seqs.get(seq_id, "seq_id").keys)

    def committed_rows(self, seq_ids: Sequence, group: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Cache lengths (int64 `[n]`) and host table rows of layer group `group` (int32 `[n, width]`) of
        distinct sequences on device and not in the prepared step (else ValueError naming `seq_ids`)."""
        slots = self._resolve(list(seq_ids), step=False)[1]
        return self.page_table.lengths[slots], self.page_table.groups[self._group(group)].rows[slots]

    @property
    def prepared_sequences(self) -> list:
        """Ids of the rows of the prepared step not yet committed (empty when there is none)."""
        return [] if self._pending is None else [s.seq_id for s in self._pending.seqs]

    @property
    def prepared_rows(self) -> StepRows | None:
        """The rows of the prepared step not yet committed (None when there is none)."""
        p = self._pending
        return None if p is None else StepRows(p.slots, p.num_new, p.new_lengths)

    @property
    def prefix_root(self) -> bytes:
        """Parent key of every sequence's first page (from `hash_salt`): keys chain from it."""
        return self._root

    def num_free_pages(self, group: int = 0) -> int:
        """Pages an allocation in layer group `group` can use now: unused pages plus evictable cached pages."""
        return self.page_pools[self._group(group)].available()

    def num_cached_pages(self, group: int = 0) -> int:
        """Pages of layer group `group` in the prefix cache (referenced or evictable)."""
        return len(self.page_pools[self._group(group)].key_of)

    def kv_bytes_in_use(self) -> int:
        """Bytes of K/V (and FP8 scales) that the pages some sequence holds take, summed over the groups
        (cached pages nobody holds are not in use: an allocation may take them)."""
        return sum(
            pool.in_use() * c.params.page_bytes for pool, c in zip(self.page_pools, self.collections, strict=True)
        )

    def is_offloaded(self, seq_id: Hashable) -> bool:
        return self._seqs.get(seq_id, "seq_id").host_pages is not None

    def check_new_ids(self, seq_ids: Sequence, name: str = "seq_ids") -> None:
        """ValueError naming `name` unless `seq_ids` are hashable, distinct and not in use."""
        self._seqs.check_new_ids(list(seq_ids), name)

    def fresh_ids(self, count: int) -> list:
        """`count` ids `("loaded", n)` no sequence has, counting on from the last ones added."""
        return self._seqs.fresh_ids(count)

    # -- helpers -------------------------------------------------------------------------------
    def _check_unlocked(self) -> None:
        reservation = self._reservation
        if reservation is not None and reservation.open:
            raise RuntimeError("KVCacheManager: a reservation is open (reserve); commit or abort it first")

    def _on_device(self, seq_id: Hashable) -> SequenceState:
        return self._seqs.on_device(seq_id, "seq_id", () if self._pending is None else self._pending.seqs)

    def _group(self, group: int) -> int:
        if not isinstance(group, int) or not 0 <= group < len(self.collections):
            raise ValueError(f"group: expected a layer group 0..{len(self.collections) - 1}, got {group!r}")
        return group

    def _resolve(self, ids: list, step: bool = True) -> tuple[list[SequenceState], np.ndarray]:
        """Sequences and slots of `ids`: the rows of a step, or sequences not in the prepared step."""
        prepared = () if self._pending is None else self._pending.seqs
        seqs = self._seqs.resolve(ids, prepared, self.groups.max_batch_size if step else None)
        return seqs, np.array([seq.slot for seq in seqs], dtype=np.int64)

    def _add(
        self, seq_id: Hashable, pages: list[list[int]], length: int, tokens: np.ndarray | None, keys: list[bytes]
    ) -> SequenceState:
        return self._seqs.add(seq_id, self.page_table.add(pages, length, tokens), keys)
