"""MLA latent caches: params and layout, the per-layer view's latent/rope rows, the ops `store_latent` and
`mla_attention` (reference backend) against an fp64 oracle of the absorbed formula, which is itself
checked against the non-absorbed one (decompressed K and V), FP8 rope-aware rows, validation, compile."""

from __future__ import annotations

import pytest
import torch

import torch_paged_kv as pk
from torch_paged_kv import layout
from torch_paged_kv.ops import quant
from torch_paged_kv.ops.cute.operand import KVCacheMHAOperand
from torch_paged_kv.testing import (
    ATTENTION_TOLERANCE,
    absorb_query,
    make_mla_batch,
    mla_attention_fp64,
    mla_nonabsorbed_fp64,
    mla_row_contents,
)

# -- params and layout ---------------------------------------------------------------------------


def test_mla_params_derive_the_row_width():
    bf16 = pk.KVCacheParams.mla(torch.bfloat16, num_layers=4, page_size=64)
    assert (bf16.num_kv_heads, bf16.head_dim, bf16.kv_lora_rank, bf16.rope_dim, bf16.num_planes) == (1, 576, 512, 64, 1)
    assert bf16.rope_dtype == torch.bfloat16 and bf16.bytes_per_token == 4 * 576 * 2
    fp8 = pk.KVCacheParams.mla(torch.float8_e4m3fn, num_layers=4, page_size=64)
    # MAX's rope-aware row: 512 FP8 latent bytes, then 64 bf16 rope elements (128 bytes)
    assert (fp8.head_dim, fp8.quantization_granularity, fp8.scales_per_head, fp8.rope_dtype) == (
        640,
        512,
        1,
        torch.bfloat16,
    )
    assert fp8.bytes_per_token == 4 * 640 and fp8.scale_bytes_per_token == 4 * 4
    blocked = pk.KVCacheParams.mla(torch.float8_e4m3fn, 4, 64, quantization_granularity=128)
    assert blocked.scales_per_head == 4
    static = pk.KVCacheParams.mla(torch.float8_e5m2, 4, 64, static_scales=(0.1,))
    assert not static.has_scales_tensor and static.head_dim == 640
    for params in (bf16, fp8, blocked, static):
        assert pk.KVCacheParams.from_dict(params.to_dict()) == params
    # the same params written out by hand compare equal
    assert pk.KVCacheParams(torch.bfloat16, 4, 1, 576, 64, is_mla=True, rope_dim=64) == bf16


def test_old_mla_and_mha_dicts_load_as_before():
    old = {"dtype": "float32", "num_layers": 2, "num_kv_heads": 1, "head_dim": 16, "page_size": 4, "is_mla": True}
    params = pk.KVCacheParams.from_dict(old)
    assert (params.kv_lora_rank, params.rope_dim) == (16, 0)  # the whole row is latent, as it was
    mha = pk.KVCacheParams(torch.float16, 2, 2, 8, 4)
    assert "kv_lora_rank" not in mha.to_dict() and "rope_dim" not in mha.to_dict()
    fp8_old = dict(old, dtype="float8_e4m3fn", quantization_granularity=8, scale_dtype="float32")
    assert pk.KVCacheParams.from_dict(fp8_old).scales_per_head == 2  # every element quantized, as before


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(rope_dim=-1), "rope_dim"),
        (dict(kv_lora_rank=0), "kv_lora_rank"),
        (dict(rope_dim=True), "rope_dim"),
        (dict(quantization_granularity=100, dtype=torch.float8_e4m3fn), "quantization_granularity"),
        (dict(static_scales=(0.1, 0.2), dtype=torch.float8_e4m3fn), "static_scales"),
    ],
)
def test_mla_params_reject_bad_fields(kwargs, field):
    kwargs = {"dtype": torch.bfloat16, **kwargs}
    with pytest.raises(ValueError, match=field):
        pk.KVCacheParams.mla(kwargs.pop("dtype"), 2, 16, **kwargs)


def test_mla_fields_need_is_mla_and_a_consistent_head_dim():
    with pytest.raises(ValueError, match="rope_dim: only an MLA cache"):
        pk.KVCacheParams(torch.bfloat16, 2, 2, 64, 16, rope_dim=16)
    with pytest.raises(ValueError, match="head_dim: an MLA row is kv_lora_rank \\+ 2 \\* rope_dim"):
        pk.KVCacheParams(torch.float8_e4m3fn, 2, 1, 576, 16, is_mla=True, kv_lora_rank=512, rope_dim=64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("continuous", [False, True])
def test_mla_views_split_each_row_into_latent_and_rope(dtype, continuous):
    gen = torch.Generator().manual_seed(0)
    params = pk.KVCacheParams.mla(
        dtype, num_layers=3, page_size=5 if not continuous else 12, kv_lora_rank=32, rope_dim=8
    )
    if continuous:
        c = pk.ContinuousBatchingKVCacheCollection(params, max_batch_size=2, max_seq_len=12)
    else:
        c = pk.PagedKVCacheCollection(params, num_pages=6, max_batch_size=2, max_seq_len=12)
        c.lookup_table[:, :3] = torch.tensor([[4, 2, 6], [1, 5, 3]], dtype=torch.int32)
    assert c.blocks.shape == (c.num_pages + 1, 1, 3, params.page_size, 1, params.head_dim)
    with pytest.raises(ValueError, match="no value plane"):
        c.get_value_cache(0)
    view = c.get_latent_cache(1)
    assert view.is_mla and (view.kv_lora_rank, view.rope_dim) == (32, 8)
    assert view.page_stride == 3 * params.page_size  # the MLA stride: one plane
    latent = torch.randn(32, generator=gen)
    rope = torch.randn(8, generator=gen)
    b, tok = 1, 7
    page = int(c.lookup_table[b]) if continuous else int(c.lookup_table[b, tok // params.page_size])
    row = c.blocks[page, 0, 1, tok % params.page_size, 0]  # the token's row, by plain indexing
    if params.quantized:
        q, scale = quant.quantize(latent, dtype, 32)
        view.store(b, 0, tok, 0, q)
        view.store_scale(b, 0, tok, 0, scale[0])
        expected_latent = q.float() * scale
        assert torch.equal(row[32:].view(torch.bfloat16), torch.zeros(8, dtype=torch.bfloat16))
    else:
        view.store(b, 0, tok, 0, latent.to(dtype))
        expected_latent = latent.to(dtype)
    view.store_rope(b, tok, rope)
    assert torch.equal(view.load_latent(b, tok), expected_latent)
    assert torch.equal(view.load_rope(b, tok), rope.bfloat16())
    assert view.rope_row_view().dtype == torch.bfloat16 and view.rope_row_view().shape == (view.num_kv_rows(), 8)
    r = view.row_idx(b, tok)
    assert view.get_tma_row(page * params.page_size + tok % params.page_size) == r
    assert torch.equal(view.rope_row_view()[r], rope.bfloat16())
    tail = row[32:].view(torch.bfloat16) if params.quantized else row[32:]
    assert torch.equal(tail, rope.bfloat16())  # the rope sits after the latent in the row
    logical = view.load(b, 0, tok)
    assert logical.shape == (40,) and torch.equal(logical[32:].float(), rope.bfloat16().float())
    # The CuTe operand sees the same rows with the MLA stride; its "V" row is the latent row.
    op = KVCacheMHAOperand.from_blocks(c.blocks, c.cache_lengths, c.lookup_table, 1)
    assert op.is_mla and op.get_tma_row(page * params.page_size + tok % params.page_size, 1) == r
    assert op.page_stride == layout.page_stride_rows(1, 3, params.page_size)


def test_mha_views_have_no_latent_rows():
    c = pk.PagedKVCacheCollection(pk.KVCacheParams(torch.float32, 1, 2, 8, 4), 2, 1, 8)
    with pytest.raises(ValueError, match="only an MLA cache"):
        c.get_key_cache(0).rope_row_view()
    with pytest.raises(ValueError, match="only an MLA cache"):
        c.get_latent_cache(0)


# -- store_latent ----------------------------------------------------------------------------------

QUANT = {
    "bf16": (torch.bfloat16, {}),
    "fp32": (torch.float32, {}),
    "fp8-per-token": (torch.float8_e4m3fn, {}),
    "fp8-granule8": (torch.float8_e4m3fn, dict(quantization_granularity=8)),
    "e5m2-static": (torch.float8_e5m2, dict(static_scales=(0.01,))),
}


def _raw(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.mark.parametrize("kind", QUANT)
@pytest.mark.parametrize("page_size, continuous", [(1, False), (5, False), (24, True)])
def test_store_latent_writes_exactly_the_new_rows(kind, page_size, continuous):
    dtype, quantization = QUANT[kind]
    b = make_mla_batch(
        [3, 0, 9], [2, 4, 1], page_size=page_size, dtype=dtype, continuous=continuous, seed=2, **quantization
    )
    expected_blocks, expected_scales = b.blocks.clone(), None if b.scales is None else b.scales.clone()
    # the expected pool, by plain indexing: each new row at its slot, as the FP8 rule stores it
    params = pk.KVCacheParams.mla(dtype, 2, page_size, 32, 16, **quantization)
    stored, row_scales, _, rope = mla_row_contents(b.new_latent, b.new_rope, params)
    row = 0
    for s, (cached, new) in enumerate(zip([3, 0, 9], [2, 4, 1], strict=True)):
        for t in range(cached, cached + new):
            page = int(b.lookup_table[s]) if continuous else int(b.lookup_table[s, t // page_size])
            slot = (page, 0, b.layer_idx, t % page_size, 0)
            packed = torch.cat(
                (_raw(stored[row]), _raw(rope[row]).view(torch.uint8) if params.quantized else rope[row])
            )
            _raw(expected_blocks)[slot] = packed
            if row_scales is not None:
                expected_scales[slot] = row_scales[row]
            row += 1
    pk.store_latent(b.new_latent, b.new_rope, b.blocks, *b.step, b.layer_idx, b.scales)
    assert torch.equal(_raw(b.blocks), _raw(expected_blocks))
    assert b.scales is None or torch.equal(b.scales, expected_scales)


# -- mla_attention (reference backend) against the fp64 oracle --------------------------------------

ATTENTION_CASES = {
    # name: (cached, new, page_size, continuous, heads, rank, rope, dtype, causal)
    "prefill-page1": ([0, 0, 0], [5, 1, 9], 1, False, 4, 32, 16, torch.float32, True),
    "chunked-page3": ([7, 0, 12], [6, 3, 5], 3, False, 2, 32, 16, torch.bfloat16, True),
    "chunked-page16-noncausal": ([20, 33], [17, 2], 16, False, 4, 16, 8, torch.float32, False),
    "decode-ragged-page4": ([45, 3, 60, 0], [1, 1, 1, 1], 4, False, 8, 32, 16, torch.float16, True),
    "decode-equal-slots": ([9, 9], [1, 1], 16, True, 3, 32, 16, torch.float32, True),
    "slots-mixed-no-rope": ([10, 0, 31], [1, 6, 1], 40, True, 4, 32, 0, torch.bfloat16, True),
}


def _check_attention(b, scale: float, causal: bool = True) -> torch.Tensor:
    pk.store_latent(b.new_latent, b.new_rope, b.blocks, *b.step, b.layer_idx, b.scales)
    got = pk.mla_attention(b.q_nope, b.q_rope, b.blocks, *b.step, b.layer_idx, scale, causal, b.scales)
    assert got.shape == b.q_nope.shape and got.dtype == b.q_nope.dtype and got.is_contiguous()  # as the fake says
    expected = mla_attention_fp64(b.q_nope, b.q_rope, b.latents, b.ropes, b.cache_lengths.tolist(), scale, causal)
    torch.testing.assert_close(got, expected.to(got.dtype), **ATTENTION_TOLERANCE[got.dtype])
    return got


@pytest.mark.parametrize("name", ATTENTION_CASES)
def test_mla_attention_matches_fp64(name):
    cached, new, page_size, continuous, heads, rank, rope, dtype, causal = ATTENTION_CASES[name]
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
    )
    _check_attention(b, (rank + rope) ** -0.5, causal)


DEEPSEEK_CASES = {  # kv_lora_rank 512, rope 64, qk_nope 128, v 128: (cached, new, page_size, heads, dtype)
    "decode-page1-h128": ([37, 5], [1, 1], 1, 128, torch.bfloat16),
    "chunked-page16-h16": ([19, 0], [3, 6], 16, 16, torch.bfloat16),
    "decode-page64-h16-fp32": ([70, 130, 1], [1, 1, 1], 64, 16, torch.float32),
    "prefill-page64-h128": ([0, 5], [7, 3], 64, 128, torch.bfloat16),
}


@pytest.mark.parametrize("name", DEEPSEEK_CASES)
def test_mla_attention_deepseek_shapes_match_the_non_absorbed_formula(name):
    """At DeepSeek's shapes with random W_UK / W_UV: the op against the fp64 absorbed oracle on the
    queries it is given, that oracle (with exact queries) against MLA with decompressed K and V, and,
    for fp32, the op's output through W_UV against the non-absorbed formula directly."""
    cached, new, page_size, heads, dtype = DEEPSEEK_CASES[name]
    b = make_mla_batch(
        cached, new, page_size=page_size, num_heads=heads, kv_lora_rank=512, rope_dim=64, dtype=dtype, seed=5
    )
    gen = torch.Generator().manual_seed(6)
    w_uk, w_uv = torch.randn(2, heads, 128, 512, generator=gen, dtype=torch.float64) / 512**0.5
    q_nope_full = torch.randn(b.q_nope.shape[0], heads, 128, generator=gen, dtype=torch.float64)
    b.q_nope = absorb_query(q_nope_full, w_uk).to(dtype)
    scale = 192**-0.5  # DeepSeek-V2: 1/sqrt(qk_nope_head_dim + qk_rope_head_dim)
    got = _check_attention(b, scale)
    exact = mla_nonabsorbed_fp64(q_nope_full, b.q_rope, b.latents, b.ropes, w_uk, w_uv, cached, scale)
    absorbed = mla_attention_fp64(absorb_query(q_nope_full, w_uk), b.q_rope, b.latents, b.ropes, cached, scale)
    torch.testing.assert_close(torch.einsum("thr,hvr->thv", absorbed, w_uv), exact, rtol=1e-10, atol=1e-12)
    if dtype == torch.float32:
        projected = torch.einsum("thr,hvr->thv", got.double(), w_uv).float()
        torch.testing.assert_close(projected, exact.float(), **ATTENTION_TOLERANCE[torch.float32])


@pytest.mark.parametrize("kind", [k for k in QUANT if k.startswith(("fp8", "e5m2"))])
@pytest.mark.parametrize("cached, new", [([12, 0, 30], [1, 5, 2]), ([40, 7], [1, 1])])
def test_mla_attention_on_fp8_rows_matches_fp64_over_what_the_cache_holds(kind, cached, new):
    dtype, quantization = QUANT[kind]
    b = make_mla_batch(cached, new, page_size=8, dtype=dtype, seed=7, **quantization)
    _check_attention(b, 0.15)


def test_absorbed_mla_is_the_non_absorbed_formula():
    """The oracle's absorbed formula equals MLA with decompressed K and V (fp64, to rounding), and the
    op's fp32 output, projected through W_UV, matches the non-absorbed formula within fp32 tolerance."""
    gen = torch.Generator().manual_seed(11)
    heads, nope, v_dim, rank, rope = 4, 24, 20, 32, 16
    b = make_mla_batch([9, 0, 17], [3, 5, 1], page_size=4, num_heads=heads, kv_lora_rank=rank, rope_dim=rope, seed=4)
    w_uk = torch.randn(heads, nope, rank, generator=gen, dtype=torch.float64) / rank**0.5
    w_uv = torch.randn(heads, v_dim, rank, generator=gen, dtype=torch.float64) / rank**0.5
    q_nope_full = torch.randn(b.q_nope.shape[0], heads, nope, generator=gen, dtype=torch.float64)
    b.q_nope = absorb_query(q_nope_full, w_uk).float()
    scale = (nope + rope) ** -0.5
    lengths = b.cache_lengths.tolist()
    exact = mla_nonabsorbed_fp64(q_nope_full, b.q_rope, b.latents, b.ropes, w_uk, w_uv, lengths, scale)
    absorbed = mla_attention_fp64(absorb_query(q_nope_full, w_uk), b.q_rope, b.latents, b.ropes, lengths, scale)
    torch.testing.assert_close(torch.einsum("thr,hvr->thv", absorbed, w_uv), exact, rtol=1e-12, atol=1e-12)
    got = _check_attention(b, scale)
    projected = torch.einsum("thr,hvr->thv", got.double(), w_uv)
    torch.testing.assert_close(projected.float(), exact.float(), **ATTENTION_TOLERANCE[torch.float32])


# -- validation: a rejected call names the argument and leaves blocks and scales bit-identical --------


def _fp8_batch():
    return make_mla_batch([5, 9, 0], [2, 1, 3], page_size=4, dtype=torch.float8_e4m3fn, seed=3)


def _args(b, **over) -> tuple[dict, dict]:
    store = dict(
        latent=b.new_latent,
        k_rope=b.new_rope,
        blocks=b.blocks,
        cache_lengths=b.cache_lengths,
        lookup_table=b.lookup_table,
        input_row_offsets=b.input_row_offsets,
        layer_idx=b.layer_idx,
        scales=b.scales,
    )
    attend = dict(q_nope=b.q_nope, q_rope=b.q_rope, **{k: v for k, v in store.items() if k not in ("latent", "k_rope")})
    attend = dict(list(attend.items())[:7]) | dict(softmax_scale=0.1, causal=True, scales=b.scales)
    return {**store, **{k: v for k, v in over.items() if k in store}}, {
        **attend,
        **{k: v for k, v in over.items() if k in attend},
    }


def _mha_pool(b):
    return torch.zeros(b.blocks.shape[0], 2, *b.blocks.shape[2:], dtype=torch.bfloat16)


MLA_CASES = {
    # case: (ops it applies to, argument named, override)
    "latent dtype": ("store", "latent", lambda b: dict(latent=b.new_latent.to(torch.int32))),
    "latent 3-D": ("store", "latent", lambda b: dict(latent=b.new_latent[:, None])),
    "rank and rope do not fill the row": ("store", "latent", lambda b: dict(latent=b.new_latent[:, :16])),
    "rope width": ("store", "latent", lambda b: dict(k_rope=b.new_rope[:, :8])),
    "rope rows": ("store", "k_rope", lambda b: dict(k_rope=b.new_rope[:-1])),
    "rope dtype": ("store", "k_rope", lambda b: dict(k_rope=b.new_rope.half())),
    "latent requires grad": ("store", "latent", lambda b: dict(latent=b.new_latent.float().requires_grad_())),
    "rows vs offsets": ("store", "input_row_offsets", lambda b: dict(latent=b.new_latent[:-1], k_rope=b.new_rope[:-1])),
    "q_nope 2-D": ("attend", "q_nope", lambda b: dict(q_nope=b.q_nope[:, 0])),
    "q_nope rank": ("attend", "q_nope", lambda b: dict(q_nope=b.q_nope[..., :16])),
    "q_rope heads": ("attend", "q_rope", lambda b: dict(q_rope=b.q_rope[:, :2])),
    "q_rope rows": ("attend", "q_rope", lambda b: dict(q_rope=b.q_rope[:-1])),
    "q_rope dtype": ("attend", "q_rope", lambda b: dict(q_rope=b.q_rope.float())),
    "q rows vs offsets": ("attend", "input_row_offsets", lambda b: dict(q_nope=b.q_nope[:-1], q_rope=b.q_rope[:-1])),
    "scale": ("attend", "softmax_scale", lambda b: dict(softmax_scale=float("nan"))),
    "no scales": ("both", "scales", lambda b: dict(scales=None)),
    "scales granules do not divide the rank": (
        "both",
        "scales",
        lambda b: dict(scales=b.scales.expand(-1, -1, -1, -1, -1, 3).contiguous()),
    ),
    "scales dtype": ("both", "scales", lambda b: dict(scales=b.scales.double())),
    "null page": ("both", "lookup_table", lambda b: dict(lookup_table=_null_page(b))),
    "layer": ("both", "layer_idx", lambda b: dict(layer_idx=2)),
    "a K/V pool": ("both", "blocks", lambda b: dict(blocks=_mha_pool(b), scales=None)),
    "two heads": ("both", "blocks", lambda b: dict(blocks=b.blocks.expand(-1, -1, -1, -1, 2, -1).contiguous())),
}


def _null_page(b):
    table = b.lookup_table.clone()
    table[0, 1] = pk.NULL_PAGE  # holds tokens 4..7 of sequence 0: read, and 5..6 written, this step
    return table


@pytest.mark.parametrize(
    "op, case", [(op, case) for case, c in MLA_CASES.items() for op in ("store", "attend") if c[0] in (op, "both")]
)
def test_mla_ops_reject_and_write_nothing(op, case):
    _, name, override = MLA_CASES[case]
    b = _fp8_batch()
    store, attend = _args(b, **override(b))
    before = (b.blocks.view(torch.uint8).clone(), b.scales.clone())
    with pytest.raises(ValueError, match=f"^{name}:"):
        if op == "store":
            pk.store_latent(*store.values())
        else:
            pk.mla_attention(*attend.values())
    assert torch.equal(b.blocks.view(torch.uint8), before[0]) and torch.equal(b.scales, before[1])


def test_kv_ops_refuse_an_mla_pool_with_a_clear_message():
    b = make_mla_batch([3], [1], page_size=4, dtype=torch.float32)
    rows = torch.zeros(1, 1, b.blocks.shape[-1])
    with pytest.raises(ValueError, match="blocks: an MLA latent cache .* store_latent / mla_attention"):
        pk.store_kv(rows, rows, b.blocks, *b.step, 0)
    with pytest.raises(ValueError, match="blocks: an MLA latent cache"):
        pk.flash_attention(rows, b.blocks, *b.step, 0, 0.1)
    with pytest.raises(ValueError, match="blocks: an MLA latent cache"):
        pk.gather_kv(b.blocks, *b.step, 0, 8)
    info = pk.backend_info("cpu", pk.KVCacheParams.mla(torch.bfloat16, 2, 16))
    assert info == {"copy_pages": "cpu", "store_latent": "cpu", "mla_attention": "cpu"}  # (only the ops it takes)
    assert "mla_attention" not in pk.backend_info("cpu", pk.KVCacheParams(torch.bfloat16, 2, 2, 64, 16))
    assert pk.backend_info("cpu")["mla_attention"] == "cpu"


# -- opcheck ------------------------------------------------------------------------------------------


# opcheck's test_schema compares tensors with torch.allclose, which torch lacks for FP8 (as in
# test_fp8.py); the mutations of an FP8 call are checked bit for bit by the next test instead.
OPCHECK_FP8 = ("test_faketensor", "test_aot_dispatch_dynamic", "test_autograd_registration")


@pytest.mark.parametrize("overload", ["default", "unchecked"])
@pytest.mark.parametrize("kind", ["bf16", "fp8-per-token"])
def test_opcheck_mla_ops(overload, kind):
    dtype, quantization = QUANT[kind]
    b = make_mla_batch([3, 0, 6], [2, 4, 1], page_size=4, dtype=dtype, seed=1, **quantization)
    utils = OPCHECK_FP8 if b.scales is not None else torch.library._OPCHECK_DEFAULT_UTILS
    torch.library.opcheck(
        getattr(torch.ops.paged_kv.store_latent, overload),
        (b.new_latent, b.new_rope, b.blocks, *b.step, b.layer_idx, b.scales),
        test_utils=utils,
    )
    torch.library.opcheck(
        getattr(torch.ops.paged_kv.mla_attention, overload),
        (b.q_nope, b.q_rope, b.blocks, *b.step, b.layer_idx, 0.3),
        {"causal": True, "scales": b.scales},
        test_utils=utils,
    )


def test_fp8_mla_ops_mutate_exactly_what_their_schemas_declare():
    b = _fp8_batch()
    before = b.blocks.view(torch.uint8).clone(), b.scales.clone(), b.q_nope.clone(), b.new_latent.clone()
    pk.mla_attention(b.q_nope, b.q_rope, b.blocks, *b.step, b.layer_idx, 0.3, scales=b.scales)
    assert torch.equal(b.blocks.view(torch.uint8), before[0]) and torch.equal(b.scales, before[1])
    pk.store_latent(b.new_latent, b.new_rope, b.blocks, *b.step, b.layer_idx, b.scales)
    assert not torch.equal(b.blocks.view(torch.uint8), before[0]) and not torch.equal(b.scales, before[1])
    assert torch.equal(b.q_nope, before[2]) and torch.equal(b.new_latent, before[3])


# -- torch.compile: a decode step, fullgraph, no recompiles across batch sizes ------------------------

LAYERS, HEADS, RANK, ROPE = 2, 4, 32, 16


def _mla_decode_step(q_nope, q_rope, latent, k_rope, plan: pk.StepPlan):
    out = q_nope
    for layer in range(LAYERS):
        plan.store_latent(latent, k_rope, layer)
        out = plan.mla_attention(out, q_rope, layer, 0.2)
    return out * 2


@pytest.mark.parametrize("kind", ["fp32", "fp8-per-token"])
def test_mla_decode_step_compiles_fullgraph_without_recompiling(kind):
    torch._dynamo.reset()
    dtype, quantization = QUANT[kind]
    q_dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    params = pk.KVCacheParams.mla(dtype, LAYERS, page_size=4, kv_lora_rank=RANK, rope_dim=ROPE, **quantization)
    collection = pk.PagedKVCacheCollection(params, num_pages=64, max_batch_size=8, max_seq_len=24)
    if params.quantized:  # random codes below every NaN pattern, and random bf16 rope bytes of small exponent
        collection.blocks.view(torch.uint8).copy_(torch.randint(0, 100, collection.blocks.view(torch.uint8).shape))
    else:
        collection.blocks.copy_(torch.randn(collection.blocks.shape, generator=gen))
    if collection.scales is not None:
        collection.scales.uniform_(0.01, 0.02, generator=gen)
    collection.lookup_table[:, :6] = (torch.randperm(64, generator=gen)[:48] + 1).view(8, 6).int()

    @torch.compile(fullgraph=True, dynamic=True)
    def compiled(q_nope, q_rope, latent, k_rope, blocks, scales, *step):
        return _mla_decode_step(q_nope, q_rope, latent, k_rope, pk.StepPlan(blocks, pk.StepTensors(*step), scales))

    for i, batch in enumerate([1, 3, 5, 8, 2, 1]):
        step = collection.step_tensors(batch)
        step.cache_lengths.copy_(torch.randint(0, 20, (batch,), generator=gen, dtype=torch.int32))
        step.input_row_offsets.copy_(torch.arange(batch + 1, dtype=torch.int32))
        rows = [torch.randn(batch, *shape, generator=gen).to(q_dtype) for shape in ((HEADS, RANK), (HEADS, ROPE))]
        rows += [torch.randn(batch, n, generator=gen).to(q_dtype) for n in (RANK, ROPE)]
        pk.mark_step_dynamic(step, *rows)
        eager = [t.clone() for t in (collection.blocks, collection.scales) if t is not None]
        expected = _mla_decode_step(*rows, pk.StepPlan(eager[0], step, *eager[1:]))
        if i == 1:
            torch.compiler.set_stance("fail_on_recompile")
        try:
            out = compiled(*rows, collection.blocks, collection.scales, *step)
        finally:
            torch.compiler.set_stance("default")
        assert torch.equal(out, expected)
        assert torch.equal(collection.blocks.view(torch.uint8), eager[0].view(torch.uint8))
        assert collection.scales is None or torch.equal(collection.scales, eager[1])


# -- manager, offload, checkpoints ------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["bf16", "fp8-granule8"])
def test_mla_pages_move_through_fork_offload_restore_and_save_load(tmp_path, kind):
    """An MLA row (and an FP8 row's scales) is page content like K/V: forking copies a partial page,
    offload/restore and save/load bring it back bit for bit, so MLA attention is unchanged."""
    dtype, quantization = QUANT[kind]
    params = pk.KVCacheParams.mla(dtype, num_layers=2, page_size=4, kv_lora_rank=RANK, rope_dim=ROPE, **quantization)

    def manager():
        return pk.KVCacheManager(pk.PagedKVCacheCollection(params, num_pages=24, max_batch_size=4, max_seq_len=40))

    m = manager()
    c = m.collection
    gen = torch.Generator().manual_seed(3)

    def step(ids, counts):
        plan = pk.StepPlan.of(c, m.prepare_step(ids, counts))
        for layer in range(params.num_layers):
            plan.store_latent(
                torch.randn(sum(counts), RANK, generator=gen).bfloat16(),
                torch.randn(sum(counts), ROPE, generator=gen).bfloat16(),
                layer,
            )
        m.commit_step()

    def attention(manager_, seq_id):
        coll = manager_.collection
        lengths = torch.tensor([manager_.cache_length(seq_id) - 1], dtype=torch.int32)
        table = torch.zeros(1, coll.lookup_table.shape[1], dtype=torch.int32)
        table[0, : len(manager_.pages(seq_id))] = torch.tensor(manager_.pages(seq_id), dtype=torch.int32)
        q = torch.randn(1, HEADS, RANK + ROPE, generator=torch.Generator().manual_seed(0)).bfloat16()
        step_ = (lengths, table, torch.tensor([0, 1], dtype=torch.int32))
        plan = pk.StepPlan(coll.blocks, pk.StepTensors(*step_), coll.scales)
        return torch.cat([plan.mla_attention(q[..., :RANK], q[..., RANK:], layer, 0.2) for layer in range(2)])

    m.claim("a", list(range(10)))
    step(["a"], [10])
    m.fork("a", "b")  # 10 tokens: two full pages shared, the third (2 tokens) copied
    assert m.pages("a")[:2] == m.pages("b")[:2] and m.pages("a")[2] != m.pages("b")[2]
    for t in c.page_tensors():
        assert torch.equal(_raw(t[m.pages("a")[2]]), _raw(t[m.pages("b")[2]]))
    step(["a", "b"], [3, 1])
    before = {i: attention(m, i) for i in ("a", "b")}
    m.offload(["a"])
    m.release("b")
    m.claim("x", [9] * 30)
    step(["x"], [30])  # takes the freed pages and writes new rows there
    m.restore(["a"])
    assert torch.equal(attention(m, "a"), before["a"])
    pk.save_sequences(m, tmp_path / "a.safetensors", ["a"])
    other = manager()
    (loaded,) = pk.load_sequences(other, tmp_path / "a.safetensors")
    assert torch.equal(attention(other, loaded), before["a"])


def test_mla_checkpoint_round_trip_and_inspect(tmp_path, capsys):
    from torch_paged_kv.__main__ import main

    b = make_mla_batch([5, 9], [0, 0], page_size=4, dtype=torch.float8_e4m3fn, num_layers=2)
    params = pk.KVCacheParams.mla(torch.float8_e4m3fn, num_layers=2, page_size=4, kv_lora_rank=32, rope_dim=16)
    c = pk.PagedKVCacheCollection(params, num_pages=b.blocks.shape[0] - 1, max_batch_size=2, max_seq_len=16)
    c.blocks.copy_(b.blocks)
    c.scales.copy_(b.scales)
    c.cache_lengths.copy_(b.cache_lengths)
    c.lookup_table[:, : b.lookup_table.shape[1]] = b.lookup_table
    pk.save_cache(c, tmp_path / "mla.safetensors")
    loaded = pk.load_cache(tmp_path / "mla.safetensors")
    assert loaded.params == params
    for coll in (c, loaded):
        view = coll.get_latent_cache(1)
        rows = [(view.load_latent(s, t), view.load_rope(s, t)) for s, n in enumerate((5, 9)) for t in range(n)]
        if coll is c:
            expected = rows
    for (latent, rope), (want_latent, want_rope) in zip(rows, expected, strict=True):
        assert torch.equal(latent, want_latent) and torch.equal(rope, want_rope)
    assert main(["inspect", str(tmp_path / "mla.safetensors")]) == 0
    out = capsys.readouterr().out
    assert "mla:        latent 32 (float8_e4m3fn, one float32 scale per token) + rope 16 (bfloat16)" in out
    assert "kv_lora_rank=32, rope_dim=16" in out
