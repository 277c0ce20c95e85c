"""Every rejected call raises ValueError naming the argument, and leaves `blocks` bit-identical.

Each test runs with either CPU backend forced (`reference`, `cpu`): the checks run before the
backend, and what a backend does with a bad call that skipped them differs (below)."""

import pytest
import torch

import torch_paged_kv as pk
import torch_paged_kv.ops as ops
from torch_paged_kv.ops import reference
from torch_paged_kv.testing import make_paged_batch

CACHED, NEW = [5, 9, 0], [2, 1, 3]


@pytest.fixture(params=["reference", "cpu"], autouse=True)
def backend(request, force_backend):
    force_backend(request.param)
    return request.param


def _batch():
    return make_paged_batch(CACHED, NEW, page_size=4, seed=7)


def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


def _store(b, **over):
    args = dict(
        key=b.new_keys,
        value=b.new_values,
        blocks=b.blocks,
        cache_lengths=b.cache_lengths,
        lookup_table=b.lookup_table,
        input_row_offsets=b.input_row_offsets,
        layer_idx=b.layer_idx,
    )
    args.update(over)
    pk.store_kv(*args.values())


STORE_CASES = {
    "key dtype": ("key", lambda b: dict(key=b.new_keys.double())),
    "key heads": ("key", lambda b: dict(key=b.new_keys[:, :1])),
    "key head_dim": ("key", lambda b: dict(key=b.new_keys[..., :16])),
    "value rows": ("value", lambda b: dict(value=b.new_values[:-1])),
    "key rows vs offsets": ("input_row_offsets", lambda b: dict(key=b.new_keys[:-1], value=b.new_values[:-1])),
    "int64 lengths": ("cache_lengths", lambda b: dict(cache_lengths=b.cache_lengths.long())),
    "table rows": ("lookup_table", lambda b: dict(lookup_table=b.lookup_table[:2])),
    "table 3-D": ("lookup_table", lambda b: dict(lookup_table=b.lookup_table[None])),
    "strided lengths": ("cache_lengths", lambda b: dict(cache_lengths=b.cache_lengths.repeat_interleave(2)[::2])),
    "strided table": ("lookup_table", lambda b: dict(lookup_table=b.lookup_table.repeat_interleave(2, 1)[:, ::2])),
    "offsets length": ("input_row_offsets", lambda b: dict(input_row_offsets=b.input_row_offsets[:-1])),
    "offsets start": ("input_row_offsets", lambda b: dict(input_row_offsets=b.input_row_offsets + 1)),
    "offsets order": ("input_row_offsets", lambda b: dict(input_row_offsets=_i32([0, 3, 2, 6]))),
    "negative length": ("cache_lengths", lambda b: dict(cache_lengths=_i32([5, -1, 0]))),
    "past the table": ("cache_lengths", lambda b: dict(cache_lengths=_i32([5, 9, b.lookup_table.shape[1] * 4]))),
    "page out of range": ("lookup_table", lambda b: dict(lookup_table=_bad_page(b, 0, 1, 10_000))),
    "negative page": ("lookup_table", lambda b: dict(lookup_table=_bad_page(b, 2, 0, -1))),
    "write into the null page": ("lookup_table", lambda b: dict(lookup_table=_bad_page(b, 1, 2, pk.NULL_PAGE))),
    "key requires grad": ("key", lambda b: dict(key=b.new_keys.clone().requires_grad_())),
    "layer": ("layer_idx", lambda b: dict(layer_idx=2)),
    "negative layer": ("layer_idx", lambda b: dict(layer_idx=-1)),
    "blocks 5-D": ("blocks", lambda b: dict(blocks=b.blocks[0])),
    "blocks strided": ("blocks", lambda b: dict(blocks=b.blocks.transpose(4, 5))),
}


def _bad_page(b, row, col, page):
    table = b.lookup_table.clone()
    table[row, col] = page
    return table


@pytest.mark.parametrize("case", list(STORE_CASES))
def test_store_kv_rejects_and_writes_nothing(case):
    b = _batch()
    name, override = STORE_CASES[case]
    over = override(b)
    before = b.blocks.clone()
    with pytest.raises(ValueError, match=f"^{name}:"):
        _store(b, **over)
    if "blocks" not in over:
        assert torch.equal(b.blocks, before)


def test_store_kv_ignores_pages_it_does_not_touch():
    b = _batch()
    table = b.lookup_table.clone()
    table[0, 5:] = 10_000  # entries past what sequence 0 reaches are never read
    _store(b, lookup_table=table)


def test_device_mismatch_is_named():
    b = _batch()
    with pytest.raises(ValueError, match="^cache_lengths:.*device"):
        _store(b, cache_lengths=b.cache_lengths.to("meta"))


@pytest.mark.parametrize(
    "name, over",
    [
        ("q", dict(q_heads=3)),
        ("softmax_scale", dict(softmax_scale=0.0)),
        ("softmax_scale", dict(softmax_scale=float("nan"))),
        ("softcap", dict(softcap=-1.0)),
        ("input_row_offsets", dict(q_rows=-1)),
        ("lookup_table", dict(bad_page=True)),
        ("lookup_table", dict(null_page=True)),
        ("q", dict(requires_grad=True)),
    ],
)
def test_flash_attention_rejects(name, over):
    b = _batch()
    q = b.q[: b.q.shape[0] + over.get("q_rows", 0)]
    if "q_heads" in over:
        q = torch.randn(q.shape[0], over["q_heads"], q.shape[2])
    if over.get("requires_grad"):
        q = q.clone().requires_grad_()
    table = _bad_page(b, 1, 2, 99) if over.get("bad_page") else b.lookup_table
    if over.get("null_page"):  # reading tokens from a page the sequence never got
        table = _bad_page(b, 0, 0, pk.NULL_PAGE)
    before = b.blocks.clone()
    with pytest.raises(ValueError, match=f"^{name}:"):
        pk.flash_attention(
            q,
            b.blocks,
            b.cache_lengths,
            table,
            b.input_row_offsets,
            b.layer_idx,
            over.get("softmax_scale", 0.5),
            softcap=over.get("softcap", 0.0),
        )
    assert torch.equal(b.blocks, before)


def test_gather_kv_rejects_short_max_kv_len():
    b = _batch()
    with pytest.raises(ValueError, match="^max_kv_len:"):
        pk.gather_kv(b.blocks, *b.step, b.layer_idx, 9)
    with pytest.raises(ValueError, match="^max_kv_len:"):
        pk.gather_kv(b.blocks, *b.step, b.layer_idx, -1)


@pytest.mark.parametrize(
    "name, src, dst",
    [
        ("src_pages", [1, 99], [2, 3]),
        ("dst_pages", [1, 2], [3, -1]),
        ("dst_pages", [1, 2], [3, 3]),
        ("dst_pages", [1, 2], [3]),
        ("dst_pages", [1, 2], [3, pk.NULL_PAGE]),
    ],
)
def test_copy_pages_rejects_and_writes_nothing(name, src, dst):
    b = _batch()
    before = b.blocks.clone()
    with pytest.raises(ValueError, match=f"^{name}:"):
        pk.copy_pages(b.blocks, _i32(src), _i32(dst))
    assert torch.equal(b.blocks, before)


def test_copy_pages_rejects_int64_ids():
    b = _batch()
    with pytest.raises(ValueError, match="^src_pages:.*int32"):
        pk.copy_pages(b.blocks, torch.tensor([1]), _i32([2]))


def test_shapes_only_mode_skips_value_checks(monkeypatch, backend):
    b = _batch()
    monkeypatch.setenv("TORCH_PAGED_KV_VALIDATE", "shapes")
    with pytest.raises(ValueError, match="^key:"):
        _store(b, key=b.new_keys.double())  # shape/dtype checks always run
    before = b.blocks.clone()
    bad_table = _bad_page(b, 0, 1, 10_000)  # sequence 0's new tokens (positions 5, 6)
    _store(b, lookup_table=bad_table)  # value checks skipped: every backend skips rows whose page is out of range
    expected = before.clone()
    reference.store_kv(
        b.new_keys[2:],
        b.new_values[2:],
        expected,
        b.cache_lengths[1:],
        b.lookup_table[1:],
        b.input_row_offsets[1:] - 2,
        1,
    )
    assert torch.equal(b.blocks, expected)


def test_unchecked_overloads_skip_the_value_checks_only(backend):
    b = _batch()
    duplicate = _i32([3, 3])
    with pytest.raises(ValueError, match="^dst_pages:"):
        pk.copy_pages(b.blocks, _i32([1, 2]), duplicate)
    ops.copy_pages_unchecked(b.blocks, _i32([1, 2]), duplicate)  # value checks skipped: accepted
    outside = (b.cache_lengths, _bad_page(b, 0, 1, 10_000), b.input_row_offsets, b.layer_idx)
    with pytest.raises(ValueError, match="^lookup_table:"):
        pk.flash_attention(b.q, b.blocks, *outside, 0.5)
    # every backend keeps page ids inside blocks: a wrong answer, but no read outside it
    assert ops.flash_attention_unchecked(b.q, b.blocks, *outside, 0.5).shape == b.q.shape
    step = (b.cache_lengths, b.lookup_table, b.input_row_offsets, b.layer_idx)
    with pytest.raises(ValueError, match="^key:"):  # shape checks still run
        ops.store_kv_unchecked(b.new_keys.double(), b.new_values, b.blocks, *step)
    with pytest.raises(ValueError, match="^q:"):
        ops.flash_attention_unchecked(b.q[..., :16], b.blocks, *step, 0.5)
    with pytest.raises(ValueError, match="^max_kv_len:"):
        ops.gather_kv_unchecked(b.blocks, *step, -1)


def test_grad_is_fine_when_disabled():
    b = _batch()
    q = b.q.clone().requires_grad_()
    with torch.no_grad():
        pk.flash_attention(q, b.blocks, *b.step, b.layer_idx, 0.5)
    with torch.inference_mode():
        pk.flash_attention(q, b.blocks, *b.step, b.layer_idx, 0.5)
