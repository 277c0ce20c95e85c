"""A decode step (store_kv + flash_attention) under torch.compile(fullgraph=True): no graph break,
no recompile as the batch size changes over one preallocated pool, even when batch 1 comes first."""

import pytest
import torch

import torch_paged_kv as pk
from torch_paged_kv.testing import attention_fp64

NUM_LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM, PAGE = 2, 2, 4, 16, 4


def decode_step(q, k, v, blocks, cache_lengths, lookup_table, input_row_offsets, scales=None):
    out = q
    for layer in range(NUM_LAYERS):
        pk.store_kv(k, v, blocks, cache_lengths, lookup_table, input_row_offsets, layer, scales)
        out = pk.flash_attention(
            out, blocks, cache_lengths, lookup_table, input_row_offsets, layer, HEAD_DIM**-0.5, scales=scales
        )
    return out * 2


def _step_inputs(collection, batch, gen):
    step = collection.step_tensors(batch)
    step.cache_lengths.copy_(torch.randint(0, 20, (batch,), generator=gen, dtype=torch.int32))
    step.input_row_offsets.copy_(torch.arange(batch + 1, dtype=torch.int32))
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(batch, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(batch, KV_HEADS, HEAD_DIM, generator=gen)
    pk.mark_step_dynamic(step, q, k, v)
    return q, k, v, step


@pytest.mark.parametrize(
    "dtype, quant",
    [(torch.float32, {}), (torch.float8_e4m3fn, dict(quantization_granularity=8)), (torch.float8_e5m2, {})],
    ids=["fp32", "fp8-granule8", "fp8-per-token"],
)
def test_decode_step_compiles_fullgraph_without_recompiling(dtype, quant):
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    params = pk.KVCacheParams(dtype, NUM_LAYERS, KV_HEADS, HEAD_DIM, PAGE, **quant)
    collection = pk.PagedKVCacheCollection(params, num_pages=64, max_batch_size=8, max_seq_len=24)
    collection.blocks.copy_(torch.randn(collection.blocks.shape, generator=gen).to(dtype))
    if collection.scales is not None:
        collection.scales.uniform_(0.01, 0.02, generator=gen)
    collection.lookup_table[:, :6] = (torch.randperm(64, generator=gen)[:48] + 1).view(8, 6).int()
    compiled = torch.compile(decode_step, fullgraph=True, dynamic=True)

    for i, batch in enumerate([1, 3, 5, 8, 2, 1]):
        q, k, v, step = _step_inputs(collection, batch, gen)
        eager = [t.clone() for t in (collection.blocks, collection.scales) if t is not None]
        expected = decode_step(q, k, v, *eager[:1], *step, *eager[1:])
        if i == 1:
            torch.compiler.set_stance("fail_on_recompile")
        try:
            out = compiled(q, k, v, collection.blocks, *step, collection.scales)
        finally:
            torch.compiler.set_stance("default")
        assert torch.equal(out, expected)
        assert torch.equal(collection.blocks.view(torch.uint8), eager[0].view(torch.uint8))
        assert collection.scales is None or torch.equal(collection.scales, eager[1])


def test_compiled_attention_matches_fp64():
    torch._dynamo.reset()
    from torch_paged_kv.testing import make_paged_batch

    b = make_paged_batch(
        [6, 1, 0],
        [1, 1, 1],
        page_size=PAGE,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        group=Q_HEADS // KV_HEADS,
        seed=1,
    )

    @torch.compile(fullgraph=True)
    def step(q, k, v, blocks, cache_lengths, lookup_table, input_row_offsets):
        pk.store_kv(k, v, blocks, cache_lengths, lookup_table, input_row_offsets, b.layer_idx)
        return pk.flash_attention(q, blocks, cache_lengths, lookup_table, input_row_offsets, b.layer_idx, 0.3)

    out = step(b.q, b.new_keys, b.new_values, b.blocks, *b.step)
    ref = attention_fp64(b.q, b.keys, b.values, [6, 1, 0], 0.3)
    assert (out.double() - ref).abs().max() < 2e-5


def plan_step(q, k, v, sinks, tree, blocks, cache_lengths, lookup_table, input_row_offsets):
    """Two layers as Llama 4 and GPT-OSS mix them: a chunked layer, then one with attention sinks (and
    a tree mask, one draft per row)."""
    plan = pk.StepPlan(blocks, pk.StepTensors(cache_lengths, lookup_table, input_row_offsets))
    out = q
    for layer, options in enumerate(({"attention_chunk_size": 8}, {"sinks": sinks, "tree_mask": tree})):
        plan.store_kv(k, v, layer)
        out = plan.flash_attention(out, layer, HEAD_DIM**-0.5, **options)
    return out * 2


def test_sinks_chunks_and_trees_compile_fullgraph_without_recompiling():
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(2)
    params = pk.KVCacheParams(torch.float32, NUM_LAYERS, KV_HEADS, HEAD_DIM, PAGE)
    collection = pk.PagedKVCacheCollection(params, num_pages=64, max_batch_size=8, max_seq_len=24)
    collection.blocks.copy_(torch.randn(collection.blocks.shape, generator=gen))
    collection.lookup_table[:, :6] = (torch.randperm(64, generator=gen)[:48] + 1).view(8, 6).int()
    sinks = torch.randn(Q_HEADS, generator=gen)
    compiled = torch.compile(plan_step, fullgraph=True, dynamic=True)
    for i, batch in enumerate([1, 3, 5, 2]):
        q, k, v, step = _step_inputs(collection, batch, gen)
        tree = torch.ones(batch, dtype=torch.int64)  # each row's one new token sees itself
        pk.mark_step_dynamic(step, tree)
        eager_blocks = collection.blocks.clone()
        expected = plan_step(q, k, v, sinks, tree, eager_blocks, *step)
        if i == 1:
            torch.compiler.set_stance("fail_on_recompile")
        try:
            out = compiled(q, k, v, sinks, tree, collection.blocks, *step)
        finally:
            torch.compiler.set_stance("default")
        assert torch.equal(out, expected)
        assert torch.equal(collection.blocks, eager_blocks)


@pytest.mark.parametrize("check_with_traces", [True, False])
def test_traced_shape_checks_compile_and_refuse(monkeypatch, check_with_traces):
    """`shape_checks.check_traced` under `torch.compile(fullgraph=True, dynamic=True)` traces with no
    graph break through `torch._check_with` (torch 2.13 on) and through `torch._check` (older torch,
    forced here), and refuses mismatched rows either way (with the message where `_check_with` runs)."""
    from torch_paged_kv.ops import shape_checks

    if check_with_traces and not shape_checks.CHECK_WITH_TRACES:
        pytest.skip(f"torch {torch.__version__}: dynamo traces torch._check_with only from 2.13")
    monkeypatch.setattr(shape_checks, "CHECK_WITH_TRACES", check_with_traces)
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, dynamic=True, backend="eager")
    def rows_checked(t: torch.Tensor, rows: int) -> torch.Tensor:
        shape_checks.check_step_rows("key", t, rows, 3, 0)
        return t * 2

    t = torch.randn(5, 2)
    torch.testing.assert_close(rows_checked(t, 5), t * 2)
    match = "key: layer 3 got other new rows than layer 0" if check_with_traces else None
    with pytest.raises((ValueError, RuntimeError), match=match):  # (dynamo wraps a failing traced check)
        rows_checked(torch.randn(6, 2), 7)
