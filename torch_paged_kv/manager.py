"""`KVCacheManager`: which pages each sequence holds, through claim, release, fork, steps and offload.

The manager keeps policy: who claims and releases pages, when pages are shared, copied, offloaded
or dropped. It drives a cache of one or more layer groups (layer_groups.py: one collection each,
with its own geometry and page pool). State lives in objects it owns: a `PagePool` per group
(refcounts, free pages, the prefix cache: page_pool.py) and one `PageTable` (per-sequence slot:
lengths, token ids, and per group the pages and the upload of a step into that group's step
tensors: page_table.py, group_table.py), kept with the read-only queries in manager_state.py.
`prepare_step` fills the step tensors in place for the
sequences of one step, all or nothing across groups; the model runs; `commit_step` advances the
lengths, caches the pages that became full (one sha256 per page that fills, the same key in every
group) and drops, in sliding-window groups, the pages that left the window of every later query.
Sequences filled elsewhere come in through `reserve` (reservation.py), host copies through
offload.py, prefix hits are found by prefix_hit.py, speculative decoding's `rewind` and `accept`
run in rewind.py; KV checkpoints of a manager's sequences are
`sequence_checkpoint.save_sequences` / `load_sequences`, a layer above.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import cast

import numpy as np

from . import offload as host
from .collection import StepTensors
from .layout import NULL_PAGE
from .manager_state import ManagerState
from .page_pool import OutOfPagesError, token_array
from .prefix_hit import match_prefix
from .reservation import Incoming, Reservation
from .rewind import accept_path, rewind_tokens
from .sequences import cache_full_pages, check_unique
from .step_rows import PreparedStep, StepRows, UploadedRows, check_lengths, check_num_new, check_token_ids

__all__ = ["KVCacheManager", "OutOfPagesError", "Reservation", "StepRows"]


class KVCacheManager(ManagerState):
    """Pages of a paged KV cache for sequences named by any hashable id: one `PagedKVCacheCollection`,
    or the collections of a `LayerGroups` (one per layer group; each sequence has pages in every group).

    Prefix caching (on by default) keys every full page by a sha256 chained over its parent's
    key and its token ids (plus `hash_salt`); `claim` reuses the longest cached prefix that every
    group still holds what the rest of the sequence needs of (docs/manager.md). The counters
    `prefix_cache_hits` / `prefix_cache_misses` count prompt *tokens* given to `claim` that were
    reused / must be computed. In a sliding-window group (`KVCacheParams.sliding_window`) a
    sequence's pages go back to the pool (cached ones stay cached) once every later query's window
    has passed them; its table entries there are the null page. `max_rewind=R` (an int >= 0) keeps
    the pages that a `rewind` or `accept` of up to R tokens needs as well: a page goes back once it
    left the window of every query at any length >= the sequence's length - R, so rewinding to no
    fewer than (its longest length - R) tokens is never refused for a dropped page, at a cost of
    about R / page_size more pages per sequence in each sliding group (docs/manager.md).

    `page_pools[g]` and `page_table` are the state it owns (read them; change them only through the
    manager); `collection` and `page_pool` are those of a cache of one group. `tp_shard` says which
    of the model's KV heads the pool holds (a tensor-parallel rank's; None: all; one group only);
    checkpoints and transfers record and check it, the manager itself does not use it.

    Speculative decoding: `rewind` drops a sequence's last tokens, `accept` keeps a tree step's
    accepted path (rewind.py, docs/manager.md).
    """

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
            params = [c.params for c in self.collections]
            pages, keys = match_prefix(self.page_pools, params, self._root, prompt, max_pages, self.max_rewind)
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
                group.copy_pages(src_pages[full : full + 1], group_pages[-1:])
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
        the pages of sliding-window groups that left the window of every later query (and of every
        query at a length a rewind of up to `max_rewind` tokens goes back to)."""
        self._check_unlocked()
        step = self._pending
        if step is None:
            raise RuntimeError("commit_step: no prepared step (call prepare_step first)")
        self._pending = None
        table = self.page_table
        old_lengths = table.lengths[step.slots]
        table.lengths[step.slots] = step.new_lengths
        table.step_start[step.slots] = old_lengths  # what `accept` reorders
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
        for seq in self._resolve(list(seq_ids), step=False)[0]:
            seq.host_pages = host.offload_slot(self.page_pools, self.page_table, seq.slot)
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
        host.restore_slots(self.page_pools, self.page_table, [s.slot for s in seqs], host_pages, [s.keys for s in seqs])
        for seq in seqs:
            seq.host_pages = None

    # -- speculative decoding ------------------------------------------------------------------
    def rewind(self, seq_id: Hashable, n: int) -> None:
        """Drop the last `n` committed tokens of `seq_id` (rejected drafts), all or nothing.

        Pages past the new length go back to their pools (shared and cached ones keep their other
        holders and keys); a partial last page that others hold or the prefix cache keys is copied
        or unpublished first, so nobody sees it change; token ids and prefix keys past it are
        forgotten. `ValueError` naming `n` unless `0 <= n <= cache_length(seq_id)`, or when a
        sliding-window group already dropped pages the shorter sequence needs (never when it ends
        within `max_rewind` tokens of the longest it has been); naming `seq_id` when
        it is unknown, offloaded or in the prepared step; `OutOfPagesError` when a copy finds no page.
        """
        self._check_unlocked()
        rewind_tokens(self.page_pools, self.page_table, self._on_device(seq_id), n)
        self._uploaded = None  # its table rows changed

    def accept(self, seq_id: Hashable, kept: Sequence[int], token_ids: Sequence[int] | None = None) -> None:
        """After a tree verify step of `seq_id` (its last `commit_step`, n new tokens at positions
        L..L+n-1 in tree order), keep its new tokens `kept` (indices < n, in path order) at positions
        L..L+len(kept)-1 and drop the others, all or nothing.

        Their K/V move in every group, layer and plane (FP8 scales with them); the step's token ids
        move with them, or `token_ids` (the kept tokens' ids) are recorded; full pages are keyed
        anew. `ValueError` naming `kept` (not distinct indices < n, or past what a sliding window
        kept: never when the step had at most `max_rewind` tokens), `token_ids`, or `seq_id` (no
        step to accept since its last commit, rewind or accept).
        """
        self._check_unlocked()
        seq = self._on_device(seq_id)
        accept_path(self.page_pools, self.page_table, self._root, seq, kept, token_ids)
        self._uploaded = None  # its table rows changed

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
