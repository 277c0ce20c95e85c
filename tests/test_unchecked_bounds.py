"""No call, however wrong its step tensors' values, makes a kernel read or write outside its tensors.

The `.unchecked` overloads (and `StepPlan`'s later layers) skip the value checks, so each backend
that runs on CPU (`reference`, `cpu`, `triton` under the interpreter) gets every kind of wrong value
and wrong row count here: a call either raises `ValueError` naming the argument with nothing
written, or completes; either way the sentinel bytes around the pool (and, for Triton's attention,
around its output) are unchanged and the null page is never written. Calls that are valid but whose
tables hold junk past each sequence's length, or point there at reused pages holding NaN, must give
the clean call's result (the contract: only positions below a sequence's length are read).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import torch_paged_kv as pk
from torch_paged_kv import ops
from torch_paged_kv.layout import NULL_PAGE
from torch_paged_kv.ops.records import FlashAttentionArgs
from torch_paged_kv.testing import make_mla_batch, make_paged_batch

CACHED, NEW = [5, 9, 0], [2, 1, 3]
PAD = 256  # sentinel elements on each side of a guarded tensor


def _i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


class Guarded:
    """A copy of `t` inside a larger buffer of random sentinel bytes: `view` is contiguous, and
    `intact()` says whether nothing outside it was written."""

    def __init__(self, t: torch.Tensor, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        itemsize = t.element_size()
        self.buffer = torch.randint(0, 256, ((t.numel() + 2 * PAD) * itemsize,), dtype=torch.uint8, generator=gen)
        self.view = self.buffer.view(t.dtype)[PAD : PAD + t.numel()].view(t.shape)
        self.view.copy_(t)
        self.sentinels = self._outside().clone()

    def _outside(self) -> torch.Tensor:
        edge = PAD * self.view.element_size()
        return torch.cat((self.buffer[:edge], self.buffer[-edge:]))

    def intact(self) -> bool:
        return torch.equal(self._outside(), self.sentinels)


@pytest.fixture(params=["reference", "cpu", "triton"])
def backend(request, force_backend):
    force_backend(request.param)
    return request.param


def _batch(dtype: torch.dtype = torch.float32):
    return make_paged_batch(CACHED, NEW, page_size=4, seed=11, dtype=dtype, spare_pages=4)


# Wrong step values: each maps (batch) -> the changed arguments (rows: q/key rows; the step tensors).
WRONG_VALUES: dict[str, Callable] = {
    "fewer rows than the offsets": lambda b: dict(rows=slice(0, 1)),
    "more rows than the offsets": lambda b: dict(extra_rows=5),
    "offsets past the rows": lambda b: dict(input_row_offsets=b.input_row_offsets + _i32([0, 0, 0, 7])),
    "offsets going down": lambda b: dict(input_row_offsets=_i32([0, 3, 2, 6])),
    "offsets starting below 0": lambda b: dict(input_row_offsets=b.input_row_offsets - 1),
    "negative length": lambda b: dict(cache_lengths=_i32([5, -7, 0])),
    "length past the table": lambda b: dict(cache_lengths=_i32([5, 9, b.lookup_table.shape[1] * 4 + 100])),
    "huge length": lambda b: dict(cache_lengths=_i32([2**30, 9, 0])),
    "the largest length": lambda b: dict(cache_lengths=_i32([5, 2**31 - 1, 0])),  # (+ new tokens: past int32)
    "offsets at the int32 extremes": lambda b: dict(input_row_offsets=_i32([0, 2**31 - 1, -(2**31), 6])),
    "page ids outside the pool": lambda b: dict(lookup_table=_table(b, {(0, 1): 10**6, (2, 0): -5})),
    "the null page where tokens go": lambda b: dict(lookup_table=_table(b, {(0, 1): NULL_PAGE, (1, 2): NULL_PAGE})),
}


def _table(b, entries: dict[tuple[int, int], int]) -> torch.Tensor:
    table = b.lookup_table.clone()
    for (row, col), page in entries.items():
        table[row, col] = page
    return table


def _wrong_call(b, case: str, rows: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """(the new rows, the step tensors) of `case` applied to batch `b` and its new `rows`."""
    over = WRONG_VALUES[case](b)
    if "rows" in over:
        rows = rows[over["rows"]]
    if "extra_rows" in over:
        rows = torch.cat((rows, torch.randn(over["extra_rows"], *rows.shape[1:]).to(rows.dtype)))
    step = tuple(over.get(name, getattr(b, name)) for name in ("cache_lengths", "lookup_table", "input_row_offsets"))
    return rows, step


def _expect_bounded(call: Callable[[], object], pool: Guarded, before: torch.Tensor) -> object:
    """Run `call`: a ValueError leaves the pool as it was; either way nothing outside it and nothing in
    the null page changed. Returns the call's result (None where it raised)."""
    result = None
    try:
        result = call()
    except ValueError:
        assert torch.equal(pool.view, before), "a rejected call wrote to the pool"
    assert pool.intact(), "a kernel wrote outside blocks"
    assert torch.equal(pool.view[NULL_PAGE], before[NULL_PAGE]), "a kernel wrote the null page"
    return result


@pytest.mark.parametrize("case", WRONG_VALUES)
def test_store_kv_unchecked_stays_in_bounds(backend, case):
    b = _batch()
    pool = Guarded(b.blocks)
    before = pool.view.clone()
    key, step = _wrong_call(b, case, b.new_keys)
    value = torch.randn_like(key)
    _expect_bounded(lambda: ops.store_kv_unchecked(key, value, pool.view, *step, b.layer_idx), pool, before)


@pytest.mark.parametrize("case", WRONG_VALUES)
def test_flash_attention_unchecked_stays_in_bounds(backend, case):
    b = _batch()
    pool = Guarded(b.blocks)
    before = pool.view.clone()
    q, step = _wrong_call(b, case, b.q)
    out = _expect_bounded(lambda: ops.flash_attention_unchecked(q, pool.view, *step, b.layer_idx, 0.3), pool, before)
    assert out is None or out.shape == q.shape


@pytest.mark.parametrize("case", WRONG_VALUES)
def test_gather_kv_unchecked_stays_in_bounds(backend, case):
    b = _batch()
    pool = Guarded(b.blocks)
    before = pool.view.clone()
    _, step = _wrong_call(b, case, b.q)
    result = _expect_bounded(lambda: ops.gather_kv_unchecked(pool.view, *step, b.layer_idx, 16), pool, before)
    assert result is None or result[0].shape == (3, 16, *b.blocks.shape[4:])


@pytest.mark.parametrize(
    "src, dst",
    [([1, 2], [NULL_PAGE, 3]), ([1, 10**6], [2, 3]), ([-4, 1], [2, 3]), ([1, 2], [10**6, -1]), ([1, 2], [3, 3])],
)
def test_copy_pages_unchecked_stays_in_bounds(backend, src, dst):
    b = _batch()
    pool = Guarded(b.blocks)
    before = pool.view.clone()
    _expect_bounded(lambda: ops.copy_pages_unchecked(pool.view, _i32(src), _i32(dst)), pool, before)
    untouched = [p for p in range(b.blocks.shape[0]) if p not in dst]
    assert torch.equal(pool.view[untouched], before[untouched])


def test_triton_attention_writes_only_its_output_rows():
    """The Triton kernel bounds its query rows by q's own count, whatever the offsets say: its output
    sits inside sentinels here (the op allocates it, so the launch is rebuilt around a guarded one)."""
    from torch_paged_kv.ops.triton import flash_attention as triton_attention
    from torch_paged_kv.ops.triton.common import Launch

    b = _batch()
    for case in ("fewer rows than the offsets", "offsets past the rows", "offsets starting below 0"):
        q, step = _wrong_call(b, case, b.q)
        out, launches = triton_attention.plan_flash_attention(FlashAttentionArgs(q, b.blocks, *step, b.layer_idx, 0.3))
        guarded = Guarded(out)
        for launch in launches:
            args = tuple(guarded.view if a is out else a for a in launch.args)
            Launch(launch.kernel, launch.grid, args, launch.kwargs)()
        assert guarded.intact(), f"{case}: the kernel wrote outside its output"


# -- valid calls whose tables hold junk past each sequence's length -----------------------------


def _junk_past_lengths(b, stale_page: int) -> torch.Tensor:
    """The table with every entry past each sequence's pages set to junk: ids outside the pool, and
    `stale_page` (a page holding NaN, as a reused page that no sequence here owns may)."""
    table = b.lookup_table.clone()
    page_size = b.blocks.shape[3]
    kv_len = (b.cache_lengths + b.input_row_offsets.diff()).tolist()
    for row, length in enumerate(kv_len):
        used = -(-length // page_size)
        junk = torch.tensor([stale_page, 10**6, -3, 2**31 - 1], dtype=torch.int32)
        table[row, used:] = junk.repeat(table.shape[1])[: table.shape[1] - used]
    return table


def _stale_page(b) -> int:
    """A spare page (no sequence of `b` owns it), filled with NaN."""
    owned = set(b.lookup_table.flatten().tolist())
    page = next(p for p in range(1, b.blocks.shape[0]) if p not in owned)
    b.blocks[page] = float("nan")
    return page


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "unchecked"])
def test_reads_only_below_each_length(backend, checked):
    """Junk table entries past a sequence's length (ids outside the pool, a page holding NaN) change
    nothing: flash_attention and gather_kv read only the positions below each sequence's length."""
    b = _batch()
    pk.store_kv(b.new_keys, b.new_values, b.blocks, *b.step, b.layer_idx)
    clean_out = pk.flash_attention(b.q, b.blocks, *b.step, b.layer_idx, 0.3)
    clean_kv = pk.gather_kv(b.blocks, *b.step, b.layer_idx, 16)
    table = _junk_past_lengths(b, _stale_page(b))
    step = (b.cache_lengths, table, b.input_row_offsets)
    attention = pk.flash_attention if checked else ops.flash_attention_unchecked
    gather = pk.gather_kv if checked else ops.gather_kv_unchecked
    out = attention(b.q, b.blocks, *step, b.layer_idx, 0.3)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, clean_out, rtol=0, atol=0)
    for got, want in zip(gather(b.blocks, *step, b.layer_idx, 16), clean_kv, strict=True):
        assert torch.equal(got, want)


def test_step_plan_rejects_a_later_layer_with_other_rows(backend):
    """A step planned at its first layer for N new rows: a later layer that passes another count
    (transformers' K/V-sharing layers trimmed to `logits_to_keep` did) raises, naming the argument."""
    b = _batch()
    plan = pk.StepPlan(b.blocks, pk.StepTensors(*b.step), first_layer=0)
    plan.store_kv(torch.randn_like(b.new_keys), torch.randn_like(b.new_values), 0)
    plan.flash_attention(b.q, 0, 0.3)
    before = b.blocks.clone()
    with pytest.raises(ValueError, match="^key: layer 1 got 1 rows, but this step has 6"):
        plan.store_kv(b.new_keys[:1], b.new_values[:1], 1)
    with pytest.raises(ValueError, match="^q: layer 1 got 1 rows"):
        plan.flash_attention(b.q[-1:], 1, 0.3)
    assert torch.equal(b.blocks, before)


# -- MLA ----------------------------------------------------------------------------------------

MLA_WRONG = {
    "fewer rows than the offsets": lambda b: dict(rows=slice(0, 1)),
    "offsets past the rows": lambda b: dict(input_row_offsets=b.input_row_offsets + _i32([0, 0, 0, 7])),
    "offsets going down": lambda b: dict(input_row_offsets=_i32([0, 3, 2, 6])),
    "negative length": lambda b: dict(cache_lengths=_i32([5, -7, 0])),
    "length past the table": lambda b: dict(cache_lengths=_i32([5, 9, b.lookup_table.shape[1] * 4 + 100])),
    "page ids outside the pool": lambda b: dict(lookup_table=_table(b, {(0, 1): 10**6, (2, 0): -5})),
    "the null page where tokens go": lambda b: dict(lookup_table=_table(b, {(0, 1): NULL_PAGE})),
}


@pytest.mark.parametrize("mla_backend", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("case", MLA_WRONG)
def test_mla_unchecked_stays_in_bounds(force_backend, case, mla_backend):
    force_backend(mla_backend)
    b = make_mla_batch(CACHED, NEW, page_size=4, seed=5)
    pool = Guarded(b.blocks)
    before = pool.view.clone()
    over = MLA_WRONG[case](b)
    rows = over.get("rows", slice(None))
    step = tuple(over.get(name, getattr(b, name)) for name in ("cache_lengths", "lookup_table", "input_row_offsets"))
    latent, rope = b.new_latent[rows], b.new_rope[rows]
    _expect_bounded(lambda: ops.store_latent_unchecked(latent, rope, pool.view, *step, b.layer_idx), pool, before)
    q_nope, q_rope = b.q_nope[rows], b.q_rope[rows]
    before = pool.view.clone()
    out = _expect_bounded(
        lambda: ops.mla_attention_unchecked(q_nope, q_rope, pool.view, *step, b.layer_idx, 0.2), pool, before
    )
    assert out is None or out.shape == q_nope.shape


def test_a_row_at_a_negative_position_writes_nothing(backend):
    """A length that puts a new row just before position 0 (its column rounds to 0 under C's
    division) stores nothing for that row; the other rows land where they belong (or the call is
    refused, as the cpu kernels refuse any negative length, with nothing written)."""
    b = _batch()
    before = b.blocks.clone()
    lengths = _i32([5, -1, 0])
    key, value = b.new_keys, torch.randn_like(b.new_keys)
    try:
        ops.store_kv_unchecked(key, value, b.blocks, lengths, b.lookup_table, b.input_row_offsets, b.layer_idx)
    except ValueError:
        assert backend == "cpu" and torch.equal(b.blocks, before)
        return
    expected = before.clone()
    offsets, page_size = b.input_row_offsets.tolist(), b.blocks.shape[3]
    for seq in (0, 2):
        for row in range(offsets[seq], offsets[seq + 1]):
            pos = int(lengths[seq]) + row - offsets[seq]
            page = int(b.lookup_table[seq, pos // page_size])
            expected[page, 0, b.layer_idx, pos % page_size] = key[row]
            expected[page, 1, b.layer_idx, pos % page_size] = value[row]
    assert torch.equal(b.blocks, expected)
