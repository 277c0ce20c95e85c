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
