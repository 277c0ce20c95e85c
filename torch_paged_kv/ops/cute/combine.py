"""Split-KV merge: out = sum_s 2^(lse_s - M) * out_s / sum_s 2^(lse_s - M), written in the output dtype.

One CTA of `head_dim` threads per (query row, query head), rows on grid x (`grids.combine_grid`);
`lse` is base 2, `-inf` for empty splits (a row whose splits are all empty gets zeros, as the
reference gives a query that sees no key).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from . import grids


class SplitCombine:
    """Merges `[splits, rows, heads, head_dim]` fp32 partials into `[rows, heads, head_dim]`."""

    def __init__(self, dtype: type[cutlass.Numeric], head_dim: int) -> None:
        self.dtype = dtype
        self.head_dim = head_dim

    @cute.jit
    def __call__(
        self,
        mOutPartial: cute.Tensor,
        mLse: cute.Tensor,
        mOut: cute.Tensor,
        num_splits: Int32,
        stream: cute.typing.Any = None,
    ) -> None:
        self.kernel(mOutPartial, mLse, mOut, num_splits).launch(
            grid=list(grids.combine_grid(mOut.shape[0], mOut.shape[1])), block=[self.head_dim, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, mOutPartial: cute.Tensor, mLse: cute.Tensor, mOut: cute.Tensor, num_splits: Int32) -> None:
        d, _, _ = cute.arch.thread_idx()
        row, head, _ = cute.arch.block_idx()  # grids.combine_grid: query rows on x
        m_all = -Float32.inf
        for s in cutlass.range(num_splits, unroll=1):
            m_all = cutlass.max(m_all, mLse[s, row, head])
        out = Float32(0.0)
        if m_all > -Float32.inf:
            total = Float32(0.0)
            for s in cutlass.range(num_splits, unroll=1):
                weight = cute.math.exp2(mLse[s, row, head] - m_all, fastmath=True)
                total += weight
                out += weight * mOutPartial[s, row, head, d]
            out = out / total
        mOut[row, head, d] = out.to(self.dtype)
