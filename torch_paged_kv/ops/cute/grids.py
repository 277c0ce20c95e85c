"""The kernels' launch grids and CUDA's limits on them: what the kernels launch with (`decode_sm90`,
`decode_sm100`, `combine`) and what `attention.covers` checks a call against, in one place."""

from __future__ import annotations

from typing import Any

MAX_GRID = (2**31 - 1, 65535, 65535)
"""CUDA's launch limits on grid x, y and z."""


def decode_grid(rows: Any, kv_heads: Any, splits: Any) -> tuple[Any, Any, Any]:
    """The decode kernel's grid: one CTA per (query row, KV head, split). Query rows, the one
    dimension without a small bound (a decode batch), go on x; `attention.covers` checks the rest."""
    return rows, kv_heads, splits


def combine_grid(rows: Any, q_heads: Any) -> tuple[Any, Any, Any]:
    """The split merge's grid: one CTA per (query row, query head), rows on x."""
    return rows, q_heads, 1


def grid_fits(grid: tuple[int, int, int]) -> bool:
    """Whether CUDA can launch `grid` (every dimension within `MAX_GRID`)."""
    return all(0 < n <= limit for n, limit in zip(grid, MAX_GRID, strict=True))
