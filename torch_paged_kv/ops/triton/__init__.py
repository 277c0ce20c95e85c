"""Triton backend: every cache op, on CUDA tensors, or on CPU tensors under `TRITON_INTERPRET=1`.

Kernel modules are imported on the first call, so a test may set `TRITON_INTERPRET=1` after
`torch_paged_kv` is imported but before any Triton kernel runs.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any, Callable

import torch

from .. import dispatch

_COMMON = __name__ + ".common"
_OPS = ("store_kv", "flash_attention", "gather_kv", "copy_pages")


def unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on `device` now; None if they can."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    interpret_env = os.environ.get("TRITON_INTERPRET") == "1"
    built_interpreted = sys.modules[_COMMON].INTERPRET if _COMMON in sys.modules else interpret_env
    if device.type == "cuda":
        if built_interpreted:
            return "the Triton kernels were built for the interpreter (TRITON_INTERPRET=1), not for CUDA"
        return None
    if device.type == "cpu":
        if not interpret_env:
            return "CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1"
        if not built_interpreted:
            return "the Triton kernels were built for CUDA before TRITON_INTERPRET=1 was set"
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


def register() -> None:
    """Declare backend "triton" and its four kernels with the dispatcher."""
    dispatch.register_backend("triton", unavailable_reason)
    for op in _OPS:
        supports = _flash_attention_supports if op == "flash_attention" else None
        dispatch.register_kernel("triton", op, _lazy(op), supports)
