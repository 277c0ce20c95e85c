"""Per-layer views of a paged cache: MAX's `KVCacheT` surface (`PagedKVCache`,
`ContinuousBatchingKVCache`) over a pool and a step's tensors.

A view holds no memory of its own: it addresses one layer's K or V plane (an MLA cache's latent rows)
of `blocks` through the lookup table, with the row arithmetic the kernels use (`layout.tma_row`).
Collections hand them out (`get_key_cache`, `get_value_cache`, `get_latent_cache`); no package code
relies on them.
"""

from __future__ import annotations

import torch

from . import layout
from .ops.quant import FP8_DTYPES


class PagedKVCache:
    """One layer's K (plane 0) or V (plane 1) of a paged cache, with MAX's `KVCacheT` surface.

    Built from the step tensors, so it can wrap a collection's buffers or any slice of them.
    Host-side helpers (`cache_length`, `load`, `store`, ...) read tensors and may synchronise;
    kernels use the same arithmetic (`layout.tma_row`) on device.

    An FP8 cache also takes its `scales` (the collection's: per granule, or the static `[planes]`
    pair): `load` then dequantizes, `load_quantized` / `store` move raw FP8 elements, and
    `load_scale` / `store_scale` the scales, whose row view has the same rows as `blocks`' row view
    (`scale_row_view`, `scale_col_idx`).

    An MLA view (`blocks` with one plane) with `rope_dim > 0` splits each row into `kv_lora_rank`
    latent elements and `rope_dim` rope elements (bf16 after FP8 latent bytes in an FP8 cache):
    `latent_row_view` / `rope_row_view` are the two column ranges of `row_view` (same rows: MAX's
    content and rope TMA tiles), `load_latent` / `load_rope` / `store_rope` read and write them, and
    `load` reads the logical row (latent, dequantized, then rope).
    """

    def __init__(
        self,
        blocks: torch.Tensor,
        cache_lengths: torch.Tensor,
        lookup_table: torch.Tensor,
        layer_idx: int,
        plane: int = 0,
        input_row_offsets: torch.Tensor | None = None,
        scales: torch.Tensor | None = None,
        rope_dim: int = 0,
    ) -> None:
        if blocks.dim() != 6:
            raise ValueError(f"blocks: expected 6 dims, got shape {tuple(blocks.shape)}")
        num_planes, num_layers = blocks.shape[1], blocks.shape[2]
        if not 0 <= layer_idx < num_layers:
            raise ValueError(f"layer_idx: expected 0..{num_layers - 1}, got {layer_idx}")
        if not 0 <= plane < num_planes:
            raise ValueError(f"plane: expected 0..{num_planes - 1}, got {plane}")
        self.blocks = blocks
        self.cache_lengths = cache_lengths
        self.lookup_table = lookup_table
        self.input_row_offsets = input_row_offsets
        self.layer_idx = layer_idx
        self.plane = plane
        self.page_size = blocks.shape[3]
        self.num_kv_heads = blocks.shape[4]
        self.head_dim = blocks.shape[5]
        self.page_stride = layout.page_stride_rows(num_planes, num_layers, self.page_size)
        self.plane_offset = layout.plane_row_offset(layer_idx, plane, num_layers, self.page_size)
        self.scales = scales
        self.quantization_enabled = blocks.dtype in FP8_DTYPES
        if self.quantization_enabled and (scales is None or scales.dim() not in (1, 6)):
            raise ValueError("scales: an FP8 cache needs its scales (per granule, 6 dims, or the static [planes] pair)")
        self.is_mla = num_planes == 1
        self.rope_dim = rope_dim
        rope_width = rope_dim * (2 if self.quantization_enabled else 1)  # bf16 rope after FP8 latent bytes
        if rope_dim < 0 or (rope_dim and not self.is_mla) or rope_width >= self.head_dim:
            raise ValueError(f"rope_dim: expected 0 (or 0 < rope width < head_dim for an MLA pool), got {rope_dim}")
        self.kv_lora_rank = self.head_dim - rope_width if self.is_mla else None

    # -- lengths ---------------------------------------------------------------------------
    def cache_length(self, batch_idx: int) -> int:
        """Tokens already cached for sequence `batch_idx` before this step."""
        return int(self.cache_lengths[batch_idx])

    def cache_lengths_nd(self) -> torch.Tensor:
        """The `[batch]` int32 tensor of cached lengths."""
        return self.cache_lengths

    def empty_cache(self) -> bool:
        """True when no sequence has cached tokens (a pure prefill step)."""
        return not bool(self.cache_lengths.any())

    def _new_tokens(self) -> torch.Tensor:
        if self.input_row_offsets is None:
            return torch.zeros_like(self.cache_lengths)
        return self.input_row_offsets[1:] - self.input_row_offsets[:-1]

    def max_prompt_length(self) -> int:
        """Most new tokens any sequence brings this step (0 without `input_row_offsets`)."""
        return int(self._new_tokens().max()) if self.cache_lengths.numel() else 0

    def max_context_length(self) -> int:
        """Longest `cache_length + new tokens` over the batch."""
        if not self.cache_lengths.numel():
            return 0
        return int((self.cache_lengths + self._new_tokens()).max())

    # -- row view --------------------------------------------------------------------------
    def row_view(self) -> torch.Tensor:
        """`blocks` as a 2-D matrix of rows of width `num_kv_heads * head_dim` (no copy)."""
        return self.blocks.view(-1, self.num_kv_heads * self.head_dim)

    def num_kv_rows(self) -> int:
        """Height of the row view (what a TMA descriptor bounds)."""
        return self.row_view().shape[0]

    def get_tma_row(self, encoded: layout.IntLike) -> layout.IntLike:
        """Row-view row of `encoded = page * page_size + offset` for this layer and plane."""
        return layout.tma_row(encoded, self.page_size, self.page_stride, self.plane_offset)

    def _page(self, batch_idx: int | torch.Tensor, tok: int | torch.Tensor) -> torch.Tensor:
        return self.lookup_table[batch_idx, tok // self.page_size]

    def _encode(self, batch_idx: int | torch.Tensor, tok: int | torch.Tensor) -> torch.Tensor:
        return self._page(batch_idx, tok).to(torch.int64) * self.page_size + tok % self.page_size

    def row_idx(self, batch_idx: int, tok: int) -> int:
        """Row-view row of token `tok` of sequence `batch_idx`."""
        return int(self.get_tma_row(self._encode(batch_idx, tok)))

    def col_idx(self, head_idx: int) -> int:
        """First column of KV head `head_idx` in the row view."""
        return head_idx * self.head_dim

    def populate(self, batch_idx: int, base_row: int, num_rows: int) -> torch.Tensor:
        """Row-view rows (int64 `[num_rows]`) of tokens `base_row .. base_row+num_rows-1`."""
        toks = torch.arange(base_row, base_row + num_rows, device=self.lookup_table.device)
        return self.get_tma_row(self._encode(batch_idx, toks))

    # -- quantization (MAX's quantized KVCacheT surface) -------------------------------------
    @property
    def per_granule(self) -> bool:
        """Whether scales are per token, head and granule (else: one static scale per plane)."""
        return self.quantization_enabled and self._fp8_scales.dim() == 6

    @property
    def _fp8_scales(self) -> torch.Tensor:
        """`scales` of an FP8 view (its constructor requires them)."""
        scales = self.scales
        assert scales is not None
        return scales

    @property
    def quantization_granularity(self) -> int | None:
        """Elements of head_dim (MLA: of the latent) sharing one scale (None: unquantized or a static
        per-tensor scale)."""
        return self._granule_width() if self.per_granule else None

    def _granule_width(self) -> int:
        """Elements of head_dim (MLA: of the latent) sharing one scale of a per-granule cache."""
        width = self.head_dim if self.kv_lora_rank is None else self.kv_lora_rank
        return width // self._fp8_scales.shape[-1]

    @property
    def scale_dtype(self) -> torch.dtype | None:
        return self._fp8_scales.dtype if self.quantization_enabled else None

    def scale_row_view(self) -> torch.Tensor:
        """Per-granule `scales` as rows of width `num_kv_heads * groups`: row r holds the scales of row r
        of `row_view()` (same `get_tma_row` / `row_idx` arithmetic)."""
        if not self.per_granule:
            raise ValueError("scale_row_view: only a per-granule FP8 cache has a scales row view")
        return self._fp8_scales.view(-1, self.num_kv_heads * self._fp8_scales.shape[-1])

    def scale_col_idx(self, head_idx: int, group: int = 0) -> int:
        """Column of (KV head `head_idx`, granule `group`) in `scale_row_view()`."""
        return head_idx * self._fp8_scales.shape[-1] + group

    def load_scale(self, batch_idx: int, head_idx: int, tok: int, group: int = 0) -> torch.Tensor:
        """The fp32 scale of granule `group` of one cached token's head vector (the plane's static
        scale for a per-tensor cache)."""
        self._require_quantized("load_scale")
        if not self.per_granule:
            return self._fp8_scales[self.plane]
        return self.scale_row_view()[self.row_idx(batch_idx, tok), self.scale_col_idx(head_idx, group)]

    def store_scale(self, batch_idx: int, head_idx: int, tok: int, group: int, scale: float | torch.Tensor) -> None:
        """Write the scale of granule `group` of one cached token's head vector."""
        self._require_quantized("store_scale")
        if not self.per_granule:
            raise ValueError("store_scale: a per-tensor FP8 cache has fixed static scales")
        self.scale_row_view()[self.row_idx(batch_idx, tok), self.scale_col_idx(head_idx, group)] = scale

    def load_quantized(
        self, batch_idx: int, head_idx: int, tok: int, dim: int = 0, width: int | None = None
    ) -> torch.Tensor:
        """`width` raw FP8 elements (default: to the end of the head) of one cached token's head vector."""
        self._require_quantized("load_quantized")
        return self._raw(batch_idx, head_idx, tok, dim, width)

    def _require_quantized(self, name: str) -> None:
        if not self.quantization_enabled:
            raise ValueError(f"{name}: this cache is not quantized (dtype {self.blocks.dtype})")

    # -- element access (host-side) --------------------------------------------------------
    def _raw(self, batch_idx: int, head_idx: int, tok: int, dim: int, width: int | None) -> torch.Tensor:
        width = self.head_dim - dim if width is None else width
        col = self.col_idx(head_idx) + dim
        return self.row_view()[self.row_idx(batch_idx, tok), col : col + width]

    def load(self, batch_idx: int, head_idx: int, tok: int, dim: int = 0, width: int | None = None) -> torch.Tensor:
        """`width` elements (default: to the end of the head) of one cached token's head vector;
        dequantized to fp32 for an FP8 cache. An FP8 MLA row with rope reads as its logical row:
        `kv_lora_rank` dequantized latent elements, then `rope_dim` rope elements (as fp32)."""
        if self.is_mla and self.quantization_enabled and self.rope_dim:
            row = torch.cat((self.load_latent(batch_idx, tok), self.load_rope(batch_idx, tok).float()))
            return row[dim : None if width is None else dim + width]
        raw = self._raw(batch_idx, head_idx, tok, dim, width)
        if not self.quantization_enabled:
            return raw
        if not self.per_granule:
            return raw.float() * self._fp8_scales[self.plane]
        groups = torch.arange(dim, dim + raw.numel(), device=raw.device) // self._granule_width()
        row = self.scale_row_view()[self.row_idx(batch_idx, tok)]
        return raw.float() * row[self.scale_col_idx(head_idx) + groups]

    def store(self, batch_idx: int, head_idx: int, tok: int, dim: int, values: torch.Tensor) -> None:
        """Write `values` into one cached token's head vector starting at `dim`, as raw elements of
        the cache's dtype (for an FP8 cache: quantized values; write their scales with `store_scale`)."""
        col = self.col_idx(head_idx) + dim
        self.row_view()[self.row_idx(batch_idx, tok), col : col + values.numel()] = values.reshape(-1)

    # -- MLA rows: latent, then rope (MAX's content and rope tiles) -------------------------------
    def _require_mla(self, name: str) -> int:
        if self.kv_lora_rank is None:
            raise ValueError(f"{name}: only an MLA cache (one plane) has latent and rope columns")
        return self.kv_lora_rank

    def latent_row_view(self) -> torch.Tensor:
        """The latent columns of `row_view()`: `[num_kv_rows, kv_lora_rank]` in `blocks`' dtype (raw
        FP8 for an FP8 cache; its scales are `scale_row_view()`)."""
        return self.row_view()[:, : self._require_mla("latent_row_view")]

    def rope_row_view(self) -> torch.Tensor:
        """The rope columns of `row_view()` as `[num_kv_rows, rope_dim]` rope elements: bf16 viewed
        from the bytes after the FP8 latent in an FP8 cache (what MAX's rope TMA tile reads), else the
        trailing columns. Same rows as `row_view()` (`row_idx`, `get_tma_row`)."""
        rank = self._require_mla("rope_row_view")
        rows = self.row_view()
        if not self.quantization_enabled:
            return rows[:, rank:]
        return rows.view(torch.uint8)[:, rank:].view(torch.bfloat16)

    def load_latent(self, batch_idx: int, tok: int) -> torch.Tensor:
        """One cached token's latent `[kv_lora_rank]` (fp32, dequantized, for an FP8 cache)."""
        rank = self._require_mla("load_latent")
        raw = self.latent_row_view()[self.row_idx(batch_idx, tok)]
        if not self.quantization_enabled:
            return raw
        if not self.per_granule:
            return raw.float() * self._fp8_scales[0]
        groups = torch.arange(rank, device=raw.device) // self._granule_width()
        return raw.float() * self.scale_row_view()[self.row_idx(batch_idx, tok)][groups]

    def load_rope(self, batch_idx: int, tok: int) -> torch.Tensor:
        """One cached token's rope key `[rope_dim]`, in the rope dtype (bf16 in an FP8 cache)."""
        return self.rope_row_view()[self.row_idx(batch_idx, tok)]

    def store_rope(self, batch_idx: int, tok: int, values: torch.Tensor) -> None:
        """Write one cached token's rope key (cast to the rope dtype)."""
        view = self.rope_row_view()
        view[self.row_idx(batch_idx, tok)] = values.reshape(-1).to(view.dtype)


class ContinuousBatchingKVCache(PagedKVCache):
    """`PagedKVCache` over the slot layout: a 1-D `lookup_table` maps each row to its slot."""

    def _page(self, batch_idx: int | torch.Tensor, tok: int | torch.Tensor) -> torch.Tensor:
        return self.lookup_table[batch_idx]
