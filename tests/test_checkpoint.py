"""KV-state checkpoints: bit-exact round trips, compaction, sharding, atomic writes, bad files, CLI."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import crafted_files
import pytest
import torch
from safetensors import safe_open

from torch_paged_kv import (
    ContinuousBatchingKVCacheCollection,
    KVCacheParams,
    LayerGroups,
    PagedKVCacheCollection,
    checkpoint,
    page_stream,
)
from torch_paged_kv.checkpoint import CheckpointError, load_cache, load_pages, read_info, save_cache, verify
from torch_paged_kv.safetensors_stream import SafetensorsWriter

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn]


def _random_blocks(collection, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    data = torch.randn(collection.blocks.shape, generator=g) + 3.0  # never zero
    collection.blocks.copy_(data.to(collection.blocks.dtype))
    if collection.params.has_scales_tensor:
        collection.scales.copy_(torch.rand(collection.scales.shape, generator=g) + 0.5)


def make_paged(dtype=torch.bfloat16, seed: int = 0, mla: bool = False, **quant) -> PagedKVCacheCollection:
    """4 rows over shuffled pages; row 2 forks row 0's first two pages; row 3 is empty."""
    params = KVCacheParams(
        dtype, num_layers=2, num_kv_heads=1 if mla else 2, head_dim=8, page_size=4, is_mla=mla, **quant
    )
    c = PagedKVCacheCollection(params, num_pages=24, max_batch_size=4, max_seq_len=30)
    _random_blocks(c, seed)
    pages = (torch.randperm(24, generator=torch.Generator().manual_seed(seed)) + 1).to(torch.int32)
    c.cache_lengths.copy_(torch.tensor([10, 29, 13, 0], dtype=torch.int32))
    c.lookup_table[0, :3] = pages[0:3]
    c.lookup_table[1, :8] = pages[3:11]
    c.lookup_table[2, :4] = torch.cat([pages[0:2], pages[11:13]])
    c.lookup_table[3, :2] = pages[13:15]  # stale entries beyond length 0: not saved
    return c


def make_continuous(dtype=torch.bfloat16, seed: int = 0, **quant) -> ContinuousBatchingKVCacheCollection:
    params = KVCacheParams(dtype, num_layers=2, num_kv_heads=2, head_dim=8, page_size=16, **quant)
    c = ContinuousBatchingKVCacheCollection(params, max_batch_size=4, max_seq_len=16)
    _random_blocks(c, seed)
    c.lookup_table.copy_(torch.tensor([3, 1, 4, 2], dtype=torch.int32))
    c.cache_lengths.copy_(torch.tensor([7, 0, 11, 3], dtype=torch.int32))
    return c


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def assert_rows_equal(src, loaded, rows: list[int]) -> None:
    """Loaded row i holds exactly the tokens of source row rows[i], with the same page sharing."""
    ps = src.params.page_size
    assert loaded.params == src.params and loaded.max_seq_len == src.max_seq_len
    assert loaded.max_batch_size == len(rows)
    assert loaded.cache_lengths.tolist() == [int(src.cache_lengths[b]) for b in rows]
    src_pages, new_pages = [], []
    for i, b in enumerate(rows):
        n = int(src.cache_lengths[b])
        if loaded.lookup_table.dim() == 1:
            if n:
                for new_pool, src_pool in zip(loaded.page_tensors(), src.page_tensors(), strict=True):
                    assert torch.equal(
                        bits(new_pool[int(loaded.lookup_table[i]), :, :, :n]),
                        bits(src_pool[int(src.lookup_table[b]), :, :, :n]),
                    )
                src_pages.append(int(src.lookup_table[b]))
                new_pages.append(int(loaded.lookup_table[i]))
            continue
        used = -(-n // ps)
        assert (loaded.lookup_table[i, used:] == 0).all()
        for j in range(used):
            s, d = int(src.lookup_table[b, j]), int(loaded.lookup_table[i, j])
            assert d != 0  # whole pages, scales included
            pairs = zip(loaded.page_tensors(), src.page_tensors(), strict=True)
            assert all(torch.equal(bits(new[d]), bits(old[s])) for new, old in pairs)
            src_pages.append(s)
            new_pages.append(d)
    pairs = set(zip(src_pages, new_pages, strict=True))
    assert len(pairs) == len(set(src_pages)) == len(set(new_pages))  # sharing preserved, nothing extra
    if loaded.lookup_table.dim() == 2:
        assert loaded.num_pages == max(1, len(set(new_pages)))
        assert sorted(set(new_pages)) == list(range(1, len(set(new_pages)) + 1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_place", [False, True])
def test_paged_round_trip_bit_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, in_place: bool
) -> None:
    if in_place:  # write runs of consecutive pages straight from the pool instead of gathering
        monkeypatch.setattr(page_stream, "DIRECT_RUN_BYTES", 1)
    src = make_paged(dtype)
    save_cache(src, tmp_path / "kv.safetensors", metadata={"model": "tiny"})
    loaded = load_cache(tmp_path / "kv.safetensors")
    assert isinstance(loaded, PagedKVCacheCollection)
    assert_rows_equal(src, loaded, [0, 1, 2, 3])
    assert loaded.num_pages == 3 + 8 + 2  # row 2 shares two pages of row 0
    assert (loaded.blocks[0] == 0).all()
    assert read_info(tmp_path / "kv.safetensors").user_metadata == {"model": "tiny"}


def test_mla_round_trip(tmp_path: Path) -> None:
    src = make_paged(torch.float16, seed=3, mla=True)
    save_cache(src, tmp_path / "mla.safetensors")
    assert_rows_equal(src, load_cache(tmp_path / "mla.safetensors"), [0, 1, 2, 3])


@pytest.mark.parametrize("dtype", DTYPES)
def test_continuous_round_trip_bit_exact(tmp_path: Path, dtype: torch.dtype) -> None:
    src = make_continuous(dtype)
    save_cache(src, tmp_path / "cb.safetensors")
    loaded = load_cache(tmp_path / "cb.safetensors")
    assert isinstance(loaded, ContinuousBatchingKVCacheCollection)
    assert_rows_equal(src, loaded, [0, 1, 2, 3])
    assert sorted(loaded.lookup_table.tolist()) == [1, 2, 3, 4]  # every row owns a slot
    assert read_info(tmp_path / "cb.safetensors").page_tokens == 11  # slots stored up to the longest row
    assert not loaded.blocks[:, :, :, 11:].any()  # tokens past them load as zeros, as documented


def test_partial_reordered_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_paged(torch.float32, seed=1)
    save_cache(src, tmp_path / "part.safetensors", batch_indices=[2, 0])
    loaded = load_cache(tmp_path / "part.safetensors")
    assert_rows_equal(src, loaded, [2, 0])
    assert loaded.num_pages == 5  # rows 2 and 0 share two pages
    assert loaded.lookup_table[0, :2].tolist() == loaded.lookup_table[1, :2].tolist()
    cb = make_continuous(torch.float16, seed=2)
    monkeypatch.setattr(page_stream, "CHUNK_BYTES", 100)  # trimmed slots, one (page, plane, layer) per chunk
    save_cache(cb, tmp_path / "cb.safetensors", batch_indices=[3, 1])
    assert_rows_equal(cb, load_cache(tmp_path / "cb.safetensors"), [3, 1])


def test_empty_rows_save_no_pages(tmp_path: Path) -> None:
    src = make_paged()
    save_cache(src, tmp_path / "empty.safetensors", batch_indices=[3])
    loaded = load_cache(tmp_path / "empty.safetensors")
    assert loaded.num_pages == 1 and loaded.cache_lengths.tolist() == [0]
    assert (loaded.lookup_table == 0).all()


def test_bad_arguments(tmp_path: Path) -> None:
    src = make_paged()
    for rows in ([], [0, 0], [4]):
        with pytest.raises(CheckpointError, match="batch_indices"):
            save_cache(src, tmp_path / "x.safetensors", batch_indices=rows)
    src.lookup_table[0, 1] = 0  # a row within its length on the null page
    with pytest.raises(CheckpointError, match="page ids outside"):
        save_cache(src, tmp_path / "x.safetensors")
    assert not list(tmp_path.iterdir())


def test_readable_by_safetensors(tmp_path: Path) -> None:
    src = make_paged(torch.bfloat16, seed=4)
    save_cache(src, tmp_path / "kv.safetensors")
    loaded = load_cache(tmp_path / "kv.safetensors")
    with safe_open(tmp_path / "kv.safetensors", framework="pt") as f:
        assert set(f.keys()) == {"cache_lengths", "lookup_table", "blocks.00000"}
        meta = f.metadata()
        assert meta["format"] == "torch_paged_kv.kv_cache" and meta["format_version"] == "4"
        assert KVCacheParams.from_dict(json.loads(meta["params"])) == src.params
        assert torch.equal(bits(f.get_tensor("blocks.00000")), bits(loaded.blocks[1:]))
        assert torch.equal(f.get_tensor("lookup_table"), loaded.lookup_table)


def test_sharded_round_trip_and_chunking(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_paged(torch.float16, seed=5)
    page_bytes = src.blocks[0].numel() * 2
    monkeypatch.setattr(page_stream, "CHUNK_BYTES", page_bytes // 3)  # chunks of layer ranges within a page
    save_cache(src, tmp_path / "kv.safetensors", shard_bytes=3 * page_bytes)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 5  # 13 pages, 3 per file: the main file and 4 shards
    for name in files:
        with safe_open(tmp_path / name, framework="pt") as f:
            assert all(f.get_tensor(k).numel() for k in f.keys())  # noqa: SIM118 (safe_open is not iterable)
    assert_rows_equal(src, load_cache(tmp_path / "kv.safetensors"), [0, 1, 2, 3])
    save_cache(src, tmp_path / "kv.safetensors")  # re-save unsharded: the old shards go away
    assert [p.name for p in tmp_path.iterdir()] == ["kv.safetensors"]
    assert_rows_equal(src, load_cache(tmp_path / "kv.safetensors"), [0, 1, 2, 3])


@pytest.mark.parametrize("chunk_bytes", [None, 100])
def test_load_pages_into_live_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk_bytes) -> None:
    if chunk_bytes:
        monkeypatch.setattr(page_stream, "CHUNK_BYTES", chunk_bytes)
    src = make_paged(torch.float32, seed=12)
    save_cache(src, tmp_path / "kv.safetensors", batch_indices=[1, 2], shard_bytes=5000)
    loaded = load_cache(tmp_path / "kv.safetensors")
    pool = torch.randn(40, *src.blocks.shape[1:])
    before = pool.clone()
    targets = [30, 31, 32, 5, 17, 2, 9, 10, 11, 38, 1, 25]  # runs and scattered ids
    info = load_pages(tmp_path / "kv.safetensors", pool, targets)
    assert info.num_pages == len(targets)
    assert torch.equal(bits(pool[targets]), bits(loaded.blocks[1:]))
    untouched = [i for i in range(40) if i not in targets]
    assert torch.equal(bits(pool[untouched]), bits(before[untouched]))
    with pytest.raises(CheckpointError, match="do not fit the target blocks"):
        load_pages(tmp_path / "kv.safetensors", pool.half(), targets)
    with pytest.raises(ValueError, match="pages: expected 12 distinct ids"):
        load_pages(tmp_path / "kv.safetensors", pool, [*targets[:-1], 30])
    with pytest.raises(ValueError, match="never the null page"):
        load_pages(tmp_path / "kv.safetensors", pool, [*targets[:-1], 0])


def _flip(path: Path, offset_from_end: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[-offset_from_end] ^= 0x10
    path.write_bytes(bytes(raw))


def test_bad_files_raise_checkpoint_error(tmp_path: Path) -> None:
    src = make_paged(seed=6)
    good = tmp_path / "good.safetensors"
    save_cache(src, good)
    raw = good.read_bytes()

    cases = {
        "truncated": (raw[:-100], "truncated"),
        "padded": (raw + b"\0" * 16, "16 unexpected bytes after the last tensor"),
        "garbage": (b"definitely not a checkpoint" * 3, "not a safetensors file"),
        "tiny": (b"abc", "not a safetensors file"),
        "header": (raw.replace(b'"format_version":"4"', b'"format_version":"7"'), "header checksum mismatch"),
    }
    crafted = {  # consistent files (the header checksum made right again)
        "version": ({"format_version": "7"}, "unknown format version '7'"),
        "foreign": ({"format": "torch_paged_kv.other"}, "not a torch_paged_kv checkpoint"),
    }
    for name, (values, message) in crafted.items():
        cases[name] = (
            crafted_files.edit_metadata(good, tmp_path / f"{name}.safetensors", **values).read_bytes(),
            message,
        )
    for name, (content, message) in cases.items():
        bad = tmp_path / f"{name}.safetensors"
        bad.write_bytes(content)
        with pytest.raises(CheckpointError, match=message):
            load_cache(bad)
    flipped = tmp_path / "flipped.safetensors"
    flipped.write_bytes(raw)
    _flip(flipped, 1000)
    with pytest.raises(CheckpointError, match="checksum mismatch in tensor 'blocks.00000'"):
        load_cache(flipped)
    with pytest.raises(CheckpointError, match="missing checkpoint file"):
        load_cache(tmp_path / "nope.safetensors")
    other = KVCacheParams(torch.float16, 2, 2, 8, 4)
    with pytest.raises(CheckpointError, match="do not fit the target"):
        load_cache(good, expected_params=other)
    assert load_cache(good, expected_params=src.params).num_pages == 13


@pytest.mark.parametrize(
    "entry, lengths, message",
    [
        ((0, 0), None, "puts a row's tokens in a page it does not store"),
        ((0, 1), None, "page ids outside 0..13"),
        (None, [10, 31, 13, 0], "outside 0..30"),
    ],
)
def test_inconsistent_tables_raise_checkpoint_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, entry, lengths, message
) -> None:
    """A file whose checksums are right but whose lookup table or lengths do not describe its pages."""
    real_plan = checkpoint.write.plan_save

    def bad_plan(*args):
        plan = real_plan(*args)
        if entry is not None:
            plan.lookup_table[entry] = 0 if entry == (0, 0) else 14
        if lengths is not None:
            plan.cache_lengths = torch.tensor(lengths, dtype=torch.int32)
        return plan

    monkeypatch.setattr(checkpoint.write, "plan_save", bad_plan)
    save_cache(make_paged(seed=8), tmp_path / "bad.safetensors")
    for read in (read_info, load_cache):
        with pytest.raises(CheckpointError, match=message):
            read(tmp_path / "bad.safetensors")


def test_bad_shards(tmp_path: Path) -> None:
    src = make_paged(seed=7)
    page_bytes = src.blocks[0].numel() * 2
    save_cache(src, tmp_path / "a.safetensors", shard_bytes=4 * page_bytes)
    save_cache(src, tmp_path / "b.safetensors", shard_bytes=4 * page_bytes)
    shards = sorted(tmp_path.glob("a-*"))
    assert len(shards) == 3
    _flip(shards[1], 10)
    with pytest.raises(CheckpointError, match="checksum mismatch in tensor 'blocks.00002'"):
        verify(tmp_path / "a.safetensors")
    other = sorted(tmp_path.glob("b-*"))[1]
    os.replace(other, shards[1])  # a shard of a different save, same content
    with pytest.raises(CheckpointError, match="does not belong"):
        load_cache(tmp_path / "a.safetensors")
    shards[1].unlink()
    with pytest.raises(CheckpointError, match=f"missing shard {shards[1].name}"):
        load_cache(tmp_path / "a.safetensors")


@pytest.mark.parametrize("shard_pages, fail_after", [(None, 2), (2, 4), (2, 8)])
def test_interrupted_save_keeps_previous(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shard_pages, fail_after: int
) -> None:
    """Fail in the single file's pages; after 4 of 6 shards are in place; in the main file's pages."""
    old, new = make_paged(seed=8), make_paged(seed=9)
    shard_bytes = shard_pages * old.blocks[0].numel() * 2 if shard_pages else checkpoint.DEFAULT_SHARD_BYTES
    path = tmp_path / "kv.safetensors"
    save_cache(old, path, shard_bytes=shard_bytes)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    calls = {"n": 0}
    original = SafetensorsWriter._write_bytes

    def failing(self, data):
        calls["n"] += 1
        if calls["n"] > fail_after:
            raise OSError("disk full (simulated)")
        original(self, data)

    monkeypatch.setattr(SafetensorsWriter, "_write_bytes", failing)
    with pytest.raises(OSError, match="disk full"):
        save_cache(new, path, shard_bytes=shard_bytes)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no temp files, old intact
    assert_rows_equal(old, load_cache(path), [0, 1, 2, 3])


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torch_paged_kv", *args],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
        timeout=120,
    )


def test_cli_inspect(tmp_path: Path) -> None:
    src = make_paged(seed=10)
    good = tmp_path / "kv.safetensors"
    save_cache(src, good, batch_indices=[1, 0], metadata={"model": "tiny"})
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(good.read_bytes())
    _flip(bad, 5)
    out = _cli("inspect", str(good))
    assert out.returncode == 0, out.stderr
    for text in (
        "dtype=bfloat16",
        "pages stored=11",
        "checksums:  OK",
        "'model': 'tiny'",
        "rows:       2",
        "11 referenced by the rows, 11 stored",
        "quantized:  none (bfloat16)",
    ):
        assert text in out.stdout
    assert "   0            29      8" in out.stdout
    out = _cli("inspect", str(bad))
    assert out.returncode == 1 and "checksum mismatch in tensor 'blocks.00000'" in out.stderr


def test_progress_bar(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    src = make_paged(seed=11)
    save_cache(src, tmp_path / "kv.safetensors", progress=True)
    load_cache(tmp_path / "kv.safetensors", progress=True)
    err = capsys.readouterr().err
    assert "save kv.safetensors" in err and "load kv.safetensors" in err


@pytest.mark.parametrize(
    "quant", [dict(quantization_granularity=4), dict(static_scales=(0.25, 2.0))], ids=["granule4", "static"]
)
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_round_trips_carry_scales(tmp_path: Path, dtype, quant) -> None:
    src = make_paged(dtype, seed=5, **quant)
    save_cache(src, tmp_path / "fp8.safetensors")
    loaded = load_cache(tmp_path / "fp8.safetensors")
    assert_rows_equal(src, loaded, [0, 1, 2, 3])  # params, pages and per-granule scales
    if "static_scales" in quant:
        assert loaded.scales.tolist() == list(quant["static_scales"])
    with safe_open(tmp_path / "fp8.safetensors", framework="pt") as f:
        has_scales = "scales.00000" in f.keys()  # noqa: SIM118 (safe_open is not iterable)
    assert has_scales == ("quantization_granularity" in quant)
    cb = make_continuous(dtype, seed=6, **quant)
    save_cache(cb, tmp_path / "cb8.safetensors")
    assert_rows_equal(cb, load_cache(tmp_path / "cb8.safetensors"), [0, 1, 2, 3])


def test_fp8_scales_are_checksummed_and_must_fit(tmp_path: Path) -> None:
    src = make_paged(torch.float8_e4m3fn, seed=7, quantization_granularity=4)
    path = tmp_path / "fp8.safetensors"
    save_cache(src, path)
    info = read_info(path)
    start, end = info.tensor_offsets["scales.00000"]
    raw = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(raw[:8], "little")
    raw[header + (start + end) // 2] ^= 0x10
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="checksum mismatch in tensor 'scales.00000'"):
        load_cache(bad)
    target = PagedKVCacheCollection(src.params, num_pages=20, max_batch_size=4, max_seq_len=30)
    with pytest.raises(CheckpointError, match="do not fit the target scales \\(none\\)"):
        load_pages(path, target.blocks, list(range(1, info.num_pages + 1)))
    before = target.scales.clone()
    load_pages(path, target.blocks, list(range(2, info.num_pages + 2)), scales=target.scales)
    assert not torch.equal(before, target.scales) and torch.equal(target.scales[2], load_cache(path).scales[1])


def test_version_3_files_still_load(tmp_path: Path) -> None:
    """A version-3 file is what version 4 writes for a cache of one group without a window."""
    src = make_paged(torch.bfloat16, seed=9)
    save_cache(src, tmp_path / "v4.safetensors")
    old = crafted_files.edit_metadata(tmp_path / "v4.safetensors", tmp_path / "v3.safetensors", format_version="3")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_info(old).metadata["format_version"] == "3"
        assert_rows_equal(src, load_cache(old), [0, 1, 2, 3])


@pytest.mark.parametrize("version", [1, 2])
def test_older_versions_still_load_with_a_warning(tmp_path: Path, version: int) -> None:
    """A version-1 or -2 file is what version 4 writes for an unquantized cache of one group without
    a window, without the header checksum: it loads, and says its metadata is unverified."""
    src = make_paged(torch.bfloat16, seed=9)
    save_cache(src, tmp_path / "v4.safetensors")
    old = crafted_files.as_old_version(tmp_path / "v4.safetensors", version, tmp_path / "old.safetensors")
    with pytest.warns(checkpoint.UnverifiedMetadataWarning, match="unverified metadata"):
        assert read_info(old).metadata["format_version"] == str(version)
    with pytest.warns(checkpoint.UnverifiedMetadataWarning):
        assert_rows_equal(src, load_cache(old), [0, 1, 2, 3])


def test_cli_inspect_shows_the_quantization(tmp_path: Path) -> None:
    for quant, text in [
        (dict(quantization_granularity=4), "quantized:  float8_e4m3fn, a float32 scale per token, head and 4 elements"),
        (dict(static_scales=(0.5, 2)), "quantized:  float8_e4m3fn, one static scale per tensor (0.5, 2.0 for K, V)"),
    ]:
        save_cache(make_paged(torch.float8_e4m3fn, seed=11, **quant), tmp_path / "q.safetensors")
        out = _cli("inspect", str(tmp_path / "q.safetensors"))
        assert out.returncode == 0 and text in out.stdout and "checksums:  OK" in out.stdout, out.stdout + out.stderr


# -- layer groups (format version 4) ----------------------------------------------------------------


def make_groups(seed: int = 0) -> LayerGroups:
    """Group 0: `make_paged` (model layers 0 and 2); group 1: an FP8 sliding-window group (window 6,
    another head_dim; layer 1) whose rows hold only their window's pages, the null page below."""
    full = make_paged(torch.bfloat16, seed=seed)
    params = KVCacheParams(torch.float8_e4m3fn, 1, 1, 16, 4, quantization_granularity=8, sliding_window=6)
    window = PagedKVCacheCollection(params, num_pages=24, max_batch_size=4, max_seq_len=30)
    _random_blocks(window, seed + 1)
    pages = (torch.randperm(24, generator=torch.Generator().manual_seed(seed + 2)) + 1).tolist()
    window.cache_lengths.copy_(full.cache_lengths)
    for b, n in enumerate(full.cache_lengths.tolist()):
        first, stop = params.first_held_page(n), -(-n // 4)
        window.lookup_table[b, first:stop] = torch.tensor([pages.pop() for _ in range(first, stop)], dtype=torch.int32)
    return LayerGroups([full, window], [[0, 2], [1]])


def test_layer_groups_round_trip_with_window_holes_and_shards(tmp_path: Path) -> None:
    src = make_groups(seed=5)
    path = tmp_path / "kv.safetensors"
    save_cache(src, path, batch_indices=[2, 0, 1, 3], shard_bytes=600)  # a few pages per file
    info = verify(path)
    assert len(info.files) > 3 and [g.layers for g in info.groups] == [(0, 2), (1,)]
    window = src.collections[1]
    held = [(window.lookup_table[b] != 0).sum().item() for b in range(4)]
    assert info.groups[1].num_pages == sum(held) == 2 + 2 + 2 + 0  # lengths 10, 29, 13, 0: window pages only
    loaded = load_cache(path)
    assert isinstance(loaded, LayerGroups) and loaded.layers == src.layers
    assert_rows_equal(src.collections[0], loaded.collections[0], [2, 0, 1, 3])
    got, want = loaded.collections[1], window
    for i, b in enumerate([2, 0, 1, 3]):
        n = int(want.cache_lengths[b])
        first, stop = want.params.first_held_page(n), -(-n // 4)
        assert (got.lookup_table[i, :first] == 0).all() and (got.lookup_table[i, stop:] == 0).all()
        for j in range(first, stop):
            d, s = int(got.lookup_table[i, j]), int(want.lookup_table[b, j])
            assert d and all(
                torch.equal(bits(x[d]), bits(y[s]))
                for x, y in zip(got.page_tensors(), want.page_tensors(), strict=True)
            )
    with pytest.raises(CheckpointError, match="do not fit the target"):
        load_cache(path, expected_params=src.collections[0].params)
    load_cache(path, expected_params=list(src.params))
    out = _cli("inspect", str(path))
    assert out.returncode == 0, out.stderr
    stored = (info.groups[0].num_pages, info.groups[1].num_pages)
    assert "layers [0, 2]: dtype=bfloat16" in out.stdout and "layers [1]: " in out.stdout
    assert (
        f"sliding_window=6; pages: {sum(held)} referenced by the rows, {stored[1]} stored (0 references" in out.stdout
    )


def test_layer_group_metadata_is_checked(tmp_path: Path) -> None:
    good = tmp_path / "good.safetensors"
    save_cache(make_groups(seed=7), good)
    groups = json.loads(read_info(good).metadata["groups"])
    one = crafted_files.edit_metadata(good, tmp_path / "one.safetensors", format_version="3")
    overlap = [dict(groups[0]), dict(groups[1], layers=[0])]
    cases = {
        "v3": (one, "layer groups are a paged cache's of every KV head, from format version 4 on"),
        "overlap": (
            crafted_files.edit_metadata(good, tmp_path / "o.safetensors", groups=overlap),
            "model layers 0..n-1",
        ),
        "pages": (
            crafted_files.edit_metadata(
                good, tmp_path / "p.safetensors", groups=[groups[0], dict(groups[1], num_pages=99)]
            ),
            "groups.1.blocks",
        ),
        "missing": (crafted_files.edit_metadata(good, tmp_path / "m.safetensors", groups=None), "not part of a"),
    }
    for path, message in cases.values():
        with pytest.raises(CheckpointError, match=re.escape(message)):
            read_info(path)
    raw = bytearray(good.read_bytes())
    raw[-5] ^= 0x10  # the last bytes: group 1's page data in the main file
    (tmp_path / "flip.safetensors").write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="checksum mismatch in tensor 'groups.1."):
        verify(tmp_path / "flip.safetensors")


def test_a_sliding_window_cache_in_a_version_3_file_is_refused(tmp_path: Path) -> None:
    """A lone sliding-window group's file (its rows' early pages not stored) claims version 3, which
    has no windows: refused, naming the field, not read as a file whose tables hold every page."""
    window = make_groups(seed=3).collections[1]
    good = tmp_path / "window.safetensors"
    save_cache(window, good)
    assert read_info(good).params.sliding_window == 6
    old = crafted_files.edit_metadata(good, tmp_path / "v3.safetensors", format_version="3")
    with pytest.raises(CheckpointError, match="'params': sliding_window .* format version 4 field"):
        read_info(old)


# -- extra tensors (format version 5) --------------------------------------------------------------


def make_extras(seed: int = 0) -> dict[str, torch.Tensor]:
    """Small tensors of every stored dtype, random (fresh bits, never zeros), one of them 0-d."""
    g = torch.Generator().manual_seed(seed)
    return {
        "extra.states.0.conv": torch.randn(4, 6, 3, generator=g),
        "extra.half": torch.randn(5, generator=g).to(torch.float16),
        "extra.b-f.16": torch.randn(2, 3, generator=g).to(torch.bfloat16),
        "extra.fp8": torch.randn(7, generator=g).to(torch.float8_e5m2),
        "extra.ids": torch.randint(-(2**40), 2**40, (3,), generator=g),
        "extra.scalar": torch.randn((), generator=g),
        "extra.empty": torch.empty(0, 4, dtype=torch.int32),
    }


def test_extra_tensors_round_trip_bit_exact(tmp_path: Path) -> None:
    """Extra tensors are stored in the main file (also of a sharded save), listed in the header,
    and read back bit for bit; the pages load as without them. A file without extras stays version 4."""
    src = make_paged(torch.bfloat16, seed=11)
    extras = make_extras(seed=11)
    page_bytes = src.blocks[0].numel() * src.blocks.element_size()
    path = tmp_path / "kv.safetensors"
    save_cache(src, path, extra_tensors=extras, shard_bytes=4 * page_bytes)
    info = read_info(path)
    assert info.metadata["format_version"] == "5" and len(info.files) > 1
    assert info.extra_tensors == {name: (t.dtype, tuple(t.shape)) for name, t in extras.items()}
    assert all(info.tensor_files[name] == path for name in extras)
    held = checkpoint.read_extra_tensors(info)
    assert held.keys() == extras.keys()
    for name, t in extras.items():
        assert (held[name].dtype, held[name].shape) == (t.dtype, t.shape), name
        assert torch.equal(bits(held[name].reshape(-1)), bits(t.reshape(-1))), name
    assert_rows_equal(src, load_cache(path), [0, 1, 2, 3])
    assert verify(path).extra_tensors == info.extra_tensors
    with safe_open(path, framework="pt") as f:  # plain safetensors still
        assert torch.equal(f.get_tensor("extra.ids"), extras["extra.ids"])
    save_cache(src, tmp_path / "plain.safetensors", extra_tensors={})
    plain = read_info(tmp_path / "plain.safetensors")
    assert plain.metadata["format_version"] == "4" and "extra_tensors" not in plain.metadata
    assert plain.extra_tensors == {}


def test_bad_extra_tensors_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    src = make_paged(seed=12)
    for extras, message in [
        ({"states": torch.ones(2)}, "expected names 'extra.'"),  # no prefix: could clash with the format's
        ({"extra.": torch.ones(2)}, "expected names"),
        ({"extra../x": torch.ones(2)}, "expected names"),
        ({"extra.a b": torch.ones(2)}, "expected names"),
        ({"extra." + "a" * 201: torch.ones(2)}, "expected names"),
        ({"extra.x": [1.0]}, "'extra.x': expected a tensor of .*, got list"),
        ({"extra.x": torch.ones(2, dtype=torch.float64)}, "'extra.x': expected a tensor of .*, got torch.float64"),
        ({"extra.x": torch.ones(2, dtype=torch.bool)}, "'extra.x': expected a tensor of .*, got torch.bool"),
        ([("extra.x", torch.ones(2))], "expected a dict"),
    ]:
        with pytest.raises(CheckpointError, match=f"^extra_tensors: .*{message}"):
            save_cache(src, tmp_path / "x.safetensors", extra_tensors=extras)
    assert not list(tmp_path.iterdir())


def test_extra_tensors_in_a_version_4_file_are_refused(tmp_path: Path) -> None:
    """What a reader of version 4 would not know to read: a file saying version 4 with extras is refused."""
    save_cache(make_paged(seed=13), tmp_path / "kv.safetensors", extra_tensors=make_extras())
    old = crafted_files.edit_metadata(tmp_path / "kv.safetensors", tmp_path / "v4.safetensors", format_version="4")
    with pytest.raises(CheckpointError, match="'extra_tensors' is a format version 5 field, but the file says 4"):
        read_info(old)


def test_cli_inspect_lists_the_extra_tensors(tmp_path: Path) -> None:
    save_cache(make_paged(seed=14), tmp_path / "kv.safetensors", extra_tensors=make_extras())
    done = _cli("inspect", str(tmp_path / "kv.safetensors"))
    assert done.returncode == 0, done.stderr
    assert "v5," in done.stdout and "extra:      7 tensor(s) in the main file" in done.stdout
    assert "  extra.states.0.conv float32[4, 6, 3]" in done.stdout and "  extra.scalar float32[]" in done.stdout
    assert "checksums:  OK (10 tensors" in done.stdout
