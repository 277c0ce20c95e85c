"""KVCacheParams, collections and the per-layer views (row arithmetic against direct indexing)."""

import dataclasses

import pytest
import torch

import torch_paged_kv as pk
from torch_paged_kv import huge_pages, layout
from torch_paged_kv.params import normalized_shard, params_from_dict, params_to_dict


def test_params_round_trip_and_equality():
    p = pk.KVCacheParams(torch.bfloat16, num_layers=3, num_kv_heads=4, head_dim=64, page_size=16)
    q = pk.KVCacheParams.from_dict(p.to_dict())
    assert q == p and hash(q) == hash(p)
    assert p.to_dict()["dtype"] == "bfloat16"
    assert p != pk.KVCacheParams(torch.bfloat16, 3, 4, 64, 8)
    assert p.bytes_per_token == 2 * 3 * 4 * 64 * 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.page_size = 4


@pytest.mark.parametrize(
    "field, value", [("num_layers", 0), ("num_kv_heads", -1), ("head_dim", 2.5), ("page_size", True)]
)
def test_params_reject_bad_values(field, value):
    kwargs = dict(dtype=torch.float16, num_layers=1, num_kv_heads=1, head_dim=8, page_size=4)
    kwargs[field] = value
    with pytest.raises(ValueError, match=field):
        pk.KVCacheParams(**kwargs)


def test_params_from_dict_rejects_unknown():
    with pytest.raises(ValueError, match="dtype"):
        pk.KVCacheParams.from_dict(dict(dtype="int8", num_layers=1, num_kv_heads=1, head_dim=8, page_size=4))
    with pytest.raises(ValueError, match="unknown keys"):
        pk.KVCacheParams.from_dict(
            dict(dtype="float16", num_layers=1, num_kv_heads=1, head_dim=8, page_size=4, colour="red")
        )


def test_a_tp_shard_travels_beside_the_params_in_the_dicts_of_before():
    """Checkpoints and transfers carry a shard in the params dict, with the fields KVCacheParams had
    before TPShard was separate: an unsharded cache's dict is exactly the plain params dict."""
    full = pk.KVCacheParams(torch.float16, num_layers=2, num_kv_heads=8, head_dim=16, page_size=4)
    old = dict(dtype="float16", num_layers=2, num_kv_heads=8, head_dim=16, page_size=4, is_mla=False)
    assert full.to_dict() == old and params_to_dict(full) == old and params_from_dict(old) == (full, None)
    assert params_to_dict(full, pk.TPShard(1, 0, 0, 8)) == old  # rank 0 of 1, every head: no shard
    assert normalized_shard(full, pk.TPShard(1, 0, 0, 8)) is None
    params = dataclasses.replace(full, num_kv_heads=2)
    shard = pk.TPShard(tp_size=4, tp_rank=3, kv_head_start=6, total_kv_heads=8)
    assert shard.kv_head_range(params.num_kv_heads) == range(6, 8)
    written = {**old, "num_kv_heads": 2, "tp_size": 4, "tp_rank": 3, "kv_head_start": 6, "total_kv_heads": 8}
    assert params_to_dict(params, shard) == written
    assert params_from_dict(written) == (params, shard)
    replicated = pk.TPShard(tp_size=4, tp_rank=1, kv_head_start=0, total_kv_heads=2)  # fields at defaults left out
    one = dataclasses.replace(full, num_kv_heads=1)
    assert params_to_dict(one, replicated) == {
        **old,
        "num_kv_heads": 1,
        "tp_size": 4,
        "tp_rank": 1,
        "total_kv_heads": 2,
    }
    assert params_from_dict(params_to_dict(one, replicated)) == (one, replicated)
    with pytest.raises(ValueError, match="unknown keys"):
        pk.KVCacheParams.from_dict(written)  # the params alone take no shard fields


@pytest.mark.parametrize(
    "fields, name",
    [
        (dict(tp_size=0), "tp_size"),
        (dict(tp_size=2, tp_rank=2), "tp_rank"),
        (dict(tp_rank=-1), "tp_rank"),
        (dict(kv_head_start=7, total_kv_heads=8), "num_kv_heads"),
        (dict(kv_head_start=8, total_kv_heads=8), "kv_head_start"),
        (dict(total_kv_heads=1), "num_kv_heads"),
        (dict(total_kv_heads=2.0), "total_kv_heads"),
        (dict(tp_size=True), "tp_size"),
    ],
)
def test_tp_shards_reject_bad_fields(fields, name):
    params = pk.KVCacheParams(torch.float16, num_layers=1, num_kv_heads=2, head_dim=8, page_size=4)
    with pytest.raises(ValueError, match=f"^{name}"):
        params_from_dict({**params.to_dict(), **fields})
    with pytest.raises(ValueError, match=f"^{name}"):
        normalized_shard(
            params, pk.TPShard(**{**dict(tp_size=1, tp_rank=0, kv_head_start=0, total_kv_heads=2), **fields})
        )


def test_paged_collection_layout():
    p = pk.KVCacheParams(torch.float16, num_layers=3, num_kv_heads=2, head_dim=8, page_size=5)
    c = pk.PagedKVCacheCollection(p, num_pages=10, max_batch_size=4, max_seq_len=23)
    assert c.blocks.shape == (11, 2, 3, 5, 2, 8)  # + the null page
    assert c.max_pages_per_sequence == 5
    width = c.lookup_table.shape[1]
    assert width % 8 == 0 and width >= 5 + 8
    assert bool((c.lookup_table == pk.NULL_PAGE).all())
    assert c.cache_lengths.dtype == c.lookup_table.dtype == c.input_row_offsets.dtype == torch.int32
    step = c.step_tensors(3)
    assert step.cache_lengths.data_ptr() == c.cache_lengths.data_ptr() and step.input_row_offsets.shape == (4,)
    assert c.memory_footprint() >= c.blocks.numel() * 2
    with pytest.raises(ValueError, match="batch"):
        c.step_tensors(5)


def test_mla_collection_has_one_plane():
    p = pk.KVCacheParams(torch.float32, num_layers=2, num_kv_heads=1, head_dim=16, page_size=4, is_mla=True)
    c = pk.PagedKVCacheCollection(p, 3, 1, 8)
    assert c.blocks.shape[1] == 1
    with pytest.raises(ValueError, match="MLA"):
        c.get_value_cache(0)


def test_continuous_batching_collection():
    p = pk.KVCacheParams(torch.float32, num_layers=2, num_kv_heads=2, head_dim=8, page_size=12)
    c = pk.ContinuousBatchingKVCacheCollection(p, max_batch_size=3, max_seq_len=12)
    assert c.blocks.shape == (4, 2, 2, 12, 2, 8) and c.lookup_table.tolist() == [1, 2, 3]
    assert isinstance(c.get_key_cache(1), pk.ContinuousBatchingKVCache)
    with pytest.raises(ValueError, match="page_size"):
        pk.ContinuousBatchingKVCacheCollection(p, 3, 16)


@pytest.mark.parametrize("continuous", [False, True])
def test_view_rows_match_direct_indexing(continuous):
    torch.manual_seed(0)
    page_size = 7 if not continuous else 20
    p = pk.KVCacheParams(torch.float32, num_layers=3, num_kv_heads=2, head_dim=4, page_size=page_size)
    if continuous:
        c = pk.ContinuousBatchingKVCacheCollection(p, 3, 20)
        c.lookup_table.copy_(torch.tensor([3, 1, 2], dtype=torch.int32))
    else:
        c = pk.PagedKVCacheCollection(p, num_pages=12, max_batch_size=3, max_seq_len=20)
        c.lookup_table[:, :3] = (torch.randperm(12)[:9] + 1).view(3, 3).int()
    c.blocks.normal_()
    c.cache_lengths.copy_(torch.tensor([4, 19, 0], dtype=torch.int32))
    c.input_row_offsets.copy_(torch.tensor([0, 2, 3, 3], dtype=torch.int32))
    rows = c.blocks.view(-1, 2 * 4)
    for layer in range(3):
        for plane, view in enumerate((c.get_key_cache(layer), c.get_value_cache(layer))):
            assert view.num_kv_rows() == rows.shape[0]
            for b, tok in [(0, 0), (0, 6), (1, 13), (1, 19), (2, 3)]:
                page = int(c.lookup_table[b]) if continuous else int(c.lookup_table[b, tok // page_size])
                expected = c.blocks[page, plane, layer, tok % page_size, 1]
                assert torch.equal(rows[view.row_idx(b, tok), view.col_idx(1) : view.col_idx(1) + 4], expected)
                assert torch.equal(view.load(b, 1, tok), expected)
            populated = view.populate(1, 5, 9)
            assert populated.tolist() == [view.row_idx(1, t) for t in range(5, 14)]
            encoded = page * page_size + 3
            assert view.get_tma_row(encoded) == layout.tma_row(encoded, page_size, view.page_stride, view.plane_offset)
    v = c.get_key_cache(2)
    assert v.cache_length(1) == 19 and not v.empty_cache()
    assert v.max_prompt_length() == 2 and v.max_context_length() == 20
    new = torch.randn(3)
    v.store(0, 1, 2, 1, new)
    assert torch.equal(v.load(0, 1, 2, dim=1, width=3), new)


def test_view_rejects_bad_layer():
    p = pk.KVCacheParams(torch.float32, 2, 1, 4, 4)
    c = pk.PagedKVCacheCollection(p, 2, 1, 8)
    with pytest.raises(ValueError, match="layer_idx"):
        c.get_key_cache(2)


def _thp_mode() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def _mapping_flags(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds `address`."""
    fields: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    return fields


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="Linux transparent huge pages are off here")
def test_a_large_cpu_pool_asks_for_huge_pages_and_starts_zeroed():
    params = pk.KVCacheParams(torch.bfloat16, num_layers=2, num_kv_heads=8, head_dim=128, page_size=16)
    c = pk.PagedKVCacheCollection(params, 128, 4, 256)  # 16 MiB of pages
    assert c.blocks.count_nonzero() == 0
    assert _mapping_flags(c.blocks.data_ptr() + c.blocks.nbytes // 2).get("THPeligible") == "1"
    assert not huge_pages.advise(torch.empty(1024))  # too small to hold an aligned huge page
