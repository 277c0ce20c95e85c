"""Fuzzing every checkpoint reader with damaged and crafted files.

Each case takes one of a few saved checkpoints (a manager's, with token ids and shared pages; a
sharded bf16 one; an FP8 one with scales; a continuous-batching one; an old-version one), damages one
of its files (flipped bytes, cut short, extended) or crafts a header (a random edit anywhere in it,
JSON inside metadata strings included, with the header checksum made right again as an attacker would,
or not), and runs every reader on it. A reader may succeed or raise its documented errors, nothing
else; a refusing reader leaves its target as it was; `inspect` prints one line, never a traceback.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import warnings
from collections import Counter
from pathlib import Path

import crafted_files
import pytest
import torch
from distributed_ranks import assert_same, snapshot
from fuzz_mutations import damage_bytes, mutate_json
from test_checkpoint import make_continuous, make_paged
from test_manager import make, run_step

import torch_paged_kv as tpk
from torch_paged_kv import __main__ as cli
from torch_paged_kv.checkpoint import (
    CheckpointError,
    UnverifiedMetadataWarning,
    load_cache,
    load_pages,
    read_info,
    verify,
)
from torch_paged_kv.manager import OutOfPagesError


def _manager_file(directory: Path) -> Path:
    src = make()
    model = {"a": [], "b": []}
    src.claim("a", list(range(100, 109)))
    src.claim("b")
    run_step(src, ["a", "b"], [list(range(100, 109)), [4, 4, 4, 4, 4]], model)
    src.fork("a", "c")  # shares a's two full pages
    model["c"] = list(model["a"])
    run_step(src, ["c"], [[7, 8]], model)
    tpk.save_sequences(src, directory / "manager.safetensors", ["c", "b", "a"])
    return directory / "manager.safetensors"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[str, bytes], int]]:
    """name -> ({file name: bytes}, pages stored): the files of each base checkpoint, the main file first."""
    directory = tmp_path_factory.mktemp("fuzz-files")
    paged = make_paged(seed=21)
    page_bytes = paged.blocks[0].numel() * paged.blocks.element_size()
    tpk.save_cache(paged, directory / "sharded.safetensors", shard_bytes=4 * page_bytes)
    fp8 = make_paged(torch.float8_e4m3fn, seed=22, quantization_granularity=4)
    tpk.save_cache(fp8, directory / "fp8.safetensors")
    tpk.save_cache(make_continuous(seed=23), directory / "continuous.safetensors")
    manager = _manager_file(directory)
    crafted_files.as_old_version(manager, 2, directory / "old.safetensors")
    out = {}
    for name in ("manager", "sharded", "fp8", "continuous", "old"):
        main = directory / f"{name}.safetensors"
        files = [main, *sorted(directory.glob(f"{name}-*"))]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnverifiedMetadataWarning)
            out[name] = ({p.name: p.read_bytes() for p in files}, read_info(main).num_pages)
    return out


def _mutated(files: dict[str, bytes], rng: random.Random, directory: Path) -> str:
    """Write the files with one of them damaged or crafted; returns what was done."""
    for name, data in files.items():
        (directory / name).write_bytes(data)
    target = directory / rng.choice(list(files))
    roll = rng.random()
    if roll < 0.4:
        target.write_bytes(damage_bytes(target.read_bytes(), rng))
        return f"damaged {target.name}"
    header, data = crafted_files.split(target.read_bytes())
    meta = header["__metadata__"]
    if rng.random() < 0.7:  # mostly the metadata, where a checkpoint's meaning lives
        key = rng.choice(sorted(meta))
        value = mutate_json(meta[key], rng)
        meta[key] = value if isinstance(value, str) or rng.random() < 0.1 else json.dumps(value)  # strings, mostly
    else:
        key = rng.choice(sorted(header))
        header[key] = mutate_json(header[key], rng)
    target.write_bytes(crafted_files.join(header, data, rechecksum=roll < 0.85))
    return f"crafted the header of {target.name} ({'re-checksummed' if roll < 0.85 else 'as damage'})"


def _target_manager(params: tpk.KVCacheParams) -> tpk.KVCacheManager:
    m = tpk.KVCacheManager(tpk.PagedKVCacheCollection(params, 64, 8, 64))
    m.claim("live")
    step = m.prepare_step(["live"], [6])
    g = torch.Generator().manual_seed(0)
    dtype = torch.float32 if params.quantized else params.dtype  # an FP8 cache quantizes float rows
    k, v = (torch.randn(6, params.num_kv_heads, params.head_dim, generator=g).to(dtype) for _ in range(2))
    for layer in range(params.num_layers):
        tpk.store_kv(k, v, m.collection.blocks, *step, layer, m.collection.scales)
    m.commit_step()
    return m


def _expect(allowed: tuple[type[BaseException], ...], call, outcomes: Counter, what: str) -> bool:
    """Run `call`; True if it succeeded, False if it raised one of `allowed` (anything else fails)."""
    try:
        call()
    except allowed:
        outcomes[f"{what}: refused"] += 1
        return False
    outcomes[f"{what}: read"] += 1
    return True


@pytest.mark.filterwarnings("ignore::torch_paged_kv.checkpoint.UnverifiedMetadataWarning")
def test_readers_refuse_damaged_and_crafted_files_cleanly(checkpoints, tmp_path: Path, fuzz_cases) -> None:
    outcomes: Counter = Counter()
    for case in fuzz_cases(150):
        rng = random.Random(case)
        base = rng.choice(sorted(checkpoints))
        directory = tmp_path / f"case{case % 4}"
        directory.mkdir(exist_ok=True)
        files, num_pages = checkpoints[base]
        what = _mutated(files, rng, directory)
        main = directory / f"{base}.safetensors"
        context = f"case {case}: {base}, {what}"
        try:
            _run_readers(main, base, num_pages, outcomes)
        except AssertionError as exc:
            raise AssertionError(f"{context}: {exc}") from exc
        except Exception as exc:
            raise AssertionError(f"{context}: {type(exc).__name__}: {exc}") from exc
    assert outcomes["load_cache: refused"] and outcomes["load_cache: read"], outcomes
    assert outcomes["load_sequences: refused"] and outcomes["load_sequences: read"], outcomes


def _run_readers(main: Path, base: str, num_pages: int, outcomes: Counter) -> None:
    for what, reader in (("read_info", read_info), ("verify", verify), ("load_cache", load_cache)):
        _expect((CheckpointError,), lambda reader=reader: reader(main), outcomes, what)
    params = {
        "manager": make().collection.params,
        "old": make().collection.params,
        "sharded": make_paged().params,
        "fp8": make_paged(torch.float8_e4m3fn, quantization_granularity=4).params,
        "continuous": make_continuous().params,
    }[base]
    if base != "continuous":
        _load_pages(main, params, num_pages, outcomes)
        _manager_load(main, params, outcomes)
    _inspect(main, outcomes)


def _load_pages(main: Path, params: tpk.KVCacheParams, num_pages: int, outcomes: Counter) -> None:
    """Into a live pool: refused or not, only the pages listed were written."""
    c = tpk.PagedKVCacheCollection(params, 40, 4, 64)
    g = torch.Generator().manual_seed(1)
    c.blocks.view(torch.uint8).copy_(torch.randint(0, 256, c.blocks.view(torch.uint8).shape, generator=g))
    before = [t.clone() for t in c.page_tensors()]
    pages = list(range(3, 3 + num_pages))  # as many as the undamaged file stores
    try:
        load_pages(main, c.blocks, pages, scales=c.scales)
        outcomes["load_pages: read"] += 1
    except CheckpointError:
        outcomes["load_pages: refused"] += 1
    except ValueError as exc:  # a file of another page count: the `pages` argument no longer fits
        assert str(exc).startswith("pages:"), exc
        outcomes["load_pages: refused"] += 1
    untouched = torch.ones(c.blocks.shape[0], dtype=torch.bool)
    untouched[pages] = False
    for old, new in zip(before, c.page_tensors(), strict=True):
        assert torch.equal(old[untouched].view(torch.uint8), new[untouched].view(torch.uint8)), (
            "load_pages wrote elsewhere"
        )


def _manager_load(main: Path, params: tpk.KVCacheParams, outcomes: Counter) -> None:
    """Into a live manager: all or nothing."""
    m = _target_manager(params)
    before = snapshot(m)
    try:
        ids = tpk.load_sequences(m, main)
    except (CheckpointError, OutOfPagesError):
        outcomes["load_sequences: refused"] += 1
        assert_same(before, snapshot(m))
        return
    outcomes["load_sequences: read"] += 1
    for seq_id in ids:
        m.release(seq_id)
    held = {p for p in m.pages("live")}
    assert all(m.page_pool.refcounts[p] == (p in held) for p in range(1, 65)), "refcounts after release"


def _inspect(main: Path, outcomes: Counter) -> None:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["inspect", str(main)])
    if code == 0:
        outcomes["inspect: read"] += 1
        assert "checksums:  OK" in out.getvalue()
    else:
        outcomes["inspect: refused"] += 1
        assert code == 1 and err.getvalue().startswith("error: ") and err.getvalue().count("\n") == 1, err.getvalue()
