"""The transfer wire format on its own: messages round-trip, bad ones are refused, checksums notice damage."""

from __future__ import annotations

import zlib

import pytest
import torch

from torch_paged_kv.distributed import wire


def test_preamble_round_trips_and_refuses_what_it_does_not_understand():
    pre = wire.Preamble(meta_bytes=100, num_pages=7, page_bytes=512, scale_bytes=16, chunk_pages=3, checksum=wire.CRC32)
    assert wire.Preamble.unpack(pre.pack()) == pre
    assert pre.bytes_per_page == 528 and pre.chunk_sizes(7) == [3, 3, 1] and pre.chunk_sizes(0) == []
    words = pre.pack()
    for index, value, message in [(0, 1, "bad magic"), (1, 99, "version 99"), (6, 0, "malformed"), (7, 5, "malformed")]:
        bad = words.clone()
        bad[index] = value
        with pytest.raises(ValueError, match=message):
            wire.Preamble.unpack(bad)


def test_meta_round_trips_ids_keys_and_tokens():
    keys = [[bytes(range(32))], []]
    data = wire.encode_meta(
        {"dtype": "float32"},
        None,
        [("req", 7), object()],
        [5, 2],
        [[0, 1], [2]],
        [[1, 2, 3, 4, 5], None],
        keys,
        b"r",
        {"x": 1},
    )
    meta = wire.decode_meta(data)
    assert [s["id"] for s in meta["sequences"]] == [("req", 7), None]  # ids that do not travel arrive as None
    assert [s["keys"] for s in meta["sequences"]] == keys
    assert meta["sequences"][0]["token_ids"] == [1, 2, 3, 4, 5] and meta["metadata"] == {"x": 1}
    assert meta["root"] == wire.root_fingerprint(b"r") != wire.root_fingerprint(b"s")
    for bad in (
        b"\xff",
        b"{}",
        b'{"params": {}, "sequences": [{"id": 1}], "scales": null, "root": "", "metadata": {}}',
    ):
        with pytest.raises(ValueError, match="malformed transfer metadata"):
            wire.decode_meta(bad)


def test_replies_carry_a_status_a_reason_and_the_wanted_pages():
    status, reason, wanted = wire.unpack_reply(wire.pack_reply(wire.ACCEPTED, "", [True, False, True]))
    assert (status, reason, wanted) == (wire.ACCEPTED, "", [True, False, True])
    status, reason, wanted = wire.unpack_reply(wire.pack_reply(wire.REJECTED, "é" * 300))
    assert status == wire.REJECTED and reason.startswith("é") and wanted == []
    assert wire.pack_reply(wire.FAILED, "x" * 1000).numel() == wire.REPLY_BYTES


@pytest.mark.parametrize("kind", [wire.CRC32, wire.SUM64])
def test_checksums_notice_flipped_bits_swaps_and_truncation(kind):
    gen = torch.Generator().manual_seed(0)
    payload = torch.randint(0, 256, (10_007,), dtype=torch.uint8, generator=gen)
    base = wire.checksum(payload, kind)
    assert base == wire.checksum(payload.clone(), kind)
    for i in (0, 4096, 10_006):
        flipped = payload.clone()
        flipped[i] ^= 1
        assert wire.checksum(flipped, kind) != base
    swapped = payload.clone()
    swapped[[0, 4]] = swapped[[4, 0]]
    if not torch.equal(swapped, payload):
        assert wire.checksum(swapped, kind) != base
    assert wire.checksum(payload[:-1], kind) != base
    assert wire.checksum(torch.zeros(8, dtype=torch.uint8), kind) != wire.checksum(
        torch.zeros(16, dtype=torch.uint8), kind
    )
    if kind == wire.CRC32:
        assert base == zlib.crc32(bytes(payload.numpy()))


def test_trailer_round_trips_a_uint64():
    buf = torch.zeros(20, dtype=torch.uint8)
    wire.put_trailer(buf, 2**64 - 3)
    assert wire.get_trailer(buf) == 2**64 - 3 and buf[:12].eq(0).all()


def test_sum64_is_the_same_in_numpy_and_in_torch():
    gen = torch.Generator().manual_seed(1)
    for n in (0, 1, 4095, 4096, 4097, 3 * 4096 + 17):
        payload = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        assert wire._sum64_numpy(payload) == wire._sum64_torch(payload), n
