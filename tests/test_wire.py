"""The transfer wire format on its own: messages round-trip, bad ones are refused, checksums notice damage."""

from __future__ import annotations

import struct
import zlib

import numpy as np
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


def test_a_preamble_arrives_in_a_larger_zeroed_buffer_on_the_cpu():
    pre = wire.Preamble(meta_bytes=100, num_pages=7, page_bytes=512, scale_bytes=16, chunk_pages=3, checksum=wire.SUM64)
    buffer = wire.empty_preamble("cpu")
    assert buffer.numel() == wire.FIRST_MESSAGE_BYTES and buffer.dtype == torch.uint8
    buffer[: wire.PREAMBLE_BYTES] = pre.pack().view(torch.uint8)
    assert wire.Preamble.unpack(buffer) == pre
    buffer[wire.PREAMBLE_BYTES + 5] = 1  # a longer first message: not ours
    with pytest.raises(ValueError, match="other than 64 bytes"):
        wire.Preamble.unpack(buffer)
    huge = wire.Preamble(wire.MAX_META_BYTES + 1, 7, 512, 16, 3, wire.SUM64)
    with pytest.raises(ValueError, match="bytes of metadata"):
        wire.Preamble.unpack(huge.pack())


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
        [5, 9, 2],
        {"x": 1},
    )
    meta = wire.decode_meta(data)
    assert [s["id"] for s in meta["sequences"]] == [("req", 7), None]  # ids that do not travel arrive as None
    assert [s["keys"] for s in meta["sequences"]] == keys
    assert meta["sequences"][0]["token_ids"] == [1, 2, 3, 4, 5] and meta["metadata"] == {"x": 1}
    assert meta["root"] == wire.root_fingerprint(b"r") != wire.root_fingerprint(b"s")
    assert meta["source_pages"] == [5, 9, 2]
    for bad in (
        b"\xff",
        b"{}",
        b'{"params": {}, "sequences": [{"id": 1}], "scales": null, "root": "", "source_pages": null, "metadata": {}}',
        b'{"params": {}, "sequences": [], "scales": null, "root": "", "metadata": {}}',
        b'{"params": {}, "sequences": [], "scales": null, "root": "", "source_pages": [1, -2], "metadata": {}}',
        b'{"params": {}, "sequences": [], "scales": null, "root": "", "source_pages": null, "metadata": {}}',
        b"[" * 100_000 + b"]" * 100_000,
        data.replace(b'"length":5', b'"length":true'),
        data.replace(b'"pages":[0,1]', b'"pages":[0,[1]]'),
        data.replace(b'"token_ids":[1,2,3,4,5]', b'"token_ids":[1,2,3,4,1e3]'),
        data.replace(b'"params":{', b'"params":[{').replace(b'},"scales"', b'}],"scales"'),
    ):
        with pytest.raises(ValueError, match="malformed transfer metadata"):
            wire.decode_meta(bad)


def test_check_pages_wants_the_rows_to_use_exactly_the_incoming_pages():
    meta = {"sequences": [{"pages": [0, 1]}, {"pages": [1, 2]}], "source_pages": None}
    wire.check_pages(meta, 3)
    for num_pages in (2, 4, 2**31):
        with pytest.raises(ValueError, match=f"preamble says {num_pages}"):
            wire.check_pages(meta, num_pages)
    with pytest.raises(ValueError, match="source_pages"):
        wire.check_pages({**meta, "source_pages": [4, 5]}, 3)


def test_replies_carry_a_status_a_reason_and_the_wanted_pages():
    flags = [wire.STARTS, 0, wire.SEND, wire.STARTS]
    status, reason, wanted = wire.unpack_reply(wire.pack_reply(wire.ACCEPTED, "", flags))
    assert (status, reason, wanted) == (wire.ACCEPTED, "", flags)
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


def sum64_by_definition(data: bytes) -> int:
    """sum64 from its definition (wire.sum64's docstring), in Python ints: the oracle of both routes."""
    n = len(data)
    words = struct.unpack(f"<{(n + 4095) // 4096 * 512}Q", data + bytes(-n % 4096))
    rows = [sum(words[r : r + 512]) for r in range(0, len(words), 512)]
    cols = [sum(words[c::512]) for c in range(512)]
    weighted_rows = sum(s * (2 * r + 1) for r, s in enumerate(rows))
    weighted_cols = sum(t * (2 * c + 1) for c, t in enumerate(cols))
    return (weighted_rows + 0x9E3779B97F4A7C15 * weighted_cols + n) % (1 << 64)


@pytest.mark.parametrize("size", [0, 1, 7, 4095, 4096, 4097, 3 * 4096 + 17, 1 << 20])
def test_sum64_of_host_bytes_and_of_device_bytes_is_its_definition(size, monkeypatch):
    """Host bytes (C++ where the library builds) and device bytes (torch reductions, here run on CPU
    tensors) give the value of the definition; so do host bytes without the library (torch route).
    tests/gpu/test_distributed_gpu.py compares a GPU tensor's sum with the C++ one."""
    gen = torch.Generator().manual_seed(size)
    payload = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)
    want = sum64_by_definition(bytes(payload.numpy()))
    on_device = wire.sum64_tensor(payload)  # the device route
    assert on_device.dtype == torch.int64 and on_device.dim() == 0
    assert int(on_device) & (1 << 64) - 1 == want
    assert wire.sum64(payload) == want  # the host route: C++ where it builds
    monkeypatch.setattr(wire, "has_copy_sum64", lambda: False)
    assert wire.sum64(payload) == want  # without the library: the torch route
    with pytest.raises(ValueError, match="contiguous"):
        wire.sum64(torch.zeros(64, dtype=torch.uint8)[::2])


def test_checksums_tensor_keeps_device_sums_and_packs_host_sums_as_uint64_bits():
    gen = torch.Generator().manual_seed(2)
    payloads = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in (5, 4096, 9000)]
    host = [wire.sum64(p) for p in payloads]
    assert any(x >= 1 << 63 for x in host)  # the uint64 bits of a negative int64 survive the packing
    want = torch.tensor(np.array(host, dtype=np.uint64).view(np.int64))
    assert torch.equal(wire.checksums_tensor(host, torch.device("cpu")), want)
    on_device = [wire.sum64_tensor(p) for p in payloads]
    assert torch.equal(wire.checksums_tensor(on_device, torch.device("cpu")), want)


# -- the fused copy and sum64 of the CPU library ------------------------------------------------------

SLAB = 128 << 10  # wire_copy.cpp's slab; the lengths below cross several
LENGTHS = [0, 1, 7, 8, 9, 4095, 4096, 4097, 3 * 4096 + 17, SLAB - 1, SLAB, SLAB + 8, 3 * SLAB + 5 * 4096 + 13]

needs_library = pytest.mark.skipif(not wire.has_copy_sum64(), reason="no C++ compiler: no fused copy")


def _scattered(n: int, rng: np.random.Generator) -> tuple[torch.Tensor, np.ndarray]:
    """A pool with the `n` payload bytes cut into random pieces (some cut at 4 KiB rows and slabs,
    +-1), placed in shuffled order with gaps; and the `copy_sum64` segments of those pieces."""
    near = [b + d for b in (4096, 8192, SLAB, 2 * SLAB) for d in (-1, 0, 1)]
    cuts = {int(c) for c in rng.integers(1, max(n, 2), size=min(n, 12))} | {b for b in near if 0 < b < n}
    bounds = np.array(sorted({0, n} | {c for c in cuts if c < n}), dtype=np.int64)
    sizes = np.diff(bounds)
    gaps = rng.integers(0, 64, size=len(sizes))
    order = rng.permutation(len(sizes))
    place = np.empty(len(sizes), dtype=np.int64)
    place[order] = np.cumsum(np.append(0, (sizes + gaps)[order]))[:-1]
    pool = torch.from_numpy(rng.integers(0, 256, size=int(sizes.sum() + gaps.sum()), dtype=np.uint8))
    segments = np.stack([bounds[:-1], pool.data_ptr() + place, sizes], axis=1) if n else np.zeros((0, 3), np.int64)
    return pool, segments


def _pool_spans(pool: torch.Tensor, segments: np.ndarray) -> list[tuple[int, int]]:
    """(start in `pool`, bytes) of each segment's piece."""
    return [(address - pool.data_ptr(), size) for _, address, size in segments.tolist()]


@needs_library
@pytest.mark.parametrize("n", LENGTHS)
def test_copy_sum64_packs_and_unpacks_exactly_with_the_checksum_of_sum64(n):
    rng = np.random.default_rng(n)
    pool, segments = _scattered(n, rng)
    spans = _pool_spans(pool, segments)
    message = torch.from_numpy(rng.integers(0, 256, size=n, dtype=np.uint8))  # stale bytes to overwrite
    packed = wire.copy_sum64(segments, message, to_payload=True)
    assert torch.equal(message, torch.cat([torch.zeros(0, dtype=torch.uint8), *(pool[a : a + k] for a, k in spans)]))
    assert packed == wire.sum64(message)

    received = torch.from_numpy(rng.integers(0, 256, size=n, dtype=np.uint8))
    before, covered = pool.clone(), torch.zeros(pool.numel(), dtype=torch.bool)
    assert wire.copy_sum64(segments, received, to_payload=False) == wire.sum64(received)
    for (a, k), offset in zip(spans, segments[:, 0].tolist(), strict=True):
        assert torch.equal(pool[a : a + k], received[offset : offset + k])
        covered[a : a + k] = True
    assert torch.equal(pool[~covered], before[~covered])  # the gaps between the pieces are untouched


@needs_library
@pytest.mark.parametrize("to_payload", [True, False])
def test_copy_sum64_notices_a_flipped_bit(to_payload):
    n = 2 * SLAB + 777
    pool, segments = _scattered(n, np.random.default_rng(3))
    message = torch.zeros(n, dtype=torch.uint8)
    base = wire.copy_sum64(segments, message, to_payload)
    starts = [a for a, _ in _pool_spans(pool, segments)]
    for i in (0, 4095, SLAB + 3, n - 1):  # message byte i, in the message or in the pool piece it comes from
        piece = int(np.searchsorted(segments[:, 0], i, side="right")) - 1
        data, j = (pool, starts[piece] + i - int(segments[piece, 0])) if to_payload else (message, i)
        data[j] ^= 0x10
        assert wire.copy_sum64(segments, message, to_payload) != base, i
        data[j] ^= 0x10


def test_copy_sum64_refuses_segments_that_do_not_cover_the_payload():
    payload = torch.zeros(100, dtype=torch.uint8)
    source = torch.zeros(100, dtype=torch.uint8)
    for bad in ([[0, source.data_ptr(), 99]], [[0, source.data_ptr(), 50], [51, source.data_ptr(), 49]]):
        with pytest.raises(ValueError, match="segments"):
            wire.copy_sum64(np.array(bad, dtype=np.int64), payload, to_payload=True)


def test_direct_messages_break_where_either_side_stops_being_consecutive():
    source, dest = [4, 5, 6, 9, 10, 11, 12, 13], [1, 2, 3, 4, 7, 8, 9, 10]
    flags = wire.direct_flags(source, dest, max_pages=3)
    # breaks: the cap after 3 pages; source 6 -> 9; dest 4 -> 7; the cap again
    assert wire.direct_messages(flags) == [(0, 3), (3, 1), (4, 3), (7, 1)]
    assert wire.direct_messages(wire.direct_flags(list(range(5)), list(range(7, 12)), 10)) == [(0, 5)]
    assert wire.direct_flags([], [], 4) == [] and wire.direct_messages([]) == []
    with pytest.raises(ValueError, match="first wanted page"):
        wire.direct_messages([wire.SEND, wire.STARTS])
