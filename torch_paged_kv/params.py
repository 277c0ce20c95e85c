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

    Tensor parallelism: a cache may hold a slice of the model's KV heads. `num_kv_heads` is what
    this cache holds, the global heads `kv_head_start .. kv_head_start + num_kv_heads - 1` of
    `total_kv_heads` (None: `num_kv_heads`, the whole model), as rank `tp_rank` of a group of
    `tp_size` (see `torch_paged_kv.distributed.tensor_parallel.shard_params`). The defaults describe
    an unsharded cache, and `to_dict` leaves out fields at their defaults.
    """

    dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    is_mla: bool = False
    tp_size: int = 1
    tp_rank: int = 0
    kv_head_start: int = 0
    total_kv_heads: int | None = None

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
        self._check_tensor_parallel()

    def _check_tensor_parallel(self) -> None:
        if self.total_kv_heads is None:
            object.__setattr__(self, "total_kv_heads", self.num_kv_heads)  # normalised: equal params compare equal
        for name in ("tp_size", "total_kv_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        for name, bound in (("tp_rank", self.tp_size), ("kv_head_start", self.total_kv_heads)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < bound:
                raise ValueError(f"{name}: expected an int in 0..{bound - 1}, got {value!r}")
        if self.kv_head_start + self.num_kv_heads > self.total_kv_heads:
            raise ValueError(
                f"num_kv_heads: heads {self.kv_head_start}..{self.kv_head_start + self.num_kv_heads - 1} "
                f"do not fit total_kv_heads={self.total_kv_heads}"
            )

    @property
    def kv_head_range(self) -> range:
        """The global KV heads this cache holds, in order."""
        return range(self.kv_head_start, self.kv_head_start + self.num_kv_heads)

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
        defaults = {"tp_size": 1, "tp_rank": 0, "kv_head_start": 0, "total_kv_heads": self.num_kv_heads}
        for name, default in defaults.items():  # an unsharded cache's dict is what it was before these fields
            if out[name] == default:
                del out[name]
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
