"""Differences between the Triton versions the project meets (3.6 on the GPU machine, newest in CI)."""

from __future__ import annotations

from typing import Any

import triton


def _squeeze_interpreter_index() -> None:
    """Make the interpreter turn a scalar (a 1-element numpy array) into an int as triton 3.7 does
    (triton#9172): before, it called `int(array)`, which numpy >= 2.4 rejects, failing `range(tensor)`."""
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patch(tensor: Any, *scope: Any) -> None:  # the scope (3.6) restores the original after the launch
        patch_tensor(tensor, *scope)
        tensor.__index__ = lambda self: int(self.handle.data.squeeze())

    interpreter._patch_lang_tensor = patch


TRITON_VERSION = tuple(int(part) for part in triton.__version__.split(".")[:2])

if TRITON_VERSION < (3, 7):
    _squeeze_interpreter_index()
