"""`KVCacheManager`: which pages each sequence holds, through claim, release, fork, steps and offload.

The manager keeps policy: who claims and releases pages, when pages are shared, copied, offloaded
or dropped. It drives a cache of one or more layer groups (layer_groups.py: one collection each,
with its own geometry and page pool). State lives in objects it owns: a `PagePool` per group
(refcounts, free pages, the prefix cache: page_pool.py) and one `PageTable` (per-sequence slot:
lengths, token ids, and per group the pages and the upload of a step into that group's step
tensors: page_table.py, group_table.py). `prepare_step` fills the step tensors in place for the
sequences of one step, all or nothing across groups; the model runs; `commit_step` advances the
lengths, caches the pages that became full (one sha256 per page that fills, the same key in every
group) and drops, in sliding-window groups, the pages that left the window of every later query.
Sequences filled elsewhere come in through `reserve` (reservation.py), host copies through
offload.py; KV checkpoints of a manager's sequences are
`sequence_checkpoint.save_sequences` / `load_sequences`, a layer above.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import cast

import numpy as np
import torch

from . import offload as host
from .checkpoint import mark_driven
from .collection import PagedKVCacheCollection, StepTensors
from .layer_groups import LayerGroups
from .layout import NULL_PAGE
from .ops import copy_pages
from .page_pool import OutOfPagesError, PagePool, page_key, root_key, token_array
from .page_table import PageTable
from .params import KVCacheParams, TPShard, normalized_shard
from .reservation import Incoming, Reservation
from .sequences import Sequences, SequenceState, cache_full_pages, check_unique
from .step_rows import PreparedStep, StepRows, UploadedRows, check_lengths, check_num_new, check_token_ids

__all__ = ["KVCacheManager", "OutOfPagesError", "Reservation", "StepRows"]


class KVCacheManager:
    """Pages of a paged KV cache for sequences named by any hashable id: one `PagedKVCacheCollection`,
    or the collections of a `LayerGroups` (one per layer group; each sequence has pages in every group).

    Prefix caching (on by default) keys every full page by a sha256 chained over its parent's
    key and its token ids (plus `hash_salt`); `claim` reuses the longest cached prefix that every
    group still holds what the rest of the sequence needs of (docs/manager.md). The counters
    `prefix_cache_hits` / `prefix_cache_misses` count prompt *tokens* given to `claim` that were
    reused / must be computed. In a sliding-window group (`KVCacheParams.sliding_window`) a
    sequence's pages go back to the pool (cached ones stay cached) once every later query's window
    has passed them; its table entries there are the null page.

    `page_pools[g]` and `page_table` are the state it owns (read them; change them only through the
    manager); `collection` and `page_pool` are those of a cache of one group. `tp_shard` says which
    of the model's KV heads the pool holds (a tensor-parallel rank's; None: all; one group only);
    checkpoints and transfers record and check it, the manager itself does not use it.

    Rewinding a sequence (speculative decoding) is not here yet; it would lower the length, unref
    the pages past it in every group and drop their prefix keys, in the pattern of `commit_step`
    run backwards: a sliding-window group can rewind only as far as the pages it still holds
    (`KVCacheParams.first_held_page` of the shorter length).
    """

    def __init__(
        self,
        collection: PagedKVCacheCollection | LayerGroups,
        enable_prefix_caching: bool = True,
        hash_salt: bytes | None = None,
        *,
        tp_shard: TPShard | None = None,
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
        self.page_table = PageTable(self.collections)
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

    # -- sequences -----------------------------------------------------------------------------
    def claim(self, seq_id: Hashable, prompt_tokens: Sequence[int] | None = None) -> int:
        """Start a sequence; returns the prompt tokens reused from the prefix cache (its length).

        Only whole pages are reused and at least one prompt token is left to compute. The prompt
        is remembered, so steps that compute it need no `token_ids`.
        """
        self._check_unlocked()
        self._seqs.check_new(seq_id, "seq_id")
        prompt = token_array("prompt_tokens", () if prompt_tokens is None else prompt_tokens)
        if len(prompt) > self.max_seq_len:
            raise ValueError(f"prompt_tokens: {len(prompt)} tokens exceed max_seq_len={self.max_seq_len}")
        pages: list[list[int]] = [[] for _ in self.collections]
        keys: list[bytes] = []
        if self.enable_prefix_caching and prompt_tokens is not None:
            max_pages = (len(prompt) - 1) // self.page_size  # leave at least one token to compute
            pages, keys = self._match_prefix(prompt, max_pages)
            for pool, group_pages in zip(self.page_pools, pages, strict=True):
                for page in group_pages:
                    if page != NULL_PAGE:
                        pool.ref(page)
            self.prefix_cache_hits += len(keys) * self.page_size
            self.prefix_cache_misses += len(prompt) - len(keys) * self.page_size
        tokens = prompt if self.enable_prefix_caching else None
        self._add(seq_id, pages, len(keys) * self.page_size, tokens, keys)
        return len(keys) * self.page_size

    def release(self, seq_id: Hashable) -> None:
        """Forget a sequence; its pages return to the pool (cached ones stay cached, LRU last page first)."""
        self._check_unlocked()
        seq = self._seqs.get(seq_id, "seq_id")
        self._seqs.remove(seq_id)
        for pool, held in zip(self.page_pools, self.page_table.remove(seq.slot), strict=True):
            pool.unref(reversed(held))
        if self._pending is not None and seq in self._pending.seqs:
            self._pending = self._pending.without(seq)
        self._uploaded = None  # its slot may be handed out again

    def fork(self, parent: Hashable, child: Hashable) -> None:
        """New sequence `child` with `parent`'s cache: full pages shared, a partial last page copied
        (in every group: all or nothing)."""
        self._check_unlocked()
        src = self._seqs.on_device(parent, "parent", () if self._pending is None else self._pending.seqs)
        self._seqs.check_new(child, "child")
        table = self.page_table
        length = int(table.lengths[src.slot])
        full = length // self.page_size
        partial = length % self.page_size != 0
        for pool in self.page_pools:
            pool.require(int(partial))
        pages = []
        for pool, group in zip(self.page_pools, table.groups, strict=True):
            src_pages = group.pages(src.slot)
            group_pages = src_pages[:full]
            for page in group_pages:
                if page != NULL_PAGE:
                    pool.ref(page)
            if partial:
                group_pages += pool.allocate(1)
                c = group.collection
                copied, copy = (
                    torch.tensor([p], dtype=torch.int32, device=c.device) for p in (src_pages[full], group_pages[-1])
                )
                copy_pages(c.blocks, copied, copy, c.scales)
            pages.append(group_pages)
        known = int(table.known[src.slot])
        tokens = table.tokens[src.slot, : min(known, length)] if known >= 0 else None
        self._add(child, pages, length, tokens, src.keys[:full])

    def reserve(
        self,
        seq_ids: Sequence,
        cache_lengths: Sequence[int],
        page_rows: Sequence[Sequence[int]] | Sequence[Sequence[Sequence[int]]],
        *,
        token_ids: Sequence[Sequence[int] | None] | None = None,
        prefix_keys: Sequence[Sequence[bytes]] | None = None,
    ) -> Reservation:
        """Plan adding sequences whose pages come from elsewhere (another process, a file), taking nothing.

        Sequence i holds `cache_lengths[i]` tokens in incoming pages `page_rows[i]` (indices into
        `0..n-1`; for a cache of several layer groups, `page_rows[g][i]` into group g's incoming
        pages), with known `token_ids[i]` and the `prefix_keys[i]` of its full pages (see
        `reservation.Incoming`; a page whose key is cached here is shared, not filled). Checked here
        (`ValueError` naming the argument, `OutOfPagesError`); then write the pages the `Reservation`
        names and `commit()` or `abort()` it. Until then every change to the manager raises `RuntimeError`.
        """
        self._check_unlocked()
        ids = list(seq_ids)
        self.check_new_ids(ids)
        one = len(self.collections) == 1
        rows = cast(Sequence[Sequence[Sequence[int]]], [page_rows] if one else list(page_rows))
        if len(rows) != len(self.collections):
            raise ValueError(f"page_rows: expected {len(self.collections)} lists of rows (one per layer group)")
        limits = ([c.params for c in self.collections], self.max_seq_len, self.enable_prefix_caching)
        request = Incoming.check(ids, cache_lengths, rows, token_ids, prefix_keys, *limits)
        self._reservation = Reservation(self.page_pools, request, self._add_reserved)
        return self._reservation

    # -- steps ---------------------------------------------------------------------------------
    def prepare_step(
        self, seq_ids: Sequence, num_new_tokens: Sequence[int], token_ids: Sequence[Sequence[int]] | None = None
    ) -> StepTensors | tuple[StepTensors, ...]:
        """Reserve pages for this step's new tokens and fill the step tensors; row b is `seq_ids[b]`.
        Returns the collection's step tensors, or for a cache of several layer groups each group's.

        `token_ids[b]` (optional) are the ids of row b's new tokens, for the prefix cache.
        All or nothing: on any error (`OutOfPagesError` included) nothing changed. A prepared
        step not yet committed is abandoned by the next `prepare_step` (its pages stay reserved).
        """
        self._check_unlocked()
        table, last = self.page_table, self._uploaded
        ids = list(seq_ids)
        batch = len(ids)
        rows_kept = last if last is not None and ids == last.ids else None  # (the same rows as last step)
        counts_kept = last if last is not None and last.same_counts(num_new_tokens, batch) else None
        seqs, slots = (rows_kept.seqs, rows_kept.slots) if rows_kept is not None else self._resolve(ids)
        num_new = counts_kept.num_new if counts_kept is not None else check_num_new(num_new_tokens, batch)
        flat_ids = None if token_ids is None else check_token_ids(token_ids, num_new)
        lengths = table.lengths[slots]
        new_lengths = lengths + num_new
        longest = check_lengths(new_lengths, ids, self.max_seq_len)
        need = table.pages_for(new_lengths)
        grows = []
        for pool, group in zip(self.page_pools, table.groups, strict=True):
            missing = need - group.num_pages[slots]
            grow = np.flatnonzero(missing > 0)
            if grow.size:
                pool.require(int(missing[grow].sum()))
            grows.append((grow, missing))
        for g, (pool, group, (grow, missing)) in enumerate(zip(self.page_pools, table.groups, grows, strict=True)):
            if grow.size:
                group.extend(slots[grow], missing[grow], pool.allocate(int(missing[grow].sum())))
            changed = None
            if rows_kept is not None:
                left = self._left_window[g]
                changed = grow if left is None else np.union1d(grow, left)
            self._left_window[g] = None
            group.upload(slots, lengths, num_new, changed, same_offsets=counts_kept is not None)
        if flat_ids is not None and self.enable_prefix_caching:
            table.reserve_tokens(longest)  # room for this step's ids
        if counts_kept is None:
            counts = list(num_new_tokens) if type(num_new_tokens) is list else None
            self._uploaded = UploadedRows(ids, seqs, slots, counts, num_new)
        elif rows_kept is None:
            self._uploaded = counts_kept._replace(ids=ids, seqs=seqs, slots=slots)
        self._pending = PreparedStep(seqs, slots, num_new, new_lengths, flat_ids)
        if len(table.groups) == 1:
            return table.groups[0].step_tensors(batch)
        return tuple(group.step_tensors(batch) for group in table.groups)

    def commit_step(self) -> None:
        """After the model ran the prepared step: advance lengths, cache newly full pages, and drop
        the pages of sliding-window groups that left the window of every later query."""
        self._check_unlocked()
        step = self._pending
        if step is None:
            raise RuntimeError("commit_step: no prepared step (call prepare_step first)")
        self._pending = None
        table = self.page_table
        old_lengths = table.lengths[step.slots]
        table.lengths[step.slots] = step.new_lengths
        if self.enable_prefix_caching:
            known = table.known[step.slots]
            if step.token_ids is not None:
                known = table.append_tokens(step.slots, old_lengths, step.new_lengths, step.num_new, step.token_ids)
            full = step.new_lengths // self.page_size
            end = full * self.page_size  # a row whose last full page ends past its old length crossed into it
            crossed = np.flatnonzero((end > old_lengths) & (known >= end)).tolist()
            if crossed:
                seqs = [step.seqs[b] for b in crossed]
                cache_full_pages(self.page_pools, table, self._root, seqs, full[crossed].tolist())
        for g in self._windowed:  # after keying: a cached page that leaves stays cached (evictable)
            moved, dropped = table.groups[g].leave_window(step.slots, old_lengths, step.new_lengths)
            if moved:
                self.page_pools[g].unref(dropped)
                self._left_window[g] = np.array(moved, dtype=np.int64)

    # -- offload -------------------------------------------------------------------------------
    def offload(self, seq_ids: Sequence) -> None:
        """Move sequences' pages to CPU memory (pinned when the pool is on a GPU) and free them."""
        self._check_unlocked()
        seqs = self._resolve(list(seq_ids), step=False)[0]
        table = self.page_table
        for seq in seqs:
            length = table.lengths[seq.slot : seq.slot + 1]
            copies = []
            for pool, group in zip(self.page_pools, table.groups, strict=True):
                first, used = int(group.first_held(length)[0]), table.pages_for(int(length[0]))
                copies.append(host.read_pages(group.collection, group.pages(seq.slot)[first:used]))
                pool.unref(reversed(group.held(seq.slot)))
                group.set_pages(seq.slot, [])
            seq.host_pages = copies
        self._uploaded = None  # their table rows changed

    def restore(self, seq_ids: Sequence) -> None:
        """Bring offloaded sequences back, contents identical (all or nothing, over every group): full
        pages still in the prefix cache are shared again, the others copied into fresh pages."""
        self._check_unlocked()
        ids = list(seq_ids)
        check_unique(ids, "seq_ids")
        seqs = [self._seqs.get(i, "seq_ids") for i in ids]
        host_pages = []
        for seq in seqs:
            if seq.host_pages is None:
                raise ValueError(f"seq_ids: sequence {seq.seq_id!r} is not offloaded")
            host_pages.append(seq.host_pages)
        table = self.page_table
        firsts = [group.first_held(table.lengths[[seq.slot for seq in seqs]]).tolist() for group in table.groups]
        copies = [
            [(held[g], seq.keys[first:]) for seq, held, first in zip(seqs, host_pages, firsts[g], strict=True)]
            for g in range(len(table.groups))
        ]
        for pool, group_copies in zip(self.page_pools, copies, strict=True):
            pool.require(host.restore_need(pool, group_copies))
        restored = [
            host.restore_pages(pool, group.collection, group_copies)
            for pool, group, group_copies in zip(self.page_pools, table.groups, copies, strict=True)
        ]
        for i, seq in enumerate(seqs):
            seq.host_pages = None
            for g, group in enumerate(table.groups):
                group.set_pages(seq.slot, [NULL_PAGE] * firsts[g][i] + restored[g][i])

    # -- helpers -------------------------------------------------------------------------------
    def _check_unlocked(self) -> None:
        reservation = self._reservation
        if reservation is not None and reservation.open:
            raise RuntimeError("KVCacheManager: a reservation is open (reserve); commit or abort it first")

    def _group(self, group: int) -> int:
        if not isinstance(group, int) or not 0 <= group < len(self.collections):
            raise ValueError(f"group: expected a layer group 0..{len(self.collections) - 1}, got {group!r}")
        return group

    def _resolve(self, ids: list, step: bool = True) -> tuple[list[SequenceState], np.ndarray]:
        """Sequences and slots of `ids`: the rows of a step, or sequences not in the prepared step."""
        prepared = () if self._pending is None else self._pending.seqs
        seqs = self._seqs.resolve(ids, prepared, self.groups.max_batch_size if step else None)
        return seqs, np.array([seq.slot for seq in seqs], dtype=np.int64)

    def _match_prefix(self, prompt: np.ndarray, max_pages: int) -> tuple[list[list[int]], list[bytes]]:
        """Each group's pages of the longest cached prefix of `prompt` (whole pages, at most
        `max_pages`) that every group can continue from, and its keys (docs/manager.md): a group
        without a window needs every page of the prefix cached; a sliding-window group only the
        pages from the first one it holds at that length (`first_held_page`); the rest are the null page."""
        pools, params = self.page_pools, [c.params for c in self.collections]
        keys: list[bytes] = []
        parent = self._root

        def key(i: int) -> bytes:  # keys are computed as far as they are asked for
            nonlocal parent
            while len(keys) <= i:
                j = len(keys)
                parent = page_key(parent, prompt[j * self.page_size : (j + 1) * self.page_size])
                keys.append(parent)
            return keys[i]

        hit = max_pages
        for pool, p in zip(pools, params, strict=True):
            if p.sliding_window is None:  # a full group: the prefix cached from page 0 on
                n = 0
                while n < hit and pool.lookup(key(n)) is not None:
                    n += 1
                hit = n
        changed = True
        while changed:  # a sliding group may shorten the hit, which moves the pages others need
            changed = False
            for pool, p in zip(pools, params, strict=True):
                if p.sliding_window is not None:
                    n = _sliding_hit(pool, p, hit, key)
                    changed |= n < hit
                    hit = n
        pages = []
        for pool, p in zip(pools, params, strict=True):
            first = p.first_held_page(hit * self.page_size)
            pages.append([NULL_PAGE] * first + [pool.page_of[key(i)] for i in range(first, hit)])
        return pages, keys[:hit]

    def _add(
        self, seq_id: Hashable, pages: list[list[int]], length: int, tokens: np.ndarray | None, keys: list[bytes]
    ) -> SequenceState:
        return self._seqs.add(seq_id, self.page_table.add(pages, length, tokens), keys)

    def _add_reserved(self, request: Incoming, rows: list[list[list[int]]]) -> None:
        """A reservation's commit: register its sequences in `rows[g]`' pages and key their full pages."""
        r = request
        per_seq = [[group_rows[b] for group_rows in rows] for b in range(len(r.seq_ids))]
        seqs = [
            self._add(seq_id, pages, length, tokens, list(keys))
            for seq_id, pages, length, tokens, keys in zip(r.seq_ids, per_seq, r.lengths, r.tokens, r.keys, strict=True)
        ]
        known = [min(n, int(self.page_table.known[s.slot])) for s, n in zip(seqs, r.lengths, strict=True)]
        cache_full_pages(self.page_pools, self.page_table, self._root, seqs, [n // self.page_size for n in known])


def _sliding_hit(pool: PagePool, params: KVCacheParams, hit: int, key: Callable[[int], bytes]) -> int:
    """The longest hit of at most `hit` pages whose pages from `params.first_held_page` on are all
    cached in `pool` (a sliding-window group's test, scanned from the end as vLLM's)."""
    while hit > 0:
        first = params.first_held_page(hit * params.page_size)
        miss = next((i for i in range(hit - 1, first - 1, -1) if pool.lookup(key(i)) is None), None)
        if miss is None:
            return hit
        hit = miss  # a hit ending at or before the missing page
    return 0
