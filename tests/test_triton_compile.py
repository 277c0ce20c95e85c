"""The Triton kernels compile for real GPUs, without one: `torch_paged_kv.ops.triton.aot --quick`
(a representative subset of the launched variants) for sm_80 and sm_90, in a subprocess with
triton in compiled mode (this session's triton may be in interpreter mode), started with the session
beside the slow set's other subprocesses (conftest.py's `background_runs`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("triton")

ROW = re.compile(r"^sm(\d+)\s+(.+?)\s+(\d+)\s+(\d+)\s+(\S+)\s+[\d.]+$")


def _compile(keep: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_DEFAULT_FP_FUSION": "1"}
    return subprocess.run(
        [sys.executable, "-m", "torch_paged_kv.ops.triton.aot", "--arch", "90", "80", "--quick", "--keep", str(keep)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def background_jobs(items, request) -> list[tuple[str, float, Callable[[], tuple[Path, Any]]]]:
    """The AOT compile, if a selected test takes it, for conftest's `background_runs` (about 2 minutes
    on a loaded 2-core machine)."""
    if not any("compiled" in item.fixturenames for item in items):
        return []
    keep = request.getfixturevalue("tmp_path_factory").mktemp("aot")
    return [("triton aot --quick", 120, lambda: (keep, _compile(keep)))]


@pytest.fixture(scope="module")
def compiled(background_runs) -> tuple[dict[tuple[int, str], tuple[int, int, str]], Path]:
    """(arch, variant) -> (registers, spill bytes, tensor-core instructions), and the kept asm."""
    keep, run = background_runs["triton aot --quick"].result()
    print(run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr[-5000:]
    rows = {(int(m[1]), m[2]): (int(m[3]), int(m[4]), m[5]) for m in map(ROW.match, run.stdout.splitlines()) if m}
    return rows, keep


@pytest.mark.slow  # the AOT compile (the `compiled` fixture)
def test_every_kernel_compiles_for_both_targets(compiled):
    rows, _ = compiled
    for arch in (80, 90):
        kernels = {name.split()[0] for a, name in rows if a == arch}
        assert kernels == {
            "attention_kernel",
            "merge_kernel",
            "store_kv",
            "gather_kv",
            "copy_pages",
            "mla_attention_kernel",
            "mla_sparse_attention_kernel",
            "mla_merge_kernel",
            "store_latent",
        }, arch


@pytest.mark.slow  # the AOT compile (the `compiled` fixture)
def test_no_variant_spills_more_than_a_few_registers(compiled):
    """ptxas sometimes spills a word or two to keep occupancy (16-24 bytes in a few full-set variants);
    tiles too large for the register file spill kilobytes (fp32 attention did, before its tiles shrank)."""
    rows, _ = compiled
    spilling = {key: row for key, row in rows.items() if row[1] > 64}
    assert not spilling, spilling


@pytest.mark.slow  # the AOT compile (the `compiled` fixture)
def test_16_bit_attention_uses_tensor_cores(compiled):
    """sm_80 and decode tiles (16 rows) emit mma.sync; sm_90 prefill tiles (64 rows) emit wgmma. Sparse
    MLA takes the MLA decode tiles (16 heads of one token)."""
    rows, keep = compiled
    attention = {(arch, name): row for (arch, name), row in rows.items() if name.startswith("attention_kernel")}
    mla = {(arch, name): row for (arch, name), row in rows.items() if name.startswith("mla_")}
    mla = {key: row for key, row in mla.items() if key[1].split()[0].endswith("attention_kernel")}
    assert {name.split()[0] for _, name in mla} == {"mla_attention_kernel", "mla_sparse_attention_kernel"}
    for (arch, name), (_, _, cores) in mla.items():  # 16-row tiles: mma.sync on both
        assert cores == ("-" if " fp32 " in name else "mma"), (arch, name)
    for (arch, name), (_, _, cores) in attention.items():
        words = name.split()
        expected = "-" if "fp32" in words else "wgmma" if arch == 90 and "prefill" in words else "mma"
        assert cores == expected, (arch, name)
    ptx = (keep / "sm90" / "attention_kernel_bf16_d128_g1_prefill_causal.ptx").read_text()
    assert "wgmma.mma_async.sync.aligned" in ptx and "wgmma.wait_group" in ptx
    ptx = (keep / "sm80" / "attention_kernel_bf16_d128_g4_decode-split_causal.ptx").read_text()
    assert re.search(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32", ptx)


FP8_CACHES = {"fp8", "fp8-g128", "e5m2-static", "over"}  # words naming an FP8 attention variant (`aot`)


@pytest.mark.slow  # the AOT compile (the `compiled` fixture)
def test_fp8_attention_converts_in_hardware_on_sm_90_and_decodes_integers_on_sm_80(compiled):
    """FP8 pages reach `tl.dot` through the FP8 -> fp16 `cvt` on sm_90 (`fp8.hardware_fp8`), with no
    spill: the integer decode made the sm_90 per-token MLA decode loop 3x longer and spilled (28-48
    bytes). sm_80, which has no FP8 instructions, keeps the integer decode (its subnormal factor,
    2^-9 or 2^-16, is a PTX constant there and absent on sm_90)."""
    rows, keep = compiled
    fp8 = [key for key in rows if key[1].split()[0].endswith("attention_kernel") and FP8_CACHES & set(key[1].split())]
    assert {arch for arch, _ in fp8} == {80, 90} and {name.split()[0] for _, name in fp8} == {
        "attention_kernel",
        "mla_attention_kernel",
        "mla_sparse_attention_kernel",
    }
    for arch, name in fp8:
        stem = re.sub(r"[^\w.+-]+", "_", name)
        ptx = (keep / f"sm{arch}" / f"{stem}.ptx").read_text()
        hardware = re.search(r"cvt\.rn\.f16x2\.e(4m3|5m2)x2", ptx) is not None
        integer = re.search(r"0f3B000000|0f37800000", ptx) is not None
        assert (hardware, integer) == ((True, False) if arch == 90 else (False, True)), (arch, name)
        if arch == 90:
            assert rows[arch, name][1] == 0, (name, rows[arch, name])


@pytest.mark.slow  # the AOT compile (the `compiled` fixture)
def test_no_kernel_multiplies_a_layer_or_page_offset_in_int32(compiled):
    """Triton passes ints below 2**31 as i32: `layer_idx * stride_layer` wrapped at layer 16 of a
    128k-slot continuous-batching pool. `aot` fails a variant with such a multiply (the run above
    exited 0); here the kept TTIR of every variant is read again (attention with in-page offsets
    that fit int32 may keep that product i32: `aot.offset_args`), and the checker is shown to catch
    the old store_kv line."""
    from torch_paged_kv.ops.triton import aot

    _, keep = compiled
    checked = set()
    for name, launch in aot.variants(quick=True):
        stem = re.sub(r"[^\w.+-]+", "_", name)
        for path in keep.glob(f"sm*/{stem}.ttir"):  # the distinct variants were kept
            args = aot.offset_args(launch)
            assert aot.narrow_offset_products(path.read_text(), args) == [], path
            checked.add((name.split()[0], any(arg.endswith("stride_token") for arg in args)))
    assert checked >= {("attention_kernel", True), ("attention_kernel", False), ("store_kv", True)}
    assert checked >= {("mla_attention_kernel", True), ("mla_attention_kernel", False), ("store_latent", True)}
    assert checked >= {("mla_sparse_attention_kernel", True), ("mla_sparse_attention_kernel", False)}
    kernels = {"attention_kernel", "merge_kernel", "store_kv", "gather_kv", "copy_pages"}
    kernels |= {"mla_attention_kernel", "mla_sparse_attention_kernel", "mla_merge_kernel", "store_latent"}
    assert {kernel for kernel, _ in checked} == kernels
    old = (
        "tt.func public @k(%layer_idx: i32 loc(#loc1), %stride_layer: i32 loc(#loc2)) {\n"
        "    %slot_182 = arith.muli %layer_idx, %stride_layer : i32 loc(#loc111)\n"
        "    %slot_183 = arith.extsi %slot_182 : i32 to i64 loc(#loc110)\n"
        "    %wide = arith.extsi %layer_idx : i32 to i64 loc(#loc3)\n"
        "    %ok = arith.muli %wide, %wide : i64 loc(#loc4)\n"
    )
    assert aot.narrow_offset_products(old) == ["%slot_182 = arith.muli %layer_idx, %stride_layer : i32 loc(#loc111)"]
    old_mla = (  # store_latent before its in-page offset was widened: the MLA views' names count too
        "tt.func public @k(%page_size: i32 loc(#loc1), %cache_stride_token: i32 loc(#loc2)) {\n"
        "    %offset = arith.remsi %pos, %page_size : i32 loc(#loc3)\n"
        "    %slot_172 = arith.muli %offset, %cache_stride_token : i32 loc(#loc114)\n"
    )
    assert aot.narrow_offset_products(old_mla) == [
        "%slot_172 = arith.muli %offset, %cache_stride_token : i32 loc(#loc114)"
    ]


def test_every_pool_stride_argument_is_checked_for_int32_products():
    """An argument named like a pool stride (page, plane, layer or token) is one `aot.OFFSET_ARG`
    names, in every kernel: a new kernel's naming cannot slip past the check above."""
    from torch_paged_kv.ops.triton import aot

    for name, launch in aot.variants(quick=True):
        for arg in launch.kernel.arg_names:
            if "stride" in arg and any(word in arg for word in ("page", "plane", "layer", "token")):
                assert aot.OFFSET_ARG.search(arg), (name, arg)


GROWING_STEPS = """
import torch
from torch_paged_kv.ops.triton import aot
from torch_paged_kv.ops.records import FlashAttentionArgs, MLAAttentionArgs, StoreKVArgs, StoreLatentArgs
from torch_paged_kv.ops.triton.flash_attention import plan_flash_attention
from torch_paged_kv.ops.triton.store_kv import plan_store_kv
from torch_paged_kv.ops.triton.mla_attention import plan_mla_attention
from torch_paged_kv.ops.triton.mla_sparse import plan_mla_sparse
from torch_paged_kv.ops.triton.mla_store import plan_store_latent
keys = {}
for batch in (1, 2, 15, 16, 17, 300):
    for layer in (0, 1, 2, 16):
        blocks, lengths, table, offsets, rows = aot._paged(torch.bfloat16, 128, batch, 1, 128)
        q = torch.empty(batch, 32, 128, dtype=torch.bfloat16, device="meta")
        launches = plan_flash_attention(FlashAttentionArgs(q, blocks, lengths, table, offsets, layer, 0.1))[1]
        launches += plan_store_kv(StoreKVArgs(rows, rows, blocks, lengths, table, offsets, layer))
        blocks, scales, lengths, table, offsets, latent, rope = aot._mla_paged(torch.bfloat16, "fp8", batch, 1, 128)
        q_nope = torch.empty(batch, 16, 512, dtype=torch.bfloat16, device="meta")
        q_rope = torch.empty(batch, 16, 64, dtype=torch.bfloat16, device="meta")
        a = MLAAttentionArgs(q_nope, q_rope, blocks, lengths, table, offsets, layer, 0.1, True, scales)
        launches += plan_mla_attention(a)[1][:1]
        positions = torch.empty(batch, 2047 + layer % 2, dtype=torch.int32, device="meta")  # (k: 16-divisible or not)
        launches += plan_mla_sparse(a._replace(key_positions=positions))[1][:1]  # (split 2-8 ways at every batch)
        launches += plan_store_latent(StoreLatentArgs(latent, rope, blocks, lengths, table, offsets, layer, scales))
        for launch in launches:
            keys.setdefault(launch.kernel.__name__, set()).add(aot.compile_key(launch, 90))
print(sorted((name, len(found)) for name, found in keys.items()))
"""


def test_growing_batch_and_other_layers_compile_nothing_new():
    """Triton specialises int arguments equal to 1 or divisible by 16 unless told not to: batch,
    total and layer_idx (and sparse MLA's k) must not, or a serving batch reaching 16 (or layer 1)
    compiles again."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_DEFAULT_FP_FUSION": "1"}
    run = subprocess.run([sys.executable, "-c", GROWING_STEPS], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == (
        "[('_attention_kernel', 1), ('_mla_attention_kernel', 1), ('_mla_sparse_attention_kernel', 1), "
        "('_store_kv_kernel', 1), ('_store_latent_kernel', 1)]"
    )
