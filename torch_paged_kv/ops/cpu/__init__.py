"""CPU backend: every op as a compiled C++ kernel that reads K/V in place from the pages.

`kernels.cpp` is compiled on first use with the system C++ compiler and cached on disk (`build.py`);
each op is one ctypes call (`kernels.py`). Without a working compiler the backend is unavailable and
CPU calls fall back to `reference` (a forced `cpu` raises instead). See docs/cpu.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import build, kernels

_OPS = ("store_kv", "flash_attention", "gather_kv", "copy_pages")


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


UNQUANTIZED_ARITY = {"gather_kv": 6}
"""Arguments before the FP8 ones (`scales`, `out_dtype`) of the ops that run only on unquantized
caches here; the others take FP8 pools too."""


def _supports(op: str) -> Callable[..., bool]:
    """gather_kv covers unquantized caches in their own dtype (an FP8 gather, or one to another
    dtype, runs on the reference backend); the other ops cover every cache."""
    if op not in UNQUANTIZED_ARITY:
        return lambda *args: True
    arity = UNQUANTIZED_ARITY[op]
    return lambda *args: all(a is None for a in args[arity:])


def _declines(op: str) -> Callable[[Any], str | None]:
    """Why `op` skips an FP8 cache described by `params` (backend_info), or None."""
    if op not in UNQUANTIZED_ARITY:
        return lambda params: None
    return lambda params: "FP8 gathers, a debugging path, run on the reference backend" if params.quantized else None


KERNELS = {op: (getattr(kernels, op), _supports(op), _declines(op)) for op in _OPS}
"""op -> (kernel, supports, declines): what `ops/backends.py` registers as backend "cpu"."""
