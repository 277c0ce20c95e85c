"""`KVCacheManager`: which pages each sequence holds, through claim, release, fork, steps and offload.

The manager keeps policy: who claims and releases pages, when pages are shared, copied or offloaded.
State lives in two objects it owns: a `PagePool` (refcounts, free pages, the prefix cache:
page_pool.py) and a `PageTable` (per-sequence slot: lengths, pages, token ids, and the upload of a
step into the collection's step tensors: page_table.py). `prepare_step` fills the step tensors in
place for the sequences of one step, the model runs, `commit_step` advances the lengths and caches
the pages that became full (one sha256 per page that fills). Sequences filled elsewhere come in
through `reserve` (reservation.py), host copies through offload.py; KV checkpoints of a manager's
sequences are `sequence_checkpoint.save_sequences` / `load_sequences`, a layer above.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
import torch

from . import offload as host
from .checkpoint import mark_driven
from .collection import PagedKVCacheCollection, StepTensors
from .ops import copy_pages
from .page_pool import OutOfPagesError, PagePool, root_key, token_array
from .page_table import PageTable
from .params import TPShard, normalized_shard
from .reservation import Incoming, Reservation
from .sequences import Sequences, SequenceState, cache_full_pages, check_unique
from .step_rows import PreparedStep, StepRows, UploadedRows, check_lengths, check_num_new, check_token_ids

__all__ = ["KVCacheManager", "OutOfPagesError", "Reservation", "StepRows"]


class KVCacheManager:
    """Pages of one `PagedKVCacheCollection` for sequences named by any hashable id.

    Prefix caching (on by default) keys every full page by a sha256 chained over its parent's
    key and its token ids (plus `hash_salt`); `claim` reuses the longest cached prefix. The
    counters `prefix_cache_hits` / `prefix_cache_misses` count prompt *tokens* given to `claim`
    that were reused / must be computed. `page_pool` and `page_table` are the state it owns
    (read them; change them only through the manager). `tp_shard` says which of the model's KV
    heads the pool holds (a tensor-parallel rank's; None: all); checkpoints and transfers record
    and check it, the manager itself does not use it.
    """

    def __init__(
        self,
        collection: PagedKVCacheCollection,
        enable_prefix_caching: bool = True,
        hash_salt: bytes | None = None,
        *,
        tp_shard: TPShard | None = None,
    ) -> None:
        if not isinstance(collection, PagedKVCacheCollection):
            raise ValueError(f"collection: expected a PagedKVCacheCollection, got {type(collection).__name__}")
        if hash_salt is not None and not isinstance(hash_salt, bytes):
            raise ValueError(f"hash_salt: expected bytes or None, got {type(hash_salt).__name__}")
        self.tp_shard = normalized_shard(collection.params, tp_shard)
        self.collection = collection
        mark_driven(collection, "torch_paged_kv.save_sequences(manager, path, seq_ids)")
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.page_size = collection.params.page_size
        self.prefix_cache_hits = 0
        self.prefix_cache_misses = 0
        self.page_pool = PagePool(collection.num_pages)
        self.page_table = PageTable(collection)
        self._root = root_key(hash_salt)
        self._seqs = Sequences()
        self._pending: PreparedStep | None = None
        self._uploaded: UploadedRows | None = None
        self._reservation: Reservation | None = None

    # -- queries -------------------------------------------------------------------------------
    @property
    def sequences(self) -> list:
        """Ids of the claimed sequences (offloaded ones included), in claim order."""
        return list(self._seqs)

    def cache_length(self, seq_id: Hashable) -> int:
        """Tokens cached for `seq_id` (committed steps only)."""
        return int(self.page_table.lengths[self._seqs.get(seq_id, "seq_id").slot])

    def pages(self, seq_id: Hashable) -> list[int]:
        """Physical pages of `seq_id` in order (empty while it is offloaded)."""
        return self.page_table.pages(self._seqs.get(seq_id, "seq_id").slot)

    def token_ids(self, seq_id: Hashable) -> list[int] | None:
        """Token ids of `seq_id` known from position 0 (a claimed prompt may run past its length), or None."""
        return self.page_table.token_ids(self._seqs.get(seq_id, "seq_id").slot)

    def prefix_keys(self, seq_id: Hashable) -> list[bytes]:
        """Prefix-cache keys of `seq_id`'s leading full pages (chained sha256, see page_pool.py)."""
        return list(self._seqs.get(seq_id, "seq_id").keys)

    def committed_rows(self, seq_ids: Sequence) -> tuple[np.ndarray, np.ndarray]:
        """Cache lengths (int64 `[n]`) and host table rows (int32 `[n, width]`) of distinct sequences
        on device and not in the prepared step (else ValueError naming `seq_ids`)."""
        slots = self._resolve(list(seq_ids), step=False)[1]
        return self.page_table.lengths[slots], self.page_table.rows[slots]

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

    def num_free_pages(self) -> int:
        """Pages an allocation can use now: unused pages plus evictable cached pages."""
        return self.page_pool.available()

    def num_cached_pages(self) -> int:
        """Pages in the prefix cache (referenced or evictable)."""
        return len(self.page_pool.key_of)

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
        if len(prompt) > self.collection.max_seq_len:
            raise ValueError(f"prompt_tokens: {len(prompt)} tokens exceed max_seq_len={self.collection.max_seq_len}")
        pages: list[int] = []
        keys: list[bytes] = []
        if self.enable_prefix_caching and prompt_tokens is not None:
            max_pages = (len(prompt) - 1) // self.page_size  # leave at least one token to compute
            pages, keys = self.page_pool.match_prefix(self._root, prompt, self.page_size, max_pages)
            for page in pages:
                self.page_pool.ref(page)
            self.prefix_cache_hits += len(pages) * self.page_size
            self.prefix_cache_misses += len(prompt) - len(pages) * self.page_size
        tokens = prompt if self.enable_prefix_caching else None
        self._add(seq_id, pages, len(pages) * self.page_size, tokens, keys)
        return len(pages) * self.page_size

    def release(self, seq_id: Hashable) -> None:
        """Forget a sequence; its pages return to the pool (cached ones stay cached, LRU last page first)."""
        self._check_unlocked()
        seq = self._seqs.get(seq_id, "seq_id")
        self._seqs.remove(seq_id)
        self.page_pool.unref(reversed(self.page_table.remove(seq.slot)))
        if self._pending is not None and seq in self._pending.seqs:
            self._pending = self._pending.without(seq)
        self._uploaded = None  # its slot may be handed out again

    def fork(self, parent: Hashable, child: Hashable) -> None:
        """New sequence `child` with `parent`'s cache: full pages shared, a partial last page copied."""
        self._check_unlocked()
        src = self._seqs.on_device(parent, "parent", () if self._pending is None else self._pending.seqs)
        self._seqs.check_new(child, "child")
        table = self.page_table
        length = int(table.lengths[src.slot])
        full = length // self.page_size
        partial = length % self.page_size != 0
        self.page_pool.require(int(partial))
        src_pages = table.pages(src.slot)
        pages = src_pages[:full]
        for page in pages:
            self.page_pool.ref(page)
        if partial:
            pages += self.page_pool.allocate(1)
            c = self.collection
            copied, copy = (torch.tensor([p], dtype=torch.int32, device=c.device) for p in (src_pages[full], pages[-1]))
            copy_pages(c.blocks, copied, copy, c.scales)
        known = int(table.known[src.slot])
        tokens = table.tokens[src.slot, : min(known, length)] if known >= 0 else None
        self._add(child, pages, length, tokens, src.keys[:full])

    def reserve(
        self,
        seq_ids: Sequence,
        cache_lengths: Sequence[int],
        page_rows: Sequence[Sequence[int]],
        *,
        token_ids: Sequence[Sequence[int] | None] | None = None,
        prefix_keys: Sequence[Sequence[bytes]] | None = None,
    ) -> Reservation:
        """Plan adding sequences whose pages come from elsewhere (another process, a file), taking nothing.

        Sequence i holds `cache_lengths[i]` tokens in incoming pages `page_rows[i]` (indices into
        `0..n-1`), with known `token_ids[i]` and the `prefix_keys[i]` of its full pages (see
        `reservation.Incoming`; a page whose key is cached here is shared, not filled). Checked here
        (`ValueError` naming the argument, `OutOfPagesError`); then write the pages the `Reservation`
        names and `commit()` or `abort()` it. Until then every change to the manager raises `RuntimeError`.
        """
        self._check_unlocked()
        ids = list(seq_ids)
        self.check_new_ids(ids)
        limits = (self.page_size, self.collection.max_seq_len, self.enable_prefix_caching)
        request = Incoming.check(ids, cache_lengths, page_rows, token_ids, prefix_keys, *limits)
        self._reservation = Reservation(self.page_pool, request, self._add_reserved)
        return self._reservation

    # -- steps ---------------------------------------------------------------------------------
    def prepare_step(
        self, seq_ids: Sequence, num_new_tokens: Sequence[int], token_ids: Sequence[Sequence[int]] | None = None
    ) -> StepTensors:
        """Reserve pages for this step's new tokens and fill the step tensors; row b is `seq_ids[b]`.

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
        new_lengths = table.lengths[slots] + num_new
        longest = check_lengths(new_lengths, ids, self.collection.max_seq_len)
        missing = table.pages_for(new_lengths) - table.num_pages[slots]
        grow = np.flatnonzero(missing > 0)
        if grow.size:
            needed = int(missing[grow].sum())
            self.page_pool.require(needed)
            table.extend(slots[grow], missing[grow], self.page_pool.allocate(needed))
        if flat_ids is not None and self.enable_prefix_caching:
            table.reserve_tokens(longest)  # room for this step's ids
        table.upload(slots, num_new, None if rows_kept is None else grow, same_offsets=counts_kept is not None)
        if counts_kept is None:
            counts = list(num_new_tokens) if type(num_new_tokens) is list else None
            self._uploaded = UploadedRows(ids, seqs, slots, counts, num_new)
        elif rows_kept is None:
            self._uploaded = counts_kept._replace(ids=ids, seqs=seqs, slots=slots)
        self._pending = PreparedStep(seqs, slots, num_new, new_lengths, flat_ids)
        return table.step_tensors(batch)

    def commit_step(self) -> None:
        """After the model ran the prepared step: advance lengths, cache newly full pages."""
        self._check_unlocked()
        step = self._pending
        if step is None:
            raise RuntimeError("commit_step: no prepared step (call prepare_step first)")
        self._pending = None
        table = self.page_table
        old_lengths = table.lengths[step.slots]
        table.lengths[step.slots] = step.new_lengths
        if not self.enable_prefix_caching:
            return
        known = table.known[step.slots]
        if step.token_ids is not None:
            known = table.append_tokens(step.slots, old_lengths, step.new_lengths, step.num_new, step.token_ids)
        full = step.new_lengths // self.page_size
        end = full * self.page_size  # a row whose last full page ends past its old length crossed into it
        crossed = np.flatnonzero((end > old_lengths) & (known >= end)).tolist()
        if crossed:
            seqs = [step.seqs[b] for b in crossed]
            cache_full_pages(self.page_pool, table, self._root, seqs, full[crossed].tolist())

    # -- offload -------------------------------------------------------------------------------
    def offload(self, seq_ids: Sequence) -> None:
        """Move sequences' pages to CPU memory (pinned when the pool is on a GPU) and free them."""
        self._check_unlocked()
        seqs = self._resolve(list(seq_ids), step=False)[0]
        table = self.page_table
        for seq in seqs:
            used = table.pages(seq.slot)[: table.pages_for(int(table.lengths[seq.slot]))]
            seq.host_pages = host.read_pages(self.collection, used)
            self.page_pool.unref(reversed(table.pages(seq.slot)))
            table.set_pages(seq.slot, [])
        self._uploaded = None  # their table rows changed

    def restore(self, seq_ids: Sequence) -> None:
        """Bring offloaded sequences back, contents identical (all or nothing): full pages still in
        the prefix cache are shared again, the others copied into fresh pages."""
        self._check_unlocked()
        ids = list(seq_ids)
        check_unique(ids, "seq_ids")
        seqs = [self._seqs.get(i, "seq_ids") for i in ids]
        copies = []
        for seq in seqs:
            if seq.host_pages is None:
                raise ValueError(f"seq_ids: sequence {seq.seq_id!r} is not offloaded")
            copies.append((seq.host_pages, seq.keys))
        for seq, pages in zip(seqs, host.restore_pages(self.page_pool, self.collection, copies), strict=True):
            seq.host_pages = None
            self.page_table.set_pages(seq.slot, pages)

    # -- helpers -------------------------------------------------------------------------------
    def _check_unlocked(self) -> None:
        reservation = self._reservation
        if reservation is not None and reservation.open:
            raise RuntimeError("KVCacheManager: a reservation is open (reserve); commit or abort it first")

    def _resolve(self, ids: list, step: bool = True) -> tuple[list[SequenceState], np.ndarray]:
        """Sequences and slots of `ids`: the rows of a step, or sequences not in the prepared step."""
        prepared = () if self._pending is None else self._pending.seqs
        seqs = self._seqs.resolve(ids, prepared, self.collection.max_batch_size if step else None)
        return seqs, np.array([seq.slot for seq in seqs], dtype=np.int64)

    def _add(
        self, seq_id: Hashable, pages: list[int], length: int, tokens: np.ndarray | None, keys: list[bytes]
    ) -> SequenceState:
        return self._seqs.add(seq_id, self.page_table.add(pages, length, tokens), keys)

    def _add_reserved(self, request: Incoming, rows: list[list[int]]) -> None:
        """A reservation's commit: register its sequences in `rows`' pages and key their full pages."""
        r = request
        seqs = [
            self._add(seq_id, pages, length, tokens, list(keys))
            for seq_id, pages, length, tokens, keys in zip(r.seq_ids, rows, r.lengths, r.tokens, r.keys, strict=True)
        ]
        known = [min(n, int(self.page_table.known[s.slot])) for s, n in zip(seqs, r.lengths, strict=True)]
        cache_full_pages(self.page_pool, self.page_table, self._root, seqs, [n // self.page_size for n in known])
