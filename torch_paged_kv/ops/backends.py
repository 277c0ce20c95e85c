"""Registers every backend that can load in this environment, in one place."""

from __future__ import annotations

from . import dispatch, reference

dispatch.register_backend("reference", lambda device: None)
for _op in dispatch.OPS:
    dispatch.register_kernel("reference", _op, getattr(reference, _op))

from .triton import register as _register_triton  # noqa: E402  (declares "triton"; imports no kernels)

_register_triton()

from ..cute import register as _register_cute  # noqa: E402  (declares "cute"; imports no kernels, no cutlass)

_register_cute()
