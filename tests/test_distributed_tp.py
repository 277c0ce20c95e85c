"""Tensor parallelism over gloo: sharded heads give the single-rank attention, a TP decode step
compiles with fullgraph=True per rank, the ranks' page decisions are checked every step, and
checkpoints saved at one TP size load at another."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed_ranks import check_contents, run_step

import torch_paged_kv as pk
from torch_paged_kv.distributed.reshard import load_cache_sharded, load_sharded, plan_shards, shard_path
from torch_paged_kv.distributed.tensor_parallel import (
    TensorParallelDivergenceError,
    TensorParallelKVCacheManager,
    head_shard,
    kv_head_range,
    shard_params,
    tp_shard,
    unshard_params,
)

HEAD_DIM, PAGE = 16, 4


def test_head_ranges_split_evenly_or_replicate():
    assert [kv_head_range(8, 4, r) for r in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert [kv_head_range(2, 4, r) for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    with pytest.raises(ValueError, match="tp_size"):
        kv_head_range(3, 2, 0)
    assert head_shard(8, 2, 4, 3) == (range(6, 8), range(1, 2))  # GQA group 4: q heads 6, 7 read kv head 1
    with pytest.raises(ValueError, match="num_q_heads"):
        head_shard(6, 2, 4, 0)
    full = pk.KVCacheParams(torch.float16, 2, 8, HEAD_DIM, PAGE)
    params, shard = shard_params(full, 4, 2), tp_shard(full, 4, 2)
    assert params.num_kv_heads == 2 and shard == pk.TPShard(tp_size=4, tp_rank=2, kv_head_start=4, total_kv_heads=8)
    assert unshard_params(params, shard) == full and unshard_params(full, None) == full
    mla = pk.KVCacheParams(torch.float16, 2, 1, 64, PAGE, is_mla=True)
    assert shard_params(mla, 4, 3) == mla  # the latent head is replicated
    assert tp_shard(mla, 4, 3).kv_head_range(1) == range(0, 1)


# -- attention across ranks ----------------------------------------------------------------------------


def _attention_steps(full_kv: int, manager: pk.KVCacheManager, num_q_heads: int, heads) -> list:
    """A few steps (ragged prefill, decode, a late arrival) with global q/k/v (`full_kv` KV heads) from
    a fixed seed; each cache gets its KV heads and attends with its query heads `heads = (q_range, kv_range)`."""
    gen = torch.Generator().manual_seed(0)
    q_heads, kv_heads = heads
    params = manager.collection.params
    schedule = [(["a", "b", "c"], [5, 12, 1]), (["a", "b", "c"], [1, 1, 1]), (["b", "c", "d"], [1, 2, 9])]
    schedule += [(["a", "b", "c", "d"], [1, 1, 1, 1])] * 2
    outs = []
    for ids, counts in schedule:
        for i in ids:
            if i not in manager.sequences:
                manager.claim(i)
        step = manager.prepare_step(ids, counts)
        total = sum(counts)
        q = torch.randn(total, num_q_heads, HEAD_DIM, generator=gen)
        k, v = (torch.randn(total, full_kv, HEAD_DIM, generator=gen) for _ in range(2))
        plan = pk.StepPlan(manager.collection.blocks, step)
        out = []
        for layer in range(params.num_layers):
            plan.store_kv(k[:, kv_heads].contiguous(), v[:, kv_heads].contiguous(), layer)
            out.append(plan.flash_attention(q[:, q_heads].contiguous(), layer, HEAD_DIM**-0.5))
        manager.commit_step()
        outs.append(torch.stack(out))
    return outs


def _tp_attention(rank: int, world: int, num_q_heads: int, num_kv_heads: int) -> list:
    full = pk.KVCacheParams(torch.float32, 2, num_kv_heads, HEAD_DIM, PAGE)
    cache = pk.PagedKVCacheCollection(shard_params(full, world, rank), 48, 8, 64)
    manager = TensorParallelKVCacheManager(cache, tp_shard=tp_shard(full, world, rank))
    outs = _attention_steps(num_kv_heads, manager, num_q_heads, head_shard(num_q_heads, num_kv_heads, world, rank))
    manager.verify(full=True)
    return outs


@pytest.mark.parametrize("world, num_q_heads, num_kv_heads", [(2, 8, 4), (4, 8, 4), (4, 8, 2)])
def test_tensor_parallel_attention_equals_the_single_rank_result(rank_groups, world, num_q_heads, num_kv_heads):
    per_rank = rank_groups.get(world).run(_tp_attention, num_q_heads, num_kv_heads)
    full = pk.KVCacheParams(torch.float32, 2, num_kv_heads, HEAD_DIM, PAGE)
    single = pk.KVCacheManager(pk.PagedKVCacheCollection(full, 48, 8, 64))
    expected = _attention_steps(num_kv_heads, single, num_q_heads, (range(num_q_heads), range(num_kv_heads)))
    for step, want in enumerate(expected):
        got = torch.cat([outs[step] for outs in per_rank], dim=2)  # [layers, tokens, heads, dim]
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6, msg=f"step {step}")


# -- the ranks' page decisions ---------------------------------------------------------------------------


def _divergence(rank: int, world: int) -> str:
    full = pk.KVCacheParams(torch.float32, 2, 4, HEAD_DIM, PAGE)
    params, shard = shard_params(full, world, rank), tp_shard(full, world, rank)
    other = tp_shard(full, world, 1 - rank)
    with pytest.raises(ValueError, match=f"^tp_shard: rank {1 - rank} of 2, this process is rank {rank}"):
        TensorParallelKVCacheManager(pk.PagedKVCacheCollection(params, 8, 2, 32), tp_shard=other)
    with pytest.raises(ValueError, match="^tp_shard: rank 0 of 1"):
        TensorParallelKVCacheManager(pk.PagedKVCacheCollection(params, 8, 2, 32))
    m = TensorParallelKVCacheManager(pk.PagedKVCacheCollection(params, 32, 4, 64), tp_shard=shard)
    model = {"a": []}
    m.claim("a")
    run_step(m, ["a"], [[1, 2, 3, 4, 5, 6]], model)  # verified
    run_step(m, ["a"], [[7]], model)
    m.verify(full=True)
    if rank == 1:  # a call the other rank does not make: a page copied on rank 1 only
        m.fork("a", "b")
    m.prepare_step(["a"], [1], [[8]])  # the check runs while the model would
    with pytest.raises(TensorParallelDivergenceError, match="differ at step 3") as info:
        m.commit_step()
    assert m.cache_length("a") == 7  # nothing was committed
    waiting = TensorParallelKVCacheManager(pk.PagedKVCacheCollection(params, 32, 4, 64), tp_shard=shard, overlap=False)
    waiting.claim("a" if rank == 0 else "b")  # a different id: the same pages, but not the same sequences
    waiting.claim("x")
    if rank == 1:
        waiting.claim("y")
    with pytest.raises(TensorParallelDivergenceError, match="differ at step 1"):
        waiting.prepare_step(["x"], [2])  # without overlap the step itself raises
    return str(info.value)


def test_diverging_page_decisions_fail_loudly_on_every_rank(rank_groups):
    messages = rank_groups.get(2).run(_divergence)
    assert all("same manager calls" in m for m in messages) and messages[0].startswith("rank 0 of 2")


def _diverging_tree_paths(rank: int, world: int) -> str:
    """Ranks that keep different tree paths of one length: the same lengths, pages and counts, but
    different K/V in the pages (rank 0 keeps drafts 0 and 2, rank 1 drafts 0 and 3)."""
    full = pk.KVCacheParams(torch.float32, 2, 4, HEAD_DIM, PAGE)
    params, shard = shard_params(full, world, rank), tp_shard(full, world, rank)
    m = TensorParallelKVCacheManager(pk.PagedKVCacheCollection(params, 32, 4, 64), tp_shard=shard)
    m.claim("a")
    run_step(m, ["a"], [[1, 2, 3, 4, 5, 6]], {"a": []})
    for kept in ([0, 2], [0, 2 + rank]):  # the first agreed on (its next step passes), the second not
        m.prepare_step(["a"], [4])  # a tree verify step (its ids come with accept)
        m.commit_step()
        m.accept("a", kept)
    m.prepare_step(["a"], [1], [[9]])
    with pytest.raises(TensorParallelDivergenceError, match="differ at step 4") as info:
        m.commit_step()
    assert m.cache_length("a") == 10  # nothing was committed
    return str(info.value)


def test_diverging_tree_paths_fail_loudly_on_every_rank(rank_groups):
    messages = rank_groups.get(2).run(_diverging_tree_paths)
    assert all("same manager calls" in m for m in messages)


def _diverging_token_ids(rank: int, world: int) -> list[str]:
    """Ranks whose sampled tokens differ (same lengths and pages): in a step's ids, and in accept's."""
    full = pk.KVCacheParams(torch.float32, 2, 4, HEAD_DIM, PAGE)
    params, shard = shard_params(full, world, rank), tp_shard(full, world, rank)
    messages = []
    for where in ("step", "accept"):
        m = TensorParallelKVCacheManager(pk.PagedKVCacheCollection(params, 32, 4, 64), tp_shard=shard)
        m.claim("a")
        m.prepare_step(["a"], [3], [[1, 2, 3]])
        m.commit_step()
        if where == "step":
            m.prepare_step(["a"], [1], [[4 + rank]])
        else:
            m.prepare_step(["a"], [3])  # a verify step: the kept tokens' ids come with accept
            m.commit_step()
            m.accept("a", [0, 1], token_ids=[4, 5 + rank])
            m.prepare_step(["a"], [1], [[6]])
        with pytest.raises(TensorParallelDivergenceError, match="differ at step") as info:
            m.commit_step()
        messages.append(str(info.value))
    return messages


def test_diverging_token_ids_fail_loudly_on_every_rank(rank_groups):
    per_rank = rank_groups.get(2).run(_diverging_token_ids)
    assert all(len(messages) == 2 and all("same manager calls" in m for m in messages) for messages in per_rank)


# -- a compiled tensor-parallel decode step --------------------------------------------------------------

VOCAB, DIM, FFN, LAYERS, Q_HEADS, KV_HEADS = 64, 64, 128, 2, 4, 2


def _weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)

    def w(*shape):
        return torch.randn(*shape, generator=gen) / shape[-1] ** 0.5

    out = {"embed": torch.randn(VOCAB, DIM, generator=gen), "out": w(VOCAB, DIM)}
    for layer in range(LAYERS):
        out[f"q{layer}"], out[f"o{layer}"] = w(Q_HEADS * HEAD_DIM, DIM), w(DIM, Q_HEADS * HEAD_DIM)
        out[f"k{layer}"], out[f"v{layer}"] = w(KV_HEADS * HEAD_DIM, DIM), w(KV_HEADS * HEAD_DIM, DIM)
        out[f"up{layer}"], out[f"down{layer}"] = w(FFN, DIM), w(DIM, FFN)
    return out


def _shard(weights: dict, world: int, rank: int) -> dict:
    """Megatron sharding: q/k/v/up split by output rows (column-parallel), o/down by input columns
    (row-parallel, summed over ranks afterwards)."""
    q, kv = head_shard(Q_HEADS, KV_HEADS, world, rank)
    qrows = slice(q.start * HEAD_DIM, q.stop * HEAD_DIM)
    kvrows = slice(kv.start * HEAD_DIM, kv.stop * HEAD_DIM)
    frows = slice(rank * FFN // world, (rank + 1) * FFN // world)
    out = {"embed": weights["embed"], "out": weights["out"]}
    for layer in range(LAYERS):
        out[f"q{layer}"], out[f"o{layer}"] = weights[f"q{layer}"][qrows], weights[f"o{layer}"][:, qrows]
        out[f"k{layer}"], out[f"v{layer}"] = weights[f"k{layer}"][kvrows], weights[f"v{layer}"][kvrows]
        out[f"up{layer}"], out[f"down{layer}"] = weights[f"up{layer}"][frows], weights[f"down{layer}"][:, frows]
    return out


class _Model(torch.nn.Module):
    """Weights as buffers (static to the compiler); `reduce` sums row-parallel partial outputs over ranks."""

    def __init__(self, weights: dict, blocks: torch.Tensor, reduce) -> None:
        super().__init__()
        for name, tensor in weights.items():
            self.register_buffer(name, tensor)
        self.register_buffer("blocks", blocks)
        self.reduce = reduce

    def forward(self, tokens: torch.Tensor, step: pk.StepTensors) -> torch.Tensor:
        """Logits of each sequence's last new token."""
        w = dict(self.named_buffers())
        x = w["embed"][tokens]
        plan = pk.StepPlan(self.blocks, step)
        for layer in range(LAYERS):
            h = F.rms_norm(x, (DIM,))
            q = (h @ w[f"q{layer}"].T).unflatten(-1, (-1, HEAD_DIM))
            k = (h @ w[f"k{layer}"].T).unflatten(-1, (-1, HEAD_DIM))
            v = (h @ w[f"v{layer}"].T).unflatten(-1, (-1, HEAD_DIM))
            plan.store_kv(k, v, layer)
            x = x + self.reduce(plan.flash_attention(q, layer, HEAD_DIM**-0.5).flatten(1) @ w[f"o{layer}"].T)
            h = F.rms_norm(x, (DIM,))
            x = x + self.reduce(F.silu(h @ w[f"up{layer}"].T) @ w[f"down{layer}"].T)
        return F.rms_norm(x[step.input_row_offsets[1:] - 1], (DIM,)) @ w["out"].T


def _generate(model, manager, decode) -> tuple[dict, list]:
    """Two prompts, greedy decode; one request finishes early (batch 2 -> 1)."""
    prompts = {"a": [1, 2, 3, 4, 5, 6, 7], "b": [9, 8, 7]}
    lengths = {"a": 6, "b": 4}  # new tokens each
    tokens = {i: [] for i in prompts}
    logits_seen = []
    with torch.no_grad():
        for i, p in prompts.items():
            manager.claim(i, p)
        step = manager.prepare_step(list(prompts), [len(p) for p in prompts.values()])
        flat = torch.tensor([t for p in prompts.values() for t in p])
        logits = model(flat, step)
        manager.commit_step()
        running = list(prompts)
        for i, row in zip(running, logits.argmax(-1).tolist(), strict=True):
            tokens[i].append(row)
        while running:
            step = manager.prepare_step(running, [1] * len(running), [tokens[i][-1:] for i in running])
            flat = torch.tensor([tokens[i][-1] for i in running])
            pk.mark_step_dynamic(step, flat)
            logits = decode(flat, step)
            manager.commit_step()
            logits_seen.append(logits.clone())
            for i, t in zip(list(running), logits.argmax(-1).tolist(), strict=True):
                tokens[i].append(t)
                if len(tokens[i]) == lengths[i]:
                    running.remove(i)
                    manager.release(i)
    return tokens, logits_seen


def _tp_compiled_decode(rank: int, world: int) -> dict:
    import torch.distributed._functional_collectives as fcol

    torch._dynamo.reset()
    weights = _weights()
    full = pk.KVCacheParams(torch.float32, LAYERS, KV_HEADS, HEAD_DIM, PAGE)
    single = pk.KVCacheManager(pk.PagedKVCacheCollection(full, 16, 2, 32))
    reference = _Model(weights, single.collection.blocks, lambda t: t)
    want, want_logits = _generate(reference, single, reference)

    group = dist.group.WORLD
    params = shard_params(full, world, rank)
    manager = TensorParallelKVCacheManager(
        pk.PagedKVCacheCollection(params, 16, 2, 32), tp_shard=tp_shard(full, world, rank)
    )

    def all_reduce(t):
        return fcol.all_reduce(t, "sum", group)

    model = _Model(_shard(weights, world, rank), manager.collection.blocks, all_reduce)
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    calls = [0]

    def decode(*args):
        calls[0] += 1
        if calls[0] == 2:  # compiled once (batch 2); batch 1 later must reuse it
            torch.compiler.set_stance("fail_on_recompile")
        return compiled(*args)

    try:
        got, got_logits = _generate(model, manager, decode)
    finally:
        torch.compiler.set_stance("default")
    assert got == want, (got, want)
    for a, b in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    return got


def test_tensor_parallel_decode_step_compiles_fullgraph_per_rank(rank_groups):
    tokens = rank_groups.get(2).run(_tp_compiled_decode, timeout=300)
    assert tokens[0] == tokens[1]


# -- checkpoints across TP sizes ----------------------------------------------------------------------------

FULL = pk.KVCacheParams(torch.bfloat16, num_layers=2, num_kv_heads=4, head_dim=8, page_size=4)


def _build(manager: pk.KVCacheManager) -> dict:
    """The same sequences on every rank: a shared prompt, a fork, ragged decode with token ids."""
    model = {"a": [], "b": [], "c": []}
    manager.claim("a", list(range(11)))
    run_step(manager, ["a"], [list(range(11))], model)
    manager.claim("b", [*range(8), 42])
    model["b"] = list(range(8))  # reused from the prefix cache
    run_step(manager, ["b"], [[42]], model)
    manager.fork("a", "c")
    model["c"] = list(model["a"])
    run_step(manager, ["a", "b", "c"], [[1], [2, 3], [4, 5, 6]], model)
    return model


def _tp_manager(world: int, rank: int, params: pk.KVCacheParams = FULL) -> TensorParallelKVCacheManager:
    cache = pk.PagedKVCacheCollection(shard_params(params, world, rank), 32, 4, 64)
    return TensorParallelKVCacheManager(cache, tp_shard=tp_shard(params, world, rank))


def _save_tp(rank: int, world: int, directory: str) -> tuple[dict, str]:
    manager = _tp_manager(world, rank)
    model = _build(manager)
    path = shard_path(f"{directory}/kv.safetensors", manager.tp_shard)
    pk.save_sequences(manager, path, ["c", "a", "b"])
    return model, str(path)


def _load_tp(rank: int, world: int, files: list[str], model: dict, directory: str) -> str:
    manager = _tp_manager(world, rank)
    ids = load_sharded(manager, files, ["c", "a", "b"])
    check_contents(manager, model, ids)
    manager.verify(full=True)
    assert manager.claim("d", [*range(8), 0]) == 8  # token ids came along: the prefix is cached
    manager.release("d")
    path = shard_path(f"{directory}/kv.safetensors", manager.tp_shard)
    pk.save_sequences(manager, path, ids)
    return str(path)


def test_checkpoints_reshard_between_tp_sizes(rank_groups, tmp_path):
    (tmp_path / "tp2").mkdir()
    (tmp_path / "tp4").mkdir()
    saved = rank_groups.get(2).run(_save_tp, str(tmp_path / "tp2"))
    model, files2 = saved[0][0], [path for _, path in saved]
    assert [p.split("/")[-1] for p in files2] == ["kv.tp0-of-2.safetensors", "kv.tp1-of-2.safetensors"]
    meta = json.loads(pk.checkpoint.read_info(files2[1]).metadata["params"])
    assert (meta["tp_size"], meta["tp_rank"], meta["kv_head_start"], meta["total_kv_heads"]) == (2, 1, 2, 4)
    files4 = rank_groups.get(4).run(_load_tp, files2, model, str(tmp_path / "tp4"))  # TP=2 -> TP=4

    one = pk.KVCacheManager(pk.PagedKVCacheCollection(FULL, 32, 4, 64))  # TP=2 -> TP=1
    ids = load_sharded(one, files2)
    check_contents(one, {i: model[n] for i, n in zip(ids, "cab", strict=True)}, ids)
    for r in range(2):  # TP=4 -> TP=2 gives back the TP=2 files' contents, bit for bit
        again = load_cache_sharded(files4, tp_size=2, tp_rank=r)
        original = load_cache_sharded(files2, tp_size=2, tp_rank=r)
        assert again.params == original.params == shard_params(FULL, 2, r)
        assert pk.checkpoint.read_info(files2[r]).tp_shard == tp_shard(FULL, 2, r)
        assert torch.equal(again.blocks.view(torch.int16), original.blocks.view(torch.int16))
        assert torch.equal(again.lookup_table, original.lookup_table)
    whole = load_cache_sharded(files4)  # TP=4 -> TP=1, as a new collection
    assert torch.equal(whole.blocks.view(torch.int16), one.collection.blocks[: whole.blocks.shape[0]].view(torch.int16))


def test_an_unsharded_checkpoint_loads_at_any_tp_size(tmp_path):
    m = pk.KVCacheManager(pk.PagedKVCacheCollection(FULL, 32, 4, 64))
    model = _build(m)
    pk.save_sequences(m, tmp_path / "kv.safetensors", ["a", "b", "c"])
    for r in range(4):
        cache = pk.PagedKVCacheCollection(shard_params(FULL, 4, r), 32, 4, 64)
        shard = pk.KVCacheManager(cache, tp_shard=tp_shard(FULL, 4, r))
        ids = load_sharded(shard, [tmp_path / "kv.safetensors"], ["a", "b", "c"])
        check_contents(shard, model, ids)


def _shard_files(tmp_path, build=_build) -> list:
    files = []
    for r in range(2):
        m = pk.KVCacheManager(
            pk.PagedKVCacheCollection(shard_params(FULL, 2, r), 32, 4, 64), tp_shard=tp_shard(FULL, 2, r)
        )
        build(m)
        files.append(shard_path(tmp_path / "kv.safetensors", m.tp_shard))
        pk.save_sequences(m, files[-1], ["a", "b", "c"])
    return files


def test_mismatched_shards_are_refused_with_a_clear_error(tmp_path):
    files = _shard_files(tmp_path)
    target = pk.KVCacheManager(pk.PagedKVCacheCollection(FULL, 32, 4, 64))
    with pytest.raises(pk.CheckpointError, match=r"KV heads \[2, 3\] of the target \(heads 0..3 of 4\) are in none"):
        load_sharded(target, files[:1])
    with pytest.raises(pk.CheckpointError, match="a shard of other KV heads"):
        pk.load_sequences(target, files[0])  # the plain loader says where to go
    (tmp_path / "other").mkdir()

    def build_other(m):
        model = _build(m)
        run_step(m, ["a"], [[9]], model)

    other = _shard_files(tmp_path / "other", build_other)
    with pytest.raises(pk.CheckpointError, match="not shards of one KV state"):
        load_sharded(target, [files[0], other[1]])
    wider = pk.KVCacheParams(torch.bfloat16, num_layers=2, num_kv_heads=4, head_dim=16, page_size=4)
    with pytest.raises(pk.CheckpointError, match="only the KV heads a file holds may differ"):
        plan_shards(files, wider)
    more_heads = pk.KVCacheParams(torch.bfloat16, num_layers=2, num_kv_heads=8, head_dim=8, page_size=4)
    with pytest.raises(pk.CheckpointError, match="does not fit the target"):
        plan_shards(files, shard_params(more_heads, 2, 0), tp_shard(more_heads, 2, 0))
    same_count = pk.KVCacheManager(pk.PagedKVCacheCollection(shard_params(FULL, 2, 1), 32, 4, 64))
    with pytest.raises(pk.CheckpointError, match="a shard of other KV heads"):
        pk.load_sequences(same_count, files[0])  # two heads, but not heads 0..1 of 4 (no tp_shard: the whole cache)
    assert target.sequences == [] and target.num_free_pages() == 32  # nothing was allocated


def test_fp8_checkpoints_reshard_blocks_and_scales(tmp_path):
    """Per-granule FP8: each head's scales depend on that head only, so the shards of a TP=2 run are
    exactly the head slices of a TP=1 run, and reload at any size bit for bit (blocks and scales)."""
    fp8 = pk.KVCacheParams(torch.float8_e4m3fn, num_layers=2, num_kv_heads=4, head_dim=8, page_size=4)
    whole = pk.KVCacheManager(pk.PagedKVCacheCollection(fp8, 32, 4, 64))
    _build(whole)
    files = []
    for r in range(2):
        m = pk.KVCacheManager(
            pk.PagedKVCacheCollection(shard_params(fp8, 2, r), 32, 4, 64), tp_shard=tp_shard(fp8, 2, r)
        )
        _build(m)
        files.append(shard_path(tmp_path / "kv.safetensors", m.tp_shard))
        pk.save_sequences(m, files[-1], ["a", "b", "c"])
    as_bytes = [lambda t: t.view(torch.uint8), lambda t: t]
    for tp_size in (1, 2, 4):
        for r in range(tp_size):
            cache = pk.PagedKVCacheCollection(shard_params(fp8, tp_size, r), 32, 4, 64)
            target = pk.KVCacheManager(cache, tp_shard=tp_shard(fp8, tp_size, r))
            ids = load_sharded(target, files, ["a", "b", "c"])
            heads = kv_head_range(4, tp_size, r)
            for i in ids:
                mine, theirs = torch.tensor(target.pages(i)), torch.tensor(whole.pages(i))
                for view, a, b in zip(
                    as_bytes, target.collection.page_tensors(), whole.collection.page_tensors(), strict=True
                ):
                    assert torch.equal(view(a[mine]), view(b[theirs][:, :, :, :, heads.start : heads.stop])), (
                        tp_size,
                        r,
                        i,
                    )


def test_inspect_says_which_heads_a_shard_holds(tmp_path, capsys):
    from torch_paged_kv.__main__ import main

    files = _shard_files(tmp_path)
    assert main(["inspect", str(files[1])]) == 0
    assert "kv heads:   2..3 of 4 (tensor-parallel rank 1 of 2" in capsys.readouterr().out
    m = pk.KVCacheManager(pk.PagedKVCacheCollection(FULL, 32, 4, 64))
    _build(m)
    pk.save_sequences(m, tmp_path / "whole.safetensors", ["a"])
    assert main(["inspect", str(tmp_path / "whole.safetensors")]) == 0
    assert "kv heads:   all 4" in capsys.readouterr().out
