"""Fuzzing the ops with random calls, valid and mutated, on every backend that runs on CPU.

Each case builds a random step (batch, lengths, page size, GQA group, head_dim), picks an op and its
checked or `.unchecked` overload, and applies zero to three mutations: an offset, a length or a
table entry changed to a random value, rows of the new tensor dropped or added, junk table entries
past a sequence's length, or entries there pointing at a page no sequence owns, holding NaN. The
pool sits between sentinel bytes.

Whatever the call, it raises `ValueError` with the pool unchanged, or completes; either way nothing
outside the pool and nothing in the null page changed. A call that passed the checked overload is
valid, and must then give the reference backend's result (the same written bytes; attention within
the dtype's tolerance, gathers exactly; a NaN only where the reference has one: a page no sequence
owns never reaches an output).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from torch_paged_kv import ops
from torch_paged_kv.layout import NULL_PAGE
from torch_paged_kv.ops import dispatch
from torch_paged_kv.testing import ATTENTION_TOLERANCE, make_paged_batch

PAD = 128  # sentinel elements on each side of the pool
OPS = ("store_kv", "flash_attention", "gather_kv", "copy_pages")


def _guarded(t: torch.Tensor, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    """(a copy of `t` inside random sentinel bytes, the whole buffer)."""
    raw = bytes(rng.getrandbits(8) for _ in range((t.numel() + 2 * PAD) * t.element_size()))
    buffer = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    view = buffer.view(t.dtype)[PAD : PAD + t.numel()].view(t.shape)
    view.copy_(t)
    return view, buffer


def _outside(buffer: torch.Tensor, itemsize: int) -> torch.Tensor:
    edge = PAD * itemsize
    return torch.cat((buffer[:edge], buffer[-edge:])).clone()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical (NaN included)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _random_step(rng: random.Random):
    batch = rng.randint(1, 4)
    cached = [rng.randint(0, 20) for _ in range(batch)]
    new = [rng.choice([0, 1, 1, 2, 5]) for _ in range(batch)]
    page_size = rng.choice([1, 3, 4, 8])
    return make_paged_batch(
        cached, new, page_size=page_size, group=rng.choice([1, 2]), head_dim=rng.choice([16, 32]),
        spare_pages=3, seed=rng.getrandbits(16),
    )  # fmt: skip


def _mutate(rng: random.Random, b, rows: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], list[str]]:
    """(new rows, step tensors, names of the mutations applied)."""
    cache_lengths, table, offsets = b.cache_lengths.clone(), b.lookup_table.clone(), b.input_row_offsets.clone()
    applied = []
    for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
        kind = rng.choice(["offset", "length", "table", "rows", "junk", "stale", "stale"])
        applied.append(kind)
        if kind == "offset":
            offsets[rng.randrange(len(offsets))] = rng.randint(-3, int(offsets[-1]) + 4)
        elif kind == "length":
            cache_lengths[rng.randrange(len(cache_lengths))] = rng.choice([-2, 0, rng.randint(0, 40), 2**30])
        elif kind == "table":
            row, col = rng.randrange(table.shape[0]), rng.randrange(table.shape[1])
            table[row, col] = rng.choice([NULL_PAGE, -1, b.blocks.shape[0], rng.randint(-10, b.blocks.shape[0] + 10)])
        elif kind == "rows":
            extra = rng.randint(-rows.shape[0], 3)
            rows = (
                rows[: rows.shape[0] + extra] if extra < 0 else torch.cat((rows, torch.randn(extra, *rows.shape[1:])))
            )
        elif kind in ("junk", "stale"):  # valid: entries past each sequence's pages hold junk ids, or
            # point at a page no sequence owns, holding NaN (a reused page)
            spare = sorted(set(range(1, b.blocks.shape[0])) - set(b.lookup_table.flatten().tolist()))
            stale = rng.choice(spare) if spare and kind == "stale" else None
            if stale is not None:
                b.blocks[stale] = float("nan")
            used = -(-(cache_lengths + offsets.diff()).clamp(min=0) // b.blocks.shape[3])
            for r, n in enumerate(used.tolist()):
                if 0 <= n < table.shape[1]:
                    table[r, n:] = stale if stale is not None else rng.choice([-7, 10**6, b.blocks.shape[0]])
    return rows, (cache_lengths, table, offsets), applied


def _call(op: str, checked: bool, b, pool: torch.Tensor, rows: torch.Tensor, step, rng: random.Random) -> Callable:
    fn = getattr(ops, op if checked else f"{op}_unchecked")
    if op == "store_kv":
        return lambda: fn(rows, rows.flip(0).clone(), pool, *step, b.layer_idx)
    if op == "flash_attention":
        heads = rows.shape[1] * (b.q.shape[1] // b.blocks.shape[4])
        q = rows.repeat_interleave(heads // rows.shape[1], dim=1)
        return lambda: fn(q, pool, *step, b.layer_idx, 0.4, rng.random() < 0.8, rng.choice([-1, 3]))
    if op == "gather_kv":
        return lambda: fn(pool, *step, b.layer_idx, rng.choice([0, 8, 48]))
    src = torch.tensor([rng.randint(-2, b.blocks.shape[0] + 1) for _ in range(3)], dtype=torch.int32)
    dst = torch.tensor([rng.randint(-2, b.blocks.shape[0] + 1) for _ in range(3)], dtype=torch.int32)
    return lambda: fn(pool, src, dst)


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_random_op_calls_stay_in_bounds_and_agree_with_the_reference(backend, force_backend, fuzz_cases):
    for seed in fuzz_cases(120 if backend != "triton" else 30):
        rng = random.Random(f"{backend}-{seed}")
        b = _random_step(rng)
        op, checked = rng.choice(OPS), rng.random() < 0.5
        rows, step, applied = _mutate(rng, b, b.new_keys)
        where = f"case {seed}: {op} {'checked' if checked else 'unchecked'} {applied}"
        state = rng.getstate()
        pool, buffer = _guarded(b.blocks, rng)
        sentinels, before = _outside(buffer, pool.element_size()), pool.clone()
        force_backend(backend)
        try:
            result, error = _call(op, checked, b, pool, rows, step, rng)(), None
        except ValueError as exc:
            result, error = None, exc
        assert torch.equal(_outside(buffer, pool.element_size()), sentinels), f"{where}: wrote outside blocks"
        assert _same(pool[NULL_PAGE], before[NULL_PAGE]), f"{where}: wrote the null page"
        if error is not None:
            assert _same(pool, before), f"{where}: a refused call wrote ({error})"
            continue
        if not checked:
            continue
        # a valid call: the reference backend on a copy of the same inputs gives the same result
        rng.setstate(state)
        expected_pool, _ = _guarded(before, rng)
        force_backend("reference")
        expected = _call(op, checked, b, expected_pool, rows, step, rng)()
        assert _same(pool, expected_pool), f"{where}: the pool differs from the reference's"
        if op == "flash_attention":
            tolerance = ATTENTION_TOLERANCE[result.dtype]
            torch.testing.assert_close(result, expected, **tolerance, equal_nan=True, msg=where)
        elif op == "gather_kv":
            assert all(_same(got, want) for got, want in zip(result, expected, strict=True)), where
    force_backend(None)
    assert dispatch.forced_backend() is None
