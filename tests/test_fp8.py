"""FP8 caches: the quantization rule against an independent fp64 implementation, the ops on FP8 pools
(store quantizes, attention and gather dequantize, copy moves scales), validation, and accuracy."""

from __future__ import annotations

import pytest
import torch

import torch_paged_kv as pk
from torch_paged_kv.ops import quant
from torch_paged_kv.testing import (
    ATTENTION_TOLERANCE,
    attention_fp64,
    make_fp8_batch,
    make_paged_batch,
    outlier_kv,
    quantized_attention_error,
)

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


# -- an independent fp64 implementation of the rule ------------------------------------------------


def _fp8_grid(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Every finite value of `dtype` in fp64, ascending, and whether its bit pattern is even."""
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = bits.view(dtype).double()
    finite = values.isfinite() & ~((values == 0) & (bits >= 128))  # drop NaN/inf and -0
    order = values[finite].argsort()
    return values[finite][order], (bits[finite][order].int() % 2 == 0)


def round_to_fp8(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round fp64 `x` (already within ±max) to the nearest `dtype` value, ties to the even pattern."""
    grid, even = _fp8_grid(dtype)
    hi = torch.searchsorted(grid, x).clamp(1, len(grid) - 1)
    lo = hi - 1
    down, up = x - grid[lo], grid[hi] - x
    pick_hi = (up < down) | ((up == down) & even[hi])
    return torch.where(pick_hi, grid[hi], grid[lo])


def quantize_fp64(x: torch.Tensor, dtype: torch.dtype, granularity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q as fp64, fp32 scales): scale = amax / max rounded once to fp32; q = round(x / scale), clamped."""
    top = torch.finfo(dtype).max
    groups = x.double().unflatten(-1, (x.shape[-1] // granularity, granularity))
    scales = (groups.abs().amax(-1) / top).float()
    ratio = torch.where(scales[..., None] > 0, groups / scales.double()[..., None].clamp_min(1e-300), 0.0)
    return round_to_fp8(ratio.clamp(-top, top), dtype).flatten(-2), scales


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("granularity", [128, 64, 32, 8])
def test_quantize_matches_the_fp64_rule_bit_for_bit(dtype, granularity):
    gen = torch.Generator().manual_seed(granularity)
    x = torch.randn(37, 4, 128, generator=gen) * torch.logspace(-3, 3, 37)[:, None, None]
    x[0] = 0.0  # zeros: scale 0, q 0
    x[1] = 2.5  # all equal: every element at ±max
    x[2, :, :granularity] = torch.tensor(1e-40)  # subnormal fp32 inputs
    x[3] = torch.randn(4, 128, generator=gen) * 1e37  # huge
    x[4, 1, 3] = -3.0e38
    q, scales = quant.quantize(x, dtype, granularity)
    want_q, want_scales = quantize_fp64(x, dtype, granularity)
    assert torch.equal(scales, want_scales)
    assert torch.equal(q.double(), want_q)
    assert (q[0].double() == 0).all() and (scales[0] == 0).all()
    assert (q[1].double() == torch.finfo(dtype).max).all()
    back = quant.dequantize(q, scales)
    assert back.isfinite().all() and (back[0] == 0).all()
    assert torch.equal(
        back, (want_q.unflatten(-1, (128 // granularity, -1)) * want_scales.double()[..., None]).flatten(-2).float()
    )


@pytest.mark.parametrize("dtype", FP8)
def test_static_quantization_saturates(dtype):
    x = torch.tensor([0.0, 1.0, -1.0, 1e30, -1e30, 3.3])
    q = quant.quantize_static(x, dtype, 0.5)
    top = torch.finfo(dtype).max
    assert torch.equal(q.double(), round_to_fp8((x.double() / 0.5).clamp(-top, top), dtype))
    assert q.double().abs().max() == top


# -- params, collections, views ---------------------------------------------------------------------


def test_params_validate_and_round_trip():
    p = pk.KVCacheParams(torch.float8_e4m3fn, 2, 4, 64, 16)
    assert p.quantization_granularity == 64 and p.scale_dtype == torch.float32 and p.has_scales_tensor
    assert p == pk.KVCacheParams(torch.float8_e4m3fn, 2, 4, 64, 16, quantization_granularity=64)
    assert pk.KVCacheParams.from_dict(p.to_dict()) == p
    s = pk.KVCacheParams(torch.float8_e5m2, 2, 4, 64, 16, static_scales=(0.5, 2))
    assert s.static_scales == (0.5, 2.0) and not s.has_scales_tensor and pk.KVCacheParams.from_dict(s.to_dict()) == s
    assert "quantization_granularity" not in pk.KVCacheParams(torch.bfloat16, 2, 4, 64, 16).to_dict()
    bad = [
        (dict(dtype=torch.bfloat16, quantization_granularity=32), "^quantization_granularity: only an FP8"),
        (dict(quantization_granularity=48), "^quantization_granularity: expected a divisor of head_dim=64"),
        (dict(quantization_granularity=0), "^quantization_granularity: expected a positive int"),
        (dict(scale_dtype=torch.bfloat16), "^scale_dtype: expected one of"),
        (dict(static_scales=(1.0,)), "^static_scales: expected 2 floats"),
        (dict(static_scales=(1.0, float("nan"))), "^static_scales: expected finite positive"),
        (dict(static_scales=(1.0, 1.0), quantization_granularity=32), "^static_scales: a per-tensor FP8 cache"),
    ]
    for over, match in bad:
        with pytest.raises(ValueError, match=match):
            pk.KVCacheParams(
                **{**dict(dtype=torch.float8_e4m3fn, num_layers=2, num_kv_heads=4, head_dim=64, page_size=16), **over}
            )
    with pytest.raises(ValueError, match="^scale_dtype"):
        pk.KVCacheParams.from_dict({**p.to_dict(), "scale_dtype": "float64"})


def test_collection_allocates_scales_and_counts_them():
    p = pk.KVCacheParams(
        torch.float8_e4m3fn, num_layers=3, num_kv_heads=2, head_dim=64, page_size=8, quantization_granularity=32
    )
    c = pk.PagedKVCacheCollection(p, num_pages=10, max_batch_size=2, max_seq_len=40)
    assert c.scales.shape == (11, 2, 3, 8, 2, 2) and c.scales.dtype == torch.float32
    bf16 = pk.PagedKVCacheCollection(pk.KVCacheParams(torch.bfloat16, 3, 2, 64, 8), 10, 2, 40)
    assert bf16.scales is None
    assert c.memory_footprint() - bf16.memory_footprint() == c.scales.numel() * 4 - c.blocks.numel()  # fp8: 1 byte
    assert p.scale_bytes_per_token == 2 * 3 * 2 * 2 * 4 and p.bytes_per_token == 2 * 3 * 2 * 64
    static = pk.PagedKVCacheCollection(
        pk.KVCacheParams(torch.float8_e4m3fn, 3, 2, 64, 8, static_scales=(2.0, 4.0)), 10, 2, 40
    )
    assert static.scales.tolist() == [2.0, 4.0]


@pytest.mark.parametrize("continuous", [False, True])
def test_views_load_dequantized_and_raw_and_scales(continuous):
    p = pk.KVCacheParams(
        torch.float8_e4m3fn,
        num_layers=2,
        num_kv_heads=2,
        head_dim=16,
        page_size=8 if not continuous else 24,
        quantization_granularity=8,
    )
    if continuous:
        c = pk.ContinuousBatchingKVCacheCollection(p, max_batch_size=2, max_seq_len=24)
    else:
        c = pk.PagedKVCacheCollection(p, num_pages=8, max_batch_size=2, max_seq_len=24)
        c.lookup_table[1, :3] = torch.tensor([5, 2, 7], dtype=torch.int32)
    x = torch.randn(24, 2, 16)
    q, s = quant.quantize(x, p.dtype, 8)
    view = c.get_value_cache(1)
    assert view.quantization_enabled and view.quantization_granularity == 8 and view.scale_dtype == torch.float32
    for tok in range(24):
        for head in range(2):
            view.store(1, head, tok, 0, q[tok, head])
            for g in range(2):
                view.store_scale(1, head, tok, g, s[tok, head, g])
    for tok in (0, 9, 23):
        assert torch.equal(view.load_quantized(1, 1, tok).view(torch.uint8), q[tok, 1].view(torch.uint8))
        assert torch.equal(view.load(1, 1, tok), quant.dequantize(q[tok, 1], s[tok, 1]))
        assert torch.equal(view.load(1, 1, tok, dim=6, width=5), quant.dequantize(q[tok, 1], s[tok, 1])[6:11])
        assert view.load_scale(1, 0, tok, 1) == s[tok, 0, 1]
        row = view.row_idx(1, tok)
        assert view.scale_row_view()[row, view.scale_col_idx(1, 1)] == s[tok, 1, 1]  # same rows as blocks
    k, v = pk.gather_kv(c.blocks, torch.tensor([24, 0], dtype=torch.int32), c.lookup_table[[1, 0]],
                        torch.zeros(3, dtype=torch.int32), 1, 24, c.scales)  # fmt: skip
    assert torch.equal(v[0], quant.dequantize(q, s)) and k.dtype == torch.float32
    with pytest.raises(ValueError, match="^load_scale: this cache is not quantized"):
        pk.PagedKVCacheCollection(pk.KVCacheParams(torch.bfloat16, 2, 2, 16, 8), 8, 2, 24).get_key_cache(0).load_scale(
            0, 0, 0
        )


# -- ops ---------------------------------------------------------------------------------------------

CACHED, NEW = [0, 21, 40, 7, 0], [9, 5, 1, 1, 0]


def fp8_batch(dtype=torch.float8_e4m3fn, granularity: int | None = 16, continuous=False, seed=0):
    """`make_fp8_batch` over CACHED / NEW: (batch, scales, new_keys, new_values)."""
    b, new_keys, new_values = make_fp8_batch(
        CACHED, NEW, dtype=dtype, granularity=granularity, page_size=64 if continuous else 8, continuous=continuous,
        seed=seed,
    )  # fmt: skip
    return b, b.scales, new_keys, new_values


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("granularity", [32, 16, 8, None])
@pytest.mark.parametrize("continuous", [False, True])
def test_store_quantizes_and_attention_reads_the_dequantized_cache(force_backend, dtype, granularity, continuous):
    force_backend("reference")
    b, scales, new_keys, new_values = fp8_batch(dtype, granularity, continuous=continuous)
    pk.store_kv(new_keys, new_values, b.blocks, *b.step, b.layer_idx, scales)
    for causal, window in [(True, -1), (False, -1), (True, 6)]:
        out = pk.flash_attention(b.q, b.blocks, *b.step, b.layer_idx, 0.3, causal, window, 0.0, scales)
        want = attention_fp64(b.q, b.keys, b.values, CACHED, 0.3, causal, window)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.double(), want, **ATTENTION_TOLERANCE[out.dtype])
    k, v = pk.gather_kv(b.blocks, *b.step, b.layer_idx, 45, scales, torch.float64)
    for i, (kk, vv) in enumerate(zip(b.keys, b.values, strict=True)):
        assert torch.equal(k[i, : len(kk)], kk.double()) and torch.equal(v[i, : len(vv)], vv.double())
        assert not k[i, len(kk) :].any()


def test_copy_pages_moves_scales_with_their_pages():
    b, scales, _, _ = fp8_batch(granularity=16)
    src, dst = torch.tensor([1, 2, 3], dtype=torch.int32), torch.tensor([3, 1, 4], dtype=torch.int32)
    blocks0, scales0 = b.blocks.clone(), scales.clone()
    pk.copy_pages(b.blocks, src, dst, scales)
    assert torch.equal(b.blocks[[3, 1, 4]].view(torch.uint8), blocks0[[1, 2, 3]].view(torch.uint8))
    assert torch.equal(scales[[3, 1, 4]], scales0[[1, 2, 3]]) and torch.equal(scales[2], scales0[2])


def _call(op: str, b, **kw):
    kw = dict(q=b.q, key=b.new_keys.bfloat16(), value=b.new_values.bfloat16(), blocks=b.blocks) | kw
    step = (*b.step, b.layer_idx)
    if op == "store_kv":
        pk.store_kv(kw["key"], kw["value"], kw["blocks"], *step, kw["scales"])
    elif op == "flash_attention":
        pk.flash_attention(kw["q"], kw["blocks"], *step, 0.3, scales=kw["scales"])
    elif op == "gather_kv":
        pk.gather_kv(kw["blocks"], *step, 45, kw["scales"], kw.get("out_dtype"))
    else:
        pk.copy_pages(
            kw["blocks"], torch.tensor([1], dtype=torch.int32), torch.tensor([2], dtype=torch.int32), kw["scales"]
        )


@pytest.mark.parametrize("op", ["store_kv", "flash_attention", "gather_kv", "copy_pages"])
def test_bad_scales_are_rejected_by_name_and_change_nothing(op):
    b, scales, _, _ = fp8_batch(granularity=16)
    blocks0, scales0 = b.blocks.clone(), scales.clone()
    cases = [
        (dict(scales=None), "^scales: an FP8 cache"),
        (dict(scales=scales.double()), "^scales: expected dtype float32"),
        (dict(scales=scales[..., :1].contiguous().expand(*scales.shape[:5], 3).contiguous()), "^scales: expected \\["),
        (dict(scales=scales[:3].contiguous()), "^scales: expected \\["),
        (dict(scales=torch.ones(3)), "^scales: expected \\["),
        (dict(scales=scales.transpose(0, 1).contiguous().transpose(0, 1)), "^scales: expected a contiguous"),
        (dict(scales=scales.to("meta")), "^scales: expected device cpu"),
    ]
    if op == "store_kv":
        cases.append((dict(key=b.new_keys.to(torch.float8_e4m3fn)), "^key: expected float32/float16/bfloat16"))
        cases.append((dict(value=b.new_values.half()), "^value: expected dtype torch.bfloat16 like key"))
    if op == "gather_kv":
        cases.append((dict(out_dtype=torch.int32), "^out_dtype: expected float64/float32"))
    for over, match in cases:
        with pytest.raises(ValueError, match=match):
            _call(op, b, **{"scales": scales, **over})
        assert torch.equal(b.blocks.view(torch.uint8), blocks0.view(torch.uint8)) and torch.equal(scales, scales0)
    bf16 = make_paged_batch(CACHED, NEW, page_size=8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="^scales: only an FP8 cache has scales"):
        _call(op, bf16, scales=torch.ones(2), q=bf16.q, key=bf16.new_keys, value=bf16.new_values)


# opcheck's test_schema compares tensors with torch.allclose, which torch does not implement for
# FP8; the mutation annotations it would check are checked bit for bit by the next test instead.
OPCHECK_FP8 = ("test_faketensor", "test_aot_dispatch_dynamic", "test_autograd_registration")


@pytest.mark.parametrize("overload", ["default", "unchecked"])
@pytest.mark.parametrize("granularity", [16, None])
def test_opcheck_fp8(overload, granularity):
    b, scales, _, _ = fp8_batch(granularity=granularity)
    ops = torch.ops.paged_kv
    step = (*b.step, b.layer_idx)
    rows = (b.new_keys.bfloat16(), b.new_values.bfloat16())
    pages = torch.tensor([1, 2], dtype=torch.int32), torch.tensor([4, 3], dtype=torch.int32)
    for op, args in [
        (ops.store_kv, (*rows, b.blocks, *step, scales)),
        (ops.flash_attention, (b.q, b.blocks, *step, 0.3, True, -1, 0.0, scales)),
        (ops.gather_kv, (b.blocks, *step, 45, scales, torch.bfloat16)),
        (ops.copy_pages, (b.blocks, *pages, scales)),
    ]:
        torch.library.opcheck(getattr(op, overload), args, test_utils=OPCHECK_FP8)


@pytest.mark.parametrize("granularity", [16, None])
def test_fp8_ops_mutate_exactly_what_their_schemas_declare(granularity):
    b, scales, new_keys, new_values = fp8_batch(granularity=granularity)
    pages = torch.tensor([1, 2], dtype=torch.int32), torch.tensor([4, 3], dtype=torch.int32)
    calls = {
        "store_kv": lambda: pk.store_kv(new_keys, new_values, b.blocks, *b.step, b.layer_idx, scales),
        "flash_attention": lambda: pk.flash_attention(b.q, b.blocks, *b.step, b.layer_idx, 0.3, scales=scales),
        "gather_kv": lambda: pk.gather_kv(b.blocks, *b.step, b.layer_idx, 45, scales),
        "copy_pages": lambda: pk.copy_pages(b.blocks, *pages, scales),
    }
    for name, call in calls.items():
        before = [b.blocks.view(torch.uint8).clone(), scales.clone()]
        call()
        changed = [not torch.equal(b.blocks.view(torch.uint8), before[0]), not torch.equal(scales, before[1])]
        declared = [f"{arg.name}" for arg in getattr(torch.ops.paged_kv, name).default._schema.arguments
                    if arg.alias_info is not None and arg.alias_info.is_write]  # fmt: skip
        assert changed[0] <= ("blocks" in declared) and changed[1] <= ("scales" in declared), name
        if name in ("store_kv", "copy_pages"):
            assert changed[0] and changed[1] == (granularity is not None), name  # static scales never change


# -- accuracy ----------------------------------------------------------------------------------------


def test_per_token_scales_beat_per_tensor_on_outliers():
    """Decode attention error against the bf16 cache, 512 keys with a few 100x channels: one scale per
    token and head is much closer than one per tensor; finer granules are no worse."""
    k, v = outlier_kv(512, 2, 128, outliers=True)
    q = torch.randn(8, 128, generator=torch.Generator().manual_seed(1))
    per_token = quantized_attention_error(k, v, q, torch.float8_e4m3fn, 128)[1]
    per_tensor = quantized_attention_error(k, v, q, torch.float8_e4m3fn, None)[1]
    granule32 = quantized_attention_error(k, v, q, torch.float8_e4m3fn, 32)[1]
    assert per_token < per_tensor / 2 and granule32 <= per_token * 1.1, (per_token, per_tensor, granule32)


def test_backend_info_says_which_backend_runs_an_fp8_cache_and_why(force_backend):
    from torch_paged_kv.ops import cute

    fp8 = pk.KVCacheParams(torch.float8_e4m3fn, 1, 2, 96, 16, quantization_granularity=32)
    odd = pk.KVCacheParams(torch.float8_e4m3fn, 1, 2, 96, 16, quantization_granularity=48)
    bf16 = pk.KVCacheParams(torch.bfloat16, 1, 2, 96, 16)
    assert set(pk.backend_info("cpu", fp8).values()) == {"cpu"}  # the cpu kernels cover FP8 pools
    force_backend("triton")  # the interpreter runs Triton on CPU tensors here (tests/conftest.py)
    assert pk.backend_info("cpu", bf16)["store_kv"] == pk.backend_info("cpu", fp8)["store_kv"] == "triton"
    assert pk.backend_info("cpu", odd)["store_kv"] == (
        "unavailable: triton: its kernels tile FP8 granules of a power of two elements, not 48"
    )
    declines = cute.KERNELS["flash_attention"][2]
    assert declines(bf16) is None and "FP8 pages with scales" in declines(fp8)
