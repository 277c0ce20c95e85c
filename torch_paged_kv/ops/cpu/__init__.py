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


UNQUANTIZED_ARITY = {"store_kv": 7, "gather_kv": 6}
"""Arguments before the FP8 ones (`scales`, and `out_dtype` for gather_kv) of the ops that run only
on unquantized caches here; flash_attention and copy_pages take FP8 pools too."""


def _supports(op: str) -> Callable[..., bool]:
    """store_kv and gather_kv cover unquantized caches (an FP8 call, or a gather to another dtype,
    runs on the reference backend); flash_attention and copy_pages cover every cache."""
    if op not in UNQUANTIZED_ARITY:
        return lambda *args: True
    arity = UNQUANTIZED_ARITY[op]
    return lambda *args: all(a is None for a in args[arity:])


def _declines(op: str) -> Callable[[Any], str | None]:
    """Why `op` skips an FP8 cache described by `params` (backend_info), or None."""
    if op not in UNQUANTIZED_ARITY:
        return lambda params: None
    reason = (
        "FP8 caches quantize on write with the reference backend's exact rule"
        if op == "store_kv"
        else "FP8 gathers, a debugging path, run on the reference backend"
    )
    return lambda params: reason if params.quantized else None


KERNELS = {op: (getattr(kernels, op), _supports(op), _declines(op)) for op in _OPS}
"""op -> (kernel, supports, declines): what `ops/backends.py` registers as backend "cpu"."""
