"""CPU backend: every op (the MLA latent ops too) as a compiled C++ kernel that reads K/V in place from the pages.

The C++ sources live in `native/` (`kernels.cpp`, compiled on first use with the system C++ compiler
and cached on disk by `native/build.py`); each op is one ctypes call (`kernels.py`), its argument
struct declared in `args.py`. Without a working compiler the backend is unavailable and
CPU calls fall back to `reference` (a forced `cpu` raises instead). See docs/cpu.md.
"""

from __future__ import annotations

import torch

from ...native import build
from ..records import GatherKVArgs
from . import kernels

_OPS = ("store_kv", "flash_attention", "gather_kv", "copy_pages", "store_latent", "mla_attention")


def unavailable_reason(device: torch.device) -> str | None:
    """Why the CPU kernels cannot run on `device` in this process; None if they can. The first call
    on a CPU device loads the library (compiling it if the on-disk cache is cold), then the answer
    is kept (it is asked at every op call)."""
    if device.type != "cpu":
        return f"the cpu backend runs on CPU tensors only, not {device.type!r}"
    if kernels.loaded():
        return None
    try:
        kernels.load()
    except build.BuildError as exc:
        return str(exc)
    return None


def _gather_in_its_dtype(a: GatherKVArgs) -> bool:
    """gather_kv covers gathers in the pool's own dtype (fp32 for an FP8 pool); one converting to
    another dtype runs on the reference backend."""
    return a.out_dtype is None or a.out_dtype == (torch.float32 if a.scales is not None else a.blocks.dtype)


VALUE_CHECK = kernels.step_ok
"""The step's value checks in one C++ pass (`dispatch.ValueCheck`): what `ops/backends.py` registers
for CPU tensors."""

KERNELS = {op: (getattr(kernels, op), _gather_in_its_dtype if op == "gather_kv" else None) for op in _OPS}
"""op -> (kernel, supports): what `ops/backends.py` registers as backend "cpu"."""
