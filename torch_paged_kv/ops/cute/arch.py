"""Which GPU arch a device is and whether its kernels may run: what the backend's availability
(`__init__`) and `attention.supports` both ask."""

from __future__ import annotations

import functools
import os

import torch

ARCHS = {(9, 0): "sm_90a", (10, 0): "sm_100a"}
"""Compute capability -> the arch-specific target the kernels are built for (which runs on that
exact capability only: sm_100a code does not run on a 10.3 B300)."""


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def device_arch(index: int) -> str | None:
    """ "sm_90a" (H100/H200) or "sm_100a" (B200) for CUDA device `index`, else None."""
    return ARCHS.get(torch.cuda.get_device_capability(index))


UNVERIFIED_ARCH_ENV = "TORCH_PAGED_KV_CUTE_SM100"
"""Set to 1 to run the sm_100a kernels anyway (the Blackwell session that verifies them)."""


def unverified_reason(arch: str | None) -> str | None:
    """Why the kernels for `arch` must not run yet: the sm_100a (TMA gather4) kernels are compiled
    and PTX/SASS-checked in CI but have never run on a Blackwell GPU; None for other arches."""
    if arch != "sm_100a" or os.environ.get(UNVERIFIED_ARCH_ENV) == "1":
        return None
    return (
        "the sm_100a (TMA gather4) kernels compile and pass the PTX/SASS checks but have never run on "
        f"a Blackwell GPU; Triton runs instead ({UNVERIFIED_ARCH_ENV}=1 runs them, to verify them)"
    )
