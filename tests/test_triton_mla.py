"""Triton MLA kernels under TRITON_INTERPRET=1 on CPU tensors: `store_latent` bit for bit against the
reference backend, `mla_attention` against the reference and the fp64 oracle (`torch_paged_kv.testing`);
FP8 rope-aware rows included. Tiny shapes: the interpreter runs every program in Python."""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("a GPU is visible: tests/gpu covers the Triton kernels", allow_module_level=True)

import torch_paged_kv as pk
from torch_paged_kv import NULL_PAGE
from torch_paged_kv.ops import reference_mla
from torch_paged_kv.ops import splits as split_rule
from torch_paged_kv.ops.records import MLAAttentionArgs, StoreLatentArgs
from torch_paged_kv.ops.triton import mla_attention as triton_mla
from torch_paged_kv.ops.triton import unavailable_reason
from torch_paged_kv.testing import ATTENTION_TOLERANCE, make_mla_batch, mla_attention_fp64

if unavailable_reason(torch.device("cpu")) is not None:
    pytest.fail(f"Triton kernels cannot run on CPU tensors here: {unavailable_reason(torch.device('cpu'))}")

QUANT = {
    "bf16": (torch.bfloat16, {}),
    "fp32": (torch.float32, {}),
    "fp16": (torch.float16, {}),
    "fp8-per-token": (torch.float8_e4m3fn, {}),
    "fp8-granule8": (torch.float8_e4m3fn, dict(quantization_granularity=8)),
    "e5m2-static": (torch.float8_e5m2, dict(static_scales=(0.01,))),
}
FP8_KINDS = ("fp8-per-token", "fp8-granule8", "e5m2-static")


@pytest.fixture(autouse=True)
def force_triton(force_backend):
    force_backend("triton")


def _raw(t):
    return None if t is None else t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.mark.parametrize("kind", QUANT)
@pytest.mark.parametrize("page_size, continuous", [(1, False), (5, False), (24, True)])
def test_store_latent_writes_exactly_the_reference_rows(kind, page_size, continuous):
    dtype, quantization = QUANT[kind]
    b = make_mla_batch([3, 0, 9], [2, 4, 1], page_size=page_size, dtype=dtype, continuous=continuous, **quantization)
    latent, rope = b.new_latent, b.new_rope
    if kind == "fp8-per-token":  # fp32 rows, some big, one all zero: the rule's corners
        latent, rope = latent.float() * torch.logspace(-3, 3, latent.shape[0])[:, None], rope.float()
        latent[1] = 0.0
    expected_blocks, expected_scales = b.blocks.clone(), None if b.scales is None else b.scales.clone()
    reference_mla.store_latent(latent, rope, expected_blocks, *b.step, b.layer_idx, expected_scales)
    pk.store_latent(latent, rope, b.blocks, *b.step, b.layer_idx, b.scales)
    assert torch.equal(_raw(b.blocks), _raw(expected_blocks))
    assert b.scales is None or torch.equal(b.scales, expected_scales)


def test_store_latent_skips_out_of_range_and_null_pages_when_checks_are_off(monkeypatch):
    monkeypatch.setenv("TORCH_PAGED_KV_VALIDATE", "shapes")
    b = make_mla_batch([2, 6], [5, 2], page_size=3, layer_idx=0, dtype=torch.float8_e4m3fn)
    expected_blocks, expected_scales = b.blocks.clone(), b.scales.clone()
    bad_table = b.lookup_table.clone()
    bad_table[0, :3] = torch.tensor([-1, b.blocks.shape[0], NULL_PAGE])  # tokens 2..6 of sequence 0
    pk.store_latent(b.new_latent, b.new_rope, b.blocks, b.cache_lengths, bad_table, b.input_row_offsets, 0, b.scales)
    # Only sequence 1 is written: the same as storing it alone.
    reference_mla.store_latent(
        b.new_latent[5:],
        b.new_rope[5:],
        expected_blocks,
        b.cache_lengths[1:],
        b.lookup_table[1:],
        b.input_row_offsets[1:] - 5,
        0,
        expected_scales,
    )
    assert torch.equal(_raw(b.blocks), _raw(expected_blocks)) and torch.equal(b.scales, expected_scales)


ATTENTION_CASES = {
    # name: (cached, new, page_size, continuous, heads, rank, rope, kind, causal)
    "prefill-page1": ([0, 0], [5, 3], 1, False, 4, 32, 16, "fp32", True),
    "chunked-page3-bf16": ([7, 0, 12], [6, 3, 5], 3, False, 2, 32, 16, "bf16", True),
    "noncausal-page16-h20": ([20, 3], [5, 2], 16, False, 20, 16, 8, "fp16", False),
    "decode-ragged": ([45, 3, 0], [1, 1, 1], 4, False, 8, 32, 16, "bf16", True),
    "decode-h40": ([45, 3, 70], [1, 1, 1], 8, False, 40, 32, 16, "bf16", True),  # 3 head blocks, one partial
    "slots-no-rope": ([10, 0, 21], [1, 6, 1], 24, True, 4, 32, 0, "fp32", True),
    "fp8-per-token-mixed": ([12, 0, 30], [1, 5, 2], 8, False, 4, 32, 16, "fp8-per-token", True),
    "fp8-granule8-decode": ([40, 7], [1, 1], 8, False, 4, 32, 16, "fp8-granule8", True),
    "e5m2-static-prefill": ([5, 0], [4, 6], 4, False, 4, 32, 16, "e5m2-static", True),
}


def _check(b, scale: float, causal: bool = True) -> None:
    reference_mla.store_latent(b.new_latent, b.new_rope, b.blocks, *b.step, b.layer_idx, b.scales)
    args = (b.q_nope, b.q_rope, b.blocks, *b.step, b.layer_idx, scale, causal, b.scales)
    got = pk.mla_attention(*args)
    assert got.shape == b.q_nope.shape and got.dtype == b.q_nope.dtype
    tolerance = ATTENTION_TOLERANCE[got.dtype]
    torch.testing.assert_close(got, reference_mla.mla_attention(*args), **tolerance)
    expected = mla_attention_fp64(b.q_nope, b.q_rope, b.latents, b.ropes, b.cache_lengths.tolist(), scale, causal)
    torch.testing.assert_close(got, expected.to(got.dtype), **tolerance)


@pytest.mark.parametrize("name", ATTENTION_CASES)
def test_mla_attention_matches_reference_and_fp64(name):
    _mla_attention_case(name)


@pytest.mark.parametrize("name", [name for name, case in ATTENTION_CASES.items() if case[7] in FP8_KINDS])
def test_fp8_rows_through_the_hardware_conversion_match_fp64(name, monkeypatch):
    """The sm_89+ read path (`hardware_fp8`: FP8 -> fp16 by `cvt`, then the query's dtype), which the
    interpreter emulates exactly for finite codes (these rows hold no NaN)."""
    monkeypatch.setattr(triton_mla, "hardware_fp8", lambda device: True)
    b = _mla_attention_case(name)
    a = MLAAttentionArgs(b.q_nope, b.q_rope, b.blocks, *b.step, b.layer_idx, 0.1, True, b.scales)
    assert triton_mla.plan_mla_attention(a)[1][0].kwargs["HW_FP8"] is True


def _mla_attention_case(name: str):
    cached, new, page_size, continuous, heads, rank, rope, kind, causal = ATTENTION_CASES[name]
    dtype, quantization = QUANT[kind]
    b = make_mla_batch(
        cached,
        new,
        page_size=page_size,
        continuous=continuous,
        num_heads=heads,
        kv_lora_rank=rank,
        rope_dim=rope,
        dtype=dtype,
        seed=len(name),
        **quantization,
    )
    _check(b, (rank + rope) ** -0.5, causal)
    return b


@pytest.mark.parametrize("kind", ["bf16", "fp8-per-token"])
def test_split_kv_decode_matches_fp64(monkeypatch, kind):
    monkeypatch.setattr(split_rule, "MIN_SPLIT_KEYS", 16)
    dtype, quantization = QUANT[kind]
    b = make_mla_batch([70, 5, 33], [1, 1, 1], page_size=8, num_heads=4, dtype=dtype, seed=3, **quantization)
    a = MLAAttentionArgs(b.q_nope, b.q_rope, b.blocks, *b.step, b.layer_idx, 0.2, True, b.scales)
    launches = triton_mla.plan_mla_attention(a)[1]
    assert len(launches) == 2 and launches[0].grid[2] > 1  # split attention, then the merge
    _check(b, 0.2)


SINK_CASES = {  # name: (cached, new, page_size, heads, kind, causal, split decode)
    "prefill-chunked-page3": ([7, 0, 12], [6, 3, 5], 3, 2, "bf16", True, False),
    "prefill-noncausal-h20": ([20, 3], [5, 2], 16, 20, "fp16", False, False),  # 2 head blocks, one partial
    "decode-h40": ([45, 3, 70], [1, 1, 1], 8, 40, "bf16", True, False),  # 3 head blocks, one partial
    "decode-split": ([70, 5, 33], [1, 1, 1], 8, 4, "bf16", True, True),  # splits holding none of the 6 keys
    "decode-split-fp8-per-token": ([70, 5, 33], [1, 1, 1], 8, 4, "fp8-per-token", True, True),
}


@pytest.mark.parametrize("name", SINK_CASES)
def test_sinks_match_fp64(name, monkeypatch):
    """Each head's sink logit joins its rows' denominators: at the end of a program, or once in the
    merge of split decode (where some splits saw no key of the shorter sequences)."""
    cached, new, page_size, heads, kind, causal, split = SINK_CASES[name]
    if split:
        monkeypatch.setattr(split_rule, "MIN_SPLIT_KEYS", 16)
    dtype, quantization = QUANT[kind]
    b = make_mla_batch(cached, new, page_size=page_size, num_heads=heads, dtype=dtype, seed=len(name), **quantization)
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(len(name))) + 3  # e^3: as heavy as ~10 keys
    a = MLAAttentionArgs(b.q_nope, b.q_rope, b.blocks, *b.step, b.layer_idx, 0.2, causal, b.scales, None, sinks)
    launches = triton_mla.plan_mla_attention(a)[1]
    assert len(launches) == (2 if split else 1) and launches[0].kwargs["SINK"]
    assert all(launch.kwargs["SINK"] for launch in launches)  # (the merge adds the sink term)
    reference_mla.store_latent(b.new_latent, b.new_rope, b.blocks, *b.step, b.layer_idx, b.scales)
    got = pk.mla_attention(b.q_nope, b.q_rope, b.blocks, *b.step, b.layer_idx, 0.2, causal, b.scales, None, sinks)
    expected = mla_attention_fp64(b.q_nope, b.q_rope, b.latents, b.ropes, b.cache_lengths.tolist(), 0.2, causal, sinks)
    torch.testing.assert_close(got, expected.to(got.dtype), **ATTENTION_TOLERANCE[got.dtype])


def test_deepseek_shape_decode_matches_fp64():
    """kv_lora_rank 512, rope 64, 16 heads: one latent row per token serves every head."""
    b = make_mla_batch([21, 3], [1, 1], page_size=16, num_heads=16, kv_lora_rank=512, rope_dim=64, dtype=torch.bfloat16)
    _check(b, 192**-0.5)


def test_triton_declines_ranks_it_does_not_cover(force_backend):
    b = make_mla_batch([2], [1], page_size=4, kv_lora_rank=24, rope_dim=8)
    with pytest.raises(pk.BackendUnavailableError, match="does not cover"):
        pk.mla_attention(b.q_nope, b.q_rope, b.blocks, *b.step, b.layer_idx, 0.2)
    force_backend(None)
    pk.mla_attention(b.q_nope, b.q_rope, b.blocks, *b.step, b.layer_idx, 0.2)  # the reference runs it on CPU


def test_triton_leaves_fp32_queries_over_fp8_rows_to_the_reference(force_backend):
    b = make_mla_batch([2], [1], page_size=4, dtype=torch.float8_e4m3fn, q_dtype=torch.float32)
    args = (b.q_nope, b.q_rope, b.blocks, *b.step, b.layer_idx, 0.2, True, b.scales)
    with pytest.raises(pk.BackendUnavailableError, match="does not cover"):
        pk.mla_attention(*args)
    force_backend(None)
    torch.testing.assert_close(pk.mla_attention(*args), reference_mla.mla_attention(*args))


# -- `.unchecked` calls with values the data checks would reject: never outside a tensor -------------

SENTINEL = 7.0


def _guarded(t: torch.Tensor, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(a view equal to `t` inside a buffer one dim-0 slice larger on each side, the buffer); the
    guard slices hold `fill`: a kernel that reads them reads `fill`, one that writes them changes it."""
    buffer = torch.full((t.shape[0] + 2, *t.shape[1:]), fill, dtype=t.dtype)
    buffer[1:-1] = t
    return buffer[1:-1], buffer


def _guards_hold(buffer: torch.Tensor, fill: float) -> bool:
    return bool((buffer[0].float() == fill).all() and (buffer[-1].float() == fill).all())


def _store_unchecked(b, latent, rope, blocks, cache_lengths, lookup_table, offsets, scales) -> None:
    torch.ops.paged_kv.store_latent.unchecked(latent, rope, blocks, cache_lengths, lookup_table, offsets,
                                              b.layer_idx, scales)  # fmt: skip


STORE_CASES = {  # name: (cache_lengths, input_row_offsets, new rows given) for cached [3, 0, 9]
    "more-rows-than-offsets": ([3, 0, 9], [0, 2, 3, 4], 9),
    "fewer-rows-than-offsets": ([3, 0, 9], [0, 4, 9, 12], 5),
    "offsets-starting-past-0": ([0, 0, 9], [2, 4, 6, 7], 7),  # rows 0-1 sit before sequence 0, in page 1
    "lengths-past-the-table": ([40, 1000, 3], [0, 2, 4, 5], 5),
    "lengths-near-int32-max": ([2**31 - 2, 2**31 - 1, 3], [0, 2, 4, 5], 5),
    "negative-lengths": ([-1, -7, -(2**31)], [0, 2, 4, 5], 5),
}


@pytest.mark.parametrize("kind", ["bf16", "fp8-granule8", "e5m2-static"])
@pytest.mark.parametrize("case", STORE_CASES)
def test_unchecked_store_latent_stays_inside_blocks_and_off_the_null_page(case, kind):
    """Whatever rows, offsets and lengths say, the kernel writes only non-null pages of `blocks`
    (and their scales): the guard pages around them and page 0 keep their bytes."""
    lengths, offsets, rows = STORE_CASES[case]
    dtype, quantization = QUANT[kind]
    b = make_mla_batch([3, 0, 9], [2, 2, 1], page_size=4, layer_idx=0, dtype=dtype, seed=5, **quantization)
    b.lookup_table[0, 0] = 1  # sequence 0 starts at page 1, right after the null page
    blocks, block_buffer = _guarded(b.blocks.view(torch.uint8) if b.scales is not None else b.blocks, SENTINEL)
    blocks = blocks.view(b.blocks.dtype)
    scales, scale_buffer = (None, None) if b.scales is None or b.scales.dim() == 1 else _guarded(b.scales, SENTINEL)
    scales = b.scales if b.scales is not None and b.scales.dim() == 1 else scales
    null_page = blocks[0].view(torch.uint8).clone()
    gen = torch.Generator().manual_seed(6)
    latent = torch.randn(rows, b.new_latent.shape[1], generator=gen).to(b.new_latent.dtype)
    rope = torch.randn(rows, b.new_rope.shape[1], generator=gen).to(b.new_rope.dtype)
    step = (torch.tensor(lengths, dtype=torch.int32), b.lookup_table, torch.tensor(offsets, dtype=torch.int32))
    _store_unchecked(b, latent, rope, blocks, *step, scales)
    assert _guards_hold(block_buffer, SENTINEL) and torch.equal(blocks[0].view(torch.uint8), null_page)
    assert scale_buffer is None or _guards_hold(scale_buffer, SENTINEL)


def test_unchecked_store_latent_skips_bad_page_ids_inside_guards():
    b = make_mla_batch([2, 6], [5, 2], page_size=3, layer_idx=0, dtype=torch.bfloat16, seed=2)
    blocks, buffer = _guarded(b.blocks, SENTINEL)
    before = blocks.clone()
    table = b.lookup_table.clone()
    table[0, :3] = torch.tensor([-1, b.blocks.shape[0], NULL_PAGE])
    table[1, :3] = torch.tensor([2**31 - 1, -(2**31), b.blocks.shape[0] + 1])
    _store_unchecked(b, b.new_latent, b.new_rope, blocks, b.cache_lengths, table, b.input_row_offsets, None)
    assert _guards_hold(buffer, SENTINEL) and torch.equal(blocks, before)


def _attention_unchecked(b, q_rows: int, lengths, table, offsets) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`mla_attention` planned on `q_rows` query rows, its output (and split partials) moved into
    guarded buffers, run; (the output, the buffers, whose guards must hold)."""
    gen = torch.Generator().manual_seed(9)
    heads, rank, rope = b.q_nope.shape[1], b.q_nope.shape[2], b.q_rope.shape[2]
    q_nope, q_rope = (torch.randn(q_rows, heads, n, generator=gen).to(b.q_nope.dtype) for n in (rank, rope))
    q_nope, _ = _guarded(q_nope, float("nan"))  # read past its rows, a query row would be NaN
    q_rope, _ = _guarded(q_rope, float("nan"))
    step = (torch.tensor(lengths, dtype=torch.int32), table, torch.tensor(offsets, dtype=torch.int32))
    out, launches = triton_mla.plan_mla_attention(
        MLAAttentionArgs(q_nope, q_rope, b.blocks, *step, b.layer_idx, 0.1, True, b.scales)
    )
    moved, buffers = {}, []
    for t in {id(a): a for launch in launches for a in launch.args[:5] if isinstance(a, torch.Tensor)}.values():
        if t is not q_nope and t is not q_rope:
            view, buffer = _guarded(torch.zeros_like(t), SENTINEL)
            moved[id(t)] = view
            buffers.append(buffer)
    for launch in launches:
        launch._replace(args=tuple(moved.get(id(a), a) for a in launch.args))()
    return moved[id(out)], buffers


ATTENTION_UNCHECKED = {  # name: (query rows given, cache_lengths, input_row_offsets) for cached [12, 0, 30]
    "offsets-past-the-query-rows": (3, [12, 0, 30], [0, 2, 4, 6]),
    "offsets-starting-negative": (4, [12, 0, 30], [-5, 1, 3, 4]),
    "lengths-past-the-table": (3, [70, 500, 30], [0, 1, 2, 3]),
    "lengths-near-int32-max": (3, [2**31 - 2, 2**31 - 16, 30], [0, 1, 2, 3]),
    "negative-lengths": (3, [-1, -(2**31), 30], [0, 1, 2, 3]),
}


@pytest.mark.parametrize("kind", ["bf16", "fp8-per-token"])
@pytest.mark.parametrize("case", ATTENTION_UNCHECKED)
def test_unchecked_mla_attention_reads_and_writes_only_its_tensors(case, kind, monkeypatch):
    """Rows past the query (or before it), lengths past the table: the output and split partials are
    written only inside (their guards hold); no key outside the table is read (its spare columns
    point at a page of NaN), so every row the kernel writes is finite."""
    monkeypatch.setattr(split_rule, "MIN_SPLIT_KEYS", 16)  # split decode, then the merge
    q_rows, lengths, offsets = ATTENTION_UNCHECKED[case]
    dtype, quantization = QUANT[kind]
    b = make_mla_batch([12, 0, 30], [1, 1, 1], page_size=8, num_heads=4, dtype=dtype, seed=4, **quantization)
    poisoned = min(set(range(1, b.blocks.shape[0])) - set(b.lookup_table.flatten().tolist()))  # a spare page
    if dtype.itemsize == 1:
        b.scales[poisoned] = float("nan")
    else:
        b.blocks[poisoned] = float("nan")
    width = b.lookup_table.shape[1]
    wide = torch.full((3, width + 8), poisoned, dtype=torch.int32)
    wide[:, :width] = b.lookup_table
    out, buffers = _attention_unchecked(b, q_rows, lengths, wide[:, :width], offsets)
    assert all(_guards_hold(buffer, SENTINEL) for buffer in buffers)
    written = ~(out == 0).all(-1).all(-1)
    assert written.any() and torch.isfinite(out[written]).all()


def test_unchecked_mla_attention_skips_bad_page_ids(monkeypatch):
    """Page ids outside `blocks` (the pages around it hold NaN) are never read."""
    b = make_mla_batch([12, 0, 30], [1, 1, 1], page_size=8, num_heads=4, dtype=torch.bfloat16, seed=3)
    blocks, _ = _guarded(b.blocks, float("nan"))
    table = b.lookup_table.clone()
    table[0, :2] = torch.tensor([-1, b.blocks.shape[0]])
    table[2, :4] = torch.tensor([2**31 - 1, -(2**31), NULL_PAGE, b.blocks.shape[0] + 5])
    args = (b.q_nope, b.q_rope, blocks, b.cache_lengths, table, b.input_row_offsets, b.layer_idx, 0.1)
    out = torch.ops.paged_kv.mla_attention.unchecked(*args, True, None)
    assert torch.isfinite(out).all()


def test_wide_slots_take_int64_in_page_offsets(tmp_path):
    """A continuous-batching MLA pool whose slot spans more than 2**31 elements (2**26 + 2 tokens of
    32 elements): `store_latent` writes its last tokens where they belong, not into page 0 (an i32
    `offset * token stride` wrapped there); attention plans its int64 variant (`wide_page`)."""
    from torch_paged_kv.ops.triton.mla_store import mla_views, store_latent

    slot = 2**26 + 2
    shape = (2, 1, 1, slot, 1, 32)  # rank 16 + rope 16, float16
    storage = torch.from_file(str(tmp_path / "pool.bin"), shared=True, size=2 * slot * 32, dtype=torch.float16)
    blocks = storage.view(shape)
    gen = torch.Generator().manual_seed(1)
    latent, rope = (torch.randn(4, 16, generator=gen).half() for _ in range(2))
    lengths, table = torch.tensor([slot - 4], dtype=torch.int32), torch.ones(1, 8, dtype=torch.int32)
    store_latent(StoreLatentArgs(latent, rope, blocks, lengths, table, torch.tensor([0, 4], dtype=torch.int32), 0))
    assert torch.equal(blocks[1, 0, 0, -4:, 0, :16], latent) and torch.equal(blocks[1, 0, 0, -4:, 0, 16:], rope)
    assert not blocks[0, 0, 0, :8].any()  # where the wrapped offsets pointed
    assert triton_mla.wide_page(*mla_views(blocks, 16, None)[:2])


@pytest.mark.parametrize("splits", [1, 3])
def test_64_head_tiles_match_fp64_in_the_interpreter(monkeypatch, splits):
    """The tile sm_90 decode takes at 64+ heads (64 heads x 32 keys), forced in the interpreter: 96
    heads make two head blocks, the second half empty; per-token FP8 rows too; and forced splits,
    some holding no key of the shorter sequences, merged."""
    monkeypatch.setattr(triton_mla, "_blocks_for", lambda *_: (64, 1, 32, 8))
    monkeypatch.setattr(triton_mla, "num_splits", lambda *_: splits)
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        b = make_mla_batch([140, 3, 70], [1, 1, 1], page_size=8, num_heads=96, dtype=dtype, seed=5)
        a = MLAAttentionArgs(b.q_nope, b.q_rope, b.blocks, *b.step, b.layer_idx, 0.2, True, b.scales)
        assert len(triton_mla.plan_mla_attention(a)[1]) == (2 if splits > 1 else 1)  # (the merge)
        _check(b, 0.2)


@pytest.mark.parametrize(
    ("heads", "decode", "dtype", "fp8", "granules", "expected"),
    [
        (128, True, "bf16", False, False, (64, 1, 32, 8)),
        (64, True, "bf16", True, False, (64, 1, 32, 8)),
        (32, True, "bf16", False, False, (16, 1, 32, 4)),  # fewer heads than one tile
        (128, False, "bf16", False, False, (16, 1, 32, 8)),  # prefill
        (128, True, "fp32", False, False, (16, 1, 16, 8)),  # no tensor cores
        (128, True, "bf16", True, True, (16, 1, 32, 8)),  # scale granules (not timed)
    ],
)
def test_sm90_decode_at_64_heads_or_more_takes_64_head_tiles(heads, decode, dtype, fp8, granules, expected):
    fp32 = dtype == "fp32"
    got = triton_mla._blocks_for(512, heads, decode, False, fp32, fp8, hw_fp8=True, wgmma=True, granules=granules)
    assert got == expected
    assert triton_mla._blocks_for(512, heads, decode, False, fp32, fp8, hw_fp8=True, wgmma=False)[0] == 16
