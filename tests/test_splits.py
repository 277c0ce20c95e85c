"""The decode split rule every GPU backend shares (ops/splits.py), planned on "meta" (an H100's
132 SMs) as the ahead-of-time compiles do."""

from __future__ import annotations

import pytest
import torch

from torch_paged_kv.ops import splits
from torch_paged_kv.ops.records import FlashAttentionArgs

META = torch.device("meta")


@pytest.mark.parametrize(
    "programs, keys, tile, per_sm, expected",
    [
        (8, 32768, 64, 4, 64),  # batch 1 x 8 kv heads, 32k keys: the device wants 66, capped at 64
        (512, 32768, 64, 4, 2),  # batch 64 x 8: ceil(528 / 512)
        (512, 32768, 64, 2, 1),  # half the programs per SM: one pass already fills the device
        (8, 1000, 64, 4, 4),  # short contexts: at least 256 keys a split
        (8, 1000, 512, 4, 2),  # ... or a whole key tile when the tile is larger
        (10**6, 10**6, 64, 4, 1),
        (0, 0, 64, 4, 1),
    ],
)
def test_split_counts(programs, keys, tile, per_sm, expected):
    assert splits.num_splits(programs, keys, tile, META, per_sm) == expected


def test_triton_plans_its_decode_grid_by_the_shared_rule(monkeypatch):
    """The split count reaches the planned launch (grid z) and follows the rule's inputs: a device
    with fewer SMs, or a shorter table, gets fewer splits."""
    pytest.importorskip("triton")
    from torch_paged_kv.ops.triton import flash_attention as triton_attention

    def planned_splits(table_width: int) -> int:
        q = torch.empty(1, 32, 128, dtype=torch.bfloat16, device=META)
        blocks = torch.empty(table_width + 1, 2, 1, 16, 8, 128, dtype=torch.bfloat16, device=META)
        lengths, offsets = (torch.empty(n, dtype=torch.int32, device=META) for n in (1, 2))
        table = torch.empty(1, table_width, dtype=torch.int32, device=META)
        _, launches = triton_attention.plan_flash_attention(
            FlashAttentionArgs(q, blocks, lengths, table, offsets, 0, 0.1)
        )
        return launches[0].grid[2]

    assert planned_splits(2048) == 64  # 32k keys, 8 kv heads on 132 SMs: the cap
    assert planned_splits(32) == 2  # 512 keys: 256 a split
    monkeypatch.setattr(splits, "sm_count", lambda device: 4)
    assert planned_splits(2048) == 2  # 16 programs wanted over 8 kv heads
