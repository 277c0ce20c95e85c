"""The `cpu` backend's MLA kernels (`store_latent`, `mla_attention`): stores bit for bit as the reference
stores, attention against an fp64 oracle written here (rows gathered through the table in fp64 from
what the pool holds, plain softmax) and against the reference, over every pool kind, page sizes 1 /
16 / 64, ragged prefill + decode steps, causal or not, sparse key lists with -1 and duplicate
entries, sinks, split key ranges and threads; unchecked calls with wild page ids or key positions
read nothing outside the sequence's pages."""

from __future__ import annotations

import pytest
import torch

import torch_paged_kv as pk
from torch_paged_kv import ops
from torch_paged_kv.layout import NULL_PAGE
from torch_paged_kv.ops import reference_mla
from torch_paged_kv.ops.cpu import kernels
from torch_paged_kv.testing import ATTENTION_TOLERANCE, make_mla_batch

pytestmark = pytest.mark.usefixtures("cpu_backend")

KINDS = {  # pool: (dtype, quantization)
    "fp32": (torch.float32, {}),
    "bf16": (torch.bfloat16, {}),
    "fp16": (torch.float16, {}),
    "e4m3-per-token": (torch.float8_e4m3fn, {}),
    "e4m3-granule8": (torch.float8_e4m3fn, dict(quantization_granularity=8)),
    "e5m2-per-token": (torch.float8_e5m2, {}),
    "e4m3-static": (torch.float8_e4m3fn, dict(static_scales=(0.02,))),
}
RANK, ROPE = 40, 8  # not multiples of the vector width: the padded tails run


@pytest.fixture
def cpu_backend(force_backend):
    if pk.backend_info("cpu")["mla_attention"] != "cpu":
        pytest.skip("the cpu kernels cannot be built here")
    force_backend("cpu")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes (NaNs compare equal by their bits)."""
    return t.view(torch.uint8)


def _batch(kind: str, cached, new, page_size: int, heads: int = 5, q_dtype=None, seed: int = 0, **kw):
    dtype, quantization = KINDS[kind]
    return make_mla_batch(
        cached, new, page_size=page_size, num_heads=heads, kv_lora_rank=kw.pop("rank", RANK),
        rope_dim=kw.pop("rope", ROPE), dtype=dtype, q_dtype=q_dtype, seed=seed, **quantization, **kw,
    )  # fmt: skip


# -- store_latent -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_store_latent_is_the_reference_bit_for_bit(kind, page_size):
    """Every pool kind, every source dtype an FP8 pool takes, special values (NaN, inf, zeros, huge)
    in the rows, and a table naming the null page and a page outside the pool for some rows (an
    unchecked call: those rows are skipped by both)."""
    for q_dtype in (None, torch.float32, torch.float16) if KINDS[kind][0].itemsize == 1 else (None,):
        b = _batch(kind, [3, 0, 17], [2, 19, 1], page_size, q_dtype=q_dtype, seed=page_size)
        latent, rope = b.new_latent.clone(), b.new_rope.clone()
        latent[0, 3], latent[1, :8], latent[2, 5], latent[3] = float("nan"), 0.0, float("inf"), 0.0
        latent[4, 0], rope[5, 1] = 6e4 if latent.dtype == torch.float16 else 1e30, float("-inf")
        table = b.lookup_table.clone()
        table[1, 1] = NULL_PAGE if page_size == 16 else table[1, 1]
        table[1, 3 if page_size == 1 else 0] = 10**6
        step = (b.cache_lengths, table, b.input_row_offsets)
        pools = []
        for store in (reference_mla.store_latent, ops.store_latent_unchecked):
            blocks, scales = b.blocks.clone(), None if b.scales is None else b.scales.clone()
            store(latent, rope, blocks, *step, b.layer_idx, scales)
            pools.append((blocks, scales))
        (want, want_scales), (got, got_scales) = pools
        assert torch.equal(_bits(got), _bits(want))
        assert got_scales is None or torch.equal(_bits(got_scales), _bits(want_scales))
        assert not torch.equal(_bits(got), _bits(b.blocks))  # (rows were written)
        assert torch.equal(_bits(got[NULL_PAGE]), _bits(b.blocks[NULL_PAGE]))


# -- mla_attention against fp64 and the reference ------------------------------------------------------


def _rows_fp64(b, s: int, kv_len: int) -> torch.Tensor:
    """`[kv_len, rank + rope]` fp64: sequence s's rows as the pool holds them, through its table."""
    blocks, page_size = b.blocks, b.blocks.shape[3]
    table = b.lookup_table if b.lookup_table.dim() == 2 else b.lookup_table[:, None]
    pos = torch.arange(kv_len)
    pages = table[s, pos // page_size].long() if table.shape[1] > 1 else table[s, 0].long().expand(kv_len)
    rows = blocks[pages, 0, b.layer_idx, pos % page_size, 0]  # [kv_len, width]
    rank = b.q_nope.shape[2]
    if b.scales is None:
        return rows.double()
    latent = rows[:, :rank].double()
    rope = rows[:, rank:].view(torch.uint8).contiguous().view(torch.bfloat16).double()
    if b.scales.dim() == 1:
        latent = latent * b.scales[0].double()
    else:
        row_scales = b.scales[pages, 0, b.layer_idx, pos % page_size, 0].double()  # [kv_len, groups]
        latent = (latent.view(kv_len, row_scales.shape[1], -1) * row_scales[..., None]).view(kv_len, rank)
    return torch.cat((latent, rope), dim=1)


def _oracle(b, scale: float, causal: bool, key_positions=None, sinks=None) -> torch.Tensor:
    """fp64 absorbed MLA from the op contract, query row by query row: scores over the keys it may see
    (dense: 0 .. its position, or all when not causal; sparse: the listed entries among those, each
    as often as listed), plain softmax with each head's sink logit in the denominator, times the latents."""
    q = torch.cat((b.q_nope.double(), b.q_rope.double()), dim=2)
    rank = b.q_nope.shape[2]
    out = torch.zeros(b.q_nope.shape, dtype=torch.float64)
    offsets, cached = b.input_row_offsets.tolist(), b.cache_lengths.tolist()
    for s in range(len(cached)):
        new = offsets[s + 1] - offsets[s]
        rows = _rows_fp64(b, s, cached[s] + new)
        for i in range(new):
            t = offsets[s] + i
            last = cached[s] + i if causal else cached[s] + new - 1
            if key_positions is None:
                keys = rows[: last + 1]
            else:
                keys = rows[[p for p in key_positions[t].tolist() if 0 <= p <= last]]
            scores = q[t] @ keys.T * scale  # [heads, keys]
            if sinks is not None:
                scores = torch.cat((scores, sinks.double()[:, None]), dim=1)
            if scores.shape[1] == 0:
                continue
            weights = torch.softmax(scores, dim=1)[:, : keys.shape[0]]
            out[t] = weights @ keys[:, :rank]
    return out


def _check(b, scale=0.11, causal=True, key_positions=None, sinks=None):
    ops.store_latent(b.new_latent, b.new_rope, b.blocks, *b.step, b.layer_idx, b.scales)
    args = (b.q_nope, b.q_rope, b.blocks, *b.step, b.layer_idx, scale, causal, b.scales, key_positions, sinks)
    got = ops.mla_attention(*args)
    assert got.shape == b.q_nope.shape and got.dtype == b.q_nope.dtype and got.is_contiguous()
    tolerance = ATTENTION_TOLERANCE[got.dtype]
    expected = _oracle(b, scale, causal, key_positions, sinks)
    torch.testing.assert_close(got.double(), expected.to(got.dtype).double(), **tolerance)
    torch.testing.assert_close(got, reference_mla.mla_attention(*args), **tolerance)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_dense_attention_matches_fp64_and_the_reference(kind, page_size):
    """A ragged step of decode and prefill rows (one sequence past a page, one starting empty)."""
    b = _batch(kind, [37, 0, 70, 5], [1, 9, 1, 3], page_size, seed=page_size + len(kind))
    _check(b, causal=page_size != 16)


@pytest.mark.parametrize("kind", ["bf16", "e4m3-per-token", "e5m2-per-token", "e4m3-static"])
def test_bf16_dot_product_scores(kind):
    """bf16 queries over bf16 rows or FP8 latents of one scale per token (rank a multiple of 32: the
    codes' bf16 values, the scale on the score, where the CPU has AVX512-BF16), prefill and decode."""
    b = _batch(kind, [45, 0], [1, 6], 16, heads=6, rank=64, rope=8, seed=len(kind))
    assert b.q_nope.dtype == torch.bfloat16
    _check(b, sinks=torch.randn(6))


@pytest.mark.parametrize("heads, rank, rope", [(70, 64, 16), (3, 20, 6), (16, 48, 0)])
def test_head_blocks_and_widths(heads, rank, rope):
    """Over 64 heads (head blocks per token), few heads with odd widths, no rope."""
    _check(_batch("fp32", [20, 3], [1, 4], 16, heads=heads, rank=rank, rope=rope, seed=heads), causal=False)


def test_continuous_batching_slots():
    _check(_batch("bf16", [12, 0], [1, 6], 24, continuous=True, seed=3))


def _key_positions(b, k: int, causal: bool, seed: int) -> torch.Tensor:
    """`[total, k]` random entries each query may see, with -1 entries and duplicates."""
    gen = torch.Generator().manual_seed(seed)
    offsets, cached = b.input_row_offsets.tolist(), b.cache_lengths.tolist()
    rows = []
    for s in range(len(cached)):
        new = offsets[s + 1] - offsets[s]
        for i in range(new):
            last = cached[s] + i if causal else cached[s] + new - 1
            row = torch.randint(0, last + 1, (k,), generator=gen)
            row[torch.rand(k, generator=gen) < 0.2] = -1
            row[1] = row[0]  # a duplicate (counts twice)
            rows.append(row)
    return torch.stack(rows).int()


@pytest.mark.parametrize("kind", ["fp32", "bf16", "e4m3-granule8", "e5m2-per-token", "e4m3-static"])
@pytest.mark.parametrize("causal", [True, False])
def test_sparse_attention_with_sinks(kind, causal):
    b = _batch(kind, [50, 0, 9], [1, 5, 2], 16, seed=len(kind) + causal)
    positions = _key_positions(b, 45, causal, seed=4)
    positions[3] = -1  # a query with no key: zeros (sinks: zeros too)
    sinks = torch.randn(b.q_nope.shape[1])
    _check(b, causal=causal, key_positions=positions, sinks=sinks)


def test_dense_attention_with_sinks():
    b = _batch("bf16", [30, 2], [1, 6], 16, seed=9)
    _check(b, sinks=torch.randn(b.q_nope.shape[1]) * 3)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("sparse", [False, True])
def test_split_key_ranges_and_threads(monkeypatch, threads, sparse):
    """Key ranges split into many parts (merged after), on one thread and on two."""
    monkeypatch.setattr(kernels, "WANT_ITEMS", 64)
    monkeypatch.setattr(kernels, "MIN_SPLIT_KEYS", 3)
    monkeypatch.setattr(kernels, "MIN_WORK_PER_THREAD", 1)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        b = _batch("e4m3-per-token", [130, 77, 0], [1, 1, 4], 16, rank=64, seed=threads + 2 * sparse)
        sinks = torch.randn(b.q_nope.shape[1])
        positions = _key_positions(b, 90, True, seed=threads) if sparse else None
        _check(b, key_positions=positions, sinks=sinks)
    finally:
        torch.set_num_threads(previous)


def test_backend_info_names_cpu_for_mla_caches():
    params = pk.KVCacheParams.mla(torch.float8_e4m3fn, 2, 16)
    info = pk.backend_info("cpu", params)
    assert info["store_latent"] == info["mla_attention"] == "cpu"


# -- unchecked calls never read outside the sequence's pages ---------------------------------------------


@pytest.mark.parametrize("kind", ["bf16", "e4m3-granule8"])
def test_unchecked_wild_entries_read_only_the_sequences_pages(kind):
    """The pool sits in a buffer of NaN and every page no sequence owns holds NaN (FP8: NaN latent
    codes); tables name such pages past each sequence's length; key_positions list positions the
    query may not see, positions far past the table, and below -1. An unchecked call must give what
    the same call with those entries as -1 gives (a read of any NaN row would poison the output)."""
    b = _batch(kind, [20, 3], [1, 2], 4, spare_pages=3, seed=1)
    fp8 = b.blocks.element_size() == 1
    pad, numel = 512, b.blocks.numel()
    if fp8:
        buffer = torch.full((numel + 2 * pad,), 0x7F, dtype=torch.uint8).view(b.blocks.dtype)  # e4m3fn NaN
    else:
        buffer = torch.full((numel + 2 * pad,), float("nan"), dtype=b.blocks.dtype)
    pool = buffer[pad : pad + numel].view(b.blocks.shape)
    pool.copy_(b.blocks)
    owned = set(b.lookup_table[b.lookup_table != NULL_PAGE].tolist())
    spare = [p for p in range(1, pool.shape[0]) if p not in owned]
    if fp8:
        pool.view(torch.uint8)[spare] = 0x7F
    else:
        pool[spare] = float("nan")
    b.blocks = pool
    table = b.lookup_table.clone()
    table[0, 6:] = spare[0]  # past sequence 0's 21 tokens (6 pages of 4)
    table[1, 2:] = spare[1]  # past sequence 1's 5
    ops.store_latent(b.new_latent, b.new_rope, b.blocks, *b.step, b.layer_idx, b.scales)
    step = (b.cache_lengths, table, b.input_row_offsets)
    for causal in (True, False):
        clean = _key_positions(b, 12, causal, seed=2)
        wild = clean.clone()
        wild[:, -4:] = torch.tensor([24, 10**6, -(2**31), 2**31 - 1], dtype=torch.int32)  # NaN pages, or none
        clean[:, -4:] = -1
        if causal:
            wild[1, -5], clean[1, -5] = 4, -1  # row 1 (sequence 1 at position 3) may not see position 4
        args = (b.q_nope, b.q_rope, b.blocks, *step, b.layer_idx, 0.2, causal, b.scales)
        got = ops.mla_attention_unchecked(*args, wild)
        assert not got.isnan().any()
        torch.testing.assert_close(got, ops.mla_attention(*args, clean), rtol=0, atol=0)
        assert not ops.mla_attention_unchecked(*args).isnan().any()  # dense: no page past the lengths read
