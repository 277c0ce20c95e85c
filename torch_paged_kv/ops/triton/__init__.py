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

from ..records import MLAAttentionArgs, StoreLatentArgs

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


def _lazy(module: str, name: str) -> Callable[[tuple], Any]:
    """`name` (a kernel entry point, or `supports`, taking the op's record) of submodule `module`,
    imported on first call."""
    found: list[Callable[[tuple], Any]] = []

    def run(a: tuple) -> Any:
        if not found:
            found.append(getattr(importlib.import_module(f"{__name__}.{module}"), name))
        return found[0](a)

    run.__name__ = name if name == module else f"{module}_{name}"
    return run


def _declines(params: Any) -> str | None:
    """What `backend_info(device, params)` says of caches the kernels do not cover (see `fp8.covered`)."""
    granularity = params.quantization_granularity
    if params.has_scales_tensor and granularity & (granularity - 1):
        return f"its kernels tile FP8 granules of a power of two elements, not {granularity}"
    return None


KERNELS: dict[str, tuple[Callable[[Any], Any], ...]] = {
    op: (_lazy(op, op), _lazy(op, "supports"), _declines) for op in _OPS
}
"""op -> (kernel, supports[, declines]): what `ops/backends.py` registers as backend "triton". Each module's
`supports` refuses, from shapes alone, the calls its kernels cannot launch (CUDA's grid limits) or
compute (attention's head_dim, FP8 granules that are not a power of two)."""


# -- MLA ops (mla_*.py): FP8 rope-aware rows included ------------------------------------------------


def _power_of_two(n: int, low: int, high: int) -> bool:
    return low <= n <= high and n & (n - 1) == 0


def _store_latent_supports(a: StoreLatentArgs) -> bool:
    """kv_lora_rank a power of two (tl.arange, per-granule reshape); any rope_dim."""
    return _power_of_two(a.latent.shape[1], 16, 4096)


def _mla_attention_supports(a: MLAAttentionArgs) -> bool:
    """kv_lora_rank a power of two from 16 (tl.dot) to 512 (the fp32 accumulator's registers); rope_dim
    <= 256; not fp32 queries over FP8 rows (its FMA tiles spill kilobytes at rank 512: the reference
    runs them; FP8 caches serve 16-bit models); a grid CUDA can launch. With or without
    `key_positions` and `sinks`."""
    if a.scales is not None and a.q_nope.dtype == torch.float32:
        return False
    total, heads, rank = a.q_nope.shape  # grid x: query tiles (at most total + batch) x head blocks
    launchable = (total + a.cache_lengths.shape[0]) * heads < 2**31  # (common.MAX_GRID; common imports triton)
    return _power_of_two(rank, 16, 512) and a.q_rope.shape[2] <= 256 and launchable


KERNELS["store_latent"] = (_lazy("mla_store", "store_latent"), _store_latent_supports)
_dense_mla, _sparse_mla = _lazy("mla_attention", "mla_attention"), _lazy("mla_sparse", "mla_sparse")


def _mla_attention(a: MLAAttentionArgs) -> Any:
    """`mla_attention.py`'s kernel, or `mla_sparse.py`'s for a call with `key_positions`."""
    return (_dense_mla if a.key_positions is None else _sparse_mla)(a)


KERNELS["mla_attention"] = (_mla_attention, _mla_attention_supports)
