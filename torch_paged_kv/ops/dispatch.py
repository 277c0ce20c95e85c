"""Which backend runs an op: registry, default order, `TORCH_PAGED_KV_BACKEND`, `backend_info`.

Backends register kernels with `register_kernel(backend, op, fn, supports)`; `fn` takes the op's
argument record (`records.py`) and may assume it passed validation. `supports(record)` says whether
the kernel covers a particular call (shapes, dtypes, arch); without it every call is covered. A
backend may also register a fast version of the step's value checks for tensors of one device type
(`register_value_check`), which `validate.py` asks first.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

OPS = ("store_kv", "flash_attention", "gather_kv", "copy_pages", "store_latent", "mla_attention")
KV_OPS = ("store_kv", "flash_attention", "gather_kv")  # read or write K/V planes: not for an MLA cache
MLA_OPS = ("store_latent", "mla_attention")  # read or write MLA latent rows: only for an MLA cache
BACKENDS = ("cute", "triton", "cpu", "reference")
# What runs when nothing is forced, best first. CUDA joins "cute" here once tests/gpu has verified
# its kernels on a real GPU; until then it runs only when forced. CPU: the compiled kernels, or the
# reference where they cannot be built. Other devices: the reference.
DEFAULT_ORDER = {"cuda": ("triton", "reference"), "cpu": ("cpu", "reference")}
FALLBACK_ORDER = ("reference",)
ENV_VAR = "TORCH_PAGED_KV_BACKEND"

Kernel = Callable[[Any], Any]  # the op's record -> its result
Supports = Callable[[Any], bool]  # the op's record -> whether the kernel covers the call
WhyNot = Callable[[Any], "str | None"]  # the op's record -> what of the call the kernel lacks, or None
Declines = Callable[[Any], "str | None"]  # KVCacheParams -> why caches like these are not covered, or None
ValueCheck = Callable[..., bool]
"""(blocks, cache_lengths, lookup_table, input_row_offsets, total_rows, reads_all, max_kv_len) -> whether
the step passes every value check `validate.check_store_kv_data` (`reads_all` 0) or
`check_read_data` (1; W + 1 within a sliding window of W) makes. True settles it; False means: let
validate.py's checks say what is wrong."""


class BackendUnavailableError(RuntimeError):
    """`TORCH_PAGED_KV_BACKEND` forces a backend that cannot run this call."""


_kernels: dict[tuple[str, str], tuple[Kernel, Supports | None]] = {}
_declines: dict[tuple[str, str], Declines] = {}
_why_not: dict[tuple[str, str], WhyNot] = {}
_availability: dict[str, Callable[[torch.device], str | None]] = {}
_value_checks: dict[str, ValueCheck] = {}


def register_backend(name: str, unavailable_reason: Callable[[torch.device], str | None]) -> None:
    """Declare a backend; `unavailable_reason(device)` returns None when it can run there."""
    if name not in BACKENDS:
        raise ValueError(f"name: unknown backend {name!r}; expected one of {BACKENDS}")
    _availability[name] = unavailable_reason


def register_kernel(
    backend: str,
    op: str,
    fn: Kernel,
    supports: Supports | None = None,
    declines: Declines | None = None,
    why_not: WhyNot | None = None,
) -> None:
    """Register `fn` as `backend`'s implementation of `op`. `declines(params)` (optional) says why the
    kernel does not cover caches of those `KVCacheParams` (what `backend_info(device, params)` reports);
    it must agree with `supports`, which decides each call. `why_not(record)` (optional) names what of
    a call that `supports` refuses the kernel lacks (a forced backend's error says it)."""
    if op not in OPS:
        raise ValueError(f"op: unknown op {op!r}; expected one of {OPS}")
    if backend not in _availability:
        raise ValueError(f"backend: {backend!r} is not registered; call register_backend first")
    _kernels[(backend, op)] = (fn, supports)
    if declines is not None:
        _declines[(backend, op)] = declines
    if why_not is not None:
        _why_not[(backend, op)] = why_not


def register_value_check(device_type: str, check: ValueCheck) -> None:
    """Register `check` as the fast value check of steps whose tensors are on `device_type` devices."""
    _value_checks[device_type] = check


def value_check(device_type: str) -> ValueCheck | None:
    """The fast value check registered for `device_type`, or None."""
    return _value_checks.get(device_type)


def _reason(backend: str, op: str, device: torch.device, args: tuple | None) -> str | None:
    """Why `backend` cannot run `op` on `device` (for the call of record `args`, when given); None if it can."""
    if backend not in _availability:
        return f"backend {backend!r} is not installed"
    reason = _availability[backend](device)
    if reason is not None:
        return reason
    entry = _kernels.get((backend, op))
    if entry is None:
        return f"backend {backend!r} has no {op} kernel"
    supports = entry[1]
    if args is not None and supports is not None and not supports(args):
        lacking = _why_not[(backend, op)](args) if (backend, op) in _why_not else None
        return f"backend {backend!r} does not cover this {op} call: {lacking or 'its shapes/dtypes'}"
    return None


def forced_backend() -> str | None:
    """The backend named by `TORCH_PAGED_KV_BACKEND`, or None."""
    name = os.environ.get(ENV_VAR) or None
    if name is not None and name not in BACKENDS:
        raise BackendUnavailableError(f"{ENV_VAR}={name!r}: expected one of {BACKENDS}")
    return name


def select(op: str, device: torch.device, args: tuple) -> Kernel:
    """The kernel that runs the call of `op` on `device` whose record is `args`."""
    forced = forced_backend()
    if forced is not None:
        reason = _reason(forced, op, device, args)
        if reason is not None:
            raise BackendUnavailableError(f"{ENV_VAR}={forced}: cannot run {op} on {device}: {reason}")
        return _kernels[(forced, op)][0]
    for backend in DEFAULT_ORDER.get(device.type, FALLBACK_ORDER):
        if _reason(backend, op, device, args) is None:
            return _kernels[(backend, op)][0]
    raise BackendUnavailableError(f"no backend can run {op} on {device}")


def backend_info(device: torch.device | str = "cpu", params: Any = None) -> dict[str, str]:
    """For each op, the backend a typical call on `device` would use (or why none can). With `params`
    (`KVCacheParams`), for a call on a cache of those params: only the ops that apply to it (an MLA
    cache: copy_pages, store_latent, mla_attention; a K/V cache: the other four), a backend that
    declines such caches is skipped, and the answer says which and why, e.g. "reference (triton: ...)"."""
    device = torch.device(device)
    forced = forced_backend()
    info = {}
    for op in OPS:
        if params is not None and op in (KV_OPS if params.is_mla else MLA_OPS):
            continue  # ops that do not apply to such a cache (K/V ops on an MLA cache, MLA ops on K/V)
        candidates = (forced,) if forced else DEFAULT_ORDER.get(device.type, FALLBACK_ORDER)
        reasons = {}
        for backend in candidates:
            reasons[backend] = _reason(backend, op, device, None)
            if reasons[backend] is None and params is not None and (backend, op) in _declines:
                reasons[backend] = _declines[(backend, op)](params)
            if reasons[backend] is None:
                break
        chosen = next((b for b, r in reasons.items() if r is None), None)
        skipped = "; ".join(f"{b}: {r}" for b, r in reasons.items() if r is not None)
        if chosen is None:
            info[op] = "unavailable: " + skipped
        else:
            info[op] = chosen + (f" ({skipped})" if skipped and params is not None else "")
    return info
