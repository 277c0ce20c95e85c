"""The CPU kernels' calling convention: args.py's Structures against args.h's structs, each entry's
values bound to the right fields, and what the build says when it compiles."""

from __future__ import annotations

import ctypes
import shutil

import pytest
import torch

from torch_paged_kv import ops
from torch_paged_kv.native import build
from torch_paged_kv.ops.cpu import args, kernels
from torch_paged_kv.ops.records import (
    CopyPagesArgs,
    FlashAttentionArgs,
    GatherKVArgs,
    MLAAttentionArgs,
    StoreKVArgs,
    StoreLatentArgs,
)


def test_the_library_reports_the_structs_args_py_declares():
    lib = kernels.load()
    reported = args.parse_layout(lib.pkv_args_layout().decode())
    assert reported == {name: args.layout_of(structure) for name, structure in args.STRUCTURES.items()}
    for name, packer in args.PACKERS.items():
        assert packer.size == ctypes.sizeof(args.STRUCTURES[name])


def _edited(edit: str) -> type[ctypes.Structure]:
    fields = list(args.FlashAttentionStruct._fields_)
    names = [name for name, _ in fields]
    if edit == "swap":  # two int64 strides side by side: offsets and sizes as before, names swapped
        i = names.index("q_stride_row")
        fields[i], fields[i + 1] = fields[i + 1], fields[i]
    elif edit == "drop":
        del fields[names.index("sinks")]
    else:  # retype: the same name, offset and size, another kind
        fields[names.index("scale")] = ("scale", ctypes.c_int64)
    return type("FlashAttentionStruct", (ctypes.Structure,), {"_fields_": fields})


@pytest.mark.parametrize("edit, where", [("swap", "field 2"), ("drop", "field 30"), ("retype", "field 25")])
def test_a_struct_edited_on_one_side_fails_the_load(monkeypatch, force_backend, edit, where):
    """A Structure that no longer matches its struct in args.h stops the library from loading, with
    an error naming the field; an op call then raises it instead of falling back to the reference."""
    monkeypatch.setitem(args.STRUCTURES, "flash_attention", _edited(edit))
    monkeypatch.setattr(kernels, "_lib", None)
    with pytest.raises(args.ArgsLayoutError, match=f"flash_attention arguments .* disagree at {where}"):
        kernels.load()
    assert not kernels.loaded()
    q = torch.randn(1, 2, 32)
    blocks = torch.randn(3, 2, 1, 4, 2, 32)
    step = (torch.tensor([1], dtype=torch.int32), torch.tensor([[1, 0]], dtype=torch.int32))
    force_backend(None)
    with pytest.raises(args.ArgsLayoutError):
        ops.flash_attention(q, blocks, *step, torch.tensor([0, 1], dtype=torch.int32), 0, 0.5)


class _Recorder:
    """Stands in for the library: records each entry's packed arguments, reads nothing."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ctypes.Structure]] = []

    def __getattr__(self, name: str):
        def entry(packed: bytes) -> int:
            self.calls.append((name, args.STRUCTURES[name.removeprefix("pkv_")].from_buffer_copy(packed)))
            return 0

        return entry


def _fields(s: ctypes.Structure) -> dict[str, object]:
    return {name: getattr(s, name) or 0 for name, _ in s._fields_}  # (a null c_void_p reads None)


def _sliced(*shape: int, width: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor of `shape` whose last dim is `width` wide in memory: strides unlike its sizes."""
    return torch.zeros(*shape[:-1], width, dtype=dtype)[..., : shape[-1]]


def test_each_entry_gets_each_value_in_its_named_field(monkeypatch):
    """The call sites pack values by position: every value lands in the field of its name (read back
    through the Structure). The shapes are chosen so that no two fields a swap could confuse are equal."""
    pages, layers, page_size, heads, head_dim, layer, groups, batch = 13, 7, 6, 3, 32, 5, 4, 4
    blocks = torch.zeros(pages, 2, layers, page_size, heads, head_dim, dtype=torch.float8_e5m2)
    scales = torch.zeros(pages, 2, layers, page_size, heads, groups)
    cache_lengths = torch.tensor([3, 1, 4, 1], dtype=torch.int32)
    table = _sliced(batch, 10, width=12, dtype=torch.int32)
    offsets = torch.tensor([0, 1, 3, 6, 11], dtype=torch.int32)
    q = _sliced(11, 15, head_dim, width=40)
    sinks = torch.zeros(15)
    tree = torch.zeros(11, dtype=torch.int64)
    key = _sliced(11, heads, head_dim, width=48, dtype=torch.bfloat16)
    value = _sliced(11, heads, head_dim, width=56, dtype=torch.bfloat16)
    src, dst = torch.tensor([1, 2, 3], dtype=torch.int32), torch.tensor([4, 5, 6], dtype=torch.int32)
    recorder = _Recorder()
    monkeypatch.setattr(kernels, "_lib", recorder)
    threads = torch.get_num_threads()
    torch.set_num_threads(9)
    try:
        kernels.store_kv(StoreKVArgs(key, value, blocks, cache_lengths, table, offsets, layer, scales))
        call = (q, blocks, cache_lengths, table, offsets, layer, 0.125, True, 17, 2.5, scales, sinks, 21, tree)
        kernels.flash_attention(FlashAttentionArgs(*call))
        kernels.gather_kv(GatherKVArgs(blocks, cache_lengths, table, offsets, layer, 23, scales))
        kernels.copy_pages(CopyPagesArgs(blocks, src, dst, scales))
        kernels.step_ok(blocks, cache_lengths, table, offsets, 11, True, 23)
    finally:
        torch.set_num_threads(threads)
    pool = dict(
        blocks=blocks.data_ptr(),
        num_pages=pages,
        num_layers=layers,
        page_size=page_size,
        kv_heads=heads,
        head_dim=head_dim,
        layer=layer,
        fp8=2,
        scales=scales.data_ptr(),
        scale_groups=groups,
    )
    step = dict(
        cache_lengths=cache_lengths.data_ptr(),
        table=table.data_ptr(),
        table_stride=12,
        table_width=10,
        offsets=offsets.data_ptr(),
        batch=batch,
    )
    names = [name for name, _ in recorder.calls]
    assert names == [
        "pkv_store_kv",
        "pkv_flash_attention",
        "pkv_gather_kv",
        "pkv_copy_pages",
        "pkv_copy_pages",
        "pkv_step_ok",
    ]
    got = [_fields(s) for _, s in recorder.calls]

    assert got[0] == dict(
        src_dtype=kernels.DTYPE_CODES[torch.bfloat16],
        key=key.data_ptr(),
        key_stride_row=heads * 48,
        key_stride_head=48,
        value=value.data_ptr(),
        value_stride_row=heads * 56,
        value_stride_head=56,
        rows=11,
        **pool,
        **step,
        threads=9,
    )

    attention = got[1]
    assert attention.pop("out") != 0
    assert attention == dict(
        dtype=kernels.DTYPE_CODES[torch.float32],
        q=q.data_ptr(),
        q_stride_row=15 * 40,
        q_stride_head=40,
        q_rows=11,
        q_heads=15,
        out_stride_row=15 * head_dim,
        out_stride_head=head_dim,
        **pool,
        **step,
        scale=0.125,
        softcap=2.5,
        causal=1,
        window=17,
        chunk=21,
        sinks=sinks.data_ptr(),
        tree=tree.data_ptr(),
        min_split=kernels.MIN_SPLIT_KEYS,
        want_items=kernels.WANT_ITEMS,
        min_work=kernels.MIN_WORK_PER_THREAD,
        threads=9,
    )

    gather = got[2]
    assert 0 != gather.pop("key_out") != gather.pop("value_out") != 0
    assert gather == dict(itemsize=1, **pool, **step, max_kv_len=23, threads=9)

    for copy, pool_tensor in zip(got[3:5], (blocks, scales), strict=True):
        assert copy == dict(
            pool=pool_tensor.data_ptr(),
            page_bytes=pool_tensor[0].nbytes,
            num_pages=pages,
            src=src.data_ptr(),
            dst=dst.data_ptr(),
            count=3,
            threads=9,
        )

    assert got[5] == dict(
        **step, table_2d=1, total_rows=11, page_size=page_size, num_pages=pages, reads_all=1, max_kv_len=23
    )


def test_the_mla_entries_get_each_value_in_its_named_field(monkeypatch):
    """store_latent and mla_attention, as above: distinct shapes, strides and options; an FP8 pool
    (the store gets its rope as bf16)."""
    pages, layers, page_size, rank, rope, layer, groups, batch = 13, 7, 6, 32, 8, 5, 4, 4
    blocks = torch.zeros(pages, 1, layers, page_size, 1, rank + 2 * rope, dtype=torch.float8_e4m3fn)
    scales = torch.zeros(pages, 1, layers, page_size, 1, groups)
    cache_lengths = torch.tensor([3, 1, 4, 1], dtype=torch.int32)
    table = _sliced(batch, 10, width=12, dtype=torch.int32)
    offsets = torch.tensor([0, 1, 3, 6, 11], dtype=torch.int32)
    latent = _sliced(11, rank, width=44, dtype=torch.bfloat16)
    k_rope = _sliced(11, rope, width=9, dtype=torch.bfloat16)
    q_nope = _sliced(11, 15, rank, width=36, dtype=torch.bfloat16)
    q_rope = _sliced(11, 15, rope, width=10, dtype=torch.bfloat16)
    positions = torch.zeros(11, 19, dtype=torch.int32)
    sinks = torch.zeros(15)
    recorder = _Recorder()
    monkeypatch.setattr(kernels, "_lib", recorder)
    threads = torch.get_num_threads()
    torch.set_num_threads(9)
    try:
        kernels.store_latent(StoreLatentArgs(latent, k_rope, blocks, cache_lengths, table, offsets, layer, scales))
        call = (q_nope, q_rope, blocks, cache_lengths, table, offsets, layer, 0.125, False, scales, positions, sinks)
        kernels.mla_attention(MLAAttentionArgs(*call))
    finally:
        torch.set_num_threads(threads)
    pool = dict(
        blocks=blocks.data_ptr(),
        num_pages=pages,
        num_layers=layers,
        page_size=page_size,
        kv_heads=1,
        head_dim=rank + 2 * rope,
        layer=layer,
        fp8=1,
        scales=scales.data_ptr(),
        scale_groups=groups,
    )
    step = dict(
        cache_lengths=cache_lengths.data_ptr(),
        table=table.data_ptr(),
        table_stride=12,
        table_width=10,
        offsets=offsets.data_ptr(),
        batch=batch,
    )
    assert [name for name, _ in recorder.calls] == ["pkv_store_latent", "pkv_mla_attention"]
    store, attention = (_fields(s) for _, s in recorder.calls)
    assert store == dict(
        src_dtype=kernels.DTYPE_CODES[torch.bfloat16],
        latent=latent.data_ptr(),
        latent_stride_row=44,
        rope=k_rope.data_ptr(),
        rope_stride_row=9,
        rows=11,
        rank=rank,
        rope_dim=rope,
        **pool,
        **step,
        threads=9,
    )
    assert attention.pop("out") != 0
    assert attention == dict(
        dtype=kernels.DTYPE_CODES[torch.bfloat16],
        q_nope=q_nope.data_ptr(),
        q_nope_stride_row=15 * 36,
        q_nope_stride_head=36,
        q_rope=q_rope.data_ptr(),
        q_rope_stride_row=15 * 10,
        q_rope_stride_head=10,
        q_rows=11,
        q_heads=15,
        rank=rank,
        rope_dim=rope,
        **pool,
        **step,
        scale=0.125,
        causal=0,
        key_positions=positions.data_ptr(),
        top_k=19,
        sinks=sinks.data_ptr(),
        min_split=kernels.MIN_SPLIT_KEYS,
        want_items=kernels.WANT_ITEMS,
        min_work=kernels.MIN_WORK_PER_THREAD,
        threads=9,
    )


def test_compiling_says_so_once_and_a_cached_load_says_nothing(monkeypatch, tmp_path, capsys):
    built = kernels.load()._name  # stands in for the compiler's output
    monkeypatch.setenv("TORCH_PAGED_KV_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(build.EXTRA_FLAGS_ENV, raising=False)

    def fake_compile(compiler, flags, sources, target):
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(built, target)

    monkeypatch.setattr(build, "_compile", fake_compile)
    monkeypatch.setattr(build, "_loaded", {})
    build.library()
    said = capsys.readouterr().err.splitlines()
    assert said == [f"torch_paged_kv: compiling the CPU kernels once (about 15 s); cached in {tmp_path / 'cpu'}"]
    monkeypatch.setattr(build, "_loaded", {})
    build.library()
    assert capsys.readouterr().err == ""
