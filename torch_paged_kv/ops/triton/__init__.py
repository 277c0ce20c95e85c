"""Triton backend: every cache op, on CUDA tensors, or on CPU tensors under `TRITON_INTERPRET=1`.

Kernel modules (and triton itself) are imported on the first call, keeping `import torch_paged_kv`
light. Interpreter or compiled mode is fixed per process (see `common`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

_OPS = ("store_kv", "flash_attention", "gather_kv", "copy_pages")


def _interpreter_mode() -> bool:
    """Whether Triton kernels in this process run in its interpreter. Triton fixes that when it is
    first imported (by `TRITON_INTERPRET` then), so once imported, ask triton itself."""
    if "triton" in sys.modules:
        return _imported_triton_interprets()
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _imported_triton_interprets() -> bool:
    """Triton's own answer; fixed for the life of the process once triton is imported (cached: asked per op)."""
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(standard.sum, InterpretedFunction)


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on `device` in this process; None if they can."""
    if not _triton_installed():
        return "triton is not installed"
    if device.type == "cuda":
        if _interpreter_mode():
            return "Triton runs in interpreter mode in this process (TRITON_INTERPRET=1 when it was imported)"
        return None
    if device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            return "CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before triton is imported"
        if not _interpreter_mode():
            return "triton was imported before TRITON_INTERPRET=1 was set; its kernels are compiled for GPUs"
        return None
    return f"no Triton kernels for device type {device.type!r}"


def _lazy(op: str, name: str) -> Callable[..., Any]:
    """`name` (the kernel entry point `op`, or `supports`) of module `op`, imported on first call."""
    found: list[Callable[..., Any]] = []

    def run(*args: Any) -> Any:
        if not found:
            found.append(getattr(importlib.import_module(f"{__name__}.{op}"), name))
        return found[0](*args)

    run.__name__ = name if name == op else f"{op}_{name}"
    return run


KERNELS = {op: (_lazy(op, op), _lazy(op, "supports")) for op in _OPS}
"""op -> (kernel, supports): what `ops/backends.py` registers as backend "triton". Each module's
`supports` refuses, from shapes alone, the calls its kernels cannot launch (CUDA's grid limits) or
compute (attention's head_dim)."""
