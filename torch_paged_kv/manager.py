"""`KVCacheManager`: sequences, page allocation, prefix caching, fork, offload and KV checkpoints.

The manager owns a `PagedKVCacheCollection`'s step tensors: `prepare_step` fills their first
rows in place for the sequences of one step, the model runs, `commit_step` advances the lengths.
Host bookkeeping lives in int64 numpy arrays indexed by a per-sequence slot (lengths, page
tables, known token ids) plus a list of prefix-cache keys per sequence, so a decode step costs a
few vectorised numpy operations, one sha256 per page that fills, and one device copy of the
lengths; table rows are re-sent only when a row gains pages or the rows change sequence.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import os
from array import array
from collections.abc import Hashable, Iterable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from . import checkpoint, layout
from .collection import PagedKVCacheCollection, StepTensors
from .ops import copy_pages
from .prefix_cache import TOKEN_DTYPE, PagePool, page_key, page_key_of_bytes, root_key

METADATA_KEY = "torch_paged_kv.manager"
"""Checkpoint user-metadata key holding the saved sequences' token ids (JSON)."""


class OutOfPagesError(RuntimeError):
    """Not enough free or evictable pages; the manager was left unchanged."""

    def __init__(self, needed: int, free: int, evictable: int) -> None:
        super().__init__(f"out of KV pages: {needed} needed, {free} free, {evictable} evictable")
        self.needed, self.free, self.evictable = needed, free, evictable


@dataclasses.dataclass(eq=False)
class _Sequence:
    seq_id: Hashable
    slot: int
    keys: list[bytes]  # prefix-cache keys of the leading full pages
    host_pages: torch.Tensor | None = None  # page contents while offloaded


class _Step(NamedTuple):
    seqs: list[_Sequence]
    slots: np.ndarray
    num_new: np.ndarray
    new_lengths: np.ndarray
    token_ids: np.ndarray | None  # the rows' new token ids, concatenated


def _int64s(name: str, tokens: Iterable[int]) -> np.ndarray:
    """`tokens` as an int64 array; anything but ints (floats, strings) raises ValueError naming `name`."""
    try:
        return np.frombuffer(array("q", tokens), dtype=np.int64)
    except (TypeError, OverflowError) as exc:
        raise ValueError(f"{name}: expected a sequence of int token ids ({exc})") from None


class KVCacheManager:
    """Pages of one `PagedKVCacheCollection` for sequences named by any hashable id.

    Prefix caching (on by default) keys every full page by a sha256 chained over its parent's
    key and its token ids (plus `hash_salt`); `claim` reuses the longest cached prefix. The
    counters `prefix_cache_hits` / `prefix_cache_misses` count prompt *tokens* given to `claim`
    that were reused / must be computed.
    """

    def __init__(
        self, collection: PagedKVCacheCollection, enable_prefix_caching: bool = True, hash_salt: bytes | None = None
    ) -> None:
        if not isinstance(collection, PagedKVCacheCollection):
            raise ValueError(f"collection: expected a PagedKVCacheCollection, got {type(collection).__name__}")
        if hash_salt is not None and not isinstance(hash_salt, bytes):
            raise ValueError(f"hash_salt: expected bytes or None, got {type(hash_salt).__name__}")
        self.collection = collection
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.page_size = collection.params.page_size
        self.prefix_cache_hits = 0
        self.prefix_cache_misses = 0
        self._root = root_key(hash_salt)
        self._pool = PagePool(collection.num_pages)
        self._seqs: dict[Hashable, _Sequence] = {}
        # Per-slot host state; a slot is a sequence's row in these arrays.
        self._lengths = np.zeros(0, dtype=np.int64)
        self._num_pages = np.zeros(0, dtype=np.int64)
        self._known = np.zeros(0, dtype=np.int64)  # token ids known from position 0; -1: unknown
        self._tokens = np.zeros((0, 0), dtype=TOKEN_DTYPE)  # [slot, :known]: the ids (columns double)
        self._table = np.zeros((0, collection.lookup_table.shape[1]), dtype=np.int32)
        self._free_slots: list[int] = []
        self._grow_slots(collection.max_batch_size)
        # What the device rows hold: the ids/sequences/slots of the last prepared step.
        self._rows_ids: list | None = None
        self._rows_seqs: list[_Sequence] = []
        self._rows_slots = np.zeros(0, dtype=np.int64)
        self._rows_num_new_list: list | None = None
        self._rows_num_new: np.ndarray | None = None
        self._pending: _Step | None = None
        self._step_views: dict[int, StepTensors] = {}
        self._next_loaded_id = 0
        on_cpu = collection.device.type == "cpu"
        self._host_views = (
            (collection.cache_lengths.numpy(), collection.lookup_table.numpy(), collection.input_row_offsets.numpy())
            if on_cpu
            else None
        )

    # -- queries -------------------------------------------------------------------------------
    @property
    def sequences(self) -> list:
        """Ids of the claimed sequences (offloaded ones included), in claim order."""
        return list(self._seqs)

    def cache_length(self, seq_id: Hashable) -> int:
        """Tokens cached for `seq_id` (committed steps only)."""
        return int(self._lengths[self._get(seq_id, "seq_id").slot])

    def num_free_pages(self) -> int:
        """Pages an allocation can use now: unused pages plus evictable cached pages."""
        return self._pool.available()

    def num_cached_pages(self) -> int:
        """Pages in the prefix cache (referenced or evictable)."""
        return len(self._pool.key_of)

    def is_offloaded(self, seq_id: Hashable) -> bool:
        return self._get(seq_id, "seq_id").host_pages is not None

    # -- sequences -----------------------------------------------------------------------------
    def claim(self, seq_id: Hashable, prompt_tokens: Sequence[int] | None = None) -> int:
        """Start a sequence; returns the prompt tokens reused from the prefix cache (its length).

        Only whole pages are reused and at least one prompt token is left to compute. The prompt
        is remembered, so steps that compute it need no `token_ids`.
        """
        self._check_new_id(seq_id, "seq_id")
        prompt = _int64s("prompt_tokens", () if prompt_tokens is None else prompt_tokens)
        if len(prompt) > self.collection.max_seq_len:
            raise ValueError(f"prompt_tokens: {len(prompt)} tokens exceed max_seq_len={self.collection.max_seq_len}")
        pages: list[int] = []
        keys: list[bytes] = []
        if self.enable_prefix_caching and prompt_tokens is not None:
            ps, parent = self.page_size, self._root
            for i in range((len(prompt) - 1) // ps):
                key = page_key(parent, prompt[i * ps : (i + 1) * ps])
                page = self._pool.lookup(key)
                if page is None:
                    break
                pages.append(page)
                keys.append(key)
                parent = key
            for page in pages:
                self._pool.ref(page)
            self.prefix_cache_hits += len(pages) * ps
            self.prefix_cache_misses += len(prompt) - len(pages) * ps
        tokens = prompt if self.enable_prefix_caching else None
        self._add(seq_id, pages, len(pages) * self.page_size, tokens, keys)
        return len(pages) * self.page_size

    def release(self, seq_id: Hashable) -> None:
        """Forget a sequence; its pages return to the pool (cached ones stay cached, LRU last page first)."""
        seq = self._get(seq_id, "seq_id")
        del self._seqs[seq_id]
        self._drop_pages(seq)
        self._free_slots.append(seq.slot)  # its lengths are overwritten when the slot is reused
        if self._pending is not None and seq in self._pending.seqs:
            p = self._pending
            keep = np.array([s is not seq for s in p.seqs])
            self._pending = _Step(
                [s for s in p.seqs if s is not seq],
                p.slots[keep],
                p.num_new[keep],
                p.new_lengths[keep],
                None if p.token_ids is None else p.token_ids[np.repeat(keep, p.num_new)],
            )
        self._rows_ids = None

    def fork(self, parent: Hashable, child: Hashable) -> None:
        """New sequence `child` with `parent`'s cache: full pages shared, a partial last page copied."""
        src = self._get_on_device(parent, "parent")
        self._check_new_id(child, "child")
        length = int(self._lengths[src.slot])
        full = length // self.page_size
        partial = length % self.page_size != 0
        self._require_pages(int(partial))
        src_pages = self._pages(src)
        pages = src_pages[:full]
        for page in pages:
            self._pool.ref(page)
        if partial:
            pages += self._pool.allocate(1)
            self._copy_pages([src_pages[full]], pages[-1:])
        known = int(self._known[src.slot])
        tokens = self._tokens[src.slot, : min(known, length)] if known >= 0 else None
        self._add(child, pages, length, tokens, src.keys[:full])

    # -- steps ---------------------------------------------------------------------------------
    def prepare_step(
        self, seq_ids: Sequence, num_new_tokens: Sequence[int], token_ids: Sequence[Sequence[int]] | None = None
    ) -> StepTensors:
        """Reserve pages for this step's new tokens and fill the step tensors; row b is `seq_ids[b]`.

        `token_ids[b]` (optional) are the ids of row b's new tokens, for the prefix cache.
        All or nothing: on any error (`OutOfPagesError` included) nothing changed. A prepared
        step not yet committed is abandoned by the next `prepare_step` (its pages stay reserved).
        """
        ids = list(seq_ids)
        if ids == self._rows_ids:
            seqs, slots = self._rows_seqs, self._rows_slots
        else:
            seqs, slots = self._resolve(ids)
        batch = len(ids)
        num_new_list = num_new_tokens if type(num_new_tokens) is list else None
        if num_new_list is not None and len(num_new_list) == batch and num_new_list == self._rows_num_new_list:
            num_new = self._rows_num_new  # same counts as the last step: already validated
        else:
            num_new = self._check_num_new(num_new_tokens, batch)
            num_new_list = None if num_new_list is None else list(num_new_list)
        flat_ids = None if token_ids is None else self._check_token_ids(token_ids, num_new)
        old_lengths = self._lengths[slots]
        new_lengths = old_lengths + num_new
        longest = int(new_lengths.max())
        if longest > self.collection.max_seq_len:
            b = int(new_lengths.argmax())
            raise ValueError(
                f"num_new_tokens: sequence {ids[b]!r} would reach {longest} tokens, "
                f"past max_seq_len={self.collection.max_seq_len}"
            )
        missing = (new_lengths + (self.page_size - 1)) // self.page_size - self._num_pages[slots]
        grow = np.flatnonzero(missing > 0)
        if grow.size:
            needed = int(missing[grow].sum())
            self._require_pages(needed)
            self._extend_pages(slots[grow], missing[grow], needed)
        if flat_ids is not None and self.enable_prefix_caching:
            self._reserve_tokens(longest)  # room for this step's ids
        self._upload(batch, seqs is self._rows_seqs, grow, slots, old_lengths, num_new)
        self._rows_ids, self._rows_seqs, self._rows_slots = ids, seqs, slots
        self._rows_num_new_list, self._rows_num_new = num_new_list, num_new
        self._pending = _Step(seqs, slots, num_new, new_lengths, flat_ids)
        views = self._step_views.get(batch)
        if views is None:
            views = self._step_views[batch] = self.collection.step_tensors(batch)
        return views

    def commit_step(self) -> None:
        """After the model ran the prepared step: advance lengths, cache newly full pages."""
        step = self._pending
        if step is None:
            raise RuntimeError("commit_step: no prepared step (call prepare_step first)")
        self._pending = None
        old_lengths = self._lengths[step.slots]
        self._lengths[step.slots] = step.new_lengths
        if not self.enable_prefix_caching:
            return
        known = self._known[step.slots]
        if step.token_ids is not None:
            known = self._append_tokens(step, old_lengths, known)
        full = step.new_lengths // self.page_size
        end = full * self.page_size  # a row whose last full page ends past its old length crossed into it
        crossed = np.flatnonzero((end > old_lengths) & (known >= end)).tolist()
        if crossed:
            self._register_full_pages([step.seqs[b] for b in crossed], full[crossed].tolist())

    # -- offload -------------------------------------------------------------------------------
    def offload(self, seq_ids: Sequence) -> None:
        """Move sequences' pages to CPU memory (pinned when the pool is on a GPU) and free them."""
        seqs = self._resolve(list(seq_ids), name="seq_ids", limit_batch=False)[0]
        blocks = self.collection.blocks
        for seq in seqs:
            used = self._pages(seq)[: self._pages_for(int(self._lengths[seq.slot]))]
            host = torch.empty((len(used), *blocks.shape[1:]), dtype=blocks.dtype, pin_memory=blocks.is_cuda)
            host.copy_(blocks[torch.tensor(used, dtype=torch.long, device=blocks.device)])
            self._drop_pages(seq)
            seq.host_pages = host
        self._rows_ids = None

    def restore(self, seq_ids: Sequence) -> None:
        """Bring offloaded sequences back, contents identical (all or nothing): full pages still in
        the prefix cache are shared again, the others copied into fresh pages."""
        ids = list(seq_ids)
        self._check_unique(ids, "seq_ids")
        seqs = [self._get(i, "seq_ids") for i in ids]
        for seq in seqs:
            if seq.host_pages is None:
                raise ValueError(f"seq_ids: sequence {seq.seq_id!r} is not offloaded")
        # A full page still in the prefix cache (its key) is shared again, not copied back.
        cached = [[self._pool.lookup(key) for key in seq.keys] for seq in seqs]
        missing = sum(
            seq.host_pages.shape[0] - len(hits) + hits.count(None) for seq, hits in zip(seqs, cached, strict=True)
        )
        revived = {page for hits in cached for page in hits if page is not None and self._pool.refcounts[page] == 0}
        self._require_pages(missing + len(revived))  # a revived cached page leaves the evictable ones
        for hits in cached:
            for page in hits:
                if page is not None:
                    self._pool.ref(page)
        for seq, hits in zip(seqs, cached, strict=True):
            host, seq.host_pages = seq.host_pages, None
            hits += [None] * (host.shape[0] - len(hits))
            todo = [i for i, page in enumerate(hits) if page is None]
            fresh = self._pool.allocate(len(todo))
            self._write_pages(fresh, host[todo])
            for i, page in zip(todo, fresh, strict=True):
                hits[i] = page
            self._set_pages(seq.slot, hits)
            for page, key in zip(hits[: len(seq.keys)], seq.keys, strict=True):  # keyed: the leading full pages
                self._pool.register(page, key)

    # -- checkpoints ---------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str], seq_ids: Sequence) -> None:
        """Save sequences (on device, not in a prepared step) with `checkpoint.save_cache`.

        Row i of the file is `seq_ids[i]`; pages they share are stored once. Token ids known
        for prefix caching go into the checkpoint's metadata. The live step tensors are untouched.
        """
        seqs = self._resolve(list(seq_ids), name="seq_ids", limit_batch=False)[0]
        if not seqs:
            raise ValueError("seq_ids: nothing to save (empty)")
        view = copy.copy(self.collection)  # shares `blocks`; gets step tensors of its own below
        view.max_batch_size = len(seqs)
        view.cache_lengths = torch.tensor([int(self._lengths[s.slot]) for s in seqs], dtype=torch.int32)
        view.lookup_table = torch.from_numpy(self._table[[s.slot for s in seqs]])
        meta = {"token_ids": [self._token_ids(s) for s in seqs]}
        checkpoint.save_cache(view, path, metadata={METADATA_KEY: json.dumps(meta)})

    def load(self, path: str | os.PathLike[str], seq_ids: Sequence | None = None) -> list:
        """Add the sequences of a checkpoint to this live cache, in free pages; returns their ids.

        Ids are `seq_ids` if given, else fresh `("loaded", n)` tuples. All or nothing: a checkpoint
        whose params or kind do not match raises `checkpoint.CheckpointError`, too few pages
        `OutOfPagesError`, and the manager is unchanged. Pages stream straight into the pool
        (`checkpoint.load_pages`); a checksum error found on the way also raises `CheckpointError`
        and frees them again, but prefix-cache entries evicted to make room stay evicted.
        """
        info = checkpoint.read_info(path)
        params, c = self.collection.params, self.collection
        if info.kind != checkpoint.PAGED or info.params != params:
            raise checkpoint.CheckpointError(
                f"{path}: a {info.kind} cache of {info.params} does not fit this paged cache of {params}"
            )
        if max(info.cache_lengths) > c.max_seq_len:
            raise checkpoint.CheckpointError(
                f"{path}: a sequence of {max(info.cache_lengths)} tokens exceeds max_seq_len={c.max_seq_len}"
            )
        batch = len(info.cache_lengths)
        ids = self._new_ids(batch) if seq_ids is None else list(seq_ids)
        if len(ids) != batch:
            raise ValueError(f"seq_ids: the checkpoint holds {batch} sequences, got {len(ids)} ids")
        self._check_unique(ids, "seq_ids")
        for i in ids:
            self._check_new_id(i, "seq_ids")
        self._require_pages(info.num_pages)
        tokens = json.loads(info.user_metadata.get(METADATA_KEY, "{}")).get("token_ids", [None] * batch)
        tokens = [
            None if t is None or not self.enable_prefix_caching else _int64s(f"{path}: token_ids", t) for t in tokens
        ]
        new_pages = self._pool.allocate(info.num_pages)
        try:  # streamed straight into the pool, through bounded host buffers
            checkpoint.load_pages(path, c.blocks, new_pages)
        except BaseException:
            self._pool.unref(new_pages[::-1])  # back to free, in their old order; evicted cache entries stay evicted
            raise
        pages = [layout.NULL_PAGE, *new_pages]  # checkpoint page j -> pages[j]
        seen: set[int] = set()
        for b, (seq_id, per_row) in enumerate(zip(ids, info.pages_per_row(), strict=True)):
            length = info.cache_lengths[b]
            row = [pages[j] for j in info.lookup_table[b, :per_row].tolist()]
            for page in row:
                if page in seen:  # shared in the checkpoint: one more owner
                    self._pool.ref(page)
                seen.add(page)
            self._add(seq_id, row, length, tokens[b], [])
        seqs = [self._seqs[i] for i in ids]
        self._register_full_pages(
            seqs,
            [min(n, int(self._known[s.slot])) // self.page_size for s, n in zip(seqs, info.cache_lengths, strict=True)],
        )
        if seq_ids is None:
            self._next_loaded_id = ids[-1][1] + 1
        return ids

    # -- helpers -------------------------------------------------------------------------------
    def _get(self, seq_id: Hashable, name: str) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):
            raise ValueError(f"{name}: unknown sequence {seq_id!r}") from None

    def _get_on_device(self, seq_id: Hashable, name: str) -> _Sequence:
        seq = self._get(seq_id, name)
        if seq.host_pages is not None:
            raise ValueError(f"{name}: sequence {seq_id!r} is offloaded; restore it first")
        if self._pending is not None and seq in self._pending.seqs:
            raise ValueError(f"{name}: sequence {seq_id!r} is in the prepared step; commit_step first")
        return seq

    def _check_new_id(self, seq_id: Hashable, name: str) -> None:
        try:
            taken = seq_id in self._seqs
        except TypeError:
            raise ValueError(f"{name}: sequence ids must be hashable, got {type(seq_id).__name__}") from None
        if taken:
            raise ValueError(f"{name}: sequence {seq_id!r} already exists")

    def _new_ids(self, count: int) -> list:
        """`count` unused ids `("loaded", n)`, counting on from the last load."""
        ids: list = []
        n = self._next_loaded_id
        while len(ids) < count:
            if ("loaded", n) not in self._seqs:
                ids.append(("loaded", n))
            n += 1
        return ids

    @staticmethod
    def _check_unique(ids: list, name: str) -> None:
        try:
            unique = len(set(ids)) == len(ids)
        except TypeError:
            raise ValueError(f"{name}: sequence ids must be hashable") from None
        if not unique:
            raise ValueError(f"{name}: lists a sequence more than once")

    def _resolve(
        self, ids: list, name: str = "seq_ids", limit_batch: bool = True
    ) -> tuple[list[_Sequence], np.ndarray]:
        """Sequences (on device, not pending unless this is a step) and slots of `ids`, validated."""
        if limit_batch and not 0 < len(ids) <= self.collection.max_batch_size:
            raise ValueError(
                f"{name}: expected 1..{self.collection.max_batch_size} sequences (max_batch_size), got {len(ids)}"
            )
        self._check_unique(ids, name)
        if limit_batch:  # a step may re-prepare sequences of an abandoned step
            seqs = [self._get(i, name) for i in ids]
            for seq in seqs:
                if seq.host_pages is not None:
                    raise ValueError(f"{name}: sequence {seq.seq_id!r} is offloaded; restore it first")
        else:
            seqs = [self._get_on_device(i, name) for i in ids]
        return seqs, np.array([seq.slot for seq in seqs], dtype=np.int64)

    @staticmethod
    def _check_num_new(num_new_tokens: Sequence[int], batch: int) -> np.ndarray:
        num_new = np.asarray(num_new_tokens)
        if num_new.shape != (batch,) or num_new.dtype.kind not in "iu":
            raise ValueError(f"num_new_tokens: expected {batch} ints (one per sequence), got {num_new_tokens!r}")
        if num_new.min() < 1:
            raise ValueError(f"num_new_tokens: every sequence needs >= 1 new token, got {num_new.min()}")
        return num_new.astype(np.int64, copy=False)

    @staticmethod
    def _check_token_ids(token_ids: Sequence[Sequence[int]], num_new: np.ndarray) -> np.ndarray:
        """The rows' ids concatenated, after checking their counts and types."""
        if int(num_new.sum()) == len(num_new):  # one id per row (decode): unpacking checks the counts
            try:
                flat = [x for (x,) in token_ids]
            except (TypeError, ValueError):
                flat = None
            if flat is not None and len(flat) == len(num_new):
                return _int64s("token_ids", flat)
        try:
            counts = list(map(len, token_ids))
        except TypeError:
            raise ValueError("token_ids: expected one sequence of ints per row") from None
        if counts != num_new.tolist():
            raise ValueError(f"token_ids: expected {num_new.tolist()} ids per row, got {counts}")
        return _int64s("token_ids", itertools.chain.from_iterable(token_ids))

    def _pages_for(self, length: int) -> int:
        return -(-length // self.page_size)

    def _require_pages(self, needed: int) -> None:
        """`OutOfPagesError` unless an allocation of `needed` pages can succeed now."""
        if needed > self._pool.available():
            raise OutOfPagesError(needed, len(self._pool.free), len(self._pool.evictable))

    def _grow_slots(self, extra: int) -> None:
        start = len(self._lengths)
        zeros = np.zeros(extra, dtype=np.int64)
        self._lengths = np.concatenate([self._lengths, zeros])
        self._num_pages = np.concatenate([self._num_pages, zeros])
        self._known = np.concatenate([self._known, zeros])
        self._tokens = np.concatenate([self._tokens, np.zeros((extra, self._tokens.shape[1]), dtype=TOKEN_DTYPE)])
        pad = np.full((extra, self._table.shape[1]), layout.NULL_PAGE, dtype=np.int32)
        self._table = np.concatenate([self._table, pad])
        self._free_slots.extend(range(start + extra - 1, start - 1, -1))

    def _add(
        self, seq_id: Hashable, pages: list[int], length: int, tokens: np.ndarray | None, keys: list[bytes]
    ) -> None:
        if not self._free_slots:
            self._grow_slots(len(self._lengths))
        slot = self._free_slots.pop()
        self._lengths[slot] = length
        if tokens is None:
            self._known[slot] = -1
        else:
            self._reserve_tokens(len(tokens))
            self._tokens[slot, : len(tokens)] = tokens
            self._known[slot] = len(tokens)
        self._set_pages(slot, pages)
        self._seqs[seq_id] = _Sequence(seq_id, slot, keys)

    def _reserve_tokens(self, length: int) -> None:
        """Room for `length` token ids per slot: whole pages, doubling until they fit."""
        capacity = self._tokens.shape[1]
        if length > capacity:
            doubled = min(2 * capacity // self.page_size, self.collection.max_pages_per_sequence)
            pages = max(self._pages_for(length), doubled)
            grown = np.zeros((len(self._tokens), pages * self.page_size), dtype=TOKEN_DTYPE)
            grown[:, :capacity] = self._tokens
            self._tokens = grown

    def _token_ids(self, seq: _Sequence) -> list[int] | None:
        """Known token ids of `seq` from position 0 (may run past its length: the prompt), or None."""
        known = int(self._known[seq.slot])
        return self._tokens[seq.slot, :known].tolist() if known >= 0 else None

    def _append_tokens(self, step: _Step, old_lengths: np.ndarray, known: np.ndarray) -> np.ndarray:
        """Store the committed step's token ids; returns the rows' new known counts.

        A row whose ids are known up to its old length gets the new ids written there (over the
        rest of a remembered prompt: they are what ran); any other row stops caching pages (-1).
        """
        ok = known >= old_lengths
        rows, cols, ids = step.slots, old_lengths, step.token_ids
        if len(ids) != len(rows):  # some row has several new tokens: one (row, col) per id
            starts = np.cumsum(step.num_new) - step.num_new
            cols = np.repeat(old_lengths - starts, step.num_new) + np.arange(len(ids))
            rows = np.repeat(rows, step.num_new)
        if ok.all():
            known = step.new_lengths
        else:
            select = np.repeat(ok, step.num_new)
            rows, cols, ids = rows[select], cols[select], ids[select]
            known = np.where(ok, step.new_lengths, -1)
        self._tokens[rows, cols] = ids  # prepare_step made room
        self._known[step.slots] = known
        return known

    def _pages(self, seq: _Sequence) -> list[int]:
        """Physical pages of `seq`, in order (its table row is the only record of them)."""
        return self._table[seq.slot, : self._num_pages[seq.slot]].tolist()

    def _set_pages(self, slot: int, pages: list[int]) -> None:
        self._table[slot, : len(pages)] = pages
        self._num_pages[slot] = len(pages)

    def _extend_pages(self, slots: np.ndarray, counts: np.ndarray, total: int) -> None:
        """Allocate `counts[i]` more pages for each slot (vectorised when each needs one)."""
        pages = self._pool.allocate(total)
        if total == len(slots):
            self._table[slots, self._num_pages[slots]] = pages
            self._num_pages[slots] += 1
            return
        i = 0
        for slot, count in zip(slots.tolist(), counts.tolist(), strict=True):
            start = int(self._num_pages[slot])
            self._table[slot, start : start + count] = pages[i : i + count]
            self._num_pages[slot] = start + count
            i += count

    def _drop_pages(self, seq: _Sequence) -> None:
        """Unreference all of `seq`'s pages, last first (so LRU evicts tails before heads)."""
        self._pool.unref(reversed(self._pages(seq)))
        self._table[seq.slot, : self._num_pages[seq.slot]] = layout.NULL_PAGE
        self._num_pages[seq.slot] = 0

    def _register_full_pages(self, seqs: list[_Sequence], num_full: Sequence[int]) -> None:
        """Cache the pages of `seqs[i]` below page `num_full[i]` not yet keyed (their ids are known)."""
        ps, width, root, register = self.page_size, 8 * self.page_size, self._root, self._pool.register
        todo = [(seq, i) for seq, n in zip(seqs, num_full, strict=True) for i in range(len(seq.keys), n)]
        if not todo:
            return
        slots, index = [seq.slot for seq, _ in todo], [i for _, i in todo]
        data = self._tokens.reshape(len(self._tokens), -1, ps)[slots, index].tobytes()  # one page a row
        for (seq, _), page, start in zip(
            todo, self._table[slots, index].tolist(), range(0, len(data), width), strict=True
        ):
            keys = seq.keys  # a sequence's pages come in order: each chains over the one before
            key = page_key_of_bytes(keys[-1] if keys else root, data[start : start + width])
            keys.append(key)
            register(page, key)

    def _copy_pages(self, src: list[int], dst: list[int]) -> None:
        device = self.collection.device
        copy_pages(
            self.collection.blocks,
            torch.tensor(src, dtype=torch.int32, device=device),
            torch.tensor(dst, dtype=torch.int32, device=device),
        )

    def _write_pages(self, pages: list[int], contents: torch.Tensor) -> None:
        blocks = self.collection.blocks
        index = torch.tensor(pages, dtype=torch.long, device=blocks.device)
        blocks.index_copy_(0, index, contents.to(blocks.device))

    def _upload(
        self,
        batch: int,
        same_rows: bool,
        grow: np.ndarray,
        slots: np.ndarray,
        old_lengths: np.ndarray,
        num_new: np.ndarray,
    ) -> None:
        """Write the step into the collection's tensors: lengths, offsets, changed table rows."""
        c = self.collection
        rows = grow if same_rows else slice(0, batch)
        table_same = same_rows and grow.size == 0
        offsets_same = same_rows and num_new is self._rows_num_new
        if self._host_views is not None:
            lengths_np, table_np, offsets_np = self._host_views
            lengths_np[:batch] = old_lengths
            if not table_same:
                table_np[rows] = self._table[slots[rows]]
            if not offsets_same:
                np.cumsum(num_new, out=offsets_np[1 : batch + 1])
            return
        c.cache_lengths[:batch].copy_(torch.from_numpy(old_lengths))
        if not table_same:
            if same_rows:
                c.lookup_table[torch.from_numpy(grow).to(c.device)] = torch.from_numpy(self._table[slots[grow]]).to(
                    c.device
                )
            else:
                c.lookup_table[:batch].copy_(torch.from_numpy(self._table[slots]))
        if not offsets_same:
            c.input_row_offsets[1 : batch + 1].copy_(torch.from_numpy(np.cumsum(num_new)))
