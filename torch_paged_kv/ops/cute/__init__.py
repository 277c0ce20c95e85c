"""CuTe DSL backend: paged decode attention on Hopper (TMA page boxes) and Blackwell (TMA gather4).

Only `flash_attention` has CuTe kernels, for decode-shaped calls (see `attention.supports`);
prefill, `store_kv`, `gather_kv` and `copy_pages` stay with Triton. cutlass is imported on the
first kernel call, so `import torch_paged_kv` works without nvidia-cutlass-dsl.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from typing import Any

import torch

from .arch import ARCHS, UNVERIFIED_ARCH_ENV, device_arch, device_index, unverified_reason

__all__ = [
    "ARCHS",
    "KERNELS",
    "UNVERIFIED_ARCH_ENV",
    "device_arch",
    "device_index",
    "unavailable_reason",
    "unverified_reason",
]

_warned: list[bool] = []


@functools.cache
def cutlass_missing() -> bool:
    return importlib.util.find_spec("cutlass") is None or importlib.util.find_spec("cutlass.cute") is None


def unavailable_reason(device: torch.device) -> str | None:
    """Why the CuTe kernels cannot run on `device`; None if they can (sm90 / sm100 GPU with cutlass)."""
    if device.type != "cuda":
        return f"CuTe kernels need a CUDA device, got {device.type!r}"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    index = device_index(device)
    if device_arch(index) is None:
        major, minor = torch.cuda.get_device_capability(index)
        return f"CuTe kernels target sm_90a / sm_100a; this GPU is sm_{major}{minor}"
    if (unverified := unverified_reason(device_arch(index))) is not None:
        return unverified
    if cutlass_missing():
        if not _warned:
            _warned.append(True)
            warnings.warn(
                "nvidia-cutlass-dsl is not installed: the CuTe backend is off; Triton runs instead", stacklevel=2
            )
        return "nvidia-cutlass-dsl (cutlass.cute) is not installed"
    return None


def _flash_attention(a: Any) -> torch.Tensor:
    from .attention import flash_attention

    return flash_attention(a)


def _flash_attention_supports(a: Any) -> bool:
    from .attention import supports

    return supports(a)


def _flash_attention_unsupported(a: Any) -> str | None:
    from .attention import unsupported_option

    return unsupported_option(a)


def _flash_attention_declines(params: Any) -> str | None:
    if params.quantized:
        return (
            "its decode kernels read 16-bit pages; FP8 pages with scales would need a dequantizing "
            "consumer and a TMA load of the scale rows, not built (Triton runs FP8 decode)"
        )
    return None


KERNELS = {
    "flash_attention": (
        _flash_attention,
        _flash_attention_supports,
        _flash_attention_declines,
        _flash_attention_unsupported,
    )
}
"""op -> (kernel, supports, declines, why_not): what `ops/backends.py` registers as backend "cute"."""
