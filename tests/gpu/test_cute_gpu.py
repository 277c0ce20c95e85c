"""CuTe decode kernels on an sm90 (or sm100) GPU against the fp64 oracle of `torch_paged_kv.testing`.

Needs the CuTe DSL kit (`. /tmp/kit/env.sh`, see shared/gpu/README.md); each test skips, saying so,
where cutlass is missing or the GPU is not sm_90a / sm_100a. Unused cache slots hold a large finite
poison (300): a kernel that reads a key it must not see gets a visibly wrong answer, while the
oracle (on contiguous K/V, never the pool) stays exact.
"""

import pytest
import torch

from torch_paged_kv.ops import cute, dispatch, reference
from torch_paged_kv.ops.records import FlashAttentionArgs
from torch_paged_kv.testing import ATTENTION_TOLERANCE, PagedBatch, attention_fp64, make_paged_batch

POISON = 300.0


CUDA = torch.device("cuda")
if torch.cuda.is_available() and (_reason := cute.unavailable_reason(CUDA)) is not None:
    pytest.skip(f"{_reason} (the CuTe DSL kit: `. /tmp/kit/env.sh`, shared/gpu/README.md)", allow_module_level=True)


def _decode_batch(
    batch: int,
    max_ctx: int,
    page_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    *,
    group: int,
    layer: int,
    continuous: bool = False,
    seed: int = 0,
) -> PagedBatch:
    """A decode step on CUDA, its token already stored: ragged lengths in [1, max_ctx] (the first
    max_ctx), shuffled pages, every other pool slot poisoned."""
    kv_len = torch.randint(1, max_ctx + 1, (batch,), generator=torch.Generator().manual_seed(seed))
    kv_len[0] = max_ctx
    step = make_paged_batch(
        (kv_len - 1).tolist(),
        [1] * batch,
        page_size=page_size,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        group=group,
        layer_idx=layer,
        dtype=dtype,
        device="cuda",
        continuous=continuous,
        spare_pages=0,
        seed=seed,
        fill=POISON,
    )
    reference.store_kv(step.new_keys, step.new_values, step.blocks, *step.step, step.layer_idx)
    return step


def _args(step: PagedBatch, *options) -> FlashAttentionArgs:
    """`flash_attention`'s record: the step's tensors and layer, then `options` (scale, causal, ...)."""
    return FlashAttentionArgs(step.q, step.blocks, *step.step, step.layer_idx, *options)


def _check(out: torch.Tensor, step: PagedBatch, scale: float, causal: bool = True, window: int = -1) -> None:
    """`out` against fp64 attention over each sequence's first cache_length + 1 tokens (lengths as now)."""
    lengths = step.cache_lengths.tolist()
    keys = [k[: n + 1] for k, n in zip(step.keys, lengths, strict=True)]
    values = [v[: n + 1] for v, n in zip(step.values, lengths, strict=True)]
    expected = attention_fp64(step.q, keys, values, lengths, scale, causal, window)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected.to(out.dtype), **ATTENTION_TOLERANCE[out.dtype])


CASES = [  # (batch, max_ctx): up to 32k context, batch 1..256
    (1, 32768),
    (4, 8192),
    (64, 2048),
    (256, 300),
]


@pytest.mark.parametrize("page_size", [8, 16, 64, 128, 256])
@pytest.mark.parametrize("batch, max_ctx", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_matches_reference(page_size, batch, max_ctx, dtype):
    from torch_paged_kv.ops.cute.attention import flash_attention, supports

    head_dim = 128
    step = _decode_batch(batch, max_ctx, page_size, 8, head_dim, dtype, group=4, layer=1)
    args = _args(step, head_dim**-0.5)
    assert supports(args)
    _check(flash_attention(args), step, head_dim**-0.5)


@pytest.mark.parametrize("head_dim, group", [(64, 1), (64, 8), (128, 1), (128, 16), (256, 2), (256, 8)])
def test_decode_head_dims_and_gqa_groups(head_dim, group):
    from torch_paged_kv.ops.cute.attention import flash_attention

    step = _decode_batch(16, 3000, 16, 2, head_dim, torch.bfloat16, group=group, layer=0, seed=1)
    _check(flash_attention(_args(step, head_dim**-0.5)), step, head_dim**-0.5)


@pytest.mark.parametrize("causal, window", [(False, -1), (True, 100), (True, 1), (True, 5000)])
def test_decode_window_and_non_causal(causal, window):
    from torch_paged_kv.ops.cute.attention import flash_attention

    step = _decode_batch(8, 4000, 64, 4, 128, torch.bfloat16, group=4, layer=1, seed=2)
    _check(flash_attention(_args(step, 0.1, causal, window)), step, 0.1, causal, window)


@pytest.mark.parametrize("causal, window", [(True, -1), (False, -1), (True, 300)])
def test_ragged_chunked_call_matches_fp64(causal, window):
    """Several new rows per sequence on a cached prefix: `supports` sends such calls to Triton, but
    the kernels take any ragged call; here causality and the window differ per query row."""
    from torch_paged_kv.ops.cute.attention import flash_attention

    step = make_paged_batch(
        [500, 37, 0],
        [7, 3, 5],
        page_size=16,
        num_kv_heads=4,
        head_dim=128,
        group=4,
        dtype=torch.bfloat16,
        device="cuda",
        spare_pages=0,
        seed=7,
        fill=POISON,
    )
    reference.store_kv(step.new_keys, step.new_values, step.blocks, *step.step, step.layer_idx)
    expected = attention_fp64(step.q, step.keys, step.values, step.cache_lengths.tolist(), 0.09, causal, window)
    out = flash_attention(_args(step, 0.09, causal, window))
    torch.testing.assert_close(out, expected.to(out.dtype), **ATTENTION_TOLERANCE[out.dtype])


def test_continuous_batching_table():
    """A 1-D slot table (page_size = max_seq_len) is the same layout with one page per row."""
    from torch_paged_kv.ops.cute.attention import flash_attention

    step = _decode_batch(6, 1024, 1024, 4, 128, torch.float16, group=4, layer=0, continuous=True, seed=3)
    assert step.lookup_table.dim() == 1
    _check(flash_attention(_args(step, 0.08)), step, 0.08)


def test_small_pages_are_declined_on_sm90_and_dispatch_falls_back(monkeypatch, force_backend):
    from torch_paged_kv.ops.cute.attention import supports

    step = _decode_batch(4, 100, 1, 2, 128, torch.bfloat16, group=4, layer=0)
    args = _args(step, 0.1, True, -1, 0.0)
    if cute.device_arch(torch.cuda.current_device()) != "sm_90a":
        assert supports(args)  # gather4 streams single rows
        return
    assert not supports(args)  # page 1 on Hopper: below a TMA box, Triton's kernel runs it
    monkeypatch.setitem(dispatch.DEFAULT_ORDER, "cuda", ("cute", "triton", "reference"))
    assert dispatch.select("flash_attention", CUDA, args) is dispatch._kernels[("triton", "flash_attention")][0]
    force_backend("cute")
    with pytest.raises(dispatch.BackendUnavailableError, match="does not cover"):
        dispatch.select("flash_attention", CUDA, args)


def test_forced_backend_runs_cute_through_the_op(force_backend):
    import torch_paged_kv  # noqa: F401  (registers the ops)

    force_backend("cute")
    step = _decode_batch(32, 2048, 16, 8, 128, torch.bfloat16, group=4, layer=0, seed=4)
    _check(torch.ops.paged_kv.flash_attention(*_args(step, 0.088)), step, 0.088)


def test_cuda_graph_replay_sees_updated_lengths():
    from torch_paged_kv.ops.cute.attention import flash_attention

    step = _decode_batch(8, 1024, 16, 4, 128, torch.bfloat16, group=4, layer=0, seed=5)
    args = _args(step, 0.1)
    flash_attention(args)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attention(args)
    step.cache_lengths.sub_(7).clamp_(min=0)
    graph.replay()
    torch.cuda.synchronize()
    _check(out, step, 0.1)


def test_disk_cache_kernel_gives_the_same_answer(tmp_path, monkeypatch):
    from torch_paged_kv.ops.cute import attention, compile_cache, variants

    step = _decode_batch(4, 512, 16, 2, 64, torch.float16, group=2, layer=0, seed=6)
    args = _args(step, 0.125)
    first = attention.flash_attention(args)
    key = variants.decode_key(cute.device_arch(torch.cuda.current_device()), "float16", 64, 16, 2)
    compile_cache.CompileCache(cache_dir=tmp_path).get(key, lambda: variants.build(key))  # compile + export
    monkeypatch.setattr(compile_cache, "CACHE", compile_cache.CompileCache(cache_dir=tmp_path))
    second = attention.flash_attention(args)
    assert compile_cache.CACHE.stats()[key][1] == "disk"
    torch.testing.assert_close(first, second, atol=0, rtol=0)
