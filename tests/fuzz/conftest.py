"""Fuzz tests: fixed seeds and a number of cases sized for CI (the directory in well under a minute).

`TORCH_PAGED_KV_FUZZ_SCALE=k` runs k times as many cases (the CI ones, then new ones);
`TORCH_PAGED_KV_FUZZ_SEED=s` starts the case seeds at `s` instead of 0. A failure names its case seed.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest


@pytest.fixture
def fuzz_cases() -> Callable[[int], range]:
    """`fuzz_cases(n)`: the case seeds of a fuzz test whose CI size is `n` cases."""
    scale = float(os.environ.get("TORCH_PAGED_KV_FUZZ_SCALE", "1"))
    first = int(os.environ.get("TORCH_PAGED_KV_FUZZ_SEED", "0"))

    def cases(n: int) -> range:
        return range(first, first + max(1, round(n * scale)))

    return cases
