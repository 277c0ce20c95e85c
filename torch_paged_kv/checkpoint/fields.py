"""Parsers of the header metadata fields: each returns the value or raises ValueError saying why."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from ..params import KVCacheParams, TPShard, params_from_dict
from ..safetensors_stream import DTYPE_NAMES
from .file_format import CheckpointError, extra_name_error

T = TypeVar("T")

_CRC = re.compile(r"crc32:[0-9a-f]{8}")


def count(text: str) -> int:
    if not re.fullmatch(r"[0-9]{1,18}", text):  # below 2**63: compared with int64 tensors
        raise ValueError(f"expected a non-negative integer below 10**18, got {text[:40]!r}")
    return int(text)


def json_value(text: str, kind: type) -> Any:
    value = json.loads(text)
    if not isinstance(value, kind):
        raise ValueError(f"expected a JSON {kind.__name__}, got {type(value).__name__}")
    return value


def params_and_shard(text: str) -> tuple[KVCacheParams, TPShard | None]:
    return params_from_dict(json_value(text, dict))


def checksums(value: Any) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(v, str) and _CRC.fullmatch(v) for v in value.values()):
        raise ValueError('expected an object of "crc32:xxxxxxxx" strings')
    return value


def strings(text: str) -> dict[str, str]:
    value = json_value(text, dict)
    if not all(isinstance(v, str) for v in value.values()):
        raise ValueError("expected an object of strings")
    return value


def row_numbers(text: str) -> list[int]:
    value = json_value(text, list)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise ValueError("expected a list of row numbers")
    return value


def shard_list(text: str) -> list[tuple[str, dict[str, str]]]:
    """(file name, checksums) of each listed shard: plain names of files beside the main file."""
    shards = []
    for entry in json_value(text, list):
        name = entry.get("file") if isinstance(entry, dict) else None
        if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name or "\\" in name:
            raise ValueError(
                f"expected entries {{'file': a file name beside the main file, 'checksums': ...}}, got {entry!r:.80}"
            )
        shards.append((name, checksums(entry.get("checksums"))))
    return shards


def group_list(text: str) -> list[tuple[KVCacheParams, tuple[int, ...], int]]:
    """(params, model layers, stored pages) of each layer group."""
    groups = []
    for entry in json_value(text, list):
        if not isinstance(entry, dict) or set(entry) != {"params", "layers", "num_pages"}:
            raise ValueError(f"expected entries {{'params': ..., 'layers': [...], 'num_pages': n}}, got {entry!r:.80}")
        layers = entry["layers"]
        if not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
            raise ValueError(f"'layers': expected a list of layer numbers, got {layers!r:.80}")
        params = KVCacheParams.from_dict(json_value(json.dumps(entry["params"]), dict))
        groups.append((params, tuple(layers), count(str(entry["num_pages"]))))
    return groups


def extra_specs(text: str) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """(dtype, shape) of each extra tensor, by name."""
    by_name = {v: k for k, v in DTYPE_NAMES.items()}
    specs = {}
    for name, entry in json_value(text, dict).items():
        why = extra_name_error(name)
        if why is not None:
            raise ValueError(why)
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if (
            not isinstance(entry, dict)
            or set(entry) != {"dtype", "shape"}
            or entry["dtype"] not in by_name
            or not isinstance(shape, list)
            or not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 10**18 for n in shape)
        ):
            raise ValueError(
                f"{name!r}: expected {{'dtype': one of {sorted(by_name)}, 'shape': [sizes]}}, got {entry!r:.80}"
            )
        specs[name] = (by_name[entry["dtype"]], tuple(shape))
    return specs


def parse_field(path: Path, metadata: dict[str, str], key: str, parse: Callable[[str], T]) -> T:
    """`parse(metadata[key])`, any failure a CheckpointError naming the file and the field."""
    if key not in metadata:
        raise CheckpointError(f"{path}: metadata field {key!r} is missing")
    try:
        return parse(metadata[key])
    except (ValueError, TypeError, AttributeError, OverflowError, RecursionError) as exc:
        raise CheckpointError(f"{path}: metadata field {key!r}: {exc}") from None
