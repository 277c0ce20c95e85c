"""`KVCacheParams`: the static shape of a KV cache, shared by every layer and backend."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

SUPPORTED_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclasses.dataclass(frozen=True)
class KVCacheParams:
    """What a KV cache holds: element type, layer count, heads, head size and page size.

    `is_mla=True` describes a latent (MLA) cache: one plane per layer instead of K and V.
    Instances are immutable, hashable, comparable and round-trip through `to_dict`/`from_dict`.
    """

    dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    is_mla: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES.values():
            raise ValueError(f"dtype: expected one of {list(SUPPORTED_DTYPES)}, got {self.dtype}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if not isinstance(self.is_mla, bool):
            raise ValueError(f"is_mla: expected a bool, got {self.is_mla!r}")
        if self.is_mla and self.num_kv_heads != 1:
            raise ValueError(f"num_kv_heads: an MLA cache has one latent head, got {self.num_kv_heads}")

    @property
    def num_planes(self) -> int:
        """2 (K and V) for MHA caches, 1 for MLA latent caches."""
        return 1 if self.is_mla else 2

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies across all layers, K and V."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.num_planes * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe description (the dtype by name)."""
        out = dataclasses.asdict(self)
        out["dtype"] = str(self.dtype).removeprefix("torch.")
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVCacheParams:
        """Inverse of `to_dict`; rejects unknown keys and dtypes with a `ValueError`."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - fields
        if unknown:
            raise ValueError(f"KVCacheParams: unknown keys {sorted(unknown)}")
        values = dict(data)
        dtype = values.get("dtype")
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype: expected one of {list(SUPPORTED_DTYPES)}, got {dtype!r}")
        values["dtype"] = SUPPORTED_DTYPES[dtype]
        return cls(**values)
