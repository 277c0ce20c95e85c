"""`flash_attention`'s `tree_mask` (speculative decoding's tree verification) on every backend that
runs on CPU (`reference`, `cpu`, `triton` under the interpreter), against the fp64 oracle on
contiguous K/V (`testing.attention_fp64`, written from the op contract alone)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from test_sliding_pages import drop_pages

import torch_paged_kv as pk
from torch_paged_kv import ops
from torch_paged_kv.ops.cpu import kernels as cpu_kernels
from torch_paged_kv.testing import ATTENTION_TOLERANCE, attention_fp64, make_paged_batch


@pytest.fixture(params=["reference", "cpu", "triton"])
def backend(request, force_backend):
    force_backend(request.param)
    return request.param


def _int64(bits: int) -> int:
    """An unsigned 64-bit pattern as the int64 holding it."""
    return bits - (1 << 64) if bits >= 1 << 63 else bits


def tree_bits(parents: list[int]) -> list[int]:
    """Each draft token's mask of itself and its ancestors, from `parents` (-1: a root, whose parent is
    the last cached token; else an earlier draft's index)."""
    bits: list[int] = []
    for i, parent in enumerate(parents):
        assert parent < i
        bits.append((1 << i) | (bits[parent] if parent >= 0 else 0))
    return [_int64(b) for b in bits]


def random_tree(n: int, rng: random.Random, deep: bool = False) -> list[int]:
    """Parents of a random tree of n drafts; `deep`: each one's parent among the 3 before it (depths
    about n / 2, so windows and chunks cut through its paths)."""
    return [-1] + [rng.randrange(max(i - 3, -1) if deep else -1, i) for i in range(1, n)]


def _tree_step(cached: list[int], new: list[int], seed: int, deep: bool = False, **options):
    rng = random.Random(seed)
    b = make_paged_batch(cached, new, page_size=4, group=2, head_dim=32, seed=seed, **options)
    mask = torch.tensor([m for n in new for m in tree_bits(random_tree(n, rng, deep))], dtype=torch.int64)
    return b, mask


def _attend(b, tree_mask, **options):
    pk.store_kv(b.new_keys, b.new_values, b.blocks, *b.step, b.layer_idx)
    return pk.flash_attention(b.q, b.blocks, *b.step, b.layer_idx, 0.3, tree_mask=tree_mask, **options)


def _expected(b, tree_mask, **options):
    return attention_fp64(b.q, b.keys, b.values, b.cache_lengths.tolist(), 0.3, tree_mask=tree_mask, **options)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_random_trees_match_fp64(backend, dtype):
    """A ragged batch of trees (one with no cache, one of 64 drafts: bit 63 is the sign bit), a plain
    decode row among them (its mask is bit 0)."""
    b, mask = _tree_step([5, 0, 17, 40], [9, 12, 1, 64], seed=3, dtype=dtype)
    out = _attend(b, mask)
    torch.testing.assert_close(out.double(), _expected(b, mask), **ATTENTION_TOLERANCE[dtype])


def test_a_chain_is_causal_attention(backend):
    """The tree of one branch (each draft sees every earlier one) is plain causal attention."""
    b = make_paged_batch([5, 0, 17], [7, 3, 5], page_size=4, group=2, head_dim=32, seed=5)
    chain = torch.tensor([m for n in [7, 3, 5] for m in tree_bits(list(range(-1, n - 1)))], dtype=torch.int64)
    out = _attend(b, chain)
    plain = pk.flash_attention(b.q, b.blocks, *b.step, b.layer_idx, 0.3)
    torch.testing.assert_close(out, plain, **ATTENTION_TOLERANCE[torch.float32])
    torch.testing.assert_close(out.double(), _expected(b, None), **ATTENTION_TOLERANCE[torch.float32])


def test_trees_with_sinks_and_split_key_ranges(backend, monkeypatch):
    """Long cached prefixes (the cpu kernels told to split key ranges at 16 keys; the interpreter
    splits past 256) and attention sinks on top of the tree."""
    monkeypatch.setattr(cpu_kernels, "MIN_SPLIT_KEYS", 16)
    monkeypatch.setattr(cpu_kernels, "WANT_ITEMS", 64)
    b, mask = _tree_step([600, 300], [6, 1], seed=7)
    sinks = torch.randn(b.q.shape[1], generator=torch.Generator().manual_seed(1))
    out = _attend(b, mask, sinks=sinks)
    expected = _expected(b, mask, sinks=sinks)
    torch.testing.assert_close(out.double(), expected, **ATTENTION_TOLERANCE[torch.float32])


INTERPRETER_UPCASTS = "Triton's interpreter computes bf16 pages in fp32 too: the bf16 case runs the same code"


def _storage_window_fp64(b, mask: torch.Tensor, window: int) -> torch.Tensor:
    """Tree attention with the window measured from each draft's place in the step (cache_length + t)
    instead of its depth: what the contract must not compute."""
    out, row = [], 0
    for k, v, cached in zip(b.keys, b.values, b.cache_lengths.tolist(), strict=True):
        group = b.q.shape[1] // k.shape[1]
        for t in range(k.shape[0] - cached):
            bits = int(mask[row].item())
            keys = [j for j in range(cached) if cached + t - j < window]
            keys += [cached + u for u in range(64) if cached + u < k.shape[0] and (bits >> u) & 1]
            kk = k[keys].double().repeat_interleave(group, dim=1)  # [keys, Hq, D]
            vv = v[keys].double().repeat_interleave(group, dim=1)
            weights = (torch.einsum("hd,khd->hk", b.q[row].double(), kk) * 0.3).softmax(-1)
            out.append(torch.einsum("hk,khd->hd", weights, vv))
            row += 1
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [65, 150])
def test_trees_with_a_window_wider_than_64(backend, monkeypatch, dtype, window):
    """A sliding window measured from each draft's depth (cache_length + depth - 1), on long cached
    prefixes with split key ranges (cpu kernels told to split at 16 keys), a 40-draft tree crossing
    the cpu kernels' 32-token items and Triton's query tiles, and a 64-draft tree."""
    if backend == "triton" and dtype == torch.float32:
        pytest.skip(INTERPRETER_UPCASTS)
    monkeypatch.setattr(cpu_kernels, "MIN_SPLIT_KEYS", 16)
    monkeypatch.setattr(cpu_kernels, "WANT_ITEMS", 64)
    b, mask = _tree_step([600, 300, 20, 90], [40, 1, 7, 64], seed=13, dtype=dtype)
    expected = _expected(b, mask, sliding_window=window)
    # the depth matters: some draft sees other cached keys than its place in the step would show
    assert (expected - _storage_window_fp64(b, mask, window)).abs().amax() > 0.05
    out = _attend(b, mask, sliding_window=window)
    torch.testing.assert_close(out.double(), expected, **ATTENTION_TOLERANCE[dtype])


def depths(mask: torch.Tensor) -> list[int]:
    """Each row's depth: the bits of its mask (itself and its ancestors)."""
    return [bin(bits % 2**64).count("1") for bits in mask.tolist()]


def hidden_ancestors(b, mask: torch.Tensor, window: int = -1, chunk: int = -1) -> int:
    """(row, ancestor) pairs of the step whose positions (depths) put the ancestor out of the row's
    window or chunk: what the mask shows and the rules hide."""
    hidden, row = 0, 0
    for cached, new in zip(b.cache_lengths.tolist(), (b.input_row_offsets.diff()).tolist(), strict=True):
        bits, depth = mask[row : row + new].tolist(), depths(mask[row : row + new])
        for r, t in itertools.product(range(new), range(new)):
            if t != r and (bits[r] >> t) & 1:
                p, pt = cached + depth[r] - 1, cached + depth[t] - 1
                hidden += (0 < window <= p - pt) or (chunk > 0 and p // chunk != pt // chunk)
        row += new
    return hidden


WINDOWS_AND_CHUNKS = [
    {"sliding_window": 1},
    {"sliding_window": 3},
    {"sliding_window": 17},
    {"sliding_window": 64},
    {"attention_chunk_size": 1},
    {"attention_chunk_size": 4},
    {"attention_chunk_size": 16},
    {"attention_chunk_size": 100},
    {"sliding_window": 17, "attention_chunk_size": 16},
    {"sliding_window": 3, "attention_chunk_size": 4, "causal": False},
]


def _ids(option: dict) -> str:
    return ",".join(
        f"{k.replace('sliding_window', 'w').replace('attention_chunk_size', 'c')}={v}" for k, v in option.items()
    )


@pytest.mark.parametrize("option", WINDOWS_AND_CHUNKS, ids=_ids)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_trees_with_windows_and_chunks_match_fp64(backend, monkeypatch, dtype, option):
    """Windows of 64 or less and chunks, measured between positions (a new token's is its depth), on
    a ragged batch: long cached prefixes with split key ranges (cpu kernels told to split at 16 keys),
    one sequence with no cache, a 40-draft tree crossing the cpu kernels' 32-token items and Triton's
    query tiles, a plain decode row and a 64-draft tree; attention sinks on top. The rules hide some
    ancestors the mask shows."""
    if backend == "triton" and dtype == torch.float32:
        pytest.skip(INTERPRETER_UPCASTS)
    monkeypatch.setattr(cpu_kernels, "MIN_SPLIT_KEYS", 16)
    monkeypatch.setattr(cpu_kernels, "WANT_ITEMS", 64)
    b, mask = _tree_step([600, 0, 93, 20, 90], [40, 12, 1, 7, 64], seed=13, deep=True, dtype=dtype)
    window, chunk = option.get("sliding_window", -1), option.get("attention_chunk_size", -1)
    assert hidden_ancestors(b, mask, window, chunk) > 0 or window == 64  # (64: only the deepest of 64 drafts)
    sinks = torch.randn(b.q.shape[1], generator=torch.Generator().manual_seed(3))
    out = _attend(b, mask, sinks=sinks, **option)
    expected = _expected(b, mask, sinks=sinks, **option)
    torch.testing.assert_close(out.double(), expected, **ATTENTION_TOLERANCE[dtype])


@pytest.mark.parametrize(
    "option",
    [{"sliding_window": 3}, {"attention_chunk_size": 4}, {"sliding_window": 5, "attention_chunk_size": 4}],
    ids=_ids,
)
def test_a_chain_is_causal_attention_with_windows_and_chunks(backend, option):
    """A chain's depths are its places in the step: the tree rules give plain causal attention with
    the same window and chunks (and sinks)."""
    b = make_paged_batch([5, 0, 17, 30], [7, 3, 5, 33], page_size=4, group=2, head_dim=32, seed=5)
    new = [7, 3, 5, 33]
    chain = torch.tensor([m for n in new for m in tree_bits(list(range(-1, n - 1)))], dtype=torch.int64)
    sinks = torch.randn(b.q.shape[1], generator=torch.Generator().manual_seed(2))
    out = _attend(b, chain, sinks=sinks, **option)
    plain = pk.flash_attention(b.q, b.blocks, *b.step, b.layer_idx, 0.3, sinks=sinks, **option)
    torch.testing.assert_close(out, plain, **ATTENTION_TOLERANCE[torch.float32])
    torch.testing.assert_close(
        out.double(), _expected(b, None, sinks=sinks, **option), **ATTENTION_TOLERANCE[torch.float32]
    )


@pytest.mark.parametrize("option", [{"sliding_window": 70}, {"sliding_window": 5, "attention_chunk_size": 8}], ids=_ids)
def test_a_tree_with_a_window_runs_in_a_step_plan(backend, option):
    b, mask = _tree_step([200, 90], [12, 30], seed=17, deep=True)
    pk.store_kv(b.new_keys, b.new_values, b.blocks, *b.step, b.layer_idx)
    plan = pk.StepPlan(b.blocks, pk.StepTensors(*b.step), first_layer=0)
    out = plan.flash_attention(b.q, b.layer_idx, 0.3, tree_mask=mask, **option)
    expected = _expected(b, mask, **option)
    torch.testing.assert_close(out.double(), expected, **ATTENTION_TOLERANCE[torch.float32])


@pytest.mark.parametrize("window", [2, 5, 9])
def test_a_tree_with_a_narrow_window_reads_only_held_pages(backend, window):
    """Pages below what the step's first token's window needs are gone (the null page; what they held
    poisoned), as a sliding group's manager leaves them: a tree row, whose window starts at its depth,
    never reads them."""
    b, mask = _tree_step([5, 17, 30, 41], [9, 12, 1, 20], seed=window, deep=True, fill=300.0)
    assert drop_pages(b, window) > 0
    out = _attend(b, mask, sliding_window=window)
    expected = _expected(b, mask, sliding_window=window)
    torch.testing.assert_close(out.double(), expected, **ATTENTION_TOLERANCE[torch.float32])


@pytest.mark.parametrize(
    "option", [{"sliding_window": 5}, {"sliding_window": 2}, {"attention_chunk_size": 4}], ids=_ids
)
def test_an_unchecked_cpu_row_without_its_own_bit_reads_nothing_before_the_first_token(force_backend, option):
    """An `.unchecked` mask row holding no bit (depth 0: position cached - 1) reads no key before
    those the step's first token sees: poisoning those pages (NaN, as a given-back page that another
    sequence reused while the table still names it) changes nothing. The cpu kernels read only the
    keys in each row's range; Triton's tiles read a page's keys and mask them (a given-back page is
    the null page there, as the manager leaves it), and the reference gathers every page."""
    force_backend("cpu")
    window, chunk = option.get("sliding_window", 0), option.get("attention_chunk_size", 0)
    cached, new, page = [12, 9, 8], [3, 2, 3], 4
    b, mask = _tree_step(cached, new, seed=29)
    starts = b.input_row_offsets[:-1].long()
    mask[starts] = 0  # each sequence's root
    mask[starts[0] + 2] = 0
    pk.store_kv(b.new_keys, b.new_values, b.blocks, *b.step, b.layer_idx)
    clean = ops.flash_attention_unchecked(b.q, b.blocks, *b.step, b.layer_idx, 0.3, tree_mask=mask, **option)
    poisoned = 0
    for row, length in enumerate(cached):
        first = max(length - window + 1, 0) if window else length // chunk * chunk  # the first token's oldest key
        below = max(length - 1 - window + 1, 0) if window else (length - 1) // chunk * chunk  # depth 0's
        poisoned += first // page > below // page
        b.blocks[b.lookup_table[row, : first // page].long()] = float("nan")
    assert poisoned > 0  # some row's depth-0 range starts on a poisoned page
    out = ops.flash_attention_unchecked(b.q, b.blocks, *b.step, b.layer_idx, 0.3, tree_mask=mask, **option)
    torch.testing.assert_close(out, clean, rtol=0, atol=0)
    assert torch.isfinite(out).all()


def test_a_tree_of_more_than_64_drafts_is_refused(backend):
    b = make_paged_batch([3, 2], [65, 1], page_size=4, group=2, head_dim=32, seed=2)
    mask = torch.full((66,), -1, dtype=torch.int64)
    with pytest.raises(ValueError, match="^tree_mask: sequence 0 has 65 new tokens"):
        pk.flash_attention(b.q, b.blocks, *b.step, b.layer_idx, 0.3, tree_mask=mask)
    # unchecked, draft 64 and later are simply never seen: no read or shift past the bits
    out = ops.flash_attention_unchecked(b.q, b.blocks, *b.step, b.layer_idx, 0.3, tree_mask=mask)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize(
    "mask, message",
    [
        (torch.ones(7, dtype=torch.int32), "1-D int64"),
        (torch.ones(7, 1, dtype=torch.int64), "1-D int64"),
        (torch.ones(6, dtype=torch.int64), "expected 7 entries like q"),
    ],
)
def test_bad_tree_masks_are_rejected(force_backend, mask, message):
    force_backend("reference")
    b = make_paged_batch([3, 2], [6, 1], page_size=4, group=2, head_dim=32)
    with pytest.raises(ValueError, match=f"^tree_mask: .*{message}"):
        pk.flash_attention(b.q, b.blocks, *b.step, b.layer_idx, 0.3, tree_mask=mask)


def test_step_plan_passes_the_tree(backend):
    b, mask = _tree_step([5, 9], [4, 6], seed=11)
    pk.store_kv(b.new_keys, b.new_values, b.blocks, *b.step, b.layer_idx)
    plan = pk.StepPlan(b.blocks, pk.StepTensors(*b.step), first_layer=0)
    plan.flash_attention(b.q, 0, 0.3, tree_mask=mask)
    out = plan.flash_attention(b.q, b.layer_idx, 0.3, tree_mask=mask)  # a later layer: the kept kernel
    torch.testing.assert_close(out.double(), _expected(b, mask), **ATTENTION_TOLERANCE[torch.float32])


def test_a_row_without_its_own_bit_is_refused(backend):
    """Each row's mask holds itself (its depth, which places its window, counts it): a mask that
    leaves a row's own bit out is refused, naming the row, before anything is read."""
    b, mask = _tree_step([5, 9], [4, 6], seed=3)
    bad = mask.clone()
    bad[6] &= ~(1 << 2)  # sequence 1's new token 2
    with pytest.raises(ValueError, match=r"^tree_mask: row 6 lacks its own bit 2"):
        pk.flash_attention(b.q, b.blocks, *b.step, b.layer_idx, 0.3, tree_mask=bad)
    pk.flash_attention(b.q, b.blocks, *b.step, b.layer_idx, 0.3, tree_mask=mask)


@pytest.mark.parametrize(
    "option",
    [
        {"sliding_window": 1},
        {"sliding_window": 4},
        {"attention_chunk_size": 4},
        {"sliding_window": 3, "attention_chunk_size": 8},
        {"sliding_window": 2, "causal": False},
    ],
    ids=_ids,
)
def test_masks_naming_later_drafts_count_them_in_depths(backend, monkeypatch, option):
    """The checks take a row whose mask also names later new tokens (only its own bit is required);
    its depth counts them, so its position (a query's and a key's) passes its place in the step, and
    every backend must still follow the contract: a key deeper than its place is seen by the rows
    whose window or chunk holds its position (cpu items split at 16 keys)."""
    monkeypatch.setattr(cpu_kernels, "MIN_SPLIT_KEYS", 16)
    monkeypatch.setattr(cpu_kernels, "WANT_ITEMS", 64)
    rng = random.Random(23)
    b, mask = _tree_step([40, 0, 9], [12, 6, 20], seed=23)
    row = 0
    for new in (b.input_row_offsets.diff()).tolist():  # 2 to 4 later bits in the first half of the rows
        for t in range(new // 2):
            for later in rng.sample(range(t + 1, new), rng.randrange(2, 5)):
                mask[row + t] |= 1 << later
        row += new
    places = torch.cat([torch.arange(n) for n in b.input_row_offsets.diff().tolist()])
    assert (torch.tensor(depths(mask)) - 1 > places).sum() > 5
    out = _attend(b, mask, **option)
    torch.testing.assert_close(out.double(), _expected(b, mask, **option), **ATTENTION_TOLERANCE[torch.float32])
