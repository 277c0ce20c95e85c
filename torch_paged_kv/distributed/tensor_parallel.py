"""Tensor parallelism: KV heads sharded over the ranks of a group, one page manager per rank in lockstep.

Rank r of a group of `tp_size` holds a slice of the KV heads in its own pool (`shard_params` gives
its params, `tp_shard` which heads they are: a `TPShard` its manager keeps), with the same page
layout as every other rank; attention is each rank running the ordinary ops on its query heads and
their KV heads (`head_shard`; GQA groups never straddle ranks), and the model's output projection
sums over ranks (a row-parallel linear and an all-reduce, as in Megatron).

Every rank must make the same page decisions: the lookup tables of rank 0 are those of every rank.
`TensorParallelKVCacheManager` gets there by determinism: every rank runs the same manager calls
(the scheduler's decisions, broadcast by the serving stack), and each `prepare_step` compares a
digest of the step across the group (one all-reduce of two int64 over a CPU group), raising
`TensorParallelDivergenceError` on every rank at the first step where they differ. Each rank
applies page copies, offloads, checkpoints and transfers to its own heads.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Hashable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from ..collection import PagedKVCacheCollection, StepTensors
from ..manager import KVCacheManager
from ..params import KVCacheParams, TPShard


def kv_head_range(total_kv_heads: int, tp_size: int, tp_rank: int) -> range:
    """Global KV heads rank `tp_rank` holds: an even split when `tp_size` divides the heads, else one
    head replicated on `tp_size / total_kv_heads` consecutive ranks (when the heads divide `tp_size`)."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank: expected 0..{tp_size - 1}, got {tp_rank}")
    if total_kv_heads % tp_size == 0:
        per_rank = total_kv_heads // tp_size
        return range(tp_rank * per_rank, (tp_rank + 1) * per_rank)
    if tp_size % total_kv_heads == 0:
        head = tp_rank // (tp_size // total_kv_heads)
        return range(head, head + 1)
    raise ValueError(f"tp_size: {total_kv_heads} KV heads neither split evenly over nor divide {tp_size} ranks")


def head_shard(num_q_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[range, range]:
    """(query heads, KV heads) of rank `tp_rank`: an even split of the query heads and the KV heads
    their GQA groups read, so each rank's attention is the ordinary op on its slices."""
    if num_q_heads % num_kv_heads or num_q_heads % tp_size:
        raise ValueError(
            f"num_q_heads: {num_q_heads} must be a multiple of num_kv_heads={num_kv_heads} and of tp_size={tp_size}"
        )
    per_rank = num_q_heads // tp_size
    q = range(tp_rank * per_rank, (tp_rank + 1) * per_rank)
    kv = kv_head_range(num_kv_heads, tp_size, tp_rank)
    group = num_q_heads // num_kv_heads
    if q.start // group != kv.start or (q.stop - 1) // group != kv.stop - 1:
        raise ValueError(f"num_q_heads: query heads {q} of rank {tp_rank} read KV heads outside {kv}")
    return q, kv


def tp_shard(params: KVCacheParams, tp_size: int, tp_rank: int) -> TPShard:
    """Which KV heads rank `tp_rank` of `tp_size` holds of the model's cache `params` (every head):
    the `TPShard` its manager gets next to `shard_params`' params."""
    heads = kv_head_range(params.num_kv_heads, tp_size, tp_rank)
    return TPShard(tp_size, tp_rank, heads.start, params.num_kv_heads)


def shard_params(params: KVCacheParams, tp_size: int, tp_rank: int) -> KVCacheParams:
    """The params of rank `tp_rank`'s cache: the model's cache `params` (every head) with the heads
    that rank holds (an MLA latent cache is replicated: every rank holds the one latent head)."""
    return dataclasses.replace(params, num_kv_heads=len(kv_head_range(params.num_kv_heads, tp_size, tp_rank)))


def unshard_params(params: KVCacheParams, tp_shard: TPShard | None) -> KVCacheParams:
    """The params of the model's whole cache (every head) that a cache of `params` holding `tp_shard` is part of."""
    return params if tp_shard is None else dataclasses.replace(params, num_kv_heads=tp_shard.total_kv_heads)


class TensorParallelDivergenceError(RuntimeError):
    """The ranks of a tensor-parallel group made different page decisions (raised on every rank)."""


class TensorParallelKVCacheManager(KVCacheManager):
    """A `KVCacheManager` for rank `tp_rank` of a tensor-parallel group, checked against the others.

    `collection` holds this rank's heads (`shard_params`), `tp_shard` says which (`tp_shard`); its
    `tp_size`/`tp_rank` must be this process's size/rank in `group` (no shard: a group of one).
    Call it exactly as every other rank does. Every `verify_every`-th `prepare_step` (default: each)
    all-reduces a digest of the step (its rows' slots, lengths, page counts, last pages and token
    ids, the pool's counters, every `rewind` and `accept` so far) over `cpu_group` (default `group`,
    which must then be a gloo group; with NCCL pass a gloo group of the same ranks). With `overlap` (default) the
    all-reduce runs while the model does and `commit_step` checks it; without, `prepare_step` waits
    for it. Either raises `TensorParallelDivergenceError` on every rank if any differs, before the
    step is committed. `verify(full=True)` also compares every sequence's pages and the free list
    (after a load or a transfer, say).
    """

    def __init__(
        self,
        collection: PagedKVCacheCollection,
        group: dist.ProcessGroup | None = None,
        *,
        tp_shard: TPShard | None = None,
        cpu_group: dist.ProcessGroup | None = None,
        verify_every: int = 1,
        overlap: bool = True,
        enable_prefix_caching: bool = True,
        hash_salt: bytes | None = None,
    ) -> None:
        super().__init__(collection, enable_prefix_caching, hash_salt, tp_shard=tp_shard)
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        held = (1, 0) if self.tp_shard is None else (self.tp_shard.tp_size, self.tp_shard.tp_rank)
        if held != (size, rank):
            raise ValueError(f"tp_shard: rank {held[1]} of {held[0]}, this process is rank {rank} of {size}")
        if cpu_group is None:
            if "gloo" not in str(dist.get_backend(group)):
                raise ValueError("cpu_group: the digests go over a CPU (gloo) group; pass one for these ranks")
            cpu_group = group
        if not isinstance(verify_every, int) or verify_every < 0:
            raise ValueError(f"verify_every: expected an int >= 0 (0: never), got {verify_every!r}")
        self.group, self.cpu_group, self.verify_every = group, cpu_group, verify_every
        self.tp_rank, self.tp_size = rank, size
        self.overlap = bool(overlap)
        self.steps_prepared = 0
        self._in_flight: tuple[int, torch.Tensor, dist.Work] | None = None
        self._speculation = b""  # a running hash of every rewind and accept (see `_record`)

    def prepare_step(
        self, seq_ids: Sequence, num_new_tokens: Sequence[int], token_ids: Sequence[Sequence[int]] | None = None
    ) -> StepTensors:
        """`KVCacheManager.prepare_step`, then (every `verify_every` steps) the digest all-reduce is
        started; with `overlap` it completes while the model runs and `commit_step` checks it."""
        self._check_pending()  # an abandoned step's check still counts
        step = super().prepare_step(seq_ids, num_new_tokens, token_ids)
        assert isinstance(step, StepTensors)  # a tensor-parallel cache has one layer group
        self.steps_prepared += 1
        if self.verify_every and self.steps_prepared % self.verify_every == 0:
            if self.overlap:
                self._in_flight = self._start(self.digest())
            else:
                self.verify()
        return step

    def commit_step(self) -> None:
        """Check this step's digests (`TensorParallelDivergenceError` before anything is committed),
        then `KVCacheManager.commit_step`."""
        self._check_pending()
        super().commit_step()

    def rewind(self, seq_id: Hashable, n: int) -> None:
        """`KVCacheManager.rewind`, recorded for the next digest."""
        super().rewind(seq_id, n)
        self._record(seq_id, 0, n)

    def accept(self, seq_id: Hashable, kept: Sequence[int], token_ids: Sequence[int] | None = None) -> None:
        """`KVCacheManager.accept`, recorded for the next digest: ranks that keep different paths of
        the same length end with the same lengths and pages but different K/V in them."""
        super().accept(seq_id, kept, token_ids)
        self._record(seq_id, 1, *kept, token_ids=token_ids)

    def _record(self, seq_id: Hashable, *call: int, token_ids: Sequence[int] | None = None) -> None:
        """Chain a rewind or accept that succeeded (its arguments, the sequence's slot, the pages it left
        and accept's token ids) into the hash every later digest includes, so a rank that decided
        otherwise differs from then on."""
        h = hashlib.blake2b(self._speculation, digest_size=16)
        slot = self._seqs.get(seq_id, "seq_id").slot
        h.update(np.array([*call, slot, self.cache_length(seq_id), *self.pages(seq_id)], dtype=np.int64).tobytes())
        ids = [-1] if token_ids is None else [len(token_ids), *map(int, token_ids)]
        h.update(np.array(ids, dtype=np.int64).tobytes())
        self._speculation = h.digest()

    def digest(self, full: bool = False) -> int:
        """A 56-bit digest of the page decisions so far (see the class docs); equal on every rank."""
        h = hashlib.blake2b(digest_size=7)
        table = self.page_table
        step = self._pending
        if step is not None:
            counts = table.num_pages[step.slots]
            last = table.rows[step.slots, np.maximum(counts - 1, 0)]
            ids = np.full(1, -1) if step.token_ids is None else step.token_ids
            for array in (step.slots, step.new_lengths, step.num_new, counts, last, ids):
                h.update(np.ascontiguousarray(array, dtype=np.int64).tobytes())
        sequences = self.sequences
        counters = (*self.page_pool.counts(), len(sequences), self.steps_prepared)
        h.update(np.array(counters, dtype=np.int64).tobytes())
        h.update(self._speculation)
        if full:
            for seq_id in sequences:
                pages = self.pages(seq_id)
                h.update(np.array([self.cache_length(seq_id), len(pages), *pages], dtype=np.int64).tobytes())
            h.update(np.array(self.page_pool.free_pages(), dtype=np.int64).tobytes())
        return int.from_bytes(h.digest(), "little")

    def _start(self, digest: int) -> tuple[int, torch.Tensor, dist.Work]:
        both = torch.tensor([digest, -digest], dtype=torch.int64)
        work = dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.cpu_group, async_op=True)
        assert work is not None  # (async_op: a handle)
        return digest, both, work

    def _check(self, digest: int, both: torch.Tensor, work: dist.Work) -> None:
        work.wait()
        high, low = int(both[0]), -int(both[1])
        if high != low:
            raise TensorParallelDivergenceError(
                f"rank {self.tp_rank} of {self.tp_size}: the ranks' page decisions differ at step "
                f"{self.steps_prepared} (digest {digest:#x} here, between {low:#x} and {high:#x} over the group); "
                "every rank must make the same manager calls in the same order"
            )

    def _check_pending(self) -> None:
        if self._in_flight is not None:
            in_flight, self._in_flight = self._in_flight, None
            self._check(*in_flight)

    def verify(self, full: bool = False) -> None:
        """Compare `digest(full)` across the group now; `TensorParallelDivergenceError` on every rank
        if any rank differs."""
        self._check_pending()
        self._check(*self._start(self.digest(full)))
