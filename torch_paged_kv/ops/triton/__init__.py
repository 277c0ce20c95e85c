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


def _lazy(op: str) -> Callable[..., Any]:
    """`op`'s kernel entry point, importing its module on first call."""
    kernel: list[Callable[..., Any]] = []

    def run(*args: Any) -> Any:
        if not kernel:
            kernel.append(getattr(importlib.import_module(f"{__name__}.{op}"), op))
        return kernel[0](*args)

    run.__name__ = op
    return run


def _flash_attention_supports(*args: Any) -> bool:
    """Power-of-two head_dim from 16 to 256 (tl.arange and tl.dot need it); others go to the reference."""
    head_dim = args[1].shape[5]
    return 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0


KERNELS = {op: (_lazy(op), _flash_attention_supports if op == "flash_attention" else None) for op in _OPS}
"""op -> (kernel, supports): what `ops/backends.py` registers as backend "triton"."""
