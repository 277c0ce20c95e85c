"""Paged decode attention for Hopper (sm_90a): TMA page boxes, warp-specialised, split-KV.

One CTA per (query row, kv_head, split), query rows on grid x (`grids.decode_grid`). The producer
warp walks the CTA's key tiles and brings each tile's K and V rows into a `stages`-deep shared-memory
ring with plain TMA from the cache's row view: one `box_rows x head_dim` box per page
(`box_rows = min(page_size, tile_n)`), signalled on a full mbarrier; tiles past the sequence's last
page use a row coordinate past the tensor so TMA zero-fills them. `consumer_warps` warps each own
`tile_n / consumer_warps` keys of a tile and all `group` query heads of the KV head (GQA packing).
A warp scores `keys_per_step` keys at once: each key's row is split over `key_lanes` lanes (as few as
keep the query and accumulator within 32 registers each), reduced with butterfly shuffles; a block of
scores is held in registers and the online softmax (fp32, base 2) is updated once per block, so the
keys' dot products and shuffles are independent and overlap instead of forming one chain per key.
The warps merge through shared memory and write a normalised partial output and its log-sum-exp;
`combine.py` merges splits.

Every query row is handled on its own (the sequence is found by binary search in
`input_row_offsets`), so ragged calls are correct; the kernel is efficient for decode.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync

from . import grids
from .operand import KVCacheMHAOperand


class PagedDecodeSm90:
    """Decode kernel specialised on dtype, head_dim, page_size, GQA group and tile config."""

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
        if head_dim % 32 or head_dim > 256:
            raise ValueError(f"head_dim: expected a multiple of 32 up to 256, got {head_dim}")
        if tile_n % consumer_warps:
            raise ValueError(f"tile_n={tile_n} must split over {consumer_warps} consumer warps")
        self.check_page_size(page_size, tile_n)
        self.dtype = dtype
        self.head_dim = head_dim
        self.page_size = page_size
        self.group = group
        self.tile_n = tile_n
        self.stages = stages
        self.consumer_warps = consumer_warps
        self.box_rows = min(page_size, tile_n)
        self.boxes = tile_n // self.box_rows
        keys_per_warp = tile_n // consumer_warps
        self.key_lanes = self.lanes_per_key(head_dim, group, keys_per_warp)
        self.keys_per_step = 32 // self.key_lanes  # keys a warp scores at once, one per lane group
        self.elems = head_dim // self.key_lanes  # head_dim elements per lane
        self.steps = keys_per_warp // self.keys_per_step  # steps per tile and warp
        self.block_steps = math.gcd(self.steps, max(1, 32 // group))  # steps per softmax update: 32 scores
        self.key_levels = self.key_lanes.bit_length() - 1  # butterfly levels of a key's dot product
        self.step_levels = self.keys_per_step.bit_length() - 1  # of the lane groups' final merge
        self.threads = 32 * (consumer_warps + 1)
        self.tile_bytes = 2 * tile_n * head_dim * dtype.width // 8  # K and V of one stage

    @staticmethod
    def lanes_per_key(head_dim: int, group: int, keys_per_warp: int) -> int:
        """Lanes that share one key's row: the fewest (a power of two up to 32) that keep the query
        and the accumulator at most 32 fp32 registers each (`group * head_dim / lanes`), a row slice
        at most 16 elements (two 16-byte loads), and no more keys per step than a warp has per tile."""
        lanes = 1
        while lanes < 32 and (group * head_dim > 32 * lanes or head_dim > 16 * lanes or keys_per_warp * lanes < 32):
            lanes *= 2
        return lanes

    @staticmethod
    def check_page_size(page_size: int, tile_n: int) -> None:
        """Page boxes must tile the key tile: one box per page, or several boxes per page."""
        if not (page_size % tile_n == 0 or tile_n % page_size == 0):
            raise ValueError(f"page_size={page_size} and tile_n={tile_n}: one must divide the other")

    # -- host ---------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mRows: cute.Tensor,
        mTable: cute.Tensor,
        mCacheLen: cute.Tensor,
        mOffsets: cute.Tensor,
        mOutPartial: cute.Tensor,
        mLse: cute.Tensor,
        page_stride: Int32,
        k_offset: Int32,
        v_offset: Int32,
        scale_log2: Float32,
        window: Int32,
        causal: Int32,
        num_splits: Int32,
        stream: cute.typing.Any = None,
    ) -> None:
        atom, coords = self.make_tma(mRows)
        num_kv_heads = mQ.shape[1] // self.group
        self.kernel(
            atom,
            coords,
            mQ,
            mTable,
            mCacheLen,
            mOffsets,
            mOutPartial,
            mLse,
            mRows.shape[0],
            page_stride,
            k_offset,
            v_offset,
            scale_log2,
            window,
            causal,
            num_splits,
        ).launch(
            grid=list(grids.decode_grid(mQ.shape[0], num_kv_heads, num_splits)),
            block=[self.threads, 1, 1],
            stream=stream,
        )

    def make_tma(self, mRows: cute.Tensor) -> tuple[cute.CopyAtom, cute.Tensor]:
        return KVCacheMHAOperand.create_tma_tile(mRows, self.box_rows, self.head_dim)

    def allocate_producer_smem(self, smem: cutlass.memory.SmemAllocator) -> cute.Tensor | None:
        """Shared memory only the producer uses (none for page boxes)."""
        return None

    # -- device -------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        atom: cute.CopyAtom,
        coords: cute.Tensor,
        mQ: cute.Tensor,
        mTable: cute.Tensor,
        mCacheLen: cute.Tensor,
        mOffsets: cute.Tensor,
        mOutPartial: cute.Tensor,
        mLse: cute.Tensor,
        num_rows: Int32,
        page_stride: Int32,
        k_offset: Int32,
        v_offset: Int32,
        scale_log2: Float32,
        window: Int32,
        causal: Int32,
        num_splits: Int32,
    ) -> None:
        N, D, G, C = self.tile_n, self.head_dim, self.group, self.consumer_warps
        tidx, _, _ = cute.arch.thread_idx()
        row, kv_head, split = cute.arch.block_idx()  # grids.decode_grid: query rows on x
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32

        smem = cutlass.memory.SmemAllocator()
        ring = cute.make_layout((N * self.stages, D), stride=(D, 1))
        sK = smem.allocate_tensor(self.dtype, ring, 128)
        sV = smem.allocate_tensor(self.dtype, ring, 128)
        full = smem.allocate_array(Int64, self.stages, byte_alignment=8)
        empty = smem.allocate_array(Int64, self.stages, byte_alignment=8)
        sAcc = smem.allocate_tensor(Float32, cute.make_layout((C, G, D), stride=(G * D, D, 1)), 16)
        sStat = smem.allocate_tensor(Float32, cute.make_layout((2, C, G), stride=(C * G, G, 1)), 16)
        sProducer = self.allocate_producer_smem(smem)

        if warp == 0:
            with cute.arch.elect_one():
                for s in cutlass.range_constexpr(self.stages):
                    cute.arch.mbarrier_init(full + s, 1)
                    cute.arch.mbarrier_init(empty + s, C)
        cute.arch.mbarrier_init_fence()
        cute.arch.barrier()

        # The query row's sequence, position and visible key range [lo, hi).
        batch = mCacheLen.shape[0]
        seq = Int32(0)
        step = Int32(1)
        while step * 2 <= batch:
            step *= 2
        while step > 0:
            if seq + step < batch:
                if mOffsets[seq + step] <= row:
                    seq += step
            step //= 2
        start = mOffsets[seq]
        kv_len = mCacheLen[seq] + mOffsets[seq + 1] - start
        q_pos = mCacheLen[seq] + row - start
        hi = kv_len
        if causal != 0:
            hi = q_pos + 1
        hi = cutlass.min(hi, mTable.shape[1] * self.page_size)  # only keys the table addresses (unchecked calls)
        lo = Int32(0)
        if window > 0:
            lo = cutlass.max(q_pos - window + 1, 0)
        t_lo = lo // N
        per_split = cute.ceil_div(cute.ceil_div(hi, N) - t_lo, num_splits)
        my_lo = t_lo + split * per_split
        my_hi = cutlass.min(my_lo + per_split, cute.ceil_div(hi, N))
        last_page = cute.ceil_div(hi, self.page_size)

        if warp == C:
            self.produce(
                atom,
                coords,
                sK,
                sV,
                sProducer,
                full,
                empty,
                mTable,
                seq,
                kv_head,
                my_lo,
                my_hi,
                last_page,
                num_rows,
                page_stride,
                k_offset,
                v_offset,
            )
        else:
            self.consume(
                sK,
                sV,
                full,
                empty,
                sAcc,
                sStat,
                mQ,
                mOutPartial,
                mLse,
                row,
                split,
                kv_head,
                warp,
                lane,
                tidx,
                lo,
                hi,
                my_lo,
                my_hi,
                scale_log2,
            )

    @cute.jit
    def page_row(
        self,
        mTable: cute.Tensor,
        seq: Int32,
        key: Int32,
        last_page: Int32,
        num_rows: Int32,
        page_stride: Int32,
        plane_offset: Int32,
    ) -> Int32:
        """Row-view row of key `key` (KVCacheMHAOperand.get_tma_row); past the sequence: `num_rows`."""
        col = key // self.page_size
        result = num_rows
        if col < last_page:
            result = mTable[seq, col] * page_stride + plane_offset + key % self.page_size
        return result

    @cute.jit
    def produce(
        self,
        atom: cute.CopyAtom,
        coords: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        sProducer: cute.Tensor | None,
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
        """Producer warp: one TMA box per page (or page slice) of every tile, K then V."""
        box, boxes = self.box_rows, self.boxes
        box_layout = cute.make_layout(
            (box, self.head_dim, boxes * self.stages), stride=(self.head_dim, 1, box * self.head_dim)
        )
        tKsK, tKgK = cpasync.tma_partition(
            atom,
            0,
            cute.make_layout(1),
            cute.group_modes(cute.make_tensor(sK.iterator, box_layout), 0, 2),
            cute.group_modes(coords, 0, 2),
        )
        tVsV, tVgV = cpasync.tma_partition(
            atom,
            0,
            cute.make_layout(1),
            cute.group_modes(cute.make_tensor(sV.iterator, box_layout), 0, 2),
            cute.group_modes(coords, 0, 2),
        )
        # The whole warp walks the tiles; only the transaction-count arrive is elected. `cute.copy` of
        # a TMA atom elects its one issuing lane itself: inside `elect_one` it would nest a second
        # election in a single active lane (undefined for `elect.sync` over the full warp). The tile's
        # rows are read from the lookup table before the wait for its stage, which hides the read.
        for tile in cutlass.range(my_lo, my_hi, unroll=1):
            i = tile - my_lo
            stage = i % self.stages
            rows = []
            for j in cutlass.range_constexpr(boxes):
                key = tile * self.tile_n + j * box
                k_row = self.page_row(mTable, seq, key, last_page, num_rows, page_stride, k_offset)
                v_row = self.page_row(mTable, seq, key, last_page, num_rows, page_stride, v_offset)
                rows.append((k_row, v_row))
            cute.arch.mbarrier_wait(empty + stage, ((i // self.stages) % 2) ^ 1)
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(full + stage, self.tile_bytes)
            for j in cutlass.range_constexpr(boxes):
                k_row, v_row = rows[j]
                slot = stage * boxes + j
                cute.copy(atom, tKgK[None, k_row // box, kv_head], tKsK[None, slot], tma_bar_ptr=full + stage)
                cute.copy(atom, tVgV[None, v_row // box, kv_head], tVsV[None, slot], tma_bar_ptr=full + stage)

    @cute.jit
    def consume(
        self,
        sK: cute.Tensor,
        sV: cute.Tensor,
        full,
        empty,
        sAcc: cute.Tensor,
        sStat: cute.Tensor,
        mQ: cute.Tensor,
        mOutPartial: cute.Tensor,
        mLse: cute.Tensor,
        row: Int32,
        split: Int32,
        kv_head: Int32,
        warp: Int32,
        lane: Int32,
        tidx: Int32,
        lo: Int32,
        hi: Int32,
        my_lo: Int32,
        my_hi: Int32,
        scale_log2: Float32,
    ) -> None:
        """Consumer warps: a warp scores `keys_per_step` keys at once (lane group `sub` takes one, its
        `key_lanes` lanes split head_dim), holds `block_steps` steps of scores, and updates the online
        softmax once per block; then the lane groups, and the warps, merge."""
        N, D, G, C, E = self.tile_n, self.head_dim, self.group, self.consumer_warps, self.elems
        L, B = self.key_lanes, self.block_steps
        per_warp = N // C
        sub = lane // L  # this lane's key of each step
        part = lane % L  # this lane's head_dim slice: elements part * E ... part * E + E - 1
        lanes_k = cute.make_tensor(sK.iterator, cute.make_layout((E, L, N * self.stages), stride=(1, E, D)))
        lanes_v = cute.make_tensor(sV.iterator, cute.make_layout((E, L, N * self.stages), stride=(1, E, D)))

        q = cute.make_rmem_tensor((G, E), Float32)
        for g in cutlass.range_constexpr(G):
            for e in cutlass.range_constexpr(E):
                q[g, e] = Float32(mQ[row, kv_head * G + g, part * E + e]) * scale_log2
        m = cute.make_rmem_tensor((G,), Float32)
        row_sum = cute.make_rmem_tensor((G,), Float32)
        acc = cute.make_rmem_tensor((G, E), Float32)
        m.fill(-Float32.inf)
        row_sum.fill(0.0)
        acc.fill(0.0)
        k = cute.make_rmem_tensor((E,), Float32)
        v = cute.make_rmem_tensor((E,), Float32)
        scores = cute.make_rmem_tensor((G, B), Float32)  # base-2 scores, then probabilities

        for tile in cutlass.range(my_lo, my_hi, unroll=1):
            i = tile - my_lo
            stage = i % self.stages
            cute.arch.mbarrier_wait(full + stage, (i // self.stages) % 2)
            first_key = tile * N + warp * per_warp + sub
            first_slot = stage * N + warp * per_warp + sub
            for block in cutlass.range_constexpr(self.steps // self.block_steps):
                # Scores of the block's keys: independent dot products and butterfly reductions.
                # A key outside [lo, hi) scores -inf whatever its slot holds.
                for b in cutlass.range_constexpr(self.block_steps):
                    local = (block * self.block_steps + b) * self.keys_per_step
                    key = first_key + local
                    k.store(lanes_k[None, part, first_slot + local].load().to(Float32))
                    for g in cutlass.range_constexpr(G):
                        s = Float32(0.0)
                        for e in cutlass.range_constexpr(E):
                            s += q[g, e] * k[e]
                        for level in cutlass.range_constexpr(self.key_levels):
                            s += cute.arch.shuffle_sync_bfly(s, offset=self.key_lanes >> (level + 1))
                        scores[g, b] = Float32(cutlass.select_((key >= lo) & (key < hi), s, -Float32.inf))
                # One online-softmax update per block.
                for g in cutlass.range_constexpr(G):
                    m_new = m[g]
                    for b in cutlass.range_constexpr(self.block_steps):
                        m_new = cute.arch.fmax(m_new, scores[g, b])
                    base = Float32(cutlass.select_(m_new == -Float32.inf, Float32(0.0), m_new))
                    corr = cute.math.exp2(m[g] - base, fastmath=True)
                    m[g] = m_new
                    total = Float32(0.0)
                    for b in cutlass.range_constexpr(self.block_steps):
                        p = cute.math.exp2(scores[g, b] - base, fastmath=True)
                        scores[g, b] = p
                        total += p
                    row_sum[g] = row_sum[g] * corr + total
                    for e in cutlass.range_constexpr(E):
                        acc[g, e] = acc[g, e] * corr
                # acc += p * v; V of a key outside [lo, hi) counts as zeros (its slot may hold anything).
                for b in cutlass.range_constexpr(self.block_steps):
                    local = (block * self.block_steps + b) * self.keys_per_step
                    key = first_key + local
                    valid = (key >= lo) & (key < hi)
                    v.store(lanes_v[None, part, first_slot + local].load().to(Float32))
                    for e in cutlass.range_constexpr(E):
                        v[e] = Float32(cutlass.select_(valid, v[e], Float32(0.0)))
                    for g in cutlass.range_constexpr(G):
                        for e in cutlass.range_constexpr(E):
                            acc[g, e] += scores[g, b] * v[e]
            cute.arch.sync_warp()
            if lane == 0:
                cute.arch.mbarrier_arrive(empty + stage)

        # Merge the lane groups of the warp (butterfly over `sub`): every lane ends with the warp's state.
        for level in cutlass.range_constexpr(self.step_levels):
            offset = self.key_lanes << level
            for g in cutlass.range_constexpr(G):
                m_other = cute.arch.shuffle_sync_bfly(m[g], offset=offset)
                sum_other = cute.arch.shuffle_sync_bfly(row_sum[g], offset=offset)
                m_new = cute.arch.fmax(m[g], m_other)
                base = Float32(cutlass.select_(m_new == -Float32.inf, Float32(0.0), m_new))
                mine = cute.math.exp2(m[g] - base, fastmath=True)
                theirs = cute.math.exp2(m_other - base, fastmath=True)
                row_sum[g] = row_sum[g] * mine + sum_other * theirs
                m[g] = m_new
                for e in cutlass.range_constexpr(E):
                    acc[g, e] = acc[g, e] * mine + cute.arch.shuffle_sync_bfly(acc[g, e], offset=offset) * theirs

        # Merge the consumer warps: lane group 0 of each writes (m, l, acc); threads then own (g, d) pairs.
        if sub == 0:
            for g in cutlass.range_constexpr(G):
                for e in cutlass.range_constexpr(E):
                    sAcc[warp, g, part * E + e] = acc[g, e]
                if lane == 0:
                    sStat[0, warp, g] = m[g]
                    sStat[1, warp, g] = row_sum[g]
        cute.arch.barrier(barrier_id=1, number_of_threads=32 * C)
        for idx in cutlass.range(tidx, G * D, 32 * C, unroll=1):
            g = idx // D
            d = idx % D
            m_all = -Float32.inf
            for w in cutlass.range_constexpr(C):
                m_all = cutlass.max(m_all, sStat[0, w, g])
            total = Float32(0.0)
            out = Float32(0.0)
            if m_all > -Float32.inf:
                for w in cutlass.range_constexpr(C):
                    scale = cute.math.exp2(sStat[0, w, g] - m_all, fastmath=True)
                    total += sStat[1, w, g] * scale
                    out += sAcc[w, g, d] * scale
                out = out / total
            mOutPartial[split, row, kv_head * G + g, d] = out
            if d == 0:
                lse = -Float32.inf
                if m_all > -Float32.inf:
                    lse = m_all + cute.math.log2(total, fastmath=True)
                mLse[split, row, kv_head * G + g] = lse
