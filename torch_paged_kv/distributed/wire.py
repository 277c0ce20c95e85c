"""The wire format of a page transfer: what goes over `torch.distributed`, in which order, as bytes.

One transfer moves the pages of one or more sequences from a sender's pool to a receiver's pool,
over a process group (gloo: CPU tensors; NCCL: tensors on the current CUDA device). Messages, in
order (S: sender, R: receiver); every message is one tensor, sizes known to both sides beforehand:

1. S->R preamble, int64 `[8]`: `MAGIC, VERSION, meta_bytes, num_pages, page_bytes, scale_bytes,
   chunk_pages, checksum` (`Preamble`).
2. S->R meta, uint8 `[meta_bytes]`: UTF-8 JSON (`encode_meta`): the sender's params, the scales'
   dtype and per-page shape (or null), the sequences (`id`, `length`, `pages`: indices into the
   `num_pages` incoming pages, `token_ids` or null, `keys`: hex prefix keys of the leading full
   pages), `root`: a fingerprint of the sender's prefix-cache root (keys only mean something to a
   receiver with the same root), `metadata`: the caller's JSON.
3. R->S reply, uint8 `[REPLY_BYTES + num_pages]` (`pack_reply`): status (0: accepted), a reason
   (UTF-8, NUL-padded), then one byte per incoming page: 1 = send it, 0 = the receiver has it cached.
4. S->R chunks (accepted only): the wanted pages in index order, `chunk_pages` per message, each
   uint8 `[n * page_bytes + n * scale_bytes + 8]`: the pages' `blocks` bytes, their `scales` bytes
   (quantized caches), and the checksum of all of that as a little-endian uint64.
5. R->S done, uint8 `[REPLY_BYTES]`: status 0 once every chunk arrived and checked out (the
   receiver registers the sequences right after), else the reason it gave up.

Checksums: `CRC32` (zlib, on host bytes: gloo) or `SUM64` (`sum64`, a position-weighted 64-bit sum
computed with torch ops on the wire device: NCCL, no device-to-host copy of the data).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import zlib
from typing import Any

import torch

MAGIC = 0x4B5650_41474553  # "KVPAGES"
VERSION = 1
PREAMBLE_WORDS = 8
REPLY_BYTES = 256
"""Status byte plus a 255-byte reason."""
TRAILER_BYTES = 8

CRC32, SUM64 = 1, 2
CHECKSUM_NAMES = {CRC32: "crc32", SUM64: "sum64"}

ACCEPTED, REJECTED, FAILED = 0, 1, 2


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
        """Raises ValueError for anything that is not a preamble this version understands."""
        words = tensor.cpu().tolist()
        if len(words) != PREAMBLE_WORDS or words[0] != MAGIC:
            raise ValueError("not a torch_paged_kv page transfer (bad magic number)")
        if words[1] != VERSION:
            raise ValueError(f"wire format version {words[1]}, this library speaks version {VERSION}")
        out = cls(*words[2:])
        if min(words[2:]) < 0 or out.chunk_pages < 1 or out.checksum not in CHECKSUM_NAMES:
            raise ValueError(f"malformed preamble {words}")
        return out

    @property
    def bytes_per_page(self) -> int:
        return self.page_bytes + self.scale_bytes

    def chunk_sizes(self, wanted: int) -> list[int]:
        """Pages per chunk message for `wanted` pages."""
        return [min(self.chunk_pages, wanted - a) for a in range(0, wanted, self.chunk_pages)]


def empty_preamble(device: torch.device | str = "cpu") -> torch.Tensor:
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
        "metadata": metadata or {},
    }
    return json.dumps(meta, separators=(",", ":")).encode()


def decode_meta(data: bytes) -> dict[str, Any]:
    try:
        meta = json.loads(data.decode())
        for seq in meta["sequences"]:
            seq["id"] = id_from_json(seq["id"])
            seq["keys"] = [bytes.fromhex(k) for k in seq["keys"]]
        missing = {"params", "scales", "root", "metadata"} - set(meta)
        if missing:
            raise KeyError(sorted(missing))
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"malformed transfer metadata ({type(exc).__name__}: {exc})") from None
    return meta


def pack_reply(status: int, reason: str = "", wanted: list[bool] | None = None, device="cpu") -> torch.Tensor:
    """Message 3 (with `wanted`, one flag per incoming page) or 5 (without)."""
    text = reason.encode()[: REPLY_BYTES - 1]
    head = bytes([status]) + text + bytes(REPLY_BYTES - 1 - len(text))
    body = bytes(int(w) for w in wanted) if wanted is not None else b""
    return torch.frombuffer(bytearray(head + body), dtype=torch.uint8).to(device)


def unpack_reply(tensor: torch.Tensor) -> tuple[int, str, list[bool]]:
    data = bytes(tensor.cpu().numpy())
    reason = data[1:REPLY_BYTES].rstrip(b"\0").decode(errors="replace")
    return data[0], reason, [b != 0 for b in data[REPLY_BYTES:]]


def sum64(payload: torch.Tensor) -> int:
    """Position-weighted 64-bit checksum of a uint8 tensor, in torch ops on its device.

    The bytes are read as little-endian int32 words (zero-padded), laid out as rows of `_WIDTH`
    words; the checksum is `sum(w) + sum_rows(row_sum * (r + 1)) * K1 + sum_cols(col_sum * (c + 1)) * K2`
    modulo 2**64. Any changed byte, truncation or shift of whole words changes it with high
    probability (not a cryptographic hash: it guards against transport faults and bugs)."""
    n = payload.numel()
    padded = math.ceil(n / (4 * _WIDTH)) * 4 * _WIDTH
    if padded != n:
        buf = torch.zeros(padded, dtype=torch.uint8, device=payload.device)
        buf[:n] = payload
        payload = buf
    words = payload.view(torch.int32).view(-1, _WIDTH)
    rows = words.sum(1, dtype=torch.int64)
    cols = words.sum(0, dtype=torch.int64)
    r = torch.arange(1, rows.numel() + 1, dtype=torch.int64, device=payload.device)
    c = torch.arange(1, _WIDTH + 1, dtype=torch.int64, device=payload.device)
    total = rows.sum() + (rows * r).sum() * _K1 + (cols * c).sum() * _K2 + n
    return int(total) & 0xFFFF_FFFF_FFFF_FFFF


_WIDTH = 1024
_K1, _K2 = 0x9E37_79B9, 0x85EB_CA6B


def checksum(payload: torch.Tensor, kind: int) -> int:
    """The checksum `kind` (CRC32 or SUM64) of a uint8 tensor `payload` (contiguous)."""
    if kind == CRC32:
        host = payload if payload.device.type == "cpu" else payload.cpu()
        return zlib.crc32(memoryview(host.numpy()))
    return sum64(payload)


def put_trailer(buffer: torch.Tensor, value: int) -> None:
    """Write `value` as the little-endian uint64 in the last 8 bytes of `buffer`."""
    data = torch.frombuffer(bytearray(value.to_bytes(TRAILER_BYTES, "little")), dtype=torch.uint8)
    buffer[-TRAILER_BYTES:].copy_(data)


def get_trailer(buffer: torch.Tensor) -> int:
    return int.from_bytes(bytes(buffer[-TRAILER_BYTES:].cpu().numpy()), "little")
