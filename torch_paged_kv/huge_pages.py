"""CPU pools on transparent huge pages (Linux).

A decode step reads pages scattered over the whole pool; with 4 KiB OS pages nearly every KV page
needs its own TLB entries and page walks (a 64 MiB pool is 16k of them, the L2 TLB holds ~2k).
Where the kernel hands out 2 MiB pages on request (`/sys/kernel/mm/transparent_hugepage/enabled`
is `madvise` or `always`), `zeros` asks for them before the pool is first touched: decode over a
cold bf16/fp32 pool took 4-9% less time in A/B runs on a 2-vCPU EPYC (docs/cpu.md). Elsewhere
(another OS, THP off, a GPU, a small pool) it is `torch.zeros`.
"""

from __future__ import annotations

import ctypes
import sys

import torch

HUGE_PAGE = 2 << 20
MIN_BYTES = 2 * HUGE_PAGE
"""Smaller pools cannot hold a whole aligned huge page to advise (or gain nothing from one)."""
_MADV_HUGEPAGE = 14


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _libc() if sys.platform.startswith("linux") else None


def advise(tensor: torch.Tensor) -> bool:
    """Ask Linux to back the 2 MiB-aligned interior of a CPU tensor's memory with huge pages (best
    before the memory is first touched); True if the kernel took the advice."""
    nbytes = tensor.numel() * tensor.element_size()
    if _LIBC is None or tensor.device.type != "cpu" or nbytes < MIN_BYTES:
        return False
    start = -(-tensor.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (tensor.data_ptr() + nbytes) // HUGE_PAGE * HUGE_PAGE
    if end <= start:
        return False
    return _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE) == 0


def zeros(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.zeros(shape)`, on huge pages where a CPU pool can have them."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    out = torch.empty(shape, dtype=dtype, device=device)
    advise(out)
    return out.zero_()
