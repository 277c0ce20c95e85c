"""Registers every backend with the dispatcher, in one place (kernel packages never import dispatch).

Declaring a backend imports neither its kernels nor triton / cutlass: that happens on first use.
"""

from __future__ import annotations

from . import cpu, cute, dispatch, reference, reference_mla
from . import triton as triton_kernels
from .records import unpacked


def _register(name: str, unavailable_reason, kernels: dict) -> None:
    """`kernels`: op -> (kernel, supports) or (kernel, supports, declines); see `dispatch.register_kernel`."""
    dispatch.register_backend(name, unavailable_reason)
    for op, entry in kernels.items():
        dispatch.register_kernel(name, op, *entry)


# The reference takes the public signature (it is also the tests' oracle; a test pins its signatures).
_register(
    "reference",
    lambda device: None,
    {op: (unpacked(getattr(reference_mla if op in dispatch.MLA_OPS else reference, op)), None) for op in dispatch.OPS},
)
_register("cpu", cpu.unavailable_reason, cpu.KERNELS)
dispatch.register_value_check("cpu", cpu.VALUE_CHECK)
_register("triton", triton_kernels.unavailable_reason, triton_kernels.KERNELS)
_register("cute", cute.unavailable_reason, cute.KERNELS)
