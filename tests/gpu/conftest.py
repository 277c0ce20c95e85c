"""tests/gpu: every backend on CUDA against the reference. Skipped, with the reason, without a GPU."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="tests/gpu needs a CUDA GPU; none is visible (torch.cuda.is_available() is False)")
    for item in items:
        if "tests/gpu" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)
