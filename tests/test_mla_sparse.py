"""Sparse absorbed MLA and MLA sinks: `mla_attention` with `key_positions` (each query attends to the
keys it lists, DeepSeek-V3.2's DSA) and with `sinks` (HY-V4), against fp64 oracles over the rows the
cache holds, kept contiguous by the test; validation, the unchecked overload's bounds, opcheck and a
compiled decode step."""

from __future__ import annotations

import pytest
import torch
from test_mla import QUANT

import torch_paged_kv as pk
from torch_paged_kv.testing import ATTENTION_TOLERANCE, make_mla_batch, mla_attention_fp64
from torch_paged_kv.testing.mla import random_key_positions, sparse_mla_attention_fp64

CASES = {  # (cached, new, page_size, continuous, heads, rank, rope, dtype, causal, k)
    "decode-page4": ([13, 6, 30], [1, 1, 1], 4, False, 4, 32, 16, torch.float32, True, 5),
    "prefill-ragged-page8": ([0, 0, 9], [7, 3, 5], 8, False, 4, 32, 16, torch.float32, True, 4),
    "chunked-bf16": ([11, 2], [4, 6], 4, False, 8, 64, 16, torch.bfloat16, True, 6),
    "slots-non-causal": ([10, 0, 5], [2, 6, 1], 24, True, 2, 32, 8, torch.float32, False, 3),
    "k-above-lengths": ([2, 0], [1, 3], 4, False, 4, 16, 16, torch.float32, True, 16),
}


def case_batch(case: tuple, seed: int, dtype: torch.dtype | None = None, **quantization):
    """The MLA batch of a `CASES`-shaped case (cached, new, page_size, continuous, heads, rank, rope, dtype,
    causal, k), in `dtype` if given."""
    cached, new, page_size, continuous, heads, rank, rope, case_dtype, _, _ = case
    return make_mla_batch(
        cached,
        new,
        page_size=page_size,
        continuous=continuous,
        num_heads=heads,
        kv_lora_rank=rank,
        rope_dim=rope,
        dtype=dtype or case_dtype,
        seed=seed,
        **quantization,
    )


def _batch(name: str, dtype: torch.dtype | None = None, **quantization):
    return case_batch(CASES[name], len(name), dtype, **quantization)


def _run(
    b, key_positions: torch.Tensor | None, scale: float, causal: bool = True, overload: str = "default", sinks=None
) -> torch.Tensor:
    pk.store_latent(b.new_latent, b.new_rope, b.blocks, *b.step, b.layer_idx, b.scales)
    op = getattr(torch.ops.paged_kv.mla_attention, overload)
    return op(b.q_nope, b.q_rope, b.blocks, *b.step, b.layer_idx, scale, causal, b.scales, key_positions, sinks)


@pytest.mark.parametrize("name", CASES)
def test_sparse_mla_attention_matches_fp64(name):
    causal, k = CASES[name][8], CASES[name][9]
    b = _batch(name)
    positions = random_key_positions(b, k, seed=len(name), causal=causal)
    scale = (b.q_nope.shape[2] + b.q_rope.shape[2]) ** -0.5
    got = _run(b, positions, scale, causal)
    assert got.shape == b.q_nope.shape and got.dtype == b.q_nope.dtype and got.is_contiguous()
    torch.testing.assert_close(
        got, sparse_mla_attention_fp64(b, positions, scale, causal).to(got.dtype), **ATTENTION_TOLERANCE[got.dtype]
    )


@pytest.mark.parametrize("kind", ["fp8-per-token", "fp8-granule8", "e5m2-static"])
def test_sparse_mla_attention_on_fp8_rows_matches_fp64_over_what_the_cache_holds(kind):
    dtype, quantization = QUANT[kind]
    b = _batch("chunked-bf16", dtype, **quantization)
    positions = random_key_positions(b, 6, seed=3)
    got = _run(b, positions, 0.1)
    torch.testing.assert_close(
        got, sparse_mla_attention_fp64(b, positions, 0.1).to(got.dtype), **ATTENTION_TOLERANCE[got.dtype]
    )


def test_listing_every_visible_key_is_dense_attention():
    b = _batch("prefill-ragged-page8")
    offsets, lengths = b.input_row_offsets.tolist(), b.cache_lengths.tolist()
    width = max(lengths[s] + offsets[s + 1] - offsets[s] for s in range(len(lengths)))
    rows = []
    for s in range(len(lengths)):
        for i in range(offsets[s + 1] - offsets[s]):
            row = torch.full((width,), -1, dtype=torch.int32)
            row[: lengths[s] + i + 1] = torch.arange(lengths[s] + i + 1, dtype=torch.int32).flip(0)
            rows.append(row)
    sparse = _run(b, torch.stack(rows), 0.2)
    dense = pk.mla_attention(b.q_nope, b.q_rope, b.blocks, *b.step, b.layer_idx, 0.2)
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-6)


def test_a_listed_twice_key_counts_twice_and_a_query_with_no_key_gets_zeros():
    b = _batch("decode-page4")
    positions = torch.tensor([[3, 3, 7, -1, -1], [-1] * 5, [0, 29, 30, -1, 30]], dtype=torch.int32)
    got = _run(b, positions, 0.3)
    torch.testing.assert_close(
        got, sparse_mla_attention_fp64(b, positions, 0.3).float(), **ATTENTION_TOLERANCE[torch.float32]
    )
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    once = sparse_mla_attention_fp64(b, torch.tensor([[3, 7, -1, -1, -1]] * 3, dtype=torch.int32), 0.3)
    assert not torch.allclose(got[0].double(), once[0], rtol=1e-3)  # the duplicate weighs in


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_sinks_match_fp64(name, sparse):
    """Each head's sink logit joins its softmax denominator (dense: the fp64 MHA oracle's sinks; sparse:
    the per-query oracle's); magnitudes near the scores', so they matter."""
    causal, k = CASES[name][8], CASES[name][9]
    b = _batch(name)
    scale = (b.q_nope.shape[2] + b.q_rope.shape[2]) ** -0.5
    sinks = torch.randn(b.q_nope.shape[1], generator=torch.Generator().manual_seed(9)) * 2
    positions = random_key_positions(b, k, seed=len(name), causal=causal) if sparse else None
    got = _run(b, positions, scale, causal, sinks=sinks)
    if sparse:
        expected = sparse_mla_attention_fp64(b, positions, scale, causal, sinks)
    else:
        expected = mla_attention_fp64(
            b.q_nope, b.q_rope, b.latents, b.ropes, b.cache_lengths.tolist(), scale, causal, sinks
        )
    torch.testing.assert_close(got, expected.to(got.dtype), **ATTENTION_TOLERANCE[got.dtype])
    without = pk.mla_attention(b.q_nope, b.q_rope, b.blocks, *b.step, b.layer_idx, scale, causal, b.scales, positions)
    assert not torch.allclose(got, without, rtol=1e-2)  # the sinks weigh in


def test_bad_sinks_are_refused_naming_them():
    b = _batch("decode-page4")
    for sinks, message in [
        (torch.zeros(3), "expected 4 entries"),
        (torch.zeros(4, dtype=torch.float64), "expected a 1-D float32"),
        (torch.zeros(8)[::2], "expected unit stride"),
    ]:
        with pytest.raises(ValueError, match=f"^sinks: {message}"):
            _run(b, None, 0.2, sinks=sinks)


REJECTED = {  # case: (override of key_positions, message)
    "int64": (lambda p: p.long(), "expected dtype int32"),
    "1-D": (lambda p: p[:, 0], "expected 2 dims"),
    "rows": (lambda p: p[:-1], "rows like q_nope"),
    "no columns": (lambda p: p[:, :0], "at least one column"),
    "strided rows": (lambda p: torch.cat((p, p), dim=1)[:, ::2], "unit stride|contiguous rows"),
    "a future key": (
        lambda p: p.index_fill(1, torch.tensor([0]), 0).index_put_(
            (torch.tensor([1]), torch.tensor([0])), torch.tensor(7, dtype=torch.int32)
        ),
        "row 1 lists position 7",
    ),
    "a key past the sequence": (
        lambda p: p.index_put_((torch.tensor([2]), torch.tensor([1])), torch.tensor(31, dtype=torch.int32)),
        "row 2 lists position 31",
    ),
    "below -1": (
        lambda p: p.index_put_((torch.tensor([0]), torch.tensor([2])), torch.tensor(-2, dtype=torch.int32)),
        "row 0 lists position -2",
    ),
}


@pytest.mark.parametrize("case", REJECTED)
def test_bad_key_positions_are_refused_naming_them(case):
    override, message = REJECTED[case]
    b = _batch("decode-page4")
    pk.store_latent(b.new_latent, b.new_rope, b.blocks, *b.step, b.layer_idx, b.scales)
    positions = override(random_key_positions(b, 5, seed=1, none_share=0.0))
    with pytest.raises(ValueError, match=f"^key_positions: .*({message})"):
        pk.mla_attention(b.q_nope, b.q_rope, b.blocks, *b.step, b.layer_idx, 0.2, True, b.scales, positions)


def test_step_plan_checks_each_layers_key_positions():
    """Every layer picks its own keys: a `StepPlan` checks them at later layers too (whose step tensors
    it leaves unchecked), naming `key_positions`."""
    b = make_mla_batch([13, 6], [1, 1], page_size=4, num_layers=2, layer_idx=1, seed=3)
    plan = pk.StepPlan(b.blocks, pk.StepTensors(*b.step))
    positions = torch.tensor([[0, 13], [6, -1]], dtype=torch.int32)
    for layer in (0, 1):
        plan.store_latent(b.new_latent, b.new_rope, layer)
        assert plan.mla_attention(b.q_nope, b.q_rope, layer, 0.2, key_positions=positions).shape == b.q_nope.shape
    with pytest.raises(ValueError, match="^key_positions: row 0 lists position 14"):
        plan.mla_attention(b.q_nope, b.q_rope, 1, 0.2, key_positions=positions + 1)


def test_unchecked_call_skips_keys_it_may_not_see():
    """Entries past what a query may see, past the table, or below -1 read nothing: they count as -1."""
    b = _batch("decode-page4")  # sequences of 14, 7 and 31 keys, one query each, at their last position
    positions = random_key_positions(b, 5, seed=2)
    wild = positions.clone()
    wild[:, -1] = torch.tensor([14, 2**31 - 1, -(2**31)], dtype=torch.int32)
    expected = sparse_mla_attention_fp64(
        b, torch.cat((positions[:, :-1], torch.full((3, 1), -1, dtype=torch.int32)), dim=1), 0.2
    )
    got = _run(b, wild, 0.2, overload="unchecked")
    torch.testing.assert_close(got, expected.float(), **ATTENTION_TOLERANCE[torch.float32])


@pytest.mark.parametrize("overload", ["default", "unchecked"])
def test_opcheck_sparse_mla_attention(overload):
    b = _batch("chunked-bf16")
    pk.store_latent(b.new_latent, b.new_rope, b.blocks, *b.step, b.layer_idx, b.scales)
    torch.library.opcheck(
        getattr(torch.ops.paged_kv.mla_attention, overload),
        (b.q_nope, b.q_rope, b.blocks, *b.step, b.layer_idx, 0.3),
        {"causal": True, "scales": None, "key_positions": random_key_positions(b, 6, seed=4)},
    )


def test_sparse_decode_step_compiles_fullgraph_without_recompiling():
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    params = pk.KVCacheParams.mla(torch.float32, 1, page_size=4, kv_lora_rank=32, rope_dim=16)
    collection = pk.PagedKVCacheCollection(params, num_pages=64, max_batch_size=8, max_seq_len=24)
    collection.blocks.copy_(torch.randn(collection.blocks.shape, generator=gen))
    collection.lookup_table[:, :6] = (torch.randperm(64, generator=gen)[:48] + 1).view(8, 6).int()

    def step_fn(q_nope, q_rope, positions, plan: pk.StepPlan):
        return plan.mla_attention(q_nope, q_rope, 0, 0.2, key_positions=positions) * 2

    @torch.compile(fullgraph=True, dynamic=True)
    def compiled(q_nope, q_rope, positions, blocks, *step):
        return step_fn(q_nope, q_rope, positions, pk.StepPlan(blocks, pk.StepTensors(*step)))

    for i, batch in enumerate([1, 3, 5, 8, 2]):
        step = collection.step_tensors(batch)
        lengths = torch.randint(3, 20, (batch,), generator=gen, dtype=torch.int32)
        step.cache_lengths.copy_(lengths)
        step.input_row_offsets.copy_(torch.arange(batch + 1, dtype=torch.int32))
        q_nope, q_rope = (torch.randn(batch, 4, n, generator=gen) for n in (32, 16))
        positions = (torch.rand(batch, 3, generator=gen) * (lengths[:, None] + 1)).int()
        pk.mark_step_dynamic(step, q_nope, q_rope, positions)
        expected = step_fn(q_nope, q_rope, positions, pk.StepPlan(collection.blocks, step))
        if i == 1:
            torch.compiler.set_stance("fail_on_recompile")
        try:
            out = compiled(q_nope, q_rope, positions, collection.blocks, *step)
        finally:
            torch.compiler.set_stance("default")
        assert torch.equal(out, expected)
