"""`KVCacheManager`: sequences, page allocation, prefix caching, fork, offload and KV checkpoints.

The manager keeps policy: who claims and releases pages, when pages are shared, copied, offloaded,
saved or loaded. State lives in two objects it owns: a `PagePool` (refcounts, free pages, the
prefix cache: page_pool.py) and a `PageTable` (per-sequence slot: lengths, pages, token ids, and
the upload of a step into the collection's step tensors: page_table.py). `prepare_step` fills the
step tensors in place for the sequences of one step, the model runs, `commit_step` advances the
lengths and caches the pages that became full (one sha256 per page that fills).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from array import array
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from . import checkpoint
from .collection import PagedKVCacheCollection, StepTensors
from .ops import copy_pages
from .ops.quant import indexable
from .page_pool import PagePool, root_key
from .page_table import PageTable
from .params import KVCacheParams

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
    host_pages: list[torch.Tensor] | None = None  # while offloaded: the page tensors' contents (page_tensors())


class _Step(NamedTuple):
    seqs: list[_Sequence]
    slots: np.ndarray
    num_new: np.ndarray
    new_lengths: np.ndarray
    token_ids: np.ndarray | None  # the rows' new token ids, concatenated


class _Rows(NamedTuple):
    """What the collection's step tensors hold: the rows of the last prepared step (none after a
    change that may have moved pages: release, offload)."""

    ids: list | None = None
    seqs: Sequence[_Sequence] = ()
    slots: np.ndarray = np.zeros(0, dtype=np.int64)
    num_new_list: list | None = None
    num_new: np.ndarray | None = None


def _int64s(name: str, tokens: Iterable[int]) -> np.ndarray:
    """`tokens` as an int64 array; anything but ints (floats, strings) raises ValueError naming `name`."""
    try:
        return np.frombuffer(array("q", tokens), dtype=np.int64)
    except (TypeError, OverflowError) as exc:
        raise ValueError(f"{name}: expected a sequence of int token ids ({exc})") from None


def _misfit(kind: str, theirs: KVCacheParams, ours: KVCacheParams) -> str:
    """Why a checkpoint of `kind` and params `theirs` does not load into this paged cache of `ours`."""
    if theirs.is_mla != ours.is_mla:
        kinds = {True: "an MLA (latent)", False: "a K/V"}
        return f"{kinds[theirs.is_mla]} cache does not fit this {kinds[ours.is_mla].split(' ', 1)[1]} cache ({theirs})"
    heads = ("num_kv_heads", "tp_size", "tp_rank", "kv_head_start", "total_kv_heads")
    try:
        other_heads = dataclasses.replace(theirs, **{f: getattr(ours, f) for f in heads}) == ours
    except ValueError:
        other_heads = False
    hint = " (a shard of other KV heads: see torch_paged_kv.distributed.reshard.load_sharded)" * other_heads
    return f"a {kind} cache of {theirs} does not fit this paged cache of {ours}{hint}"


def saved_token_ids(path: str | os.PathLike[str], info: checkpoint.CheckpointInfo, max_len: int) -> list:
    """The token ids `save` stored with each sequence of `info` (None where it had none), checked."""
    text = info.user_metadata.get(METADATA_KEY)
    batch = len(info.cache_lengths)
    if text is None:
        return [None] * batch

    def bad(what: str) -> checkpoint.CheckpointError:
        return checkpoint.CheckpointError(f"{path}: user metadata {METADATA_KEY!r}: {what}")

    try:
        payload = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise bad(f"not JSON ({exc})") from None
    if not isinstance(payload, dict):
        raise bad(f"expected a JSON object, got {type(payload).__name__}")
    rows = payload.get("token_ids", [None] * batch)
    if not isinstance(rows, list) or len(rows) != batch:
        got = f"{len(rows)} rows of token ids" if isinstance(rows, list) else type(rows).__name__
        raise bad(f"'token_ids': the file holds {batch} sequences, {got}")
    tokens = []
    for b, row in enumerate(rows):
        ok = row is None or (isinstance(row, list) and len(row) <= max_len and all(type(t) is int for t in row))
        try:
            tokens.append(None if row is None or not ok else _int64s("token_ids", row))
        except ValueError:
            ok = False
        if not ok:
            raise bad(f"'token_ids' row {b}: expected null or at most {max_len} int64 ids")
    return tokens


class KVCacheManager:
    """Pages of one `PagedKVCacheCollection` for sequences named by any hashable id.

    Prefix caching (on by default) keys every full page by a sha256 chained over its parent's
    key and its token ids (plus `hash_salt`); `claim` reuses the longest cached prefix. The
    counters `prefix_cache_hits` / `prefix_cache_misses` count prompt *tokens* given to `claim`
    that were reused / must be computed. `page_pool` and `page_table` are the state it owns
    (read them; change them only through the manager).
    """

    def __init__(
        self, collection: PagedKVCacheCollection, enable_prefix_caching: bool = True, hash_salt: bytes | None = None
    ) -> None:
        if not isinstance(collection, PagedKVCacheCollection):
            raise ValueError(f"collection: expected a PagedKVCacheCollection, got {type(collection).__name__}")
        if hash_salt is not None and not isinstance(hash_salt, bytes):
            raise ValueError(f"hash_salt: expected bytes or None, got {type(hash_salt).__name__}")
        self.collection = collection
        checkpoint.mark_driven(collection, "KVCacheManager.save(path, seq_ids)")
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.page_size = collection.params.page_size
        self.prefix_cache_hits = 0
        self.prefix_cache_misses = 0
        self.page_pool = PagePool(collection.num_pages)
        self.page_table = PageTable(collection)
        self._root = root_key(hash_salt)
        self._seqs: dict[Hashable, _Sequence] = {}
        self._pending: _Step | None = None
        self._rows = _Rows()  # what the device rows hold: the last prepared step
        self._next_loaded_id = 0

    # -- queries -------------------------------------------------------------------------------
    @property
    def sequences(self) -> list:
        """Ids of the claimed sequences (offloaded ones included), in claim order."""
        return list(self._seqs)

    def cache_length(self, seq_id: Hashable) -> int:
        """Tokens cached for `seq_id` (committed steps only)."""
        return int(self.page_table.lengths[self._get(seq_id, "seq_id").slot])

    def pages(self, seq_id: Hashable) -> list[int]:
        """Physical pages of `seq_id` in order (empty while it is offloaded)."""
        return self.page_table.pages(self._get(seq_id, "seq_id").slot)

    def token_ids(self, seq_id: Hashable) -> list[int] | None:
        """Token ids of `seq_id` known from position 0 (a claimed prompt may run past its length), or None."""
        return self.page_table.token_ids(self._get(seq_id, "seq_id").slot)

    def prefix_keys(self, seq_id: Hashable) -> list[bytes]:
        """Prefix-cache keys of `seq_id`'s leading full pages (chained sha256, see page_pool.py)."""
        return list(self._get(seq_id, "seq_id").keys)

    @property
    def prepared_sequences(self) -> list:
        """Ids of the rows of the prepared step not yet committed (empty when there is none)."""
        return [] if self._pending is None else [s.seq_id for s in self._pending.seqs]

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
        seq = self._get(seq_id, "seq_id")
        del self._seqs[seq_id]
        self.page_pool.unref(reversed(self.page_table.remove(seq.slot)))
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
        self._rows = _Rows()

    def fork(self, parent: Hashable, child: Hashable) -> None:
        """New sequence `child` with `parent`'s cache: full pages shared, a partial last page copied."""
        src = self._get_on_device(parent, "parent")
        self._check_new_id(child, "child")
        table = self.page_table
        length = int(table.lengths[src.slot])
        full = length // self.page_size
        partial = length % self.page_size != 0
        self._require_pages(int(partial))
        src_pages = table.pages(src.slot)
        pages = src_pages[:full]
        for page in pages:
            self.page_pool.ref(page)
        if partial:
            pages += self.page_pool.allocate(1)
            self._copy_pages([src_pages[full]], pages[-1:])
        known = int(table.known[src.slot])
        tokens = table.tokens[src.slot, : min(known, length)] if known >= 0 else None
        self._add(child, pages, length, tokens, src.keys[:full])

    def adopt(
        self,
        seq_ids: Sequence,
        cache_lengths: Sequence[int],
        page_rows: Sequence[Sequence[int]],
        fill: Callable[[list[int], list[int]], None],
        *,
        token_ids: Sequence[Sequence[int] | None] | None = None,
        prefix_keys: Sequence[Sequence[bytes]] | None = None,
    ) -> list[int]:
        """Add sequences whose pages come from elsewhere (another process, a file), all or nothing.

        Sequence `seq_ids[i]` holds `cache_lengths[i]` tokens in the incoming pages `page_rows[i]`
        (`ceil(length / page_size)` indices into the incoming pages `0..n-1`, each used; rows may
        share full pages). `token_ids[i]` are its known ids from position 0 (or None), for prefix
        caching; `prefix_keys[i]` the keys of its leading full pages, computed with this manager's
        salt: an incoming page whose key is cached here is shared, not filled. Then
        `fill(incoming, pages)` must write incoming page `incoming[j]` into physical page `pages[j]`
        (the pages: free ones first, then cached ones to evict, least recently used first) and
        must not use the manager. Only after it returns are pages taken and the sequences
        registered; returns the incoming pages that were filled.

        On any error nothing changed, except when `fill` raises after writing into cached pages
        this allocation was going to evict: their cache entries are dropped (they are free pages
        now). An exception with an int `pages_written` limits that to the first pages it wrote.
        """
        ids, lengths, rows, tokens, keys = self._check_adopt(seq_ids, cache_lengths, page_rows, token_ids, prefix_keys)
        pool = self.page_pool
        num_incoming = 1 + max((i for row in rows for i in row), default=-1)
        key_of_incoming: dict[int, bytes] = {}
        for row, row_keys in zip(rows, keys, strict=True):
            for i, key in zip(row, row_keys, strict=False):
                if key_of_incoming.setdefault(i, key) != key:
                    raise ValueError(f"prefix_keys: incoming page {i} has two different keys")
        hits = {i: page for i, key in key_of_incoming.items() if (page := pool.lookup(key)) is not None}
        incoming = [i for i in range(num_incoming) if i not in hits]
        revived = sum(1 for page in hits.values() if pool.refcounts[page] == 0)
        self._require_pages(len(incoming) + revived)  # a revived cached page leaves the evictable ones
        pages = pool.peek(len(incoming), keep=set(hits.values()))
        try:
            fill(list(incoming), list(pages))
        except BaseException as exc:
            evicting = pages[min(len(pages), len(pool.free)) :]
            written = getattr(exc, "pages_written", None)
            pool.forget(evicting if not isinstance(written, int) else evicting[: max(0, written - len(pool.free))])
            raise
        pool.take(pages)
        physical = {**hits, **dict(zip(incoming, pages, strict=True))}
        taken = set(pages)
        for seq_id, length, row, seq_tokens, row_keys in zip(ids, lengths, rows, tokens, keys, strict=True):
            row_pages = [physical[i] for i in row]
            for page in row_pages:
                if page in taken:
                    taken.discard(page)  # the first owner holds the refcount `take` gave it
                else:
                    pool.ref(page)
            for page, key in zip(row_pages, row_keys, strict=False):
                pool.register(page, key)
            self._add(seq_id, row_pages, length, seq_tokens, list(row_keys))
        seqs = [self._seqs[i] for i in ids]
        known = [min(n, int(self.page_table.known[s.slot])) for s, n in zip(seqs, lengths, strict=True)]
        self._cache_full_pages(seqs, [n // self.page_size for n in known])
        return incoming

    # -- steps ---------------------------------------------------------------------------------
    def prepare_step(
        self, seq_ids: Sequence, num_new_tokens: Sequence[int], token_ids: Sequence[Sequence[int]] | None = None
    ) -> StepTensors:
        """Reserve pages for this step's new tokens and fill the step tensors; row b is `seq_ids[b]`.

        `token_ids[b]` (optional) are the ids of row b's new tokens, for the prefix cache.
        All or nothing: on any error (`OutOfPagesError` included) nothing changed. A prepared
        step not yet committed is abandoned by the next `prepare_step` (its pages stay reserved).
        """
        table, last = self.page_table, self._rows
        ids = list(seq_ids)
        same_rows = ids == last.ids
        seqs, slots = (last.seqs, last.slots) if same_rows else self._resolve(ids)
        batch = len(ids)
        num_new_list = num_new_tokens if type(num_new_tokens) is list else None
        if (
            num_new_list is not None
            and len(num_new_list) == batch
            and num_new_list == last.num_new_list
            and set(map(type, num_new_list)) == {int}  # == holds for 1.0 and True too
        ):
            num_new = last.num_new  # same counts as the last step: already validated
        else:
            num_new = self._check_num_new(num_new_tokens, batch)
            num_new_list = None if num_new_list is None else list(num_new_list)
        flat_ids = None if token_ids is None else self._check_token_ids(token_ids, num_new)
        new_lengths = table.lengths[slots] + num_new
        longest = int(new_lengths.max())
        if longest > self.collection.max_seq_len:
            b = int(new_lengths.argmax())
            raise ValueError(
                f"num_new_tokens: sequence {ids[b]!r} would reach {longest} tokens, "
                f"past max_seq_len={self.collection.max_seq_len}"
            )
        missing = table.pages_for(new_lengths) - table.num_pages[slots]
        grow = np.flatnonzero(missing > 0)
        if grow.size:
            needed = int(missing[grow].sum())
            self._require_pages(needed)
            table.extend(slots[grow], missing[grow], self.page_pool.allocate(needed))
        if flat_ids is not None and self.enable_prefix_caching:
            table.reserve_tokens(longest)  # room for this step's ids
        table.upload(slots, num_new, grow if same_rows else None, same_rows and num_new is last.num_new)
        self._rows = _Rows(ids, seqs, slots, num_new_list, num_new)
        self._pending = _Step(seqs, slots, num_new, new_lengths, flat_ids)
        return table.step_tensors(batch)

    def commit_step(self) -> None:
        """After the model ran the prepared step: advance lengths, cache newly full pages."""
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
            self._cache_full_pages([step.seqs[b] for b in crossed], full[crossed].tolist())

    # -- offload -------------------------------------------------------------------------------
    def offload(self, seq_ids: Sequence) -> None:
        """Move sequences' pages to CPU memory (pinned when the pool is on a GPU) and free them."""
        seqs = self._resolve(list(seq_ids), name="seq_ids", limit_batch=False)[0]
        table = self.page_table
        for seq in seqs:
            used = table.pages(seq.slot)[: table.pages_for(int(table.lengths[seq.slot]))]
            seq.host_pages = self._read_pages(used)
            self.page_pool.unref(reversed(table.pages(seq.slot)))
            table.set_pages(seq.slot, [])
        self._rows = _Rows()

    def restore(self, seq_ids: Sequence) -> None:
        """Bring offloaded sequences back, contents identical (all or nothing): full pages still in
        the prefix cache are shared again, the others copied into fresh pages."""
        ids = list(seq_ids)
        self._check_unique(ids, "seq_ids")
        seqs = [self._get(i, "seq_ids") for i in ids]
        for seq in seqs:
            if seq.host_pages is None:
                raise ValueError(f"seq_ids: sequence {seq.seq_id!r} is not offloaded")
        pool = self.page_pool
        # A full page still in the prefix cache (its key) is shared again, not copied back.
        cached = [[pool.lookup(key) for key in seq.keys] for seq in seqs]
        missing = sum(
            seq.host_pages[0].shape[0] - len(hits) + hits.count(None) for seq, hits in zip(seqs, cached, strict=True)
        )
        revived = {page for hits in cached for page in hits if page is not None and pool.refcounts[page] == 0}
        self._require_pages(missing + len(revived))  # a revived cached page leaves the evictable ones
        for hits in cached:
            for page in hits:
                if page is not None:
                    pool.ref(page)
        for seq, hits in zip(seqs, cached, strict=True):
            host, seq.host_pages = seq.host_pages, None
            hits += [None] * (host[0].shape[0] - len(hits))
            todo = [i for i, page in enumerate(hits) if page is None]
            fresh = pool.allocate(len(todo))
            self._write_pages(fresh, [t[todo] for t in host])
            for i, page in zip(todo, fresh, strict=True):
                hits[i] = page
            self.page_table.set_pages(seq.slot, hits)
            for page, key in zip(hits[: len(seq.keys)], seq.keys, strict=True):  # keyed: the leading full pages
                pool.register(page, key)

    # -- checkpoints ---------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str], seq_ids: Sequence) -> None:
        """Save sequences (on device, not in a prepared step) with `checkpoint.save_cache`.

        Row i of the file is `seq_ids[i]`; pages they share are stored once. Token ids known
        for prefix caching go into the checkpoint's metadata. The live step tensors are untouched.
        """
        seqs = self._resolve(list(seq_ids), name="seq_ids", limit_batch=False)[0]
        if not seqs:
            raise ValueError("seq_ids: nothing to save (empty)")
        slots = [s.slot for s in seqs]
        table = self.page_table
        rows = (torch.from_numpy(table.lengths[slots].astype(np.int32)), torch.from_numpy(table.rows[slots]))
        meta = {"token_ids": [table.token_ids(slot) for slot in slots]}
        checkpoint.save_cache(self.collection, path, rows=rows, metadata={METADATA_KEY: json.dumps(meta)})

    def load(self, path: str | os.PathLike[str], seq_ids: Sequence | None = None) -> list:
        """Add the sequences of a checkpoint to this live cache, in free pages; returns their ids.

        Ids are `seq_ids` if given, else fresh `("loaded", n)` tuples. All or nothing, through
        `adopt`: a checkpoint whose params, kind, tables or token ids do not fit raises
        `checkpoint.CheckpointError`, too few pages `OutOfPagesError`, before any page is taken.
        Pages stream straight into the pool (`checkpoint.load_pages`); a checksum error found on the
        way also raises `CheckpointError` with the manager as before, except that prefix-cache
        entries of the pages it was going to evict are dropped.
        """
        info = checkpoint.read_info(path)
        params, c = self.collection.params, self.collection
        if info.kind != checkpoint.PAGED or info.params != params:
            raise checkpoint.CheckpointError(f"{path}: {_misfit(info.kind, info.params, params)}")
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
        tokens = saved_token_ids(path, info, c.max_seq_len)
        rows = [[j - 1 for j in info.lookup_table[b, :n].tolist()] for b, n in enumerate(info.pages_per_row())]

        def fill(incoming: list[int], pages: list[int]) -> None:  # stored page j + 1 -> pages[j]
            order = [0] * info.num_pages
            for i, page in zip(incoming, pages, strict=True):
                order[i] = page
            checkpoint.load_pages(path, c.blocks, order, scales=c.scales)

        try:
            self.adopt(ids, info.cache_lengths, rows, fill, token_ids=tokens)
        except checkpoint.CheckpointError:
            raise
        except ValueError as exc:  # the ids were checked above: what adopt refuses is the file's
            raise checkpoint.CheckpointError(f"{path}: {exc}") from None
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
        bools = isinstance(num_new_tokens, (list, tuple)) and any(
            isinstance(n, (bool, np.bool_)) for n in num_new_tokens
        )
        if num_new.shape != (batch,) or num_new.dtype.kind not in "iu" or bools:
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

    def _check_adopt(
        self,
        seq_ids: Sequence,
        cache_lengths: Sequence[int],
        page_rows: Sequence[Sequence[int]],
        token_ids: Sequence[Sequence[int] | None] | None,
        prefix_keys: Sequence[Sequence[bytes]] | None,
    ) -> tuple[list, list[int], list[list[int]], list[np.ndarray | None], list[list[bytes]]]:
        """`adopt`'s arguments, checked (ValueError naming the argument) and normalised."""
        ids = list(seq_ids)
        self._check_unique(ids, "seq_ids")
        for i in ids:
            self._check_new_id(i, "seq_ids")
        batch = len(ids)
        for name, value in (("cache_lengths", cache_lengths), ("page_rows", page_rows)):
            if len(value) != batch:
                raise ValueError(f"{name}: expected {batch} entries (one per sequence), got {len(value)}")
        lengths = [int(n) for n in cache_lengths]
        if any(not 0 <= n <= self.collection.max_seq_len for n in lengths):
            raise ValueError(f"cache_lengths: expected 0..{self.collection.max_seq_len}, got {lengths}")
        rows = [list(map(int, row)) for row in page_rows]
        used = sorted({i for row in rows for i in row})
        if used != list(range(len(used))) or any(
            len(row) != self.page_table.pages_for(n) for row, n in zip(rows, lengths, strict=True)
        ):
            raise ValueError("page_rows: expected ceil(length / page_size) incoming pages per row, using all of 0..n-1")
        uses = Counter(i for row in rows for i in row)
        if any(uses[row[-1]] > 1 for row, n in zip(rows, lengths, strict=True) if n % self.page_size):
            raise ValueError("page_rows: only full pages may be shared (a partially filled page is in two places)")
        tokens: list[np.ndarray | None] = [None] * batch
        if token_ids is not None:
            if len(token_ids) != batch:
                raise ValueError(f"token_ids: expected {batch} entries (one per sequence), got {len(token_ids)}")
            tokens = [None if t is None else _int64s("token_ids", t) for t in token_ids]
            if any(t is not None and len(t) > self.collection.max_seq_len for t in tokens):
                raise ValueError(f"token_ids: more than max_seq_len={self.collection.max_seq_len} ids")
        keys: list[list[bytes]] = [[] for _ in ids]
        if prefix_keys is not None:
            if len(prefix_keys) != batch:
                raise ValueError(f"prefix_keys: expected {batch} entries (one per sequence), got {len(prefix_keys)}")
            keys = [list(k) for k in prefix_keys]
            for row_keys, n in zip(keys, lengths, strict=True):
                well_formed = all(isinstance(k, bytes) and len(k) == 32 for k in row_keys)
                if len(row_keys) > n // self.page_size or not well_formed:
                    raise ValueError("prefix_keys: expected 32-byte keys of at most the full pages of each row")
        if not self.enable_prefix_caching:
            tokens, keys = [None] * batch, [[] for _ in ids]
        return ids, lengths, rows, tokens, keys

    def _require_pages(self, needed: int) -> None:
        """`OutOfPagesError` unless an allocation of `needed` pages can succeed now."""
        if needed > self.page_pool.available():
            raise OutOfPagesError(needed, len(self.page_pool.free), len(self.page_pool.evictable))

    def _add(
        self, seq_id: Hashable, pages: list[int], length: int, tokens: np.ndarray | None, keys: list[bytes]
    ) -> None:
        self._seqs[seq_id] = _Sequence(seq_id, self.page_table.add(pages, length, tokens), keys)

    def _cache_full_pages(self, seqs: list[_Sequence], num_full: Sequence[int]) -> None:
        """Cache the pages of `seqs[i]` below page `num_full[i]` not yet keyed (their ids are known)."""
        todo = [(seq, i) for seq, n in zip(seqs, num_full, strict=True) for i in range(len(seq.keys), n)]
        if not todo:
            return
        slots, index = [seq.slot for seq, _ in todo], [i for _, i in todo]
        data = self.page_table.page_tokens(slots, index)  # one page of token ids after another
        width = len(data) // len(todo)
        pages = self.page_table.rows[slots, index].tolist()
        for (seq, _), page, start in zip(todo, pages, range(0, len(data), width), strict=True):
            keys = seq.keys  # a sequence's pages come in order: each chains over the one before
            keys.append(
                self.page_pool.cache_full_page(keys[-1] if keys else self._root, page, data[start : start + width])
            )

    def _copy_pages(self, src: list[int], dst: list[int]) -> None:
        c = self.collection
        index = [torch.tensor(pages, dtype=torch.int32, device=c.device) for pages in (src, dst)]
        copy_pages(c.blocks, *index, c.scales)

    def _read_pages(self, pages: list[int]) -> list[torch.Tensor]:
        """Host copies of `pages` of every page tensor (pinned for a GPU pool)."""
        out = []
        for t in self.collection.page_tensors():
            data = indexable(t)
            host = torch.empty((len(pages), *data.shape[1:]), dtype=data.dtype, pin_memory=data.is_cuda)
            out.append(host.copy_(data.index_select(0, torch.tensor(pages, dtype=torch.long, device=data.device))))
        return out

    def _write_pages(self, pages: list[int], contents: list[torch.Tensor]) -> None:
        """Write host copies made by `_read_pages` into `pages`."""
        for t, host in zip(self.collection.page_tensors(), contents, strict=True):
            data = indexable(t)
            data.index_copy_(0, torch.tensor(pages, dtype=torch.long, device=data.device), host.to(data.device))
