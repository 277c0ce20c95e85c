"""A streaming writer and a header reader for the safetensors format.

The safetensors Python API (`save_file`) wants every tensor in memory at once; this writer takes
tensors chunk by chunk, so a cache larger than host memory can be written. Format: an 8-byte
little-endian header length, a JSON header (`{"__metadata__": {str: str}, name: {"dtype",
"shape", "data_offsets"}}`, space-padded to a multiple of 8), then the raw bytes of each tensor.

A CRC-32 of every tensor's bytes goes into the metadata key `checksums` (JSON `{name:
"crc32:xxxxxxxx"}`). The header is written first with zero placeholders of the same width and
patched once the data is out, so nothing has to be read twice.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from dataclasses import dataclass
from typing import BinaryIO

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
CHECKSUM_KEY = "checksums"
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


def _header_bytes(specs: list[TensorSpec], metadata: dict[str, str], checksums: dict[str, str]) -> bytes:
    header: dict[str, object] = {"__metadata__": {**metadata, CHECKSUM_KEY: json.dumps(checksums)}}
    offset = 0
    for spec in specs:
        header[spec.name] = {
            "dtype": DTYPE_NAMES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
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
        data = memoryview(chunk.contiguous().view(-1).view(torch.uint8).numpy())
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
        header = _header_bytes(self._specs, self._metadata, self._checksums)
        assert len(header) == self._header_len, "checksum strings have a fixed width"
        self._file.seek(8)
        self._file.write(header)
        self._file.flush()
        os.fsync(self._file.fileno())
        return dict(self._checksums)


def read_header(path: str | os.PathLike[str]) -> tuple[dict[str, str], dict[str, dict]]:
    """`(metadata, tensors)` of a safetensors file, checking it is complete. Each tensor's
    `data_offsets` are made absolute (from the start of the file).

    Raises `SafetensorsFormatError` for a file too short, a header that is not JSON, or data
    offsets that do not exactly cover the rest of the file (truncated or padded).
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
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SafetensorsFormatError(f"not a safetensors file (header is not JSON: {exc})") from None
    if not isinstance(header, dict):
        raise SafetensorsFormatError("not a safetensors file (header is not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    end = 0
    for name, info in header.items():
        try:
            end = max(end, int(info["data_offsets"][1]))
        except (TypeError, KeyError, IndexError, ValueError):
            raise SafetensorsFormatError(f"not a safetensors file (bad entry for tensor {name!r})") from None
    data_bytes = size - 8 - header_len
    if data_bytes < end:
        raise SafetensorsFormatError(f"truncated: the header promises {end} data bytes, the file has {data_bytes}")
    if data_bytes > end:
        raise SafetensorsFormatError(f"{data_bytes - end} unexpected bytes after the last tensor")
    for info in header.values():
        info["data_offsets"] = [8 + header_len + int(x) for x in info["data_offsets"]]
    return metadata, header


def read_into(file: BinaryIO, offset: int, out: torch.Tensor) -> None:
    """Fill the contiguous CPU tensor `out` with the file's bytes at `offset`."""
    view = memoryview(out.view(-1).view(torch.uint8).numpy())
    file.seek(offset)
    while view.nbytes:
        count = file.readinto(view)
        if not count:
            raise SafetensorsFormatError(f"truncated: end of file at byte {file.tell()}")
        view = view[count:]
