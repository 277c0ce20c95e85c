"""The FP8 quantization rule every backend and the per-layer views share, in plain torch.

Per granule (`granularity` consecutive elements of head_dim): `scale = amax / dtype_max` in fp32,
stored value `q = round(x / scale)` clamped to ±dtype_max (saturating), read back as `q * scale`.
A granule of zeros (or one whose scale underflows to 0) stores scale 0 and q = 0, so it reads back
as zeros, never NaN or inf. A granule holding a NaN or an infinity stores scale NaN and q = 0: it
reads back as NaN, every element (as a NaN or infinite key poisons its scores unquantized).
Per tensor: one fixed scale, `q = round(x / scale)` clamped (infinities saturate); a NaN stores
the positive NaN code 0x7F, its sign dropped (GPUs do not keep a NaN's sign through a division),
and reads back as NaN. Every backend stores and reads these bit for bit alike.
"""

from __future__ import annotations

import torch
from torch import Tensor

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def indexable(t: Tensor) -> Tensor:
    """`t` viewed as uint8 when it is FP8 (torch has no FP8 `index_copy_`), else `t`: for moving
    whole pages, which never looks at the values."""
    return t.view(torch.uint8) if t.dtype in FP8_DTYPES else t


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an FP8 `dtype` (448 for e4m3fn, 57344 for e5m2)."""
    return torch.finfo(dtype).max


def _divisor(value: float | Tensor, device: torch.device) -> Tensor:
    """`value` as an fp32 tensor on `device`. CUDA divides by a Python number or a CPU scalar as a
    multiply by its reciprocal, which can round differently from the IEEE division the rule (and
    the CPU and Triton backends) use, so the reference backend on a GPU divides by this instead."""
    if isinstance(value, Tensor):
        return value.to(device=device, dtype=torch.float32)
    return torch.full((), value, dtype=torch.float32, device=device)  # (a fill: CUDA graphs capture it)


def quantize(x: Tensor, dtype: torch.dtype, granularity: int) -> tuple[Tensor, Tensor]:
    """`x` `[..., head_dim]` -> (`q` `[..., head_dim]` in `dtype`, `scales` `[..., head_dim / granularity]` fp32)."""
    top = fp8_max(dtype)
    groups = x.float().unflatten(-1, (x.shape[-1] // granularity, granularity))
    scales = groups.abs().amax(-1) / _divisor(top, x.device)
    scales = scales.where(scales.isfinite(), torch.nan)  # a NaN or inf in the granule
    safe = torch.where(scales > 0, scales, 1.0)[..., None]
    q = torch.where(scales[..., None] > 0, groups / safe, 0.0).clamp_(-top, top)
    return q.flatten(-2).to(dtype), scales


def quantize_static(x: Tensor, dtype: torch.dtype, scale: float | Tensor) -> Tensor:
    """`x` stored with one fixed `scale`: `round(x / scale)` clamped to ±dtype_max."""
    top = fp8_max(dtype)
    q = (x.float() / _divisor(scale, x.device)).clamp_(-top, top)
    return q.masked_fill_(q.isnan(), torch.nan).to(dtype)  # the positive NaN: code 0x7F


def dequantize(q: Tensor, scales: Tensor | float) -> Tensor:
    """fp32 values of `q` `[..., head_dim]` with `scales` `[..., groups]` (or one float per tensor)."""
    if not isinstance(scales, Tensor):
        return q.float() * scales
    groups = scales.shape[-1]
    return (q.float().unflatten(-1, (groups, q.shape[-1] // groups)) * scales[..., None]).flatten(-2)
