"""Paged decode attention for Blackwell (sm_100a): the sm90 kernel with TMA gather4 loads.

`cp.async.bulk.tensor.2d.tile::gather4` brings four arbitrary rows of one KV head per instruction,
so a tile of `tile_n` keys costs `tile_n / 4` instructions for K and as many for V whatever the page
size: small pages stream like large ones. The producer warp computes the tile's rows with the
`get_tma_row` arithmetic (lane i: keys i, i+32, ...) into shared memory; the elected lane issues the
gather4s, which read their four row indices from there. Rows past the sequence's last page are
`num_rows`, outside the descriptor, so TMA zero-fills them. Consumers are those of sm90.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync

from .decode_sm90 import PagedDecodeSm90
from .operand import KVCacheMHAOperand


class PagedDecodeSm100(PagedDecodeSm90):
    """Decode kernel whose producer loads K/V rows with TMA gather4 (any page size)."""

    def __init__(
        self,
        dtype: type[cutlass.Numeric],
        head_dim: int,
        page_size: int,
        group: int,
        tile_n: int,
        stages: int,
        consumer_warps: int = 4,
    ) -> None:
        super().__init__(dtype, head_dim, page_size, group, tile_n, stages, consumer_warps)
        if tile_n % 32:
            raise ValueError(f"tile_n: gather4 producer needs a multiple of 32, got {tile_n}")

    @staticmethod
    def check_page_size(page_size: int, tile_n: int) -> None:
        """Rows are gathered one by one: every page size works."""

    def make_tma(self, mRows: cute.Tensor) -> tuple[cute.CopyAtom, cute.Tensor]:
        return KVCacheMHAOperand.create_gather4_tma_tile(mRows, self.head_dim)

    def allocate_producer_smem(self, smem: cutlass.memory.SmemAllocator) -> cute.Tensor:
        """Row indices of one tile, K then V: Int32 `(2, tile_n)`."""
        return smem.allocate_tensor(Int32, cute.make_layout((2, self.tile_n), stride=(self.tile_n, 1)), 16)

    @cute.jit
    def produce(
        self,
        atom: cute.CopyAtom,
        coords: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        sProducer: cute.Tensor,
        full,
        empty,
        mTable: cute.Tensor,
        seq: Int32,
        kv_head: Int32,
        my_lo: Int32,
        my_hi: Int32,
        last_page: Int32,
        num_rows: Int32,
        page_stride: Int32,
        k_offset: Int32,
        v_offset: Int32,
    ) -> None:
        """Producer warp: rows of the tile from the lookup table, then tile_n/4 gather4s each for K, V."""
        N, D, quads = self.tile_n, self.head_dim, self.tile_n // 4
        lane = cute.arch.lane_idx()
        ring = cute.make_layout((D, 4, quads * self.stages), stride=(1, D, 4 * D))
        index = cute.make_layout((D, 4, quads), stride=(0, 1, 4))
        head_coords = cute.domain_offset((kv_head * D, 0), coords)
        gather = cute.group_modes(
            cute.make_tensor(head_coords.iterator, cute.append(head_coords.layout, cute.make_layout(quads, stride=0))),
            0,
            2,
        )
        tKsK, tKgK, tKgI = cpasync.tma_partition(
            atom,
            0,
            cute.make_layout(1),
            cute.group_modes(cute.make_tensor(sK.iterator, ring), 0, 2),
            [gather, cute.group_modes(cute.make_tensor(sProducer[0, None].iterator, index), 0, 2)],
        )
        tVsV, tVgV, tVgI = cpasync.tma_partition(
            atom,
            0,
            cute.make_layout(1),
            cute.group_modes(cute.make_tensor(sV.iterator, ring), 0, 2),
            [gather, cute.group_modes(cute.make_tensor(sProducer[1, None].iterator, index), 0, 2)],
        )
        for tile in cutlass.range(my_lo, my_hi, unroll=1):
            i = tile - my_lo
            stage = i % self.stages
            cute.arch.mbarrier_wait(empty + stage, ((i // self.stages) % 2) ^ 1)
            for r in cutlass.range_constexpr(N // 32):
                key = tile * N + r * 32 + lane
                sProducer[0, r * 32 + lane] = self.page_row(
                    mTable, seq, key, last_page, num_rows, page_stride, k_offset
                )
                sProducer[1, r * 32 + lane] = self.page_row(
                    mTable, seq, key, last_page, num_rows, page_stride, v_offset
                )
            cute.arch.sync_warp()
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(full + stage, self.tile_bytes)
            # The whole warp calls the copies: `cute.copy` of a TMA atom elects its one issuing lane
            # itself, and wrapping it in `elect_one` nests two elections (divergent warp syncs).
            for j in cutlass.range_constexpr(quads):
                slot = stage * quads + j
                cute.copy(atom, [tKgK[None, j], tKgI[None, j]], tKsK[None, slot], tma_bar_ptr=full + stage)
                cute.copy(atom, [tVgV[None, j], tVgI[None, j]], tVsV[None, slot], tma_bar_ptr=full + stage)
            cute.arch.sync_warp()  # every gather4 has read its rows before the next tile rewrites them
