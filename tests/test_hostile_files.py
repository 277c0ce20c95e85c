"""Checkpoints written by an attacker or damaged on the way: what a reader, and a save over them, may do.

Crafted files keep their header checksum right (`crafted_files`), as an attacker would, so the checks
behind it are what is tested; damaged files do not.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import time
from pathlib import Path

import crafted_files
import pytest
import torch
from test_checkpoint import make_continuous, make_paged
from test_manager import assert_same, make, run_step, snapshot

import torch_paged_kv as tpk
from torch_paged_kv import __main__ as cli
from torch_paged_kv import checkpoint
from torch_paged_kv.checkpoint import CheckpointError, load_cache, read_info, save_cache, verify
from torch_paged_kv.sequence_checkpoint import METADATA_KEY

# -- saving over a crafted file (issue 40, item 1) ------------------------------------------------


def test_saving_over_a_crafted_file_deletes_nothing_outside_its_own_shards(tmp_path: Path) -> None:
    """The previous checkpoint's shard list comes from its header: names outside the checkpoint's
    directory, links, and files not named like its shards are never deleted."""
    ckpt_dir = tmp_path / "ckpt"
    ckpt_dir.mkdir()
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    beside = ckpt_dir / "notes.txt"
    beside.write_text("keep me too")
    path = ckpt_dir / "kv.safetensors"
    save_cache(make_paged(seed=1), path)
    save_id = read_info(path).metadata["save_id"]
    linked = ckpt_dir / f"kv-{save_id}-00001-of-00004.safetensors"  # named like a shard, a link out
    linked.symlink_to(precious)
    listed = [str(precious), "../precious.txt", "notes.txt", linked.name]
    crafted_files.edit_metadata(path, shards=[{"file": name, "checksums": {}} for name in listed])
    save_cache(make_paged(seed=2), path)
    assert precious.read_text() == "keep me" and beside.read_text() == "keep me too"
    assert linked.is_symlink()
    load_cache(path)


def test_saving_over_a_sharded_checkpoint_still_removes_its_old_shards(tmp_path: Path) -> None:
    src = make_paged(seed=3)
    path = tmp_path / "kv.safetensors"
    page_bytes = src.blocks[0].numel() * src.blocks.element_size()
    save_cache(src, path, shard_bytes=4 * page_bytes)
    old = sorted(p.name for p in tmp_path.iterdir() if p.name != path.name)
    assert len(old) == 3
    save_cache(src, path, shard_bytes=4 * page_bytes)
    new = sorted(p.name for p in tmp_path.iterdir() if p.name != path.name)
    assert len(new) == 3 and not set(old) & set(new)


# -- metadata is checksummed (item 2) -------------------------------------------------------------


def _saved_by_a_manager(tmp_path: Path) -> Path:
    src = make()
    src.claim("a", [4242, 4343, 4444, 4545, 4646, 4747])
    run_step(src, ["a"], [[4242, 4343, 4444, 4545, 4646, 4747]], {"a": []})
    tpk.save_sequences(src, tmp_path / "kv.safetensors", ["a"])
    return tmp_path / "kv.safetensors"


@pytest.mark.parametrize(
    "old, new",
    [
        (b"4343", b"4353"),  # a token id: the prefix cache would key the page by the wrong tokens
        (b'"max_seq_len":"64"', b'"max_seq_len":"60"'),  # the same table width: nothing else notices
        (b'"source_batch_indices":"[0]"', b'"source_batch_indices":"[1]"'),
        (b'"shards":"[]"', b'"shards":"{}"'),
    ],
)
def test_a_damaged_header_is_refused_by_every_reader(tmp_path: Path, old: bytes, new: bytes) -> None:
    path = _saved_by_a_manager(tmp_path)
    raw = path.read_bytes()
    header_end = 8 + int.from_bytes(raw[:8], "little")
    assert raw.count(old, 0, header_end) == 1, old
    path.write_bytes(raw.replace(old, new))
    m = make()
    before = snapshot(m)
    for read in (read_info, verify, load_cache, functools.partial(tpk.load_sequences, m)):
        with pytest.raises(CheckpointError, match="header checksum mismatch"):
            read(path)
    assert_same(before, snapshot(m))


# -- sizes are bounded before anything is allocated (item 3) ---------------------------------------


def _huge(path: Path, out: Path, continuous: bool) -> Path:
    """A consistent file without pages whose params describe an enormous collection."""
    params = read_info(path).params.to_dict()
    if continuous:  # a slot of 2**40 tokens per row
        params.update(page_size=2**40)
        return crafted_files.edit_metadata(path, out, params=params, max_seq_len="1099511627776")
    # pages of 2**40 tokens and 100000 layers; the same lookup-table width as before
    params.update(num_layers=100_000, page_size=2**40)
    big = str(2**40)
    return crafted_files.edit_metadata(path, out, params=params, max_seq_len=big, page_tokens=big)


@pytest.mark.parametrize("continuous", [False, True], ids=["paged", "continuous"])
def test_a_tiny_file_declaring_an_enormous_cache_is_refused_at_once(tmp_path: Path, continuous: bool) -> None:
    empty = make_continuous() if continuous else make_paged()
    empty.cache_lengths.zero_()
    save_cache(empty, tmp_path / "empty.safetensors")
    huge = _huge(tmp_path / "empty.safetensors", tmp_path / "huge.safetensors", continuous)
    assert huge.stat().st_size < 2048
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    field = "max_seq_len" if continuous else "params"
    with pytest.raises(CheckpointError, match=f"metadata field '{field}'.* more than the .* bytes of memory"):
        load_cache(huge)
    assert time.perf_counter() - start < 2.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 64 << 10  # KiB: nothing large touched
    with pytest.raises(CheckpointError, match="do not fit the target"):
        load_cache(huge, expected_params=empty.params)


def test_tensor_sizes_must_match_their_bytes(tmp_path: Path) -> None:
    """A header may not declare more (or fewer) elements than the bytes it points at."""
    save_cache(make_paged(seed=4), tmp_path / "kv.safetensors")

    def grow(header):
        header["blocks.00000"]["shape"][0] = 10**12

    crafted_files.rewrite(tmp_path / "kv.safetensors", grow, tmp_path / "big.safetensors")
    with pytest.raises(CheckpointError, match="tensor 'blocks.00000': data_offsets .* hold"):
        load_cache(tmp_path / "big.safetensors")


# -- crafted headers raise CheckpointError naming the file and the field (item 6) ------------------

NESTED = "[" * 100_000 + "]" * 100_000
CRAFTED_METADATA = {
    "params": ["[1, 2]", '{"dtype": ["x"]}', "not json", NESTED, '{"dtype": "float32", "num_layers": "2"}'],
    "shards": ["[1]", '[{"file": 5}]', '[{"file": "x.safetensors"}]', '[{"file": "../x", "checksums": {}}]', "{}"],
    "checksums": ["[]", '{"cache_lengths": 5}', '{"cache_lengths": "crc32:xyz"}'],
    "max_seq_len": ["abc", "-3", "1e3", "0", str(10**30)],
    "num_pages": [None, "x"],
    "page_tokens": ["5"],
    "collection": ["sideways", None],
    "user_metadata": ["[]", '{"a": 1}', "{"],
    "source_batch_indices": ['{"a": 1}', "[-1]"],
}


@pytest.mark.parametrize(
    "field, value", [(f, v) for f, values in CRAFTED_METADATA.items() for v in values], ids=lambda v: str(v)[:20]
)
def test_crafted_metadata_fields_raise_checkpoint_error_naming_the_field(tmp_path: Path, field: str, value) -> None:
    save_cache(make_paged(seed=5), tmp_path / "kv.safetensors")
    bad = crafted_files.edit_metadata(tmp_path / "kv.safetensors", tmp_path / "bad.safetensors", **{field: value})
    for read in (read_info, load_cache):
        with pytest.raises(CheckpointError) as error:
            read(bad)
        message = str(error.value)
        assert str(bad) in message and (f"'{field}'" in message or field == "checksums"), message


CRAFTED_HEADERS = {
    "metadata not an object": (lambda h: h.update(__metadata__=[]), "__metadata__ is not an object"),
    "metadata value not a string": (lambda h: h["__metadata__"].update(num_pages=3), "__metadata__ is not an object"),
    "unknown dtype": (lambda h: h["blocks.00000"].update(dtype="Q7"), "unknown dtype"),
    "no data offsets": (lambda h: h["blocks.00000"].pop("data_offsets"), "expected an object"),
    "shape of strings": (lambda h: h["cache_lengths"].update(shape=["4"]), "not a list of sizes"),
    "tensor entry a list": (lambda h: h.update(cache_lengths=[1, 2]), "expected an object"),
    "overlapping tensors": (
        lambda h: h["lookup_table"].update(data_offsets=h["cache_lengths"]["data_offsets"], shape=[4]),
        "overlaps|gap",
    ),
}


@pytest.mark.parametrize("name", list(CRAFTED_HEADERS))
def test_crafted_tensor_entries_raise_checkpoint_error(tmp_path: Path, name: str) -> None:
    edit, message = CRAFTED_HEADERS[name]
    save_cache(make_paged(seed=5), tmp_path / "kv.safetensors")
    bad = crafted_files.rewrite(tmp_path / "kv.safetensors", edit, tmp_path / "bad.safetensors")
    with pytest.raises(CheckpointError, match=message):
        load_cache(bad)


def test_inspect_prints_one_line_for_a_crafted_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    save_cache(make_paged(seed=5), tmp_path / "kv.safetensors")
    bad = crafted_files.edit_metadata(tmp_path / "kv.safetensors", tmp_path / "bad.safetensors", shards="[1]")
    assert cli.main(["inspect", str(bad)]) == 1
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and out.err.startswith("error: ") and "'shards'" in out.err


def test_inspect_says_when_metadata_is_unverified(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    save_cache(make_paged(seed=5), tmp_path / "kv.safetensors")
    old = crafted_files.as_old_version(tmp_path / "kv.safetensors", 2, tmp_path / "v2.safetensors")
    assert cli.main(["inspect", str(old)]) == 0
    out = capsys.readouterr()
    assert "header:     not verified (format version 2" in out.out and out.err == ""
    assert cli.main(["inspect", str(tmp_path / "kv.safetensors")]) == 0
    assert "header checksums: OK" in capsys.readouterr().out


# -- load_sequences is all or nothing (item 5) and says what does not fit ------------------------------


@pytest.mark.parametrize(
    "payload, message",
    [
        ({"token_ids": [[4242, 4343]]}, "2 sequences, 1 rows of token ids"),  # fewer rows than sequences
        ({"token_ids": [[1], "x"]}, "row 1"),
        ({"token_ids": [[1], [2**70]]}, "row 1"),
        ({"token_ids": None}, "token_ids"),
        ([1], "expected a JSON object"),
    ],
)
def test_a_bad_manager_payload_is_refused_before_any_page_is_taken(tmp_path: Path, payload, message) -> None:
    src = make()
    model = {"a": [], "b": []}
    src.claim("a")
    src.claim("b")
    run_step(src, ["a", "b"], [[1] * 9, [2] * 5], model)
    tpk.save_sequences(src, tmp_path / "kv.safetensors", ["a", "b"])
    user = {METADATA_KEY: json.dumps(payload)}
    crafted_files.edit_metadata(tmp_path / "kv.safetensors", user_metadata=user)
    m = make()
    m.claim("x")
    run_step(m, ["x"], [[3] * 6], {"x": []})
    before = snapshot(m)
    with pytest.raises(CheckpointError, match=f"{METADATA_KEY}.*{message}"):
        tpk.load_sequences(m, tmp_path / "kv.safetensors")
    assert_same(before, snapshot(m))
    m.release("x")
    assert all(count == 0 for count in m.page_pool.refcounts)


def test_a_file_that_shares_a_partial_page_is_refused_by_a_manager(tmp_path: Path) -> None:
    """Two rows in one partially filled page: a collection may hold that, a manager's sequences may not."""
    c = tpk.PagedKVCacheCollection(make().collection.params, 8, 2, 64)
    c.blocks.normal_()
    c.cache_lengths.copy_(torch.tensor([3, 3], dtype=torch.int32))
    c.lookup_table[:, 0] = 5
    save_cache(c, tmp_path / "kv.safetensors")
    m = make()
    before = snapshot(m)
    with pytest.raises(CheckpointError, match="only full pages may be shared"):
        tpk.load_sequences(m, tmp_path / "kv.safetensors")
    assert_same(before, snapshot(m))


def test_an_mla_file_into_a_kv_manager_says_so(tmp_path: Path) -> None:
    save_cache(make_paged(mla=True, seed=3), tmp_path / "mla.safetensors")
    m = make()
    with pytest.raises(CheckpointError, match="an MLA .*latent.* cache does not fit this K/V cache"):
        tpk.load_sequences(m, tmp_path / "mla.safetensors")


def test_a_file_cut_short_after_its_header_was_read_is_a_checkpoint_error(tmp_path: Path, monkeypatch) -> None:
    """Between reading the headers and the pages, another process truncates the file."""
    save_cache(make_paged(seed=6), tmp_path / "kv.safetensors")
    real = checkpoint.load.read_info

    def then_truncated(path):
        info = real(path)
        os.truncate(path, os.path.getsize(path) - 100)
        return info

    monkeypatch.setattr(checkpoint.load, "read_info", then_truncated)  # what `verify` calls
    with pytest.raises(CheckpointError, match="truncated: end of file"):
        verify(tmp_path / "kv.safetensors")


# -- extra tensors: listed in the header, each checked against it ------------------------------------


def _saved_with_extras(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(8)
    extras = {"extra.a": torch.randn(3, 2, generator=g), "extra.b": torch.randn(4, generator=g).to(torch.bfloat16)}
    save_cache(make_paged(seed=8), tmp_path / "kv.safetensors", extra_tensors=extras)
    return tmp_path / "kv.safetensors"


def _edit_listed(edit):
    """A header edit applying `edit` to the decoded 'extra_tensors' metadata."""

    def apply(header):
        listed = json.loads(header["__metadata__"]["extra_tensors"])
        edit(listed)
        header["__metadata__"]["extra_tensors"] = json.dumps(listed)

    return apply


def _rename(old: str, new: str):
    def apply(header):
        header[new] = header.pop(old)

    return apply


CRAFTED_EXTRAS = {
    "listed, not stored": (
        _edit_listed(lambda e: e.update({"extra.c": {"dtype": "F32", "shape": [1]}})),
        "extra tensor 'extra.c' listed in metadata field 'extra_tensors' is missing",
    ),
    "stored, not listed": (_edit_listed(lambda e: e.pop("extra.b")), "extra tensors \\['extra.b'\\] are not listed"),
    "renamed": (_rename("extra.a", "extra.z"), "extra tensor 'extra.a' listed .* is missing"),
    "renamed to a page tensor": (_rename("extra.a", "blocks.00001"), "extra tensor 'extra.a' listed .* is missing"),
    "reshaped": (lambda h: h["extra.a"].update(shape=[2, 3]), "'extra.a' is F32\\[2, 3\\], .* says F32\\[3, 2\\]"),
    "retyped": (
        _edit_listed(lambda e: e["extra.a"].update(dtype="I32")),
        "'extra.a' is F32\\[3, 2\\], .* says I32\\[3, 2\\]",
    ),
    "a name without the prefix": (
        _edit_listed(lambda e: e.update({"blocks.00000": e.pop("extra.a")})),
        "metadata field 'extra_tensors': expected names 'extra.'",
    ),
    "a dtype not stored": (_edit_listed(lambda e: e["extra.a"].update(dtype="F64")), "'extra_tensors': 'extra.a'"),
    "a shape of strings": (_edit_listed(lambda e: e["extra.a"].update(shape=["3", 2])), "'extra_tensors': 'extra.a'"),
    "a negative size": (_edit_listed(lambda e: e["extra.a"].update(shape=[-3, 2])), "'extra_tensors': 'extra.a'"),
    "another key": (_edit_listed(lambda e: e["extra.a"].update(offset=0)), "'extra_tensors': 'extra.a'"),
    "not an object": (lambda h: h["__metadata__"].update(extra_tensors="[]"), "'extra_tensors': expected a JSON dict"),
}


@pytest.mark.parametrize("name", list(CRAFTED_EXTRAS))
def test_crafted_extra_tensors_are_refused_by_every_reader(tmp_path: Path, name: str) -> None:
    """A header whose extra tensors disagree with their list (its checksum made right again) is
    refused naming the file, by every reader, before any tensor is read."""
    edit, message = CRAFTED_EXTRAS[name]
    bad = crafted_files.rewrite(_saved_with_extras(tmp_path), edit, tmp_path / "bad.safetensors")
    for read in (read_info, verify, load_cache):
        with pytest.raises(CheckpointError, match=message) as error:
            read(bad)
        assert str(bad) in str(error.value)


def test_a_flipped_bit_in_an_extra_tensor_is_found(tmp_path: Path) -> None:
    """`read_extra_tensors` and `verify` check every extra tensor's checksum (`load_cache` does not
    read them: they are the caller's)."""
    path = _saved_with_extras(tmp_path)
    header, _ = crafted_files.split(path.read_bytes())
    raw = bytearray(path.read_bytes())
    raw[8 + int.from_bytes(raw[:8], "little") + header["extra.b"]["data_offsets"][0] + 3] ^= 0x04
    path.write_bytes(bytes(raw))
    info = read_info(path)
    with pytest.raises(CheckpointError, match=f"{path}: checksum mismatch in tensor 'extra.b'"):
        checkpoint.read_extra_tensors(info)
    with pytest.raises(CheckpointError, match="checksum mismatch in tensor 'extra.b'"):
        verify(path)
