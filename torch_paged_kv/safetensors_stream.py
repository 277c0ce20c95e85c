"""A streaming writer and a header reader for the safetensors format.

The safetensors Python API (`save_file`) wants every tensor in memory at once; this writer takes
tensors chunk by chunk, so a cache larger than host memory can be written. Format: an 8-byte
little-endian header length, a JSON header (`{"__metadata__": {str: str}, name: {"dtype",
"shape", "data_offsets"}}`, space-padded to a multiple of 8), then the raw bytes of each tensor.

A CRC-32 of every tensor's bytes goes into the metadata key `checksums` (JSON `{name:
"crc32:xxxxxxxx"}`), and a CRC-32 of the header itself (`header_checksum`) into `header_checksum`.
The header is written first with zero placeholders of the same width and patched once the data is
out, so nothing has to be read twice. `read_header` checks a file against the format strictly
(every tensor's bytes exactly where its dtype and shape say, no gaps) before anything trusts it.
"""

from __future__ import annotations

import io
import json
import math
import os
import struct
import zlib
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",  # safetensors' names for torch's FP8 dtypes
    torch.float8_e5m2: "F8_E5M2",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.uint8: "U8",
}
DTYPE_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip
"""Bytes per element of the safetensors dtypes a header may name."""
CHECKSUM_KEY = "checksums"
HEADER_CHECKSUM_KEY = "header_checksum"
_PLACEHOLDER = "crc32:" + "0" * 8
MAX_HEADER_BYTES = 100 << 20


class SafetensorsFormatError(ValueError):
    """A file that is not (complete, well-formed) safetensors."""


def format_crc(crc: int) -> str:
    """The checksum string stored for a CRC-32 value."""
    return f"crc32:{crc:08x}"


@dataclass(frozen=True)
class TensorSpec:
    """Name, dtype and shape of a tensor to be written."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def header_checksum(header: dict[str, Any]) -> str:
    """The checksum of a header as it is in the file (data offsets relative to the data): CRC-32 of its
    canonical JSON (keys sorted, no spaces), its own `header_checksum` entry left out."""
    body = dict(header)
    metadata = body.get("__metadata__")
    if isinstance(metadata, dict):
        body["__metadata__"] = {k: v for k, v in metadata.items() if k != HEADER_CHECKSUM_KEY}
    return format_crc(zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()))


def _header_bytes(
    specs: list[TensorSpec], metadata: dict[str, str], checksums: dict[str, str], final: bool = False
) -> bytes:
    """The header; with `final`, its own checksum filled in (else a placeholder of the same width)."""
    meta = {**metadata, CHECKSUM_KEY: json.dumps(checksums), HEADER_CHECKSUM_KEY: _PLACEHOLDER}
    header: dict[str, Any] = {"__metadata__": meta}
    offset = 0
    for spec in specs:
        header[spec.name] = {
            "dtype": DTYPE_NAMES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    if final:
        meta[HEADER_CHECKSUM_KEY] = header_checksum(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


class SafetensorsWriter:
    """Writes tensors in the declared order, chunk by chunk, to an open binary file.

    Call `write(tensor)` with consecutive pieces of each tensor (any leading-dim split), then
    `finish()`, which checks every byte arrived, patches the checksums into the header and
    flushes and fsyncs the file. Returns the checksums from `finish`.
    """

    def __init__(self, file: BinaryIO, specs: list[TensorSpec], metadata: dict[str, str]) -> None:
        if len({s.name for s in specs}) != len(specs):
            raise ValueError("specs: tensor names must be unique")
        self._file = file
        self._specs = specs
        self._metadata = metadata
        header = _header_bytes(specs, metadata, {s.name: _PLACEHOLDER for s in specs})
        self._header_len = len(header)
        file.write(struct.pack("<Q", len(header)))
        file.write(header)
        self._index = 0
        self._written = 0
        self._crc = 0
        self._checksums: dict[str, str] = {}
        self._close_empty()

    def _close_empty(self) -> None:
        while self._index < len(self._specs) and self._written == self._specs[self._index].nbytes:
            self._checksums[self._specs[self._index].name] = format_crc(self._crc)
            self._index, self._written, self._crc = self._index + 1, 0, 0

    def write(self, chunk: torch.Tensor) -> None:
        """Append the bytes of `chunk` (a CPU tensor, any dtype) to the current tensor."""
        if self._index >= len(self._specs):
            raise ValueError("write: every declared tensor is already complete")
        spec = self._specs[self._index]
        if chunk.device.type != "cpu":
            raise ValueError(f"write: {spec.name} expects a CPU chunk, got one on {chunk.device}")
        data = chunk.contiguous().view(-1).view(torch.uint8).numpy().data
        if self._written + data.nbytes > spec.nbytes:
            raise ValueError(f"write: {spec.name} overflows its {spec.nbytes} bytes")
        self._write_bytes(data)
        self._crc = zlib.crc32(data, self._crc)
        self._written += data.nbytes
        self._close_empty()

    def _write_bytes(self, data: memoryview) -> None:
        self._file.write(data)

    def finish(self) -> dict[str, str]:
        """Patch checksums into the header, flush and fsync; returns `{name: "crc32:..."}`."""
        if self._index != len(self._specs):
            raise ValueError(f"finish: tensor {self._specs[self._index].name} is incomplete")
        header = _header_bytes(self._specs, self._metadata, self._checksums, final=True)
        assert len(header) == self._header_len, "checksum strings have a fixed width"
        self._file.seek(8)
        self._file.write(header)
        self._file.flush()
        os.fsync(self._file.fileno())
        return dict(self._checksums)


def read_header(path: str | os.PathLike[str]) -> tuple[dict[str, str], dict[str, dict]]:
    """`(metadata, tensors)` of a safetensors file, checked against the format. Each tensor's
    `data_offsets` are made absolute (from the start of the file).

    Raises `SafetensorsFormatError` for a file too short, a header that is not a JSON object of the
    format's fields (metadata str -> str; per tensor a known dtype, a shape of ints, two data offsets),
    tensors whose bytes are not exactly `prod(shape) * dtype size` laid end to end from the start of
    the data to the end of the file (truncated, padded, overlapping, with gaps), or a header that
    carries a `header_checksum` its contents do not match.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise SafetensorsFormatError(f"not a safetensors file ({size} bytes, too short for a header)")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(MAX_HEADER_BYTES, size - 8):
            raise SafetensorsFormatError(
                f"not a safetensors file (header length {header_len} exceeds the file's {size} bytes)"
            )
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise SafetensorsFormatError(f"not a safetensors file (header is not JSON: {exc})") from None
    if not isinstance(header, dict):
        raise SafetensorsFormatError("not a safetensors file (header is not a JSON object)")
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SafetensorsFormatError("not a safetensors file (__metadata__ is not an object of strings)")
    stored = metadata.get(HEADER_CHECKSUM_KEY)
    if stored is not None and stored != header_checksum(header):
        raise SafetensorsFormatError(
            f"header checksum mismatch (stored {stored}, computed {header_checksum(header)}): the header was damaged"
        )
    tensors = {name: _tensor_entry(name, info) for name, info in header.items() if name != "__metadata__"}
    end = 0
    for name, info in sorted(tensors.items(), key=lambda item: item[1]["data_offsets"]):
        begin, stop = info["data_offsets"]
        if begin != end:
            what = "overlaps the tensor before it" if begin < end else f"leaves a gap of {begin - end} bytes before it"
            raise SafetensorsFormatError(f"not a safetensors file (tensor {name!r} {what})")
        end = stop
    data_bytes = size - 8 - header_len
    if data_bytes < end:
        raise SafetensorsFormatError(f"truncated: the header promises {end} data bytes, the file has {data_bytes}")
    if data_bytes > end:
        raise SafetensorsFormatError(f"{data_bytes - end} unexpected bytes after the last tensor")
    for info in tensors.values():
        info["data_offsets"] = [8 + header_len + x for x in info["data_offsets"]]
    return dict(metadata), tensors


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _tensor_entry(name: str, info: Any) -> dict[str, Any]:
    """A header's entry for tensor `name`, checked: a known dtype, a shape of counts, and data offsets
    `[begin, end]` exactly `prod(shape) * dtype size` apart."""

    def bad(what: str) -> SafetensorsFormatError:
        return SafetensorsFormatError(f"not a safetensors file (tensor {name!r}: {what})")

    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise bad("expected an object of dtype, shape and data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise bad(f"unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_count(n) for n in shape):
        raise bad(f"shape {shape!r} is not a list of sizes")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(x) for x in offsets):
        raise bad(f"data_offsets {offsets!r} are not two byte offsets")
    nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
    if offsets[1] - offsets[0] != nbytes:
        raise bad(f"data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes, its {dtype}{shape} has {nbytes}")
    return {"dtype": dtype, "shape": shape, "data_offsets": list(offsets)}


def read_into(file: io.BufferedIOBase, offset: int, out: torch.Tensor) -> None:
    """Fill the contiguous CPU tensor `out` with the file's bytes at `offset`."""
    view = out.view(-1).view(torch.uint8).numpy().data
    file.seek(offset)
    while view.nbytes:
        count = file.readinto(view)
        if not count:
            raise SafetensorsFormatError(f"truncated: end of file at byte {file.tell()}")
        view = view[count:]
