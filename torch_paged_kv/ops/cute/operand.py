"""`KVCacheMHAOperand`: how every CuTe kernel sees one layer's K and V (MAX's struct of that name).

Host side it is plain torch and Python ints (no cutlass import): the row view, the lookup table and
the scalars a kernel needs, with the row arithmetic of `layout.py` (the same the collections' views
use). Device side, `create_tma_tile` and `create_gather4_tma_tile` build the TMA descriptors inside a
`@cute.jit` function from the row view passed in as a `cute.Tensor`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ... import layout


@dataclasses.dataclass(frozen=True)
class KVCacheMHAOperand:
    """One layer's K and V planes of a paged (or continuous-batching) cache, as kernels read them.

    `rows` is `blocks` as a `[num_kv_rows, num_kv_heads * head_dim]` matrix; the K row of encoded
    token `page * page_size + offset` is `get_tma_row(encoded, 0)`, its V row `get_tma_row(encoded, 1)`.
    `lookup_table` is always 2-D (a continuous-batching `[batch]` table becomes `[batch, 1]`).
    Over an MLA pool (one plane) both are the token's one latent row (`is_mla`): the MLA stride
    `num_layers * page_size` rows per page, values being the row's first `kv_lora_rank` columns.
    """

    rows: torch.Tensor
    lookup_table: torch.Tensor
    cache_lengths: torch.Tensor
    page_size: int
    num_kv_heads: int
    head_dim: int
    page_stride: int
    k_plane_offset: int
    v_plane_offset: int
    quantization_enabled: bool = False
    is_mla: bool = False

    @classmethod
    def from_blocks(
        cls, blocks: torch.Tensor, cache_lengths: torch.Tensor, lookup_table: torch.Tensor, layer_idx: int
    ) -> KVCacheMHAOperand:
        """Operand over layer `layer_idx` of a `[pages, 2|1, layers, page_size, heads, head_dim]` pool
        (K/V planes, or an MLA pool's latent plane)."""
        if blocks.dim() != 6 or blocks.shape[1] not in (1, 2):
            raise ValueError(
                f"blocks: expected a pool [pages, 2|1, layers, page, heads, dim], got {tuple(blocks.shape)}"
            )
        if not blocks.is_contiguous():
            raise ValueError("blocks: the row view needs a contiguous pool")
        _, planes, num_layers, page_size, num_kv_heads, head_dim = blocks.shape
        if not 0 <= layer_idx < num_layers:
            raise ValueError(f"layer_idx: expected 0..{num_layers - 1}, got {layer_idx}")
        return cls(
            rows=blocks.view(-1, num_kv_heads * head_dim),
            lookup_table=lookup_table if lookup_table.dim() == 2 else lookup_table.view(-1, 1),  # a slot is a page
            cache_lengths=cache_lengths,
            page_size=page_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            page_stride=layout.page_stride_rows(planes, num_layers, page_size),
            k_plane_offset=layout.plane_row_offset(layer_idx, 0, num_layers, page_size),
            v_plane_offset=layout.plane_row_offset(layer_idx, planes - 1, num_layers, page_size),
            is_mla=planes == 1,
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.rows.dtype

    def num_kv_rows(self) -> int:
        """Height of the row view: the bound of every TMA descriptor (rows past it read as zeros)."""
        return self.rows.shape[0]

    def get_tma_row(self, encoded: layout.IntLike, plane: int = 0) -> layout.IntLike:
        """Row of `encoded = page * page_size + offset` in K (plane 0) or V (plane 1)."""
        offset = self.k_plane_offset if plane == 0 else self.v_plane_offset
        return layout.tma_row(encoded, self.page_size, self.page_stride, offset)

    def populate(self, batch_idx: int, base_row: int, num_rows: int, plane: int = 0) -> torch.Tensor:
        """Rows (int64 `[num_rows]`) of tokens `base_row ..` of sequence `batch_idx`: gather4 indices."""
        tokens = torch.arange(base_row, base_row + num_rows, device=self.lookup_table.device)
        pages = self.lookup_table[batch_idx, tokens // self.page_size].to(torch.int64)
        return self.get_tma_row(pages * self.page_size + tokens % self.page_size, plane)

    # -- device side (call inside @cute.jit) -------------------------------------------------
    @staticmethod
    def create_tma_tile(rows: Any, box_rows: int, head_dim: int) -> tuple[Any, Any]:
        """Plain TMA over the row view, one `box_rows x head_dim` box per page (or per tile of a page).

        Returns `(atom, coords)` where `coords` is the TMA coordinate tensor tiled by box:
        `coords[None, None, row // box_rows, kv_head]` addresses the box starting at `row`.
        """
        import cutlass.cute as cute
        from cutlass.cute.nvgpu import cpasync

        smem_layout = cute.make_layout((box_rows, head_dim), stride=(head_dim, 1))
        atom, tma_tensor = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), rows, smem_layout, (box_rows, head_dim)
        )
        return atom, cute.local_tile(tma_tensor, (box_rows, head_dim), (None, None))

    @staticmethod
    def create_gather4_tma_tile(rows: Any, head_dim: int) -> tuple[Any, Any]:
        """TMA gather4 over the row view (2-D descriptor, box of one row per index, four per instruction).

        The descriptor sees the row view transposed, `(width, num_kv_rows)` with the head dimension
        contiguous; one instruction fills a `(head_dim, 4)` smem block from four row indices read
        from an Int32 index tensor of layout `(head_dim, 4) : (0, 1)`. Returns `(atom, coords)`;
        `coords` is the `(head_dim, 4)` coordinate tensor, offset per head with `cute.domain_offset`.
        """
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.nvgpu import cpasync

        columns = cute.make_tensor(
            rows.iterator, cute.make_layout((rows.shape[1], rows.shape[0]), stride=(1, rows.stride[0]))
        )
        index = cute.make_tensor(
            cute.recast_ptr(rows.iterator, dtype=cutlass.Int32), cute.make_layout((head_dim, 4), stride=(0, 1))
        )
        smem_layout = cute.make_layout((head_dim, 4), stride=(1, head_dim))
        atom, coords = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensor2DGather4G2SOp(), columns, smem_layout, (head_dim, 4), gmem_coord_tensor=index
        )
        return atom, coords
