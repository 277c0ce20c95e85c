"""`KVCacheParams`: the static shape of a KV cache, shared by every layer and backend."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import torch

from .ops.quant import FP8_DTYPES

SUPPORTED_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
SCALE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32}
ROPE_DTYPE = torch.bfloat16
"""The rope part of an FP8 MLA row stays in this dtype (MAX's rope-aware row)."""


_OPTIONAL_FIELDS = (
    "quantization_granularity",
    "scale_dtype",
    "static_scales",
    "kv_lora_rank",
    "rope_dim",
    "sliding_window",
)
"""Fields `to_dict` leaves out when None (a dict written before they existed reads the same)."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclasses.dataclass(frozen=True)
class KVCacheParams:
    """What a KV cache holds: element type, layer count, heads, head size and page size.

    `is_mla=True` describes a latent (MLA) cache: one plane per layer instead of K and V, one head,
    and a row per token of `kv_lora_rank` latent elements followed by `rope_dim` rotated rope-key
    elements (`KVCacheParams.mla(...)` builds one). `head_dim` is then the row width in `dtype`
    elements: `kv_lora_rank + rope_dim`, or for an FP8 cache `kv_lora_rank + 2 * rope_dim` (MAX's
    rope-aware row: FP8 latent bytes, then the rope in bf16, two bytes per element). An MLA dict
    written before these fields existed loads as `kv_lora_rank = head_dim`, `rope_dim = 0`.

    An FP8 `dtype` (`torch.float8_e4m3fn` / `torch.float8_e5m2`) makes a quantized cache, in one of
    two ways (MAX's quantized `PagedKVCache`, vLLM's per-tensor FP8):

    - per granule (the default): a `scales` tensor beside `blocks` holds one `scale_dtype` scale per
      token, head and `quantization_granularity` elements of head_dim (a divisor of head_dim;
      head_dim, the default, means one scale per token and head; for MLA the granules cover the
      latent only, `kv_lora_rank` by default: one scale per token). Stored value = round(x / scale),
      scale = amax of the granule / the dtype's max.
    - per tensor: `static_scales=(k_scale, v_scale)` (one value for MLA), fixed, no `scales` tensor.

    `sliding_window=W` says that every query reads only the keys of its last W positions (itself
    included), as `flash_attention(..., sliding_window=W)` does: a `KVCacheManager` then frees a
    sequence's pages once every token in them has left the window of every later query, so the cache
    holds O(W + page_size) tokens per sequence between steps. None (the default): every layer keeps
    every token.

    Instances are immutable, hashable, comparable and round-trip through `to_dict`/`from_dict`.
    Construction normalises the optional fields: `kv_lora_rank` and `rope_dim` are set exactly for
    an MLA cache, `quantization_granularity` and `scale_dtype` exactly for one with a scales tensor
    (`has_scales_tensor`), `static_scales` exactly for a per-tensor FP8 cache.

    `num_kv_heads` is what the cache holds: a tensor-parallel rank's cache holds some of the model's
    KV heads, and which ones is a `TPShard` kept next to the params (by its manager, in checkpoints
    and transfers), not part of them.
    """

    dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    is_mla: bool = False
    quantization_granularity: int | None = None
    scale_dtype: torch.dtype | None = None
    static_scales: tuple[float, ...] | None = None
    kv_lora_rank: int | None = None
    rope_dim: int | None = None
    sliding_window: int | None = None

    @classmethod
    def mla(
        cls,
        dtype: torch.dtype,
        num_layers: int,
        page_size: int,
        kv_lora_rank: int = 512,
        rope_dim: int = 64,
        **quantization: Any,
    ) -> KVCacheParams:
        """An MLA latent cache (DeepSeek-V2/V3: `kv_lora_rank` 512, `rope_dim` 64): one head whose row
        is the latent then the rope key; `head_dim` is derived (see the class docstring)."""
        per_rope = 2 if dtype in FP8_DTYPES else 1  # bf16 rope elements in an FP8 row take two bytes
        numbers = all(isinstance(n, int) for n in (kv_lora_rank, rope_dim))
        head_dim = kv_lora_rank + per_rope * rope_dim if numbers else 0  # bad values: __post_init__ names them
        return cls(
            dtype,
            num_layers,
            1,
            head_dim,
            page_size,
            True,
            kv_lora_rank=kv_lora_rank,
            rope_dim=rope_dim,
            **quantization,
        )

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
        window = self.sliding_window
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window <= 0):
            raise ValueError(f"sliding_window: expected a positive int or None, got {window!r}")
        self._check_mla()
        self._check_quantization()

    def _check_mla(self) -> None:
        given = {k: getattr(self, k) for k in ("kv_lora_rank", "rope_dim")}
        if not self.is_mla:
            extra = [k for k, v in given.items() if v is not None]
            if extra:
                raise ValueError(f"{extra[0]}: only an MLA cache (is_mla=True) has a latent/rope split")
            return
        rope_dim = 0 if self.rope_dim is None else self.rope_dim
        if not isinstance(rope_dim, int) or isinstance(rope_dim, bool) or rope_dim < 0:
            raise ValueError(f"rope_dim: expected an int >= 0, got {rope_dim!r}")
        rope_width = rope_dim * self.rope_elements_per_dtype_element
        rank = self.head_dim - rope_width if self.kv_lora_rank is None else self.kv_lora_rank
        if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
            raise ValueError(f"kv_lora_rank: expected a positive int, got {rank!r}")
        if self.head_dim != rank + rope_width:
            layout = (
                "kv_lora_rank + 2 * rope_dim (FP8 latent, bf16 rope)" if self.quantized else "kv_lora_rank + rope_dim"
            )
            raise ValueError(f"head_dim: an MLA row is {layout} = {rank + rope_width} elements, got {self.head_dim}")
        if self.quantized and rope_dim and rank % 2:
            raise ValueError(f"kv_lora_rank: an FP8 row's bf16 rope must start 2-byte aligned; got odd {rank}")
        object.__setattr__(self, "kv_lora_rank", rank)  # normalised: equal params compare equal
        object.__setattr__(self, "rope_dim", rope_dim)

    def _check_quantization(self) -> None:
        quantized = self.dtype in FP8_DTYPES
        given = {k: getattr(self, k) for k in ("quantization_granularity", "scale_dtype", "static_scales")}
        if not quantized:
            extra = [k for k, v in given.items() if v is not None]
            if extra:
                raise ValueError(f"{extra[0]}: only an FP8 cache is quantized, but dtype is {self.dtype}")
            return
        if self.static_scales is not None:
            scales = self.static_scales
            if self.quantization_granularity is not None or self.scale_dtype is not None:
                raise ValueError(
                    "static_scales: a per-tensor FP8 cache has no scales tensor; leave "
                    "quantization_granularity and scale_dtype unset"
                )
            if not isinstance(scales, (tuple, list)) or len(scales) != self.num_planes:
                raise ValueError(
                    f"static_scales: expected {self.num_planes} floats (one per plane: K, V), got {scales!r}"
                )
            numbers = all(isinstance(s, (int, float)) and not isinstance(s, bool) for s in scales)
            if not numbers or not all(math.isfinite(s) and s > 0 for s in scales):
                raise ValueError(f"static_scales: expected finite positive floats, got {scales!r}")
            object.__setattr__(self, "static_scales", tuple(float(s) for s in scales))
            return
        width = self.quantized_width
        granularity = width if self.quantization_granularity is None else self.quantization_granularity
        if not isinstance(granularity, int) or isinstance(granularity, bool) or granularity <= 0:
            raise ValueError(f"quantization_granularity: expected a positive int, got {granularity!r}")
        if width % granularity:
            what = f"kv_lora_rank={width}" if self.is_mla else f"head_dim={width}"
            raise ValueError(f"quantization_granularity: expected a divisor of {what}, got {granularity}")
        scale_dtype = torch.float32 if self.scale_dtype is None else self.scale_dtype
        if scale_dtype not in SCALE_DTYPES.values():
            raise ValueError(f"scale_dtype: expected one of {list(SCALE_DTYPES)}, got {scale_dtype}")
        object.__setattr__(self, "quantization_granularity", granularity)  # normalised: equal params compare equal
        object.__setattr__(self, "scale_dtype", scale_dtype)

    @property
    def num_planes(self) -> int:
        """2 (K and V) for MHA caches, 1 for MLA latent caches."""
        return 1 if self.is_mla else 2

    @property
    def rope_elements_per_dtype_element(self) -> int:
        """`dtype` elements one rope element takes in an MLA row: 2 for an FP8 cache (bf16 rope), else 1."""
        return 2 if self.quantized else 1  # FP8 elements are bytes; ROPE_DTYPE (bf16) takes two

    @property
    def rope_dtype(self) -> torch.dtype | None:
        """The dtype of an MLA row's rope part: bf16 in an FP8 cache (rope-aware), else `dtype`."""
        if not self.is_mla:
            return None
        return ROPE_DTYPE if self.quantized else self.dtype

    @property
    def quantized_width(self) -> int:
        """Elements of a head's row that an FP8 cache quantizes: head_dim, or an MLA cache's latent."""
        return self.head_dim if self.kv_lora_rank is None else self.kv_lora_rank  # set exactly for MLA

    @property
    def quantized(self) -> bool:
        """Whether the cache stores FP8 values (with a `scales` tensor or static scales)."""
        return self.dtype in FP8_DTYPES

    @property
    def has_scales_tensor(self) -> bool:
        """Whether collections allocate a `scales` tensor (per-granule FP8)."""
        return self.quantized and self.static_scales is None

    @property
    def scales_per_head(self) -> int:
        """Scales per token and head: `head_dim / quantization_granularity` (MLA: `kv_lora_rank / ...`;
        0 without a scales tensor)."""
        granularity = self.quantization_granularity  # set exactly with a scales tensor
        return 0 if granularity is None else self.quantized_width // granularity

    def first_held_page(self, length: int) -> int:
        """The first page a sequence of `length` tokens still needs: the one holding position
        `length - sliding_window + 1`, the oldest key the next query (at position `length`) sees;
        0 without a window. Pages before it hold no key any later query reads."""
        if self.sliding_window is None:
            return 0
        return max(0, length - self.sliding_window + 1) // self.page_size

    @property
    def page_bytes(self) -> int:
        """Bytes one page holds in `blocks` and (per-granule FP8) `scales`, every layer, K and V."""
        return self.page_size * (self.bytes_per_token + self.scale_bytes_per_token)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of `blocks` one token occupies across all layers, K and V."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.num_planes * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    @property
    def scale_bytes_per_token(self) -> int:
        """Bytes of `scales` one token occupies across all layers, K and V (0 without a scales tensor)."""
        if not self.has_scales_tensor:
            return 0
        itemsize = torch.empty((), dtype=self.scale_dtype).element_size()
        return self.num_planes * self.num_layers * self.num_kv_heads * self.scales_per_head * itemsize

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe description (dtypes by name; the quantization fields only for FP8 caches, the
        MLA fields only for MLA caches, `sliding_window` only when set)."""
        out = dataclasses.asdict(self)
        out["dtype"] = _dtype_name(self.dtype)
        for name in _OPTIONAL_FIELDS:
            if out[name] is None:
                del out[name]  # unquantized (MHA) params without a window keep the format they always had
        if self.scale_dtype is not None:
            out["scale_dtype"] = _dtype_name(self.scale_dtype)
        if self.static_scales is not None:
            out["static_scales"] = list(self.static_scales)
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
        if "scale_dtype" in values:
            if values["scale_dtype"] not in SCALE_DTYPES:
                raise ValueError(f"scale_dtype: expected one of {list(SCALE_DTYPES)}, got {values['scale_dtype']!r}")
            values["scale_dtype"] = SCALE_DTYPES[values["scale_dtype"]]
        return cls(**values)


def _check_int(name: str, value: Any, low: int, high: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value >= high):
        bounds = f"an int in {low}..{high - 1}" if high is not None else f"an int >= {low}"
        raise ValueError(f"{name}: expected {bounds}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class TPShard:
    """Which of the model's KV heads a tensor-parallel rank's cache holds, next to its `KVCacheParams`.

    The cache's `num_kv_heads` heads are the global heads `kv_head_start ..` of `total_kv_heads`,
    held by rank `tp_rank` of a group of `tp_size` (`torch_paged_kv.distributed.tensor_parallel`
    computes them). None where a shard is optional means the cache holds every head. Immutable,
    hashable, comparable.
    """

    tp_size: int
    tp_rank: int
    kv_head_start: int
    total_kv_heads: int

    FIELDS: ClassVar[tuple[str, ...]] = ("tp_size", "tp_rank", "kv_head_start", "total_kv_heads")
    """The dict keys of a shard, the same as in checkpoints and transfers written before it was separate."""

    def __post_init__(self) -> None:
        _check_int("tp_size", self.tp_size, 1)
        _check_int("total_kv_heads", self.total_kv_heads, 1)
        _check_int("tp_rank", self.tp_rank, 0, self.tp_size)
        _check_int("kv_head_start", self.kv_head_start, 0, self.total_kv_heads)

    def kv_head_range(self, num_kv_heads: int) -> range:
        """The global KV heads a cache of `num_kv_heads` heads holds, in order."""
        return range(self.kv_head_start, self.kv_head_start + num_kv_heads)

    def check(self, params: KVCacheParams) -> None:
        """ValueError naming `num_kv_heads` unless the heads of a cache of `params` fit `total_kv_heads`."""
        if self.kv_head_start + params.num_kv_heads > self.total_kv_heads:
            raise ValueError(
                f"num_kv_heads: heads {self.kv_head_start}..{self.kv_head_start + params.num_kv_heads - 1} "
                f"do not fit total_kv_heads={self.total_kv_heads}"
            )


def describe_heads(params: KVCacheParams, shard: TPShard | None) -> str:
    """Which KV heads a cache of `params` holding `shard` has, in words."""
    if shard is None:
        return f"every KV head ({params.num_kv_heads})"
    heads = shard.kv_head_range(params.num_kv_heads)
    return (
        f"KV heads {heads.start}..{heads.stop - 1} of {shard.total_kv_heads} "
        f"(tensor-parallel rank {shard.tp_rank} of {shard.tp_size})"
    )


def normalized_shard(params: KVCacheParams, shard: TPShard | None) -> TPShard | None:
    """`shard` after checking it fits `params`, or None where it describes an unsharded cache (rank 0
    of 1 holding every head): the form managers keep and compare."""
    if shard is None:
        return None
    if not isinstance(shard, TPShard):
        raise ValueError(f"tp_shard: expected a TPShard or None, got {type(shard).__name__}")
    shard.check(params)
    return None if shard == TPShard(1, 0, 0, params.num_kv_heads) else shard


def params_to_dict(params: KVCacheParams, shard: TPShard | None = None) -> dict[str, Any]:
    """`params.to_dict()` plus the shard's fields that differ from an unsharded cache's (tp_size 1,
    tp_rank 0, kv_head_start 0, total_kv_heads = num_kv_heads): the dict checkpoints and transfers
    carry (an unsharded cache's is `params.to_dict()`)."""
    out = params.to_dict()
    if normalized_shard(params, shard) is not None:
        defaults = (1, 0, 0, params.num_kv_heads)
        for name, default in zip(TPShard.FIELDS, defaults, strict=True):
            if getattr(shard, name) != default:
                out[name] = getattr(shard, name)
    return out


def params_from_dict(data: dict[str, Any]) -> tuple[KVCacheParams, TPShard | None]:
    """Inverse of `params_to_dict` (ValueError for anything `KVCacheParams.from_dict` or `TPShard`
    refuses, and for heads that do not fit); the shard is `normalized_shard`'s (None: unsharded)."""
    values = dict(data)
    given = {name: values.pop(name) for name in TPShard.FIELDS if name in values}
    params = KVCacheParams.from_dict(values)
    if not given:
        return params, None
    defaults = dict(zip(TPShard.FIELDS, (1, 0, 0, params.num_kv_heads), strict=True))
    return params, normalized_shard(params, TPShard(**{**defaults, **given}))
