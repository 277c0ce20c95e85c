"""The `cpu` backend's own paths (split key ranges, threads, odd head dims, unchecked calls, the
build and its on-disk cache), against the fp64 oracle and the reference backend. The contract
tests shared with the reference (test_reference_ops, test_properties, test_validation) run on it
too."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading

import pytest
import torch

import torch_paged_kv as pk
import torch_paged_kv.ops as ops
from torch_paged_kv import NULL_PAGE
from torch_paged_kv.native import build
from torch_paged_kv.ops import BackendUnavailableError, reference
from torch_paged_kv.ops.cpu import kernels
from torch_paged_kv.ops.records import FlashAttentionArgs
from torch_paged_kv.testing import (
    ATTENTION_TOLERANCE,
    PagedBatch,
    attention_fp64,
    make_fp8_batch,
    make_mla_batch,
    make_paged_batch,
)


@pytest.fixture(autouse=True)
def force_cpu(force_backend):
    force_backend("cpu")


def check_attention(batch: PagedBatch, scale: float, causal=True, window=-1, softcap=0.0) -> torch.Tensor:
    """Store the step's K/V with the cpu backend, attend, compare with fp64 and with the reference."""
    ops.store_kv(batch.new_keys, batch.new_values, batch.blocks, *batch.step, batch.layer_idx)
    args = (batch.q, batch.blocks, *batch.step, batch.layer_idx, scale, causal, window, softcap)
    got = ops.flash_attention(*args)
    assert got.dtype == batch.q.dtype and got.shape == batch.q.shape
    expected = attention_fp64(
        batch.q, batch.keys, batch.values, batch.cache_lengths.tolist(), scale, causal, window, softcap
    )
    torch.testing.assert_close(got, expected.to(got.dtype), **ATTENTION_TOLERANCE[got.dtype])
    torch.testing.assert_close(got, reference.flash_attention(*args), **ATTENTION_TOLERANCE[got.dtype])
    return got


@pytest.mark.parametrize(
    "dtype, window, softcap, causal",
    [
        (torch.float32, -1, 0.0, True),
        (torch.bfloat16, 70, 4.0, True),
        (torch.float16, -1, 0.0, False),
    ],
)
def test_split_key_ranges_match_fp64(monkeypatch, dtype, window, softcap, causal):
    """Long key ranges split over several items (merged after), for decodes and a prefill."""
    monkeypatch.setattr(kernels, "MIN_SPLIT_KEYS", 16)
    monkeypatch.setattr(kernels, "WANT_ITEMS", 64)
    batch = make_paged_batch(
        [300, 5, 150, 0], [1, 1, 4, 40], page_size=16, num_kv_heads=2, head_dim=64, group=4, dtype=dtype, seed=1
    )
    check_attention(batch, 0.125, causal, window, softcap)


def test_threads_match_fp64(monkeypatch):
    """Every call spread over two threads (work items run in any order)."""
    monkeypatch.setattr(kernels, "MIN_WORK_PER_THREAD", 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        batch = make_paged_batch(
            [0, 37, 100, 5, 0, 129], [9, 6, 1, 1, 0, 3], page_size=7, group=4, dtype=torch.bfloat16, seed=2
        )
        check_attention(batch, 0.3)
        monkeypatch.setattr(kernels, "WANT_ITEMS", 32)
        monkeypatch.setattr(kernels, "MIN_SPLIT_KEYS", 8)
        check_attention(make_paged_batch([200, 90], [1, 1], page_size=5, group=2, seed=3), 0.3, window=50)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "head_dim, group, num_kv_heads, dtype",
    [
        (24, 3, 2, torch.bfloat16),
        (40, 16, 1, torch.float16),
        (72, 1, 3, torch.float32),
        (8, 5, 2, torch.float32),
        (256, 2, 1, torch.bfloat16),
        (33, 4, 2, torch.float32),  # odd: the keys-major P V tile's one-column tail
    ],
)
def test_head_dims_and_groups_match_fp64(head_dim, group, num_kv_heads, dtype):
    """Head dims that are no multiple of the vector width, odd and large GQA groups, prefill and decode
    (bf16 head dims that are a multiple of twice the vector width take the paired loads)."""
    batch = make_paged_batch(
        [20, 0, 33],
        [1, 12, 2],
        page_size=4,
        head_dim=head_dim,
        group=group,
        num_kv_heads=num_kv_heads,
        dtype=dtype,
        seed=head_dim,
    )
    check_attention(batch, head_dim**-0.5, softcap=3.0 if group == 3 else 0.0)


def test_long_prefill_over_many_key_blocks_matches_fp64():
    """A chunked prefill whose queries span several row blocks and key blocks, under a window."""
    batch = make_paged_batch([150], [200], page_size=32, num_kv_heads=2, head_dim=32, group=2, seed=4)
    check_attention(batch, 0.2, window=120)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_peaked_scores_match_fp64(dtype):
    """Scores spread over hundreds (a large softmax scale): each row's running max must be the true
    max of its block, or exp overflows (a max too small) or every probability underflows (too
    large). Decodes and a keys-major prefill. Output rows are near one-hot, so a wrong max shows."""
    batch = make_paged_batch(
        [300, 0], [1, 40], page_size=16, num_kv_heads=2, head_dim=64, group=4, dtype=dtype, seed=11
    )
    check_attention(batch, 8.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_key_reaches_exactly_the_rows_that_see_it(dtype):
    """A NaN in one key's row makes NaN every output row that sees that key (its score, then its
    probabilities, are NaN) and changes no other row: a decode and a keys-major prefill. (The
    reference spreads it further: SDPA's boolean mask leaves NaN in masked scores.)"""
    batch = make_paged_batch([40, 0], [1, 48], page_size=16, num_kv_heads=2, head_dim=64, group=4, dtype=dtype, seed=7)
    ops.store_kv(batch.new_keys, batch.new_values, batch.blocks, *batch.step, batch.layer_idx)
    args = (batch.q, batch.blocks, *batch.step, batch.layer_idx, 0.125)
    clean = ops.flash_attention(*args)
    for seq, pos, head in ((0, 10, 0), (1, 20, 1)):  # a cached key of the decode; a new one of the prefill
        page = int(batch.lookup_table[seq, pos // 16])
        batch.blocks[page, 0, batch.layer_idx, pos % 16, head, 5] = float("nan")
    got = ops.flash_attention(*args)
    nan_rows = got.isnan().any(-1)  # [tokens, q heads]: row 0 the decode, rows 1.. the prefill
    expected = torch.zeros_like(nan_rows)
    expected[0, :4] = True  # kv head 0's query heads
    expected[1 + 20 :, 4:] = True  # kv head 1's, from position 20 on (causal)
    assert torch.equal(nan_rows, expected)
    torch.testing.assert_close(got[~expected], clean[~expected], rtol=0, atol=0)


def test_continuous_batching_slots_match_fp64():
    batch = make_paged_batch([10, 0, 31], [1, 6, 1], page_size=40, continuous=True, group=4, dtype=torch.float16)
    check_attention(batch, 0.25, softcap=8.0)


def test_concurrent_calls_from_python_threads():
    """ctypes releases the GIL: calls from several threads run at once, each with its own scratch."""
    batches = [make_paged_batch([40, 3], [1, 5], page_size=8, group=2, seed=s) for s in range(4)]
    outputs: list = [None] * len(batches)

    def run(i: int) -> None:
        b = batches[i]
        for _ in range(20):
            outputs[i] = kernels.flash_attention(FlashAttentionArgs(b.q, b.blocks, *b.step, b.layer_idx, 0.3))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for b, out in zip(batches, outputs, strict=True):
        expected = reference.flash_attention(b.q, b.blocks, *b.step, b.layer_idx, 0.3)
        torch.testing.assert_close(out, expected, **ATTENTION_TOLERANCE[out.dtype])


# -- store_kv, gather_kv, copy_pages ----------------------------------------------------------------


@pytest.mark.parametrize(
    "page_size, slots, dtype", [(1, False, torch.float32), (3, False, torch.bfloat16), (40, True, torch.float16)]
)
def test_store_and_gather_match_reference(page_size, slots, dtype):
    batch = make_paged_batch([5, 0, 17, 2], [3, 4, 1, 0], page_size=page_size, continuous=slots, dtype=dtype)
    args = (*batch.step, batch.layer_idx)
    expected = batch.blocks.clone()
    reference.store_kv(batch.new_keys, batch.new_values, expected, *args)
    # strided rows (a slice of a wider tensor) are read as they are
    wide_keys = torch.cat([batch.new_keys, batch.new_keys], dim=1)[:, : batch.new_keys.shape[1]]
    ops.store_kv(wide_keys, batch.new_values, batch.blocks, *args)
    assert torch.equal(batch.blocks, expected)
    for got, want in zip(
        ops.gather_kv(batch.blocks, *args, 23), reference.gather_kv(batch.blocks, *args, 23), strict=True
    ):
        assert torch.equal(got, want)


def test_store_kv_skips_out_of_range_and_null_pages_when_checks_are_off(monkeypatch):
    monkeypatch.setenv("TORCH_PAGED_KV_VALIDATE", "shapes")
    batch = make_paged_batch([2, 6], [5, 2], page_size=3, head_dim=16, layer_idx=0)
    key, value = batch.new_keys, batch.new_values
    before = batch.blocks.clone()
    bad_table = batch.lookup_table.clone()
    bad_table[0, :3] = torch.tensor([-1, batch.blocks.shape[0], NULL_PAGE])  # tokens 2..6 of sequence 0
    ops.store_kv(key, value, batch.blocks, batch.cache_lengths, bad_table, batch.input_row_offsets, 0)
    reference.store_kv(
        key[5:], value[5:], before, batch.cache_lengths[1:], batch.lookup_table[1:], batch.input_row_offsets[1:] - 5, 0
    )
    assert torch.equal(batch.blocks, before)  # only sequence 1 was written


@pytest.mark.parametrize("src, dst", [([1, 2, 3], [2, 3, 4]), ([1, 2, 3], [3, 1, 2]), ([4, 4], [1, 5])])
def test_copy_pages_reads_every_source_first(src, dst):
    blocks = make_paged_batch([5, 9], [0, 0], page_size=3, head_dim=16).blocks
    original, expected = blocks.clone(), blocks.clone()
    reference.copy_pages(expected, torch.tensor(src, dtype=torch.int32), torch.tensor(dst, dtype=torch.int32))
    ops.copy_pages(blocks, torch.tensor(src, dtype=torch.int32), torch.tensor(dst, dtype=torch.int32))
    assert torch.equal(blocks, expected)
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(blocks[d], original[s])


def test_copy_pages_moves_mla_latent_pages(force_backend):
    """An MLA pool's pages are rows of kv_lora_rank + rope_dim: the cpu kernel copies them whole."""
    force_backend("cpu")
    blocks = make_mla_batch([9, 5], [0, 0], page_size=4, dtype=torch.bfloat16).blocks
    src, dst = torch.tensor([1, 2, 3], dtype=torch.int32), torch.tensor([3, 1, 4], dtype=torch.int32)
    expected = blocks.clone()
    reference.copy_pages(expected, src, dst)
    ops.copy_pages(blocks, src, dst)
    assert torch.equal(blocks, expected) and not torch.equal(blocks[4], blocks[0])


def test_copy_pages_never_writes_the_null_page_or_outside_when_checks_are_off():
    batch = make_paged_batch([4], [1], page_size=4, head_dim=16, layer_idx=0)
    before = batch.blocks.clone()
    src = torch.tensor([1, 2], dtype=torch.int32)
    ops.copy_pages_unchecked(batch.blocks, src, torch.tensor([NULL_PAGE, batch.blocks.shape[0]], dtype=torch.int32))
    assert torch.equal(batch.blocks, before)


# -- dispatch and the build --------------------------------------------------------------------------


def test_cpu_is_the_default_and_reference_can_be_forced(force_backend):
    force_backend(None)
    info = pk.backend_info("cpu")
    assert {op: info[op] for op in ops.dispatch.OPS if op not in ops.dispatch.MLA_OPS} == dict.fromkeys(
        ("store_kv", "flash_attention", "gather_kv", "copy_pages"), "cpu"
    )
    force_backend("reference")
    assert set(pk.backend_info("cpu").values()) == {"reference"}
    with pytest.raises(BackendUnavailableError, match="CPU tensors only"):
        force_backend("cpu")
        ops.dispatch.select("store_kv", torch.device("meta"), ())


def test_without_a_compiler_cpu_calls_fall_back_to_reference(monkeypatch, tmp_path, force_backend):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("TORCH_PAGED_KV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(kernels, "_lib", None)
    force_backend(None)
    assert set(pk.backend_info("cpu").values()) == {"reference"}
    batch = make_paged_batch([3], [2], page_size=4, seed=5)
    check_attention(batch, 0.5)  # ran on the reference
    force_backend("cpu")
    with pytest.raises(BackendUnavailableError, match="no C\\+\\+ compiler"):
        ops.flash_attention(batch.q, batch.blocks, *batch.step, batch.layer_idx, 0.5)


def test_a_variant_that_fails_to_compile_warns_and_is_not_compiled_again(monkeypatch, tmp_path):
    """The native variant's compile fails: the next variant loads, a RuntimeWarning quotes the first
    error, and a later process (here: a fresh load) takes the kept failure instead of compiling."""
    built = kernels.load()._name  # stands in for the fallback variant's build
    monkeypatch.setenv("TORCH_PAGED_KV_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(build.EXTRA_FLAGS_ENV, raising=False)
    monkeypatch.setattr(build, "_loaded", {})
    compiled = []

    def fake_compile(compiler, flags, sources, target):
        compiled.append(flags)
        if "-march=native" in flags:
            return "kernels.cpp:1: warning: noise\nkernels.cpp:2: error: no such instruction\n1 error generated."
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(built, target)
        return None

    monkeypatch.setattr(build, "_compile", fake_compile)
    with pytest.warns(RuntimeWarning, match="-march=native -fopenmp: kernels.cpp:2: error: no such instruction"):
        build.library()
    assert compiled == [build.VARIANT_FLAGS[0], build.VARIANT_FLAGS[1]]
    monkeypatch.setattr(build, "_loaded", {})
    compiled.clear()
    with pytest.warns(RuntimeWarning, match="no such instruction"):
        build.library()
    assert compiled == []


def test_a_second_process_loads_the_cached_library_without_compiling():
    kernels.load()  # built (or found) by this process
    code = (
        "import time\n"
        "from torch_paged_kv.native import build\n"
        "def refuse(*args): raise AssertionError('compiled again')\n"
        "build._compile = refuse\n"
        "t = time.perf_counter()\n"
        "build.library()\n"
        "print(time.perf_counter() - t)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    assert result.returncode == 0, result.stderr
    assert float(result.stdout.split()[-1]) < 1.0  # milliseconds, in fact


def test_the_build_key_covers_every_header_the_kernels_include():
    """A header edit must rebuild the library: every file kernels.cpp includes (transitively, by
    quotes) is hashed into the cache key."""
    included, todo = set(), [build.SOURCE]
    while todo:
        source = todo.pop()
        for name in re.findall(r'^#include "([^"]+)"', source.read_text(), flags=re.M):
            path = source.parent / name
            if path not in included:
                included.add(path)
                todo.append(path)
    assert included == set(build.headers())  # (and no header beside it goes unused)


# -- the value checks' fast path ---------------------------------------------------------------------


def _numpy_verdict(fn, *args) -> bool:
    try:
        fn(*args)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("continuous", [False, True])
def test_fast_value_checks_agree_with_the_numpy_checks(monkeypatch, continuous):
    """`kernels.step_ok` says yes exactly where validate.py's numpy checks pass (else those run and
    raise): random steps, each with one field broken or none."""
    from torch_paged_kv.ops import validate

    kernels.load()
    gen = torch.Generator().manual_seed(7)
    agree = 0
    for trial in range(300):
        cached = torch.randint(0, 30, (4,), generator=gen).tolist()
        new = torch.randint(0, 4, (4,), generator=gen).tolist()
        b = make_paged_batch(cached, new, page_size=40 if continuous else 4, continuous=continuous, seed=trial)
        lengths, table, offsets = b.cache_lengths.clone(), b.lookup_table.clone(), b.input_row_offsets.clone()
        rows, max_kv_len = b.q.shape[0], max(c + n for c, n in zip(cached, new, strict=True))
        pick = lambda n: int(torch.randint(0, n, (1,), generator=gen))
        broken = trial % 9
        if broken == 1:
            table.view(-1)[pick(table.numel())] = [-1, 0, b.blocks.shape[0], 10_000][pick(4)]
        elif broken == 2:
            lengths[pick(4)] = [-1, 1000, lengths.max() + 3][pick(3)]
        elif broken == 3:
            offsets[pick(5)] += [-1, 1][pick(2)]
        elif broken == 4:
            rows += [-1, 1][pick(2)]
        elif broken == 5:
            max_kv_len -= pick(3)
        step = (lengths, table, offsets)
        fast_store = kernels.step_ok(b.blocks, *step, rows, False)
        fast_read = kernels.step_ok(b.blocks, *step, rows, True, max_kv_len)
        monkeypatch.setattr(validate, "_fast_yes", lambda *args: False)
        slow_store = _numpy_verdict(
            validate.check_store_kv_data,
            b.q[:rows] if rows <= b.q.shape[0] else torch.empty(rows, 1, 1),
            b.blocks,
            *step,
        )
        slow_read = _numpy_verdict(validate.check_read_data, b.blocks, *step, rows, max_kv_len)
        monkeypatch.undo()
        assert (fast_store, fast_read) == (slow_store, slow_read), (trial, broken, cached, new)
        agree += not slow_read
    assert agree > 50  # a good share of the steps were bad ones


def test_validate_takes_the_value_check_the_cpu_backend_registered(monkeypatch):
    """validate.py asks dispatch for the fast check of the tensors' device type (the CPU backend
    registers `kernels.step_ok`): its yes settles a step, its no (or none registered) runs the numpy
    checks, which raise."""
    from torch_paged_kv.ops import dispatch, validate

    assert dispatch.value_check("cpu") is kernels.step_ok
    b = make_paged_batch([5, 3], [1, 1], page_size=4, seed=3)
    lengths = b.cache_lengths.clone()
    lengths[0] = -1  # a bad step
    asked = []

    def says(answer):
        def check(*args):
            asked.append(args[4:])
            return answer

        return check

    monkeypatch.setitem(dispatch._value_checks, "cpu", says(True))
    validate.check_read_data(b.blocks, lengths, b.lookup_table, b.input_row_offsets, 2)  # settled: no raise
    monkeypatch.setitem(dispatch._value_checks, "cpu", says(False))
    with pytest.raises(ValueError, match="cache_lengths: sequence 0 has negative length -1"):
        validate.check_store_kv_data(b.new_keys, b.blocks, lengths, b.lookup_table, b.input_row_offsets)
    assert asked == [(2, True, None), (2, False, None)]
    monkeypatch.delitem(dispatch._value_checks, "cpu")
    with pytest.raises(ValueError, match="cache_lengths"):
        validate.check_read_data(b.blocks, lengths, b.lookup_table, b.input_row_offsets, 2)


# -- FP8 caches ----------------------------------------------------------------------------------

FP8_CASES = [  # dtype, scales per granularity (None: a static pair), head_dim, query dtype
    (torch.float8_e4m3fn, 64, 64, torch.bfloat16),  # one scale per token and head: codes read in place
    (torch.float8_e5m2, 32, 32, torch.float32),  # the same, e5m2
    (torch.float8_e4m3fn, 16, 64, torch.float16),  # granules of 16: in place (AVX2), else dequantized blocks
    (torch.float8_e5m2, 32, 128, torch.bfloat16),  # granules of 32: codes read in place
    (torch.float8_e4m3fn, 8, 64, torch.float32),  # granules of 8: dequantized blocks
    (torch.float8_e5m2, 8, 40, torch.float32),  # odd head_dim: partial vectors
    (torch.float8_e5m2, None, 64, torch.bfloat16),  # a static pair: codes read in place
]


@pytest.mark.parametrize("dtype, granularity, head_dim, q_dtype", FP8_CASES)
@pytest.mark.parametrize("split", [False, True])
def test_fp8_attention_matches_fp64_on_the_dequantized_cache(
    monkeypatch, force_backend, dtype, granularity, head_dim, q_dtype, split
):
    """Decodes, a chunked and a fresh prefill over FP8 pages (random bytes and scales in every
    unused slot), causal, windowed and softcapped, against fp64 attention over what the cache
    holds; split key ranges merged after, or not."""
    if split:
        monkeypatch.setattr(kernels, "MIN_SPLIT_KEYS", 16)
        monkeypatch.setattr(kernels, "WANT_ITEMS", 64)
    b, new_keys, new_values = make_fp8_batch(
        [300, 37, 90, 0], [1, 1, 6, 20], dtype=dtype, granularity=granularity, head_dim=head_dim,
        page_size=16, group=4, seed=7,
    )  # fmt: skip
    force_backend(None)  # the reference quantizes the new rows
    ops.store_kv(new_keys, new_values, b.blocks, *b.step, b.layer_idx, b.scales)
    force_backend("cpu")
    q = b.q.to(q_dtype)
    for window, softcap in ((-1, 0.0), (50, 0.0), (-1, 1.5)):
        got = ops.flash_attention(q, b.blocks, *b.step, b.layer_idx, 0.2, True, window, softcap, b.scales)
        assert got.dtype == q_dtype and got.is_contiguous()
        want = attention_fp64(q, b.keys, b.values, b.cache_lengths.tolist(), 0.2, True, window, softcap)
        torch.testing.assert_close(got.double(), want, **ATTENTION_TOLERANCE[q_dtype])


@pytest.mark.parametrize("granularity, q_dtype, declined", [
    (64, torch.float16, True),  # fp16 queries never stay narrow over FP8 codes
    (16, torch.bfloat16, True),  # bf16 queries over granules finer than the row: declined
    (64, torch.bfloat16, None),  # one scale per row: FP8_*_DOT where the build has it
    (16, torch.float32, False),
])  # fmt: skip
def test_the_kernels_alone_decide_which_queries_over_fp8_stay_narrow(granularity, q_dtype, declined):
    """The dispatch in attention.h declines (`kernels._DECLINED`) the queries it has no kind for;
    `kernels.flash_attention` then calls again in fp32, so both give the same output."""
    b, _, _ = make_fp8_batch([40, 9], [1, 1], granularity=granularity, head_dim=64, page_size=8, group=4, seed=3)
    lib = kernels.load()
    if declined is None:
        declined = not (lib.pkv_bf16_dot() and lib.pkv_fp8_byte_tables())
    q = b.q.to(q_dtype)
    args = FlashAttentionArgs(q, b.blocks, *b.step, b.layer_idx, 0.2, scales=b.scales)
    said, out = kernels._flash_attention_call(lib, q, args)
    assert said == (kernels._DECLINED if declined else 0)
    fp32 = kernels._flash_attention_call(lib, q.float(), args)[1]
    if not declined:
        torch.testing.assert_close(out.float(), fp32, **ATTENTION_TOLERANCE[q_dtype])
    got = kernels.flash_attention(args)
    assert got.dtype == q_dtype
    if declined:
        assert torch.equal(got, fp32.to(q_dtype))


def test_fp8_copy_pages_moves_scales_with_their_pages():
    b, _, _ = make_fp8_batch([40, 9], [0, 0], granularity=16, page_size=8)
    blocks, scales = b.blocks.view(torch.uint8).clone(), b.scales.clone()
    src, dst = torch.tensor([1, 2, 3], dtype=torch.int32), torch.tensor([3, 1, 4], dtype=torch.int32)
    ops.copy_pages(b.blocks, src, dst, b.scales)
    assert torch.equal(b.blocks.view(torch.uint8)[[3, 1, 4]], blocks[[1, 2, 3]])
    assert torch.equal(b.scales[[3, 1, 4]], scales[[1, 2, 3]])
    untouched = [p for p in range(blocks.shape[0]) if p not in (1, 3, 4)]
    assert torch.equal(b.blocks.view(torch.uint8)[untouched], blocks[untouched])
    assert torch.equal(b.scales[untouched], scales[untouched])


def test_every_op_runs_here_on_an_fp8_cache_and_backend_info_says_so(force_backend):
    force_backend(None)
    params = pk.KVCacheParams(torch.float8_e4m3fn, 1, 2, 64, 16, quantization_granularity=16)
    assert set(pk.backend_info("cpu", params).values()) == {"cpu"}


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("granularity", [None, 8, 32])
def test_fp8_gather_dequantizes_exactly_as_the_reference(force_backend, fp8, granularity):
    """fp32 K/V of every cached and new token equal the reference's bit for bit (random codes,
    NaN codes included), zeros past each length; a gather to bf16 still runs (on the reference)."""
    b, _, _ = make_fp8_batch([13, 0, 30], [4, 9, 3], dtype=fp8, granularity=granularity, page_size=8, head_dim=32)
    first = int(b.lookup_table[0, 0])  # sequence 0's position 0: NaN codes, e5m2's inf, a subnormal
    b.blocks.view(torch.uint8)[first, :, b.layer_idx, 0, 0, :4] = torch.tensor([0x7F, 0xFF, 0x7C, 0x01])
    got = {}
    for backend in ("reference", "cpu"):
        force_backend(backend)
        got[backend] = ops.gather_kv(b.blocks, *b.step, b.layer_idx, 40, b.scales)
    for want, have in zip(got["reference"], got["cpu"], strict=True):
        assert have.dtype == torch.float32 and have.shape == want.shape
        torch.testing.assert_close(have, want, rtol=0, atol=0, equal_nan=True)
    force_backend(None)
    k16, _ = ops.gather_kv(b.blocks, *b.step, b.layer_idx, 40, b.scales, torch.bfloat16)
    torch.testing.assert_close(k16, got["reference"][0].bfloat16(), rtol=0, atol=0, equal_nan=True)


def _awkward_rows(n: int, heads: int, head_dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random rows, wide in magnitude, with the cases the rule has to get right: a zero granule,
    values far below the format's smallest step, one row with an infinity, one with a NaN."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(n, heads, head_dim, generator=gen) * torch.exp2(
        torch.randint(-20, 20, (n, heads, 1), generator=gen)
    )
    rows[0, 0, :8] = 0.0
    rows[1, 0] *= 1e-30
    rows[2, 1, 3] = float("inf")
    rows[3, 0, 5] = float("nan")
    return rows.to(dtype)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("granularity", [None, 8, 32])  # static pair; per 8; per token and head
@pytest.mark.parametrize("rows_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_store_quantizes_exactly_as_the_reference(force_backend, fp8, granularity, rows_dtype):
    """Codes and scales of every written slot equal the reference's bit for bit (NaN scales as NaN),
    across ragged new rows and pages; every other byte of the pool and its scales is untouched."""
    b, _, _ = make_fp8_batch([13, 0, 30], [4, 9, 3], dtype=fp8, granularity=granularity, page_size=8, head_dim=32)
    total = int(b.step[2][-1])
    key, value = _awkward_rows(total, 2, 32, rows_dtype, 1), _awkward_rows(total, 2, 32, rows_dtype, 2)
    pools = {}
    for backend in ("reference", "cpu"):
        blocks, scales = b.blocks.clone(), b.scales.clone()
        force_backend(backend)
        ops.store_kv(key, value, blocks, *b.step, b.layer_idx, scales)
        pools[backend] = blocks.view(torch.uint8), scales
    (ref_codes, ref_scales), (got_codes, got_scales) = pools["reference"], pools["cpu"]
    assert not torch.equal(ref_codes, b.blocks.view(torch.uint8))  # the store wrote something
    assert torch.equal(got_codes, ref_codes)
    torch.testing.assert_close(got_scales, ref_scales, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize(
    "head_dim, groups",
    [
        (136, 0), (136, 1), (136, 17), (136, 34),  # dequantized blocks: static pair, per token, granules of 8 and 4
        (128, 0), (128, 1), (128, 4), (128, 8),  # codes read in place: static, per token, granules of 32 and 16
    ],
)  # fmt: skip
@pytest.mark.parametrize("magnitude", [1.0, 1e-40, 2e36])  # scales near 1; subnormal; scale x 2^8 overflows
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])  # bf16: scores as bf16 dot products
def test_fp8_codes_dequantize_exactly(dtype, head_dim, groups, magnitude, q_dtype):
    """Every FP8 code (subnormals, -0, e5m2's infinities, the NaN codes) as V of the only key a
    query sees: attention returns that V row, so it must equal code value x scale, exactly (also
    where the product is subnormal or overflows), rounded once to q's dtype."""
    batch = 2  # 256 or 272 slots: every code; 136: the vector path and (AVX-512) the scalar tail
    blocks = torch.full((3, 2, 1, 4, 1, head_dim), 0x38, dtype=torch.uint8)  # K: 1.0 (e4m3) / 0.5 (e5m2)
    codes = torch.arange(batch * head_dim, dtype=torch.int64).remainder(256).to(torch.uint8)
    blocks[1:, 1, 0, 0, 0] = codes.view(batch, head_dim)  # V of position 0 of pages 1 and 2
    blocks = blocks.view(dtype)
    gen = torch.Generator().manual_seed(5)
    scales = torch.rand(*blocks.shape[:5], groups, generator=gen) + 0.5 if groups else torch.tensor([0.7, 1.3])
    scales = scales * magnitude
    step = (
        torch.zeros(batch, dtype=torch.int32),
        torch.tensor([[1], [2]], dtype=torch.int32),
        torch.arange(batch + 1, dtype=torch.int32),
    )
    q = torch.randn(batch, 1, head_dim, generator=gen).to(q_dtype)
    got = ops.flash_attention(q, blocks, *step, 0, 0.1, True, -1, 0.0, scales)
    v = blocks[1:, 1, 0, 0, 0].float()  # torch's own conversion, then the scale
    scale = scales[1:, 1, 0, 0, 0].repeat_interleave(head_dim // groups, -1) if groups else scales[1]
    torch.testing.assert_close(got[:, 0], (v * scale).to(q_dtype), rtol=0, atol=0, equal_nan=True)


def test_this_build_reads_fp8_codes_through_byte_tables_where_the_cpu_can(cpu_flags):
    """With AVX512-VBMI (Ice Lake, Zen 4, Sapphire Rapids) the library must build the FP8 byte-table
    conversions (and with AVX512-BF16 the bf16 dot-product scores over them), so that the tests
    above run them; test_cpu_isa builds it without."""
    if build.find_compiler() is None:
        pytest.skip("no C++ compiler: the cpu backend cannot be built here")
    if not cpu_flags:
        pytest.skip("no /proc/cpuinfo flags to say what this CPU has")
    if os.environ.get(build.EXTRA_FLAGS_ENV):
        pytest.skip(f"built with {build.EXTRA_FLAGS_ENV}={os.environ[build.EXTRA_FLAGS_ENV]!r}")
    lib = kernels.load()
    assert lib.pkv_fp8_byte_tables() == int("avx512vbmi" in cpu_flags), sorted(cpu_flags)


# (cooperlake: AVX512-BF16 without VBMI; icelake-server: VBMI without BF16)
@pytest.mark.parametrize(
    "arch", ["x86-64", "haswell", "skylake-avx512", "cooperlake", "icelake-server", "sapphirerapids"]
)
def test_kernels_compile_for_other_x86_targets(arch):
    """`-march=native` builds only for this machine's vector width; the others (AVX-512's 16-float
    vectors, plain SSE) must compile too, or the build falls back to generic code there."""
    compiler = build.find_compiler()
    if compiler is None or "x86_64" not in os.uname().machine:
        pytest.skip("needs an x86-64 C++ compiler")
    flags = [*build.BASE_FLAGS, "-fopenmp", f"-march={arch}", "-fsyntax-only"]  # types and templates, no code
    for source in build.SOURCES:
        done = subprocess.run([compiler, *flags, str(source)], capture_output=True)
        assert done.returncode == 0, f"{source.name}: " + done.stderr.decode()[-3000:]
