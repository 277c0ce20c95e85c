"""How many splits a decode's keys get (flash-decoding), from shapes alone: one rule for every GPU
backend (Triton's K/V and MLA attention, CuTe's decode), so none reads a length on the host and a
CUDA graph replays the same plan.

Enough programs to keep every SM busy (`programs_per_sm`: how many of a backend's programs one SM
runs at once), at least `MIN_SPLIT_KEYS` keys per split (below that the merge costs more than
the parallelism gains), at most `MAX_SPLITS` (the merge's scratch and loop).
"""

from __future__ import annotations

import functools

import torch

MAX_SPLITS = 64
MIN_SPLIT_KEYS = 256


@functools.cache
def sm_count(device: torch.device) -> int:
    """SMs of a CUDA device; on "meta" (launches planned for ahead-of-time compiles) an H100's 132;
    elsewhere (the Triton interpreter on CPU tensors) 4, so tests see a few splits."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132 if device.type == "meta" else 4


def num_splits(programs: int, key_bound: int, key_tile: int, device: torch.device, programs_per_sm: int) -> int:
    """Splits of each of `programs` (sequences x head groups) over its at most `key_bound` keys,
    walked `key_tile` keys at a time."""
    wanted = -(-programs_per_sm * sm_count(device) // max(1, programs))
    by_keys = -(-key_bound // max(MIN_SPLIT_KEYS, key_tile))
    return max(1, min(wanted, by_keys, MAX_SPLITS))
