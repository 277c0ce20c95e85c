"""tests/gpu: every backend on CUDA against the reference. Without a GPU each test is skipped, saying
why, except the `cpu` variants of tests parametrized by `device`: the same body at small sizes on
CPU tensors (Triton in its interpreter), so CI runs the code the GPU will. With a GPU visible those
`cpu` variants are skipped instead (Triton is then in compiled mode; the `cuda` variant runs)."""

import pytest
import torch


def _device(item: pytest.Item) -> str | None:
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("device") if callspec is not None else None


def pytest_collection_modifyitems(config, items):
    gpu = torch.cuda.is_available()
    no_gpu = pytest.mark.skip(reason="tests/gpu needs a CUDA GPU; none is visible (torch.cuda.is_available() is False)")
    cpu_stand_in = pytest.mark.skip(reason="a GPU is visible: the cuda variant of this test runs instead")
    for item in items:
        if "tests/gpu" not in str(item.fspath).replace("\\", "/"):
            continue
        if _device(item) == "cpu":
            if gpu:
                item.add_marker(cpu_stand_in)
        elif not gpu:
            item.add_marker(no_gpu)
