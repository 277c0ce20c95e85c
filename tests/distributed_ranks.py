"""Worker processes for multi-process tests: a gloo (or NCCL) group of N ranks that runs test functions.

Starting processes that import torch costs seconds on the CI machines, so a `Ranks` group is
started once and reused by the tests of a module: `ranks.run(fn, *args)` runs the module-level
function `fn(rank, world_size, *args)` on every rank and returns each rank's result, or raises with
every failing rank's traceback. Every wait has a timeout; a group that failed or timed out is
killed, and the next `run` through `RankGroups.get` starts a fresh one. The rendezvous is a file in a
temporary directory, so parallel test runs never collide on a port.
"""

from __future__ import annotations

import datetime
import os
import queue
import tempfile
import time
import traceback
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

GROUP_TIMEOUT_S = 30.0
FAILURE_GRACE_S = 5.0


def _worker(rank: int, world_size: int, init_file: str, tasks: Any, results: Any, backend: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    if backend == "nccl":  # one GPU per rank
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
    )
    results.put((rank, True, "ready"))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            results.put((rank, True, fn(rank, world_size, *args)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
    results.close()
    results.join_thread()
    os._exit(0)  # no destroy_process_group: it can wait on peers that are gone


class Ranks:
    """`world_size` worker processes in one gloo group (or NCCL: rank r on GPU r)."""

    def __init__(self, world_size: int, timeout: float = 120.0, backend: str = "gloo") -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self._dir = tempfile.TemporaryDirectory(prefix="tpk-ranks-")
        init_file = os.path.join(self._dir.name, "rendezvous")
        self._tasks = [ctx.SimpleQueue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker, args=(r, world_size, init_file, self._tasks[r], self._results, backend), daemon=True
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self.alive = True
        self._collect(timeout, "start", expect_exit=())

    def _collect(self, timeout: float, what: str, expect_exit: tuple[int, ...]) -> list[Any]:
        deadline = time.monotonic() + timeout
        got: dict[int, tuple[bool, Any]] = {}
        while len(got) < self.world_size:
            for r in expect_exit:  # ranks meant to die report nothing
                if r not in got and not self._procs[r].is_alive():
                    got[r] = (True, None)
            if len(got) == self.world_size:
                break
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in got and r not in expect_exit]
            try:
                rank, ok, value = self._results.get(timeout=0.2)
                got[rank] = (ok, value)
                if not ok:  # the others may wait for it in a collective: give them a little while
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
                continue
            except queue.Empty:
                pass
            if dead:
                self.close()
                raise AssertionError(
                    f"{what}: rank(s) {dead} died (exit codes {[self._procs[r].exitcode for r in dead]})"
                )
            if time.monotonic() > deadline:
                self.close()
                missing = sorted(set(range(self.world_size)) - set(got))
                raise AssertionError(f"{what}: rank(s) {missing} did not answer within {timeout:.0f} s")
        failures = [f"rank {r}:\n{value}" for r, (ok, value) in sorted(got.items()) if not ok]
        if failures:
            self.close()
            raise AssertionError(f"{what} failed on {len(failures)} rank(s):\n" + "\n".join(failures))
        return [got[r][1] for r in range(self.world_size)]

    def run(self, fn: Any, *args: Any, timeout: float = 120.0, expect_exit: tuple[int, ...] = ()) -> list[Any]:
        """`fn(rank, world_size, *args)` on every rank; the ranks in `expect_exit` may die instead
        (their result is None, and the group is closed afterwards)."""
        assert self.alive, "this group was closed"
        for q in self._tasks:
            q.put((fn, args))
        try:
            return self._collect(timeout, getattr(fn, "__name__", "task"), expect_exit)
        finally:
            if expect_exit:
                self.close()

    def close(self) -> None:
        if not self.alive:
            return
        self.alive = False
        for p, q in zip(self._procs, self._tasks, strict=True):
            if p.is_alive():
                q.put(None)
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._dir.cleanup()


class RankGroups:
    """One live `Ranks` per world size, restarted after a failure; `close_all` at the end."""

    def __init__(self) -> None:
        self._groups: dict[int, Ranks] = {}

    def get(self, world_size: int) -> Ranks:
        group = self._groups.get(world_size)
        if group is None or not group.alive:
            group = self._groups[world_size] = Ranks(world_size)
        return group

    def close_all(self) -> None:
        for group in self._groups.values():
            group.close()


# -- K/V that is a function of the token prefix (so every rank and every process can recompute it) --


def kv_rows(params: Any, tokens: list[int], start: int, stop: int, total_kv_heads: int | None = None) -> Any:
    """K/V of positions start..stop-1 for every global KV head: `[n, planes, layers, total_kv_heads
    (default: the params' heads), head_dim]` in `params.dtype`, a pure function of `tokens[:position + 1]`."""
    import torch

    h, hashes = 7, []
    for tok in tokens[:stop]:
        h = (h * 1_000_003 + tok + 1) % 2_147_483_647
        hashes.append(h)
    total = params.num_kv_heads if total_kv_heads is None else total_kv_heads
    shape = (params.num_planes, params.num_layers, total, params.head_dim)
    n_vals = shape[0] * shape[1] * shape[2] * shape[3]
    mult = torch.arange(1, n_vals + 1, dtype=torch.int64) * 7919
    vals = (torch.tensor(hashes[start:], dtype=torch.int64)[:, None] * mult[None]) % 997
    dtype = torch.float32 if params.quantized else params.dtype  # an FP8 cache quantizes float rows
    return (vals.double() / 997 - 0.5).to(dtype).view(-1, *shape)


def heads(manager: Any) -> tuple[range, int]:
    """The global KV heads `manager`'s cache holds (its `tp_shard`), and the model's head count."""
    p, shard = manager.collection.params, manager.tp_shard
    if shard is None:
        return range(p.num_kv_heads), p.num_kv_heads
    return shard.kv_head_range(p.num_kv_heads), shard.total_kv_heads


def run_step(manager: Any, ids: list, news: list[list[int]], model: dict) -> None:
    """prepare_step (with token ids), store each row's K/V (this cache's heads), commit_step."""
    import torch

    import torch_paged_kv as pk

    p, (held, total) = manager.collection.params, heads(manager)
    step = manager.prepare_step(ids, [len(t) for t in news], news)
    kv = torch.cat(
        [kv_rows(p, model[i] + t, len(model[i]), len(model[i]) + len(t), total) for i, t in zip(ids, news, strict=True)]
    )
    kv = kv[:, :, :, held.start : held.stop]
    for layer in range(p.num_layers):
        k, v = kv[:, 0, layer].contiguous(), kv[:, 1, layer].contiguous()
        pk.store_kv(k, v, manager.collection.blocks, *step, layer, manager.collection.scales)
    manager.commit_step()
    for i, t in zip(ids, news, strict=True):
        model[i] = model[i] + t


def check_contents(manager: Any, model: dict, ids: list) -> None:
    """`gather_kv` over each sequence's pages equals its K/V recomputed from its tokens (this cache's
    heads; not for FP8 caches, whose pages hold rounded values: compare their bytes instead)."""
    import torch

    import torch_paged_kv as pk

    c, p = manager.collection, manager.collection.params
    held, total = heads(manager)
    for i in ids:
        pages, length = manager.pages(i), len(model[i])
        assert manager.cache_length(i) == length, (i, manager.cache_length(i), length)
        table = torch.full((1, c.lookup_table.shape[1]), pk.NULL_PAGE, dtype=torch.int32)
        table[0, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        want = kv_rows(p, model[i], 0, length, total)[:, :, :, held.start : held.stop]
        for layer in range(p.num_layers):
            k, v = pk.gather_kv(
                c.blocks,
                torch.tensor([length], dtype=torch.int32),
                table,
                torch.zeros(2, dtype=torch.int32),
                layer,
                length,
            )
            assert torch.equal(k[0], want[:, 0, layer]) and torch.equal(v[0], want[:, 1, layer]), (i, layer)


def snapshot(manager: Any) -> dict:
    """The manager's bookkeeping and the contents of every page a sequence holds or the cache keeps
    (free pages may be written by a failed transfer; nothing else may change)."""
    import copy

    import torch

    table, pool = manager.page_table, manager.page_pool
    kept = sorted({p for i in manager.sequences for p in manager.pages(i)} | set(pool.key_of))
    return {
        "table": [getattr(table, n).tolist() for n in ("lengths", "num_pages", "known", "rows")],
        "tokens": table.tokens.tolist(),
        "pool": copy.deepcopy(vars(pool)),
        "seqs": {i: (manager.cache_length(i), manager.pages(i), manager.token_ids(i)) for i in manager.sequences},
        "pages": manager.collection.blocks[torch.tensor(kept, dtype=torch.long)].clone(),
        "counters": (manager.prefix_cache_hits, manager.prefix_cache_misses),
    }


def assert_same(a: dict, b: dict) -> None:
    import torch

    assert a.keys() == b.keys()
    for key in a:
        if key == "pages":
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key
