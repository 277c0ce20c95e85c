"""Triton's sparse MLA kernel (`mla_attention` with `key_positions`, `ops/triton/mla_sparse.py`) under
TRITON_INTERPRET=1 on CPU tensors, against the fp64 oracle `testing.mla.sparse_mla_attention_fp64`:
decode, ragged and chunked prefill, slots, non-causal, k past the lengths, duplicates, rows with no
key, 16/32-bit and FP8 rows, split decode, head blocks with masked heads; the unchecked overload's
wild entries; which backend takes such a call. Tiny shapes: the interpreter runs every program in
Python."""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("a GPU is visible: tests/gpu covers the Triton kernels", allow_module_level=True)

from test_mla import QUANT
from test_mla_sparse import case_batch

import torch_paged_kv as pk
from torch_paged_kv.ops import dispatch
from torch_paged_kv.ops import splits as split_rule
from torch_paged_kv.ops.records import MLAAttentionArgs
from torch_paged_kv.ops.triton import KERNELS, mla_attention, mla_sparse, unavailable_reason
from torch_paged_kv.testing import ATTENTION_TOLERANCE, make_mla_batch
from torch_paged_kv.testing.mla import random_key_positions, sparse_mla_attention_fp64

if unavailable_reason(torch.device("cpu")) is not None:
    pytest.fail(f"Triton kernels cannot run on CPU tensors here: {unavailable_reason(torch.device('cpu'))}")


@pytest.fixture(autouse=True)
def force_triton(force_backend):
    force_backend("triton")


CASES = {  # (cached, new, page_size, continuous, heads, rank, rope, dtype, causal, k)
    "decode-page1-h20": ([13, 6, 30], [1, 1, 1], 1, False, 20, 32, 16, torch.float16, True, 7),  # 2 head blocks
    "prefill-ragged-page16": ([0, 0, 0], [7, 1, 5], 16, False, 4, 32, 16, torch.bfloat16, True, 5),
    "chunked-page64": ([70, 2], [3, 4], 64, False, 4, 32, 16, torch.float32, True, 6),
    "slots-non-causal": ([10, 0, 5], [2, 4, 1], 24, True, 4, 32, 8, torch.float32, False, 4),
    "k-above-lengths-no-rope": ([2, 0], [1, 3], 4, False, 4, 16, 0, torch.bfloat16, True, 16),
}


def _batch(name: str, dtype: torch.dtype | None = None, **quantization):
    return case_batch(CASES[name], len(name), dtype, **quantization)


def _run(b, positions: torch.Tensor, scale: float, causal: bool = True, overload: str = "default") -> torch.Tensor:
    pk.store_latent(b.new_latent, b.new_rope, b.blocks, *b.step, b.layer_idx, b.scales)
    op = getattr(torch.ops.paged_kv.mla_attention, overload)
    return op(b.q_nope, b.q_rope, b.blocks, *b.step, b.layer_idx, scale, causal, b.scales, positions)


def _check(b, positions: torch.Tensor, scale: float, causal: bool = True) -> torch.Tensor:
    got = _run(b, positions, scale, causal)
    assert got.shape == b.q_nope.shape and got.dtype == b.q_nope.dtype
    expected = sparse_mla_attention_fp64(b, positions, scale, causal).to(got.dtype)
    torch.testing.assert_close(got, expected, **ATTENTION_TOLERANCE[got.dtype])
    return got


@pytest.mark.parametrize("name", CASES)
def test_sparse_mla_attention_matches_fp64(name):
    causal, k = CASES[name][8], CASES[name][9]
    b = _batch(name)
    _check(b, random_key_positions(b, k, seed=len(name), causal=causal), 0.2, causal)


@pytest.mark.parametrize("kind", ["fp8-per-token", "fp8-granule8", "e5m2-static"])
@pytest.mark.parametrize("hardware", [False, True])
def test_fp8_rows_match_fp64_over_what_the_cache_holds(kind, hardware, monkeypatch):
    """The integer decode (sm_80, the interpreter) and the sm_89+ hardware conversion (emulated exactly
    by the interpreter for these finite codes)."""
    monkeypatch.setattr(mla_attention, "hardware_fp8", lambda device: hardware)
    dtype, quantization = QUANT[kind]
    b = _batch("prefill-ragged-page16", dtype, **quantization)
    positions = random_key_positions(b, 5, seed=3)
    a = MLAAttentionArgs(b.q_nope, b.q_rope, b.blocks, *b.step, b.layer_idx, 0.1, True, b.scales, positions)
    assert mla_sparse.plan_mla_sparse(a)[1][0].kwargs["HW_FP8"] is hardware
    _check(b, positions, 0.1)


def test_a_key_listed_twice_counts_twice_and_a_query_with_no_key_gets_zeros():
    b = make_mla_batch([13, 6, 30], [1, 1, 1], page_size=4, seed=7)  # 14, 7 and 31 keys
    positions = torch.tensor([[3, 3, 7, -1, -1], [-1] * 5, [0, 29, 30, -1, 30]], dtype=torch.int32)
    got = _check(b, positions, 0.3)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    once = sparse_mla_attention_fp64(b, torch.tensor([[3, 7, -1, -1, -1]] * 3, dtype=torch.int32), 0.3)
    assert not torch.allclose(got[0].double(), once[0], rtol=1e-3)  # the duplicate weighs in


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_split_decode_merges_splits_some_empty(dtype, monkeypatch):
    """Decode over 40 entries in 16-entry tiles dealt to 3 splits: a split whose entries are all -1 (the
    shorter rows) or a row with none at all (zeros) merges to the right answer."""
    monkeypatch.setattr(split_rule, "MIN_SPLIT_KEYS", 16)
    b = make_mla_batch([60, 40, 9], [1, 1, 1], page_size=8, dtype=dtype, seed=2)
    positions = random_key_positions(b, 40, seed=5, none_share=0.1)
    positions[2] = -1
    a = MLAAttentionArgs(b.q_nope, b.q_rope, b.blocks, *b.step, b.layer_idx, 0.2, True, b.scales, positions)
    launches = mla_sparse.plan_mla_sparse(a)[1]
    assert len(launches) == 2 and launches[0].grid == (3, 1, 3)  # split attention, then the merge
    got = _check(b, positions, 0.2)
    assert torch.equal(got[2], torch.zeros_like(got[2]))


SINK_CASES = {  # name: (CASES entry or None for the split decode batch, pool kind, splits)
    "decode-page1-h20": ("decode-page1-h20", None, 1),  # 2 head blocks, one partial
    "prefill-ragged-page16": ("prefill-ragged-page16", None, 1),
    "decode-split": (None, None, 3),
    "decode-split-fp8-per-token": (None, "fp8-per-token", 3),
}


@pytest.mark.parametrize("name", SINK_CASES)
def test_sinks_match_fp64(name, monkeypatch):
    """Each head's sink logit joins its rows' denominators: at the end of a program, or once in the
    merge of split decode (splits whose entries are all -1 included); a query with no key still gets
    zeros (row 2, listing none)."""
    case, kind, splits = SINK_CASES[name]
    dtype, quantization = QUANT[kind] if kind else (None, {})
    if case is None:
        monkeypatch.setattr(split_rule, "MIN_SPLIT_KEYS", 16)
        b = make_mla_batch([60, 40, 9], [1, 1, 1], page_size=8, dtype=dtype or torch.bfloat16, seed=2, **quantization)
        positions = random_key_positions(b, 40, seed=5, none_share=0.1)
    else:
        b = _batch(case, dtype, **quantization)
        positions = random_key_positions(b, CASES[case][9], seed=len(name))
    positions[2] = -1
    sinks = torch.randn(b.q_nope.shape[1], generator=torch.Generator().manual_seed(len(name))) + 3  # e^3: ~10 keys
    a = MLAAttentionArgs(b.q_nope, b.q_rope, b.blocks, *b.step, b.layer_idx, 0.2, True, b.scales, positions, sinks)
    launches = mla_sparse.plan_mla_sparse(a)[1]
    assert launches[0].grid[2] == splits and all(launch.kwargs["SINK"] for launch in launches)
    pk.store_latent(b.new_latent, b.new_rope, b.blocks, *b.step, b.layer_idx, b.scales)
    got = pk.mla_attention(b.q_nope, b.q_rope, b.blocks, *b.step, b.layer_idx, 0.2, True, b.scales, positions, sinks)
    expected = sparse_mla_attention_fp64(b, positions, 0.2, True, sinks).to(got.dtype)
    torch.testing.assert_close(got, expected, **ATTENTION_TOLERANCE[got.dtype])
    assert torch.equal(got[2], torch.zeros_like(got[2]))


@pytest.mark.parametrize("splits", [1, 2])
def test_64_head_tiles_mask_the_heads_past_the_last(splits, monkeypatch):
    """The tile sm_90 takes at 64+ heads (64 heads x 32 keys, forced here): 72 heads make two head
    blocks, the second mostly masked rows."""
    monkeypatch.setattr(mla_attention, "_blocks_for", lambda *_: (64, 1, 32, 8))
    monkeypatch.setattr(mla_sparse, "num_splits", lambda *_: splits)
    b = make_mla_batch([40, 3], [1, 2], page_size=16, num_heads=72, dtype=torch.bfloat16, seed=6)
    positions = random_key_positions(b, 36, seed=6)
    a = MLAAttentionArgs(b.q_nope, b.q_rope, b.blocks, *b.step, b.layer_idx, 0.2, True, b.scales, positions)
    assert mla_sparse.plan_mla_sparse(a)[1][0].grid == (3 * 2, 1, splits)
    _check(b, positions, 0.2)


def test_unchecked_call_skips_entries_it_may_not_see_or_whose_page_is_bad():
    """Entries past what a query may see (inside its pages, which hold random rows), past the table,
    below -1, and on table entries naming no page of the pool read nothing: the result is bit for bit
    that of the call with them as -1."""
    b = make_mla_batch([13, 6, 30], [1, 1, 1], page_size=4, seed=8)  # 14, 7 and 31 keys
    pk.store_latent(b.new_latent, b.new_rope, b.blocks, *b.step, b.layer_idx)
    table = b.lookup_table.clone()
    table[2, 6:8] = torch.tensor([-1, b.blocks.shape[0]], dtype=torch.int32)  # keys 24..31 of sequence 2
    positions = random_key_positions(b, 8, seed=2, none_share=0.0)
    positions[2, :3] = torch.tensor([25, 30, 5], dtype=torch.int32)
    wild = positions.clone()
    wild[:, -3:] = torch.tensor([[14, 15, -2], [2**31 - 1, 7, -(2**31)], [31, 2**31 - 1, -(2**31)]], dtype=torch.int32)
    skipped = wild.clone()
    skipped[:, -3:] = -1
    skipped[2][skipped[2] >= 24] = -1

    def run(listed: torch.Tensor) -> torch.Tensor:
        step = (b.cache_lengths, table, b.input_row_offsets)
        return torch.ops.paged_kv.mla_attention.unchecked(
            b.q_nope, b.q_rope, b.blocks, *step, b.layer_idx, 0.2, True, None, listed
        )

    got = run(wild)
    assert torch.equal(got, run(skipped))
    torch.testing.assert_close(
        got, sparse_mla_attention_fp64(b, skipped, 0.2).float(), **ATTENTION_TOLERANCE[torch.float32]
    )


def _deepseek_call(total: int, batch: int, heads: int, k: int = 2048) -> MLAAttentionArgs:
    """Meta tensors of a sparse DeepSeek-V3.2 call (kv_lora_rank 512, rope 64, bf16, pages of 64)."""

    def meta(*shape, dtype=torch.bfloat16):
        return torch.empty(shape, dtype=dtype, device="meta")

    index = torch.int32
    return MLAAttentionArgs(
        meta(total, heads, 512), meta(total, heads, 64), meta(batch * 40 + 1, 1, 61, 64, 1, 576),
        meta(batch, dtype=index), meta(batch, 40, dtype=index), meta(batch + 1, dtype=index), 3, 192**-0.5,
        True, None, meta(total, k, dtype=index),
    )  # fmt: skip


def test_deepseek_decode_splits_its_2048_entries_and_prefill_does_not(monkeypatch):
    """One token per program over 16-head tiles (not sm_90's 64-head ones, which `WGMMA_TILES` picks
    under older triton): a decode of 4 tokens at 128 heads is 32 programs, so its 2048 entries split 8
    ways (256 each: `ops/splits.py`, an H100's 132 SMs on meta), merged; a 1024-token prefill does not."""
    monkeypatch.setattr(mla_attention, "WGMMA_TILES", False)
    out, launches = mla_sparse.plan_mla_sparse(_deepseek_call(4, 4, 128))
    assert out.shape == (4, 128, 512) and [launch.grid for launch in launches] == [(32, 1, 8), (4, 128)]
    assert launches[0].kwargs["BLOCK_H"] * 8 == 128
    launches = mla_sparse.plan_mla_sparse(_deepseek_call(1024, 2, 128))[1]
    assert [launch.grid for launch in launches] == [(1024 * 8, 1, 1)]


def test_triton_takes_sparse_calls_on_cuda(force_backend, monkeypatch):
    """`supports` accepts `key_positions` and `sinks`, and the default order on CUDA picks Triton for such a call
    (Triton's availability on CUDA, which this interpreter process lacks, patched in)."""
    force_backend(None)
    a = _deepseek_call(4, 4, 128)
    kernel, supports = KERNELS["mla_attention"][:2]
    assert supports(a) and supports(a._replace(key_positions=None))
    sinks = torch.empty(128, device="meta")
    assert supports(a._replace(sinks=sinks)) and supports(a._replace(key_positions=None, sinks=sinks))
    assert not supports(a._replace(q_nope=a.q_nope.float(), scales=torch.empty(1, device="meta")))
    monkeypatch.setitem(dispatch._availability, "triton", lambda device: None)
    assert dispatch.select("mla_attention", torch.device("cuda"), a) is kernel
    assert pk.backend_info("cuda")["mla_attention"] == "triton"
