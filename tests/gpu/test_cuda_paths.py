"""CUDA paths outside the kernels: the reference backend on CUDA, manager offload/restore through
pinned memory, checkpoints of a CUDA pool. Each body takes `device`, so it can also run on CPU."""

import pytest
import torch

import torch_paged_kv as pk
from torch_paged_kv.testing import attention_fp64, make_paged_batch

DEVICE = "cuda"
CACHED, NEW = [0, 37, 300, 5, 1000], [64, 9, 1, 1, 1]


def reference_matches_fp64(device: str) -> None:
    b = make_paged_batch(
        CACHED, NEW, page_size=16, num_kv_heads=4, head_dim=128, group=4, dtype=torch.bfloat16, device=device, seed=1
    )
    cpu = make_paged_batch(
        CACHED, NEW, page_size=16, num_kv_heads=4, head_dim=128, group=4, dtype=torch.bfloat16, seed=1
    )
    for batch in (b, cpu):
        pk.store_kv(batch.new_keys, batch.new_values, batch.blocks, *batch.step, batch.layer_idx)
    assert torch.equal(b.blocks.cpu(), cpu.blocks)  # the same slots, bit for bit, on either device
    out = pk.flash_attention(b.q, b.blocks, *b.step, b.layer_idx, 128**-0.5, sliding_window=200)
    ref = attention_fp64(
        b.q.cpu(), [k.cpu() for k in b.keys], [v.cpu() for v in b.values], CACHED, 128**-0.5, sliding_window=200
    )
    assert (out.cpu().double() - ref).abs().max() <= 1.6e-2
    key, _ = pk.gather_kv(b.blocks, *b.step, b.layer_idx, 1001)
    assert torch.equal(key[4, :1001].cpu(), b.keys[4].cpu())


def offload_restore_round_trip(device: str) -> None:
    """Offload, then another sequence takes every free page (the offloaded one's cached pages too) and
    writes them: restore copies everything back from pinned memory, bit for bit."""
    params = pk.KVCacheParams(torch.float16, num_layers=2, num_kv_heads=2, head_dim=64, page_size=16)
    cache = pk.PagedKVCacheCollection(params, num_pages=40, max_batch_size=4, max_seq_len=1024, device=device)
    cache.blocks.normal_()
    manager = pk.KVCacheManager(cache)
    manager.claim("a", list(range(100)))
    manager.claim("b", list(range(500, 530)))
    step = manager.prepare_step(["a", "b"], [100, 30])
    assert step.cache_lengths.device.type == torch.device(device).type
    before = cache.blocks[step.lookup_table[0, :7].long()].clone()  # "a" is row 0: 100 tokens, 7 pages
    manager.commit_step()
    free = manager.num_free_pages()
    manager.offload(["a"])
    assert manager.is_offloaded("a") and manager.num_free_pages() == free + 7
    taken = manager.num_free_pages() * 16
    manager.claim("c", list(range(1000, 1000 + taken)))
    step = manager.prepare_step(["c"], [taken])
    cache.blocks[step.lookup_table[0, : taken // 16].long()] = torch.randn(1).to(cache.blocks)  # a's pages too
    manager.commit_step()
    manager.release("c")
    manager.restore(["a"])
    step = manager.prepare_step(["a"], [1], [[7]])
    assert torch.equal(cache.blocks[step.lookup_table[0, :7].long()], before)


def checkpoint_round_trip(device: str, tmp_path) -> None:
    params = pk.KVCacheParams(torch.bfloat16, num_layers=3, num_kv_heads=2, head_dim=64, page_size=8)
    cache = pk.PagedKVCacheCollection(params, num_pages=30, max_batch_size=3, max_seq_len=64, device=device)
    cache.blocks.copy_(torch.randn(cache.blocks.shape).to(torch.bfloat16))
    cache.lookup_table[:, :4] = (torch.randperm(30)[:12] + 1).view(3, 4).int()
    cache.cache_lengths.copy_(torch.tensor([29, 0, 17], dtype=torch.int32))
    pk.save_cache(cache, tmp_path / "kv.safetensors", shard_bytes=4096)
    loaded = pk.load_cache(tmp_path / "kv.safetensors", device=device)
    assert loaded.blocks.device.type == torch.device(device).type
    for row, length in ((0, 29), (2, 17)):
        src = pk.gather_kv(
            cache.blocks,
            cache.cache_lengths[row : row + 1],
            cache.lookup_table[row : row + 1],
            torch.zeros(2, dtype=torch.int32, device=device),
            0,
            length,
        )
        dst = pk.gather_kv(
            loaded.blocks,
            loaded.cache_lengths[row : row + 1],
            loaded.lookup_table[row : row + 1],
            torch.zeros(2, dtype=torch.int32, device=device),
            0,
            length,
        )
        assert all(torch.equal(s, d) for s, d in zip(src, dst, strict=True))


@pytest.fixture(autouse=True)
def reference_backend(force_backend):
    force_backend("reference")


def test_reference_backend_on_cuda_matches_fp64():
    reference_matches_fp64(DEVICE)


@pytest.mark.parametrize("device", [DEVICE, "cpu"])
def test_manager_offload_restore_through_pinned_memory(device):
    offload_restore_round_trip(device)


def test_checkpoint_of_a_cuda_pool_round_trips(tmp_path):
    checkpoint_round_trip(DEVICE, tmp_path)
