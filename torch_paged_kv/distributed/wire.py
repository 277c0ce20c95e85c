"""The wire format of a page transfer: what goes over `torch.distributed`, in which order, as bytes.

One transfer moves the pages of one or more sequences from a sender's pool to a receiver's pool,
over a process group (gloo: CPU tensors; NCCL: tensors on the current CUDA device). Messages, in
order (S: sender, R: receiver); every message is one tensor, sizes known to both sides beforehand:

1. S->R preamble, int64 `[8]`: `MAGIC, VERSION, meta_bytes, num_pages, page_bytes, scale_bytes,
   chunk_pages, checksum` (`Preamble`). A gloo receiver takes it into a zeroed buffer of
   `FIRST_MESSAGE_BYTES` (`empty_preamble`): a stray or foreign first message up to that size is
   refused, not fatal (gloo aborts the process on a message longer than the posted receive).
2. S->R meta, uint8 `[meta_bytes]` (at most `MAX_META_BYTES`): UTF-8 JSON (`encode_meta`): the
   sender's params, the scales' dtype and per-page shape (or null), the sequences (`id`, `length`,
   `pages`: indices into the `num_pages` incoming pages, `token_ids` or null, `keys`: hex prefix
   keys of the leading full pages), `root`: a fingerprint of the sender's prefix-cache root (keys
   only mean something to a receiver with the same root), `source_pages`: the sender's page ids of
   the incoming pages, or null where it cannot send from its pool (its pool is not where the
   group's messages live), `metadata`: the caller's JSON. `decode_meta` checks every field's type,
   `check_pages` that the rows use exactly the incoming pages `0..num_pages-1`.
3. R->S reply, uint8 `[REPLY_BYTES + num_pages]` (`pack_reply`): status (0: accepted), a reason
   (UTF-8, NUL-padded), then one byte per incoming page: 0 = the receiver has it cached, 1 = send it,
   `STARTS` (2) = send it, and it starts a direct message. Any `STARTS` makes the transfer direct.
   A refusal over gloo is the first `REPLY_BYTES` only (a shorter message is fine there; the flags
   of a hostile `num_pages` are never built).
4. S->R pages (accepted only), the wanted pages in index order, one of two ways:
   - packed (no `STARTS`): `chunk_pages` pages per message, each uint8
     `[n * page_bytes + n * scale_bytes + 8]`: the pages' `blocks` bytes, their `scales` bytes
     (quantized caches), and the checksum of all of that as a little-endian uint64;
   - direct: one message per run the reply marks (pages consecutive in both pools, at most
     `chunk_pages`), uint8 `[n * page_bytes]`, sent from the sender's `blocks` and received into the
     receiver's; then, for a cache with `scales`, one message uint8 `[wanted * scale_bytes]` of every
     wanted page's scales; then int64 `[messages]`: the checksum of each of those messages (as
     uint64 bits), in order.
5. R->S done, uint8 `[REPLY_BYTES]`: status 0 once every message arrived and checked out (the
   receiver registers the sequences right after), else the reason it gave up.

Checksums: `SUM64` (`sum64`, a position-weighted 64-bit sum; the default) or `CRC32` (zlib's CRC-32
of the bytes, on the host: stronger against reordered bytes, several times slower). SUM64 has two
implementations, one per place the bytes are: host bytes in C++ (`native/wire_copy.cpp`: `sum64`
of bytes in place, and `copy_sum64`, which moves pages into or out of a message and sums it in the
same pass), device bytes in torch reductions (`sum64_tensor`: no copy to the host, no wait). Where
the C++ library cannot be built, host bytes take the torch route too. Both give the same value
(tests/test_wire.py checks them against each other and against the definition).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import json
import re
import zlib
from typing import Any

import numpy as np
import torch

from ..native import build

MAGIC = 0x4B5650_41474553  # "KVPAGES"
VERSION = 2
PREAMBLE_WORDS = 8
PREAMBLE_BYTES = 8 * PREAMBLE_WORDS
FIRST_MESSAGE_BYTES = 64 << 10
"""Room a gloo receiver gives the first message of a transfer: a longer one aborts it (in gloo)."""
MAX_META_BYTES = 256 << 20
"""Largest metadata message (a receiver allocates it before reading it): about 30M token ids."""
REPLY_BYTES = 256
"""Status byte plus a 255-byte reason."""
TRAILER_BYTES = 8

CRC32, SUM64 = 1, 2
CHECKSUM_NAMES = {CRC32: "crc32", SUM64: "sum64"}

ACCEPTED, REJECTED, FAILED = 0, 1, 2
SEND, STARTS = 1, 2
"""Reply flags of a wanted page: send it; send it, first page of a direct message."""


@dataclasses.dataclass(frozen=True)
class Preamble:
    """Message 1: the sizes of everything that follows."""

    meta_bytes: int
    num_pages: int
    page_bytes: int
    scale_bytes: int
    chunk_pages: int
    checksum: int

    def pack(self, device: torch.device | str = "cpu") -> torch.Tensor:
        words = [
            MAGIC,
            VERSION,
            self.meta_bytes,
            self.num_pages,
            self.page_bytes,
            self.scale_bytes,
            self.chunk_pages,
            self.checksum,
        ]
        return torch.tensor(words, dtype=torch.int64, device=device)

    @classmethod
    def unpack(cls, tensor: torch.Tensor) -> Preamble:
        """The preamble in `tensor` (an `empty_preamble` buffer it was received into: bytes past the
        preamble must still be zero). Raises ValueError for anything that is not a preamble this
        version understands, or that declares more metadata than `MAX_META_BYTES`."""
        data = tensor.cpu().contiguous().view(torch.uint8)
        if data.numel() < PREAMBLE_BYTES or bool(data[PREAMBLE_BYTES:].any()):
            raise ValueError(
                f"not a torch_paged_kv page transfer (a first message of other than {PREAMBLE_BYTES} bytes)"
            )
        words = data[:PREAMBLE_BYTES].view(torch.int64).tolist()
        if words[0] != MAGIC:
            raise ValueError("not a torch_paged_kv page transfer (bad magic number)")
        if words[1] != VERSION:
            raise ValueError(f"wire format version {words[1]}, this library speaks version {VERSION}")
        out = cls(*words[2:])
        if min(words[2:]) < 0 or out.chunk_pages < 1 or out.checksum not in CHECKSUM_NAMES:
            raise ValueError(f"malformed preamble {words}")
        if out.meta_bytes > MAX_META_BYTES:
            raise ValueError(f"a preamble declaring {out.meta_bytes} bytes of metadata (at most {MAX_META_BYTES})")
        return out

    @property
    def bytes_per_page(self) -> int:
        return self.page_bytes + self.scale_bytes

    def chunk_sizes(self, wanted: int) -> list[int]:
        """Pages per chunk message for `wanted` pages."""
        return [min(self.chunk_pages, wanted - a) for a in range(0, wanted, self.chunk_pages)]


def empty_preamble(device: torch.device | str = "cpu") -> torch.Tensor:
    """The buffer a receiver takes a preamble into: on the CPU (gloo) `FIRST_MESSAGE_BYTES` zeroed bytes,
    so that a longer first message is refused instead of aborting the process; elsewhere (NCCL,
    whose sizes must match) exactly the preamble."""
    if torch.device(device).type == "cpu":
        return torch.zeros(FIRST_MESSAGE_BYTES, dtype=torch.uint8)
    return torch.zeros(PREAMBLE_WORDS, dtype=torch.int64, device=device)


def root_fingerprint(root: bytes) -> str:
    """What the meta says of the sender's prefix-cache root: equal iff the roots are equal."""
    return hashlib.sha256(b"torch_paged_kv/wire/root/" + root).hexdigest()


def _json_id(seq_id: Any) -> Any:
    """A sequence id as JSON: str, int, or (nested) tuples of them; anything else goes as null."""
    if isinstance(seq_id, bool):
        return None
    if isinstance(seq_id, (str, int)):
        return seq_id
    if isinstance(seq_id, tuple):
        parts = [_json_id(x) for x in seq_id]
        return None if any(p is None for p in parts) else parts
    return None


def id_from_json(value: Any) -> Any:
    """Inverse of the id encoding: lists come back as tuples (hashable)."""
    return tuple(id_from_json(x) for x in value) if isinstance(value, list) else value


def encode_meta(
    params: dict[str, Any],
    scales: dict[str, Any] | None,
    seq_ids: list,
    lengths: list[int],
    rows: list[list[int]],
    token_ids: list[list[int] | None],
    keys: list[list[bytes]],
    root: bytes,
    source_pages: list[int] | None,
    metadata: dict[str, Any] | None,
) -> bytes:
    sequences = [
        {"id": _json_id(i), "length": n, "pages": row, "token_ids": t, "keys": [k.hex() for k in ks]}
        for i, n, row, t, ks in zip(seq_ids, lengths, rows, token_ids, keys, strict=True)
    ]
    meta = {
        "params": params,
        "scales": scales,
        "sequences": sequences,
        "root": root_fingerprint(root),
        "source_pages": source_pages,
        "metadata": metadata or {},
    }
    return json.dumps(meta, separators=(",", ":")).encode()


def decode_meta(data: bytes) -> dict[str, Any]:
    """Message 2, every field's type checked (ids come back as tuples, keys as bytes); raises ValueError
    naming what is malformed."""
    try:
        meta = json.loads(data.decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ValueError(f"malformed transfer metadata (not JSON: {exc})") from None
    try:
        _check_meta(meta)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"malformed transfer metadata ({exc})") from None
    for seq in meta["sequences"]:
        seq["id"] = id_from_json(seq["id"])
        seq["keys"] = [bytes.fromhex(k) for k in seq["keys"]]
    return meta


_SEQUENCE_FIELDS = {"id", "length", "pages", "token_ids", "keys"}
_KEY = re.compile(r"[0-9a-f]{64}")


def _is_int(value: Any, low: int = 0) -> bool:
    return type(value) is int and low <= value < 1 << 63


def _is_json_id(value: Any) -> bool:
    return value is None or (type(value) is int) or isinstance(value, str) or (
        isinstance(value, list) and all(x is not None and _is_json_id(x) for x in value)
    )  # fmt: skip


def _check_meta(meta: Any) -> None:
    if not isinstance(meta, dict):
        raise ValueError("not a JSON object")
    missing = {"params", "scales", "sequences", "root", "source_pages", "metadata"} - set(meta)
    if missing:
        raise ValueError(f"missing {sorted(missing)}")
    if not isinstance(meta["params"], dict) or not (meta["scales"] is None or isinstance(meta["scales"], dict)):
        raise ValueError("params / scales: expected objects")
    if not isinstance(meta["root"], str):
        raise ValueError("root: expected a string")
    source = meta["source_pages"]
    if source is not None and not (isinstance(source, list) and all(_is_int(p) for p in source)):
        raise ValueError("source_pages: expected null or page ids")
    seqs = meta["sequences"]
    if not isinstance(seqs, list) or not seqs:
        raise ValueError("sequences: expected a non-empty list")
    for k, seq in enumerate(seqs):
        if not isinstance(seq, dict) or set(seq) != _SEQUENCE_FIELDS:
            raise ValueError(f"sequence {k}: expected an object of {sorted(_SEQUENCE_FIELDS)}")
        tokens, keys = seq["token_ids"], seq["keys"]
        checks = {
            "id": _is_json_id(seq["id"]),
            "length": _is_int(seq["length"]),
            "pages": isinstance(seq["pages"], list) and all(_is_int(p) for p in seq["pages"]),
            "token_ids": tokens is None or (isinstance(tokens, list) and all(_is_int(t, -(1 << 63)) for t in tokens)),
            "keys": isinstance(keys, list) and all(isinstance(x, str) and _KEY.fullmatch(x) for x in keys),
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"sequence {k}: bad {', '.join(bad)}")


def check_pages(meta: dict[str, Any], num_pages: int) -> None:
    """ValueError unless the sequences of a decoded meta use exactly the incoming pages
    `0..num_pages-1` and `source_pages` (if any) names one page for each."""
    used = {p for seq in meta["sequences"] for p in seq["pages"]}  # ints >= 0 (decode_meta)
    top = max(used, default=-1)
    if len(used) != num_pages or top != num_pages - 1:
        raise ValueError(
            f"the sequences use {len(used)} incoming pages (up to index {top}), the preamble says {num_pages}"
        )
    source = meta["source_pages"]
    if source is not None and len(source) != num_pages:
        raise ValueError(f"source_pages: {len(source)} pages for {num_pages} incoming pages")


def pack_reply(status: int, reason: str = "", flags: list[int] | None = None, device="cpu") -> torch.Tensor:
    """Message 3 (with `flags`, one per incoming page: 0, `SEND` or `STARTS`) or 5 (without)."""
    text = reason.encode()[: REPLY_BYTES - 1]
    head = bytes([status]) + text + bytes(REPLY_BYTES - 1 - len(text))
    body = bytes(flags) if flags is not None else b""
    return torch.frombuffer(bytearray(head + body), dtype=torch.uint8).to(device)


def unpack_reply(tensor: torch.Tensor) -> tuple[int, str, list[int]]:
    data = bytes(tensor.cpu().numpy())
    reason = data[1:REPLY_BYTES].rstrip(b"\0").decode(errors="replace")
    return data[0], reason, list(data[REPLY_BYTES:])


def direct_flags(source: list[int], dest: list[int], max_pages: int) -> list[int]:
    """Reply flags of the wanted pages for a direct transfer: a message starts (`STARTS`) wherever
    the sender's pages `source` or the receiver's `dest` stop being consecutive, or after
    `max_pages` pages."""
    flags, run = [], 0
    for j, (s, d) in enumerate(zip(source, dest, strict=True)):
        run = 0 if j == 0 or s != source[j - 1] + 1 or d != dest[j - 1] + 1 or run == max_pages else run
        flags.append(STARTS if run == 0 else SEND)
        run += 1
    return flags


def direct_messages(flags: list[int]) -> list[tuple[int, int]]:
    """(first, count) of each direct message over the wanted pages' flags (`direct_flags`); raises
    ValueError unless the first page starts one."""
    if flags and flags[0] != STARTS:
        raise ValueError("direct flags: the first wanted page must start a message")
    starts = [j for j, f in enumerate(flags) if f == STARTS]
    return [(a, b - a) for a, b in zip(starts, [*starts[1:], len(flags)][: len(starts)], strict=True)]


_ROW_BYTES = 4096
_ROW_WORDS = _ROW_BYTES // 8
_K_INT64 = 0x9E37_79B9_7F4A_7C15 - (1 << 64)  # K, the column factor, as the int64 of the same bits
_MASK = (1 << 64) - 1


def sum64(payload: torch.Tensor) -> int:
    """Position-weighted 64-bit checksum of a contiguous uint8 tensor.

    The bytes, zero-padded to whole 4 KiB rows, are read as little-endian 64-bit words `w[r, c]`
    (512 per row); with row sums `s_r` and column sums `t_c` (mod 2**64) the checksum is
    `sum_r s_r (2r + 1) + K sum_c t_c (2c + 1) + n` mod 2**64, `n` the length in bytes. A changed
    bit, a truncation or a moved word changes it (not a cryptographic hash: it guards against
    transport faults and bugs). Host bytes are summed in C++ in one pass (several times faster than
    zlib's CRC-32), device bytes with `sum64_tensor` (read back here)."""
    if payload.dtype != torch.uint8 or not payload.is_contiguous():
        raise ValueError(f"payload: expected a contiguous uint8 tensor, got {payload.dtype}")
    if payload.device.type == "cpu" and has_copy_sum64():
        return _library().pkv_wire_sum(payload.data_ptr(), payload.numel())
    return int(sum64_tensor(payload).item()) & _MASK


def sum64_tensor(payload: torch.Tensor) -> torch.Tensor:
    """`sum64` of a contiguous uint8 tensor as a 0-d int64 tensor (its uint64 bits) on the payload's
    device: torch reductions whose int64 arithmetic wraps mod 2**64, nothing copied to the host (on a
    GPU, no wait for the stream)."""
    n = payload.numel()
    full = n // _ROW_BYTES * _ROW_BYTES
    words = payload[:full].view(torch.int64).view(-1, _ROW_WORDS)
    rows, cols = words.sum(1), words.sum(0)
    if n > full:  # the last row, zero-padded
        tail = torch.zeros(_ROW_BYTES, dtype=torch.uint8, device=payload.device)
        tail[: n - full] = payload[full:]
        last = tail.view(torch.int64)
        rows, cols = torch.cat([rows, last.sum().view(1)]), cols + last
    weights = torch.arange(1, 2 * rows.numel() + 1, 2, dtype=torch.int64, device=payload.device)
    column_weights = torch.arange(1, 2 * _ROW_WORDS + 1, 2, dtype=torch.int64, device=payload.device)
    a, b = (rows * weights).sum(), (cols * column_weights).sum()
    return a + _K_INT64 * b + n


def sums_stay_on(device: torch.device) -> bool:
    """Whether SUM64 checksums of messages on `device` stay there (`message_checksum`): off the CPU,
    where one sum per message read back to the host would wait for the device each time."""
    return device.type != "cpu"


def message_checksum(payload: torch.Tensor, kind: int) -> int | torch.Tensor:
    """`checksum(payload, kind)`, or for SUM64 where `sums_stay_on` the payload's device,
    `sum64_tensor(payload)`: the caller compares many at once (`checksums_tensor`)."""
    if kind == SUM64 and sums_stay_on(payload.device):
        return sum64_tensor(payload)
    return checksum(payload, kind)


def checksums_tensor(sums: list[int | torch.Tensor], device: torch.device) -> torch.Tensor:
    """`message_checksum`s in order as int64 `[len(sums)]` (uint64 bits) on `device`."""
    tensors = [s for s in sums if isinstance(s, torch.Tensor)]
    if tensors:  # (all of one kind: the messages share a device)
        return torch.stack(tensors).to(device)
    return torch.from_numpy(np.array(sums, dtype=np.uint64).view(np.int64)).to(device)


def has_copy_sum64() -> bool:
    """Whether `copy_sum64` and `sum64` of host bytes run in C++ here: the CPU library builds (the
    answer is kept for the process; else host bytes take the torch route)."""
    try:
        _library()
    except build.BuildError:
        return False
    return True


SIGNATURES: build.Signatures = {
    # segments (int64 [n, 3]), n, message, payload bytes, to_message -> the payload's sum64
    "pkv_wire_copy": (
        [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int],
        ctypes.c_uint64,
    ),
    "pkv_wire_sum": ([ctypes.c_void_p, ctypes.c_int64], ctypes.c_uint64),  # data, bytes -> sum64
}
"""The native library's wire functions (`native/wire_copy.cpp`)."""


@functools.cache
def _library() -> ctypes.CDLL:
    """The native library with the wire's functions declared (raises `build.BuildError`)."""
    return build.declare(build.library(), SIGNATURES)


def copy_sum64(segments: np.ndarray, payload: torch.Tensor, to_payload: bool) -> int:
    """Copy `segments` into the CPU uint8 tensor `payload` (contiguous; `to_payload`) or out of it and
    return `sum64(payload)`, in one pass over the bytes (`native/wire_copy.cpp`).

    `segments`: int64 `[n, 3]` rows (offset in `payload`, host address, bytes) in payload order,
    covering `payload` without gaps or overlaps (the addresses are the caller's to get right).
    Raises `build.BuildError` where the library cannot be built (see `has_copy_sum64`)."""
    if payload.device.type != "cpu" or payload.dtype != torch.uint8 or not payload.is_contiguous():
        raise ValueError(f"payload: expected a contiguous uint8 CPU tensor, got {payload.dtype} on {payload.device}")
    segments = np.ascontiguousarray(segments, dtype=np.int64).reshape(-1, 3)
    starts = np.cumsum(np.append(0, segments[:, 2]))
    if (segments[:, 2] < 0).any() or not np.array_equal(segments[:, 0], starts[:-1]) or starts[-1] != payload.numel():
        raise ValueError(f"segments: expected runs covering the payload's {payload.numel()} bytes in order")
    return _library().pkv_wire_copy(
        segments.ctypes.data, len(segments), payload.data_ptr(), payload.numel(), int(to_payload)
    )


def checksum(payload: torch.Tensor, kind: int) -> int:
    """The checksum `kind` (CRC32 or SUM64) of a uint8 tensor `payload` (contiguous)."""
    if kind == CRC32:
        host = payload if payload.device.type == "cpu" else payload.cpu()
        return zlib.crc32(host.numpy().data)
    return sum64(payload)


def put_trailer(buffer: torch.Tensor, value: int | torch.Tensor) -> None:
    """Write `value` as the little-endian uint64 in the last 8 bytes of `buffer`: an int, or a 0-d int64
    tensor of its bits (`sum64_tensor`) on the buffer's device, copied there without a host wait."""
    if isinstance(value, torch.Tensor):
        data = value.reshape(1).view(torch.uint8)
    else:
        data = torch.frombuffer(bytearray(value.to_bytes(TRAILER_BYTES, "little")), dtype=torch.uint8)
    buffer[-TRAILER_BYTES:].copy_(data)


def get_trailer(buffer: torch.Tensor) -> int:
    """The little-endian uint64 in the last 8 bytes of `buffer` (read back to the host)."""
    return int.from_bytes(bytes(buffer[-TRAILER_BYTES:].cpu().numpy()), "little")


def trailer_tensor(buffer: torch.Tensor) -> torch.Tensor:
    """The last 8 bytes of `buffer` as a 0-d int64 tensor (uint64 bits) on its device: no host wait."""
    return buffer[-TRAILER_BYTES:].clone().view(torch.int64).reshape(())
