"""CuTe decode kernels on an sm90 (or sm100) GPU against the reference backend.

Needs the CuTe DSL kit (`. /tmp/kit/env.sh`, see shared/gpu/README.md); each test skips, saying so,
where cutlass is missing or the GPU is not sm_90a / sm_100a. Unused cache slots hold a large finite
poison (300): a kernel that reads a key it must not see gets a visibly wrong answer, while the
reference (which multiplies masked keys by exactly 0) stays exact.
"""

import importlib.util
import math

import pytest
import torch

from torch_paged_kv.ops import dispatch, reference

POISON = 300.0


def _require_kit() -> None:
    if importlib.util.find_spec("cutlass") is None:
        pytest.skip("nvidia-cutlass-dsl is not importable here: run `. /tmp/kit/env.sh` (shared/gpu/README.md)")
    major, minor = torch.cuda.get_device_capability()
    if major not in (9, 10):
        pytest.skip(f"CuTe kernels target sm_90a / sm_100a; this GPU is sm_{major}{minor}")


def _decode_state(batch, max_ctx, page_size, kv_heads, head_dim, dtype, num_layers=2, seed=0):
    """Random paged decode state: shuffled pages, ragged lengths in [1, max_ctx], poisoned slack."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    kv_len = torch.randint(1, max_ctx + 1, (batch,), generator=g)
    kv_len[0] = max_ctx
    pages_needed = (kv_len + page_size - 1) // page_size
    num_pages = int(pages_needed.sum()) + 1
    width = int(math.ceil(max_ctx / page_size / 8) * 8 + 8)
    blocks = torch.full((num_pages, 2, num_layers, page_size, kv_heads, head_dim), POISON, dtype=dtype)
    table = torch.zeros(batch, width, dtype=torch.int32)
    perm = torch.randperm(num_pages - 1, generator=g) + 1
    used = 0
    for b in range(batch):
        n = int(pages_needed[b])
        table[b, :n] = perm[used: used + n].to(torch.int32)
        used += n
        pages = table[b, :n].long()
        data = torch.randn(n * page_size, 2, num_layers, kv_heads, head_dim, generator=g).to(dtype)
        data[int(kv_len[b]):] = POISON  # slots past the sequence
        blocks[pages] = data.view(n, page_size, 2, num_layers, kv_heads, head_dim).permute(0, 2, 3, 1, 4, 5)
    cache_lengths = (kv_len - 1).to(torch.int32)
    offsets = torch.arange(batch + 1, dtype=torch.int32)
    return [t.cuda() for t in (blocks, cache_lengths, table, offsets)]


def _oracle(q, blocks, cache_lengths, table, offsets, layer, scale, causal=True, window=-1):
    return reference.flash_attention(q.float(), blocks.float(), cache_lengths, table, offsets, layer, scale,
                                     causal, window, 0.0)


def _check(out, expected):
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


CASES = [  # (batch, max_ctx): up to 32k context, batch 1..256
    (1, 32768), (4, 8192), (64, 2048), (256, 300),
]


@pytest.mark.parametrize("page_size", [8, 16, 64, 128, 256])
@pytest.mark.parametrize("batch, max_ctx", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_matches_reference(page_size, batch, max_ctx, dtype):
    _require_kit()
    from torch_paged_kv.cute.attention import flash_attention, supports

    kv_heads, group, head_dim = 8, 4, 128
    blocks, cache_lengths, table, offsets = _decode_state(batch, max_ctx, page_size, kv_heads, head_dim, dtype)
    q = torch.randn(batch, kv_heads * group, head_dim, device="cuda", dtype=dtype)
    args = (q, blocks, cache_lengths, table, offsets, 1, head_dim ** -0.5)
    assert supports(*args)
    _check(flash_attention(*args), _oracle(*args))


@pytest.mark.parametrize("head_dim, group", [(64, 1), (64, 8), (128, 1), (128, 16), (256, 2), (256, 8)])
def test_decode_head_dims_and_gqa_groups(head_dim, group):
    _require_kit()
    from torch_paged_kv.cute.attention import flash_attention

    blocks, cache_lengths, table, offsets = _decode_state(16, 3000, 16, 2, head_dim, torch.bfloat16, seed=1)
    q = torch.randn(16, 2 * group, head_dim, device="cuda", dtype=torch.bfloat16)
    args = (q, blocks, cache_lengths, table, offsets, 0, head_dim ** -0.5)
    _check(flash_attention(*args), _oracle(*args))


@pytest.mark.parametrize("causal, window", [(False, -1), (True, 100), (True, 1), (True, 5000)])
def test_decode_window_and_non_causal(causal, window):
    _require_kit()
    from torch_paged_kv.cute.attention import flash_attention

    blocks, cache_lengths, table, offsets = _decode_state(8, 4000, 64, 4, 128, torch.bfloat16, seed=2)
    q = torch.randn(8, 16, 128, device="cuda", dtype=torch.bfloat16)
    args = (q, blocks, cache_lengths, table, offsets, 1, 0.1, causal, window)
    _check(flash_attention(*args), _oracle(*args))


def test_continuous_batching_table():
    """A 1-D slot table (page_size = max_seq_len) is the same layout with one page per row."""
    _require_kit()
    from torch_paged_kv.cute.attention import flash_attention

    blocks, cache_lengths, table, offsets = _decode_state(6, 1024, 1024, 4, 128, torch.float16, seed=3)
    slots = table[:, 0].contiguous()
    q = torch.randn(6, 16, 128, device="cuda", dtype=torch.float16)
    args = (q, blocks, cache_lengths, slots, offsets, 0, 0.08)
    _check(flash_attention(*args), _oracle(*args))


def test_small_pages_are_declined_on_sm90_and_dispatch_falls_back():
    _require_kit()
    from torch_paged_kv.cute.attention import device_arch, supports

    blocks, cache_lengths, table, offsets = _decode_state(4, 100, 1, 2, 128, torch.bfloat16)
    q = torch.randn(4, 8, 128, device="cuda", dtype=torch.bfloat16)
    args = (q, blocks, cache_lengths, table, offsets, 0, 0.1, True, -1, 0.0)
    if device_arch(torch.cuda.current_device()) == "sm_90a":
        assert not supports(*args)  # page 1: Triton's kernel runs it
        assert dispatch.select("flash_attention", q.device, args) is not None
    else:
        assert supports(*args)


def test_forced_backend_runs_cute_through_the_op(monkeypatch):
    _require_kit()
    import torch_paged_kv  # noqa: F401  (registers the ops)

    monkeypatch.setenv(dispatch.ENV_VAR, "cute")
    blocks, cache_lengths, table, offsets = _decode_state(32, 2048, 16, 8, 128, torch.bfloat16, seed=4)
    q = torch.randn(32, 32, 128, device="cuda", dtype=torch.bfloat16)
    out = torch.ops.paged_kv.flash_attention(q, blocks, cache_lengths, table, offsets, 0, 0.088)
    _check(out, _oracle(q, blocks, cache_lengths, table, offsets, 0, 0.088))


def test_cuda_graph_replay_sees_updated_lengths():
    _require_kit()
    from torch_paged_kv.cute.attention import flash_attention

    blocks, cache_lengths, table, offsets = _decode_state(8, 1024, 16, 4, 128, torch.bfloat16, seed=5)
    q = torch.randn(8, 16, 128, device="cuda", dtype=torch.bfloat16)
    args = (q, blocks, cache_lengths, table, offsets, 0, 0.1)
    flash_attention(*args)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attention(*args)
    cache_lengths.sub_(7).clamp_(min=0)
    graph.replay()
    torch.cuda.synchronize()
    _check(out, _oracle(*args))


def test_disk_cache_kernel_gives_the_same_answer(tmp_path, monkeypatch):
    _require_kit()
    from torch_paged_kv.cute import attention, compile_cache, variants

    blocks, cache_lengths, table, offsets = _decode_state(4, 512, 16, 2, 64, torch.float16, seed=6)
    q = torch.randn(4, 4, 64, device="cuda", dtype=torch.float16)
    args = (q, blocks, cache_lengths, table, offsets, 0, 0.125)
    first = attention.flash_attention(*args)
    key = variants.decode_key(attention.device_arch(torch.cuda.current_device()), "float16", 64, 16, 2)
    compile_cache.CompileCache(cache_dir=tmp_path).get(key, lambda: variants.build(key))  # compile + export
    monkeypatch.setattr(compile_cache, "CACHE", compile_cache.CompileCache(cache_dir=tmp_path))
    second = attention.flash_attention(*args)
    assert compile_cache.CACHE.stats()[key][1] == "disk"
    torch.testing.assert_close(first, second, atol=0, rtol=0)
