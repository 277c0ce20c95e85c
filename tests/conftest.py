"""Session setup that must happen before any test module imports triton, and shared fixtures."""

from __future__ import annotations

import concurrent.futures
import importlib.metadata
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    # No GPU: the Triton kernels run on CPU tensors in Triton's interpreter. Triton fixes the mode
    # when it is first imported (transformers imports it), so set it before collection starts.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _backport_triton_interpreter_index() -> None:
    """Under triton < 3.7 make the interpreter turn a scalar (a 1-element numpy array) into an int as
    triton 3.7 does (triton#9172): before, it called `int(array)`, which numpy >= 2.4 rejects, failing
    every interpreted kernel with a tensor loop bound (`range(tensor)`). The tests' concern: the
    package does not patch triton for its users (docs/triton.md says what they need)."""
    try:
        version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return
    if tuple(int(part) for part in version.split(".")[:2]) >= (3, 7):
        return
    from triton.runtime import interpreter  # (after TRITON_INTERPRET is settled above)

    patch_tensor = interpreter._patch_lang_tensor

    def patch(tensor: Any, *scope: Any) -> None:  # the scope (3.6) restores the original after the launch
        patch_tensor(tensor, *scope)
        tensor.__index__ = lambda self: int(self.handle.data.squeeze())

    interpreter._patch_lang_tensor = patch


_backport_triton_interpreter_index()


@pytest.fixture
def one_thread() -> Iterator[None]:
    """torch on one thread for the test (tiny models: threads only add synchronisation, and spin for long on
    a busy machine); the count before it restored after. Modules use it with
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def force_backend(monkeypatch: pytest.MonkeyPatch) -> Callable[[str | None], None]:
    """`force_backend(name)` makes every op call of this test run backend `name` (None: the default
    order again), through `TORCH_PAGED_KV_BACKEND`; the setting ends with the test."""
    from torch_paged_kv.ops import dispatch

    def force(name: str | None) -> None:
        if name is None:
            monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
        else:
            monkeypatch.setenv(dispatch.ENV_VAR, name)

    return force


@pytest.fixture(scope="session")
def rank_groups():
    """Worker processes in gloo groups for multi-process tests (`distributed_ranks.RankGroups`),
    started on first use and shared by the session."""
    from distributed_ranks import RankGroups

    groups = RankGroups()
    yield groups
    groups.close_all()


@pytest.fixture(scope="session")
def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux's /proc/cpuinfo names them (empty where it is not there)."""
    try:
        with open("/proc/cpuinfo") as f:
            return {flag for line in f if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    except OSError:
        return set()


Job = tuple[str, float, Callable[[], Any]]  # (name, rough seconds, run)


def _submit(pool: concurrent.futures.ThreadPoolExecutor, jobs: list[Job]) -> dict[str, concurrent.futures.Future[Any]]:
    return {name: pool.submit(run) for name, _, run in sorted(jobs, key=lambda job: -job[1])}


class _StartedOnFirstUse(dict):
    """name -> Future: a module's runs all start when one of its tests first asks for one."""

    def __init__(self, pool: concurrent.futures.ThreadPoolExecutor, by_module: list[list[Job]]) -> None:
        super().__init__()
        self.pool, self.module_of = pool, {job[0]: jobs for jobs in by_module for job in jobs}

    def __missing__(self, name: str) -> concurrent.futures.Future[Any]:
        self.update(_submit(self.pool, self.module_of[name]))
        return self[name]


@pytest.fixture(scope="session", autouse=True)
def background_runs(request) -> Iterator[dict[str, concurrent.futures.Future[Any]]]:
    """name -> a subprocess run that selected tests check (the slow set's builds, compiles and
    examples), all started when the session starts, the longest first, as many at a time as there are
    cores (each is mostly one thread). A test module lists its runs with a function
    `background_jobs(its selected items, request)` -> [(name, rough seconds, function)] (`request`: this
    fixture's, for session fixtures such as tmp_path_factory).

    Under pytest-xdist (`-n`) every worker collects every test but runs only some: there a module's
    runs start when one of its tests first asks for one (once in all with `--dist loadfile`)."""
    by_module = []
    items = request.session.items
    for module in dict.fromkeys(getattr(item, "module", None) for item in items):
        plan = getattr(module, "background_jobs", None)
        if plan is not None and (
            jobs := plan([item for item in items if getattr(item, "module", None) is module], request)
        ):
            by_module.append(jobs)
    if not by_module:
        yield {}
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=cores)
    if "PYTEST_XDIST_WORKER" in os.environ:
        yield _StartedOnFirstUse(pool, by_module)
    else:
        yield _submit(pool, [job for jobs in by_module for job in jobs])
    pool.shutdown(cancel_futures=True)
