"""Random `.unchecked` calls into the cpu kernels, for `tests/sanitize_cpu.sh` (AddressSanitizer) above
all: every tensor is its own allocation of exactly its size (no sentinel buffer around the pool, so a
sanitizer sees a read or write one element past any of them), and the calls reach what
`test_fuzz_ops.py` leaves out: tree masks (random bits, rows without their own bit, zero and negative
masks), sinks, chunks with windows, softcap, bf16/fp16/FP8 pools (per-granule and static scales),
head dims with vector tails, prefill-sized steps (keys-major tiles), long cached prefixes (several key
blocks) and split key ranges on two threads.

Each case takes a valid step and applies zero to three wrong values (a length, an offset, a table
entry, a tree row; shapes stay valid). The call raises `ValueError` with the pool unchanged, or
completes; either way the null page is unchanged.
"""

from __future__ import annotations

import random

import torch

from torch_paged_kv import ops
from torch_paged_kv.layout import NULL_PAGE
from torch_paged_kv.ops.cpu import kernels as cpu_kernels
from torch_paged_kv.testing import make_fp8_batch, make_paged_batch

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]


def _random_step(rng: random.Random):
    """(batch, store_kv's new rows): a random valid step in a random pool dtype."""
    batch = rng.randint(1, 3)
    long_prefix = rng.random() < 0.3  # several key blocks (and split ranges)
    cached = [rng.randint(0, 300 if long_prefix else 24) for _ in range(batch)]
    new = [rng.choice([0, 1, 1, 2, 5, 9, 40]) for _ in range(batch)]
    dtype = rng.choice(DTYPES)
    seed = rng.getrandbits(16)
    if dtype.itemsize == 1:
        head_dim = rng.choice([32, 64, 128])
        granularity = rng.choice([None, head_dim, 16])
        b, new_k, new_v = make_fp8_batch(
            cached, new, dtype=dtype, granularity=granularity, page_size=rng.choice([1, 4, 16]),
            head_dim=head_dim, group=rng.choice([1, 2, 4]), seed=seed,
        )  # fmt: skip
        return b, (new_k, new_v)
    b = make_paged_batch(
        cached, new, page_size=rng.choice([1, 3, 4, 16]), head_dim=rng.choice([8, 24, 32, 40, 64, 128]),
        group=rng.choice([1, 2, 4, 8]), dtype=dtype, spare_pages=2, seed=seed,
    )  # fmt: skip
    b.scales = None
    return b, (b.new_keys, b.new_values)


def _tree_mask(rng: random.Random, new: list[int]) -> torch.Tensor:
    """Per new token: its own bit and some earlier ones (a tree), or junk (no own bit, zero, a later
    token's bit, every bit, the sign bit)."""
    rows = []
    for n in new:
        for t in range(n):
            bits = (1 << t) | sum(1 << u for u in range(t) if rng.random() < 0.5)
            bits = rng.choice([bits] * 4 + [bits & ~(1 << t), 0, bits | (1 << min(t + 1, 63)), -1, -(2**63)])
            rows.append(bits - (1 << 64) if bits >= 1 << 63 else bits)
    return torch.tensor(rows, dtype=torch.int64)


def _wrong(rng: random.Random, b, step: list[torch.Tensor], tree: torch.Tensor | None) -> list[str]:
    """Apply zero to three wrong values to the step tensors (in place); their names."""
    lengths, table, offsets = step
    applied = []
    for _ in range(rng.choice([0, 1, 1, 2, 3])):
        kind = rng.choice(["length", "offset", "table", "tree"] if tree is not None else ["length", "offset", "table"])
        applied.append(kind)
        if kind == "length":
            lengths[rng.randrange(len(lengths))] = rng.choice([-1, 0, rng.randint(0, 400), 2**31 - 1])
        elif kind == "offset":
            offsets[rng.randrange(len(offsets))] = rng.randint(-2, int(offsets[-1]) + 3)
        elif kind == "table":
            row, col = rng.randrange(table.shape[0]), rng.randrange(table.shape[1])
            table[row, col] = rng.choice([NULL_PAGE, -1, b.blocks.shape[0], 2**31 - 1, -(2**31)])
        elif tree is not None and tree.numel():
            tree[rng.randrange(tree.numel())] = rng.choice([0, -1, -(2**63), rng.getrandbits(63)])
    return applied


def _call(rng: random.Random, b, rows: tuple[torch.Tensor, torch.Tensor], step, tree: torch.Tensor | None):
    op = rng.choice(["flash_attention"] * 4 + ["store_kv", "gather_kv"])
    if op == "store_kv":
        return lambda: ops.store_kv_unchecked(*rows, b.blocks, *step, b.layer_idx, scales=b.scales)
    if op == "gather_kv":
        return lambda: ops.gather_kv_unchecked(
            b.blocks, *step, b.layer_idx, rng.choice([0, 8, 64, 400]), scales=b.scales
        )
    sinks = torch.randn(b.q.shape[1]) if rng.random() < 0.3 else None
    window = rng.choice([-1, -1, 1, 2, 5, 17, 200])
    chunk = rng.choice([-1, -1, 1, 4, 7, 64])
    causal = tree is not None or rng.random() < 0.8
    softcap = rng.choice([0.0, 0.0, 5.0])
    return lambda: ops.flash_attention_unchecked(
        b.q, b.blocks, *step, b.layer_idx, 0.3, causal=causal, sliding_window=window, softcap=softcap,
        scales=b.scales, sinks=sinks, attention_chunk_size=chunk, tree_mask=tree,
    )  # fmt: skip


def test_random_unchecked_cpu_calls_stay_in_their_tensors(force_backend, fuzz_cases, monkeypatch):
    force_backend("cpu")
    threads = torch.get_num_threads()
    try:
        for seed in fuzz_cases(40):
            rng = random.Random(f"cpu-unchecked-{seed}")
            b, rows = _random_step(rng)
            new = b.input_row_offsets.diff().tolist()
            tree = _tree_mask(rng, new) if rng.random() < 0.4 and max(new, default=0) <= 64 else None
            step = [b.cache_lengths.clone(), b.lookup_table.clone(), b.input_row_offsets.clone()]
            applied = _wrong(rng, b, step, tree)
            # split key ranges (two threads, small splits) in some cases
            monkeypatch.setattr(cpu_kernels, "MIN_SPLIT_KEYS", rng.choice([cpu_kernels.MIN_SPLIT_KEYS, 16]))
            monkeypatch.setattr(cpu_kernels, "MIN_WORK_PER_THREAD", rng.choice([cpu_kernels.MIN_WORK_PER_THREAD, 1]))
            torch.set_num_threads(rng.choice([1, 2]))
            call = _call(rng, b, rows, step, tree)
            before = b.blocks.clone()
            where = f"case {seed}: {b.blocks.dtype} {applied} tree={tree is not None}"
            try:
                call()
            except ValueError as exc:
                assert torch.equal(b.blocks.view(torch.uint8), before.view(torch.uint8)), (
                    f"{where}: refused ({exc}) but wrote"
                )
            assert torch.equal(b.blocks[NULL_PAGE].view(torch.uint8), before[NULL_PAGE].view(torch.uint8)), where
    finally:
        torch.set_num_threads(threads)
