"""The CPU backends (`reference`, the oracle, and `cpu`, the compiled kernels) against references
written independently: fp64 math and torch SDPA on contiguous K/V, for ragged batches (prefill,
chunked prefill, decode) over shuffled pages. Every test runs once per backend."""

import itertools

import pytest
import torch
import torch.nn.functional as F

import torch_paged_kv as pk
from torch_paged_kv.testing import ATTENTION_TOLERANCE, attention_fp64, make_paged_batch

DTYPES = list(ATTENTION_TOLERANCE)
BACKENDS = ["reference", "cpu"]
# cached tokens / new tokens: a prefill, a chunked prefill, two decodes, an idle row, a long one
CACHED = [0, 37, 100, 5, 0, 129]
NEW = [9, 6, 1, 1, 0, 3]


@pytest.fixture(params=BACKENDS, autouse=True)
def backend(request, force_backend):
    force_backend(request.param)
    return request.param


def _store_then_attend(batch, scale, **kwargs):
    pk.store_kv(batch.new_keys, batch.new_values, batch.blocks, *batch.step, batch.layer_idx)
    return pk.flash_attention(batch.q, batch.blocks, *batch.step, batch.layer_idx, scale, **kwargs)


def _check(out, ref):
    """`out` (in its dtype) against the fp64 `ref`, with the one attention tolerance table."""
    torch.testing.assert_close(out.double(), ref, **ATTENTION_TOLERANCE[out.dtype])


@pytest.mark.parametrize("page_size, dtype", list(itertools.product([1, 7, 16, 128], DTYPES)))
def test_attention_matches_fp64(page_size, dtype):
    batch = make_paged_batch(
        CACHED, NEW, page_size=page_size, num_kv_heads=2, head_dim=64, group=4, dtype=dtype, seed=page_size
    )
    out = _store_then_attend(batch, 0.125)
    assert out.dtype == dtype and out.shape == batch.q.shape
    ref = attention_fp64(batch.q, batch.keys, batch.values, CACHED, 0.125)
    _check(out, ref)


@pytest.mark.parametrize("head_dim, group", [(64, 1), (128, 4), (256, 8), (128, 8)])
def test_attention_head_dims_and_gqa(head_dim, group):
    batch = make_paged_batch(
        CACHED,
        NEW,
        page_size=16,
        num_kv_heads=2,
        head_dim=head_dim,
        group=group,
        dtype=torch.bfloat16,
        seed=head_dim + group,
    )
    scale = head_dim**-0.5
    ref = attention_fp64(batch.q, batch.keys, batch.values, CACHED, scale)
    _check(_store_then_attend(batch, scale), ref)


@pytest.mark.parametrize(
    "causal, sliding_window, softcap",
    [(False, -1, 0.0), (True, 4, 0.0), (True, 50, 0.0), (True, -1, 2.5), (False, 7, 1.5)],
)
def test_attention_masks_and_softcap(causal, sliding_window, softcap):
    batch = make_paged_batch(CACHED, NEW, page_size=8, group=2, seed=3)
    kwargs = dict(causal=causal, sliding_window=sliding_window, softcap=softcap)
    ref = attention_fp64(batch.q, batch.keys, batch.values, CACHED, 0.4, **kwargs)
    _check(_store_then_attend(batch, 0.4, **kwargs), ref)


def test_mqa_single_kv_head():
    batch = make_paged_batch(CACHED, NEW, page_size=4, num_kv_heads=1, group=8, seed=5)
    ref = attention_fp64(batch.q, batch.keys, batch.values, CACHED, 0.2)
    _check(_store_then_attend(batch, 0.2), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_continuous_batching_layout(dtype):
    batch = make_paged_batch(CACHED, NEW, page_size=160, continuous=True, group=2, dtype=dtype, seed=9)
    assert batch.lookup_table.dim() == 1
    ref = attention_fp64(batch.q, batch.keys, batch.values, CACHED, 0.3)
    _check(_store_then_attend(batch, 0.3), ref)


def test_attention_matches_sdpa_on_contiguous_kv():
    batch = make_paged_batch(CACHED, NEW, page_size=16, num_kv_heads=2, head_dim=64, group=4, seed=11)
    out = _store_then_attend(batch, 64**-0.5)
    row = 0
    for k, v, cached in zip(batch.keys, batch.values, CACHED, strict=True):
        new = k.shape[0] - cached
        if new == 0:
            continue
        q = batch.q[row : row + new].transpose(0, 1)[None]  # [1, Hq, new, D]
        mask = torch.arange(k.shape[0])[None] <= cached + torch.arange(new)[:, None]
        ref = F.scaled_dot_product_attention(
            q, k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask, enable_gqa=True
        )
        torch.testing.assert_close(out[row : row + new], ref[0].transpose(0, 1), atol=2e-5, rtol=1e-5)
        row += new


def test_attention_empty_step():
    batch = make_paged_batch([3, 4], [0, 0], page_size=4, seed=1)
    out = pk.flash_attention(batch.q, batch.blocks, *batch.step, batch.layer_idx, 1.0)
    assert out.shape == (0, 2, 32)


@pytest.mark.parametrize("page_size, continuous", [(1, False), (5, False), (16, False), (160, True)])
def test_store_kv_writes_exactly_the_new_slots(page_size, continuous):
    batch = make_paged_batch(CACHED, NEW, page_size=page_size, continuous=continuous, seed=2)
    expected = batch.blocks.clone()
    for b, (cached, new) in enumerate(zip(CACHED, NEW, strict=True)):
        for t in range(new):
            pos = cached + t
            page = int(batch.lookup_table[b]) if continuous else int(batch.lookup_table[b, pos // page_size])
            expected[page, 0, batch.layer_idx, pos % page_size] = batch.keys[b][pos]
            expected[page, 1, batch.layer_idx, pos % page_size] = batch.values[b][pos]
    assert not torch.equal(expected, batch.blocks)
    pk.store_kv(batch.new_keys, batch.new_values, batch.blocks, *batch.step, batch.layer_idx)
    assert torch.equal(batch.blocks, expected)


@pytest.mark.parametrize("page_size, continuous", [(3, False), (16, False), (160, True)])
def test_gather_kv_pads_with_zeros(page_size, continuous):
    batch = make_paged_batch(CACHED, NEW, page_size=page_size, continuous=continuous, dtype=torch.bfloat16, seed=4)
    pk.store_kv(batch.new_keys, batch.new_values, batch.blocks, *batch.step, batch.layer_idx)
    max_kv_len = 140
    key, value = pk.gather_kv(batch.blocks, *batch.step, batch.layer_idx, max_kv_len)
    assert key.shape == (len(CACHED), max_kv_len, 2, 32) and key.dtype == torch.bfloat16
    for b in range(len(CACHED)):
        n = batch.keys[b].shape[0]
        assert torch.equal(key[b, :n], batch.keys[b]) and torch.equal(value[b, :n], batch.values[b])
        assert not key[b, n:].any() and not value[b, n:].any()


def test_copy_pages_overlapping_lists_read_before_write():
    torch.manual_seed(0)
    blocks = torch.randn(6, 2, 2, 4, 2, 8)
    before = blocks.clone()
    src = torch.tensor([1, 2, 3], dtype=torch.int32)
    dst = torch.tensor([2, 3, 5], dtype=torch.int32)
    pk.copy_pages(blocks, src, dst)
    expected = before.clone()
    expected[2], expected[3], expected[5] = before[1], before[2], before[3]
    assert torch.equal(blocks, expected)


@pytest.mark.parametrize("softcap", [0.0, 3.0])
def test_attention_in_query_chunks_matches_fp64(monkeypatch, softcap):
    """Chunks of query positions (a tiny budget forces one position per chunk of the reference) give
    the same answer."""
    from torch_paged_kv.ops import reference

    monkeypatch.setattr(reference, "CHUNK_BUDGET_BYTES", 1)
    batch = make_paged_batch(CACHED, NEW, page_size=5, num_kv_heads=3, head_dim=32, group=4, seed=21)
    kwargs = dict(sliding_window=40, softcap=softcap)
    ref = attention_fp64(batch.q, batch.keys, batch.values, CACHED, 0.2, **kwargs)
    _check(_store_then_attend(batch, 0.2, **kwargs), ref)


@pytest.mark.parametrize(
    "new, causal, sliding_window",
    [
        ([1, 1, 1], True, -1),  # decode, equal lengths: every query sees its whole sequence (no mask)
        ([1, 1, 1], True, 500),  # a window longer than the sequences changes nothing (no mask)
        ([1, 1, 1], True, 9),  # a window that cuts in needs the mask
        ([6, 6, 6], False, -1),  # non-causal prefill over equal lengths (no mask)
        ([6, 6, 6], True, -1),  # causal prefill needs the mask
    ],
)
def test_attention_with_equal_lengths_matches_fp64(new, causal, sliding_window):
    cached = [30 - n for n in new]
    batch = make_paged_batch(cached, new, page_size=8, group=2, seed=sum(new) + sliding_window)
    kwargs = dict(causal=causal, sliding_window=sliding_window)
    ref = attention_fp64(batch.q, batch.keys, batch.values, cached, 0.3, **kwargs)
    _check(_store_then_attend(batch, 0.3, **kwargs), ref)
