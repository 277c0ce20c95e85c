"""Crafting checkpoint files the way an attacker (or a broken tool) would: rewrite a safetensors header
and keep the file consistent otherwise, recomputing the header checksum so that the checks behind it
are the ones tested.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch_paged_kv.safetensors_stream import HEADER_CHECKSUM_KEY, header_checksum


def split(raw: bytes) -> tuple[dict[str, Any], bytes]:
    """(header as JSON, the data after it) of a safetensors file's bytes."""
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def join(header: Any, data: bytes, rechecksum: bool = True) -> bytes:
    """A safetensors file of `header` (any JSON) and `data`; with `rechecksum` the header checksum is
    made right again (if the header has one: an old version's file has none)."""
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if rechecksum and isinstance(meta, dict) and HEADER_CHECKSUM_KEY in meta:
        meta[HEADER_CHECKSUM_KEY] = header_checksum(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def rewrite(
    path: Path, edit: Callable[[dict[str, Any]], Any], out: Path | None = None, rechecksum: bool = True
) -> Path:
    """Apply `edit` to the header of the file at `path` (it changes the dict in place) and write the
    result to `out` (default: `path`)."""
    header, data = split(path.read_bytes())
    edit(header)
    out = out or path
    out.write_bytes(join(header, data, rechecksum))
    return out


def edit_metadata(path: Path, out: Path | None = None, **values: Any) -> Path:
    """Set metadata keys (JSON-encoded unless given as str; None removes the key)."""

    def edit(header: dict[str, Any]) -> None:
        meta = header["__metadata__"]
        for key, value in values.items():
            if value is None:
                meta.pop(key, None)
            else:
                meta[key] = value if isinstance(value, str) else json.dumps(value)

    return rewrite(path, edit, out)


def as_old_version(path: Path, version: int, out: Path) -> Path:
    """What a writer of format `version` (1 or 2: no header checksum) made of the same state."""

    def edit(header: dict[str, Any]) -> None:
        header["__metadata__"].pop(HEADER_CHECKSUM_KEY)
        header["__metadata__"]["format_version"] = str(version)

    return rewrite(path, edit, out, rechecksum=False)
