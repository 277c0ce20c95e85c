"""CuTe backend without a GPU: kernels compile for sm_90a / sm_100a with the expected TMA PTX, the
compile cache compiles once per key (also under threads, also from disk), and the operand's row
arithmetic matches the cache views. The kernels themselves run only in tests/gpu/test_cute_gpu.py."""

import itertools
import re
import subprocess
import sys
import threading

import pytest
import torch

import torch_paged_kv as pk
from torch_paged_kv.ops.cute.operand import KVCacheMHAOperand

cute = pytest.importorskip("cutlass.cute", reason="nvidia-cutlass-dsl (cutlass.cute) is not importable")

from torch_paged_kv.ops.cute import __main__ as cli  # noqa: E402
from torch_paged_kv.ops.cute import grids, variants  # noqa: E402
from torch_paged_kv.ops.cute.compile_cache import CompileCache  # noqa: E402


@pytest.fixture(scope="module", params=variants.ARCHES)
def compiled(request, tmp_path_factory):
    """(arch, [(key, PTX path)] of `cli.quick_keys(arch)`, grid calls): each variant compiled once, while
    recording which (rows, heads, ...) the launches asked `grids.decode_grid` / `combine_grid` for."""
    arch, out_dir, calls = request.param, tmp_path_factory.mktemp(request.param), []

    def recorder(name, grid):
        def record(*args):
            calls.append(name)
            return grid(*args)

        return record

    compiled = []
    with pytest.MonkeyPatch.context() as patch:
        for name in ("decode_grid", "combine_grid"):
            patch.setattr(grids, name, recorder(name, getattr(grids, name)))
        for key in cli.quick_keys(arch):
            cli.compile_with_ptx(key, out_dir)
            compiled.append((key, out_dir / f"{key.slug()}.ptx"))
    return arch, compiled, calls


def tma_copies(key) -> int:
    """TMA instructions per tile: one box per page (or page slice) for K and for V on sm90, one
    gather4 per four rows for K and for V on sm100, whatever the page size."""
    if key.arch == "sm_90a":
        return 2 * key.tile_n // min(key.page_size, key.tile_n)
    return 2 * key.tile_n // 4


def test_variants_compile_with_tma_ptx(compiled):
    arch, variants_compiled, _ = compiled
    for key, path in variants_compiled:
        ptx = path.read_text()
        assert f".target {arch}" in ptx
        if key.kernel == "combine":
            continue
        tma, gather4 = ptx.count("cp.async.bulk.tensor"), ptx.count("tile::gather4")
        assert (tma, gather4) == (tma_copies(key), 0 if arch == "sm_90a" else tma_copies(key)), key
        assert "mbarrier.try_wait" in ptx and "mbarrier.arrive.expect_tx" in ptx


def test_launches_take_their_grid_from_variants(compiled):
    """The launch grids `test_launch_limits.py` checks against CUDA's limits are the ones the
    kernels launch with: every compile asked `variants` for its grid."""
    _, variants_compiled, calls = compiled
    expected = sorted(f"{key.kernel}_grid" for key, _ in variants_compiled)
    assert sorted(calls) == expected


def test_no_tma_copy_inside_an_elected_region(compiled):
    """`cute.copy` of a TMA atom elects its issuing lane itself (cutlass/cute/nvgpu/cpasync/copy.py:
    "Do NOT wrap in elect_one (can cause deadlock)"); inside `with elect_one()` the one elected lane
    runs a full-warp `elect.sync` alone. Both producers did until issue 14 (sm90: the loop of copies,
    sm100: the gather4s)."""
    _, variants_compiled, _ = compiled
    for key, path in variants_compiled:
        assert cli.nested_elections(path.read_text()) == 0, key


@pytest.mark.skipif(
    cli.cuda_tool("ptxas") is None or cli.cuda_tool("nvdisasm") is None,
    reason="ptxas and nvdisasm (CUDA toolkit on PATH, or the copies triton bundles) are not found",
)
def test_sass_issues_tma_copies_from_a_converged_warp(compiled):
    """In the SASS (ptxas, then nvdisasm): every TMA copy is there (UTMALDG), and no warp collective
    needs a divergence check (BRA.DIV) or its slow path (WARPSYNC.COLLECTIVE). The sm_100a producer
    with the copies inside `elect_one` had 34 and 35 of them."""
    arch, variants_compiled, _ = compiled
    for key, path in variants_compiled:
        sass = cli.sass(path, arch)
        assert cli.divergent_syncs(sass) == 0, key
        if key.kernel == "decode":
            assert len(re.findall(r"\bUTMALDG\b", sass)) == tma_copies(key), key


@pytest.mark.skipif(cli.cuda_tool("ptxas") is None, reason="ptxas (CUDA toolkit, or triton's copy) is not found")
def test_variants_assemble_without_spills(compiled):
    arch, variants_compiled, _ = compiled
    for key, path in variants_compiled:
        assert cli.ptxas_usage(path, arch).endswith(" 0 B spill"), key


def test_consumer_lanes_read_each_key_and_element_of_a_tile_once():
    """The consumers' lane mapping (`decode_sm90.consume`) for every decode variant: lane `(sub, part)`
    of warp w at step t reads key `w * tile_n / 4 + t * keys_per_step + sub`, elements
    `part * elems ...`; together they read each (key, element) of a tile exactly once, the softmax
    blocks split the steps evenly, and the query and accumulator fit in 64 registers per lane."""
    from cutlass import BFloat16

    from torch_paged_kv.ops.cute.decode_sm90 import PagedDecodeSm90

    for key in variants.all_keys("sm_90a"):
        if key.kernel != "decode":
            continue
        k = PagedDecodeSm90(BFloat16, key.head_dim, key.page_size, key.group, key.tile_n, key.stages)
        reads = torch.zeros(key.tile_n, key.head_dim, dtype=torch.int32)
        per_warp = key.tile_n // k.consumer_warps
        for warp, step, lane in itertools.product(range(k.consumer_warps), range(k.steps), range(32)):
            sub, part = divmod(lane, k.key_lanes)
            reads[warp * per_warp + step * k.keys_per_step + sub, part * k.elems : (part + 1) * k.elems] += 1
        assert bool((reads == 1).all()), key
        assert k.steps % k.block_steps == 0 and k.group * k.block_steps <= max(32, k.group), key
        assert k.group * k.elems <= (32 if k.key_lanes < 32 else 64), key


def test_cache_returns_same_object_and_compiles_once_under_threads():
    cache = CompileCache(cache_dir="")
    key = variants.combine_key("sm_90a", "float16", 64)
    builds = []

    def build():
        builds.append(1)
        return variants.build(key)

    results = []
    threads = [threading.Thread(target=lambda: results.append(cache.get(key, build))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1 and len(results) == 6 and all(r is results[0] for r in results)
    assert cache.get(key, build) is results[0] and len(builds) == 1
    seconds, source = cache.stats()[key]
    assert source == "compiled" and seconds > 0


def test_cache_reloads_exported_kernel_from_disk(tmp_path):
    key = variants.combine_key("sm_90a", "bfloat16", 64)
    first = CompileCache(cache_dir=tmp_path)
    first.get(key, lambda: variants.build(key))
    assert first.stats()[key][1] == "compiled" and list(tmp_path.glob("*.o"))
    second = CompileCache(cache_dir=tmp_path)
    fn = second.get(key, lambda: pytest.fail("a kernel on disk must not be recompiled"))
    assert callable(fn) and second.stats()[key][1] == "disk"


@pytest.mark.parametrize("page_size, continuous", [(1, False), (5, False), (16, False), (24, True)])
def test_operand_rows_match_cache_views(page_size, continuous):
    torch.manual_seed(page_size)
    params = pk.KVCacheParams(torch.float16, num_layers=3, num_kv_heads=2, head_dim=8, page_size=page_size)
    if continuous:
        coll = pk.ContinuousBatchingKVCacheCollection(params, max_batch_size=4, max_seq_len=page_size)
        coll.lookup_table.copy_(torch.randperm(4, dtype=torch.int32) + 1)
    else:
        coll = pk.PagedKVCacheCollection(params, num_pages=40, max_batch_size=4, max_seq_len=24)
        coll.lookup_table.copy_(torch.randint(1, 41, coll.lookup_table.shape, dtype=torch.int32))
    coll.blocks.copy_(torch.randn(coll.blocks.shape))
    layer = 1
    op = KVCacheMHAOperand.from_blocks(coll.blocks, coll.cache_lengths, coll.lookup_table, layer)
    assert op.lookup_table.dim() == 2 and not op.quantization_enabled
    assert op.num_kv_rows() == coll.get_key_cache(layer).num_kv_rows()
    for plane in (0, 1):
        for b in range(4):
            rows = op.populate(b, 0, 24, plane)
            view = (coll.get_key_cache if plane == 0 else coll.get_value_cache)(layer)
            assert torch.equal(rows, view.populate(b, 0, 24))  # the collection's views: the same rows
            for tok in (0, 7, 23):  # each row holds that token's data, found by plain indexing
                page = int(op.lookup_table[b, tok // page_size])
                expected = coll.blocks[page, plane, layer, tok % page_size].flatten()
                assert torch.equal(op.rows[int(rows[tok])], expected)


def test_supports_declines_cpu_and_import_needs_no_cutlass():
    from torch_paged_kv.ops.cute.attention import supports
    from torch_paged_kv.ops.records import FlashAttentionArgs

    q = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
    blocks = torch.zeros(3, 2, 1, 16, 2, 64, dtype=torch.bfloat16)
    step = (torch.zeros(2, dtype=torch.int32), torch.zeros(2, 8, dtype=torch.int32), torch.arange(3, dtype=torch.int32))
    assert not supports(FlashAttentionArgs(q, blocks, *step, 0, 0.125))
    code = "import sys, torch_paged_kv; assert 'cutlass' not in sys.modules; print(torch_paged_kv.backend_info('cpu'))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_launch_arguments_match_the_compiled_signature(tmp_path):
    """Exported TVM-FFI kernels check every argument; on CPU tensors the first complaint must be the device."""
    from torch_paged_kv.ops.cute.attention import launch

    writer = CompileCache(cache_dir=tmp_path)
    keys = (variants.decode_key("sm_90a", "bfloat16", 128, 16, 4), variants.combine_key("sm_90a", "bfloat16", 128))
    for key in keys:
        writer.get(key, lambda key=key: variants.build(key))
    reader = CompileCache(cache_dir=tmp_path)
    decode, combine = (reader.get(key, lambda: pytest.fail("expected a disk hit")) for key in keys)
    blocks = torch.zeros(5, 2, 2, 16, 2, 128, dtype=torch.bfloat16)
    cache_lengths, offsets = torch.zeros(3, dtype=torch.int32), torch.arange(4, dtype=torch.int32)
    op = KVCacheMHAOperand.from_blocks(blocks, cache_lengths, torch.zeros(3, 8, dtype=torch.int32), 1)
    q = torch.zeros(3, 8, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"argument #0 .*expected device_type=cuda"):
        launch(decode, combine, q, op, offsets, 0.1, True, -1, 2)
    with pytest.raises(TypeError, match="Expects 14 parameters"):
        decode(q)
