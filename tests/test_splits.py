"""The decode split rule every GPU backend shares (ops/splits.py), planned on "meta" (an H100's
132 SMs) as the ahead-of-time compiles do."""

from __future__ import annotations

import pytest
import torch

from torch_paged_kv.ops import splits

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


def test_both_gpu_backends_use_the_shared_rule():
    pytest.importorskip("triton")
    from torch_paged_kv.ops.cute import attention as cute_attention
    from torch_paged_kv.ops.triton import flash_attention as triton_attention

    for programs, keys in ((8, 32768), (64, 4096), (2048, 300)):
        assert triton_attention.num_splits(programs, keys, 64, META) == splits.num_splits(
            programs, keys, 64, META, triton_attention.PROGRAMS_PER_SM
        )
    assert not hasattr(cute_attention, "num_splits") and cute_attention.PROGRAMS_PER_SM == 2
